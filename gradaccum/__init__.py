"""gradaccum: exact gradient accumulation and synchronous multi-device training.

For TensorFlow 1.x graph mode (``tf.compat.v1``), TF 1.15 to 2.x. Public
names are re-exported here explicitly, one per line, and imported on first
use; the modules ``tower`` (several devices), ``subdivisions`` (one run per update, the micro-batches in a
loop inside the graph), ``cluster`` (several processes
and hosts, with its engines ``collective`` and ``ingraph``), ``launch``
(the one-machine launcher, ``python -m gradaccum.launch``), ``membership``
(elastic jobs: the same examples per update on any number of workers) and
``statistics`` (the gradient noise scale behind ``summaries``) are public too.
"""
import importlib as _importlib
import sys as _sys

from gradaccum._version import __version__

# Public name -> (module, attribute; None for the module itself), one per line.
# Imported on first use (PEP 562), so that `python -m gradaccum.launch`, which
# imports this package first, parses its flags without loading TensorFlow.
_EXPORTS = {
    "GradientAccumulator": ("gradaccum.window.accumulator", "GradientAccumulator"),
    "Reducer": ("gradaccum.window.reducers", "Reducer"),
    "WindowObserver": ("gradaccum.window.observers", "WindowObserver"),
    "AdaptiveBatch": ("gradaccum.batch.adaptive", "AdaptiveBatch"),
    "batch_ramp": ("gradaccum.batch.schedules", "batch_ramp"),
    "step_schedule": ("gradaccum.batch.schedules", "step_schedule"),
    "MicroBatchChoice": ("gradaccum.batch.finder", "MicroBatchChoice"),
    "find_micro_batch": ("gradaccum.batch.finder", "find_micro_batch"),
    "batch_normalization": ("gradaccum.devices.batch_norm", "batch_normalization"),
    "recompute": ("gradaccum.devices.recompute", "recompute"),
    "AllReduceOnApply": ("gradaccum.distributed.cluster", "AllReduceOnApply"),
    "ClusterConfig": ("gradaccum.distributed.cluster", "ClusterConfig"),
    "ClusterError": ("gradaccum.distributed.cluster", "ClusterError"),
    "Heartbeat": ("gradaccum.distributed.cluster", "Heartbeat"),
    "StopSignal": ("gradaccum.distributed.cluster", "StopSignal"),
    "CollectiveAllReduce": ("gradaccum.distributed.collective", "CollectiveAllReduce"),
    "ShardedAllReduce": ("gradaccum.distributed.sharded", "ShardedAllReduce"),
    "Membership": ("gradaccum.distributed.membership", "Membership"),
    "assign_examples": ("gradaccum.distributed.membership", "assign_examples"),
    "micro_batches_per_worker": ("gradaccum.distributed.membership", "micro_batches_per_worker"),
    "update_examples": ("gradaccum.distributed.membership", "update_examples"),
    "synchronized_batch_norm": ("gradaccum.distributed.collective", "synchronized_batch_norm"),
    "summaries": ("gradaccum.window.summaries", "summaries"),
    "SubdividedTraining": ("gradaccum.devices.subdivisions", "SubdividedTraining"),
    "plain_variables": ("gradaccum.window.checkpoints", "plain_variables"),
    "ModelResult": ("gradaccum.devices.model", "ModelResult"),
    "Tower": ("gradaccum.devices.tower", "Tower"),
    "TowerTraining": ("gradaccum.devices.tower", "TowerTraining"),
    "cluster": ("gradaccum.distributed.cluster", None),
    "collective": ("gradaccum.distributed.collective", None),
    "consolidate": ("gradaccum.distributed.consolidate", None),
    "ingraph": ("gradaccum.distributed.ingraph", None),
    "launch": ("gradaccum.distributed.launch", None),
    "membership": ("gradaccum.distributed.membership", None),
    "observers": ("gradaccum.window.observers", None),
    "reducers": ("gradaccum.window.reducers", None),
    "sharded": ("gradaccum.distributed.sharded", None),
    "statistics": ("gradaccum.window.statistics", None),
    "subdivisions": ("gradaccum.devices.subdivisions", None),
    "tower": ("gradaccum.devices.tower", None),
}

if _sys.argv[:1] != ["-m"]:  # "-m" only while `python -m gradaccum.<module>` locates its module.
    from gradaccum import _compat  # noqa: F401  Fails at once, in one sentence, without TensorFlow.


def __getattr__(name):
    """Imports an exported name on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError("module 'gradaccum' has no attribute %r" % (name,))
    module, attribute = _EXPORTS[name]
    value = _importlib.import_module(module)
    value = value if attribute is None else getattr(value, attribute)
    globals()[name] = value
    return value


def __dir__():
    """The module's names, exported ones included before their first use."""
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "__version__",
    "AdaptiveBatch",
    "AllReduceOnApply",
    "ClusterConfig",
    "ClusterError",
    "CollectiveAllReduce",
    "GradientAccumulator",
    "Heartbeat",
    "Membership",
    "MicroBatchChoice",
    "ModelResult",
    "Reducer",
    "ShardedAllReduce",
    "StopSignal",
    "SubdividedTraining",
    "Tower",
    "TowerTraining",
    "WindowObserver",
    "batch_normalization",
    "assign_examples",
    "batch_ramp",
    "cluster",
    "collective",
    "consolidate",
    "find_micro_batch",
    "ingraph",
    "launch",
    "membership",
    "micro_batches_per_worker",
    "observers",
    "plain_variables",
    "recompute",
    "reducers",
    "sharded",
    "statistics",
    "step_schedule",
    "subdivisions",
    "summaries",
    "synchronized_batch_norm",
    "tower",
    "update_examples",
]
