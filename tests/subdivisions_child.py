"""One worker of test_subdivisions' multi-process test: ``subdivisions.minimize`` on collective workers.

Run by ``python -m gradaccum.launch --workers P -- python tests/subdivisions_child.py --out PREFIX``
(``TF_CONFIG`` names the task). For each engine of ``--engines`` (``collective``:
``CollectiveAllReduce``; ``clip``: the same with ``clip_norm=CLIP_NORM``;
``stage1``: ``ShardedAllReduce``; ``recompute``: ``CollectiveAllReduce`` with
the whole model one block that ``gradaccum.recompute`` recomputes in the
backward pass), every worker builds
the test module's model, takes worker 0's initial values, and runs
``UPDATES`` updates, one run each: worker p feeds its share of the batch
(``SHARES[p]`` examples of it), split into ``K`` micro-batches inside the
graph, and one all-reduce after the loop sums the workers' weighted sums.
It writes every model variable and Adam slot into ``<PREFIX>-<engine>-worker<p>.npz``.
"""
import argparse

import numpy as np

import sharded_child

K = 3
CLIP_NORM = 0.5
SHARES = (14, 9)  # Of the 23 examples: uneven shares, uneven micro-batches (5, 5, 4 and 3, 3, 3).


def _run(tf, engine, config, server, out):
    import gradaccum
    from gradaccum import cluster
    import test_subdivisions as shared

    rank = config.compute_tasks.index((config.task_type, config.task_index))
    start = sum(SHARES[:rank])
    make = gradaccum.ShardedAllReduce if engine == "stage1" else gradaccum.CollectiveAllReduce
    clip = {"clip_norm": CLIP_NORM} if engine == "clip" else {}
    model = gradaccum.recompute(shared._model) if engine == "recompute" else shared._model
    with tf.Graph().as_default() as graph:
        feeds = shared._placeholders()
        acc = gradaccum.GradientAccumulator(make(shared.OPTIMIZERS["adam"](), config, timeout_seconds=60), K, **clip)
        result = gradaccum.subdivisions.minimize(acc, model, feeds,
                                                 global_step=tf.compat.v1.train.get_or_create_global_step())
        broadcast = cluster.broadcast_variables(config, tf.compat.v1.trainable_variables())
        init = tf.compat.v1.global_variables_initializer()
        variables = dict((v.op.name, v) for v in tf.compat.v1.global_variables())
    with tf.compat.v1.Session(server.target, graph=graph, config=cluster.collective_session_config(config)) as sess:
        sess.run(init)
        sess.run(broadcast)
        for batch in shared._batches():
            mine = dict((f, b[start:start + SHARES[rank]]) for f, b in zip(feeds, batch))
            sess.run(result.train_op, mine)
        values = sess.run(variables)
    np.savez("%s-%s-worker%d.npz" % (out, engine, rank), **dict((k.replace("/", "__"), v) for k, v in values.items()))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--engines", default="collective,clip,stage1,recompute")
    args = parser.parse_args(argv)
    tf = sharded_child.start_tensorflow()
    # No heartbeat: a peer that finishes first is not a failure here.
    config, server, _ = sharded_child.serve(heartbeat=False)
    for engine in args.engines.split(","):
        _run(tf, engine, config, server, args.out)
    return 0


if __name__ == "__main__":
    sharded_child.exit_now(main())
