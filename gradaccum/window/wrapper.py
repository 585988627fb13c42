"""The base of the optimizers that wrap another optimizer.

``GradientAccumulator`` and ``cluster.AllReduceOnApply`` both change what
happens between ``compute_gradients`` and the wrapped optimizer's
``apply_gradients``. Everything else must look like the wrapped optimizer, so
that hooks, savers and ``get_slot`` calls written for it keep working. This
module creates no variables and no collections.
"""
from gradaccum import _validate
from gradaccum._compat import tf


def optimizer_chain(optimizer):
    """Yields ``optimizer`` and each optimizer it wraps, outermost first, each once.

    Follows ``optimizer`` (ours) or ``_optimizer`` (ours, and TF's loss-scale
    optimizers); a chain that leads back to an optimizer already seen ends.

    Args:
      optimizer: any object; ``None`` yields nothing.

    Yields:
      The optimizers of the chain.

    Example:
      >>> [type(o).__name__ for o in optimizer_chain(GradientAccumulator(AdamOptimizer(1e-3), 4))]
      ['GradientAccumulator', 'AdamOptimizer']
    """
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)


class WrappingOptimizer(tf.compat.v1.train.Optimizer):
    """A ``tf.compat.v1.train.Optimizer`` that forwards to a wrapped one.

    ``compute_gradients``, ``get_slot`` and ``get_slot_names`` are the wrapped
    optimizer's (a loss-scale optimizer scales in ``compute_gradients``);
    ``variables()`` adds the wrapper's own state (``_own_variables``) to the
    wrapped optimizer's. Subclasses write ``apply_gradients``.

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
        """Returns the wrapped optimizer's slot ``name`` of ``var``, exactly as it would.

        A wrapper's own state is never a slot here, so that no name of the
        wrapped optimizer is shadowed (Adadelta and Ftrl call theirs
        ``"accum"``); subclasses expose their state through properties.

        Args:
          var: a variable this optimizer trains.
          name: a slot name of the wrapped optimizer (for Adam ``"m"`` and ``"v"``).

        Returns:
          The slot variable, or ``None``.

        Example:
          >>> opt.get_slot(kernel, "m")  # Adam's first moment
        """
        return self._optimizer.get_slot(var, name)

    def get_slot_names(self):
        """Returns the wrapped optimizer's slot names, exactly as it would.

        Returns:
          A list of strings.

        Example:
          >>> opt.get_slot_names()
          ['m', 'v']
        """
        return self._optimizer.get_slot_names()

    def variables(self):
        """Returns the wrapped optimizer's variables and the wrapper's own state.

        Both in the current default graph, sorted by name, as TF's
        ``Optimizer.variables()``. A wrapper without state (``AllReduceOnApply``,
        ``GradientAccumulator`` with k = 1 and nothing to count) returns
        exactly the wrapped optimizer's list.

        Returns:
          A list of variables sorted by name.

        Example:
          >>> saver = tf.compat.v1.train.Saver(opt.variables())
        """
        graph = tf.compat.v1.get_default_graph()
        own = [var for var in self._own_variables() if var.graph is graph]
        return sorted(list(self._optimizer.variables()) + own, key=lambda var: var.name)

    def _own_variables(self):
        """The wrapper's own state variables, in any graph (none here)."""
        return []
