"""The one place that knows about TensorFlow-version differences.

Everything else in gradaccum imports TensorFlow through :data:`tf` from this
module, so that a missing or too-old TensorFlow fails in one sentence and
version-dependent behaviour stays in one file. This module creates no
variables and no collections.
"""
import contextlib
import sys
import re

_INSTALL_HINT = (
    "gradaccum needs TensorFlow 1.15 or newer: install it with "
    "`pip install \"gradaccum[tf]\"` (newest TensorFlow 2.x) or "
    "`pip install tensorflow-gpu==1.15` (TensorFlow 1.x)"
)

try:
    import tensorflow as tf
except ImportError as exc:  # The user-facing sentence matters more than the chain.
    raise ImportError("%s; importing tensorflow failed with: %s" % (_INSTALL_HINT, exc)) from None

MIN_TF_VERSION = (1, 15)


def parse_version(text):
    """Returns the leading ``(major, minor)`` of a version string.

    Args:
      text: a version such as ``"2.21.0"`` or ``"1.15.5rc0"``.

    Returns:
      A tuple of two ints, or ``(0, 0)`` when ``text`` has no leading numbers.

    Example:
      >>> parse_version("1.15.5")
      (1, 15)
    """
    match = re.match(r"\s*(\d+)\.(\d+)", str(text))
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TF_VERSION = parse_version(getattr(tf, "__version__", "0.0"))
if TF_VERSION < MIN_TF_VERSION or not hasattr(tf, "compat") or not hasattr(tf.compat, "v1"):
    raise ImportError("%s; found TensorFlow %s" % (_INSTALL_HINT, getattr(tf, "__version__", "?")))

v1 = tf.compat.v1


def is_resource_variable(var):
    """Tells whether ``var`` is a resource variable (TF2 behaviour) or a ref variable.

    Args:
      var: a ``tf.Variable``.

    Returns:
      True for a resource variable.

    Example:
      >>> is_resource_variable(tf.compat.v1.get_variable("w", [2]))
    """
    # Ref variables carry a ``_ref`` dtype; resource variables a ``handle``.
    return hasattr(var, "handle") and not var.dtype._is_ref_dtype


def is_ref_tensor(tensor):
    """Tells whether ``tensor`` is a TF1 reference (a ``VariableV2`` output, or what forwards one).

    Args:
      tensor: a graph ``tf.Tensor``.

    Returns:
      True for a tensor of a ``*_ref`` dtype.

    Example:
      >>> is_ref_tensor(tf.compat.v1.get_variable("w", [2])._ref())  # TF1 behaviour
      True
    """
    return tensor.dtype._is_ref_dtype  # Private, in TF 1.15 to 2.x; as is_resource_variable above.


def is_variable(value):
    """Tells whether ``value`` is a graph variable that an optimizer can update.

    Args:
      value: anything.

    Returns:
      True for a ``tf.Variable`` (ref or resource), and for a strategy's
      distributed variable (``MirroredVariable``, ``AggregatingVariable``),
      which TF 1.15 does not derive from ``tf.Variable``.

    Example:
      >>> is_variable(tf.compat.v1.get_variable("w", [2]))
      True
    """
    if isinstance(value, tf.Variable):
        return True
    from tensorflow.python.distribute import values as values_lib  # Not exported by tf.*.

    # TF 1.15 keeps AggregatingVariable here too; TF 2.x derives both from tf.Variable.
    kinds = tuple(getattr(values_lib, name) for name in ("DistributedVariable", "AggregatingVariable")
                  if hasattr(values_lib, name))
    return isinstance(value, kinds)


def visible_gpus():
    """Lists the names of the GPUs this process sees, as ``"/gpu:i"`` strings.

    Returns:
      A list of device strings, empty on a machine without GPUs.

    Example:
      >>> visible_gpus()
      []
    """
    devices = tf.config.experimental.list_physical_devices("GPU")
    return ["/gpu:%d" % i for i in range(len(devices))]


def in_control_flow(graph=None):
    """Tells whether ops are being built inside ``tf.cond`` or ``tf.while_loop``.

    Covers both v1 control-flow contexts and the function graphs of control
    flow v2.

    Args:
      graph: the graph to ask; the default graph when ``None``.

    Returns:
      True inside a conditional or loop body.

    Example:
      >>> in_control_flow()
      False
    """
    graph = graph or tf.compat.v1.get_default_graph()
    # Neither question has a public API in TF 1.15; both attributes exist
    # from 1.15 to 2.21.
    return graph._get_control_flow_context() is not None or bool(getattr(graph, "building_function", False))


# tf.compat.v1.layers.batch_normalization takes its fused kernel for these input
# ranks (with a float16/bfloat16/float32 input and the channel axis first or
# last after the batch): rank 4 only up to TF 2.4, ranks 4 and 5 from TF 2.5
# (tensorflow/tensorflow#48115).
FUSED_BATCH_NORM_RANKS = (4, 5) if TF_VERSION >= (2, 5) else (4,)
# TF 1.15's collective group leader crashes (SIGSEGV) when the devices of one
# worker form a group of their own beside the workers' group.
TOWER_GROUPS_BESIDE_WORKERS = TF_VERSION >= (2, 0)


def add_control_inputs(op, inputs):
    """Makes the existing ``op`` wait for the ops ``inputs`` (graph mode).

    ``Operation._add_control_inputs`` is private, but present from TF 1.15
    to 2.x.

    Args:
      op: a ``tf.Operation`` already in the graph.
      inputs: ops or tensors of the same graph.

    Example:
      >>> add_control_inputs(update_op, [other_tower_mean])
    """
    op._add_control_inputs([getattr(item, "op", item) for item in inputs])


@contextlib.contextmanager
def v1_control_flow(needed=True):
    """Builds ``tf.cond`` with v1 control flow inside the block, when ``needed``.

    Ref (old-style) variables cannot be updated inside control flow v2 (the
    branch functions see plain tensors where the update kernels need refs),
    which TF2 behaviour turns on even when ``disable_resource_variables()``
    keeps ref variables. Inside this block ``tf.cond`` builds v1 ``Switch``
    and ``Merge`` ops instead, as TF 1.x does; the setting is restored after.

    Args:
      needed: when False, or when control flow v2 is off, the block changes
        nothing.

    Yields:
      None.

    Example:
      >>> with v1_control_flow(any(not is_resource_variable(v) for v in var_list)):
      ...     op = tf.cond(due, apply, tf.no_op)
    """
    if not needed or not tf.compat.v1.control_flow_v2_enabled():
        yield
        return
    tf.compat.v1.disable_control_flow_v2()
    try:
        yield
    finally:
        tf.compat.v1.enable_control_flow_v2()


def _collective_ops():
    from tensorflow.python.ops import collective_ops  # Not exported by tf.*; in TF 1.15 to 2.x.
    return collective_ops


def _collective_timeout(function, timeout_seconds):
    """``{"timeout": s}`` where the op takes one (TF 2.x); ``{}`` on TF 1.15, which has none."""
    import inspect

    if timeout_seconds is None or "timeout" not in inspect.signature(function).parameters:
        return {}
    return {"timeout": float(timeout_seconds)}


def _on_device(device):
    """``tf.device(device)``; for None no scope at all (``tf.device(None)`` would clear the caller's)."""
    return contextlib.nullcontext() if device is None else tf.device(device)


def _placed(tensor, device):
    """``tensor``, copied onto ``device`` when one is named: TF 1.15 checks that a collective's input is placed."""
    return tensor if device is None else tf.identity(tensor)


def collective_sum(tensor, group_size, group_key, instance_key, timeout_seconds=None, device=None):
    """Sums ``tensor`` over the ``group_size`` devices that run the same keys.

    TensorFlow's collective all-reduce (``CollectiveReduce``), between the
    devices of one session or of several processes. Its module is not public
    API, and its signature changed after TF 1.15 (``merge_op`` and
    ``final_op`` became optional, ``timeout`` appeared): all are passed
    explicitly, the timeout only where the op takes one.

    Args:
      tensor: this device's contribution.
      group_size: the number of devices taking part.
      group_key: int identifying the group.
      instance_key: int identifying this reduction; the same on every task.
      timeout_seconds: None, or how long the op may wait before it fails
        with ``DeadlineExceededError`` (TF 2.x; ignored on TF 1.15, whose
        collectives have no timeout).
      device: None (the enclosing device scope), or the device that runs the
        op and a copy of its input, whatever device scope is active (a
        gradient is built where the optimizer differentiates).

    Returns:
      The elementwise sum over the group.

    Example:
      >>> total = collective_sum(local_sum, 3, group_key=1, instance_key=7)
    """
    ops = _collective_ops()
    extra = _collective_timeout(ops.all_reduce, timeout_seconds)
    with _on_device(device):
        return ops.all_reduce(_placed(tensor, device), group_size, group_key, instance_key, "Add", "Id", **extra)


def collective_broadcast(tensor, send, group_size, group_key, instance_key, timeout_seconds=None, device=None):
    """Sends ``tensor`` from this task (``send``) or receives one of its shape and dtype.

    Args:
      tensor: on the sender, the value; elsewhere, a tensor of the same shape
        and dtype (its value is not used).
      send: True on the one sending task.
      group_size: the number of tasks taking part.
      group_key: int identifying the group.
      instance_key: int identifying this broadcast; the same on every task.
      timeout_seconds: as in :func:`collective_sum`.
      device: as in :func:`collective_sum`.

    Returns:
      The sender's value, on every task.

    Example:
      >>> value = collective_broadcast(flat, rank == 0, 3, group_key=1, instance_key=8)
    """
    ops = _collective_ops()
    shape, dtype = tensor.shape, tensor.dtype.base_dtype
    with _on_device(device):
        if send:
            extra = _collective_timeout(ops.broadcast_send, timeout_seconds)
            return ops.broadcast_send(_placed(tensor, device), shape, dtype, group_size, group_key, instance_key,
                                      **extra)
        extra = _collective_timeout(ops.broadcast_recv, timeout_seconds)
        return ops.broadcast_recv(shape, dtype, group_size, group_key, instance_key, **extra)


# TF 1.15's distributed collectives fail a broadcast whose sender is not the group leader ("Instance k
# found no source for broadcast", measured on 1.15.5); TF 2.21 runs it. The versions between are not
# measured and take the all-reduce below, which is exact everywhere.
BROADCAST_FROM_ANY_TASK = TF_VERSION >= (2, 21)


def collective_broadcast_from(tensor, send, sender_leads, group_size, group_key, instance_key, timeout_seconds=None,
                              device=None):
    """:func:`collective_broadcast`, or where this TF cannot send from a task that is not the group leader,
    an all-reduce to which the receivers add zeros (exact; about twice the bytes of a broadcast).

    Args:
      tensor: as in :func:`collective_broadcast`.
      send: True on the one sending task.
      sender_leads: True when the sending task is the group leader (rank 0).
      group_size: the number of tasks taking part.
      group_key: int identifying the group.
      instance_key: int identifying this exchange; the same on every task.
      timeout_seconds: as in :func:`collective_sum`.
      device: as in :func:`collective_sum`.

    Returns:
      The sender's value, on every task.

    Example:
      >>> value = collective_broadcast_from(flat, rank == 1, False, 3, group_key=1, instance_key=9)
    """
    if sender_leads or BROADCAST_FROM_ANY_TASK:
        return collective_broadcast(tensor, send, group_size, group_key, instance_key, timeout_seconds, device)
    with _on_device(device):
        mine = tensor if send else tf.zeros(tensor.shape, tensor.dtype.base_dtype)
    return collective_sum(mine, group_size, group_key, instance_key, timeout_seconds, device)


def loss_scale_optimizer_types():
    """TF's loss-scale optimizer classes that exist in this process.

    TF 1.15 exports ``tf.train.experimental.MixedPrecisionLossScaleOptimizer``,
    TF 2.x ``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer``;
    TF 1.15's contrib ``LossScaleOptimizer`` counts when contrib is loaded
    (an instance of it exists only then; importing contrib here would be slow).
    """
    found = []
    for path in ("compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer",
                 "compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer",
                 "train.experimental.MixedPrecisionLossScaleOptimizer"):
        value = tf
        for part in path.split("."):
            value = getattr(value, part, None)
        if isinstance(value, type) and value not in found:
            found.append(value)
    contrib = sys.modules.get("tensorflow.contrib.mixed_precision")
    if contrib is not None and hasattr(contrib, "LossScaleOptimizer"):
        found.append(contrib.LossScaleOptimizer)
    return tuple(found)


# ------------------------------------------------------------ tf.distribute (replica context)

# The keyword arguments a variable creator receives that ResourceVariable's
# constructor takes too (TF 1.15 to 2.x); the others (use_resource,
# expected_shape, ...) only steer the creator stack, which is bypassed.
_RESOURCE_VARIABLE_ARGS = ("initial_value", "trainable", "collections", "validate_shape", "caching_device",
                           "name", "dtype", "constraint", "synchronization", "aggregation", "shape")


def plain_resource_variable(**kwargs):
    """A ``ResourceVariable`` made directly, past every variable creator in scope.

    Under a ``tf.distribute`` strategy every ``tf.Variable`` goes through the
    strategy's creator, which mirrors it (MirroredStrategy) or wraps it
    (CentralStorageStrategy's ``AggregatingVariable``). A replica's own
    window state must be neither: constructing the class itself skips the
    creator stack (its metaclass only dispatches ``tf.Variable`` and
    ``VariableV1`` calls through it), on TF 1.15 to 2.x.

    Args:
      **kwargs: what a variable creator receives; those ResourceVariable
        does not take are dropped.

    Returns:
      The new resource variable, placed by the current device scope.

    Example:
      >>> with tf.compat.v1.variable_creator_scope(lambda _, **kw: plain_resource_variable(**kw)):
      ...     count = tf.compat.v1.Variable(0, use_resource=True)
    """
    from tensorflow.python.ops import resource_variable_ops  # Not exported by tf.*.

    import inspect
    accepted = inspect.signature(resource_variable_ops.ResourceVariable.__init__).parameters
    given = {key: value for key, value in kwargs.items()
             if key in _RESOURCE_VARIABLE_ARGS and key in accepted and value is not None}
    return resource_variable_ops.ResourceVariable(**given)


def like_distributed(value, components):
    """A distributed value of the same kind and devices as ``value``, holding ``components``.

    Args:
      value: a ``PerReplica`` or ``Mirrored`` value (one component per local
        device), or a plain tensor (then ``components`` has one entry).
      components: one tensor per component of ``value``, in its order.

    Returns:
      The ``PerReplica``/``Mirrored`` of ``components``, or ``components[0]``.

    Example:
      >>> halved = like_distributed(reduced, [t / 2 for t in strategy.experimental_local_results(reduced)])
    """
    if not hasattr(value, "values") or isinstance(value, (tf.Tensor, tf.IndexedSlices)):
        return components[0]
    from tensorflow.python.distribute import values as values_lib  # Not exported by tf.*.

    wrap = values_lib.Mirrored if isinstance(value, values_lib.Mirrored) else values_lib.PerReplica
    if TF_VERSION < (2, 0):  # TF 1.15's distributed values carry a device map.
        return wrap(value.device_map, tuple(components))
    return wrap(tuple(components))


def distributed_apply(optimizer, distribution, grads_and_vars, global_step=None, name=None):
    """A v1 optimizer's cross-replica apply: what its ``apply_gradients`` hands to ``merge_call``.

    ``Optimizer._distributed_apply`` is private, with this signature from
    TF 1.13 to 2.x. TF's own loss-scale optimizer's re-enters replica context
    to call its inner optimizer's ``apply_gradients``, which would reduce the
    (already reduced) update once more: for it, this does what it does (its
    loss scale's public ``update``, then apply when finite) with the inner
    optimizer's cross-replica apply instead.

    Args:
      optimizer: a ``tf.compat.v1.train.Optimizer``.
      distribution: the strategy (or a stand-in with its ``extended`` API).
      grads_and_vars: ``(gradient, variable)`` pairs, variables distributed.
      global_step: ``None`` or the step variable.
      name: ``None`` or the op's name.

    Returns:
      The apply op.

    Raises:
      TypeError: when ``optimizer`` has no cross-replica apply.

    Example:
      >>> op = distributed_apply(adam, strategy, reduced_pairs, global_step)
    """
    loss_scale, inner = getattr(optimizer, "_loss_scale", None), getattr(optimizer, "_optimizer", None)
    if isinstance(optimizer, loss_scale_optimizer_types()) and loss_scale is not None and inner is not None:
        grads_and_vars = list(grads_and_vars)
        update_scale, finite = loss_scale.update([grad for grad, _ in grads_and_vars])
        applied = tf.cond(finite, lambda: tf.group(distributed_apply(inner, distribution, grads_and_vars,
                                                                     global_step, name)), tf.no_op)
        return tf.group(applied, update_scale)
    apply = getattr(optimizer, "_distributed_apply", None)
    if apply is None:
        raise TypeError("%s has no cross-replica apply (_distributed_apply), so it cannot apply under a "
                        "tf.distribute strategy" % type(optimizer).__name__)
    return apply(distribution, grads_and_vars, global_step, name)


def gradient_function(op):
    """The gradient function TensorFlow's ``gradients`` would call for ``op`` (None: not differentiable).

    ``ops.get_gradient_function`` is not exported by ``tf.*``; it exists in TF
    1.15 to 2.x and honours a gradient override and, on TF 2.x, the Python-side
    ``_gradient_function`` of a ``tf.function`` call.

    Args:
      op: a graph ``tf.Operation``.

    Returns:
      A callable ``fn(op, *output_gradients)``, or None for an op registered
      as not differentiable.

    Raises:
      LookupError: when no gradient is defined for the op's type.

    Example:
      >>> gradient_function(tf.nn.tanh(x).op) is not None
      True
    """
    from tensorflow.python.framework import ops  # Not exported by tf.*.

    return ops.get_gradient_function(op)


def copy_gradient_state(original, copy):
    """Gives ``copy`` the Python-side gradient state of ``original`` (a ``tf.function`` call's).

    ``Graph.create_op`` copies a node's attributes, not what TensorFlow keeps
    on the Python ``Operation``: TF 2.x's ``_gradient_function`` (a function
    call's delayed-rewrite gradient, which rewrites the op it is given) and
    TF 1.x's ``__defun``.

    Args:
      original: the ``tf.Operation`` copied.
      copy: its copy, built with the same type and attributes.

    Example:
      >>> copy_gradient_state(call_op, copied_call_op)
    """
    function = getattr(original, "_gradient_function", None)
    if function is not None:
        copy._gradient_function = function
    defun = getattr(original, "__defun", None)
    if defun is not None:
        setattr(copy, "__defun", defun)


def function_definition(graph, name):
    """The ``FunctionDef`` named ``name`` in ``graph``'s library (or an outer graph's), or None.

    Args:
      graph: a ``tf.Graph``.
      name: the function's name (a ``func`` attribute's ``name``).

    Returns:
      A ``FunctionDef`` protocol buffer, or None when the graph has none of
      that name.

    Example:
      >>> function_definition(graph, if_op.get_attr("then_branch").name).signature.name
    """
    while graph is not None:
        function = graph._get_function(name)  # Private, in TF 1.15 to 2.x.
        if function is not None:
            return function.definition
        graph = getattr(graph, "outer_graph", None)
    return None


def op_is_stateful(op_type):
    """Tells whether the registered op type ``op_type`` is stateful (False when it is not registered).

    Args:
      op_type: an op type name, as a ``NodeDef``'s ``op``.

    Returns:
      A bool; None when no such op type is registered (a function's name).

    Example:
      >>> op_is_stateful("RandomUniform")
      True
    """
    from tensorflow.python.framework import op_def_registry  # Its API changed after TF 1.15.

    if hasattr(op_def_registry, "get"):
        op_def = op_def_registry.get(op_type)
    else:
        op_def = op_def_registry.get_registered_ops().get(op_type)
    return None if op_def is None else bool(op_def.is_stateful)


def colocating(graph):
    """Tells whether ops built now in ``graph`` are colocated with another op (``colocate_with``).

    ``tf.gradients`` with ``colocate_gradients_with_ops=True`` (always so for
    TF 2's ``tf.gradients``) builds each gradient function under
    ``colocate_with`` its forward op.

    Args:
      graph: a ``tf.Graph``.

    Returns:
      True inside a ``colocate_with`` scope.

    Example:
      >>> colocating(tf.compat.v1.get_default_graph())
      False
    """
    return any(True for _ in graph._colocation_stack.peek_objs())  # Private, in TF 1.15 to 2.x.
