"""Keeps TensorFlow's session hooks quiet about accumulation's global step.

TF's ``StepCounterHook`` (which ``MonitoredTrainingSession`` adds whenever it
has a ``checkpoint_dir`` or ``summary_dir`` and ``log_step_count_steps``)
warns "It seems that global step (tf.train.get_global_step) has not been
increased" each time a run leaves ``global_step`` where it was, for its first
five such runs. An accumulator with k > 1 leaves it still on k - 1 runs of
every k, by design: ``global_step`` counts applied updates, as with
``SyncReplicasOptimizer``, whose case the hook's own comment names. So a
``GradientAccumulator`` that builds a train op with k > 1 and a
``global_step`` installs :class:`GlobalStepWarningFilter` on TensorFlow's
logger (once per process). It drops that one warning and nothing else; the
hook's steps-per-second figures (updates per second) and every other hook are
untouched. :func:`remove_global_step_warning_filter` takes it off again.

This module creates no variables and no collections.
"""
import logging

from gradaccum._compat import tf

WARNING_START = "It seems that global step (tf.train.get_global_step) has not been increased"
"""The start of the warning that :class:`GlobalStepWarningFilter` drops."""

_installed = []


class GlobalStepWarningFilter(logging.Filter):
    """A ``logging.Filter`` that drops TF's "global step has not been increased" warning.

    Example:
      >>> tf.get_logger().addFilter(GlobalStepWarningFilter())
    """

    def filter(self, record):
        """Returns False for the step-counter warning, True for every other record.

        Args:
          record: a ``logging.LogRecord``.

        Returns:
          Whether the record is logged.

        Example:
          >>> GlobalStepWarningFilter().filter(record)
        """
        return not str(record.msg).startswith(WARNING_START)


def install_global_step_warning_filter():
    """Installs :class:`GlobalStepWarningFilter` on TensorFlow's logger (idempotent).

    Called by ``GradientAccumulator`` when it builds a train op with k > 1 and
    a ``global_step``.

    Returns:
      The installed filter.

    Example:
      >>> install_global_step_warning_filter()
    """
    if not _installed:
        _installed.append(GlobalStepWarningFilter())
        tf.get_logger().addFilter(_installed[0])
    return _installed[0]


def remove_global_step_warning_filter():
    """Removes the filter, so that TF's step-counter warning is logged again.

    Later accumulating train ops with a ``global_step`` install it again.

    Returns:
      None.

    Example:
      >>> remove_global_step_warning_filter()
    """
    while _installed:
        tf.get_logger().removeFilter(_installed.pop())
