"""A later tower that may have no example: its model runs only when it has one.

``gradaccum.tower.minimize`` builds tower ``i > 0`` through :func:`run_if`
when the tower's example count is known only when the graph runs. The
tower's model and gradients are built inside ``tf.cond(count > 0, ...)``;
the other branch gives what an empty tower contributes, all zeros: a loss
of 0, zero gradients (an empty ``IndexedSlices`` for a sparse one) and
per-example outputs with no rows. The tower's weight is its count, 0 then,
so the average is exactly the towers' that have examples.

No kernel ever sees the empty shard: some cannot take one (TF 1.15's fused
LSTM aborts the process). The variables already exist (the first tower,
never empty, created them), so the branch only reads them. The cond is a
v1 one in either TF behaviour, so the tower's ops stay in the graph, placed
on the tower's device, and a run of the loss alone prunes the gradients.
Ops the branch adds to ``UPDATE_OPS`` cannot be run from outside it; both
forms only guard towers whose update ops they do not run (the one-run form
guards a later tower's first micro-batch). Variables: none. Collections:
none of its own.
"""
from gradaccum._compat import tf, v1_control_flow


def run_if(has_examples, build, first_outputs):
    """``build()`` when ``has_examples`` is true at run time, else an empty tower's zeros.

    Args:
      has_examples: a scalar bool tensor.
      build: a callable with no argument returning ``(loss, grads_and_vars,
        outputs)``: a scalar loss (or a list of scalars: a loss and a
        weight), ``(gradient, variable)`` pairs (a gradient may be ``None``
        or an ``IndexedSlices``) and a list of per-example tensors.
      first_outputs: the first tower's ``outputs``, whose shapes give the
        empty outputs theirs when the built ones' are not static.

    Returns:
      ``(loss, grads_and_vars, outputs)`` as ``build`` returns them, each
      tensor now the output of the ``tf.cond``.

    Example:
      >>> loss, grads_and_vars, outputs = run_if(size > 0, build, first_outputs)
    """
    built = {}

    def present():
        loss, grads_and_vars, outputs = build()
        scalars = loss if isinstance(loss, list) else [loss]
        built.update(scalars=scalars, grads_and_vars=grads_and_vars, outputs=outputs)
        return scalars + _flat_gradients(grads_and_vars) + list(outputs)

    def absent():
        # tf.cond builds `present` first, so `built` describes what to mirror.
        zeros = [tf.zeros([], scalar.dtype) for scalar in built["scalars"]]
        for grad, var in built["grads_and_vars"]:
            zeros.extend(_zero_gradient(grad, var))
        return zeros + [_no_rows(out, first) for out, first in zip(built["outputs"], first_outputs)]

    # v1 control flow in either behaviour: the tower's ops stay in the graph (placed,
    # inspectable), and a run that fetches only the loss prunes the gradients.
    with v1_control_flow():
        flat = tf.compat.v1.cond(has_examples, present, absent, strict=True, name="has_examples")
    outputs = flat[len(flat) - len(built["outputs"]):]
    scalars = len(built["scalars"])
    loss = flat[:scalars] if scalars > 1 else flat[0]
    return loss, _gradients_from(flat[scalars:], built["grads_and_vars"]), outputs


def _flat_gradients(grads_and_vars):
    flat = []
    for grad, _ in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            flat.extend([grad.values, grad.indices])
        elif grad is not None:
            flat.append(grad)
    return flat


def _zero_gradient(grad, var):
    """What an empty tower's ``grad`` flattens to: zeros, or an ``IndexedSlices`` of no rows."""
    if grad is None:
        return []
    if isinstance(grad, tf.IndexedSlices):
        row = var.shape[1:] if var.shape[1:].is_fully_defined() else grad.values.shape[1:]
        return [tf.zeros([0] + row.as_list(), grad.values.dtype), tf.zeros([0], grad.indices.dtype)]
    if grad.shape.is_fully_defined():
        return [tf.zeros(grad.shape, grad.dtype)]
    return [tf.zeros_like(var, dtype=grad.dtype)]


def _no_rows(output, first):
    """``output`` with no rows, of its dtype and (from the first tower's when not static) row shape."""
    if output.shape[1:].is_fully_defined():
        return tf.zeros([0] + output.shape[1:].as_list(), output.dtype)
    return tf.zeros(tf.concat([[0], tf.shape(first)[1:]], 0), output.dtype)


def _gradients_from(flat, grads_and_vars):
    """Rebuilds ``grads_and_vars``' structure from the cond's flat outputs."""
    pairs, position = [], 0
    for grad, var in grads_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            # The branch's dense_shape stays inside it: the variable's is the same.
            dense_shape = None if grad.dense_shape is None else _shape(var, grad.dense_shape.dtype)
            pairs.append((tf.IndexedSlices(flat[position], flat[position + 1], dense_shape), var))
            position += 2
        elif grad is not None:
            pairs.append((flat[position], var))
            position += 1
        else:
            pairs.append((None, var))
    return pairs


def _shape(var, dtype):
    if var.shape.is_fully_defined():
        return tf.constant(var.shape.as_list(), dtype)
    return tf.shape(var, out_type=dtype)
