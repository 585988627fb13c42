"""Schedules of the number of micro-batches: pass one as ``num_micro_batches``.

Each helper returns a callable ``global_step -> int64 scalar tensor``, which
a ``GradientAccumulator`` reads when a window starts (so a change takes
effect at the next window). ``global_step`` counts applied windows. The
schedules are plain functions of the step, computed in the graph from
Python constants: they create no variables and no collections, and a
checkpoint that restores ``global_step`` restores where they are.
"""
import fractions
import numbers

from gradaccum import _validate
from gradaccum._compat import tf


def step_schedule(boundaries, num_micro_batches):
    """Piecewise-constant k by ``global_step``, as ``tf.compat.v1.train.piecewise_constant``.

    Args:
      boundaries: strictly increasing ints > 0: the steps where k changes.
      num_micro_batches: ints >= 1, one more than ``boundaries``: k before the
        first boundary, between each pair, and after the last.

    Returns:
      A callable ``global_step -> int64 scalar tensor``.

    Raises:
      ValueError: for a boundary that is not an int > 0 or not increasing, a
        k that is not an int >= 1, or lists of mismatched lengths.

    Example:
      >>> schedule = gradaccum.step_schedule([100, 300], [2, 4, 8])
      >>> opt = gradaccum.GradientAccumulator(sgd, num_micro_batches=schedule)
    """
    boundaries = [_validate.check_positive_int(b, "boundaries") for b in _as_list(boundaries, "boundaries")]
    if any(later <= earlier for earlier, later in zip(boundaries, boundaries[1:])):
        raise ValueError("`boundaries` must be strictly increasing, got %r" % (boundaries,))
    values = [_validate.check_positive_int(k, "num_micro_batches")
              for k in _as_list(num_micro_batches, "num_micro_batches")]
    if len(values) != len(boundaries) + 1:
        raise ValueError("`num_micro_batches` must hold one more value than `boundaries` (%d), got %r"
                         % (len(boundaries), values))
    return _piecewise(boundaries, values)


def batch_ramp(start, increment, ramp_examples, batch_size, micro_batch_size):
    """A batch that grows in steps of ``increment`` examples, as Megatron-LM's ``--rampup-batch-size``.

    The batch starts at ``start`` examples and grows by ``increment`` each
    time another ``ramp_examples / n`` examples have been trained on (``n``
    the number of increments), until it reaches ``batch_size``, where it
    stays. Examples are counted exactly, window by window, so the schedule
    is a function of ``global_step`` alone. k is the batch over
    ``micro_batch_size``.

    Args:
      start: the first batch, in examples (an int >= 1).
      increment: the growth per step, in examples (an int >= 1).
      ramp_examples: over how many examples the batch ramps (an int >= 1).
      batch_size: the final batch, in examples: ``start`` plus a whole number
        of increments.
      micro_batch_size: examples per micro-batch; ``start`` and
        ``increment`` must be multiples of it.

    Returns:
      A callable ``global_step -> int64 scalar tensor``.

    Raises:
      ValueError: for an argument that is not an int >= 1, a ``batch_size``
        not reached by whole increments, or sizes that are not multiples of
        ``micro_batch_size``.

    Example:
      >>> ramp = gradaccum.batch_ramp(100, 100, 60000, 1000, micro_batch_size=100)
      >>> opt = gradaccum.GradientAccumulator(adam, num_micro_batches=ramp)
    """
    start, increment, ramp_examples, batch_size, micro = (
        _validate.check_positive_int(value, arg) for value, arg in (
            (start, "start"), (increment, "increment"), (ramp_examples, "ramp_examples"),
            (batch_size, "batch_size"), (micro_batch_size, "micro_batch_size")))
    if batch_size < start or (batch_size - start) % increment:
        raise ValueError("`batch_size` must be `start` (%d) plus a whole number of `increment` (%d), got %d"
                         % (start, increment, batch_size))
    for value, arg in ((start, "start"), (increment, "increment")):
        if value % micro:
            raise ValueError("`%s` must be a multiple of `micro_batch_size` (%d), got %d" % (arg, micro, value))
    steps = (batch_size - start) // increment
    if steps == 0:
        return _piecewise([], [start // micro])
    per_step = fractions.Fraction(ramp_examples, steps)
    boundaries, values, seen, updates = [], [start // micro], 0, 0
    for level in range(steps):
        batch = start + level * increment
        # Windows of this batch until the examples seen pass the next threshold.
        windows = max(0, -(-(per_step * (level + 1) - seen) // batch))
        seen += windows * batch
        updates += windows
        boundaries.append(int(updates))
        values.append((batch + increment) // micro)
    return _piecewise(boundaries, values)


def _as_list(values, arg):
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError("`%s` must be a list of ints, got %s" % (arg, _validate.describe(values)))
    values = list(values)
    if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
        raise ValueError("`%s` must be a list of ints, got %s" % (arg, _validate.describe(values)))
    return values


def _piecewise(boundaries, values):
    """``values[i]`` for ``boundaries[i-1] <= step < boundaries[i]``, as a sum of steps (no control flow)."""

    def schedule(global_step):
        with tf.compat.v1.name_scope("num_micro_batches_schedule"):
            k = tf.constant(values[0], tf.int64)
            if global_step is None:
                raise ValueError("a schedule of `num_micro_batches` needs `global_step`, got None")
            step = tf.cast(global_step, tf.int64)
            for boundary, before, after in zip(boundaries, values, values[1:]):
                k += tf.cast(step >= boundary, tf.int64) * (after - before)
            return k

    schedule.boundaries = tuple(boundaries)
    schedule.values = tuple(values)
    return schedule
