"""Window statistics: update ops that must see a whole accumulation window.

A layer whose per-run update would be wrong under accumulation (batch norm's
moving averages, which should move once per window from the pooled window
statistics) puts a ``gradaccum.WindowObserver`` with an ``update_op``
attribute into the graph collection :data:`WINDOW_STATISTICS`, and its
plain, TF-like per-run ``update_op`` into ``UPDATE_OPS``. A
``GradientAccumulator`` with k > 1 splits its update ops with
:func:`split_update_ops`: plain ops run on every micro-step, and each
statistics object observes the window instead (``added`` on every
micro-step, ``applied`` once an applied window's update is done, ``reset``
on skipped windows and in ``zero_op``). This module creates no variables; the collection is
filled by the layers, not here.
"""
from gradaccum._compat import tf

WINDOW_STATISTICS = "gradaccum_window_statistics"
"""Graph collection of window-statistics objects (window observers with an ``update_op``)."""


def split_update_ops(update_ops, graph=None):
    """Splits update ops into plain ops and the window-statistics objects they belong to.

    Args:
      update_ops: a list of ops (or tensors), for example ``UPDATE_OPS``.
      graph: the graph whose :data:`WINDOW_STATISTICS` collection is read;
        the default graph when ``None``.

    Returns:
      ``(plain_ops, stats)``: the ops that are no statistics object's
      ``update_op``, in their order, and the statistics objects whose
      ``update_op`` is in ``update_ops`` (compared by identity), in
      collection order.

    Example:
      >>> plain, stats = split_update_ops(
      ...     tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS))
    """
    graph = graph or tf.compat.v1.get_default_graph()
    given = [_as_op(op) for op in update_ops]
    stats = [obj for obj in graph.get_collection(WINDOW_STATISTICS)
             if any(_as_op(obj.update_op) is op for op in given)]
    taken = [_as_op(obj.update_op) for obj in stats]
    plain = [original for op, original in zip(given, update_ops) if not any(op is t for t in taken)]
    return plain, stats


def _as_op(op_or_tensor):
    return getattr(op_or_tensor, "op", op_or_tensor)
