"""The graphs the benchmarks measure: two models, each trained in several ways.

Models:

* ``"cnn"``: the example's batch-norm CNN (``build_logits`` from
  ``examples/fashion_mnist_subdivision.py``), ``width`` = channels of its first
  block;
* ``"mlp"``: a small MLP (784 -> ``width`` -> 10) whose steps are so cheap that
  the per-step overhead of accumulation shows most.

Variants (how one window of ``k`` micro-batches is trained):

* ``"plain"``: Adam, one update per run (``k`` updates per window);
  ``"one_device"`` is the same, the reference of the towers;
* ``"fused"``: ``gradaccum.GradientAccumulator``, one run per micro-batch;
* ``"fused_float64"``: the same, accumulating in float64;
* ``"manual"``: the same accumulator driven as in the seeds: ``zero_op``, then
  ``k`` runs of ``accumulate_op``, then ``apply_op``;
* ``"tensorpack"``, ``"horovod"``: tensorpack's ``AccumGradOptimizer`` and
  Horovod's ``backward_passes_per_step`` on one process, when installed;
* ``"towers<n>"``: ``gradaccum.tower.minimize`` over ``/cpu:0`` .. ``/cpu:<n-1>``.

Each builder works in the default graph; callers make a fresh ``tf.Graph``
per variant. Variables: the model's (``model/...`` or ``mlp/...``),
``global_step``, Adam's slots and beta powers, and the accumulator's state
(see ``gradaccum.accumulator``) or the other libraries' own.
"""
import collections
import importlib
import importlib.util
import inspect
import os
import sys

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if EXAMPLES_DIR not in sys.path:
    sys.path.insert(0, EXAMPLES_DIR)
# tf.compat.v1.layers needs tf_keras on TF >= 2.16; TF 1.15 to 2.15 have Keras 2 built in,
# and there the variable would break tf.compat.v1.layers if tf_keras is absent.
if importlib.util.find_spec("tf_keras") is not None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import fashion_mnist_subdivision as example  # noqa: E402
import gradaccum  # noqa: E402
from gradaccum import tower  # noqa: E402

# Small enough that thousands of soak steps on random labels stay finite.
LEARNING_RATE = 1e-3
MODELS = ("cnn", "mlp")

# What one window runs: `before` and `after` without a feed, `each` once per micro-batch.
Window = collections.namedtuple("Window", ["before", "each", "after"])
Bench = collections.namedtuple("Bench", ["name", "session", "run_window", "examples", "runs", "param_bytes"])
Bench.__doc__ = """A built, initialised variant, ready to run.

Attributes:
  name: the variant.
  session: its ``tf.compat.v1.Session`` (close it when done).
  run_window: callable running one window (one effective update).
  examples: examples per window.
  runs: ``session.run`` calls per window.
  param_bytes: bytes of the trainable parameters.
"""


def default_width(model):
    """Returns the width a model gets when none is given.

    Args:
      model: ``"cnn"`` or ``"mlp"``.

    Returns:
      The example's default width for the CNN, 64 hidden units for the MLP.

    Example:
      >>> default_width("cnn")
      24
    """
    return example.DEFAULT_WIDTH if model == "cnn" else 64


def model_loss(model, images, labels, width):
    """Builds the mean cross-entropy of ``model``; calling it again reuses its variables.

    Args:
      model: ``"cnn"`` or ``"mlp"``.
      images: float32 ``[N, 28, 28, 1]``.
      labels: int32 ``[N]``.
      width: the CNN's first-block channels, or the MLP's hidden units.

    Returns:
      A scalar float32 loss tensor.

    Example:
      >>> loss = model_loss("mlp", images, labels, 64)
    """
    if model == "cnn":
        logits = example.build_logits(images, True, width)
    else:
        with tf.compat.v1.variable_scope("mlp", reuse=tf.compat.v1.AUTO_REUSE):
            hidden = tf.compat.v1.layers.dense(tf.reshape(images, [-1, 28 * 28]), width, tf.nn.relu,
                                               name="hidden")
            logits = tf.compat.v1.layers.dense(hidden, 10, name="logits")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                          name="loss")


def unavailable(variant):
    """Says why ``variant`` cannot be built here, or returns None when it can.

    Args:
      variant: a variant name (see the module docstring).

    Returns:
      ``None``, or a one-line reason (a library not installed, an argument missing).

    Example:
      >>> unavailable("tensorpack")
      'tensorpack is not installed'
    """
    if variant == "fused_float64":
        params = inspect.signature(gradaccum.GradientAccumulator.__init__).parameters
        return None if "accumulation_dtype" in params else "GradientAccumulator has no `accumulation_dtype`"
    module = {"tensorpack": "tensorpack.tfutils.optimizer", "horovod": "horovod.tensorflow"}.get(variant)
    if module is None:
        return None
    if importlib.util.find_spec(variant) is None:
        return "%s is not installed" % variant
    try:
        importlib.import_module(module)
    except Exception as exc:  # An installed but broken package is a reason, not a crash.
        return "importing %s failed: %s" % (module, " ".join(str(exc).split()))
    return None


def _adam():
    return tf.compat.v1.train.AdamOptimizer(LEARNING_RATE)


def _after_update_ops(build):
    # Batch-norm moving averages run on every run, as in the example.
    with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
        return build()


def _accumulator(variant, k):
    if variant == "fused_float64":
        return gradaccum.GradientAccumulator(_adam(), k, accumulation_dtype=tf.float64)
    return gradaccum.GradientAccumulator(_adam(), k)


def _other_library(variant, k, loss, global_step):
    if variant == "tensorpack":
        from tensorpack.tfutils.optimizer import AccumGradOptimizer  # Optional; see unavailable().

        # It counts its own iterations and refuses a global_step.
        return _after_update_ops(lambda: AccumGradOptimizer(_adam(), k).minimize(loss))
    import horovod.tensorflow as hvd  # Optional; see unavailable().

    hvd.init()
    optimizer = hvd.DistributedOptimizer(_adam(), backward_passes_per_step=k)
    return _after_update_ops(lambda: optimizer.minimize(loss, global_step=global_step))


def _towers(variant, model, images, labels, width, global_step):
    count = int(variant[len("towers"):])

    def model_fn(shard_images, shard_labels):
        return model_loss(model, shard_images, shard_labels, width)

    devices = ["/cpu:%d" % index for index in range(count)]
    return tower.minimize(_adam(), model_fn, [images, labels], devices=devices,
                          global_step=global_step, update_ops="first").train_op


def build_window(model, variant, width, k):
    """Builds ``variant`` of ``model`` in the default graph.

    Args:
      model: ``"cnn"`` or ``"mlp"``.
      variant: see the module docstring; ``"towers<n>"`` needs ``n`` CPU devices.
      width: see ``model_loss``.
      k: micro-batches per window (1 for the towers).

    Returns:
      ``(images, labels, window)``: the placeholders and a ``Window``.

    Raises:
      ValueError: for an unknown model or variant.

    Example:
      >>> with tf.Graph().as_default():
      ...     images, labels, window = build_window("mlp", "fused", 64, 10)
    """
    if model not in MODELS:
        raise ValueError("`model` must be one of %r, got %r" % (MODELS, model))
    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    global_step = tf.compat.v1.train.get_or_create_global_step()
    if variant.startswith("towers"):
        return images, labels, Window([], _towers(variant, model, images, labels, width, global_step), [])
    loss = model_loss(model, images, labels, width)
    if variant in ("plain", "one_device"):
        train_op = _after_update_ops(lambda: _adam().minimize(loss, global_step=global_step))
    elif variant in ("fused", "fused_float64", "manual"):
        accumulator = _accumulator(variant, k)
        train_op = accumulator.minimize(loss, global_step=global_step, weight=tf.shape(images)[0])
        if variant == "manual":
            return images, labels, Window([accumulator.zero_op], accumulator.accumulate_op, [accumulator.apply_op])
    elif variant in ("tensorpack", "horovod"):
        train_op = _other_library(variant, k, loss, global_step)
    else:
        raise ValueError("`variant` %r is unknown" % (variant,))
    return images, labels, Window([], train_op, [])


def random_batch(size, seed):
    """Returns ``size`` random images and labels (timing and memory need no real data).

    Args:
      size: examples.
      seed: the numpy seed.

    Returns:
      ``(images, labels)``: float32 ``[size, 28, 28, 1]`` and int32 ``[size]``.

    Example:
      >>> images, labels = random_batch(100, 0)
    """
    rng = np.random.RandomState(seed)
    return rng.rand(size, 28, 28, 1).astype(np.float32), rng.randint(0, 10, size).astype(np.int32)


def param_bytes(graph):
    """Returns the bytes of the trainable variables of ``graph``.

    Args:
      graph: a ``tf.Graph``.

    Returns:
      An int.

    Example:
      >>> param_bytes(tf.compat.v1.get_default_graph())
    """
    variables = graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
    return int(sum(np.prod(v.shape.as_list()) * v.dtype.base_dtype.size for v in variables))


def build_bench(model, variant, width, micro, k, cpus=1, seed=0):
    """Builds ``variant`` in a fresh graph, opens a session, initialises it.

    Args:
      model: ``"cnn"`` or ``"mlp"``.
      variant: see the module docstring.
      width: see ``model_loss``; ``None`` for ``default_width(model)``.
      micro: examples per run of the train op.
      k: runs per window (micro-batches per effective update; 1 for towers).
      cpus: CPU devices of the session (towers need one per tower).
      seed: graph and data seed.

    Returns:
      A ``Bench``; one ``run_window()`` trains on ``micro * k`` examples.

    Example:
      >>> bench = build_bench("mlp", "fused", None, 32, 10)
      >>> bench.run_window()
      >>> bench.session.close()
    """
    width = default_width(model) if width is None else width
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(seed)
        images, labels, window = build_window(model, variant, width, k)
        global_init = tf.compat.v1.global_variables_initializer()
        local_init = tf.compat.v1.local_variables_initializer()
    config = tf.compat.v1.ConfigProto(device_count={"CPU": cpus})
    session = tf.compat.v1.Session(graph=graph, config=config)
    feed = dict(zip((images, labels), random_batch(micro, seed)))
    session.run(global_init)
    # Horovod keeps its aggregation state in LOCAL_VARIABLES, initialised
    # with zeros_like(gradient): after the globals, and it needs a feed.
    session.run(local_init, feed)
    graph.finalize()  # A benchmark that grows the graph measures the growth.

    def run_window():
        for op in window.before:
            session.run(op)
        for _ in range(k):
            session.run(window.each, feed)
        for op in window.after:
            session.run(op)

    runs = len(window.before) + k + len(window.after)
    return Bench(variant, session, run_window, micro * k, runs, param_bytes(graph))
