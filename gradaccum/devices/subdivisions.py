"""One run per update: the batch split into micro-batches inside the graph.

:func:`minimize` takes what :func:`gradaccum.tower.minimize` takes, a model
function and its inputs, with a :class:`gradaccum.GradientAccumulator` whose
``num_micro_batches`` is k. One ``session.run`` of its train op is one
update: the whole batch (dense tensors or ``tf.SparseTensor``, or k pulls of
a callable input) is split into one shard per tower and each shard into
``min(k, its size)`` micro-batches, so that no micro-batch is empty, inside
a ``tf.while_loop`` (``gradaccum.devices.loop``); each iteration builds the model on
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
are added before the window's end; a later tower whose shard may be empty
at run time builds its micro-batch 0 inside ``tf.cond`` (as
``tower.minimize`` builds such a tower) and adds nothing then. Per-example
outputs (``ModelResult.outputs``) come back in batch order.
``gradaccum.batch_normalization`` pools
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
from gradaccum.devices import guard as tower_guard
from gradaccum.devices import splitting
from gradaccum.devices.loop import STATISTICS_ONLY, Looped, Model, micro_batch, summed_loop
from gradaccum.devices.model import check_model_fn, checked_var_list, tower_scope
from gradaccum.devices.placement import device_function, placement as checked_placement
from gradaccum.window import pipeline
from gradaccum.window.accumulator import GradientAccumulator
from gradaccum.window.replicas import in_replica_context
from gradaccum.window.update_ops import ALL, FIRST, chosen_update_ops


class SubdividedTraining(collections.namedtuple("SubdividedTraining", ["train_op", "loss", "num_micro_batches"])):
    """What :func:`minimize` builds: a ``(train_op, loss, num_micro_batches)`` tuple with ``outputs``.

    ``outputs`` is an attribute, not a fourth item, so that
    ``train_op, loss, k = result`` keeps working.

    Attributes:
      train_op: the op to run once per update, with the whole batch fed (or
        nothing, for a callable input).
      loss: scalar, the mean loss over the whole batch (the micro-batches'
        losses weighted as their gradients are).
      num_micro_batches: int64 scalar tensor, the k of the run (read once per run).
      outputs: ``None``, or the per-example outputs ``model_fn`` returned in
        its :class:`gradaccum.ModelResult`, every micro-batch's rows
        concatenated in batch order. A callable input: tower after tower,
        each tower's k micro-batches in the order that tower pulled them.
        The towers' loops pull concurrently, so which micro-batches of the
        source each tower gets is decided at run time (with one tower they
        are in the source's order): put the labels or example ids among the
        outputs to match rows with examples.

    Example:
      >>> result = subdivisions.minimize(opt, model_fn, [images, labels])
      >>> _, predictions = sess.run([result.train_op, result.outputs], feed)
    """

    outputs = None  # What _make and _replace (which bypass __new__) give.

    def __new__(cls, train_op, loss, num_micro_batches, outputs=None):
        self = super(SubdividedTraining, cls).__new__(cls, train_op, loss, num_micro_batches)
        self.outputs = outputs
        return self


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
        its ``weight`` and per-example ``outputs`` (a pair ``(loss, weight)``
        is deprecated). The first micro-batch creates the variables
        (``tf.compat.v1.get_variable``, ``tf.compat.v1.layers``); the others
        reuse them.
      inputs: the whole batch, a tensor or ``tf.SparseTensor`` or a list of
        them, cut along axis 0 into one shard per tower and each shard into
        ``min(k, its size)`` micro-batches whose sizes differ by at most one;
        or a callable without arguments returning one micro-batch, called k
        times per run and tower.
      global_step: optional variable, incremented once per applied update.
      var_list: optional list of the variables to train (default: the trainable ones),
        or a callable returning it once ``model_fn`` has built them.
      devices: one device string per tower, as in ``tower.minimize``
        (``None``: every visible GPU, else the CPU; in a ``tf.distribute``
        replica context, one tower where the strategy placed the replica):
        each tower loops over its shard's micro-batches (a callable input:
        over its own pulls).
      variables_device: where the variables are created (``None``: the first device).
      update_ops: ``"first"`` (the first tower's ``UPDATE_OPS``), ``"all"``
        (every tower's; every tower then needs an example), run on every
        micro-batch; or ``[]``, none. Window batch norm pools every tower's
        micro-batches with ``"first"`` too.
      name: name scope of the loops and the first micro-batches' models.

    Returns:
      A :class:`SubdividedTraining` ``(train_op, loss, num_micro_batches)`` with ``outputs``.

    Raises:
      TypeError: for a non-accumulator, a non-callable ``model_fn``,
        non-tensor inputs, or no scalar float loss.
      ValueError: for an empty static batch, a bad ``update_ops``, ``name``
        or device, or ``ShardedAllReduce(shard_cache=True)``.

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
        towers = _towers(scope, Model(optimizer, model_fn, update_ops, var_list, 0), placements,
                         _input_sources(inputs, k, len(placements), update_ops == ALL))
        first = towers[0].build_first()
    _, pairs, step, config = builder.prepare(first.pairs, pipeline.Step(global_step, name, None, [], None, False))
    with v1_control_flow(config.ref_step_flow):
        done, state, summed = _looped_window(config, step, towers, outer_scope)
    with tf.compat.v1.name_scope(scope):
        train_op = tf.group(done, name="train")
        loss = tf.cast(summed.loss_sum / summed.total, first.loss.dtype.base_dtype, name="loss")
        k = tf.cast(k, tf.int64, name="window_size")
        outputs = _packed_outputs(first.structure, summed.outputs)
    window = pipeline.Window(train_op, [v for _, v in pairs], state, size=(k, tf.constant(True)), no_state=NO_STATE)
    return SubdividedTraining(builder.register(window, step), loss, k, outputs)


def _looped_window(config, step, towers, outer_scope):
    """Every tower's loop, their sums added, and the window's end: ``(op, state, summed Looped)``."""
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
        looped.append(tower.loop(state, dtypes, previous, towers[0].first))
        if tower.first.stats:
            # The towers' window batch-norm statistics fold into one window by read-modify-write:
            # concurrent loops would race on it, so each such tower's loop waits for the one before.
            previous = [looped[-1].total]
    with tf.compat.v1.name_scope(window_scope):
        summed = _combined(looped)
        with tf.control_dependencies([summed.total]):
            done = pipeline.finish_summed(config, state, step, outer_scope, summed.pairs, summed.total)
    return done, state, summed


def _towers(scope, model, placements, sources):
    """One :class:`_Tower` per placement whose shard may hold examples.

    ``update_ops="first"`` gives the later towers their window statistics only.
    """
    count = len(placements)
    return [_Tower(scope, model._replace(update_ops=_tower_update_ops(model.update_ops, index), tower=index),
                   placement, source, count)
            for index, (placement, source) in enumerate(zip(placements, sources))
            if not (isinstance(source.size, int) and source.size == 0)]


class _Tower(object):
    """One device's share of a run: its first micro-batch (built outside the loop) and its loop."""

    def __init__(self, scope, model, placement, source, count):
        self._scope = scope + ("tower_%d/" % model.tower if count > 1 else "")
        self._model, self._placement, self._source = model, placement, source
        self._reuse = True if model.tower else None
        self._var_scope = tf.compat.v1.get_variable_scope()
        self.first = None

    def _building(self):
        """The tower's scopes: its name, device function and (after the first tower) variable reuse."""
        return tower_scope(self._scope, self._placement, self._reuse, self._var_scope)

    def build_first(self, guarded_like=None):
        """Builds and keeps the tower's micro-batch 0; returns it.

        ``guarded_like``: tower 0's micro-batch 0, when this one is built
        inside ``tf.cond`` (its outputs give an empty tower's theirs).
        """
        with self._building(), tf.compat.v1.name_scope("micro_batch_0"):
            if guarded_like is not None:
                self.first = _guarded_micro_batch(self._model, self._source, guarded_like.outputs)
            else:
                self.first = micro_batch(self._model, self._source.take(0), keep=True,
                                         var_list=self._model.var_list)
        return self.first

    def loop(self, state, dtypes, previous, first):
        """The tower's :data:`gradaccum.devices.loop.Looped` sums over its micro-batches.

        ``first``: tower 0's micro-batch 0.
        """
        if self.first is None:
            # A later tower whose shard may be empty at run time runs no model then, unless its update
            # ops or window statistics must see it: they need every tower to have an example.
            guarded = self._source.may_be_empty and not first.stats and self._model.update_ops != ALL
            with tf.control_dependencies(self._needs_an_example(first) if not guarded else []):
                self.build_first(first if guarded else None)
        self._reuse = True  # The loop's micro-batches reuse the first one's variables.
        with self._building():
            return summed_loop(self._model, self._source, self.first, state, dtypes, previous)


    def _needs_an_example(self, first):
        """A run-time check that this tower's shard is not empty, where window statistics must see it."""
        if not (self._source.may_be_empty and first.stats):
            return []  # update_ops="all": the batch's size was checked against the towers already.
        return [tf.compat.v1.assert_positive(
            self._source.size, name="tower_%d_has_an_example" % self._model.tower,
            message="`inputs` must give every tower an example with window batch norm (an empty tower's "
                    "batch statistics are NaN); tower, examples:")]


def _guarded_micro_batch(model, source, first_outputs):
    """Micro-batch 0 of a later tower built inside ``tf.cond(size > 0)``: zeros of weight 0 when it is empty."""
    tensors, size = source.take(0)
    tensors = [splitting.identity(tensor) for tensor in tensors]  # On the tower's device, as the cond's switches.
    built = {}

    def build():
        micro = micro_batch(model, (tensors, size), keep=True, var_list=model.var_list)
        built["micro"] = micro
        return [micro.loss, tf.convert_to_tensor(micro.weight)], micro.pairs, micro.outputs

    (loss, weight), pairs, outputs = tower_guard.run_if(source.size > 0, build, first_outputs)
    micro = built["micro"]
    grad_weight = None if micro.grad_weight is None else weight
    return micro._replace(loss=loss, weight=weight, pairs=pairs, grad_weight=grad_weight, outputs=outputs)


def _tower_update_ops(update_ops, index):
    """What a tower runs: its own update ops, or only its window statistics when ``"first"`` keeps tower 0's."""
    return STATISTICS_ONLY if update_ops == FIRST and index else update_ops


def _placements(devices, variables_device):
    """One device function per tower, as ``tower.minimize`` places its towers.

    In a ``tf.distribute`` replica context, ``devices=None`` is one tower where
    the strategy placed the replica (its variables are the strategy's).
    """
    if devices is None and in_replica_context():
        return [_where_placed]
    if devices is None and visible_gpus():
        warnings.warn("subdivisions.minimize(devices=None) now means what it means in tower.minimize: every "
                      "visible GPU, variables on `variables_device`; it was one tower, unplaced. Pass "
                      "devices=['/gpu:0'] for one GPU", FutureWarning, stacklevel=3)
    checked = checked_placement(devices, variables_device)
    return [device_function(device, checked.variables_device) for device in checked.devices]


def _where_placed(op):
    return op.device or ""


def _combined(looped):
    """The towers' :data:`Looped` sums added: dense sums on their variable's device, sparse rows joined."""
    if len(looped) == 1:
        return looped[0]
    pairs = []
    for per_tower in zip(*[tower.pairs for tower in looped]):
        grads, var = [grad for grad, _ in per_tower], per_tower[0][1]
        with tf.compat.v1.device(var.device):
            if isinstance(grads[0], tf.IndexedSlices):
                pairs.append((tf.IndexedSlices(tf.concat([g.values for g in grads], 0),
                                               tf.concat([g.indices for g in grads], 0), grads[0].dense_shape), var))
            else:
                pairs.append((tf.add_n(grads), var))
    outputs = [tf.concat(list(parts), 0) for parts in zip(*[tower.outputs for tower in looped])]
    return Looped(tf.add_n([tower.loss_sum for tower in looped]), pairs,
                  tf.add_n([tower.total for tower in looped]), outputs)


def _packed_outputs(structure, flat):
    """The outputs in ``model_fn``'s nesting, or ``None`` when it returned none."""
    if structure is None:
        return None
    with tf.compat.v1.name_scope("outputs"):
        return tf.nest.pack_sequence_as(structure, [tf.identity(out) for out in flat])


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
    """What the one-run form does not build, in one ValueError."""
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

# A tower's micro-batches: take(i) is micro-batch i's (tensors, size); count how many
# there are (an int or an int32 tensor); size the tower's examples; may_be_empty
# whether size is known only at run time and may be 0 (a later tower).
_Source = collections.namedtuple("_Source", ["take", "count", "size", "may_be_empty"])


def _input_sources(inputs, k, towers, every_tower):
    """One :data:`_Source` per tower: its shard of the batch in ``min(k, shard size)`` micro-batches.

    A callable input is pulled k times per tower. ``every_tower``: each tower
    needs an example (``update_ops="all"``); otherwise the first does.
    """
    if callable(inputs) and not isinstance(inputs, (tf.Tensor, tf.Variable, tf.SparseTensor)):
        pulled = _Source(lambda i: _pulled(inputs), k, None, False)
        return [pulled] * towers
    static_k = tf.get_static_value(k)
    k = k if static_k is None else int(static_k)
    tensors, n = _checked_batch(splitting.check_inputs(inputs, "inputs"), towers if every_tower else 1)
    sources = []
    for index in range(towers):
        shard_start, shard_size = splitting.part(n, towers, index)
        count = (min(k, shard_size) if isinstance(k, int) and isinstance(shard_size, int)
                 else tf.minimum(k, shard_size))
        sources.append(_Source(_slicer(tensors, shard_start, shard_size, count), count, shard_size,
                               bool(index) and not isinstance(shard_size, int)))
    return sources


def _slicer(tensors, shard_start, shard_size, count):
    """``take(i)``: rows of micro-batch i of the shard ``[shard_start, shard_start + shard_size)``."""
    # An empty shard has no micro-batch: its micro-batch 0 (guarded, never run) divides by one.
    parts = count if isinstance(count, int) else tf.maximum(count, 1)

    def take(i):
        start, size = splitting.part(shard_size, parts, i)
        return [splitting.rows(tensor, shard_start + start, size) for tensor in tensors], size
    return take


def _pulled(inputs):
    """One micro-batch from a callable input, and its size (its first input's leading dimension)."""
    tensors = splitting.check_inputs(inputs(), "inputs()")
    return tensors, splitting.leading(tensors[0])


def _checked_batch(tensors, needed):
    """``(tensors, n)``: the inputs and their batch size n, after checks that n >= ``needed`` and they agree."""
    n = splitting.batch_size(tensors)
    if isinstance(n, int):
        if n < needed:
            raise ValueError("`inputs` must hold at least %d example%s, got a batch of %d"
                             % (needed, "s, one per tower with update_ops='all'" if needed > 1 else "", n))
        return splitting.checked(tensors, n, []), n
    n = tf.identity(n, name="batch_size")
    enough = tf.compat.v1.assert_greater_equal(
        n, needed, name="enough_examples",
        message="`inputs` must hold at least one example (one per tower with update_ops='all'); batch, needed:")
    return splitting.checked(tensors, n, [enough]), n
