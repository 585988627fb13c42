"""find_micro_batch: the largest micro-batch that fits in memory, and the k it implies.

What darknet users do by hand with ``subdivisions``, and PyTorch Lightning's
``BatchSizeFinder`` does for a plain batch: try one accumulate step at a
micro-batch size, double it while it runs, bisect below the first size that
raises ``tf.errors.ResourceExhaustedError``, keep a safety margin, and split
the target batch into that many micro-batches of (nearly) equal size. It
never tries more than twice the largest size that ran, because a request far
past the memory limit can kill the process instead of raising.

A try changes state (the accumulator's caches and counters, batch-norm
moving averages): given a ``session``, every variable in ``var_list`` is
read once before the search and written back after every try. This module
creates no variables and no ops (it feeds the variables' initializers).
"""
import collections

from gradaccum import _validate
from gradaccum._compat import tf

MicroBatchChoice = collections.namedtuple("MicroBatchChoice", [
    "micro_batch_size", "num_micro_batches", "largest_that_ran", "smallest_that_failed"])
MicroBatchChoice.__doc__ = """What :func:`find_micro_batch` chose.

Attributes:
  micro_batch_size: examples per micro-batch: ``ceil(target_batch / num_micro_batches)``.
  num_micro_batches: the k that covers ``target_batch``.
  largest_that_ran: the largest size tried that ran.
  smallest_that_failed: the smallest size that raised ``ResourceExhaustedError``,
    or ``None`` when the whole target batch ran.
"""


def find_micro_batch(run_step, target_batch, *, session=None, var_list=None, start=1, margin=0.9,
                     precision=0.05):
    """Searches the largest micro-batch that runs one accumulate step without running out of memory.

    Args:
      run_step: ``run_step(micro_batch_size)`` runs one accumulate step on a
        micro-batch of that many examples (for example
        ``sess.run(opt.accumulate_op, feed_of(size))``, or a function that
        builds a graph for that size and runs it), and raises
        ``tf.errors.ResourceExhaustedError`` when it does not fit.
      target_batch: the batch to reach, in examples (an int >= 1); no size
        above it is tried.
      session: ``None``, or the session whose variables a try changes.
      var_list: the variables to restore after each try; ``None`` means every
        global variable of ``session``'s graph. Only with ``session``.
      start: the first size tried (an int >= 1, at most ``target_batch``).
      margin: the share of the largest size that ran to use (0 < margin <= 1):
        memory use varies between runs (allocator, other processes).
      precision: the bisection stops when the sizes that ran and failed
        differ by at most this share (and by at least one example).

    Returns:
      A :class:`MicroBatchChoice`.

    Raises:
      ValueError: for an argument out of range, naming it; when even
        ``start`` does not fit; ``var_list`` without ``session``.
      TypeError: when ``run_step`` is not callable.

    Example:
      >>> choice = gradaccum.find_micro_batch(
      ...     lambda n: sess.run(opt.accumulate_op, {x: data[:n], y: labels[:n]}),
      ...     target_batch=5000, session=sess)
      >>> choice.micro_batch_size, choice.num_micro_batches
      (100, 50)
    """
    if not callable(run_step):
        raise TypeError("`run_step` must be callable as run_step(micro_batch_size), got %s"
                        % _validate.describe(run_step))
    target = _validate.check_positive_int(target_batch, "target_batch")
    start = _validate.check_positive_int(start, "start")
    if start > target:
        raise ValueError("`start` must be at most `target_batch` (%d), got %d" % (target, start))
    margin = _check_share(margin, "margin", upper_open=False)
    precision = _check_share(precision, "precision", upper_open=True)
    if var_list is not None and session is None:
        raise ValueError("`var_list` needs `session`, got session=None")
    attempt = _restoring_attempt(run_step, session, var_list)
    ran, failed = _grow(attempt, start, target)
    if ran is None:
        raise ValueError("not even `start`=%d examples fit in memory: try a smaller `start` or model" % start)
    if failed is None:
        return MicroBatchChoice(target, 1, target, None)
    ran, failed = _bisect(attempt, ran, failed, precision)
    usable = max(1, int(ran * margin))
    k = -(-target // usable)
    return MicroBatchChoice(-(-target // k), k, ran, failed)


def _check_share(value, arg, upper_open):
    value = _validate.check_positive_number(value, arg)
    if value is None or value > 1 or (upper_open and value == 1):
        raise ValueError("`%s` must be a number in (0, 1%s, got %r" % (arg, ")" if upper_open else "]", value))
    return float(value)


def _restoring_attempt(run_step, session, var_list):
    """``attempt(size)``: True when ``run_step(size)`` ran, False when it ran out of memory."""
    if session is not None:
        variables = list(session.graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
                         if var_list is None else var_list)
        saved = session.run(variables)
    else:
        variables, saved = [], []

    def attempt(size):
        try:
            run_step(size)
            return True
        except tf.errors.ResourceExhaustedError:
            return False
        finally:
            for var, value in zip(variables, saved):
                # What Variable.load does, without its deprecation warning: feed the initializer.
                session.run(var.initializer, {var.initializer.inputs[1]: value})

    return attempt


def _grow(attempt, start, target):
    """Doubles from ``start`` up to ``target``: ``(largest that ran, first that failed)``."""
    ran, size = None, start
    while True:
        if not attempt(size):
            return ran, size
        ran = size
        if size == target:
            return ran, None
        size = min(2 * size, target)


def _bisect(attempt, ran, failed, precision):
    """Narrows ``ran < failed`` until they are within ``precision`` of each other."""
    while failed - ran > max(1, precision * ran):
        middle = (ran + failed) // 2
        if attempt(middle):
            ran = middle
        else:
            failed = middle
    return ran, failed
