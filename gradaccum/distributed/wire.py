"""The collective wire: what the collective engines send, and how.

:mod:`gradaccum.distributed.collective` and
:mod:`gradaccum.distributed.sharded` exchange tensors the same way, and
:mod:`~gradaccum.distributed.membership` and
:mod:`~gradaccum.distributed.consolidate` place a task in the same group.
This module is that shared part:

* the group: :data:`GROUP_KEY`, a task's ``(size, rank, leader)`` in it
  (:func:`group`) and the device its collectives run on (:func:`device`);
* instance keys: :func:`next_instance_key`, one process-wide counter (from
  1), so that every worker numbers the collectives it builds in the same
  order alike;
* packing: :func:`packed` flattens tensors into one buffer per dtype, split
  into near-equal pieces of at most ``buffer_bytes``, one exchange each;
* the form of a gradient on the wire: :func:`to_wire` and :func:`from_wire`
  (an ``IndexedSlices`` travels densified, with one touched flag per row);
* what can travel: :data:`BROADCAST_DTYPES` and :func:`check_static`.

It creates no variables and adds nothing to any collection; the ops it
builds are those its callers' exchanges build, in their name scopes.
"""
import itertools

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.window.gradients import densified, sparse_again

GROUP_KEY = 0x6761
"""The collective group key of the compute tasks (chief and workers)."""
DEFAULT_BUFFER_BYTES = 16 * 2 ** 20
"""The largest message the engines send by default (16 MiB)."""
BROADCAST_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64)
"""The dtypes a collective broadcast carries (and that ``broadcast_variables`` accepts)."""

_instance_keys = itertools.count(1)


def next_instance_key():
    """The next instance key of this process's collectives (1, 2, ...).

    Every worker builds the same collective ops in the same order, so the
    same op gets the same key on every worker. Window batch norm counts its
    keys apart (``gradaccum.devices.context.next_collective_key``, from
    ``1 << 24``).

    Returns:
      An int.

    Example:
      >>> collective_sum(piece, size, GROUP_KEY, next_instance_key(), None, device=device(config))
    """
    return next(_instance_keys)


def group(config):
    """``(size, rank, leader)`` of this task in the compute group (chief first).

    Args:
      config: a ``gradaccum.cluster.ClusterConfig`` of a chief or worker
        task, or None (one process).

    Returns:
      ``(size, rank, leader)``: the number of compute tasks, this task's
      index among them, and the leader's task name
      (``/job:<job>/replica:0/task:<i>``); ``(1, 0, None)`` for None.

    Raises:
      TypeError: when ``config`` is not a ``ClusterConfig`` or None.
      ValueError: for a ps or evaluator task's ``config``.

    Example:
      >>> size, rank, leader = group(config)
    """
    if config is None:
        return 1, 0, None
    me = (getattr(config, "task_type", None), getattr(config, "task_index", None))
    tasks = getattr(config, "compute_tasks", None)
    if tasks is None:
        raise TypeError("`config` must be a gradaccum.cluster.ClusterConfig or None, got %s"
                        % _validate.describe(config))
    if me not in tasks:
        raise ValueError("`config` must be a chief or worker task's (ps and evaluator tasks take no part in "
                         "collectives), got %s" % config.task_name)
    return len(tasks), tasks.index(me), "/job:%s/replica:0/task:%d" % tasks[0]


def device(config):
    """Where this task's collectives run: its CPU (TF 1.15 needs every collective placed).

    Args:
      config: a ``gradaccum.cluster.ClusterConfig`` of a chief or worker task.

    Returns:
      A device string, ``/job:<type>/replica:0/task:<index>/device:CPU:0``.

    Example:
      >>> with tf.device(device(config)):
      ...     one = collective_sum(tf.ones([1]), size, GROUP_KEY, next_instance_key(), None)
    """
    return "/job:%s/replica:0/task:%d/device:CPU:0" % (config.task_type, config.task_index)


def _split_sizes(count, itemsize, buffer_bytes):
    pieces = max(1, -(-count * itemsize // buffer_bytes))
    return [count // pieces + (1 if i < count % pieces else 0) for i in range(pieces)]


def packed(tensors, buffer_bytes, exchange):
    """Flattens ``tensors`` into one buffer per dtype, exchanges each piece, unpacks.

    The buffers go in the order of each dtype's first tensor; a buffer of
    more than ``buffer_bytes`` is split into near-equal pieces. Every worker
    must pass tensors of the same dtypes and shapes in the same order.

    Args:
      tensors: list of tensors with fully defined shapes.
      buffer_bytes: int > 0, the largest piece in bytes.
      exchange: callable ``piece -> piece after communication`` (a 1-D
        tensor of the same dtype and size), called once per piece.

    Returns:
      ``(results, count)``: the exchanged tensors in order, with their
      shapes, and the number of exchanges.

    Example:
      >>> reduced, count = packed(flat, DEFAULT_BUFFER_BYTES, all_reduce)
    """
    by_dtype = {}
    for position, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype.base_dtype, []).append(position)
    results, count = [None] * len(tensors), 0
    for dtype, positions in sorted(by_dtype.items(), key=lambda item: item[1][0]):
        shapes = [tensors[p].shape for p in positions]
        sizes = [shape.num_elements() for shape in shapes]
        flat = tf.concat([tf.reshape(tensors[p], [-1]) for p in positions], 0) if len(positions) > 1 \
            else tf.reshape(tensors[positions[0]], [-1])
        split = _split_sizes(sum(sizes), dtype.size, buffer_bytes)
        pieces = tf.split(flat, split) if len(split) > 1 else [flat]
        done = [exchange(piece) for piece in pieces]
        count += len(done)
        whole = tf.concat(done, 0) if len(done) > 1 else done[0]
        parts = tf.split(whole, sizes) if len(sizes) > 1 else [whole]
        for position, part, shape in zip(positions, parts, shapes):
            results[position] = tf.reshape(part, shape)
    return results, count


def to_wire(sums_and_vars):
    """The tensors that carry ``sums_and_vars`` in an all-reduce, and how many carry each pair.

    A dense sum travels as it is (1 tensor); an ``IndexedSlices`` one
    densified to its variable's shape, with one touched flag per row (2), so
    that :func:`from_wire` makes it sparse again over the rows any worker
    touched.

    Args:
      sums_and_vars: list of ``(sum, variable)``; sums dense or ``IndexedSlices``.

    Returns:
      ``(tensors, widths)``: the flat list to exchange, and per pair the
      number of its tensors (1 or 2).

    Raises:
      ValueError: for a gradient or variable without a fully defined shape.

    Example:
      >>> flat, widths = to_wire(sums_and_vars)
    """
    flat, widths = [], []
    for grad, var in sums_and_vars:
        if isinstance(grad, tf.IndexedSlices):
            check_static(var, "variable %r" % var.op.name)
            flat.extend(densified(grad, var))
            widths.append(2)
        else:
            flat.append(check_static(tf.convert_to_tensor(grad), "the gradient of %r" % var.op.name))
            widths.append(1)
    return flat, widths


def from_wire(reduced, sums_and_vars, widths):
    """The ``(sum, variable)`` pairs again from their exchanged tensors (the first ``sum(widths)``).

    Args:
      reduced: the exchanged tensors, in :func:`to_wire`'s order (more may follow).
      sums_and_vars: the pairs given to :func:`to_wire`.
      widths: :func:`to_wire`'s widths.

    Returns:
      A list of ``(sum, variable)``: a sparse sum as an ``IndexedSlices`` of
      the rows any worker touched.

    Example:
      >>> summed = from_wire(reduced, sums_and_vars, widths)
    """
    out, position = [], 0
    for (_, var), width in zip(sums_and_vars, widths):
        part = reduced[position:position + width]
        out.append((part[0] if width == 1 else sparse_again(part[0], part[1], var), var))
        position += width
    return out


def check_static(tensor, what):
    """``tensor``, when its shape is fully defined: every worker must size its buffers alike.

    Args:
      tensor: a tensor or variable.
      what: how the error names it, e.g. ``"variable 'w'"``.

    Returns:
      ``tensor``.

    Raises:
      ValueError: for a shape that is not fully defined.

    Example:
      >>> check_static(var, "variable %r" % var.op.name)
    """
    if not tensor.shape.is_fully_defined():
        raise ValueError("collective reduction needs fully defined shapes: %s has shape %s" % (what, tensor.shape))
    return tensor
