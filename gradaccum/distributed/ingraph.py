"""In-graph replication: the chief builds one graph that spans every process.

The chief (the ``chief`` task when the cluster has one, else ``worker`` 0)
builds ONE graph: one tower per compute task from :func:`worker_devices`, the
variables on :func:`variables_device`, the towers' gradients averaged in that
graph, so every update is synchronous and equals the full-batch update. The
other tasks only serve the graph pieces the chief's session places on them,
in :func:`serve`, until the chief sends them the stop signal
(:class:`StopSignal`) and ends, their chief disappears, or it stops answering
for ``heartbeat_timeout_seconds``. The chief bounds its own wait for a silent
task with a :class:`gradaccum.cluster.Heartbeat` around its session. An
evaluator task is not part of that graph: no tower, no stop signal, and no
task waits for it.

All names here are also importable from :mod:`gradaccum.cluster`.

This module creates no variables and adds nothing to graph collections.
:class:`StopSignal` and :func:`serve` create one FIFO queue per non-chief task,
shared under the name ``gradaccum_stop_<job>_<index>`` in that task's resource
manager.
"""
import re
import time

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.distributed import tfconfig
from gradaccum.distributed.heartbeat import DEFAULT_HEARTBEAT_SECONDS, Heartbeat
from gradaccum.distributed.tfconfig import ClusterError

_CHIEF_EXIT_POLL_SECONDS = 0.05  # How late this task may end after its chief.
_DEVICE_RE = re.compile(r"^(?:/?device:)?([A-Za-z_]+):(\d+)$")


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
            raise ValueError("`device` entries must look like \"cpu:0\" or \"gpu:1\", got %s"
                             % _validate.describe(item))
        names.append("%s:%s" % (match.group(1).lower(), match.group(2)))
    return names


def worker_devices(config, device="cpu:0"):
    """Device strings for ``tower.minimize``: one tower per compute task.

    Args:
      config: a :class:`~gradaccum.cluster.ClusterConfig`.
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
      config: a :class:`~gradaccum.cluster.ClusterConfig`.
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
      config: a :class:`~gradaccum.cluster.ClusterConfig`.
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


def _stop_queue(job, index):
    with tf.device("/job:%s/task:%d" % (job, index)):
        return tf.queue.FIFOQueue(1, tf.int32, shared_name="gradaccum_stop_%s_%d" % (job, index),
                                  name="stop_queue_%s_%d" % (job, index))


def _non_chief_tasks(config):
    return [task for task in tfconfig.tasks(config.cluster) if task != config.chief]


class StopSignal(object):
    """The chief's way to tell every other task that training is over.

    Build it in the chief's graph before the graph is finalized, and
    :meth:`send` it after training; :func:`serve` then returns in each task
    once the chief's process has ended, so that the chief's session closes
    while every task it ran ops on still serves.

    Args:
      config: a :class:`~gradaccum.cluster.ClusterConfig`.
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


def _chief_address(config):
    return config.cluster[config.chief[0]][config.chief[1]]


def _watch_chief(config, chief_seen, deadline):
    """Returns the new ``chief_seen``; raises when the chief is gone or late."""
    address = _chief_address(config)
    if tfconfig.reachable(address):
        return True
    chief_name = "%s:%d" % config.chief
    if chief_seen:
        raise ClusterError("%s: chief %s at %s went away without sending the stop signal"
                           % (config.task_name, chief_name, address))
    if time.time() >= deadline:
        raise ClusterError("%s: chief %s at %s did not come up within the startup timeout"
                           % (config.task_name, chief_name, address))
    return False


def _wait_for_stop(sess, dequeue, options, config, deadline, heartbeat):
    """True once the stop signal arrived; False when ``heartbeat`` found the chief silent (its ``failure``)."""
    chief_seen = False
    while heartbeat.failure is None:
        try:
            sess.run(dequeue, options=options)
            return True
        except tf.errors.DeadlineExceededError:
            chief_seen = _watch_chief(config, chief_seen, deadline)
        if chief_seen and heartbeat.started is None:  # Probe a chief that is up.
            heartbeat.start()
    return False


def _wait_for_chief_exit(config, timeout_seconds):
    """Returns once the chief's server refuses connections (its process ended), or after ``timeout_seconds``.

    The chief closes its session right after :meth:`StopSignal.send`. A task that exits during that close can
    hang it for ever (``LocalMaster::CloseSession`` waits on it: TensorFlow 1.15 in every try, 2.21 at times), so
    this task outlives the close. Once the chief has gone, nothing waits on this task any more.
    """
    address = _chief_address(config)
    deadline = time.time() + timeout_seconds
    while time.time() < deadline and tfconfig.reachable(address, min(1.0, max(deadline - time.time(), 0.01))):
        time.sleep(_CHIEF_EXIT_POLL_SECONDS)


def serve(server, config, poll_seconds=1.0, startup_timeout_seconds=600.0,
          heartbeat_timeout_seconds=DEFAULT_HEARTBEAT_SECONDS, chief_exit_timeout_seconds=30.0):
    """Serves this non-chief task until the chief's :class:`StopSignal` arrives and the chief has ended.

    While it waits it checks every ``poll_seconds`` that the chief's server
    still accepts connections, and a :class:`gradaccum.cluster.Heartbeat`
    checks that the chief still answers, so a task never outlives a crashed
    or stopped (SIGSTOP) chief by more than ``heartbeat_timeout_seconds``.

    After the stop signal it returns as soon as the chief's server has gone
    (within 50 ms of the chief's exit), or ``chief_exit_timeout_seconds``
    after the signal if the chief still runs then. The chief closes its
    session after :meth:`StopSignal.send`, and TensorFlow can hang that close
    for ever when a task it ran ops on exits during it: this task outlives it.

    Args:
      server: this task's server from :func:`~gradaccum.cluster.start_server`.
      config: a :class:`~gradaccum.cluster.ClusterConfig` of a non-chief task.
      poll_seconds: interval of the stop-signal and chief checks.
      startup_timeout_seconds: how long the chief may take to come up.
      heartbeat_timeout_seconds: how long a chief that accepts connections
        may stay silent (stopped, or its host lost) before this task fails.
      chief_exit_timeout_seconds: how long after the stop signal this task
        waits for the chief to exit before it returns anyway.

    Raises:
      TypeError: for a timeout that is not a number.
      ValueError: when ``config`` is the chief's or an evaluator's, or for a
        timeout <= 0.
      ClusterError: one line when the chief went away without the stop signal,
        never came up, or stopped answering.

    Example:
      >>> if not config.is_chief:
      ...     serve(start_server(config), config)
    """
    if config.is_chief or config.is_evaluator:
        raise ValueError("`config` must be a non-chief task's, got the %s %s"
                         % ("chief" if config.is_chief else "evaluator", config.task_name))
    # Checked here, under their own names: the Heartbeat below gets their sum.
    startup_timeout_seconds = _validate.check_seconds(startup_timeout_seconds, "startup_timeout_seconds")
    heartbeat_timeout_seconds = _validate.check_seconds(heartbeat_timeout_seconds, "heartbeat_timeout_seconds")
    chief_exit_timeout_seconds = _validate.check_seconds(chief_exit_timeout_seconds, "chief_exit_timeout_seconds")
    deadline = time.time() + startup_timeout_seconds
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(poll_seconds * 1000))
    # The startup is judged by the connection check (its message is clearer). A failure is raised below.
    heartbeat = Heartbeat(server, config, peers=[config.chief], timeout_seconds=heartbeat_timeout_seconds,
                          startup_timeout_seconds=startup_timeout_seconds + heartbeat_timeout_seconds,
                          on_failure=lambda message: None)
    with tf.Graph().as_default():
        dequeue = _stop_queue(config.task_type, config.task_index).dequeue()
        with tf.compat.v1.Session(server.target, config=session_config(config)) as sess:  # This task's only.
            try:
                stopped = _wait_for_stop(sess, dequeue, options, config, deadline, heartbeat)
            finally:
                heartbeat.stop()
    if not stopped:
        raise ClusterError(heartbeat.failure)
    _wait_for_chief_exit(config, chief_exit_timeout_seconds)
