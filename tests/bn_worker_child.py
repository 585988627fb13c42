"""One worker of tests/test_batch_norm_workers.py: a small batch-norm model on the collective engine.

Run by ``python -m gradaccum.launch --workers P -- python tests/bn_worker_child.py ...``
(``TF_CONFIG`` names the task). Every worker builds the same graph, takes
worker 0's initial values (``broadcast_variables``), trains ``--steps``
updates of ``--k`` micro-batches of its own data (worker p's micro-batches
have ``--sizes[p]`` examples) with ``GradientAccumulator(CollectiveAllReduce(
opt), k)``, and writes every global variable into ``<--out>_<rank>.npz``.
``--no-sync`` builds the model outside ``synchronized_batch_norm`` (each
worker's own batch statistics); ``--towers T`` builds it with
``tower.minimize`` over T CPU devices of the worker.

The test module imports :func:`batches` and :func:`model` to build the
single-process reference on the union of the workers' micro-batches.
"""
import argparse
import contextlib
import os
import sys

import numpy as np

if __name__ == "__main__":  # The test module imports this file after conftest set the mode.
    import tensorflow as tf

    if os.environ.get("GRADACCUM_TF_MODE", "tf1") == "tf2":
        tf.compat.v1.disable_eager_execution()
    else:
        tf.compat.v1.disable_v2_behavior()
else:
    import tensorflow as tf

FEATURES = 4
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.1),
}


def batches(sizes, k, steps, seed=7):
    """``[step][micro][worker] -> (x, y)``: worker p's data is shifted by p, so its statistics differ."""
    rng = np.random.RandomState(seed)
    spread = np.linspace(0.5, 2.0, FEATURES)
    data = []
    for _ in range(steps * k):
        micro = []
        for worker, size in enumerate(sizes):
            x = 3.0 * worker * np.linspace(1.0, -1.0, FEATURES) + spread * rng.randn(size, FEATURES)
            micro.append((x.astype(np.float64), rng.randint(0, 2, size).astype(np.int32)))
        data.append(micro)
    return [data[step * k:(step + 1) * k] for step in range(steps)]


def model(x, y, layer):
    """batch norm -> tanh -> dense -> batch norm -> tanh -> dense, mean cross-entropy (float64).

    The second batch norm's input depends on a kernel, so its statistics'
    gradient reaches a variable (the backward all-reduce matters); the first
    tanh keeps that input's mean away from 0.
    """
    rng = np.random.RandomState(5)
    h = tf.tanh(layer(x, True, momentum=0.9))
    h = tf.matmul(h, tf.compat.v1.get_variable("dense0", dtype=tf.float64, initializer=rng.randn(FEATURES, 3)))
    h = tf.tanh(layer(h, True, momentum=0.9))
    logits = tf.matmul(h, tf.compat.v1.get_variable("dense1", dtype=tf.float64, initializer=rng.randn(3, 2)))
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _build(args, config):
    import gradaccum
    from gradaccum import cluster, tower

    x = tf.compat.v1.placeholder(tf.float64, [None, FEATURES], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = gradaccum.GradientAccumulator(
        cluster.CollectiveAllReduce(OPTIMIZERS[args.opt](), config, timeout_seconds=60), args.k)
    scope = contextlib.ExitStack() if args.no_sync else cluster.synchronized_batch_norm(config, timeout_seconds=60)
    with scope:
        if args.towers > 1:
            devices = ["/cpu:%d" % i for i in range(args.towers)]
            model_fn = lambda x, y: model(x, y, gradaccum.batch_normalization)  # noqa: E731
            train_op = tower.minimize(optimizer, model_fn, [x, y], devices=devices, global_step=step).train_op
        else:
            loss = model(x, y, gradaccum.batch_normalization)
            train_op = optimizer.minimize(loss, global_step=step, weight=tf.shape(x)[0])
    return x, y, train_op, cluster.broadcast_variables(config)


def main(argv):
    from gradaccum import cluster

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--sizes", type=lambda text: [int(s) for s in text.split(",")], default=[5, 3])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--opt", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument("--towers", type=int, default=1)
    parser.add_argument("--no-sync", action="store_true")
    args = parser.parse_args(argv)
    config = cluster.load_tf_config()
    rank = config.compute_tasks.index((config.task_type, config.task_index))
    proto = cluster.collective_session_config(
        config, tf.compat.v1.ConfigProto(device_count={"CPU": max(1, args.towers)}))
    server = cluster.start_server(config, proto)
    with tf.Graph().as_default() as graph:
        x, y, train_op, broadcast = _build(args, config)
        init = tf.compat.v1.global_variables_initializer()
        variables = tf.compat.v1.global_variables()
    with tf.compat.v1.Session(server.target, graph=graph, config=proto) as sess:
        sess.run(init)
        sess.run(broadcast)
        for window in batches(args.sizes, args.k, args.steps):
            for micro in window:
                sess.run(train_op, {x: micro[rank][0], y: micro[rank][1]})
        values = dict(zip([v.op.name for v in variables], sess.run(variables)))
    np.savez("%s_%d.npz" % (args.out, rank), **dict((k.replace("/", "__"), v) for k, v in values.items()))
    print("worker %d done" % rank)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
