"""The cluster a multi-process job runs on: ``TF_CONFIG``, servers, liveness.

Every process of a job reads the standard ``TF_CONFIG`` JSON, for example::

    {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.1:2223"]},
     "task": {"type": "worker", "index": 0}}

and starts its own ``tf.compat.v1.train.Server`` (:func:`start_server`). Two
engines then train on that cluster, each in its own module; their public names
are re-exported here, where users look for them:

* :mod:`gradaccum.collective`: between-graph training on TensorFlow's
  collective ops. Every worker builds the same graph, reads its own data and
  all-reduces once per applied update (:class:`CollectiveAllReduce`,
  :func:`broadcast_variables`, :func:`collective_session_config`), and
  :class:`AllReduceOnApply` for Horovod's all-reduce.
* :mod:`gradaccum.ingraph`: in-graph replication. The chief builds one graph
  with a tower per task (:func:`worker_devices`, :func:`variables_device`,
  :func:`session_config`); the other tasks :func:`serve` until the chief's
  :class:`StopSignal`.

:class:`Heartbeat` bounds the wait for a peer that died or stopped answering
(SIGKILL, SIGSTOP, a lost host), for both engines: a session blocked in an
all-reduce or a remote step cannot be interrupted from Python, so a peer
silent for ``timeout_seconds`` ends this process with one line.

This module creates no variables and adds nothing to graph collections; a
:class:`Heartbeat` builds its probe ops in graphs of its own.
"""
import collections
import errno
import json
import os
import re
import socket
import sys
import threading
import time

from gradaccum import _validate
from gradaccum._compat import tf

TF_CONFIG_VAR = "TF_CONFIG"
TASK_TYPES = ("chief", "worker", "ps")
HEARTBEAT_EXIT_STATUS = 75
DEFAULT_HEARTBEAT_SECONDS = 30.0


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
        """How many towers :func:`gradaccum.ingraph.worker_devices` returns."""
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


_NOT_THE_CAUSE = ("Graph execution error", "Additional GRPC error information", ":UNKNOWN:", "[[",
                  "The error could be from", "Original stack trace", "Errors may have originated",
                  "0 successful operations", "0 derived errors", "From /job:")


def describe_op_error(error):
    """One line for a ``tf.errors.OpError`` of a multi-process run: its class, cause and tasks.

    TensorFlow's message runs over many lines (where the op was defined, gRPC
    details); this keeps the first line that says what happened and the
    tasks the message names.

    Args:
      error: a ``tf.errors.OpError`` (or any exception).

    Returns:
      A one-line string such as ``"UnavailableError: recvmsg:Connection reset
      by peer (tasks named: worker:1)"``.

    Example:
      >>> try:
      ...     sess.run(train_op)
      ... except tf.errors.OpError as exc:
      ...     sys.exit("training failed: " + cluster.describe_op_error(exc))
    """
    message = getattr(error, "message", None) or str(error)
    lines = [line.strip() for line in message.splitlines()]
    start = 0
    if any(line.startswith("Detected at node") for line in lines):  # Skip the op's Python traceback.
        start = 1 + max([i for i, line in enumerate(lines) if line.startswith(("File \"", "Detected at node"))])
    cause = next((line for line in lines[start:] if line and not line.startswith(_NOT_THE_CAUSE)),
                 next((line for line in lines if line), ""))
    tasks = sorted(set("%s:%s" % found for found in re.findall(r"/job:(\w+)/replica:\d+/task:(\d+)", message)))
    return "%s: %s%s" % (type(error).__name__, cause[:300], " (tasks named: %s)" % ", ".join(tasks) if tasks else "")


def _task_address(config, task):
    return config.cluster[task[0]][task[1]]


def _exit_with_message(message):
    """The default failure action: one line on stderr, then exit at once.

    The main thread may be blocked inside ``session.run`` (an all-reduce, a
    remote step), which neither a Python exception nor ``Session.close`` can
    interrupt (both tried on TF 1.15 and 2.21): only leaving the process does.
    """
    sys.stderr.write("gradaccum: %s\n" % message)
    sys.stderr.flush()
    os._exit(HEARTBEAT_EXIT_STATUS)


class Heartbeat(object):
    """Fails this process within a bound when a peer task stops answering.

    One thread per peer runs a tiny op (``tf.timestamp``) on that peer every
    ``interval_seconds``, in a session of its own on this task's server; a
    checker thread calls ``on_failure`` with one line when a peer has not
    answered for ``timeout_seconds`` (a killed peer, a stopped one, a lost
    host). Its last answer came before it went silent, so this process ends
    at most ``timeout_seconds + 1`` s after the peer stopped (31 s by
    default), even inside an all-reduce. A slow peer that still answers is
    not a failure. Before a peer's first answer, it has
    ``startup_timeout_seconds`` to come up.

    Args:
      server: this task's server from :func:`start_server`.
      config: a :class:`ClusterConfig`.
      peers: ``(job, index)`` pairs to watch; default every other task.
      timeout_seconds: how long a peer may stay silent, a number > 0
        (default 30).
      interval_seconds: pause between probes; default ``timeout_seconds / 6``
        clipped to [0.5, 10].
      startup_timeout_seconds: how long a peer may take to answer first.
      on_failure: called once with the message; default: print
        ``gradaccum: <message>`` on stderr and ``os._exit(75)``.

    Attributes:
      started: ``time.time()`` of :meth:`start`, or None before it.
      failure: None, or the one-line message passed to ``on_failure``.

    Raises:
      TypeError: for a timeout that is not a number.
      ValueError: for a bad timeout or a peer that is not a task of the cluster.

    Example:
      >>> with cluster.Heartbeat(server, config, timeout_seconds=30):
      ...     train(sess)
    """

    def __init__(self, server, config, peers=None, timeout_seconds=DEFAULT_HEARTBEAT_SECONDS, interval_seconds=None,
                 startup_timeout_seconds=300.0, on_failure=None):
        self._timeout = _validate.check_seconds(timeout_seconds, "timeout_seconds")
        self._startup = _validate.check_seconds(startup_timeout_seconds, "startup_timeout_seconds")
        interval = min(max(self._timeout / 6.0, 0.5), 10.0) if interval_seconds is None else interval_seconds
        self._interval = _validate.check_seconds(interval, "interval_seconds")
        everyone = [(job, i) for job in sorted(config.cluster) for i in range(len(config.cluster[job]))]
        me = (config.task_type, config.task_index)
        self._peers = [t for t in everyone if t != me] if peers is None else [tuple(p) for p in peers]
        for peer in self._peers:
            if peer not in everyone or peer == me:
                raise ValueError("`peers` must name other tasks of the cluster as (job, index), got %s"
                                 % _validate.describe(peer))
        self._server, self._config = server, config
        self._on_failure = _exit_with_message if on_failure is None else on_failure
        self._answered = {}
        self._errors = {}
        self._stop = threading.Event()
        self._threads = []
        self.failure = None
        self.started = None

    def start(self):
        """Starts the probe and checker threads (daemons); sets ``started``; returns ``self``."""
        self.started = time.time()
        targets = [(self._probe, (peer,)) for peer in self._peers] + [(self._check, ())]
        for target, args in targets:
            thread = threading.Thread(target=target, args=args, name="gradaccum-heartbeat")
            thread.daemon = True
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, wait_seconds=5.0):
        """Stops watching; waits up to ``wait_seconds`` for the threads to end.

        Threads still inside TensorFlow when the interpreter exits abort it
        (``FATAL: exception not rethrown``), so a normal end waits for them; a
        probe stuck on a silent peer is abandoned after ``wait_seconds``.
        """
        self._stop.set()
        deadline = time.time() + wait_seconds
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.time()))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def _probe(self, peer):
        job, index = peer
        proto = tf.compat.v1.ConfigProto(device_filters=[
            "/job:%s/task:%d" % (self._config.task_type, self._config.task_index), "/job:%s/task:%d" % peer])
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(self._timeout * 1000))
        with tf.Graph().as_default() as graph:
            with tf.device("/job:%s/replica:0/task:%d/cpu:0" % (job, index)):
                stamp = tf.timestamp()  # Stateful: never folded away, so it runs on the peer.
        session = None
        try:
            while not self._stop.is_set():
                try:
                    session = session or tf.compat.v1.Session(self._server.target, graph=graph, config=proto)
                    session.run(stamp, options=options)
                    self._answered[peer] = time.time()
                except tf.errors.OpError as exc:
                    self._errors[peer] = "%s: %s" % (type(exc).__name__, exc.message.splitlines()[0][:160])
                self._stop.wait(self._interval)
        finally:
            if session is not None:
                session.close()

    def _silent_peer(self, now):
        for peer in self._peers:
            last = self._answered.get(peer)
            if last is None and now - self.started > self._startup:
                return peer, "did not answer within the startup timeout of %g s" % self._startup
            if last is not None and now - last > self._timeout:
                return peer, "has not answered for %.0f s (heartbeat timeout %g s)" % (now - last, self._timeout)
        return None, None

    def _check(self):
        while not self._stop.wait(min(self._interval, 1.0)):
            peer, what = self._silent_peer(time.time())
            if peer is not None:
                error = self._errors.get(peer)
                self.failure = "%s: %s:%d at %s %s%s; stopping" % (
                    self._config.task_name, peer[0], peer[1], _task_address(self._config, peer), what,
                    " (last error: %s)" % error if error else "")
                self._stop.set()
                self._on_failure(self.failure)
                return


# The engines' names, where users look for them. Imported last: ingraph
# imports this module.
from gradaccum.collective import AllReduceOnApply  # noqa: E402,F401
from gradaccum.collective import CollectiveAllReduce  # noqa: E402,F401
from gradaccum.collective import broadcast_variables  # noqa: E402,F401
from gradaccum.collective import collective_session_config  # noqa: E402,F401
from gradaccum.collective import synchronized_batch_norm  # noqa: E402,F401
from gradaccum.ingraph import StopSignal  # noqa: E402,F401
from gradaccum.ingraph import serve  # noqa: E402,F401
from gradaccum.ingraph import session_config  # noqa: E402,F401
from gradaccum.ingraph import variables_device  # noqa: E402,F401
from gradaccum.ingraph import worker_devices  # noqa: E402,F401
