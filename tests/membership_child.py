"""One worker of tests/test_membership.py's elastic jobs (not collected by pytest).

``python membership_child.py --engines collective,sharded --updates U
--checkpoint-dir DIR --out PREFIX [--kill-at V]``: for each engine in turn
(``collective``, ``sharded`` for ``ShardedAllReduce``, ``stage2`` for
``shard_cache=True``), tests/sharded_child.py's float64 model with a sparse
embedding and Adam, trained on its 24 points with a global batch of
:data:`GLOBAL_BATCH` examples in micro-batches of at most
:data:`MICRO_BATCH`, assigned by ``gradaccum.membership.Membership`` from the
``TF_CONFIG`` P. Each engine resumes from ``DIR/<engine>`` (saved after every
update: by the chief for ``collective``, by every worker for the sharded
ones) and trains up to global step U, then writes
``<PREFIX>-<engine>-worker<r>.npz`` (the model, this worker's Adam state, the
step). With ``--kill-at V``, worker 2 of a 3-worker job SIGKILLs itself after
the first micro-batch of update V, once it printed ``killed at <time>``; a
chief that resumed on 2 workers prints ``first update on 2 workers at <time>``.
"""
import argparse
import os
import signal
import time

import numpy as np

import sharded_child

GLOBAL_BATCH, MICRO_BATCH, SEED = 10, 2, 3


def _parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", default="collective")
    parser.add_argument("--updates", type=int, required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def _reducer(gradaccum, engine, config):
    if engine == "collective":
        return lambda: gradaccum.CollectiveAllReduce(sharded_child.optimizer(tf, "adam"), config,
                                                     timeout_seconds=60)
    return lambda: gradaccum.ShardedAllReduce(sharded_child.optimizer(tf, "adam"), config, timeout_seconds=60,
                                              shard_cache=engine == "stage2")


def _save(sess, saver, engine, config, directory, step):
    from gradaccum import consolidate

    if engine != "collective":
        directory = consolidate.shard_directory(directory, config)
    elif not config.is_chief:
        return
    os.makedirs(directory, exist_ok=True)
    saver.save(sess, os.path.join(directory, "model.ckpt"), global_step=step)


def _train(sess, graph, membership, args, start):
    """Runs the updates from ``start``; SIGKILLs worker 2 of 3 in the middle of update ``--kill-at``."""
    step = start
    while step < args.updates:
        for i, points in enumerate(membership.micro_batches(step)):
            if step == args.kill_at and i == 1 and membership.num_workers == 3 and membership.rank == 2:
                print("killed at %.6f" % time.time(), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            sess.run(graph["train"], sharded_child.feed(graph, points))
        step = int(sess.run(graph["step"]))
        yield step


def _run(args, config, server, engine, after_training):
    import gradaccum
    from gradaccum import cluster, membership as elastic

    directory = os.path.join(args.checkpoint_dir, engine)
    with tf.Graph().as_default() as g:
        membership = elastic.Membership(config, GLOBAL_BATCH, MICRO_BATCH, sharded_child.N_POINTS, seed=SEED)
        graph = sharded_child.build(tf, _reducer(gradaccum, engine, config), k=membership.num_micro_batches)
        shared = tf.compat.v1.global_variables() if engine == "collective" else tf.compat.v1.trainable_variables()
        broadcast = cluster.broadcast_variables(config, shared)
        init = tf.compat.v1.global_variables_initializer()
        saver = tf.compat.v1.train.Saver(max_to_keep=20)
        adam = sharded_child.slots(tf)
    with tf.compat.v1.Session(server.target, graph=g, config=cluster.collective_session_config(config)) as sess:
        restored = membership.restore(sess, saver, directory, init)
        sess.run(broadcast)
        start = int(sess.run(graph["step"]))
        print("%s: %d workers, k = %d, from global_step %d (%s)" % (engine, membership.num_workers,
              membership.num_micro_batches, start, "restored" if restored else "fresh"), flush=True)
        for step in _train(sess, graph, membership, args, start):
            if step == start + 1 and restored and membership.num_workers == 2 and config.is_chief:
                print("first update on 2 workers at %.6f" % time.time(), flush=True)
            _save(sess, saver, engine, config, directory, step)
        after_training()  # No collective runs after this: a peer that exits first is not a failure.
        values = sess.run(dict(graph["variables"], **adam))
        np.savez("%s-%s-worker%d.npz" % (args.out, engine, membership.rank), step=sess.run(graph["step"]),
                 **values)


def main(argv=None):
    args = _parse(argv)
    config, server, beat = sharded_child.serve()
    engines = args.engines.split(",")
    for i, engine in enumerate(engines):
        _run(args, config, server, engine, beat.stop if i == len(engines) - 1 else lambda: None)
    return 0


if __name__ == "__main__":
    tf = sharded_child.start_tensorflow()
    sharded_child.exit_now(main())
