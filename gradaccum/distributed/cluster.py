"""The cluster a multi-process job runs on: ``TF_CONFIG``, Slurm, servers, liveness.

Every process of a job finds its place with :func:`from_environment`: the
standard ``TF_CONFIG`` JSON when it is set, for example::

    {"cluster": {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["10.0.0.1:2223"]},
     "task": {"type": "worker", "index": 0}}

as written by hand, by ``python -m gradaccum.launch``, by Kubeflow's TFJob
(``"environment": "cloud"``, hosts such as ``job-worker-0.ns.svc:2222``, an
``evaluator`` task outside ``cluster``) or by Google's training service
(``"master"`` for the chief); else, under Slurm's ``srun``, the ``SLURM_*``
variables (:func:`from_environment` says how). Then it starts its own
``tf.compat.v1.train.Server`` (:func:`start_server`). Two engines train on
that cluster, each in its own module; their public names are re-exported
here, where users look for them:

* :mod:`gradaccum.collective`: between-graph training on TensorFlow's
  collective ops. Every worker builds the same graph, reads its own data and
  all-reduces once per applied update (:class:`CollectiveAllReduce`,
  :func:`broadcast_variables`, :func:`collective_session_config`), and
  :class:`AllReduceOnApply` for Horovod's all-reduce.
* :mod:`gradaccum.ingraph`: in-graph replication. The chief builds one graph
  with a tower per task (:func:`worker_devices`, :func:`variables_device`,
  :func:`session_config`); the other tasks :func:`serve` until the chief's
  :class:`StopSignal`.

:class:`Heartbeat` (defined in ``gradaccum.distributed.heartbeat``) bounds the wait for a
peer that died or stopped answering, for both engines. An evaluator task
(:attr:`ClusterConfig.is_evaluator`) is no part of training: no engine, no
broadcast and no Heartbeat waits for it, and it runs no server.

This module creates no variables and adds nothing to graph collections; a
:class:`Heartbeat` builds its probe ops in graphs of its own.
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
from gradaccum.distributed import slurm
from gradaccum.distributed import tfconfig
from gradaccum.distributed.heartbeat import DEFAULT_HEARTBEAT_SECONDS  # noqa: F401
from gradaccum.distributed.heartbeat import HEARTBEAT_EXIT_STATUS  # noqa: F401
from gradaccum.distributed.heartbeat import Heartbeat  # noqa: F401
from gradaccum.distributed.tfconfig import ClusterError
from gradaccum.distributed.tfconfig import TF_CONFIG_VAR  # noqa: F401
# The engines' names, where users look for them.
from gradaccum.distributed.collective import AllReduceOnApply  # noqa: F401
from gradaccum.distributed.collective import CollectiveAllReduce  # noqa: F401
from gradaccum.distributed.collective import broadcast_variables  # noqa: F401
from gradaccum.distributed.collective import collective_session_config  # noqa: F401
from gradaccum.distributed.collective import synchronized_batch_norm  # noqa: F401
from gradaccum.distributed.ingraph import StopSignal  # noqa: F401
from gradaccum.distributed.ingraph import serve  # noqa: F401
from gradaccum.distributed.ingraph import session_config  # noqa: F401
from gradaccum.distributed.ingraph import variables_device  # noqa: F401
from gradaccum.distributed.ingraph import worker_devices  # noqa: F401

TASK_TYPES = ("chief", "worker", "ps")
EVALUATOR = "evaluator"
# Google's training service names the chief "master"; it is read as "chief".
_ALIASES = {"master": "chief"}
_KNOWN = "chief, worker, ps, evaluator; master is read as chief"


def _config_error(what, value):
    return ValueError("`TF_CONFIG` %s, got %s" % (what, _validate.describe(value)))


class ClusterConfig(collections.namedtuple("ClusterConfig", ["cluster", "task_type", "task_index"])):
    """This process's place in the cluster, from :func:`from_environment` or :func:`parse_tf_config`.

    Attributes:
      cluster: dict from job name (``"chief"``, ``"worker"``, ``"ps"``) to the
        list of ``"host:port"`` addresses of its tasks: the training cluster,
        never an evaluator.
      task_type: this process's job name, or ``"evaluator"``.
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
        """The ``"host:port"`` this process's server is reached at; None for an evaluator (no server)."""
        return None if self.is_evaluator else self.cluster[self.task_type][self.task_index]

    @property
    def chief(self):
        """``(job, index)`` of the chief: ``("chief", 0)`` if present, else ``("worker", 0)``."""
        return ("chief", 0) if "chief" in self.cluster else ("worker", 0)

    @property
    def is_chief(self):
        """True in the one process that builds the graph and runs the session."""
        return (self.task_type, self.task_index) == self.chief

    @property
    def is_evaluator(self):
        """True in an evaluator: outside the training cluster, waited for by no task."""
        return self.task_type == EVALUATOR

    @property
    def compute_tasks(self):
        """``(job, index)`` of every task that computes a tower, chief first (no ps, no evaluator)."""
        return tfconfig.tasks(self.cluster, ("chief", "worker"))

    @property
    def num_towers(self):
        """How many towers :func:`gradaccum.ingraph.worker_devices` returns."""
        return len(self.compute_tasks)


def _check_address(job, address):
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (host and sep and port.isdigit() and 0 < int(port) < 65536):
        raise _config_error("cluster job %r must list \"host:port\" strings with a port in 1..65535" % job, address)


def _training_cluster(cluster):
    """The cluster without its evaluator job, ``master`` renamed ``chief``, checked."""
    if not isinstance(cluster, dict) or not cluster:
        raise _config_error("`cluster` must be a non-empty object of job name -> address list", cluster)
    if "chief" in cluster and "master" in cluster:
        raise _config_error("cluster names its chief twice, as \"chief\" and \"master\"", sorted(cluster))
    cluster = {_ALIASES.get(job, job): addresses for job, addresses in cluster.items() if job != EVALUATOR}
    for job, addresses in sorted(cluster.items()):
        if job not in TASK_TYPES:
            raise _config_error("cluster has unknown task type %r (known: %s)" % (job, _KNOWN), job)
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
    return {job: list(addresses) for job, addresses in cluster.items()}


def _check_task(task, cluster):
    if not isinstance(task, dict):
        raise _config_error("`task` must be an object with \"type\" and \"index\"", task)
    task_type, index = _ALIASES.get(task.get("type"), task.get("type")), task.get("index", 0)
    if task_type not in TASK_TYPES + (EVALUATOR,):
        raise _config_error("task has unknown task type (known: %s)" % _KNOWN, task.get("type"))
    if not isinstance(index, int) or isinstance(index, bool):
        raise _config_error("task index must be an int", index)
    if task_type == EVALUATOR:  # Outside the training cluster: any index of its own job.
        if index < 0:
            raise _config_error("task index must be >= 0", index)
        return task_type, index
    if task_type not in cluster:
        raise _config_error("task type %r is not a job of the cluster (jobs: %s)"
                            % (task_type, ", ".join(sorted(cluster))), task_type)
    if not 0 <= index < len(cluster[task_type]):
        raise _config_error("task index is outside the cluster: job %r has tasks 0..%d"
                            % (task_type, len(cluster[task_type]) - 1), index)
    return task_type, index


def parse_tf_config(text):
    """Parses and validates a ``TF_CONFIG`` JSON string.

    Accepts what Kubeflow's TFJob and Google's training service write: an
    ``"environment"`` key (ignored), ``"master"`` for the chief (read as
    ``"chief"``), an ``"evaluator"`` task, usually left out of ``"cluster"``
    (an ``"evaluator"`` job in it is dropped), and hosts of any DNS form.

    Args:
      text: the JSON text, with a ``"cluster"`` object (job name -> list of
        ``"host:port"``; jobs ``"chief"``, ``"worker"``, ``"ps"``) and a
        ``"task"`` object (``"type"``, ``"index"``).

    Returns:
      A :class:`ClusterConfig`.

    Raises:
      ValueError: one line naming what is wrong: text that is not JSON, an
        unknown task type, a task index outside the cluster, a bad address,
        a ``"sparseCluster"`` (TFJob's dynamic workers).

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
    if "sparseCluster" in data:
        raise _config_error("has \"sparseCluster\" (TFJob's dynamic workers), but synchronous training needs "
                            "every task to know all others: leave `enableDynamicWorker` unset in the TFJob, "
                            "so that it writes \"cluster\"", sorted(data))
    cluster = _training_cluster(data.get("cluster"))
    task_type, index = _check_task(data.get("task"), cluster)
    return ClusterConfig(cluster, task_type, index)


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


def from_environment(environ=None):
    """This process's cluster, from ``TF_CONFIG`` or else from Slurm's ``srun``.

    The one call that finds the cluster, wherever the job was launched:

    * ``TF_CONFIG`` set (by hand, ``gradaccum.launch``, Kubeflow's TFJob, a
      cloud service): as :func:`load_tf_config`.
    * Else ``SLURM_PROCID`` and ``SLURM_NTASKS`` set (a task started by
      ``srun``): tasks ``worker:0`` to ``worker:N-1`` in ``SLURM_PROCID``
      order, on the hosts of ``scontrol show hostnames $SLURM_STEP_NODELIST``
      with ``SLURM_STEP_TASKS_PER_NODE`` tasks each (srun's default block
      layout), task ``SLURM_LOCALID`` of a node at port
      ``GRADACCUM_PORT_BASE + SLURM_LOCALID`` (base 8888 by default).
      A step of one task is a single-process run: None.
    * Else None: a single-process run.

    Args:
      environ: mapping to read, ``os.environ`` by default.

    Returns:
      A :class:`ClusterConfig`, or None for a single-process run.

    Raises:
      ValueError: one line, for a bad ``TF_CONFIG`` (as
        :func:`parse_tf_config`), or Slurm variables that are malformed or
        disagree, naming the variable and its value.
      ClusterError: one line when ``scontrol`` is missing or fails.

    Example:
      >>> config = from_environment()
      >>> print("single process" if config is None else config.task_name)
    """
    environ = os.environ if environ is None else environ
    config = load_tf_config(environ)
    if config is not None:
        return config
    found = slurm.slurm_cluster(environ)
    return None if found is None else ClusterConfig({"worker": found[0]}, "worker", found[1])


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
    text = tfconfig.tf_config_json(cluster, task_type, task_index)
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
      ValueError: for an evaluator's ``config`` (it takes no part in training).
      ClusterError: one line when the port is in use or the server fails to start.

    Example:
      >>> server = start_server(from_environment())
      >>> sess = tf.compat.v1.Session(server.target, config=session_config(config))
    """
    if config.is_evaluator:
        raise ValueError("`config` must be a training task's: an evaluator runs no server, got %s"
                         % config.task_name)
    check_port_free(config)
    spec = tf.train.ClusterSpec(config.cluster)
    try:
        return tf.compat.v1.train.Server(spec, job_name=config.task_type, task_index=config.task_index,
                                         config=server_config, start=True)
    except tf.errors.OpError as exc:
        raise ClusterError("cannot start %s at %r: %s" % (config.task_name, config.address,
                                                         exc.message.splitlines()[0])) from None


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
    pending = tfconfig.tasks(config.cluster)
    while True:
        pending = [t for t in pending if not tfconfig.reachable(config.cluster[t[0]][t[1]])]
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
