"""Train a batch-norm CNN on Fashion-MNIST with a batch of 5,000 split into 50 micro-batches.

This is the model of the user seed that asked for "subdivisions" (darknet's
name for it): conv(3x3, no bias) + batch-norm + leaky-ReLU blocks, trained
with Adam. ``gradaccum.GradientAccumulator`` adds the gradients of 50
micro-batches of 100 and applies their average once: the update of a 5,000
batch, in about the memory of a 100 batch.

The default model has five blocks of ``width * 1 .. width * 5`` channels
(strides 1, 2, 2, 1, 1), flattened into a dense layer of 10. The learning
rate warms up linearly over the first updates and then follows a cosine down
to 0 at the last one, both driven by ``global_step`` (which counts applied
updates, not micro-batches). ``--width 128 --strides 2,2,1,1,1 --head mean``
is the seed's model (slow on a CPU).

Data: ``idx_data.load_dataset`` (``--data-dir``, the Keras cache,
``/usr/share/datasets/fashion-mnist``, a download, else scikit-learn's digits
with a note on how to get Fashion-MNIST), announced in one line. Bad input
stops the script with one line and exit status 2, before TensorFlow is
imported where possible. TensorFlow's start-up noise is kept out of the
output (``_quiet``); ``--verbose`` lets it through. ``--json PATH`` writes a
summary of the run. ``--logdir DIR`` writes TensorBoard summaries once per
update (``gradaccum.summaries``); the accumulator keeps the gradient noise
scale (``statistics=True``), printed at the end. ``GRADACCUM_TF_MODE=tf2``
runs with resource variables (``disable_eager_execution`` only) instead of
``disable_v2_behavior``.

Reuse: ``build_logits(images, is_training, width)`` and
``build_training(config)`` build the same graph for other scripts.

Graph state: placeholders under ``inputs/``; the model's variables under
``model/`` (``conv1``..``conv5``, ``bn1``..``bn5`` with their moving
averages, ``logits``), ``global_step``, the learning rate under
``learning_rate/``, Adam's slots and beta powers, and the accumulator's state
(see ``gradaccum.accumulator``).
"""
import collections
import json
import math
import os
import random
import resource
import sys
import time

START_TIME = time.time()

import _quiet  # noqa: E402

VERBOSE = __name__ == "__main__" and "--verbose" in sys.argv[1:]
_quiet.before_import(VERBOSE)

import numpy as np  # noqa: E402

import _workers  # noqa: E402
import idx_data  # noqa: E402
import _cli  # noqa: E402
from _cli import OneLineParser, fail  # noqa: E402

SEED_WIDTH = 128  # The seed's channels per block unit.
DEFAULT_WIDTH = 16
DEFAULT_MAX_STEPS = 120  # Updates when neither --epochs nor --max-steps is given (10 epochs).
DEFAULT_LEARNING_RATE = 0.003  # Adam's peak learning rate, after the warm-up.
DEFAULT_WARMUP = 10  # Updates of linear warm-up.
STRIDES = (1, 2, 2, 1, 1)  # The seed's are 2, 2, 1, 1, 1: cheaper, and about 0.007 less accurate.
SEED_STRIDES = (2, 2, 1, 1, 1)
HEADS = ("flatten", "mean")  # Dense layer over all positions; the seed's global mean pool.
# Momentum of the batch-norm moving averages, per update of the moving statistics:
# per micro-batch for "micro" (50 per applied update), per applied update for "window".
BN_MOMENTUM = {"micro": 0.9, "window": 0.5}
BN_EPSILON = 1e-5
REDRAW_SECONDS = {True: 0.5, False: 30.0}  # Progress line redraws: terminal, log file.

TrainingConfig = collections.namedtuple(
    "TrainingConfig", ["width", "learning_rate", "subdivisions", "towers", "warmup_updates", "total_updates",
                       "bn_stats", "bn_momentum", "head", "strides"])
TrainingConfig.__new__.__defaults__ = (0, None, "micro", None, "flatten", STRIDES)
TrainingConfig.__doc__ = """What ``build_training`` needs.

Attributes:
  width: channels of the first block; block i has ``width * i``.
  learning_rate: Adam's (peak) learning rate.
  subdivisions: ``None`` for plain training (one update per run), else the
    number of micro-batches per update, through ``GradientAccumulator``.
  towers: 1, or the number of CPU devices to replicate the model over with
    ``gradaccum.tower.minimize`` (the session needs that many CPU devices).
  warmup_updates: updates of linear warm-up (default 0).
  total_updates: ``None`` (default) for a constant learning rate, else the
    update at which the cosine decay reaches 0.
  bn_stats: ``"micro"`` (default): ``tf.compat.v1.layers.batch_normalization``,
    whose moving averages follow every micro-batch; ``"window"``:
    ``gradaccum.batch_normalization``, once per update from the whole window.
  bn_momentum: the moving averages' momentum; ``None`` means ``BN_MOMENTUM[bn_stats]``.
  head: ``"flatten"`` (default) or ``"mean"`` (the seed's global mean pool).
  strides: the five blocks' strides (default ``STRIDES``).
"""

Training = collections.namedtuple(
    "Training", ["images", "labels", "is_training", "logits", "loss", "train_op",
                 "global_step", "accumulator", "learning_rate"])
Training.__doc__ = """What ``build_training`` returns.

Attributes:
  images: float32 placeholder ``[None, 28, 28, 1]``.
  labels: int32 placeholder ``[None]``.
  is_training: bool placeholder, default True; feed False for evaluation.
  logits: ``[None, 10]`` (batch norm in the mode ``is_training`` says).
  loss: scalar mean cross-entropy of the fed (micro-)batch.
  train_op: run once per micro-batch (once per batch for plain training).
  global_step: int64 variable, incremented once per applied update.
  accumulator: the ``GradientAccumulator``, or None for plain training.
  learning_rate: the scalar learning rate of the next update.
"""


# ---------------------------------------------------------- command line


def _parser():
    parser = OneLineParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--batch-size", type=int, default=5000, help="examples per update (default 5000)")
    add("--subdivisions", type=int, default=50, help="micro-batches per update (default 50)")
    add("--no-subdivisions", action="store_true", help="plain training on the whole batch, to compare")
    add("--width", type=int, default=DEFAULT_WIDTH,
        help="channels of the first block (default %d; the seed's is %d)" % (DEFAULT_WIDTH, SEED_WIDTH))
    add("--strides", default=",".join(map(str, STRIDES)),
        help="the five blocks' strides, 1 or 2 (default %s; the seed's are %s)"
             % (",".join(map(str, STRIDES)), ",".join(map(str, SEED_STRIDES))))
    add("--head", choices=HEADS, default="flatten",
        help="flatten (default) or mean: the seed's global mean pool before the dense layer")
    add("--epochs", type=int, default=None, help="stop after this many epochs (default: no limit)")
    add("--max-steps", type=int, default=None,
        help="stop after this many updates (default %d when --epochs is not given)" % DEFAULT_MAX_STEPS)
    add("--learning-rate", type=float, default=DEFAULT_LEARNING_RATE,
        help="Adam's peak learning rate (default %g)" % DEFAULT_LEARNING_RATE)
    add("--warmup-updates", type=int, default=DEFAULT_WARMUP,
        help="updates of linear warm-up before the cosine decay (default %d)" % DEFAULT_WARMUP)
    add("--bn-stats", choices=("window", "micro"), default=None,
        help="batch-norm moving statistics: window = once per update from the whole window "
             "(gradaccum.batch_normalization, the default where it exists), micro = every micro-batch "
             "(tf.compat.v1.layers.batch_normalization)")
    add("--bn-momentum", type=float, default=None,
        help="momentum of the batch-norm moving averages (default %s)" % BN_MOMENTUM)
    add("--towers", type=int, default=1,
        help="replicate the model over this many (virtual) CPU devices with gradaccum.tower (default 1)")
    add("--data-dir", default=None, help="directory with the four Fashion-MNIST IDX files")
    add("--offline", action="store_true", help="do not try to download Fashion-MNIST")
    add("--json", default=None, metavar="PATH", help="write a summary of the run to PATH")
    add("--save", default=None, metavar="PATH", help="save the trained model to this TF checkpoint prefix")
    add("--logdir", default=None, metavar="DIR",
        help="write TensorBoard summaries to DIR (gradaccum.summaries: effective batch, gradient norm, "
             "skipped windows, gradient noise scale, learning rate; once per update)")
    add("--seed", type=int, default=0, help="random seed (default 0)")
    add("--verbose", action="store_true", help="let TensorFlow's log messages and warnings through")
    return parser


def parse_args(argv=None):
    """Parses and checks the flags; bad input exits with one line.

    Args:
      argv: the arguments, without the program name (default ``sys.argv[1:]``).

    Returns:
      An ``argparse.Namespace``; ``max_steps`` holds the default when needed.

    Example:
      >>> args = parse_args(["--subdivisions", "10"])
    """
    args = _parser().parse_args(argv)
    for flag in ("batch_size", "subdivisions", "width", "towers", "epochs", "max_steps"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), value))
    strides = args.strides.split(",")
    if len(strides) != 5 or any(stride not in ("1", "2") for stride in strides):
        fail("`--strides` must be five strides of 1 or 2, like %s, got %r"
             % (",".join(map(str, STRIDES)), args.strides))
    args.strides = tuple(int(stride) for stride in strides)
    if args.warmup_updates < 0:
        fail("`--warmup-updates` must be an int >= 0, got %d" % args.warmup_updates)
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    if args.bn_momentum is not None and not 0 <= args.bn_momentum < 1:
        fail("`--bn-momentum` must be in [0, 1), got %r" % args.bn_momentum)
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        fail("`--data-dir` %r is not a directory" % args.data_dir)
    for flag in ("json", "save"):
        path = getattr(args, flag)
        if path is not None and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            fail("`--%s` %r: directory %r does not exist" % (flag, path, os.path.dirname(os.path.abspath(path))))
    if not args.no_subdivisions:
        _check_subdivisions(args.batch_size, args.subdivisions)
    shares = _workers.check_shares(args.batch_size, None if args.no_subdivisions else args.subdivisions,
                                   _workers.cluster_size())
    if shares is not None:
        fail(shares)
    elif args.no_subdivisions and args.logdir is not None:
        fail("`--logdir` %r: the summaries come from the accumulator, which --no-subdivisions leaves out"
             % args.logdir)
    if args.epochs is None and args.max_steps is None:
        args.max_steps = DEFAULT_MAX_STEPS
    return args


def _check_subdivisions(batch_size, subdivisions):
    if subdivisions > batch_size:
        fail("`--subdivisions` %d is larger than `--batch-size` %d: each micro-batch needs an example"
             % (subdivisions, batch_size))
    if batch_size % subdivisions:
        lower = batch_size - batch_size % subdivisions
        fail("`--batch-size` %d is not divisible by `--subdivisions` %d: micro-batches must be equal "
             "(try `--batch-size` %d or %d)" % (batch_size, subdivisions, lower, lower + subdivisions))


def fit_batch_to_data(args, num_train, log=print):
    """Shrinks a batch larger than the training set, saying so in one line.

    The batch becomes the largest multiple of the micro-batch count that fits
    (the digits fallback has 1,500 training examples, fewer than 5,000).

    Args:
      args: parsed flags; ``args.batch_size`` is changed in place.
      num_train: the number of training examples.
      log: called with the one-line notice.

    Returns:
      ``args``.

    Example:
      >>> fit_batch_to_data(args, 1500)  # 5000 -> 1500 = 50 x 30
    """
    if args.batch_size <= num_train:
        return args
    parts = 1 if args.no_subdivisions else args.subdivisions
    if parts > num_train:
        fail("`--subdivisions` %d is larger than the %d training examples" % (parts, num_train))
    fitted = num_train - num_train % parts
    log("note: `--batch-size` %d is larger than the %d training examples: using %d (%d micro-batch%s of %d)"
        % (args.batch_size, num_train, fitted, parts, "" if parts == 1 else "es", fitted // parts))
    args.batch_size = fitted
    return args


def prepare(argv=None, log=print):
    """Checks the flags and loads the data, without TensorFlow; bad input exits in one line.

    Args:
      argv: the arguments, without the program name.
      log: called with one-line notices (what data, from where; a fitted batch).

    Returns:
      ``(args, data)``: the flags and an ``idx_data.Dataset``.

    Example:
      >>> args, data = prepare(["--data-dir", "/data/fashion-mnist"])
    """
    args, notices = parse_args(argv), []
    try:
        data = idx_data.load_dataset(args.data_dir, download=not args.offline, log=notices.append)
    except ValueError as exc:
        fail(exc)
    fit_batch_to_data(args, len(data.train_labels), notices.append)
    for notice in notices:  # Only once the input is known good: an error stays one line.
        log(notice)
    return args, data


if __name__ == "__main__":
    # Before TensorFlow's import, which is slow: a mistyped flag or a corrupt
    # file then fails at once, in exactly one line.
    ARGS, DATA = prepare()

with _quiet.native_stderr(VERBOSE):
    import tensorflow as tf  # noqa: E402

    import gradaccum  # noqa: E402
    from gradaccum import cluster, tower  # noqa: E402

    if VERBOSE is False and __name__ == "__main__":
        _quiet.after_import(tf)
    tf.compat.v1.layers.Layer  # Loads tf-keras (TF >= 2.16) now, inside the quiet block.


# ----------------------------------------------------------------- model


def default_bn_stats():
    """Returns ``"window"`` where ``gradaccum.batch_normalization`` exists, else ``"micro"``.

    Returns:
      A string.

    Example:
      >>> default_bn_stats()
      'window'
    """
    return "window" if hasattr(gradaccum, "batch_normalization") else "micro"


def batch_norm_function(bn_stats):
    """Returns the batch-norm layer function ``bn_stats`` names: the one switch of the model.

    Args:
      bn_stats: ``"micro"`` (``tf.compat.v1.layers.batch_normalization``) or
        ``"window"`` (``gradaccum.batch_normalization``).

    Returns:
      A function with ``tf.compat.v1.layers.batch_normalization``'s signature.

    Raises:
      ValueError: for another name, or ``"window"`` without ``gradaccum.batch_normalization``.

    Example:
      >>> batch_norm = batch_norm_function("micro")
    """
    if bn_stats == "micro":
        return tf.compat.v1.layers.batch_normalization
    if bn_stats == "window" and hasattr(gradaccum, "batch_normalization"):
        return gradaccum.batch_normalization
    if bn_stats == "window":
        raise ValueError("`--bn-stats` window needs gradaccum.batch_normalization, which this gradaccum "
                         "%s does not have: use `--bn-stats` micro" % gradaccum.__version__)
    raise ValueError("`bn_stats` must be 'micro' or 'window', got %r" % (bn_stats,))


# TF 2.15 does not list tf_keras (which TF_USE_LEGACY_KERAS=1 selects) as safe
# from autograph, and converting these straight-line layers costs seconds.
@tf.autograph.experimental.do_not_convert
def build_logits(images, is_training, width, batch_norm=None, momentum=BN_MOMENTUM["micro"], head="flatten",
                 strides=STRIDES):
    """Builds the CNN; calling it again reuses the same variables.

    Args:
      images: float32 ``[N, 28, 28, 1]``.
      is_training: Python bool or bool tensor: batch statistics (and moving
        average updates) when True, moving averages when False.
      width: int >= 1, channels of the first block; block i has ``width * i``.
      batch_norm: the batch-norm function (``batch_norm_function``); ``None``
        means ``tf.compat.v1.layers.batch_normalization``.
      momentum: the moving averages' momentum.
      head: ``"flatten"`` (all positions into the dense layer) or ``"mean"``
        (global mean pool first, the seed's).
      strides: one stride per block (five).

    Returns:
      float32 logits ``[N, 10]``.

    Example:
      >>> logits = build_logits(images, is_training=True, width=16)
    """
    batch_norm = batch_norm or tf.compat.v1.layers.batch_normalization
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        net = images
        for block, stride in enumerate(strides, 1):
            net = tf.compat.v1.layers.conv2d(net, width * block, 3, stride, "same", use_bias=False,
                                             name="conv%d" % block)
            net = batch_norm(net, momentum=momentum, epsilon=BN_EPSILON, training=is_training,
                             name="bn%d" % block)
            net = tf.nn.leaky_relu(net, name="leaky_relu%d" % block)
        if head == "mean":
            net = tf.reduce_mean(net, axis=[1, 2], name="global_mean_pool")
        else:
            net = tf.compat.v1.layers.flatten(net, name="flatten")
        return tf.compat.v1.layers.dense(net, 10, name="logits")


def learning_rate_schedule(global_step, peak, warmup_updates=0, total_updates=None):
    """Linear warm-up to ``peak``, then a cosine decay to 0, driven by ``global_step``.

    Update ``s`` (counting from 0) uses ``peak * (s + 1) / warmup_updates``
    while ``s < warmup_updates``, then ``peak * (1 + cos(pi * p)) / 2`` with
    ``p = (s - warmup_updates) / (total_updates - warmup_updates)``, capped at 1.
    Under an accumulator ``global_step`` counts applied updates, so the
    schedule is the same whatever the number of micro-batches.

    Args:
      global_step: the int64 step variable.
      peak: the learning rate after the warm-up.
      warmup_updates: int >= 0.
      total_updates: ``None`` for no decay, else the update at which it reaches 0.

    Returns:
      A scalar float32 tensor.

    Example:
      >>> lr = learning_rate_schedule(tf.compat.v1.train.get_or_create_global_step(), 0.003, 10, 120)
    """
    with tf.compat.v1.name_scope("learning_rate"):
        step = tf.cast(global_step, tf.float32)
        rate = tf.constant(peak, tf.float32)
        if total_updates is not None:
            span = float(max(1, total_updates - warmup_updates))
            progress = tf.clip_by_value((step - warmup_updates) / span, 0.0, 1.0)
            rate = peak * 0.5 * (1.0 + tf.cos(math.pi * progress))
        if warmup_updates > 0:
            rate = tf.compat.v1.where(step < warmup_updates, peak * (step + 1.0) / warmup_updates, rate)
        return tf.identity(rate, name="value")


def learning_rate_at(step, peak, warmup_updates=0, total_updates=None):
    """The value ``learning_rate_schedule`` has at update ``step``, in Python.

    Args:
      step: the update, counting from 0 (``global_step`` before it).
      peak, warmup_updates, total_updates: as for ``learning_rate_schedule``.

    Returns:
      A float.

    Example:
      >>> learning_rate_at(0, 0.003, 10, 120)
      0.0003
    """
    if step < warmup_updates:
        return peak * (step + 1.0) / warmup_updates
    if total_updates is None:
        return peak
    progress = min(1.0, max(0.0, (step - warmup_updates) / float(max(1, total_updates - warmup_updates))))
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def bn_momentum(config):
    """The batch-norm momentum ``config`` uses: its own, else ``BN_MOMENTUM[config.bn_stats]``.

    Args:
      config: a ``TrainingConfig``.

    Returns:
      A float.

    Example:
      >>> bn_momentum(TrainingConfig(16, 0.003, 50, 1, bn_stats="window"))
      0.5
    """
    return BN_MOMENTUM[config.bn_stats] if config.bn_momentum is None else config.bn_momentum


def _mean_loss(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                          name="loss")


def _model_fn(config):
    """Returns ``logits_fn(images, is_training)`` for ``config``."""
    batch_norm, momentum = batch_norm_function(config.bn_stats), bn_momentum(config)

    def logits_fn(images, is_training):
        return build_logits(images, is_training, config.width, batch_norm, momentum, config.head, config.strides)
    return logits_fn


def _towers_train(optimizer, config, images, labels, is_training, global_step):
    """Trains through ``tower.minimize``; returns ``(loss, train_op, logits)``."""
    logits_fn = _model_fn(config)

    def model_fn(shard_images, shard_labels):
        return _mean_loss(shard_labels, logits_fn(shard_images, is_training))

    devices = ["/cpu:%d" % index for index in range(config.towers)]
    result = tower.minimize(optimizer, model_fn, [images, labels], devices=devices,
                            global_step=global_step, update_ops="first")
    # Evaluation runs the whole batch on one device, with the shared variables.
    return result.loss, result.train_op, logits_fn(images, is_training)


def _inputs():
    with tf.compat.v1.name_scope("inputs"):
        images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        is_training = tf.compat.v1.placeholder_with_default(True, [], name="is_training")
    return images, labels, is_training


def build_training(config, optimizer=None, worker=None):
    """Builds the placeholders, the model, and its train op in the default graph.

    Args:
      config: a ``TrainingConfig`` (any object with its attributes).
      optimizer: optional ``tf.compat.v1.train.Optimizer`` to use instead of
        Adam with ``learning_rate_schedule``.
      worker: a ``_workers.WorkerRun`` of a collective job, or None: the
        optimizer is then wrapped in ``cluster.CollectiveAllReduce`` inside
        the accumulator, which runs ``config.subdivisions / worker.size``
        micro-batches per update.

    Returns:
      A ``Training``.

    Example:
      >>> with tf.Graph().as_default():
      ...     training = build_training(TrainingConfig(16, 0.003, subdivisions=50, towers=1))
    """
    images, labels, is_training = _inputs()
    global_step = tf.compat.v1.train.get_or_create_global_step()
    rate = learning_rate_schedule(global_step, config.learning_rate, config.warmup_updates,
                                  config.total_updates)
    optimizer = optimizer or tf.compat.v1.train.AdamOptimizer(rate)
    accumulator, runs = None, config.subdivisions
    if worker is not None:  # Summed over the workers once per update, inside the accumulator.
        optimizer, runs = cluster.CollectiveAllReduce(optimizer, worker.config), runs // worker.size
    if config.subdivisions is not None:
        # statistics=True: the gradient noise scale (issue 16), one extra read of the gradients per run.
        accumulator = gradaccum.GradientAccumulator(optimizer, num_micro_batches=runs, statistics=True)
    if config.towers > 1:
        loss, train_op, logits = _towers_train(accumulator or optimizer, config, images, labels,
                                               is_training, global_step)
    else:
        logits = _model_fn(config)(images, is_training)
        loss = _mean_loss(labels, logits)
        if accumulator is not None:
            # update_ops=None: the batch-norm updates in UPDATE_OPS; micro: every
            # micro-batch, window: pooled and applied once per update.
            train_op = accumulator.minimize(loss, global_step=global_step, weight=tf.shape(images)[0],
                                            update_ops=None)
        else:
            with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
                train_op = optimizer.minimize(loss, global_step=global_step)
    return Training(images, labels, is_training, logits, loss, train_op, global_step, accumulator, rate)


# -------------------------------------------------------------- training


def peak_memory_mb():
    """Returns this process's peak resident memory in MB (``getrusage`` max RSS).

    Returns:
      A float.

    Example:
      >>> peak_memory_mb()
      812.3
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0  # bytes vs KB


def _clock(seconds):
    seconds = int(round(seconds))
    return "%d:%02d" % (seconds // 60, seconds % 60) if seconds < 3600 else "%d:%02d:%02d" % (
        seconds // 3600, seconds // 60 % 60, seconds % 60)


class Progress(object):
    """One progress line on stderr: updates done, loss, examples/s and ETA.

    Nothing is drawn before the first update is done: the rate and the ETA
    are measured from then on (the first update includes TensorFlow's one-off
    graph set-up), so they are never a made-up 0 or NaN. On a terminal the
    line is redrawn in place; in a log file a line is written at most every
    30 s and at the end of each epoch.

    Args:
      total: updates the run will make.
      batch_size: examples per update.
      stream: where to draw (default ``sys.stderr``).

    Example:
      >>> progress = Progress(120, 5000)
      >>> progress.update(2.31)
    """

    def __init__(self, total, batch_size, stream=None):
        self.total, self.batch_size, self.stream = total, batch_size, stream or sys.stderr
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done, self.first, self.drawn = 0, None, 0.0

    def update(self, loss, force=False):
        """Records one more update, whose mean micro-batch loss was ``loss``; may redraw.

        Args:
          loss: the update's mean loss.
          force: redraw even if the last redraw was recent (but never before
            a second update: the first one only starts the clock).
        """
        now, self.done = time.time(), self.done + 1
        done = self.done
        if self.first is None:
            self.first = (done, now)
            return
        if not force and now - self.drawn < REDRAW_SECONDS[self.terminal]:
            return
        self.drawn = now
        per_update = (now - self.first[1]) / max(1, done - self.first[0])
        filled = int(20 * done / max(1, self.total))
        line = "update %d/%d [%s%s] loss %.4f, %.0f examples/s, ETA %s" % (
            done, self.total, "#" * filled, "." * (20 - filled), loss, self.batch_size / per_update,
            _clock(per_update * (self.total - done)))
        self.stream.write(("\r%s\033[K" if self.terminal else "%s\n") % line)
        self.stream.flush()

    def finish(self):
        """Ends the line on a terminal."""
        if self.terminal and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def train_epoch(sess, training, data, micro_batch, updates, parts, rng, progress, after_update=None, share=(0, 1)):
    """Runs ``updates`` updates of ``parts`` micro-batches over a fresh shuffle.

    In a collective job of P workers every worker draws the same shuffle and
    worker r runs micro-batches r, r + P, r + 2P, ... of each update, so that
    the workers together run exactly the micro-batches one process would.

    Args:
      sess: the session.
      training: a ``Training``.
      data: an ``idx_data.Dataset``.
      micro_batch: examples per run of the train op.
      updates: updates to make.
      parts: runs of the train op per update.
      rng: ``np.random.RandomState`` for the shuffle.
      progress: a ``Progress``, told after each update.
      after_update: optional function of ``sess``, called after each update.
      share: ``(rank, workers)``: which of every ``workers`` micro-batches this
        process runs (default all).

    Returns:
      The mean loss of the micro-batches this process ran.

    Example:
      >>> loss = train_epoch(sess, training, data, 100, 12, 50, np.random.RandomState(0), Progress(12, 5000))
    """
    order = rng.permutation(len(data.train_labels))
    losses = []
    for update in range(updates):
        for part in range(share[0], parts, share[1]):
            index = update * parts + part
            chosen = order[index * micro_batch:(index + 1) * micro_batch]
            feed = {training.images: data.train_images[chosen], training.labels: data.train_labels[chosen]}
            losses.append(sess.run([training.train_op, training.loss], feed)[1])
        progress.update(float(np.mean(losses[-(parts // share[1]):])), force=update + 1 == updates)
        if after_update is not None:
            after_update(sess)
    return float(np.mean(losses))


def evaluate(sess, training, images, labels, chunk):
    """Returns the accuracy and mean loss on ``images``, batch norm in inference mode.

    Args:
      sess: the session.
      training: a ``Training``.
      images: float32 ``[N, 28, 28, 1]``.
      labels: int ``[N]``.
      chunk: examples per run.

    Returns:
      ``(accuracy, loss)``: the fraction of correct predictions, the mean cross-entropy.

    Example:
      >>> accuracy, loss = evaluate(sess, training, data.test_images, data.test_labels, 500)
    """
    correct, total_loss = 0, 0.0
    for start in range(0, len(labels), chunk):
        feed = {training.images: images[start:start + chunk], training.labels: labels[start:start + chunk],
                training.is_training: False}
        logits, loss = sess.run([training.logits, training.loss], feed)
        correct += int(np.sum(np.argmax(logits, 1) == labels[start:start + chunk]))
        total_loss += float(loss) * len(logits)
    return correct / float(len(labels)), total_loss / len(labels)


def config_from_args(args, total_updates=None):
    """Returns the ``TrainingConfig`` the flags describe.

    Args:
      args: parsed flags (``args.bn_stats`` None means ``default_bn_stats()``).
      total_updates: where the cosine decay ends (``None``: constant after the warm-up).

    Returns:
      A ``TrainingConfig``.

    Example:
      >>> config_from_args(parse_args([]), total_updates=120)
    """
    subdivisions = None if args.no_subdivisions else args.subdivisions
    return TrainingConfig(args.width, args.learning_rate, subdivisions, args.towers, args.warmup_updates,
                          total_updates, args.bn_stats or default_bn_stats(), args.bn_momentum, args.head,
                          args.strides)


def total_updates(args, per_epoch):
    """Returns the number of updates the run makes (``--max-steps``, ``--epochs``, or both).

    Args:
      args: parsed flags.
      per_epoch: updates per epoch.

    Returns:
      An int.

    Example:
      >>> total_updates(parse_args(["--epochs", "3"]), 12)
      36
    """
    limits = [limit for limit in (args.max_steps, args.epochs and args.epochs * per_epoch) if limit]
    return min(limits)


def _describe_run(args, config, total, per_epoch, workers=1):
    params = sum(int(np.prod(v.shape.as_list())) for v in tf.compat.v1.trainable_variables())
    how = ("plain training, no accumulator" if args.no_subdivisions else
           "%d micro-batches of %d through GradientAccumulator" % (args.subdivisions,
                                                                   args.batch_size // args.subdivisions))
    if workers > 1:
        how += ", %d per worker on %d workers (collective all-reduce once per update)" % (
            args.subdivisions // workers, workers)
    momentum = bn_momentum(config)
    print("model: width %d (channels %d..%d, strides %s, %s head, %.3g M parameters), batch norm %s "
          "statistics (momentum %g), %d tower(s)" % (
              args.width, args.width, 5 * args.width, ",".join(map(str, config.strides)), config.head,
              params / 1e6, config.bn_stats, momentum, args.towers))
    print("batch %d = %s; %d update(s) per epoch; %d updates; Adam, learning rate %g after %d warm-up "
          "update(s), cosine decay to 0" % (args.batch_size, how, per_epoch, total, args.learning_rate,
                                            args.warmup_updates))
    sys.stdout.flush()


def _session(args, worker, broadcast):
    """A session with initialised variables: worker 0's values everywhere in a collective job."""
    if worker is None:
        target, config = "", tf.compat.v1.ConfigProto(device_count={"CPU": args.towers})
    else:
        target, config = worker.server.target, worker.session_config
    with _quiet.native_stderr(VERBOSE or __name__ != "__main__"):
        sess = tf.compat.v1.Session(target, config=config)
        sess.run(tf.compat.v1.global_variables_initializer())
        if broadcast is not None:
            sess.run(broadcast)
    return sess


def _set_up(args):
    """Graph mode and seeds, as the test suite's behaviour says."""
    _cli.graph_mode(tf)
    # Under TF2 behaviour the v1 layers' initialisers come from tf-keras, which
    # ignores the graph seed and draws from Python's random: seed both.
    tf.compat.v1.set_random_seed(args.seed)
    random.seed(args.seed)


def _summary_writer(args, training):
    """With ``--logdir``: a function writing ``gradaccum.summaries`` at the current step, else None."""
    if args.logdir is None or training.accumulator is None:
        return None
    summary_op = gradaccum.summaries(training.accumulator)
    writer = tf.compat.v1.summary.FileWriter(args.logdir, tf.compat.v1.get_default_graph())

    def write(sess):
        summary, step = sess.run([summary_op, training.global_step])
        writer.add_summary(summary, step)
    write.close = writer.close
    return write


def _noise_scale(sess, training):
    """The accumulator's gradient noise scale in examples, or None (no accumulator, no estimate yet)."""
    if training.accumulator is None:
        return None
    value = float(sess.run(training.accumulator.statistics.noise_scale))
    return round(value, 1) if np.isfinite(value) else None


def train(args, data):
    """Trains and evaluates as the flags say, one line per epoch on stdout.

    In a collective job (``TF_CONFIG`` naming several workers) this process
    trains on its own shard and only the chief evaluates and prints.

    Args:
      args: flags from ``prepare``.
      data: an ``idx_data.Dataset``.

    Returns:
      A dict: the history of the run (see ``summary``); ``history["chief"]``
      is False in the other workers of a collective job.

    Example:
      >>> history = train(*prepare(["--max-steps", "2"]))
    """
    _set_up(args)
    with _quiet.native_stderr(VERBOSE or __name__ != "__main__"):
        worker = _workers.start(tf, cluster, args.towers)
    size, rank = (1, 0) if worker is None else (worker.size, worker.rank)
    parts = 1 if args.no_subdivisions else args.subdivisions
    micro_batch, per_epoch = args.batch_size // parts, len(data.train_labels) // args.batch_size
    total = total_updates(args, per_epoch)
    config = config_from_args(args, total)
    with _quiet.native_stderr(VERBOSE or __name__ != "__main__"):
        training = build_training(config, worker=worker)
        write_summaries = _summary_writer(args, training) if rank == 0 else None
        broadcast = None if worker is None else cluster.broadcast_variables(worker.config)
        saver = tf.compat.v1.train.Saver() if args.save and rank == 0 else None
    if rank == 0:
        _describe_run(args, config, total, per_epoch, size)
    heartbeat = None if worker is None else cluster.Heartbeat(worker.server, worker.config)
    with _session(args, worker, broadcast) as sess:
        if heartbeat is not None:
            heartbeat.start()
        history = _epochs(sess, training, data, args, config, (micro_batch, parts, per_epoch, total, (rank, size)),
                          write_summaries)
        if heartbeat is not None:
            heartbeat.stop()
        if saver is not None:
            saver.save(sess, args.save, write_meta_graph=False)
    if write_summaries is not None:
        write_summaries.close()
    history["config"] = config
    return history


def _epochs(sess, training, data, args, config, shape, write_summaries):
    """The training loop of ``train``; ``shape`` is (micro_batch, parts, per_epoch, total, (rank, workers))."""
    micro_batch, parts, per_epoch, total, share = shape
    rank = share[0]
    history = collections.defaultdict(list)
    history["chief"] = rank == 0
    stream = sys.stderr if rank == 0 else open(os.devnull, "w")
    rng, step, begin = np.random.RandomState(args.seed), 0, time.time()  # The same shuffle in every worker.
    progress = Progress(total, args.batch_size, stream)
    while step < total:
        start = time.time()
        loss = train_epoch(sess, training, data, micro_batch, min(per_epoch, total - step), parts, rng, progress,
                           write_summaries, share)
        step = int(sess.run(training.global_step))
        progress.finish()
        if rank == 0:
            _evaluate_epoch(sess, training, data, args, config, history, (loss, step, total, start, begin))
    history["gradient_noise_scale"] = _noise_scale(sess, training)
    history["train_seconds"] = time.time() - begin
    if rank:
        stream.close()
    return history


def _evaluate_epoch(sess, training, data, args, config, history, when):
    """Evaluates on the test set, records the epoch in ``history`` and prints its line."""
    loss, step, total, start, begin = when
    accuracy, test_loss = evaluate(sess, training, data.test_images, data.test_labels, 500)
    rate = learning_rate_at(step - 1, config.learning_rate, config.warmup_updates, total)
    for key, value in (("train_loss", loss), ("test_loss", test_loss), ("test_accuracy", accuracy),
                       ("examples_seen", step * args.batch_size), ("seconds", time.time() - begin)):
        history[key].append(value)
    print("epoch %d: step %d, learning rate %.3g, train loss %.4f, test loss %.4f, test accuracy %.4f, "
          "%.1f s, peak memory %.0f MB" % (len(history["test_accuracy"]), step, rate, loss, test_loss,
                                           accuracy, time.time() - start, peak_memory_mb()))
    sys.stdout.flush()


def summary(args, data, history):
    """Returns the run's summary, what ``--json`` writes.

    Args:
      args: the flags.
      data: the ``idx_data.Dataset``.
      history: what ``train`` returned.

    Returns:
      A dict with ``dataset``, ``source``, ``train_examples``, ``test_examples``,
      ``updates``, ``test_accuracy`` (one per evaluation), ``final_test_accuracy``,
      ``seconds`` (since the script started), ``peak_rss_mb``, and more detail.

    Example:
      >>> json.dumps(summary(args, data, train(args, data)))
    """
    times = os.times()
    return collections.OrderedDict([
        ("dataset", data.name), ("source", data.location),
        ("train_examples", len(data.train_labels)), ("test_examples", len(data.test_labels)),
        ("updates", history["examples_seen"][-1] // args.batch_size),
        ("test_accuracy", history["test_accuracy"]), ("final_test_accuracy", history["test_accuracy"][-1]),
        ("seconds", round(time.time() - START_TIME, 1)), ("peak_rss_mb", round(peak_memory_mb(), 1)),
        ("cpu_seconds", round(times.user + times.system, 1)),
        ("train_seconds", round(history["train_seconds"], 1)),
        ("test_loss", history["test_loss"]), ("train_loss", history["train_loss"]),
        ("examples_seen", history["examples_seen"]),
        ("eval_seconds", [round(value, 1) for value in history["seconds"]]),
        ("batch_size", args.batch_size), ("subdivisions", history["config"].subdivisions),
        ("width", args.width), ("strides", list(args.strides)), ("head", args.head),
        ("learning_rate", args.learning_rate),
        ("warmup_updates", args.warmup_updates), ("bn_stats", history["config"].bn_stats),
        ("bn_momentum", bn_momentum(history["config"])), ("seed", args.seed),
        ("tensorflow", tf.__version__),
        ("gradient_noise_scale", history.get("gradient_noise_scale")),
    ])


def main(args, data):
    """Trains, prints the noise scale and the result (one line each), and writes ``--json``.

    Args:
      args: flags from ``prepare``.
      data: an ``idx_data.Dataset``.

    Example:
      >>> main(*prepare(["--max-steps", "2"]))
    """
    try:
        history = train(args, data)
    except ValueError as exc:  # A flag TensorFlow's side rejects (--bn-stats window without support).
        fail(exc)
    except (cluster.ClusterError, tf.errors.OpError) as exc:  # A collective job's peer failed.
        detail = cluster.describe_op_error(exc) if isinstance(exc, tf.errors.OpError) else exc
        fail("training failed: %s" % detail, status=1)
    if not history["chief"]:
        return
    result = summary(args, data, history)
    noise = result["gradient_noise_scale"]
    print("gradient noise scale: %s, batch used: %d examples" % (
        "n/a (no accumulator)" if history["config"].subdivisions is None else
        "n/a (no estimate yet)" if noise is None else "%.0f examples" % noise, args.batch_size))
    print("done: %d updates in %.1f s (%.1f s training, %.1f s CPU), peak memory %.0f MB, test accuracy %s"
          % (result["updates"], result["seconds"], result["train_seconds"], result["cpu_seconds"],
             result["peak_rss_mb"], ", ".join("%.4f" % value for value in result["test_accuracy"][-2:])))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
            handle.write("\n")


if __name__ == "__main__":
    main(ARGS, DATA)
