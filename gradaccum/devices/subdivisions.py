"""One run per update: the batch split into micro-batches inside the graph.

:func:`minimize` takes what :func:`gradaccum.tower.minimize` takes, a model
function and its inputs, with a :class:`gradaccum.GradientAccumulator` whose
``num_micro_batches`` is k. One ``session.run`` of its train op is one
update: the whole batch (or k pulls of a callable input) is split into k
micro-batches inside a ``tf.while_loop``; each iteration builds the model on
its micro-batch with the same variables and adds its gradients, weighted by
the micro-batch's size, to loop-carried sums. After the loop the window's
end runs once, as for the fused train op: reduce across workers, divide,
decide skip, clip, apply, count ``global_step``, notify observers.

The first micro-batch is built before the loop, so that the model's
variables are created outside any control flow, in the caller's variable
scope, with the names a plain graph gives them; the loop adds micro-batches
2 to k. Gradients are read only inside the loop and applied after its exit,
so no apply can overwrite a variable that a backward pass still reads (TF1
reference variables alias their buffers). ``parallel_iterations=1`` keeps
one micro-batch's activations in memory at a time. With ``devices``, each
tower runs such a loop over its shard on its device, and the towers' sums
are added before the window's end. ``gradaccum.batch_normalization`` pools
every micro-batch of a run into its first call's window statistics, which
move the moving averages once per run, as under the fused train op.

Variables: none of its own. The accumulator creates only what a window's
end needs: ``<scope>/skipped_windows`` and its observers' variables
(``statistics``, an ``AdaptiveBatch``). There are no caches and no
``micro_step``: the sums are loop values, so no window is ever in progress
between runs and every checkpoint is at a window boundary.

Collections: the train op is appended to ``TRAIN_OP``. ``UPDATE_OPS`` keeps
the first micro-batch's update ops; those built inside the loop are taken
out again (no op outside the loop can run them), and every micro-batch's
run inside the train op.
"""
import collections
import warnings

from gradaccum import _validate
from gradaccum._compat import tf, v1_control_flow, visible_gpus
from gradaccum.devices import splitting
from gradaccum.devices.model import check_model_fn, checked_var_list, read_result, resolved_var_list, tower_scope
from gradaccum.devices.placement import device_function, placement as checked_placement
from gradaccum.window import custom_gradients, pipeline
from gradaccum.window.accumulator import GradientAccumulator, weighted_grad_loss
from gradaccum.window.gradients import weighted
from gradaccum.window.observers import MicroBatch
from gradaccum.window.update_ops import ALL, FIRST, chosen_update_ops, split_update_ops

SubdividedTraining = collections.namedtuple("SubdividedTraining", ["train_op", "loss", "num_micro_batches"])
SubdividedTraining.__doc__ = """What :func:`minimize` builds.

Attributes:
  train_op: the op to run once per update, with the whole batch fed (or
    nothing, for a callable input).
  loss: scalar, the mean loss over the whole batch (the micro-batches'
    losses weighted as their gradients are).
  num_micro_batches: int64 scalar tensor, the k of the run (read once per run).
"""

# Why the accessors of a window in progress have nothing to say about this form.
NO_STATE = ("the one-run form (subdivisions.minimize) keeps no window between runs: each run of its train op "
            "is one whole update; run SubdividedTraining.train_op, and read its num_micro_batches")


def minimize(optimizer, model_fn, inputs, *, global_step=None, var_list=None, devices=None,
             variables_device="/cpu:0", update_ops=FIRST, name="subdivisions"):
    """Builds one train op that splits a batch into k micro-batches inside the graph.

    One run is one update, equal to the wrapped optimizer's step on the whole
    batch: micro-batch i adds ``w_i * gradient_i`` (``w_i`` its size, or the
    weight ``model_fn`` returns), and ``sum_i w_i g_i / sum_i w_i`` is applied.

    Args:
      optimizer: a :class:`gradaccum.GradientAccumulator`: its
        ``num_micro_batches`` is k (an int, or a tensor, schedule or policy
        read once per run); its clipping, skipping, observers and reducer act
        as for the fused train op.
      model_fn: callable taking one micro-batch per input, returning its mean
        loss (a scalar float tensor) or a :class:`gradaccum.ModelResult` with
        its ``weight`` (a pair ``(loss, weight)`` is deprecated). The first
        micro-batch creates the variables (``tf.compat.v1.get_variable``,
        ``tf.compat.v1.layers``); the others reuse them.
      inputs: the whole batch, a tensor or a list of tensors cut along axis 0
        into micro-batches whose sizes differ by at most one; or a callable
        without arguments returning one micro-batch, called k times per run.
      global_step: optional variable, incremented once per applied update.
      var_list: optional list of the variables to train (default: the trainable ones),
        or a callable returning it once ``model_fn`` has built them.
      devices: one device string per tower, as in ``tower.minimize``
        (``None``: every visible GPU, else the CPU): each tower loops over
        its shard's k micro-batches (a callable input: over its own pulls).
      variables_device: where the variables are created (``None``: the first device).
      update_ops: ``"first"`` (the first tower's ``UPDATE_OPS``), ``"all"``
        (every tower's), run on every micro-batch; or ``[]``, none. Window
        batch norm pools every tower's micro-batches with ``"first"`` too.
      name: name scope of the loops and the first micro-batches' models.

    Returns:
      A :class:`SubdividedTraining` ``(train_op, loss, num_micro_batches)``.

    Raises:
      TypeError: for a non-accumulator, a non-callable ``model_fn``,
        non-tensor inputs, or no scalar float loss.
      ValueError: for a static batch below k x towers, a bad ``update_ops``,
        ``name`` or device, or ``ShardedAllReduce(shard_cache=True)``.

    Example:
      >>> opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(1e-3), 50)
      >>> result = gradaccum.subdivisions.minimize(opt, model_fn, [images, labels])
      >>> sess.run(result.train_op, {images: batch_x, labels: batch_y})  # one update
    """
    update_ops = _check_arguments(optimizer, model_fn, update_ops, name)
    var_list = checked_var_list(var_list)
    builder = optimizer.builder
    builder.check_global_step(global_step)
    placements = _placements(devices, variables_device)
    outer_scope = tf.compat.v1.get_default_graph().get_name_scope()
    with tf.compat.v1.name_scope(name) as scope:
        k = _loop_bound(builder, global_step)
        towers = _towers(scope, _Model(optimizer, model_fn, update_ops, var_list, 0), placements,
                         _input_sources(inputs, k, len(placements)))
        first = towers[0].build_first()
    _, pairs, step, config = builder.prepare(first.pairs, pipeline.Step(global_step, name, None, [], None, False))
    with v1_control_flow(config.ref_step_flow):
        done, state, loss_sum, total = _looped_window(config, step, towers, k, outer_scope)
    with tf.compat.v1.name_scope(scope):
        train_op = tf.group(done, name="train")
        loss = tf.cast(loss_sum / total, first.loss.dtype.base_dtype, name="loss")
        k = tf.cast(k, tf.int64, name="window_size")
    window = pipeline.Window(train_op, [v for _, v in pairs], state, size=(k, tf.constant(True)), no_state=NO_STATE)
    return SubdividedTraining(builder.register(window, step), loss, k)


def _looped_window(config, step, towers, k, outer_scope):
    """Every tower's loop, their sums added, and the window's end: ``(op, state, loss sum, total weight)``."""
    _refuse(config)
    pairs = towers[0].first.pairs
    # The first micro-batch's window batch-norm statistics observe the window; the others fold into them.
    step = step._replace(observers=list(towers[0].first.stats))
    # The window's state and end are named as the fused train op's: checkpoints interchange.
    with tf.compat.v1.name_scope(config.name) as window_scope:
        state = pipeline.summed_state(config, pairs, step)
    dtypes = pipeline.sum_dtypes(config, pairs)
    looped, previous = [], []
    for tower in towers:
        looped.append(tower.loop(k, state, dtypes, previous))
        if tower.first.stats:
            # The towers' window batch-norm statistics fold into one window by read-modify-write:
            # concurrent loops would race on it, so each such tower's loop waits for the one before.
            previous = [looped[-1][2]]
    with tf.compat.v1.name_scope(window_scope):
        loss_sum, sums, total = _combined(looped)
        with tf.control_dependencies([total]):
            done = pipeline.finish_summed(config, state, step, outer_scope, sums, total)
    return done, state, loss_sum, total


# What every micro-batch is built from: the accumulator, the model function, the
# update-ops choice of its tower ("first": the later towers run none of their plain
# update ops, but their window batch-norm statistics fold in) and the variables trained.
_Model = collections.namedtuple("_Model", ["optimizer", "model_fn", "update_ops", "var_list", "tower"])


def _towers(scope, model, placements, sources):
    """One :class:`_Tower` per placement; ``update_ops="first"`` gives the later towers statistics only."""
    count = len(placements)
    return [_Tower(scope, model._replace(update_ops=_tower_update_ops(model.update_ops, index), tower=index),
                   placement,
                   source, index, count) for index, (placement, source) in enumerate(zip(placements, sources))]


class _Tower(object):
    """One device's share of a run: its first micro-batch (built outside the loop) and its loop."""

    def __init__(self, scope, model, placement, source, index, count):
        self._scope = scope + ("tower_%d/" % index if count > 1 else "")
        self._model, self._placement, self._source = model, placement, source
        self._reuse = True if index else None
        self._var_scope = tf.compat.v1.get_variable_scope()
        self.first = None

    def _building(self):
        """The tower's scopes: its name, device function and (after the first tower) variable reuse."""
        return tower_scope(self._scope, self._placement, self._reuse, self._var_scope)

    def build_first(self):
        """Builds and keeps the tower's micro-batch 0; returns it."""
        with self._building(), tf.compat.v1.name_scope("micro_batch_0"):
            self.first = _micro_batch(self._model, self._source(0), keep=True, var_list=self._model.var_list)
        return self.first

    def loop(self, k, state, dtypes, previous):
        """The tower's ``(loss sum, sums, total)`` over its k micro-batches."""
        if self.first is None:
            self.build_first()
        self._reuse = True  # The loop's micro-batches reuse the first one's variables.
        with self._building():
            return _summed_loop(self._model, self._source, k, self.first, state, dtypes, previous)


# A later tower under "first": its window batch-norm statistics, none of its plain update ops.
_STATISTICS_ONLY = "statistics only"


def _tower_update_ops(update_ops, index):
    """What a tower runs: its own update ops, or only its window statistics when ``"first"`` keeps tower 0's."""
    return _STATISTICS_ONLY if update_ops == FIRST and index else update_ops


def _placements(devices, variables_device):
    """One device function per tower, as ``tower.minimize`` places its towers."""
    if devices is None and visible_gpus():
        warnings.warn("subdivisions.minimize(devices=None) now means what it means in tower.minimize: every "
                      "visible GPU, variables on `variables_device`; it was one tower, unplaced. Pass "
                      "devices=['/gpu:0'] for one GPU", FutureWarning, stacklevel=3)
    checked = checked_placement(devices, variables_device)
    return [device_function(device, checked.variables_device) for device in checked.devices]


def _combined(looped):
    """The towers' ``(loss sum, pairs, total)`` added: dense sums on their variable's device, sparse rows joined."""
    if len(looped) == 1:
        return looped[0]
    loss_sum = tf.add_n([loss for loss, _, _ in looped])
    total = tf.add_n([weight for _, _, weight in looped])
    pairs = []
    for per_tower in zip(*[sums for _, sums, _ in looped]):
        grads, var = [grad for grad, _ in per_tower], per_tower[0][1]
        with tf.compat.v1.device(var.device):
            if isinstance(grads[0], tf.IndexedSlices):
                pairs.append((tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                                               tf.concat([g.indices for g in grads], 0), grads[0].dense_shape), var))
            else:
                pairs.append((tf.add_n(grads), var))
    return loss_sum, pairs, total


# ------------------------------------------------------------------ checks


def _check_arguments(optimizer, model_fn, update_ops, name):
    """Checks :func:`minimize`'s arguments; returns the update-ops choice."""
    if not isinstance(optimizer, GradientAccumulator):
        raise TypeError("`optimizer` must be a gradaccum.GradientAccumulator (its num_micro_batches is the "
                        "number of micro-batches per run), got %s; wrap it: GradientAccumulator(opt, k)"
                        % _validate.describe(optimizer))
    check_model_fn(model_fn)
    update_ops = chosen_update_ops(update_ops, "subdivisions.minimize", none_means="none")
    if isinstance(update_ops, list) and update_ops:
        raise ValueError("`update_ops` must be 'first', 'all' or [] in subdivisions.minimize, got a list of %d "
                         "ops: the loop runs the update ops model_fn builds on each micro-batch, and ops built "
                         "outside it cannot run inside it" % len(update_ops))
    _validate.check_name(name)
    return update_ops


def _refuse(config):
    """What the in-graph form does not build, in one ValueError."""
    if getattr(config.reducer, "shard_cache", False):
        raise ValueError("subdivisions.minimize sums the micro-batches inside one run and reduces once after "
                         "the loop: ShardedAllReduce(shard_cache=True) reduces every micro-batch; use "
                         "shard_cache=False (stage 1) or the fused train op")


def _loop_bound(builder, global_step):
    """k as an int32 scalar tensor: the accumulator's static int, or its source read once per run."""
    size = builder.size
    if size.k is not None:
        return tf.constant(size.k, tf.int32, name="num_micro_batches")
    with tf.compat.v1.name_scope("num_micro_batches"):
        return tf.cast(size.read(global_step), tf.int32)


# ------------------------------------------------------------------ inputs


def _input_sources(inputs, k, towers):
    """One source per tower: ``source(i)`` is ``(tensors, size)`` of the tower's micro-batch i."""
    if callable(inputs) and not isinstance(inputs, (tf.Tensor, tf.Variable)):
        return [lambda i: _pulled(inputs)] * towers
    k_static = tf.get_static_value(k)
    tensors, n = _checked_batch(_dense(inputs, "inputs"), k * towers if k_static is None else int(k_static) * towers)

    def source_for(tower_index):
        shard_start, shard_size = splitting.part(n, towers, tower_index)

        def source(i):
            start, size = splitting.part(shard_size, k, i)
            start += shard_start
            return [tensor[start:start + size] for tensor in tensors], size
        return source
    return [source_for(index) for index in range(towers)]


def _pulled(inputs):
    """One micro-batch from a callable input, and its size (its first tensor's leading dimension)."""
    tensors = _dense(inputs(), "inputs()")
    return tensors, tf.shape(tensors[0])[0]


def _dense(value, arg):
    """``value`` as a non-empty list of dense tensors with a shared leading (batch) dimension."""
    tensors = splitting.check_inputs(value, arg)
    sparse = [tensor for tensor in tensors if isinstance(tensor, tf.SparseTensor)]
    if sparse:
        raise ValueError("`%s` must be dense tensors: the loop slices them along axis 0; densify a "
                         "tf.SparseTensor inside model_fn (tf.sparse.to_dense), or use tower.minimize, got %s"
                         % (arg, _validate.describe(sparse[0])))
    return tensors


def _checked_batch(tensors, needed):
    """``(tensors, n)``: the inputs and their batch size n, after checks that n >= ``needed`` and they agree."""
    static = tf.compat.dimension_value(tensors[0].shape[0])
    if static is not None and isinstance(needed, int) and static < needed:
        raise ValueError("`inputs` must hold at least num_micro_batches x towers (%d) examples, got a batch of %d"
                         % (needed, static))
    n = tf.shape(tensors[0], name="batch_size")[0]
    enough = tf.compat.v1.assert_greater_equal(
        n, needed, name="enough_examples",
        message="`inputs` must hold at least num_micro_batches x towers examples (one per micro-batch); "
                "batch, needed:")
    return splitting.checked(tensors, n, [enough]), n


# ------------------------------------------------------------------ one micro-batch

# One micro-batch as built: its mean loss and weight, its (gradient,
# variable) pairs, the plain update ops to run, its window batch-norm
# statistics (gradaccum.window.update_ops), which fold into the window's, and the
# weight its gradients still need (None: backprop carried it).
_Micro = collections.namedtuple("_Micro", ["loss", "weight", "pairs", "to_run", "stats", "grad_weight"])


def _micro_batch(model, source, keep, var_list=None, optimizer=None):
    """Builds ``model_fn`` on one micro-batch and its gradients (by ``optimizer``, else the model's).

    ``keep``: leave the update ops it creates in ``UPDATE_OPS`` (the first
    micro-batch's, outside the loop); inside the loop they are taken out.
    """
    tensors, size = source
    optimizer, update_ops = optimizer or model.optimizer, model.update_ops
    graph = tf.compat.v1.get_default_graph()
    updates = graph.get_collection_ref(tf.compat.v1.GraphKeys.UPDATE_OPS)
    before = len(updates)
    result = read_result(model.model_fn(*tensors), "weight", model.tower, warn=keep and not model.tower)
    var_list = resolved_var_list(var_list)
    if result.outputs is not None:
        raise ValueError("`model_fn` returned outputs in tower %d: subdivisions.minimize does not collect "
                         "per-example outputs; compute them with a separate forward pass, or use "
                         "tower.minimize" % model.tower)
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
    if isinstance(update_ops, list):  # []: none
        return _Micro(loss, weight, pairs, [], [], grad_weight)
    plain, stats = split_update_ops(created)
    return _Micro(loss, weight, pairs, [] if update_ops == _STATISTICS_ONLY else plain, stats, grad_weight)


# ------------------------------------------------------------------ the loop


def _summed_loop(model, source, k, first, state, dtypes, previous):
    """``(sum_i w_i loss_i, [(sum_i w_i g_i, var)], sum_i w_i)`` over micro-batches 0..k-1.

    Micro-batch 0 (``first``) starts the sums; micro-batches 1..k-1 are added
    in a ``tf.while_loop``. A dense sum is a loop value; a sparse one is a
    pair of ``TensorArray`` of rows and indices, concatenated after the loop,
    so that it holds every row as given, as the full batch's gradient does.
    """
    variables = [var for _, var in first.pairs]
    grad_dtypes, sum_dtype = dtypes
    with tf.control_dependencies(previous):  # A previous tower's loop, where window statistics are shared.
        observed = _observed(state, first)
    with tf.control_dependencies(first.to_run + observed):
        start = [_weighted_loss(first, sum_dtype), tf.cast(first.weight, sum_dtype)]
        start += _start_sums(first, grad_dtypes)
    initial = [_after(tf.constant(1), start + observed)] + start

    var_scope = tf.compat.v1.get_variable_scope()

    def body(i, loss_sum, total, *sums):
        # The variables exist: micro-batches 1..k-1 reuse the first one's.
        with tf.compat.v1.variable_scope(var_scope, reuse=True, auxiliary_name_scope=False):
            # A reducer's compute_gradients may exchange (the collective engine's first-run sync):
            # micro-batch 0 did that, outside the loop; inside it, its wrapped optimizer's.
            reducer = model.optimizer.builder.reducer
            micro = _micro_batch(model, source(i), keep=False, var_list=variables,
                                 optimizer=None if reducer is None else reducer.optimizer)
        with tf.control_dependencies(micro.to_run):
            added = _add_to_sums(list(sums), micro, i, grad_dtypes)
            weight = tf.cast(micro.weight, sum_dtype)
            carried = [loss_sum + _weighted_loss(micro, sum_dtype), total + weight] + added
            # The next micro-batch starts after this one's gradients, update ops and observers:
            # one micro-batch's activations at a time.
            following = _after(tf.add(i, 1), carried + micro.to_run + _observed(state, micro), "next_micro_batch")
            return [following] + carried

    final = tf.compat.v1.while_loop(lambda i, *_: i < k, body, initial, back_prop=False, parallel_iterations=1,
                                    name="micro_batches")
    _, loss_sum, total = final[:3]
    return loss_sum, _finished_sums(final[3:], first.pairs), total


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
            shape = tf.TensorShape([None]).concatenate(rows.shape[1:])
            flat.append(tf.TensorArray(dtype, size=0, dynamic_size=True, infer_shape=False,
                                       element_shape=shape).write(0, rows))
            flat.append(tf.TensorArray(indices.dtype, size=0, dynamic_size=True, infer_shape=False,
                                       element_shape=tf.TensorShape([None])).write(0, indices))
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
