"""Ops executed per ``session.run``: how many graph nodes each kind of run executes.

For the benchmarks' CNN setup (``peers.SETUPS["cnn"]``: the CNN of width 16, micro-batch
100, k=5, Adam, ``weight`` = the micro-batch size), this builds three trainers with the
harness (``ours``: ``GradientAccumulator``; ``seeds_manual``: zero / accumulate / apply;
``plain``: Adam on every micro-batch), runs one untraced window, then traces one window
with ``RunOptions(trace_level=FULL_TRACE)`` and counts the nodes of
``RunMetadata.step_stats`` (every device's ``node_stats``, less ``_SOURCE``/``_SINK``).
Counted apart: the nodes whose name holds ``GradientAccumulator`` (the accumulator's scope), and
the wrapped Adam's outside it (``Adam``, ``_power``: apply, slots, beta powers).

Rows: ``ours`` accumulate (micro-steps 1..k-1, must agree) and apply (micro-step k);
``seeds_manual`` zero, accumulate and apply; ``plain`` one run. It measures whichever
``gradaccum`` is importable, so the same script measures a checkout before and after (run it as
a script, not with ``-m``: then ``PYTHONPATH`` comes before the working directory)::

    PYTHONPATH=<checkout before> python benchmarks/ops.py --json ops_tf1.json
    python benchmarks/ops.py --tf-mode tf2 --json ops_tf2.json

``--tf-mode tf1`` (default) is ``disable_v2_behavior()``, ``tf2`` ``disable_eager_execution()``.

``--time N`` also times what the window's decision costs an accumulate-only run, in one
graph (the same CNN, k = 50 so that no run applies): the fused train op (adds, counters,
the ``apply_if_due`` cond not taken) against the accumulator's own ``accumulate_op`` (the
adds and counters alone), N runs of each, interleaved in a new random order each time
(``zero_op`` every 20 runs). It prints the median of the per-pair ratios and the
difference of the medians in ms.
The JSON also lists the accumulator's executed nodes of an accumulate run: ``ours_accumulate_nodes``
(micro-step 2, adding) and ``ours_window_start_nodes`` (micro-step 1, writing).
"""
import argparse
import collections
import functools
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import peers  # noqa: E402

SCOPE = "GradientAccumulator"
PSEUDO = ("_SOURCE", "_SINK")


def traced_nodes(session, fetch, feed=None):
    """The names of the nodes one ``session.run(fetch, feed)`` executes (all devices)."""
    tf = harness._tf()
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    session.run(fetch, feed, options=options, run_metadata=metadata)
    return [node.node_name for dev in metadata.step_stats.dev_stats for node in dev.node_stats
            if node.node_name not in PSEUDO]


def row(nodes):
    adam = [name for name in nodes if SCOPE not in name and ("Adam" in name or "_power" in name)]
    return {"nodes": len(nodes), "accumulator_nodes": sum(SCOPE in name for name in nodes), "adam_nodes": len(adam)}


def measure(setup):
    """``{row: {"nodes", "accumulator_nodes", "adam_nodes"}}``; the accumulator's nodes of micro-steps 2, 1."""
    rows, names = collections.OrderedDict(), {}
    for trainer in ("ours", "seeds_manual", "plain"):
        bench = harness.build_bench(trainer, setup["model"], peers.ROWS[trainer], setup["micro"], setup["k"],
                                    setup["model_args"])
        try:
            bench.run_window()  # Warm-up: the first runs may differ (initial placement, caches).
            window, session, feeds = bench.window, bench.session, bench.feeds
            befores = [traced_nodes(session, op) for op in window.before]
            eaches = [traced_nodes(session, window.each, feed) for feed in feeds]
            afters = [traced_nodes(session, op) for op in window.after]
        finally:
            harness.close([bench])
        if trainer == "ours":
            counts = sorted(set(len(nodes) for nodes in eaches[:-1]))
            if len(counts) > 1:
                print("warning: accumulate runs differ in node count: %s" % counts)
            typical = eaches[1] if len(eaches) > 2 else eaches[0]  # Micro-step 2: adds (step 1 writes).
            rows["ours_accumulate"] = dict(row(typical), micro_step="1..%d" % (len(eaches) - 1),
                                           counts_over_micro_steps=[len(nodes) for nodes in eaches])
            rows["ours_apply"] = dict(row(eaches[-1]), micro_step=str(len(eaches)))
            names = {"ours_accumulate_nodes": sorted(name for name in typical if SCOPE in name),
                     "ours_window_start_nodes": sorted(name for name in eaches[0] if SCOPE in name)}
        elif trainer == "seeds_manual":
            rows["manual_zero"] = row(befores[0])
            rows["manual_accumulate"] = row(eaches[0])
            rows["manual_apply"] = row(afters[0])
        else:
            rows["plain"] = row(eaches[0])
    return rows, names


def time_decision(setup, runs):
    """``(median train/accumulate ratio, median ms difference)``: the cond's cost on a run that only adds."""
    kept = []
    bench = harness.build_bench("decision", setup["model"], functools.partial(harness.ours, keep=kept),
                                setup["micro"], 50, setup["model_args"])
    opt = kept[0]
    fetches = {"train": bench.window.each, "accumulate": opt.accumulate_op}
    times, order = {"train": [], "accumulate": []}, random.Random(0)
    try:
        for index in range(runs + 10):  # The first 10 pairs warm up.
            if index % 20 == 0:
                bench.session.run(opt.zero_op)  # Never 50 adds: no run applies.
            for name in order.sample(sorted(times), 2):
                start = time.perf_counter()
                bench.session.run(fetches[name], bench.feeds[index % len(bench.feeds)])
                if index >= 10:
                    times[name].append(time.perf_counter() - start)
    finally:
        harness.close([bench])
    ratio = statistics.median(a / b for a, b in zip(times["train"], times["accumulate"]))
    return ratio, 1e3 * (statistics.median(times["train"]) - statistics.median(times["accumulate"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tf-mode", choices=("tf1", "tf2"), default="tf1")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--time", type=int, default=0, metavar="N",
                        help="also time train op / accumulate_op on accumulate-only runs, N pairs")
    args = parser.parse_args(argv)
    if args.time < 0:
        parser.error("--time must be >= 0, got %d" % args.time)
    tf = harness.setup_tensorflow(args.tf_mode)
    import gradaccum

    setup = peers.SETUPS["cnn"]
    rows, names = measure(setup)
    print("gradaccum %s (%s), TensorFlow %s, mode %s; cnn width %d, micro-batch %d, k=%d"
          % (getattr(gradaccum, "__version__", "?"), gradaccum.__file__, tf.__version__, args.tf_mode,
             setup["model_args"]["width"], setup["micro"], setup["k"]))
    print("%-18s %8s %20s %6s" % ("run", "nodes", SCOPE, "Adam"))
    for name, counts in rows.items():
        print("%-18s %8d %20d %6d" % (name, counts["nodes"], counts["accumulator_nodes"], counts["adam_nodes"]))
    decision = None
    if args.time:
        ratio, ms = time_decision(setup, args.time)
        decision = {"runs": args.time, "train_over_accumulate": ratio, "ms": ms}
        print("accumulate-only run, train op / accumulate_op (%d interleaved pairs): %.4f, %+.3f ms"
              % (args.time, ratio, ms))
    if args.json:
        result = {"gradaccum": gradaccum.__file__, "tensorflow": tf.__version__, "tf_mode": args.tf_mode,
                  "setup": dict(setup, rows=None), "rows": rows, "decision_cost": decision,
                  "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        result.update(names)
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
