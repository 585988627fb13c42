"""GradientAccumulator: exact gradient accumulation for any v1 optimizer.

A batch too big for the device is split into k micro-batches. Each run of the
train op adds one micro-batch's (optionally weighted) gradients to cache
variables; the k-th run divides by the accumulated weight, applies the result
through the wrapped optimizer, increments ``global_step`` and resets, all in
that same ``session.run``. With k = 1 the wrapper is the wrapped optimizer:
same ops, same results, same errors (see the README's "drop-in" section for
what is proven and how).

Variables this module creates (global, non-trainable, so that a ``Saver``
checkpoint taken in the middle of a window restores it exactly; resource
variables, each colocated with the variable it serves). Each train op built
with k > 1 has its own window, scoped ``<scope>`` (``name``, made unique):

* ``<var>/<name>``: the cache of each variable with a gradient, of the
  variable's shape, in its dtype widened to at least float32 (and to
  ``accumulation_dtype`` when that is wider);
* ``<var>/<name>_touched``: for a sparse (``IndexedSlices``) gradient only,
  one flag per row, so that the applied gradient is sparse again and touches
  exactly the rows the full batch would;
* ``<scope>/micro_step`` (int64): micro-batches added since the last apply or
  reset; ``<scope>/weight_sum``: the weight added since then;
* ``<scope>/skipped_windows`` (int64): windows not applied because their
  total weight was zero, or their sum was not finite (with
  ``skip_nonfinite``, or a wrapped loss-scale optimizer's overflow);
* with ``statistics=True``: ``<scope>/statistics/...`` (see
  ``gradaccum.statistics``).

With k = 1 there is no cache, ``micro_step`` or ``weight_sum``; only
``skipped_windows`` when a window can be skipped or statistics are kept.
None of these is a slot: ``get_slot`` and ``get_slot_names`` are the wrapped
optimizer's. ``variables()`` returns the wrapped optimizer's variables plus
:attr:`GradientAccumulator.state_variables`; ``Saver()`` saves them all.

Memory passes (issue 13): per micro-step, one pass per dense cache. A
window's first micro-batch writes its gradients (``cache = weight *
gradient``), later ones add them (``cache += weight * gradient``, one kernel
with the weight as its scalar); ``minimize`` folds ``weight`` into
``grad_loss`` where that is exact, so the gradients arrive weighted and no
kernel multiplies. At a window's end the division by the weight is the only
pass that reads the caches; no pass zeroes them. So a dense cache holds the
window's sum only while ``micro_step`` > 0: after an apply, a skip or
``zero_op`` it still holds the last window's sum until the next write.

Collections: the variables go to ``GLOBAL_VARIABLES`` only. The train op is
appended to ``TRAIN_OP``; the wrapped optimizer's internal apply ops are kept
out of it, because running them on their own would apply a stale window.
Logging: a train op with k > 1 and a ``global_step`` installs
``gradaccum.hooks.GlobalStepWarningFilter`` (see there).
"""
import collections

from gradaccum import _validate
from gradaccum import hooks
from gradaccum import statistics as _statistics
from gradaccum._compat import in_control_flow, is_resource_variable, tf, v1_control_flow
from gradaccum._window import split_update_ops
from gradaccum._wrapper import WrappingOptimizer, optimizer_chain, state_variable, weighted

# Half-precision sums lose digits after a few additions: never accumulate
# in fewer bits than float32.
_FLOAT_WIDTH = {tf.float16: 16, tf.bfloat16: 16, tf.float32: 32, tf.float64: 64}
_ACCUMULATION_DTYPES = (tf.float32, tf.float64)
_EAGER_MESSAGE = (
    "GradientAccumulator builds TF1 graph-mode train ops, but eager execution is enabled: call "
    "tf.compat.v1.disable_eager_execution() (or tf.compat.v1.disable_v2_behavior()) at the top of "
    "the script, before building the model"
)

Window = collections.namedtuple("Window", [
    "train_op", "accumulate_op", "apply_op", "zero_op", "micro_step", "weight_sum", "skipped_windows",
    "accumulators", "touched", "variables", "statistics"])
Window.__doc__ = """What one ``minimize``/``apply_gradients`` call of a GradientAccumulator built.

Each train op has its own window: its own caches and counters.

Attributes:
  train_op: the op returned, run once per micro-batch.
  accumulate_op: adds the fed micro-batch, never applies (manual pattern);
    ``None`` with k = 1.
  apply_op: applies ``cache / weight_sum`` whatever the count, increments
    ``global_step`` and resets (skips a zero-weight window); needs no feed;
    ``None`` with k = 1.
  zero_op: resets the window without applying; ``None`` with k = 1.
  micro_step: int64 variable, micro-batches since the last apply or reset
    (``None`` with k = 1).
  weight_sum: variable, the weight since then (``None`` with k = 1).
  skipped_windows: int64 variable counting skipped windows, or ``None``
    (k = 1 with nothing that can skip).
  accumulators: the cache variables, one per variable with a gradient;
    a dense one holds the window's sum only while ``micro_step`` > 0.
  touched: per cache, the row flags of a sparse one, else ``None``.
  variables: the trained variables, in the order of ``accumulators``.
  statistics: the ``gradaccum.statistics.GradientStatistics``, or ``None``.
"""

# One variable's accumulation state; ``touched`` is None for dense gradients.
_Slot = collections.namedtuple("_Slot", ["var", "accum", "touched"])
# The state of one window while it is being built.
_State = collections.namedtuple("_State", ["slots", "micro_step", "weight_sum", "skipped", "stats"])


class GradientAccumulator(WrappingOptimizer):
    """Wraps a ``tf.compat.v1.train.Optimizer`` to apply once every k micro-batches.

    The train op is run once per micro-batch. Runs 1 to k-1 of a window only
    add gradients to the caches: variables, the wrapped optimizer's slots and
    ``global_step`` do not change. Run k applies ``sum_i(w_i * g_i) /
    sum_i(w_i)`` through the wrapped optimizer, so with a mean loss and
    ``weight`` = the micro-batch size the update equals the full-batch update,
    uneven micro-batches included. With k = 1 it is the wrapped optimizer.

    When the wrapped optimizer has ``reduce_window`` (a collective reducer,
    ``gradaccum.collective``), the window's un-normalised sums and weight are
    reduced across workers once per window, skip or apply is decided on the
    reduced values, and the average is applied with its ``apply_reduced``.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the averaged
        gradients (its slots change only on applying runs).
      num_micro_batches: int >= 1, the micro-batches per applied update.
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
                 skip_nonfinite=False, statistics=False, name="GradientAccumulator"):
        super(GradientAccumulator, self).__init__(optimizer, name)  # Checks `optimizer` and `name` first.
        if isinstance(optimizer, GradientAccumulator):
            raise TypeError(
                "`optimizer` is already a GradientAccumulator (num_micro_batches=%d); nest nothing, "
                "use one GradientAccumulator with the product of the counts" % optimizer.num_micro_batches
            )
        self._k = _validate.check_positive_int(num_micro_batches, "num_micro_batches")
        self._clip_norm = _validate.check_positive_number(clip_norm, "clip_norm")
        self._accumulation_dtype = _check_accumulation_dtype(accumulation_dtype)
        self._skip_nonfinite = _validate.check_bool(skip_nonfinite, "skip_nonfinite")
        self._use_statistics = _validate.check_bool(statistics, "statistics")
        # Facts about the wrapped chain, which never changes: read once, not per build step.
        self._reducer = _reducer(optimizer)
        self._loss_scaled = _skips_nonfinite(optimizer)
        self._windows = []

    # ------------------------------------------------------------------ API

    def __repr__(self):
        # Keras 3's compile() rejects a TF1 optimizer with only its repr: say there what to use.
        return ("<GradientAccumulator(%s, num_micro_batches=%d): a tf.compat.v1 optimizer for graph "
                "mode and Keras 2 (tf_keras with TF_USE_LEGACY_KERAS=1); Keras 3 takes no TF1 "
                "optimizer, use its own gradient_accumulation_steps there>"
                % (type(self._optimizer).__name__, self._k))

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
            Window statistics among them (``gradaccum._window``) are
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
        update_ops = [] if update_ops is None else list(update_ops)
        graph = tf.compat.v1.get_default_graph()
        train_ops_before = list(graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP))
        with v1_control_flow(any(not is_resource_variable(var) for _, var in pairs)):
            if self._k == 1:
                window = self._build_direct(grads_and_vars, pairs, weight, global_step, name, update_ops,
                                            small_batches)
            else:
                window = self._build_window(pairs, weight, global_step, name, update_ops, small_batches,
                                            weighted_grads)
        if window.skipped_windows is not None or window.statistics is not None or self._clip_norm is not None:
            _reset_collection(graph, tf.compat.v1.GraphKeys.TRAIN_OP, train_ops_before + [window.train_op])
        self._windows.append(window)
        if self._k > 1 and global_step is not None:
            hooks.install_global_step_warning_filter()
        return window.train_op

    # -------------------------------------------------- state, after building

    @property
    def windows(self):
        """The :class:`Window` of every train op built, in build order (all graphs)."""
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
        """Variable: the weight added since the last apply or reset."""
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
        found = []
        for window in self._windows:
            found.extend(window.accumulators)
            found.extend(flags for flags in window.touched if flags is not None)
            found.extend(v for v in (window.micro_step, window.weight_sum, window.skipped_windows) if v is not None)
            if window.statistics is not None:
                found.extend(window.statistics.variables)
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

    def _build_direct(self, grads_and_vars, pairs, weight, global_step, name, update_ops, small_batches):
        """k = 1: the wrapped optimizer's own train op, unless something must be decided or observed."""
        reducer = self._reducer
        decide = weight is not None or self._skip_nonfinite or reducer is not None
        if not (decide or self._use_statistics or self._clip_norm is not None):
            with tf.control_dependencies(update_ops):
                train_op = self._optimizer.apply_gradients(grads_and_vars, global_step, name)
            return Window(train_op, None, None, None, None, None, None, [], [], [v for _, v in pairs], None)
        outer_scope = tf.compat.v1.get_default_graph().get_name_scope()
        with tf.compat.v1.name_scope(self._name):
            skipped, stats = self._create_direct_state(pairs, decide or self._use_statistics)
            with tf.control_dependencies(update_ops):
                observed = [] if stats is None else [
                    stats.observe_small([g for g, _ in pairs], weight, small_batches=small_batches)]
                with tf.control_dependencies(observed):
                    sums, total = pairs, None
                    if reducer is not None:
                        sums = [(weighted(g, weight), v) for g, v in pairs]
                        total = tf.constant(1.0) if weight is None else tf.cast(weight, tf.float32)
                    elif weight is not None:
                        total = weight
                    done = self._finish(sums, total, reducer is not None, global_step, outer_scope,
                                        list, list, _State([], None, None, skipped, stats))
                train_op = tf.group(done, name=name or "train")
        return Window(train_op, None, None, None, None, None, skipped, [], [], [v for _, v in pairs], stats)

    def _create_direct_state(self, pairs, count):
        with tf.compat.v1.init_scope():
            first = min((var for _, var in pairs), key=lambda v: v.name)
            skipped = state_variable("skipped_windows", [], tf.int64, first) if count else None
            stats = _statistics.create(pairs, _sum_dtype(pairs, None)) if self._use_statistics else None
        return skipped, stats

    def _build_window(self, pairs, weight, global_step, name, update_ops, small_batches, weighted_grads):
        """k > 1: accumulate on every run, finish the window on the k-th."""
        plain_ops, window_stats = split_update_ops(update_ops)
        outer_scope = tf.compat.v1.get_default_graph().get_name_scope()
        with tf.compat.v1.name_scope(self._name) as scope:
            state = self._create_window_state(pairs)
            with tf.control_dependencies(plain_ops):
                accumulate = _accumulate(state, pairs, weight, window_stats, small_batches, weighted_grads)
                with tf.control_dependencies([accumulate]):
                    due = tf.greater_equal(state.micro_step.read_value(), self._k, name="window_full")
                fused = tf.cond(due, lambda: self._finish_window(state, window_stats, global_step, outer_scope),
                                tf.no_op, name="apply_if_due")
                train_op = tf.group(fused, name=name or "train")
            # The manual ops must not wait for the caller's control dependencies
            # (typically UPDATE_OPS, which need a feed): rebuild the scope cleanly.
            with tf.control_dependencies(None), tf.compat.v1.name_scope(scope):
                apply_op = tf.group(self._finish_window(state, window_stats, global_step, outer_scope,
                                                        may_be_empty=True), name="apply")
                discard = [] if state.stats is None else [state.stats.discard()]
                zero_op = tf.group(_reset(state, window_stats) + discard, name="zero")
        slots = state.slots
        return Window(train_op, accumulate, apply_op, zero_op, state.micro_step, state.weight_sum, state.skipped,
                      [s.accum for s in slots], [s.touched for s in slots], [s.var for s in slots], state.stats)

    def _create_window_state(self, pairs):
        # init_scope: outside surrounding control dependencies and control flow,
        # so initializers never wait for update ops or feeds.
        with tf.compat.v1.init_scope():
            slots = [self._create_slot(var, grad) for grad, var in pairs]
            first = min((var for _, var in pairs), key=lambda v: v.name)
            sum_dtype = _sum_dtype(pairs, self._accumulation_dtype)
            micro_step = state_variable("micro_step", [], tf.int64, first)
            weight_sum = state_variable("weight_sum", [], sum_dtype, first)
            skipped = state_variable("skipped_windows", [], tf.int64, first)
            stats = _statistics.create(pairs, sum_dtype) if self._use_statistics else None
        return _State(slots, micro_step, weight_sum, skipped, stats)

    def _create_slot(self, var, grad):
        shape = var.get_shape()
        if not shape.is_fully_defined():
            raise ValueError("variable %r needs a fully defined shape to be accumulated, got %s"
                             % (var.op.name, shape))
        dtype = _accumulator_dtype(var.dtype.base_dtype, self._accumulation_dtype)
        # Named from the root, as slots are: "<var>/<name>".
        with tf.compat.v1.get_default_graph().name_scope(""):
            accum = state_variable(var.op.name + "/" + self._name, shape, dtype, var)
            touched = None
            if isinstance(grad, tf.IndexedSlices):
                touched = state_variable(var.op.name + "/" + self._name + "_touched", shape[:1], dtype, var)
        return _Slot(var, accum, touched)

    def _finish_window(self, state, window_stats, global_step, outer_scope, may_be_empty=False):
        """Applies the window (or skips it: zero weight, or not finite), then resets."""
        sums, rows = _window_sums(state, may_be_empty)
        total = state.weight_sum.read_value()

        def done():
            return [s.finalize() for s in window_stats] + _reset(state, [], rows)

        return self._finish(sums, total, True, global_step, outer_scope, done,
                            lambda: _reset(state, window_stats), state)

    def _finish(self, sums, total, divide, global_step, outer_scope, done, skip, state):
        """Applies ``sums / total`` (``sums`` when not ``divide``), or skips; returns an op.

        ``done()`` gives the ops that run after the wrapped apply; ``skip()``
        those of a skipped window. With a reducer, ``sums`` and ``total`` are
        reduced first and every worker decides on the same values.
        """
        reducer = self._reducer
        if reducer is not None:
            sums, total = reducer.reduce_window(sums, total)
        usable = self._usable(sums, total)

        def apply():
            return self._apply(sums, total, divide, global_step, outer_scope, done, skip, state)

        if usable is None:
            return apply()
        return tf.cond(usable, apply, lambda: _skip(skip(), state), name="apply_or_skip")

    def _usable(self, sums, total):
        checks = []
        if total is not None:
            checks.append(tf.greater(total, 0, name="has_weight"))
        # A loss-scale optimizer must see a non-finite window itself, or its
        # scale would never come down: _apply follows its decision instead.
        if self._skip_nonfinite and not self._loss_scaled:
            checks.append(_all_finite(sums))
        if not checks:
            return None
        return checks[0] if len(checks) == 1 else tf.logical_and(checks[0], checks[1], name="usable")

    def _apply(self, sums, total, divide, global_step, outer_scope, done, skip, state):
        averaged = _divided(sums, total if divide else None)
        stats = state.stats
        # The wrapped loss-scale optimizer skips a non-finite window on its own;
        # the same test, on the same tensors, keeps the statistics out of it too.
        finite = _all_finite(averaged) if self._loss_scaled else None
        observed = []
        if stats is not None:
            def observe():
                return stats.observe_big([g for g, _ in averaged], total)
            observed = [observe() if finite is None
                        else tf.cond(finite, observe, tf.no_op, name="observe_if_finite")]
        if self._clip_norm is not None:
            grads, variables = zip(*averaged)
            grads, _ = tf.clip_by_global_norm(list(grads), self._clip_norm, name="clip")
            averaged = list(zip(grads, variables))
        reducer = self._reducer
        # The wrapped optimizer's non-slot variables (Adam's beta powers) are
        # named from the current scope: use the caller's, as plain training would.
        graph = tf.compat.v1.get_default_graph()
        with tf.control_dependencies(observed), graph.name_scope(outer_scope + "/" if outer_scope else ""):
            if reducer is not None:
                applied = reducer.apply_reduced(averaged, global_step=global_step)
            else:
                applied = self._optimizer.apply_gradients(averaged, global_step=global_step)
        with tf.control_dependencies([applied]):
            if finite is None:
                return tf.group(*done(), name="reset")
            return tf.cond(finite, lambda: tf.group(*done(), name="reset"), lambda: _skip(skip(), state),
                           name="reset_or_skip")


# ---------------------------------------------------------------- helpers

_K1 = "with num_micro_batches=1 it keeps no window (no cache, no counter); run its train op"
_MISSING = {
    "skipped_windows": "nothing can skip a window here (k = 1 without `weight`, `skip_nonfinite`, "
                       "a reducer or statistics)",
    "statistics": "create it with GradientAccumulator(..., statistics=True)",
}


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


def _accumulator_dtype(var_dtype, minimum):
    """The wider of the variable's float dtype (at least float32) and ``minimum``."""
    if var_dtype not in _FLOAT_WIDTH:  # complex: keep as is
        return var_dtype
    choices = [tf.float32, var_dtype] + ([minimum] if minimum is not None else [])
    return max(choices, key=lambda dtype: _FLOAT_WIDTH.get(dtype, 0))


def _sum_dtype(pairs, minimum):
    """float64 when any cache is float64, else float32: the dtype of the weight sum."""
    wide = any(_accumulator_dtype(v.dtype.base_dtype, minimum) == tf.float64 for _, v in pairs)
    return tf.float64 if wide else tf.float32


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


def _accumulate(state, pairs, weight, window_stats, small_batches, weighted_grads):
    """Adds one micro-batch: gradients times weight (unless ``weighted_grads``), the weight, the count."""
    with tf.compat.v1.name_scope("accumulate"):
        grad_weight = None if weighted_grads else weight
        dense = [(grad, slot) for (grad, _), slot in zip(pairs, state.slots) if slot.touched is None]
        adds = [_write_or_add(dense, grad_weight, state.micro_step)] if dense else []
        for (grad, _), slot in zip(pairs, state.slots):
            if slot.touched is not None:
                adds.extend(_add_sparse(slot, grad, grad_weight))
        added = 1.0 if weight is None else tf.cast(weight, state.weight_sum.dtype.base_dtype)
        # A constant weight depends on no input: without this, a run that fails
        # at its input (OutOfRangeError at the end of a tf.data loop) would
        # still count one micro-batch.
        with tf.control_dependencies(list(adds)):
            adds.append(state.weight_sum.assign_add(added))
        adds.extend(stats.accumulate() for stats in window_stats)
        if state.stats is not None:
            adds.append(state.stats.observe_small([g for g, _ in pairs], weight, small_batches=small_batches))
        with tf.control_dependencies(adds):
            # The counter moves last, so reading it orders after every addition.
            return tf.group(state.micro_step.assign_add(1), name="accumulate")


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


def _write_or_add(dense, weight, micro_step):
    """One pass per dense cache: ``cache = w * g`` when a window starts, ``cache += w * g`` after.

    Writing the first micro-batch is what lets the reset leave the dense caches
    alone: no pass ever zeroes them, and a cache holds a sum only while
    ``micro_step`` > 0.
    """
    first = tf.equal(micro_step.read_value(), 0, name="window_start")

    def write():
        return tf.group(*[slot.accum.assign(weighted(tf.cast(grad, slot.accum.dtype.base_dtype), weight),
                                            read_value=False) for grad, slot in dense], name="write")

    def add():
        return tf.group(*[_add_dense(slot, grad, weight) for grad, slot in dense], name="add")

    return tf.cond(first, write, add, name="write_or_add")


def _add_dense(slot, grad, weight):
    """``cache += weight * grad`` in one kernel: the weight is its scalar, no product is materialised."""
    dtype = slot.accum.dtype.base_dtype
    grad = tf.cast(grad, dtype)
    if weight is None:
        return slot.accum.assign_add(grad, read_value=False)
    # ResourceApplyGradientDescent computes var -= alpha * delta in one pass;
    # with alpha = -weight that is the weighted add.
    alpha = tf.negative(tf.cast(weight, dtype))
    return tf.raw_ops.ResourceApplyGradientDescent(var=slot.accum.handle, alpha=alpha, delta=grad, use_locking=False)


def _add_sparse(slot, grad, weight):
    """Adds the weighted rows of an ``IndexedSlices`` gradient and flags them as touched."""
    dtype = slot.accum.dtype.base_dtype
    values = weighted(tf.cast(grad.values, dtype), weight)
    ones = tf.ones_like(grad.indices, dtype=dtype)
    return [tf.compat.v1.scatter_add(slot.accum, grad.indices, values),
            tf.compat.v1.scatter_update(slot.touched, grad.indices, ones)]


def _window_sums(state, may_be_empty=False):
    """The caches as ``(sum, variable)`` pairs (sparse ones as ``IndexedSlices``) and their rows.

    With ``may_be_empty`` (the manual ``apply_op``), dense sums read as zeros
    while ``micro_step`` is 0: the caches then still hold the last window's.
    """
    dense = [slot.accum for slot in state.slots if slot.touched is None]

    def read():
        return [cache.read_value() for cache in dense]

    if dense and may_be_empty:
        # strict: a list of one stays a list on TF 1.15.
        values = tf.compat.v1.cond(tf.greater(state.micro_step.read_value(), 0), read,
                                   lambda: [tf.zeros(cache.shape, cache.dtype.base_dtype) for cache in dense],
                                   strict=True, name="sums_or_zeros")
    else:
        values = read()
    values = iter(values)
    sums, rows = [], []
    for slot in state.slots:
        if slot.touched is None:
            sums.append((next(values), slot.var))
            rows.append(None)
            continue
        index = _touched_rows(slot)
        shape = tf.shape(slot.var, out_type=tf.int64)
        sums.append((tf.IndexedSlices(tf.gather(slot.accum, index), index, dense_shape=shape), slot.var))
        rows.append(index)
    return sums, rows


def _divided(sums, total):
    """``sum / total`` in each variable's dtype (``total`` None: just the cast); the one pass at window end."""
    averaged = []
    for grad, var in sums:
        dtype = var.dtype.base_dtype
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        if total is not None:
            values = values / tf.cast(total, values.dtype.base_dtype)
        values = tf.cast(values, dtype)
        if isinstance(grad, tf.IndexedSlices):
            values = tf.IndexedSlices(values, grad.indices, dense_shape=grad.dense_shape)
        averaged.append((values, var))
    return averaged


def _touched_rows(slot):
    return tf.reshape(tf.where(slot.touched.read_value() > 0), [-1])


def _reset(state, window_stats, rows=None):
    """Zeroes the counters, the window statistics and the touched rows of sparse caches.

    Dense caches are left as they are: the next window's first micro-batch
    overwrites them (``_write_or_add``), so they are never zeroed in a pass
    of their own.
    """
    rows = rows or [None] * len(state.slots)
    ops = [state.micro_step.assign(0, read_value=False), state.weight_sum.assign(0, read_value=False)]
    ops.extend(stats.reset() for stats in window_stats)
    for slot, index in zip(state.slots, rows):
        if slot.touched is None:
            continue
        index = _touched_rows(slot) if index is None else index
        with tf.control_dependencies([index]):
            shape = tf.concat([tf.shape(index), tf.shape(slot.accum)[1:]], 0)
            ops.append(tf.compat.v1.scatter_update(
                slot.accum, index, tf.zeros(shape, slot.accum.dtype.base_dtype)))
            ops.append(slot.touched.assign(tf.zeros(slot.touched.shape, slot.touched.dtype.base_dtype),
                                           read_value=False))
    return ops


def _skip(resets, state):
    ops = list(resets) + ([] if state.stats is None else [state.stats.discard()])
    if state.skipped is None:
        return tf.group(*ops, name="skip")
    with tf.control_dependencies(ops):
        return tf.group(state.skipped.assign_add(1), name="skip")


def _skips_nonfinite(optimizer):
    """Whether ``optimizer``, or one it wraps, is TF's loss-scale optimizer.

    Such an optimizer skips an update whose gradients are not all finite
    (and lowers its loss scale); its class names differ between TF 1.15's
    ``tf.train.experimental``, contrib and ``tf.compat.v1.mixed_precision``.
    """
    return any(cls.__name__.endswith("LossScaleOptimizer")
               for wrapped in optimizer_chain(optimizer) for cls in type(wrapped).__mro__)


def _all_finite(grads_and_vars):
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in grads_and_vars]
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]), name="all_finite")


def _reset_collection(graph, key, values):
    """Replaces a graph collection's content with ``values``."""
    ref = graph.get_collection_ref(key)
    del ref[:]
    ref.extend(values)
