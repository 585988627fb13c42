"""The window under a ``tf.distribute`` strategy: one window per replica, one reduction per update.

A train op built where a strategy runs the model once per replica (an
Estimator's ``model_fn`` with ``train_distribute``, Keras under
``strategy.scope()``, ``strategy.run``, ``experimental_run_v2`` or
``extended.call_for_each_replica``) keeps its window on each replica: runs
1 to k-1 add to that replica's caches and move nothing between devices or
workers. Every run hands the replica's window to the strategy through one
``merge_call``, unconditionally (a ``merge_call`` inside a ``tf.cond``
branch cannot run); the condition on the window's end lives inside it,
built with v1 control flow, so that the strategy's cross-device ops are
ordinary graph nodes that run on the last micro-batch only. There it:

1. reduces every replica's sums and weight in one ``batch_reduce_to`` (SUM):
   the strategy's own all-reduce (NCCL, ring, collective or copy to one
   device, as the strategy chooses);
2. on each device, divides by the summed weight over the replica count,
   decides skip and clips, as the window does (``pipeline.averaged``);
3. applies through the wrapped optimizer's own cross-replica apply, handed
   the reduced values (so nothing is reduced twice), which increments
   ``global_step`` once.

The update is ``R * sum(w g) / sum(w)`` over all R replicas' micro-batches.
The strategy sums its replicas' gradients, so each replica's loss carries
1/R (the v1 optimizer's ``compute_gradients`` scales a mean loss so under a
strategy): the update is then one device's step on the global batch, and
with even micro-batches the strategy's plain step with each replica fed its
whole window.

Variables: the window's own (see ``gradaccum.window.pipeline``), one set per
replica, made directly as resource variables past the strategy's variable
creator (neither mirrored nor aggregated), each on its replica's device
(colocated with the replica's copy of its variable where there is one). A
replica's set is named as the pipeline names it, in the replica's name
scope; where two replicas would share a name (CentralStorageStrategy keeps
one copy of each variable), replica r > 0's name ends in ``_replica_<r>``.
They go to ``GLOBAL_VARIABLES`` only.
"""
import contextlib
import functools

from gradaccum._compat import distributed_apply, like_distributed, plain_resource_variable, tf, v1_control_flow

# The strategies whose replicas all apply the same reduced update in step, by
# their ``extended`` class (TF 1.15 to 2.x name them alike). Any other is
# refused by name: an unknown strategy must not train silently differently.
_SYNCHRONOUS = ("MirroredExtended", "CollectiveAllReduceExtended", "OneDeviceExtended")
# TF 1's ParameterServerStrategy and CentralStorageStrategy share this class:
# with its variables on a parameter-server job each worker applies its own
# update, asynchronously; with them on a local device (CentralStorageStrategy,
# or no cluster) it is one synchronous step.
_PARAMETER_SERVER = "ParameterServerStrategyExtended"
_INSTEAD = ("use MirroredStrategy, MultiWorkerMirroredStrategy, CentralStorageStrategy or OneDeviceStrategy, "
            "or gradaccum's own CollectiveAllReduce across processes")


def in_replica_context():
    """Whether ops are being built in a (non-default) ``tf.distribute`` strategy's replica context.

    Returns:
      A Python bool.

    Example:
      >>> in_replica_context()
      False
    """
    return tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context()


def local_replica():
    """This replica's index among the replicas of its own process, or ``None`` outside a replica context.

    Returns:
      ``None``, or an int from 0: the replicas of one process are numbered
      alike on every worker, so index 0 is the one each process reports.

    Example:
      >>> local_replica() is None
      True
    """
    if not in_replica_context():
        return None
    replica = _replica_id(tf.distribute.get_replica_context())
    return replica % len(tf.distribute.get_strategy().extended.worker_devices)


def _replica_id(context):
    """The replica's id in sync (over every worker) as an int: TF 2 gives a constant tensor, TF 1.15 an int."""
    replica = context.replica_id_in_sync_group
    return int(replica if isinstance(replica, int) else tf.get_static_value(replica))


def current(name):
    """The :class:`Replicas` of the replica context being built in, or ``None`` outside a strategy.

    Args:
      name: the accumulator's name, for the error.

    Returns:
      A :class:`Replicas`, or ``None`` (no strategy, the default one, or a
      cross-replica context).

    Raises:
      ValueError: under a strategy whose replicas do not apply in step
        (``ParameterServerStrategy``, ``TPUStrategy``, one not known).

    Example:
      >>> replicas = current("GradientAccumulator")
    """
    if not in_replica_context():
        return None
    strategy = tf.distribute.get_strategy()
    kind = type(strategy.extended).__name__
    remote = kind == _PARAMETER_SERVER and any("/job:ps" in device for device in strategy.extended.parameter_devices)
    if kind in _SYNCHRONOUS or (kind == _PARAMETER_SERVER and not remote):
        return Replicas(strategy, tf.distribute.get_replica_context())
    if kind == _PARAMETER_SERVER:
        why = "its workers apply their own updates to the parameter servers asynchronously"
    elif "TPU" in kind:
        why = "its train step is compiled for the TPU, where the window's variables and conditions do not run"
    else:
        why = "gradaccum does not know whether its replicas apply one reduced update in step"
    raise ValueError("GradientAccumulator %r cannot accumulate under %s: %s; %s"
                     % (name, name_of(strategy), why, _INSTEAD))


def name_of(strategy):
    """The strategy's class name as users write it (TF 1.15's ``MirroredStrategyV1`` is ``MirroredStrategy``)."""
    name = type(strategy).__name__
    return name[:-2] if name.endswith(("V1", "V2")) else name


class Replicas(object):
    """One replica's side of a strategy: its own window state, and the window's end handed over once.

    Args:
      strategy: the ``tf.distribute`` strategy.
      context: this replica's ``ReplicaContext``.

    Attributes:
      strategy: the strategy.
      name: its class name, as users write it.

    Example:
      >>> replicas = Replicas(strategy, tf.distribute.get_replica_context())
    """

    def __init__(self, strategy, context):
        self.strategy, self.name = strategy, name_of(strategy)
        self._context = context
        self._replica = _replica_id(context)

    @contextlib.contextmanager
    def local_variables(self):
        """A block whose variables are this replica's own (neither mirrored nor aggregated).

        Yields:
          None.

        Example:
          >>> with replicas.local_variables():
          ...     count = state_variable("micro_step", [], tf.int64)
        """
        with tf.compat.v1.variable_creator_scope(self._create):
            yield

    def _create(self, next_creator, **kwargs):
        del next_creator  # The strategy's creator is the one to skip.
        name = kwargs.get("name")
        scope = tf.compat.v1.get_default_graph().get_name_scope()
        mark = "replica_%d" % (self._replica or 0)
        if self._replica and name and mark not in "%s/%s" % (scope, name):
            kwargs["name"] = "%s_%s" % (name, mark)
        return plain_resource_variable(**kwargs)

    def end_window(self, due, window, finish):
        """Builds this replica's part of every run's hand-over; returns its "applied" bool tensor.

        Args:
          due: bool scalar tensor, this replica's window is full (the same on
            every replica: they all count the same micro-batches).
          window: ``(sums, total, scalars)``: this replica's ``(sum, variable)``
            pairs, weight sum, and other scalars to sum over the replicas,
            read after this run's micro-batch was added.
          finish: a :class:`Finish`, how the reduced window is applied.

        Returns:
          A bool scalar tensor: True on the run that applied the window, False
          when it was not due or was skipped.

        Example:
          >>> applied = replicas.end_window(due, (sums, total, []), finish)
        """
        sums, total, scalars = window
        grads = tuple(grad for grad, _ in sums)
        merge = functools.partial(_end_of_window, finish)
        return self._context.merge_call(merge, args=(due, grads, total, tuple(scalars)))


class Finish(object):
    """How the replicas' reduced window becomes an update, given to :meth:`Replicas.end_window`.

    Args:
      optimizer: the wrapped ``tf.compat.v1.train.Optimizer`` that applies.
      variables: the trained (distributed) variables, in the sums' order.
      prepare: ``prepare(sums_and_vars, total, scalars) -> (usable, pairs,
        finite)`` on one device's reduced values: ``usable`` a bool tensor or
        ``None`` (always), ``pairs`` the averaged, clipped update, ``finite``
        ``None`` or whether a wrapped loss-scale optimizer applies it.
      global_step: ``None`` or the step variable.
      outer_scope: the name scope the wrapped optimizer builds in.

    Example:
      >>> finish = Finish(adam, variables, prepare, global_step, "")
    """

    def __init__(self, optimizer, variables, prepare, global_step, outer_scope):
        self.optimizer, self.variables, self.prepare = optimizer, list(variables), prepare
        self.global_step, self.outer_scope = global_step, outer_scope


def _end_of_window(finish, strategy, due, grads, total, scalars):
    """Cross-replica: on the run that ends the window, reduce once, average, apply; else nothing."""
    due = strategy.experimental_local_results(due)[0]  # Every replica counts alike.
    # v1 control flow: the strategy's cross-device (collective) ops are nodes of
    # the graph itself, so a session numbers the runs of this graph alike on
    # every worker (inside control flow v2's branch functions they would not meet).
    with v1_control_flow():
        if strategy.extended.experimental_between_graph:
            with tf.control_dependencies([_first_run_sync(strategy, total, finish.variables[0])]):
                due = tf.identity(due)
        return tf.cond(due, lambda: _reduce_and_apply(finish, strategy, grads, total, scalars),
                       lambda: tf.constant(False), name="apply_if_due")


def _first_run_sync(strategy, value, anchor):
    """Between processes: one all-reduce on this graph's first run only, before any other.

    A session takes the step numbers of a graph's collective ops from the
    group leader's sequence when it first runs the graph. Runs 1 to k-1 of a
    window execute no collective, so without this a leader that runs its
    first micro-batches ahead of a peer would number the window's reduction
    differently from it, and the two would never meet. The flag is in no
    collection: no initializer sets it, the sync does.
    """
    with tf.compat.v1.init_scope():
        flag = plain_resource_variable(initial_value=True, trainable=False, collections=[], name="synced")
    first = tf.logical_not(tf.compat.v1.is_variable_initialized(flag))

    def sync():
        summed = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, [(value, anchor)])
        with tf.control_dependencies(strategy.experimental_local_results(summed[0])):
            return tf.group(flag.assign(True, read_value=False))

    return tf.cond(first, sync, tf.no_op, name="sync_once")


def _reduce_and_apply(finish, strategy, grads, total, scalars):
    variables = finish.variables
    anchor = variables[0]
    pairs = list(zip(grads, variables)) + [(value, anchor) for value in (total,) + tuple(scalars)]
    # One reduction per update: every replica's sums, weight and scalars together.
    reduced = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, pairs)
    local = [strategy.experimental_local_results(value) for value in reduced]
    decisions, updates = None, []
    for device in range(len(local[0])):
        mine = [values[device] for values in local]
        with tf.device(_device_of(mine[0])):
            total = mine[len(variables)] / tf.cast(strategy.num_replicas_in_sync, mine[len(variables)].dtype)
            usable, update, finite = finish.prepare(list(zip(mine[:len(variables)], variables)), total,
                                                    mine[len(variables) + 1:])
        decisions = decisions or (usable, finite)  # The same values on every device: the first decides.
        updates.append([grad for grad, _ in update])
    usable, finite = decisions
    averaged = [like_distributed(reduced[i], [update[i] for update in updates]) for i in range(len(variables))]

    def apply():
        graph = tf.compat.v1.get_default_graph()
        with graph.name_scope(finish.outer_scope + "/" if finish.outer_scope else ""):
            applied = distributed_apply(finish.optimizer, _Reduced(strategy, averaged),
                                        list(zip(averaged, variables)), finish.global_step)
        with tf.control_dependencies([applied]):
            # A wrapped loss-scale optimizer skips a non-finite update itself: not applied, then.
            return tf.constant(True) if finite is None else tf.identity(finite)

    if usable is None:
        return apply()
    return tf.cond(usable, apply, lambda: tf.constant(False), name="apply_or_skip")


def _device_of(value):
    return value.values.device if isinstance(value, tf.IndexedSlices) else value.device


class _Reduced(object):
    """The strategy, whose ``batch_reduce_to`` hands back the window's already-reduced update.

    The wrapped optimizer's cross-replica apply reduces what it is given;
    the window reduced its sums already (in the same exchange as the weight
    it divides by), so a second all-reduce would only cost time.
    """

    def __init__(self, strategy, reduced):
        self._strategy = strategy
        self.extended = _ReducedExtended(strategy.extended, reduced)

    def __getattr__(self, name):
        return getattr(self._strategy, name)


class _ReducedExtended(object):

    def __init__(self, extended, reduced):
        self._extended, self._reduced = extended, list(reduced)

    def batch_reduce_to(self, reduce_op, value_destination_pairs, options=None):
        del reduce_op, value_destination_pairs, options
        return list(self._reduced)

    def __getattr__(self, name):
        return getattr(self._extended, name)
