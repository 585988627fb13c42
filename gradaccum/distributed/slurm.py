"""The cluster of a Slurm job step, from the variables ``srun`` sets (no TensorFlow).

:func:`gradaccum.cluster.from_environment` calls :func:`slurm_cluster` when
``TF_CONFIG`` is unset. TensorFlow's own ``SlurmClusterResolver`` is not
used: its constructor differs between TF 1.15 (``jobs`` required; reads
``SLURM_NTASKS_PER_NODE``, the same count on every node; runs ``scontrol``
without a node list) and 2.x (reads the step's variables; expands the host
list itself), and both look for GPUs (``nvidia-smi``) and set
``CUDA_VISIBLE_DEVICES`` as they resolve, which fails or surprises on CPU
nodes. This module creates no variables and adds nothing to graph
collections.
"""
import re
import shutil
import subprocess

from gradaccum.distributed.tfconfig import ClusterError

PORT_BASE_VAR = "GRADACCUM_PORT_BASE"
DEFAULT_PORT_BASE = 8888
_SCONTROL_SECONDS = 60
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _bad(name, what, value):
    return ValueError("`%s` %s, got %r" % (name, what, value))


def _int(environ, name, smallest):
    value = environ.get(name)
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or number < smallest:
        raise _bad(name, "must be an int >= %d" % smallest, value)
    return number


def _required(environ, name):
    value = environ.get(name, "").strip()
    if not value:
        raise _bad(name, "must be set (it is, in every task srun starts: run the job's tasks with srun)",
                   environ.get(name))
    return value


def tasks_per_node(text, name="SLURM_STEP_TASKS_PER_NODE"):
    """Expands Slurm's count list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts = []
    for part in text.split(","):
        match = _COUNT.match(part.strip())
        if match is None or int(match.group(1)) < 1 or match.group(2) == "0":
            raise _bad(name, "must look like \"2(x3),1\" (tasks per node, in node order)", text)
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def hostnames(nodelist, environ):
    """The hosts of a Slurm node list, from ``scontrol show hostnames`` (found on ``environ``'s PATH)."""
    scontrol = shutil.which("scontrol", path=environ.get("PATH"))
    if scontrol is None:
        raise ClusterError("cannot expand SLURM_STEP_NODELIST %r: `scontrol` is not on PATH (Slurm's client "
                           "tools must be installed where srun starts the tasks)" % nodelist)
    try:
        done = subprocess.run([scontrol, "show", "hostnames", nodelist], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, universal_newlines=True, env=dict(environ),
                              timeout=_SCONTROL_SECONDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterError("cannot expand SLURM_STEP_NODELIST %r: `scontrol` failed (%s)" % (nodelist, exc)) from None
    hosts = done.stdout.split()
    if done.returncode != 0 or not hosts:
        why = (done.stderr.strip().splitlines() or ["no host printed"])[-1]
        raise ClusterError("cannot expand SLURM_STEP_NODELIST %r: `scontrol show hostnames` exited %d (%s)"
                           % (nodelist, done.returncode, why))
    return hosts


def _port_base(environ, most_per_node):
    text = environ.get(PORT_BASE_VAR, "").strip() or str(DEFAULT_PORT_BASE)
    top = 65535 - (most_per_node - 1)
    if not text.isdigit() or not 1 <= int(text) <= top:
        raise _bad(PORT_BASE_VAR, "must be a port in 1..%d (task SLURM_LOCALID of a node listens on base + "
                   "SLURM_LOCALID)" % top, environ.get(PORT_BASE_VAR))
    return int(text)


def _check_own_place(environ, rank, counts):
    """This task's node and local id must be those of srun's block layout."""
    node = next(i for i in range(len(counts)) if rank < sum(counts[:i + 1]))
    local = rank - sum(counts[:node])
    for name, expected in (("SLURM_NODEID", node), ("SLURM_LOCALID", local)):
        if environ.get(name, "").strip() not in ("", str(expected)):
            raise _bad(name, "must be %d for SLURM_PROCID %d with SLURM_STEP_TASKS_PER_NODE %r: the tasks must "
                       "be laid out in blocks (srun --distribution=block, the default)"
                       % (expected, rank, environ.get("SLURM_STEP_TASKS_PER_NODE")), environ.get(name))


def slurm_cluster(environ):
    """``(addresses, rank)`` of this ``srun`` task, or None outside Slurm or for a step of one task.

    Args:
      environ: the mapping to read (``SLURM_PROCID``, ``SLURM_NTASKS``,
        ``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``, optional
        ``SLURM_STEP_NUM_TASKS``, ``SLURM_NODEID``, ``SLURM_LOCALID``,
        ``GRADACCUM_PORT_BASE``; ``PATH`` to find ``scontrol``).

    Returns:
      None, or the ``"host:port"`` of every task in ``SLURM_PROCID`` order and
      this task's ``SLURM_PROCID``.

    Raises:
      ValueError: one line naming the variable that is malformed or disagrees.
      ClusterError: when ``scontrol`` is missing or fails.
    """
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return None
    ntasks = _int(environ, "SLURM_NTASKS", 1)
    rank = _int(environ, "SLURM_PROCID", 0)
    if rank >= ntasks:
        raise _bad("SLURM_PROCID", "must be < SLURM_NTASKS (%d)" % ntasks, environ["SLURM_PROCID"])
    step = environ.get("SLURM_STEP_NUM_TASKS", "").strip()
    if step and step != str(ntasks):
        raise _bad("SLURM_STEP_NUM_TASKS", "must equal SLURM_NTASKS (%d)" % ntasks, step)
    if ntasks == 1:
        return None
    nodelist = _required(environ, "SLURM_STEP_NODELIST")
    counts = tasks_per_node(_required(environ, "SLURM_STEP_TASKS_PER_NODE"))
    if sum(counts) != ntasks:
        raise _bad("SLURM_STEP_TASKS_PER_NODE", "must add up to SLURM_NTASKS (%d)" % ntasks,
                   environ["SLURM_STEP_TASKS_PER_NODE"])
    _check_own_place(environ, rank, counts)
    base = _port_base(environ, max(counts))
    hosts = hostnames(nodelist, environ)
    if len(hosts) != len(counts):
        raise _bad("SLURM_STEP_TASKS_PER_NODE", "must give one count per node of SLURM_STEP_NODELIST %r "
                   "(%d: %s)" % (nodelist, len(hosts), " ".join(hosts)), environ["SLURM_STEP_TASKS_PER_NODE"])
    addresses = ["%s:%d" % (host, base + local) for host, count in zip(hosts, counts) for local in range(count)]
    return addresses, rank
