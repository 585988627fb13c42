"""The Fashion-MNIST example as one worker of a collective job (``--workers P`` under the launcher).

Run ``python -m gradaccum.launch --workers P -- python examples/fashion_mnist_subdivision.py``:
every worker builds the same graph, draws the same shuffle and runs its own
share of each update's micro-batches (worker r runs micro-batches r, r + P,
r + 2P, ...: ``subdivisions / P`` of them, of the same size as on one
process); ``gradaccum.cluster.CollectiveAllReduce`` inside the accumulator sums
the window once per update over the workers, so every update is the one of the
whole batch, and the trained variables are those of one process. Worker 0's initial values are broadcast to all; a
``cluster.Heartbeat`` ends a worker whose peer stopped answering. Only the
chief (worker 0) evaluates, prints and writes ``--json``.

Without ``TF_CONFIG`` (or with one worker) nothing here is used. This module
creates no variables itself; see ``gradaccum.collective`` for the engine's.
"""
import collections
import os

WorkerRun = collections.namedtuple("WorkerRun", ["config", "rank", "size", "server", "session_config"])
WorkerRun.__doc__ = """This process's part in a collective job.

Attributes:
  config: its ``gradaccum.cluster.ClusterConfig``.
  rank: its index among the compute tasks (0: the chief, which reports).
  size: the number of workers P.
  server: its started ``tf.compat.v1.train.Server``.
  session_config: the ``ConfigProto`` of its server and session.
"""


def cluster_size(environ=None):
    """The number of compute tasks ``TF_CONFIG`` names (1 without one), without importing TensorFlow.

    Args:
      environ: the environment (default ``os.environ``).

    Returns:
      An int >= 1.

    Example:
      >>> cluster_size({"TF_CONFIG": '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {}}'})
      2
    """
    import json  # Only here: most runs have no TF_CONFIG.
    text = (environ or os.environ).get("TF_CONFIG")
    if not text:
        return 1
    try:
        spec = json.loads(text).get("cluster", {})
    except (ValueError, AttributeError):
        return 1  # gradaccum.cluster.load_tf_config names the problem later, in one line.
    return max(1, len(spec.get("chief", ())) + len(spec.get("worker", ())))


def check_shares(batch_size, subdivisions, workers):
    """The one-line problem with splitting the update over ``workers``, or None.

    Each worker runs ``subdivisions / workers`` micro-batches of
    ``batch_size / subdivisions`` examples.

    Args:
      batch_size: examples per update, over all workers.
      subdivisions: micro-batches per update, over all workers (None: no accumulator).
      workers: the number of workers.

    Returns:
      A message naming the flag and its value, or None.

    Example:
      >>> check_shares(5000, 50, 4)
      '`--subdivisions` 50 must be divisible by the 4 workers ...'
    """
    if workers == 1:
        return None
    if subdivisions is None:
        return "`--no-subdivisions` trains one process on the whole batch; it does not combine with %d workers" % (
            workers)
    if subdivisions % workers:
        return ("`--subdivisions` %d must be divisible by the %d workers (each runs %d/%d of every update's "
                "micro-batches), e.g. %d" % (subdivisions, workers, subdivisions, workers,
                                             subdivisions - subdivisions % workers or workers))
    return None


def start(tf, cluster, devices, startup_timeout_seconds=300.0):
    """Starts this task's server for the collective engine and waits for the other tasks.

    Args:
      tf: the ``tensorflow`` module.
      cluster: the ``gradaccum.cluster`` module.
      devices: CPU devices per worker (its towers).
      startup_timeout_seconds: how long to wait for the other tasks.

    Returns:
      A ``WorkerRun``, or None without a cluster of several workers.

    Raises:
      ValueError: for a cluster with a ps task, or a bad ``TF_CONFIG``.
      gradaccum.cluster.ClusterError: when a task never comes up.

    Example:
      >>> run = start(tf, cluster, 1)
    """
    config = cluster.load_tf_config()
    if config is None or len(config.compute_tasks) == 1:
        return None
    if config.cluster.get("ps"):
        raise ValueError("the collective engine takes no ps task, got %d (run the launcher with --ps 0)"
                         % len(config.cluster["ps"]))
    base = tf.compat.v1.ConfigProto(device_count={"CPU": devices})
    session_config = cluster.collective_session_config(config, base)
    server = cluster.start_server(config, session_config)
    cluster.wait_for_tasks(config, timeout_seconds=startup_timeout_seconds)
    rank = config.compute_tasks.index((config.task_type, config.task_index))
    return WorkerRun(config, rank, len(config.compute_tasks), server, session_config)
