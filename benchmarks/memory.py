"""Family "memory": one update of a batch B of the example's CNN, directly and as k micro-batches.

Configurations (one fresh process each, repeated ``REPEATS`` times, interleaved):
``full`` (plain training on B), ``plain`` (plain training on B/k), ``ours`` (the
accumulator on k micro-batches of B/k). Each child runs with the BFC CPU allocator
(``TF_CPU_ALLOCATOR_USE_BFC=true``) so that TensorFlow's own peak is known where TF
keeps it (TF >= 2.5; TF 1.15 has no allocator statistics: ``n/a``), beside peak RSS.
Target: ours <= (plain at B/k + one copy of the parameters) x 1.05.
"""
import statistics

import harness

PLANS = {False: {"batch": 1000, "ks": [1, 10, 50], "repeats": 2}, True: {"batch": 400, "ks": [10], "repeats": 1}}
TRAINERS = {"full": harness.plain, "plain": harness.plain, "ours": harness.ours}


def plan(quick):
    """The configurations, repeat 1 of each first, then repeat 2, ..."""
    settings = PLANS[quick]
    configs = [("full", settings["batch"], 1)]
    configs += [("plain", settings["batch"] // k, k) for k in settings["ks"] if k > 1]
    configs += [("ours", settings["batch"] // k, k) for k in settings["ks"]]
    return [{"kind": "memory", "config": config, "micro": micro, "k": k, "repeat": repeat,
             "env": {"TF_CPU_ALLOCATOR_USE_BFC": "true"}}
            for repeat in range(settings["repeats"]) for config, micro, k in configs]


def measure(spec):
    """Builds one configuration on the CNN (width 16 unless overridden) and measures one window."""
    model_args = spec.get("model_args", {"width": 16})
    bench = harness.build_bench(spec["config"], "cnn", TRAINERS[spec["config"]], spec["micro"], spec["k"], model_args)
    result = harness.measure_memory(bench, windows=1)
    result["param_bytes"] = 4 * harness.trainable_floats(bench.session.graph)
    bench.session.close()
    return result


def _median(results, key):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def _ratio(top, bottom, extra=0.0):
    return None if top is None or bottom is None else top / (bottom + extra)


def summarize(results):
    """Ratios per k (medians of the repeats); the largest k gives the headline keys."""
    def cell(config, k):
        chosen = [r for r in results if r["spec"]["config"] == config and r["spec"]["k"] == k]
        return dict((key, _median(chosen, key)) for key in ("peak_rss_bytes", "tf_peak_bytes"))

    if not results:
        return {}, []
    full, params = cell("full", 1), float(results[0]["param_bytes"])
    rows, cells = [], []
    for k in sorted(set(r["spec"]["k"] for r in results if r["spec"]["config"] == "ours")):
        plain, ours = (full if k == 1 else cell("plain", k)), cell("ours", k)
        rows.append({"k": k, "plain": plain, "ours": ours,
                     "over_micro_plus_params": _ratio(ours["peak_rss_bytes"], plain["peak_rss_bytes"], params),
                     "over_full": _ratio(ours["peak_rss_bytes"], full["peak_rss_bytes"]),
                     "tf_over_micro_plus_params": _ratio(ours["tf_peak_bytes"], plain["tf_peak_bytes"], params),
                     "tf_over_full": _ratio(ours["tf_peak_bytes"], full["tf_peak_bytes"])})
        cells.append([k, harness.mb(plain["peak_rss_bytes"]), harness.mb(ours["peak_rss_bytes"]),
                      harness.fmt(rows[-1]["over_micro_plus_params"]), harness.fmt(rows[-1]["over_full"]),
                      harness.mb(plain["tf_peak_bytes"]), harness.mb(ours["tf_peak_bytes"]),
                      harness.fmt(rows[-1]["tf_over_micro_plus_params"]), harness.fmt(rows[-1]["tf_over_full"])])
    last, batch = rows[-1], results[0]["spec"]["micro"] * results[0]["spec"]["k"]
    keys = {"accumulated_peak_over_micro_peak_plus_params": last["over_micro_plus_params"],
            "accumulated_peak_over_full_batch_peak": last["over_full"],
            "tf_allocator_accumulated_peak_over_micro_peak_plus_params": last["tf_over_micro_plus_params"],
            "tf_allocator_accumulated_peak_over_full_batch_peak": last["tf_over_full"],
            "memory_ratios_k": last["k"], "memory_rows": rows, "memory_full_batch": full}
    lines = ["### Memory: one update of a batch of %d, the example's CNN (width 16)" % batch, "",
             "Median of %d process(es) per configuration, BFC allocator on. Full batch directly: peak RSS %s, TF "
             "peak %s." % (max(r["spec"]["repeat"] for r in results) + 1, harness.mb(full["peak_rss_bytes"]),
                           harness.mb(full["tf_peak_bytes"])),
             ""] + harness.markdown_table(
                 ["k", "peak RSS, plain B/k", "peak RSS, ours", "ours / (plain + params)", "ours / full",
                  "TF peak, plain", "TF peak, ours", "TF: ours / (plain + params)", "TF: ours / full"], cells)
    return keys, lines
