"""Benchmarks of gradaccum: memory and time of accumulation, towers, wide accumulators.

Usage::

    python benchmarks/run.py            # full run, ~10 min on 2 quiet cores
    python benchmarks/run.py --quick    # < 60 s: for the trend, not for quoting
    python benchmarks/run.py --json results.json

Prints a markdown report and writes ``results.md`` and ``results.png`` (with
``--quick``: ``results_quick.md`` and ``results_quick.png``) into
``--output-dir`` (default: this directory).

What it measures, each configuration in a fresh process started with
``sys.executable`` (``bench_child.py``), so that every peak is clean:

1. Memory of one effective update of a batch B of the example's CNN: B
   directly, B as k micro-batches through ``GradientAccumulator``, and plain
   training (no accumulator) on the same k micro-batches of B/k, for each k.
   Peak RSS (``getrusage`` and psutil sampling), median of ``--repeats``
   processes run interleaved; and TensorFlow's peak allocator bytes, in one
   more process per configuration with ``TF_CPU_ALLOCATOR_USE_BFC=true`` (the
   default CPU allocator keeps no statistics).
2. Time per example of the fused train op, plain training at the same
   micro-batch, the manual zero/accumulate/apply pattern, float64
   accumulators, and tensorpack / Horovod when installed: the example's CNN
   and a small MLP. All variants of a model are built in one process and
   timed in interleaved rounds; a ratio is the median of per-round ratios,
   with a distribution-free 95% confidence interval.
3. Towers: 1, 2 and 4 towers on virtual CPU devices against one device.

The parent process never imports TensorFlow. Bad flags print one line and
exit with status 2; a failed or timed-out child prints one line and exits 1.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import bench_report  # noqa: E402

CHILD = os.path.join(HERE, "bench_child.py")
RESULT_PREFIX = "BENCH_RESULT "  # bench_child.RESULT_PREFIX, without importing TensorFlow here.
CNN_VARIANTS = ["plain", "fused", "manual", "fused_float64", "tensorpack", "horovod"]
MLP_VARIANTS = ["plain", "fused", "manual", "fused_float64"]
TOWER_VARIANTS = ["one_device", "towers1", "towers2", "towers4"]

# Sized so that the full run takes ~10 minutes on 2 quiet cores while the full
# batch still costs clearly more memory than a micro-batch; --quick keeps every
# ratio. A block of this VM's CNN steps varies by ~10% from run to run, so the
# CNN needs ~120 paired rounds for a 95% interval of about +-2% on its ratios.
# The MLP is tiny (784-16-10, micro-batches of 8) so that the per-step
# overhead, not arithmetic, dominates: the worst case for accumulation.
PLANS = {
    "full": {
        "batch": 1000, "ks": [1, 2, 5, 10, 25, 50], "repeats": 3, "allocator": True,
        "memory_timeout": 900, "time_timeout": 3600,
        "groups": [
            {"name": "cnn", "model": "cnn", "variants": CNN_VARIANTS, "micro": 100, "k": 5, "rounds": 121,
             "windows": 1},
            {"name": "mlp", "model": "mlp", "variants": MLP_VARIANTS, "width": 16, "micro": 8, "k": 10,
             "rounds": 61, "windows": 20},
            {"name": "towers", "model": "cnn", "variants": TOWER_VARIANTS, "micro": 200, "k": 1, "cpus": 4,
             "rounds": 41, "windows": 1},
        ],
    },
    "quick": {
        "batch": 400, "ks": [10], "repeats": 1, "allocator": False,
        "memory_timeout": 240, "time_timeout": 600,
        "groups": [
            {"name": "cnn", "model": "cnn", "variants": CNN_VARIANTS, "micro": 50, "k": 2, "rounds": 5,
             "windows": 1},
            {"name": "mlp", "model": "mlp", "variants": MLP_VARIANTS, "width": 16, "micro": 8, "k": 10,
             "rounds": 5, "windows": 5},
            {"name": "towers", "model": "cnn", "variants": TOWER_VARIANTS, "micro": 50, "k": 1, "cpus": 4,
             "rounds": 3, "windows": 1},
        ],
    },
}


class ChildError(RuntimeError):
    """A measurement child failed, timed out, or printed no result."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        fail(message)


def fail(message, status=2):
    """Prints ``message`` as one line on stderr and exits with ``status``.

    Args:
      message: the error.
      status: the exit status (2: bad input, 1: a failed measurement).

    Example:
      >>> fail("`--batch` must be divisible by 50, got 1001")
    """
    sys.stderr.write("run.py: error: %s\n" % " ".join(str(message).split()))
    sys.exit(status)


def parse_args(argv=None):
    """Parses and checks the flags; bad input exits with one line.

    Args:
      argv: the arguments, without the program name.

    Returns:
      An ``argparse.Namespace`` whose ``plan`` is the chosen ``PLANS`` entry,
      with ``--batch`` and ``--repeats`` applied.

    Example:
      >>> parse_args(["--quick"]).plan["batch"]
      400
    """
    parser = _OneLineParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small and fast (< 60 s): the trend only")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--tf-mode", choices=("tf1", "tf2"), default="tf1",
                        help="tf1: disable_v2_behavior() (default); tf2: disable_eager_execution() only")
    parser.add_argument("--batch", type=int, help="the memory benchmark's batch B (default: 1000, quick 400)")
    parser.add_argument("--repeats", type=int, help="processes per memory configuration (default: 3, quick 1)")
    parser.add_argument("--output-dir", default=HERE, help="where results*.md and results*.png go")
    args = parser.parse_args(argv)
    plan = json.loads(json.dumps(PLANS["quick" if args.quick else "full"]))  # A deep copy.
    for flag in ("batch", "repeats"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag, value))
        plan[flag] = plan[flag] if value is None else value
    bad = [k for k in plan["ks"] if plan["batch"] % k]
    if bad:
        fail("`--batch` %d must be divisible by every k in %s, not by %s"
             % (plan["batch"], plan["ks"], bad))
    if not os.path.isdir(args.output_dir):
        fail("`--output-dir` %r is not a directory" % args.output_dir)
    args.plan = plan
    return args


def run_child(kind, spec, timeout, allocator=False):
    """Runs ``bench_child.py kind spec`` in a fresh ``sys.executable`` and returns its result.

    Args:
      kind: ``"memory"`` or ``"time"``.
      spec: the JSON-serialisable spec (holds ``mode``).
      timeout: seconds before the child is killed.
      allocator: run with TensorFlow's BFC CPU allocator, which keeps statistics.

    Returns:
      The child's result dict.

    Raises:
      ChildError: on a timeout, a non-zero exit or no result line; the
        message holds the child's last stderr line.

    Example:
      >>> run_child("memory", {"mode": "tf1", "model": "cnn", "variant": "fused", "micro": 10, "k": 2}, 300)
    """
    # The child sets TF_USE_LEGACY_KERAS itself, only where tf_keras is installed.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CPU_ALLOCATOR_USE_BFC", None)
    if allocator:
        env["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    command = [sys.executable, CHILD, kind, json.dumps(spec)]
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ChildError("%s child timed out after %d s: %s" % (kind, timeout, json.dumps(spec))) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise ChildError("%s child exited with status %d (%s): %s"
                         % (kind, done.returncode, last_error_line(done.stderr), json.dumps(spec)))
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def last_error_line(stderr):
    """Returns the last exception line of a traceback in ``stderr``, else its last line.

    Args:
      stderr: a child's standard error.

    Returns:
      One line (``"no output"`` when empty).

    Example:
      >>> last_error_line("Traceback ...\n  File x\nValueError: bad\n")
      'ValueError: bad'
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b", line)]
    return (errors or lines or ["no output"])[-1]


def memory_configs(plan):
    """Lists the memory configurations: the full batch, then plain and accumulated per k.

    Args:
      plan: a ``PLANS`` entry (``batch``, ``ks``).

    Returns:
      A list of dicts with ``config``, ``variant``, ``micro`` and ``k``.

    Example:
      >>> [c["config"] for c in memory_configs({"batch": 10, "ks": [1, 5]})]
      ['full', 'plain', 'fused', 'fused']
    """
    batch = plan["batch"]
    configs = [{"config": "full", "variant": "plain", "micro": batch, "k": 1}]
    # Plain training on B/1 is the full batch itself: measured once.
    configs += [{"config": "plain", "variant": "plain", "micro": batch // k, "k": k} for k in plan["ks"] if k > 1]
    configs += [{"config": "fused", "variant": "fused", "micro": batch // k, "k": k} for k in plan["ks"]]
    return configs


def _log(message):
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def measure_memory(plan, mode, log=_log):
    """Runs every memory configuration ``repeats`` times, interleaved, plus the allocator pass.

    Args:
      plan: a ``PLANS`` entry.
      mode: ``"tf1"`` or ``"tf2"``.
      log: called with one progress line per child.

    Returns:
      The children's results, each tagged with ``allocator`` (bool).

    Raises:
      ChildError: when a child fails.

    Example:
      >>> records = measure_memory(PLANS["quick"], "tf1")
    """
    configs = memory_configs(plan)
    passes = [False] * plan["repeats"] + ([True] if plan["allocator"] else [])
    records = []
    for allocator in passes:
        for config in configs:
            record = run_child("memory", dict(config, model="cnn", mode=mode), plan["memory_timeout"], allocator)
            record["allocator"] = allocator
            records.append(record)
            log("memory %d/%d: %-5s k=%-2d micro-batch %-4d %s peak RSS %4.0f MB, TF peak %s, %.1f s" % (
                len(records), len(passes) * len(configs), config["config"], config["k"], config["micro"],
                "BFC allocator:" if allocator else "default:     ", record["peak_rss_bytes"] / bench_report.MB,
                "n/a" if record["tf_peak_bytes"] is None else "%.0f MB" % (record["tf_peak_bytes"] / bench_report.MB),
                record["seconds"]))
    return records


def machine_description(gpus):
    """Describes this machine in one phrase: system, cores, memory, GPUs.

    Args:
      gpus: the number of GPUs TensorFlow saw.

    Returns:
      A string such as ``"Linux x86_64, 2 CPU cores, 24 GB RAM, CPU only"``.

    Example:
      >>> machine_description(0)
    """
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024.0 ** 3
    return "%s %s, %d CPU cores, %.0f GB RAM, %s" % (
        platform.system(), platform.machine(), os.cpu_count(), memory,
        "CPU only" if not gpus else "%d GPU(s)" % gpus)


def _notes(plan, time_result, seconds, loads):
    notes = ["Memory: B = %d, k in %s, %d process(es) per configuration%s." % (
        plan["batch"], plan["ks"], plan["repeats"],
        "" if plan["allocator"] else "; TF allocator peaks not measured (--quick)")]
    for group in time_result["groups"]:
        for variant, reason in sorted(group["skipped"].items()):
            notes.append("%s: %s skipped (%s)." % (group["name"], variant, reason))
    notes.append("Took %.0f s; load average %.1f at the start, %.1f at the end (2 cores; other processes "
                 "may have been running: the interleaving makes them hit every variant alike)."
                 % (seconds, loads[0], loads[1]))
    return notes


def write_outputs(summary, args):
    """Writes the plot, the markdown report and (with ``--json``) the JSON.

    Args:
      summary: a ``bench_report.summarize`` result (``plot`` is set here).
      args: the parsed flags.

    Returns:
      The markdown text.

    Example:
      >>> text = write_outputs(summary, args)
    """
    suffix = "_quick" if args.quick else ""
    png = os.path.join(args.output_dir, "results%s.png" % suffix)
    summary["plot"] = os.path.basename(png) if bench_report.plot(summary, png) else None
    if summary["plot"] is None:
        summary["notes"].append("matplotlib is not installed: no plot.")
    text = bench_report.render_markdown(summary)
    with open(os.path.join(args.output_dir, "results%s.md" % suffix), "w") as stream:
        stream.write(text)
    if args.json:
        bench_report.write_json(summary, args.json)
    return text


def main(argv=None):
    """Runs the benchmarks the flags ask for and prints the markdown report.

    Args:
      argv: the arguments, without the program name.

    Returns:
      0 (failures exit through ``fail``).

    Example:
      >>> main(["--quick", "--json", "/tmp/bench.json"])
    """
    args = parse_args(argv)
    plan, start, load_start = args.plan, time.time(), os.getloadavg()[0]
    try:
        records = measure_memory(plan, args.tf_mode)
        _log("timing %s in one process, interleaved..." % ", ".join(g["name"] for g in plan["groups"]))
        time_result = run_child("time", {"mode": args.tf_mode, "groups": plan["groups"]}, plan["time_timeout"])
    except ChildError as exc:
        fail(exc, status=1)
    seconds = time.time() - start
    context = {
        "date": datetime.date.today().isoformat(), "machine": machine_description(time_result.get("gpus", 0)),
        "command": " ".join(["python", "benchmarks/run.py"] + list(sys.argv[1:] if argv is None else argv)),
        "quick": args.quick, "mode": args.tf_mode, "seconds": seconds, "plan": plan,
        "notes": _notes(plan, time_result, seconds, (load_start, os.getloadavg()[0])),
    }
    summary = bench_report.summarize(context, records, time_result)
    sys.stdout.write(write_outputs(summary, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
