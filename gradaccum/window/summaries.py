"""``summaries``: TensorBoard scalars about an accumulator's windows.

Apart from ``gradaccum.statistics``, which the accumulator's window imports,
so that neither module imports the other. It creates no variables; the
scalars go to the collections given (``SUMMARIES`` by default).
"""
from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.window.accumulator import GradientAccumulator
from gradaccum.window.statistics import learning_rate


def summaries(accumulator, collections=None, name="gradaccum"):
    """Adds TensorBoard scalars about an accumulator's windows.

    The scalars, tagged ``<name>/...``: ``effective_batch`` (the last applied
    window's weight), ``gradient_norm`` (its averaged gradient's global norm,
    before clipping), ``skipped_windows`` (so far), ``noise_scale`` (the
    smoothed ``B_simple``, in the weight's units: NaN until a window gave an
    estimate) and ``learning_rate`` (only when the wrapped optimizer, or one
    it wraps, keeps it as ``_learning_rate`` or ``_lr``: a number, a tensor or
    a callable). They go to ``collections``, so ``MonitoredTrainingSession``'s
    summary hook writes them; run the returned op to write them yourself.

    Args:
      accumulator: a ``GradientAccumulator`` built with ``statistics=True``
        whose train op exists.
      collections: graph collections for the scalars; ``None`` means
        ``[tf.compat.v1.GraphKeys.SUMMARIES]``.
      name: the name scope, and the tags' prefix.

    Returns:
      A merged summary op of these scalars (a string tensor for
      ``FileWriter.add_summary``); it is added to no collection.

    Raises:
      TypeError: when ``accumulator`` is not a ``GradientAccumulator``.
      ValueError: when it has no train op yet or was built without
        statistics, or ``name`` is empty.

    Example:
      >>> opt = gradaccum.GradientAccumulator(sgd, 8, statistics=True)
      >>> train_op = opt.minimize(loss, weight=tf.shape(x)[0])
      >>> summary_op = gradaccum.summaries(opt)
      >>> writer.add_summary(sess.run(summary_op), step)
    """
    stats = _statistics_of(accumulator)
    _validate.check_name(name)
    skipped = accumulator.skipped_windows
    scalars = [("effective_batch", stats.window_weight.read_value()), ("gradient_norm", stats.gradient_norm),
               ("skipped_windows", skipped.read_value()), ("noise_scale", stats.noise_scale)]
    rate = learning_rate(accumulator.optimizer)
    if rate is not None:
        scalars.append(("learning_rate", rate))
    with tf.compat.v1.name_scope(name):
        ops = [tf.compat.v1.summary.scalar(tag, tf.cast(value, tf.float32), collections=collections)
               for tag, value in scalars]
        return tf.compat.v1.summary.merge(ops, name="merged")


def _statistics_of(accumulator):
    if not isinstance(accumulator, GradientAccumulator):
        raise TypeError("`accumulator` must be a gradaccum.GradientAccumulator, got %s"
                        % _validate.describe(accumulator))
    # ValueError when there is no train op yet, or it was built without statistics.
    return accumulator.statistics
