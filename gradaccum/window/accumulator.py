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
is built by ``gradaccum.window.pipeline``, whose docstring lists the variables each
train op creates (global, non-trainable, so a ``Saver`` checkpoint taken in
the middle of a window restores it exactly). None of them is a slot:
``get_slot`` and ``get_slot_names`` are the wrapped optimizer's.
``variables()`` returns the wrapped optimizer's variables plus
:attr:`GradientAccumulator.state_variables`; ``Saver()`` saves them all.

Collections: the variables go to ``GLOBAL_VARIABLES`` only. The train op is
appended to ``TRAIN_OP``; the wrapped optimizer's internal apply ops are kept
out of it, because running them on their own would apply a stale window.
Logging: a train op with k > 1 and a ``global_step`` installs
``gradaccum.window.logfilter.GlobalStepWarningFilter`` (see there).
"""
from gradaccum import _validate
from gradaccum._compat import (in_control_flow, is_resource_variable, is_variable, loss_scale_optimizer_types, tf,
                               v1_control_flow)
from gradaccum.window import custom_gradients, logfilter, pipeline, replicas
from gradaccum.window import statistics as _statistics
from gradaccum.window.access import WindowAccess
from gradaccum.window.observers import WindowObserver
from gradaccum.window.reducers import Reducer
from gradaccum.window.update_ops import chosen_update_ops, graph_update_ops, split_update_ops
from gradaccum.window.wrapper import WrappingOptimizer, optimizer_chain

_ACCUMULATION_DTYPES = (tf.float32, tf.float64)
_EAGER_MESSAGE = (
    "GradientAccumulator builds TF1 graph-mode train ops, but eager execution is enabled: call "
    "tf.compat.v1.disable_eager_execution() (or tf.compat.v1.disable_v2_behavior()) at the top of "
    "the script, before building the model"
)
Window = pipeline.Window


class GradientAccumulator(WindowAccess, WrappingOptimizer):
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

    A wrapped :class:`gradaccum.Reducer` (the collective engine, the Horovod
    adapter) combines each window across workers (``gradaccum.reducers``).
    Built in a ``tf.distribute`` strategy's replica context (an Estimator's
    ``model_fn`` with ``train_distribute``, Keras under ``strategy.scope()``,
    ``strategy.run``), each replica accumulates its own micro-batches and the
    strategy reduces them once per window, on its last run
    (``gradaccum.window.replicas``).

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the averaged
        gradients (its slots change only on applying runs).
      num_micro_batches: the micro-batches per applied update: an int >= 1;
        a scalar integer tensor or variable; a callable ``global_step ->
        scalar integer tensor`` (a schedule, such as :func:`gradaccum.batch_ramp`;
        needs ``global_step`` at ``minimize``); or a
        :class:`gradaccum.AdaptiveBatch` (which turns ``statistics`` on, and
        needs ``global_step`` too). A non-int k is read once per window,
        when its first micro-batch arrives, and must then be >= 1, or that
        run raises ``InvalidArgumentError``.
      clip_norm: ``None``, or a number > 0: the averaged gradients are clipped
        by global norm once, just before they are applied; the norm is
        ``tf.clip_by_global_norm``'s of the full batch's gradients.
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
      observers: ``None`` or a list of :class:`gradaccum.WindowObserver`.
      loss_scaling: whether the wrapped optimizer skips non-finite updates
        itself; ``None``: True when it is, or wraps, TF's loss-scale optimizer.
      gradients: ``None`` (TensorFlow's gradients), or a callable ``(loss,
        variables, grad_loss) -> list`` of one gradient (or ``None``) per
        variable, used by ``compute_gradients`` in the fused train op,
        ``tower.minimize`` and ``subdivisions.minimize`` (a rewrite such as
        ``memory_saving_gradients.gradients``). It replaces the innermost
        wrapped optimizer's differentiation only: the optimizers between act
        as usual, and inside ``gradients`` that optimizer's own
        ``compute_gradients`` returns TensorFlow's gradients. ``grad_loss``
        is ``None`` or a float tensor of the loss's dtype and shape (the
        micro-batch weight, when backprop carries it). ``gate_gradients``,
        ``aggregation_method`` and ``colocate_gradients_with_ops`` are passed
        on as ``tf.compat.v1.gradients`` takes them when the function declares them
        (or ``**kwargs``); otherwise only their defaults (and ``GATE_GRAPH``,
        applied to its gradients) are accepted.
      name: the name scope of the ops and of the state variables.

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer, or is itself a
        ``GradientAccumulator``; when ``clip_norm`` is not a number,
        ``skip_nonfinite``, ``statistics`` or ``loss_scaling`` not a bool,
        or ``observers`` not a list of ``WindowObserver``; when ``gradients``
        is neither None nor callable.
      ValueError: when ``num_micro_batches`` is not an int >= 1, a scalar
        integer tensor, a callable or a policy, ``clip_norm``
        is not > 0, ``accumulation_dtype`` is not float32 or float64,
        ``name`` is empty, ``loss_scaling=True`` with ``ShardedAllReduce``,
        or ``gradients`` would replace a loss-scale optimizer's scaling.

    Example:
      >>> opt = gradaccum.GradientAccumulator(
      ...     tf.compat.v1.train.AdamOptimizer(1e-3), num_micro_batches=8)
      >>> train_op = opt.minimize(loss, global_step=global_step,
      ...                         weight=tf.shape(images)[0])
      >>> for images_i, labels_i in micro_batches:  # 8 runs = 1 update
      ...     sess.run(train_op, {images: images_i, labels: labels_i})
    """

    def __init__(self, optimizer, num_micro_batches, *, clip_norm=None, accumulation_dtype=None,
                 skip_nonfinite=False, statistics=False, observers=None, loss_scaling=None,
                 name="GradientAccumulator", gradients=None):
        super(GradientAccumulator, self).__init__(optimizer, name)  # Checks `optimizer` and `name` first.
        if isinstance(optimizer, GradientAccumulator):
            raise TypeError(
                "`optimizer` is already a GradientAccumulator (num_micro_batches=%r); nest nothing, "
                "use one GradientAccumulator with the product of the counts" % (optimizer.num_micro_batches,)
            )
        self._size = _window_size(num_micro_batches)
        self._given = num_micro_batches
        given = _check_observers(observers) + _policy(num_micro_batches)
        self._clip_norm = _validate.check_positive_number(clip_norm, "clip_norm")
        self._accumulation_dtype = _check_accumulation_dtype(accumulation_dtype)
        self._skip_nonfinite = _validate.check_bool(skip_nonfinite, "skip_nonfinite")
        self._use_statistics = (_validate.check_bool(statistics, "statistics")
                                or any(observer.uses_statistics for observer in given))
        # Called once per train op: statistics are per window; the observers given serve all.
        self._observers = ([_statistics.create] if self._use_statistics else []) + [
            _shared(observer) for observer in given]
        # An observer that reads each micro-batch's gradients must see them unweighted.
        self._observers_read_gradients = any(observer.reads_gradients for observer in given)
        # Facts about the wrapped chain, which never changes: read once, not per build step.
        self._reducer = optimizer if isinstance(optimizer, Reducer) else None
        self._loss_scaled = _loss_scaled(optimizer, loss_scaling, self._reducer)
        self._gradients = custom_gradients.check_function(gradients, optimizer)
        self._windows = []
        self._config = pipeline.Config(self._reducer or self._optimizer, self._name, self._size, self._clip_norm,
                                       self._accumulation_dtype, self._skip_nonfinite, self._observers,
                                       self._reducer, self._loss_scaled, False)
        self._builder = WindowBuilder(self)

    # ------------------------------------------------------------------ API

    def __repr__(self):  # Keras 3's compile() shows only this: say there what to use.
        return ("<GradientAccumulator(%s, num_micro_batches=%r): a tf.compat.v1 optimizer for graph "
                "mode and Keras 2 (tf_keras with TF_USE_LEGACY_KERAS=1); Keras 3 takes no TF1 "
                "optimizer, use its own gradient_accumulation_steps there>"
                % (type(self._optimizer).__name__, self.num_micro_batches))

    @property
    def num_micro_batches(self):
        """The micro-batches per applied update, as given (the int, tensor, callable or policy)."""
        return self._given if self._size.k is None else self._size.k

    @property
    def builder(self):
        """The :class:`WindowBuilder` through which gradaccum's forms build this accumulator's windows."""
        return self._builder

    @property
    def gradients(self):
        """The gradient function given as ``gradients``, or ``None`` (TensorFlow's)."""
        return self._gradients

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``compute_gradients``, differentiating with ``gradients`` when given.

        Args:
          *args: as ``tf.compat.v1.train.Optimizer.compute_gradients``.
          **kwargs: as ``tf.compat.v1.train.Optimizer.compute_gradients``.

        Returns:
          The list of ``(gradient, variable)`` pairs.

        Raises:
          ValueError: with ``gradients``, when it returns no list of one
            gradient per variable, or is given a ``gate_gradients``,
            ``aggregation_method`` or ``colocate_gradients_with_ops`` it does
            not declare, other than the default.

        Example:
          >>> grads_and_vars = opt.compute_gradients(loss)
        """
        with custom_gradients.differentiating(self._optimizer, self._gradients):
            return super(GradientAccumulator, self).compute_gradients(*args, **kwargs)

    @property
    def clip_norm(self):
        """The global-norm clip applied to the averaged gradients, or ``None``."""
        return self._clip_norm

    def minimize(self, loss, global_step=None, var_list=None,
                 gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
                 aggregation_method=None, colocate_gradients_with_ops=False,
                 name=None, grad_loss=None, *, weight=None, update_ops="first"):
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
          update_ops: what to run on every micro-batch before its gradients are
            added (batch-norm moving averages): ``"first"`` (the default) or
            ``"all"``, every op in ``tf.GraphKeys.UPDATE_OPS`` at call time; or
            a list of ops, ``[]`` for none. ``None`` (deprecated, with a
            ``FutureWarning``) still means every op.

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
        update_ops = graph_update_ops(chosen_update_ops(update_ops, "minimize", none_means="all"))
        weighted_grads = self._builder.weight_in_backprop(loss, weight, var_list)
        if weighted_grads:
            # Backprop carries the weight from the loss to every gradient for free,
            # where the accumulate kernel would multiply each one on every micro-step.
            grad_loss = weighted_grad_loss(loss, grad_loss, weight)
        grads_and_vars = self.compute_gradients(
            loss, var_list=var_list, gate_gradients=gate_gradients,
            aggregation_method=aggregation_method,
            colocate_gradients_with_ops=colocate_gradients_with_ops, grad_loss=grad_loss)
        if all(grad is None for grad, _ in grads_and_vars):  # TF's message, word for word.
            raise ValueError(
                "No gradients provided for any variable, check your graph for ops that do not support "
                "gradients, between variables %s and loss %s." % ([str(v) for _, v in grads_and_vars], loss))
        return self._build(grads_and_vars, pipeline.Step(global_step, name, weight, update_ops, None, weighted_grads))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, *, weight=None,
                        update_ops=(), small_batches=None):
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
            added: a list (by default none: ``tf.control_dependencies`` then),
            or ``"first"``/``"all"``, every op in ``tf.GraphKeys.UPDATE_OPS``
            at call time. ``None`` (deprecated, with a ``FutureWarning``)
            still means none.
            Window statistics among them (``gradaccum.window.update_ops``) are
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
        update_ops = graph_update_ops(chosen_update_ops(update_ops, "apply_gradients", none_means="none"))
        return self._build(grads_and_vars, pipeline.Step(global_step, name, weight, update_ops, small_batches, False))

    def _build(self, grads_and_vars, step):
        """``apply_gradients`` for one :data:`gradaccum.window.pipeline.Step` (its update ops not yet split)."""
        grads_and_vars, pairs, step, config = self._builder.prepare(grads_and_vars, step)
        graph = tf.compat.v1.get_default_graph()
        with v1_control_flow(config.ref_step_flow), pipeline.keep_train_ops(graph):
            window = pipeline.build(config, grads_and_vars, pairs, step)
        return self._builder.register(window, step)


class WindowBuilder(object):
    """How gradaccum's forms build a :class:`GradientAccumulator`'s windows.

    The fused train op (``minimize``, ``apply_gradients``), the one-run form
    (``gradaccum.subdivisions``) and the towers reach the window through
    this object, ``accumulator.builder``: its settings are fixed when the
    accumulator is made. It creates no variables.

    Attributes:
      size: the accumulator's :class:`gradaccum.window.pipeline.WindowSize` (k).
      reducer: the wrapped :class:`gradaccum.Reducer`, or ``None``.
      observers_read_gradients: True when an observer given reads each
        micro-batch's gradients (``WindowObserver.reads_gradients``).

    Example:
      >>> grads_and_vars, pairs, step, config = opt.builder.prepare(grads_and_vars, step)
      >>> train_op = opt.builder.register(pipeline.build(config, grads_and_vars, pairs, step), step)
    """

    def __init__(self, accumulator):
        self._accumulator = accumulator
        self.size = accumulator._size
        self.reducer = accumulator._reducer
        self.observers_read_gradients = accumulator._observers_read_gradients

    def prepare(self, grads_and_vars, step):
        """Checks a train op's pairs and :data:`gradaccum.window.pipeline.Step`.

        Args:
          grads_and_vars: ``(gradient, variable)`` pairs, ``None`` gradients allowed.
          step: the train op's ``Step``, its ``update_ops`` a list of ops, not yet split.

        Returns:
          ``(grads_and_vars, pairs, step, config)``: the pairs checked, those
          with a gradient, the step with its weight checked and its window
          statistics split from its plain update ops, and the window's
          :data:`gradaccum.window.pipeline.Config`.

        Raises:
          ValueError, TypeError: as ``apply_gradients``.
        """
        accumulator = self._accumulator
        _check_outside_control_flow(accumulator.get_name())
        grads_and_vars, pairs = _checked_pairs(grads_and_vars)
        weight = _validate.check_scalar_tensor(step.weight, "weight", allow_none=True)
        self.check_global_step(step.global_step)
        update_ops = list(step.update_ops)
        # k = 1 has no window to pool statistics over: every update op is a plain one.
        plain, observers = (update_ops, []) if self.size.k == 1 else split_update_ops(update_ops)
        step = step._replace(weight=weight, update_ops=plain, observers=observers)
        ref_flow = any(not is_resource_variable(var) for var in [v for _, v in pairs] + [step.global_step]
                       if var is not None)
        config = accumulator._config._replace(ref_step_flow=ref_flow,
                                              replicas=replicas.current(accumulator.get_name()))
        if config.replicas is not None:
            _check_under_strategy(config, step)
        return grads_and_vars, pairs, step, config

    def register(self, window, step):
        """Records a built window and puts its train op in ``TRAIN_OP``; returns the train op.

        Under a ``tf.distribute`` strategy each replica registers its own
        window; ``window.replica`` is its index in its process (else ``None``).
        """
        window.replica = replicas.local_replica()
        tf.compat.v1.get_default_graph().add_to_collection(tf.compat.v1.GraphKeys.TRAIN_OP, window.train_op)
        self._accumulator._windows.append(window)
        if self.size.k != 1 and step.global_step is not None:
            logfilter.install_global_step_warning_filter()
        return window.train_op

    def check_global_step(self, global_step):
        """Raises ``ValueError`` when k is a schedule of ``global_step`` and it is ``None``."""
        if self.size.needs_global_step and global_step is None:
            raise ValueError("`num_micro_batches` %r is a schedule of `global_step` (a callable or a policy): "
                             "pass `global_step` to minimize or apply_gradients, got None"
                             % (self._accumulator._given,))

    def weight_in_backprop(self, loss, weight, var_list):
        """Whether a micro-batch's ``weight`` is folded into ``grad_loss`` (k > 1 windows only).

        Backprop then carries the weight from the loss to every gradient for
        free, where the sum would multiply each one on every micro-batch.

        Not with statistics or an observer that reads each micro-batch's
        gradients (``WindowObserver.reads_gradients``), which need them
        unweighted, nor under a loss-scale optimizer, whose overflow test
        would then see the weighted gradients, nor for a callable loss, whose
        shape is not known yet, nor where a cache is wider than its gradient
        (``accumulation_dtype``, half-precision variables): the product is
        then taken in the cache's dtype. Nor across processes (a reducer, or
        collective ops behind the loss, as in worker-synchronised batch
        norm): there each worker's backward pass mixes in the others', which
        carry their own weights, so scaling it is not scaling the gradient.

        Args:
          loss: the micro-batch's loss tensor (or a callable).
          weight: ``None`` or its scalar weight tensor.
          var_list: ``None`` (the trainable variables) or the variables trained.

        Returns:
          A Python bool.
        """
        accumulator = self._accumulator
        if (weight is None or self.size.k == 1 or accumulator._use_statistics or self.observers_read_gradients
                or callable(loss)):
            return False
        dtype = tf.convert_to_tensor(loss).dtype.base_dtype
        variables = tf.compat.v1.trainable_variables() if var_list is None else var_list
        return (dtype in _ACCUMULATION_DTYPES and accumulator._accumulation_dtype in (None, dtype)
                and all(v.dtype.base_dtype == dtype for v in variables)
                and not accumulator._loss_scaled and self.reducer is None
                and not _crosses_processes(loss))


# ---------------------------------------------------------------- helpers

def _check_outside_control_flow(name):
    _check_graph_mode()
    if in_control_flow():
        raise ValueError(
            "GradientAccumulator %r must build its train op outside tf.cond and tf.while_loop; "
            "to combine it with loss scaling, wrap the loss-scale optimizer inside it: "
            "GradientAccumulator(MixedPrecisionLossScaleOptimizer(opt, 'dynamic'), k)" % name)


def _check_under_strategy(config, step):
    """Refuses, in one line, what a window cannot yet do exactly in a strategy's replica context."""
    refused = [what for what, used in (
        ("a Reducer (%s)" % type(config.reducer).__name__, config.reducer is not None),
        ("statistics, an adaptive policy or observers", bool(config.observers)),
        ("window batch norm", bool(step.observers))) if used]
    if refused:
        raise ValueError(
            "GradientAccumulator %r cannot combine %s with a tf.distribute strategy (%s): the strategy reduces "
            "the window itself; leave it out, or train without the strategy"
            % (config.name, refused[0], config.replicas.name))


def _window_size(num_micro_batches):
    """The :class:`gradaccum.window.pipeline.WindowSize` of ``num_micro_batches``, checked."""
    if isinstance(num_micro_batches, (tf.Tensor, tf.Variable)):
        tensor = num_micro_batches
        dtype = tensor.dtype.base_dtype
        if dtype == tf.bool or not dtype.is_integer or tensor.shape.ndims not in (None, 0):
            raise ValueError("`num_micro_batches` must be an int >= 1 or a scalar integer tensor, got %s"
                             % _validate.describe(tensor))
        return pipeline.WindowSize(fn=lambda global_step: tensor)
    if callable(num_micro_batches):
        return pipeline.WindowSize(fn=num_micro_batches, needs_global_step=True)
    return pipeline.WindowSize(k=_validate.check_positive_int(num_micro_batches, "num_micro_batches"))


def _policy(num_micro_batches):
    """``[num_micro_batches]`` when it also watches the windows it sizes (``AdaptiveBatch``), else ``[]``."""
    return [num_micro_batches] if isinstance(num_micro_batches, WindowObserver) else []


def _shared(observer):
    return lambda pairs, dtype: observer


def _check_observers(observers):
    if observers is None:
        return []
    if not isinstance(observers, (list, tuple)) or not all(isinstance(o, WindowObserver) for o in observers):
        raise TypeError("`observers` must be None or a list of gradaccum.WindowObserver, got %s"
                        % _validate.describe(observers))
    return list(observers)


def _check_graph_mode():
    if tf.executing_eagerly():
        raise RuntimeError(_EAGER_MESSAGE)


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
        if not (isinstance(var, tf.Tensor) or is_variable(var)):
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


def weighted_grad_loss(loss, grad_loss, weight):
    """``grad_loss`` (ones, when None) times ``weight``, in the loss's dtype: with :func:`weight_in_backprop`."""
    loss = tf.convert_to_tensor(loss)
    ones = tf.ones_like(loss) if grad_loss is None else grad_loss
    return ones * tf.cast(weight, loss.dtype.base_dtype)


def _loss_scaled(optimizer, loss_scaling, reducer):
    """Whether ``optimizer``, or one it wraps, skips non-finite updates itself (TF's loss-scale optimizer).

    Refused with a reducer that applies a share per worker: each would test
    its own share for overflow only.
    """
    if loss_scaling is None:
        types = loss_scale_optimizer_types()
        scaled = any(isinstance(wrapped, types) for wrapped in optimizer_chain(optimizer))
    else:
        scaled = _validate.check_bool(loss_scaling, "loss_scaling")
    if scaled and reducer is not None and reducer.applies_a_share:
        raise ValueError(
            "`loss_scaling` must not be True with %s: each worker applies the wrapped optimizer to its own "
            "variables only, so a loss-scale optimizer would test its own share for overflow and the workers' "
            "loss scales would drift apart; use skip_nonfinite=True" % type(reducer).__name__)
    return scaled
