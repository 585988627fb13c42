"""Elastic membership: the same examples per update on any number of workers, and resuming on another P.

Update ``u`` of a job whose global batch is ``B`` reads examples
``[u*B, (u+1)*B)`` of one endless stream: the data set's examples in a
seeded shuffled order, a new order each epoch. Those ``B`` examples are split
into ``P * k`` micro-batches of nearly equal sizes (the sizes differ by one
at most; the bigger ones first), and worker ``r`` of ``P`` takes micro-batches
``r*k`` to ``r*k + k - 1``. ``k`` is the fewest micro-batches per worker that
keeps each at or below the micro-batch size. Nothing is dropped or padded:
each micro-batch goes to the accumulator with ``weight=`` its size, so every
update is the mean over the same ``B`` examples whatever ``P`` is, and a job
resumed on another number of workers trains the same updates.

:class:`Membership` ties this to a job. It creates one variable,
``gradaccum_membership/num_workers`` (int64, a non-trainable global variable,
so in every checkpoint), which records the P that wrote a checkpoint, and
:meth:`Membership.restore` resumes from the newest checkpoint of either
layout: the collective engine's ordinary checkpoint (every worker that can
read it restores it, the others initialise, then ``broadcast_variables`` as
always) or ``ShardedAllReduce``'s shards,
consolidated first when they were written by another P. A checkpoint saved in
the middle of a window resumes only on the P that wrote it, and only when
every worker saved its own partial sums (shards, or one process): each
worker's partial sums belong to its own micro-batches.

This module creates no collections.
"""
import functools
import math
import os

import numpy as np

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.distributed import consolidate, layout, wire

_SCOPE = "gradaccum_membership"


def micro_batches_per_worker(global_batch, micro_batch_size, num_workers):
    """The window size k that keeps the global batch at ``global_batch`` on ``num_workers`` workers.

    ``k = ceil(global_batch / (num_workers * micro_batch_size))``: the fewest
    micro-batches per worker with none above ``micro_batch_size``.

    Args:
      global_batch: examples per update, an int >= ``num_workers``.
      micro_batch_size: the most examples in one micro-batch, an int >= 1.
      num_workers: the number of workers P, an int >= 1.

    Returns:
      k, an int >= 1.

    Raises:
      ValueError: for a value that is not an int >= 1, or a
        ``global_batch`` smaller than ``num_workers``.

    Example:
      >>> micro_batches_per_worker(10, 2, 3), micro_batches_per_worker(10, 2, 2)
      (2, 3)
    """
    global_batch = _validate.check_positive_int(global_batch, "global_batch")
    micro_batch_size = _validate.check_positive_int(micro_batch_size, "micro_batch_size")
    num_workers = _validate.check_positive_int(num_workers, "num_workers")
    if global_batch < num_workers:
        raise ValueError("`global_batch` must be at least the number of workers (%d), got %s"
                         % (num_workers, _validate.describe(global_batch)))
    return int(math.ceil(global_batch / float(num_workers * micro_batch_size)))


@functools.lru_cache(maxsize=2)  # An update straddles at most two epochs while B <= N.
def _epoch_order(num_examples, seed, epoch):
    if seed is None:
        return np.arange(num_examples, dtype=np.int64)
    return np.random.RandomState([seed, epoch]).permutation(num_examples).astype(np.int64)


def update_examples(update, global_batch, num_examples, seed=0):
    """The indices of the examples that update ``update`` averages, whatever the number of workers.

    Positions ``[update*global_batch, (update+1)*global_batch)`` of the
    stream of epochs, each epoch a permutation of ``range(num_examples)``
    drawn from ``(seed, epoch)``; an update may straddle two epochs.

    Args:
      update: the update's index (its global step), an int >= 0.
      global_batch: examples per update, an int >= 1.
      num_examples: the size of the data set, an int >= 1.
      seed: an int, or None for the data set's own order every epoch.

    Returns:
      An int64 NumPy array of ``global_batch`` indices.

    Raises:
      ValueError: for a bad ``update``, ``global_batch`` or ``num_examples``.
      TypeError: for a ``seed`` that is neither None nor an int.

    Example:
      >>> update_examples(0, 4, 10, seed=None)
      array([0, 1, 2, 3])
    """
    if isinstance(update, bool) or not isinstance(update, (int, np.integer)) or update < 0:
        raise ValueError("`update` must be an int >= 0, got %s" % _validate.describe(update))
    global_batch = _validate.check_positive_int(global_batch, "global_batch")
    num_examples = _validate.check_positive_int(num_examples, "num_examples")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError("`seed` must be None or an int, got %s" % _validate.describe(seed))
    positions = int(update) * global_batch + np.arange(global_batch, dtype=np.int64)
    epochs, within = np.divmod(positions, num_examples)
    out = np.empty(global_batch, np.int64)
    for epoch in np.unique(epochs):
        mask = epochs == epoch
        out[mask] = _epoch_order(num_examples, seed, int(epoch))[within[mask]]
    return out


def assign_examples(update, global_batch, micro_batch_size, num_workers, rank, num_examples, seed=0):
    """Worker ``rank``'s k micro-batches of update ``update``: index arrays, uneven, never padded.

    The update's examples (:func:`update_examples`) are split into
    ``num_workers * k`` nearly equal parts (:func:`micro_batches_per_worker`);
    this worker's are parts ``rank*k`` to ``rank*k + k - 1``. A part is empty
    when ``global_batch`` is below ``num_workers * k``: feed it with weight 0
    (a loss that is a mean must then not divide by zero).

    Args:
      update: the update's index, an int >= 0.
      global_batch: examples per update B, an int >= ``num_workers``.
      micro_batch_size: the most examples per micro-batch, an int >= 1.
      num_workers: P, an int >= 1.
      rank: this worker's rank in ``[0, num_workers)``.
      num_examples: the size of the data set.
      seed: as in :func:`update_examples`.

    Returns:
      A list of k int64 arrays; pass ``weight=len(part)`` with each.

    Raises:
      ValueError: for a bad argument, such as ``global_batch`` < ``num_workers``.

    Example:
      >>> [len(p) for p in assign_examples(0, 10, 2, 3, 2, 24)]
      [1, 1]
    """
    k = micro_batches_per_worker(global_batch, micro_batch_size, num_workers)
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < num_workers:
        raise ValueError("`rank` must be an int in [0, %d), got %s" % (num_workers, _validate.describe(rank)))
    parts = np.array_split(update_examples(update, global_batch, num_examples, seed), num_workers * k)
    return parts[rank * k:(rank + 1) * k]


def _checkpoint_step(prefix):
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    return int(reader.get_tensor("global_step")) if reader.has_tensor("global_step") else -1


def newest_checkpoint(checkpoint_dir, num_workers=None):
    """The newest checkpoint in ``checkpoint_dir``, of either layout, and the P that wrote it.

    The ordinary layout is the collective engine's (``tf.train.latest_checkpoint``);
    the sharded one is ``ShardedAllReduce``'s ``shard-<r>-of-<P>/`` folders,
    which may hold several worker counts after a resize: the newest step that
    every shard of one count holds wins (on a tie, ``num_workers``'s).

    Args:
      checkpoint_dir: the job's checkpoint directory.
      num_workers: the P of the job about to resume (breaks ties), or None.

    Returns:
      ``(step, workers, prefixes)``: ``prefixes`` is one prefix (ordinary;
      ``workers`` as recorded by :class:`Membership`, None when not recorded)
      or the P shard prefixes in rank order; ``(None, None, [])`` when there
      is none.

    Raises:
      ValueError: when the shards of one count do not fit together.

    Example:
      >>> step, workers, prefixes = newest_checkpoint("/ckpt", 2)
    """
    found = []
    for count in sorted(set(count for _, count, _ in layout.list_shards(checkpoint_dir))):
        step, prefixes = consolidate.sharded_checkpoints(checkpoint_dir, workers=count)
        if prefixes:
            found.append((step, count == num_workers, count, prefixes))
    plain = tf.train.latest_checkpoint(checkpoint_dir) if os.path.isdir(checkpoint_dir) else None
    if plain is not None:
        workers = recorded_workers(plain)
        found.append((_checkpoint_step(plain), workers == num_workers, workers, [plain]))
    if not found:
        return None, None, []
    step, _, workers, prefixes = max(found, key=lambda item: item[:2])
    return step, workers, prefixes


def recorded_workers(prefix):
    """The P that :class:`Membership` recorded in the checkpoint ``prefix``, or None.

    Args:
      prefix: a checkpoint prefix.

    Returns:
      An int, or None when the checkpoint holds no record.

    Example:
      >>> recorded_workers("/ckpt/model.ckpt-6")
      3
    """
    reader = tf.compat.v1.train.NewCheckpointReader(prefix)
    name = _SCOPE + "/num_workers"
    return int(reader.get_tensor(name)) if reader.has_tensor(name) else None


def check_window_ended(prefixes, saved_workers, num_workers):
    """Refuses, in one line, a checkpoint saved mid-window that cannot resume exactly on ``num_workers``.

    That is one saved on another P, or an ordinary checkpoint that the chief
    of several collective workers saved: it holds the chief's partial sums
    only. Shards resume mid-window on their own P (each worker's own sums).

    Args:
      prefixes: the checkpoint's prefix, or its shards' prefixes.
      saved_workers: the P that wrote it (None: unknown, taken as another P).
      num_workers: the P about to resume it.

    Raises:
      ValueError: when some ``micro_step`` is not 0 in such a checkpoint.

    Example:
      >>> check_window_ended(["/ckpt/model.ckpt-6"], 3, 2)
    """
    chief_only = not layout.is_shard_checkpoint(prefixes[0]) and (saved_workers or 1) > 1
    if saved_workers == num_workers and not chief_only:
        return
    why = ("it holds the chief's partial sums only" if chief_only
           else "it resumes only on that many workers, not on %d" % num_workers)
    for prefix in prefixes:
        reader = tf.compat.v1.train.NewCheckpointReader(prefix)
        for name in sorted(reader.get_variable_to_dtype_map()):
            if name.endswith("/micro_step") and int(reader.get_tensor(name)) != 0:
                raise ValueError(
                    "the checkpoint %s was saved by %s workers in the middle of a window (%s = %d): %s; resume "
                    "from a checkpoint saved at the end of a window"
                    % (prefix, saved_workers if saved_workers is not None else "an unknown number of",
                       name, int(reader.get_tensor(name)), why))


class Membership(object):
    """One job's place in an elastic run: its k, its examples per update, and how it resumes.

    Creates the variable ``gradaccum_membership/num_workers`` (int64, global,
    not trainable, initialised to P): build it before the ``Saver``. A
    checkpoint written before the job used ``Membership`` lacks it: restore
    that one once with a ``Saver`` that leaves :attr:`variable` out.

    Args:
      config: this task's ``gradaccum.cluster.ClusterConfig``, or None for one process.
      global_batch: examples per update B, an int >= P; the same on every P.
      micro_batch_size: the most examples per micro-batch; the same on every
        P too, so that window batch norm sees the same micro-batch sizes.
      num_examples: the size of the data set.
      seed: as in :func:`update_examples`.

    Raises:
      ValueError: for a bad argument, such as a ``global_batch`` below P.
      TypeError: for a bad ``config`` or ``seed``.

    Example:
      >>> membership = Membership(config, global_batch=256, micro_batch_size=32,
      ...                         num_examples=60000)
      >>> opt = gradaccum.GradientAccumulator(
      ...     gradaccum.CollectiveAllReduce(adam, config), membership.num_micro_batches)
    """

    def __init__(self, config, global_batch, micro_batch_size, num_examples, *, seed=0):
        self._size, self._rank, _ = wire.group(config)
        self._k = micro_batches_per_worker(global_batch, micro_batch_size, self._size)
        self._batch, self._micro = global_batch, micro_batch_size
        update_examples(0, 1, num_examples, seed)  # Checks num_examples and seed.
        self._examples, self._seed = num_examples, seed
        with tf.compat.v1.init_scope(), tf.compat.v1.variable_scope(_SCOPE, reuse=tf.compat.v1.AUTO_REUSE):
            self._var = tf.compat.v1.get_variable(
                "num_workers", dtype=tf.int64, initializer=tf.constant(self._size, tf.int64), trainable=False)

    @property
    def num_workers(self):
        """P, this job's number of workers."""
        return self._size

    @property
    def rank(self):
        """This worker's rank in ``[0, P)``."""
        return self._rank

    @property
    def num_micro_batches(self):
        """k, the window size for ``GradientAccumulator`` on this P."""
        return self._k

    @property
    def variable(self):
        """The ``num_workers`` variable, which records P in every checkpoint."""
        return self._var

    def micro_batches(self, update):
        """This worker's k index arrays of update ``update`` (see :func:`assign_examples`)."""
        return assign_examples(update, self._batch, self._micro, self._size, self._rank, self._examples,
                               self._seed)

    def dataset(self, arrays=None, first_update=0, num_updates=None):
        """This worker's micro-batches as a ``tf.data.Dataset`` of ``(micro-batch, weight)``.

        Args:
          arrays: a structure (``tf.nest``) of NumPy arrays or tensors whose
            first dimension is the example; None gives the index vectors
            instead, for a pipeline that loads examples by index (``map``).
          first_update: the update to start from (the restored global step).
          num_updates: how many updates, or None for no end.

        Returns:
          A dataset of ``(micro-batch, weight)`` elements, k per update;
          ``weight`` is the micro-batch's int32 size.

        Example:
          >>> batch, weight = tf.compat.v1.data.make_one_shot_iterator(
          ...     membership.dataset({"x": x, "y": y}, first_update=step)).get_next()
        """
        def indices():
            update = first_update
            while num_updates is None or update < first_update + num_updates:
                for part in self.micro_batches(update):
                    yield part
                update += 1

        data = tf.data.Dataset.from_generator(indices, tf.int64, tf.TensorShape([None]))
        if arrays is None:
            return data.map(lambda index: (index, tf.size(index)))
        tensors = tf.nest.map_structure(tf.convert_to_tensor, arrays)
        return data.map(lambda index: (tf.nest.map_structure(lambda t: tf.gather(t, index), tensors),
                                       tf.size(index)))

    def restore(self, sess, saver, checkpoint_dir, init_op):
        """Resumes from the newest checkpoint of ``checkpoint_dir``, written on this P or another.

        Every worker that sees an ordinary checkpoint restores it (the others
        run ``init_op``); sharded checkpoints of this P restore shard by
        shard, and those of another P are first consolidated, under
        ``<checkpoint_dir>/resized/``. Then this P is recorded. Run
        ``broadcast_variables`` afterwards, as after any restore.

        Args:
          sess: the session.
          saver: a ``tf.compat.v1.train.Saver`` of this graph.
          checkpoint_dir: the job's checkpoint directory.
          init_op: the initialiser to run when nothing is restored.

        Returns:
          The restored prefix, or None (``init_op`` ran).

        Raises:
          ValueError: for a checkpoint saved in the middle of a window by another
            P, or by the chief of several collective workers (see
            :func:`check_window_ended`).

        Example:
          >>> membership.restore(sess, saver, "/ckpt", init)
          >>> sess.run(broadcast)
        """
        step, workers, prefixes = newest_checkpoint(checkpoint_dir, self._size)
        path = None
        if prefixes:
            check_window_ended(prefixes, workers, self._size)
            if not layout.is_shard_checkpoint(prefixes[0]) or workers != self._size:
                path = prefixes[0] if not layout.is_shard_checkpoint(prefixes[0]) else consolidate.consolidate(
                    checkpoint_dir, os.path.join(checkpoint_dir, "resized", "step-%d-from-%d-worker-%d-of-%d"
                                                 % (step, workers, self._rank, self._size), "model.ckpt"),
                    step, workers)
            else:
                path = prefixes[self._rank]
            saver.restore(sess, path)
        else:
            sess.run(init_op)
        sess.run(self._var.initializer)
        return path
