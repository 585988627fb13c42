"""gradaccum: exact gradient accumulation and synchronous multi-device training.

For TensorFlow 1.x graph mode (``tf.compat.v1``), TF 1.15 to 2.x. Public
names are re-exported here explicitly, one per line; the modules ``tower``
(several devices), ``cluster`` (several processes and hosts) and ``launch``
(the one-machine launcher, ``python -m gradaccum.launch``) are public too.
"""
from gradaccum import cluster
from gradaccum import launch
from gradaccum import tower
from gradaccum._version import __version__
from gradaccum.accumulator import GradientAccumulator
from gradaccum.cluster import AllReduceOnApply
from gradaccum.cluster import ClusterConfig
from gradaccum.cluster import ClusterError
from gradaccum.cluster import StopSignal
from gradaccum.tower import Tower
from gradaccum.tower import TowerTraining

__all__ = [
    "__version__",
    "AllReduceOnApply",
    "ClusterConfig",
    "ClusterError",
    "GradientAccumulator",
    "StopSignal",
    "Tower",
    "TowerTraining",
    "cluster",
    "launch",
    "tower",
]
