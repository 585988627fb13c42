"""GradientAccumulator: exact gradient accumulation for any v1 optimizer.

A batch too big for the device is split into k micro-batches. Each run of the
train op adds one micro-batch's (optionally weighted) gradients to cache
variables; the k-th run divides by the accumulated weight, applies the result
through the wrapped optimizer, increments ``global_step`` and resets, all in
that same ``session.run``.

Variables this module creates (all global, non-trainable, so that a
``Saver`` checkpoint taken in the middle of a window restores it exactly),
each colocated with the variable it serves:

* ``<var>/<name>``: one accumulator per variable with a gradient, slot
  ``"accum"``, the variable's shape, in the variable's dtype widened to at
  least float32 (and to ``accumulation_dtype`` when that is wider).
* ``<var>/<name>_touched``: for a sparse (``IndexedSlices``) gradient only,
  slot ``"touched"``, one flag per row, so that the applied gradient is sparse
  again and touches exactly the rows the full batch would.
* ``<scope>/micro_step`` (int64): micro-batches added since the last apply or
  reset.
* ``<scope>/weight_sum``: the weight added since the last apply or reset.
* ``<scope>/skipped_windows`` (int64): windows not applied because their
  total weight was zero, or (with ``skip_nonfinite``) their sum not finite.

Collections: these variables go to ``GLOBAL_VARIABLES`` only. The fused train
op is appended to ``TRAIN_OP``; the wrapped optimizer's internal apply ops are
kept out of it, because running them on their own would apply a stale window.
"""
import collections

from gradaccum import _validate
from gradaccum._compat import in_control_flow, tf
from gradaccum._wrapper import WrappingOptimizer

# Half-precision sums lose digits after a few additions: never accumulate
# in fewer bits than float32.
_FLOAT_WIDTH = {tf.float16: 16, tf.bfloat16: 16, tf.float32: 32, tf.float64: 64}
_ACCUMULATION_DTYPES = (tf.float32, tf.float64)

# What apply_gradients builds; documented on the public properties.
_Window = collections.namedtuple(
    "_Window", ["slots", "micro_step", "weight_sum", "skipped", "accumulate", "apply", "zero"]
)
# One variable's accumulation state; ``touched`` is None for dense gradients.
_Slot = collections.namedtuple("_Slot", ["var", "accum", "touched"])


class GradientAccumulator(WrappingOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer`` to apply once every k micro-batches.

    The train op is run once per micro-batch. Runs 1 to k-1 of a window only
    add gradients to the accumulators: variables, the wrapped optimizer's slots
    and ``global_step`` do not change. Run k applies
    ``sum_i(w_i * g_i) / sum_i(w_i)`` through the wrapped optimizer, so with a
    mean loss and ``weight`` = the micro-batch size the update equals the
    full-batch update, uneven micro-batches included.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the averaged
        gradients (its slots change only on applying runs).
      num_micro_batches: int >= 1, the micro-batches per applied update.
      clip_norm: ``None``, or a number > 0: the averaged gradients are clipped
        by global norm once, just before they are applied.
      accumulation_dtype: ``None``, ``tf.float32`` or ``tf.float64``: the
        narrowest dtype the accumulators use. ``None`` keeps the variable's
        dtype (float32 for float16/bfloat16 variables). ``tf.float64`` keeps
        sums of many float32 micro-batches exact to float32 precision (large
        k with a large common offset), at the cost of a float64 cache.
      skip_nonfinite: when True, a window whose summed gradients are not
        finite is not applied, only reset and counted in ``skipped_windows``
        (for training without loss scaling; a loss-scale optimizer wrapped
        inside does this on its own and lowers its scale).
      name: the name scope of the ops and of the state variables.

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer, or is itself a
        ``GradientAccumulator``; when ``clip_norm`` is not a number or
        ``skip_nonfinite`` not a bool.
      ValueError: when ``num_micro_batches`` is not an int >= 1, ``clip_norm``
        is not > 0, ``accumulation_dtype`` is not float32 or float64, or
        ``name`` is empty.

    Example:
      >>> opt = gradaccum.GradientAccumulator(
      ...     tf.compat.v1.train.AdamOptimizer(1e-3), num_micro_batches=8)
      >>> train_op = opt.minimize(loss, global_step=global_step,
      ...                         weight=tf.shape(images)[0])
      >>> for images_i, labels_i in micro_batches:  # 8 runs = 1 update
      ...     sess.run(train_op, {images: images_i, labels: labels_i})
    """

    def __init__(self, optimizer, num_micro_batches, *, clip_norm=None, accumulation_dtype=None,
                 skip_nonfinite=False, name="GradientAccumulator"):
        super(GradientAccumulator, self).__init__(optimizer, name)  # Checks `optimizer` and `name` first.
        if isinstance(optimizer, GradientAccumulator):
            raise TypeError(
                "`optimizer` is already a GradientAccumulator (num_micro_batches=%d); nest nothing, "
                "use one GradientAccumulator with the product of the counts" % optimizer.num_micro_batches
            )
        self._k = _validate.check_positive_int(num_micro_batches, "num_micro_batches")
        self._clip_norm = _validate.check_positive_number(clip_norm, "clip_norm")
        self._accumulation_dtype = _check_accumulation_dtype(accumulation_dtype)
        if not isinstance(skip_nonfinite, bool):
            raise TypeError("`skip_nonfinite` must be a bool, got %s" % _validate.describe(skip_nonfinite))
        self._skip_nonfinite = skip_nonfinite
        self._window = None

    # ------------------------------------------------------------------ API

    @property
    def num_micro_batches(self):
        """Micro-batches per applied update (the ``k`` of the window)."""
        return self._k

    @property
    def clip_norm(self):
        """The global-norm clip applied to the averaged gradients, or ``None``."""
        return self._clip_norm

    def minimize(self, loss, global_step=None, var_list=None,
                 gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
                 aggregation_method=None, colocate_gradients_with_ops=False,
                 name=None, grad_loss=None, *, weight=None, update_ops=None):
        """Builds the fused train op: ``compute_gradients`` plus ``apply_gradients``.

        Args:
          loss: the scalar loss of one micro-batch (a mean, when ``weight`` is
            the micro-batch size).
          global_step: optional variable, incremented once per applied update.
          var_list: optional non-empty list of variables to train.
          gate_gradients: as in ``tf.compat.v1.train.Optimizer.minimize``.
          aggregation_method: as in ``tf.compat.v1.train.Optimizer.minimize``.
          colocate_gradients_with_ops: as in ``tf.compat.v1.train.Optimizer``.
          name: optional name of the returned op.
          grad_loss: optional tensor holding the gradient of ``loss``.
          weight: ``None`` (each micro-batch weighs 1) or a scalar tensor, for
            example the micro-batch's example count.
          update_ops: ops to run on every micro-batch, before its gradients are
            added (batch-norm moving averages). ``None`` means every op in
            ``tf.GraphKeys.UPDATE_OPS`` at call time; ``[]`` means none.

        Returns:
          The fused train op; run it once per micro-batch.

        Raises:
          TypeError: for a non-tensor loss, a bad ``var_list`` or ``weight``.
          ValueError: for a non-scalar loss, an empty ``var_list``, no
            gradient at all, or a second train op on this accumulator.

        Example:
          >>> train_op = opt.minimize(loss, global_step=global_step,
          ...                         weight=tf.shape(images)[0])
        """
        loss = _check_loss(loss)
        var_list = _validate.check_var_list(var_list)
        if update_ops is None:
            update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)
        with tf.control_dependencies(list(update_ops)):
            return self.apply_gradients(grads_and_vars, global_step, name, weight=weight)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, *, weight=None):
        """Builds the fused train op from ``(gradient, variable)`` pairs.

        Each run adds the gradients (times ``weight``) to the accumulators; the
        ``num_micro_batches``-th run since the last apply divides by the summed
        weight, applies through the wrapped optimizer (which increments
        ``global_step``) and resets, in the same run. Variables whose gradient
        is ``None`` get no accumulator and are left alone. Ops created under a
        surrounding ``tf.control_dependencies`` wait for it on every run; the
        manual ``apply_op`` and ``zero_op`` are built outside it, so that they
        need no feed.

        Args:
          grads_and_vars: list of ``(gradient, variable)`` pairs, as returned
            by ``compute_gradients``; gradients may be ``IndexedSlices``.
          global_step: optional variable, incremented once per applied update.
          name: optional name of the returned op (default ``"train"``).
          weight: ``None`` (each micro-batch weighs 1) or a scalar tensor.

        Returns:
          The fused train op.

        Raises:
          TypeError: for malformed pairs or a non-numeric ``weight``.
          ValueError: when every gradient is ``None``, ``weight`` is not a
            scalar, this accumulator already built a train op, or it is
            called inside ``tf.cond``/``tf.while_loop`` (as when a loss-scale
            optimizer wraps the accumulator instead of the other way round).

        Example:
          >>> grads_and_vars = opt.compute_gradients(loss)
          >>> train_op = opt.apply_gradients(grads_and_vars, global_step)
        """
        if self._window is not None:
            raise ValueError(
                "this GradientAccumulator (name=%r) already built a train op; make one "
                "GradientAccumulator per train op" % self.get_name()
            )
        if in_control_flow():
            raise ValueError(
                "GradientAccumulator %r must build its train op outside tf.cond and tf.while_loop; "
                "to combine it with loss scaling, wrap the loss-scale optimizer inside it: "
                "GradientAccumulator(MixedPrecisionLossScaleOptimizer(opt, 'dynamic'), k)" % self.get_name()
            )
        pairs = _checked_pairs(grads_and_vars)
        weight = _validate.check_scalar_tensor(weight, "weight", allow_none=True)
        graph = tf.compat.v1.get_default_graph()
        outer_scope = graph.get_name_scope()
        train_ops_before = list(graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP))
        with tf.compat.v1.name_scope(self._name) as scope:
            self._window = self._build_window(pairs, weight, global_step, outer_scope, scope)
            with tf.control_dependencies([self._window.accumulate]):
                due = tf.greater_equal(self._window.micro_step.read_value(), self._k, name="window_full")
            fused = tf.cond(due, lambda: self._finish_window(global_step, outer_scope), tf.no_op,
                            name="apply_if_due")
            train_op = tf.group(fused, name=name or "train")
        _reset_collection(graph, tf.compat.v1.GraphKeys.TRAIN_OP, train_ops_before + [train_op])
        return train_op

    # -------------------------------------------------- state, after building

    @property
    def accumulate_op(self):
        """Adds the current micro-batch's gradients; never applies (manual pattern)."""
        return self._built().accumulate

    @property
    def apply_op(self):
        """Applies ``accum / weight_sum`` whatever the count, increments
        ``global_step`` and resets. Needs no feed; never recomputes gradients.
        A window whose weight is zero is skipped and counted instead."""
        return self._built().apply

    @property
    def zero_op(self):
        """Resets the accumulators, ``micro_step`` and ``weight_sum`` without applying."""
        return self._built().zero

    @property
    def micro_step(self):
        """int64 variable: micro-batches added since the last apply or reset."""
        return self._built().micro_step

    @property
    def weight_sum(self):
        """Variable: the weight added since the last apply or reset."""
        return self._built().weight_sum

    @property
    def skipped_windows(self):
        """int64 variable: windows not applied because their total weight was zero
        or, with ``skip_nonfinite``, their sum was not finite."""
        return self._built().skipped

    @property
    def accumulators(self):
        """The accumulator variables, one per variable with a gradient."""
        return [slot.accum for slot in self._built().slots]

    # ------------------------------------------------------------ building

    def _built(self):
        if self._window is None:
            raise ValueError(
                "GradientAccumulator %r has no train op yet: call `minimize` or "
                "`apply_gradients` first" % self.get_name()
            )
        return self._window

    def _build_window(self, pairs, weight, global_step, outer_scope, scope):
        slots, micro_step, weight_sum, skipped = self._create_state(pairs)
        window = _Window(slots, micro_step, weight_sum, skipped, None, None, None)
        self._window = window  # _finish_window reads it below.
        accumulate = _accumulate(window, pairs, weight)
        # The manual ops must not wait for the caller's control dependencies
        # (typically UPDATE_OPS, which need a feed): rebuild the scope cleanly.
        with tf.control_dependencies(None), tf.compat.v1.name_scope(scope):
            apply_op = tf.group(self._finish_window(global_step, outer_scope), name="apply")
            zero_op = tf.group(_reset(window), name="zero")
        return window._replace(accumulate=accumulate, apply=apply_op, zero=zero_op)

    def _create_state(self, pairs):
        # init_scope: outside surrounding control dependencies and control flow,
        # so initializers never wait for update ops or feeds.
        with tf.compat.v1.init_scope():
            slots = [self._create_slot(var, grad) for grad, var in pairs]
            first = min((var for _, var in pairs), key=lambda v: v.name)
            sum_dtype = tf.float64 if any(s.accum.dtype.base_dtype == tf.float64 for s in slots) else tf.float32
            micro_step = self._create_non_slot_variable(_zero(tf.int64), "micro_step", first)
            weight_sum = self._create_non_slot_variable(_zero(sum_dtype), "weight_sum", first)
            skipped = self._create_non_slot_variable(_zero(tf.int64), "skipped_windows", first)
        return slots, micro_step, weight_sum, skipped

    def _create_slot(self, var, grad):
        shape = var.get_shape()
        if not shape.is_fully_defined():
            raise ValueError("variable %r needs a fully defined shape to be accumulated, got %s"
                             % (var.op.name, shape))
        dtype = _accumulator_dtype(var.dtype.base_dtype, self._accumulation_dtype)
        zeros = tf.compat.v1.zeros_initializer()
        accum = self._get_or_make_slot_with_initializer(var, zeros, shape, dtype, "accum", self._name)
        touched = None
        if isinstance(grad, tf.IndexedSlices):
            touched = self._get_or_make_slot_with_initializer(
                var, zeros, shape[:1], dtype, "touched", self._name + "_touched")
        return _Slot(var, accum, touched)

    def _finish_window(self, global_step, outer_scope):
        """Applies the window (or skips it: zero weight, or not finite), then resets."""
        window = self._window
        usable = tf.greater(window.weight_sum.read_value(), 0, name="has_weight")
        if self._skip_nonfinite:
            finite = [tf.reduce_all(tf.math.is_finite(slot.accum.read_value())) for slot in window.slots]
            usable = tf.logical_and(usable, tf.reduce_all(tf.stack(finite)), name="usable")
        return tf.cond(usable, lambda: self._apply_and_reset(global_step, outer_scope),
                       lambda: _skip_and_reset(window), name="apply_or_skip")

    def _apply_and_reset(self, global_step, outer_scope):
        window = self._window
        grads_and_vars, rows = _averaged(window)
        if self._clip_norm is not None:
            grads, variables = zip(*grads_and_vars)
            grads, _ = tf.clip_by_global_norm(list(grads), self._clip_norm, name="clip")
            grads_and_vars = list(zip(grads, variables))
        # The wrapped optimizer's non-slot variables (Adam's beta powers) are
        # named from the current scope: use the caller's, as plain training would.
        with tf.compat.v1.get_default_graph().name_scope(outer_scope + "/" if outer_scope else ""):
            applied = self._optimizer.apply_gradients(grads_and_vars, global_step=global_step)
        with tf.control_dependencies([applied]):
            return tf.group(_reset(window, rows), name="reset")


# ---------------------------------------------------------------- helpers


def _zero(dtype):
    return tf.zeros([], dtype=dtype)


def _check_accumulation_dtype(dtype):
    if dtype is None:
        return None
    try:
        converted = tf.as_dtype(dtype)
    except TypeError:
        converted = None
    if converted not in _ACCUMULATION_DTYPES:
        raise ValueError("`accumulation_dtype` must be None, tf.float32 or tf.float64, got %s"
                         % _validate.describe(dtype))
    return converted


def _accumulator_dtype(var_dtype, minimum):
    """The wider of the variable's float dtype (at least float32) and ``minimum``."""
    if var_dtype not in _FLOAT_WIDTH:  # complex: keep as is
        return var_dtype
    choices = [tf.float32, var_dtype] + ([minimum] if minimum is not None else [])
    return max(choices, key=lambda dtype: _FLOAT_WIDTH.get(dtype, 0))


def _check_loss(loss):
    if callable(loss) or not isinstance(loss, (tf.Tensor, tf.Variable)):
        raise TypeError("`loss` must be a scalar tensor (graph mode), got %s" % _validate.describe(loss))
    if loss.shape.ndims is not None and loss.shape.ndims != 0:
        raise ValueError("`loss` must be a scalar tensor, got shape %s: reduce it with tf.reduce_mean"
                         % (loss.shape,))
    return loss


def _checked_pairs(grads_and_vars):
    """Keeps the pairs with a gradient; raises when there is none."""
    try:
        pairs = [(grad, var) for grad, var in grads_and_vars]
    except (TypeError, ValueError):
        raise TypeError("`grads_and_vars` must be a list of (gradient, variable) pairs, got %s"
                        % _validate.describe(grads_and_vars)) from None
    for _, var in pairs:
        if not isinstance(var, tf.Variable):
            raise TypeError("`grads_and_vars` must pair gradients with variables, got %s"
                            % _validate.describe(var))
    kept = [(grad, var) for grad, var in pairs if grad is not None]
    if not kept:
        raise ValueError("`grads_and_vars` has no gradient for any variable: %s; check that the "
                         "loss depends on them" % _validate.describe([v.op.name for _, v in pairs]))
    return kept


def _accumulate(window, pairs, weight):
    """Adds one micro-batch: gradients times weight, the weight, then the count."""
    with tf.compat.v1.name_scope("accumulate"):
        adds = []
        for (grad, _), slot in zip(pairs, window.slots):
            adds.extend(_add_gradient(slot, grad, weight))
        added = 1.0 if weight is None else tf.cast(weight, window.weight_sum.dtype.base_dtype)
        adds.append(window.weight_sum.assign_add(added))
        with tf.control_dependencies(adds):
            # The counter moves last, so reading it orders after every addition.
            return tf.group(window.micro_step.assign_add(1), name="accumulate")


def _add_gradient(slot, grad, weight):
    dtype = slot.accum.dtype.base_dtype
    if isinstance(grad, tf.IndexedSlices):
        values = _weighted(grad.values, weight, dtype)
        ones = tf.ones_like(grad.indices, dtype=dtype)
        return [tf.compat.v1.scatter_add(slot.accum, grad.indices, values),
                tf.compat.v1.scatter_update(slot.touched, grad.indices, ones)]
    return [slot.accum.assign_add(_weighted(grad, weight, dtype))]


def _weighted(values, weight, dtype):
    values = tf.cast(values, dtype)
    return values if weight is None else values * tf.cast(weight, dtype)


def _averaged(window):
    """Reads ``accum / weight_sum`` per variable; sparse accumulators become IndexedSlices."""
    grads_and_vars, rows = [], []
    for slot in window.slots:
        var_dtype = slot.var.dtype.base_dtype
        total = tf.cast(window.weight_sum.read_value(), slot.accum.dtype.base_dtype)
        if slot.touched is None:
            grad = tf.cast(slot.accum.read_value() / total, var_dtype)
            rows.append(None)
        else:
            index = _touched_rows(slot)
            values = tf.cast(tf.gather(slot.accum, index) / total, var_dtype)
            grad = tf.IndexedSlices(values, index, dense_shape=tf.shape(slot.var, out_type=tf.int64))
            rows.append(index)
        grads_and_vars.append((grad, slot.var))
    return grads_and_vars, rows


def _touched_rows(slot):
    return tf.reshape(tf.where(slot.touched.read_value() > 0), [-1])


def _reset(window, rows=None):
    """Zeroes the accumulators (only touched rows of sparse ones) and the counters."""
    rows = rows or [None] * len(window.slots)
    ops = [window.micro_step.assign(0), window.weight_sum.assign(0)]
    for slot, index in zip(window.slots, rows):
        if slot.touched is None:
            ops.append(slot.accum.assign(tf.zeros(slot.accum.shape, slot.accum.dtype.base_dtype)))
            continue
        index = _touched_rows(slot) if index is None else index
        with tf.control_dependencies([index]):
            shape = tf.concat([tf.shape(index), tf.shape(slot.accum)[1:]], 0)
            ops.append(tf.compat.v1.scatter_update(
                slot.accum, index, tf.zeros(shape, slot.accum.dtype.base_dtype)))
            ops.append(slot.touched.assign(tf.zeros(slot.touched.shape, slot.touched.dtype.base_dtype)))
    return ops


def _skip_and_reset(window):
    with tf.control_dependencies(_reset(window)):
        return tf.group(window.skipped.assign_add(1), name="skip")


def _reset_collection(graph, key, values):
    """Replaces a graph collection's content with ``values``."""
    ref = graph.get_collection_ref(key)
    del ref[:]
    ref.extend(values)
