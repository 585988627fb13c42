"""Family "features": what optional features cost, each beside the same training without it.

Groups (one child each, rows timed side by side; a row whose feature has not landed
is skipped with the reason):

* ``statistics_cnn``, ``statistics_mlp10m``: ``GradientAccumulator(..., statistics=True)``
  (the gradient noise scale, issue 16) against ``statistics=False``;
* ``window_bn``: the CNN under the accumulator with ``gradaccum.batch_normalization``
  (window statistics, issue 19) against ``tf.compat.v1.layers.batch_normalization``;
* ``towers``: ``gradaccum.tower`` on 2 and 4 virtual CPU devices with synchronized batch
  norm (issue 14) and with per-tower batch norm, and one device; a batch of 200 per run;
* ``tensor_k_cnn``, ``tensor_k_mlp10m``: ``num_micro_batches`` as a constant tensor (the
  elastic window: k read at each window's start) against the same int.

A group with ``"profile": True`` also traces both rows after timing them (``RunMetadata``
step stats, ``harness.profile_window``) and reports where the difference goes: per
micro-step, the kernels whose summed time grew most with the feature on.

A new feature row: one ``ROWS`` entry (trainer, model arguments, requirement) and its name
in a group.
"""
import functools

import harness

GROUPS = {
    "statistics_cnn": {"setup": "cnn", "rows": ["ours", "ours_statistics"]},
    "statistics_mlp10m": {"setup": "mlp10m", "rows": ["ours", "ours_statistics"], "profile": True},
    "window_bn": {"setup": "cnn", "rows": ["ours", "ours_window_bn"]},
    "towers": {"setup": "towers", "rows": ["one_device", "towers2", "towers2_sync_bn", "towers4", "towers4_sync_bn"]},
    "tensor_k_cnn": {"setup": "cnn", "rows": ["ours", "ours_tensor_k"]},
    "tensor_k_mlp10m": {"setup": "mlp10m", "rows": ["ours", "ours_tensor_k"]},
}
SETUPS = {"cnn": {"model": "cnn", "model_args": {"width": 16}, "micro": 100, "k": 5, "cpus": 1},
          "mlp10m": {"model": "mlp", "model_args": {}, "micro": 8, "k": 8, "cpus": 1},
          "towers": {"model": "cnn", "model_args": {"width": 16}, "micro": 200, "k": 1, "cpus": 4}}
ROUNDS = {False: {"statistics_cnn": 31, "statistics_mlp10m": 41, "window_bn": 31, "towers": 21,
                 "tensor_k_cnn": 31, "tensor_k_mlp10m": 41},
          True: {"statistics_cnn": 3, "statistics_mlp10m": 3, "window_bn": 3, "towers": 3,
                 "tensor_k_cnn": 3, "tensor_k_mlp10m": 3}}
# JSON key -> (group, row, reference row).
KEYS = {
    "statistics_on_over_off_time_cnn": ("statistics_cnn", "ours_statistics", "ours"),
    "statistics_on_over_off_time_mlp10m": ("statistics_mlp10m", "ours_statistics", "ours"),
    "window_bn_over_tf_bn_time": ("window_bn", "ours_window_bn", "ours"),
    "towers2_sync_bn_over_per_tower_bn_time": ("towers", "towers2_sync_bn", "towers2"),
    "towers4_sync_bn_over_per_tower_bn_time": ("towers", "towers4_sync_bn", "towers4"),
    "towers2_over_one_device_time": ("towers", "towers2", "one_device"),
    "towers4_over_one_device_time": ("towers", "towers4", "one_device"),
    "tensor_k_over_int_k_time_cnn": ("tensor_k_cnn", "ours_tensor_k", "ours"),
    "tensor_k_over_int_k_time_mlp10m": ("tensor_k_mlp10m", "ours_tensor_k", "ours"),
}


def towers(count):
    """A trainer: ``gradaccum.tower.minimize`` over ``/cpu:0`` .. ``/cpu:<count-1>`` (k must be 1)."""
    def trainer(model_fn, images, labels, k, make_optimizer, global_step):
        from gradaccum import tower

        devices = ["/cpu:%d" % index for index in range(count)]
        return harness.Window([], tower.minimize(make_optimizer(), model_fn, [images, labels], devices=devices,
                                                 global_step=global_step, update_ops="first").train_op, [])
    return trainer


def ours_tensor_k(model_fn, images, labels, k, make_optimizer, global_step):
    """``harness.ours`` with ``num_micro_batches`` a constant int64 tensor instead of the int."""
    import tensorflow as tf

    return harness.ours(model_fn, images, labels, tf.constant(k, tf.int64), make_optimizer, global_step)


# row -> (trainer, uses gradaccum.batch_normalization, needs the `statistics` argument)
ROWS = {
    "ours": (harness.ours, False, False),
    "ours_statistics": (functools.partial(harness.ours, statistics=True), False, True),
    "ours_window_bn": (harness.ours, True, False),
    "one_device": (harness.plain, False, False),
    "towers2": (towers(2), False, False), "towers2_sync_bn": (towers(2), True, False),
    "towers4": (towers(4), False, False), "towers4_sync_bn": (towers(4), True, False),
    "ours_tensor_k": (ours_tensor_k, False, False),
}


def unavailable(row):
    """Why ``row``'s feature cannot run here (not landed yet), or None."""
    import inspect

    import gradaccum

    _, needs_bn, needs_statistics = ROWS[row]
    try:
        has_bn = hasattr(gradaccum, "batch_normalization")  # Imported lazily by gradaccum.
    except Exception as exc:  # A half-landed module is a reason, not a crash.
        return "importing gradaccum.batch_normalization failed: %s" % " ".join(str(exc).split())[:200]
    if needs_bn and not has_bn:
        return "gradaccum.batch_normalization does not exist yet"
    if needs_statistics and "statistics" not in inspect.signature(gradaccum.GradientAccumulator).parameters:
        return "GradientAccumulator has no `statistics` argument yet"
    return None


def plan(quick):
    """One timing child per group."""
    return [{"kind": "time", "group": name, "rounds": ROUNDS[quick][name]} for name in GROUPS]


def measure(spec):
    """Times one group's available rows side by side; returns times and skip reasons."""
    import gradaccum

    group = dict(GROUPS[spec["group"]], **spec.get("override", {}))
    setup = dict(SETUPS[group["setup"]], **spec.get("setup_override", {}))
    skipped = dict((row, unavailable(row)) for row in group["rows"] if unavailable(row))
    benches = []
    try:
        for row in [r for r in group["rows"] if r not in skipped]:
            trainer, needs_bn, _ = ROWS[row]
            args = dict(setup["model_args"], **({"batch_norm": gradaccum.batch_normalization} if needs_bn else {}))
            benches.append(harness.build_bench(row, setup["model"], trainer, setup["micro"], setup["k"], args,
                                               cpus=setup["cpus"]))
        times = harness.time_side_by_side(benches, spec["rounds"], max_seconds=30) if len(benches) > 1 else {}
        profile = _profile_difference(benches) if group.get("profile") and len(benches) == 2 else None
    finally:
        harness.close(benches)
    return {"group": spec["group"], "setup": setup, "times": times, "skipped": skipped, "profile": profile}


def _kernel_ms_per_step(bench, windows=3):
    """``{kernel: ms}`` per micro-step, summed over scopes and averaged over a window's steps."""
    totals = {}
    steps = harness.profile_window(bench, windows)
    for step in steps:
        for _, kind, ms in step:
            totals[kind] = totals.get(kind, 0.0) + ms / len(steps)
    return totals


def _profile_difference(benches, top=6):
    """The kernels whose time per micro-step grew most from the first row (off) to the second (on)."""
    off, on = (_kernel_ms_per_step(bench) for bench in benches)
    grown = sorted(((on.get(kind, 0.0) - off.get(kind, 0.0), kind) for kind in set(on) | set(off)), reverse=True)
    return {"rows": [bench.name for bench in benches], "total_ms": [sum(off.values()), sum(on.values())],
            "grown": [[kind, ms] for ms, kind in grown[:top]]}


def summarize(results):
    """JSON keys (None where a row was skipped) and one markdown table of all groups."""
    by_group = dict((r["group"], r) for r in results)
    keys, cells = {}, []
    for key, (group, row, reference) in KEYS.items():
        result = by_group.get(group, {"times": {}, "skipped": {}})
        keys[key], keys[key + "_ci95"] = harness.ratio_with_ci(result["times"], row, reference)
        reason = result["skipped"].get(row) or result["skipped"].get(reference) or (
            "" if group in by_group else "not run")
        ci = keys[key + "_ci95"] or [None, None]
        cells.append(["`%s`: %s / %s" % (key, row, reference), harness.fmt(keys[key]),
                      "%s-%s" % (harness.fmt(ci[0]), harness.fmt(ci[1])), len(result["times"].get(row, [])),
                      "skipped: %s" % reason if reason else ""])
    keys["features_skipped"] = dict((r["group"], r["skipped"]) for r in results if r["skipped"])
    keys["features_profiles"] = dict((r["group"], r["profile"]) for r in results if r.get("profile"))
    lines = ["### Features: cost against the same training without them", "",
             "Statistics and window BN: time per micro-step (CNN: width 16, micro-batch 100, k = 5; MLP: 10M, "
             "micro-batch 8, k = 8). Towers: time per example, a batch of 200 per run on 4 virtual CPU devices "
             "(2 real cores: overhead only)."] + [""] + harness.markdown_table(
                 ["ratio", "median of per-round ratios", "95% CI", "rounds", "note"], cells)
    for group, profile in sorted(keys["features_profiles"].items()):
        lines += _profile_lines(group, profile)
    return keys, lines


def _profile_lines(group, profile):
    off, on = profile["rows"]
    lines = ["", "Where `%s`'s time goes: kernel time per micro-step under `RunMetadata` tracing (which slows "
             "every kernel alike), %s %.2f ms, %s %.2f ms; the kernels that grew most:" % (
                 group, off, profile["total_ms"][0], on, profile["total_ms"][1]), ""]
    return lines + harness.markdown_table(["kernel", "ms per micro-step, %s - %s" % (on, off)],
                                          [[kind, "%+.3f" % ms] for kind, ms in profile["grown"]])
