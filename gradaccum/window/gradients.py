"""Gradient arithmetic shared by the window, the collective engine and the towers.

One weighting, one normalisation of a weighted sum, one encoding of the rows
a sparse (``IndexedSlices``) gradient touched, and one finiteness test. This
module creates no variables and adds nothing to any collection.
"""
from gradaccum._compat import tf


def weighted(values, weight):
    """``values * weight`` in ``values``' dtype (``IndexedSlices`` stay sparse); ``values`` for None.

    Args:
      values: a gradient, a ``tf.Tensor`` or ``tf.IndexedSlices``.
      weight: None, or a scalar (any real dtype; cast to the values').

    Returns:
      The weighted gradient, of the same kind as ``values``.

    Example:
      >>> weighted(grad, tf.shape(x)[0])
    """
    if weight is None:
        return values
    if isinstance(values, tf.IndexedSlices):
        return tf.IndexedSlices(weighted(values.values, weight), values.indices, values.dense_shape)
    return values * tf.cast(weight, values.dtype.base_dtype)


def normalized(sums_and_vars, total):
    """``sum / total`` in each variable's dtype (``total`` None: just the cast).

    The one division of a window (and of a collective step): the weighted
    mean is the weighted sum over the summed weight, computed in the sum's
    dtype and cast to the variable's once.

    Args:
      sums_and_vars: ``(sum, variable)`` pairs; sums dense or ``IndexedSlices``.
      total: ``None`` or a scalar tensor, the summed weight.

    Returns:
      ``(mean, variable)`` pairs of the same kinds.

    Example:
      >>> averaged = normalized(sums, weight_sum)
    """
    averaged = []
    for grad, var in sums_and_vars:
        values = grad.values if isinstance(grad, tf.IndexedSlices) else grad
        if total is not None:
            values = values / tf.cast(total, values.dtype.base_dtype)
        values = tf.cast(values, var.dtype.base_dtype)
        if isinstance(grad, tf.IndexedSlices):
            values = tf.IndexedSlices(values, grad.indices, dense_shape=grad.dense_shape)
        averaged.append((values, var))
    return averaged


def touched_rows(flags):
    """The int64 indices of the rows whose flag is set (> 0).

    Args:
      flags: a vector, one flag per row of a variable.

    Returns:
      An int64 vector.

    Example:
      >>> index = touched_rows(touched.read_value())
    """
    return tf.reshape(tf.where(flags > 0), [-1])


def densified(grad, var):
    """An ``IndexedSlices`` as ``(dense sum over its rows, one touched flag per row)``.

    Args:
      grad: an ``IndexedSlices`` gradient of ``var``.
      var: the variable, with a fully defined first dimension.

    Returns:
      ``(dense, flags)``: a tensor of ``var``'s shape, and a vector of 0/1.

    Example:
      >>> dense, flags = densified(grad, embeddings)
    """
    rows = var.shape.as_list()[0]
    values = grad.values
    dense = tf.math.unsorted_segment_sum(values, grad.indices, rows)
    ones = tf.ones_like(grad.indices, dtype=values.dtype.base_dtype)
    flags = tf.minimum(tf.math.unsorted_segment_sum(ones, grad.indices, rows), 1)
    return dense, flags


def sparse_again(dense, flags, var, index=None):
    """The rows of ``dense`` whose flag is set, as an ``IndexedSlices`` of ``var``.

    Args:
      dense: a tensor of ``var``'s shape (or a variable holding it).
      flags: one flag per row.
      var: the variable the gradient is for (its shape is the dense shape).
      index: ``None``, or the touched rows already computed.

    Returns:
      A ``tf.IndexedSlices`` over exactly the touched rows.

    Example:
      >>> grad = sparse_again(dense, flags, embeddings)
    """
    index = touched_rows(flags) if index is None else index
    return tf.IndexedSlices(tf.gather(dense, index), index, dense_shape=tf.shape(var, out_type=tf.int64))


def values_of(grad):
    """The dense values of a gradient: the tensor, or an ``IndexedSlices``' rows."""
    return grad.values if isinstance(grad, tf.IndexedSlices) else grad


def all_finite(grads_and_vars):
    """bool scalar: every value of every gradient is finite.

    Args:
      grads_and_vars: ``(gradient, variable)`` pairs, no ``None`` gradient.

    Returns:
      A bool scalar tensor.

    Example:
      >>> finite = all_finite(averaged)
    """
    values = [values_of(g) for g, _ in grads_and_vars]
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]), name="all_finite")
