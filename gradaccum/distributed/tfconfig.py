"""The cluster description without TensorFlow: ``TF_CONFIG`` text, task lists, reachability.

Shared by :mod:`gradaccum.cluster`, :mod:`gradaccum.ingraph`,
:mod:`gradaccum.distributed.heartbeat` and the launcher, which must not import
TensorFlow. This module creates no variables and adds nothing to graph
collections.
"""
import json
import socket

TF_CONFIG_VAR = "TF_CONFIG"


class ClusterError(RuntimeError):
    """A cluster task cannot start or lost its peers; the message is one line."""


# Its public home, where the API reference documents it and users import it.
ClusterError.__module__ = "gradaccum.cluster"


def tasks(cluster, jobs=None):
    """``(job, index)`` of every task of ``cluster``: jobs in ``jobs`` order (default sorted), indices ascending.

    The one enumeration of a cluster's tasks: the compute group
    (``jobs=("chief", "worker")``), the tasks a chief waits for or watches,
    the launcher's start order.
    """
    jobs = sorted(cluster) if jobs is None else [job for job in jobs if job in cluster]
    return [(job, index) for job in jobs for index in range(len(cluster[job]))]


def tf_config_json(cluster, task_type, task_index):
    """The ``TF_CONFIG`` JSON of task ``task_type:task_index`` of ``cluster`` (not validated)."""
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": task_index}})


def reachable(address, timeout_seconds=1.0):
    """True when ``"host:port"`` accepts a TCP connection within ``timeout_seconds``."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_seconds).close()
        return True
    except OSError:
        return False
