"""One benchmark measurement in a process of its own; prints its result as one JSON line.

``run.py`` starts this script with ``sys.executable``, once per memory
configuration (so that each peak is the peak of a fresh process) and once for
all the timing groups (whose variants are timed side by side, interleaved)::

    python benchmarks/bench_child.py memory '{"model": "cnn", "variant": "fused", ...}'
    python benchmarks/bench_child.py time '{"mode": "tf1", "groups": [...]}'

The last line of stdout is ``BENCH_RESULT <json>``. TensorFlow's own allocator
statistics exist on the CPU only with ``TF_CPU_ALLOCATOR_USE_BFC=true`` in the
environment; without it, ``tf_peak_bytes`` is ``null``. This module creates
no graph state of its own (see ``bench_models``).
"""
import importlib.util
import json
import os
import resource
import sys
import threading
import time

RESULT_PREFIX = "BENCH_RESULT "
MODES = ("tf1", "tf2")


def setup_tensorflow(mode):
    """Imports TensorFlow in the behaviour ``mode`` names; call before building any graph.

    Args:
      mode: ``"tf1"`` (``disable_v2_behavior``) or ``"tf2"`` (``disable_eager_execution`` only).

    Returns:
      The ``tensorflow`` module.

    Raises:
      ValueError: for another mode.

    Example:
      >>> tf = setup_tensorflow("tf1")
    """
    if mode not in MODES:
        raise ValueError("`mode` must be one of %r, got %r" % (MODES, mode))
    # tf.compat.v1.layers needs tf_keras on TF >= 2.16; TF 1.15 to 2.15 have Keras 2 built in,
    # and there the variable would break tf.compat.v1.layers if tf_keras is absent.
    if importlib.util.find_spec("tf_keras") is not None:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    if mode == "tf1":
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    return tf


def max_rss_bytes():
    """Returns this process's peak resident set size so far (``getrusage``), in bytes.

    Returns:
      An int.

    Example:
      >>> max_rss_bytes() > 0
      True
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KB on Linux.


class RssSampler(object):
    """Samples the resident set size with psutil in a thread; ``peak`` is the largest seen.

    Args:
      interval: seconds between samples.

    Example:
      >>> with RssSampler() as sampler:
      ...     bench.run_window()
      >>> sampler.peak
    """

    def __init__(self, interval=0.005):
        import psutil

        self._process = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss_sampler", daemon=True)
        self.peak = self._process.memory_info().rss

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self._interval)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def allocator_peak_bytes(tf, reset=False):
    """Returns TensorFlow's peak allocator bytes on ``CPU:0``, or None where it keeps none.

    Args:
      tf: the ``tensorflow`` module.
      reset: reset the peak first (and return None).

    Returns:
      An int, or ``None`` (the default CPU allocator keeps no statistics).

    Example:
      >>> allocator_peak_bytes(tf)
    """
    try:
        if reset:
            tf.config.experimental.reset_memory_stats("CPU:0")
            return None
        return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    except (ValueError, AttributeError, tf.errors.OpError):
        return None


def measure_memory(tf, spec):
    """Trains one effective update of ``spec`` from a fresh session; returns its memory figures.

    Args:
      tf: the ``tensorflow`` module, in the right behaviour.
      spec: dict with ``model``, ``variant``, ``width`` (or None), ``micro``
        (examples per run) and ``k`` (runs per update).

    Returns:
      A dict: ``peak_rss_bytes`` (``getrusage``), ``psutil_peak_rss_bytes``
      (sampled during the update), ``rss_before_bytes`` (graph built, session
      initialised, nothing trained), ``tf_peak_bytes`` (allocator peak during
      the update, or None), ``param_bytes``, ``examples``, ``runs``,
      ``seconds`` and the spec.

    Example:
      >>> measure_memory(tf, {"model": "cnn", "variant": "fused", "width": 8, "micro": 10, "k": 2})
    """
    import psutil

    import bench_models

    bench = bench_models.build_bench(spec["model"], spec["variant"], spec.get("width"), spec["micro"], spec["k"])
    rss_before = psutil.Process().memory_info().rss
    allocator_peak_bytes(tf, reset=True)
    start = time.perf_counter()
    with RssSampler() as sampler:
        bench.run_window()
    seconds = time.perf_counter() - start
    result = dict(spec, peak_rss_bytes=max_rss_bytes(), psutil_peak_rss_bytes=int(sampler.peak),
                  rss_before_bytes=int(rss_before), tf_peak_bytes=allocator_peak_bytes(tf),
                  param_bytes=bench.param_bytes, examples=bench.examples, runs=bench.runs, seconds=seconds,
                  width=spec.get("width") or bench_models.default_width(spec["model"]))
    bench.session.close()
    return result


def _time_rounds(benches, rounds, windows):
    """Times ``windows`` windows of each bench per round, rotating the order every round.

    Returns ``(wall, cpu)``: variant -> seconds per example, one entry per round.
    """
    names = list(benches)
    wall, cpu = dict((name, []) for name in names), dict((name, []) for name in names)
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            bench = benches[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(windows):
                bench.run_window()
            examples = float(windows * bench.examples)
            wall[name].append((time.perf_counter() - start) / examples)
            cpu[name].append((time.process_time() - start_cpu) / examples)
    return wall, cpu


def time_group(group):
    """Times the variants of one group side by side; returns seconds per example per round.

    Args:
      group: dict with ``name``, ``model``, ``variants``, ``width`` (or None),
        ``micro``, ``k``, ``cpus``, ``rounds``, ``windows`` (per round and
        variant) and ``warmup`` (untimed windows per variant first).

    Returns:
      The group, plus ``times`` (variant -> list of wall-clock seconds per
      example, one per round, rounds in the same order for every variant),
      ``cpu_times`` (the same in CPU seconds of this process), ``skipped``
      (variant -> reason) and ``examples_per_window``.

    Example:
      >>> time_group({"name": "mlp", "model": "mlp", "variants": ["plain", "fused"], "width": None,
      ...             "micro": 32, "k": 10, "cpus": 1, "rounds": 3, "windows": 5, "warmup": 1})
    """
    import bench_models

    benches, skipped = {}, {}
    for variant in group["variants"]:
        reason = bench_models.unavailable(variant)
        if reason:
            skipped[variant] = reason
            continue
        benches[variant] = bench_models.build_bench(group["model"], variant, group.get("width"), group["micro"],
                                                    group["k"], cpus=group.get("cpus", 1))
    try:
        for bench in benches.values():
            for _ in range(group.get("warmup", 1)):
                bench.run_window()
        times, cpu_times = _time_rounds(benches, group["rounds"], group["windows"])
    finally:
        for bench in benches.values():
            bench.session.close()
    width = group.get("width") or bench_models.default_width(group["model"])
    return dict(group, width=width, times=times, cpu_times=cpu_times, skipped=skipped,
                examples_per_window=group["micro"] * group["k"])


def main(argv):
    """Runs ``argv = [kind, spec_json]`` and prints ``BENCH_RESULT <json>``.

    Args:
      argv: ``["memory", json]`` or ``["time", json]``; the spec holds ``mode``.

    Returns:
      The process exit status.

    Example:
      >>> main(["time", '{"mode": "tf1", "groups": []}'])
    """
    if len(argv) != 2 or argv[0] not in ("memory", "time"):
        sys.stderr.write("usage: bench_child.py memory|time SPEC_JSON\n")
        return 2
    spec = json.loads(argv[1])
    tf = setup_tensorflow(spec.get("mode", "tf1"))
    if argv[0] == "memory":
        result = measure_memory(tf, spec)
    else:
        result = dict(spec, groups=[time_group(group) for group in spec["groups"]])
    result.update(tensorflow=tf.__version__, mode=spec.get("mode", "tf1"),
                  gpus=len(tf.config.experimental.list_physical_devices("GPU")))
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
