"""Family "strategy": ``GradientAccumulator`` under ``tf.distribute.MirroredStrategy`` beside the strategy's own training.

One ``MirroredStrategy`` on 2 virtual CPU devices (``ConfigProto(device_count={"CPU": 2})``) reducing
through ``ReductionToOneDevice``, the example's CNN (width 16, ``harness.MODELS["cnn"]``), Adam, each
replica fed ``MICRO`` examples per run from its own placeholders, its loss divided by the replica count
(the strategy sums its replicas' gradients). Three rows, each a graph of its own built in
``strategy.run`` under ``strategy.scope()``:

* ``plain``: the strategy's plain training, the wrapped Adam's ``minimize``: one reduction per micro-batch;
* ``plain_twin``: ``plain`` built again (the A/A row: the resolution of the ratio);
* ``ours``: ``GradientAccumulator(Adam, K).minimize`` in the same strategy (weight = the micro-batch size):
  one reduction per update of ``K`` micro-batches.

``time`` children (``CHILDREN`` of them, pooled; odd ones build the rows in reverse order) time the rows
side by side in interleaved, shuffled rounds (``harness.time_side_by_side``), time per micro-step, i.e.
per run of ``MICRO`` examples on each replica. Each child then traces one update (``K`` runs, after an
untraced one) of ``plain`` and ``ours`` with ``RunMetadata`` (``FULL_TRACE``) in a second session on the
same graph, grappler's arithmetic optimizer off there so that the reduction's ``AddN`` nodes keep their
names, and counts per run the executed ``AddN`` nodes outside backprop (no ``gradients`` in the name):
``ReductionToOneDevice``'s sums. A run with any is a run in which the cross-device reduction executed.

Graph state: each row's graph holds the CNN's mirrored variables (``model/...``), ``global_step``, Adam's
slots and, for ``ours``, each replica's window (sums, weight, counter) on its device.
"""
import harness

DEVICES = 2
MODEL_ARGS = {"width": 16}
MICRO = 50  # Examples per replica per run: 100 per run over the two replicas.
K = 5  # As the CNN rows of the other families.
ROWS = ("plain", "plain_twin", "ours")
PLANS = {False: {"children": 2, "rounds": 41}, True: {"children": 1, "rounds": 3}}
MAX_SECONDS = 25  # Per child's timing: a loaded machine keeps the family within about two minutes.
# key -> (target, "<=")
TARGETS = {"strategy_mirrored_over_plain_time": (1.02, "<="), "strategy_reductions_per_update": (1, "<=")}
ARITHMETIC_OFF = 2  # RewriterConfig.OFF: keeps the reduction's AddN nodes under their own names in a trace.


def plan(quick):
    """``time`` children, each timing the three rows and tracing one update of ``plain`` and ``ours``."""
    settings = PLANS[quick]
    return [{"kind": "time", "repeat": child, "rounds": settings["rounds"], "micro": MICRO, "k": K}
            for child in range(settings["children"])]


def measure(spec):
    """Times the rows side by side, then counts the reductions of one update of ``plain`` and ``ours``."""
    order = ROWS if spec["repeat"] % 2 == 0 else ROWS[::-1]
    built = []
    try:
        for row in order:
            built.append(build(row, spec["micro"], spec["k"], seed=0))
        benches = [bench for bench, _ in built]
        times = harness.time_side_by_side(benches, spec["rounds"], max_seconds=MAX_SECONDS, seed=spec["repeat"])
        addn = dict((bench.name, addn_per_run(bench, init)) for bench, init in built if bench.name != "plain_twin")
    finally:
        harness.close([bench for bench, _ in built])
    micro, model_args = _sized(spec["micro"])
    return {"times": times, "addn_per_run": addn, "micro": micro, "k": spec["k"], "model_args": model_args,
            "devices": DEVICES, "order": list(order)}


def _sized(micro):
    """``(micro, model_args)``, at ``harness``'s smoke size in a smoke child."""
    if harness.smoke:
        return min(micro, harness.SMOKE_MICRO), dict(MODEL_ARGS, **harness.SMOKE_MODEL_ARGS["cnn"])
    return micro, dict(MODEL_ARGS)


def session_config(trace=False):
    """The sessions' ``ConfigProto``: ``DEVICES`` CPU devices; with ``trace``, the arithmetic optimizer off."""
    import tensorflow as tf

    config = tf.compat.v1.ConfigProto(device_count={"CPU": DEVICES})
    if trace:
        config.graph_options.rewrite_options.arithmetic_optimization = ARITHMETIC_OFF
    return config


def build(row, micro, k, seed=0):
    """Builds ``row`` under a fresh ``MirroredStrategy`` in a fresh graph and session, initialised, finalized.

    Args:
      row: ``"plain"``, ``"plain_twin"`` or ``"ours"``.
      micro: examples per replica per run; k: runs per update of ``ours`` (and per traced window).
      seed: graph and data seed.

    Returns:
      ``(bench, init)``: a ``harness.Bench`` of ``k`` runs per window (``variable_bytes`` None), and the
      initialisers, for another session on its graph.

    Example:
      >>> bench, init = build("ours", 50, 4)
    """
    import tensorflow as tf

    micro, model_args = _sized(micro)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        strategy = tf.distribute.MirroredStrategy(["/cpu:%d" % index for index in range(DEVICES)],
                                                  cross_device_ops=tf.distribute.ReductionToOneDevice())
        images = [tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images_%d" % r)
                  for r in range(DEVICES)]
        labels = [tf.compat.v1.placeholder(tf.int32, [None], name="labels_%d" % r) for r in range(DEVICES)]
        with strategy.scope():
            train = _train_op(strategy, row, images, labels, k, model_args)
        init = [tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()]
    session = tf.compat.v1.Session(graph=graph, config=session_config())
    session.run(init)
    graph.finalize()
    replica_feeds = [harness.random_feeds(images[r], labels[r], micro, k, seed + r) for r in range(DEVICES)]
    feeds = [dict(pair for feed in feeds_of_run for pair in feed.items()) for feeds_of_run in zip(*replica_feeds)]

    def run_window(window_feeds=None):
        for feed in window_feeds or feeds:
            session.run(train, feed)

    return harness.Bench(row, session, run_window, k, feeds, harness.Window([], train, []), None, None), init


def _train_op(strategy, row, images, labels, k, model_args):
    """The grouped train op of ``row``, built once per replica by ``strategy.run``."""
    import tensorflow as tf

    import gradaccum

    v1 = tf.compat.v1
    step = v1.train.get_or_create_global_step()
    optimizer = v1.train.AdamOptimizer(harness.LEARNING_RATE)
    if row == "ours":
        optimizer = gradaccum.GradientAccumulator(optimizer, k)

    def replica_step():
        replica = _replica_id()
        before = len(v1.get_collection(v1.GraphKeys.UPDATE_OPS))
        loss = harness.MODELS["cnn"](images[replica], labels[replica], **model_args) / float(DEVICES)
        # This replica's batch-norm updates only (the collection is the graph's, every replica's).
        mine = v1.get_collection(v1.GraphKeys.UPDATE_OPS)[before:]
        if row == "ours":
            return optimizer.minimize(loss, global_step=step, weight=tf.shape(images[replica])[0], update_ops=mine)
        with tf.control_dependencies(mine):
            return optimizer.minimize(loss, global_step=step)

    run = getattr(strategy, "run", None) or strategy.experimental_run_v2  # TF 1.15: experimental_run_v2.
    return strategy.group(run(replica_step))


def _replica_id():
    """This replica's index as a Python int (TF 1.15 gives an int, TF 2.x a constant tensor)."""
    import tensorflow as tf

    replica = tf.distribute.get_replica_context().replica_id_in_sync_group
    return replica if isinstance(replica, int) else int(tf.get_static_value(replica))


def addn_per_run(bench, init):
    """Per run of one update (after an untraced one), the executed ``AddN`` nodes outside backprop.

    Traced in a second session on ``bench``'s graph (``session_config(trace=True)``), so that the timed
    session's graph is the one users get.
    """
    import tensorflow as tf

    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    counts = []
    with tf.compat.v1.Session(graph=bench.session.graph, config=session_config(trace=True)) as session:
        session.run(init)
        for feed in bench.feeds:
            session.run(bench.window.each, feed)
        for feed in bench.feeds:
            metadata = tf.compat.v1.RunMetadata()
            session.run(bench.window.each, feed, options=options, run_metadata=metadata)
            counts.append(sum(1 for device in metadata.step_stats.dev_stats for node in device.node_stats
                              if node.timeline_label.split(" = ")[-1].startswith("AddN")
                              and "gradients" not in node.node_name))
    return counts


def _reducing_runs(results, row):
    """The most runs of one update in which ``row``'s reduction executed, over the children; None if none."""
    runs = [sum(1 for count in r["addn_per_run"][row] if count) for r in results if row in r.get("addn_per_run", {})]
    return max(runs) if runs else None


def summarize(results):
    """The ratio beside its A/A, the reductions per update of both rows, and one markdown table."""
    import statistics

    times = {}
    for result in sorted(results, key=lambda r: r["spec"]["repeat"]):
        for name, values in result["times"].items():
            times.setdefault(name, []).extend(values)
    keys = {}
    keys["strategy_mirrored_over_plain_time"], keys["strategy_mirrored_over_plain_time_ci95"] = \
        harness.ratio_with_ci(times, "ours", "plain")
    keys["strategy_plain_twin_over_plain_time"], keys["strategy_plain_twin_over_plain_time_ci95"] = \
        harness.ratio_with_ci(times, "plain_twin", "plain")
    keys["strategy_reductions_per_update"] = _reducing_runs(results, "ours")
    keys["strategy_plain_reductions_per_update"] = _reducing_runs(results, "plain")
    first = results[0] if results else {}
    keys["strategy_k"] = first.get("k")
    keys["strategy_addn_per_run"] = dict((r["spec"]["repeat"], r["addn_per_run"]) for r in results)
    keys["strategy_rounds"] = len(times.get("plain", []))
    keys["strategy_ms_per_micro_step"] = dict((name, 1e3 * statistics.median(values)) for name, values in times.items())
    keys["strategy_verdicts"] = dict((key, harness.verdict(keys.get(key), keys.get(key + "_ci95"), target))
                                     for key, (target, _) in TARGETS.items())
    return keys, _lines(keys, first, len(results))


def _cell(keys, key):
    ci = keys.get(key + "_ci95")
    return "**%s**%s" % (harness.fmt(keys.get(key)), "" if not ci or None in ci else
                         " (%s-%s)" % (harness.fmt(ci[0]), harness.fmt(ci[1])))


def _lines(keys, first, children):
    k, ms = keys["strategy_k"], keys["strategy_ms_per_micro_step"]
    rows = [["time per micro-step, ours / plain", _cell(keys, "strategy_mirrored_over_plain_time"),
             _cell(keys, "strategy_plain_twin_over_plain_time"), "<= 1.02",
             keys["strategy_verdicts"]["strategy_mirrored_over_plain_time"]],
            ["runs of one update (k = %s) in which the cross-device reduction executed, ours" % k,
             "**%s**" % keys["strategy_reductions_per_update"], "-", "<= 1",
             keys["strategy_verdicts"]["strategy_reductions_per_update"]],
            ["the same, the strategy's plain training (per k micro-steps)",
             "**%s**" % keys["strategy_plain_reductions_per_update"], "-", "-", "-"]]
    addn = first.get("addn_per_run", {})
    return (["### Under `tf.distribute.MirroredStrategy`: ours / the strategy's plain training", "",
             "%d virtual CPU devices (2 real cores), `ReductionToOneDevice`, the example's CNN (width %s), Adam, "
             "%s examples per replica per run, k = %s; %d rounds in %d process(es), pooled; ms per micro-step: %s."
             % (first.get("devices", DEVICES), first.get("model_args", {}).get("width"), first.get("micro"), k,
                keys["strategy_rounds"], children,
                ", ".join("%s %.2f" % (name, value) for name, value in sorted(ms.items())) or "n/a"), ""]
            + harness.markdown_table(["what", "measured (95% CI)", "A/A: plain built twice, the second / the first",
                                      "target", "verdict"], rows)
            + ["", "Reductions counted from a `RunMetadata` trace of one update (grappler's arithmetic optimizer "
                   "off): the `AddN` nodes outside backprop executed in each run, plain %s, ours %s."
               % (addn.get("plain"), addn.get("ours"))])
