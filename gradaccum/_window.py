"""The accumulation window: its state, the accumulate step and the end-of-window apply.

``GradientAccumulator`` checks its arguments and hands each train op to
:func:`build`, which returns a :class:`Window`. A window sums weighted
micro-batch gradients into caches and, on the run that fills it, divides by
the summed weight, applies through the wrapped optimizer (or its collective
reducer), counts ``global_step`` and resets, all in that ``session.run``.

Variables it creates (global, non-trainable resource variables, so that a
``Saver`` checkpoint taken in the middle of a window restores it exactly;
each colocated with the variable it serves; the counters with the first
trained variable by name), for a window scoped ``<scope>``:

* ``<var>/<scope>``: the cache of each variable with a gradient, of the
  variable's shape, in its dtype widened to at least float32 (and to
  ``accumulation_dtype`` when that is wider);
* ``<var>/<scope>_touched``: for a sparse (``IndexedSlices``) gradient only,
  one flag per row, so that the applied gradient is sparse again and touches
  exactly the rows the full batch would;
* ``<scope>/micro_step`` (int64): micro-batches added since the last apply or
  reset; ``<scope>/weight_sum``: the weight added since then;
* ``<scope>/window_size`` (int64): only when the number of micro-batches is a
  tensor, a schedule or a policy: the size of the window in progress, read
  when its first micro-batch arrives;
* ``<scope>/skipped_windows`` (int64): windows not applied because their
  total weight was zero, or their sum was not finite;
* with statistics: ``<scope>/statistics/...`` (``gradaccum.statistics``).

With a static k = 1 there is no cache, ``micro_step`` or ``weight_sum``; only
``skipped_windows`` when a window can be skipped or statistics are kept.
This module adds nothing to any collection; the caller keeps the wrapped
optimizer's internal apply ops out of ``TRAIN_OP``.
"""
import collections

from gradaccum import statistics as _statistics
from gradaccum._compat import tf, v1_control_flow
from gradaccum._update_ops import split_update_ops
from gradaccum._wrapper import state_variable, weighted

# Half-precision sums lose digits after a few additions: never accumulate
# in fewer bits than float32.
_FLOAT_WIDTH = {tf.float16: 16, tf.bfloat16: 16, tf.float32: 32, tf.float64: 64}
_BASE_APPLY = tf.compat.v1.train.Optimizer.apply_gradients

Config = collections.namedtuple("Config", [
    "optimizer", "name", "num_micro_batches", "size_fn", "policy", "clip_norm", "accumulation_dtype",
    "skip_nonfinite", "statistics", "reducer", "loss_scaled", "ref_step_flow"])
"""What a ``GradientAccumulator`` decided once: ``num_micro_batches`` is the
static k or ``None``; then ``size_fn(global_step)`` gives the next window's k."""

# One variable's accumulation state; ``touched`` is None for dense gradients.
_Slot = collections.namedtuple("_Slot", ["var", "accum", "touched"])
# The state of one window while it is being built.
_State = collections.namedtuple("_State", ["slots", "micro_step", "weight_sum", "skipped", "stats", "size"])


class Window(object):
    """What one ``minimize``/``apply_gradients`` call of a GradientAccumulator built.

    Each train op has its own window: its own caches and counters.

    Attributes:
      train_op: the op returned, run once per micro-batch.
      accumulate_op: adds the fed micro-batch, never applies (manual pattern);
        ``None`` with a static k = 1.
      apply_op: applies ``cache / weight_sum`` whatever the count, counts
        ``global_step`` and resets (skips a zero-weight window); needs no
        feed; ``None`` with a static k = 1. Built on first access: that
        build is the second call of the wrapped optimizer's
        ``apply_gradients`` for this window (see :attr:`apply_op`).
      zero_op: resets the window without applying; ``None`` with k = 1.
      micro_step: int64 variable, micro-batches since the last apply or reset
        (``None`` with a static k = 1).
      weight_sum: variable, the weight since then (``None`` with k = 1).
      window_size: int64 variable holding the size of the window in progress
        when k is a tensor, schedule or policy; ``None`` for a static k.
      size: int64 scalar tensor, the micro-batches the loop must feed: those
        of the window in progress, or of the next one when none is.
      ended: bool scalar tensor, True when no window is in progress: after a
        train-op run, that run applied (or skipped) its window.
      skipped_windows: int64 variable counting skipped windows, or ``None``
        (k = 1 with nothing that can skip).
      accumulators: the cache variables, one per variable with a gradient;
        a dense one holds the window's sum only while ``micro_step`` > 0.
      touched: per cache, the row flags of a sparse one, else ``None``.
      variables: the trained variables, in the order of ``accumulators``.
      statistics: the ``gradaccum.statistics.GradientStatistics``, or ``None``.

    Example:
      >>> window = opt.windows[-1]
      >>> for _ in range(sess.run(window.size)):
      ...     sess.run(window.train_op, next_feed())
    """

    def __init__(self, train_op, variables, state=None, accumulate_op=None, zero_op=None, build_apply=None,
                 size=None):
        self.train_op = train_op
        self.variables = list(variables)
        self.accumulate_op = accumulate_op
        self.zero_op = zero_op
        self.skipped_windows = None if state is None else state.skipped
        self.statistics = None if state is None else state.stats
        slots = [] if state is None else state.slots
        self.accumulators = [s.accum for s in slots]
        self.touched = [s.touched for s in slots]
        self.micro_step = None if state is None else state.micro_step
        self.weight_sum = None if state is None else state.weight_sum
        self.window_size = None if state is None else state.size
        self._build_apply = build_apply
        self._apply_op = None
        self.size, self.ended = size

    @property
    def apply_op(self):
        """The manual apply (``None`` with a static k = 1), built the first time it is read.

        The wrapped optimizer's ``apply_gradients`` is called once per train
        op; only this manual op needs a second call, because it must run
        without the train op's feed. It is made under
        ``variable_scope(reuse=AUTO_REUSE)`` in the train op's scopes, so an
        optimizer that creates its state with ``tf.get_variable`` shares it.
        Read it before the graph is finalized (before a
        ``MonitoredTrainingSession`` starts).
        """
        if self._apply_op is None and self._build_apply is not None:
            if self.train_op.graph.finalized:
                raise RuntimeError(
                    "the accumulator's `apply_op` is built the first time it is read, and this graph is "
                    "finalized: read `apply_op` once before the session starts (MonitoredTrainingSession "
                    "finalizes the graph)")
            self._apply_op = self._build_apply()
            self._build_apply = None
        return self._apply_op

    def state_variables(self):
        """The window's own variables: caches, row flags, counters, statistics."""
        found = list(self.accumulators) + [flags for flags in self.touched if flags is not None]
        found.extend(v for v in (self.micro_step, self.weight_sum, self.window_size, self.skipped_windows)
                     if v is not None)
        if self.statistics is not None:
            found.extend(self.statistics.variables)
        return found


def build(config, grads_and_vars, pairs, weight, global_step, name, update_ops, small_batches, weighted_grads):
    """Builds one train op's window.

    Args:
      config: the accumulator's :data:`Config`.
      grads_and_vars: every ``(gradient, variable)`` pair, ``None`` gradients
        included (passed on as given where the wrapped optimizer applies them).
      pairs: the pairs with a gradient.
      weight: ``None`` or a scalar tensor.
      global_step: ``None`` or the variable counting applied windows.
      name: the train op's name, or ``None``.
      update_ops: ops to run on every micro-batch (window statistics split out).
      small_batches: ``None`` or the towers' shards, for statistics.
      weighted_grads: the gradients already carry ``weight``.

    Returns:
      A :class:`Window`.

    Example:
      >>> window = build(config, gv, gv, None, step, None, [], None, False)
    """
    if config.num_micro_batches == 1:
        return _build_direct(config, grads_and_vars, pairs, weight, global_step, name, update_ops, small_batches)
    return _build_window(config, pairs, weight, global_step, name, update_ops, small_batches, weighted_grads)


# ------------------------------------------------------------ k = 1, static


def _build_direct(config, grads_and_vars, pairs, weight, global_step, name, update_ops, small_batches):
    """k = 1: the wrapped optimizer's own train op, unless something must be decided or observed."""
    reducer = config.reducer
    decide = weight is not None or config.skip_nonfinite or reducer is not None
    one = (tf.constant(1, tf.int64), tf.constant(True))
    variables = [v for _, v in pairs]
    if not (decide or config.statistics or config.clip_norm is not None):
        with tf.control_dependencies(update_ops):
            train_op = counted_apply(
                config.optimizer, lambda gv: config.optimizer.apply_gradients(gv, global_step, name),
                grads_and_vars, global_step)
        return Window(train_op, variables, size=one)
    outer_scope = tf.compat.v1.get_default_graph().get_name_scope()
    with tf.compat.v1.name_scope(config.name):
        with tf.compat.v1.init_scope():
            first = _first(pairs)
            skipped = state_variable("skipped_windows", [], tf.int64, first)
            stats = _statistics.create(pairs, _sum_dtype(pairs, None)) if config.statistics else None
        state = _State([], None, None, skipped, stats, None)
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
                done = _finish(config, sums, total, reducer is not None, global_step, outer_scope,
                               list, list, state)
            train_op = tf.group(done, name=name or "train")
    return Window(train_op, variables, state, size=one)


# ------------------------------------------------------------ k > 1 or dynamic


def _build_window(config, pairs, weight, global_step, name, update_ops, small_batches, weighted_grads):
    """Accumulates on every run; finishes the window on the run that fills it."""
    plain_ops, window_stats = split_update_ops(update_ops)
    graph = tf.compat.v1.get_default_graph()
    outer_scope = graph.get_name_scope()
    var_scope = tf.compat.v1.get_variable_scope()
    with tf.compat.v1.name_scope(config.name) as scope:
        state = _create_state(config, pairs)
        size_now = _size_now(config, state, global_step)
        with tf.control_dependencies(plain_ops):
            accumulate = _accumulate(state, pairs, weight, window_stats, small_batches, weighted_grads, size_now)
            with tf.control_dependencies([accumulate]):
                limit = config.num_micro_batches if state.size is None else state.size.read_value()
                due = tf.greater_equal(state.micro_step.read_value(), limit, name="window_full")
            fused = tf.cond(due, lambda: _finish_window(config, state, window_stats, global_step, outer_scope),
                            tf.no_op, name="apply_if_due")
            train_op = tf.group(fused, name=name or "train")
        # The manual ops must not wait for the caller's control dependencies
        # (typically UPDATE_OPS, which need a feed): rebuild the scope cleanly.
        with tf.control_dependencies(None), tf.compat.v1.name_scope(scope):
            discard = [] if state.stats is None else [state.stats.discard()]
            zero_op = tf.group(_reset(state, window_stats) + discard, name="zero")
            size = _size(config, state, size_now)

    def build_apply():
        with graph.as_default(), v1_control_flow(config.ref_step_flow), tf.control_dependencies(None), \
                tf.compat.v1.variable_scope(var_scope, reuse=tf.compat.v1.AUTO_REUSE, auxiliary_name_scope=False), \
                tf.compat.v1.name_scope(scope), keep_train_ops(graph):
            return tf.group(_finish_window(config, state, window_stats, global_step, outer_scope, may_be_empty=True),
                            name="apply")

    return Window(train_op, [s.var for s in state.slots], state, accumulate, zero_op, build_apply, size)


def _create_state(config, pairs):
    # init_scope: outside surrounding control dependencies and control flow,
    # so initializers never wait for update ops or feeds.
    with tf.compat.v1.init_scope():
        slots = [_create_slot(config, var, grad) for grad, var in pairs]
        first = _first(pairs)
        sum_dtype = _sum_dtype(pairs, config.accumulation_dtype)
        micro_step = state_variable("micro_step", [], tf.int64, first)
        weight_sum = state_variable("weight_sum", [], sum_dtype, first)
        size = None if config.size_fn is None else state_variable("window_size", [], tf.int64, first)
        skipped = state_variable("skipped_windows", [], tf.int64, first)
        stats = _statistics.create(pairs, sum_dtype) if config.statistics else None
    return _State(slots, micro_step, weight_sum, skipped, stats, size)


def _create_slot(config, var, grad):
    shape = var.get_shape()
    if not shape.is_fully_defined():
        raise ValueError("variable %r needs a fully defined shape to be accumulated, got %s"
                         % (var.op.name, shape))
    dtype = _accumulator_dtype(var.dtype.base_dtype, config.accumulation_dtype)
    # Named from the root, as slots are: "<var>/<name>".
    with tf.compat.v1.get_default_graph().name_scope(""):
        accum = state_variable(var.op.name + "/" + config.name, shape, dtype, var)
        touched = None
        if isinstance(grad, tf.IndexedSlices):
            touched = state_variable(var.op.name + "/" + config.name + "_touched", shape[:1], dtype, var)
    return _Slot(var, accum, touched)


def _first(pairs):
    return min((var for _, var in pairs), key=lambda v: v.name)


def _size_now(config, state, global_step):
    """The k a window starting now would get (int64 tensor), checked >= 1; ``None`` for a static k."""
    if state.size is None:
        return None
    with tf.compat.v1.name_scope("window_size"):
        k = tf.cast(config.size_fn(global_step), tf.int64)
        check = tf.compat.v1.assert_greater_equal(
            k, tf.constant(1, tf.int64), message="`num_micro_batches` must be >= 1 for every window, got")
        with tf.control_dependencies([check]):
            # A copy: k may alias a reference variable the caller changes in place.
            return tf.raw_ops.Snapshot(input=k, name="next")


def _size(config, state, size_now):
    """``(size, ended)``: micro-batches of the window in progress (else of the next), and no window open."""
    ended = tf.equal(state.micro_step.read_value(), 0, name="window_ended")
    if size_now is None:
        return tf.constant(config.num_micro_batches, tf.int64, name="window_size"), ended
    return tf.compat.v1.where(ended, size_now, state.size.read_value(), name="window_size"), ended


def _accumulate(state, pairs, weight, window_stats, small_batches, weighted_grads, size_now):
    """Adds one micro-batch: gradients times weight (unless ``weighted_grads``), the weight, the count."""
    with tf.compat.v1.name_scope("accumulate"):
        grad_weight = None if weighted_grads else weight
        dense = [(grad, slot) for (grad, _), slot in zip(pairs, state.slots) if slot.touched is None]
        adds = [_write_or_add(dense, grad_weight, state.micro_step)] if dense else []
        if size_now is not None:
            adds.append(_start_window(state, size_now))
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


def _start_window(state, size_now):
    """Fixes the window's k when its first micro-batch arrives; a change waits for the next window."""
    first = tf.equal(state.micro_step.read_value(), 0, name="window_start")
    return tf.cond(first, lambda: tf.group(state.size.assign(size_now, read_value=False)), tf.no_op,
                   name="fix_window_size")


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


# ------------------------------------------------------------ end of a window


def _finish_window(config, state, window_stats, global_step, outer_scope, may_be_empty=False):
    """Applies the window (or skips it: zero weight, or not finite), then resets."""
    sums, rows = _window_sums(state, may_be_empty)
    total = state.weight_sum.read_value()

    def done():
        after = [s.finalize() for s in window_stats] + _reset(state, [], rows)
        if config.policy is not None:
            after.append(config.policy.update(state.stats))
        return after

    return _finish(config, sums, total, True, global_step, outer_scope, done,
                   lambda: _reset(state, window_stats), state)


def _finish(config, sums, total, divide, global_step, outer_scope, done, skip, state):
    """Applies ``sums / total`` (``sums`` when not ``divide``), or skips; returns an op.

    ``done()`` gives the ops that run after the wrapped apply; ``skip()``
    those of a skipped window. With a reducer, ``sums`` and ``total`` are
    reduced first and every worker decides on the same values.
    """
    small = None
    if config.reducer is not None:
        sums, total, small = _reduced(config.reducer, sums, total, state.stats)
    usable = _usable(config, sums, total)

    def apply():
        return _apply(config, sums, total, divide, global_step, outer_scope, done, skip, state, small)

    if usable is None:
        return apply()
    return tf.cond(usable, apply, lambda: _skip(skip(), state), name="apply_or_skip")


def _reduced(reducer, sums, total, stats):
    """Reduces the window across workers, with the statistics' small-batch sums in the same exchange.

    Every worker then estimates the noise scale from every small batch, so
    policies driven by it (``AdaptiveBatch``) decide alike everywhere.
    """
    extra = [] if stats is None else stats.small_sums()
    anchor = sums[0][1]
    reduced, total = reducer.reduce_window(list(sums) + [(value, anchor) for value in extra], total)
    cut = len(reduced) - len(extra)
    return reduced[:cut], total, [value for value, _ in reduced[cut:]] if extra else None


def _usable(config, sums, total):
    checks = []
    if total is not None:
        checks.append(tf.greater(total, 0, name="has_weight"))
    # A loss-scale optimizer must see a non-finite window itself, or its
    # scale would never come down: _apply follows its decision instead.
    if config.skip_nonfinite and not config.loss_scaled:
        checks.append(_all_finite(sums))
    if not checks:
        return None
    return checks[0] if len(checks) == 1 else tf.logical_and(checks[0], checks[1], name="usable")


def _apply(config, sums, total, divide, global_step, outer_scope, done, skip, state, small=None):
    averaged = _divided(sums, total if divide else None)
    stats = state.stats
    # The wrapped loss-scale optimizer skips a non-finite window on its own;
    # the same test, on the same tensors, keeps the statistics out of it too.
    finite = _all_finite(averaged) if config.loss_scaled else None
    observed = []
    if stats is not None:
        def observe():
            return stats.observe_big([g for g, _ in averaged], total, small_sums=small)
        observed = [observe() if finite is None
                    else tf.cond(finite, observe, tf.no_op, name="observe_if_finite")]
    if config.clip_norm is not None:
        grads, variables = zip(*averaged)
        grads, _ = tf.clip_by_global_norm(list(grads), config.clip_norm, name="clip")
        averaged = list(zip(grads, variables))
    applier = config.reducer if config.reducer is not None else config.optimizer
    apply = applier.apply_reduced if config.reducer is not None else applier.apply_gradients
    # The wrapped optimizer's non-slot variables (Adam's beta powers) are
    # named from the current scope: use the caller's, as plain training would.
    graph = tf.compat.v1.get_default_graph()
    with tf.control_dependencies(observed), graph.name_scope(outer_scope + "/" if outer_scope else ""):
        applied = counted_apply(applier, lambda gv: apply(gv, global_step=global_step), averaged, global_step,
                                finite)
    with tf.control_dependencies([applied]):
        if finite is None:
            return tf.group(*done(), name="reset")
        return tf.cond(finite, lambda: tf.group(*done(), name="reset"), lambda: _skip(skip(), state),
                       name="reset_or_skip")


def counted_apply(applier, apply, grads_and_vars, global_step, finite=None):
    """``apply(grads_and_vars)``, after which ``global_step`` has moved by exactly one.

    TF's ``Optimizer.apply_gradients`` increments ``global_step`` itself. An
    optimizer that overrides it may not (BERT's AdamWeightDecayOptimizer
    ignores it): then the step is read before the apply and incremented
    after it unless the apply moved it. With ``finite`` (a wrapped
    loss-scale optimizer's decision), a window it skipped is not counted.

    Args:
      applier: the object whose ``apply_gradients`` (or ``apply_reduced``) runs.
      apply: ``apply(grads_and_vars)`` builds the update and returns an op.
      grads_and_vars: the pairs to apply (``None`` gradients allowed).
      global_step: ``None`` or the step variable.
      finite: ``None`` or a bool tensor, False when the applier skips.

    Returns:
      The op.

    Example:
      >>> op = counted_apply(opt, lambda gv: opt.apply_gradients(gv, step), gv, step)
    """
    if global_step is None or getattr(type(applier), "apply_gradients", None) is _BASE_APPLY:
        return apply(grads_and_vars)
    # A copy, not an Identity: a reference variable's Identity aliases its
    # buffer and would show the increment it was meant to precede.
    before = tf.raw_ops.Snapshot(input=global_step, name="step_before")
    # Every update reads a gradient: ordering the gradients after the read
    # orders the whole apply after it, without touching the optimizer's code.
    with tf.control_dependencies([before]):
        ordered = [(_identity(grad), var) for grad, var in grads_and_vars]
    applied = apply(ordered)
    with tf.control_dependencies([applied]):
        unmoved = tf.equal(tf.identity(global_step), before)
        if finite is not None:
            unmoved = tf.logical_and(unmoved, finite)
        count = tf.cond(unmoved, lambda: _increment(global_step), tf.no_op, name="count_step")
    return tf.group(applied, count)


def _identity(grad):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


def _increment(global_step):
    with tf.compat.v1.colocate_with(global_step):
        return tf.group(tf.compat.v1.assign_add(global_step, tf.ones([], global_step.dtype.base_dtype)))


class keep_train_ops(object):
    """Restores ``TRAIN_OP`` on exit: the wrapped optimizer's inner apply ops stay out of it.

    Running one of them alone would apply a stale window.

    Args:
      graph: the graph whose collection is kept.

    Example:
      >>> with keep_train_ops(graph):
      ...     op = wrapped.apply_gradients(pairs)
    """

    def __init__(self, graph):
        self._graph = graph
        self._before = None

    def __enter__(self):
        self._before = list(self._graph.get_collection(tf.compat.v1.GraphKeys.TRAIN_OP))

    def __exit__(self, *exc):
        ref = self._graph.get_collection_ref(tf.compat.v1.GraphKeys.TRAIN_OP)
        del ref[:]
        ref.extend(self._before)
        return False


# ---------------------------------------------------------------- helpers


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


def _all_finite(grads_and_vars):
    values = [g.values if isinstance(g, tf.IndexedSlices) else g for g, _ in grads_and_vars]
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]), name="all_finite")
