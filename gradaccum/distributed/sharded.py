"""Sharded optimizer state over collective workers (ZeRO stages 1 and 2): each worker keeps its variables' slots.

:class:`ShardedAllReduce` is :class:`gradaccum.collective.CollectiveAllReduce`
with one change in :meth:`~ShardedAllReduce.apply_reduced`: the trainable
variables are partitioned over the P workers (whole variables, balanced by
bytes, :func:`partition_variables`), each worker applies the wrapped
optimizer to the variables it owns only, so the optimizer creates slots (Adam's
``m`` and ``v``) for those only, and then every variable travels from its
owner to every other worker by collective broadcast: one broadcast per owner
and dtype, packed as the all-reduce packs (split above ``buffer_bytes``).

The window's reduction is the unsharded engine's, unchanged: an all-reduce
of every sum, so that every worker holds the whole reduced gradient and
takes every whole-gradient decision alike (zero-weight and non-finite skip,
``clip_norm``, the noise-scale statistics, the adaptive policy). Both
stages use an all-reduce on every TF version: TF 1.15 has no reduce-scatter,
and TF 2.15's and 2.21's ``CollectiveReduceScatterV2`` does not run on the
CPU devices these collectives use ("Failed to get CollectiveExecutor", TF1
behaviour; "did not find collective implementation", TF2 behaviour;
``benchmarks/sharded.py --collectives`` tries it). Bytes on the wire per
update and worker: the all-reduce's ``2 (P - 1) / P`` times the gradient
bytes, plus the broadcasts, about ``(P - 1) / P`` times the model bytes; a
reduce-scatter with an all-gather would send ``2 (P - 1) / P`` in all.

Stage 2 (``shard_cache=True``): :meth:`~ShardedAllReduce.reduce_micro_batch`
all-reduces each micro-batch's weighted gradient when it is added (then
each worker keeps its own variables' sums) and hands the window the owned
sums only, so the window caches those only; at the window's end :meth:`~gradaccum.Reducer.reduce` gets no gradient,
only the weight and the whole-gradient scalars (squared norm, non-finite
count) that every worker decides from. Bytes on the wire per update: k
times the all-reduce's, plus the broadcasts. A sparse (``IndexedSlices``)
gradient travels as the unsharded engine's does, densified to its
variable's shape plus one flag per row, but on every micro-batch: its owner
gets an ``IndexedSlices`` of the rows any worker touched, caches it sparse
and applies it sparse; ``clip_norm`` measures its rows as given, from each
worker's own micro-batches (the window's ``sparse_sq_norm``, summed over the
workers at the end with the other scalars). Statistics, AdaptiveBatch and
observers work, with the unsharded numbers: observers see each worker's own
micro-batches and, at the window's end, its share with the whole gradient's
squared norm (``WindowUpdate.sq_norm``, :mod:`gradaccum.observers`).
Refused: fewer variables than workers (here), window batch norm (by the
window) and loss scaling (when the accumulator is constructed).

Variables: the wrapped optimizer's slots, for the owned variables only, and
its non-slot variables (Adam's ``beta1_power`` and ``beta2_power``, once per
graph) on a worker that owns at least one variable; the first-run flag of
:class:`~gradaccum.collective.CollectiveAllReduce` (in no collection). No
collection is added to. ``global_step`` is incremented once per applied
update on every worker, after the broadcasts (the wrapped optimizer is not
given it), so a schedule that reads it sees the same step everywhere.
With ``shard_cache=True`` the accumulator's caches (``<var>/<scope>``, and
``<var>/<scope>_touched`` of a sparse one) exist for the owned variables
only; its counters (``micro_step``, ``weight_sum``, ``skipped_windows``, and
``sparse_sq_norm`` with ``clip_norm`` and a sparse gradient) on every worker.

Checkpoints: see :mod:`gradaccum.consolidate` (each worker saves its own
shard under ``<dir>/shard-<rank>-of-<P>/``).
"""
from gradaccum import _validate
from gradaccum._compat import BROADCAST_FROM_ANY_TASK, collective_broadcast_from, loss_scale_optimizer_types, tf
from gradaccum.distributed import wire
from gradaccum.distributed.collective import CollectiveAllReduce
from gradaccum.distributed.wire import DEFAULT_BUFFER_BYTES, GROUP_KEY
from gradaccum.window.gradients import weighted
from gradaccum.window.reducers import Reducer
from gradaccum.window.wrapper import optimizer_chain


def _variable_bytes(var):
    wire.check_static(var, "variable %r" % var.op.name)
    return var.shape.num_elements() * var.dtype.base_dtype.size


def partition_variables(variables, num_workers):
    """The owner (worker rank) of each variable: whole variables, greedily balanced by bytes.

    The rule, computed alike by every worker from the variables alone: sort
    the variables by bytes, largest first (ties by name), and give each in
    turn to the worker holding the fewest bytes so far (ties to the lowest
    rank). A worker's share is at most ``total / P + largest variable``; when
    one variable holds more than ``total / P`` bytes (an embedding table),
    its owner holds that variable alone or nearly, and the others share the
    rest: whole variables are never split.

    Args:
      variables: list of variables with fully defined shapes.
      num_workers: int >= 1, the number of workers P.

    Returns:
      A list of ints in ``[0, num_workers)``, one per variable, in order.

    Raises:
      ValueError: for a bad ``num_workers``, or a shape not fully defined.

    Example:
      >>> partition_variables([embedding, kernel, bias], 2)  # 4 MB, 1 MB, 4 KB
      [0, 1, 1]
    """
    num_workers = _validate.check_positive_int(num_workers, "num_workers")
    sizes = [_variable_bytes(var) for var in variables]
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], variables[i].op.name))
    loads, owners = [0] * num_workers, [0] * len(sizes)
    for i in order:
        owner = min(range(num_workers), key=lambda rank: (loads[rank], rank))
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


def _check_wrapped(optimizer):
    """Refuses the wrapped optimizers whose apply cannot be split over workers, in one line."""
    scaled = loss_scale_optimizer_types()
    for inner in optimizer_chain(optimizer):
        if scaled and isinstance(inner, scaled):
            raise ValueError(
                "`optimizer` %s is a loss-scale optimizer: ShardedAllReduce cannot shard its state (each "
                "worker would test only its own variables for overflow and move the loss scale apart); wrap "
                "a plain optimizer and use GradientAccumulator(..., skip_nonfinite=True)" % type(inner).__name__)
        if isinstance(inner, Reducer) or type(inner).__name__ == "GradientAccumulator":
            raise ValueError("`optimizer` must not be a reducer or a GradientAccumulator (wrap ShardedAllReduce "
                             "in the accumulator: GradientAccumulator(ShardedAllReduce(adam, config), k)), got %s"
                             % type(inner).__name__)


def _names(variables):
    return frozenset(var.op.name for var in variables)


def _at_least_float32(grad):
    """Half-precision sums over workers would lose digits: sum in float32, as the window's cache does.

    An ``IndexedSlices`` stays one (its values cast).
    """
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(_at_least_float32(grad.values), grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    return tf.cast(grad, tf.float32) if grad.dtype.base_dtype in (tf.float16, tf.bfloat16) else grad


def _check_broadcastable(variables):
    for var in variables:
        if var.dtype.base_dtype not in wire.BROADCAST_DTYPES:
            raise ValueError("ShardedAllReduce broadcasts every trained variable: dtypes %s, got %r of %s"
                             % (", ".join(d.name for d in wire.BROADCAST_DTYPES), var.op.name,
                                var.dtype.base_dtype.name))
        wire.check_static(var, "variable %r" % var.op.name)


class ShardedAllReduce(CollectiveAllReduce):
    """:class:`~gradaccum.collective.CollectiveAllReduce` whose optimizer state is sharded over the workers.

    Stage 1 of ZeRO: the window is all-reduced as by the unsharded engine
    (so skip, clip and statistics decide on the whole gradient, alike on
    every worker); then each worker applies the wrapped optimizer to the
    variables it owns (:func:`partition_variables`), so slots exist only
    for those, and broadcasts them to the others. With Adam a worker holds
    ``4 + 4 + 8 / P`` bytes per float32 parameter (model, accumulation
    cache, its share of the moments) instead of 16. The updates equal the
    unsharded engine's and one process's on the union of the data.

    What differs for the user:

    * Broadcast only the model after initialisation:
      ``cluster.broadcast_variables(config, tf.compat.v1.trainable_variables())``
      (the workers' global variables differ: each has its own slots).
    * Every worker saves and restores its own checkpoint shard
      (:mod:`gradaccum.consolidate`); a worker restores its own shard and
      broadcasts nothing after it.
    * Not supported: a wrapped loss-scale optimizer (refused here; use
      ``skip_nonfinite``), splitting one variable over workers.
    * ``shard_cache=True`` (stage 2) shards the accumulation cache too:
      ``4 + 12 / P`` bytes per parameter; k all-reduces per update instead
      of one (:meth:`reduce_micro_batch`). It refuses window batch norm and
      loss scaling (statistics, AdaptiveBatch and observers work: see
      :mod:`gradaccum.observers`). Towers inside a worker are fine (the
      worker's optimizer state is not split further over them).
    * A sparse gradient (``tf.gather``) is densified for the all-reduce, as
      by the unsharded engine (a dense copy of the variable plus a flag per
      row; in stage 2 on every micro-batch), and applied sparse by its
      owner, over the rows any worker touched.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies each
        worker's share of the update (not a loss-scale optimizer).
      config: this task's ``gradaccum.cluster.ClusterConfig`` (chief or
        worker), or None for one process (no sharding, no communication).
      timeout_seconds: as in ``CollectiveAllReduce``.
      buffer_bytes: the largest all-reduce or broadcast message.
      name: name scope of the reduce and broadcast ops.
      shard_cache: bool; True shards the accumulation cache too (stage 2).

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer, ``config`` not
        a ``ClusterConfig``, or ``shard_cache`` not a bool.
      ValueError: for a loss-scale, reducer or accumulator ``optimizer``, a
        ps task's ``config``, a bad ``timeout_seconds``, ``buffer_bytes`` or
        ``name``.

    Example:
      >>> config = cluster.load_tf_config()
      >>> opt = gradaccum.GradientAccumulator(
      ...     gradaccum.ShardedAllReduce(tf.compat.v1.train.AdamOptimizer(1e-3), config), 4)
      >>> train_op = opt.minimize(loss, global_step=global_step, weight=tf.shape(x)[0])
      >>> broadcast = cluster.broadcast_variables(config, tf.compat.v1.trainable_variables())
    """

    def __init__(self, optimizer, config, *, timeout_seconds=None, buffer_bytes=DEFAULT_BUFFER_BYTES,
                 name="ShardedAllReduce", shard_cache=False):
        super(ShardedAllReduce, self).__init__(optimizer, config, timeout_seconds=timeout_seconds,
                                               buffer_bytes=buffer_bytes, name=name)
        _check_wrapped(optimizer)
        if not isinstance(shard_cache, bool):
            raise TypeError("`shard_cache` must be a bool, got %s" % _validate.describe(shard_cache))
        self._shard_cache = shard_cache
        self._owners = {}
        self._partitions = {}  # Stage 2: {owned variable names: (every variable, owners)}
        self._broadcasts = 0
        self._sent_bytes = 0
        self._micro_bytes = 0

    @property
    def owners(self):
        """``{variable name: owner rank}`` of the last train op built (empty before)."""
        return dict(self._owners)

    @property
    def broadcasts_per_update(self):
        """Broadcast ops one applied update runs on this worker (after the train op is built)."""
        return self._broadcasts

    @property
    def broadcast_bytes_per_update(self):
        """Bytes this worker puts into the broadcasts of one update: its own variables'.

        Where TF cannot broadcast from a worker other than rank 0 (TF < 2.21,
        ``_compat.BROADCAST_FROM_ANY_TASK``), the other owners' variables
        travel by an all-reduce to which every worker adds zeros: then their
        bytes count here too.
        """
        return self._sent_bytes

    @property
    def applies_a_share(self):
        """Whether each worker applies the wrapped optimizer to a share of the variables only; True here, its own."""
        return True

    @property
    def shard_cache(self):
        """Whether the accumulation cache is sharded too (stage 2)."""
        return self._shard_cache

    @property
    def micro_batch_bytes(self):
        """Bytes this worker puts into the all-reduces of one micro-batch (stage 2; 0 before or without it).

        A ring all-reduce sends about ``2 (P - 1) / P`` times this per worker,
        k times per update.
        """
        return self._micro_bytes

    def reduce_micro_batch(self, grads_and_vars, weight):
        """Stage 2: sums ``weight * gradient`` over the workers on every micro-batch; returns this worker's share.

        The gradients are packed as at the end of a window (one buffer per
        dtype, split above ``buffer_bytes``) and all-reduced, on every TF
        version; each worker keeps the sums of the variables it owns
        (:func:`partition_variables`), so the window caches those only.
        Half-precision gradients are summed in float32. A sparse
        (``IndexedSlices``) gradient travels densified, with one touched
        flag per row, as in
        :meth:`gradaccum.collective.CollectiveAllReduce.reduce`, and its sum
        comes back as an ``IndexedSlices`` of the rows any worker touched in
        this micro-batch (a zero weight or a zero sum still touches them), so
        the window caches it sparse and its owner applies it over the union
        of the window's rows, as the unsharded engine does.

        Args:
          grads_and_vars: list of ``(gradient, variable)`` of one micro-batch.
          weight: None or a scalar tensor, the micro-batch's weight.

        Returns:
          None without ``shard_cache`` or for one process; else the owned
          ``(sum over workers, variable)`` pairs (dense tensors or
          ``IndexedSlices``, as the gradients).

        Raises:
          ValueError: for fewer variables than workers, a variable of a dtype
            collectives cannot carry, or a shape not fully defined.

        Example:
          >>> mine = reducer.reduce_micro_batch(pairs, tf.shape(x)[0])
        """
        if not self._shard_cache or self._size == 1:
            return None
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        variables = [v for _, v in pairs]
        _check_broadcastable(variables)
        owners = partition_variables(variables, self._size)
        if set(owners) != set(range(self._size)):
            raise ValueError("ShardedAllReduce(shard_cache=True) needs every worker to own a variable: %d "
                             "variables with gradients over `config`'s %d workers leave rank %d none"
                             % (len(variables), self._size, min(set(range(self._size)) - set(owners))))
        with tf.compat.v1.name_scope(self._name + "_micro_batch"):
            weighted_pairs = [(weighted(_at_least_float32(g), weight), v) for g, v in pairs]
            flat, widths = wire.to_wire(weighted_pairs)
            self._micro_bytes = sum(t.shape.num_elements() * t.dtype.size for t in flat)
            before = self._bytes
            reduced, _ = wire.packed(flat, self._buffer_bytes, self._all_reduce)
            self._bytes = before
            summed = wire.from_wire(reduced, weighted_pairs, widths)
        mine = [pair for pair, owner in zip(summed, owners) if owner == self._rank]
        self._partitions[_names(var for _, var in mine)] = (variables, owners)
        return mine

    def apply_reduced(self, grads_and_vars, global_step=None, name=None):
        """Applies the wrapped optimizer to this worker's variables, then broadcasts every variable from its owner.

        Args:
          grads_and_vars: list of ``(gradient, variable)``: the window's
            mean over every worker, clipped; ``None`` gradients are left out.
          global_step: optional variable, incremented once after the
            broadcasts, on every worker.
          name: optional name of the returned op.

        Returns:
          The op.

        Raises:
          ValueError: when no gradient is given, or for a variable of a dtype
            collectives cannot carry or a shape not fully defined.

        Example:
          >>> op = reducer.apply_reduced(averaged, global_step)
        """
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError("`grads_and_vars` has no gradient for any variable")
        if self._size == 1:
            return self._optimizer.apply_gradients(pairs, global_step=global_step, name=name)
        variables = [v for _, v in pairs]
        _check_broadcastable(variables)
        if _names(variables) in self._partitions:  # Stage 2: the window gave this worker's share only.
            variables, owners = self._partitions[_names(variables)]
            mine = pairs
        else:
            owners = partition_variables(variables, self._size)
            mine = [pair for pair, owner in zip(pairs, owners) if owner == self._rank]
        self._owners = dict((v.op.name, r) for v, r in zip(variables, owners))
        # In the caller's name scope, as unsharded: Adam's beta powers are named from it.
        applied = self._optimizer.apply_gradients(mine) if mine else tf.no_op(name="owns_nothing")
        with tf.compat.v1.name_scope(self._name + "_broadcast"):
            done = self._broadcast_from_owners(variables, owners, applied)
        if global_step is None:
            return tf.group(done, name=name)
        with tf.control_dependencies([done]):
            with tf.compat.v1.colocate_with(global_step):
                count = tf.compat.v1.assign_add(global_step, tf.ones([], global_step.dtype.base_dtype))
        return tf.group(count, name=name)

    def _broadcast_from_owners(self, variables, owners, applied):
        """Per owner, in rank order (alike on every worker): its variables, packed, broadcast after its update.

        The owners' broadcasts run concurrently. Chaining them (one owner's
        after the previous one's landed, to keep one share's receive buffers
        alive at a time instead of the model's) measured 1.75 times the
        unsharded update's time at P = 2 instead of 1.1, and no measurable
        peak-RSS gain on a 10M model.
        """
        done, self._broadcasts, self._sent_bytes = [applied], 0, 0
        for owner in range(self._size):
            held = [var for var, rank in zip(variables, owners) if rank == owner]
            if not held:
                continue
            sending = owner == self._rank
            with tf.control_dependencies([applied] if sending else None):
                values = [var.read_value() if sending else tf.identity(var) for var in held]

            def exchange(piece, sending=sending, leads=owner == 0):
                if sending or not (leads or BROADCAST_FROM_ANY_TASK):  # an all-reduce: everyone sends
                    self._sent_bytes += piece.shape.num_elements() * piece.dtype.size
                return collective_broadcast_from(piece, sending, leads, self._size, GROUP_KEY,
                                                 wire.next_instance_key(), self._timeout,
                                                 device=wire.device(self._config))

            received, count = wire.packed(values, self._buffer_bytes, exchange)
            self._broadcasts += count
            if sending:
                done.append(tf.group(*received, name="sent_%d" % owner))
            else:
                done.append(tf.group(*[tf.compat.v1.assign(var, value) for var, value in zip(held, received)],
                                     name="from_%d" % owner))
        return tf.group(*done, name="all_owners")
