"""The one maker of the library's state variables.

Caches, counters, statistics, the adaptive policy and window batch norm all
keep state that a ``Saver`` checkpoint must restore exactly and that no
optimizer may train: zero-initialised (or given) global, non-trainable
resource variables, colocated with the variable they serve. This module
creates only the variables its caller asks for, in ``GLOBAL_VARIABLES``.
"""
from gradaccum._compat import tf


def state_variable(name, shape, dtype, colocate_with=None, initial=None):
    """A global, non-trainable resource variable, next to ``colocate_with``.

    Args:
      name: the variable's name.
      shape: its shape.
      dtype: its dtype.
      colocate_with: ``None``, or a variable or op to colocate it with.
      initial: ``None`` (zeros), or a tensor or number: the initial value.

    Returns:
      The new ``tf.Variable`` (in ``GLOBAL_VARIABLES``: checkpoints save it).

    Example:
      >>> count = state_variable("micro_step", [], tf.int64, var)
    """
    def initial_value():
        if initial is None:
            return tf.zeros(shape, dtype)
        return tf.cast(initial, dtype)

    def make():
        return tf.compat.v1.Variable(initial_value, dtype=dtype, trainable=False, name=name,
                                     collections=[tf.compat.v1.GraphKeys.GLOBAL_VARIABLES], use_resource=True)

    if colocate_with is None:
        return make()
    with tf.compat.v1.colocate_with(colocate_with):
        return make()
