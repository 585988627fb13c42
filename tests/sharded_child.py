"""One worker of tests/test_sharded.py's jobs (not collected by pytest).

A float64 model with a sparse variable (``tf.gather`` of an embedding),
trained on 24 fixed points. Worker r reads its own uneven share
(``--shares``) and splits it into 3 uneven micro-batches per window. Window
``--empty-window`` feeds nothing anywhere (zero weight); window
``--nan-window`` puts a NaN into the last worker's first micro-batch (skipped
with ``skip_nonfinite``). ``--runs`` lists ``engine-optimizer`` trainings
(``sharded-adam``, ``sharded-adamclip`` with ``clip_norm``,
``collective-sgd``, ``stage2-adam`` for ``shard_cache=True``, ``-adamstats``
for Adam with ``statistics=True`` (``-adamclipstats`` with ``clip_norm``
too; "clip" and "stats" in a name switch them on), ``-adaptive`` for SGD
under an ``AdaptiveBatch``, whose windows split the worker's points into the k
micro-batches the policy asks for, ...), one graph each, in this one
process; each writes ``<out>-<run>-worker<r>.npz`` (the model, the Adam
state this worker holds by :func:`slot_key`, the step, the skipped windows,
what it holds and who owns what; with the statistics, ``stats_<name>``,
after every window, and the window sizes, ``sizes``). With
``--checkpoint-dir`` (one run), every worker saves its shard every
``--checkpoint-every`` steps and at the end, and restores its shard of the
newest common step on start; ``--kill-at W`` makes the last worker SIGKILL
itself after the first micro-batch of window W. Imported by the tests for
:func:`build`, :func:`slots` and :func:`windows` (the one-process reference).
"""
import argparse
import os
import signal
import sys

import numpy as np

N_POINTS, ROWS, K = 24, 7, 3


def data():
    rng = np.random.RandomState(1)
    return rng.normal(size=(N_POINTS, 3)), rng.randint(0, ROWS, N_POINTS).astype(np.int32), \
        rng.normal(size=(N_POINTS, 1))


def initial_values():
    rng = np.random.RandomState(2)
    return [("emb", rng.normal(size=(ROWS, 3))), ("w1", rng.normal(size=(3, 5)) / 2), ("b1", np.zeros(5)),
            ("w2", rng.normal(size=(5, 1)) / 2), ("b2", np.zeros(1)), ("scale", np.ones(3))]


def build(tf, make_optimizer, k=K, skip_nonfinite=True, clip_norm=None, statistics=False):
    """The graph's tensors: placeholders, loss, train op, variables by name, global step.

    ``k=None``: the plain optimizer (clipped by ``tf.clip_by_global_norm``
    with ``clip_norm``), one run per update, the reference.
    """
    x = tf.compat.v1.placeholder(tf.float64, [None, 3], name="x")
    ids = tf.compat.v1.placeholder(tf.int32, [None], name="ids")
    y = tf.compat.v1.placeholder(tf.float64, [None, 1], name="y")
    step = tf.compat.v1.train.get_or_create_global_step()
    v = dict((name, tf.compat.v1.get_variable(name, initializer=value)) for name, value in initial_values())
    rows = tf.gather(v["emb"], ids)  # a sparse (IndexedSlices) gradient
    h = tf.tanh(tf.matmul(x * rows * v["scale"], v["w1"]) + v["b1"])
    n = tf.shape(x)[0]
    loss = tf.reduce_sum(tf.square(tf.matmul(h, v["w2"]) + v["b2"] - y)) / tf.maximum(tf.cast(n, tf.float64), 1.0)
    opt = make_optimizer()
    if k is None:
        grads, variables = zip(*opt.compute_gradients(loss))
        if clip_norm is not None:
            grads, _ = tf.clip_by_global_norm(list(grads), clip_norm)
        train = opt.apply_gradients(list(zip(grads, variables)), step)
    else:
        import gradaccum
        opt = gradaccum.GradientAccumulator(opt, k, skip_nonfinite=skip_nonfinite, clip_norm=clip_norm,
                                            statistics=statistics)
        train = opt.minimize(loss, step, weight=n)
    return dict(x=x, ids=ids, y=y, loss=loss, train=train, variables=v, step=step, opt=opt)


def slots(tf):
    """The default graph's Adam state by :func:`slot_key`: moments of the variables held here, beta powers."""
    return dict((slot_key(v.op.name), v) for v in tf.compat.v1.global_variables()
                if v.op.name.endswith(("/Adam", "/Adam_1")) or v.op.name in ("beta1_power", "beta2_power"))


def slot_key(name):
    """The npz key of an Adam variable: ``slot_`` and its name, ``/`` as ``_``."""
    return "slot_" + name.replace("/", "_")


CLIP_NORM = 0.05  # "adamclip": Adam after clip_norm, which binds on every window here


# "-adaptive": the targets' offset, which the model learns over the windows: the mean
# gradient shrinks, the noise scale grows, and the policy's k with it.
OFFSET = 3.0


def policy():
    """The ``-adaptive`` runs' policy: its k moves between 2 and 6 on this problem (no threshold)."""
    import gradaccum

    return gradaccum.AdaptiveBatch(micro_batch_size=4, factor=10.0, min_micro_batches=2,
                                   max_micro_batches=6, threshold=0.0, rule="sgd")


def optimizer(tf, name):
    if name.startswith("adam"):
        return tf.compat.v1.train.AdamOptimizer(0.05)
    return tf.compat.v1.train.GradientDescentOptimizer(0.1)


def windows(shares, count, empty=None, nan=None):
    """Per window, per worker, K lists of point indices (uneven); and the windows a reference skips."""
    starts = np.cumsum([0] + list(shares))
    out = []
    for w in range(count):
        per_worker = []
        for r, n in enumerate(shares):
            idx = np.arange(starts[r], starts[r] + n)
            parts = np.split(idx, [max(1, n // 5), max(2, n // 2)]) if w != empty else [idx[:0]] * K
            per_worker.append(parts)
        out.append(per_worker)
    return out, [w for w in (empty, nan) if w is not None]


def feed(graph, points, nan=False, offset=0.0):
    x, ids, y = data()
    values = y[points] + offset
    if nan and len(values):
        values[0, 0] = np.nan
    return {graph["x"]: x[points], graph["ids"]: ids[points], graph["y"]: values}


def _parse(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", default="sharded-adam")
    parser.add_argument("--shares", default="9,15")
    parser.add_argument("--windows", type=int, default=6)
    parser.add_argument("--empty-window", type=int, default=None)
    parser.add_argument("--nan-window", type=int, default=None)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def _run(tf, args, config, server, run, after_training):
    import gradaccum
    from gradaccum import cluster, consolidate

    engine, opt_name = run.split("-")
    size, rank = len(config.compute_tasks), config.compute_tasks.index((config.task_type, config.task_index))
    if engine == "collective":
        make = gradaccum.CollectiveAllReduce
    else:
        def make(opt, config, **kwargs):
            return gradaccum.ShardedAllReduce(opt, config, shard_cache=engine == "stage2", **kwargs)
    with tf.Graph().as_default() as g:
        graph = build(tf, lambda: make(optimizer(tf, opt_name), config, timeout_seconds=60),
                      k=policy() if opt_name == "adaptive" else K,
                      clip_norm=CLIP_NORM if "clip" in opt_name else None, statistics="stats" in opt_name)
        stats = graph["opt"].statistics.variables if "stats" in opt_name or opt_name == "adaptive" else []
        stats = dict((v.op.name.rsplit("/", 1)[1], v) for v in stats)
        window_size = graph["opt"].windows[-1].size
        broadcast = cluster.broadcast_variables(config, tf.compat.v1.trainable_variables())
        init = tf.compat.v1.global_variables_initializer()
        saver = tf.compat.v1.train.Saver(max_to_keep=10)
        skipped = [v for v in tf.compat.v1.global_variables() if v.op.name.endswith("skipped_windows")][0]
        adam = slots(tf)
        held = dict((v.op.name, v.shape.num_elements() * v.dtype.base_dtype.size)
                    for v in tf.compat.v1.global_variables())
    plan, _ = windows([int(s) for s in args.shares.split(",")], args.windows, args.empty_window, args.nan_window)
    with tf.compat.v1.Session(server.target, graph=g, config=cluster.collective_session_config(config)) as sess:
        path = consolidate.latest_shard(args.checkpoint_dir, config) if args.checkpoint_dir else None
        if path:
            saver.restore(sess, path)
            print("restored global_step %d" % sess.run(graph["step"]), flush=True)
        else:
            sess.run(init)
            sess.run(broadcast)
        first = int(sess.run(graph["step"])) if args.checkpoint_dir else 0
        sizes, trace = [], []
        for w in range(first, args.windows):
            sizes.append(int(sess.run(window_size)))
            parts = plan[w][rank]
            if opt_name == "adaptive":
                parts = np.array_split(np.concatenate(parts), sizes[-1])
            for i, points in enumerate(parts):
                if w == args.kill_at and i == 1 and rank == size - 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                nan = w == args.nan_window and rank == size - 1 and i == 0
                sess.run(graph["train"], feed(graph, points, nan, offset=OFFSET if opt_name == "adaptive" else 0.0))
            trace.append(sess.run(stats) if stats else {})
            step = int(sess.run(graph["step"]))
            if args.checkpoint_dir and (step % args.checkpoint_every == 0 or w == args.windows - 1):
                saver.save(sess, os.path.join(consolidate.shard_directory(args.checkpoint_dir, config),
                                              "model.ckpt"), global_step=step)
                print("saved global_step %d" % step, flush=True)
        after_training()  # No collective runs after this: a peer that exits first is not a failure.
        values = sess.run(dict(graph["variables"], **adam))
        reducer = graph["opt"].optimizer
        owners = reducer.owners if engine != "collective" else {}
        np.savez("%s-%s-worker%d.npz" % (args.out, run, rank), step=sess.run(graph["step"]),
                 skipped=sess.run(skipped), held_names=np.array(sorted(held)),
                 held_bytes=np.array([held[n] for n in sorted(held)]),
                 owner_names=np.array(sorted(owners)), owner_ranks=np.array([owners[n] for n in sorted(owners)]),
                 broadcasts=getattr(reducer, "broadcasts_per_update", 0), sizes=np.array(sizes),
                 **dict(values, **dict(("stats_" + name, np.array([t[name] for t in trace])) for name in stats)))


def start_tensorflow():
    """TensorFlow, quiet, in the test run's behaviour (``GRADACCUM_TF_MODE``); returns the module."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if os.environ.get("GRADACCUM_TF_MODE", "tf1") == "tf1":
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()
    return tf


def serve(heartbeat=True):
    """This task's config, its started server and (``heartbeat``) a 3 s heartbeat, once every task answers."""
    from gradaccum import cluster

    config = cluster.from_environment()
    server = cluster.start_server(config, cluster.collective_session_config(config))
    cluster.wait_for_tasks(config, timeout_seconds=60, poll_seconds=0.1)  # The peers start within a second.
    return config, server, cluster.Heartbeat(server, config, timeout_seconds=3.0).start() if heartbeat else None


def main(argv=None):
    args = _parse(argv)
    tf = start_tensorflow()
    config, server, beat = serve()
    runs = args.runs.split(",")
    for i, run in enumerate(runs):
        _run(tf, args, config, server, run, beat.stop if i == len(runs) - 1 else lambda: None)
    return 0


def exit_now(status):
    """Exits at once with ``status``, output flushed: tearing down TensorFlow's gRPC server takes seconds."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    exit_now(main())
