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
import inspect
import os
import warnings

from gradaccum._compat import tf

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # gradaccum/

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


FIRST = "first"
"""``update_ops="first"``: the update ops of the model's first tower (of the one model, without towers)."""
ALL = "all"
"""``update_ops="all"``: every tower's update ops (the same as ``"first"`` without towers)."""


def chosen_update_ops(update_ops, caller, none_means):
    """Checks an ``update_ops`` argument; one meaning wherever gradaccum takes it.

    ``"first"`` and ``"all"`` are returned as given (a form with towers
    chooses among its towers' ops; without towers both are the model's
    ``UPDATE_OPS``); a list or tuple of ops is returned as a list (``[]``:
    none). ``None`` is deprecated: it meant every ``UPDATE_OPS`` op in
    ``GradientAccumulator.minimize`` and none elsewhere, which it still
    does, with a ``FutureWarning``.

    Args:
      update_ops: the argument as given.
      caller: the function's name, for the messages.
      none_means: what ``None`` still means there: ``"all"`` or ``"none"``.

    Returns:
      ``"first"``, ``"all"`` or a list of ops.

    Raises:
      ValueError: for any other value, naming it.

    Example:
      >>> chosen_update_ops("first", "tower.minimize", none_means="none")
      'first'
    """
    if update_ops is None:
        warnings.warn("%s(update_ops=None) is deprecated: it runs %s; say update_ops=[] (none), 'first' or "
                      "'all' (every UPDATE_OPS op the model built), which mean the same in minimize, "
                      "apply_gradients, tower.minimize and subdivisions.minimize"
                      % (caller, "every UPDATE_OPS op" if none_means == ALL else "no update ops"),
                      FutureWarning, stacklevel=user_stacklevel())
        return ALL if none_means == ALL else []
    if isinstance(update_ops, str) and update_ops in (FIRST, ALL):
        return update_ops
    if isinstance(update_ops, (list, tuple)):
        return list(update_ops)
    raise ValueError("`update_ops` must be 'first', 'all' or a list of ops ([]: none), got %r" % (update_ops,))


def user_stacklevel():
    """The ``stacklevel`` at which ``warnings.warn``, called by this function's caller, names the user's line.

    That is the first frame outside the gradaccum package, however deep
    inside gradaccum the warning is raised (``tower.minimize`` and
    ``subdivisions.minimize`` check their arguments a few calls down).

    Returns:
      An int >= 2.

    Example:
      >>> warnings.warn("deprecated", FutureWarning, stacklevel=user_stacklevel())
    """
    frame, level = inspect.currentframe().f_back, 1  # warnings.warn's caller is level 1.
    try:
        while frame.f_back is not None and _inside_package(frame):
            frame, level = frame.f_back, level + 1
        return level
    finally:
        del frame  # A frame kept in a local makes a reference cycle.


def _inside_package(frame):
    return os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE + os.sep)


def graph_update_ops(update_ops):
    """``update_ops`` as a list of ops for one model: ``"first"`` and ``"all"`` are ``UPDATE_OPS`` now.

    Args:
      update_ops: a value returned by :func:`chosen_update_ops`.

    Returns:
      A list of ops.

    Example:
      >>> train_op = opt.apply_gradients(pairs, update_ops=graph_update_ops("first"))
    """
    if isinstance(update_ops, str):
        return tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)
    return update_ops
