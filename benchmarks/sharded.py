"""Sharded optimizer state (gradaccum.ShardedAllReduce, ZeRO stages 1 and 1 + 2) beside the unsharded engine.

Engines: ``unsharded`` (CollectiveAllReduce), ``sharded`` (stage 1,
``ShardedAllReduce``) and ``stage12`` (``ShardedAllReduce(...,
shard_cache=True)``: the accumulation cache sharded too, one all-reduce of
the whole gradient per micro-batch).

For a ~10M-parameter float32 MLP with Adam inside a GradientAccumulator, at
P = 2 and P = 4 loopback workers, each engine runs in its own P fresh
processes (so each peak RSS is its own), the two engines one after the other
at each P. Per worker it reports:

* the bytes of the variables it holds, from its graph: model (trainable),
  cache (the accumulator's state and ``global_step``) and slots (Adam's
  moments and beta powers), per trained parameter;
* its memory three ways: the RSS once built and initialised (``rss_ready``:
  variables allocated, nothing exchanged yet), TensorFlow's own peak
  allocation (variables and transients; the children run with
  ``TF_CPU_ALLOCATOR_USE_BFC=true``, TF >= 2.5) and the process's peak RSS
  (``ru_maxrss``: that plus the gRPC transport's buffers), each against the
  prediction from the variable bytes;
* the bytes it puts on the wire per update, estimated from the graph: a ring
  all-reduce sends ``2 (P - 1) / P`` times its buffer per worker; a
  broadcast tree sends each owner's bytes to P - 1 workers, ``(P - 1) / P``
  times the model per worker on average (where TF < 2.21 cannot broadcast
  from a worker other than rank 0, those owners' variables travel by an
  all-reduce: ``2 (P - 1) / P`` times their bytes); ``stage12`` all-reduces
  the gradient on each of the k micro-batches instead of once;
* the time per update (k micro-batches), median over the timed updates, and
  its ratio to the unsharded engine at the same P (``--rounds`` alternating
  runs of each engine; the median of the per-round ratios).

``--buffer-mb`` sets the engines' ``buffer_bytes`` (the largest message;
smaller messages keep fewer bytes in flight at a time, at some speed).
``--collectives`` also times, at each P and in fresh processes, the
exchanges alone on the model's bytes: the unsharded engine's all-reduce,
stage 1's P broadcasts of a share each, and a ring all-gather of the shares;
and tries TensorFlow's ``CollectiveReduceScatterV2`` on these CPU tasks,
reporting ``runs`` or the first line of its error.

The default model is 8 dense layers of 1120 x 1120 (10.0M parameters), so
that whole variables share out evenly over 2 and 4 workers; with
``--widths 1000,2048,2048,1024,1000`` (9.4M) one layer holds 45% of the
parameters and its owner holds its slots alone (the partition's documented
imbalance).

Usage (the parent never imports TensorFlow)::

    python benchmarks/sharded.py --workers 2,4 --updates 4 --rounds 3 --collectives --json sharded.json

Keys of ``--json``: ``sharded_p4_stage1_bytes_per_param``,
``sharded_p4_stage12_bytes_per_param``, ``unsharded_p4_bytes_per_param``, ``sharded_p4_stage1_peak_rss_over_unsharded``,
``sharded_p4_stage1_time_over_unsharded``, the ``stage12`` ratios (and the
``p2`` ones), the memory drops against the prediction
(``*_predicted_drop_mb``, ``*_ready_rss_drop_mb``, ``*_tf_peak_drop_mb``,
``*_rss_drop_mb``), with ``--collectives`` the ``collectives_p<P>_*`` keys,
plus ``runs``: every worker's figures.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

MB = 2.0 ** 20


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _categories(tf):
    """``{"model": bytes, "cache": bytes, "slots": bytes}`` of this graph's global variables."""
    held = {"model": 0, "cache": 0, "slots": 0}
    trainable = set(tf.compat.v1.trainable_variables())
    for var in tf.compat.v1.global_variables():
        size = var.shape.num_elements() * var.dtype.base_dtype.size
        name = var.op.name
        if var in trainable:
            held["model"] += size
        elif name.endswith(("/Adam", "/Adam_1")) or name in ("beta1_power", "beta2_power"):
            held["slots"] += size
        else:
            held["cache"] += size
    return held


def _mlp(tf, widths):
    x = tf.compat.v1.placeholder(tf.float32, [None, widths[0]], name="x")
    y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
    h = x
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        w = tf.compat.v1.get_variable("w%d" % i, [fan_in, fan_out],
                                      initializer=tf.compat.v1.glorot_uniform_initializer(seed=i))
        b = tf.compat.v1.get_variable("b%d" % i, [fan_out], initializer=tf.compat.v1.zeros_initializer())
        h = tf.matmul(h, w) + b
        if i < len(widths) - 2:
            h = tf.nn.relu(h)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
    return x, y, loss


def _wire_bytes(reducer, size, model_bytes, from_any, k):
    """Bytes this worker sends per update, estimated from the graph (see the module docstring)."""
    ring = 2.0 * (size - 1) / size
    total = ring * reducer.bytes_per_update
    # Stage 2: one all-reduce of the whole gradient per micro-batch.
    total += ring * k * getattr(reducer, "micro_batch_bytes", 0)
    if hasattr(reducer, "broadcasts_per_update"):
        # A broadcast tree: (P - 1) / P of the model per worker on average; the all-reduce that
        # replaces it on TF < 2.21 (owners other than rank 0): at most 2 (P - 1) / P of the model.
        total += ((size - 1.0) / size if from_any else ring) * model_bytes
    return total


def _rss_now():
    """This process's resident set size now (``/proc/self/statm``), in bytes; 0 where there is none."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def child(args):
    """One worker: builds, trains a warm-up update and ``--updates`` timed ones, prints ``RESULT {json}``."""
    import harness  # Beside this script; imports no TensorFlow.

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    tf.compat.v1.disable_v2_behavior()
    import gradaccum
    from gradaccum import _compat, cluster

    config, server = _start(cluster)
    if args.child == "collectives":
        return _report(collectives_child(args, tf, np, config, server))
    widths = [int(w) for w in args.widths.split(",")]
    x, y, loss = _mlp(tf, widths)
    adam = tf.compat.v1.train.AdamOptimizer(1e-4)
    buffer = dict(buffer_bytes=int(args.buffer_mb * MB))
    if args.child == "unsharded":
        reducer = gradaccum.CollectiveAllReduce(adam, config, **buffer)
    else:
        reducer = gradaccum.ShardedAllReduce(adam, config, shard_cache=args.child == "stage12", **buffer)
    opt = gradaccum.GradientAccumulator(reducer, args.k)
    step = tf.compat.v1.train.get_or_create_global_step()
    train = opt.minimize(loss, step, weight=tf.shape(x)[0])
    broadcast = cluster.broadcast_variables(config, tf.compat.v1.trainable_variables())
    held = _categories(tf)
    params = sum(v.shape.num_elements() for v in tf.compat.v1.trainable_variables())
    rng = np.random.RandomState(config.task_index)
    feed = {x: rng.normal(size=(args.micro, widths[0])).astype(np.float32),
            y: rng.randint(0, widths[-1], args.micro)}
    times = []
    with tf.compat.v1.Session(server.target, config=cluster.collective_session_config(config)) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(broadcast)
        rss_ready = _rss_now()
        for update in range(args.updates + 1):  # The first is a warm-up.
            start = time.perf_counter()
            for _ in range(args.k):
                sess.run(train, feed)
            if update:
                times.append(time.perf_counter() - start)
        assert int(sess.run(step)) == args.updates + 1
    result = dict(engine=args.child, workers=len(config.compute_tasks), rank=config.task_index, params=params,
                  held=held, bytes_per_param=sum(held.values()) / float(params),
                  peak_rss=harness.peak_rss_bytes(), rss_ready=rss_ready,
                  # TF's own peak: None where it keeps none (TF < 2.5; ``launch`` turns the BFC allocator on).
                  tf_peak=harness.allocator_peak_bytes(),
                  wire_bytes_per_update=_wire_bytes(reducer, len(config.compute_tasks), held["model"],
                                                    _compat.BROADCAST_FROM_ANY_TASK, args.k),
                  update_seconds=sorted(times)[len(times) // 2], tf_version=tf.__version__)
    return _report(result)


def _start(cluster):
    config = cluster.from_environment()
    server = cluster.start_server(config, cluster.collective_session_config(config))
    cluster.wait_for_tasks(config, timeout_seconds=180)
    return config, server


def _report(result):
    print("RESULT " + json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)  # Not a normal exit: tearing down TensorFlow's gRPC server takes seconds.


def _timed(sess, op, repeats):
    times = []
    for _ in range(repeats + 1):  # The first is a warm-up.
        start = time.perf_counter()
        sess.run(op)
        times.append(time.perf_counter() - start)
    return _median(times[1:])


def collectives_child(args, tf, np, config, server):
    """One worker of ``--collectives``: times the exchanges the engines make, alone, on the model's bytes.

    ``all_reduce``: one all-reduce of the whole float32 gradient (the
    unsharded engine's window); ``broadcasts``: P concurrent broadcasts of a
    1/P share each (stage 1's, from every owner); ``all_gather``: one ring
    all-gather of 1/P shares (what could replace them). Last, whether this TF
    runs ``CollectiveReduceScatterV2`` on these CPU tasks (the first line of
    its error if not): it is last because a failed collective aborts the
    task's collectives for good.
    """
    from gradaccum import _compat, cluster
    from gradaccum.distributed import wire

    size, rank = len(config.compute_tasks), config.task_index
    widths = [int(w) for w in args.widths.split(",")]
    share = sum((a + 1) * b for a, b in zip(widths[:-1], widths[1:])) // size
    ops = _compat._collective_ops()
    keys = iter(range(1 << 20, 1 << 21))
    with tf.device(wire.device(config)):
        model = tf.compat.v1.Variable(np.ones(share * size, np.float32), name="model")
        mine = tf.compat.v1.Variable(np.ones(share, np.float32), name="share")
        exchanges = {
            "all_reduce": _compat.collective_sum(model.read_value(), size, 1, next(keys)),
            "broadcasts": tf.group(*[_compat.collective_broadcast_from(mine.read_value(), owner == rank, owner == 0,
                                                                     size, 1, next(keys)) for owner in range(size)]),
            "all_gather": ops.all_gather(tf.identity(mine), size, 1, next(keys))}
    result = {"engine": "collectives", "workers": size, "rank": rank, "share_bytes": share * 4,
              "tf_version": tf.__version__}
    with tf.compat.v1.Session(server.target, config=cluster.collective_session_config(config)) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for name, op in sorted(exchanges.items()):
            result[name + "_seconds"] = _timed(sess, op, args.updates)
        result["reduce_scatter"] = _probe_reduce_scatter(tf, sess, model, size, next(keys))
    return result


def _probe_reduce_scatter(tf, sess, model, size, key):
    """``"runs"``, or why this TF cannot reduce-scatter here (the error's first line)."""
    from tensorflow.python.ops import gen_collective_ops

    if not hasattr(gen_collective_ops, "collective_reduce_scatter_v2"):
        return "no CollectiveReduceScatterV2 op in this TensorFlow"
    with tf.device(model.device):
        scattered = gen_collective_ops.collective_reduce_scatter_v2(
            model.read_value(), group_size=size, group_key=1, instance_key=key, ordering_token=[], merge_op="Add",
            final_op="Id", timeout_seconds=60.0)
    try:
        sess.run(scattered)
        return "runs"
    except tf.errors.OpError as error:
        lines = error.message.splitlines()
        said = [line for line in lines if "implementation" in line or "CollectiveExecutor" in line] or lines
        return said[0].strip()[:200]


def launch(engine, workers, args):
    """Runs one engine on ``workers`` loopback processes; returns their results, rank order."""
    spec = {"worker": ["127.0.0.1:%d" % port for port in _free_ports(workers)]}
    command = [sys.executable, os.path.abspath(__file__), "--child", engine, "--widths", args.widths,
               "--k", str(args.k), "--micro", str(args.micro), "--updates", str(args.updates),
               "--buffer-mb", str(args.buffer_mb)]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CPU_ALLOCATOR_USE_BFC="true")
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                              env=dict(env, TF_CONFIG=json.dumps({"cluster": spec,
                                                                  "task": {"type": "worker", "index": i}})))
             for i in range(workers)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=args.timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            if proc.returncode != 0 or not lines:
                raise RuntimeError("%s worker failed (status %s): %s" % (engine, proc.returncode, err[-2000:]))
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return results


def _median(values):
    values = sorted(values)
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2.0


def summarize(runs):
    """The keys of ``--json`` from ``{(engine, P): [round: [per-worker results]]}``.

    Per round, the worst worker's bytes and peak RSS and worker 0's time per
    update (every worker waits for the others in each update); a ratio is
    the median over the rounds of the per-round ratios.
    """
    out = {}
    for (engine, workers), rounds in sorted(runs.items()):
        if engine not in _STAGES or ("unsharded", workers) not in runs:
            continue
        base, tag = runs[("unsharded", workers)], "sharded_p%d_%s" % (workers, _STAGES[engine])
        worst = lambda results, key: max(r[key] for r in results)  # noqa: E731
        out[tag + "_bytes_per_param"] = worst(rounds[0], "bytes_per_param")
        out["unsharded_p%d_bytes_per_param" % workers] = worst(base[0], "bytes_per_param")
        out[tag + "_peak_rss_over_unsharded"] = _median(
            [worst(s, "peak_rss") / float(worst(u, "peak_rss")) for s, u in zip(rounds, base)])
        out[tag + "_time_over_unsharded"] = _median(
            [s[0]["update_seconds"] / u[0]["update_seconds"] for s, u in zip(rounds, base)])
        out[tag + "_wire_over_unsharded"] = (worst(rounds[0], "wire_bytes_per_update")
                                             / worst(base[0], "wire_bytes_per_update"))
        out[tag + "_wire_mb_per_update"] = worst(rounds[0], "wire_bytes_per_update") / MB
        out[tag + "_rss_drop_mb"] = _median(
            [(worst(u, "peak_rss") - worst(s, "peak_rss")) / MB for s, u in zip(rounds, base)])
        out[tag + "_predicted_drop_mb"] = (
            sum(base[0][0]["held"].values()) - max(sum(r["held"].values()) for r in rounds[0])) / MB
        out.update(_drops(tag, rounds, base))
    return out


def _drops(tag, rounds, base):
    """RSS once initialised (mean over the workers), and TensorFlow's own peak (the worst worker's), per
    round: how far each fell from the unsharded engine's, in MB (median over the rounds)."""
    mean = lambda results, key: sum(r[key] for r in results) / float(len(results))  # noqa: E731
    out = {tag + "_ready_rss_drop_mb": _median([(mean(u, "rss_ready") - mean(s, "rss_ready")) / MB
                                                for s, u in zip(rounds, base)])}
    if all(r.get("tf_peak") for results in rounds + base for r in results):
        peaks = [(max(r["tf_peak"] for r in s), max(r["tf_peak"] for r in u)) for s, u in zip(rounds, base)]
        out[tag + "_tf_peak_over_unsharded"] = _median([mine / float(theirs) for mine, theirs in peaks])
        out[tag + "_tf_peak_drop_mb"] = _median([(theirs - mine) / MB for mine, theirs in peaks])
    return out


def summarize_collectives(probes):
    """``collectives_p<P>_*`` keys from ``{P: [per-worker results]}``: worker 0's seconds per exchange, stage 1's
    exchanges (the all-reduce, then the broadcasts) over the unsharded engine's (the all-reduce), and what
    became of the reduce-scatter."""
    out = {}
    for workers, results in sorted(probes.items()):
        tag, first = "collectives_p%d_" % workers, results[0]
        for name in ("all_reduce", "broadcasts", "all_gather"):
            out[tag + name + "_seconds"] = first[name + "_seconds"]
        out[tag + "stage1_exchange_over_unsharded"] = (
            (first["all_reduce_seconds"] + first["broadcasts_seconds"]) / first["all_reduce_seconds"])
        out[tag + "reduce_scatter"] = first["reduce_scatter"]
    return out


_STAGES = {"sharded": "stage1", "stage12": "stage12"}
ENGINES = ("unsharded",) + tuple(_STAGES)


def _table(runs):
    lines = ["| engine | P | rank | model MB | cache MB | slots MB | B/param | RSS ready MB | peak RSS MB | TF peak MB "
             "| wire MB/update | s/update |", "| --- " * 12 + "|"]
    for (engine, workers), rounds in sorted(runs.items(), key=lambda item: (item[0][1], item[0][0] != "unsharded",
                                                                              item[0][0])):
        for r in rounds[0]:
            lines.append("| %s | %d | %d | %.1f | %.1f | %.1f | %.2f | %.0f | %.0f | %s | %.1f | %.3f |" % (
                engine, workers, r["rank"], r["held"]["model"] / MB, r["held"]["cache"] / MB,
                r["held"]["slots"] / MB, r["bytes_per_param"], r["rss_ready"] / MB, r["peak_rss"] / MB,
                "%.0f" % (r["tf_peak"] / MB) if r.get("tf_peak") else "n/a", r["wire_bytes_per_update"] / MB,
                r["update_seconds"]))
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4", help="worker counts, e.g. 2,4")
    parser.add_argument("--widths", default=",".join(["1120"] * 9),
                        help="MLP widths (default: 8 layers of 1120 x 1120, 10.0M params)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each engine, alternating, per P")
    parser.add_argument("--k", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--micro", type=int, default=16, help="examples per micro-batch")
    parser.add_argument("--updates", type=int, default=4, help="timed updates per run (after one warm-up)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--engines", default="unsharded,sharded,stage12", help="engines to run, in round 0's order")
    parser.add_argument("--buffer-mb", type=float, default=16.0,
                        help="the engines' buffer_bytes, in MB (the largest message; default 16, theirs)")
    parser.add_argument("--collectives", action="store_true",
                        help="also time the exchanges alone at each P (and try a reduce-scatter)")
    parser.add_argument("--child", choices=ENGINES + ("collectives",), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [engine for engine in args.engines.split(",") if engine and engine not in ENGINES]
    if unknown:
        parser.error("--engines: unknown engine %r (known: %s)" % (unknown[0], ", ".join(ENGINES)))
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        return child(args)
    runs, probes = {}, {}
    for workers in [int(w) for w in args.workers.split(",")]:
        if args.collectives:
            probes[workers] = launch("collectives", workers, args)
        engines = [engine for engine in args.engines.split(",") if engine]
        for round_ in range(args.rounds):  # Alternating: round 0's order in even rounds, reversed in odd ones.
            for engine in engines[::1 if round_ % 2 == 0 else -1]:
                started = time.time()
                runs.setdefault((engine, workers), []).append(launch(engine, workers, args))
                print("%s P=%d round %d: %.0f s" % (engine, workers, round_, time.time() - started),
                      file=sys.stderr, flush=True)
    summary = dict(summarize(runs), **summarize_collectives(probes))
    if runs:
        print(_table(runs))
        print()
    for key, value in sorted(summary.items()):
        print("%-48s %s" % (key, value if isinstance(value, str) else "%.3f" % value))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dict(summary, runs=[r for rounds in runs.values() for results in rounds for r in results]
                           + [r for results in probes.values() for r in results],
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())), handle, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
