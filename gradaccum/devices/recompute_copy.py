"""The copy of a recomputed block, built inside its gradient, and what its inner gradients leave out.

:func:`copy_ops` rebuilds a :class:`~gradaccum.devices.recompute_walk.Walk`'s
ops from the gated boundary, each on its original op's device. A reused op
(a random op, ``Print``) is not run again: the copy reads its forward
outputs through a *stand-in* ``IdentityN`` whose gradient is the reused op's
own gradient function, given the copy's inputs, so that the gradient still
flows to what is upstream of it (a ``tf.random.gamma`` sample to its
``alpha``, a ``Print`` to its input).

The stand-ins' gradient is registered once per process under
``"GradaccumRecomputeReused"``. This module creates no variables and no
collections.
"""
import contextlib

from gradaccum import _compat
from gradaccum._compat import is_ref_tensor, tf
from gradaccum.devices import recompute_walk

REUSED_GRADIENT_NAME = "GradaccumRecomputeReused"


def copy_ops(walk, mapping):
    """Copies ``walk``'s ops (in creation order) with inputs remapped through ``mapping``; fills ``mapping``.

    An input that ``mapping`` lacks (a constant's, a reused op's without a
    gradient to pass on) is the forward tensor, read as it is. A control
    input on an op of the block that is not copied is dropped: it ran in the
    forward pass, before the gradient the copy waits for.

    Args:
      walk: a ``Walk``.
      mapping: ``{forward tensor name: tensor}``, holding the gated boundary.
    """
    graph = tf.compat.v1.get_default_graph()
    copies, reused = {}, set(walk.reused)
    for op in sorted(walk.ops + walk.reused, key=walk.order.get):
        if op in reused:
            _stand_in(op, mapping)
            continue
        inputs = [mapping.get(tensor.name, tensor) for tensor in op.inputs]
        controls = [copies.get(control, control) for control in op.control_inputs
                    if control in copies or control not in walk.order]
        attrs = {key: value for key, value in op.node_def.attr.items()}
        with _on_device(op.device), tf.control_dependencies(controls):
            copy = graph.create_op(op.type, inputs, [t.dtype for t in op.outputs], name=op.name.split("/")[-1],
                                   attrs=attrs, op_def=op.op_def)
        _compat.copy_gradient_state(op, copy)
        copies[op] = copy
        for original, copied in zip(op.outputs, copy.outputs):
            mapping[original.name] = copied


def _on_device(device):
    """The original op's device (an empty one: the enclosing scope's; ``tf.device(None)`` would clear it)."""
    return tf.compat.v1.device(device) if device else contextlib.nullcontext()


def _stand_in(op, mapping):
    """Maps a reused op's outputs to a stand-in whose gradient reaches the copy's inputs of ``op``."""
    indices = [i for i, tensor in enumerate(op.inputs)
               if recompute_walk.differentiable(tensor) and tensor.name in mapping]
    if not indices or _gradient_or_lookup_error(op) is None:
        return  # Nothing upstream to reach: the copy reads the forward outputs as they are.
    graph = tf.compat.v1.get_default_graph()
    with _on_device(op.device), graph.gradient_override_map({"IdentityN": REUSED_GRADIENT_NAME}):
        stand = tf.identity_n(list(op.outputs) + [mapping[op.inputs[i].name] for i in indices])
    stand[0].op._gradaccum_reused = (op, indices)
    for original, standing in zip(op.outputs, stand):
        mapping[original.name] = standing


def _gradient_or_lookup_error(op):
    """The op's gradient function; a stand-in function that raises TensorFlow's LookupError when it has none."""
    try:
        return _compat.gradient_function(op)
    except LookupError as error:
        message = str(error)

        def raising(*unused):
            raise LookupError(message)
        return raising


class _WithInputs(object):
    """A forward op as its gradient function sees it, with the copy's tensors as its inputs."""

    def __init__(self, op, inputs):
        self._op = op
        self.inputs = inputs
        self.outputs = list(op.outputs)

    def __getattr__(self, name):
        return getattr(self._op, name)


def reused_gradient(stand, *grads):
    """The stand-in's gradient: None for the forward outputs, the reused op's gradient for the copy's inputs.

    Args:
      stand: the stand-in ``IdentityN``.
      *grads: the gradients of its outputs.

    Returns:
      One gradient (or None) per input of the stand-in.
    """
    op, indices = stand._gradaccum_reused
    count = len(op.outputs)
    inputs = list(op.inputs)
    for position, index in enumerate(indices):
        inputs[index] = stand.inputs[count + position]
    result = _gradient_or_lookup_error(op)(_WithInputs(op, inputs), *grads[:count])
    result = list(result) if isinstance(result, (list, tuple)) else [result]
    return [None] * count + [result[index] for index in indices]


def is_filled_zero(grad):
    """True for a gradient known to be zero: what TensorFlow fills in for an output nobody differentiates.

    ``tf.gradients`` gives a float output of a multi-output op that no path
    from the loss reaches ``ZerosLike(output)`` (inside a loop, zeros of its
    shape). Taken as a real gradient, it would keep the forward output alive
    and send zeros where the plain model sends no gradient.
    """
    if not isinstance(grad, tf.Tensor):
        return False
    if grad.op.type == "ZerosLike":  # Zeros whatever its input: TensorFlow's filler for ``output``.
        return True
    if grad.op.type == "Fill":
        return _static_zero(grad.op.inputs[1]) is True
    return _static_zero(grad) is True


def _static_zero(tensor):
    """True when ``tensor``'s value is known to be all zeros, False when known otherwise, None when unknown."""
    value = tf.get_static_value(tensor)
    return None if value is None else not value.any()


def left_out(walk, routed, outputs):
    """The names of ``routed`` boundary tensors whose gradient the copy cannot give, and no optimizer needs.

    A boundary tensor that depends on no variable (a fed side input, a
    constant) and whose only paths to ``outputs`` cross an op without a
    gradient (``ResizeArea``) is left out of the copy's gradients: the
    plain model's gradients reach it only when it is asked for by name. One
    that depends on a variable stays in, and the missing gradient raises
    TensorFlow's ``LookupError``, as in the plain model.

    Args:
      walk: the block's ``Walk``.
      routed: its differentiable boundary tensors.
      outputs: the outputs whose gradients arrived.

    Returns:
      A set of tensor names.
    """
    needed = _ancestors(walk, outputs)
    blocked = set(op for op in needed if _lacks_gradient(op))
    if not blocked:
        return set()
    return set(tensor.name for tensor in routed
               if _reaches(tensor, blocked, needed) and not _depends_on_variable(tensor))


def _ancestors(walk, outputs):
    """The copied and reused ops on a path to ``outputs``."""
    members, found, todo = set(walk.ops + walk.reused), set(), [t.op for t in outputs]
    while todo:
        op = todo.pop()
        if op in members and op not in found:
            found.add(op)
            todo += [tensor.op for tensor in op.inputs]
    return found


def _lacks_gradient(op):
    try:
        _compat.gradient_function(op)
    except LookupError:
        return True
    return False


def _reaches(tensor, targets, within):
    """True when a differentiable path from ``tensor`` through ops of ``within`` reaches one of ``targets``."""
    seen, todo = set(), [tensor]
    while todo:
        current = todo.pop()
        for consumer in current.consumers():
            if consumer in within and consumer not in seen:
                seen.add(consumer)
                if consumer in targets:
                    return True
                todo += [t for t in consumer.outputs if recompute_walk.differentiable(t)]
    return False


def _depends_on_variable(tensor):
    """True when ``tensor`` is, or is computed from, a variable (a ref or resource tensor upstream)."""
    seen, todo = set(), [tensor]
    while todo:
        current = todo.pop()
        if is_ref_tensor(current) or current.dtype.base_dtype == tf.resource:
            return True
        if current.op not in seen:
            seen.add(current.op)
            todo += list(current.op.inputs)
    return False
