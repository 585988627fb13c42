"""Synchronous training across processes and hosts on TensorFlow's gRPC runtime.

Every process of a job reads the standard ``TF_CONFIG`` JSON, for example::

    {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.1:2223"]},
     "task": {"type": "worker", "index": 0}}

and starts its own ``tf.compat.v1.train.Server``. The chief (the ``chief`` task
when the cluster has one, else ``worker`` 0) builds ONE graph that spans all
processes (in-graph replication): one tower per compute task from
:func:`worker_devices`, the variables on :func:`variables_device`, the towers'
gradients averaged in that graph, so every update is synchronous and equals
the full-batch update. The other tasks only serve the graph pieces the chief's
session places on them, in :func:`serve`, until the chief sends them the stop
signal (:class:`StopSignal`) or their chief disappears.

:class:`AllReduceOnApply` is for the other engine, Horovod: wrapped inside a
``GradientAccumulator`` it all-reduces the averaged gradients once per applied
update instead of once per micro-batch.

This module creates no variables and adds nothing to graph collections.
:class:`StopSignal` and :func:`serve` create one FIFO queue per non-chief task,
shared under the name ``gradaccum_stop_<job>_<index>`` in that task's resource
manager.
"""
import collections
import errno
import json
import os
import re
import socket
import time

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum._wrapper import WrappingOptimizer

TF_CONFIG_VAR = "TF_CONFIG"
TASK_TYPES = ("chief", "worker", "ps")
_DEVICE_RE = re.compile(r"^(?:/?device:)?([A-Za-z_]+):(\d+)$")


class ClusterError(RuntimeError):
    """A cluster task cannot start or lost its peers; the message is one line."""


def _config_error(what, value):
    return ValueError("`TF_CONFIG` %s, got %s" % (what, _validate.describe(value)))


class ClusterConfig(collections.namedtuple("ClusterConfig", ["cluster", "task_type", "task_index"])):
    """This process's place in the cluster, as read from ``TF_CONFIG``.

    Attributes:
      cluster: dict from job name (``"chief"``, ``"worker"``, ``"ps"``) to the
        list of ``"host:port"`` addresses of its tasks.
      task_type: this process's job name.
      task_index: this process's index in its job.

    Example:
      >>> config = parse_tf_config('{"cluster": {"worker": ["127.0.0.1:2222"]},'
      ...                          ' "task": {"type": "worker", "index": 0}}')
      >>> config.is_chief, config.task_name
      (True, 'worker:0')
    """

    __slots__ = ()

    @property
    def task_name(self):
        """``"job:index"`` of this process, as the launcher prints it."""
        return "%s:%d" % (self.task_type, self.task_index)

    @property
    def address(self):
        """The ``"host:port"`` this process's server listens on."""
        return self.cluster[self.task_type][self.task_index]

    @property
    def chief(self):
        """``(job, index)`` of the chief: ``("chief", 0)`` if present, else ``("worker", 0)``."""
        return ("chief", 0) if "chief" in self.cluster else ("worker", 0)

    @property
    def is_chief(self):
        """True in the one process that builds the graph and runs the session."""
        return (self.task_type, self.task_index) == self.chief

    @property
    def compute_tasks(self):
        """``(job, index)`` of every task that computes a tower, chief first."""
        return [(job, i) for job in ("chief", "worker") for i in range(len(self.cluster.get(job, ())))]

    @property
    def num_towers(self):
        """How many towers :func:`worker_devices` returns."""
        return len(self.compute_tasks)


def _check_address(job, address):
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
        raise _config_error("cluster job %r must list \"host:port\" strings with a port in 1..65535" % job, address)


def _check_cluster(cluster):
    if not isinstance(cluster, dict) or not cluster:
        raise _config_error("`cluster` must be a non-empty object of job name -> address list", cluster)
    for job, addresses in sorted(cluster.items()):
        if job not in TASK_TYPES:
            raise _config_error("cluster has unknown task type %r (known: %s)" % (job, ", ".join(TASK_TYPES)), job)
        if not isinstance(addresses, list) or not addresses:
            raise _config_error("cluster job %r must be a non-empty list of addresses" % job, addresses)
        for address in addresses:
            _check_address(job, address)
    if "chief" not in cluster and "worker" not in cluster:
        raise _config_error("cluster needs a \"worker\" or \"chief\" job", sorted(cluster))
    if len(cluster.get("chief", ())) > 1:
        raise _config_error("cluster job \"chief\" must have exactly one address", cluster["chief"])
    everything = [a for job in sorted(cluster) for a in cluster[job]]
    if len(set(everything)) != len(everything):
        raise _config_error("cluster lists an address twice", everything)


def _check_task(task, cluster):
    if not isinstance(task, dict):
        raise _config_error("`task` must be an object with \"type\" and \"index\"", task)
    task_type, index = task.get("type"), task.get("index", 0)
    if task_type not in TASK_TYPES:
        raise _config_error("task has unknown task type (known: %s)" % ", ".join(TASK_TYPES), task_type)
    if task_type not in cluster:
        raise _config_error("task type %r is not a job of the cluster (jobs: %s)"
                            % (task_type, ", ".join(sorted(cluster))), task_type)
    if not isinstance(index, int) or isinstance(index, bool):
        raise _config_error("task index must be an int", index)
    if not 0 <= index < len(cluster[task_type]):
        raise _config_error("task index is outside the cluster: job %r has tasks 0..%d"
                            % (task_type, len(cluster[task_type]) - 1), index)
    return task_type, index


def parse_tf_config(text):
    """Parses and validates a ``TF_CONFIG`` JSON string.

    Args:
      text: the JSON text, with a ``"cluster"`` object (job name -> list of
        ``"host:port"``; jobs ``"chief"``, ``"worker"``, ``"ps"``) and a
        ``"task"`` object (``"type"``, ``"index"``).

    Returns:
      A :class:`ClusterConfig`.

    Raises:
      ValueError: one line naming what is wrong: text that is not JSON, an
        unknown task type, a task index outside the cluster, a bad address.

    Example:
      >>> parse_tf_config('{"cluster": {"worker": ["h1:2222", "h2:2222"]},'
      ...                 ' "task": {"type": "worker", "index": 1}}').task_name
      'worker:1'
    """
    if not isinstance(text, str):
        raise _config_error("must be a JSON string", text)
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise _config_error("is not valid JSON (%s)" % str(exc).splitlines()[0], text) from None
    if not isinstance(data, dict):
        raise _config_error("must be a JSON object with \"cluster\" and \"task\"", data)
    cluster = data.get("cluster")
    _check_cluster(cluster)
    task_type, index = _check_task(data.get("task"), cluster)
    return ClusterConfig({job: list(cluster[job]) for job in cluster}, task_type, index)


def load_tf_config(environ=None):
    """Reads ``TF_CONFIG`` from the environment.

    Args:
      environ: mapping to read, ``os.environ`` by default.

    Returns:
      A :class:`ClusterConfig`, or None when ``TF_CONFIG`` is unset or blank
      (a single-process run).

    Raises:
      ValueError: as :func:`parse_tf_config`.

    Example:
      >>> config = load_tf_config()
      >>> print("single process" if config is None else config.task_name)
    """
    text = (os.environ if environ is None else environ).get(TF_CONFIG_VAR, "")
    return parse_tf_config(text) if text.strip() else None


def make_tf_config(cluster, task_type, task_index):
    """Builds the ``TF_CONFIG`` JSON for one task of ``cluster``.

    Args:
      cluster: dict from job name to its list of ``"host:port"`` addresses.
      task_type: the task's job name.
      task_index: the task's index in its job.

    Returns:
      The JSON string; it passes :func:`parse_tf_config`.

    Raises:
      ValueError: as :func:`parse_tf_config`.

    Example:
      >>> make_tf_config({"worker": ["127.0.0.1:2222"]}, "worker", 0)
      '{"cluster": {"worker": ["127.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}'
    """
    text = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": task_index}})
    parse_tf_config(text)
    return text


def _device_names(config, device):
    if isinstance(device, str):
        device = [device] * config.num_towers
    if not isinstance(device, (list, tuple)) or len(device) != config.num_towers:
        raise ValueError("`device` must be a device string or a list of %d (one per compute task), got %s"
                         % (config.num_towers, _validate.describe(device)))
    names = []
    for item in device:
        match = _DEVICE_RE.match(item) if isinstance(item, str) else None
        if match is None:
            raise ValueError("`device` entries must look like \"cpu:0\" or \"gpu:1\", got %s" % _validate.describe(item))
        names.append("%s:%s" % (match.group(1).lower(), match.group(2)))
    return names


def worker_devices(config, device="cpu:0"):
    """Device strings for ``tower.minimize``: one tower per compute task.

    Args:
      config: a :class:`ClusterConfig`.
      device: the local device each task computes its tower on, e.g.
        ``"cpu:0"`` or ``"gpu:0"``, or a list with one entry per compute task
        (chief first, then the workers in index order).

    Returns:
      A list such as ``["/job:worker/task:0/cpu:0", "/job:worker/task:1/cpu:0"]``.

    Raises:
      ValueError: when ``device`` is malformed or its length is wrong.

    Example:
      >>> worker_devices(config, "gpu:0")
      ['/job:worker/task:0/gpu:0', '/job:worker/task:1/gpu:0']
    """
    names = _device_names(config, device)
    return ["/job:%s/task:%d/%s" % (job, i, name) for (job, i), name in zip(config.compute_tasks, names)]


def variables_device(config, ps_task=0):
    """Where the shared variables live: a ps task, else the chief's CPU.

    Args:
      config: a :class:`ClusterConfig`.
      ps_task: which ps task holds the variables when the cluster has ps tasks.

    Returns:
      ``"/job:ps/task:<ps_task>"``, or ``"/job:<chief>/task:0/cpu:0"`` without ps.

    Raises:
      ValueError: when ``ps_task`` is not a ps task of the cluster.

    Example:
      >>> variables_device(config)
      '/job:ps/task:0'
    """
    num_ps = len(config.cluster.get("ps", ()))
    if not num_ps:
        return "/job:%s/task:%d/cpu:0" % config.chief
    if not isinstance(ps_task, int) or isinstance(ps_task, bool) or not 0 <= ps_task < num_ps:
        raise ValueError("`ps_task` must be an int in 0..%d, got %s" % (num_ps - 1, _validate.describe(ps_task)))
    return "/job:ps/task:%d" % ps_task


def session_config(config, base=None):
    """A ``ConfigProto`` for a session on this task's server.

    The chief's session sees every task. A non-chief task's own session sees
    only itself, so that it does not wait for the other tasks to come up.

    Args:
      config: a :class:`ClusterConfig`.
      base: a ``tf.compat.v1.ConfigProto`` to start from (copied), or None.

    Returns:
      A new ``tf.compat.v1.ConfigProto``.

    Example:
      >>> sess = tf.compat.v1.Session(server.target, config=session_config(config))
    """
    proto = tf.compat.v1.ConfigProto()
    if base is not None:
        proto.CopyFrom(base)
    if not config.is_chief:
        del proto.device_filters[:]
        proto.device_filters.append("/job:%s/task:%d" % (config.task_type, config.task_index))
    return proto


def _port(address):
    return int(address.rpartition(":")[2])


def check_port_free(config):
    """Fails in one line when this task's port is taken by another process.

    TensorFlow's own failure on a busy port is a C++ log and an ``UnknownError``
    (on some versions an abort), so the port is tried first. A port taken
    between this check and the server's start still fails in TensorFlow.

    Args:
      config: a :class:`ClusterConfig`.

    Raises:
      ClusterError: when the port is in use.

    Example:
      >>> check_port_free(config)
    """
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # SO_REUSEADDR: a port left in TIME_WAIT is reusable; a listening one is not.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", _port(config.address)))
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ClusterError("cannot start %s: port %d of %r is already in use by another process"
                           % (config.task_name, _port(config.address), config.address)) from None
    finally:
        probe.close()


def start_server(config, server_config=None):
    """Starts this process's ``tf.compat.v1.train.Server``.

    Args:
      config: a :class:`ClusterConfig`.
      server_config: optional ``tf.compat.v1.ConfigProto`` for the server's
        default sessions (e.g. ``device_count``).

    Returns:
      The started server; sessions connect with ``server.target``.

    Raises:
      ClusterError: one line when the port is in use or the server fails to start.

    Example:
      >>> server = start_server(load_tf_config())
      >>> sess = tf.compat.v1.Session(server.target, config=session_config(config))
    """
    check_port_free(config)
    spec = tf.train.ClusterSpec(config.cluster)
    try:
        return tf.compat.v1.train.Server(spec, job_name=config.task_type, task_index=config.task_index,
                                         config=server_config, start=True)
    except tf.errors.OpError as exc:
        raise ClusterError("cannot start %s at %r: %s" % (config.task_name, config.address,
                                                         exc.message.splitlines()[0])) from None


def _reachable(address, timeout_seconds=1.0):
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_seconds).close()
        return True
    except OSError:
        return False


def wait_for_tasks(config, timeout_seconds=300.0, poll_seconds=0.5):
    """Waits until every task's server accepts connections.

    Call it in the chief before the first ``session.run``: a session on a
    cluster whose task is missing would otherwise wait forever.

    Args:
      config: a :class:`ClusterConfig`.
      timeout_seconds: how long to wait in total.
      poll_seconds: pause between rounds of connection attempts.

    Raises:
      ClusterError: one line naming the tasks still unreachable at the deadline.

    Example:
      >>> wait_for_tasks(config, timeout_seconds=60)
    """
    deadline = time.time() + timeout_seconds
    pending = [(job, i) for job in sorted(config.cluster) for i in range(len(config.cluster[job]))]
    while True:
        pending = [t for t in pending if not _reachable(config.cluster[t[0]][t[1]])]
        if not pending:
            return
        if time.time() >= deadline:
            raise ClusterError("timed out after %.0f s waiting for %s" % (timeout_seconds, ", ".join(
                "%s:%d at %s" % (job, i, config.cluster[job][i]) for job, i in pending)))
        time.sleep(poll_seconds)


def _stop_queue(job, index):
    with tf.device("/job:%s/task:%d" % (job, index)):
        return tf.queue.FIFOQueue(1, tf.int32, shared_name="gradaccum_stop_%s_%d" % (job, index),
                                  name="stop_queue_%s_%d" % (job, index))


def _non_chief_tasks(config):
    return [(job, i) for job in sorted(config.cluster) for i in range(len(config.cluster[job]))
            if (job, i) != config.chief]


class StopSignal(object):
    """The chief's way to tell every other task that training is over.

    Build it in the chief's graph before the graph is finalized, and
    :meth:`send` it after training; :func:`serve` then returns in each task.

    Args:
      config: a :class:`ClusterConfig`.
      name: name scope of the enqueue ops.

    Example:
      >>> stop = StopSignal(config)
      >>> with tf.compat.v1.Session(server.target) as sess:
      ...     train(sess)
      ...     stop.send(sess)
    """

    def __init__(self, config, name="stop_tasks"):
        self._tasks = _non_chief_tasks(config)
        with tf.compat.v1.name_scope(name):
            self._ops = [_stop_queue(job, i).enqueue(1) for job, i in self._tasks]

    def send(self, session, timeout_seconds=10.0):
        """Signals every non-chief task; a task that is gone is skipped.

        Args:
          session: a session on the chief's server.
          timeout_seconds: how long to try each task.

        Returns:
          The ``"job:index"`` names of the tasks that could not be signalled.

        Example:
          >>> missed = stop.send(sess)
        """
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_seconds * 1000))
        missed = []
        for (job, i), op in zip(self._tasks, self._ops):
            try:
                session.run(op, options=options)
            except tf.errors.OpError:
                missed.append("%s:%d" % (job, i))
        return missed


def _watch_chief(config, chief_seen, deadline):
    """Returns the new ``chief_seen``; raises when the chief is gone or late."""
    address = config.cluster[config.chief[0]][config.chief[1]]
    if _reachable(address):
        return True
    chief_name = "%s:%d" % config.chief
    if chief_seen:
        raise ClusterError("%s: chief %s at %s went away without sending the stop signal"
                           % (config.task_name, chief_name, address))
    if time.time() >= deadline:
        raise ClusterError("%s: chief %s at %s did not come up within the startup timeout"
                           % (config.task_name, chief_name, address))
    return False


def serve(server, config, poll_seconds=1.0, startup_timeout_seconds=600.0):
    """Serves this non-chief task until the chief's :class:`StopSignal` arrives.

    While it waits it checks every ``poll_seconds`` that the chief's server
    still accepts connections, so a task never outlives a crashed chief.

    Args:
      server: this task's server from :func:`start_server`.
      config: a :class:`ClusterConfig` of a non-chief task.
      poll_seconds: interval of the stop-signal and chief checks.
      startup_timeout_seconds: how long the chief may take to come up.

    Raises:
      ValueError: when ``config`` is the chief's.
      ClusterError: one line when the chief went away without the stop signal
        or never came up.

    Example:
      >>> if not config.is_chief:
      ...     serve(start_server(config), config)
    """
    if config.is_chief:
        raise ValueError("`config` must be a non-chief task's, got the chief %s" % config.task_name)
    deadline = time.time() + startup_timeout_seconds
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(poll_seconds * 1000))
    with tf.Graph().as_default():
        dequeue = _stop_queue(config.task_type, config.task_index).dequeue()
        with tf.compat.v1.Session(server.target, config=session_config(config)) as sess:
            chief_seen = False
            while True:
                try:
                    sess.run(dequeue, options=options)
                    return
                except tf.errors.DeadlineExceededError:
                    chief_seen = _watch_chief(config, chief_seen, deadline)


class AllReduceOnApply(WrappingOptimizer):
    """Reduces gradients across processes when, and only when, they are applied.

    Put it INSIDE a ``GradientAccumulator``: the accumulator adds local
    micro-batch gradients without communication and hands their average to
    this optimizer's ``apply_gradients`` once per window, which all-reduces it
    and applies it. ``hvd.DistributedOptimizer`` instead reduces in
    ``compute_gradients``, i.e. on every micro-batch. Every process must run
    the same number of micro-batches, so that all reach the reduce together.

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
