"""One tower's micro-batches in one run: the loop of the one-run form.

:func:`micro_batch` builds ``model_fn`` and its gradients on one
micro-batch; :func:`summed_loop` adds a tower's micro-batches 1 to n-1 to
micro-batch 0's in a ``tf.while_loop`` (:func:`gradaccum.subdivisions.minimize`
builds micro-batch 0 outside it, so that the variables are created outside
control flow). Each iteration's gradients, update ops and observers finish
before the next micro-batch starts: one micro-batch's activations at a time.
Gradients are read only inside the loop and applied after its exit, so no
apply overwrites a variable that a backward pass still reads (TF1 reference
variables alias their buffers).

Variables: none. Collections: the update ops a micro-batch inside the loop
adds to ``UPDATE_OPS`` are taken out again (no op outside the loop can run
them); the loop runs them itself.
"""
import collections

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.devices.model import check_outputs, read_result, resolved_var_list
from gradaccum.window import custom_gradients, pipeline
from gradaccum.window.accumulator import weighted_grad_loss
from gradaccum.window.gradients import weighted
from gradaccum.window.observers import MicroBatch
from gradaccum.window.update_ops import split_update_ops

STATISTICS_ONLY = "statistics only"
"""A tower's update-ops choice under ``"first"`` after tower 0: its window
batch-norm statistics fold into the window, none of its plain update ops run."""

Model = collections.namedtuple("Model", ["optimizer", "model_fn", "update_ops", "var_list", "tower"])
Model.__doc__ = """What every micro-batch of a tower is built from.

Attributes:
  optimizer: the :class:`gradaccum.GradientAccumulator`.
  model_fn: the model function.
  update_ops: ``"first"``, ``"all"``, :data:`STATISTICS_ONLY` or ``[]``.
  var_list: ``None``, a list of variables, or a callable returning one.
  tower: the tower's index.
"""

Micro = collections.namedtuple("Micro", ["loss", "weight", "pairs", "to_run", "stats", "grad_weight", "outputs",
                                         "structure"])
Micro.__doc__ = """One micro-batch as built.

Attributes:
  loss: its mean loss.
  weight: its weight (its size, or the weight ``model_fn`` returned).
  pairs: its ``(gradient, variable)`` pairs, no ``None``.
  to_run: the plain update ops to run with it.
  stats: its window batch-norm statistics, which fold into the window's.
  grad_weight: the weight its gradients still need (``None``: backprop carried it).
  outputs: the flat list of its per-example outputs (``[]`` for none).
  structure: the outputs as ``model_fn`` nested them, or ``None``.
"""


def micro_batch(model, source, keep, var_list=None, optimizer=None):
    """Builds ``model_fn`` on one micro-batch and its gradients (by ``optimizer``, else the model's).

    Args:
      model: the tower's :data:`Model`.
      source: ``(tensors, size)`` of the micro-batch.
      keep: leave the update ops it creates in ``UPDATE_OPS`` (micro-batch
        0, outside the loop); inside the loop they are taken out.
      var_list: the variables to differentiate (``None``: the trainable ones).
      optimizer: the optimizer whose ``compute_gradients`` differentiates.

    Returns:
      A :data:`Micro`.

    Raises:
      ValueError: when no variable trained has a gradient.

    Example:
      >>> first = micro_batch(model, source(0), keep=True)
    """
    tensors, size = source
    optimizer = optimizer or model.optimizer
    updates = tf.compat.v1.get_default_graph().get_collection_ref(tf.compat.v1.GraphKeys.UPDATE_OPS)
    before = len(updates)
    result = read_result(model.model_fn(*tensors), "weight", model.tower, warn=keep and not model.tower)
    var_list = resolved_var_list(var_list)
    loss, weight = result.loss, size if result.weight is None else result.weight
    created = list(updates[before:])
    if not keep:
        del updates[before:]
    in_backprop = model.optimizer.builder.weight_in_backprop(loss, weight, var_list)
    grad_loss = weighted_grad_loss(loss, None, weight) if in_backprop else None
    with custom_gradients.differentiating(optimizer, model.optimizer.gradients):  # Also with a reducer's optimizer.
        pairs = optimizer.compute_gradients(loss, var_list=var_list, grad_loss=grad_loss)
    pairs = [(grad, var) for grad, var in pairs if grad is not None]
    if not pairs:
        raise ValueError("No gradients provided for any variable: `model_fn`'s loss %s depends on no "
                         "variable trained" % _validate.describe(loss))
    grad_weight = None if in_backprop else weight
    outputs = check_outputs(result.outputs, model.tower)
    if isinstance(model.update_ops, list):  # []: none
        return Micro(loss, weight, pairs, [], [], grad_weight, outputs, result.outputs)
    plain, stats = split_update_ops(created)
    to_run = [] if model.update_ops == STATISTICS_ONLY else plain
    return Micro(loss, weight, pairs, to_run, stats, grad_weight, outputs, result.outputs)


Looped = collections.namedtuple("Looped", ["loss_sum", "pairs", "total", "outputs"])
Looped.__doc__ = """A tower's sums after its loop.

Attributes:
  loss_sum: ``sum_i w_i loss_i``.
  pairs: ``[(sum_i w_i g_i, variable)]``; a sparse sum holds every row as given.
  total: ``sum_i w_i``.
  outputs: the flat per-example outputs, every micro-batch's rows in order.
"""


def summed_loop(model, source, first, state, dtypes, previous):
    """A tower's :data:`Looped` sums over its micro-batches 0..n-1.

    Micro-batch 0 (``first``) starts the sums; micro-batches 1..n-1 are added
    in a ``tf.while_loop``. A dense sum is a loop value; a sparse one, and
    each per-example output, a ``TensorArray`` of rows, concatenated after
    the loop, so that a sparse sum holds every row as given, as the full
    batch's gradient does.

    Args:
      model: the tower's :data:`Model`.
      source: the tower's source: ``source.take(i)`` is micro-batch i's
        ``(tensors, size)``, ``source.count`` the number of micro-batches.
      first: micro-batch 0's :data:`Micro`.
      state: the window's summed state (``pipeline.summed_state``).
      dtypes: ``pipeline.sum_dtypes`` of the window.
      previous: ops that micro-batch 0's observers wait for (a previous
        tower's loop, where window statistics are shared).

    Returns:
      A :data:`Looped`.

    Example:
      >>> looped = summed_loop(model, source, first, state, dtypes, [])
    """
    variables = [var for _, var in first.pairs]
    grad_dtypes, sum_dtype = dtypes
    with tf.control_dependencies(previous):
        observed = _observed(state, first)
    with tf.control_dependencies(first.to_run + observed):
        start = [_weighted_loss(first, sum_dtype), tf.cast(first.weight, sum_dtype)]
        start += _start_sums(first, grad_dtypes) + [_rows_array(out).write(0, out) for out in first.outputs]
    initial = [_after(tf.constant(1), start + observed)] + start
    var_scope = tf.compat.v1.get_variable_scope()
    reducer = model.optimizer.builder.reducer

    def body(i, loss_sum, total, *carried):
        # The variables exist: micro-batches 1..n-1 reuse the first one's.
        with tf.compat.v1.variable_scope(var_scope, reuse=True, auxiliary_name_scope=False):
            # A reducer's compute_gradients may exchange (the collective engine's first-run sync):
            # micro-batch 0 did that, outside the loop; inside it, its wrapped optimizer's.
            micro = micro_batch(model, source.take(i), keep=False, var_list=variables,
                                optimizer=None if reducer is None else reducer.optimizer)
        sums, outputs = carried[:len(carried) - len(first.outputs)], carried[len(carried) - len(first.outputs):]
        with tf.control_dependencies(micro.to_run):
            added = _add_to_sums(list(sums), micro, i, grad_dtypes)
            added += [array.write(i, out) for array, out in zip(outputs, micro.outputs)]
            carried = [loss_sum + _weighted_loss(micro, sum_dtype), total + tf.cast(micro.weight, sum_dtype)] + added
            # The next micro-batch starts after this one's gradients, update ops and observers.
            following = _after(tf.add(i, 1), carried + micro.to_run + _observed(state, micro), "next_micro_batch")
            return [following] + carried

    final = tf.compat.v1.while_loop(lambda i, *_: i < source.count, body, initial, back_prop=False,
                                    parallel_iterations=1, name="micro_batches")
    outputs = final[len(final) - len(first.outputs):]
    return Looped(final[1], _finished_sums(final[3:len(final) - len(first.outputs)], first.pairs), final[2],
                  [array.concat() for array in outputs])


def _rows_array(rows):
    """An empty growing ``TensorArray`` for blocks of ``rows``' kind (any number of rows)."""
    shape = tf.TensorShape([None]).concatenate(rows.shape[1:])
    # On the tower's device: colocated with its first rows, an input pulled as it is (a tf.data
    # iterator's ids returned among the outputs) would tie a later tower's array to the iterator's device.
    return tf.TensorArray(rows.dtype, size=0, dynamic_size=True, infer_shape=False, element_shape=shape,
                          colocate_with_first_write_call=False)


def _after(value, waited, name=None):
    """``value`` once every tensor, ``TensorArray`` (its flow) or op of ``waited`` is done."""
    ops = [item.flow if isinstance(item, tf.TensorArray) else item for item in waited]
    with tf.control_dependencies(ops):
        return tf.identity(value, name=name)


def _observed(state, micro):
    """The observers' ops for one micro-batch: its own, and its batch-norm statistics folded into the window's."""
    ops = pipeline.added(state, MicroBatch(micro.pairs, micro.weight, None), made_only=True)
    window_stats = state.observers[state.made:]
    if len(micro.stats) != len(window_stats):
        raise ValueError("`model_fn` built %d window batch-norm layers on this micro-batch and %d on the first; "
                         "build the same layers on every micro-batch" % (len(micro.stats), len(window_stats)))
    for stats, window in zip(micro.stats, window_stats):
        if stats is not window:
            stats.share_window(window)
        ops.append(stats.accumulate())
    return ops


def _start_sums(first, grad_dtypes):
    """Micro-batch 0's weighted gradients as the loop's first values (flat)."""
    flat = []
    for (grad, _), dtype in zip(first.pairs, grad_dtypes):
        if isinstance(grad, tf.IndexedSlices):
            rows, indices = _rows(grad, first.grad_weight, dtype)
            flat.extend([_rows_array(rows).write(0, rows), _rows_array(indices).write(0, indices)])
        else:
            flat.append(weighted(tf.cast(grad, dtype), first.grad_weight))
    return flat


def _add_to_sums(sums, micro, i, grad_dtypes):
    """The sums with micro-batch ``i`` added (its graph is the first one's: the same kinds of gradient)."""
    out, position = [], 0
    for (grad, _), dtype in zip(micro.pairs, grad_dtypes):
        if isinstance(sums[position], tf.TensorArray):
            rows, indices = _rows(grad, micro.grad_weight, dtype)
            out.extend([sums[position].write(i, rows), sums[position + 1].write(i, indices)])
            position += 2
        else:
            out.append(sums[position] + weighted(tf.cast(grad, dtype), micro.grad_weight))
            position += 1
    return out


def _rows(grad, weight, dtype):
    """A sparse gradient's weighted rows and its indices."""
    return weighted(tf.cast(grad.values, dtype), weight), grad.indices


def _finished_sums(flat, first_pairs):
    """``(sum, variable)`` pairs from the loop's final values; sparse ones as ``IndexedSlices``."""
    pairs, position = [], 0
    for grad, var in first_pairs:
        if isinstance(flat[position], tf.TensorArray):
            rows, indices = flat[position].concat(), flat[position + 1].concat()
            pairs.append((tf.IndexedSlices(rows, indices, grad.dense_shape), var))
            position += 2
        else:
            pairs.append((flat[position], var))
            position += 1
    return pairs


def _weighted_loss(micro, dtype):
    return tf.cast(micro.loss, dtype) * tf.cast(micro.weight, dtype)
