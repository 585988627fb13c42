"""Synchronous multi-device training: one model replicated as towers.

:func:`minimize` splits a batch into one shard per device, builds the model
once per device ("tower") with shared variables, averages the towers'
gradients weighted by shard size, and applies them once, so that one run of
the train op equals one step of a single device on the whole batch.
:func:`average_gradients` is the averaging step on its own.

Variables: this module creates none of its own. The variables of ``model_fn``
are created once, by the first tower, in the caller's variable scope (so they
have the names a single-device graph gives them and checkpoints are
interchangeable), on ``variables_device``. The optimizer creates its slots as
usual; a ``GradientAccumulator`` creates its own state (see its module).

Collections: nothing is added by this module. It reads the ``UPDATE_OPS``
that each tower's ``model_fn`` adds (batch-norm moving averages) to choose
which of them the train op runs. What ``model_fn`` itself adds (for example
each tower's loss in ``LOSSES``) is added once per tower. While ``model_fn``
builds tower ``i``, ``gradaccum.devices.context.current()`` tells synchronized
layers (``gradaccum.batch_normalization``) the tower's index, devices and
shard sizes.

Inputs: one batch (tensors or ``tf.SparseTensor``, split by rows) or a
callable that each tower calls for its own batch (an iterator's
``get_next``; the towers then weigh their own example counts); see
``gradaccum.devices.splitting``. ``model_fn`` may return
``ModelResult(loss, outputs=...)``: the per-example outputs come back
concatenated in batch order.

A batch smaller than the number of towers works, and no model runs on an
empty shard: tower 0 always has an example; a later tower that a static
batch leaves empty is not built, and one whose shard size is known only at
run time builds its model and gradients inside ``tf.cond(size > 0)``
(``gradaccum.devices.guard``), contributing zeros of weight 0 otherwise.
Synchronized layers (``gradaccum.batch_normalization``) sum over every
tower, so with them every tower runs. ``update_ops="all"`` needs an example
in every tower: an empty tower's batch-norm statistics are NaN.
``gradaccum.batch_normalization`` builds its one update in the first tower
only (from the whole batch's statistics), so there ``"first"`` and ``"all"``
are the same. With a ``GradientAccumulator``, the update ops are its
``update_ops`` (run on every micro-batch) and with ``statistics=True`` each
tower's shard is a small batch of the gradient noise scale
(``gradaccum.statistics``). A non-scalar loss is refused: TF would
differentiate its sum, which the shard-size weighting would make wrong.
"""
import collections
import functools
import numbers

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.devices import context as tower_context
from gradaccum.devices import guard as tower_guard
from gradaccum.devices import splitting
from gradaccum.devices.model import (check_model_fn, check_outputs, checked_var_list, read_result, resolved_var_list,
                                     tower_scope)
from gradaccum.devices.placement import device_function, placement as checked_placement
from gradaccum.window.accumulator import GradientAccumulator
from gradaccum.window.gradients import normalized
from gradaccum.window.update_ops import FIRST, chosen_update_ops
from gradaccum.window.wrapper import optimizer_chain


class TowerTraining(collections.namedtuple("TowerTraining", ["train_op", "loss", "towers"])):
    """What :func:`minimize` builds: a ``(train_op, loss, towers)`` tuple with ``outputs``.

    ``outputs`` is an attribute, not a fourth item, so that
    ``train_op, loss, towers = result`` keeps working.

    Attributes:
      train_op: the op to run once per batch (per micro-batch with a
        ``GradientAccumulator``).
      loss: scalar, the mean loss over the whole batch (tower losses weighted by
        their example counts).
      towers: list of :class:`Tower`, one per device, in device order (a
        device that a static batch leaves without an example gets none).
      outputs: ``None``, or the per-example outputs ``model_fn`` returned
        beside its loss, each concatenated across towers in batch order.

    Example:
      >>> train_op, loss, towers = result = tower.minimize(opt, model_fn, inputs)
      >>> sess.run([train_op, result.outputs])
    """

    outputs = None  # What _make and _replace (which bypass __new__) give.

    def __new__(cls, train_op, loss, towers, outputs=None):
        self = super(TowerTraining, cls).__new__(cls, train_op, loss, towers)
        self.outputs = outputs
        return self


Tower = collections.namedtuple("Tower", ["device", "scope", "loss", "grads_and_vars"])
Tower.__doc__ = """One replica of the model, as built by :func:`minimize`.

Attributes:
  device: the device string the tower computes on, as given.
  scope: the tower's name scope, e.g. ``"tower_0/"``.
  loss: scalar, the mean loss over this tower's shard.
  grads_and_vars: this tower's ``(gradient, variable)`` pairs, unweighted.
"""


def minimize(optimizer, model_fn, inputs, *, devices=None, global_step=None, var_list=None,
             variables_device="/cpu:0", update_ops=FIRST, name="tower"):
    """Builds synchronous data-parallel training of ``model_fn`` over ``devices``.

    Each input is split along axis 0 into one shard per device (the first
    towers get the larger shards), or each tower calls a callable ``inputs``.
    Tower ``i`` calls ``model_fn(*shards_i)`` under ``name_scope("<name>_<i>")``
    on ``devices[i]``; the first creates the variables, the others reuse them.
    Averages weigh example counts: the update is one device's on all the
    towers' examples. A tower without one runs no model (module docstring).

    Args:
      optimizer: a v1 optimizer or a ``GradientAccumulator`` (a run is a micro-batch).
      model_fn: callable taking one shard per input and returning the scalar
        mean loss over that shard, or a :class:`gradaccum.ModelResult` with
        per-example ``outputs`` (a pair ``(loss, outputs)`` is deprecated);
        variables from ``get_variable`` or layers.
      inputs: a tensor or ``tf.SparseTensor``, or a list or tuple of them with
        the same leading (batch) dimension, static or not; or a callable
        returning one of those, called once per tower, in tower order.
      devices: device strings, one tower each (``None``: every GPU, else ``["/cpu:0"]``).
      global_step: optional variable, incremented once per applied update.
      var_list: optional list of the variables to train (default: the trainable ones),
        or a callable returning it once ``model_fn`` has built them.
      variables_device: device of the shared variables (``None``: the first tower's).
      update_ops: ``"first"`` runs the ``UPDATE_OPS`` the first tower created,
        ``"all"`` every tower's (every tower then needs an example), a list
        those ops, ``[]`` none (``None``, deprecated, too).
      name: name scope of the ops outside the towers, and the towers' prefix.

    Returns:
      A :class:`TowerTraining` ``(train_op, loss, towers)`` with ``outputs``.

    Raises:
      TypeError: for a non-optimizer or non-callable ``model_fn``, inputs that
        are not tensors, a non-float loss or outputs without a batch dimension.
      ValueError: for empty ``devices``, a bad ``update_ops`` or ``name``, bad
        static batches, a non-scalar loss, towers that differ in outputs,
        inputs or variables.

    Example:
      >>> result = tower.minimize(tf.compat.v1.train.AdamOptimizer(1e-3), model_fn,
      ...                         [images, labels], devices=["/gpu:0", "/gpu:1"],
      ...                         global_step=tf.compat.v1.train.get_or_create_global_step())
      >>> sess.run([result.train_op, result.loss])
    """
    placement, update_ops = _check_arguments(optimizer, model_fn, devices, variables_device, update_ops, name)
    var_list = checked_var_list(var_list)
    with tf.compat.v1.name_scope(name) as scope:
        batches = splitting.tower_batches(inputs, len(placement.devices), update_ops == "all")
    plan = _plan(name, placement, batches, update_ops != "all", var_list)
    # What synchronized layers see (batch_norm.py).
    rank, workers = _collective_worker(optimizer)
    group = tower_context.TowerGroup(plan.devices, plan.batches.sizes, worker=rank, workers=workers)
    towers, tower_update_ops, tower_outputs = _build_towers(optimizer, model_fn, plan, group)
    chosen = update_ops if isinstance(update_ops, list) else {
        "first": tower_update_ops[0], "all": sum(tower_update_ops, [])}[update_ops]
    weights = _check_weights(plan.batches.sizes, len(towers))
    with tf.compat.v1.name_scope(scope):
        loss, grads_and_vars, outputs = _combine(towers, weights, tower_outputs, plan.returned["outputs"])
    # In the caller's scope, so that the optimizer's variables (Adam's beta
    # powers) get the names one device gives them: checkpoints interchange.
    small_batches = [(t.grads_and_vars, w) for t, w in zip(towers, weights)]  # each shard, for statistics
    train_op = _apply(optimizer, grads_and_vars, global_step, batches.batch_size, chosen, small_batches)
    return TowerTraining(train_op, loss, towers, outputs)


def average_gradients(tower_grads, weights=None):
    """Averages the towers' gradients variable by variable.

    The average is ``sum_i(w_i * g_i) / sum_i(w_i)``: with each tower's mean
    loss and ``w_i`` its shard size, that is the gradient of the mean loss over
    the whole batch. A tower whose weight is 0 contributes nothing, even when
    its gradient is NaN (the mean over an empty shard). A ``None`` gradient in
    some towers counts as zero; a variable whose gradient is ``None`` in every
    tower is dropped. ``IndexedSlices`` stay sparse: each tower's values are
    scaled and the values and indices concatenated. Each average is built on
    its variable's device.

    Args:
      tower_grads: non-empty list, one entry per tower, of ``(gradient,
        variable)`` lists as returned by ``compute_gradients``.
      weights: ``None`` (equal weights) or one weight per tower: numbers >= 0
        or scalar tensors (for example shard sizes).

    Returns:
      A list of ``(gradient, variable)`` pairs in the first tower's order.

    Raises:
      TypeError: for a malformed ``tower_grads`` or a non-numeric weight.
      ValueError: for an empty ``tower_grads``, towers that disagree on the
        variable list, a ``weights`` of the wrong length, a negative weight
        or number weights that are all zero.

    Example:
      >>> tower_grads = [opt.compute_gradients(loss_0), opt.compute_gradients(loss_1)]
      >>> grads_and_vars = tower.average_gradients(tower_grads, weights=[64, 63])
      >>> train_op = opt.apply_gradients(grads_and_vars)
    """
    towers = _check_tower_grads(tower_grads)
    weights = _check_weights(weights, len(towers))
    variables = _common_variables(towers)
    by_name = [dict((var.name, grad) for grad, var in pairs) for pairs in towers]
    kept = [(var, [grads[var.name] for grads in by_name]) for var in variables]
    kept = [(var, grads) for var, grads in kept if any(g is not None for g in grads)]
    with tf.compat.v1.name_scope("average_gradients"):
        averaged = []
        for var, grads in kept:
            with tf.compat.v1.device(var.device), tf.compat.v1.name_scope(var.op.name):
                averaged.append((_weighted_mean(grads, weights, var), var))
    return averaged


# ------------------------------------------------------------ minimize's steps


def _check_arguments(optimizer, model_fn, devices, variables_device, update_ops, name):
    """Checks :func:`minimize`'s arguments: ``(placement, update ops choice)``."""
    _validate.check_optimizer(optimizer)
    check_model_fn(model_fn)
    checked = checked_placement(devices, variables_device)
    _validate.check_name(name)
    return checked, chosen_update_ops(update_ops, "tower.minimize", none_means="none")


def _plan(name, placement, batches, guard, var_list):
    """The towers to build: those whose batch is not known to be empty."""
    devices, variables_device = placement.devices, placement.variables_device
    indices = [i for i, size in enumerate(batches.sizes) if not (isinstance(size, int) and size == 0)]
    kept = splitting.Batches(batches.batch_size, [batches.sizes[i] for i in indices],
                             [batches.shards[i] for i in indices])
    return _Plan(name, indices, [devices[i] for i in indices], variables_device, kept, guard, var_list, {})


def _collective_worker(optimizer):
    """``(rank, workers)`` of a ``CollectiveAllReduce`` in the optimizer chain, else ``(0, 1)``."""
    for wrapped in optimizer_chain(optimizer):
        if isinstance(getattr(wrapped, "worker_rank", None), int):
            return wrapped.worker_rank, wrapped.num_workers
    return 0, 1


# How to build the towers; `returned` records what the first tower's model_fn returned.
_Plan = collections.namedtuple("_Plan", ["name", "indices", "devices", "variables_device", "batches", "guard",
                                         "var_list", "returned"])


def _build_towers(optimizer, model_fn, plan, group):
    """Builds one tower per device that may have examples.

    Returns the towers, each tower's update ops and each tower's outputs.
    """
    towers, update_ops, outputs = [], [], []
    for position in range(len(plan.indices)):
        built = _build_tower(optimizer, model_fn, plan, group, position, outputs[0] if outputs else None)
        towers.append(built[0])
        update_ops.append(built[1])
        outputs.append(built[2])
    return towers, update_ops, outputs


def _build_tower(optimizer, model_fn, plan, group, position, first_outputs):
    """Tower ``position``: ``(Tower, its UPDATE_OPS, its flat outputs)``."""
    graph = tf.compat.v1.get_default_graph()
    known = _variable_names(graph)
    updates_before = len(graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
    index, device, size = plan.indices[position], plan.devices[position], plan.batches.sizes[position]
    shard = plan.batches.shards[position]
    with tower_scope("%s_%d" % (plan.name, index), device_function(device, plan.variables_device),
                     True if position else None) as scope, tower_context.TowerContext(group, position):
        # A later tower may get no example: then its model must not run (some kernels
        # abort on an empty batch). Synchronized layers need every tower to take part.
        guarded = position and plan.guard and not isinstance(size, int) and not group.synchronized
        if guarded:  # On the tower's device, so that the cond's switches of the shard are too.
            shard = [splitting.identity(tensor) for tensor in shard]
        run = functools.partial(_run_model, optimizer, model_fn, shard, (index, plan.returned), plan.var_list)
        if guarded:
            loss, grads_and_vars, outputs = tower_guard.run_if(size > 0, run, first_outputs)
        else:
            loss, grads_and_vars, outputs = run()
        if position:
            _check_no_new_variables(graph, known, index)
    updates = graph.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)[updates_before:]
    return Tower(device, scope, loss, grads_and_vars), updates, outputs


def _run_model(optimizer, model_fn, shard, tower, var_list):
    """``model_fn`` on ``shard``: ``(loss, grads_and_vars, flat per-example outputs)``.

    ``tower`` is ``(index, returned)``: the first tower records its outputs'
    structure in ``returned["outputs"]``, the others must match it.
    """
    index, returned = tower
    result = read_result(model_fn(*shard), "outputs", index, warn=not index)
    if result.weight is not None:
        raise ValueError("`model_fn` returned a weight in tower %d: tower.minimize weighs each tower by its "
                         "example count; a weight per micro-batch is subdivisions.minimize's, or "
                         "GradientAccumulator.minimize's `weight`" % index)
    loss, outputs = result.loss, result.outputs
    flat = check_outputs(outputs, index)
    returned.setdefault("outputs", outputs)
    if len(flat) != len(check_outputs(returned["outputs"], 0)):
        raise ValueError("`model_fn` must return the same outputs in every tower, got %s in tower %d and %s "
                         "in tower 0" % (_validate.describe(outputs), index, _validate.describe(returned["outputs"])))
    return loss, optimizer.compute_gradients(loss, var_list=resolved_var_list(var_list)), flat


def _combine(towers, weights, tower_outputs, structure):
    """The whole batch's loss, gradients and outputs (in ``structure``'s nesting, or None)."""
    loss = tf.identity(_weighted_mean([t.loss for t in towers], weights), name="loss")
    grads_and_vars = average_gradients([t.grads_and_vars for t in towers], weights=weights)
    if structure is None:
        return loss, grads_and_vars, None
    with tf.compat.v1.name_scope("outputs"):
        joined = [tf.concat(list(parts), 0) for parts in zip(*tower_outputs)]
    return loss, grads_and_vars, tf.nest.pack_sequence_as(structure, joined)


def _variable_names(graph):
    found = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES)
    found += graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
    return set(var.name for var in found)


def _check_no_new_variables(graph, known, index):
    created = sorted(_variable_names(graph) - known)
    if created:
        raise ValueError(
            "`model_fn` created variables in tower %d that tower 0 did not: %s; create variables "
            "with tf.compat.v1.get_variable or tf.compat.v1.layers (not tf.Variable or Keras "
            "layers) so that the towers share them" % (index, _validate.describe(created)))


def _weighted_mean(values, weights, like=None):
    """``sum_i w_i * values_i / sum_i w_i`` in ``like``'s dtype (the first value's by default).

    The weighted sum is taken in at least float32, an empty tower (weight 0)
    adds exactly nothing even when its value is NaN, and the division is the
    window's and the collective engine's (``_gradients.normalized``). ``None``
    values count as zero; ``IndexedSlices`` stay sparse, their rows concatenated.
    """
    present = [(value, weight) for value, weight in zip(values, weights) if value is not None]
    like = present[0][0] if like is None else like
    wide = tf.float64 if like.dtype.base_dtype == tf.float64 else tf.float32
    cast = [(value, tf.cast(weight, wide)) for value, weight in present]
    total = sum(weights) if all(isinstance(w, float) for w in weights) else tf.add_n(
        [tf.cast(w, wide) for w in weights])
    if all(isinstance(value, tf.IndexedSlices) for value, _ in cast):
        summed = _sum_sparse(cast, wide)
    else:
        summed = tf.add_n([_scaled(tf.cast(tf.convert_to_tensor(value), wide), weight) for value, weight in cast],
                          name="weighted_sum")
    return normalized([(summed, like)], total)[0][0]


def _apply(optimizer, grads_and_vars, global_step, batch_size, update_ops, small_batches):
    """Applies the averaged gradients after ``update_ops`` (on every micro-batch)."""
    if isinstance(optimizer, GradientAccumulator):
        # A micro-batch weighs its example count, so uneven micro-batches stay exact. The
        # accumulator runs the update ops: window statistics once per window (gradaccum.window.update_ops).
        return optimizer.apply_gradients(grads_and_vars, global_step=global_step, weight=batch_size,
                                         update_ops=update_ops, small_batches=small_batches)
    with tf.control_dependencies(update_ops):
        return optimizer.apply_gradients(grads_and_vars, global_step=global_step)


# ---------------------------------------------------- average_gradients' steps


def _check_tower_grads(tower_grads):
    """Returns ``tower_grads`` as a list of lists of ``(grad, var)`` pairs."""
    if not isinstance(tower_grads, (list, tuple)):
        raise TypeError("`tower_grads` must be a list (one entry per tower) of (gradient, variable) "
                        "lists, got %s" % _validate.describe(tower_grads))
    if not tower_grads:
        raise ValueError("`tower_grads` must hold at least one tower, got %s"
                         % _validate.describe(tower_grads))
    towers = []
    for index, pairs in enumerate(tower_grads):
        try:
            pairs = [(grad, var) for grad, var in pairs]
        except (TypeError, ValueError):
            raise TypeError("`tower_grads[%d]` must be a list of (gradient, variable) pairs, got %s"
                            % (index, _validate.describe(pairs))) from None
        for _, var in pairs:
            if not isinstance(var, tf.Variable):
                raise TypeError("`tower_grads[%d]` must pair gradients with variables, got %s"
                                % (index, _validate.describe(var)))
        towers.append(pairs)
    return towers


def _check_weights(weights, count):
    """Returns one weight per tower: floats when all are numbers, else tensors."""
    if weights is None:
        return [1.0] * count
    if not isinstance(weights, (list, tuple)) or len(weights) != count:
        raise ValueError("`weights` must be None or a list with one weight per tower (%d), got %s"
                         % (count, _validate.describe(weights)))
    if not all(isinstance(w, numbers.Real) and not isinstance(w, bool) for w in weights):
        return [_validate.check_scalar_tensor(w, "weights") for w in weights]
    if any(not 0 <= float(w) < float("inf") for w in weights) or not any(float(w) > 0 for w in weights):
        raise ValueError("`weights` must be finite numbers >= 0, not all zero, got %s"
                         % _validate.describe(weights))
    return [float(w) for w in weights]


def _common_variables(towers):
    """Returns the first tower's variables; raises when a tower differs."""
    first = [var for _, var in towers[0]]
    names = [var.name for var in first]
    if len(set(names)) != len(names):
        raise ValueError("`tower_grads[0]` lists a variable twice: %s" % _validate.describe(names))
    for index, pairs in enumerate(towers[1:], 1):
        other = [var.name for _, var in pairs]
        missing, extra = sorted(set(names) - set(other)), sorted(set(other) - set(names))
        if missing or extra or len(other) != len(names):
            raise ValueError(
                "`tower_grads` disagree on the variable list: tower %d lacks %s and has extra %s "
                "(or repeats one) compared with tower 0" % (index, missing, extra))
    return first


def _scaled(value, weight):
    """``value * weight``, exactly 0 when ``weight`` is 0 even if ``value`` is NaN (an empty shard)."""
    return tf.math.multiply_no_nan(value, weight)  # float32 and float64 kernels: the callers widen.


def _sum_sparse(present, wide):
    index_dtypes = set(grad.indices.dtype for grad, _ in present)
    index_dtype = index_dtypes.pop() if len(index_dtypes) == 1 else tf.int64
    values = tf.concat([_scaled(tf.cast(grad.values, wide), weight) for grad, weight in present], 0, name="values")
    indices = tf.concat([tf.cast(grad.indices, index_dtype) for grad, _ in present], 0, name="indices")
    return tf.IndexedSlices(values, indices, dense_shape=present[0][0].dense_shape)
