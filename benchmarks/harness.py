"""The one shared benchmark harness: models, trainers, side-by-side timing, memory, errors, floor, output.

Families of measurements (``peers.py``, ``features.py``, ``memory.py``, and any
new ``<family>.py``) use only this API; ``run.py`` drives them. A family module
defines three functions and imports TensorFlow only inside them:

* ``plan(quick) -> [spec, ...]``: JSON-serialisable specs, one per child process;
* ``measure(spec) -> dict``: runs in a fresh child (``python harness.py FAMILY SPEC``),
  TensorFlow already set up in ``spec["mode"]``;
* ``summarize(results) -> (keys, markdown_lines)``: in the parent, no TensorFlow.

The API (all seconds are per micro-step, i.e. per ``session.run`` of a train op):

* ``MODELS`` (name -> ``fn(images, labels, **model_args) -> loss``) and ``SMOKE_MODEL_ARGS`` (name ->
  its smallest arguments, for ``--smoke``): add a model with one entry in each.
* Trainers ``fn(model_fn, images, labels, k, make_optimizer, global_step) -> Window``:
  ``ours``, ``ours_unweighted``, ``plain``, ``fwd_bwd``, ``one_run`` (its rows keyed ``ingraph``, as results.json keeps them) here; a peer is one more such function.
  A trainer that takes the whole window in one run (``one_run``) returns ``Window(..., whole_window=True)``:
  its bench feeds the k micro-batches end to end, and its time is still per micro-batch (window / k).
* ``build_bench(name, model, trainer, micro, k, ...) -> Bench``: fresh graph, session, feeds,
  graph finalized; ``close(benches)``; ``random_feeds``, ``trainable_floats(graph)``.
  A bench that is not a TF graph is any ``Bench`` with a ``run_window`` (``session=None``).
* ``stream_bench(num_floats)``, ``numpy_stream_bench(num_floats)``: ``a += b`` passes over
  ``num_floats`` floats, timed with the others; ``stream_bandwidth_gbs(times, num_floats)``.
* ``time_side_by_side(benches, rounds)``: interleaved rounds, shuffled order ->
  ``{name: [seconds per micro-step, one per round]}``; ``paired_ratio``, ``median_ci95``,
  ``median_with_ci(values)``, ``ratio_with_ci(times, top, bottom)``.
* ``measure_memory(bench)``: peak RSS (getrusage + psutil sampling) and TF allocator
  peak (only with ``TF_CPU_ALLOCATOR_USE_BFC=true`` on TF >= 2.5; TF 1.15 has none).
* ``update_errors(bench, windows)``: max relative error of each window's update against
  the full-batch update (build the bench with ``optimizer="sgd", reference=True``).
* ``profile_window(bench)``: op time per micro-step by scope and op type (``RunMetadata`` step stats).
* ``run_child(family, spec, timeout, env)`` (``ChildError``), ``markdown_table(header, rows)``, ``fmt``.
* Smoke size: a child whose spec has ``"smoke": true`` (``run.py --smoke``) builds every bench at
  ``SMOKE_MICRO`` examples per micro-batch at most, on its model's ``SMOKE_MODEL_ARGS`` (a model
  without that entry is refused), and times, profiles and checks errors over at most
  ``SMOKE_ROUNDS`` rounds or windows: every code path of the child runs, in seconds; its figures
  mean nothing.

A minimal family (``engines.py`` would look the same)::

    import harness

    def plan(quick):
        return [{"kind": "time", "rounds": 3 if quick else 41}]

    def measure(spec):
        benches = [harness.build_bench(n, "cnn", t, 100, 8) for n, t in (("ours", harness.ours),
                                                                          ("plain", harness.plain))]
        try:
            return {"times": harness.time_side_by_side(benches, spec["rounds"])}
        finally:
            harness.close(benches)

    def summarize(results):
        ratio, ci = harness.ratio_with_ci(results[0]["times"], "ours", "plain")
        return {"my_ratio": ratio}, ["- ours / plain: %s" % harness.fmt(ratio)]

Graph state: each bench's graph holds its model's variables (``model/...``,
``mlp/...``), ``global_step``, the optimizer's slots and the trainer's own state.
"""
import collections
import importlib
import importlib.util
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # The benchmarks' own CNN (model.py) and flag parser (flags.py).
    sys.path.insert(0, HERE)

from flags import OneLineParser  # noqa: E402,F401  (run.py's and soak.py's parser; imports no TF)
RESULT_PREFIX = "BENCH_RESULT "
MB = 1024.0 * 1024.0
LEARNING_RATE = 1e-3  # Adam, for timing; small enough to stay finite on random labels.
SGD_LEARNING_RATE = 1e-2  # For errors: an SGD update is proportional to its gradient.
SMOKE_MICRO = 4  # Examples per micro-batch at most in a smoke child (4 towers take one each).
SMOKE_ROUNDS = 2  # Timed rounds, profiled and error windows at most in a smoke child.
# Whether this process is a smoke child: set by ``child_main`` from the spec's ``"smoke"``.
smoke = False

Window = collections.namedtuple("Window", ["before", "each", "after", "whole_window"], defaults=(False,))
Window.__doc__ = """One window's runs: ``before``/``after`` without a feed, ``each`` once per micro-batch,
or, with ``whole_window``, once on the k micro-batches fed end to end (one run per window)."""
Bench = collections.namedtuple("Bench", ["name", "session", "run_window", "micro_steps", "feeds", "window",
                                         "reference", "variable_bytes"])
Bench.__doc__ = """A built, initialised variant. ``run_window(feeds=None)`` runs one window
(``micro_steps`` train runs); ``feeds`` is its list of k feed dicts; ``reference`` is
``(trainable variables, gradient tensors)`` or None; ``variable_bytes`` all variables' bytes."""


def _tf():
    import tensorflow as tf  # Lazy: run.py (the parent) never imports TensorFlow.

    return tf


def setup_tensorflow(mode):
    """Imports TensorFlow in behaviour ``mode``; call before building any graph.

    Args:
      mode: ``"tf1"`` (``disable_v2_behavior``) or ``"tf2"`` (``disable_eager_execution`` only).

    Returns:
      The ``tensorflow`` module.

    Raises:
      ValueError: for another mode.

    Example:
      >>> tf = setup_tensorflow("tf1")
    """
    if mode not in ("tf1", "tf2"):
        raise ValueError("`mode` must be 'tf1' or 'tf2', got %r" % (mode,))
    if importlib.util.find_spec("tf_keras") is not None:  # tf.compat.v1.layers on TF >= 2.16.
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    tf = _tf()
    (tf.compat.v1.disable_v2_behavior if mode == "tf1" else tf.compat.v1.disable_eager_execution)()
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    return tf


# ------------------------------------------------------------------ models


def _mean_xent(labels, logits):
    tf = _tf()
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                          name="loss")


def cnn(images, labels, width=16, batch_norm=None):
    """The example's CNN (``examples/fashion_mnist_subdivision.build_logits``, its defaults), training mode.

    Args:
      images: float32 ``[N, 28, 28, 1]``; labels: int32 ``[N]``.
      width: channels of the first block.
      batch_norm: ``None`` (the example's default, ``tf.compat.v1.layers.batch_normalization``)
        or a drop-in such as ``gradaccum.batch_normalization``.

    Returns:
      The mean cross-entropy.

    Raises:
      ValueError: for a ``batch_norm`` the example's ``build_logits`` cannot take.

    Example:
      >>> loss = cnn(images, labels, width=2)
    """
    import inspect

    import model as example

    if batch_norm is None:
        return _mean_xent(labels, example.build_logits(images, True, width))
    if "batch_norm" not in inspect.signature(example.build_logits).parameters:
        raise ValueError("the example's `build_logits` takes no `batch_norm`, got %r" % (batch_norm,))
    return _mean_xent(labels, example.build_logits(images, True, width, batch_norm=batch_norm))


def mlp(images, labels, widths=(2048, 2048, 2048)):
    """An MLP 784-widths-10; the default has 10.0M parameters (40 MB in float32).

    Args:
      images: float32 ``[N, 28, 28, 1]``; labels: int32 ``[N]``.
      widths: hidden layer sizes.

    Returns:
      The mean cross-entropy.

    Example:
      >>> loss = mlp(images, labels, widths=[4])
    """
    tf = _tf()
    with tf.compat.v1.variable_scope("mlp", reuse=tf.compat.v1.AUTO_REUSE):
        net = tf.reshape(images, [-1, 28 * 28])
        for index, units in enumerate(widths):
            net = tf.compat.v1.layers.dense(net, units, tf.nn.relu, name="hidden%d" % index)
        logits = tf.compat.v1.layers.dense(net, 10, name="logits")
    return _mean_xent(labels, logits)


MODELS = {"cnn": cnn, "mlp": mlp}
SMOKE_MODEL_ARGS = {"cnn": {"width": 2}, "mlp": {"widths": [8]}}  # Merged over a smoke child's model_args.


def _sized(model, micro, model_args):
    """``(micro, model_args)`` as given, or at the smoke size in a smoke child.

    Raises:
      ValueError: in a smoke child, for a model without a ``SMOKE_MODEL_ARGS`` entry.
    """
    if not smoke:
        return micro, model_args
    if model not in SMOKE_MODEL_ARGS:
        raise ValueError("`model` %r has no SMOKE_MODEL_ARGS entry (its smallest arguments, for --smoke)"
                         % (model,))
    return min(micro, SMOKE_MICRO), dict(model_args or {}, **SMOKE_MODEL_ARGS[model])


# ------------------------------------------------------------------ trainers


def update_ops():
    """The graph's ``UPDATE_OPS`` (batch-norm moving averages), run with every micro-batch."""
    tf = _tf()
    return tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)


def ours(model_fn, images, labels, k, make_optimizer, global_step, keep=None, **accumulator_args):
    """``gradaccum.GradientAccumulator``, fused train op, ``weight`` = the micro-batch size.

    ``keep``: None, or a list the accumulator is appended to (for its manual ops).
    """
    import gradaccum

    tf = _tf()
    loss = model_fn(images, labels)
    weight = accumulator_args.pop("weight") if "weight" in accumulator_args else tf.shape(images)[0]
    opt = gradaccum.GradientAccumulator(make_optimizer(), k, **accumulator_args)
    if keep is not None:
        keep.append(opt)
    return Window([], opt.minimize(loss, global_step=global_step, weight=weight), [])


def one_run(model_fn, images, labels, k, make_optimizer, global_step):
    """``gradaccum.subdivisions.minimize``: the k micro-batches in a ``tf.while_loop``, one run per window.

    The same accumulator (weight = the micro-batch size) as ``ours``; the micro-batches' batch-norm
    updates run inside the loop, so no ``update_ops()`` here.
    """
    import gradaccum.devices.subdivisions

    opt = gradaccum.GradientAccumulator(make_optimizer(), k)
    result = gradaccum.subdivisions.minimize(opt, model_fn, [images, labels], global_step=global_step)
    return Window([], result.train_op, [], whole_window=True)


def ours_unweighted(model_fn, images, labels, k, make_optimizer, global_step):
    """``gradaccum.GradientAccumulator`` with ``weight=None``."""
    return ours(model_fn, images, labels, k, make_optimizer, global_step, weight=None)


def plain(model_fn, images, labels, k, make_optimizer, global_step):
    """No accumulation: the optimizer applies on every micro-batch."""
    tf = _tf()
    loss = model_fn(images, labels)
    with tf.control_dependencies(update_ops()):
        return Window([], make_optimizer().minimize(loss, global_step=global_step), [])


def fwd_bwd(model_fn, images, labels, k, make_optimizer, global_step):
    """Forward and backward only (gradients computed, one element of each fetched): the compute floor.

    Grouping the gradients would not do: grappler's dependency optimizer turns stateless ops
    whose outputs nobody reads into no-ops, so the backward pass would not run at all.
    """
    tf = _tf()
    loss = model_fn(images, labels)
    grads = tf.gradients(loss, tf.compat.v1.trainable_variables())
    with tf.control_dependencies(update_ops()):
        return Window([], tf.add_n([tf.reshape(g, [-1])[0] for g in grads]), [])


# ------------------------------------------------------------------ benches


def random_feeds(images, labels, micro, count, seed):
    """Returns ``count`` feed dicts of ``micro`` random examples (timing needs no real data)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    return [{images: rng.rand(micro, 28, 28, 1).astype(np.float32),
             labels: rng.randint(0, 10, micro).astype(np.int32)} for _ in range(count)]


def end_to_end(feeds):
    """One feed of ``feeds``' micro-batches end to end, and the micro-batches again as views of it.

    A whole-window bench keeps only the views, so that it holds its window's examples once, as the others do.

    Example:
      >>> whole, views = end_to_end(random_feeds(images, labels, 4, 3, 0))  # whole[images]: 12 examples
    """
    import numpy as np

    keys = list(feeds[0])
    whole = dict((key, np.concatenate([feed[key] for feed in feeds])) for key in keys)
    bounds = np.cumsum([len(feed[keys[0]]) for feed in feeds])[:-1]
    return whole, [dict(zip(keys, parts)) for parts in zip(*(np.split(whole[key], bounds) for key in keys))]


def _window_runner(session, window, feeds):
    """``run_window(window_feeds=None)`` of a built bench: ``before``, ``each`` per micro-batch (or once on
    the micro-batches end to end), ``after``. Returns ``(run_window, feeds)``, ``feeds`` as the bench keeps them."""
    whole = None
    if window.whole_window:  # Concatenated once here: the timed runs feed it as the others feed theirs.
        whole, feeds = end_to_end(feeds)

    def run_window(window_feeds=None):
        for op in window.before:
            session.run(op)
        runs = window_feeds or feeds
        if window.whole_window:
            runs = [end_to_end(window_feeds)[0] if window_feeds else whole]
        for feed in runs:
            session.run(window.each, feed)
        for op in window.after:
            session.run(op)

    return run_window, feeds


def _make_optimizer(name):
    tf = _tf()
    if name == "sgd":
        return lambda: tf.compat.v1.train.GradientDescentOptimizer(SGD_LEARNING_RATE)
    return lambda: tf.compat.v1.train.AdamOptimizer(LEARNING_RATE)


def _variable_bytes(graph):
    tf = _tf()
    variables = graph.get_collection(tf.compat.v1.GraphKeys.GLOBAL_VARIABLES) + \
        graph.get_collection(tf.compat.v1.GraphKeys.LOCAL_VARIABLES)
    return int(sum(v.shape.num_elements() * v.dtype.base_dtype.size for v in set(variables)))


def trainable_floats(graph):
    """The number of trainable parameters in ``graph``."""
    tf = _tf()
    return int(sum(v.shape.num_elements() for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)))


def build_bench(name, model, trainer, micro, k, model_args=None, optimizer="adam", cpus=1, seed=0,
                reference=False):
    """Builds ``trainer`` on ``model`` in a fresh graph and session, initialised, graph finalized.

    Args:
      name: the bench's name (a row of the tables).
      model: a key of ``MODELS``.
      trainer: a trainer function (see the module docstring).
      micro: examples per micro-batch; k: micro-batches per window.
      model_args: keyword arguments of the model function.
      optimizer: ``"adam"`` (timing) or ``"sgd"`` (errors).
      cpus: CPU devices of the session (towers need one each).
      seed: graph and data seed.
      reference: also build the plain gradients, for ``update_errors``.

    Returns:
      A ``Bench`` with k random feeds (a whole-window trainer's run feeds them end to end).

    Example:
      >>> bench = build_bench("ours", "mlp", ours, 8, 8, {"widths": [4]})
    """
    tf = _tf()
    micro, model_args = _sized(model, micro, model_args)
    graph = tf.Graph()
    losses = []

    def model_fn(images, labels):
        losses.append(MODELS[model](images, labels, **(model_args or {})))
        return losses[-1]

    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        global_step = tf.compat.v1.train.get_or_create_global_step()
        window = trainer(model_fn, images, labels, k, _make_optimizer(optimizer), global_step)
        ref = None
        if reference:
            variables = tf.compat.v1.trainable_variables()
            # A whole-window trainer's first loss is on a slice of the feed: the reference takes the model
            # again on the placeholders (the models' variable scopes reuse their variables).
            loss = MODELS[model](images, labels, **(model_args or {})) if window.whole_window else losses[0]
            ref = (variables, tf.gradients(loss, variables))
        inits = [tf.compat.v1.global_variables_initializer(), tf.compat.v1.local_variables_initializer()]
    session = tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(device_count={"CPU": cpus}))
    feeds = random_feeds(images, labels, micro, k, seed)
    session.run(inits[0])
    session.run(inits[1], feeds[0])  # Horovod initialises its LOCAL_VARIABLES with zeros_like(gradient).
    graph.finalize()  # A bench that grows its graph would measure the growth.
    run_window, feeds = _window_runner(session, window, feeds)
    return Bench(name, session, run_window, k, feeds, window, ref, _variable_bytes(graph))


def stream_bench(num_floats, passes=8, name="stream"):
    """A TF graph doing ``passes`` chained ``a += b`` over ``num_floats`` float32 per run.

    Bytes moved per pass: ``3 * 4 * num_floats`` (read a, read b, write a): the shape of
    an accumulate pass. Its "micro-steps" are passes, so its time is seconds per pass.

    Args:
      num_floats: elements of ``a`` and ``b``.
      passes: passes per ``session.run`` (amortises the run's own overhead).
      name: the bench's name.

    Returns:
      A ``Bench``.

    Example:
      >>> bench = stream_bench(10 ** 7)
    """
    tf = _tf()
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.Variable(tf.zeros([num_floats]), name="a")
        b = tf.compat.v1.Variable(tf.ones([num_floats]) * 1e-7, name="b")
        op = tf.no_op()
        for _ in range(passes):
            with tf.control_dependencies([op]):
                op = tf.compat.v1.assign_add(a, b.read_value() if hasattr(b, "read_value") else b).op
        init = tf.compat.v1.global_variables_initializer()
    session = tf.compat.v1.Session(graph=graph)
    session.run(init)
    graph.finalize()
    return Bench(name, session, lambda window_feeds=None: session.run(op), passes, [], Window([], op, []), None,
                 8 * num_floats)


def numpy_stream_bench(num_floats, passes=8, name="stream_numpy"):
    """The same ``a += b`` passes with numpy (one thread), as a ``Bench`` without a session.

    Example:
      >>> numpy_stream_bench(10 ** 7).run_window()
    """
    import numpy as np

    a, b = np.zeros(num_floats, np.float32), np.full(num_floats, 1e-7, np.float32)

    def run_window(window_feeds=None):
        for _ in range(passes):
            np.add(a, b, out=a)

    return Bench(name, None, run_window, passes, [], None, None, 8 * num_floats)


def stream_bandwidth_gbs(times, num_floats, names=("stream", "stream_numpy")):
    """Per-round bandwidth of the ``a += b`` benches in ``times`` (the best of them each round), GB/s.

    Counts every byte read and written: ``3 * 4 * num_floats`` per pass.

    Example:
      >>> stream_bandwidth_gbs({"stream": [0.012]}, 10 ** 8)
      [100.0]
    """
    series = [times[name] for name in names if name in times]
    return [3 * 4 * num_floats / min(seconds) / 1e9 for seconds in zip(*series)]


def close(benches):
    """Closes the sessions of ``benches`` (a list of ``Bench``)."""
    for bench in benches:
        if bench.session is not None:
            bench.session.close()


# ------------------------------------------------------------------ timing


def time_side_by_side(benches, rounds, windows=1, warmup=1, max_seconds=None, min_rounds=5, seed=0):
    """Times benches in interleaved rounds, in a new random order every round.

    A shuffle, not a rotation: a rotation keeps each bench's predecessor, and a
    bench always run after the numpy stream (cold caches, idle TF threads, we
    think) measured 2% slower than its own twin over a full run.

    Args:
      benches: list of ``Bench``.
      rounds: rounds; each runs ``windows`` windows of every bench.
      windows: windows per bench and round.
      warmup: untimed windows per bench first.
      max_seconds: stop after the round that passes this many seconds (a loaded
        machine keeps the run bounded), once ``min_rounds`` rounds are done.
      min_rounds: see ``max_seconds``.
      seed: seeds the orders (each child passes its own, so that pooled children differ).

    Returns:
      ``{name: [seconds per micro-step, one per round]}``.

    Example:
      >>> times = time_side_by_side([a, b], rounds=11)
    """
    if smoke:
        rounds, min_rounds = min(rounds, SMOKE_ROUNDS), min(min_rounds, SMOKE_ROUNDS)
    for bench in benches:
        for _ in range(warmup):
            bench.run_window()
    times, begin, shuffler = dict((bench.name, []) for bench in benches), time.perf_counter(), random.Random(seed)
    for index in range(rounds):
        if max_seconds is not None and index >= min_rounds and time.perf_counter() - begin > max_seconds:
            break
        order = list(benches)
        shuffler.shuffle(order)
        for bench in order:
            start = time.perf_counter()
            for _ in range(windows):
                bench.run_window()
            times[bench.name].append((time.perf_counter() - start) / (windows * bench.micro_steps))
    return times


def paired_ratio(top, bottom):
    """The median over rounds of ``top[i] / bottom[i]``.

    Raises:
      ValueError: when the series are empty or differ in length.

    Example:
      >>> paired_ratio([1.1, 0.9, 1.0], [1.0, 1.0, 1.0])
      1.0
    """
    if not top or len(top) != len(bottom):
        raise ValueError("`top` and `bottom` must be non-empty and as long, got %d and %d" % (len(top), len(bottom)))
    return statistics.median(a / b for a, b in zip(top, bottom))


def median_ci95(values):
    """A distribution-free 95% interval of the median: order statistics ``j``, ``n+1-j``,
    ``j = floor(n/2 - 0.98 sqrt(n))``; ``(min, max)`` below 6 values.

    Example:
      >>> median_ci95(list(range(1, 101)))
      (40, 61)
    """
    ordered = sorted(values)
    j = int(math.floor(len(ordered) / 2.0 - 0.98 * math.sqrt(len(ordered))))
    if j < 1:
        return ordered[0], ordered[-1]
    return ordered[j - 1], ordered[len(ordered) - j]


def verdict(value, ci, target, direction="<="):
    """``"met"``, ``"NOT met"``, ``"not resolved"`` (the 95% interval holds the target: the ratio is within
    its own noise of it) or ``"not measured"``; ``direction`` ``"<="`` (the default) or ``">="``.

    Example:
      >>> verdict(0.88, [0.86, 0.91], 0.90)
      'not resolved'
    """
    if value is None:
        return "not measured"
    if ci and None not in ci and ci[0] <= target <= ci[1]:
        return "not resolved"
    return "met" if (value <= target if direction == "<=" else value >= target) else "NOT met"


def median_with_ci(values):
    """``(median, [low, high])`` of ``values`` (see ``median_ci95``), or ``(None, None)`` if there are none."""
    values = list(values)
    if not values:
        return None, None
    return statistics.median(values), list(median_ci95(values))


def ratio_with_ci(times, top, bottom):
    """``(paired ratio, [low, high])`` of two series of ``times``, or ``(None, None)`` if one is missing."""
    if top not in times or bottom not in times:
        return None, None
    return median_with_ci(a / b for a, b in zip(times[top], times[bottom]))


# ------------------------------------------------------------------ memory


def peak_rss_bytes():
    """This process's peak resident set size so far (``getrusage``), in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def allocator_peak_bytes(reset=False):
    """TensorFlow's peak allocator bytes on ``CPU:0``; None where it keeps none (TF < 2.5,
    or without ``TF_CPU_ALLOCATOR_USE_BFC=true``). ``reset`` resets the peak (returns None)."""
    tf = _tf()
    try:
        if reset:
            tf.config.experimental.reset_memory_stats("CPU:0")
            return None
        return int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
    except (ValueError, AttributeError, tf.errors.OpError):
        return None


def measure_memory(bench, windows=2):
    """Runs ``windows`` windows of ``bench`` and returns its memory figures (call in a fresh process).

    Returns:
      Dict: ``peak_rss_bytes`` (``getrusage``, the process's whole life), ``sampled_peak_rss_bytes``
      (psutil every 5 ms during the windows), ``rss_before_bytes`` (built and initialised),
      ``tf_peak_bytes`` (or None), ``variable_bytes``.

    Example:
      >>> measure_memory(build_bench("ours", "mlp", ours, 8, 8))["peak_rss_bytes"] > 0
      True
    """
    import psutil

    process, peak, stop = psutil.Process(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            stop.wait(0.005)

    before = process.memory_info().rss
    allocator_peak_bytes(reset=True)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    for _ in range(windows):
        bench.run_window()
    stop.set()
    thread.join()
    return {"peak_rss_bytes": peak_rss_bytes(), "sampled_peak_rss_bytes": int(max(peak[0], before)),
            "rss_before_bytes": int(before), "tf_peak_bytes": allocator_peak_bytes(),
            "variable_bytes": bench.variable_bytes}


# ------------------------------------------------------------------ errors and profiles


def update_errors(bench, windows, seed=1):
    """Max relative error of each window's update against the full-batch update.

    The full-batch update of a window is ``-lr * mean_i(g_i)`` of its k equal micro-batches
    at the window's starting values (SGD, so an update is its gradient; for batch norm each
    micro-batch is normalised by its own statistics, as in docs/guides/accumulation.md, "what equal means").

    Args:
      bench: built with ``optimizer="sgd", reference=True``.
      windows: windows, each on new random micro-batches.
      seed: data seed.

    Returns:
      A list: ``|update - full| / |full|`` (global norms) per window.

    Example:
      >>> max(update_errors(build_bench("ours", "mlp", ours, 8, 4, optimizer="sgd", reference=True), 3))
    """
    import numpy as np

    windows = min(windows, SMOKE_ROUNDS) if smoke else windows
    variables, grads = bench.reference
    images, labels = list(bench.feeds[0])
    micro = len(bench.feeds[0][images])
    errors = []
    for window in range(windows):
        feeds = random_feeds(images, labels, micro, bench.micro_steps, seed + window)
        start = bench.session.run(variables)
        sums = [np.zeros_like(v, np.float64) for v in start]
        for feed in feeds:
            sums = [s + g for s, g in zip(sums, bench.session.run(grads, feed))]
        full = [-SGD_LEARNING_RATE * s / len(feeds) for s in sums]
        bench.run_window(feeds)
        update = [b - a for a, b in zip(start, bench.session.run(variables))]
        diff = math.sqrt(sum(float(np.sum((u - f) ** 2)) for u, f in zip(update, full)))
        errors.append(diff / math.sqrt(sum(float(np.sum(f ** 2)) for f in full)))
    return errors


def profile_window(bench, windows=3):
    """Traces every micro-step of ``windows`` windows; op time by (top scope, op type) per step.

    Uses ``RunMetadata`` step stats (``op_end_rel_micros - op_start_rel_micros`` per node).
    Start at a window boundary (after whole windows, as ``time_side_by_side`` leaves a bench).

    Args:
      bench: a ``Bench`` with no ``before``/``after`` runs.
      windows: windows traced; the figures are their means.

    Returns:
      A list with one entry per micro-step of the window: ``[[scope, op type, ms], ...]``,
      largest first.

    Example:
      >>> steps = profile_window(bench)  # steps[-1]: the applying micro-step
    """
    tf = _tf()
    windows = min(windows, SMOKE_ROUNDS) if smoke else windows
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    steps = [collections.defaultdict(float) for _ in bench.feeds]
    for _ in range(windows):
        for totals, feed in zip(steps, bench.feeds):
            metadata = tf.compat.v1.RunMetadata()
            bench.session.run(bench.window.each, feed, options=options, run_metadata=metadata)
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    if " = " not in node.timeline_label:
                        continue  # _SOURCE and other runtime nodes.
                    # The kernel that ran (after grappler's rewrites, e.g. MatMul+BiasAdd+Relu fused into
                    # _FusedMatMul under the Relu's name), not the op type the graph was built with.
                    kind = node.timeline_label.split(" = ", 1)[1].split("(")[0].strip()
                    micros = node.op_end_rel_micros - node.op_start_rel_micros
                    totals[(node.node_name.split("/")[0], kind)] += micros / 1e3 / windows
    return [[[scope, kind, ms] for (scope, kind), ms in sorted(totals.items(), key=lambda item: -item[1])]
            for totals in steps]


# ------------------------------------------------------------------ processes and output


class ChildError(RuntimeError):
    """A measurement child failed, timed out, or printed no result."""


def last_error_line(stderr):
    """The last exception line of a traceback in ``stderr``, else its last line (``"no output"``)."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.split(":")[0].split(".")[-1].endswith(("Error", "Exception", "Exit"))]
    return (errors or lines or ["no output"])[-1]


def child_environment(env=None):
    """A child's environment: this process's, TensorFlow's C++ log at errors unless it says otherwise, ``env``.

    Example:
      >>> child_environment({"TF_ENABLE_ONEDNN_OPTS": "0"})["TF_ENABLE_ONEDNN_OPTS"]
      '0'
    """
    environment = dict({"TF_CPP_MIN_LOG_LEVEL": "2"}, **os.environ)
    environment.update(env or {})
    return environment


def run_child(family, spec, timeout, env=None, python=None):
    """Runs ``FAMILY.measure(spec)`` in a fresh interpreter and returns its result dict.

    Args:
      family: a module name in this directory (``"peers"``).
      spec: a JSON-serialisable dict; ``mode`` picks the TF behaviour (default ``"tf1"``).
      timeout: seconds before the child is killed.
      env: extra environment variables (for example ``TF_ENABLE_ONEDNN_OPTS``).
      python: the interpreter (default ``sys.executable``), or a list: the command's first
        arguments in its place (``tests/forkserver.py``'s client).

    Raises:
      ChildError: on a timeout, a non-zero exit or no result line (one line: the child's error).

    Example:
      >>> run_child("peers", {"kind": "time", "quick": True}, 600)
    """
    prefix = list(python) if isinstance(python, (list, tuple)) else [python or sys.executable]
    command = prefix + [os.path.abspath(__file__), family, json.dumps(spec)]
    try:
        done = subprocess.run(command, env=child_environment(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ChildError("%s child timed out after %g s: %s" % (family, timeout, json.dumps(spec))) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise ChildError("%s child exited with status %d (%s): %s"
                         % (family, done.returncode, last_error_line(done.stderr), json.dumps(spec)))
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def fmt(value, digits=3):
    """A table cell: ``n/a`` for None, else the number with ``digits`` decimals."""
    return "n/a" if value is None else "%.*f" % (digits, value)


def mb(value):
    """A table cell: ``n/a`` for None, else bytes as whole MiB."""
    return "n/a" if value is None else "%.0f MB" % (value / MB)


def markdown_table(header, rows):
    """A markdown table: first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def child_main(argv):
    """``python harness.py FAMILY SPEC_JSON``: set up TF, run ``FAMILY.measure``, print the result line.

    A spec with ``"smoke": true`` runs at the smoke size (see the module docstring).
    """
    global smoke
    if len(argv) != 2:
        sys.stderr.write("usage: harness.py FAMILY SPEC_JSON\n")
        return 2
    spec = json.loads(argv[1])
    smoke = bool(spec.get("smoke"))
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    family = importlib.import_module(argv[0])  # Families import TensorFlow only when measuring.
    warnings.filterwarnings("ignore")  # tf.compat.v1.layers' deprecation notices, once per layer.
    tf = setup_tensorflow(spec.get("mode", "tf1"))
    result = family.measure(spec)
    result.update(tensorflow=tf.__version__, mode=spec.get("mode", "tf1"),
                  onednn=os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default"))
    sys.stdout.write(RESULT_PREFIX + json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    import harness  # The module the families import: ``smoke`` must be set in it, not in ``__main__``.

    sys.exit(harness.child_main(sys.argv[1:]))
