"""Gradient statistics of an accumulator: the gradient noise scale, and summaries.

McCandlish et al. (2018), "An Empirical Model of Large-Batch Training",
estimate the *simple noise scale* ``B_simple = tr(Sigma) / |G|^2`` (``G`` the
true gradient, ``Sigma`` the per-example gradient covariance) from squared
gradient norms measured at two batch sizes. An accumulator has both for free:
each small batch (a micro-batch, or a tower's shard of one) gives
``|G_small|^2``, each window's averaged gradient gives ``|G_big|^2``. Since
``E|G_B|^2 = |G|^2 + tr(Sigma)/B`` for the weighted mean of ``B`` examples, ::

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

are unbiased. Per window of ``n`` small batches of weights ``b_i`` (summing to
``B``), ``|G_small|^2 = sum_i b_i |g_i|^2 / B``, whose expectation is
``|G|^2 + tr(Sigma) n/B`` (so ``1/B_small = n/B``), and ``B_big`` is the
window's weight (``B`` itself, or the sum over workers when a collective
reducer averaged the window). A window whose small batches are not smaller
than the big one (one small batch on one worker), or whose estimates are
not finite (overflow under a loss-scale optimizer), gives no estimate. Both
estimates are smoothed with bias-corrected exponential moving averages, as
in the paper, and ``B_simple`` is their ratio. It is in the units of the
accumulator's ``weight``: in examples when the weight is the example count
(what ``tower.minimize`` passes), in micro-batches when there is none.

Variables (global, non-trainable resource variables, so a ``Saver``
checkpoint keeps them; in ``dtype``; created where :func:`create` is called,
under ``init_scope``, colocated with the first variable by name, in the name
scope ``<accumulator>/statistics/``):

* window in progress: ``small_sq_norm_sum`` (``sum_i b_i |g_i|^2``),
  ``small_weight_sum`` (``sum_i b_i``), ``small_batches`` (``n``, counting
  small batches with ``b_i > 0``);
* last counted window: ``last_big_sq_norm`` (``|G_big|^2``),
  ``last_small_sq_norm`` (``|G_small|^2``), ``last_small_weight_sum`` (``B``),
  ``last_small_batches`` (``n``), ``last_window_weight`` (the weight the
  accumulator divided by);
* smoothed: ``ema_gradient_sq``, ``ema_noise_trace``, ``ema_weight`` (the
  bias correction: the estimates are ``ema_* / ema_weight``);
* totals: ``windows`` (int64, windows that gave an estimate),
  ``total_gradient_sq``, ``total_noise_trace`` (sums of the per-window
  estimates, for an unsmoothed mean).

Collections: the variables go to ``GLOBAL_VARIABLES`` only. ``gradaccum.summaries``
adds scalars about them to ``SUMMARIES``.
"""
import collections
import math
import numbers

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.window.observers import WindowObserver
from gradaccum.window.state import state_variable
from gradaccum.window.wrapper import optimizer_chain

DEFAULT_DECAY = 0.99
"""Decay of the moving averages (about the last 100 windows count)."""

_WINDOW = ("small_sq_norm_sum", "small_weight_sum", "small_batches")
_LAST = ("last_big_sq_norm", "last_small_sq_norm", "last_small_weight_sum", "last_small_batches",
         "last_window_weight")
_SMOOTHED = ("ema_gradient_sq", "ema_noise_trace", "ema_weight", "total_gradient_sq", "total_noise_trace")

_Estimate = collections.namedtuple("_Estimate", ["gradient_sq", "noise_trace", "valid"])


def create(pairs, dtype, decay=DEFAULT_DECAY):
    """Creates the statistics variables of an accumulator (call under ``init_scope``).

    Args:
      pairs: the accumulator's ``(gradient, variable)`` pairs, gradients not
        ``None``; only their variables are read (the first by name is the one
        the state is colocated with).
      dtype: ``tf.float32`` or ``tf.float64``, the dtype of the sums.
      decay: the moving averages' decay, a number in ``[0, 1)``.

    Returns:
      A :class:`GradientStatistics`.

    Raises:
      ValueError: for a ``decay`` outside ``[0, 1)`` or an empty ``pairs``.

    Example:
      >>> with tf.compat.v1.init_scope():
      ...     stats = statistics.create(grads_and_vars, tf.float32)
    """
    return GradientStatistics(pairs, dtype, decay)


class GradientStatistics(WindowObserver):
    """The noise-scale state of one accumulator, and the ops that update it.

    Built by :func:`create`; a window observer (:meth:`observe_small`,
    :meth:`observe_big`, :meth:`discard`). Read the estimates from
    :attr:`noise_scale`, :attr:`gradient_sq_norm` and :attr:`noise_trace`.

    Args:
      pairs: as :func:`create`.
      dtype: as :func:`create`.
      decay: as :func:`create`.

    Raises:
      ValueError: as :func:`create`.

    Example:
      >>> opt = gradaccum.GradientAccumulator(sgd, 8, statistics=True)
      >>> train_op = opt.minimize(loss, weight=tf.shape(x)[0])
      >>> sess.run(opt.statistics.noise_scale)  # examples
    """

    def __init__(self, pairs, dtype, decay=DEFAULT_DECAY):
        if not isinstance(decay, numbers.Real) or isinstance(decay, bool) or not 0 <= decay < 1:
            raise ValueError("`decay` must be a number in [0, 1), got %s" % _validate.describe(decay))
        variables = [var for _, var in pairs]
        if not variables:
            raise ValueError("`pairs` must hold at least one (gradient, variable) pair, got %s"
                             % _validate.describe(pairs))
        self._decay = float(decay)
        self._dtype = tf.as_dtype(dtype).base_dtype
        self._names = frozenset(var.name for var in variables)
        first = min(variables, key=lambda v: v.name)
        with tf.compat.v1.name_scope("statistics"):
            self._vars = dict((name, state_variable(name, [], self._dtype, first))
                              for name in _WINDOW + _LAST + _SMOOTHED)
            self._vars["windows"] = state_variable("windows", [], tf.int64, first)

    # ---------------------------------------------------------- the estimates

    @property
    def decay(self):
        """The decay of the moving averages."""
        return self._decay

    @property
    def variables(self):
        """Every state variable, sorted by name."""
        return sorted(self._vars.values(), key=lambda v: v.name)

    @property
    def noise_scale(self):
        """``B_simple``: smoothed ``tr(Sigma)`` over smoothed ``|G|^2`` (scalar tensor).

        In the units of the accumulator's weight (examples when the weight is
        the example count). NaN until a window gave an estimate; meaningless
        (negative, or huge) while the smoothed ``|G|^2`` is near zero or below,
        as it is when noise dominates.
        """
        return tf.math.truediv(self._vars["ema_noise_trace"].read_value(),
                               self._vars["ema_gradient_sq"].read_value(), name="noise_scale")

    @property
    def gradient_sq_norm(self):
        """Smoothed unbiased estimate of ``|G|^2``, the true gradient's squared norm (tensor)."""
        return self._smoothed("ema_gradient_sq")

    @property
    def noise_trace(self):
        """Smoothed unbiased estimate of ``tr(Sigma)``, the per-example gradient variance (tensor)."""
        return self._smoothed("ema_noise_trace")

    @property
    def mean_noise_scale(self):
        """Unsmoothed ``B_simple``: the mean ``tr(Sigma)`` estimate over the mean ``|G|^2`` estimate,
        over every counted window since the start (scalar tensor)."""
        return tf.math.truediv(self._vars["total_noise_trace"].read_value(),
                               self._vars["total_gradient_sq"].read_value(), name="mean_noise_scale")

    @property
    def windows(self):
        """int64 variable: windows that gave an estimate (applied, finite, small batches smaller than the window)."""
        return self._vars["windows"]

    @property
    def window_weight(self):
        """tf.Variable: the weight of the last applied window (the effective batch)."""
        return self._vars["last_window_weight"]

    @property
    def gradient_norm(self):
        """Global norm of the last applied window's averaged gradient, before clipping (tensor)."""
        return tf.sqrt(self._vars["last_big_sq_norm"].read_value(), name="gradient_norm")

    def variable(self, name):
        """Returns one state variable by its name (see the module docstring).

        Args:
          name: for example ``"last_big_sq_norm"`` or ``"small_batches"``.

        Returns:
          The variable.

        Raises:
          ValueError: for an unknown name.

        Example:
          >>> sess.run(stats.variable("last_small_sq_norm"))
        """
        if name not in self._vars:
            raise ValueError("`name` must be one of %s, got %s" % (sorted(self._vars), _validate.describe(name)))
        return self._vars[name]

    def _smoothed(self, name):
        return tf.math.truediv(self._vars[name].read_value(), self._vars["ema_weight"].read_value())

    # ---------------------------------------------------- as a window observer

    def added(self, micro_batch):
        """:meth:`observe_small` of the micro-batch (``gradaccum.observers``)."""
        return self.observe_small([g for g, _ in micro_batch.grads_and_vars], micro_batch.weight,
                                  small_batches=micro_batch.small_batches)

    def applying(self, update):
        """:meth:`observe_big` of the averaged window (or its ``sq_norm``), with the reduced small-batch sums."""
        given = {} if update.sq_norm is None else {"sq_norm": update.sq_norm}  # An override may predate it.
        return self.observe_big([g for g, _ in update.grads_and_vars], update.total,
                                small_sums=update.extras or None, **given)

    # --------------------------------------------------------- the updates

    def observe_small(self, grads, weight, small_batches=None):
        """Adds small batches' squared gradient norms to the window (one micro-step).

        One read pass over each gradient; ``IndexedSlices`` are summed per row
        first (as the dense gradient); a small batch of weight 0 adds nothing,
        even when its gradient is NaN (an empty tower shard).

        Args:
          grads: the micro-batch's gradients (``None`` entries are skipped),
            read when ``small_batches`` is ``None``.
          weight: the micro-batch's weight: a scalar tensor, a number or ``None`` (1).
          small_batches: ``None`` (the micro-batch is one small batch), or a
            list of ``(grads_and_vars, weight)``, one per small batch (the
            towers' shards), whose weights add up to the micro-batch's.

        Returns:
          An op.

        Example:
          >>> observe = stats.observe_small([g for g, _ in pairs], weight)
        """
        if small_batches is None:
            small_batches = [(list(grads), weight)]
        else:
            small_batches = [([g for g, v in pairs if v.name in self._names], w) for pairs, w in small_batches]
        with tf.compat.v1.name_scope("statistics"):
            sq_sum, weight_sum, count = [], [], []
            for batch_grads, batch_weight in small_batches:
                w = tf.cast(1.0 if batch_weight is None else batch_weight, self._dtype)
                sq_sum.append(tf.math.multiply_no_nan(_sq_norm(batch_grads, self._dtype), w))
                weight_sum.append(w)
                count.append(tf.cast(w > 0, self._dtype))
            v = self._vars
            return tf.group(v["small_sq_norm_sum"].assign_add(tf.add_n(sq_sum), read_value=False),
                            v["small_weight_sum"].assign_add(tf.add_n(weight_sum), read_value=False),
                            v["small_batches"].assign_add(tf.add_n(count), read_value=False), name="observe_small")

    def small_sums(self):
        """The window's small-batch sums, to reduce across workers with the gradients.

        Returns:
          ``[sum_i b_i |g_i|^2, sum_i b_i, n]``: scalar tensors in the
          statistics' dtype, read now.

        Example:
          >>> sums, total = reducer.reduce_window(pairs + [(s, var) for s in stats.small_sums()], total)
        """
        return [self._vars[name].read_value() for name in _WINDOW]

    def observe_big(self, averaged_grads, window_weight, small_sums=None, sq_norm=None):
        """Counts an applied window: its estimates, the moving averages, then resets the window.

        Args:
          averaged_grads: the window's averaged gradients (before clipping).
          window_weight: the weight the window's sums were divided by (summed
            over workers when reduced): a scalar tensor, or ``None`` (the
            small batches' weights, one worker).
          small_sums: ``None`` (this worker's), or :meth:`small_sums` summed
            over the workers, so that every worker estimates from every
            small batch and all of them get the same numbers.
          sq_norm: ``None``, or their squared global norm to use instead (stage 2: they are a share).

        Returns:
          An op; it reads the small batches' sums, so it must run after the
          window's last :meth:`observe_small`.

        Example:
          >>> observe = stats.observe_big([g for g, _ in averaged], weight_sum)
        """
        v = self._vars
        with tf.compat.v1.name_scope("statistics"):
            big = _sq_norm(averaged_grads, self._dtype) if sq_norm is None else tf.cast(sq_norm, self._dtype)
            small_total, weight, count = self.small_sums() if small_sums is None else small_sums
            if window_weight is None:
                window_weight = weight
            window_weight = tf.cast(window_weight, self._dtype)
            small = tf.math.divide_no_nan(small_total, weight)
            estimate = _estimate(big, small, weight, count, window_weight)
            last = {"last_big_sq_norm": big, "last_small_sq_norm": small, "last_small_weight_sum": weight,
                    "last_small_batches": count, "last_window_weight": window_weight}
            updates = dict(self._moving(estimate), **last)
            # Every value is computed (read) before any variable is written.
            with tf.control_dependencies(list(updates.values())):
                ops = [v[name].assign(value, read_value=False) for name, value in sorted(updates.items())]
                ops.append(v["windows"].assign_add(tf.cast(estimate.valid, tf.int64), read_value=False))
                with tf.control_dependencies(ops):
                    return tf.group(self._reset_window(), name="observe_big")

    def discard(self):
        """Forgets the window in progress (a skipped or reset window counts nothing).

        Returns:
          An op.

        Example:
          >>> skip = tf.group(reset, stats.discard())
        """
        with tf.compat.v1.name_scope("statistics"):
            return tf.group(self._reset_window(), name="discard")

    def extra_sums(self):  # As a window observer: reduced with the window.
        return self.small_sums()

    def reset(self):  # As a window observer: a reset window counts nothing.
        return self.discard()

    def _reset_window(self):
        return [self._vars[name].assign(tf.zeros([], self._dtype), read_value=False) for name in _WINDOW]

    def _moving(self, estimate):
        """New values of the smoothed and total variables (unchanged when ``estimate`` is not valid)."""
        decay = self._decay
        old = dict((name, self._vars[name].read_value()) for name in _SMOOTHED)  # One read each.
        new = {}
        for name, value in (("ema_gradient_sq", estimate.gradient_sq), ("ema_noise_trace", estimate.noise_trace),
                            ("ema_weight", tf.ones([], self._dtype))):
            new[name] = decay * old[name] + (1 - decay) * value
        new["total_gradient_sq"] = old["total_gradient_sq"] + estimate.gradient_sq
        new["total_noise_trace"] = old["total_noise_trace"] + estimate.noise_trace
        return dict((name, tf.compat.v1.where(estimate.valid, value, old[name])) for name, value in new.items())


# -------------------------------------------------------------- helpers


def _estimate(big, small, weight, count, window_weight):
    """The window's unbiased ``|G|^2`` and ``tr(Sigma)`` estimates (see the module docstring).

    ``E[small] = |G|^2 + tr(Sigma) / B_small`` and ``E[big] = |G|^2 +
    tr(Sigma) / B_big``, with ``1/B_small = count/weight`` and ``B_big =
    window_weight``: two equations, solved for the two unknowns.
    """
    # Valid when B_small < B_big (margin for rounding): n * B_big > B.
    valid = tf.logical_and(weight > 0, count * window_weight > weight * (1 + 1e-4))
    inv_small = tf.math.divide_no_nan(count, weight)
    inv_big = tf.math.divide_no_nan(tf.ones_like(window_weight), window_weight)
    gap = tf.compat.v1.where(valid, inv_small - inv_big, tf.ones_like(inv_small))
    noise_trace = (small - big) / gap
    gradient_sq = (big * inv_small - small * inv_big) / gap
    # A window applied with overflowed gradients (a loss-scale optimizer inside
    # skips it on its own) must not poison the averages for good.
    finite = tf.logical_and(tf.math.is_finite(noise_trace), tf.math.is_finite(gradient_sq))
    valid = tf.logical_and(valid, finite)
    zero = tf.zeros_like(big)
    return _Estimate(tf.compat.v1.where(valid, gradient_sq, zero),
                     tf.compat.v1.where(valid, noise_trace, zero), valid)


def _sq_norm(grads, dtype):
    """``sum_v |g_v|^2`` in ``dtype``; ``IndexedSlices`` rows are summed per index first.

    A dense layer's weight gradient is a product ``a^T d`` (``a``: the
    layer's ``[K, n]`` inputs, ``d``: the ``[K, m]`` backpropagated errors,
    ``K`` the micro-batch's rows), and ``|a^T d|^2 = sum((a a^T) * (d d^T))``:
    ``K^2 (n + m)`` multiply-adds on data backprop just wrote, where reading
    the gradient would move its ``n m`` elements through memory. Such
    gradients (:func:`_thin_product`) are measured so when ``K`` is small
    enough (decided when run if ``K`` is known only then), every other one
    is read.
    """
    parts = []
    for grad in grads:
        if grad is None:
            continue
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        with tf.compat.v1.device(values.device):
            if isinstance(grad, tf.IndexedSlices):
                unique, position = tf.unique(grad.indices)
                values = tf.math.unsorted_segment_sum(values, position, tf.shape(unique)[0])
            product = None if isinstance(grad, tf.IndexedSlices) else _thin_product(values)
            parts.append(_read_sq_norm(values, dtype) if product is None else _gram_or_read(values, product, dtype))
    return tf.add_n(parts) if parts else tf.zeros([], dtype)


def _read_sq_norm(values, dtype):
    """``|values|^2`` in ``dtype``, by one read pass over them."""
    if values.dtype.base_dtype != dtype:
        values = tf.cast(values, dtype)
    # l2_loss is a single fused read: sum(x^2) / 2.
    return 2 * tf.nn.l2_loss(values)


_Product = collections.namedtuple("_Product", ["left", "right", "transpose_left", "transpose_right", "rows",
                                               "widest"])

# Ops whose output holds their first input's elements, only rearranged: the
# squared norm passes through them.
_REARRANGING = frozenset(["Identity", "Snapshot", "Reshape", "Squeeze", "ExpandDims", "Transpose"])


def _thin_product(tensor):
    """A :data:`_Product` when ``tensor`` is a float32/64 ``MatMul`` of static shape ``[n, m]``
    (seen through ops that only rearrange elements), else ``None``.

    ``rows`` is its inner dimension ``K`` (an int, or a scalar tensor when
    known only when run), ``widest`` the largest ``K`` for which the Gram
    matrices cost fewer multiply-adds than half its elements: reading the
    elements would then take longer.
    """
    while tensor.op.type in _REARRANGING and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    # Half precision is left to the read: its gradient holds the product rounded to 11 bits.
    if tensor.op.type != "MatMul" or tensor.dtype.base_dtype not in (tf.float32, tf.float64):
        return None
    n, m = tensor.shape.as_list()  # A MatMul's output has rank 2.
    if n is None or m is None:
        return None
    widest = int(math.floor(math.sqrt(n * m / (2.0 * (n + m)))))
    if widest < 1:  # A vector, or nearly: even one row costs more than reading it.
        return None
    left, right = tensor.op.inputs[0], tensor.op.inputs[1]
    transpose_left = tensor.op.get_attr("transpose_a")
    axis = 0 if transpose_left else 1
    rows = tf.compat.v1.dimension_value(left.shape[axis]) if left.shape.ndims == 2 else None
    if rows is None:
        rows = tf.shape(left)[axis]
    return _Product(left, right, transpose_left, tensor.op.get_attr("transpose_b"), rows, widest)


def _gram_sq_norm(product, dtype):
    """``|left right|^2`` in ``dtype`` from the factors' Gram matrices, taken in float64 so that rows
    whose gradients (nearly) cancel lose nothing to rounding."""
    left, right = tf.cast(product.left, tf.float64), tf.cast(product.right, tf.float64)
    left_gram = tf.linalg.matmul(left, left, transpose_a=not product.transpose_left,
                                 transpose_b=product.transpose_left)
    right_gram = tf.linalg.matmul(right, right, transpose_a=product.transpose_right,
                                  transpose_b=not product.transpose_right)
    return tf.cast(tf.reduce_sum(left_gram * right_gram), dtype)


def _gram_or_read(values, product, dtype):
    """``|values|^2`` of a :data:`_Product`: from its Gram matrices when its ``K`` is at most its
    ``widest``, else by reading ``values``; a ``tf.cond`` when ``K`` is known only when run."""
    if isinstance(product.rows, int):
        return _gram_sq_norm(product, dtype) if product.rows <= product.widest else _read_sq_norm(values, dtype)
    return tf.cond(product.rows <= product.widest, lambda: _gram_sq_norm(product, dtype),
                   lambda: _read_sq_norm(values, dtype), name="sq_norm")


def learning_rate(optimizer):
    """The learning rate an optimizer keeps, as a float32 tensor, or ``None``.

    Looks at ``optimizer`` and the optimizers it wraps (``optimizer`` or
    ``_optimizer`` attributes, as gradaccum's wrappers and the loss-scale
    optimizer have) for a ``_learning_rate`` or ``_lr`` attribute: a number,
    a tensor, a variable or a callable returning one.

    Args:
      optimizer: a ``tf.compat.v1.train.Optimizer``.

    Returns:
      A scalar float32 tensor, or ``None`` when no optimizer in the chain
      exposes a learning rate.

    Example:
      >>> learning_rate(tf.compat.v1.train.AdamOptimizer(1e-3))
      <tf.Tensor 'Cast:0' shape=() dtype=float32>
    """
    for wrapped in optimizer_chain(optimizer):
        for attr in ("_learning_rate", "_lr"):
            value = getattr(wrapped, attr, None)
            if callable(value) and not isinstance(value, (tf.Tensor, tf.Variable)):
                value = value()
            if value is not None:
                return tf.cast(value, tf.float32)
    return None
