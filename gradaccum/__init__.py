"""gradaccum: exact gradient accumulation for TensorFlow 1.x graph mode.

Public names are re-exported here explicitly, one per line.
"""
from gradaccum._version import __version__
from gradaccum.accumulator import GradientAccumulator

__all__ = [
    "__version__",
    "GradientAccumulator",
]
