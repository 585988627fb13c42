"""A model function, as both forms call it: its result, its loss, its towers' scopes.

:func:`gradaccum.tower.minimize` and :func:`gradaccum.subdivisions.minimize`
take the same ``model_fn``: called with one shard (or micro-batch) per
input, it returns the mean loss over it, or a :class:`ModelResult` that
carries the loss with a weight and per-example outputs. Tower ``i`` is built
under ``name_scope("<name>_<i>")`` (one run per update: ``tower_<i>``), on
its device, reusing tower 0's variables. This module creates no variables
and no collections.
"""
import collections
import contextlib
import warnings

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.window.update_ops import user_stacklevel


class ModelResult(collections.namedtuple("ModelResult", ["loss", "weight", "outputs"])):
    """What a model function may return, in both forms: its loss, a weight and per-example outputs.

    Attributes:
      loss: scalar float tensor, the mean loss over the shard or micro-batch.
      weight: ``None`` (the example count) or a scalar tensor: how much this
        shard counts in the whole batch's mean (for example its number of
        unmasked tokens).
      outputs: ``None``, or a tensor or nested structure of tensors with a
        leading (batch) dimension; they come back concatenated in batch order.

    Example:
      >>> def model_fn(images, labels):
      ...     logits = tf.compat.v1.layers.dense(images, 10)
      ...     loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
      ...     return gradaccum.ModelResult(loss, outputs=tf.argmax(logits, 1))
    """

    def __new__(cls, loss, weight=None, outputs=None):
        return super(ModelResult, cls).__new__(cls, loss, weight, outputs)


_PAIR = {"weight": "(loss, weight)", "outputs": "(loss, outputs)"}


def read_result(returned, pair_means, index, warn=True):
    """``model_fn``'s result as a :class:`ModelResult`, its loss checked.

    A plain loss tensor is ``ModelResult(loss)``. A pair is deprecated
    (``tower.minimize`` read it as ``(loss, outputs)``, the one-run form as
    ``(loss, weight)``): it still means that, with a ``FutureWarning``.

    Args:
      returned: what ``model_fn`` returned.
      pair_means: ``"outputs"`` or ``"weight"``: what a pair's second item is.
      index: the tower's index, for the messages.
      warn: whether a pair warns (once per build: the first tower's first call).

    Returns:
      A :class:`ModelResult` whose ``loss`` passed :func:`check_loss`.

    Raises:
      TypeError, ValueError: from :func:`check_loss`, or a weight that is no scalar.

    Example:
      >>> result = read_result(model_fn(*shard), "outputs", 0)
    """
    if isinstance(returned, (list, tuple)) and not isinstance(returned, ModelResult) and len(returned) == 2 \
            and isinstance(returned[0], tf.Tensor):
        if warn:
            warnings.warn("`model_fn` returned a pair, read as %s here; the two forms read a pair differently, so "
                          "return gradaccum.ModelResult(loss, %s=...) instead (a pair is deprecated)"
                          % (_PAIR[pair_means], pair_means), FutureWarning, stacklevel=user_stacklevel())
        returned = ModelResult(returned[0], **{pair_means: returned[1]})
    if not isinstance(returned, ModelResult):
        returned = ModelResult(returned)
    check_loss(returned.loss, index)
    weight = _validate.check_scalar_tensor(returned.weight, "weight", allow_none=True)
    return returned._replace(weight=weight)


def check_loss(loss, index):
    """Returns ``loss`` when it is a scalar float tensor; raises naming the tower otherwise.

    Args:
      loss: the loss ``model_fn`` returned.
      index: the tower's index.

    Returns:
      ``loss``.

    Raises:
      TypeError: for no tensor or no float dtype.
      ValueError: for a non-scalar loss: the towers and micro-batches are
        averaged weighted by their example counts, so only a mean over the
        shard gives the full batch's update.

    Example:
      >>> check_loss(tf.reduce_mean(losses), 0)
    """
    if not isinstance(loss, tf.Tensor):
        raise TypeError("`model_fn` must return a scalar loss tensor, got %s in tower %d"
                        % (_validate.describe(loss), index))
    if not loss.dtype.base_dtype.is_floating:
        raise TypeError("`model_fn` must return a floating-point loss, got dtype %s in tower %d (%s)"
                        % (loss.dtype.base_dtype.name, index, _validate.describe(loss)))
    if loss.shape.ndims != 0:
        raise ValueError("`model_fn` must return a scalar loss (the mean over its shard), got shape %s "
                         "in tower %d: reduce it with tf.reduce_mean. TF's minimize would differentiate "
                         "the sum, but the towers are averaged weighted by shard size, so only a mean "
                         "over the shard gives the full-batch update" % (loss.shape, index))
    return loss


def check_model_fn(model_fn):
    """Raises ``TypeError`` unless ``model_fn`` is callable."""
    if not callable(model_fn):
        raise TypeError("`model_fn` must be callable, got %s" % _validate.describe(model_fn))


@contextlib.contextmanager
def tower_scope(scope, device, reuse, variable_scope=None):
    """The scopes a tower is built in: its name scope, its device, and (after the first) variable reuse.

    Args:
      scope: the tower's name scope (a string; one ending in "/" is re-entered as is).
      device: a device string or function, or ``None``.
      reuse: ``None`` for the tower that creates the variables, ``True`` for the others.
      variable_scope: the variable scope to reuse in (the caller's by default).

    Yields:
      The name scope's string.

    Example:
      >>> with tower_scope("tower_1", device_function("/gpu:1", "/cpu:0"), True):
      ...     loss = model_fn(*shard)
    """
    variable_scope = variable_scope or tf.compat.v1.get_variable_scope()
    with tf.compat.v1.variable_scope(variable_scope, reuse=reuse, auxiliary_name_scope=False), \
            tf.compat.v1.device(device), tf.compat.v1.name_scope(scope) as name:
        yield name


def checked_var_list(var_list):
    """Checks a form's ``var_list``: ``None``, a list of variables, or a callable returning one.

    A callable is called once the first tower's model exists, so that it can
    name variables that ``model_fn`` creates (GPT-2's "only the transformer
    layers").

    Args:
      var_list: the argument as given.

    Returns:
      ``var_list``, checked (a callable as given).

    Raises:
      TypeError: for anything else.

    Example:
      >>> checked_var_list(lambda: [v for v in tf.compat.v1.trainable_variables() if "/h" in v.name])
    """
    return var_list if callable(var_list) else _validate.check_var_list(var_list)


def resolved_var_list(var_list):
    """``var_list`` (from :func:`checked_var_list`) as ``None`` or a list of variables: a callable is called."""
    return _validate.check_var_list(var_list()) if callable(var_list) else var_list


def check_outputs(outputs, index):
    """The flat list of ``outputs`` (none when ``None``); each must have a batch dimension.

    Args:
      outputs: ``ModelResult.outputs``.
      index: the tower's index, for the message.

    Returns:
      A list of tensors.

    Raises:
      TypeError: for an output that is no tensor with a leading dimension.

    Example:
      >>> flat = check_outputs({"logits": logits}, 0)
    """
    if outputs is None:
        return []
    flat = tf.nest.flatten(outputs)
    for output in flat:
        if not isinstance(output, tf.Tensor) or not output.shape.ndims:
            raise TypeError("`model_fn` must return a loss or ModelResult(loss, outputs=...), outputs a tensor or "
                            "a nested structure of tensors with a leading (batch) dimension, got %s in tower %d"
                            % (_validate.describe(output), index))
    return flat
