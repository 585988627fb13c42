"""The checkpoint layout of a sharded job: one ``shard-<rank>-of-<P>`` directory per worker.

Under a checkpoint directory shared by the job, worker ``r`` of ``P`` of a
``gradaccum.ShardedAllReduce`` job saves into ``<dir>/shard-<r>-of-<P>/``
(``gradaccum.consolidate.shard_directory``); an ordinary checkpoint sits in
``<dir>`` itself. :mod:`gradaccum.distributed.consolidate` writes and merges
the shards, :mod:`gradaccum.distributed.membership` resumes from them, and
:mod:`gradaccum.distributed.launch` finds the newest step among them: all
three name and read the directories here.

Plain Python, without TensorFlow (the launcher parses its flags without
it). It creates no variables, no collections and no files.
"""
import os
import re

SHARD_PATTERN = re.compile(r"^shard-(\d+)-of-(\d+)$")
"""A shard directory's name: group 1 is the worker's rank, group 2 the number of workers P."""


def shard_name(rank, num_workers):
    """The directory name of worker ``rank``'s shard in a job of ``num_workers``.

    Args:
      rank: the worker's rank, an int in ``[0, num_workers)``.
      num_workers: P, an int >= 1.

    Returns:
      ``"shard-<rank>-of-<P>"``.

    Raises:
      TypeError: for a ``rank`` or ``num_workers`` that is not an int.
      ValueError: for a ``num_workers`` below 1 or a ``rank`` outside ``[0, num_workers)``.

    Example:
      >>> shard_name(1, 3)
      'shard-1-of-3'
    """
    for value, what in ((rank, "rank"), (num_workers, "num_workers")):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError("`%s` must be an int, got %r" % (what, value))
    if num_workers < 1 or not 0 <= rank < num_workers:
        raise ValueError("`rank` must be in [0, `num_workers`) with `num_workers` >= 1, got rank %r of %r"
                         % (rank, num_workers))
    return "shard-%d-of-%d" % (rank, num_workers)


def parse_shard(name):
    """``(rank, num_workers)`` of a shard directory's name, or None for any other name.

    Args:
      name: a directory name (a base name, not a path).

    Returns:
      A pair of ints, or None.

    Example:
      >>> parse_shard("shard-1-of-3"), parse_shard("resized")
      ((1, 3), None)
    """
    match = SHARD_PATTERN.match(name)
    return (int(match.group(1)), int(match.group(2))) if match else None


def list_shards(checkpoint_dir):
    """The shard directories directly under ``checkpoint_dir``: ``[(rank, num_workers, name)]``, sorted by name.

    Args:
      checkpoint_dir: the job's checkpoint directory (it may not exist).

    Returns:
      A list of ``(rank, num_workers, name)``; empty when there is no
      shard or no such directory.

    Example:
      >>> list_shards("/ckpt")
      [(0, 2, 'shard-0-of-2'), (1, 2, 'shard-1-of-2')]
    """
    names = sorted(os.listdir(checkpoint_dir)) if os.path.isdir(checkpoint_dir) else []
    return [parsed + (name,) for name, parsed in ((name, parse_shard(name)) for name in names) if parsed]


def is_shard_checkpoint(prefix):
    """Whether the checkpoint ``prefix`` lies in a shard directory (``.../shard-<r>-of-<P>/model.ckpt-6``).

    Args:
      prefix: a checkpoint prefix (a path).

    Returns:
      A bool.

    Example:
      >>> is_shard_checkpoint("/ckpt/shard-0-of-2/model.ckpt-6"), is_shard_checkpoint("/ckpt/model.ckpt-6")
      (True, False)
    """
    return parse_shard(os.path.basename(os.path.dirname(prefix))) is not None
