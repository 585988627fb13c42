"""One worker of test_strategy's multi-process test: the accumulator under MultiWorkerMirroredStrategy.

Run with ``TF_CONFIG`` naming the task (two workers on loopback). Each
worker is one replica: it builds test_strategy's model under the strategy,
``GradientAccumulator(adam, K).minimize`` in ``strategy.run`` (or
``experimental_run_v2``) in a ``tf.compat.v1.Session`` on its server, and
feeds its own micro-batches (test_strategy's replica ``index``) for
``UPDATES`` updates. With ``--trace`` it also records, per run of the first
update, whether a collective op executed. It writes the variables, Adam's
slots, ``global_step`` and the trace into ``<OUT>-worker<index>.npz``.
"""
import argparse
import json
import os

import numpy as np

import sharded_child


def _strategy(tf):
    v1 = getattr(tf.compat.v1.distribute.experimental, "MultiWorkerMirroredStrategy", None)
    return (v1 or tf.distribute.experimental.MultiWorkerMirroredStrategy)()


def _collectives(run_metadata):
    return sum(1 for device in run_metadata.step_stats.dev_stats for node in device.node_stats
               if node.timeline_label.split(" = ")[-1].startswith("Collective"))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    tf = sharded_child.start_tensorflow()
    import gradaccum
    import test_strategy as shared

    task = json.loads(os.environ["TF_CONFIG"])
    index = task["task"]["index"]
    strategy = _strategy(tf)
    config = strategy.update_config_proto(tf.compat.v1.ConfigProto())
    server = tf.distribute.Server(tf.train.ClusterSpec(task["cluster"]), job_name="worker", task_index=index,
                                  config=config)
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        y = tf.compat.v1.placeholder(tf.float64, [None, 1])
        built = {}
        with strategy.scope():
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(0.1), shared.K)

            def replica_step():
                built["variables"], loss = shared._model(x, y)
                loss = loss / float(strategy.num_replicas_in_sync)
                return opt.minimize(loss, global_step=step, weight=tf.shape(x)[0])

            run = getattr(strategy, "run", None) or strategy.experimental_run_v2
            train = strategy.group(run(replica_step))
        init = tf.compat.v1.global_variables_initializer()
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    traced = []
    with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
        sess.run(init)
        for update, batches in enumerate(shared._data()):
            for i in range(shared.K):
                feed = {x: batches[index * shared.K + i][0], y: batches[index * shared.K + i][1]}
                if update == 1:  # The first run of all also syncs the workers, once.
                    metadata = tf.compat.v1.RunMetadata()
                    sess.run(train, feed, options=options, run_metadata=metadata)
                    traced.append(_collectives(metadata))
                else:
                    sess.run(train, feed)
        values = shared._fetch_state(sess, opt, built["variables"], step)
    np.savez("%s-worker%d.npz" % (args.out, index), trace=np.array(traced),
             **{"state_%d" % i: value for i, value in enumerate(values)})
    return 0


if __name__ == "__main__":
    sharded_child.exit_now(main())
