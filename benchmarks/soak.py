"""Soak: many micro-steps of fused accumulation in a finalized graph, resident memory sampled.

Usage::

    python benchmarks/soak.py                 # 20,000 micro-steps, ~1-2 min on 2 cores
    python benchmarks/soak.py --steps 100000 --k 16

A small MLP (784 -> ``--width`` -> 10) is trained through
``gradaccum.GradientAccumulator`` (Adam, ``--k`` micro-batches per update,
``weight`` = the micro-batch size), with micro-batches of cycling sizes so
that uneven windows are exercised too. The graph is finalized before the
first step, so any op added while training raises. Resident memory (psutil)
is sampled every ``--sample-every`` micro-steps. It prints the series, then
start / end / max / slope per 1,000 steps (least squares, after the
``--warmup`` steps) and a verdict line: ``FLAT`` when the slope times the run
length stays under ``--tolerance-mb``, else ``GROWING`` (exit status 1).
Not a test: it is not run in CI.

Graph state: the MLP's ``mlp/...`` variables, ``global_step``, Adam's slots,
the accumulator's state (see ``gradaccum.window.accumulator``).
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import harness  # noqa: E402  (after the path; it imports no TensorFlow)

MICRO_BATCH_SIZES = (16, 24, 32, 40, 8)  # Cycled: uneven micro-batches, several shapes.


def parse_args(argv=None):
    """Parses and checks the flags; bad input exits with one line.

    Args:
      argv: the arguments, without the program name.

    Returns:
      An ``argparse.Namespace``.

    Example:
      >>> parse_args(["--steps", "1000"]).steps
      1000
    """
    parser = harness.OneLineParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--steps", type=int, default=20000, help="micro-steps (default 20000)")
    add("--k", type=int, default=8, help="micro-batches per applied update (default 8)")
    add("--width", type=int, default=64, help="hidden units of the MLP (default 64)")
    add("--sample-every", type=int, default=250, help="micro-steps between RSS samples (default 250)")
    add("--warmup", type=int, default=1000, help="micro-steps left out of the slope (default 1000)")
    add("--tolerance-mb", type=float, default=8.0,
        help="largest projected growth over the run still called flat (default 8 MB)")
    add("--tf-mode", choices=("tf1", "tf2"), default="tf1", help="TensorFlow behaviour (default tf1)")
    args = parser.parse_args(argv)
    for flag in ("steps", "k", "width", "sample_every"):
        if getattr(args, flag) < 1:
            parser.error("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if not 0 <= args.warmup < args.steps:
        parser.error("`--warmup` must be >= 0 and < `--steps` %d, got %d" % (args.steps, args.warmup))
    if not args.tolerance_mb > 0:
        parser.error("`--tolerance-mb` must be > 0, got %r" % args.tolerance_mb)
    return args


def slope_per_1000(samples):
    """Least-squares slope of ``(step, bytes)`` samples, in bytes per 1,000 steps.

    Args:
      samples: list of ``(step, rss_bytes)``, at least two distinct steps.

    Returns:
      A float (0.0 with fewer than two samples).

    Example:
      >>> slope_per_1000([(0, 100.0), (1000, 110.0), (2000, 120.0)])
      10.0
    """
    if len(samples) < 2:
        return 0.0
    mean_x = sum(s for s, _ in samples) / float(len(samples))
    mean_y = sum(r for _, r in samples) / float(len(samples))
    spread = sum((s - mean_x) ** 2 for s, _ in samples)
    return 1000.0 * sum((s - mean_x) * (r - mean_y) for s, r in samples) / spread if spread else 0.0


def summarize(samples, steps, warmup, tolerance_mb):
    """Turns the RSS series into the figures and the verdict.

    Args:
      samples: list of ``(step, rss_bytes)``, the first at step 0.
      steps: micro-steps run.
      warmup: micro-steps left out of start and slope.
      tolerance_mb: largest projected growth over ``steps`` called flat.

    Returns:
      A dict: ``start_mb`` (first sample after the warm-up), ``end_mb``,
      ``max_mb``, ``slope_mb_per_1000``, ``projected_growth_mb`` and ``flat``.

    Example:
      >>> summarize([(0, 1e8), (1000, 1e8), (2000, 1e8)], 2000, 1000, 8.0)["flat"]
      True
    """
    steady = [(step, rss) for step, rss in samples if step >= warmup] or samples[-1:]
    slope = slope_per_1000(steady) / 2.0 ** 20
    projected = slope * steps / 1000.0
    return {"start_mb": steady[0][1] / 2.0 ** 20, "end_mb": samples[-1][1] / 2.0 ** 20,
            "max_mb": max(rss for _, rss in samples) / 2.0 ** 20, "first_mb": samples[0][1] / 2.0 ** 20,
            "slope_mb_per_1000": slope, "projected_growth_mb": projected, "flat": projected <= tolerance_mb}


def build(args):
    """Builds the MLP's fused train op, initialises it and finalizes the graph.

    TensorFlow must already be in the wanted behaviour (``main`` does that).

    Args:
      args: parsed flags.

    Returns:
      ``(session, train_op, global_step, feeds)``: ``feeds`` holds one feed
      dict per size in ``MICRO_BATCH_SIZES``.

    Example:
      >>> session, train_op, global_step, feeds = build(parse_args([]))
    """
    import tensorflow as tf  # Already in the wanted behaviour.

    bench = harness.build_bench("ours", "mlp", harness.ours, MICRO_BATCH_SIZES[0], args.k, {"widths": [args.width]})
    images, labels = list(bench.feeds[0])
    feeds = [harness.random_feeds(images, labels, size, 1, seed)[0] for seed, size in enumerate(MICRO_BATCH_SIZES)]
    global_step = tf.compat.v1.train.get_global_step(bench.session.graph)
    return bench.session, bench.window.each, global_step, feeds


def soak(session, train_op, feeds, steps, sample_every):
    """Runs ``steps`` micro-steps, sampling the resident set size.

    Args:
      session: the session.
      train_op: the fused train op.
      feeds: feed dicts, cycled.
      steps: micro-steps.
      sample_every: micro-steps between samples.

    Returns:
      List of ``(step, rss_bytes)``, from step 0 to ``steps``.

    Example:
      >>> samples = soak(session, train_op, feeds, 1000, 100)
    """
    import psutil

    process = psutil.Process()
    samples = [(0, process.memory_info().rss)]
    for step in range(1, steps + 1):
        session.run(train_op, feeds[(step - 1) % len(feeds)])
        if step % sample_every == 0 or step == steps:
            samples.append((step, process.memory_info().rss))
    return samples


def report(samples, figures, args, facts):
    """Prints the series (ten samples a line), the figures and the verdict line.

    Args:
      samples: list of ``(step, rss_bytes)``.
      figures: a ``summarize`` result.
      args: parsed flags.
      facts: dict with ``seconds``, ``global_step``, ``expected_step``.

    Example:
      >>> report(samples, summarize(samples, 20000, 1000, 8.0), args, facts)
    """
    print("soak: %d micro-steps of fused accumulation (MLP 784-%d-10, k=%d, micro-batches %s), finalized "
          "graph, %s behaviour, %.0f s" % (args.steps, args.width, args.k, list(MICRO_BATCH_SIZES),
                                           args.tf_mode, facts["seconds"]))
    print("RSS (MB) every %d micro-steps:" % args.sample_every)
    values = ["%.1f" % (rss / 2.0 ** 20) for _, rss in samples]
    for start in range(0, len(values), 10):
        print("  step %6d: %s" % (samples[start][0], " ".join(values[start:start + 10])))
    print("global_step %d after %d micro-steps (expected %d: one per applied update)"
          % (facts["global_step"], args.steps, facts["expected_step"]))
    print("RSS: at step 0 %.1f MB, start (step %d) %.1f MB, end %.1f MB, max %.1f MB, slope %+.3f MB per "
          "1000 micro-steps (projected %+.2f MB over the run)" % (
              figures["first_mb"], args.warmup, figures["start_mb"], figures["end_mb"], figures["max_mb"],
              figures["slope_mb_per_1000"], figures["projected_growth_mb"]))
    print("verdict: %s (projected growth %+.2f MB vs tolerance %.1f MB; end - start %+.1f MB)" % (
        "FLAT" if figures["flat"] else "GROWING", figures["projected_growth_mb"], args.tolerance_mb,
        figures["end_mb"] - figures["start_mb"]))


def main(argv=None):
    """Runs the soak and prints the report.

    Args:
      argv: the arguments, without the program name.

    Returns:
      0 when memory is flat and ``global_step`` counted updates, else 1.

    Example:
      >>> main(["--steps", "2000"])
    """
    args = parse_args(argv)
    harness.setup_tensorflow(args.tf_mode)
    session, train_op, global_step, feeds = build(args)
    start = time.time()
    samples = soak(session, train_op, feeds, args.steps, args.sample_every)
    facts = {"seconds": time.time() - start, "global_step": int(session.run(global_step)),
             "expected_step": args.steps // args.k}
    session.close()
    figures = summarize(samples, args.steps, args.warmup, args.tolerance_mb)
    report(samples, figures, args, facts)
    return 0 if figures["flat"] and facts["global_step"] == facts["expected_step"] else 1


if __name__ == "__main__":
    sys.exit(main())
