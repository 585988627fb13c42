"""The plumbing of ``fashion_mnist_subdivision.py``: flags, data, reporting, JSON, workers.

The example itself keeps the recipe (data, model, ``GradientAccumulator``,
the micro-batch loop, evaluation); everything else it needs is here. The
flag handling and the data loading import no TensorFlow, so that bad input
fails at once, in one line (exit status 2). Functions that need TensorFlow
import it when called: the example has imported it by then, quietly.

Elastic batches (``--batch-schedule``, ``--adaptive-batch``): the batch is
given in examples and must be a multiple of the micro-batch (``--batch-size``
over ``--subdivisions``, 100 by default). ``--batch-schedule`` takes

* ``ramp:START,INCREMENT,EXAMPLES``: the batch starts at ``START`` examples
  and grows by ``INCREMENT`` each time another share of ``EXAMPLES`` has been
  trained on, up to ``--batch-size`` (``gradaccum.batch_ramp``);
* ``step:BATCH[,BATCH@UPDATE...]``: ``BATCH`` examples per update until
  update ``UPDATE``, and so on (``gradaccum.step_schedule``).

``--adaptive-batch`` lets ``gradaccum.AdaptiveBatch`` pick 2 to
``--subdivisions`` micro-batches from the gradient noise scale (a batch of
1.25 times it), scaling Adam's learning rate, tuned for ``--batch-size``, by
the square root of AdaScale's gain.
"""
import argparse
import collections
import math
import os
import random
import resource
import sys
import time

import _cli
import _workers
import idx_data
from _cli import OneLineParser, fail

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
REDRAW_SECONDS = {True: 0.5, False: 30.0}  # Progress redraws: terminal, log file.
# The adaptive mode's policy: a batch of 1.25 times the gradient noise scale, from 2 micro-batches
# up to --subdivisions. On Fashion-MNIST (10 epochs) 1 made 822 updates in the first 4 epochs, on
# course for more than 1,500; 1.5 made 871 but ended at 0.919; 1.25 ended at 0.921 in 959.
ADAPTIVE_FACTOR = 1.25
ADAPTIVE_MIN_MICRO_BATCHES = 2
SCHEDULE_HELP = ("ramp:START,INCREMENT,EXAMPLES (from START examples, INCREMENT more each EXAMPLES/n examples "
                 "trained on, up to --batch-size) or step:BATCH[,BATCH@UPDATE...] (BATCH examples per update "
                 "until update UPDATE, ...); batches are multiples of the micro-batch, e.g. ramp:500,500,300000 "
                 "or step:500,1000@300,5000@600")

TrainingConfig = collections.namedtuple(
    "TrainingConfig", ["width", "learning_rate", "subdivisions", "towers", "warmup_updates", "total_updates",
                       "bn_stats", "bn_momentum", "head", "strides", "base_batch"])
TrainingConfig.__new__.__defaults__ = (0, None, "micro", None, "flatten", STRIDES, None)
TrainingConfig.__doc__ = """What ``build_training`` needs.

Attributes:
  width: channels of the first block; block i has ``width * i``.
  learning_rate: Adam's (peak) learning rate.
  subdivisions: ``None`` for plain training (one update per run), else what
    ``GradientAccumulator`` takes as ``num_micro_batches``: an int, a schedule
    or a ``gradaccum.AdaptiveBatch``.
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
  base_batch: ``None`` (default): the learning rate follows ``global_step``;
    else it follows the examples trained on, in updates of ``base_batch``
    examples (for a batch that changes).
"""

Training = collections.namedtuple(
    "Training", ["images", "labels", "is_training", "logits", "loss", "train_op",
                 "global_step", "accumulator", "learning_rate", "window_size"])
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
  window_size: int64 scalar: the micro-batches of the update in progress (or
    the next), over all workers.
"""


# ---------------------------------------------------------- command line


def _subdivisions(text):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("`--subdivisions` must be an int >= 1 or auto, got %r" % text)


def _parser(description):
    parser = OneLineParser(description=description)
    add = parser.add_argument
    add("--batch-size", type=int, default=5000,
        help="examples per update (default 5000); with --adaptive-batch, the batch the learning rate is tuned for "
             "and the largest; with --batch-schedule, the final batch of a ramp")
    add("--subdivisions", type=_subdivisions, default=50,
        help="micro-batches per update (default 50), or auto: the fewest whose micro-batch runs without running "
             "out of memory (gradaccum.find_micro_batch)")
    add("--no-subdivisions", action="store_true", help="plain training on the whole batch, to compare")
    add("--batch-schedule", default=None, metavar="SPEC", help="a batch that changes by schedule: " + SCHEDULE_HELP)
    add("--adaptive-batch", action="store_true",
        help="the batch follows the gradient noise scale (gradaccum.AdaptiveBatch: 2 to --subdivisions micro-"
             "batches; Adam's learning rate scaled from --batch-size by the square root of AdaScale's gain)")
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
        help="updates of linear warm-up before the cosine decay (default %d); with an elastic batch, in "
             "updates of --batch-size examples" % DEFAULT_WARMUP)
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


def parse_args(argv=None, description="Train a batch-norm CNN on Fashion-MNIST with an accumulated batch."):
    """Parses and checks the flags; bad input exits with one line.

    Args:
      argv: the arguments, without the program name (default ``sys.argv[1:]``).
      description: the ``--help`` text's first line.

    Returns:
      An ``argparse.Namespace``; ``max_steps`` holds the default when needed,
      ``schedule`` the parsed ``--batch-schedule`` (or None).

    Example:
      >>> args = parse_args(["--subdivisions", "10"])
    """
    args = _parser(description).parse_args(argv)
    numbers = ["batch_size", "width", "towers", "epochs", "max_steps"]
    for flag in numbers + ([] if args.subdivisions == "auto" else ["subdivisions"]):
        value = getattr(args, flag)
        if value is not None and value < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), value))
    strides = args.strides.split(",")
    if len(strides) != 5 or any(stride not in ("1", "2") for stride in strides):
        fail("`--strides` must be five strides of 1 or 2, like %s, got %r"
             % (",".join(map(str, STRIDES)), args.strides))
    args.strides = tuple(int(stride) for stride in strides)
    _check_numbers(args)
    _check_elastic(args)
    if not args.no_subdivisions and args.subdivisions != "auto":
        _check_subdivisions(args.batch_size, args.subdivisions)
    args.schedule = None if args.batch_schedule is None else parse_schedule(args.batch_schedule, args)
    if args.subdivisions == "auto" and (args.no_subdivisions or _workers.cluster_size() > 1):
        fail("`--subdivisions` auto does not combine with %s in this example" % (
            "--no-subdivisions" if args.no_subdivisions else "%d workers" % _workers.cluster_size()))
    subdivisions = None if args.no_subdivisions or args.subdivisions == "auto" else args.subdivisions
    shares = _workers.check_shares(args.batch_size, subdivisions, _workers.cluster_size())
    if shares is not None:
        fail(shares)
    elif args.no_subdivisions and args.logdir is not None:
        fail("`--logdir` %r: the summaries come from the accumulator, which --no-subdivisions leaves out"
             % args.logdir)
    args.default_steps = args.epochs is None and args.max_steps is None
    if args.default_steps:
        args.max_steps = DEFAULT_MAX_STEPS
    return args


def _check_numbers(args):
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


def _check_elastic(args):
    """An elastic batch combines with neither another elastic mode, plain training, auto nor workers."""
    elastic = ["--batch-schedule"] * (args.batch_schedule is not None) + ["--adaptive-batch"] * args.adaptive_batch
    if len(elastic) == 2:
        fail("`--batch-schedule` %r and `--adaptive-batch` both set the batch: choose one" % args.batch_schedule)
    for other, clash in (("--no-subdivisions", args.no_subdivisions), ("--subdivisions auto",
                                                                       args.subdivisions == "auto"),
                         ("%d workers" % _workers.cluster_size(), _workers.cluster_size() > 1)):
        if elastic and clash:
            fail("`%s` does not combine with %s in this example" % (elastic[0], other))
    if args.adaptive_batch and args.subdivisions < ADAPTIVE_MIN_MICRO_BATCHES:
        fail("`--subdivisions` %d: --adaptive-batch needs at least %d (the largest batch's micro-batches)"
             % (args.subdivisions, ADAPTIVE_MIN_MICRO_BATCHES))


def elastic(args):
    """True when the batch changes during the run (``--batch-schedule`` or ``--adaptive-batch``).

    Args:
      args: parsed flags.

    Returns:
      A bool.

    Example:
      >>> elastic(parse_args(["--adaptive-batch"]))
      True
    """
    return args.schedule is not None or args.adaptive_batch


def parse_schedule(spec, args):
    """Parses ``--batch-schedule``: ``("ramp", start, increment, examples)`` or ``("step", batches, updates)``.

    Batches are in examples, multiples of the micro-batch ``args.batch_size //
    args.subdivisions``; a ramp ends at ``args.batch_size``. Bad input exits
    with one line naming the flag.

    Args:
      spec: the flag's text.
      args: the other parsed flags.

    Returns:
      A tuple, as above (``updates`` holds the boundaries, one fewer than ``batches``).

    Example:
      >>> parse_schedule("step:500,1000@300", parse_args([]))
      ('step', (500, 1000), (300,))
    """
    micro = args.batch_size // args.subdivisions
    kind, _, body = spec.partition(":")
    try:
        if kind == "ramp":
            start, increment, examples = (int(part) for part in body.split(","))
            parsed, batches = ("ramp", start, increment, examples), [start, increment]
            if min(parsed[1:]) < 1 or (args.batch_size - start) % increment or start > args.batch_size:
                raise ValueError("the ramp must climb from START by whole INCREMENTs to --batch-size %d"
                                 % args.batch_size)
        elif kind == "step":
            parts = [part.split("@") for part in body.split(",")]
            if len(parts[0]) != 1 or any(len(part) != 2 for part in parts[1:]):
                raise ValueError("write BATCH first, then BATCH@UPDATE")
            batches = [int(part[0]) for part in parts]
            updates = [int(part[1]) for part in parts[1:]]
            if any(b <= a for a, b in zip([0] + updates, updates)):
                raise ValueError("the updates must increase from 1")
            parsed = ("step", tuple(batches), tuple(updates))
        else:
            raise ValueError("unknown kind %r" % kind)
    except ValueError as exc:
        fail("`--batch-schedule` %r: %s; expected %s" % (spec, exc, SCHEDULE_HELP.split(";")[0]))
    bad = [batch for batch in batches if batch < 1 or batch % micro]
    if bad:
        fail("`--batch-schedule` %r: batch %d is not a multiple of the micro-batch %d (--batch-size %d / "
             "--subdivisions %d)" % (spec, bad[0], micro, args.batch_size, args.subdivisions))
    return parsed


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
    if getattr(args, "schedule", None) is not None or getattr(args, "adaptive_batch", False):
        fail("`--batch-size` %d is larger than the %d training examples: an elastic batch needs a smaller one"
             % (args.batch_size, num_train))
    parts = 1 if args.no_subdivisions or args.subdivisions == "auto" else args.subdivisions
    if parts > num_train:
        fail("`--subdivisions` %d is larger than the %d training examples" % (parts, num_train))
    fitted = num_train - num_train % parts
    log("note: `--batch-size` %d is larger than the %d training examples: using %d (%d micro-batch%s of %d)"
        % (args.batch_size, num_train, fitted, parts, "" if parts == 1 else "es", fitted // parts))
    args.batch_size = fitted
    return args


def prepare(argv=None, log=print, description=None):
    """Checks the flags and loads the data, without TensorFlow; bad input exits in one line.

    Args:
      argv: the arguments, without the program name.
      log: called with one-line notices (what data, from where; a fitted batch).
      description: the ``--help`` text's first line (default ``parse_args``'s).

    Returns:
      ``(args, data)``: the flags and an ``idx_data.Dataset``.

    Example:
      >>> args, data = prepare(["--data-dir", "/data/fashion-mnist"])
    """
    args, notices = parse_args(argv, *([description] if description else [])), []
    try:
        data = idx_data.load_dataset(args.data_dir, download=not args.offline, log=notices.append)
    except ValueError as exc:
        fail(exc)
    fit_batch_to_data(args, len(data.train_labels), notices.append)
    for notice in notices:  # Only once the input is known good: an error stays one line.
        log(notice)
    return args, data


# ------------------------------------------------ learning rate, batch norm


def learning_rate_schedule(global_step, peak, warmup_updates=0, total_updates=None):
    """Linear warm-up to ``peak``, then a cosine decay to 0, driven by ``global_step``.

    Update ``s`` (counting from 0) uses ``peak * (s + 1) / warmup_updates``
    while ``s < warmup_updates``, then ``peak * (1 + cos(pi * p)) / 2`` with
    ``p = (s - warmup_updates) / (total_updates - warmup_updates)``, capped at 1.
    Under an accumulator ``global_step`` counts applied updates, so the
    schedule is the same whatever the number of micro-batches. ``s`` may be
    a float (examples trained on over a batch, for a batch that changes).

    Args:
      global_step: the int64 step variable (or a float scalar).
      peak: the learning rate after the warm-up.
      warmup_updates: int >= 0.
      total_updates: ``None`` for no decay, else the update at which it reaches 0.

    Returns:
      A scalar float32 tensor.

    Example:
      >>> lr = learning_rate_schedule(tf.compat.v1.train.get_or_create_global_step(), 0.003, 10, 120)
    """
    import tensorflow as tf

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


def default_bn_stats():
    """Returns ``"window"`` where ``gradaccum.batch_normalization`` exists, else ``"micro"``.

    Returns:
      A string.

    Example:
      >>> default_bn_stats()
      'window'
    """
    import gradaccum

    return "window" if hasattr(gradaccum, "batch_normalization") else "micro"


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
    import gradaccum
    import tensorflow as tf

    if bn_stats == "micro":
        return tf.compat.v1.layers.batch_normalization
    if bn_stats == "window" and hasattr(gradaccum, "batch_normalization"):
        return gradaccum.batch_normalization
    if bn_stats == "window":
        raise ValueError("`--bn-stats` window needs gradaccum.batch_normalization, which this gradaccum "
                         "%s does not have: use `--bn-stats` micro" % gradaccum.__version__)
    raise ValueError("`bn_stats` must be 'micro' or 'window', got %r" % (bn_stats,))


# ------------------------------------------------------------ the run's shape


def num_micro_batches(args):
    """What ``GradientAccumulator`` gets as ``num_micro_batches`` for these flags, or None (plain training).

    Args:
      args: parsed flags (``--subdivisions auto`` resolved).

    Returns:
      An int, a ``gradaccum`` schedule, a ``gradaccum.AdaptiveBatch``, or None.

    Example:
      >>> num_micro_batches(parse_args(["--batch-schedule", "step:500,1000@30"]))
    """
    import gradaccum

    micro = args.batch_size // args.subdivisions if not args.no_subdivisions else args.batch_size
    try:
        if args.adaptive_batch:
            return gradaccum.AdaptiveBatch(micro, factor=ADAPTIVE_FACTOR,
                                           min_micro_batches=ADAPTIVE_MIN_MICRO_BATCHES,
                                           max_micro_batches=args.subdivisions, base_batch=args.batch_size)
        if args.schedule is not None and args.schedule[0] == "ramp":
            _, start, increment, examples = args.schedule
            return gradaccum.batch_ramp(start, increment, examples, args.batch_size, micro)
        if args.schedule is not None:
            return gradaccum.step_schedule(list(args.schedule[2]), [b // micro for b in args.schedule[1]])
    except ValueError as exc:
        fail("`--batch-schedule` %r: %s" % (args.batch_schedule, exc))
    return None if args.no_subdivisions else args.subdivisions


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
    return TrainingConfig(args.width, args.learning_rate, num_micro_batches(args), args.towers,
                          args.warmup_updates, total_updates, args.bn_stats or default_bn_stats(),
                          args.bn_momentum, args.head, args.strides, args.batch_size if elastic(args) else None)


def total_updates(args, per_epoch):
    """Returns the number of updates the run makes (``--max-steps``, ``--epochs``, or both).

    With an elastic batch: the run's length in updates of ``--batch-size``
    examples, where the learning rate's decay ends.

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


RunShape = collections.namedtuple("RunShape", ["micro_batch", "runs_per_epoch", "epochs", "updates", "max_updates",
                                               "rank", "workers", "examples"])
RunShape.__doc__ = """How the loop walks the data.

Attributes:
  micro_batch: examples per run of the train op.
  runs_per_epoch: micro-batches per epoch, over all workers (a fixed batch:
    whole updates only, as many as fit).
  epochs: the epochs to run (the last one may stop early at ``max_updates``).
  updates: the updates of a fixed batch (the learning rate's decay ends there).
  max_updates: stop once this many updates are applied (None: at the end of the epochs).
  rank, workers: this process's part of a collective job (0, 1 without one).
  examples: the examples the run trains on (at most).
"""


def run_shape(args, num_train, worker=None):
    """Returns the ``RunShape`` of the flags on ``num_train`` training examples.

    Args:
      args: parsed flags.
      num_train: training examples.
      worker: a ``_workers.WorkerRun`` of a collective job, or None.

    Returns:
      A ``RunShape``.

    Example:
      >>> run_shape(parse_args(["--epochs", "2"]), 60000).runs_per_epoch
      600
    """
    parts = 1 if args.no_subdivisions else args.subdivisions
    micro, per_epoch = args.batch_size // parts, num_train // args.batch_size
    workers = (0, 1) if worker is None else (worker.rank, worker.size)
    total = total_updates(args, per_epoch)
    if not elastic(args):
        return RunShape(micro, per_epoch * parts, -(-total // per_epoch), total, total, workers[0], workers[1],
                        total * args.batch_size)
    # An elastic batch runs whole epochs: the default length (no --epochs, no --max-steps) is
    # DEFAULT_MAX_STEPS updates' worth of --batch-size examples, however many updates that takes.
    epochs = args.epochs or -(-total * args.batch_size // num_train)
    max_updates = None if getattr(args, "default_steps", False) else args.max_steps
    return RunShape(micro, num_train // micro, epochs, total, max_updates, workers[0], workers[1],
                    epochs * (num_train // micro) * micro)


def planned_updates(shape, config):
    """The updates the run will make, when known in advance (a fixed batch, a schedule), else None.

    Args:
      shape: the ``RunShape``.
      config: the ``TrainingConfig``.

    Returns:
      An int, or None (an adaptive batch).

    Example:
      >>> planned_updates(shape, config)
      120
    """
    schedule = config.subdivisions
    if schedule is None or isinstance(schedule, int):
        return shape.max_updates
    if not hasattr(schedule, "boundaries"):
        return None
    runs, updates = 0, 0
    while runs < shape.epochs * shape.runs_per_epoch and updates != shape.max_updates:
        runs += schedule.values[sum(1 for boundary in schedule.boundaries if updates >= boundary)]
        updates += 1
    return updates


# ------------------------------------------------------------- progress


class ProgressBar(object):
    """A ``progressbar2`` bar on stderr: update i/n, loss, examples/s and ETA.

    The bar counts examples (``n`` is ``?`` when the updates are not known in
    advance, as with an adaptive batch). It starts at the first update, so
    that TensorFlow's one-off set-up counts neither in the rate nor in the
    ETA. On a terminal it redraws in place; otherwise it writes a line at most
    every 30 s and at the end of each epoch.

    Args:
      total_examples: examples the run will train on.
      total_updates: its updates, or None when unknown.
      rank: this process's rank in a collective job: only 0 draws.
      stream: where to draw (default ``sys.stderr``).

    Example:
      >>> bar = ProgressBar(600000, 120)
      >>> bar.update(5000, 0.51)
    """

    def __init__(self, total_examples, total_updates=None, rank=0, stream=None):
        import progressbar

        self.stream = stream or (sys.stderr if rank == 0 else open(os.devnull, "w"))
        self.terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.updates, self.first, self.bar = total_examples, 0, None, None
        self.label = progressbar.FormatCustomText(
            "update %(update)s/%(total)s, loss %(loss)s, %(rate)s examples/s",
            dict(update=0, total=total_updates or "?", loss="-", rate="-"))
        self.widgets = [self.label, " ", progressbar.Bar(marker="#", left="[", right="]"), " ",
                        progressbar.ETA(format_not_started="ETA --:--:--", format="ETA %(eta)s",
                                        format_zero="ETA 0:00:00", format_finished="done in %(elapsed)s")]

    def update(self, examples, loss, force=False):
        """Records one more update, after ``examples`` examples in all; may redraw.

        Args:
          examples: the examples trained on so far.
          loss: the update's mean loss.
          force: redraw now (the end of an epoch).
        """
        import progressbar

        now, self.updates = time.time(), self.updates + 1
        rate = "-" if self.first is None else "%.0f" % ((examples - self.first[0]) / max(1e-9, now - self.first[1]))
        self.label.update_mapping(update=self.updates, loss="%.4f" % loss, rate=rate)
        if self.bar is None:  # The first update starts the clock and draws the first line.
            self.first = (examples, now)
            self.bar = progressbar.ProgressBar(  # From 0 if one update is the whole run (no empty range).
                min_value=examples if examples < self.total else 0, max_value=max(examples, self.total),
                fd=self.stream, widgets=self.widgets,
                is_terminal=self.terminal, line_breaks=not self.terminal, redirect_stdout=False,
                min_poll_interval=REDRAW_SECONDS[self.terminal]).start()
        self.bar.update(max(self.bar.min_value, min(examples, self.bar.max_value)), force=force)

    def redraw(self):
        """Draws the bar now (the end of an epoch), once it has started."""
        if self.bar is not None:
            self.bar.update(self.bar.value, force=True)

    def finish(self):
        """Ends the bar's line on a terminal."""
        if self.bar is not None:
            self.bar.finish(dirty=True)


# ------------------------------------------------------------- reporting


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


def describe_batch(args, workers=1):
    """The run's batch in words, for the second line of the output.

    Args:
      args: parsed flags.
      workers: the workers of a collective job.

    Returns:
      A string.

    Example:
      >>> describe_batch(parse_args([]))
      'batch 5000 = 50 micro-batches of 100 through GradientAccumulator'
    """
    parts = 1 if args.no_subdivisions else args.subdivisions
    micro = args.batch_size // parts
    if args.adaptive_batch:
        return ("batch from the gradient noise scale (gradaccum.AdaptiveBatch, factor %g) = %d..%d micro-batches "
                "of %d through GradientAccumulator, learning rate scaled from batch %d by the square root of "
                "AdaScale's gain" % (ADAPTIVE_FACTOR, ADAPTIVE_MIN_MICRO_BATCHES, parts, micro, args.batch_size))
    if args.schedule is not None:
        return "batch by schedule %s = micro-batches of %d through GradientAccumulator, learning rate by " \
               "examples (updates of %d)" % (args.batch_schedule, micro, args.batch_size)
    how = ("plain training, no accumulator" if args.no_subdivisions else
           "%d micro-batches of %d through GradientAccumulator" % (parts, micro))
    if workers > 1:
        how += ", %d per worker on %d workers (collective all-reduce once per update)" % (parts // workers, workers)
    return "batch %d = %s" % (args.batch_size, how)


def describe_run(args, config, shape, params):
    """Prints the model's and the batch's lines.

    Args:
      args: parsed flags.
      config: the ``TrainingConfig``.
      shape: the ``RunShape``.
      params: the model's trainable parameters.

    Example:
      >>> describe_run(args, config, shape, 145000)
    """
    print("model: width %d (channels %d..%d, strides %s, %s head, %.3g M parameters), batch norm %s "
          "statistics (momentum %g), %d tower(s)" % (
              args.width, args.width, 5 * args.width, ",".join(map(str, config.strides)), config.head,
              params / 1e6, config.bn_stats, bn_momentum(config), args.towers))
    per_epoch = shape.runs_per_epoch * shape.micro_batch // args.batch_size
    length = ("%d update(s) per epoch; %d updates" % (per_epoch, shape.updates) if not elastic(args) else
              "%d epoch(s)%s" % (shape.epochs, "" if shape.max_updates is None else
                                 ", at most %d updates" % shape.max_updates))
    print("%s; %s; Adam, learning rate %g after %d warm-up update(s), cosine decay to 0"
          % (describe_batch(args, shape.workers), length, args.learning_rate, args.warmup_updates))
    sys.stdout.flush()


def new_history(args, config, shape, start_time):
    """The run's history, to fill epoch by epoch; the chief prints the model's and the batch's lines.

    Args:
      args: parsed flags.
      config: the ``TrainingConfig``.
      shape: the ``RunShape``.
      start_time: when the script started (``time.time()``).

    Returns:
      A ``defaultdict(list)`` with ``chief``, ``config`` and the run's constants.

    Example:
      >>> history = new_history(args, config, shape, time.time())
    """
    import numpy as np
    import tensorflow as tf

    chief = shape.rank == 0
    if chief:
        describe_run(args, config, shape, sum(int(np.prod(v.shape.as_list()))
                                              for v in tf.compat.v1.trainable_variables()))
    return collections.defaultdict(list, chief=chief, config=config, start_time=start_time,
                                   micro_batch=shape.micro_batch,
                                   policy=repr(config.subdivisions) if args.adaptive_batch else None)


class Window(object):
    """What the micro-batch loop counts: the window in progress, the updates and examples so far.

    Attributes:
      left: micro-batches still to run in the window in progress (0: none in progress).
      size: micro-batches of that window, over all workers.
      losses: this process's micro-batch losses in that window.
      updates, examples: updates applied and the examples they trained on.
      epoch: ``(time, updates, examples)`` when the epoch started.

    Example:
      >>> window = Window()
      >>> window.start(5)
    """

    def __init__(self):
        self.left, self.size, self.updates, self.examples, self.losses = 0, 0, 0, 0, []
        self.begin = time.time()
        self.new_epoch()

    def new_epoch(self):
        """Marks the start of an epoch."""
        self.epoch = (time.time(), self.updates, self.examples)

    def start(self, size):
        """Starts a window of ``size`` micro-batches."""
        self.size = self.left = size

    def applied(self, micro_batch):
        """Counts the window as applied (all of it, or what ran of it); returns its mean loss.

        Args:
          micro_batch: examples per micro-batch.

        Returns:
          The mean loss of this process's micro-batches in the window.
        """
        self.updates, self.examples = self.updates + 1, self.examples + (self.size - self.left) * micro_batch
        loss, self.left, self.losses = sum(self.losses) / max(1, len(self.losses)), 0, []
        return float(loss)


def end_history(history, sess, training, window):
    """Adds the run's updates, training time and gradient noise scale to ``history``.

    Args:
      history: from ``new_history``.
      sess: the session.
      training: the example's ``Training``.
      window: the loop's ``Window``.

    Example:
      >>> end_history(history, sess, training, window)
    """
    history.update(updates=window.updates, train_seconds=time.time() - window.begin,
                   gradient_noise_scale=noise_scale(sess, training))


def record_epoch(sess, training, args, shape, history, window, train_loss, evaluation):
    """Records an evaluated epoch in ``history`` and prints its line.

    Args:
      sess: the session.
      training: the example's ``Training``.
      args: parsed flags.
      shape: the ``RunShape``.
      history: from ``new_history``.
      window: the loop's ``Window``.
      train_loss: the epoch's mean micro-batch loss.
      evaluation: ``(test accuracy, test loss)``.

    Example:
      >>> record_epoch(sess, training, args, shape, history, window, 0.4, (0.88, 0.33))
    """
    step = int(sess.run(training.global_step))
    rate = (float(sess.run(training.learning_rate)) if elastic(args) else  # The next update's.
            learning_rate_at(step - 1, args.learning_rate, args.warmup_updates, shape.updates))  # The last one's.
    updates, examples = window.updates - window.epoch[1], window.examples - window.epoch[2]
    values = dict(train_loss=train_loss, test_loss=evaluation[1], test_accuracy=evaluation[0],
                  examples_seen=window.examples, batch_per_epoch=int(round(examples / float(max(1, updates)))),
                  updates_per_epoch=updates, learning_rate=rate, seconds=time.time() - window.begin)
    for key, value in values.items():
        history[key].append(value)
    line = ("epoch %d: step %d, learning rate %.3g, train loss %.4f, test loss %.4f, test accuracy %.4f, %.1f s, "
            "peak memory %.0f MB" % (len(history["test_accuracy"]), step, rate, train_loss, evaluation[1],
                                     evaluation[0], time.time() - window.epoch[0], peak_memory_mb()))
    if elastic(args):
        line += ", batch %d (%d updates)" % (values["batch_per_epoch"], updates)
    print(line)
    sys.stdout.flush()


def summary(args, data, history):
    """Returns the run's summary, what ``--json`` writes.

    Args:
      args: the flags.
      data: the ``idx_data.Dataset``.
      history: what the example's ``train`` returned.

    Returns:
      A dict with ``dataset``, ``source``, ``train_examples``, ``test_examples``,
      ``updates``, ``test_accuracy`` (one per evaluation), ``final_test_accuracy``,
      ``seconds`` (since the script started), ``peak_rss_mb``, ``batch_per_epoch``
      (mean examples per update), ``updates_per_epoch`` and more detail.

    Example:
      >>> json.dumps(summary(args, data, train(args, data)))
    """
    import tensorflow as tf

    times, config = os.times(), history["config"]
    subdivisions = config.subdivisions if isinstance(config.subdivisions, int) else None
    return collections.OrderedDict([
        ("dataset", data.name), ("source", data.location),
        ("train_examples", len(data.train_labels)), ("test_examples", len(data.test_labels)),
        ("updates", history["updates"]),
        ("test_accuracy", history["test_accuracy"]), ("final_test_accuracy", history["test_accuracy"][-1]),
        ("seconds", round(time.time() - history["start_time"], 1)), ("peak_rss_mb", round(peak_memory_mb(), 1)),
        ("cpu_seconds", round(times.user + times.system, 1)),
        ("train_seconds", round(history["train_seconds"], 1)),
        ("test_loss", history["test_loss"]), ("train_loss", history["train_loss"]),
        ("examples_seen", history["examples_seen"]),
        ("eval_seconds", [round(value, 1) for value in history["seconds"]]),
        ("batch_size", args.batch_size), ("subdivisions", subdivisions),
        ("width", args.width), ("strides", list(args.strides)), ("head", args.head),
        ("learning_rate", args.learning_rate),
        ("warmup_updates", args.warmup_updates), ("bn_stats", config.bn_stats),
        ("bn_momentum", bn_momentum(config)), ("seed", args.seed),
        ("tensorflow", tf.__version__),
        ("gradient_noise_scale", history.get("gradient_noise_scale")),
        ("batch_per_epoch", history["batch_per_epoch"]), ("updates_per_epoch", history["updates_per_epoch"]),
        ("micro_batch_size", history["micro_batch"]),
        ("batch_schedule", args.batch_schedule), ("adaptive_batch", history.get("policy")),
        ("learning_rate_per_epoch", history["learning_rate"]),
    ])


def report(args, data, history):
    """Prints the noise-scale and ``done`` lines and writes ``--json``.

    Args:
      args: the flags.
      data: the ``idx_data.Dataset``.
      history: what the example's ``train`` returned.

    Example:
      >>> report(args, data, history)
    """
    import json

    result = summary(args, data, history)
    noise = result["gradient_noise_scale"]
    if elastic(args):
        print("batch per epoch: %s examples (mean per update); %d updates"
              % (", ".join("%d" % batch for batch in result["batch_per_epoch"]), result["updates"]))
    print("gradient noise scale: %s, batch used: %d examples" % (
        "n/a (no accumulator)" if history["config"].subdivisions is None else
        "n/a (no estimate yet)" if noise is None else "%.0f examples" % noise,
        result["batch_per_epoch"][-1] if elastic(args) else args.batch_size))
    print("done: %d updates in %.1f s (%.1f s training, %.1f s CPU), peak memory %.0f MB, test accuracy %s"
          % (result["updates"], result["seconds"], result["train_seconds"], result["cpu_seconds"],
             result["peak_rss_mb"], ", ".join("%.4f" % value for value in result["test_accuracy"][-2:])))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
            handle.write("\n")


def run_and_report(train, args, data):
    """Runs ``train(args, data)``, then ``report``; a failure is one line (status 2 for bad input, else 1).

    Args:
      train: the example's ``train``.
      args: flags from ``prepare``.
      data: an ``idx_data.Dataset``.

    Example:
      >>> run_and_report(train, args, data)
    """
    import tensorflow as tf
    from gradaccum import cluster

    try:
        history = train(args, data)
    except ValueError as exc:  # A flag TensorFlow's side rejects (--bn-stats window without support).
        fail(exc)
    except (cluster.ClusterError, tf.errors.OpError) as exc:  # A collective job's peer failed.
        fail("training failed: %s" % (cluster.describe_op_error(exc) if isinstance(exc, tf.errors.OpError)
                                      else exc), status=1)
    if history["chief"]:
        report(args, data, history)


# ------------------------------------------------------------ TensorFlow plumbing


def set_up(args):
    """Graph mode and seeds, as the test suite's behaviour says.

    Args:
      args: parsed flags.

    Example:
      >>> set_up(args)
    """
    import tensorflow as tf

    _cli.graph_mode(tf)
    # Under TF2 behaviour the v1 layers' initialisers come from tf-keras, which
    # ignores the graph seed and draws from Python's random: seed both.
    tf.compat.v1.set_random_seed(args.seed)
    random.seed(args.seed)


def start_worker(args, quiet):
    """Starts this process's part of a collective job (``TF_CONFIG``), or returns None.

    Args:
      args: parsed flags.
      quiet: a context manager keeping TensorFlow's native noise out.

    Returns:
      A ``_workers.WorkerRun`` or None.

    Example:
      >>> worker = start_worker(args, _quiet.native_stderr())
    """
    import tensorflow as tf
    from gradaccum import cluster

    with quiet:
        return _workers.start(tf, cluster, args.towers)


def session(args, worker, quiet):
    """A session with initialised variables: worker 0's values everywhere in a collective job.

    Args:
      args: parsed flags.
      worker: a ``_workers.WorkerRun`` or None.
      quiet: a context manager keeping TensorFlow's native noise out.

    Returns:
      A ``tf.compat.v1.Session``.

    Example:
      >>> with session(args, None, quiet) as sess: ...
    """
    import tensorflow as tf
    from gradaccum import cluster

    if worker is None:
        target, config = "", tf.compat.v1.ConfigProto(device_count={"CPU": args.towers})
    else:
        target, config = worker.server.target, worker.session_config
    with quiet:
        broadcast = None if worker is None else cluster.broadcast_variables(worker.config)
        sess = tf.compat.v1.Session(target, config=config)
        sess.run(tf.compat.v1.global_variables_initializer())
        if broadcast is not None:
            sess.run(broadcast)
    return sess


class RunServices(object):
    """What a run does besides training: TensorBoard summaries, the heartbeat, ``--save``.

    Args:
      args: parsed flags.
      training: the example's ``Training``.
      worker: a ``_workers.WorkerRun`` or None.

    Example:
      >>> services = RunServices(args, training, worker)
      >>> services.after_update(sess)
    """

    def __init__(self, args, training, worker):
        import gradaccum
        import tensorflow as tf
        from gradaccum import cluster

        chief = worker is None or worker.rank == 0
        self.writer = self.summary_op = None
        if args.logdir is not None and training.accumulator is not None and chief:
            self.summary_op = gradaccum.summaries(training.accumulator)
            self.writer = tf.compat.v1.summary.FileWriter(args.logdir, tf.compat.v1.get_default_graph())
        self.saver = tf.compat.v1.train.Saver() if args.save and chief else None
        self.heartbeat = None if worker is None else cluster.Heartbeat(worker.server, worker.config)
        self.training, self.save_path = training, args.save

    def start(self):
        """Starts the heartbeat of a collective job."""
        if self.heartbeat is not None:
            self.heartbeat.start()

    def after_update(self, sess):
        """Writes the summaries at the current step (``--logdir``)."""
        if self.writer is not None:
            summary, step = sess.run([self.summary_op, self.training.global_step])
            self.writer.add_summary(summary, step)

    def finish(self, sess):
        """Stops the heartbeat, saves (``--save``), closes the summaries."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.saver is not None:
            self.saver.save(sess, self.save_path, write_meta_graph=False)
        if self.writer is not None:
            self.writer.close()


def noise_scale(sess, training):
    """The accumulator's gradient noise scale in examples, or None (no accumulator, no estimate yet).

    Args:
      sess: the session.
      training: the example's ``Training``.

    Returns:
      A float or None.

    Example:
      >>> noise_scale(sess, training)
      461.2
    """
    if training.accumulator is None or isinstance(training.accumulator.num_micro_batches, int) and \
            training.accumulator.num_micro_batches == 1:
        return None
    value = float(sess.run(training.accumulator.statistics.noise_scale))
    return round(value, 1) if math.isfinite(value) else None


def find_subdivisions(args, data, build_training, quiet, log=print):
    """Resolves ``--subdivisions auto``: the fewest micro-batches of ``--batch-size`` that fit in memory.

    Builds the model in a graph of its own and lets ``gradaccum.find_micro_batch``
    run one accumulate step at growing micro-batch sizes; ``args.subdivisions``
    (and ``args.batch_size``, rounded up to equal micro-batches) are set in place.

    Args:
      args: parsed flags.
      data: the ``idx_data.Dataset``.
      build_training: the example's ``build_training``.
      quiet: a context manager keeping TensorFlow's native noise out.
      log: called with the one-line result.

    Example:
      >>> find_subdivisions(args, data, build_training, quiet)
    """
    import gradaccum
    import tensorflow as tf

    with tf.Graph().as_default(), quiet:
        training = build_training(config_from_args(args_with(args, subdivisions=2)))
        with tf.compat.v1.Session(config=tf.compat.v1.ConfigProto(device_count={"CPU": args.towers})) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())

            def run_step(size):
                chosen = slice(0, size)
                sess.run(training.accumulator.accumulate_op, {training.images: data.train_images[chosen],
                                                              training.labels: data.train_labels[chosen]})
            choice = gradaccum.find_micro_batch(run_step, args.batch_size, session=sess)
    target, args.subdivisions = args.batch_size, choice.num_micro_batches
    args.batch_size = choice.num_micro_batches * choice.micro_batch_size
    log("subdivisions auto: %d micro-batch(es) of %d for a batch of %d (largest micro-batch that ran: %d%s)"
        % (args.subdivisions, choice.micro_batch_size, target, choice.largest_that_ran,
           "" if choice.smallest_that_failed is None else ", smallest that ran out of memory: %d"
           % choice.smallest_that_failed))
    if args.batch_size > len(data.train_labels):
        fail("`--subdivisions` auto: a batch of %d is larger than the %d training examples"
             % (args.batch_size, len(data.train_labels)))


def args_with(args, **changes):
    """A copy of the flags with ``changes``.

    Args:
      args: an ``argparse.Namespace``.
      **changes: attributes to replace.

    Returns:
      A new namespace.

    Example:
      >>> args_with(args, subdivisions=2).subdivisions
      2
    """
    copy = type(args)(**vars(args))
    for key, value in changes.items():
        setattr(copy, key, value)
    return copy
