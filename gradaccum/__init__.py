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
    "GradientAccumulator": ("gradaccum.accumulator", "GradientAccumulator"),
    "Reducer": ("gradaccum.reducers", "Reducer"),
    "WindowObserver": ("gradaccum.observers", "WindowObserver"),
    "AdaptiveBatch": ("gradaccum.adaptive", "AdaptiveBatch"),
    "batch_ramp": ("gradaccum.schedules", "batch_ramp"),
    "step_schedule": ("gradaccum.schedules", "step_schedule"),
    "MicroBatchChoice": ("gradaccum.finder", "MicroBatchChoice"),
    "find_micro_batch": ("gradaccum.finder", "find_micro_batch"),
    "batch_normalization": ("gradaccum.batch_norm", "batch_normalization"),
    "AllReduceOnApply": ("gradaccum.cluster", "AllReduceOnApply"),
    "ClusterConfig": ("gradaccum.cluster", "ClusterConfig"),
    "ClusterError": ("gradaccum.cluster", "ClusterError"),
    "Heartbeat": ("gradaccum.cluster", "Heartbeat"),
    "StopSignal": ("gradaccum.cluster", "StopSignal"),
    "CollectiveAllReduce": ("gradaccum.collective", "CollectiveAllReduce"),
    "ShardedAllReduce": ("gradaccum.sharded", "ShardedAllReduce"),
    "Membership": ("gradaccum.membership", "Membership"),
    "assign_examples": ("gradaccum.membership", "assign_examples"),
    "micro_batches_per_worker": ("gradaccum.membership", "micro_batches_per_worker"),
    "update_examples": ("gradaccum.membership", "update_examples"),
    "synchronized_batch_norm": ("gradaccum.collective", "synchronized_batch_norm"),
    "summaries": ("gradaccum._summaries", "summaries"),
    "SubdividedTraining": ("gradaccum.subdivisions", "SubdividedTraining"),
    "plain_variables": ("gradaccum._checkpoints", "plain_variables"),
    "Tower": ("gradaccum.tower", "Tower"),
    "TowerTraining": ("gradaccum.tower", "TowerTraining"),
    "cluster": ("gradaccum.cluster", None),
    "collective": ("gradaccum.collective", None),
    "consolidate": ("gradaccum.consolidate", None),
    "ingraph": ("gradaccum.ingraph", None),
    "launch": ("gradaccum.launch", None),
    "membership": ("gradaccum.membership", None),
    "observers": ("gradaccum.observers", None),
    "reducers": ("gradaccum.reducers", None),
    "sharded": ("gradaccum.sharded", None),
    "statistics": ("gradaccum.statistics", None),
    "subdivisions": ("gradaccum.subdivisions", None),
    "tower": ("gradaccum.tower", None),
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
