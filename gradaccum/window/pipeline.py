"""The accumulation window, one pipeline read top to bottom.

Every run of a train op adds one micro-batch (weighted, dense or sparse) to
the window's caches. The run that fills the window then, in that same
``session.run``:

    sum -> reduce across workers -> divide by the total weight -> decide skip
    -> clip -> apply through the wrapped optimizer -> count ``global_step``
    -> notify observers -> reset.

Features plug in through two protocols and nothing else: a reducer
(``gradaccum.reducers.Reducer``: the collective engine, the Horovod adapter)
and observers (``gradaccum.observers.WindowObserver``: statistics, the
adaptive policy, window batch norm, user-written ones). A reducer may also
sum each micro-batch over the workers as it is added
(``Reducer.reduce_micro_batch``, ZeRO stage 2): the window then caches the
pairs it returns only, reduces only scalars at the end, and decides skip and
clip from the whole gradient's squared norm and non-finite count summed
over the workers. Its observers see each micro-batch's local gradients,
as without it, and the whole window's squared norm in
``WindowUpdate.sq_norm`` (window batch norm and loss scaling are refused
there, in one ``ValueError``). The window size comes
from one :class:`WindowSize`, read when a window's first micro-batch arrives.
This module imports none of the feature modules.

Variables it creates (global, non-trainable resource variables, so that a
``Saver`` checkpoint taken in the middle of a window restores it exactly;
each colocated with the variable it serves; the counters with the first
trained variable by name), for a window scoped ``<scope>``:

* ``<var>/<scope>``: the cache of each variable with a gradient (with a
  reducer that sums each micro-batch, of the variables it returns only), of the
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
* ``<scope>/sparse_sq_norm``: only with ``clip_norm`` and a sparse gradient:
  ``sum_i w_i^2 |values_i|^2`` of the window's sparse rows, so that the clip
  measures the norm ``tf.clip_by_global_norm`` measures on the full batch
  (always of this worker's own gradients, also when a reducer caches sums
  over the workers: it is summed over them at the window's end);
* ``<scope>/skipped_windows`` (int64): windows not applied because their
  total weight was zero, or their sum was not finite;
* whatever the observers made by the accumulator create
  (``<scope>/statistics/...`` for ``gradaccum.statistics``).

With a static k = 1 there is no cache, ``micro_step`` or ``weight_sum``; only
``skipped_windows`` when a window can be skipped or something observes it.
Built in a ``tf.distribute`` replica context, each replica has its own set,
and the window's end is handed to the strategy once per run
(``gradaccum.window.replicas``, which says how they are named).
This module adds nothing to any collection; the caller keeps the wrapped
optimizer's internal apply ops out of ``TRAIN_OP``.
"""
import collections
import contextlib
import functools

from gradaccum._compat import is_resource_variable, tf, v1_control_flow
from gradaccum.window.gradients import all_finite, normalized, sparse_again, touched_rows, values_of, weighted
from gradaccum.window.observers import MicroBatch, WindowUpdate
from gradaccum.window.replicas import Finish
from gradaccum.window.state import state_variable

# Half-precision sums lose digits after a few additions: never accumulate
# in fewer bits than float32.
_FLOAT_WIDTH = {tf.float16: 16, tf.bfloat16: 16, tf.float32: 32, tf.float64: 64}
_BASE_APPLY = tf.compat.v1.train.Optimizer.apply_gradients
_NOTHING = contextlib.nullcontext()

Config = collections.namedtuple("Config", [
    "applier", "name", "size", "clip_norm", "accumulation_dtype", "skip_nonfinite", "observers", "reducer",
    "loss_scaled", "ref_step_flow", "replicas"], defaults=[None])
"""What a ``GradientAccumulator`` decided once. ``applier`` applies the
averaged update (the reducer or the wrapped optimizer); ``size`` is a
:class:`WindowSize`; ``observers`` are callables ``(pairs, sum_dtype) ->
WindowObserver``, called once per window, in its name scope; ``replicas``
is ``None``, or the :class:`gradaccum.window.replicas.Replicas` of the
``tf.distribute`` replica context the train op is built in."""

Step = collections.namedtuple("Step", [
    "global_step", "name", "weight", "update_ops", "small_batches", "weighted_grads", "observers"],
    defaults=[()])
"""What one train op adds to the config: its ``global_step``, its op name,
the micro-batch ``weight``, the update ops to run first on every micro-batch,
the towers' shards, whether the gradients already carry ``weight``, and its
own observers (window batch-norm statistics)."""

# One variable's accumulation state; ``touched`` is None for dense gradients.
_Slot = collections.namedtuple("_Slot", ["var", "accum", "touched"])
# The state of one window.
# ``sharded``: the reducer sums each micro-batch over the workers and this
# worker caches its share of the variables only (ZeRO stage 2).
_State = collections.namedtuple("_State", [
    "slots", "micro_step", "weight_sum", "size", "sparse_sq", "skipped", "observers", "made", "sharded"],
    defaults=[False])
# A window's sums at its end: ``rows`` are the sparse caches' touched rows.
# Sharded only, summed over the workers: the whole gradient's squared norm
# as clipping measures it (with ``clip_norm``), the workers' count of
# non-finite shares (with ``skip_nonfinite``), and the summed gradient's
# squared norm that observers read (with observers; ``sq_norm`` itself
# unless a sparse gradient makes the two differ).
_Sums = collections.namedtuple("_Sums", ["pairs", "total", "sparse_sq", "rows", "sq_norm", "nonfinite",
                                         "observed_sq_norm"], defaults=[None, None, None])
# What every end-of-window step needs: the config, the state, the step
# variable, and the caller's name scope (where the wrapped optimizer builds).
_End = collections.namedtuple("_End", ["config", "state", "global_step", "outer_scope"])


class WindowSize(object):
    """Where each window's number of micro-batches comes from.

    A static ``k`` is a Python int. Otherwise ``fn(global_step)`` gives a
    scalar integer tensor; it is read once, when a window's first
    micro-batch arrives, checked >= 1 there, and held in the window's
    ``window_size`` variable (so a checkpoint keeps it) until the window ends.

    Args:
      k: the static int, or ``None``.
      fn: ``None``, or a callable ``global_step -> scalar integer tensor``.
      needs_global_step: whether ``fn`` is a schedule of ``global_step``.
    """

    def __init__(self, k=None, fn=None, needs_global_step=False):
        self.k, self._fn, self.needs_global_step = k, fn, needs_global_step

    def read(self, global_step):
        """The next window's k, an int64 scalar tensor, checked >= 1 when it runs."""
        k = self._fn(global_step)
        k = tf.convert_to_tensor(k)
        if k.dtype.base_dtype == tf.bool or not k.dtype.base_dtype.is_integer or k.shape.ndims not in (None, 0):
            raise ValueError("`num_micro_batches` must give a scalar integer tensor for every window, got %s"
                             % (k,))
        k = tf.cast(k, tf.int64)
        check = tf.compat.v1.assert_greater_equal(
            k, tf.constant(1, tf.int64), message="`num_micro_batches` must be >= 1 for every window, got")
        with tf.control_dependencies([check]):
            # A copy: k may alias a reference variable the caller changes in place.
            return tf.raw_ops.Snapshot(input=k, name="next")


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
      observers: the window's observers: the accumulator's first (statistics,
        a policy, those given), then window batch-norm statistics.
      no_state: ``None``, or why this window keeps no state between runs
        (the one-run form), said when a missing field is read.

    Example:
      >>> window = opt.windows[-1]
      >>> for _ in range(sess.run(window.size)):
      ...     sess.run(window.train_op, next_feed())
    """

    def __init__(self, train_op, variables, state=None, manual=(None, None, None), size=None, no_state=None):
        self.train_op = train_op
        self.no_state = no_state  # Why a missing field is missing, when that is not k = 1.
        self.variables = list(variables)
        self.accumulate_op, self.zero_op, self._build_apply = manual
        state = state or _State([], None, None, None, None, None, [], 0)
        self.accumulators = [s.accum for s in state.slots]
        self.touched = [s.touched for s in state.slots]
        self.micro_step, self.weight_sum, self.window_size = state.micro_step, state.weight_sum, state.size
        self.skipped_windows = state.skipped
        self.observers = list(state.observers)
        self._own = [v for v in (state.sparse_sq,) if v is not None]
        self._own.extend(v for observer in state.observers[:state.made] for v in observer.variables)
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
        """The window's own variables: caches, row flags, counters, and its accumulator's observers'."""
        found = list(self.accumulators) + [flags for flags in self.touched if flags is not None]
        found.extend(v for v in (self.micro_step, self.weight_sum, self.window_size, self.skipped_windows)
                     if v is not None)
        found.extend(self._own)
        return found


def build(config, grads_and_vars, pairs, step):
    """Builds one train op's window.

    Args:
      config: the accumulator's :data:`Config`.
      grads_and_vars: every ``(gradient, variable)`` pair, ``None`` gradients
        included (passed on as given where the wrapped optimizer applies them).
      pairs: the pairs with a gradient.
      step: this train op's :data:`Step`.

    Returns:
      A :class:`Window`.

    Example:
      >>> window = build(config, gv, gv, Step(step, None, None, [], None, False))
    """
    check_reducer(config)
    if config.size.k == 1 and (config.replicas is None or _plain_apply(config, step)):
        return _build_direct(config, grads_and_vars, pairs, step)
    return _build_window(config, pairs, step)


def check_reducer(config):
    """Refuses, in one line, ``skip_nonfinite=True`` with a reducer whose workers skip apart (``skips_alike``).

    Args:
      config: the accumulator's :data:`Config`.

    Raises:
      ValueError: for that combination (``AllReduceOnApply``, Horovod's).

    Example:
      >>> check_reducer(config)
    """
    if config.skip_nonfinite and config.reducer is not None and not config.reducer.skips_alike:
        raise ValueError(
            "`skip_nonfinite=True` cannot be combined with %s: a skipped window is decided per rank, so ranks "
            "can disagree and the others wait in the all-reduce for ever; leave skip_nonfinite off and wrap a "
            "loss-scale optimizer inside %s (it tests the reduced gradients, the same on every rank), or use "
            "CollectiveAllReduce, which skips on every worker together"
            % (type(config.reducer).__name__, type(config.reducer).__name__))


# ------------------------------------------------------------ k = 1, static


def _plain_apply(config, step):
    """k = 1 with nothing to decide or observe: the wrapped optimizer's own train op is the window."""
    decide = step.weight is not None or config.skip_nonfinite or config.reducer is not None
    return not (decide or config.observers or config.clip_norm is not None)


def _build_direct(config, grads_and_vars, pairs, step):
    """k = 1: the wrapped optimizer's own train op, unless something must be decided or observed."""
    one = (tf.constant(1, tf.int64), tf.constant(True))
    variables = [v for _, v in pairs]
    if _plain_apply(config, step):
        with tf.control_dependencies(step.update_ops):
            train_op = counted_apply(
                config.applier, lambda gv: config.applier.apply_gradients(gv, step.global_step, step.name),
                grads_and_vars, step.global_step)
        return Window(train_op, variables, size=one)
    outer_scope = tf.compat.v1.get_default_graph().get_name_scope()
    with tf.compat.v1.name_scope(config.name):
        with tf.compat.v1.init_scope():
            skipped = state_variable("skipped_windows", [], tf.int64, _first(pairs))
            observers = _make_observers(config, pairs)
        state = _State([], None, None, None, None, skipped, observers, len(observers))
        with tf.control_dependencies(step.update_ops):
            with tf.control_dependencies(_notify(observers, "added", MicroBatch(pairs, step.weight,
                                                                                 step.small_batches))):
                sums = _direct_sums(config, pairs, step.weight)
                done = _finish(_End(config, state, step.global_step, outer_scope), sums,
                               divide=config.reducer is not None)
            train_op = tf.group(done, name=step.name or "train")
    return Window(train_op, variables, state, size=one)


def _direct_sums(config, pairs, weight):
    """A k = 1 window's sums: the gradients themselves, weighted only for a reducer."""
    if config.reducer is None:
        return _Sums(pairs, weight, None, None)
    total = tf.constant(1.0) if weight is None else tf.cast(weight, tf.float32)
    summed = [(weighted(g, weight), v) for g, v in pairs]
    sparse_sq = None
    if config.clip_norm is not None and _has_sparse(pairs):
        sparse_sq = _sparse_sq_norm([g for g, _ in pairs], weight, tf.float32)
    return _Sums(summed, total, sparse_sq, None)


def reduce_and_apply(reducer, grads_and_vars, global_step=None, name=None, weight=None):
    """A reducer's update without an accumulator: the k = 1 window, with no state of its own.

    Weigh, reduce (``reducer.reduce``), divide by the summed weight, apply
    through ``reducer.apply_reduced`` with ``global_step`` counted once
    (:func:`counted_apply`); when the summed weight is 0 nothing is applied
    and ``global_step`` does not move. No clip, no observers, no skip
    counter: it creates no variables (a checkpoint sees only the reducer's
    own). Built as a train op is: v1 control flow around ref variables, the
    inner apply ops kept out of ``TRAIN_OP``, the returned op put in it.

    Args:
      reducer: a ``gradaccum.Reducer``.
      grads_and_vars: list of ``(gradient, variable)``; ``None`` gradients are left out.
      global_step: optional variable, incremented once per applied update.
      name: optional name of the returned op (default ``"train"``).
      weight: None (weighs 1) or a scalar tensor.

    Returns:
      The train op.

    Raises:
      ValueError: when no gradient is given.

    Example:
      >>> train_op = reduce_and_apply(engine, grads_and_vars, global_step, weight=tf.shape(x)[0])
    """
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    if not pairs:
        raise ValueError("`grads_and_vars` has no gradient for any variable")
    ref_flow = any(not is_resource_variable(var) for var in [v for _, v in pairs] + [global_step]
                   if var is not None)
    config = Config(reducer, reducer.get_name(), WindowSize(k=1), None, None, False, [], reducer, False, ref_flow)
    state = _State([], None, None, None, None, None, [], 0)
    # A float32 weight, as the collective engine has always sent it.
    weight = None if weight is None else tf.cast(weight, tf.float32)
    graph = tf.compat.v1.get_default_graph()
    with v1_control_flow(ref_flow), keep_train_ops(graph):
        outer_scope = graph.get_name_scope()
        with tf.compat.v1.name_scope(config.name):
            done = _finish(_End(config, state, global_step, outer_scope), _direct_sums(config, pairs, weight),
                           divide=True)
        train_op = tf.group(done, name=name or "train")
    graph.add_to_collection(tf.compat.v1.GraphKeys.TRAIN_OP, train_op)
    return train_op


# ------------------------------------------------------------ k > 1 or dynamic


def _build_window(config, pairs, step):
    """Accumulates on every run; finishes the window on the run that fills it."""
    graph = tf.compat.v1.get_default_graph()
    outer_scope = graph.get_name_scope()
    var_scope = tf.compat.v1.get_variable_scope()
    with tf.compat.v1.name_scope(config.name) as scope:
        # This worker's own gradients and the weight they still need: what
        # the sparse clip norm measures, also when a reducer caches its sums.
        local = (pairs, None if step.weighted_grads else step.weight)
        cached, step, sharded = _reduce_micro_batch(config, pairs, step)
        state = _create_state(config, cached, step, pairs, sharded)
        end = _End(config, state, step.global_step, outer_scope)
        with tf.control_dependencies(step.update_ops):
            accumulate = _accumulate(config, state, cached, step, local)
            with tf.control_dependencies([accumulate]):
                limit = config.size.k if state.size is None else state.size.read_value()
                due = tf.greater_equal(state.micro_step.read_value(), limit, name="window_full")
            if config.replicas is None:
                fused = tf.cond(due, lambda: _end_window(end), tf.no_op, name="apply_if_due")
            else:
                with tf.control_dependencies([accumulate]):
                    fused = _hand_over(end, due, _window_sums(state))
            train_op = tf.group(fused, name=step.name or "train")
        # The manual ops must not wait for the caller's control dependencies
        # (typically UPDATE_OPS, which need a feed): rebuild the scope cleanly.
        with tf.control_dependencies(None), tf.compat.v1.name_scope(scope):
            zero_op = tf.group(_reset(state) + _notify(state.observers, "reset"), name="zero")
            size = _size(config, state, step.global_step)

    def build_apply():
        if config.replicas is not None:
            raise ValueError("GradientAccumulator %r has no manual apply_op under a tf.distribute strategy: "
                             "the strategy reduces inside the train op, on the run that ends a window; run "
                             "the train op once per micro-batch" % config.name)
        with graph.as_default(), v1_control_flow(config.ref_step_flow), tf.control_dependencies(None), \
                tf.compat.v1.variable_scope(var_scope, reuse=tf.compat.v1.AUTO_REUSE, auxiliary_name_scope=False), \
                tf.compat.v1.name_scope(scope), keep_train_ops(graph):
            return tf.group(_end_window(end, may_be_empty=True), name="apply")

    return Window(train_op, [s.var for s in state.slots], state, (accumulate, zero_op, build_apply), size)


def _create_state(config, pairs, step, every_pair, sharded):
    """The window's variables: caches for ``pairs``; the weight's dtype from ``every_pair`` (alike on all workers)."""
    # init_scope: outside surrounding control dependencies and control flow,
    # so initializers never wait for update ops or feeds.
    with tf.compat.v1.init_scope(), _replica_local(config):
        slots = [_create_slot(config, var, grad) for grad, var in pairs]
        first = _first(pairs)
        sum_dtype = _sum_dtype(every_pair, config.accumulation_dtype)
        micro_step = state_variable("micro_step", [], tf.int64, first)
        weight_sum = state_variable("weight_sum", [], sum_dtype, first)
        size = None if config.size.k is not None else state_variable("window_size", [], tf.int64, first)
        sparse_sq = None
        if config.clip_norm is not None and _has_sparse(every_pair):  # Sharded: a share may hold none.
            sparse_sq = state_variable("sparse_sq_norm", [], sum_dtype, first)
        skipped = state_variable("skipped_windows", [], tf.int64, first)
        # Every pair, not the cached share: observers see the whole model.
        made = _make_observers(config, every_pair, sum_dtype)
    return _State(slots, micro_step, weight_sum, size, sparse_sq, skipped, made + list(step.observers), len(made),
                  sharded)


def _replica_local(config):
    """Under a strategy, a block whose variables are this replica's own; else an empty block."""
    return config.replicas.local_variables() if config.replicas is not None else _NOTHING


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


def _make_observers(config, pairs, sum_dtype=None):
    sum_dtype = sum_dtype or _sum_dtype(pairs, None)
    return [make(pairs, sum_dtype) for make in config.observers]


def _size(config, state, global_step):
    """``(size, ended)``: micro-batches of the window in progress (else of the next), and no window open."""
    ended = tf.equal(state.micro_step.read_value(), 0, name="window_ended")
    if state.size is None:
        return tf.constant(config.size.k, tf.int64, name="window_size"), ended
    # Read the source only when no window is open: inside one, its k is held.
    size = tf.cond(ended, lambda: config.size.read(global_step), state.size.read_value, name="window_size")
    return size, ended


# ------------------------------------------------------------ one run, one window


def summed_state(config, pairs, step):
    """The state of a window whose micro-batches are summed inside one run: no caches, no counters.

    Only what the end of a window needs: ``skipped_windows`` and the
    observers (made from ``pairs``, then the step's own).

    Args:
      config: the accumulator's :data:`Config`.
      pairs: the ``(gradient, variable)`` pairs of one micro-batch.
      step: the train op's :data:`Step`.

    Returns:
      The window's state, for :func:`added` and :func:`finish_summed`.

    Example:
      >>> state = summed_state(config, pairs, step)
    """
    check_reducer(config)
    with tf.compat.v1.init_scope(), _replica_local(config):
        sum_dtype = _sum_dtype(pairs, config.accumulation_dtype)
        skipped = state_variable("skipped_windows", [], tf.int64, _first(pairs))
        made = _make_observers(config, pairs, sum_dtype)
    return _State([], None, None, None, None, skipped, made + list(step.observers), len(made))


def sum_dtypes(config, pairs):
    """``([dtype of each pair's sum], dtype of the weight sum)``, as the window's caches would have."""
    grads = [_accumulator_dtype(var.dtype.base_dtype, config.accumulation_dtype) for _, var in pairs]
    return grads, _sum_dtype(pairs, config.accumulation_dtype)


def added(state, micro_batch, made_only=False):
    """The observers' ops for one :class:`gradaccum.observers.MicroBatch` (a list).

    ``made_only``: only the accumulator's own observers (statistics, a
    policy, those given), not the step's window batch-norm statistics.
    """
    observers = state.observers[:state.made] if made_only else state.observers
    return _notify(observers, "added", micro_batch)


def finish_summed(config, state, step, outer_scope, pairs, total):
    """Ends a window summed inside one run: reduce, divide, decide skip, clip, apply, count, observe.

    Args:
      config: the accumulator's :data:`Config`.
      state: from :func:`summed_state`.
      step: the train op's :data:`Step` (its ``global_step``).
      outer_scope: the caller's name scope, where the wrapped optimizer builds.
      pairs: ``(sum_i w_i g_i, variable)``; a sparse sum holds every
        micro-batch's rows as given, repeated rows included, as the full
        batch's gradient does.
      total: ``sum_i w_i``, a scalar tensor.

    Returns:
      The op that applies (or skips) the window.

    Example:
      >>> op = finish_summed(config, state, step, "", sums, total)
    """
    sparse_sq = None
    if config.reducer is not None and config.clip_norm is not None and _has_sparse(pairs):
        # The reducer sums rows over the workers: keep the norm of the rows as given.
        sparse_sq = _sparse_sq_norm([grad for grad, _ in pairs], None, total.dtype.base_dtype)
    end, sums = _End(config, state, step.global_step, outer_scope), _Sums(pairs, total, sparse_sq, None)
    if config.replicas is not None:  # Every run ends a window.
        return _hand_over(end, tf.constant(True), sums)
    return _finish(end, sums, divide=True)


# ------------------------------------------------------------ add a micro-batch


def _reduce_micro_batch(config, pairs, step):
    """``(pairs to cache, step, sharded)``: the reducer's micro-batch sums (already weighted) when it gives them.

    A sharded cache holds a share of the gradient. Observers (statistics,
    an adaptive policy, user ones) still see each micro-batch's local
    gradients (``_accumulate``) and the whole window's squared norm
    (``_reduce``). Window batch norm, and loss scaling (which would test its
    own share for overflow), are still refused here.
    """
    if config.reducer is None:
        return pairs, step, False
    cached = config.reducer.reduce_micro_batch(pairs, None if step.weighted_grads else step.weight)
    if cached is None:
        return pairs, step, False
    refused = [what for what, used in (("window batch norm", step.observers),
                                       ("loss scaling", config.loss_scaled)) if used]
    if refused:
        raise ValueError("%s sums each micro-batch over the workers and caches a share of the gradient "
                         "(shard_cache=True): it cannot be combined with %s, which need the whole gradient of "
                         "each micro-batch; use shard_cache=False" % (type(config.reducer).__name__, refused[0]))
    if not cached:
        raise ValueError("%s.reduce_micro_batch must return None or a non-empty list of pairs, got []"
                         % type(config.reducer).__name__)
    return list(cached), step._replace(weighted_grads=True), True


def _accumulate(config, state, pairs, step, local):
    """Adds one micro-batch: gradients times weight (unless already), the weight, the count.

    ``local`` is ``(pairs, weight)``: this worker's own gradients and the
    weight they still need. The observers see them (sharded: before the
    reducer summed them over the workers, as without sharding), and the
    sparse clip norm is measured from them (the reducer's sums in ``pairs``
    hold each row once, summed).
    """
    weight, (local_pairs, local_weight) = step.weight, local
    with tf.compat.v1.name_scope("accumulate"):
        grad_weight = None if step.weighted_grads else weight
        dense = [(grad, slot) for (grad, _), slot in zip(pairs, state.slots) if slot.touched is None]
        adds = [_write_or_add(dense, grad_weight, state.micro_step)] if dense else []
        if state.size is not None:
            adds.append(_start_window(config, state, step.global_step))
        for (grad, _), slot in zip(pairs, state.slots):
            if slot.touched is not None:
                adds.extend(_add_sparse(slot, grad, grad_weight))
        if state.sparse_sq is not None:
            norm = _sparse_sq_norm([grad for grad, _ in local_pairs], local_weight, state.sparse_sq.dtype.base_dtype)
            adds.append(state.sparse_sq.assign_add(norm, read_value=False))
        added = 1.0 if weight is None else tf.cast(weight, state.weight_sum.dtype.base_dtype)
        # A constant weight depends on no input: without this, a run that fails
        # at its input (OutOfRangeError at the end of a tf.data loop) would
        # still count one micro-batch.
        with tf.control_dependencies(list(adds)):
            adds.append(state.weight_sum.assign_add(added))
        adds.extend(_notify(state.observers, "added", MicroBatch(local_pairs, weight, step.small_batches)))
        with tf.control_dependencies(adds):
            # The counter moves last, so reading it orders after every addition.
            return tf.group(state.micro_step.assign_add(1), name="accumulate")


def _start_window(config, state, global_step):
    """Reads and checks the window's k when its first micro-batch arrives; a change waits for the next."""
    first = tf.equal(state.micro_step.read_value(), 0, name="window_start")

    def start():
        with tf.compat.v1.name_scope("window_size"):
            return tf.group(state.size.assign(config.size.read(global_step), read_value=False))

    return tf.cond(first, start, tf.no_op, name="fix_window_size")


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


def _end_window(end, may_be_empty=False):
    """Sum: reads the window's caches, then finishes it."""
    return _finish(end, _window_sums(end.state, may_be_empty), divide=True)


def _hand_over(end, due, sums):
    """Under a strategy: hands this replica's window to the strategy (every run), then resets or skips.

    The strategy reduces and applies on the run that ends the window
    (:class:`gradaccum.window.replicas.Replicas`); each replica resets its own
    state after it, or counts a skipped window. ``sums`` are this replica's
    window sums, read after its micro-batch was added.
    """
    config, state = end.config, end.state
    scalars = [] if sums.sparse_sq is None else [sums.sparse_sq]
    finish = Finish(config.applier, [var for _, var in sums.pairs], functools.partial(averaged, config),
                    end.global_step, end.outer_scope)
    applied = config.replicas.end_window(due, (sums.pairs, sums.total, scalars), finish)

    def reset_or_skip():
        return tf.cond(applied, lambda: tf.group(*_reset(state, sums.rows)), lambda: _skip(state),
                       name="reset_or_skip")

    with tf.control_dependencies([applied]):
        return tf.cond(due, reset_or_skip, tf.no_op, name="reset_if_due")


def averaged(config, sums_and_vars, total, scalars):
    """One device's reduced window as the window applies it: ``(usable, update)``.

    Args:
      config: the accumulator's :data:`Config`.
      sums_and_vars: ``(sum, variable)`` pairs, summed over every replica.
      total: the summed weight to divide by, a scalar tensor.
      scalars: ``[]``, or ``[sparse_sq_norm]`` summed over every replica.

    Returns:
      ``(usable, pairs, finite)``: a bool tensor (``None``: always usable)
      that decides skip; the averaged, clipped ``(gradient, variable)``
      pairs; and, with a wrapped loss-scale optimizer (which skips a
      non-finite update itself), whether it applies them, else ``None``.

    Example:
      >>> usable, update, finite = averaged(config, reduced_pairs, total, [])
    """
    sums = _Sums(list(sums_and_vars), total, scalars[0] if scalars else None, None)
    mean = normalized(sums.pairs, total)
    return _usable(config, sums), _clip(config, mean, sums), _loss_scale_applies(config, mean)


def _finish(end, sums, divide):
    """Reduce, divide (when ``sums`` are weighted sums), decide skip, then apply or skip; returns an op."""
    config, state = end.config, end.state
    sums, extras = _reduce(config, state, sums)
    usable = _usable(config, sums)

    def apply():
        averaged = normalized(sums.pairs, sums.total if divide else None)
        finite = _loss_scale_applies(config, averaged)
        big = _averaged_sq_norm(sums) if state.observers else None
        updates = [WindowUpdate(averaged, sums.total, mine, state.observers, big) for mine in extras]
        applied = _clip_and_apply(end, averaged, sums, updates, finite)
        with tf.control_dependencies([applied]):
            if finite is None:
                return _done(state, sums, updates)
            return tf.cond(finite, lambda: _done(state, sums, updates), lambda: _skip(state),
                           name="reset_or_skip")

    if usable is None:
        return apply()
    return tf.cond(usable, apply, lambda: _skip(state), name="apply_or_skip")


def _reduce(config, state, sums):
    """Reduce: the window's sums, weight and every extra scalar, over the workers, in one exchange.

    Returns the reduced sums and, per observer, its reduced extra sums (none
    without a reducer: an observer then reads its own).
    """
    reducer, sharded = config.reducer, state.sharded
    if reducer is None:  # Each observer reads its own sums.
        return sums, [[] for _ in state.observers]
    own = [] if sums.sparse_sq is None or sharded else [sums.sparse_sq]  # Sharded: in the share's norm.
    asked = [list(observer.extra_sums()) for observer in state.observers]
    flat = own + [value for values in asked for value in values]
    whole = _share_scalars(config, state, sums) if sharded else []
    pairs, total, flat = reducer.reduce([] if sharded else sums.pairs, sums.total, flat + whole)
    pairs = sums.pairs if sharded else pairs  # Sharded: summed over the workers micro-batch by micro-batch.
    sparse_sq = flat[0] if own else None
    position, extras = len(own), []
    for values in asked:
        extras.append(list(flat[position:position + len(values)]))
        position += len(values)
    sq_norm = observed = nonfinite = None
    if sharded:  # In _share_scalars' order.
        whole = iter(flat[position:])
        sq_norm = next(whole) if config.clip_norm is not None else None
        observed = next(whole) if _observed_apart(config, state, sums) else sq_norm
        nonfinite = next(whole) if config.skip_nonfinite else None
    return _Sums(pairs, total, sparse_sq, sums.rows, sq_norm, nonfinite, observed), extras


def _share_scalars(config, state, sums):
    """Of this worker's share of a sharded window: its squared norm, and 1 if it is not finite (else 0).

    Summed over the workers, they give the whole gradient's norm and
    finiteness, so that every worker clips, skips and observes alike.

    The clip norm of a share is that of its dense sums plus this worker's
    ``sparse_sq_norm``: ``sum_i w_i^2 |values_i|^2`` of its own micro-batches'
    rows of every sparse variable, owned or not. Summed over the workers,
    that is what the unsharded engine measures (``_clip``); the share's
    sparse sums are left out, as there: they hold each row once, summed.
    The observers' norm is the summed gradient's, sparse sums included; it
    is a scalar of its own only when the two differ (a sparse gradient).
    """
    dtype = sums.total.dtype.base_dtype
    scalars = []
    if config.clip_norm is not None:
        squares = _squares([g for g, _ in sums.pairs if not isinstance(g, tf.IndexedSlices)], dtype)
        if sums.sparse_sq is not None:
            squares.append(tf.cast(sums.sparse_sq, dtype))
        scalars.append(tf.add_n(squares))
    if _observed_apart(config, state, sums):
        scalars.append(tf.add_n(_squares([values_of(g) for g, _ in sums.pairs], dtype)))
    if config.skip_nonfinite:
        scalars.append(tf.cast(tf.logical_not(all_finite(sums.pairs)), dtype))
    return scalars


def _observed_apart(config, state, sums):
    """Sharded: whether the observers need a squared norm other than the clip norm's.

    They need the summed gradient's; clipping measures sparse rows as given
    (``sparse_sq_norm``, which exists on every worker when any gradient is
    sparse). Without clipping, or without a sparse gradient, one serves both.
    """
    return bool(state.observers) and (config.clip_norm is None or sums.sparse_sq is not None)


def _averaged_sq_norm(sums):
    """Sharded: the averaged whole gradient's squared norm, ``observed_sq_norm / total^2``; else ``None``.

    The observers get it in ``WindowUpdate.sq_norm``: their averaged pairs
    are this worker's share only.
    """
    if sums.observed_sq_norm is None:
        return None
    total = tf.cast(sums.total, sums.observed_sq_norm.dtype.base_dtype)
    return tf.math.truediv(sums.observed_sq_norm, total * total, name="averaged_sq_norm")


# Decide skip: the two predicates, both on the reduced window, so that every
# worker decides alike.


def _usable(config, sums):
    """bool tensor, or ``None`` for always: the window has weight and (``skip_nonfinite``) a finite sum.

    A window that is not usable is skipped before anything is applied.
    """
    checks = []
    if sums.total is not None:
        checks.append(tf.greater(sums.total, 0, name="has_weight"))
    if sums.nonfinite is not None:  # Sharded: every worker's share was finite.
        checks.append(tf.equal(sums.nonfinite, 0, name="all_finite"))
    elif config.skip_nonfinite and not config.loss_scaled:
        checks.append(all_finite(sums.pairs))
    if not checks:
        return None
    return checks[0] if len(checks) == 1 else tf.logical_and(checks[0], checks[1], name="usable")


def _loss_scale_applies(config, averaged):
    """With a wrapped loss-scale optimizer only: the test it makes itself, on the same tensors.

    It must see a non-finite window, or its scale would never come down: such
    a window is handed to it (it skips it) and counted as skipped.
    """
    return all_finite(averaged) if config.loss_scaled else None


def _clip_and_apply(end, averaged, sums, updates, finite):
    """Notify observers of the update, clip, apply and count ``global_step``; returns an op."""
    config, state, global_step, outer_scope = end
    observed = [op for observer, update in zip(state.observers, updates) for op in _ops(observer.applying(update))]
    if finite is not None and observed:
        observed = [tf.cond(finite, lambda: tf.group(*observed), tf.no_op, name="observe_if_finite")]
    clipped = _clip(config, averaged, sums)
    # The wrapped optimizer's non-slot variables (Adam's beta powers) are
    # named from the current scope: use the caller's, as plain training would.
    graph = tf.compat.v1.get_default_graph()
    with tf.control_dependencies(observed), graph.name_scope(outer_scope + "/" if outer_scope else ""):
        apply = _apply_fn(config, global_step)
        return counted_apply(config.applier, apply, clipped, global_step, finite)


def _done(state, sums, updates):
    """Notify observers that the window was applied, and reset."""
    after = [op for observer, update in zip(state.observers, updates) for op in _ops(observer.applied(update))]
    return tf.group(*(after + _reset(state, sums.rows)), name="reset")


def _clip(config, averaged, sums):
    """Clip by global norm, measured as ``tf.clip_by_global_norm`` measures the full batch's gradients.

    TF measures a sparse gradient by its rows as given, a repeated row once per
    occurrence; the window holds each row's sum. So the window keeps
    ``sum_i w_i^2 |values_i|^2`` of its sparse rows and uses it, over the
    squared total weight, in place of the summed rows' squared norm.
    """
    if config.clip_norm is None:
        return averaged
    grads, variables = zip(*averaged)
    norm = None
    if sums.sq_norm is not None:  # Sharded: the whole window's norm, summed over the workers' shares.
        dtype = sums.sq_norm.dtype.base_dtype
        norm = tf.cast(tf.sqrt(sums.sq_norm) / tf.cast(sums.total, dtype), grads[0].dtype.base_dtype,
                       name="global_norm")
    elif sums.sparse_sq is not None:
        dtype = sums.sparse_sq.dtype.base_dtype
        total = tf.cast(sums.total, dtype)
        squares = [sums.sparse_sq / (total * total)] + _squares(
            [g for g in grads if not isinstance(g, tf.IndexedSlices)], dtype)
        norm = tf.cast(tf.sqrt(tf.add_n(squares)), grads[0].dtype.base_dtype, name="global_norm")
    clipped, _ = tf.clip_by_global_norm(list(grads), config.clip_norm, use_norm=norm, name="clip")
    return list(zip(clipped, variables))


def _apply_fn(config, global_step):
    """The call that applies a window: the reducer's ``apply_reduced``, else ``apply_gradients``."""
    if config.reducer is not None:
        return lambda gv: config.reducer.apply_reduced(gv, global_step=global_step)
    return lambda gv: config.applier.apply_gradients(gv, global_step=global_step)


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


def _skip(state):
    """A window not applied: reset, tell the observers, count it."""
    ops = _reset(state) + _notify(state.observers, "skipped")
    if state.skipped is None:
        return tf.group(*ops, name="skip")
    with tf.control_dependencies(ops):
        return tf.group(state.skipped.assign_add(1), name="skip")


def _reset(state, rows=None):
    """Zeroes the counters and the touched rows of sparse caches (nothing for k = 1).

    Dense caches are left as they are: the next window's first micro-batch
    overwrites them (``_write_or_add``), so they are never zeroed in a pass
    of their own.
    """
    if state.micro_step is None:
        return []
    rows = rows or [None] * len(state.slots)
    ops = [state.micro_step.assign(0, read_value=False), state.weight_sum.assign(0, read_value=False)]
    if state.sparse_sq is not None:
        ops.append(state.sparse_sq.assign(tf.zeros([], state.sparse_sq.dtype.base_dtype), read_value=False))
    for slot, index in zip(state.slots, rows):
        if slot.touched is None:
            continue
        index = touched_rows(slot.touched.read_value()) if index is None else index
        with tf.control_dependencies([index]):
            shape = tf.concat([tf.shape(index), tf.shape(slot.accum)[1:]], 0)
            ops.append(tf.compat.v1.scatter_update(
                slot.accum, index, tf.zeros(shape, slot.accum.dtype.base_dtype)))
            ops.append(slot.touched.assign(tf.zeros(slot.touched.shape, slot.touched.dtype.base_dtype),
                                           read_value=False))
    return ops


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


def _notify(observers, hook, *args):
    return [op for observer in observers for op in _ops(getattr(observer, hook)(*args))]


def _ops(result):
    if result is None:
        return []
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _identity(grad):
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.identity(grad.values), grad.indices, grad.dense_shape)
    return tf.identity(grad)


def _increment(global_step):
    with tf.compat.v1.colocate_with(global_step):
        return tf.group(tf.compat.v1.assign_add(global_step, tf.ones([], global_step.dtype.base_dtype)))


def _first(pairs):
    return min((var for _, var in pairs), key=lambda v: v.name)


def _has_sparse(pairs):
    return any(isinstance(grad, tf.IndexedSlices) for grad, _ in pairs)


def _sparse_sq_norm(grads, weight, dtype):
    """``w^2 * sum |values|^2`` over the sparse gradients' rows, as TF's global norm counts them."""
    squares = _squares([g.values for g in grads if isinstance(g, tf.IndexedSlices)], dtype)
    total = tf.add_n(squares)
    if weight is None:
        return total
    w = tf.cast(weight, dtype)
    return total * w * w


def _squares(tensors, dtype):
    """``sum(t^2)`` of each tensor, in ``dtype``."""
    return [tf.reduce_sum(tf.square(tf.cast(t, dtype))) for t in tensors]


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
    """Sum: the caches as ``(sum, variable)`` pairs (sparse ones as ``IndexedSlices``), weight, rows.

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
    pairs, rows = [], []
    for slot in state.slots:
        if slot.touched is None:
            pairs.append((next(values), slot.var))
            rows.append(None)
            continue
        index = touched_rows(slot.touched.read_value())
        pairs.append((sparse_again(slot.accum, None, slot.var, index), slot.var))
        rows.append(index)
    sparse_sq = None if state.sparse_sq is None else state.sparse_sq.read_value()
    return _Sums(pairs, state.weight_sum.read_value(), sparse_sq, rows)
