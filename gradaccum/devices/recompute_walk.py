"""Which ops of a recomputed block are copied, read as they are, or refused, by what they mean for gradients.

:class:`Walk` starts at a block's outputs and follows the ops' inputs back
to the block's *boundary* (what it reads from outside, and the values of the
variables it reads). Each op on the way gets a rule from what it is, never
from a list of the op types seen so far:

* a stateless op is copied (one without inputs, a constant, is read as it
  is); one that calls functions (a ``tf.function`` call, TF 2's
  ``tf.cond``/``tf.while_loop``) is copied when nothing in the functions
  changes state or draws random numbers, with its Python-side gradient;
* a stateful op that reads or writes no variable and no other resource (a
  random op, ``Print``, ``check_numerics``) is *reused*: the copy reads its
  forward outputs, and its gradient still flows to its inputs through its
  registered gradient function, applied to the copy's inputs;
* an op that changes a variable or another resource, v1 control flow
  (``Merge``, ``Exit``, ``NextIteration``: a copy op by op cannot rebuild
  a loop or a condition) and another recomputed block are refused, in a
  ``ValueError`` that names the op and the reason.

Ops reached only through control inputs (an assertion, its guard, a
``Print`` a result waits for) ran in the forward pass and are not copied;
they are refused only when they change state.

This module creates no variables and no collections.
"""
from gradaccum import _compat
from gradaccum._compat import is_ref_tensor, tf

GRADIENT_NAME = "GradaccumRecompute"
# Ops that return a variable's value (read as they are: part of the boundary, differentiated by the caller).
VARIABLE_READ_OPS = frozenset(["ReadVariableOp", "ResourceGather", "ResourceGatherNd"])
# What a block reads from outside even when built inside it: variables, their values, fed values, and what an
# enclosing loop or condition captures (an Enter or Switch that the block's use of an outer tensor creates).
BOUNDARY_OPS = VARIABLE_READ_OPS | frozenset([
    "VariableV2", "Variable", "VarHandleOp", "Placeholder", "PlaceholderWithDefault", "Enter", "RefEnter",
    "Switch", "RefSwitch",
])
# Where v1 control flow joins branches or iterations: ops that only make sense with their loop or condition.
V1_CONTROL_FLOW_OPS = frozenset(["Merge", "RefMerge", "Exit", "RefExit", "NextIteration", "RefNextIteration",
                                 "LoopCond"])
COPY, CONSTANT, REUSE = "copy", "constant", "reuse"


def differentiable(tensor):
    """True for a tensor a gradient can flow through (float, complex, or a resource handle)."""
    dtype = tensor.dtype.base_dtype
    return dtype.is_floating or dtype.is_complex or dtype == tf.resource


def is_recompute_op(op):
    """True for the ``IdentityN`` that routes a recomputed block's outputs."""
    try:
        return op.type == "IdentityN" and op.get_attr("_gradient_op_type") == GRADIENT_NAME.encode()
    except ValueError:
        return False


def _has_resource_input(op):
    return any(tensor.dtype.base_dtype == tf.resource for tensor in op.inputs)


def _functions(op):
    """The names of the functions ``op`` calls (its ``func`` attributes, or its type when it is one)."""
    names = []
    for value in op.node_def.attr.values():
        names += [value.func.name] if value.HasField("func") else [f.name for f in value.list.func]
    if _compat.op_is_stateful(op.type) is None:  # A function called by its name (TF 1.x's Defun).
        names.append(op.type)
    return names


class Walk(object):
    """The ops of one block between its boundary and its outputs, sorted by what recomputing does with them.

    Attributes:
      name: the block's name, for messages.
      boundary: the tensors the copy reads as they are (through a gate that waits for the gradient).
      ops: the ops to copy, in creation order.
      reused: the stateful ops whose forward outputs the copy reads, in creation order.
      order: ``{op: creation index}`` for the ops the block built.
    """

    def __init__(self, name, created, inputs, outputs):
        self.name = name
        self.order = {op: index for index, op in enumerate(created)}
        self._inputs = set(tensor.name for tensor in inputs)
        self.boundary, self.ops, self.reused = [], [], []
        data, controls = self._walk_data(outputs)
        self._check_control_only(controls, data)
        self.ops.sort(key=self.order.get)
        self.reused.sort(key=self.order.get)

    def _is_boundary(self, tensor):
        return (tensor.name in self._inputs or tensor.op not in self.order or is_ref_tensor(tensor)
                or tensor.dtype.base_dtype == tf.resource or tensor.op.type in BOUNDARY_OPS)

    def _walk_data(self, outputs):
        """Sorts the ops whose outputs the copy needs; returns them and the ops reached through control inputs."""
        seen, done, todo, controls = set(), set(), [], []

        def visit(tensor):
            if tensor.name not in seen:
                seen.add(tensor.name)
                (self.boundary.append if self._is_boundary(tensor) else todo.append)(tensor)

        for tensor in outputs:
            visit(tensor)
        while todo:
            op = todo.pop().op
            if op in done:
                continue
            done.add(op)
            kind = self._kind(op)
            controls += [control for control in op.control_inputs if control in self.order]
            if kind == COPY:
                self.ops.append(op)
            elif kind == REUSE:
                self.reused.append(op)
            for tensor in op.inputs if kind != CONSTANT else ():
                if kind == COPY or differentiable(tensor):
                    visit(tensor)
                elif tensor.op in self.order:  # A random op's shape: not needed by the copy.
                    controls.append(tensor.op)
        return done, controls

    def _check_control_only(self, todo, done):
        """Refuses an op that changes state among those the outputs wait for (they are not run again)."""
        done = set(done)
        while todo:
            op = todo.pop()
            if op in done:
                continue
            done.add(op)
            if is_recompute_op(op):
                self._refuse(op, "belongs to another recomputed block: mark either the outer block or the inner ones")
            if op.type not in VARIABLE_READ_OPS:
                self._check_state(op)
            todo += [tensor.op for tensor in op.inputs if tensor.op in self.order]
            todo += [control for control in op.control_inputs if control in self.order]

    def _kind(self, op):
        """``COPY``, ``CONSTANT`` or ``REUSE`` for an op whose outputs the copy needs; raises when none fits."""
        if is_recompute_op(op):
            self._refuse(op, "belongs to another recomputed block: mark either the outer block or the inner ones")
        if op.type in V1_CONTROL_FLOW_OPS:
            self._refuse(op, "is v1 control flow (from tf.cond or tf.while_loop under TF 1.x behaviour), which a "
                             "copy op by op cannot rebuild; move the loop or condition out of the block, or build "
                             "it with control flow v2 (tf.compat.v1.enable_control_flow_v2())")
        self._check_state(op)
        functions = _functions(op)
        if functions:
            self._check_functions(op, functions, set())
            return COPY
        if not op.op_def.is_stateful:
            return COPY if op.inputs else CONSTANT
        return REUSE

    def _check_state(self, op):
        """Refuses an op that changes a variable in place or acts on a resource other than by reading it."""
        if any(arg.is_ref for arg in op.op_def.input_arg):  # Assign and its kin are not marked stateful.
            self._refuse(op, "is stateful: it changes a variable in place (run again by the copy, or read changed "
                             "by it, it would make the gradients inexact); build it outside the block")
        if op.op_def.is_stateful and _has_resource_input(op) and not _functions(op):
            self._refuse(op, "is stateful: it acts on a resource (a variable, a queue, a table, an iterator) other "
                             "than by reading a variable's value, which recomputing would do again; build it "
                             "outside the block")

    def _check_functions(self, op, names, seen):
        """Refuses a function-calling op whose functions hold an op that must not run again."""
        for name in names:
            if name in seen:
                continue
            seen.add(name)
            definition = _compat.function_definition(op.graph, name)
            if definition is None:
                self._refuse(op, "calls the function %r, which is not in the graph's library" % name)
            for node in definition.node_def:
                inner = [value.func.name for value in node.attr.values() if value.HasField("func")]
                inner += [f.name for value in node.attr.values() for f in value.list.func]
                stateful = _compat.op_is_stateful(node.op)
                if stateful is None:
                    inner.append(node.op)
                elif stateful and node.op not in VARIABLE_READ_OPS and not inner:
                    self._refuse(op, "%s; its function %r holds the stateful op %r of type %s, which recomputing "
                                     "would run again; build it outside the block"
                                     % (_calls(op), name, node.name, node.op))
                self._check_functions(op, inner, seen)

    def _refuse(self, op, reason):
        raise ValueError("gradaccum.recompute cannot recompute block %s: op %r of type %s %s"
                         % (self.name, op.name, op.type, reason))


def _calls(op):
    """What a function-calling op is, for a message."""
    attrs = set(op.node_def.attr)
    if attrs & {"then_branch", "else_branch", "branches", "body", "cond"}:
        return "is TF 2 control flow (tf.cond, tf.case, tf.while_loop or tf.map_fn with control flow v2)"
    return "calls a function (a tf.function or another function call)"
