"""Turns the children's measurements into ratios, a markdown report, JSON and a plot.

No TensorFlow here: ``run.py`` imports this module in the parent process,
which only starts children and reads their one-line JSON results.

Every ratio is side by side: the memory ratios compare medians of processes
run interleaved (repeat 1 of every configuration, then repeat 2, ...); a time
ratio is the median over rounds of the ratio within one round, in which every
variant ran once, in a rotating order.
"""
import json
import math
import statistics

# The keys `--json` always writes (plain numbers); the contract.
REQUIRED_KEYS = (
    "fused_over_plain_time",
    "fused_over_plain_time_mlp",
    "manual_over_fused_time",
    "accumulated_peak_over_micro_peak_plus_params",
    "accumulated_peak_over_full_batch_peak",
    "towers4_over_one_device_time",
)
MEMORY_TARGET = 1.05  # accumulated <= (plain micro + params) * 1.05
TIME_TARGET = 1.02  # fused <= plain * 1.02, the example's model
MB = 1024.0 * 1024.0
VARIANT_LABELS = {
    "plain": "plain training, same micro-batch",
    "fused": "GradientAccumulator, fused train op",
    "fused_float64": "GradientAccumulator, float64 accumulators",
    "manual": "manual zero / accumulate / apply (3 kinds of run)",
    "tensorpack": "tensorpack AccumGradOptimizer",
    "horovod": "Horovod backward_passes_per_step (1 process)",
    "one_device": "one device, no tower module",
}


def paired_ratio(numerators, denominators):
    """Returns the median over rounds of ``numerators[i] / denominators[i]``.

    Args:
      numerators: per-round values of the variant on top.
      denominators: per-round values of the reference, same rounds.

    Returns:
      A float.

    Raises:
      ValueError: when the lists are empty or differ in length.

    Example:
      >>> paired_ratio([1.1, 0.9, 1.0], [1.0, 1.0, 1.0])
      1.0
    """
    if not numerators or len(numerators) != len(denominators):
        raise ValueError("`numerators` and `denominators` must be non-empty and as long, got %d and %d"
                         % (len(numerators), len(denominators)))
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def median_ci95(values):
    """Returns a distribution-free 95% confidence interval of the median of ``values``.

    The interval runs between the order statistics ``j`` and ``n + 1 - j``
    with ``j = floor(n/2 - 0.98 sqrt(n))`` (the normal approximation of the
    binomial); with fewer than 6 values it is ``(min, max)``.

    Args:
      values: a non-empty list of numbers.

    Returns:
      ``(low, high)``.

    Example:
      >>> median_ci95(list(range(1, 101)))
      (40, 61)
    """
    ordered = sorted(values)
    j = int(math.floor(len(ordered) / 2.0 - 0.98 * math.sqrt(len(ordered))))
    if j < 1:
        return ordered[0], ordered[-1]
    return ordered[j - 1], ordered[len(ordered) - j]


def paired_ratio_ci95(numerators, denominators):
    """The ``median_ci95`` of the per-round ratios (see ``paired_ratio``).

    Args:
      numerators: per-round values of the variant on top.
      denominators: per-round values of the reference, same rounds.

    Returns:
      ``(low, high)``.

    Example:
      >>> paired_ratio_ci95([1.1, 0.9, 1.0], [1.0, 1.0, 1.0])
      (0.9, 1.1)
    """
    return median_ci95([a / b for a, b in zip(numerators, denominators)])


def _median_of(records, key):
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def _memory_cell(records):
    """Medians of one configuration's default-allocator runs, plus its allocator run."""
    rss = [r for r in records if not r["allocator"]]
    return {
        "peak_rss_bytes": _median_of(rss, "peak_rss_bytes"),
        "psutil_peak_rss_bytes": _median_of(rss, "psutil_peak_rss_bytes"),
        "rss_before_bytes": _median_of(rss, "rss_before_bytes"),
        "tf_peak_bytes": _median_of([r for r in records if r["allocator"]], "tf_peak_bytes"),
        "processes": len(rss),
    }


def _ratio(top, bottom, extra=0.0):
    if top is None or bottom is None:
        return None
    return top / (bottom + extra)


def summarize_memory(records):
    """Groups memory records by configuration and computes the ratios per k.

    Args:
      records: child results with ``config`` (``"full"``, ``"plain"`` or
        ``"fused"``), ``k``, ``allocator`` (bool) and the figures of
        ``bench_child.measure_memory``.

    Returns:
      A dict: ``batch``, ``width``, ``param_bytes``, ``full`` (a cell) and
      ``rows``, one per k: ``k``, ``micro``, ``plain`` and ``fused`` cells,
      ``over_micro_plus_params``, ``over_full`` and the same for the allocator
      (``tf_``-prefixed; None where not measured). With k = 1 the plain
      micro-batch is the full batch.

    Example:
      >>> summarize_memory(records)["rows"][-1]["over_micro_plus_params"]
    """
    def cell(config, k):
        return _memory_cell([r for r in records if r["config"] == config and r["k"] == k])

    full = cell("full", 1)
    params = float(records[0]["param_bytes"])
    rows = []
    for k in sorted(set(r["k"] for r in records if r["config"] == "fused")):
        plain, fused = (full if k == 1 else cell("plain", k)), cell("fused", k)
        rows.append({
            "k": k, "micro": next(r["micro"] for r in records if r["config"] == "fused" and r["k"] == k),
            "plain": plain, "fused": fused,
            "over_micro_plus_params": _ratio(fused["peak_rss_bytes"], plain["peak_rss_bytes"], params),
            "over_full": _ratio(fused["peak_rss_bytes"], full["peak_rss_bytes"]),
            "tf_over_micro_plus_params": _ratio(fused["tf_peak_bytes"], plain["tf_peak_bytes"], params),
            "tf_over_full": _ratio(fused["tf_peak_bytes"], full["tf_peak_bytes"]),
        })
    batch = next(r["examples"] for r in records if r["config"] == "full")
    return {"batch": batch, "width": records[0]["width"], "param_bytes": int(params), "full": full, "rows": rows}


def summarize_time_group(group):
    """Medians per variant and paired ratios for one timing group.

    Args:
      group: a ``bench_child.time_group`` result.

    Returns:
      A dict: the group's settings, ``order`` (the variants as requested,
      skipped ones included), ``variants`` (name -> ``us_per_example``,
      ``examples_per_second``, ``cpu_us_per_example``, ``rounds``), ``ratios``
      and ``cpu_ratios`` (``"a/b"`` -> paired ratio of wall-clock and of CPU
      time, for every pair of variants), ``ratios_ci95`` (``"a/b"`` ->
      ``(low, high)`` of the wall-clock ratio), ``skipped``, and the raw
      series ``us_per_example_by_round`` and ``cpu_us_per_example_by_round``.

    Example:
      >>> summarize_time_group(group)["ratios"]["fused/plain"]
    """
    times, cpu = group["times"], group.get("cpu_times") or {}
    variants = {}
    for name, values in times.items():
        median = statistics.median(values)
        variants[name] = {"us_per_example": median * 1e6, "examples_per_second": 1.0 / median,
                          "cpu_us_per_example": statistics.median(cpu[name]) * 1e6 if name in cpu else None,
                          "rounds": len(values)}
    pairs = [(a, b) for a in times for b in times if a != b]
    settings = dict((key, group[key]) for key in ("name", "model", "width", "micro", "k", "cpus", "rounds",
                                                  "windows") if key in group)
    cpu_pairs = [pair for pair in pairs if pair[0] in cpu and pair[1] in cpu]
    return dict(settings, order=list(group.get("variants") or times), variants=variants,
                ratios=dict(("%s/%s" % pair, paired_ratio(times[pair[0]], times[pair[1]])) for pair in pairs),
                ratios_ci95=dict(("%s/%s" % pair, paired_ratio_ci95(times[pair[0]], times[pair[1]]))
                                 for pair in pairs),
                cpu_ratios=dict(("%s/%s" % pair, paired_ratio(cpu[pair[0]], cpu[pair[1]])) for pair in cpu_pairs),
                skipped=dict(group.get("skipped", {})),
                us_per_example_by_round=dict((name, [t * 1e6 for t in values]) for name, values in times.items()),
                cpu_us_per_example_by_round=dict((name, [t * 1e6 for t in values]) for name, values in cpu.items()))


# JSON key -> (group, variant, reference); each also gets a "..._cpu_time" twin.
TIME_RATIOS = (
    ("fused_over_plain_time", "cnn", "fused", "plain"),
    ("fused_over_plain_time_mlp", "mlp", "fused", "plain"),
    ("manual_over_fused_time", "cnn", "manual", "fused"),
    ("manual_over_fused_time_mlp", "mlp", "manual", "fused"),
    ("float64_over_default_accumulation_time", "cnn", "fused_float64", "fused"),
    ("float64_over_default_accumulation_time_mlp", "mlp", "fused_float64", "fused"),
    ("towers1_over_one_device_time", "towers", "towers1", "one_device"),
    ("towers2_over_one_device_time", "towers", "towers2", "one_device"),
    ("towers4_over_one_device_time", "towers", "towers4", "one_device"),
    ("tensorpack_over_fused_time", "cnn", "tensorpack", "fused"),
    ("horovod_over_fused_time", "cnn", "horovod", "fused"),
)


def headline_ratios(memory, time_groups):
    """Returns the JSON's headline ratios: ``REQUIRED_KEYS`` and the optional extras.

    Args:
      memory: a ``summarize_memory`` result.
      time_groups: ``summarize_time_group`` results, named ``"cnn"``, ``"mlp"``
        and ``"towers"``.

    Returns:
      A dict of plain floats (None where a variant was skipped). Time ratios
      are wall-clock; ``<key>_ci95`` is the 95% confidence interval of one,
      ``<key with _cpu_time>`` the same ratio in CPU time.

    Example:
      >>> headline_ratios(memory, groups)["fused_over_plain_time"]
    """
    by_name = dict((group["name"], group) for group in time_groups)
    ratios = {}
    for key, name, top, bottom in TIME_RATIOS:
        group = by_name.get(name, {})
        pair = "%s/%s" % (top, bottom)
        ratios[key] = group.get("ratios", {}).get(pair)
        ratios[key + "_ci95"] = group.get("ratios_ci95", {}).get(pair)
        ratios[key.replace("_time", "_cpu_time", 1)] = group.get("cpu_ratios", {}).get(pair)
    largest = memory["rows"][-1]
    ratios.update({
        "accumulated_peak_over_micro_peak_plus_params": largest["over_micro_plus_params"],
        "accumulated_peak_over_full_batch_peak": largest["over_full"],
        "tf_allocator_accumulated_peak_over_micro_peak_plus_params": largest["tf_over_micro_plus_params"],
        "tf_allocator_accumulated_peak_over_full_batch_peak": largest["tf_over_full"],
        "memory_ratios_k": largest["k"],
    })
    return ratios


def summarize(context, memory_records, time_result):
    """Builds the whole summary that the JSON holds and the markdown shows.

    Args:
      context: dict of run facts: ``date``, ``machine``, ``command``,
        ``quick``, ``mode``, ``notes`` (list of strings).
      memory_records: memory child results, tagged as for ``summarize_memory``.
      time_result: the time child's result (``groups`` and ``tensorflow``).

    Returns:
      A JSON-serialisable dict with every key of ``REQUIRED_KEYS`` at the top.

    Example:
      >>> summary = summarize(context, records, time_result)
    """
    memory = summarize_memory(memory_records)
    groups = [summarize_time_group(group) for group in time_result["groups"]]
    summary = dict(context, tensorflow=time_result.get("tensorflow"), memory=memory, time=groups)
    summary.update(headline_ratios(memory, groups))
    return summary


def check_summary(summary):
    """Raises when a required key is missing or not a finite positive number.

    Args:
      summary: a ``summarize`` result (or the JSON read back).

    Raises:
      ValueError: naming the first bad key and its value.

    Example:
      >>> check_summary(json.load(open("results.json")))
    """
    for key in REQUIRED_KEYS:
        value = summary.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value <= 0:
            raise ValueError("`%s` must be a finite number > 0, got %r" % (key, value))


def write_json(summary, path):
    """Writes ``summary`` as indented JSON after ``check_summary``.

    Args:
      summary: a ``summarize`` result.
      path: the file to write.

    Example:
      >>> write_json(summary, "/tmp/bench.json")
    """
    check_summary(summary)
    with open(path, "w") as stream:
        json.dump(summary, stream, indent=2, sort_keys=True)
        stream.write("\n")


def _mb(value):
    return "n/a" if value is None else "%.0f MB" % (value / MB)


def _x(value):
    return "n/a" if value is None else "%.3f" % value


def _with_ci(value, ci):
    if value is None or not ci:
        return _x(value)
    return "%.3f (95%% CI %.3f-%.3f)" % (value, ci[0], ci[1])


def _verdict(value, target):
    if value is None:
        return "not measured"
    return "%.3f, target <= %.2f: %s" % (value, target, "met" if value <= target else "NOT met")


def _memory_section(memory):
    full = memory["full"]
    lines = [
        "### Memory: one update of a batch of %d, the example's CNN (width %d, %.2f MB of parameters)"
        % (memory["batch"], memory["width"], memory["param_bytes"] / MB), "",
        "Peak RSS: peak resident memory of a fresh process (`getrusage` ru_maxrss; psutil sampled every "
        "5 ms agrees), median of %d processes per configuration. TF peak: TensorFlow's own peak allocator "
        "bytes during the update (`tf.config.experimental.get_memory_info`), available on the CPU only with "
        "the BFC allocator (`TF_CPU_ALLOCATOR_USE_BFC=true`), so measured in one extra process per "
        "configuration; n/a where not measured." % full["processes"], "",
        "The full batch directly: peak RSS **%s** (%s before the first run), TF peak **%s**."
        % (_mb(full["peak_rss_bytes"]), _mb(full["rss_before_bytes"]), _mb(full["tf_peak_bytes"])), "",
        "| k | micro-batch | peak RSS, plain micro-batch | peak RSS, accumulated | accumulated / (plain + params)"
        " | accumulated / full batch | TF peak, plain micro-batch | TF peak, accumulated"
        " | TF: accumulated / (plain + params) | TF: accumulated / full batch |",
        "|" + "---:|" * 10,
    ]
    for row in memory["rows"]:
        plain, fused = row["plain"], row["fused"]
        lines.append("| %d | %d | %s%s | %s | %s | %s | %s | %s | %s | %s |" % (
            row["k"], row["micro"], _mb(plain["peak_rss_bytes"]), " (full batch)" if row["k"] == 1 else "",
            _mb(fused["peak_rss_bytes"]), _x(row["over_micro_plus_params"]), _x(row["over_full"]),
            _mb(plain["tf_peak_bytes"]), _mb(fused["tf_peak_bytes"]), _x(row["tf_over_micro_plus_params"]),
            _x(row["tf_over_full"])))
    largest = memory["rows"][-1]
    lines += ["", "Target, accumulated peak <= (plain micro-batch peak + one copy of the parameters) + 5%%, "
              "k = %d: %s." % (largest["k"], _verdict(largest["over_micro_plus_params"], MEMORY_TARGET))]
    return lines


def _time_caption(group):
    if group["name"] == "towers":
        return ("### Towers: the example's CNN (width %d), a batch of %d per run, %d virtual CPU devices "
                "(2 real cores: overhead only)" % (group["width"], group["micro"], group["cpus"]))
    model = ("the example's CNN (width %d)" % group["width"] if group["model"] == "cnn"
             else "small MLP (784-%d-10), the worst case" % group["width"])
    return "### Time: %s, micro-batch %d, k = %d" % (model, group["micro"], group["k"])


def _label(name):
    if name.startswith("towers"):
        return "%s tower(s), `gradaccum.tower`" % name[len("towers"):]
    return VARIANT_LABELS.get(name, name)


def _time_row(group, name, references):
    if name in group["skipped"]:
        return "| %s | skipped: %s |%s" % (_label(name), group["skipped"][name], " |" * (2 + 2 * len(references)))
    figures = group["variants"][name]
    cells = [_label(name), "%.1f" % figures["us_per_example"], "%.0f" % figures["examples_per_second"]]
    for reference in references:
        pair = "%s/%s" % (name, reference)
        same = name == reference
        cells += ["1" if same else _with_ci(group["ratios"].get(pair), group.get("ratios_ci95", {}).get(pair)),
                  "1" if same else _x(group.get("cpu_ratios", {}).get(pair))]
    return "| " + " | ".join(cells) + " |"


def _time_section(group):
    references = ["one_device"] if group["name"] == "towers" else ["plain", "fused"]
    short = {"plain": "plain", "fused": "fused", "one_device": "one device"}
    header = "".join(" | vs %s | vs %s, CPU time" % ((short[r],) * 2) for r in references)
    lines = [_time_caption(group), "",
             "Wall-clock time, median of %d rounds of %d window(s) per variant, interleaved in a rotating "
             "order; a ratio is the median of the per-round ratios (CPU time: the same with this process's "
             "CPU seconds, less sensitive to other processes)." % (group["rounds"], group["windows"]), "",
             "| training | us per example | examples / s%s |" % header,
             "|---|" + "---:|" * (2 + 2 * len(references))]
    lines += [_time_row(group, name, references) for name in group["order"]]
    return lines


def _time_line(summary, text, key):
    return "- %s: %s; CPU time %s." % (text, _with_ci(summary.get(key), summary.get(key + "_ci95")),
                                       _x(summary.get(key.replace("_time", "_cpu_time", 1))))


def _targets(summary):
    fused = summary["fused_over_plain_time"]
    verdict = "not measured" if fused is None else "met" if fused <= TIME_TARGET else "NOT met"
    return [
        "### Headline ratios", "",
        _time_line(summary, "fused / plain, the example's CNN (target <= %.2f: %s)" % (TIME_TARGET, verdict),
                   "fused_over_plain_time"),
        _time_line(summary, "fused / plain, small MLP (worst case, no target)", "fused_over_plain_time_mlp"),
        _time_line(summary, "manual pattern / fused, CNN", "manual_over_fused_time"),
        _time_line(summary, "manual pattern / fused, MLP", "manual_over_fused_time_mlp"),
        _time_line(summary, "float64 accumulators / default (float32), CNN", "float64_over_default_accumulation_time"),
        _time_line(summary, "float64 accumulators / default (float32), MLP",
                   "float64_over_default_accumulation_time_mlp"),
        _time_line(summary, "4 towers / one device", "towers4_over_one_device_time"),
        "- accumulated peak / (plain micro-batch peak + params), k = %d: %s; TF allocator %s." % (
            summary["memory_ratios_k"], _verdict(summary["accumulated_peak_over_micro_peak_plus_params"],
                                                 MEMORY_TARGET),
            _x(summary.get("tf_allocator_accumulated_peak_over_micro_peak_plus_params"))),
        "- accumulated peak / full-batch peak, k = %d: %s; TF allocator %s." % (
            summary["memory_ratios_k"], _x(summary["accumulated_peak_over_full_batch_peak"]),
            _x(summary.get("tf_allocator_accumulated_peak_over_full_batch_peak"))),
    ]


def render_markdown(summary):
    """Renders the summary as markdown: run facts, memory, time and towers tables, headline ratios.

    Args:
      summary: a ``summarize`` result.

    Returns:
      The markdown text, ending with a newline.

    Example:
      >>> print(render_markdown(summary))
    """
    lines = ["# gradaccum benchmarks", "",
             "%s, %s, TensorFlow %s (%s behaviour). Command: `%s`%s." % (
                 summary["date"], summary["machine"], summary["tensorflow"], summary["mode"],
                 summary["command"], " (--quick: for the trend, not for quoting)" if summary["quick"] else ""),
             ""]
    lines += ["- %s" % note for note in summary.get("notes", [])] + [""]
    lines += _targets(summary) + [""] + _memory_section(summary["memory"])
    for group in summary["time"]:
        lines += [""] + _time_section(group)
    lines += ["", "![benchmark plot](%s)" % summary["plot"]] if summary.get("plot") else []
    return "\n".join(lines) + "\n"


def _plot_memory(axis, memory, key, title):
    rows = [row for row in memory["rows"] if row["fused"][key] is not None and row["plain"][key] is not None]
    if not rows or memory["full"][key] is None:
        axis.text(0.5, 0.5, "not measured", ha="center", va="center", transform=axis.transAxes)
        axis.set_title(title)
        return
    ks = [row["k"] for row in rows]
    plain = [row["plain"][key] / MB for row in rows]
    axis.plot(ks, [row["fused"][key] / MB for row in rows], "o-", label="accumulated (k micro-batches)")
    axis.plot(ks, plain, "s--", label="plain, micro-batch B/k")
    axis.plot(ks, [(p * MB + memory["param_bytes"]) * MEMORY_TARGET / MB for p in plain], ":",
              color="gray", label="target: (plain + params) + 5%")
    axis.axhline(memory["full"][key] / MB, color="red", label="full batch B")
    if key == "peak_rss_bytes":
        axis.axhline(memory["full"]["rss_before_bytes"] / MB, color="black", linestyle="-.", linewidth=0.8,
                     label="RSS before the first run")
    axis.set_xscale("log")
    axis.set_xticks(ks)
    axis.set_xticklabels([str(k) for k in ks])
    axis.set_xlabel("k (micro-batches per update), B = %d" % memory["batch"])
    axis.set_ylabel("MB")
    axis.set_title(title)
    axis.legend(fontsize=7)


def _plot_time(axis, summary):
    keys = [("CNN fused/plain", "fused_over_plain_time"), ("CNN manual/fused", "manual_over_fused_time"),
            ("CNN f64/fused", "float64_over_default_accumulation_time"),
            ("MLP fused/plain", "fused_over_plain_time_mlp"), ("MLP manual/fused", "manual_over_fused_time_mlp"),
            ("MLP f64/fused", "float64_over_default_accumulation_time_mlp")]
    keys += [("%d tower(s)/1 device" % n, "towers%d_over_one_device_time" % n) for n in (1, 2, 4)]
    keys = [(label, key) for label, key in keys if summary.get(key) is not None]
    values = [summary[key] for _, key in keys]
    cis = [summary.get(key + "_ci95") or (summary[key], summary[key]) for _, key in keys]
    errors = [[v - ci[0] for v, ci in zip(values, cis)], [ci[1] - v for v, ci in zip(values, cis)]]
    # Dots with their 95% intervals, not bars: a bar from 0 would hide differences of a few percent.
    axis.errorbar(values, [label for label, _ in keys], xerr=errors, fmt="o", color="tab:blue", capsize=3)
    axis.axvline(1.0, color="black", linewidth=0.8)
    axis.axvline(TIME_TARGET, color="gray", linestyle=":", label="1.02 (fused/plain target, CNN)")
    axis.invert_yaxis()
    axis.grid(axis="x", alpha=0.3)
    axis.set_xlabel("time per example, ratio (median of paired rounds, 95% CI)")
    axis.set_title("Time ratios")
    axis.legend(fontsize=7)


def plot(summary, path):
    """Draws memory against k (RSS and TF allocator) and the time ratios into a PNG.

    Args:
      summary: a ``summarize`` result.
      path: the PNG to write.

    Returns:
      ``path``, or None when matplotlib is not installed (nothing written).

    Example:
      >>> plot(summary, "benchmarks/results.png")
    """
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, 3, figsize=(17, 4.8))
    _plot_memory(axes[0], summary["memory"], "peak_rss_bytes", "Peak RSS of the process")
    _plot_memory(axes[1], summary["memory"], "tf_peak_bytes", "TensorFlow allocator peak (BFC)")
    _plot_time(axes[2], summary)
    figure.suptitle("gradaccum, %s, %s, TF %s%s" % (summary["date"], summary["machine"], summary["tensorflow"],
                                                   " (--quick)" if summary["quick"] else ""))
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    pyplot.close(figure)
    return path
