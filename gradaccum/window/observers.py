"""The observer protocol: what sees a window without changing its update.

A :class:`WindowObserver` is called by the window at fixed points, each time
while the train op is *built*, and returns the ops to run at that point:

* :meth:`~WindowObserver.added` on every micro-batch, with its gradients and
  weight (before they are added to the caches);
* :meth:`~WindowObserver.extra_sums` when a window ends: scalars that a
  reducer sums over the workers together with the window;
* :meth:`~WindowObserver.applying` when a window is applied, with its
  averaged gradients (before clipping), its summed weight and the reduced
  extra sums; the wrapped optimizer applies after these ops ran;
* :meth:`~WindowObserver.applied` after the wrapped optimizer applied;
* :meth:`~WindowObserver.skipped` when a window is not applied (zero weight,
  not finite, or a wrapped loss-scale optimizer's overflow);
* :meth:`~WindowObserver.reset` when the window is reset without applying
  (the accumulator's ``zero_op``); by default :meth:`skipped` does this too.

With a sharded cache (``ShardedAllReduce(..., shard_cache=True)``, ZeRO
stage 2), :meth:`~WindowObserver.added` still sees this worker's own
micro-batch gradients of every variable (before they are summed over the
workers), and the extra sums are reduced as without it; only the averaged
pairs of :meth:`~WindowObserver.applying` and ``applied`` are this worker's
share, with the whole gradient's squared norm in ``WindowUpdate.sq_norm``.

The noise-scale statistics (``gradaccum.statistics``), the adaptive policy
(``gradaccum.AdaptiveBatch``) and window batch norm
(``gradaccum.batch_normalization`` under an accumulator) are observers. This
module creates no variables and no collections.
"""
import collections

MicroBatch = collections.namedtuple("MicroBatch", ["grads_and_vars", "weight", "small_batches"])
MicroBatch.__doc__ = """What :meth:`WindowObserver.added` sees of one micro-batch.

Attributes:
  grads_and_vars: the micro-batch's ``(gradient, variable)`` pairs (no ``None``).
  weight: ``None`` (weight 1) or the micro-batch's scalar weight tensor.
  small_batches: ``None``, or the towers' ``[(grads_and_vars, weight), ...]``.
"""

WindowUpdate = collections.namedtuple("WindowUpdate", ["grads_and_vars", "total", "extras", "observers", "sq_norm"],
                                      defaults=[None])
WindowUpdate.__doc__ = """What :meth:`WindowObserver.applying` and ``applied`` see of a window.

Attributes:
  grads_and_vars: the averaged ``(gradient, variable)`` pairs, before
    clipping. With a sharded cache (``ShardedAllReduce(...,
    shard_cache=True)``, ZeRO stage 2) they are this worker's share of the
    variables only: read the whole gradient's norm from ``sq_norm``.
  total: the summed weight the window was divided by (over every worker).
  extras: this observer's :meth:`WindowObserver.extra_sums`, summed over
    the workers; ``[]`` when the window has no reducer (read your own).
  observers: every observer of the window, in order (one may read another).
  sq_norm: ``None``, or (sharded cache) a scalar tensor: the squared global
    norm of the averaged whole gradient, every variable of every worker's
    share, before clipping; alike on every worker. ``None`` means: compute
    it from ``grads_and_vars``, which then hold every variable.
"""


class WindowObserver(object):
    """Base of the objects that watch an accumulation window; every hook returns ops.

    Override the hooks you need; each returns a list of ops (or one op), and
    the defaults return none. An observer's own state must be variables (a
    checkpoint then restores a window in progress with it); list them in
    :attr:`variables`.

    Example:
      >>> class CountSkipped(gradaccum.WindowObserver):
      ...     def __init__(self):
      ...         self.count = tf.compat.v1.Variable(0, trainable=False)
      ...     def skipped(self):
      ...         return [self.count.assign_add(1)]
      >>> opt = gradaccum.GradientAccumulator(adam, 4, observers=[CountSkipped()])
    """

    uses_statistics = False
    """True when the observer reads the window's noise-scale statistics
    (``gradaccum.statistics``): the accumulator then keeps them."""

    reads_gradients = True
    """True when :meth:`added` reads the micro-batch's gradients: they are
    then each micro-batch's own, unweighted (as :data:`MicroBatch` says). An
    observer that reads only the weight, or nothing, says False, so that the
    fused train op may fold the weight into backprop, one pass fewer over
    the gradients per micro-batch."""

    @property
    def variables(self):
        """The observer's own state variables (none here)."""
        return []

    def added(self, micro_batch):
        """Ops run on every micro-batch; ``micro_batch`` is a :data:`MicroBatch`."""
        del micro_batch
        return []

    def extra_sums(self):
        """Scalar tensors to sum over the workers with the window (read when it ends)."""
        return []

    def applying(self, update):
        """Ops run before the wrapped optimizer applies; ``update`` is a :data:`WindowUpdate`."""
        del update
        return []

    def applied(self, update):
        """Ops run after the wrapped optimizer applied; ``update`` is a :data:`WindowUpdate`."""
        del update
        return []

    def skipped(self):
        """Ops run when a window ends without being applied (by default, :meth:`reset`)."""
        return self.reset()

    def reset(self):
        """Ops run when a window is reset without applying (``zero_op``)."""
        return []
