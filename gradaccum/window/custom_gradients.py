"""A user's gradient function in place of TensorFlow's, for ``GradientAccumulator(gradients=...)``.

The function takes ``(loss, variables, grad_loss)`` and returns one gradient
per variable (``None`` allowed), for example a rewrite such as
``memory_saving_gradients.gradients``. It replaces the differentiation of the
innermost optimizer of the accumulator's chain, for the time of one
``compute_gradients`` call: every optimizer wrapped between the accumulator
and it (the collective engine's first-run sync, a loss-scale optimizer that
scales the loss and unscales the gradients around its inner optimizer's
``compute_gradients``) acts as it does without the function.

While the function runs, the innermost optimizer's own ``compute_gradients``
(called by the function, directly or through the accumulator) computes
TensorFlow's gradients: the function may start from them, it does not call
itself again. TensorFlow's ``gate_gradients``, ``aggregation_method`` and
``colocate_gradients_with_ops`` are passed on as ``tf.compat.v1.gradients``
takes them to a function that declares them (or ``**kwargs``); for one that
does not, only their defaults are accepted (``GATE_GRAPH`` too: the
function's gradients are then grouped, as TensorFlow groups its own), any
other value is refused. This module creates no variables and no collections.
"""
import contextlib
import inspect
import threading

from gradaccum import _validate
from gradaccum._compat import loss_scale_optimizer_types, tf
from gradaccum.window.wrapper import optimizer_chain


def check_function(gradients, optimizer):
    """Returns ``gradients`` (None or a callable) after checking it fits ``optimizer``'s chain.

    Args:
      gradients: ``None``, or a callable ``(loss, variables, grad_loss) -> list of gradients``.
      optimizer: the optimizer the accumulator wraps.

    Returns:
      ``gradients``.

    Raises:
      TypeError: when ``gradients`` is neither None nor callable.
      ValueError: when the innermost optimizer of the chain is a loss-scale
        optimizer (one whose inner optimizer is not followed, as TF 1.15's
        contrib one): the function would replace its scaling.

    Example:
      >>> check_function(lambda loss, variables, grad_loss: tf.gradients(loss, variables, grad_loss), opt)
    """
    if gradients is None:
        return None
    if not callable(gradients):
        raise TypeError("`gradients` must be None or a callable (loss, variables, grad_loss) -> list of "
                        "gradients, got %s" % _validate.describe(gradients))
    innermost = list(optimizer_chain(optimizer))[-1]
    if isinstance(innermost, loss_scale_optimizer_types()):
        raise ValueError("`gradients` %s would replace the loss scaling of %s, whose inner optimizer gradaccum "
                         "cannot reach: wrap the loss-scale optimizer around a plain optimizer "
                         "(tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer), or pass gradients=None"
                         % (_validate.describe(gradients), type(innermost).__name__))
    return gradients


_GATES = {0: "GATE_NONE", 1: "GATE_OP", 2: "GATE_GRAPH"}
# TensorFlow's arguments of compute_gradients, their defaults, and how tf.gradients takes them.
_TF_OPTIONS = (("gate_gradients", tf.compat.v1.train.Optimizer.GATE_OP, lambda gate: gate == 1),
               ("aggregation_method", None, lambda method: method),
               ("colocate_gradients_with_ops", False, bool))
_RUNNING = threading.local()  # .optimizers: id() of each optimizer whose function is running, in this thread.


def _running():
    if not hasattr(_RUNNING, "optimizers"):
        _RUNNING.optimizers = set()
    return _RUNNING.optimizers


@contextlib.contextmanager
def differentiating(optimizer, gradients):
    """Inside the block, the innermost optimizer of ``optimizer``'s chain differentiates with ``gradients``.

    While ``gradients`` runs, that optimizer's ``compute_gradients`` is its
    own again (TensorFlow's gradients), so that the function may call it.

    Args:
      optimizer: an optimizer (its chain is followed through ``optimizer`` / ``_optimizer``).
      gradients: ``None`` (the block changes nothing) or a checked function.

    Yields:
      None.

    Example:
      >>> with differentiating(acc.optimizer, acc.gradients):
      ...     pairs = acc.optimizer.compute_gradients(loss)
    """
    innermost = list(optimizer_chain(optimizer))[-1]
    if gradients is None or id(innermost) in _running():  # Inside the function: TensorFlow's gradients.
        yield
        return
    saved = vars(innermost).get("compute_gradients")
    own = innermost.compute_gradients  # Bound before the instance's attribute hides it.

    def compute_gradients(loss, var_list=None, gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
                          aggregation_method=None, colocate_gradients_with_ops=False, grad_loss=None):
        options = dict(gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                       colocate_gradients_with_ops=colocate_gradients_with_ops)
        if id(innermost) in _running():  # The function asks the optimizer for TensorFlow's gradients.
            return own(loss, var_list=var_list, grad_loss=grad_loss, **options)
        _running().add(id(innermost))
        try:
            return pairs(gradients, loss, var_list, grad_loss, **options)
        finally:
            _running().discard(id(innermost))
    innermost.compute_gradients = compute_gradients  # This instance only, for this call.
    try:
        yield
    finally:
        if saved is None:
            del innermost.compute_gradients
        else:
            innermost.compute_gradients = saved


def pairs(gradients, loss, var_list=None, grad_loss=None, gate_gradients=tf.compat.v1.train.Optimizer.GATE_OP,
          aggregation_method=None, colocate_gradients_with_ops=False):
    """``[(gradient, variable)]`` from the user's function, as ``compute_gradients`` returns them.

    Args:
      gradients: the user's function ``(loss, variables, grad_loss) -> list``.
      loss: a tensor, or a callable returning one.
      var_list: ``None`` (the trainable variables) or a (nested) list of variables.
      grad_loss: ``None``, or the gradient of ``loss`` (with the micro-batch
        weight folded in): passed as a float tensor of the loss's dtype and shape.
      gate_gradients: ``GATE_NONE``, ``GATE_OP`` or ``GATE_GRAPH``, as
        ``tf.compat.v1.train.Optimizer.compute_gradients`` takes it.
      aggregation_method: as ``compute_gradients`` takes it.
      colocate_gradients_with_ops: as ``compute_gradients`` takes it.

    Returns:
      The list of pairs, one per variable.

    Raises:
      ValueError: when the function returns no list of one gradient per
        variable; for a ``gate_gradients`` that is not one of the three; for
        a value other than the default of an argument the function does not
        declare.

    Example:
      >>> pairs(lambda loss, variables, grad_loss: tf.gradients(loss, variables, grad_loss), loss)
    """
    given = dict(gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                 colocate_gradients_with_ops=colocate_gradients_with_ops)
    options = passed_options(gradients, given)
    loss = tf.convert_to_tensor(loss() if callable(loss) else loss)
    if var_list is None:
        var_list = (tf.compat.v1.trainable_variables()
                    + tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_RESOURCE_VARIABLES))
    variables = tf.nest.flatten(var_list)
    if grad_loss is not None:
        grad_loss = tf.convert_to_tensor(grad_loss)
        if grad_loss.dtype.base_dtype != loss.dtype.base_dtype:
            grad_loss = tf.cast(grad_loss, loss.dtype.base_dtype)
        if grad_loss.shape != loss.shape:
            grad_loss = tf.broadcast_to(grad_loss, tf.shape(loss))
    grads = gradients(loss, variables, grad_loss, **options)
    if not isinstance(grads, (list, tuple)) or len(grads) != len(variables):
        raise ValueError("`gradients` must return a list of one gradient (or None) per variable, %d here, got %s"
                         % (len(variables), _validate.describe(grads)))
    if gate_gradients == tf.compat.v1.train.Optimizer.GATE_GRAPH:  # As TensorFlow's compute_gradients.
        grads = tf.tuple(list(grads))
    return list(zip(grads, variables))


def passed_options(gradients, given):
    """TensorFlow's keyword arguments that ``gradients`` receives, as ``tf.compat.v1.gradients`` takes them.

    Args:
      gradients: the user's function.
      given: ``{name: value}`` of ``gate_gradients``, ``aggregation_method``
        and ``colocate_gradients_with_ops`` as ``compute_gradients`` got them.

    Returns:
      ``{name: value}`` of those the function declares (all, with ``**kwargs``);
      ``gate_gradients`` as a bool (True for ``GATE_OP``).

    Raises:
      ValueError: for a ``gate_gradients`` that is not ``GATE_NONE``,
        ``GATE_OP`` or ``GATE_GRAPH``; for an argument the function does not
        declare whose value is not its default (``GATE_GRAPH`` is accepted:
        the gradients are grouped after the function).

    Example:
      >>> passed_options(lambda loss, variables, grad_loss, **kwargs: ..., dict(gate_gradients=1))
      {'gate_gradients': True}
    """
    gate = given.get("gate_gradients", tf.compat.v1.train.Optimizer.GATE_OP)
    if gate not in _GATES:
        raise ValueError("`gate_gradients` must be Optimizer.GATE_NONE, GATE_OP or GATE_GRAPH (0, 1 or 2), got %s"
                         % _validate.describe(gate))
    declared = _declared(gradients)
    options = {}
    for name, default, as_tf_takes_it in _TF_OPTIONS:
        value = given.get(name, default)
        if name in declared:
            options[name] = as_tf_takes_it(value)
        elif as_tf_takes_it(value) != as_tf_takes_it(default) and not (name == "gate_gradients" and value == 2):
            shown = "Optimizer.%s" % _GATES[value] if name == "gate_gradients" else repr(value)
            raise ValueError(
                "`gradients` %s takes no `%s`, and %s=%s is not the default it is called with: declare a "
                "parameter `%s` (or **kwargs) to receive it as tf.compat.v1.gradients takes it, or leave %s out"
                % (_validate.describe(gradients), name, name, shown, name, name))
    return options


def _declared(function):
    """The names of TensorFlow's arguments that ``function`` takes by keyword."""
    names = set(name for name, _, _ in _TF_OPTIONS)
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # A callable without a signature Python can read: it declares none.
        return set()
    if any(parameter.kind == parameter.VAR_KEYWORD for parameter in parameters):
        return names
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return set(parameter.name for parameter in parameters if parameter.kind in keyword) & names
