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

Exact: the copy runs the same kernels on the same values. What each op of
the block becomes is decided by what it means for gradients
(``recompute_walk``): stateless ops are copied; a stateful op that touches
no variable (dropout's ``RandomUniform``, ``tf.random.gamma``, ``Print``,
``check_numerics``) is not run again: the copy reads its forward output,
which is therefore kept until the backward pass, and its gradient still
reaches its inputs (``recompute_copy``). Ops the outputs only wait for
(assertions, ``tf.print``) ran in the forward pass and are not copied.
Update ops (batch norm's moving averages, ``gradaccum.batch_normalization``'s
window statistics) are not ancestors of the outputs, so they are not copied
and run once per forward pass. An output whose gradient is only the zeros
TensorFlow fills in for an output nothing differentiates counts as unused.

The copies are built with ``Graph.create_op`` in the current control-flow
context, so a block works inside ``tf.while_loop`` (``subdivisions.minimize``),
under ``tf.compat.v1`` reference variables and resource variables alike.

Variables and collections: creates none. The gradient functions are
registered once per process under the names ``"GradaccumRecompute"`` and
``"GradaccumRecomputeReused"``.
"""
import functools

from gradaccum import _compat
from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.devices import recompute_copy
from gradaccum.devices import recompute_walk

GRADIENT_NAME = recompute_walk.GRADIENT_NAME
_registered = []


def recompute(block):
    """Marks ``block`` for recomputation: only its inputs are kept, its forward pass runs again in backprop.

    ``recompute(block)(*args, **kwargs)`` builds ``block(*args, **kwargs)`` as
    a plain call would (same ops, same variables) and returns its result.
    The gradients of the block's outputs with respect to everything before
    the block (its inputs, the variables it reads) are those of the plain
    call, while the block's intermediate tensors are freed after the forward
    pass and computed again, from the kept inputs, when the gradient of the
    block's outputs arrives. A tensor *inside* the block is not on the
    gradient's path: its gradient is ``None``, and ``stop_gradients`` naming
    it changes nothing. Usable as a decorator.

    Args:
      block: a callable that builds graph ops from tensors (for example a
        transformer or residual block) and returns a tensor or a nested
        structure of tensors (other values pass through).

    Returns:
      A callable with ``block``'s signature.

    Raises:
      TypeError: when ``block`` is not callable.
      RuntimeError: when the returned callable is called under eager execution.
      ValueError: when the returned callable's block returns no tensor, or
        holds an op that recomputing cannot handle: one that changes a
        variable or another resource (an assignment, a queue, also one the
        outputs only wait for), v1 control flow (``tf.cond`` or
        ``tf.while_loop`` under TF 1.x behaviour), a function call or TF 2
        control flow whose functions hold such an op or a random op, or
        another recomputed block; the message names the op and the reason.

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
    """Registers the recomputing gradients once per process (``tf.RegisterGradient`` refuses a second time)."""
    if _registered:
        return
    for name, function in ((GRADIENT_NAME, _gradient), (recompute_copy.REUSED_GRADIENT_NAME,
                                                          recompute_copy.reused_gradient)):
        try:
            tf.RegisterGradient(name)(function)
        except KeyError:  # By an earlier import of this module (a reload): its function reads the same attribute.
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
    """One recomputed block: its walk (ops to copy, boundary, reused ops) and its routed outputs."""

    def __init__(self, block, created, inputs, outputs):
        self.outputs = outputs
        self.walk = recompute_walk.Walk(_block_name(block), created, inputs, outputs)

    def route(self):
        """The outputs, through one ``IdentityN`` with the recomputing gradient (its inputs: outputs + boundary)."""
        graph = self.outputs[0].graph
        self._routed = [t for t in self.walk.boundary if recompute_walk.differentiable(t)]
        with tf.compat.v1.name_scope("recompute"), graph.gradient_override_map({"IdentityN": GRADIENT_NAME}):
            routed = tf.identity_n(self.outputs + self._routed)
        routed[0].op._gradaccum_recompute = self
        return routed[:len(self.outputs)]

    def boundary_gradients(self, incoming):
        """The gradients of the routed boundary tensors, from a copy of the block built after ``incoming``.

        An incoming gradient that is TensorFlow's zeros for an output nothing
        differentiates counts as none. The copy is built outside any
        ``colocate_with`` (gradient colocation would pull it onto the
        ``IdentityN``'s device): each copied op keeps its original's device,
        and its gradients follow it when the caller colocates them.
        """
        wanted = [(out, grad) for out, grad in zip(self.outputs, incoming)
                  if grad is not None and not recompute_copy.is_filled_zero(grad)]
        if not wanted:
            return [None] * len(self._routed)
        graph = tf.compat.v1.get_default_graph()
        colocate = _compat.colocating(graph)
        grad_ys = [tf.convert_to_tensor(grad) for _, grad in wanted]  # A sparse incoming gradient, densified.
        left_out = recompute_copy.left_out(self.walk, self._routed, [out for out, _ in wanted])
        uncolocated = tf.compat.v1.colocate_with(None, ignore_existing=True)
        with uncolocated, tf.compat.v1.name_scope("recompute"):
            with tf.control_dependencies(grad_ys):
                # Every copied op waits for the incoming gradient: nothing is recomputed before it is needed,
                # and no copy equals a forward op for common-subexpression elimination.
                mapping = {t.name: tf.identity(t) for t in self.walk.boundary}
                recompute_copy.copy_ops(self.walk, mapping)
            xs = [mapping[t.name] for t in self._routed if t.name not in left_out]
            ys = [mapping.get(out.name, out) for out, _ in wanted]
            found = iter(tf.compat.v1.gradients(ys, xs, grad_ys=grad_ys, colocate_gradients_with_ops=colocate))
        return [None if t.name in left_out else next(found) for t in self._routed]
