"""Checkpoints across adding or removing accumulation: :func:`plain_variables`.

A graph trained through a ``GradientAccumulator`` has the variables of the
same graph without it (model, the wrapped optimizer's slots and non-slot
variables, ``global_step``), under the same names, plus the accumulator's
own state. A checkpoint written without the accumulator lacks that state,
so a name-based restore of every variable fails; restoring only
:func:`plain_variables` and initialising the rest starts a new window where
the plain run stopped. The other way needs nothing: a plain graph's
``Saver`` restores its variables from an accumulated checkpoint and ignores
the rest (written at a window boundary, it holds no pending gradients).

Variables: none. Collections: none.
"""
from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.window.accumulator import GradientAccumulator
from gradaccum.window.wrapper import optimizer_chain


def plain_variables(optimizer, var_list=None):
    """The variables a checkpoint written without gradaccum's accumulator holds.

    That is ``var_list`` without the ``state_variables`` of every
    ``GradientAccumulator`` in ``optimizer``'s chain: restore these from a
    checkpoint written by the same model trained without accumulation (or
    before it was added), and initialise the accumulator's state variables,
    which starts a new window. Towers need nothing: ``tower.minimize``
    creates no variables, so their names are one device's either way.

    Args:
      optimizer: the ``GradientAccumulator`` (or an optimizer wrapping one)
        whose train op the graph holds; it must have built it.
      var_list: the variables to choose from; ``None``: every global
        variable of the default graph.

    Returns:
      A list of variables, in ``var_list``'s order.

    Raises:
      TypeError: for a non-optimizer, or a ``var_list`` that is not a list
        of variables.
      ValueError: when no ``GradientAccumulator`` in the chain has built a
        train op in the default graph.

    Example:
      >>> opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(1e-3), 4)
      >>> train_op = opt.minimize(loss, global_step=step)
      >>> restore = tf.compat.v1.train.Saver(gradaccum.plain_variables(opt))
      >>> sess.run(tf.compat.v1.global_variables_initializer())
      >>> restore.restore(sess, checkpoint_written_without_accumulation)
    """
    _validate.check_optimizer(optimizer)
    if var_list is None:
        var_list = tf.compat.v1.global_variables()
    elif not isinstance(var_list, (list, tuple)) or not all(isinstance(v, tf.Variable) for v in var_list):
        raise TypeError("`var_list` must be None or a list of variables, got %s" % _validate.describe(var_list))
    graph = tf.compat.v1.get_default_graph()
    accumulators = [wrapped for wrapped in optimizer_chain(optimizer) if isinstance(wrapped, GradientAccumulator)
                    and any(window.train_op.graph is graph for window in wrapped.windows)]
    if not accumulators:
        raise ValueError("`optimizer` must be, or wrap, a GradientAccumulator that has built its train op in "
                         "this graph, got %s" % _validate.describe(optimizer))
    own = set(id(var) for accumulator in accumulators for var in accumulator.state_variables)
    return [var for var in var_list if id(var) not in own]
