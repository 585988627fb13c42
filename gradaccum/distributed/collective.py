"""Between-graph training: every worker reads its own data and all-reduces once per update.

Every worker process builds the same graph and runs its own session on its
own data. :class:`CollectiveAllReduce` wraps the optimizer: inside a
``GradientAccumulator`` it receives each window's un-normalised local sums
(``sum_i w_i * g_i``) and weight (``sum_i w_i``) once per window
(:meth:`CollectiveAllReduce.reduce_window`), sums both over the workers with
TensorFlow's collective all-reduce (the ring all-reduce behind
``MultiWorkerMirroredStrategy``, over TensorFlow's own gRPC runtime), and the
accumulator divides, decides skip or apply on the reduced values (the same on
every worker) and applies with :meth:`CollectiveAllReduce.apply_reduced`.
Used alone, :meth:`CollectiveAllReduce.apply_gradients` does the same once
per step. So an update equals one process training on the union of all
workers' micro-batches, whatever their sizes.

Messages: the tensors of one reduction are flattened into one buffer per
dtype (the weight rides in the float buffer), and a buffer larger than
``buffer_bytes`` is split into near-equal pieces; each piece is one
all-reduce. An ``IndexedSlices`` gradient is densified into a buffer of its
variable's full shape plus one "touched" flag per row (so the applied
gradient is sparse again and touches exactly the rows any worker touched):
that costs, per worker, a dense copy of the variable and its bytes on the
wire per update.

Setup: every task's server AND session need :func:`collective_session_config`
(it names the group leader, ``/job:<chief job>/replica:0/task:0``); run
:func:`broadcast_variables` once after initialisation or restore; keep a
``gradaccum.cluster.Heartbeat`` running around training, which ends a worker
whose peer died or stopped answering within its timeout (an all-reduce waits
for ever otherwise; TF 1.15's has no timeout of its own).

:class:`AllReduceOnApply` is the same idea for another all-reduce, Horovod's.

Every worker must build the same collective ops in the same order: each gets
the next instance key of a process-wide counter (the group key is
:data:`GROUP_KEY`). How tensors travel (packing, instance keys, the group of
a config) is ``gradaccum.distributed.wire``, shared with the sharded engine.

:func:`synchronized_batch_norm` extends ``gradaccum.batch_normalization``'s
synchronized statistics from the towers of one session to every worker: its
collectives join :data:`GROUP_KEY`'s group (each worker's CPU), with instance
keys from ``gradaccum.devices.context.next_collective_key`` (per graph, from
``1 << 24``), apart from this module's counter (from 1). One tower per
worker: inside the scope, a ``tower.minimize`` of several towers is refused.

Variables: in a job of several workers, ``CollectiveAllReduce.compute_gradients``
creates ``<name>_first_run/synced_<key>`` (bool, non-trainable; ``<key>`` is
the instance key of its all-reduce), in NO collection:
never saved and never initialised by ``global_variables_initializer``; the
first run of the train op in each process initialises it (see
:meth:`CollectiveAllReduce.compute_gradients`). The train op of
:meth:`CollectiveAllReduce.apply_gradients` goes to ``TRAIN_OP``, as an
optimizer's does (the wrapped optimizer's inner apply op is kept out of it);
nothing else is added to graph collections.
"""
from gradaccum import _validate
from gradaccum._compat import collective_broadcast, collective_sum, tf, v1_control_flow
from gradaccum.devices import context as tower_context
from gradaccum.distributed import wire
from gradaccum.distributed.wire import DEFAULT_BUFFER_BYTES, GROUP_KEY  # noqa: F401  Public here as before.
from gradaccum.window import pipeline
from gradaccum.window.reducers import Reducer


def collective_session_config(config, base=None):
    """The ``ConfigProto`` that both the server and the session of every task need.

    It names the collective group leader (the chief, or ``worker:0``) and
    restricts the session to this task's devices, so that a worker's session
    neither waits for nor talks to the others except through collectives.

    Args:
      config: a ``gradaccum.cluster.ClusterConfig`` of a chief or worker task.
      base: a ``tf.compat.v1.ConfigProto`` to start from (copied), or None.

    Returns:
      A new ``tf.compat.v1.ConfigProto``.

    Raises:
      TypeError: for ``config=None`` (one process needs no config).
      ValueError: for a ps task.

    Example:
      >>> proto = cluster.collective_session_config(config)
      >>> server = cluster.start_server(config, proto)
      >>> sess = tf.compat.v1.Session(server.target, config=proto)
    """
    if config is None:
        raise TypeError("`config` must be a gradaccum.cluster.ClusterConfig of a chief or worker task, got None")
    _, _, leader = wire.group(config)
    proto = tf.compat.v1.ConfigProto()
    if base is not None:
        proto.CopyFrom(base)
    proto.experimental.collective_group_leader = leader
    del proto.device_filters[:]
    proto.device_filters.append("/job:%s/task:%d" % (config.task_type, config.task_index))
    return proto


class CollectiveAllReduce(Reducer):
    """Sums each update's gradients over the workers with TF's collective all-reduce.

    Between-graph: every worker builds the same graph, runs its own session
    on its own data and holds its own copy of the variables; all copies stay
    equal because every worker applies the same reduced update (after the
    same start, :func:`broadcast_variables`).

    * Inside a ``GradientAccumulator`` (the accumulator wraps this
      optimizer) it is the window's reducer (``gradaccum.reducers``) and
      communicates once per applied update, never per micro-batch: each
      worker contributes ``sum_i w_i * g_i`` over its window and
      ``sum_i w_i``, so workers with different batch sizes, different
      weights, or an empty window (weight 0) still give the global weighted
      mean; a window skipped for zero total weight or (``skip_nonfinite``) a
      non-finite sum is skipped on every worker together.
    * Alone, :meth:`apply_gradients` reduces once per step; pass
      ``weight=`` the local batch size (``tf.shape(x)[0]``) for the exact
      global mean, otherwise every worker weighs 1.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the
        reduced gradients.
      config: this task's ``gradaccum.cluster.ClusterConfig`` (chief or
        worker), or None for one process (no communication).
      timeout_seconds: None, or seconds after which a waiting all-reduce
        fails with ``DeadlineExceededError``: TF >= 2.x only (TF 1.15's
        collectives have no timeout; ``_compat`` drops it there). The bound
        that holds on every version is ``gradaccum.cluster.Heartbeat``.
      buffer_bytes: the largest all-reduce message; a larger buffer is split.
      name: name scope of the reduce ops.

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer, or ``config`` not a
        ``ClusterConfig``.
      ValueError: for a ps task's ``config``, a bad ``timeout_seconds``,
        ``buffer_bytes`` or ``name``.

    Example:
      >>> config = cluster.from_environment()
      >>> opt = gradaccum.GradientAccumulator(
      ...     cluster.CollectiveAllReduce(tf.compat.v1.train.AdamOptimizer(1e-3), config), 4)
      >>> train_op = opt.minimize(loss, global_step=global_step, weight=tf.shape(x)[0])
    """

    def __init__(self, optimizer, config, *, timeout_seconds=None, buffer_bytes=DEFAULT_BUFFER_BYTES,
                 name="CollectiveAllReduce"):
        super(CollectiveAllReduce, self).__init__(optimizer, name)  # Checks `optimizer` and `name`.
        self._size, self._rank, _ = wire.group(config)
        self._config = config
        self._timeout = _validate.check_positive_number(timeout_seconds, "timeout_seconds")
        self._buffer_bytes = _validate.check_positive_int(buffer_bytes, "buffer_bytes")
        self._all_reduces = 0
        self._bytes = 0

    @property
    def num_workers(self):
        """How many processes take part in each all-reduce."""
        return self._size

    @property
    def worker_rank(self):
        """This process's index among the workers (0 for one process)."""
        return self._rank

    @property
    def all_reduces_per_update(self):
        """All-reduce ops one update runs (after the train op is built)."""
        return self._all_reduces

    @property
    def bytes_per_update(self):
        """Bytes this worker contributes to the all-reduces of one update.

        A ring all-reduce sends about ``2 * (P - 1) / P`` times this per worker.
        """
        return self._bytes

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, after this process's first-run sync.

        In graph mode every worker numbers its runs of a graph from a sequence
        it fetches from the group leader on its first run; a leader that
        finished runs without communication (micro-batches of a window) before
        a peer fetched would leave the two numbered apart, and their
        all-reduce would fail. So the first run of the train op in each
        process all-reduces one number, which holds the leader until every
        worker has its sequence; later runs skip it (a ``tf.cond`` on a flag
        variable in no collection: never saved, never initialised by
        ``global_variables_initializer``). The flag's name carries the
        all-reduce's instance key, new in every graph: a server keeps
        variables by name across sessions, so a second graph on the same
        server would otherwise find its flag set and skip its own sync.

        Args:
          *args: as ``tf.compat.v1.train.Optimizer.compute_gradients``.
          **kwargs: as ``tf.compat.v1.train.Optimizer.compute_gradients``.

        Returns:
          The list of ``(gradient, variable)`` pairs.

        Example:
          >>> grads_and_vars = opt.compute_gradients(loss)
        """
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if self._size == 1:
            return pairs
        sync = self._first_run_sync()
        return [(None if grad is None else _after(grad, sync), var) for grad, var in pairs]

    def _first_run_sync(self):
        with tf.compat.v1.name_scope(self._name + "_first_run"):
            key = wire.next_instance_key()
            with tf.compat.v1.init_scope():
                flag = tf.compat.v1.Variable(True, trainable=False, collections=[], name="synced_%d" % key)
            first = tf.logical_not(tf.compat.v1.is_variable_initialized(flag))

            def sync():
                with tf.device(wire.device(self._config)):
                    one = collective_sum(tf.ones([1]), self._size, GROUP_KEY, key, self._timeout)
                # A new assign inside the branch: the variable's own initializer op lives
                # outside the cond, so it would run on every first run, racing with
                # IsVariableInitialized; a worker that lost that race skipped the sync
                # while its peers waited in it.
                with tf.control_dependencies([one]):
                    return tf.group(flag.assign(True, read_value=False))

            # v1 control flow: its CollectiveReduce is a node of the graph itself, so
            # the session numbers the runs of this graph from the leader's sequence
            # (with control flow v2 the collectives hide in branch functions, every
            # worker numbers its runs at random, and their all-reduces never meet).
            with v1_control_flow():
                return tf.cond(first, sync, tf.no_op, name="sync_once")

    def _all_reduce(self, piece):
        self._bytes += piece.shape.num_elements() * piece.dtype.size
        return collective_sum(piece, self._size, GROUP_KEY, wire.next_instance_key(), self._timeout,
                              device=wire.device(self._config))

    def reduce(self, sums_and_vars, total, extras):
        """Sums the window's local sums, weight and extra scalars over the workers, in one exchange.

        Dense sums, sparse ones (densified, with their touched-row flags),
        the extra scalars and the weight are packed into buffers of at most
        ``buffer_bytes``, one all-reduce each.

        Args:
          sums_and_vars: list of ``(sum, variable)``: ``sum_i w_i * g_i`` of
            this worker's window, dense tensors or ``IndexedSlices``.
          total: scalar tensor, ``sum_i w_i`` of this worker's window.
          extras: list of scalar tensors (statistics' sums, a clip's norm).

        Returns:
          ``(sums_and_vars, total, extras)``: the same structure, summed over
          every worker (an ``IndexedSlices`` stays one, over the rows any
          worker touched).

        Raises:
          ValueError: for a gradient or variable without a fully defined shape.

        Example:
          >>> sums, total, extras = opt.reduce(sums_and_vars, weight_sum, [])
        """
        if self._size == 1:
            return list(sums_and_vars), total, list(extras)
        with tf.compat.v1.name_scope(self._name + "_reduce"):
            flat, widths = wire.to_wire(sums_and_vars)
            flat.extend(tf.reshape(value, []) for value in extras)
            flat.append(tf.reshape(total, []))
            self._bytes = 0
            reduced, self._all_reduces = wire.packed(flat, self._buffer_bytes, self._all_reduce)
        out = wire.from_wire(reduced, sums_and_vars, widths)
        return out, reduced[-1], list(reduced[sum(widths):-1])

    def reduce_window(self, sums_and_vars, weight):
        """:meth:`reduce` without extra scalars: ``(reduced_sums_and_vars, reduced_weight)``.

        Args:
          sums_and_vars: as :meth:`reduce`.
          weight: as ``total`` in :meth:`reduce`.

        Returns:
          ``(reduced_sums_and_vars, reduced_weight)``.

        Example:
          >>> sums, total = opt.reduce_window(sums_and_vars, weight_sum)
        """
        sums, total, _ = self.reduce(sums_and_vars, weight, [])
        return sums, total

    def apply_gradients(self, grads_and_vars, global_step=None, name=None, *, weight=None):
        """Reduces ``weight * grad`` and ``weight`` over the workers, divides, applies.

        One reduction per run: the accumulator's k = 1 window
        (``gradaccum.window.pipeline.reduce_and_apply``), without its
        ``skipped_windows`` counter. When the summed weight is 0 (no worker
        had data), nothing is applied and ``global_step`` does not move, on
        every worker alike; an applied update moves it by exactly one, also
        for a wrapped optimizer that does not count it.

        Args:
          grads_and_vars: list of ``(gradient, variable)``; ``None`` gradients
            are left out.
          global_step: optional variable, incremented once per applied update.
          name: optional name of the returned op.
          weight: None (every worker weighs 1) or a scalar tensor, this
            worker's batch size for the exact global mean.

        Returns:
          The train op.

        Raises:
          ValueError: when no gradient is given, or for shapes not fully defined.

        Example:
          >>> train_op = opt.apply_gradients(opt.compute_gradients(loss), global_step,
          ...                                weight=tf.shape(x)[0])
        """
        weight = _validate.check_scalar_tensor(weight, "weight", allow_none=True)
        # The window's own k = 1 path, without its state: weigh, reduce, divide, apply or skip.
        return pipeline.reduce_and_apply(self, grads_and_vars, global_step, name, weight)


def _after(grad, op):
    with tf.control_dependencies([op]):
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(tf.identity(grad.values), tf.identity(grad.indices), grad.dense_shape)
        return tf.identity(grad)


def broadcast_variables(config, variables=None, *, timeout_seconds=None, buffer_bytes=DEFAULT_BUFFER_BYTES,
                        name="broadcast_variables"):
    """An op that copies worker 0's values of ``variables`` to every worker.

    Run it once on every worker, after initialisation or a restore (the chief
    restores the checkpoint, the others initialise): afterwards every worker
    holds the chief's values. The values travel packed, one collective
    broadcast per dtype (split above ``buffer_bytes``). Every worker must pass
    the same variables in the same order (the default does).

    Args:
      config: this task's ``gradaccum.cluster.ClusterConfig``, or None (one
        process: the op does nothing).
      variables: list of variables; default all global variables.
      timeout_seconds: as in :class:`CollectiveAllReduce`.
      buffer_bytes: the largest broadcast message.
      name: name of the returned op.

    Returns:
      The op; on worker 0 it sends, on the others it receives and assigns.

    Raises:
      ValueError: for a ps task, a variable of a dtype collectives cannot
        carry, or a shape that is not fully defined.

    Example:
      >>> sess.run(tf.compat.v1.global_variables_initializer())
      >>> sess.run(cluster.broadcast_variables(config))
    """
    size, rank, _ = wire.group(config)
    timeout = _validate.check_positive_number(timeout_seconds, "timeout_seconds")
    buffer_bytes = _validate.check_positive_int(buffer_bytes, "buffer_bytes")
    variables = tf.compat.v1.global_variables() if variables is None else list(variables)
    for var in variables:
        if var.dtype.base_dtype not in wire.BROADCAST_DTYPES:
            raise ValueError("`variables` must have dtypes %s, got %r of %s"
                             % (", ".join(d.name for d in wire.BROADCAST_DTYPES), var.op.name,
                                var.dtype.base_dtype.name))
        wire.check_static(var, "variable %r" % var.op.name)
    if size == 1 or not variables:
        return tf.no_op(name=name)
    with tf.compat.v1.name_scope(name):
        def exchange(piece):
            return collective_broadcast(piece, rank == 0, size, GROUP_KEY, wire.next_instance_key(), timeout,
                                        device=wire.device(config))

        values, _ = wire.packed([tf.convert_to_tensor(var) for var in variables], buffer_bytes, exchange)
        if rank == 0:
            return tf.group(*values, name="sent")
        return tf.group(*[var.assign(value) for var, value in zip(variables, values)], name="assigned")


def synchronized_batch_norm(config, *, timeout_seconds=None):
    """A scope whose training-mode ``gradaccum.batch_normalization`` calls use every worker's batch.

    Every ``gradaccum.batch_normalization`` call built inside the ``with``
    block in training mode normalises with the mean and variance of the
    union of all workers' batches, as one process would on that union.
    Each worker moves its own ``moving_mean`` and ``moving_variance`` from
    those global statistics (under a ``GradientAccumulator``, once per window
    from the global window), so all workers keep equal copies. Per layer and
    run, two small all-reduces forwards and two backwards, on every run
    that evaluates the layer: every worker must make the same runs. The
    gradient through the shared statistics weighs each worker by its example
    count: exact when the ``weight`` given to the accumulator or to
    :meth:`CollectiveAllReduce.apply_gradients` is the example count
    (``tf.shape(x)[0]``), the normal use. Every worker must build the same
    layers in the same order. One tower per worker: a layer built by a
    ``gradaccum.tower.minimize`` of several towers inside the scope raises
    ``ValueError`` (synchronizing every tower of every worker deadlocked
    intermittently in our tests).

    Args:
      config: this task's ``gradaccum.cluster.ClusterConfig`` (chief or
        worker), or None; with one worker (or None) the scope changes nothing.
      timeout_seconds: None, or seconds after which a waiting all-reduce
        fails with ``DeadlineExceededError`` (TF 2.x only, as in
        :class:`CollectiveAllReduce`).

    Returns:
      A context manager (enter it while building the model).

    Raises:
      TypeError: when ``config`` is not a ``ClusterConfig`` or None.
      ValueError: for a ps task's ``config`` or a bad ``timeout_seconds``.

    Example:
      >>> with cluster.synchronized_batch_norm(config):
      ...     h = gradaccum.batch_normalization(images, training=True)
      ...     loss = model_head(h, labels)
      ...     train_op = opt.minimize(loss, global_step=global_step, weight=tf.shape(images)[0])
    """
    size, _, _ = wire.group(config)
    timeout = _validate.check_positive_number(timeout_seconds, "timeout_seconds")
    if size == 1:
        return tower_context.WorkerScope(1, None, None)
    # The workers' CPUs are exactly the devices of GROUP_KEY's group: the same group, other instance
    # keys (the per-graph counter of _tower_context, from 1 << 24; ours count from 1).
    return tower_context.WorkerScope(size, GROUP_KEY, wire.device(config), timeout)


class AllReduceOnApply(Reducer):
    """Reduces gradients across processes when, and only when, they are applied.

    Put it INSIDE a ``GradientAccumulator``: the accumulator adds local
    micro-batch gradients without communication and, as the window's reducer
    (``gradaccum.reducers``), hands their average to this optimizer's
    :meth:`apply_reduced` once per window, which all-reduces it and applies
    it. Its :meth:`~gradaccum.Reducer.reduce` keeps the window local, so
    skip decisions and statistics are each process's own. ``hvd.DistributedOptimizer`` instead reduces in
    ``compute_gradients``, i.e. on every micro-batch. Every process must run
    the same number of micro-batches, so that all reach the reduce together,
    and none may skip a window alone: ``skip_nonfinite=True`` on the
    accumulator is refused (``ValueError``) when the train op is built; a
    loss-scale optimizer wrapped inside this one tests the reduced gradients,
    the same on every rank.

    For TensorFlow's own collectives use :class:`CollectiveAllReduce`, which
    also sums the window weights (exact with uneven data) and lets every
    worker skip together.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` that applies the reduced
        gradients.
      all_reduce: callable taking one gradient (a tensor or ``IndexedSlices``)
        and returning its reduction across processes, for example
        ``lambda g: hvd.allreduce(g, op=hvd.Average)``.
      name: name scope of the reduce ops.

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer or ``all_reduce`` is
        not callable.
      ValueError: when ``name`` is not a non-empty string.

    Example:
      >>> import horovod.tensorflow as hvd
      >>> hvd.init()
      >>> opt = gradaccum.GradientAccumulator(
      ...     AllReduceOnApply(tf.compat.v1.train.AdamOptimizer(1e-3 * hvd.size()),
      ...                      lambda g: hvd.allreduce(g, op=hvd.Average)),
      ...     num_micro_batches=4)
      >>> train_op = opt.minimize(loss, global_step=global_step, weight=tf.shape(x)[0])
    """

    def __init__(self, optimizer, all_reduce, name="AllReduceOnApply"):
        super(AllReduceOnApply, self).__init__(optimizer, name)  # Checks `optimizer` and `name`.
        if not callable(all_reduce):
            raise TypeError("`all_reduce` must be callable (gradient -> reduced gradient), got %s"
                            % _validate.describe(all_reduce))
        self._all_reduce = all_reduce

    @property
    def skips_alike(self):
        """Not here: ``reduce`` keeps each rank's window, so ranks decide a skip apart.

        So a ``GradientAccumulator(..., skip_nonfinite=True)`` around it is
        refused when its train op is built (a rank that skipped would leave
        the others waiting in the all-reduce).
        """
        return False

    def apply_reduced(self, grads_and_vars, global_step=None, name=None):
        """The window's apply step (``gradaccum.reducers``): :meth:`apply_gradients` of its mean.

        Example:
          >>> train_op = opt.apply_reduced(averaged, global_step)
        """
        return self.apply_gradients(grads_and_vars, global_step=global_step, name=name)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """All-reduces each gradient, then applies through the wrapped optimizer.

        Args:
          grads_and_vars: list of ``(gradient, variable)``; ``None`` gradients
            are passed on unreduced.
          global_step: optional variable, incremented by the wrapped optimizer.
          name: optional name of the returned op.

        Returns:
          The wrapped optimizer's apply op.

        Example:
          >>> train_op = opt.apply_gradients(grads_and_vars, global_step)
        """
        with tf.compat.v1.name_scope(self._name):
            reduced = [(None if grad is None else self._all_reduce(grad), var) for grad, var in grads_and_vars]
        return self._optimizer.apply_gradients(reduced, global_step=global_step, name=name)
