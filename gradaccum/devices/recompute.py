"""Recomputation: a block's activations are not kept, its forward pass runs again in the backward pass.

``h = gradaccum.recompute(block)(h)`` builds ``block`` once, as it would be
built without the call, and routes its outputs through one ``IdentityN`` op
whose inputs are the outputs and the block's *boundary*: the tensors the
block reads from outside (its arguments, tensors it captures) and the
variables it reads (the ref tensor of a TF1 reference variable, or the
value a ``ReadVariableOp`` returned, or the handle a ``ResourceGather``
takes). The ``IdentityN`` carries a gradient of its own: none flows into the
kept forward ops, so TensorFlow frees their activations once the forward
pass has used them; the boundary's gradients are those of a copy of the
block's ops, built inside the gradient function. The copy's inputs wait for
the incoming gradient (a control dependency), so it runs just before its
gradients are needed, and Grappler cannot merge it with the forward ops.

Exact: the copy runs the same kernels on the same values, and a stateful
random op (dropout's ``RandomUniform``) is not copied: the copy reads the
forward op's output, which is therefore kept until the backward pass (the
memory of one such tensor per random op). Stateless random ops are copied.
Update ops (batch norm's moving averages, ``gradaccum.batch_normalization``'s
window statistics) are not ancestors of the outputs, so they are not copied
and run once per forward pass.

The copies are built with ``Graph.create_op`` in the current control-flow
context, so a block works inside ``tf.while_loop`` (``subdivisions.minimize``),
under ``tf.compat.v1`` reference variables and resource variables alike.

Variables and collections: creates none. The gradient function is
registered once per process under the name ``"GradaccumRecompute"``.
"""
import contextlib
import functools

from gradaccum import _validate
from gradaccum._compat import is_ref_tensor, tf

GRADIENT_NAME = "GradaccumRecompute"
# Stateful random ops: the copy reads the forward op's output (same values, kept until the backward pass).
_RANDOM_OPS = frozenset([
    "RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt", "RandomShuffle",
    "Multinomial", "RandomGamma", "RandomPoisson", "RandomPoissonV2", "ParameterizedTruncatedNormal",
    "StatefulUniform", "StatefulUniformInt", "StatefulUniformFullInt", "StatefulStandardNormalV2",
    "StatefulTruncatedNormal", "RngReadAndSkip", "RngSkip", "RandomCrop",
])
# Stateful ops that have done their work in the forward pass: not run again.
_ONCE_OPS = frozenset(["Assert", "Print", "PrintV2"])
# Read as they are, without waiting for the gradient: constants (gradient functions and Grappler fold them).
_CONSTANT_OPS = frozenset(["Const", "HostConst"])
# Tensors of these ops are read as they are: variables, their values, and what a loop or function captures.
_BOUNDARY_OPS = frozenset([
    "VariableV2", "Variable", "VarHandleOp", "ReadVariableOp", "Placeholder", "PlaceholderWithDefault",
    "Enter", "RefEnter", "Switch", "RefSwitch", "ResourceGather", "ResourceGatherNd",
])
# v1 control flow cannot be copied op by op. (An Enter or Switch is what an enclosing loop or condition
# captures a tensor through: part of the boundary; a block's own loop or condition ends in these.)
_CONTROL_FLOW_OPS = frozenset(["Merge", "RefMerge", "Exit", "RefExit", "NextIteration",
                               "RefNextIteration", "LoopCond"])
_registered = []


def recompute(block):
    """Marks ``block`` for recomputation: only its inputs are kept, its forward pass runs again in backprop.

    ``recompute(block)(*args, **kwargs)`` builds ``block(*args, **kwargs)`` as
    a plain call would (same ops, same variables, same values) and returns
    its result; the gradients of everything before and inside the block are
    those of the plain call, while the block's intermediate tensors are freed
    after the forward pass and computed again, from the kept inputs, when
    the gradient of the block's outputs arrives. Usable as a decorator.

    Args:
      block: a callable that builds graph ops from tensors (for example a
        transformer or residual block) and returns a tensor or a nested
        structure of tensors (other values pass through).

    Returns:
      A callable with ``block``'s signature.

    Raises:
      TypeError: when ``block`` is not callable.
      RuntimeError: when the returned callable is called under eager execution.
      ValueError: when the returned callable's block returns no tensor, holds
        a stateful op other than a random op, a variable read or an
        assertion (an assignment, a queue, a collective), holds v1 control
        flow (``tf.cond``/``tf.while_loop`` built with v1 control flow) or
        another recomputed block; the message names the op.

    Example:
      >>> for i in range(12):
      ...     h = gradaccum.recompute(transformer_block)(h, name="block_%d" % i)
    """
    if not callable(block):
        raise TypeError("`block` must be callable, got %s" % _validate.describe(block))

    @functools.wraps(block)
    def recomputed(*args, **kwargs):
        return _call(block, args, kwargs)
    return recomputed


def _call(block, args, kwargs):
    """Builds ``block`` once and routes its outputs through the recomputing ``IdentityN``."""
    if tf.executing_eagerly():
        raise RuntimeError("gradaccum.recompute builds graph-mode ops, but eager execution is enabled: call "
                           "tf.compat.v1.disable_eager_execution() first")
    _register_gradient()
    graph = tf.compat.v1.get_default_graph()
    before = len(graph.get_operations())
    result = block(*args, **kwargs)
    created = graph.get_operations()[before:]
    flat = tf.nest.flatten(result)
    outputs = [value for value in flat if isinstance(value, tf.Tensor)]
    if not outputs:
        raise ValueError("gradaccum.recompute: `block` %s must return a tensor or a structure of tensors, got %s"
                         % (_block_name(block), _validate.describe(result)))
    inputs = [value for value in tf.nest.flatten((args, kwargs)) if isinstance(value, tf.Tensor)]
    plan = _Plan(block, created, inputs, outputs)
    routed = iter(plan.route())
    return tf.nest.pack_sequence_as(result, [next(routed) if isinstance(v, tf.Tensor) else v for v in flat])


def _block_name(block):
    return repr(getattr(block, "__name__", block))


def _register_gradient():
    """Registers the recomputing gradient once per process (``tf.RegisterGradient`` refuses a second time)."""
    if _registered:
        return
    try:
        tf.RegisterGradient(GRADIENT_NAME)(_gradient)
    except KeyError:  # By an earlier import of this module (a reload): its function reads the same op attribute.
        pass
    _registered.append(GRADIENT_NAME)


def _gradient(op, *grads):
    """The ``IdentityN``'s gradient: None for the outputs, the recomputed block's for the boundary."""
    plan = getattr(op, "_gradaccum_recompute", None)
    if plan is None:
        raise ValueError("gradaccum.recompute: the op %r was not built by gradaccum.recompute in this process "
                         "(a graph imported from a MetaGraphDef): build the gradients where the model is built"
                         % op.name)
    return [None] * len(plan.outputs) + plan.boundary_gradients(grads[:len(plan.outputs)])


class _Plan(object):
    """One recomputed block: its ops to copy (in creation order), its boundary and its reused tensors."""

    def __init__(self, block, created, inputs, outputs):
        self.name = _block_name(block)
        self.outputs = outputs
        self._order = {op: index for index, op in enumerate(created)}
        self._inputs = set(tensor.name for tensor in inputs)
        self.boundary, self.ops, self.reused = [], [], set()
        self._walk()

    def _is_boundary(self, tensor):
        return (tensor.name in self._inputs or tensor.op not in self._order or is_ref_tensor(tensor)
                or tensor.dtype.base_dtype == tf.resource or tensor.op.type in _BOUNDARY_OPS)

    def _walk(self):
        """Finds the ops between the boundary and the outputs; raises for what cannot be recomputed."""
        seen_tensors, seen_ops, todo = set(), set(), []

        def visit_tensor(tensor):
            if tensor.name in seen_tensors:
                return
            seen_tensors.add(tensor.name)
            if self._is_boundary(tensor):
                self.boundary.append(tensor)
            else:
                todo.append(tensor.op)

        for tensor in self.outputs:
            visit_tensor(tensor)
        while todo:
            op = todo.pop()
            if op in seen_ops:
                continue
            seen_ops.add(op)
            if self._kept_as_is(op):
                continue
            self.ops.append(op)
            for tensor in op.inputs:
                visit_tensor(tensor)
            todo.extend(control for control in op.control_inputs if control in self._order)
        self.ops.sort(key=self._order.get)

    def _kept_as_is(self, op):
        """True for an op whose forward outputs the copy reads; raises for an op that cannot be copied."""
        if op.type in _RANDOM_OPS or op.type in _ONCE_OPS or op.type in _CONSTANT_OPS:
            self.reused.add(op)
            return True
        if op.type in _CONTROL_FLOW_OPS:
            raise ValueError("gradaccum.recompute cannot recompute block %s: it holds v1 control flow (op %r of "
                             "type %s, from tf.cond or tf.while_loop); move the loop or condition out of the block, "
                             "or build it with control flow v2" % (self.name, op.name, op.type))
        if _is_recompute_op(op):
            raise ValueError("gradaccum.recompute cannot recompute block %s: it holds another recomputed block "
                             "(op %r); mark either the outer block or the inner ones" % (self.name, op.name))
        if op.op_def.is_stateful or any(arg.is_ref for arg in op.op_def.input_arg):  # Assign is not marked.
            raise ValueError("gradaccum.recompute cannot recompute block %s: its op %r of type %s is stateful "
                             "(recomputing it would run it twice); build it outside the block"
                             % (self.name, op.name, op.type))
        return False

    def route(self):
        """The outputs, through one ``IdentityN`` with the recomputing gradient (its inputs: outputs + boundary)."""
        graph = self.outputs[0].graph
        self._routed = [t for t in self.boundary if _differentiable(t)]
        with tf.compat.v1.name_scope("recompute"), graph.gradient_override_map({"IdentityN": GRADIENT_NAME}):
            routed = tf.identity_n(self.outputs + self._routed)
        routed[0].op._gradaccum_recompute = self
        return routed[:len(self.outputs)]

    def boundary_gradients(self, incoming):
        """The gradients of the routed boundary tensors, from a copy of the block built after ``incoming``."""
        wanted = [(out, grad) for out, grad in zip(self.outputs, incoming) if grad is not None]
        if not wanted:
            return [None] * len(self._routed)
        grad_ys = [tf.convert_to_tensor(grad) for _, grad in wanted]  # A sparse incoming gradient, densified.
        with tf.compat.v1.name_scope("recompute"), tf.control_dependencies(grad_ys):
            # Every copied op waits for the incoming gradient: nothing is recomputed before it is needed,
            # and no copy equals a forward op for common-subexpression elimination.
            mapping = {t.name: tf.identity(t) for t in self.boundary}
            gated = [mapping[t.name] for t in self._routed]
            _copy_ops(self.ops, mapping)
        ys = [_mapped(out, mapping) for out, _ in wanted]
        return list(tf.compat.v1.gradients(ys, gated, grad_ys=grad_ys))


def _copy_ops(ops, mapping):
    """Copies ``ops`` (in creation order) with inputs remapped through ``mapping``; fills ``mapping``.

    An input that ``mapping`` lacks (a random op's, a constant's) is the forward tensor, read as it is.
    """
    graph = tf.compat.v1.get_default_graph()
    copies = {}
    for op in ops:
        inputs = [_mapped(tensor, mapping) for tensor in op.inputs]
        controls = [copies.get(control, control) for control in op.control_inputs]
        attrs = {key: value for key, value in op.node_def.attr.items()}
        with _on_device(op.device), tf.control_dependencies(controls):
            copy = graph.create_op(op.type, inputs, [t.dtype for t in op.outputs], name=op.name.split("/")[-1],
                                   attrs=attrs, op_def=op.op_def)
        copies[op] = copy
        for original, copied in zip(op.outputs, copy.outputs):
            mapping[original.name] = copied
    return copies


def _on_device(device):
    """The original op's device (an empty one: the enclosing scope's; ``tf.device(None)`` would clear it)."""
    return tf.compat.v1.device(device) if device else contextlib.nullcontext()


def _mapped(tensor, mapping):
    """The copy's tensor for a forward tensor (a random op's or a constant's output is itself)."""
    return mapping.get(tensor.name, tensor)


def _differentiable(tensor):
    dtype = tensor.dtype.base_dtype
    return dtype.is_floating or dtype.is_complex or dtype == tf.resource


def _is_recompute_op(op):
    try:
        return op.type == "IdentityN" and op.get_attr("_gradient_op_type") == GRADIENT_NAME.encode()
    except ValueError:
        return False
