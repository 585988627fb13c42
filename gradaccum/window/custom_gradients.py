"""A user's gradient function in place of TensorFlow's, for ``GradientAccumulator(gradients=...)``.

The function takes ``(loss, variables, grad_loss)`` and returns one gradient
per variable (``None`` allowed), for example a rewrite such as
``memory_saving_gradients.gradients``. It replaces the differentiation of the
innermost optimizer of the accumulator's chain, for the time of one
``compute_gradients`` call: every optimizer wrapped between the accumulator
and it (the collective engine's first-run sync, a loss-scale optimizer that
scales the loss and unscales the gradients around its inner optimizer's
``compute_gradients``) acts as it does without the function. This module
creates no variables and no collections.
"""
import contextlib

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


@contextlib.contextmanager
def differentiating(optimizer, gradients):
    """Inside the block, the innermost optimizer of ``optimizer``'s chain differentiates with ``gradients``.

    Args:
      optimizer: an optimizer (its chain is followed through ``optimizer`` / ``_optimizer``).
      gradients: ``None`` (the block changes nothing) or a checked function.

    Yields:
      None.

    Example:
      >>> with differentiating(acc.optimizer, acc.gradients):
      ...     pairs = acc.optimizer.compute_gradients(loss)
    """
    if gradients is None:
        yield
        return
    innermost = list(optimizer_chain(optimizer))[-1]
    own = vars(innermost)
    saved = own.get("compute_gradients")

    def compute_gradients(loss, var_list=None, gate_gradients=None, aggregation_method=None,
                          colocate_gradients_with_ops=False, grad_loss=None):
        return pairs(gradients, loss, var_list, grad_loss)
    innermost.compute_gradients = compute_gradients  # This instance only, for this call.
    try:
        yield
    finally:
        if saved is None:
            del innermost.compute_gradients
        else:
            innermost.compute_gradients = saved


def pairs(gradients, loss, var_list=None, grad_loss=None):
    """``[(gradient, variable)]`` from the user's function, as ``compute_gradients`` returns them.

    Args:
      gradients: the user's function ``(loss, variables, grad_loss) -> list``.
      loss: a tensor, or a callable returning one.
      var_list: ``None`` (the trainable variables) or a (nested) list of variables.
      grad_loss: ``None``, or the gradient of ``loss`` (with the micro-batch
        weight folded in): passed as a float tensor of the loss's dtype and shape.

    Returns:
      The list of pairs, one per variable.

    Raises:
      ValueError: when the function returns no list of one gradient per variable.

    Example:
      >>> pairs(lambda loss, variables, grad_loss: tf.gradients(loss, variables, grad_loss), loss)
    """
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
    grads = gradients(loss, variables, grad_loss)
    if not isinstance(grads, (list, tuple)) or len(grads) != len(variables):
        raise ValueError("`gradients` must return a list of one gradient (or None) per variable, %d here, got %s"
                         % (len(variables), _validate.describe(grads)))
    return list(zip(grads, variables))
