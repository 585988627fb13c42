"""The inputs of ``gradaccum.tower.minimize``: one batch per tower.

``inputs`` is either one batch (a tensor, a ``tf.SparseTensor``, or a list
or tuple of them sharing a leading dimension), split here along axis 0 into
one shard per tower, or a callable that each tower calls for its own batch
(an iterator's ``get_next``). Either way :func:`tower_batches` returns each
tower's list of inputs and its example count, the tower's weight.

What is not known when the graph is built is checked when it runs: the
shards wait for those checks, so a failing one stops the run before any
model op or update. Variables: none. Collections: none.
"""
import collections

from gradaccum import _validate
from gradaccum._compat import tf

Batches = collections.namedtuple("Batches", ["batch_size", "sizes", "shards"])
Batches.__doc__ = """Each tower's inputs.

Attributes:
  batch_size: the examples of all towers: a Python int, or a scalar int32 tensor.
  sizes: one example count per tower, Python ints or scalar int32 tensors.
  shards: one list of inputs per tower, in the order ``inputs`` gave them.
"""


def tower_batches(inputs, count, every_tower):
    """Each tower's inputs: ``inputs`` split, or ``inputs()`` called once per tower.

    Args:
      inputs: ``tower.minimize``'s ``inputs``.
      count: the number of towers.
      every_tower: whether every tower needs an example (``update_ops="all"``);
        otherwise only the first does, the others may have none.

    Returns:
      A :class:`Batches`.

    Raises:
      TypeError: for inputs that are not tensors or sparse tensors.
      ValueError: for no inputs, a scalar, mismatched static leading
        dimensions, or too few examples known statically.

    Example:
      >>> batches = tower_batches([images, labels], 2, every_tower=False)
    """
    if callable(inputs) and not isinstance(inputs, type):  # A class is a value, not a source.
        return _called(inputs, count, every_tower)
    tensors = check_inputs(inputs, "inputs")
    return _split(tensors, count, count if every_tower else 1)


def _called(inputs, count, every_tower):
    """Calls ``inputs`` once per tower; each tower weighs its own example count."""
    batches = []
    for index in range(count):
        # In tower order: tower i's batch is pulled after tower i-1's, so that
        # the outputs, concatenated in tower order, are in the source's order.
        after = [_component(tensor) for tensor in batches[-1]] if batches else []
        with tf.compat.v1.name_scope("inputs_%d" % index), tf.control_dependencies(after):
            batches.append(check_inputs(inputs(), "inputs()"))
        if len(batches[index]) != len(batches[0]):
            raise ValueError("`inputs()` must return the same number of inputs for every tower, got %d for "
                             "tower 0 and %d for tower %d" % (len(batches[0]), len(batches[index]), index))
    sizes = [batch_size(batch) for batch in batches]
    needy = range(count) if every_tower else [0]
    for index in needy:
        if isinstance(sizes[index], int) and sizes[index] < 1:
            raise ValueError("%s, got none for tower %d" % (_too_few_called(every_tower), index))
    with tf.compat.v1.name_scope("batch_size"):
        checks = [tf.compat.v1.assert_greater_equal(sizes[index], 1, message=_too_few_called(every_tower) + ":",
                                                    name="enough_examples_%d" % index)
                  for index in needy if not isinstance(sizes[index], int)]
        total = sum(sizes) if all(isinstance(size, int) for size in sizes) else tf.add_n(
            [tf.convert_to_tensor(size, tf.int32) for size in sizes])
    shards = [checked(batch, size, checks) for batch, size in zip(batches, sizes)]
    return Batches(total, sizes, shards)


def _component(tensor):
    return tensor.values if isinstance(tensor, tf.SparseTensor) else tensor


def _too_few_called(every_tower):
    if every_tower:
        return ("`inputs()` must give every tower at least one example with update_ops='all' (an empty "
                "tower's batch statistics are NaN and would be written into the moving averages)")
    return "`inputs()` must give the first tower at least one example"


def batch_size(batch):
    """The leading dimension shared by ``batch``: a Python int when static, else a scalar int32 tensor.

    Args:
      batch: a list of tensors and ``tf.SparseTensor`` (from :func:`check_inputs`).

    Returns:
      An int or a scalar int32 tensor.

    Example:
      >>> n = batch_size([images, labels])
    """
    for tensor in batch:
        if static_leading(tensor) is not None:
            return static_leading(tensor)
    return leading(batch[0])


def check_inputs(inputs, arg):
    """Converts ``inputs`` to a list of tensors and sparse tensors that share a leading dimension.

    Args:
      inputs: a tensor (or ``tf.SparseTensor``), or a list or tuple of them.
      arg: the argument's name, for the messages.

    Returns:
      A non-empty list of tensors and sparse tensors.

    Raises:
      TypeError: for an item that is no tensor.
      ValueError: for no item, a scalar, or different static leading dimensions.

    Example:
      >>> tensors = check_inputs([images, labels], "inputs")
    """
    items = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if not items:
        raise ValueError("`%s` must be a tensor or a non-empty list of tensors, got %s"
                         % (arg, _validate.describe(inputs)))
    tensors = []
    for item in items:
        try:
            tensor = tf.compat.v1.convert_to_tensor_or_sparse_tensor(item)
        except (TypeError, ValueError):
            raise TypeError("`%s` must be tensors, got %s"
                            % (arg, _validate.describe(item))) from None
        if tensor.shape.ndims == 0:
            raise ValueError("`%s` must have a leading (batch) dimension, got the scalar %s"
                             % (arg, _validate.describe(item)))
        tensors.append(tensor)
    sizes = [static_leading(t) for t in tensors]
    if len(set(size for size in sizes if size is not None)) > 1:
        raise ValueError("`%s` must have the same leading (batch) dimension, got %s for %s"
                         % (arg, sizes, _validate.describe(tensors)))
    return tensors


def static_leading(tensor):
    """The static leading dimension of a tensor or ``tf.SparseTensor``, or None.

    Args:
      tensor: a tensor or a ``tf.SparseTensor``.

    Returns:
      A Python int, or None.

    Example:
      >>> static_leading(tf.zeros([4, 3]))
      4
    """
    return tf.compat.dimension_value(tensor.shape[0]) if tensor.shape.ndims else None


def leading(tensor):
    """The leading dimension of a tensor or ``tf.SparseTensor``, as a scalar int32 tensor.

    Args:
      tensor: a tensor or a ``tf.SparseTensor``.

    Returns:
      A scalar int32 tensor.

    Example:
      >>> batch_size = leading(labels)
    """
    if isinstance(tensor, tf.SparseTensor):
        return tf.cast(tensor.dense_shape[0], tf.int32)
    return tf.shape(tensor)[0]


def _split(tensors, count, min_batch):
    """Splits each tensor into ``count`` shards whose sizes differ by at most one."""
    static = [static_leading(t) for t in tensors if static_leading(t) is not None]
    if static:
        batch_size = static[0]
        if batch_size < min_batch:
            raise ValueError("%s, got a batch of %d" % (_too_small(min_batch), batch_size))
        # The first towers take the remainder, so tower 0 is never empty.
        sizes = [part(batch_size, count, i)[1] for i in range(count)]
        split_sizes = sizes
    else:
        batch_size = tf.identity(leading(tensors[0]), name="batch_size")
        bonus = tf.cast(tf.range(count) < batch_size % count, tf.int32)
        split_sizes = tf.add(batch_size // count, bonus, name="shard_sizes")
        sizes = tf.unstack(split_sizes, num=count)
    checks = []
    if not isinstance(batch_size, int):
        checks.append(tf.compat.v1.assert_greater_equal(
            batch_size, min_batch, message=_too_small(min_batch) + ":", name="enough_examples"))
    tensors = checked(tensors, batch_size, checks)
    per_input = [_split_one(t, split_sizes, sizes, count) for t in tensors]
    return Batches(batch_size, sizes, [list(shards) for shards in zip(*per_input)])


def part(n, parts, index):
    """``(start, size)`` of part ``index`` of ``n`` examples cut into ``parts`` that differ by at most one.

    The first ``n % parts`` parts take one example more, so part 0 is empty
    only when ``n`` is. Python ints give ints; a tensor ``n`` or ``index``
    gives int32 scalar tensors.

    Args:
      n: the number of examples, an int or an int32 scalar tensor.
      parts: the number of parts, an int or an int32 scalar tensor.
      index: the part's index, an int or an int32 scalar tensor.

    Returns:
      ``(start, size)``.

    Example:
      >>> [part(23, 4, i) for i in range(4)]
      [(0, 6), (6, 6), (12, 6), (18, 5)]
    """
    base, extra = n // parts, n % parts
    if all(isinstance(value, int) for value in (n, parts, index)):
        return index * base + min(index, extra), base + (1 if index < extra else 0)
    return index * base + tf.minimum(index, extra), base + tf.cast(index < extra, tf.int32)


def _split_one(tensor, split_sizes, sizes, count):
    if not isinstance(tensor, tf.SparseTensor):
        return tf.split(tensor, split_sizes, axis=0, num=count, name="split")
    with tf.compat.v1.name_scope("split_sparse"):
        shards, start = [], 0
        for size in sizes:
            shards.append(rows(tensor, start, size))
            start = start + size
        return shards


def rows(tensor, start, size):
    """Rows ``[start, start + size)`` of a tensor or ``tf.SparseTensor`` (renumbered from 0).

    Args:
      tensor: a tensor or a ``tf.SparseTensor`` with a leading (batch) dimension.
      start: the first row, an int or an integer scalar tensor.
      size: the number of rows, an int or an integer scalar tensor.

    Returns:
      The rows, of ``tensor``'s kind.

    Example:
      >>> micro_batch = rows(images, 6, 6)
    """
    if not isinstance(tensor, tf.SparseTensor):
        return tensor[start:start + size]
    rest = tensor.dense_shape[1:]
    start, size = tf.cast(start, tf.int64), tf.cast(size, tf.int64)
    return tf.sparse.slice(tensor, tf.concat([[start], tf.zeros_like(rest)], 0), tf.concat([[size], rest], 0))


def _too_small(min_batch):
    if min_batch == 1:
        return "`inputs` must hold at least one example"
    return ("`inputs` must hold at least %d examples, one per tower, with update_ops='all' (an empty "
            "tower's batch statistics are NaN and would be written into the moving averages)" % min_batch)


def checked(tensors, batch_size, checks):
    """Makes ``tensors`` wait for ``checks`` and for run-time checks of their leading dimensions.

    Args:
      tensors: from :func:`check_inputs`.
      batch_size: the leading dimension they must share (a scalar tensor or int).
      checks: more ops to wait for.

    Returns:
      The tensors, each an identity that runs after the checks.

    Example:
      >>> tensors = checked(tensors, tf.shape(tensors[0])[0], [enough])
    """
    checks = list(checks)
    if len(tensors) > 1:
        checks.extend(tf.compat.v1.assert_equal(
            leading(tensor), batch_size, name="same_batch_%d" % index,
            message="`inputs` must have the same leading (batch) dimension; input %d differs:" % index)
            for index, tensor in enumerate(tensors) if static_leading(tensor) is None)
    if not checks:
        return tensors
    with tf.control_dependencies(checks):
        return [identity(tensor) for tensor in tensors]


def identity(tensor):
    """``tf.identity`` of a tensor or of each component of a ``tf.SparseTensor``.

    Args:
      tensor: a tensor or a ``tf.SparseTensor``.

    Returns:
      Its identity, of the same kind.

    Example:
      >>> labels = identity(labels)
    """
    if isinstance(tensor, tf.SparseTensor):
        return tf.SparseTensor(tf.identity(tensor.indices), tf.identity(tensor.values),
                               tf.identity(tensor.dense_shape))
    return tf.identity(tensor)
