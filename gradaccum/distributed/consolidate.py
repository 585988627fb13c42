"""Checkpoints of a sharded job (``gradaccum.ShardedAllReduce``), and their consolidation into an ordinary one.

The layout: under a checkpoint directory shared by the job, worker ``r`` of
``P`` saves with its own ``tf.compat.v1.train.Saver()`` (every global
variable of its graph) into ``<dir>/shard-<r>-of-<P>/``
(:func:`shard_directory`; the names are ``gradaccum.distributed.layout``'s),
at the same global steps as the others. A shard
holds the whole model, ``global_step``, the worker's own accumulation state
and the optimizer slots of the variables it owns (with Adam's beta powers):
the model is written P times, the optimizer state once. A relaunched worker
restores its own shard of the newest step that every shard has
(:func:`latest_shard`), so a worker killed while saving costs one interval;
it needs no broadcast after the restore.

:func:`consolidate` (or ``python -m gradaccum.consolidate DIR OUTPUT``)
merges the shards of one step into an ordinary checkpoint: every variable
once, from the lowest rank that holds it (a worker's partial window, if the
step was saved mid-window, is rank 0's). Stage 2 (``shard_cache=True``):
each accumulation cache is held by its owner only, and holds the sum over
every worker of the window so far, while each worker's ``weight_sum`` and
``micro_step`` are its own: a step saved mid-window has no one-process
equivalent, so :func:`consolidate` refuses it (a sharded job of the same P
restores it exactly). Save at the end of a window, as
``GradientAccumulator`` loops do after the window's last micro-batch. A one-process unsharded job
restores it with a plain ``Saver``, and so does a sharded job of any P
(each worker restores the variables of its graph): consolidate to change P.

This module creates no variables and no collections in the caller's graph;
:func:`consolidate` builds its own graph.
"""
import argparse
import os
import re
import sys

from gradaccum.distributed import layout


def _tf():
    from gradaccum._compat import tf  # Imported on use: `python -m gradaccum.consolidate --help` needs no TF.
    return tf


def shard_directory(checkpoint_dir, config):
    """This worker's checkpoint directory: ``<checkpoint_dir>/shard-<rank>-of-<P>``.

    Args:
      checkpoint_dir: the job's checkpoint directory (a string).
      config: this task's ``gradaccum.cluster.ClusterConfig`` (chief or worker).

    Returns:
      The directory path (a string), created if missing (``Saver.save`` does not create it).

    Raises:
      TypeError: for a ``checkpoint_dir`` that is not a non-empty string, or a bad ``config``.

    Example:
      >>> saver.save(sess, os.path.join(shard_directory(ckpt_dir, config), "model.ckpt"), global_step=step)
    """
    from gradaccum.distributed import wire  # Imports TF: on use, as _tf().

    if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
        raise TypeError("`checkpoint_dir` must be a non-empty string, got %r" % (checkpoint_dir,))
    size, rank, _ = wire.group(config)
    directory = os.path.join(checkpoint_dir, layout.shard_name(rank, size))
    os.makedirs(directory, exist_ok=True)
    return directory


def _steps(directory):
    """``{step: checkpoint prefix}`` that ``directory``'s checkpoint state lists."""
    state = _tf().train.get_checkpoint_state(directory)
    found = {}
    for path in list(state.all_model_checkpoint_paths) if state else []:
        match = re.search(r"-(\d+)$", path)
        if match and _tf().compat.v1.train.checkpoint_exists(path):
            found[int(match.group(1))] = path if os.path.isabs(path) else os.path.join(directory, path)
    return found


def sharded_checkpoints(checkpoint_dir, step=None, workers=None):
    """The P shard prefixes of one step: ``step``, or the newest step that every shard holds.

    Args:
      checkpoint_dir: the job's checkpoint directory.
      step: None (newest common step) or an int.
      workers: None, or the P whose shards to read when the directory holds
        shards of several worker counts (a job resumed on another P).

    Returns:
      ``(step, [prefix of rank 0, ..., prefix of rank P - 1])``, or
      ``(None, [])`` when no step is held by every shard.

    Raises:
      ValueError: when the directory holds shards of several worker counts,
        misses a shard, or lacks the ``step`` asked for.

    Example:
      >>> step, prefixes = sharded_checkpoints("/ckpt")
    """
    listed = [(rank, count, name) for rank, count, name in layout.list_shards(checkpoint_dir)
              if workers in (None, count)]
    shards = dict((rank, count) for rank, count, _ in listed)
    counts = sorted(set(shards.values()))
    if len(counts) > 1:
        raise ValueError("`checkpoint_dir` %r holds shards of %s workers; keep one job's shards per directory"
                         % (checkpoint_dir, " and ".join(map(str, counts))))
    if not counts:
        return None, []
    size = counts[0]
    if sorted(shards) != list(range(size)):
        found = ", ".join(name for _, count, name in listed if count == size)
        raise ValueError("`checkpoint_dir` %r must hold shard-0-of-%d to shard-%d-of-%d, got %s"
                         % (checkpoint_dir, size, size - 1, size, found))
    held = [_steps(os.path.join(checkpoint_dir, layout.shard_name(rank, size))) for rank in range(size)]
    common = set(held[0]).intersection(*held[1:])
    if step is not None and step not in common:
        raise ValueError("`step` %r is not held by every shard of %r (common steps: %s)"
                         % (step, checkpoint_dir, sorted(common)))
    if not common:
        return None, []
    step = max(common) if step is None else step
    return step, [steps[step] for steps in held]


def latest_shard(checkpoint_dir, config):
    """This worker's prefix of the newest step that every shard holds, or None (start afresh).

    Args:
      checkpoint_dir: the job's checkpoint directory.
      config: this task's ``gradaccum.cluster.ClusterConfig``.

    Returns:
      A checkpoint prefix for ``saver.restore``, or None.

    Raises:
      ValueError: when the directory holds shards of another number of
        workers than ``config``'s job (consolidate them first).

    Example:
      >>> path = latest_shard(ckpt_dir, config)
      >>> saver.restore(sess, path) if path else sess.run([init, broadcast])
    """
    from gradaccum.distributed import wire  # Imports TF: on use, as _tf().

    size, rank, _ = wire.group(config)
    step, prefixes = sharded_checkpoints(checkpoint_dir)
    if prefixes and len(prefixes) != size:
        raise ValueError("`checkpoint_dir` %r holds shards of %d workers, this job has %d: run "
                         "`python -m gradaccum.consolidate` and restore the ordinary checkpoint"
                         % (checkpoint_dir, len(prefixes), size))
    return prefixes[rank] if prefixes else None


def _merged(prefixes):
    """``{name: (dtype, prefix)}``: every variable once, from the lowest rank that holds it."""
    tf = _tf()
    merged, steps = {}, set()
    for prefix in prefixes:
        reader = tf.compat.v1.train.NewCheckpointReader(prefix)
        dtypes = reader.get_variable_to_dtype_map()
        if "global_step" in dtypes:
            steps.add(int(reader.get_tensor("global_step")))
        for name in sorted(dtypes):
            merged.setdefault(name, (dtypes[name], prefix))
    if len(steps) > 1:
        raise ValueError("the shards disagree on global_step (%s): they are not one step's shards"
                         % ", ".join(map(str, sorted(steps))))
    _check_window_ended(prefixes)
    return merged


def _check_window_ended(prefixes):
    """Refuses stage-2 shards saved mid-window: a cache held by some shards only, while a window is open."""
    tf = _tf()
    readers = [tf.compat.v1.train.NewCheckpointReader(prefix) for prefix in prefixes]
    held = [set(reader.get_variable_to_dtype_map()) for reader in readers]
    for name in sorted(set().union(*held)):
        if not name.endswith("/micro_step") or not any(
                name in names and int(reader.get_tensor(name)) > 0 for reader, names in zip(readers, held)):
            continue
        scope = name[:-len("/micro_step")]
        suffix = "/" + scope.rsplit("/", 1)[-1]
        caches = set(n for names in held for n in names if n.endswith(suffix) and not n.startswith(scope + "/"))
        if any(caches - names for names in held):
            raise ValueError("the shards were saved in the middle of a window of %r by a job with shard_cache=True "
                             "(each cache on its owner only): consolidate a step saved at the end of a window"
                             % scope)


def consolidate(checkpoint_dir, output_prefix, step=None, workers=None):
    """Writes the ordinary checkpoint of a sharded job's step: every variable once, the optimizer state whole.

    Args:
      checkpoint_dir: the sharded job's checkpoint directory.
      output_prefix: where to write (``Saver.save``'s path, e.g. ``/out/model.ckpt``).
      step: None (the newest step every shard holds) or an int.
      workers: as in :func:`sharded_checkpoints`.

    Returns:
      The written checkpoint's prefix.

    Raises:
      ValueError: when no step is held by every shard, or the shards do not fit together.

    Example:
      >>> consolidate("/ckpt", "/ordinary/model.ckpt")
      '/ordinary/model.ckpt'
    """
    tf = _tf()
    step, prefixes = sharded_checkpoints(checkpoint_dir, step, workers)
    if not prefixes:
        raise ValueError("`checkpoint_dir` %r holds no step that every shard has" % (checkpoint_dir,))
    merged = _merged(prefixes)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    readers = dict((p, tf.compat.v1.train.NewCheckpointReader(p)) for p in prefixes)
    with tf.Graph().as_default():
        holders, loads = {}, []
        for i, name in enumerate(sorted(merged)):
            dtype, prefix = merged[name]
            value = readers[prefix].get_tensor(name)
            feed = tf.compat.v1.placeholder(dtype, value.shape)
            holders[name] = tf.compat.v1.Variable(feed, trainable=False, collections=[], name="v%d" % i)
            loads.append((holders[name].initializer, feed, value))
        saver = tf.compat.v1.train.Saver(holders, write_version=tf.compat.v1.train.SaverDef.V2)
        with tf.compat.v1.Session() as sess:
            for initializer, feed, value in loads:
                sess.run(initializer, {feed: value})
            return saver.save(sess, output_prefix, write_meta_graph=False)


def main(argv=None):
    """``python -m gradaccum.consolidate CHECKPOINT_DIR OUTPUT_PREFIX [--step N]``; returns the exit status.

    Prints the written checkpoint's prefix; a bad directory or step prints
    one line on stderr and returns 2.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      0 on success, 2 on an error.

    Example:
      >>> main(["/ckpt", "/ordinary/model.ckpt"])
      0
    """
    parser = argparse.ArgumentParser(prog="python -m gradaccum.consolidate",
                                     description="Merge a sharded job's checkpoint into an ordinary one.")
    parser.add_argument("checkpoint_dir", help="the sharded job's directory (holding shard-<r>-of-<P>/)")
    parser.add_argument("output_prefix", help="the ordinary checkpoint to write, e.g. /out/model.ckpt")
    parser.add_argument("--step", type=int, default=None, help="the step (default: the newest all shards hold)")
    args = parser.parse_args(argv)
    try:
        path = consolidate(args.checkpoint_dir, args.output_prefix, args.step)
    except ValueError as exc:
        print("python -m gradaccum.consolidate: error: %s" % exc, file=sys.stderr)
        return 2
    print(path)
    return 0

