"""Train a batch-norm CNN on Fashion-MNIST with a batch of 5,000 split into 50 micro-batches.

This is the model of the user seed that asked for "subdivisions" (darknet's
name for it): five conv(3x3, no bias) + batch-norm + leaky-ReLU blocks with
``width * 1 .. width * 5`` channels (strides 2, 2, 1, 1, 1), a global mean
pool and a dense layer of 10, trained with Adam. ``gradaccum.GradientAccumulator``
adds the gradients of 50 micro-batches of 100 and applies their average once:
the update of a 5,000 batch, in about the memory of a 100 batch. The
batch-norm moving averages are updated on every micro-batch.

By default the model has width 16 and the run stops after 60 updates (5
epochs of Fashion-MNIST), about 5 minutes on a 2-core CPU; ``--width 128``
is the seed's model (slow on a CPU). Without Fashion-MNIST on disk or on the
network, the script says so in one line and trains on scikit-learn's digits
instead (see ``idx_data``). Bad input stops the script with one line and exit
status 2, before TensorFlow is even imported. ``GRADACCUM_TF_MODE=tf2`` runs
with resource variables (``disable_eager_execution`` only) instead of
``disable_v2_behavior``.

Reuse: ``build_logits(images, is_training, width)`` and
``build_training(config)`` build the same graph for other scripts.

Graph state: placeholders under ``inputs/``; the model's variables under
``model/`` (``conv1``..``conv5``, ``bn1``..``bn5`` with their moving
averages in ``UPDATE_OPS``, ``logits``), ``global_step``, Adam's slots and
beta powers, and the accumulator's state (see ``gradaccum.accumulator``).
"""
import argparse
import collections
import importlib.util
import os
import random
import resource
import sys
import time
import warnings

# tf.compat.v1.layers needs tf_keras on TF >= 2.16; TF 1.15 to 2.15 have Keras 2 built in,
# and there the variable would break tf.compat.v1.layers if tf_keras is absent.
if importlib.util.find_spec("tf_keras") is not None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

import idx_data  # noqa: E402

SEED_WIDTH = 128  # The seed's channels per block unit.
DEFAULT_WIDTH = 16
DEFAULT_MAX_STEPS = 60  # Updates when neither --epochs nor --max-steps is given.
STRIDES = (2, 2, 1, 1, 1)
BN_MOMENTUM = 0.9  # The seed's (TensorLayer's) decay; 0.99 lags too long for short runs.
BN_EPSILON = 1e-5
REDRAW_SECONDS = {True: 0.5, False: 10.0}  # Progress bar redraws: terminal, log file.

TrainingConfig = collections.namedtuple(
    "TrainingConfig", ["width", "learning_rate", "subdivisions", "towers"])
TrainingConfig.__doc__ = """What ``build_training`` needs.

Attributes:
  width: channels of the first block; block i has ``width * i``.
  learning_rate: Adam's learning rate.
  subdivisions: ``None`` for plain training (one update per run), else the
    number of micro-batches per update, through ``GradientAccumulator``.
  towers: 1, or the number of CPU devices to replicate the model over with
    ``gradaccum.tower.minimize`` (the session needs that many CPU devices).
"""

Training = collections.namedtuple(
    "Training", ["images", "labels", "is_training", "logits", "loss", "train_op",
                 "global_step", "accumulator"])
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
"""


# ---------------------------------------------------------- command line


class _OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, without the usage text."""

    def error(self, message):
        fail(message)


def fail(message):
    """Prints ``message`` as one line on stderr and exits with status 2.

    Args:
      message: the error, naming the flag in backticks.

    Example:
      >>> fail("`--subdivisions` must be an int >= 1, got 0")
    """
    sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]) or "example",
                                          " ".join(str(message).split())))
    sys.exit(2)


def _parser():
    parser = _OneLineParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--batch-size", type=int, default=5000, help="examples per update (default 5000)")
    add("--subdivisions", type=int, default=50, help="micro-batches per update (default 50)")
    add("--no-subdivisions", action="store_true", help="plain training on the whole batch, to compare")
    add("--width", type=int, default=DEFAULT_WIDTH,
        help="channels of the first block (default %d; the seed's is %d)" % (DEFAULT_WIDTH, SEED_WIDTH))
    add("--epochs", type=int, default=None, help="stop after this many epochs (default: no limit)")
    add("--max-steps", type=int, default=None,
        help="stop after this many updates (default %d when --epochs is not given)" % DEFAULT_MAX_STEPS)
    add("--towers", type=int, default=1,
        help="replicate the model over this many (virtual) CPU devices with gradaccum.tower (default 1)")
    add("--data-dir", default=None, help="directory with the four Fashion-MNIST IDX files")
    add("--offline", action="store_true", help="do not try to download Fashion-MNIST")
    add("--learning-rate", type=float, default=0.01, help="Adam's learning rate (default 0.01)")
    add("--seed", type=int, default=0, help="random seed (default 0)")
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
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    if args.data_dir is not None and not os.path.isdir(args.data_dir):
        fail("`--data-dir` %r is not a directory" % args.data_dir)
    if not args.no_subdivisions:
        _check_subdivisions(args.batch_size, args.subdivisions)
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
      log: called with one-line notices (fallback data, a fitted batch).

    Returns:
      ``(args, data)``: the flags and an ``idx_data.Dataset``.

    Example:
      >>> args, data = prepare(["--data-dir", "/data/fashion-mnist"])
    """
    args = parse_args(argv)
    try:
        data = idx_data.load_dataset(args.data_dir, download=not args.offline, log=log)
    except ValueError as exc:
        fail(exc)
    return fit_batch_to_data(args, len(data.train_labels), log), data


if __name__ == "__main__":
    # Before TensorFlow's import, which is slow and logs to stderr: a mistyped
    # flag or a corrupt file then fails at once, in exactly one line.
    ARGS, DATA = prepare()

import tensorflow as tf  # noqa: E402

import gradaccum  # noqa: E402
from gradaccum import tower  # noqa: E402


# ----------------------------------------------------------------- model


# TF 2.15 does not list tf_keras (which TF_USE_LEGACY_KERAS=1 selects) as safe
# from autograph, and converting these straight-line layers costs seconds.
@tf.autograph.experimental.do_not_convert
def build_logits(images, is_training, width):
    """Builds the seed's CNN; calling it again reuses the same variables.

    Args:
      images: float32 ``[N, 28, 28, 1]``.
      is_training: Python bool or bool tensor: batch statistics (and moving
        average updates in ``UPDATE_OPS``) when True, moving averages when False.
      width: int >= 1, channels of the first block; block i has ``width * i``.

    Returns:
      float32 logits ``[N, 10]``.

    Example:
      >>> logits = build_logits(images, is_training=True, width=16)
    """
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        net = images
        for block, stride in enumerate(STRIDES, 1):
            net = tf.compat.v1.layers.conv2d(net, width * block, 3, stride, "same", use_bias=False,
                                             name="conv%d" % block)
            net = tf.compat.v1.layers.batch_normalization(
                net, momentum=BN_MOMENTUM, epsilon=BN_EPSILON, training=is_training, name="bn%d" % block)
            net = tf.nn.leaky_relu(net, name="leaky_relu%d" % block)
        net = tf.reduce_mean(net, axis=[1, 2], name="global_mean_pool")
        return tf.compat.v1.layers.dense(net, 10, name="logits")


def _mean_loss(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits),
                          name="loss")


def _towers_train(optimizer, config, images, labels, is_training, global_step):
    """Trains through ``tower.minimize``; returns ``(loss, train_op, logits)``."""
    def model_fn(shard_images, shard_labels):
        return _mean_loss(shard_labels, build_logits(shard_images, is_training, config.width))

    devices = ["/cpu:%d" % index for index in range(config.towers)]
    result = tower.minimize(optimizer, model_fn, [images, labels], devices=devices,
                            global_step=global_step, update_ops="first")
    # Evaluation runs the whole batch on one device, with the shared variables.
    return result.loss, result.train_op, build_logits(images, is_training, config.width)


def build_training(config, optimizer=None):
    """Builds the placeholders, the model, and its train op in the default graph.

    Args:
      config: a ``TrainingConfig`` (any object with its attributes).
      optimizer: optional ``tf.compat.v1.train.Optimizer`` to use instead of
        ``AdamOptimizer(config.learning_rate)``.

    Returns:
      A ``Training``.

    Example:
      >>> with tf.Graph().as_default():
      ...     training = build_training(TrainingConfig(16, 0.01, subdivisions=50, towers=1))
    """
    with tf.compat.v1.name_scope("inputs"):
        images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        is_training = tf.compat.v1.placeholder_with_default(True, [], name="is_training")
    global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = optimizer or tf.compat.v1.train.AdamOptimizer(config.learning_rate)
    accumulator = None
    if config.subdivisions is not None:
        accumulator = gradaccum.GradientAccumulator(optimizer, num_micro_batches=config.subdivisions)
    if config.towers > 1:
        loss, train_op, logits = _towers_train(accumulator or optimizer, config, images, labels,
                                               is_training, global_step)
    else:
        logits = build_logits(images, is_training, config.width)
        loss = _mean_loss(labels, logits)
        if accumulator is not None:
            # update_ops=None: UPDATE_OPS run on every micro-batch, as plain training would.
            train_op = accumulator.minimize(loss, global_step=global_step, weight=tf.shape(images)[0],
                                            update_ops=None)
        else:
            with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
                train_op = optimizer.minimize(loss, global_step=global_step)
    return Training(images, labels, is_training, logits, loss, train_op, global_step, accumulator)


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


def _progress_bar(epoch, micro_batches):
    import progressbar  # Only the command line needs it.

    widgets = ["epoch %d " % epoch,
               progressbar.SimpleProgress(format="micro-batch %(value_s)s/%(max_value_s)s"), " ",
               progressbar.Bar(), " ", progressbar.Variable("loss", format="loss {value:.4f}"), " ",
               progressbar.Variable("rate", format="{value:.0f} samples/s"), " ", progressbar.ETA()]
    bar = progressbar.ProgressBar(max_value=micro_batches, widgets=widgets,
                                  variables={"loss": float("nan"), "rate": 0.0})
    return bar.start()


def train_epoch(sess, training, data, micro_batch, micro_batches, rng, epoch):
    """Runs ``micro_batches`` micro-batches over a fresh shuffle, with a progress bar.

    Args:
      sess: the session.
      training: a ``Training``.
      data: an ``idx_data.Dataset``.
      micro_batch: examples per run of the train op.
      micro_batches: runs of the train op (whole updates' worth).
      rng: ``np.random.RandomState`` for the shuffle.
      epoch: the epoch's number, for the bar.

    Returns:
      The mean micro-batch loss.

    Example:
      >>> loss = train_epoch(sess, training, data, 100, 600, np.random.RandomState(0), 1)
    """
    order = rng.permutation(len(data.train_labels))
    bar, losses, start, drawn = _progress_bar(epoch, micro_batches), [], time.time(), 0.0
    for index in range(micro_batches):
        chosen = order[index * micro_batch:(index + 1) * micro_batch]
        feed = {training.images: data.train_images[chosen], training.labels: data.train_labels[chosen]}
        losses.append(sess.run([training.train_op, training.loss], feed)[1])
        now = time.time()
        if now - drawn >= REDRAW_SECONDS[bool(bar.is_terminal)] or index + 1 == micro_batches:
            bar.update(index + 1, loss=float(np.mean(losses)), rate=(index + 1) * micro_batch / (now - start))
            drawn = now
    bar.finish()
    return float(np.mean(losses))


def evaluate(sess, training, images, labels, chunk):
    """Returns the accuracy on ``images``, batch norm in inference mode.

    Args:
      sess: the session.
      training: a ``Training``.
      images: float32 ``[N, 28, 28, 1]``.
      labels: int ``[N]``.
      chunk: examples per run.

    Returns:
      The fraction of correct predictions.

    Example:
      >>> evaluate(sess, training, data.test_images, data.test_labels, 100)
    """
    correct = 0
    for start in range(0, len(labels), chunk):
        feed = {training.images: images[start:start + chunk], training.is_training: False}
        correct += int(np.sum(np.argmax(sess.run(training.logits, feed), 1) == labels[start:start + chunk]))
    return correct / float(len(labels))


def config_from_args(args):
    """Returns the ``TrainingConfig`` the flags describe.

    Args:
      args: parsed flags.

    Returns:
      A ``TrainingConfig``.

    Example:
      >>> config_from_args(parse_args([]))
    """
    subdivisions = None if args.no_subdivisions else args.subdivisions
    return TrainingConfig(args.width, args.learning_rate, subdivisions, args.towers)


def _describe_run(args, data, updates_per_epoch):
    params = sum(int(np.prod(v.shape.as_list())) for v in tf.compat.v1.trainable_variables())
    how = ("plain training, no accumulator" if args.no_subdivisions else
           "%d micro-batches of %d through GradientAccumulator" % (args.subdivisions,
                                                                   args.batch_size // args.subdivisions))
    print("data: %s, %d train / %d test examples"
          % (data.source, len(data.train_labels), len(data.test_labels)))
    print("model: width %d (channels %d..%d, %.3g M parameters), Adam %g, %d tower(s)"
          % (args.width, args.width, 5 * args.width, params / 1e6, args.learning_rate, args.towers))
    print("batch %d = %s; %d update(s) per epoch; stop after %s" % (
        args.batch_size, how, updates_per_epoch,
        " or ".join(text for text in (args.epochs and "%d epochs" % args.epochs,
                                      args.max_steps and "%d updates" % args.max_steps) if text)))
    sys.stdout.flush()


def _updates_left(args, epochs_done, step, per_epoch):
    """Updates the next epoch runs: a whole epoch, fewer at the step limit, 0 when done."""
    if args.epochs is not None and epochs_done >= args.epochs:
        return 0
    return per_epoch if args.max_steps is None else max(0, min(per_epoch, args.max_steps - step))


def _session(args):
    config = tf.compat.v1.ConfigProto(device_count={"CPU": args.towers})
    return tf.compat.v1.Session(config=config)


def main(args, data):
    """Trains and evaluates as the flags say, one line per epoch.

    Args:
      args: flags from ``prepare``.
      data: an ``idx_data.Dataset``.

    Example:
      >>> main(*prepare(["--max-steps", "2"]))
    """
    # The v1 layers are used on purpose (graph mode is the point): their
    # deprecation notices would only bury the output.
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    warnings.filterwarnings("ignore", message=r"`tf\.layers\.", category=UserWarning)
    if os.environ.get("GRADACCUM_TF_MODE", "tf1") == "tf2":
        tf.compat.v1.disable_eager_execution()  # The test suite's second behaviour.
    else:
        tf.compat.v1.disable_v2_behavior()
    # Under TF2 behaviour the v1 layers' initialisers come from tf-keras, which
    # ignores the graph seed and draws from Python's random: seed both.
    tf.compat.v1.set_random_seed(args.seed)
    random.seed(args.seed)
    training = build_training(config_from_args(args))
    parts = 1 if args.no_subdivisions else args.subdivisions
    micro_batch, per_epoch = args.batch_size // parts, len(data.train_labels) // args.batch_size
    _describe_run(args, data, per_epoch)
    rng, epoch, step, begin = np.random.RandomState(args.seed), 0, 0, time.time()
    with _session(args) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        while _updates_left(args, epoch, step, per_epoch):
            epoch, start = epoch + 1, time.time()
            updates = _updates_left(args, epoch - 1, step, per_epoch)
            loss = train_epoch(sess, training, data, micro_batch, updates * parts, rng, epoch)
            accuracy = evaluate(sess, training, data.test_images, data.test_labels, micro_batch)
            step = int(sess.run(training.global_step))
            print("epoch %d: step %d, train loss %.4f, test accuracy %.4f, %.1f s, peak memory %.0f MB"
                  % (epoch, step, loss, accuracy, time.time() - start, peak_memory_mb()))
            sys.stdout.flush()
    print("done: %d updates in %.1f s, test accuracy %.4f" % (step, time.time() - begin, accuracy))


if __name__ == "__main__":
    main(ARGS, DATA)
