"""Family "recompute": every block of a 12-block residual MLP recomputed (``gradaccum.recompute``) against plain.

The model (``resmlp``, registered in ``harness.MODELS``): 784 -> 64, twelve pre-norm residual blocks
(layer norm, 64 -> 256, GELU, 256 -> 64), 64 -> 10; 0.45M parameters, so that activations dominate.
Three configurations: ``plain``, ``plain_twin`` (plain built again: the A/A) and ``recompute``, all with
the fused accumulator (k = 4, Adam).

* ``memory``: one fresh process per configuration and repeat (BFC CPU allocator): TensorFlow's peak over
  one window at micro-batch ``MICRO``; ratio per repeat, median and 95% interval.
* ``time``: the three side by side in interleaved, shuffled rounds, in ``CHILDREN`` processes pooled; time
  per micro-step at the same micro-batch, i.e. per example.
* ``budget``: one process per configuration and repeat: ``gradaccum.find_micro_batch`` with one accumulate
  step failing (``ResourceExhaustedError``) when TensorFlow's peak passes ``BUDGET_MB``, for a batch of
  ``TARGET``; the ratio compares the largest micro-batches that ran (the search's bisection stops within
  5%; the micro-batch it then chooses keeps a 10% margin and splits ``TARGET`` evenly); then a whole
  update of ``TARGET`` examples at the micro-batch found, timed in both forms (the fused train op: k runs;
  ``subdivisions.minimize``: one run), time per example. Where TensorFlow keeps no allocator peak (TF 1.15,
  or no BFC allocator) the child returns only ``skipped``, the reason.
"""
import statistics

import harness

MICRO = 512
TARGET = 4096
SMOKE_TARGET = 64  # The batch a smoke child (``harness.smoke``) searches for: three tries, not nine.
BUDGET_MB = 48
MODEL_ARGS = {"blocks": 12, "width": 64, "hidden": 256}
CONFIGS = ("plain", "plain_twin", "recompute")
PLANS = {False: {"repeats": 5, "children": 2, "rounds": 25, "update_repeats": 5},
         True: {"repeats": 1, "children": 1, "rounds": 4, "update_repeats": 1}}
BFC = {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
# key -> (target, "<=" or ">="): the contract for this family.
TARGETS = {"recompute_peak_over_plain_peak": (0.35, "<="), "recompute_over_plain_time": (1.35, "<="),
           "recompute_micro_batch_over_plain_micro_batch": (2.5, ">=")}


def resmlp(images, labels, blocks=12, width=64, hidden=256, recompute=False):
    """784 -> ``width``, ``blocks`` residual blocks (each recomputed when ``recompute``), -> 10; mean cross-entropy.

    Example:
      >>> loss = resmlp(images, labels, blocks=2, recompute=True)
    """
    import tensorflow as tf

    import gradaccum

    v1 = tf.compat.v1
    with v1.variable_scope("resmlp", reuse=v1.AUTO_REUSE):
        h = v1.layers.dense(tf.reshape(images, [-1, 28 * 28]), width, name="embed")
        block = gradaccum.recompute(_block) if recompute else _block
        for index in range(blocks):
            h = block(h, index, hidden)
        logits = v1.layers.dense(h, 10, name="logits")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


def _block(h, index, hidden):
    """``h + W2 gelu(W1 layer_norm(h))``: a transformer's feed-forward half (GELU's tanh form, as GPT-2's)."""
    import tensorflow as tf

    v1 = tf.compat.v1
    with v1.variable_scope("block_%d" % index):
        width = h.shape[-1]
        mean, variance = tf.nn.moments(h, [1], keepdims=True)
        gamma = v1.get_variable("gamma", [width], initializer=v1.ones_initializer())
        beta = v1.get_variable("beta", [width], initializer=v1.zeros_initializer())
        normed = (h - mean) * tf.math.rsqrt(variance + 1e-5) * gamma + beta
        inner = v1.layers.dense(normed, hidden, name="up")
        inner = 0.5 * inner * (1.0 + tf.tanh(0.7978845608 * (inner + 0.044715 * inner * inner * inner)))
        return h + v1.layers.dense(inner, width, name="down")


harness.MODELS["resmlp"] = resmlp
harness.SMOKE_MODEL_ARGS["resmlp"] = {"blocks": 2, "width": 8, "hidden": 16}


def _args(config):
    return dict(MODEL_ARGS, recompute=config == "recompute")


def plan(quick):
    """Memory and budget children (one per configuration and repeat, interleaved), then the timing children."""
    settings = PLANS[quick]
    specs = []
    for repeat in range(settings["repeats"]):
        specs += [{"kind": "memory", "config": config, "repeat": repeat, "env": BFC} for config in CONFIGS]
        specs += [{"kind": "budget", "config": config, "repeat": repeat, "env": BFC,
                   "update_repeats": settings["update_repeats"]} for config in CONFIGS]
    specs += [{"kind": "time", "repeat": child, "rounds": settings["rounds"]} for child in range(settings["children"])]
    return specs


def measure(spec):
    """One child: ``memory`` (TF's peak of one window), ``time`` (side by side) or ``budget``."""
    if spec["kind"] == "memory":
        bench = harness.build_bench(spec["config"], "resmlp", harness.ours, MICRO, 4, _args(spec["config"]))
        result = harness.measure_memory(bench, windows=1)
        bench.session.close()
        return result
    if spec["kind"] == "time":
        benches = [harness.build_bench(config, "resmlp", harness.ours, MICRO, 4, _args(config)) for config in
                   (CONFIGS if spec["repeat"] % 2 == 0 else CONFIGS[::-1])]
        try:
            return {"times": harness.time_side_by_side(benches, spec["rounds"], seed=spec["repeat"])}
        finally:
            harness.close(benches)
    return _budget(spec)


def _budget(spec):
    """The largest micro-batch under ``BUDGET_MB`` of TF's peak, and a whole update's time there, both forms."""
    import tensorflow as tf

    import gradaccum

    bench = harness.build_bench(spec["config"], "resmlp", harness.ours, 1, 4, _args(spec["config"]))
    if harness.allocator_peak_bytes() is None:  # No peak to search a budget under: say so, as a row would.
        bench.session.close()
        return {"skipped": "TensorFlow %s keeps no allocator peak here (it needs TF >= 2.5 and "
                           "TF_CPU_ALLOCATOR_USE_BFC=true)" % tf.__version__}
    images, labels = [bench.session.graph.get_tensor_by_name(name) for name in ("images:0", "labels:0")]
    train_op = bench.window.each
    peaks = {}

    def run_step(size):
        feed = harness.random_feeds(images, labels, size, 1, 0)[0]
        harness.allocator_peak_bytes(reset=True)
        bench.session.run(train_op, feed)
        peaks[size] = harness.allocator_peak_bytes()
        if peaks[size] > BUDGET_MB * harness.MB:
            raise tf.errors.ResourceExhaustedError(None, None, "%d examples: peak %d bytes" % (size, peaks[size]))

    target = SMOKE_TARGET if harness.smoke else TARGET
    choice = gradaccum.find_micro_batch(run_step, target, session=bench.session, start=16)
    bench.session.close()
    result = {"micro_batch": choice.micro_batch_size, "k": choice.num_micro_batches,
              "largest_that_ran": choice.largest_that_ran, "peaks": peaks}
    for form, trainer in (("fused", harness.ours), ("ingraph", harness.one_run)):
        update = harness.build_bench(spec["config"], "resmlp", trainer, choice.micro_batch_size,
                                     choice.num_micro_batches, _args(spec["config"]))
        seconds = harness.time_side_by_side([update], spec["update_repeats"])[update.name]
        examples = choice.micro_batch_size * choice.num_micro_batches
        result[form + "_seconds_per_example"] = statistics.median(seconds) * update.micro_steps / examples
        harness.close([update])
    return result


def _per_repeat(results, kind, figure):
    """``{config: {repeat: figure}}`` of the children of ``kind``."""
    table = {}
    for result in results:
        if result["spec"]["kind"] == kind and result.get(figure) is not None:
            table.setdefault(result["spec"]["config"], {})[result["spec"]["repeat"]] = result[figure]
    return table


def _ratios(table, top, bottom):
    """``(median, [low, high])`` of ``top / bottom`` paired by repeat."""
    pairs = sorted(set(table.get(top, {})) & set(table.get(bottom, {})))
    return harness.median_with_ci(table[top][r] / table[bottom][r] for r in pairs)


def summarize(results):
    """The three targets, each beside its A/A, and the budget's time per example in both forms."""
    keys = {}
    peaks = _per_repeat(results, "memory", "tf_peak_bytes")
    micro = _per_repeat(results, "budget", "largest_that_ran")  # find_micro_batch's bisection: within 5%.
    times = {}
    for result in sorted((r for r in results if r["spec"]["kind"] == "time"), key=lambda r: r["spec"]["repeat"]):
        for name, values in result["times"].items():
            times.setdefault(name, []).extend(values)
    figures = [("recompute_peak_over_plain_peak", peaks), ("recompute_micro_batch_over_plain_micro_batch", micro)]
    for key, table in figures:
        keys[key], keys[key + "_ci95"] = _ratios(table, "recompute", "plain")
        keys[key + "_aa"], keys[key + "_aa_ci95"] = _ratios(table, "plain_twin", "plain")
    keys["recompute_over_plain_time"], keys["recompute_over_plain_time_ci95"] = \
        harness.ratio_with_ci(times, "recompute", "plain")
    keys["recompute_over_plain_time_aa"], keys["recompute_over_plain_time_aa_ci95"] = \
        harness.ratio_with_ci(times, "plain_twin", "plain")
    for form in ("fused", "ingraph"):
        per_example = _per_repeat(results, "budget", form + "_seconds_per_example")
        key = "recompute_at_budget_over_plain_at_budget_time_%s" % form
        keys[key], keys[key + "_ci95"] = _ratios(per_example, "recompute", "plain")
        keys[key + "_aa"], keys[key + "_aa_ci95"] = _ratios(per_example, "plain_twin", "plain")
        for config in CONFIGS:
            values = list(per_example.get(config, {}).values())
            keys["recompute_budget_us_per_example_%s_%s" % (form, config)] = (
                1e6 * statistics.median(values) if values else None)
    keys["recompute_budget_micro_batches"] = dict((c, sorted(micro.get(c, {}).values())) for c in CONFIGS)
    keys["recompute_verdicts"] = dict((key, harness.verdict(keys.get(key), keys.get(key + "_ci95"), target, direction))
                                      for key, (target, direction) in TARGETS.items())
    return keys, _lines(keys, peaks)


def _cell(keys, key):
    ci = keys.get(key + "_ci95")
    return "**%s**%s" % (harness.fmt(keys.get(key)), "" if not ci or None in ci else
                         " (%s-%s)" % (harness.fmt(ci[0]), harness.fmt(ci[1])))


def _lines(keys, peaks):
    rows = []
    for key, what in (("recompute_peak_over_plain_peak", "TF allocator peak, recomputed / plain, micro-batch %d"
                       % MICRO),
                      ("recompute_over_plain_time", "time per example, recomputed / plain, micro-batch %d" % MICRO),
                      ("recompute_micro_batch_over_plain_micro_batch", "largest micro-batch under %d MB of TF peak, "
                       "recomputed / plain" % BUDGET_MB)):
        target, direction = TARGETS[key]
        rows.append([what, _cell(keys, key), _cell(keys, key + "_aa"), "%s %.2f" % (direction, target),
                     keys["recompute_verdicts"][key]])
    for form, label in (("fused", "fused train op"), ("ingraph", "one run per update")):
        key = "recompute_at_budget_over_plain_at_budget_time_%s" % form
        rows.append(["a whole update of %d examples at that budget, %s: time per example, recomputed / plain "
                     "(%s / %s us)" % (TARGET, label,
                                       harness.fmt(keys["recompute_budget_us_per_example_%s_recompute" % form], 1),
                                       harness.fmt(keys["recompute_budget_us_per_example_%s_plain" % form], 1)),
                     _cell(keys, key), _cell(keys, key + "_aa"), "-", "-"])
    mb = dict((config, harness.mb(statistics.median(values.values()))) for config, values in peaks.items())
    return (["### Recomputation (`gradaccum.recompute`), 12-block residual MLP", ""]
            + harness.markdown_table(["what", "measured (95% CI)", "A/A", "target", "verdict"], rows)
            + ["", "Peaks (median, MB): %s; micro-batches found: %s." % (mb, keys["recompute_budget_micro_batches"])])
