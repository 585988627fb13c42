"""The reducer protocol: how a window is combined across workers.

A ``GradientAccumulator`` whose wrapped optimizer is a :class:`Reducer`
hands it each window twice, on the run that ends the window:

1. :meth:`Reducer.reduce` gets the window's *un-normalised* sums
   (``sum_i w_i * g_i``), its summed weight (``sum_i w_i``) and a few extra
   scalar sums (the noise-scale statistics', the sparse clip norm's). It
   returns the same three things, combined over the workers. The window then
   divides, decides skip or apply on the returned values, so that every
   worker decides alike, and clips.
2. :meth:`Reducer.apply_reduced` gets the averaged (and clipped) update and
   applies it, normally through the wrapped optimizer.

An engine may communicate in either step. :class:`gradaccum.CollectiveAllReduce`
sums in :meth:`~Reducer.reduce` with TensorFlow's collective all-reduce (exact
with uneven workers); :class:`gradaccum.AllReduceOnApply` all-reduces the
averaged update in :meth:`~Reducer.apply_reduced` (Horovod's averaging). The
defaults here communicate nothing, so a subclass overrides what it needs.
Each step is built once per train op and run once per applied window.

One optional hook runs per micro-batch: :meth:`Reducer.reduce_micro_batch`
(default: does nothing, returns ``None``). A reducer that returns pairs from
it has summed each micro-batch over the workers itself and keeps a cache
for those pairs only (ZeRO stage 2, ``ShardedAllReduce(...,
shard_cache=True)``); :meth:`Reducer.reduce` then gets no pairs, only the
weight and the extra scalars, among them the window's whole-gradient
scalars (its squared norm, its count of non-finite shares) that every
worker decides skip and clip from, and that its observers get
(``WindowUpdate.sq_norm``). This module creates no variables and no
collections.
"""
from gradaccum.window.wrapper import WrappingOptimizer


class Reducer(WrappingOptimizer):
    """Base of the optimizers that combine an accumulation window across workers.

    Subclass it and override :meth:`reduce`, :meth:`apply_reduced` or both;
    wrap it in a ``GradientAccumulator``. Everything else (slots,
    ``compute_gradients``, ``variables()``) is the wrapped optimizer's.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the update.
      name: non-empty string, the name scope of the reducer's ops.

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer.
      ValueError: when ``name`` is not a non-empty string.

    Example:
      >>> class SumOverWorkers(gradaccum.Reducer):
      ...     def reduce(self, sums_and_vars, total, extras):
      ...         everyone = lambda t: my_all_reduce_sum(t)
      ...         return ([(everyone(g), v) for g, v in sums_and_vars],
      ...                 everyone(total), [everyone(x) for x in extras])
      >>> opt = gradaccum.GradientAccumulator(SumOverWorkers(adam, "sum"), 4)
    """

    @property
    def applies_a_share(self):
        """Whether each worker applies the wrapped optimizer to a share of the variables only; False here.

        Then a wrapped optimizer that tests the update for overflow itself (a
        loss-scale optimizer, ``GradientAccumulator(loss_scaling=True)``)
        would test its own share only and the workers' loss scales would
        drift apart: the accumulator refuses that pair when it is constructed.
        """
        return False

    @property
    def skips_alike(self):
        """Whether every worker decides alike to skip a window; True here.

        The window decides skip (zero weight, ``skip_nonfinite``) on what
        :meth:`reduce` returns. A reducer whose :meth:`reduce` keeps each
        worker's window local while :meth:`apply_reduced` communicates
        (``AllReduceOnApply``) says False: one worker could skip while the
        others wait for it in the all-reduce, so the window refuses
        ``skip_nonfinite=True`` with it, when the train op is built.
        """
        return True

    def reduce(self, sums_and_vars, total, extras):
        """Combines one window's sums over the workers (here: this worker's, unchanged).

        Args:
          sums_and_vars: list of ``(sum, variable)``: ``sum_i w_i * g_i`` of
            this worker's window, dense tensors or ``tf.IndexedSlices``.
          total: scalar tensor, ``sum_i w_i`` of this worker's window.
          extras: list of scalar tensors to sum over the workers with the
            window (may be empty).

        Returns:
          ``(sums_and_vars, total, extras)`` of the same structure, summed over
          every worker; an ``IndexedSlices`` may come back as one over the
          rows any worker touched.

        Example:
          >>> sums, total, extras = reducer.reduce(sums, weight_sum, [])
        """
        return list(sums_and_vars), total, list(extras)

    def reduce_micro_batch(self, grads_and_vars, weight):
        """Optionally sums each micro-batch over the workers as it is added (here: does nothing).

        Called once per train op, when the window is built (k > 1 or a
        dynamic k), before its caches are made; the ops it builds run on
        every micro-batch.

        Args:
          grads_and_vars: list of ``(gradient, variable)``, every gradient
            not None: this worker's micro-batch.
          weight: None or a scalar tensor, the micro-batch's weight, not yet
            applied to the gradients.

        Returns:
          ``None``: the window caches every gradient and reduces at its end.
          Or a non-empty list of ``(sum, variable)``: ``weight * gradient``
          summed over every worker, for the variables this worker keeps a
          cache of; the window caches these only and passes :meth:`reduce`
          no pairs. A sum may be an ``IndexedSlices``: the window caches
          its rows and flags them touched, as for a sparse gradient.

        Example:
          >>> reducer.reduce_micro_batch(pairs, tf.shape(x)[0]) is None
          True
        """
        return None

    def apply_reduced(self, grads_and_vars, global_step=None, name=None):
        """Applies the window's averaged update (here: through the wrapped optimizer).

        Args:
          grads_and_vars: list of ``(gradient, variable)``: the mean over the
            window (over every worker's, after :meth:`reduce`), clipped.
          global_step: optional variable, passed to the wrapped optimizer.
          name: optional name of the returned op.

        Returns:
          The apply op.

        Example:
          >>> op = reducer.apply_reduced(averaged, global_step)
        """
        return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
