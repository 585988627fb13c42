"""Tests of the benchmark harness and its JSON keys: well-formed figures, never speed.

Nothing here asserts a time or memory ratio (those come from ``python benchmarks/run.py``).
The tests check the arithmetic of the ratios and the floor on made-up series, that the
families' summaries give every key the issue names, that a real (tiny) measurement yields
finite figures and the right update errors (ours exact, tensorpack k - 1 off), and the
child-process protocol.
"""
import importlib.util
import json
import math
import os
import sys
import time

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

import features  # noqa: E402
import harness  # noqa: E402
import memory  # noqa: E402
import strategy  # noqa: E402
import peers  # noqa: E402
import run  # noqa: E402

MB = harness.MB
TINY_MLP = {"model_args": {"widths": [8]}, "micro": 4, "k": 3}


def test_paired_ratio_and_median_interval():
    assert harness.paired_ratio([2.0, 3.0, 8.0], [1.0, 1.0, 2.0]) == 3.0
    assert harness.median_ci95(list(range(1, 101))) == (40, 61)
    assert harness.median_ci95([3, 1, 2]) == (1, 3)
    ratio, ci = harness.ratio_with_ci({"a": [2.0, 4.0, 9.0], "b": [1.0, 2.0, 3.0]}, "a", "b")
    assert ratio == 2.0 and ci == [2.0, 3.0]
    assert harness.ratio_with_ci({"a": [1.0]}, "a", "missing") == (None, None)
    assert harness.median_with_ci(iter([5.0, 1.0, 2.0])) == (2.0, [1.0, 5.0])
    assert harness.median_with_ci([]) == (None, None)
    with pytest.raises(ValueError, match="must be non-empty and as long, got 2 and 1"):
        harness.paired_ratio([1.0, 2.0], [1.0])


def test_time_side_by_side_shuffles_the_order_and_respects_its_time_budget():
    order = []

    def bench(name, micro_steps):
        return harness.Bench(name, None, lambda feeds=None: order.append(name), micro_steps, [], None, None, 0)

    benches = [bench("a", 2), bench("b", 4), bench("c", 1)]
    times = harness.time_side_by_side(benches, rounds=30, warmup=0)
    rounds = [order[i:i + 3] for i in range(0, 90, 3)]
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds) and [len(times[n]) for n in "abc"] == [30, 30, 30]
    # A rotation would keep each bench's predecessor; a shuffle gives each one every other as predecessor.
    assert set(r[r.index("a") - 1] for r in rounds if r[0] != "a") == {"b", "c"}
    assert len(set(map(tuple, rounds))) == 6
    del order[:]
    harness.time_side_by_side(benches, rounds=30, warmup=0, seed=1)
    assert [order[i:i + 3] for i in range(0, 90, 3)] != rounds
    assert all(t >= 0 for t in times["a"] + times["b"])
    assert len(harness.time_side_by_side(benches, rounds=50, warmup=0, max_seconds=0.0, min_rounds=2)["a"]) == 2
    # The budget is the whole run's: 10 ms per round, so about 5 of 50 rounds fit in 0.05 s (not each bench's).
    slow = [harness.Bench("s", None, lambda feeds=None: time.sleep(0.01), 1, [], None, None, 0)]
    assert len(harness.time_side_by_side(slow, rounds=50, warmup=0, max_seconds=0.05, min_rounds=1)["s"]) < 50


def test_a_whole_window_is_fed_end_to_end_and_its_micro_batches_are_views_of_it():
    import numpy as np

    feeds = harness.random_feeds("images", "labels", 4, 3, 0)
    whole, views = harness.end_to_end(feeds)
    assert whole["images"].shape == (12, 28, 28, 1) and whole["labels"].shape == (12,)
    assert len(views) == 3 and all(np.shares_memory(view["images"], whole["images"]) for view in views)
    for feed, view in zip(feeds, views):
        assert all(np.array_equal(feed[key], view[key]) for key in feed)


def test_a_whole_window_bench_runs_once_per_window_and_is_exact():
    import tensorflow as tf

    bench = harness.build_bench("ingraph", "mlp", harness.one_run, 4, 3, {"widths": [8]}, optimizer="sgd",
                                reference=True)
    try:
        assert bench.window.whole_window and bench.micro_steps == 3  # Its time is per micro-batch, as the others'.
        step = tf.compat.v1.train.get_global_step(bench.session.graph)
        bench.run_window()
        assert bench.session.run(step) == 1
        assert max(harness.update_errors(bench, 2)) < 1e-4
    finally:
        bench.session.close()


def test_stream_bandwidth_counts_read_read_write_and_takes_the_faster_bench():
    times = {"stream": [0.012, 0.006], "stream_numpy": [0.024, 0.003]}
    assert harness.stream_bandwidth_gbs(times, 10 ** 8) == pytest.approx([100.0, 400.0])
    assert harness.stream_bandwidth_gbs(times, 10 ** 8, ["stream"]) == pytest.approx([100.0, 200.0])


def _peers_results():
    """The 10M MLP made up: 1e6 params, k = 8; a pass over them takes 1.2 ms, so the floor is 1.3 ms."""
    ms = lambda *values: [v * 1e-3 for v in values]  # noqa: E731
    mlp = {"setup": "mlp10m", "tag": None, "micro": 8, "k": 8, "model": "mlp", "model_args": {}, "params": 10 ** 6,
           "times": {"ours": ms(5.3, 5.3, 5.3), "ours_unweighted": ms(5.3, 5.2, 5.4), "ours_twin": ms(5.565, 5.3, 5.3),
                     "fwd_bwd": ms(4.0, 4.0, 4.0),
                     "plain": ms(6.0, 6.0, 6.0), "seeds_manual": ms(5.4, 5.4, 5.4), "tensorpack": ms(5.2, 5.3, 5.2),
                     "stream": ms(1.2, 1.2, 1.2), "stream_numpy": ms(2.4, 2.4, 2.4),
                     "wrapped_apply": ms(2.6, 2.6, 2.6), "ingraph": ms(5.0, 5.0, 5.0)},
           "skipped": {"horovod": "horovod is not installed"},
           "errors": {"ours": [1e-7, 2e-7], "ours_unweighted": [1e-7, 1e-7], "seeds_manual": [3e-7, 1e-7],
                      "tensorpack": [7.0, 1.0], "ingraph": [2e-7, 1e-7]},
           "variable_bytes": {"ours": 16e6}, "profile": {
               "steps": [[["gradients", "MatMul", 2.0], ["GradientAccumulator", "AssignAdd", 1.0]]] * 7 +
                        [[["gradients", "MatMul", 2.0], ["GradientAccumulator", "RealDiv", 0.5],
                          ["Adam", "ApplyAdam", 3.0]]],
               "fwd_bwd": [["gradients", "MatMul", 2.1]]},
           "spec": {"kind": "time", "setup": "mlp10m"}}
    cnn = {"setup": "cnn", "tag": None, "micro": 100, "k": 5, "model": "cnn", "model_args": {"width": 16},
           "params": None, "times": {"ours": ms(40, 44), "ours_twin": ms(40, 44 * 0.98), "plain": ms(40, 40),
                                     "ingraph": ms(35, 38.4)},
           "skipped": {}, "errors": {"ours": [0.0]}, "variable_bytes": {}, "profile": None,
           "spec": {"kind": "time", "setup": "cnn"}}
    onednn = dict(cnn, tag="onednn_off", times={"ours": ms(40, 40), "plain": ms(41, 41)},
                  spec={"kind": "time", "setup": "cnn", "tag": "onednn_off"})
    memory_row = {"peak_rss_bytes": 900 * MB, "tf_peak_bytes": 100 * MB, "variable_bytes": 160e6,
                  "spec": {"kind": "memory", "setup": "mlp10m", "row": "ours"}}
    return [mlp, cnn, onednn, memory_row]


def test_peers_summary_has_the_floor_and_the_peers_rows():
    keys, lines = peers.summarize(_peers_results())
    assert keys["stream_bandwidth_gbs"] == pytest.approx(10.0)  # 12e6 bytes in 1.2 ms.
    assert keys["floor_ms"] == pytest.approx(1.3)  # (3 + 2/8) * 4e6 bytes at 10 GB/s.
    assert keys["mlp10m_overhead_over_floor"] == pytest.approx(1.0)  # (5.3 - 4.0) / 1.3.
    assert keys["mlp10m_own_overhead_over_floor"] == pytest.approx(0.75)  # (5.3 - 4.0 - 2.6 / 8) / 1.3.
    assert keys["mlp10m_least_possible_overhead_over_floor"] == pytest.approx(21.0 / 26 + 0.25)  # 7 adds; 2.6/8/1.3.
    assert keys["mlp10m_wrapped_apply_ms"] == pytest.approx(2.6)
    assert keys["mlp10m_weighted_over_unweighted_time"] == pytest.approx(5.3 / 5.3)
    assert keys["mlp10m_twin_over_ours_time"] == pytest.approx(1.0)  # median of 1.05, 1.0 and 1.0.
    assert keys["mlp10m_twin_over_ours_time_ci95"][1] == pytest.approx(1.05)
    assert keys["fused_over_plain_time"] == pytest.approx(1.05)  # median of 1.0 and 1.1.
    assert keys["fused_over_plain_time_onednn_off"] == pytest.approx(40.0 / 41.0)
    assert keys["cnn_twin_over_ours_time"] == pytest.approx(0.99)  # median of 1.0 and 0.98.
    # In-graph over the peer it beats least: plain on the CNN (0.875, 0.96; ours 0.875, 0.873). On the MLP
    # tensorpack, not exact, is left out: over it 0.962, over ours 0.943.
    assert keys["cnn_ingraph_over_best_peer_time"] == pytest.approx(0.9175)
    assert keys["cnn_ingraph_over_best_peer_time_ci95"] == pytest.approx([0.875, 0.96])
    assert keys["cnn_ingraph_over_best_peer_time_peer"] == "plain"
    assert keys["mlp10m_ingraph_over_best_exact_time"] == pytest.approx(5.0 / 5.3)
    assert keys["mlp10m_ingraph_over_best_exact_time_peer"] == "ours"
    assert peers.over_best({"ingraph": [1.0]}, "ingraph", ("ours", "plain")) == (None, None, None)
    rows = dict(((r["model"], r["name"]), r) for r in keys["peers"])
    assert rows[("mlp10m", "tensorpack")]["max_rel_error_vs_full_batch"] == 7.0
    assert rows[("mlp10m", "tensorpack")]["time_ratio"] == pytest.approx(5.2 / 5.3)
    assert rows[("mlp10m", "horovod")]["skipped"] == "horovod is not installed"
    assert rows[("mlp10m", "ours")]["peak_rss_bytes"] == 900 * MB
    assert rows[("mlp10m", "plain")]["max_rel_error_vs_full_batch"] is None
    account = dict(((a["scope"], a["op"]), a) for a in keys["mlp10m_profile"])
    assert account[("GradientAccumulator", "AssignAdd")]["accumulate_step_ms"] == pytest.approx(1.0)
    assert account[("Adam", "ApplyAdam")]["applying_step_ms"] == pytest.approx(3.0)
    assert account[("(all ops)", "sum")]["accumulate_step_ms"] == pytest.approx(3.0)
    text = "\n".join(lines)
    assert "| tensorpack `AccumGradOptimizer` | 5.20 | 0.981 (0.981-1.000) | 7 | n/a | n/a | n/a |" in text
    assert "skipped: horovod is not installed" in text
    results = _peers_results()
    del results[0]["times"]["wrapped_apply"]  # Not timed: no apply, so no figure without it.
    unapplied = peers.summarize(results)[0]
    assert unapplied["mlp10m_own_overhead_over_floor"] is None
    assert unapplied["mlp10m_least_possible_overhead_over_floor"] is None
    assert unapplied["mlp10m_overhead_over_floor"] == pytest.approx(1.0)


def test_timing_children_of_one_setup_pool_their_rounds():
    mlp = _peers_results()[0]
    other = dict(mlp, times=dict((name, [t * 1.1 for t in series]) for name, series in mlp["times"].items()),
                 errors={}, profile=None, spec=dict(mlp["spec"], repeat=1))
    assert peers.plan(False)[1]["repeat"] == 1 and peers.plan(False)[1]["error_windows"] == 0
    keys, lines = peers.summarize([mlp, other])
    ours = [r for r in keys["peers"] if r["model"] == "mlp10m" and r["name"] == "ours"][0]
    assert ours["ms_per_micro_step"] == pytest.approx((5.3 + 5.83) / 2) and ours["rel_errors_by_window"]
    assert keys["mlp10m_profile"] and any("6 interleaved rounds in 2 process(es)" in line for line in lines)


def test_every_key_the_issue_names_is_in_the_merged_summary(tmp_path):
    summary = {}
    summary.update(peers.summarize(_peers_results())[0])
    summary.update(features.summarize([])[0])
    summary.update(memory.summarize([])[0])
    summary.update(strategy.summarize([])[0])
    for key in list(run.TARGETS) + ["stream_bandwidth_gbs", "floor_ms", "statistics_on_over_off_time_mlp10m",
                                    "window_bn_over_tf_bn_time", "towers2_sync_bn_over_per_tower_bn_time"]:
        assert key in summary or key.startswith(("accumulated_peak", "ingraph_peak")), key
    for row in summary["peers"]:
        assert {"name", "time_ratio", "max_rel_error_vs_full_batch"} <= set(row)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(summary))
    assert json.loads(path.read_text())["floor_ms"] == pytest.approx(1.3)
    table = run.docs_table(summary)
    assert "| mlp10m | tensorpack `AccumGradOptimizer` | 0.981 (0.981-1.000) | 7 | n/a |" in table
    assert "| 10M MLP: (ours - forward+backward) / floor | **1.000** (95% CI 1.000-1.000) | <= 1.10 |" in table
    assert "| mlp10m | gradaccum `subdivisions.minimize`: the window in one run (`tf.while_loop`) | 0.943 " \
        "(0.943-0.943) | 2e-07 | n/a |" in table
    lines = run.headline(summary)
    assert any("`mlp10m_overhead_over_floor`): **1.000** (95% CI 1.000-1.000), target <= 1.10: met" in line
               for line in lines)
    # The loop of one run per update is not "in-graph" (TensorFlow's in-graph replication) where people read.
    assert any(line.startswith("| 10M MLP: one run per update / the best exact one of ours") for line in table)
    assert not any("in-graph" in line for line in table + lines)
    assert any("`cnn_ingraph_over_best_peer_time`): **0.917** (95% CI 0.875-0.960) against plain; A/A on this "
               "model 0.990 (95% CI 0.980-1.000), target <= 0.90: not resolved." in line for line in lines)
    assert any("`mlp10m_ingraph_over_best_exact_time`): **0.943** (95% CI 0.943-0.943) against ours; A/A on "
               "this model 1.000" in line and line.endswith("target <= 1.00: met.") for line in lines)
    assert run.verdicts(summary)["ingraph_peak_over_micro_peak_plus_params"] == "not measured"
    assert any("(`accumulated_peak_over_micro_peak_plus_params`): **n/a**" in line for line in lines)
    assert any("ours is 0.750 times the floor. The least any" in line and "is 1.058 times" in line for line in lines)


@pytest.mark.parametrize("value, ci, verdict", [
    (0.85, [0.80, 0.89], "met"), (0.88, [0.86, 0.91], "not resolved"), (0.88, [0.90, 0.95], "not resolved"),
    (0.92, [0.91, 0.95], "NOT met"), (0.85, None, "met"), (0.95, [None, None], "NOT met"), (None, None, "not measured"),
])
def test_a_verdict_is_not_resolved_when_the_interval_straddles_the_target(value, ci, verdict):
    assert run.verdict(value, ci, 0.90) == verdict


def test_features_summary_reports_skipped_rows_as_none():
    results = [{"group": "statistics_mlp10m", "setup": {}, "times": {},
                "skipped": {"ours_statistics": "GradientAccumulator has no `statistics` argument yet"}},
               {"group": "towers", "setup": {}, "skipped": {},
                "times": {"one_device": [1.0, 1.0], "towers2": [1.1, 1.3], "towers2_sync_bn": [1.21, 1.3],
                          "towers4": [2.0, 2.0], "towers4_sync_bn": [2.0, 2.2]}}]
    keys, lines = features.summarize(results)
    assert keys["statistics_on_over_off_time_mlp10m"] is None
    assert keys["towers2_sync_bn_over_per_tower_bn_time"] == pytest.approx(1.05)
    assert keys["towers2_over_one_device_time"] == pytest.approx(1.2)
    assert keys["features_skipped"] == {"statistics_mlp10m": results[0]["skipped"]}
    assert "skipped: GradientAccumulator has no `statistics` argument yet" in "\n".join(lines)


def test_memory_summary_takes_medians_and_the_largest_k():
    def record(config, k, micro, rss, tf_mb, repeat):
        return {"peak_rss_bytes": rss * MB, "tf_peak_bytes": tf_mb * MB, "param_bytes": 1 * MB, "feed_bytes": 2 * MB,
                "spec": {"config": config, "k": k, "micro": micro, "repeat": repeat}}
    results = []
    for repeat, delta in enumerate((0, 2)):
        results += [record("full", 1, 100, 900 + delta, 300, repeat), record("plain", 4, 25, 650 + delta, 75, repeat),
                    record("ours", 1, 100, 905 + delta, 305, repeat), record("ours", 4, 25, 660 + delta, 79, repeat),
                    record("ingraph", 1, 100, 906 + delta, 306, repeat),
                    record("ingraph", 4, 25, 662 + delta, 80, repeat)]
    keys, lines = memory.summarize(results)
    assert keys["memory_ratios_k"] == 4
    assert keys["accumulated_peak_over_micro_peak_plus_params"] == pytest.approx(661.0 / 652.0)
    assert keys["accumulated_peak_over_full_batch_peak"] == pytest.approx(661.0 / 901.0)
    assert keys["tf_allocator_accumulated_peak_over_micro_peak_plus_params"] == pytest.approx(79.0 / 76.0)
    assert "| 4 | 651 MB | 661 MB | 1.014 | 0.734 | 75 MB | 79 MB | 1.039 | 0.263 |" in lines
    # One run per update: the bound holds two copies of the parameters; the interval is the repeats' range (two of them).
    assert keys["ingraph_peak_over_micro_peak_plus_params"] == pytest.approx(663.0 / 653.0)
    assert keys["ingraph_peak_over_micro_peak_plus_params_ci95"] == pytest.approx([664.0 / 654.0, 662.0 / 652.0])
    assert keys["tf_allocator_ingraph_peak_over_micro_peak_plus_params"] == pytest.approx(80.0 / 77.0)
    assert keys["tf_allocator_ingraph_peak_over_micro_peak_plus_params_plus_feed"] == pytest.approx(80.0 / 79.0)
    assert keys["ingraph_peak_over_full_batch_peak"] == pytest.approx(663.0 / 901.0)
    assert keys["ingraph_feed_bytes"] == 2 * MB
    assert "| 4 | 651 MB | 663 MB | 1.015 | 0.736 | 75 MB | 80 MB | 1.039 | 0.267 |" in lines
    headers = [line for line in lines if line.startswith("| k |")]
    assert [h.split(" | ")[2] for h in headers] == ["peak RSS, ours", "peak RSS, one-run"], headers
    assert any("fed the whole batch (2.0 MB of inputs)" in line and "1.013 (TF)" in line for line in lines)
    assert "| k | peak RSS, plain B/k | peak RSS, one-run | one-run / (plain + 2 params) | one-run / full |" \
        " TF peak, plain | TF peak, one-run | TF: one-run / (plain + 2 params) | TF: one-run / full |" in lines
    assert not any("ingraph" in line or "in-graph" in line for line in lines)


def test_plans_name_only_known_rows_and_groups():
    for quick in (False, True):
        for spec in peers.plan(quick):
            assert spec["setup"] in peers.SETUPS and set(spec.get("rows", [])) <= set(peers.ROWS)
            assert spec["kind"] != "memory" or spec["row"] not in peers.TIMING_ONLY  # ours_twin: ours' graph
        assert [spec["group"] for spec in features.plan(quick)] == list(features.GROUPS)
        assert all(spec["env"]["TF_CPU_ALLOCATOR_USE_BFC"] == "true" for spec in memory.plan(quick))
        assert {"full", "plain", "ours", "ingraph"} == set(spec["config"] for spec in memory.plan(quick))
    assert all(set(group["rows"]) <= set(features.ROWS) for group in features.GROUPS.values())


# A benchmark child builds the same benches in both behaviours (``--tf-mode``): the tiny peers child
# runs in the tf2 session too, the other children in the tf1 session only.
_CHILD_IN_TF1 = pytest.mark.one_behaviour(reason="a benchmark child's code is the same in both behaviours; "
                                                 "test_tiny_peers_measurement_... runs one in the tf2 behaviour")


def test_tiny_peers_measurement_gives_finite_times_and_the_right_errors():
    spec = {"kind": "time", "setup": "mlp10m", "rounds": 2, "error_windows": 2, "override": TINY_MLP}
    result = peers.measure(spec)
    for name, series in result["times"].items():
        assert len(series) == 2 and all(math.isfinite(t) and t > 0 for t in series), name
    assert set(result["times"]) >= {"ours", "ours_unweighted", "ours_twin", "plain", "fwd_bwd", "seeds_manual",
                                    "stream", "ingraph"}
    assert result["params"] == 784 * 8 + 8 + 8 * 10 + 10
    for row in ("ours", "ours_unweighted", "seeds_manual", "ingraph"):
        assert max(result["errors"][row]) < 1e-4, row
    if "tensorpack" in result["errors"]:  # It sums: k - 1 = 2 off, or worse when its counter races.
        assert max(result["errors"]["tensorpack"]) > 1.5
    assert len(result["profile"]["steps"]) == TINY_MLP["k"]
    assert any(scope == "GradientAccumulator" and ms >= 0 for scope, _, ms in sum(result["profile"]["steps"][:-1], []))
    assert any("ApplyAdam" in kind for _, kind, _ in result["profile"]["steps"][-1])  # Only the last step applies.
    assert not any("ApplyAdam" in kind for _, kind, _ in sum(result["profile"]["steps"][:-1], []))
    keys, _ = peers.summarize([dict(result, spec=spec)])
    assert keys["floor_ms"] > 0 and keys["stream_bandwidth_gbs"] > 0


@_CHILD_IN_TF1
def test_odd_timing_children_build_their_rows_in_reverse_order():
    spec = {"kind": "time", "setup": "mlp10m", "rounds": 1, "error_windows": 0, "override": TINY_MLP, "repeat": 1}
    result = peers.measure(spec)
    built = [row for row in peers.SETUPS["mlp10m"]["rows"] if row not in result["skipped"]]
    assert list(result["variable_bytes"]) == built[::-1] and result["profile"] is None


@_CHILD_IN_TF1
def test_tiny_towers_group_times_every_available_row():
    rows = ["one_device", "towers2", "towers2_sync_bn"]
    spec = {"kind": "time", "group": "towers", "rounds": 1, "override": {"rows": rows},
            "setup_override": {"model_args": {"width": 2}, "micro": 8}}
    result = features.measure(spec)
    assert sorted(set(result["times"]) | set(result["skipped"])) == sorted(rows)
    assert all(len(series) == 1 and series[0] > 0 for series in result["times"].values())


def test_tiny_statistics_group_profiles_where_the_difference_goes():
    spec = {"kind": "time", "group": "statistics_mlp10m", "rounds": 1, "setup_override": TINY_MLP}
    result = features.measure(spec)
    profile = result["profile"]
    assert profile["rows"] == ["ours", "ours_statistics"]
    assert all(total > 0 for total in profile["total_ms"])
    growth = [ms for _, ms in profile["grown"]]
    assert growth == sorted(growth, reverse=True) and 0 < len(growth) <= 6
    _, lines = features.summarize([result])
    assert any(line.startswith("Where `statistics_mlp10m`'s time goes") for line in lines)
    assert "| %s | %+.3f |" % tuple(profile["grown"][0]) in lines


def _bench_script(name):
    """A benchmark script as a module of its own (``sharded`` would shadow the package's)."""
    spec = importlib.util.spec_from_file_location("bench_" + name, os.path.join(BENCH_DIR, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_decision_timing_pairs_train_op_and_accumulate_op():
    ratio, ms = _bench_script("ops").time_decision({"model": "cnn", "model_args": {"width": 2}, "micro": 4}, 3)
    assert math.isfinite(ratio) and ratio > 0 and math.isfinite(ms)


def test_sharded_bench_names_an_unknown_engine(capsys):
    bench = _bench_script("sharded")
    assert bench.parse_args(["--engines", "stage12,unsharded"]).engines == "stage12,unsharded"
    with pytest.raises(SystemExit):
        bench.parse_args(["--engines", "unsharded,stage3"])
    assert "--engines: unknown engine 'stage3' (known: unsharded, sharded, stage12)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def child_environ():
    """``env -> env`` for ``harness.run_child``: every child forks from a server that imported TensorFlow
    under the variables its import reads (``tests/forkserver.py``): this session's server, or one more per
    other set (the BFC allocator's, oneDNN off), so that no child pays a TensorFlow import."""
    import forkserver

    servers = {}

    def environ(env):
        full = harness.child_environment(env)
        signature = tuple(forkserver.import_signature(full))
        if signature == tuple(forkserver.import_signature(os.environ)):
            return env
        if signature not in servers:
            servers[signature] = forkserver.ForkServer(full).start(wait=False)
        return servers[signature].environ(env)

    yield environ
    for server in servers.values():
        server.close()


@_CHILD_IN_TF1
@pytest.mark.parametrize("config", ["ours", "ingraph"])
def test_memory_child_reports_sane_figures(tf_mode, config, child_environ):
    import forkserver

    spec = {"mode": tf_mode, "kind": "memory", "config": config, "micro": 3, "k": 2, "repeat": 0,
            "model_args": {"width": 2}}
    result = harness.run_child("memory", spec, 240, child_environ({"TF_CPU_ALLOCATOR_USE_BFC": "true"}),
                               forkserver.command())
    assert result["feed_bytes"] == 2 * 3 * (28 * 28 * 4 + 4)  # The window's examples, held once.
    # Conv kernels 3x3x(1*2 + 2*4 + 4*6 + 6*8 + 8*10) and BN gamma, beta; the dense head depends on the example's.
    assert result["mode"] == tf_mode and result["param_bytes"] > 4 * (9 * 162 + 2 * 30)
    assert result["peak_rss_bytes"] >= result["rss_before_bytes"] > 0
    assert result["variable_bytes"] > result["param_bytes"]
    import tensorflow as tf

    if hasattr(tf.config.experimental, "get_memory_info"):  # TF 1.15 keeps no allocator statistics.
        assert result["tf_peak_bytes"] > 0
    else:
        assert result["tf_peak_bytes"] is None


def test_failed_and_timed_out_children_raise_one_line():
    with pytest.raises(harness.ChildError, match=r"no_such_family child exited with status 1 \(ModuleNotFoundError"):
        harness.run_child("no_such_family", {}, 120)
    with pytest.raises(harness.ChildError, match="memory child timed out after 0.01 s"):
        harness.run_child("memory", {"kind": "memory"}, 0.01)


def test_the_smoke_plan_runs_each_variant_once_the_full_plan_s_own_too(monkeypatch):
    module = type(sys)("fake_family")
    plans = {True: [{"kind": "time", "group": "a", "rounds": 3}, {"kind": "time", "group": "a", "rounds": 3,
                                                                     "repeat": 1},
                    {"kind": "memory", "config": "x", "micro": 40, "k": 10, "env": {"B": "1"}}],
             False: [{"kind": "time", "group": "a", "rounds": 41}, {"kind": "time", "group": "b", "rounds": 41},
                     {"kind": "memory", "config": "x", "micro": 20, "k": 50, "env": {"B": "1"}},
                     {"kind": "memory", "config": "x", "micro": 20, "k": 50, "env": {"B": "0"}}]}
    module.plan = plans.get
    monkeypatch.setitem(sys.modules, "fake_family", module)
    assert run.smoke_plan("fake_family") == [
        {"kind": "time", "group": "a", "rounds": 3, "smoke": True},
        {"kind": "memory", "config": "x", "micro": 40, "k": 10, "env": {"B": "1"}, "smoke": True},
        {"kind": "time", "group": "b", "rounds": 41, "smoke": True},  # Only the full plan has it: run all the same.
        {"kind": "memory", "config": "x", "micro": 20, "k": 50, "env": {"B": "0"}, "smoke": True}]
    assert run.variant({"kind": "budget", "config": "plain", "repeat": 3, "update_repeats": 5, "smoke": True}) == \
        run.variant({"kind": "budget", "config": "plain"})
    assert run.parse_args(["--smoke"]).smoke and not run.parse_args([]).smoke


@pytest.mark.one_behaviour(reason="the benchmarks run in the tf1 behaviour unless told; the children's "
                                  "names and signatures are the same in both")
@pytest.mark.parametrize("family", run.families())
def test_every_variant_of_every_family_runs_at_the_smoke_size(family, tf_mode, child_environ):
    """``run.py --smoke``'s children, through the same child protocol, then the family's summary: a name
    renamed or a signature changed in a family, the harness or the library fails here, not in a full run."""
    import forkserver
    import tensorflow as tf

    module = importlib.import_module(family)
    assert os.path.dirname(os.path.abspath(module.__file__)) == BENCH_DIR
    specs = run.smoke_plan(family)
    # Every variant of both plans, once: a kind a family gains is run here without a word in this test.
    assert sorted(run.variant(spec) for spec in specs) == \
        sorted(set(run.variant(spec) for spec in module.plan(True) + module.plan(False)))
    allocator = hasattr(tf.config.experimental, "get_memory_info")  # TF 1.15 keeps no allocator peak.
    results = []
    for spec in specs:
        spec = dict(spec, mode=tf_mode)
        result = harness.run_child(family, spec, 240, child_environ(spec.get("env", {})), forkserver.command())
        assert result["mode"] == tf_mode
        skipped = result.get("skipped") or {}
        for reason in skipped.values() if isinstance(skipped, dict) else [skipped]:
            # A peer that is not installed, else nothing: a feature that broke must not pass as skipped.
            assert reason.endswith(" is not installed") or (not allocator and "allocator peak" in reason), reason
        results.append(dict(result, spec=spec))
    keys, lines = module.summarize(results)
    targets = set(run.TARGETS) | set(getattr(module, "TARGETS", {}))
    # Without an allocator peak (TF 1.15) the peaks, and the largest micro-batch under one, are not measured.
    excused = ("peak", "micro_batch") if not allocator else ()
    unmeasured = [key for key in keys if key in targets and keys[key] is None and not any(w in key for w in excused)]
    assert not unmeasured and lines


def test_update_docs_replaces_only_the_text_between_the_markers(tmp_path):
    page = tmp_path / "performance.md"
    page.write_text("intro\n%s\nold table\n%s\nafter\n" % (run.DOCS_BEGIN, run.DOCS_END))
    summary = dict(peers.summarize(_peers_results())[0], date="2026-11-23 10:00 UTC", machine="m",
                   tensorflow=["2.21.0 (tf1)"], command="python benchmarks/run.py ", seconds=300.0,
                   load_average=[0.5, 0.7], quick=False)
    run.update_docs(str(page), summary)
    text = page.read_text()
    assert text.startswith("intro\n" + run.DOCS_BEGIN + "\nMeasured 2026-11-23 10:00 UTC on m")
    assert "old table" not in text
    assert text.endswith(run.DOCS_END + "\nafter\n") and "| <= 1.10 |" in text
    run.update_docs(str(page), summary)  # Idempotent: the markers stay.
    assert page.read_text() == text


def test_update_docs_defaults_to_the_performance_guide_which_holds_the_markers():
    assert run.parse_args(["--update-docs"]).update_docs == run.DOCS_PAGE
    assert run.parse_args(["--update-readme", run.DOCS_PAGE]).update_docs == run.DOCS_PAGE  # The old name.
    assert run.parse_args([]).update_docs is None
    with open(run.DOCS_PAGE) as stream:
        text = stream.read()
    assert text.count(run.DOCS_BEGIN) == 1 and text.count(run.DOCS_END) == 1
    assert text.index(run.DOCS_BEGIN) < text.index(run.DOCS_END)


@pytest.mark.parametrize("argv, message", [
    (["--output-dir", "/nonexistent/dir"], "`--output-dir` '/nonexistent/dir' is not a directory"),
    (["--update-docs", os.path.abspath(__file__)], "must hold the benchmark markers once each"),
    (["--update-readme", os.path.abspath(__file__)], "`--update-docs` %r must hold the benchmark markers once each"
     % os.path.abspath(__file__)),
    (["--family", "bogus"], "argument --family: invalid choice: 'bogus'"),
    (["--smoke", "--json", "out.json"], "`--smoke` figures mean nothing: not with --json"),
    (["--smoke", "--update-docs"], "`--smoke` figures mean nothing: not with --update-docs"),
    (["--smoke", "--quick"], "argument --quick: not allowed with argument --smoke"),
])
def test_bad_flags_exit_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as raised:
        run.parse_args(argv)
    err = capsys.readouterr().err
    assert raised.value.code == 2 and message in err and err.count("\n") == 1


@pytest.mark.parametrize("stderr, line", [
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: `k` bad\n\nwarning: later\n",
     "ValueError: `k` bad"),
    ("usage: harness.py FAMILY SPEC_JSON\n", "usage: harness.py FAMILY SPEC_JSON"),
    ("", "no output"),
])
def test_last_error_line_finds_the_exception(stderr, line):
    assert harness.last_error_line(stderr) == line


def test_soak_slope_and_verdict():
    import soak

    growing = [(step, 100 * MB + step * 1024.0) for step in range(0, 20001, 1000)]  # 1 MB per 1000 steps.
    assert soak.slope_per_1000(growing) == pytest.approx(1000 * 1024.0)
    figures = soak.summarize(growing, 20000, 1000, tolerance_mb=8.0)
    assert figures["slope_mb_per_1000"] == pytest.approx(1000 / 1024.0) and not figures["flat"]
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
    assert [step for step, _ in samples] == [0, 10, 20, 30, 40] and all(rss > 0 for _, rss in samples)


def test_tensorpack_is_an_optional_extra_of_the_benchmarks():
    with open(os.path.join(os.path.dirname(BENCH_DIR), "setup.py")) as stream:
        assert '"bench": ["tensorpack' in stream.read()
    if importlib.util.find_spec("tensorpack") is None:
        assert peers.unavailable("tensorpack") == "tensorpack is not installed"


def _worker(engine, rank, held, ready, peak, tf_peak, seconds):
    return {"engine": engine, "rank": rank, "held": dict(zip(("model", "cache", "slots"), held)),
            "bytes_per_param": sum(held) / 10.0, "rss_ready": ready, "peak_rss": peak, "tf_peak": tf_peak,
            "wire_bytes_per_update": 4.0, "update_seconds": seconds}


def test_sharded_bench_summarizes_memory_three_ways_and_the_exchanges_alone():
    bench, mb = _bench_script("sharded"), 2 ** 20
    unsharded = [_worker("unsharded", r, (40 * mb, 40 * mb, 80 * mb), (1000 + r) * mb, 1200 * mb, 320 * mb, 0.4)
                 for r in range(2)]
    sharded = [_worker("sharded", r, (40 * mb, 40 * mb, 40 * mb), (960 + r) * mb, 1230 * mb, 290 * mb, 0.5)
               for r in range(2)]
    out = bench.summarize({("unsharded", 2): [unsharded], ("sharded", 2): [sharded]})
    assert out["sharded_p2_stage1_predicted_drop_mb"] == pytest.approx(40.0)
    assert out["sharded_p2_stage1_ready_rss_drop_mb"] == pytest.approx(40.0)
    assert out["sharded_p2_stage1_tf_peak_drop_mb"] == pytest.approx(30.0)
    assert out["sharded_p2_stage1_tf_peak_over_unsharded"] == pytest.approx(290.0 / 320.0)
    assert out["sharded_p2_stage1_rss_drop_mb"] == pytest.approx(-30.0)
    assert out["sharded_p2_stage1_time_over_unsharded"] == pytest.approx(1.25)
    probe = {"all_reduce_seconds": 0.2, "broadcasts_seconds": 0.1, "all_gather_seconds": 0.12,
             "reduce_scatter": "Failed to get CollectiveExecutor"}
    out = bench.summarize_collectives({4: [probe, dict(probe, all_reduce_seconds=9.0)]})
    assert out["collectives_p4_stage1_exchange_over_unsharded"] == pytest.approx(1.5)  # worker 0's
    assert out["collectives_p4_reduce_scatter"] == "Failed to get CollectiveExecutor"
    assert out["collectives_p4_all_gather_seconds"] == 0.12


def test_recompute_summary_gives_the_three_ratios_beside_their_a_a_and_merge_keeps_other_keys(tmp_path):
    recompute = _bench_script("recompute")  # By path: examples/recompute.py has the same module name.

    results = []
    for repeat in range(3):
        for config, peak, micro, seconds in (("plain", 60, 400, 2e-4), ("plain_twin", 60, 400, 2e-4),
                                             ("recompute", 15, 2800, 2.2e-4)):
            results.append({"spec": {"kind": "memory", "config": config, "repeat": repeat}, "tf_peak_bytes": peak})
            results.append({"spec": {"kind": "budget", "config": config, "repeat": repeat}, "largest_that_ran": micro,
                            "fused_seconds_per_example": seconds, "ingraph_seconds_per_example": seconds})
    results.append({"spec": {"kind": "time", "repeat": 0},
                    "times": {"plain": [1.0, 1.0], "plain_twin": [1.0, 1.1], "recompute": [1.2, 1.2]}})
    keys, lines = recompute.summarize(results)
    assert keys["recompute_peak_over_plain_peak"] == 0.25 and keys["recompute_peak_over_plain_peak_aa"] == 1.0
    assert keys["recompute_micro_batch_over_plain_micro_batch"] == 7.0
    assert keys["recompute_over_plain_time"] == pytest.approx(1.2) and keys["recompute_over_plain_time_ci95"]
    assert keys["recompute_verdicts"] == {"recompute_peak_over_plain_peak": "met", "recompute_over_plain_time": "met",
                                          "recompute_micro_batch_over_plain_micro_batch": "met"}
    assert any("| >= 2.50 | met |" in line for line in lines)
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"fused_over_plain_time": 1.01, "verdicts": {"fused_over_plain_time": "met"},
                                "raw": {"peers": []}, "date": "then"}))
    summary = dict(keys, date="now", quick=False, mode="tf1", machine="m", tensorflow=[], seconds=1.0,
                   load_average=[1.0, 1.0], command="c", failures=[], raw={"recompute": results},
                   verdicts={"fused_over_plain_time": "not measured"})
    merged = run._merged(str(path), summary, ["recompute"])
    assert merged["fused_over_plain_time"] == 1.01 and merged["verdicts"] == {"fused_over_plain_time": "met"}
    assert merged["date"] == "then" and merged["recompute_run"]["date"] == "now"
    assert set(merged["raw"]) == {"peers", "recompute"} and merged["recompute_peak_over_plain_peak"] == 0.25
