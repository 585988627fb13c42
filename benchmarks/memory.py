"""Family "memory": one update of a batch B of the example's CNN, directly and as k micro-batches.

Configurations (one fresh process each, repeated as ``PLANS`` says, interleaved):
``full`` (plain training on B), ``plain`` (plain training on B/k), ``ours`` (the
accumulator on k micro-batches of B/k, k runs) and ``ingraph``, one run per update
(``gradaccum.subdivisions.minimize``: the same k micro-batches in one run, fed the whole
batch). Each child runs with the BFC CPU allocator (``TF_CPU_ALLOCATOR_USE_BFC=true``) so
that TensorFlow's own peak is known where TF keeps it (TF >= 2.5; TF 1.15 has no
allocator statistics: ``n/a``), beside peak RSS.
Targets: ours <= (plain at B/k + one copy of the parameters) x 1.05; one run per update <= (plain
at B/k + one copy of the parameters + the sums, one more copy) x 1.05, with the whole
batch's fed inputs in its peak (the table's note also gives the ratio with them added to
the bound).
"""
import statistics

import harness

PLANS = {False: {"batch": 1000, "ks": [1, 10, 50], "repeats": 2}, True: {"batch": 400, "ks": [10], "repeats": 1}}
TRAINERS = {"full": harness.plain, "plain": harness.plain, "ours": harness.ours, "ingraph": harness.one_run}
# Copies of the parameters an accumulating configuration may hold beside a plain micro-batch's peak: ours
# its cache; the one-run loop its sums and one more copy (the bound).
EXTRA_PARAMS = {"ours": 1, "ingraph": 2}
# results.json's keys (at the largest k) -> the ratio in that k's row.
HEADLINE_KEYS = {
    "accumulated_peak_over_micro_peak_plus_params": "over_micro_plus_params",
    "accumulated_peak_over_full_batch_peak": "over_full",
    "tf_allocator_accumulated_peak_over_micro_peak_plus_params": "tf_over_micro_plus_params",
    "tf_allocator_accumulated_peak_over_full_batch_peak": "tf_over_full",
    "ingraph_peak_over_micro_peak_plus_params": "ingraph_over_micro_plus_params",
    "ingraph_peak_over_full_batch_peak": "ingraph_over_full",
    "tf_allocator_ingraph_peak_over_micro_peak_plus_params": "ingraph_tf_over_micro_plus_params",
    "tf_allocator_ingraph_peak_over_full_batch_peak": "ingraph_tf_over_full",
    "ingraph_peak_over_micro_peak_plus_params_plus_feed": "ingraph_over_micro_plus_params_plus_feed",
    "tf_allocator_ingraph_peak_over_micro_peak_plus_params_plus_feed": "ingraph_tf_over_micro_plus_params_plus_feed",
}
# Keys that also get ``_ci95``: their ratio repeat by repeat -> (configuration, figure).
INTERVALS = {"accumulated_peak_over_micro_peak_plus_params": ("ours", "peak_rss_bytes"),
             "tf_allocator_accumulated_peak_over_micro_peak_plus_params": ("ours", "tf_peak_bytes"),
             "ingraph_peak_over_micro_peak_plus_params": ("ingraph", "peak_rss_bytes"),
             "tf_allocator_ingraph_peak_over_micro_peak_plus_params": ("ingraph", "tf_peak_bytes")}


def plan(quick):
    """The configurations, repeat 1 of each first, then repeat 2, ..."""
    settings = PLANS[quick]
    configs = [("full", settings["batch"], 1)]
    configs += [("plain", settings["batch"] // k, k) for k in settings["ks"] if k > 1]
    configs += [(config, settings["batch"] // k, k) for config in ("ours", "ingraph") for k in settings["ks"]]
    return [{"kind": "memory", "config": config, "micro": micro, "k": k, "repeat": repeat,
             "env": {"TF_CPU_ALLOCATOR_USE_BFC": "true"}}
            for repeat in range(settings["repeats"]) for config, micro, k in configs]


def measure(spec):
    """Builds one configuration on the CNN (width 16 unless overridden) and measures one window."""
    model_args = spec.get("model_args", {"width": 16})
    bench = harness.build_bench(spec["config"], "cnn", TRAINERS[spec["config"]], spec["micro"], spec["k"], model_args)
    result = harness.measure_memory(bench, windows=1)
    result["param_bytes"] = 4 * harness.trainable_floats(bench.session.graph)
    result["feed_bytes"] = int(sum(array.nbytes for feed in bench.feeds for array in feed.values()))  # The window's.
    bench.session.close()
    return result


def _median(results, key):
    values = [r[key] for r in results if r.get(key) is not None]
    return statistics.median(values) if values else None


def _ratio(top, bottom, extra=0.0):
    return None if top is None or bottom is None else top / (bottom + extra)


def _versus(mine, plain, full, extra):
    """A configuration's peaks over (the plain micro-batch's + ``extra`` bytes) and over the full batch's."""
    return {"over_micro_plus_params": _ratio(mine["peak_rss_bytes"], plain["peak_rss_bytes"], extra),
            "over_full": _ratio(mine["peak_rss_bytes"], full["peak_rss_bytes"]),
            "tf_over_micro_plus_params": _ratio(mine["tf_peak_bytes"], plain["tf_peak_bytes"], extra),
            "tf_over_full": _ratio(mine["tf_peak_bytes"], full["tf_peak_bytes"])}


def _per_repeat(results, config, k, extra, key):
    """``(median, [low, high])`` of ``config``'s peak over (plain's + ``extra``), repeat by repeat (a range,
    not a 95% interval, below 6 repeats: see ``harness.median_ci95``)."""
    def peaks(name, size):
        return dict((r["spec"]["repeat"], r.get(key)) for r in results
                    if r["spec"]["config"] == name and r["spec"]["k"] == size)
    mine, plain = peaks(config, k), peaks("full", 1) if k == 1 else peaks("plain", k)
    return harness.median_with_ci(_ratio(mine[r], plain[r], extra) for r in sorted(mine)
                                  if r in plain and None not in (mine[r], plain[r]))


def _row(k, cell, full, params, feed):
    """One k's peaks and ratios: ours' unprefixed (as before), the one-run form's prefixed ``ingraph_`` (the results' keys)."""
    row = {"k": k, "plain": full if k == 1 else cell("plain", k)}
    for config, prefix in (("ours", ""), ("ingraph", "ingraph_")):
        row[config] = cell(config, k)
        row.update((prefix + key, value) for key, value in
                   _versus(row[config], row["plain"], full, EXTRA_PARAMS[config] * params).items())
    if feed is not None:  # The bound again, with the whole batch's fed inputs added to it.
        fed = _versus(row["ingraph"], row["plain"], full, EXTRA_PARAMS["ingraph"] * params + feed)
        row["ingraph_over_micro_plus_params_plus_feed"] = fed["over_micro_plus_params"]
        row["ingraph_tf_over_micro_plus_params_plus_feed"] = fed["tf_over_micro_plus_params"]
    return row


def _table(config, rows, label=None):
    """The rows of ``config`` (the results' key) as a table, its columns headed ``label`` (``config`` by default)."""
    prefix, bound = ("", "params") if config == "ours" else (config + "_", "2 params")
    label = label or config
    cells = [[row["k"], harness.mb(row["plain"]["peak_rss_bytes"]), harness.mb(row[config]["peak_rss_bytes"]),
              harness.fmt(row[prefix + "over_micro_plus_params"]), harness.fmt(row[prefix + "over_full"]),
              harness.mb(row["plain"]["tf_peak_bytes"]), harness.mb(row[config]["tf_peak_bytes"]),
              harness.fmt(row[prefix + "tf_over_micro_plus_params"]), harness.fmt(row[prefix + "tf_over_full"])]
             for row in rows]
    return harness.markdown_table(
        ["k", "peak RSS, plain B/k", "peak RSS, %s" % label, "%s / (plain + %s)" % (label, bound),
         "%s / full" % label, "TF peak, plain", "TF peak, %s" % label, "TF: %s / (plain + %s)" % (label, bound),
         "TF: %s / full" % label], cells)


def summarize(results):
    """Ratios per k (medians of the repeats); the largest k gives the headline keys."""
    def cell(config, k):
        chosen = [r for r in results if r["spec"]["config"] == config and r["spec"]["k"] == k]
        return dict((key, _median(chosen, key)) for key in ("peak_rss_bytes", "tf_peak_bytes"))

    if not results:
        return {}, []
    full, params, feed = cell("full", 1), float(results[0]["param_bytes"]), _median(results, "feed_bytes")
    rows = [_row(k, cell, full, params, feed)
            for k in sorted(set(r["spec"]["k"] for r in results if r["spec"]["config"] in EXTRA_PARAMS))]
    last, batch = rows[-1], results[0]["spec"]["micro"] * results[0]["spec"]["k"]
    keys = dict((key, last[name]) for key, name in HEADLINE_KEYS.items())
    for key, (config, measured) in INTERVALS.items():
        keys[key + "_ci95"] = _per_repeat(results, config, last["k"], EXTRA_PARAMS[config] * params, measured)[1]
    keys.update(memory_ratios_k=last["k"], memory_rows=rows, memory_full_batch=full, ingraph_feed_bytes=feed)
    return keys, _markdown(results, full, rows, batch, feed)


def _markdown(results, full, rows, batch, feed):
    return ["### Memory: one update of a batch of %d, the example's CNN (width 16)" % batch, "",
            "Median of %d process(es) per configuration, BFC allocator on. Full batch directly: peak RSS %s, TF "
            "peak %s." % (max(r["spec"]["repeat"] for r in results) + 1, harness.mb(full["peak_rss_bytes"]),
                          harness.mb(full["tf_peak_bytes"])),
            ""] + _table("ours", rows) + [
            "", "One run per update (`subdivisions.minimize`). Its bound is the plain micro-batch's peak "
            "plus 2 copies of the parameters (one, and the loop's sums). Its run is fed the whole batch "
            "(%s of inputs): the feed is in its peak, the numerator; with it added to the bound as well, the ratio "
            "at k = %d is %s (RSS) and %s (TF)." % (
                "n/a" if feed is None else "%.1f MB" % (feed / harness.MB), rows[-1]["k"],
                harness.fmt(rows[-1].get("ingraph_over_micro_plus_params_plus_feed")),
                harness.fmt(rows[-1].get("ingraph_tf_over_micro_plus_params_plus_feed"))), ""] + \
        _table("ingraph", rows, "one-run")
