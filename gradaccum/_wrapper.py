"""The base of the optimizers that wrap another optimizer.

``GradientAccumulator`` and ``cluster.AllReduceOnApply`` both change what
happens between ``compute_gradients`` and the wrapped optimizer's
``apply_gradients``. Everything else must look like the wrapped optimizer, so
that hooks, savers and ``get_slot`` calls written for it keep working. This
module creates no variables and no collections.
"""
from gradaccum import _validate
from gradaccum._compat import tf


class WrappingOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` that forwards to a wrapped one.

    ``compute_gradients`` is the wrapped optimizer's (a loss-scale optimizer
    scales there), and slots and variables are the union of the wrapper's own
    and the wrapped optimizer's. Subclasses write ``apply_gradients``.

    Args:
      optimizer: the ``tf.compat.v1.train.Optimizer`` to wrap.
      name: non-empty string, the wrapper's name (and its ops' name scope).

    Raises:
      TypeError: when ``optimizer`` is not a v1 optimizer.
      ValueError: when ``name`` is not a non-empty string.

    Example:
      >>> class Passthrough(WrappingOptimizer):
      ...     def apply_gradients(self, grads_and_vars, global_step=None, name=None):
      ...         return self.optimizer.apply_gradients(grads_and_vars, global_step, name)
      >>> opt = Passthrough(tf.compat.v1.train.AdamOptimizer(1e-3), "Passthrough")
    """

    def __init__(self, optimizer, name):
        _validate.check_optimizer(optimizer)
        _validate.check_name(name)
        super(WrappingOptimizer, self).__init__(use_locking=False, name=name)
        self._optimizer = optimizer

    @property
    def optimizer(self):
        """The wrapped ``tf.compat.v1.train.Optimizer``."""
        return self._optimizer

    def compute_gradients(self, *args, **kwargs):
        """Delegates to the wrapped optimizer, so that loss scaling keeps working.

        Args:
          *args: as ``tf.compat.v1.train.Optimizer.compute_gradients``.
          **kwargs: as ``tf.compat.v1.train.Optimizer.compute_gradients``.

        Returns:
          The wrapped optimizer's list of ``(gradient, variable)`` pairs.

        Example:
          >>> grads_and_vars = opt.compute_gradients(loss)
        """
        return self._optimizer.compute_gradients(*args, **kwargs)

    def get_slot(self, var, name):
        """Returns slot ``name`` of ``var``: the wrapper's or the wrapped optimizer's.

        Args:
          var: a variable this optimizer trains.
          name: a slot name of the wrapper (``GradientAccumulator``'s
            ``"accum"``, ``"touched"``) or of the wrapped optimizer (for Adam
            ``"m"`` and ``"v"``).

        Returns:
          The slot variable, or ``None``.

        Example:
          >>> opt.get_slot(kernel, "m")  # Adam's first moment
        """
        own = super(WrappingOptimizer, self).get_slot(var, name)
        return own if own is not None else self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        """Returns the slot names of the wrapper and of the wrapped optimizer.

        Returns:
          A sorted list of strings.

        Example:
          >>> opt.get_slot_names()
          ['accum', 'm', 'v']
        """
        own = super(WrappingOptimizer, self).get_slot_names()
        return sorted(set(own) | set(self._optimizer.get_slot_names()))

    def variables(self):
        """Returns every state variable: the wrapper's and the wrapped optimizer's.

        Returns:
          A list of variables sorted by name.

        Example:
          >>> saver = tf.compat.v1.train.Saver(opt.variables())
        """
        found = {}
        for var in list(super(WrappingOptimizer, self).variables()) + list(self._optimizer.variables()):
            found[var.name] = var
        return [found[key] for key in sorted(found)]
