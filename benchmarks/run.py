"""Runs the benchmark families and writes results.md (and JSON): ratios side by side, never timed tests.

Usage::

    python benchmarks/run.py                      # full run, <= 10 min on 2 quiet cores
    python benchmarks/run.py --quick              # a few minutes: the trend, not for quoting
    python benchmarks/run.py --smoke              # every kind of child once, tiny: does it still run?
    python benchmarks/run.py --json benchmarks/results.json
    python benchmarks/run.py --family peers --python /path/to/tf115/bin/python   # TF 1.15
    python benchmarks/run.py --update-docs        # also rewrite docs/guides/performance.md's figures

Each family (``peers.py``, ``features.py``, ``memory.py``, then any other module here
with ``plan``/``measure``/``summarize``: see ``harness.py`` for that API) plans its
children; every child is a fresh interpreter, so each memory peak is clean and
``TF_ENABLE_ONEDNN_OPTS`` can differ per child. This
parent never imports TensorFlow. Writes ``results.md`` (``results_quick.md`` with
``--quick``, ``results_smoke.md`` with ``--smoke``) into ``--output-dir``. A failed child is
reported and the run goes on; the exit status is then 1. Bad flags print one line and exit with status 2.
"""
import datetime
import importlib
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import harness  # noqa: E402
from peers import NOT_TRAINING  # noqa: E402  (imports no TF)

CORE_FAMILIES = ("peers", "features", "memory")


def families():
    """The family modules here: the core ones, then any other ``*.py`` with ``plan``, ``measure``, ``summarize``."""
    names = [name[:-3] for name in sorted(os.listdir(HERE)) if name.endswith(".py")
             and name[:-3] not in CORE_FAMILIES + ("harness", "run", "soak")]
    extra = [name for name in names
             if all(hasattr(importlib.import_module(name), f) for f in ("plan", "measure", "summarize"))]
    return list(CORE_FAMILIES) + extra


# Spec keys that only size or repeat a child; the others (``kind``, ``setup``, ``group``, ``row``,
# ``config``, ``tag``, ``rows``, ``env``, any new one) choose what it runs: its variant.
SIZE_KEYS = ("repeat", "rounds", "error_windows", "update_repeats", "micro", "k", "smoke")


def variant(spec):
    """What a child runs, whatever its size: ``spec`` less ``SIZE_KEYS``, as sorted JSON.

    Example:
      >>> variant({"kind": "time", "group": "towers", "rounds": 3})
      '{"group": "towers", "kind": "time"}'
    """
    return json.dumps(dict((key, value) for key, value in spec.items() if key not in SIZE_KEYS), sort_keys=True)


def smoke_plan(name):
    """Family ``name``'s smoke children: the first child of each variant (``variant``) of its quick plan,
    then of its full plan (a variant only that has), each with ``"smoke": True`` (``harness``'s smoke size).

    Example:
      >>> [spec["group"] for spec in smoke_plan("features")][:2]
      ['statistics_cnn', 'statistics_mlp10m']
    """
    module, specs, seen = importlib.import_module(name), [], set()
    for spec in module.plan(True) + module.plan(False):
        if variant(spec) not in seen:
            seen.add(variant(spec))
            specs.append(dict(spec, smoke=True))
    return specs


# key -> (target, what); the contract. A missing or None value is "not measured".
TARGETS = {
    "mlp10m_weighted_over_unweighted_time": (1.01, "10M MLP, weight given / weight=None, time per micro-step"),
    "mlp10m_overhead_over_floor": (1.10, "10M MLP, (ours - fwd+bwd) / floor, per micro-step"),
    "fused_over_plain_time": (1.02, "the example's CNN, ours / plain training, time per micro-step"),
    "accumulated_peak_over_micro_peak_plus_params": (1.05, "CNN, peak RSS: k micro-batches / (plain micro + params)"),
    "cnn_ingraph_over_best_peer_time": (0.90, "the example's CNN, one run per update / the best of ours, "
                                              "the manual pattern, tensorpack and plain, time per micro-batch"),
    "mlp10m_ingraph_over_best_exact_time": (1.00, "10M MLP, one run per update / the best exact one of ours, the manual "
                                                  "pattern and plain, time per micro-batch"),
    "ingraph_peak_over_micro_peak_plus_params": (1.05, "CNN, peak RSS: one run per update, fed the whole batch / (plain micro "
                                                       "+ params + sums)"),
    "strategy_mirrored_over_plain_time": (1.02, "MirroredStrategy on 2 virtual CPUs, the example's CNN: ours / the "
                                                "strategy's plain training, time per micro-step"),
}
# The A/A row (the same graph built twice) beside a target on that model: the resolution of its ratio.
AA_KEYS = {"mlp10m_weighted_over_unweighted_time": "mlp10m_twin_over_ours_time",
           "strategy_mirrored_over_plain_time": "strategy_plain_twin_over_plain_time",
           "fused_over_plain_time": "cnn_twin_over_ours_time",
           "cnn_ingraph_over_best_peer_time": "cnn_twin_over_ours_time",
           "mlp10m_ingraph_over_best_exact_time": "mlp10m_twin_over_ours_time"}


def parse_args(argv=None):
    """Parses the flags; bad input exits with one line and status 2.

    Example:
      >>> parse_args(["--quick"]).quick
      True
    """
    parser = harness.OneLineParser(description=__doc__.split("\n")[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="few rounds, fewer children: the trend only")
    sizes.add_argument("--smoke", action="store_true",
                       help="one child of every variant of every family, at the smallest size, in seconds: "
                            "that each still runs (its figures mean nothing)")
    parser.add_argument("--json", metavar="PATH", help="also write every figure as JSON to PATH")
    parser.add_argument("--merge", action="store_true",
                        help="with --json: keep PATH's other keys; this run's date, machine, load and command "
                             "go under '<families>_run'")
    parser.add_argument("--tf-mode", choices=("tf1", "tf2"), default="tf1",
                        help="tf1: disable_v2_behavior() (default); tf2: disable_eager_execution() only")
    parser.add_argument("--family", action="append", choices=families(), help="run only these (repeatable)")
    parser.add_argument("--python", default=sys.executable, help="the children's interpreter (another TF)")
    parser.add_argument("--output-dir", default=HERE, help="where results.md goes")
    parser.add_argument("--update-docs", metavar="PAGE", nargs="?", const=DOCS_PAGE, dest="update_docs",
                        help="replace the figures between PAGE's benchmark markers with this run's "
                             "(PAGE: docs/guides/performance.md when omitted)")
    parser.add_argument("--update-readme", metavar="PAGE", dest="update_docs",
                        help="the old name of --update-docs PAGE")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.output_dir):
        parser.error("`--output-dir` %r is not a directory" % args.output_dir)
    if args.smoke and (args.update_docs or args.json):
        parser.error("`--smoke` figures mean nothing: not with %s" % ("--update-docs" if args.update_docs else "--json"))
    if args.update_docs:
        try:
            with open(args.update_docs) as stream:
                text = stream.read()
        except OSError as exc:
            parser.error("`--update-docs` %r cannot be read: %s" % (args.update_docs, exc.strerror))
        if text.count(DOCS_BEGIN) != 1 or text.count(DOCS_END) != 1:
            parser.error("`--update-docs` %r must hold the benchmark markers once each" % args.update_docs)
    args.family = args.family or families()
    return args


def run_family(name, args, log):
    """Runs every child ``name.plan`` asks for; returns ``(results, failures)``.

    Each result carries its ``spec``; a failed child is a one-line entry of ``failures``.
    """
    results, failures = [], []
    specs = smoke_plan(name) if args.smoke else importlib.import_module(name).plan(args.quick)
    for spec in specs:
        spec = dict(spec, mode=args.tf_mode)
        start = time.time()
        try:
            result = harness.run_child(name, spec, 300 if args.quick or args.smoke else 900, spec.get("env"),
                                       args.python)
        except harness.ChildError as exc:
            failures.append("%s: %s" % (name, exc))
            log("FAILED " + failures[-1])
            continue
        results.append(dict(result, spec=spec))
        what = " ".join(str(spec[key]) for key in ("kind", "setup", "tag", "group", "row", "config", "repeat")
                        if spec.get(key))
        log("%s %s: %.0f s" % (name, what, time.time() - start))
    return results, failures


verdict = harness.verdict  # Kept here too: scripts and tests call run.verdict.


def verdicts(summary):
    """``{target key: verdict}`` of this run (see ``verdict``)."""
    return dict((key, verdict(summary.get(key), summary.get(key + "_ci95"), target))
                for key, (target, _) in TARGETS.items())


def headline(summary):
    """Markdown lines: each target key with its value, 95% interval, A/A row and verdict."""
    lines = ["### Headline", ""]
    for key, (target, what) in TARGETS.items():
        peer = " against %s" % summary[key + "_peer"] if summary.get(key + "_peer") else ""
        aa = "; A/A on this model %s%s" % (harness.fmt(summary.get(AA_KEYS[key])), _ci(summary, AA_KEYS[key])) \
            if key in AA_KEYS else ""
        lines.append("- %s (`%s`): **%s**%s%s%s, target <= %.2f: %s." % (
            what, key, harness.fmt(summary.get(key)), _ci(summary, key), peer, aa, target,
            verdict(summary.get(key), summary.get(key + "_ci95"), target)))
    if summary.get("floor_ms") is not None:
        lines.append("- Floor: %.2f ms per micro-step = %.0f MB (one accumulate pass, plus one scaling pass / k) at "
                     "%.1f GB/s (`a += b`, best of TF and numpy each round; TF %.1f, numpy %.1f GB/s); forward + "
                     "backward alone %.2f ms, ours %.2f ms above it." % (
                         summary["floor_ms"], summary["floor_bytes_per_micro_step"] / 1e6,
                         summary["stream_bandwidth_gbs"], summary["stream_tf_gbs"], summary["stream_numpy_gbs"],
                         summary["mlp10m_fwd_bwd_ms"], summary["mlp10m_overhead_ms"]))
    if summary.get("mlp10m_least_possible_overhead_over_floor") is not None:
        lines.append("- Less Adam's apply (%.2f ms once per window), ours is %s times the floor. The least any "
                     "accumulator wrapping this Adam could reach here (k - 1 adds at the stream's speed, no division, "
                     "plus Adam's apply / k) is %s times the floor." % (
                         summary["mlp10m_wrapped_apply_ms"], harness.fmt(summary["mlp10m_own_overhead_over_floor"]),
                         harness.fmt(summary["mlp10m_least_possible_overhead_over_floor"])))
    if summary.get("fused_over_plain_time_onednn_off") is not None:
        lines.append("- CNN, ours / plain with `TF_ENABLE_ONEDNN_OPTS=0` (another process): %s (default: %s)."
                     % (harness.fmt(summary["fused_over_plain_time_onednn_off"]),
                        harness.fmt(summary.get("fused_over_plain_time"))))
    return lines


def _ci(summary, key):
    ci = summary.get(key + "_ci95")
    return "" if not ci or None in ci else " (95%% CI %s-%s)" % (harness.fmt(ci[0]), harness.fmt(ci[1]))


def docs_table(summary):
    """Markdown lines: the performance page's tables, filled from ``summary``."""
    def row(what, key, target="-", digits=3):
        return [what, "**%s**%s" % (harness.fmt(summary.get(key), digits), _ci(summary, key)), target]

    rows = [row("the example's CNN: ours / plain training, time per micro-step", "fused_over_plain_time", "<= 1.02"),
            row("the same with `TF_ENABLE_ONEDNN_OPTS=0`", "fused_over_plain_time_onednn_off"),
            row("the example's CNN, A/A: ours built twice, the second / the first", "cnn_twin_over_ours_time"),
            row("10M MLP: `weight` given / `weight=None`", "mlp10m_weighted_over_unweighted_time", "<= 1.01"),
            row("10M MLP, A/A: ours built twice, the second / the first (the resolution of these ratios)",
                "mlp10m_twin_over_ours_time"),
            row("10M MLP: (ours - forward+backward) / floor", "mlp10m_overhead_over_floor", "<= 1.10"),
            row("the same, less the wrapped Adam's apply (once per window): the accumulator's own cost / floor",
                "mlp10m_own_overhead_over_floor"),
            row("the least any accumulator wrapping this Adam could reach: k - 1 adds at the stream's speed, "
                "no division, plus Adam's apply / k, over the floor", "mlp10m_least_possible_overhead_over_floor"),
            row("the wrapped Adam's apply alone, ms", "mlp10m_wrapped_apply_ms", "-", 2),
            row("floor per micro-step, ms", "floor_ms", "-", 2),
            row("stream bandwidth (`a += b`), GB/s", "stream_bandwidth_gbs", "-", 1),
            row("CNN, peak RSS: ours on k micro-batches / (plain micro-batch + params)",
                "accumulated_peak_over_micro_peak_plus_params", "<= 1.05"),
            row("the example's CNN: one run per update / the best of ours, the manual pattern, "
                "tensorpack and plain, time per micro-batch", "cnn_ingraph_over_best_peer_time", "<= 0.90"),
            row("10M MLP: one run per update / the best exact one of ours, the manual pattern and plain, time per micro-batch",
                "mlp10m_ingraph_over_best_exact_time", "<= 1.00"),
            row("CNN, peak RSS: one run per update, fed the whole batch / (plain micro-batch + params + sums)",
                "ingraph_peak_over_micro_peak_plus_params", "<= 1.05"),
            row("the same, TensorFlow's allocator (BFC) peak", "tf_allocator_ingraph_peak_over_micro_peak_plus_params"),
            row("the same (TF's peak), the whole batch's fed inputs added to the bound",
                "tf_allocator_ingraph_peak_over_micro_peak_plus_params_plus_feed"),
            row("statistics on / off, CNN", "statistics_on_over_off_time_cnn"),
            row("statistics on / off, 10M MLP", "statistics_on_over_off_time_mlp10m"),
            row("window-statistics BN / TF BN under the accumulator, CNN", "window_bn_over_tf_bn_time"),
            row("2 towers: synchronized BN / per-tower BN, time per example", "towers2_sync_bn_over_per_tower_bn_time"),
            row("4 towers / one device (virtual CPUs), time per example", "towers4_over_one_device_time"),
            row("`num_micro_batches` a constant tensor / the same int, CNN", "tensor_k_over_int_k_time_cnn", "<= 1.01"),
            row("`num_micro_batches` a constant tensor / the same int, 10M MLP", "tensor_k_over_int_k_time_mlp10m",
                "<= 1.01"),
            row("MirroredStrategy (2 virtual CPUs), the example's CNN: ours / the strategy's plain training, "
                "time per micro-step", "strategy_mirrored_over_plain_time", "<= 1.02"),
            row("the same, A/A: the strategy's plain training built twice, the second / the first",
                "strategy_plain_twin_over_plain_time"),
            row("MirroredStrategy: runs of one update with a cross-device reduction, ours (the plain strategy: k)",
                "strategy_reductions_per_update", "1", 0)]
    lines = harness.markdown_table(["what", "measured", "target"], rows) + [""]
    peers = [p for p in summary.get("peers", []) if p["name"] not in NOT_TRAINING]
    cells = [[p["model"], p["label"], "skipped: %s" % p["skipped"] if p.get("skipped") and p["time_ratio"] is None
              else "%s%s" % (harness.fmt(p["time_ratio"]), "" if not p.get("time_ratio_ci95") else " (%s-%s)" % (
                  harness.fmt(p["time_ratio_ci95"][0]), harness.fmt(p["time_ratio_ci95"][1]))),
              "-" if p.get("max_rel_error_vs_full_batch") is None else "%.2g" % p["max_rel_error_vs_full_batch"],
              "n/a" if p.get("tf_peak_bytes") is None else "%.0f MB" % (p["tf_peak_bytes"] / harness.MB)]
             for p in peers]
    return lines + harness.markdown_table(
        ["model", "training", "time / ours (95% CI)", "max rel. error vs full batch", "TF peak (BFC)"], cells)


DOCS_PAGE = os.path.join(os.path.dirname(HERE), "docs", "guides", "performance.md")
DOCS_BEGIN = "<!-- benchmarks: begin (python benchmarks/run.py --update-docs docs/guides/performance.md) -->"
DOCS_END = "<!-- benchmarks: end -->"


def update_docs(path, summary):
    """Replaces the text between ``DOCS_BEGIN`` and ``DOCS_END`` in ``path`` with this run's tables.

    Raises:
      ValueError: when the markers are missing.
    """
    with open(path) as stream:
        text = stream.read()
    if text.count(DOCS_BEGIN) != 1 or text.count(DOCS_END) != 1:
        raise ValueError("`--update-docs` %r must hold the markers %r and %r once each"
                         % (path, DOCS_BEGIN, DOCS_END))
    head, rest = text.split(DOCS_BEGIN)
    tail = rest.split(DOCS_END)[1]
    lines = ["Measured %s on %s, TensorFlow %s, `%s` (%.0f s, load average %.1f then %.1f)%s:" % (
        summary["date"], summary["machine"], ", ".join(summary["tensorflow"]), summary["command"].strip(),
        summary["seconds"], summary["load_average"][0], summary["load_average"][1],
        " (--quick: the trend only)" if summary["quick"] else ""), ""] + docs_table(summary)
    with open(path, "w") as stream:
        stream.write(head + DOCS_BEGIN + "\n" + "\n".join(lines) + "\n" + DOCS_END + tail)


_RUN_KEYS = ("date", "quick", "mode", "machine", "tensorflow", "seconds", "load_average", "command", "failures")


def _merged(path, summary, family_names):
    """``path``'s figures with this run's added: its own run facts under ``"<families>_run"``, ``raw`` merged
    per family, ``verdicts`` per target it measured, the other keys replaced."""
    try:
        with open(path) as stream:
            merged = json.load(stream)
    except (OSError, ValueError):
        merged = {}
    for key, value in summary.items():
        if key == "raw":
            merged.setdefault(key, {}).update(value)
        elif key == "verdicts":  # Only the targets this run measured.
            merged.setdefault(key, {}).update((k, v) for k, v in value.items() if summary.get(k) is not None)
        elif key not in _RUN_KEYS:
            merged[key] = value
    merged["_".join(family_names) + "_run"] = dict((key, summary[key]) for key in _RUN_KEYS)
    return merged


def main(argv=None):
    """Runs the chosen families, prints and writes the markdown, writes the JSON; returns the exit status."""
    args = parse_args(argv)
    start, load = time.time(), os.getloadavg()[0]

    def log(message):
        sys.stderr.write("[%4.0f s] %s\n" % (time.time() - start, message))
        sys.stderr.flush()

    summary, lines, failures, raw = {}, [], [], {}
    for name in args.family:
        results, failed = run_family(name, args, log)
        failures += failed
        raw[name] = results
        keys, family_lines = importlib.import_module(name).summarize(results)
        summary.update(keys)
        lines += family_lines + [""]
    versions = sorted(set("%s (%s)" % (r.get("tensorflow"), r.get("mode")) for rs in raw.values() for r in rs))
    summary.update(
        date=datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M UTC"), quick=args.quick, mode=args.tf_mode,
        machine="%s %s, %d CPU cores" % (platform.system(), platform.machine(), os.cpu_count()),
        tensorflow=versions, seconds=time.time() - start, load_average=[load, os.getloadavg()[0]],
        command="python benchmarks/run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        failures=failures, raw=raw)
    summary["verdicts"] = verdicts(summary)
    text = "\n".join(["# gradaccum benchmarks", "",
                      "%s, %s, TensorFlow %s. `%s`, %.0f s, load average %.1f then %.1f%s." % (
                          summary["date"], summary["machine"], ", ".join(versions), summary["command"].strip(),
                          summary["seconds"], load, summary["load_average"][1],
                          " (--quick: the trend, not for quoting)" if args.quick else
                          " (--smoke: that every child runs; the figures mean nothing)" if args.smoke else ""), ""]
                     + ["- FAILED: %s" % failure for failure in failures] + headline(summary) + [""]
                     + ["### The performance page's tables", ""] + docs_table(summary) + [""] + lines) + "\n"
    page = "results_smoke.md" if args.smoke else "results_quick.md" if args.quick else "results.md"
    with open(os.path.join(args.output_dir, page), "w") as stream:
        stream.write(text)
    if args.json:
        written = _merged(args.json, summary, args.family) if args.merge else summary
        with open(args.json, "w") as stream:
            json.dump(written, stream, indent=1, sort_keys=True)
            stream.write("\n")
    sys.stdout.write(text)
    if args.update_docs:
        update_docs(args.update_docs, summary)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
