"""Family "peers": accumulation beside its peers, correctness included, and the memory floor.

Rows (trainers, see ``harness``): ``ours`` (``GradientAccumulator``, ``weight`` = the
micro-batch size), ``ours_unweighted`` (``weight=None``), ``ours_twin`` (``ours`` built
again: an A/A pair, the resolution of every ratio here), ``plain`` (Adam on every
micro-batch), ``fwd_bwd`` (forward and backward only), ``wrapped_apply`` (Adam's apply
alone, the part of a window the floor leaves out), ``seeds_manual`` (seeds 000/001:
zero, accumulate, apply ``cache / k`` in three kinds of run), ``tensorpack``
(``AccumGradOptimizer``), ``horovod`` (``backward_passes_per_step``, one process) and
``ingraph`` (``gradaccum.subdivisions.minimize``: the same k micro-batches, fed end to end,
in one run per window; its time is per micro-batch like the others').
A peer is one trainer function plus one ``ROWS`` entry; a model is one ``SETUPS`` entry.

Per setup, one child times its rows side by side (the MLP also times ``a += b`` stream
passes over as many floats as it has parameters: the floor), then measures every
accumulating row's update against the full-batch update (SGD), and profiles ``ours``.
One more child per row measures its memory (BFC allocator on, for TF's own peak).
"""
import importlib
import importlib.util
import statistics

import harness

SETUPS = {
    "mlp10m": {"model": "mlp", "model_args": {}, "micro": 8, "k": 8, "floor": True,
               "rows": ["ours", "ours_unweighted", "ours_twin", "plain", "fwd_bwd", "wrapped_apply", "seeds_manual",
                        "tensorpack", "horovod", "ingraph"]},
    "cnn": {"model": "cnn", "model_args": {"width": 16}, "micro": 100, "k": 5, "floor": False,
            "rows": ["ours", "ours_twin", "plain", "seeds_manual", "tensorpack", "horovod", "ingraph"]},
}
ROUNDS = {False: {"mlp10m": 20, "cnn": 21, "onednn_off": 25}, True: {"mlp10m": 10, "cnn": 8, "onednn_off": 5}}
SECONDS = {"mlp10m": 30, "cnn": 40, "onednn_off": 30}  # At most, once 5 rounds are done (a loaded machine;
# the MLP went from 27 to 30 s with the one-run row, so that a quiet machine still runs its 20 rounds).
# Timing children per setup, their rounds pooled. Where a bench's buffers land moves a 10M-parameter
# row by a few percent (``ours_twin`` against ``ours``, one graph built twice: 0.96 to 1.01 in single
# children): eight MLP children average over eight placements, and odd ones build their rows in
# reverse order, so each pair is built both ways round. (A build-order effect measured before the
# rounds were shuffled was at least partly the rotation's: it fixed each bench's predecessor.)
PROCESSES = {False: {"mlp10m": 8, "cnn": 4}, True: {"mlp10m": 2, "cnn": 2}}
ERROR_WINDOWS = {False: 10, True: 4}
ACCUMULATORS = ("ours", "ours_unweighted", "seeds_manual", "tensorpack", "horovod", "ingraph")
# One run per update (key ``ingraph``) / the best (in paired terms: the largest ratio) of these rows, and the issue's target. On the MLP
# tensorpack is left out: it sums the micro-batches' gradients (k - 1 times too large an update).
INGRAPH_KEYS = {"cnn": ("cnn_ingraph_over_best_peer_time", ("ours", "seeds_manual", "tensorpack", "plain")),
                "mlp10m": ("mlp10m_ingraph_over_best_exact_time", ("ours", "seeds_manual", "plain"))}
LABELS = {
    "ours": "gradaccum `GradientAccumulator`, weight = micro-batch size",
    "ours_unweighted": "gradaccum, `weight=None`",
    "ours_twin": "gradaccum, weight = micro-batch size, built again (A/A: the resolution)",
    "plain": "plain Adam on every micro-batch (no accumulation)",
    "fwd_bwd": "forward + backward only (no update)",
    "wrapped_apply": "the wrapped Adam's apply alone, from fixed gradients (time per apply)",
    "seeds_manual": "seeds' manual zero / accumulate / apply",
    "tensorpack": "tensorpack `AccumGradOptimizer`",
    "horovod": "Horovod `backward_passes_per_step`, 1 process",
    "ingraph": "gradaccum `subdivisions.minimize`: the window in one run (`tf.while_loop`)",
}


def seeds_manual(model_fn, images, labels, k, make_optimizer, global_step):
    """Seed 000's pattern: ``zero`` run, k ``accumulate`` runs, ``apply(cache / k)`` run."""
    tf = harness._tf()
    loss = model_fn(images, labels)
    opt = make_optimizer()
    pairs = [(g, v) for g, v in opt.compute_gradients(loss) if g is not None]
    caches = [tf.compat.v1.Variable(tf.zeros(v.shape, v.dtype.base_dtype), trainable=False) for _, v in pairs]
    zero = tf.group(*[tf.compat.v1.assign(c, tf.zeros_like(c)) for c in caches])
    with tf.control_dependencies(harness.update_ops()):
        accumulate = tf.group(*[tf.compat.v1.assign_add(c, g) for c, (g, _) in zip(caches, pairs)])
    apply = opt.apply_gradients([(c / float(k), v) for c, (_, v) in zip(caches, pairs)], global_step)
    return harness.Window([zero], accumulate, [apply])


def tensorpack(model_fn, images, labels, k, make_optimizer, global_step):
    """tensorpack's ``AccumGradOptimizer`` (it counts its own micro-steps; no global_step)."""
    from tensorpack.tfutils.optimizer import AccumGradOptimizer

    tf = harness._tf()
    loss = model_fn(images, labels)
    with tf.control_dependencies(harness.update_ops()):
        return harness.Window([], AccumGradOptimizer(make_optimizer(), k).minimize(loss), [])


def wrapped_apply(model_fn, images, labels, k, make_optimizer, global_step):
    """The wrapped optimizer's apply alone: what every accumulating row runs once per window, and the
    floor leaves out. Each run applies fixed gradients (no forward, no backward)."""
    tf = harness._tf()
    model_fn(images, labels)
    variables = tf.compat.v1.trainable_variables()
    grads = [tf.compat.v1.Variable(tf.fill(v.shape, 1e-3), trainable=False, use_resource=True) for v in variables]
    return harness.Window([], make_optimizer().apply_gradients(
        [(g.read_value(), v) for g, v in zip(grads, variables)], global_step), [])


def horovod(model_fn, images, labels, k, make_optimizer, global_step):
    """Horovod's ``DistributedOptimizer(backward_passes_per_step=k)`` on one process."""
    import horovod.tensorflow as hvd

    tf = harness._tf()
    hvd.init()
    loss = model_fn(images, labels)
    optimizer = hvd.DistributedOptimizer(make_optimizer(), backward_passes_per_step=k)
    with tf.control_dependencies(harness.update_ops()):
        return harness.Window([], optimizer.minimize(loss, global_step=global_step), [])


ROWS = {"ours": harness.ours, "ours_unweighted": harness.ours_unweighted, "ours_twin": harness.ours,
        "plain": harness.plain, "fwd_bwd": harness.fwd_bwd, "wrapped_apply": wrapped_apply,
        "seeds_manual": seeds_manual, "tensorpack": tensorpack, "horovod": horovod, "ingraph": harness.one_run}
IMPORTS = {"tensorpack": "tensorpack.tfutils.optimizer", "horovod": "horovod.tensorflow"}
NOT_TRAINING = ("fwd_bwd", "wrapped_apply")  # Parts of a step, timed for the floor: not peers.
TIMING_ONLY = NOT_TRAINING + ("ours_twin",)  # No memory child: ``ours`` measures the same graph.


def unavailable(row):
    """Why ``row`` cannot run here (a one-line reason), or None."""
    module = IMPORTS.get(row)
    if module is None:
        return None
    if importlib.util.find_spec(row) is None:
        return "%s is not installed" % row
    try:
        importlib.import_module(module)
    except Exception as exc:  # An installed but broken package is a reason, not a crash.
        return "importing %s failed: %s" % (module, " ".join(str(exc).split())[:200])
    return None


def plan(quick):
    """The children: timing children per setup (``PROCESSES``; the first also measures errors and the
    profile), a oneDNN-off CNN child, one memory child per MLP row."""
    specs = [{"kind": "time", "setup": name, "rounds": ROUNDS[quick][name], "repeat": repeat,
              "error_windows": 0 if repeat else ERROR_WINDOWS[quick]}
             for name in SETUPS for repeat in range(PROCESSES[quick][name])]
    specs.append({"kind": "time", "setup": "cnn", "tag": "onednn_off", "rows": ["ours", "plain"],
                  "rounds": ROUNDS[quick]["onednn_off"], "error_windows": 0,
                  "env": {"TF_ENABLE_ONEDNN_OPTS": "0"}})
    # Memory per row on the MLP only: the CNN's 0.4 MB of parameters make every row alike there. A peer that
    # is not installed gets no child (``find_spec``, not ``unavailable``: that would import TF into the parent).
    specs += [{"kind": "memory", "setup": "mlp10m", "row": row, "env": {"TF_CPU_ALLOCATOR_USE_BFC": "true"}}
              for row in SETUPS["mlp10m"]["rows"] if row not in TIMING_ONLY
              and (row not in IMPORTS or importlib.util.find_spec(row) is not None)]
    return specs


def _setup(spec):
    setup = dict(SETUPS[spec["setup"]], **spec.get("override", {}))
    if "rows" in spec:
        setup["rows"] = spec["rows"]
    return setup


def _build(row, setup, **kwargs):
    return harness.build_bench(row, setup["model"], ROWS[row], setup["micro"], setup["k"], setup["model_args"],
                               **kwargs)


def measure(spec):
    """Runs one child's share (see ``plan``); returns plain JSON data."""
    setup = _setup(spec)
    if spec["kind"] == "memory":
        reason = unavailable(spec["row"])
        return {"skipped": reason} if reason else harness.measure_memory(_build(spec["row"], setup))
    reasons = dict((row, unavailable(row)) for row in setup["rows"])
    skipped = dict((row, reason) for row, reason in reasons.items() if reason)
    order = setup["rows"][::-1] if spec.get("repeat", 0) % 2 else setup["rows"]
    benches = [_build(row, setup) for row in order if row not in skipped]
    params = harness.trainable_floats(benches[0].session.graph)
    extra = [harness.stream_bench(params), harness.numpy_stream_bench(params)] if setup.get("floor") else []
    try:
        times = harness.time_side_by_side(benches + extra, spec["rounds"], seed=spec.get("repeat", 0),
                                          max_seconds=SECONDS[spec.get("tag") or spec["setup"]])
        named = dict((bench.name, bench) for bench in benches)
        profiled = setup.get("floor") and "ours" in named and "fwd_bwd" in named and not spec.get("repeat")
        steps = harness.profile_window(named["ours"]) if profiled else None
        base = harness.profile_window(named["fwd_bwd"], 1)[0] if profiled else None
    finally:
        harness.close(benches + extra)
    errors = {}
    for row in [r for r in setup["rows"] if r in ACCUMULATORS and r not in skipped and spec["error_windows"]]:
        bench = _build(row, setup, optimizer="sgd", reference=True)
        errors[row] = harness.update_errors(bench, spec["error_windows"])
        bench.session.close()
    return {"setup": spec["setup"], "tag": spec.get("tag"), "micro": setup["micro"], "k": setup["k"],
            "model": setup["model"], "model_args": setup["model_args"], "params": params, "times": times,
            "skipped": skipped, "errors": errors, "variable_bytes": dict((b.name, b.variable_bytes) for b in benches),
            "profile": {"steps": steps, "fwd_bwd": base} if steps else None}


def _floor(result):
    """Floor figures of a setup timed with the stream benches (per round, then medians)."""
    times, k, params = result["times"], result["k"], result["params"]
    bandwidth = harness.stream_bandwidth_gbs(times, params)
    bytes_per_step = 4.0 * params * (3 + 2.0 / k)  # Accumulate: read g, read+write cache; scale once per k.
    floors = [bytes_per_step / (gbs * 1e9) for gbs in bandwidth]
    overheads = [(a - b) / f for a, b, f in zip(times["ours"], times["fwd_bwd"], floors)]
    # The floor has no term for the wrapped optimizer's apply; take it out (once per window) as well.
    applies = times.get("wrapped_apply", [])  # Not timed: no rounds, so no figure.
    own = [(a - b - c / k) / f for a, b, c, f in zip(times["ours"], times["fwd_bwd"], applies, floors)]
    # The least any accumulator with a float32 cache per parameter could cost around this apply: the first
    # micro-step adopts its gradient, no division (1/k folded into the loss), k - 1 adds at the stream's speed.
    adds = 12.0 * params * (k - 1) / k
    least = [(adds / (gbs * 1e9) + c / k) / f for gbs, c, f in zip(bandwidth, applies, floors)]
    keys = {"stream_bandwidth_gbs": statistics.median(bandwidth), "floor_ms": statistics.median(floors) * 1e3,
            "floor_bytes_per_micro_step": bytes_per_step,
            "mlp10m_overhead_ms": statistics.median(a - b for a, b in zip(times["ours"], times["fwd_bwd"])) * 1e3,
            "mlp10m_wrapped_apply_ms": statistics.median(applies) * 1e3 if applies else None,
            "mlp10m_fwd_bwd_ms": statistics.median(times["fwd_bwd"]) * 1e3,
            "stream_tf_gbs": statistics.median(harness.stream_bandwidth_gbs(times, params, ["stream"])),
            "stream_numpy_gbs": statistics.median(harness.stream_bandwidth_gbs(times, params, ["stream_numpy"]))}
    for name, series in (("overhead", overheads), ("own_overhead", own), ("least_possible_overhead", least)):
        keys["mlp10m_%s_over_floor" % name], keys["mlp10m_%s_over_floor_ci95" % name] = harness.median_with_ci(series)
    return keys


def _rows(result, memory):
    """The ``peers`` JSON rows of one setup."""
    rows = []
    for row in SETUPS[result["setup"]]["rows"] if result["setup"] in SETUPS else result["times"]:
        mem = memory.get((result["setup"], row), {})
        ratio, ci = harness.ratio_with_ci(result["times"], row, "ours")
        errors = result["errors"].get(row)
        rows.append({"name": row, "model": result["setup"], "label": LABELS.get(row, row),
                     "skipped": result["skipped"].get(row) or mem.get("skipped"),
                     "ms_per_micro_step": statistics.median(result["times"][row]) * 1e3 if row in result["times"]
                     else None, "time_ratio": ratio, "time_ratio_ci95": ci,
                     "max_rel_error_vs_full_batch": max(errors) if errors else None,
                     "rel_errors_by_window": errors, "peak_rss_bytes": mem.get("peak_rss_bytes"),
                     "tf_peak_bytes": mem.get("tf_peak_bytes"),
                     "variable_bytes": result["variable_bytes"].get(row, mem.get("variable_bytes"))})
    return rows


def over_best(times, top, peers):
    """``(ratio, [low, high], peer)``: ``top`` over the timed ``peers`` row it beats least (the largest paired
    ratio, so the one that is fastest beside it), or ``(None, None, None)`` when there is none."""
    ratios = [harness.ratio_with_ci(times, top, peer) + (peer,) for peer in peers if peer in times]
    ratios = [entry for entry in ratios if entry[0] is not None]
    return max(ratios, key=lambda entry: entry[0]) if ratios else (None, None, None)


def _profile_account(profile, k, top=12):
    """Ops of ``ours`` per accumulate step (mean of steps 1..k-1) and at the applying step, beside fwd+bwd."""
    def table(entries):
        return dict(((scope, kind), ms) for scope, kind, ms in entries)

    steps = [table(step) for step in profile["steps"]]
    accumulate = dict((key, sum(s.get(key, 0.0) for s in steps[:-1]) / (k - 1)) for key in set().union(*steps[:-1]))
    apply, base = steps[-1], table(profile["fwd_bwd"])
    keys = sorted(set(accumulate) | set(apply), key=lambda key: -(accumulate.get(key, 0) + apply.get(key, 0) / k))
    return [{"scope": scope, "op": kind, "fwd_bwd_ms": base.get((scope, kind), 0.0),
             "accumulate_step_ms": accumulate.get((scope, kind), 0.0),
             "applying_step_ms": apply.get((scope, kind), 0.0)}
            for scope, kind in keys[:top]] + [{
                "scope": "(all ops)", "op": "sum", "fwd_bwd_ms": sum(base.values()),
                "accumulate_step_ms": sum(accumulate.values()), "applying_step_ms": sum(apply.values())}]


def _markdown(setup, rows, result):
    header = ["training", "ms / micro-step", "time / ours (95% CI)", "max rel. error vs full batch",
              "peak RSS", "TF peak (BFC)", "variables"]
    cells = []
    for row in rows:
        if row["time_ratio"] is None:
            cells.append([row["label"], "skipped: %s" % row["skipped"] if row["skipped"] else "not measured",
                          "", "", "", "", ""])
            continue
        ci = row["time_ratio_ci95"]
        cells.append([row["label"], harness.fmt(row["ms_per_micro_step"], 2),
                      "%s (%s-%s)" % (harness.fmt(row["time_ratio"]), harness.fmt(ci[0]), harness.fmt(ci[1])),
                      "%.2g" % row["max_rel_error_vs_full_batch"] if row["max_rel_error_vs_full_batch"] is not None
                      else "-", harness.mb(row["peak_rss_bytes"]), harness.mb(row["tf_peak_bytes"]),
                      harness.mb(row["variable_bytes"])])
    model = ("MLP 784-2048-2048-2048-10 (%.1fM parameters)" % (result["params"] / 1e6) if setup == "mlp10m"
             else "the example's CNN (width %d)" % result["model_args"].get("width", 16))
    return ["### Peers: %s, micro-batch %d, k = %d" % (model, result["micro"], result["k"]), "",
            "Time: median of %d interleaved rounds in %d process(es), ratio = median of per-round ratios. Error: the "
            "largest, over %d windows, of |update - full-batch update| / |full-batch update| (SGD, global norm)."
            % (len(result["times"]["ours"]), result.get("processes", 1), len((result["errors"].get("ours") or [0]))),
            ""] + \
        harness.markdown_table(header, cells)


def _profile_markdown(account, k):
    header = ["scope", "op", "fwd+bwd step, ms", "accumulate step, ms", "applying step, ms"]
    cells = [[a["scope"], a["op"], harness.fmt(a["fwd_bwd_ms"], 2), harness.fmt(a["accumulate_step_ms"], 2),
              harness.fmt(a["applying_step_ms"], 2)] for a in account]
    return ["### Where the time goes: ours on the 10M MLP, op by op (RunMetadata step stats)", "",
            "Op time summed by top-level scope and op type; accumulate step = mean of micro-steps 1..%d, "
            "applying step = micro-step %d. Traced runs are slower than untraced ones: compare within a column."
            % (k - 1, k), ""] + harness.markdown_table(header, cells)


def _pooled(first, other):
    """Two timing children of one setup as one: rounds appended, errors and profile of either."""
    times = dict((name, first["times"][name] + other["times"].get(name, [])) for name in first["times"])
    return dict(first, times=times, errors=first["errors"] or other["errors"],
                profile=first["profile"] or other["profile"], processes=first.get("processes", 1) + 1)


def summarize(results):
    """JSON keys and markdown of the peers family (``results`` in ``plan`` order, each with its ``spec``)."""
    memory = dict(((r["spec"]["setup"], r["spec"]["row"]), r) for r in results if r["spec"]["kind"] == "memory")
    timed = {}
    for result in [r for r in results if r["spec"]["kind"] == "time"]:
        key = (result["setup"], result.get("tag"))
        timed[key] = _pooled(timed[key], result) if key in timed else result
    keys, lines, peers = {}, [], []
    for (setup, tag), result in sorted(timed.items(), key=lambda item: (item[0][0] != "mlp10m", str(item[0][1]))):
        if tag:
            continue
        rows = _rows(result, memory)
        peers += rows
        lines += _markdown(setup, rows, result) + [""]
        keys["%s_twin_over_ours_time" % setup], keys["%s_twin_over_ours_time_ci95" % setup] = \
            harness.ratio_with_ci(result["times"], "ours_twin", "ours")
        if setup in INGRAPH_KEYS:
            key, rivals = INGRAPH_KEYS[setup]
            keys[key], keys[key + "_ci95"], keys[key + "_peer"] = over_best(result["times"], "ingraph", rivals)
        if result.get("params") and "fwd_bwd" in result["times"]:
            keys.update(_floor(result))
            keys["mlp10m_weighted_over_unweighted_time"], keys["mlp10m_weighted_over_unweighted_time_ci95"] = \
                harness.ratio_with_ci(result["times"], "ours", "ours_unweighted")
            keys["fused_over_plain_time_mlp10m"] = harness.ratio_with_ci(result["times"], "ours", "plain")[0]
        if result.get("profile"):
            keys["mlp10m_profile"] = _profile_account(result["profile"], result["k"])
            lines += _profile_markdown(keys["mlp10m_profile"], result["k"]) + [""]
    for tag, suffix in ((None, ""), ("onednn_off", "_onednn_off")):
        if ("cnn", tag) in timed:
            keys["fused_over_plain_time" + suffix], keys["fused_over_plain_time%s_ci95" % suffix] = \
                harness.ratio_with_ci(timed[("cnn", tag)]["times"], "ours", "plain")
    keys["peers"] = peers
    return keys, lines
