"""Collective against in-graph replication: time and bytes per update, P = 1..4 processes on loopback.

Usage (a few minutes; run on an otherwise idle machine)::

    python benchmarks/engines.py [--workers 1,2,3,4] [--ks 1,8] [--updates 4] [--micro 32] [--out engines.json]

For each P it starts one job of P processes with ``gradaccum.launch`` (each
process imports TensorFlow once) and, in that job, trains the example's CNN
(``harness.cnn``, Adam, a GradientAccumulator with k micro-batches of
``--micro`` images per worker per run, so one update is P * k * micro images):

1. the collective engine: every worker its own graph and data,
   ``CollectiveAllReduce`` inside the accumulator;
2. in-graph replication: the chief's graph with one tower per process, the
   chief feeds P * micro images per run.

It prints a table of seconds per update (chief's wall time, after one warm-up
update) and the bytes one update puts on the network, and the ratio
collective / in-graph. Bytes are counted from the graph, not sniffed
(loopback is shared with other jobs): collective, a ring all-reduce moves
2 (P - 1) / P times ``bytes_per_update`` per worker; in-graph, every remote
tower reads the variables and sends back its gradients on every micro-step,
and receives its shard of the batch. This is a standalone script (the
benchmark harness times benches inside one process; these are jobs of
several); it uses the harness only for the model.
"""
import argparse
import json
import os
import subprocess
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))


def _ints(text):
    return [int(part) for part in text.split(",")]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=_ints, default=[1, 2, 3, 4])
    parser.add_argument("--ks", type=_ints, default=[1, 8])
    parser.add_argument("--updates", type=int, default=4, help="timed updates per engine and k")
    parser.add_argument("--micro", type=int, default=32, help="images per worker per micro-batch")
    parser.add_argument("--out", default=None, help="also write the rows as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ------------------------------------------------------------------ one task


def _model(tf):
    sys.path.insert(0, _HERE)
    import harness

    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    return images, labels, lambda x, y: harness.cnn(x, y)


def _feeds(np, count, size, seed):
    rng = np.random.RandomState(seed)
    return [(rng.rand(size, 28, 28, 1).astype(np.float32), rng.randint(0, 10, size).astype(np.int32))
            for _ in range(count)]


def _timed(sess, train_op, images, labels, feeds, k, updates):
    """Seconds per update, after one warm-up update."""
    for step in range(updates + 1):
        if step == 1:
            start = time.time()
        for run in range(k):
            x, y = feeds[(step * k + run) % len(feeds)]
            sess.run(train_op, {images: x, labels: y})
    return (time.time() - start) / updates


def _collective(tf, np, config, server, k, args):
    from gradaccum import GradientAccumulator, cluster

    with tf.Graph().as_default():
        images, labels, model_fn = _model(tf)
        loss = model_fn(images, labels)
        reducer = cluster.CollectiveAllReduce(tf.compat.v1.train.AdamOptimizer(1e-3), config)
        opt = GradientAccumulator(reducer, k)
        train_op = opt.minimize(loss, tf.compat.v1.train.get_or_create_global_step(), weight=tf.shape(images)[0])
        broadcast = cluster.broadcast_variables(config)
        params = sum(v.shape.num_elements() * v.dtype.size for v in tf.compat.v1.trainable_variables())
        proto = None if config is None else cluster.collective_session_config(config)
        with tf.compat.v1.Session(server.target if server else "", config=proto) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(broadcast)
            seed = 0 if config is None else config.task_index
            seconds = _timed(sess, train_op, images, labels, _feeds(np, 4 * k, args.micro, seed), k, args.updates)
    size = reducer.num_workers
    return {"seconds": seconds, "bytes": 2 * (size - 1) * reducer.bytes_per_update,
            "all_reduces": reducer.all_reduces_per_update, "params_bytes": params}


def _ingraph(tf, np, config, server, k, args, last):
    from gradaccum import GradientAccumulator, cluster, tower

    with tf.Graph().as_default():
        images, labels, model_fn = _model(tf)
        size = 1 if config is None else config.num_towers
        devices = ["/cpu:0"] if config is None else cluster.worker_devices(config)
        var_device = "/cpu:0" if config is None else cluster.variables_device(config)
        with tf.device(var_device):
            step = tf.compat.v1.train.get_or_create_global_step()
        opt = GradientAccumulator(tf.compat.v1.train.AdamOptimizer(1e-3), k)
        result = tower.minimize(opt, model_fn, [images, labels], devices=devices, global_step=step,
                                variables_device=var_device)
        params = sum(v.shape.num_elements() * v.dtype.size for v in tf.compat.v1.trainable_variables())
        stop = cluster.StopSignal(config) if last and config is not None else None
        target = server.target if server else ""
        proto = None if config is None else cluster.session_config(config)
        with tf.compat.v1.Session(target, config=proto) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feeds = _feeds(np, 4 * k, size * args.micro, 0)
            seconds = _timed(sess, result.train_op, images, labels, feeds, k, args.updates)
            if stop is not None:
                stop.send(sess)
    shard = args.micro * (28 * 28 * 4 + 4)
    return {"seconds": seconds, "bytes": (size - 1) * k * (2 * params + shard), "params_bytes": params}


def child(args):
    sys.path.insert(0, _HERE)
    import harness

    tf = harness.setup_tensorflow("tf1")
    import numpy as np
    from gradaccum import cluster

    config = cluster.from_environment()
    server = None
    if config is not None:
        server = cluster.start_server(config, cluster.collective_session_config(config))
        cluster.wait_for_tasks(config, timeout_seconds=120)
    rows = []
    for k in args.ks:
        rows.append(dict(_collective(tf, np, config, server, k, args), engine="collective", k=k))
    if config is not None and not config.is_chief:
        cluster.serve(server, config)
        return
    for i, k in enumerate(args.ks):
        rows.append(dict(_ingraph(tf, np, config, server, k, args, i == len(args.ks) - 1), engine="ingraph", k=k))
    print("ROWS " + json.dumps(rows), flush=True)


# ------------------------------------------------------------------ parent


def _run_job(workers, args):
    command = [sys.executable, os.path.abspath(__file__), "--child", "--ks", ",".join(map(str, args.ks)),
               "--updates", str(args.updates), "--micro", str(args.micro)]
    if workers > 1:
        command = [sys.executable, "-m", "gradaccum.launch", "--workers", str(workers), "--"] + command
    done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=900, env=dict(os.environ, TF_CONFIG=""))
    for line in done.stdout.splitlines():
        if "ROWS " in line:
            return json.loads(line.split("ROWS ", 1)[1])
    raise RuntimeError("P=%d failed (status %d): %s%s" % (workers, done.returncode, done.stdout[-3000:],
                                                          done.stderr[-1000:]))


def _table(results):
    lines = ["| P | k | collective s/update | in-graph s/update | collective / in-graph | "
             "collective bytes/update | in-graph bytes/update |", "|---|---|---|---|---|---|---|"]
    for workers, rows in results:
        for k in sorted({row["k"] for row in rows}):
            col = next(r for r in rows if r["engine"] == "collective" and r["k"] == k)
            ing = next(r for r in rows if r["engine"] == "ingraph" and r["k"] == k)
            lines.append("| %d | %d | %.3f | %.3f | %.2f | %.2f MB | %.2f MB |" % (
                workers, k, col["seconds"], ing["seconds"], col["seconds"] / ing["seconds"],
                col["bytes"] / 1e6, ing["bytes"] / 1e6))
    return lines


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.child:
        child(args)
        return 0
    results = []
    for workers in args.workers:
        started = time.time()
        results.append((workers, _run_job(workers, args)))
        print("P=%d done in %.0f s" % (workers, time.time() - started), file=sys.stderr, flush=True)
    params = results[0][1][0]["params_bytes"]
    print("CNN: %.2f MB of float32 parameters; %d images per worker per micro-batch; %d timed updates"
          % (params / 1e6, args.micro, args.updates))
    print("\n".join(_table(results)))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump([{"workers": w, "rows": rows} for w, rows in results], handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
