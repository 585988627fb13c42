"""Smoke tests of the benchmark machinery in ``benchmarks/``: well-formed output, never speed.

Nothing here times anything or asserts a speed or memory ratio: the ratios
come from ``python benchmarks/run.py``. These tests prove that the report
turns measurements into the right ratios and keys, that a memory child
process reports sane figures, and that a timing group yields one finite
positive time per round and variant.
"""
import importlib.util
import json
import math
import os
import sys

import pytest
import tensorflow as tf

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import bench_report  # noqa: E402
import run  # noqa: E402

MB = bench_report.MB
# The example's CNN at width 2: conv 3x3x(1*2 + 2*4 + 4*6 + 6*8 + 8*10), batch-norm
# gamma and beta for 2+4+6+8+10 channels, dense 10x10 + 10; float32.
CNN_WIDTH2_PARAM_BYTES = 4 * (9 * 162 + 2 * 30 + 110)


def _memory_record(config, k, micro, peak_mb, tf_mb, allocator):
    return {"config": config, "k": k, "micro": micro, "examples": micro * k, "width": 24,
            "peak_rss_bytes": peak_mb * MB, "psutil_peak_rss_bytes": peak_mb * MB,
            "rss_before_bytes": 600 * MB, "tf_peak_bytes": tf_mb * MB if allocator else None,
            "param_bytes": 1 * MB, "allocator": allocator}


def _fake_records():
    """B = 100 with k in {1, 4}: two default-allocator repeats and one allocator run each."""
    table = [("full", 1, 100, (900, 902), 300), ("plain", 4, 25, (650, 652), 75),
             ("fused", 1, 100, (905, 907), 305), ("fused", 4, 25, (660, 662), 79)]
    records = []
    for config, k, micro, peaks, tf_mb in table:
        records += [_memory_record(config, k, micro, peak, None, False) for peak in peaks]
        records.append(_memory_record(config, k, micro, 0, tf_mb, True))
    return records


def _group(name, model, per_variant, skipped=None):
    return {"name": name, "model": model, "width": 24, "micro": 10, "k": 2, "cpus": 1, "rounds": 3,
            "windows": 1, "variants": list(per_variant) + list(skipped or {}), "skipped": skipped or {},
            "times": dict((v, [t * 1e-6 for t in ts]) for v, ts in per_variant.items()),
            "cpu_times": dict((v, [2 * t * 1e-6 for t in ts]) for v, ts in per_variant.items())}


def _fake_time_result():
    cnn = _group("cnn", "cnn", {"plain": [100, 200, 300], "fused": [110, 220, 330], "manual": [121, 242, 363]},
                 skipped={"tensorpack": "tensorpack is not installed"})
    mlp = _group("mlp", "mlp", {"plain": [10, 10, 10], "fused": [12, 13, 14], "manual": [24, 26, 28]})
    towers = _group("towers", "cnn", {"one_device": [50, 50, 50], "towers1": [51, 51, 51],
                                      "towers2": [55, 55, 55], "towers4": [60, 70, 65]})
    return {"tensorflow": "2.x", "groups": [cnn, mlp, towers]}


def _summary():
    context = {"date": "2026-11-22", "machine": "test machine", "command": "python benchmarks/run.py",
               "quick": False, "mode": "tf1", "notes": ["a note"]}
    return bench_report.summarize(context, _fake_records(), _fake_time_result())


def test_json_has_every_required_key_with_the_right_ratios(tmp_path):
    path = str(tmp_path / "bench.json")
    bench_report.write_json(_summary(), path)
    with open(path) as stream:
        loaded = json.load(stream)
    for key in bench_report.REQUIRED_KEYS:
        assert isinstance(loaded[key], float) and math.isfinite(loaded[key]) and loaded[key] > 0, key
    # Memory: medians of the repeats; the largest k (4) is the headline.
    np_ratio = 661.0 / (651.0 + 1.0)
    assert loaded["accumulated_peak_over_micro_peak_plus_params"] == pytest.approx(np_ratio)
    assert loaded["accumulated_peak_over_full_batch_peak"] == pytest.approx(661.0 / 901.0)
    assert loaded["tf_allocator_accumulated_peak_over_micro_peak_plus_params"] == pytest.approx(79.0 / 76.0)
    # Time: the median of per-round ratios, wall-clock and CPU.
    assert loaded["fused_over_plain_time"] == pytest.approx(1.1)
    assert loaded["manual_over_fused_time"] == pytest.approx(1.1)
    assert loaded["fused_over_plain_time_mlp"] == pytest.approx(1.3)
    assert loaded["manual_over_fused_time_mlp"] == pytest.approx(2.0)
    assert loaded["towers4_over_one_device_time"] == pytest.approx(1.3)
    assert loaded["towers4_over_one_device_time_ci95"] == pytest.approx([1.2, 1.4])  # (min, max) of 3 rounds.
    assert loaded["fused_over_plain_cpu_time"] == pytest.approx(1.1)
    assert loaded["tensorpack_over_fused_time"] is None
    assert loaded["float64_over_default_accumulation_time"] is None


def test_median_ci95_uses_the_binomial_order_statistics():
    assert bench_report.median_ci95(list(range(1, 101))) == (40, 61)
    assert bench_report.median_ci95([3, 1, 2]) == (1, 3)
    assert bench_report.paired_ratio([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == 3.0


def test_k1_compares_with_the_full_batch():
    first = _summary()["memory"]["rows"][0]
    assert first["k"] == 1
    assert first["plain"]["peak_rss_bytes"] == pytest.approx(901 * MB)
    assert first["over_micro_plus_params"] == pytest.approx(906.0 / 902.0)


@pytest.mark.parametrize("bad", [None, 0.0, -1.0, float("nan"), float("inf"), True, "1.0"])
def test_check_summary_rejects_a_bad_required_value(bad):
    summary = _summary()
    summary["towers4_over_one_device_time"] = bad
    with pytest.raises(ValueError, match="`towers4_over_one_device_time` must be a finite number > 0, got"):
        bench_report.check_summary(summary)


def test_markdown_has_every_section_and_verdict():
    text = bench_report.render_markdown(_summary())
    assert "| 4 | 25 | 651 MB | 661 MB | 1.014 | 0.734 | 75 MB | 79 MB | 1.039 |" in text
    assert "| tensorpack AccumGradOptimizer | skipped: tensorpack is not installed |" in text
    assert "- fused / plain, the example's CNN (target <= 1.02: NOT met): 1.100 (95% CI 1.100-1.100); " \
           "CPU time 1.100." in text
    assert "(plain micro-batch peak + params), k = 4: 1.014, target <= 1.05: met; TF allocator 1.039." in text
    assert "| 4 tower(s), `gradaccum.tower` | 65.0 | 15385 | 1.300 (95% CI 1.200-1.400) | 1.300 |" in text
    for caption in ("### Memory:", "### Time: the example's CNN", "### Time: small MLP", "### Towers:"):
        assert caption in text


def test_plot_writes_a_png_when_matplotlib_is_installed(tmp_path):
    path = str(tmp_path / "plot.png")
    written = bench_report.plot(_summary(), path)
    if importlib.util.find_spec("matplotlib") is None:
        assert written is None and not os.path.exists(path)
    else:
        with open(path, "rb") as stream:
            assert written == path and stream.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, message", [
    (["--batch", "1001"], "`--batch` 1001 must be divisible by every k in [1, 2, 5, 10, 25, 50], not by [2, 5"),
    (["--repeats", "0"], "`--repeats` must be an int >= 1, got 0"),
    (["--output-dir", "/nonexistent/dir"], "`--output-dir` '/nonexistent/dir' is not a directory"),
])
def test_bad_flags_exit_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        run.parse_args(argv)
    err = capsys.readouterr().err
    assert raised.value.code == 2 and message in err and err.count("\n") == 1


def test_memory_configs_cover_full_plain_and_accumulated():
    configs = run.memory_configs({"batch": 100, "ks": [1, 4]})
    assert [(c["config"], c["micro"], c["k"]) for c in configs] == [
        ("full", 100, 1), ("plain", 25, 4), ("fused", 100, 1), ("fused", 25, 4)]


def test_failed_and_timed_out_children_raise_one_line():
    with pytest.raises(run.ChildError, match=r"bogus child exited with status 2 \(usage: bench_child.py"):
        run.run_child("bogus", {}, timeout=60)
    spec = {"mode": "tf1", "model": "cnn", "variant": "fused", "width": 2, "micro": 2, "k": 2}
    with pytest.raises(run.ChildError, match="memory child timed out after 0 s"):
        run.run_child("memory", spec, timeout=0.01)


def test_memory_child_reports_sane_figures(tf_mode):
    spec = {"mode": tf_mode, "config": "fused", "model": "cnn", "variant": "fused", "width": 2, "micro": 3, "k": 2}
    result = run.run_child("memory", spec, timeout=240, allocator=True)
    assert (result["mode"], result["config"], result["examples"], result["runs"]) == (tf_mode, "fused", 6, 2)
    assert result["param_bytes"] == CNN_WIDTH2_PARAM_BYTES
    keys = ["peak_rss_bytes", "psutil_peak_rss_bytes", "rss_before_bytes", "seconds"]
    # TF < 2.5 (1.15 included) has no allocator statistics: the child reports null there.
    if hasattr(tf.config.experimental, "get_memory_info"):
        keys.append("tf_peak_bytes")
    else:
        assert result["tf_peak_bytes"] is None
    for key in keys:
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["peak_rss_bytes"] >= result["rss_before_bytes"]


@pytest.mark.parametrize("name, model, variants, cpus", [
    ("mlp", "mlp", ["plain", "fused", "manual", "fused_float64", "tensorpack", "horovod"], 1),
    ("towers", "cnn", ["one_device", "towers4"], 4),
])
def test_time_group_gives_one_positive_time_per_round(name, model, variants, cpus):
    import bench_child

    group = {"name": name, "model": model, "variants": variants, "width": 2, "micro": 4, "k": 1 if cpus > 1 else 2,
             "cpus": cpus, "rounds": 2, "windows": 1, "warmup": 1}
    result = bench_child.time_group(group)
    missing = sorted(v for v in ("tensorpack", "horovod") if v in variants and importlib.util.find_spec(v) is None)
    assert sorted(result["skipped"]) == missing
    assert sorted(result["times"]) == sorted(set(variants) - set(missing))
    for series in list(result["times"].values()) + list(result["cpu_times"].values()):
        assert len(series) == 2 and all(math.isfinite(t) and t > 0 for t in series)
    summary = bench_report.summarize_time_group(result)
    assert all(math.isfinite(r) and r > 0 for r in summary["ratios"].values())


@pytest.mark.parametrize("stderr, line", [
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: `k` bad\n\nwarning: later\n",
     "ValueError: `k` bad"),
    ("tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:\n\n  File y\n",
     "tensorflow.python.framework.errors_impl.InvalidArgumentError: Graph execution error:"),
    ("usage: bench_child.py memory|time SPEC_JSON\n", "usage: bench_child.py memory|time SPEC_JSON"),
    ("", "no output"),
])
def test_last_error_line_finds_the_exception(stderr, line):
    assert run.last_error_line(stderr) == line


def test_soak_slope_and_verdict():
    import soak

    growing = [(step, 100 * MB + step * 1024.0) for step in range(0, 20001, 1000)]  # 1 MB per 1000 steps.
    assert soak.slope_per_1000(growing) == pytest.approx(1000 * 1024.0)
    figures = soak.summarize(growing, 20000, 1000, tolerance_mb=8.0)
    assert figures["slope_mb_per_1000"] == pytest.approx(1000 / 1024.0)
    assert figures["start_mb"] == pytest.approx(100 + 1000 / 1024.0) and not figures["flat"]
    flat = [(step, 100 * MB + (step % 2000) * 10.0) for step in range(0, 20001, 1000)]
    assert soak.summarize(flat, 20000, 1000, tolerance_mb=8.0)["flat"]


def test_soak_runs_in_a_finalized_graph_and_counts_updates():
    import soak

    args = soak.parse_args(["--steps", "40", "--k", "4", "--width", "3", "--warmup", "0"])
    session, train_op, global_step, feeds = soak.build(args)
    try:
        assert session.graph.finalized
        samples = soak.soak(session, train_op, feeds, args.steps, sample_every=10)
        assert int(session.run(global_step)) == 10
    finally:
        session.close()
    assert [step for step, _ in samples] == [0, 10, 20, 30, 40]
    assert all(rss > 0 for _, rss in samples)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "`--steps` must be an int >= 1, got 0"),
    (["--steps", "100", "--warmup", "100"], "`--warmup` must be >= 0 and < `--steps` 100, got 100"),
])
def test_soak_bad_flags_exit_with_one_line(argv, message, capsys):
    import soak

    with pytest.raises(SystemExit) as raised:
        soak.parse_args(argv)
    err = capsys.readouterr().err
    assert raised.value.code == 2 and message in err and err.count("\n") == 1
