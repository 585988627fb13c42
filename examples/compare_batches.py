"""Compare a batch of 5,000 in 50 subdivisions with 5,000 at once, a small batch and an adaptive one.

Trains ``fashion_mnist_subdivision.py`` four times, each in its own process
(so that each peak memory is its own), on the same data, with the same seed,
for the same number of epochs, so every run sees the same examples:

1. ``subdivided``: a batch of 5,000 in 50 micro-batches of 100 (the default);
2. ``full``: the same batch of 5,000 at once (``--no-subdivisions``);
3. ``small``: a batch of 100, no accumulation, 50 times as many updates
   (warm-up 50 times as long, in updates; Adam's learning rate
   ``--small-learning-rate``; batch norm's momentum the 50th root of the
   others', so that the moving averages forget at the same rate per example);
4. ``adaptive``: ``--adaptive-batch``: 2 to 50 micro-batches of 100, as many
   as the gradient noise scale says, with the example's defaults and the
   learning rate of the 5,000 runs, scaled by the policy (nothing tuned for
   the batch it picks).

It writes ``compare_batches.png`` (test accuracy against the examples seen
and against the updates, test loss, and the batch per update; the legend
gives each run's wall time and peak memory), ``compare_batches.md`` (a
Markdown table of the same figures) and the runs' ``--json`` summaries into
``--out-dir``. ``--only NAME`` trains only that run and reads the others
from ``--out-dir``; ``--replot`` redraws from the summaries without
training. Bad input: one line, exit status 2.

Example:
  python examples/compare_batches.py --epochs 10 --out-dir docs
"""
import json
import os
import subprocess
import sys
import time

from _cli import OneLineParser, fail

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "fashion_mnist_subdivision.py")
# name -> (label, flags) for the example; the learning rate of "small" is added from the flags.
RUNS = [
    ("subdivided", "5,000 in 50 subdivisions of 100", ["--batch-size", "5000", "--subdivisions", "50"]),
    ("full", "5,000 at once", ["--batch-size", "5000", "--no-subdivisions"]),
    ("small", "100, no accumulation", ["--batch-size", "100", "--no-subdivisions"]),
    ("adaptive", "adaptive: 2 to 50 micro-batches of 100 by the noise scale",
     ["--batch-size", "5000", "--subdivisions", "50", "--adaptive-batch"]),
]


def parse_args(argv=None):
    """Parses the flags; anything unknown is passed on to the example.

    Args:
      argv: the arguments, without the program name.

    Returns:
      ``(args, passed_on)``.

    Example:
      >>> args, rest = parse_args(["--epochs", "2", "--width", "8"])
    """
    parser = OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10, help="epochs of every run (default 10)")
    parser.add_argument("--warmup-updates", type=int, default=10,
                        help="warm-up of the 5,000 runs, in updates; the small batch's is 50 times longer")
    parser.add_argument("--small-learning-rate", type=float, default=0.001,
                        help="Adam's peak learning rate for the batch of 100 (default 0.001)")
    parser.add_argument("--bn-momentum", type=float, default=None,
                        help="batch norm's momentum per update of 5,000 (default: the example's); "
                             "the batch of 100 gets its 50th root")
    parser.add_argument("--out-dir", default=".", help="where the PNG, the table and the summaries go")
    parser.add_argument("--only", choices=[name for name, _, _ in RUNS], action="append",
                        help="train only this run (repeatable; to run them in parallel); the others are read "
                             "from --out-dir, and the PNG and table are written once all of them are there")
    parser.add_argument("--replot", action="store_true", help="do not train: redraw from the summaries")
    args, rest = parser.parse_known_args(argv)
    if args.epochs < 1:
        fail("`--epochs` must be an int >= 1, got %d" % args.epochs)
    if args.bn_momentum is not None and not 0 <= args.bn_momentum < 1:
        fail("`--bn-momentum` must be in [0, 1), got %r" % args.bn_momentum)
    if not os.path.isdir(args.out_dir):
        fail("`--out-dir` %r is not a directory" % args.out_dir)
    return args, rest


def run_flags(name, args, passed_on):
    """Returns the example's flags for run ``name``.

    Args:
      name: ``"subdivided"``, ``"full"``, ``"small"`` or ``"adaptive"``.
      args: this script's flags.
      passed_on: flags for the example, added to every run.

    Returns:
      A list of strings.

    Example:
      >>> run_flags("small", parse_args([])[0], [])[:3]
      ['--batch-size', '100', '--no-subdivisions']
    """
    flags = dict((run, list(extra)) for run, _, extra in RUNS)[name]
    warmup = args.warmup_updates * (50 if name == "small" else 1)
    flags += ["--epochs", str(args.epochs), "--warmup-updates", str(warmup)]
    momentum = args.bn_momentum
    if momentum is None:
        sys.path.insert(0, HERE)
        import fashion_mnist_subdivision as example  # Loads TensorFlow: only when the default is needed.

        momentum = example.BN_MOMENTUM[example.default_bn_stats()]
    if name == "small":
        flags += ["--learning-rate", str(args.small_learning_rate)]
        momentum = round(momentum ** (1.0 / 50), 4)
    return flags + ["--bn-momentum", str(momentum)] + list(passed_on)


def train(name, args, passed_on):
    """Runs the example for run ``name`` in a process of its own.

    Args:
      name, args, passed_on: as for ``run_flags``.

    Returns:
      The run's ``--json`` summary, also saved as ``compare_<name>.json`` in ``--out-dir``.

    Example:
      >>> summary = train("full", args, [])
    """
    path = os.path.join(args.out_dir, "compare_%s.json" % name)
    command = [sys.executable, EXAMPLE] + run_flags(name, args, passed_on) + ["--json", path]
    print("+ %s" % " ".join(command[1:]))
    sys.stdout.flush()
    start = time.time()
    if subprocess.call(command) != 0:
        fail("run %r failed (see above)" % name)
    print("run %s: %.0f s" % (name, time.time() - start))
    with open(path) as handle:
        return json.load(handle)


def batches(summary):
    """The mean batch per update of each epoch (summaries without ``batch_per_epoch`` had a fixed batch).

    Args:
      summary: a run's ``--json`` summary.

    Returns:
      A list of numbers, one per evaluation.

    Example:
      >>> batches({"batch_size": 5000, "examples_seen": [60000, 120000]})
      [5000, 5000]
    """
    return summary.get("batch_per_epoch") or [summary["batch_size"]] * len(summary["examples_seen"])


def updates(summary):
    """The updates applied by each evaluation.

    Args:
      summary: a run's ``--json`` summary.

    Returns:
      A list of ints, one per evaluation.

    Example:
      >>> updates({"batch_size": 5000, "examples_seen": [60000, 120000]})
      [12, 24]
    """
    if summary.get("updates_per_epoch"):
        done = 0
        counts = []
        for count in summary["updates_per_epoch"]:
            done += count
            counts.append(done)
        return counts
    return [seen // summary["batch_size"] for seen in summary["examples_seen"]]


def table(results):
    """Returns the Markdown table of the runs.

    Args:
      results: ``[(name, label, summary)]``.

    Returns:
      A string.

    Example:
      >>> print(table([("full", "5,000 at once", summary)]))
    """
    lines = ["| run | batch per update, first and last epoch | updates | test accuracy, last two evaluations "
             "| final test loss | wall time | CPU time | peak memory |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, label, summary in results:
        sizes = batches(summary)
        lines.append("| %s | %s | %d | %s | %.4f | %.0f s | %.0f s | %.0f MB |" % (
            label, "%d" % sizes[0] if sizes[0] == sizes[-1] else "%d, %d" % (sizes[0], sizes[-1]),
            summary["updates"], ", ".join("%.4f" % a for a in summary["test_accuracy"][-2:]),
            summary["test_loss"][-1], summary["seconds"], summary["cpu_seconds"], summary["peak_rss_mb"]))
    return "\n".join(lines) + "\n"


def plot(results, path):
    """Draws test accuracy against examples seen and against updates, test loss, and the batch, into ``path``.

    Args:
      results: ``[(name, label, summary)]``.
      path: the PNG to write.

    Example:
      >>> plot(results, "compare_batches.png")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(2, 2, figsize=(12, 9))
    (accuracy, by_update), (loss, batch) = panels
    for name, label, summary in results:
        seen = [n / 1e3 for n in summary["examples_seen"]]
        legend = "%s: %d updates, %.0f s (CPU %.0f s), %.0f MB" % (
            label, summary["updates"], summary["seconds"], summary["cpu_seconds"], summary["peak_rss_mb"])
        style = dict(marker="o", markersize=3, label=legend)
        accuracy.plot(seen, summary["test_accuracy"], **style)
        by_update.plot(updates(summary), summary["test_accuracy"], **style)
        loss.plot(seen, summary["test_loss"], **style)
        # Each epoch's batch over that epoch's span of examples, from 0 on.
        batch.plot([0] + seen, batches(summary)[:1] + batches(summary), drawstyle="steps-pre",
                   markevery=list(range(1, len(seen) + 1)), **style)
    for panel in (accuracy, by_update):
        panel.axhline(0.92, color="grey", linewidth=0.8, linestyle=":")
        panel.set(ylabel="test accuracy", ylim=(0.8, 0.93))
    accuracy.set(xlabel="examples seen (thousands)")
    by_update.set(xlabel="updates (log scale)", xscale="log")
    loss.set(xlabel="examples seen (thousands)", ylabel="test loss (mean cross-entropy)", ylim=(0.2, 0.6))
    batch.set(xlabel="examples seen (thousands)", ylabel="examples per update (mean over the epoch, log scale)",
              yscale="log")
    figure.legend(*accuracy.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=8)
    first = results[0][2]
    figure.suptitle("Fashion-MNIST (%s), same seed and examples, %d epochs; legend: updates, wall time (CPU "
                    "time), peak memory" % (first["source"], len(first["examples_seen"])), fontsize=9)
    figure.tight_layout(rect=(0, 0.06, 1, 1))
    figure.savefig(path, dpi=100)


def main(argv=None):
    """Trains (or reads) the runs, then writes the PNG and the table.

    Args:
      argv: the arguments, without the program name.

    Example:
      >>> main(["--replot", "--out-dir", "docs"])
    """
    args, passed_on = parse_args(argv)
    trained = {}
    for name, _, _ in RUNS:
        if not args.replot and (not args.only or name in args.only):
            trained[name] = train(name, args, passed_on)
    results = []
    for name, label, _ in RUNS:
        path = os.path.join(args.out_dir, "compare_%s.json" % name)
        if name not in trained and not os.path.isfile(path):
            if args.only:
                print("%s: not there yet, so no PNG and no table" % path)
                return
            fail("no summary %r to read: train run %r first" % (path, name))
        if name not in trained:
            try:
                with open(path) as handle:
                    trained[name] = json.load(handle)
            except ValueError as exc:
                fail("summary %r cannot be read: %s" % (path, exc))
        results.append((name, label, trained[name]))
    plot(results, os.path.join(args.out_dir, "compare_batches.png"))
    with open(os.path.join(args.out_dir, "compare_batches.md"), "w") as handle:
        handle.write(table(results))
    sys.stdout.write(table(results))


if __name__ == "__main__":
    main()
