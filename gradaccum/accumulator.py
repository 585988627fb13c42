"""GradientAccumulator: exact gradient accumulation for any v1 optimizer.

A batch too big for the device is split into k micro-batches. Each run of the
train op adds one micro-batch's (optionally weighted) gradients to cache
variables; the k-th run divides by the accumulated weight, applies the result
through the wrapped optimizer, counts ``global_step`` and resets, all in that
same ``session.run``. k may be a Python int, a tensor, a schedule of
``global_step`` or an :class:`gradaccum.AdaptiveBatch` policy; it is read when
a window starts. With a static k = 1 the wrapper is the wrapped optimizer:
same ops, same results, same errors.

The window itself (its state, the accumulate step, the end-of-window apply)
is built by ``gradaccum._window``, whose docstring lists the variables each
train op creates (global, non-trainable, so a ``Saver`` checkpoint taken in
the middle of a window restores it exactly). None of them is a slot:
``get_slot`` and ``get_slot_names`` are the wrapped optimizer's.
``variables()`` returns the wrapped optimizer's variables plus
:attr:`GradientAccumulator.state_variables`; ``Saver()`` saves them all.

Collections: the variables go to ``GLOBAL_VARIABLES`` only. The train op is
appended to ``TRAIN_OP``; the wrapped optimizer's internal apply ops are kept
out of it, because running them on their own would apply a stale window.
Logging: a train op with k > 1 and a ``global_step`` installs
``gradaccum.hooks.GlobalStepWarningFilter`` (see there).
"""
from gradaccum import _validate
from gradaccum import _window
from gradaccum import hooks
from gradaccum._compat import in_control_flow, is_resource_variable, tf, v1_control_flow
from gradaccum._wrapper import WrappingOptimizer, optimizer_chain
from gradaccum.adaptive import AdaptiveBatch

_ACCUMULATION_DTYPES = (tf.float32, tf.float64)
_EAGER_MESSAGE = (
    "GradientAccumulator builds TF1 graph-mode train ops, but eager execution is enabled: call "
    "tf.compat.v1.disable_eager_execution() (or tf.compat.v1.disable_v2_behavior()) at the top of "
    "the script, before building the model"
)
Window = _window.Window


class GradientAccumulator(WrappingOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer`` to apply once every k micro-batches.

    The train op is run once per micro-batch. Runs 1 to k-1 of a window only
    add gradients to the caches: variables, the wrapped optimizer's slots and
    ``global_step`` do not change. Run k applies ``sum_i(w_i * g_i) /
    sum_i(w_i)`` through the wrapped optimizer, so with a mean loss and
    ``weight`` = the micro-batch size the update equals the full-batch update,
    uneven micro-batches included. With a static k = 1 it is the wrapped
    optimizer.

    k may change between windows: a tensor, a schedule or a policy is read
    when a window's first micro-batch arrives and holds until that window
    ends. The loop feeds ``sess.run(opt.window_size)`` micro-batches per
    window (or just runs the train op once per micro-batch, as with an int).

    When the wrapped optimizer has ``reduce_window`` (a collective reducer,
    ``gradaccum.collective``), the window's un-normalised sums and weight are
    reduced across workers once per window, skip or apply is decided on the
    reduced values, and the average is applied with its ``apply_reduced``.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the averaged
        gradients (its slots change only on applying runs).
      num_micro_batches: the micro-batches per applied update: an int >= 1;
        a scalar integer tensor or variable; a callable ``global_step ->
        scalar integer tensor`` (a schedule, such as :func:`gradaccum.batch_ramp`;
        needs ``global_step`` at ``minimize``); or a
        :class:`gradaccum.AdaptiveBatch` (which turns ``statistics`` on).
        A non-int k must evaluate to >= 1, or the run raises
        ``InvalidArgumentError``.
      clip_norm: ``None``, or a number > 0: the averaged gradients are clipped
        by global norm once, just before they are applied.
      accumulation_dtype: ``None``, ``tf.float32`` or ``tf.float64``: the
        narrowest dtype the caches use. ``None`` keeps the variable's dtype
        (float32 for float16/bfloat16 variables). ``tf.float64`` keeps sums of
        many float32 micro-batches exact to float32 precision.
      skip_nonfinite: when True, a window whose summed gradients are not
        finite is not applied, only reset and counted in ``skipped_windows``
        (for training without loss scaling; a loss-scale optimizer wrapped
        inside does this on its own and lowers its scale, and the window
        is counted and reset the same way, with or without this flag).
      statistics: when True, keep the gradient noise scale of each window
        (``gradaccum.statistics``; read it from :attr:`statistics`).
      name: the name scope of the ops and of the state variables.

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer, or is itself a
        ``GradientAccumulator``; when ``clip_norm`` is not a number, or
        ``skip_nonfinite`` or ``statistics`` not a bool.
      ValueError: when ``num_micro_batches`` is not an int >= 1, a scalar
        integer tensor, a callable or a policy, ``clip_norm``
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
                 skip_nonfinite=False, statistics=False, name="GradientAccumulator"):
        super(GradientAccumulator, self).__init__(optimizer, name)  # Checks `optimizer` and `name` first.
        if isinstance(optimizer, GradientAccumulator):
            raise TypeError(
                "`optimizer` is already a GradientAccumulator (num_micro_batches=%r); nest nothing, "
                "use one GradientAccumulator with the product of the counts" % (optimizer.num_micro_batches,)
            )
        self._k, self._size_fn, self._schedule = _window_sizes(num_micro_batches)
        self._given = num_micro_batches
        self._policy = num_micro_batches if isinstance(num_micro_batches, AdaptiveBatch) else None
        self._clip_norm = _validate.check_positive_number(clip_norm, "clip_norm")
        self._accumulation_dtype = _check_accumulation_dtype(accumulation_dtype)
        self._skip_nonfinite = _validate.check_bool(skip_nonfinite, "skip_nonfinite")
        self._use_statistics = _validate.check_bool(statistics, "statistics") or self._policy is not None
        # Facts about the wrapped chain, which never changes: read once, not per build step.
        self._reducer = _reducer(optimizer)
        self._loss_scaled = _skips_nonfinite(optimizer)
        self._windows = []

    # ------------------------------------------------------------------ API

    def __repr__(self):
        # Keras 3's compile() rejects a TF1 optimizer with only its repr: say there what to use.
        return ("<GradientAccumulator(%s, num_micro_batches=%r): a tf.compat.v1 optimizer for graph "
                "mode and Keras 2 (tf_keras with TF_USE_LEGACY_KERAS=1); Keras 3 takes no TF1 "
                "optimizer, use its own gradient_accumulation_steps there>"
                % (type(self._optimizer).__name__, self.num_micro_batches))

    @property
    def num_micro_batches(self):
        """The micro-batches per applied update, as given (the int, tensor, callable or policy)."""
        return self._k if self._size_fn is None else self._given

    @property
    def window_size(self):
        """int64 scalar tensor: the micro-batches to feed for the window in progress,
        or for the next one when none is (a constant for an int k)."""
        return self._window_field("size")

    @property
    def window_ended(self):
        """bool scalar tensor: True when no window is in progress, so after a train-op
        run, True when that run applied its window (or skipped it: see
        :attr:`skipped_windows`)."""
        return self._window_field("ended")

    @property
    def clip_norm(self):
        """The global-norm clip applied to the averaged gradients, or ``None``."""
        return self._clip_norm

    def minimize(self, loss, global_step=None, var_list=None,
                 gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
                 aggregation_method=None, colocate_gradients_with_ops=False,
                 name=None, grad_loss=None, *, weight=None, update_ops=None):
        """Builds the train op: ``compute_gradients`` plus ``apply_gradients``.

        Everything TF's ``Optimizer.minimize`` accepts is accepted and means
        the same: a callable loss (TF needs resource variables for it), a
        non-scalar loss (its sum is differentiated), ``grad_loss``.

        Args:
          loss: the loss of one micro-batch (a mean, when ``weight`` is the
            micro-batch size), or a callable returning it.
          global_step: optional variable, incremented once per applied update.
          var_list: optional list of variables to train.
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
          The train op; run it once per micro-batch.

        Raises:
          RuntimeError: when eager execution is enabled.
          TypeError: for a bad ``var_list`` or ``weight``.
          ValueError: as TF: "No variables to optimize" (empty ``var_list``),
            "No gradients provided for any variable"; for a non-scalar
            ``weight``.
          NotImplementedError: as TF, for a tensor in ``var_list``.

        Example:
          >>> train_op = opt.minimize(loss, global_step=global_step,
          ...                         weight=tf.shape(images)[0])
        """
        _check_graph_mode()
        var_list = _validate.check_var_list(var_list)
        weight = _validate.check_scalar_tensor(weight, "weight", allow_none=True)
        if update_ops is None:
            update_ops = tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
        weighted_grads = self._weight_in_backprop(loss, weight, var_list)
        if weighted_grads:
            # Backprop carries the weight from the loss to every gradient for free,
            # where the accumulate kernel would multiply each one on every micro-step.
            grad_loss = _weighted_grad_loss(loss, grad_loss, weight)
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)
        if all(grad is None for grad, _ in grads_and_vars):  # TF's message, word for word.
            raise ValueError(
                "No gradients provided for any variable, check your graph for ops that do not support "
                "gradients, between variables %s and loss %s." % ([str(v) for _, v in grads_and_vars], loss))
        return self._build(grads_and_vars, global_step, name, weight, update_ops, None, weighted_grads)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, *, weight=None,
                        update_ops=None, small_batches=None):
        """Builds a train op from ``(gradient, variable)`` pairs.

        Each run adds the gradients (times ``weight``) to the caches; the
        ``num_micro_batches``-th run since the last apply divides by the summed
        weight, applies through the wrapped optimizer (which increments
        ``global_step``) and resets, in the same run. Variables whose gradient
        is ``None`` get no cache and are left alone. Every call builds a new
        train op with its own window (see :attr:`windows`); the wrapped
        optimizer's slots are shared, as TF shares them. Ops created under a
        surrounding ``tf.control_dependencies`` wait for it on every run; the
        manual ``apply_op`` and ``zero_op`` are built outside it.

        Args:
          grads_and_vars: list of ``(gradient, variable)`` pairs, as returned
            by ``compute_gradients``; gradients may be ``IndexedSlices``.
          global_step: optional variable, incremented once per applied update.
          name: optional name of the returned op (default ``"train"``; with
            k = 1 and nothing to decide, TF's own default).
          weight: ``None`` (each micro-batch weighs 1) or a scalar tensor.
          update_ops: ops to run on every micro-batch before its gradients are
            added; ``None``: none (use ``tf.control_dependencies`` then).
            Window statistics among them (``gradaccum._update_ops``) are
            accumulated per micro-step and finalized once per applied window.
          small_batches: ``None``, or the towers' ``[(grads_and_vars,
            weight), ...]`` of this micro-batch, for ``statistics``.

        Returns:
          The train op.

        Raises:
          RuntimeError: when eager execution is enabled.
          TypeError: for malformed pairs or a non-numeric ``weight``.
          ValueError: as TF: "No variables provided", "No gradients provided
            for any variable"; for a non-scalar ``weight``, or a call inside
            ``tf.cond``/``tf.while_loop`` (as when a loss-scale optimizer wraps
            the accumulator instead of the other way round).
          NotImplementedError: as TF, for a tensor in place of a variable.

        Example:
          >>> grads_and_vars = opt.compute_gradients(loss)
          >>> train_op = opt.apply_gradients(grads_and_vars, global_step)
        """
        return self._build(grads_and_vars, global_step, name, weight, update_ops, small_batches, False)

    def _weight_in_backprop(self, loss, weight, var_list):
        """Whether ``minimize`` folds ``weight`` into ``grad_loss`` (k > 1 windows only).

        Not with statistics, which need each micro-batch's unweighted gradients,
        nor under a loss-scale optimizer, whose overflow test would then see the
        weighted gradients, nor for a callable loss, whose shape is not known yet,
        nor where a cache is wider than its gradient (``accumulation_dtype``,
        half-precision variables): the product is then taken in the cache's
        dtype. Nor across processes (a reducer, or collective ops behind the
        loss, as in worker-synchronised batch norm): there each worker's
        backward pass mixes in the others', which carry their own weights, so
        scaling it is not scaling the gradient.
        """
        if weight is None or self._k == 1 or self._use_statistics or callable(loss):
            return False
        dtype = tf.convert_to_tensor(loss).dtype.base_dtype
        variables = tf.compat.v1.trainable_variables() if var_list is None else var_list
        return (dtype in _ACCUMULATION_DTYPES and self._accumulation_dtype in (None, dtype)
                and all(v.dtype.base_dtype == dtype for v in variables)
                and not self._loss_scaled and self._reducer is None
                and not _crosses_processes(loss))

    def _build(self, grads_and_vars, global_step, name, weight, update_ops, small_batches, weighted_grads):
        """``apply_gradients``; ``weighted_grads``: the gradients already carry ``weight``."""
        _check_graph_mode()
        if in_control_flow():
            raise ValueError(
                "GradientAccumulator %r must build its train op outside tf.cond and tf.while_loop; "
                "to combine it with loss scaling, wrap the loss-scale optimizer inside it: "
                "GradientAccumulator(MixedPrecisionLossScaleOptimizer(opt, 'dynamic'), k)" % self.get_name()
            )
        grads_and_vars, pairs = _checked_pairs(grads_and_vars)
        weight = _validate.check_scalar_tensor(weight, "weight", allow_none=True)
        if self._schedule and global_step is None:
            raise ValueError("a callable `num_micro_batches` is a schedule of `global_step`: pass "
                             "`global_step` to minimize or apply_gradients, got None")
        update_ops = [] if update_ops is None else list(update_ops)
        ref_flow = any(not is_resource_variable(var) for var in [v for _, v in pairs] + [global_step]
                       if var is not None)
        config = _window.Config(self._optimizer, self._name, self._k, self._size_fn, self._policy,
                                self._clip_norm, self._accumulation_dtype, self._skip_nonfinite,
                                self._use_statistics, self._reducer, self._loss_scaled, ref_flow)
        graph = tf.compat.v1.get_default_graph()
        with v1_control_flow(ref_flow), _window.keep_train_ops(graph):
            window = _window.build(config, grads_and_vars, pairs, weight, global_step, name, update_ops,
                                   small_batches, weighted_grads)
        graph.add_to_collection(tf.compat.v1.GraphKeys.TRAIN_OP, window.train_op)
        self._windows.append(window)
        if self._k != 1 and global_step is not None:
            hooks.install_global_step_warning_filter()
        return window.train_op

    # -------------------------------------------------- state, after building

    @property
    def windows(self):
        """The ``Window`` of every train op built, in build order (all graphs)."""
        return list(self._windows)

    @property
    def accumulate_op(self):
        """Adds the current micro-batch's gradients; never applies (manual pattern)."""
        return self._window_field("accumulate_op")

    @property
    def apply_op(self):
        """Applies ``cache / weight_sum`` whatever the count, increments
        ``global_step`` and resets. Needs no feed; never recomputes gradients.
        A window whose weight is zero is skipped and counted instead."""
        return self._window_field("apply_op")

    @property
    def zero_op(self):
        """Resets the caches, ``micro_step`` and ``weight_sum`` without applying."""
        return self._window_field("zero_op")

    @property
    def micro_step(self):
        """int64 variable: micro-batches added since the last apply or reset."""
        return self._window_field("micro_step")

    @property
    def weight_sum(self):
        """tf.Variable: the weight added since the last apply or reset."""
        return self._window_field("weight_sum")

    @property
    def skipped_windows(self):
        """int64 variable: windows not applied because their total weight was zero
        or their sum was not finite (``skip_nonfinite``, or a wrapped loss-scale
        optimizer's overflow)."""
        return self._window_field("skipped_windows")

    @property
    def accumulators(self):
        """The cache variables, one per variable with a gradient (none with k = 1)."""
        return list(self._single_window().accumulators)

    @property
    def statistics(self):
        """The window's ``gradaccum.statistics.GradientStatistics`` (``statistics=True``)."""
        return self._window_field("statistics")

    @property
    def state_variables(self):
        """This accumulator's own variables in the current graph, sorted by name.

        Every window's caches, row flags, counters and statistics: what
        ``variables()`` adds to the wrapped optimizer's. They are in
        ``GLOBAL_VARIABLES``, so ``Saver()`` and
        ``global_variables_initializer()`` include them; code that initialises
        or saves only ``opt.optimizer.variables()`` must add these.
        """
        graph = tf.compat.v1.get_default_graph()
        return sorted((v for v in self._own_variables() if v.graph is graph), key=lambda v: v.name)

    # ------------------------------------------------------------ building

    def _own_variables(self):
        found = [] if self._policy is None else list(self._policy.variables)
        for window in self._windows:
            found.extend(window.state_variables())
        return found

    def _single_window(self):
        if not self._windows:
            raise ValueError("GradientAccumulator %r has no train op yet: call `minimize` or "
                             "`apply_gradients` first" % self.get_name())
        graph = tf.compat.v1.get_default_graph()
        found = [w for w in self._windows if w.train_op.graph is graph] or self._windows
        if len(found) > 1:
            raise ValueError("GradientAccumulator %r built %d train ops, each with its own window: "
                             "take the one you mean from `windows`" % (self.get_name(), len(found)))
        return found[0]

    def _window_field(self, field):
        value = getattr(self._single_window(), field)
        if value is None:
            raise ValueError(
                "GradientAccumulator %r has no `%s`: %s" % (self.get_name(), field, _MISSING.get(field, _K1)))
        return value


# ---------------------------------------------------------------- helpers

_K1 = "with num_micro_batches=1 it keeps no window (no cache, no counter); run its train op"
_MISSING = {
    "skipped_windows": "nothing can skip a window here (k = 1 without `weight`, `skip_nonfinite`, "
                       "a reducer or statistics)",
    "statistics": "create it with GradientAccumulator(..., statistics=True)",
}


def _window_sizes(num_micro_batches):
    """``(k, size_fn, is_schedule)``: the static int k, or ``None`` and ``size_fn(global_step)``."""
    if isinstance(num_micro_batches, AdaptiveBatch):
        return None, num_micro_batches.num_micro_batches, False
    if isinstance(num_micro_batches, (tf.Tensor, tf.Variable)):
        tensor = num_micro_batches
        if not tensor.dtype.base_dtype.is_integer or tensor.shape.ndims not in (None, 0):
            raise ValueError("`num_micro_batches` must be an int >= 1 or a scalar integer tensor, got %s"
                             % _validate.describe(tensor))
        return None, lambda global_step: tensor, False
    if callable(num_micro_batches):
        return None, num_micro_batches, True
    return _validate.check_positive_int(num_micro_batches, "num_micro_batches"), None, False


def _check_graph_mode():
    if tf.executing_eagerly():
        raise RuntimeError(_EAGER_MESSAGE)


def _reducer(optimizer):
    """The wrapped optimizer when it reduces windows across workers (interface B), else None."""
    return optimizer if callable(getattr(optimizer, "reduce_window", None)) else None


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


def _checked_pairs(grads_and_vars):
    """Returns the pairs as given (gradients converted) and those with a gradient.

    Raises what TF's ``apply_gradients`` raises, with TF's message first.
    """
    try:
        pairs = [(grad, var) for grad, var in grads_and_vars]
    except (TypeError, ValueError):
        raise TypeError("`grads_and_vars` must be a list of (gradient, variable) pairs, got %s"
                        % _validate.describe(grads_and_vars)) from None
    if not pairs:
        raise ValueError("No variables provided. `grads_and_vars` is empty, got %s"
                         % _validate.describe(grads_and_vars))
    converted = []
    for grad, var in pairs:
        if not isinstance(var, (tf.Variable, tf.Tensor)):
            raise TypeError("`grads_and_vars` must pair gradients with variables, got %s" % _validate.describe(var))
        if grad is not None:
            try:
                grad = tf.compat.v1.convert_to_tensor_or_indexed_slices(grad)
            except (TypeError, ValueError):
                raise TypeError("Gradient must be convertible to a Tensor or IndexedSlices, or None: "
                                "`grads_and_vars` holds %s" % _validate.describe(grad)) from None
        converted.append((grad, var))
    kept = [(grad, var) for grad, var in converted if grad is not None]
    if not kept:
        raise ValueError("No gradients provided for any variable: `grads_and_vars` has no gradient for any "
                         "variable: %s; check that the loss depends on them"
                         % _validate.describe([v.op.name for _, v in converted]))
    for _, var in kept:
        if isinstance(var, tf.Tensor):
            # TF's exception, with TF's (tuple) arguments first.
            raise NotImplementedError("Trying to update a Tensor ", var, "only variables can be trained")
    return converted, kept


def _crosses_processes(loss):
    """Whether an op behind ``loss`` talks to other processes (TF collectives, Horovod)."""
    seen, todo = set(), [tf.convert_to_tensor(loss).op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        if op.type.startswith(("Collective", "Horovod")):
            return True
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return False


def _weighted_grad_loss(loss, grad_loss, weight):
    """``grad_loss`` (ones, when None) times ``weight``, in the loss's dtype."""
    loss = tf.convert_to_tensor(loss)
    ones = tf.ones_like(loss) if grad_loss is None else grad_loss
    return ones * tf.cast(weight, loss.dtype.base_dtype)


def _skips_nonfinite(optimizer):
    """Whether ``optimizer``, or one it wraps, is TF's loss-scale optimizer.

    Such an optimizer skips an update whose gradients are not all finite
    (and lowers its loss scale); its class names differ between TF 1.15's
    ``tf.train.experimental``, contrib and ``tf.compat.v1.mixed_precision``.
    """
    return any(cls.__name__.endswith("LossScaleOptimizer")
               for wrapped in optimizer_chain(optimizer) for cls in type(wrapped).__mro__)
