"""A ``tf.estimator.Estimator`` whose ``model_fn`` trains through a GradientAccumulator.

The ``model_fn`` builds a Fashion-MNIST MLP and
``GradientAccumulator(AdamOptimizer(lr), k).minimize(loss, global_step, weight=batch size)``;
the ``input_fn`` yields micro-batches. ``Estimator.train(max_steps=N)`` then
stops after N applied updates (N * k micro-batches), because ``global_step``
counts updates; checkpoints hold the accumulator's state, so a ``train`` call
that ends in the middle of a window is resumed exactly by the next one; and
``evaluate`` restores the checkpoint as usual.

``tf.estimator`` exists up to TensorFlow 2.15: on newer TensorFlow this
script prints one line saying so and exits with status 2.

Data: ``idx_data.load_dataset`` (``--data-dir``, the Keras cache,
``/usr/share/datasets/fashion-mnist``, a download unless ``--offline``, else
scikit-learn's digits), announced in one line. Bad flags exit with one line
and status 2. Quiet by default; ``--verbose`` shows TensorFlow's logs.
``GRADACCUM_TF_MODE=tf2`` uses ``disable_eager_execution()`` only instead of
``disable_v2_behavior()``.

Graph state (in the Estimator's graph and checkpoints): the MLP's variables
under ``mlp/``, ``global_step``, Adam's slots and beta powers, and the
accumulator's state (see ``gradaccum.accumulator``).

Example:
  python examples/estimator.py --micro-batch 50 --micro-batches 4 --max-steps 20 --train-examples 2000
"""
import shutil
import sys
import tempfile
import time

import _quiet

VERBOSE = __name__ == "__main__" and "--verbose" in sys.argv[1:]
_quiet.before_import(VERBOSE)

import _cli  # noqa: E402
from _cli import fail  # noqa: E402

NEEDS = "needs tf.estimator, which exists only up to TensorFlow 2.15"


def parse_args(argv=None):
    """Parses the flags; bad input exits with one line and status 2.

    Args:
      argv: the arguments, without the program name.

    Returns:
      An ``argparse.Namespace``.

    Example:
      >>> args = parse_args(["--max-steps", "20"])
    """
    parser = _cli.small_model_parser(__doc__.splitlines()[0], "examples per micro-batch (default 100)",
                                     "graph seed (default 0)")
    parser.add_argument("--max-steps", type=_cli.positive_int("--max-steps"), default=300,
                        help="applied updates to train: Estimator.train(max_steps=...) (default 300)")
    parser.add_argument("--model-dir", default=None,
                        help="checkpoint directory (default: a temporary one, removed at the end)")
    return _cli.parse_checked(parser, argv)



with _quiet.native_stderr(VERBOSE):
    import tensorflow as tf  # noqa: E402

    import gradaccum  # noqa: E402

    if VERBOSE is False and __name__ == "__main__":
        _quiet.after_import(tf)

TF_VERSION = tuple(int(part) for part in tf.__version__.split(".")[:2])


def make_model_fn(args):
    """Returns the ``model_fn``: an MLP, a mean cross-entropy, and the accumulator in TRAIN mode.

    Args:
      args: the flags (``hidden``, ``learning_rate``, ``micro_batches``).

    Returns:
      A ``model_fn(features, labels, mode)`` for ``tf.estimator.Estimator``.

    Example:
      >>> estimator = tf.estimator.Estimator(make_model_fn(args), model_dir)
    """
    def model_fn(features, labels, mode):
        with tf.compat.v1.variable_scope("mlp"):
            hidden = tf.compat.v1.layers.dense(tf.reshape(features, [-1, 28 * 28]), args.hidden, tf.nn.relu)
            logits = tf.compat.v1.layers.dense(hidden, 10)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)  # mean over the batch
        if mode == tf.estimator.ModeKeys.EVAL:
            accuracy = tf.compat.v1.metrics.accuracy(labels, tf.argmax(logits, 1))
            return tf.estimator.EstimatorSpec(mode, loss=loss, eval_metric_ops={"accuracy": accuracy})
        opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(args.learning_rate),
                                            args.micro_batches)
        train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_global_step(),
                                weight=tf.shape(labels)[0])  # exact also for a smaller last micro-batch
        return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    return model_fn


def input_fn(images, labels, batch, repeat):
    """Returns an ``input_fn`` over numpy arrays, in batches of ``batch``.

    Args:
      images: float32 ``[N, 28, 28, 1]``.
      labels: int32 ``[N]``.
      batch: examples per batch (the micro-batch when training).
      repeat: cycle forever, shuffled with a fixed seed (training), or once in order.

    Returns:
      A function returning a ``tf.data.Dataset`` of ``(images, labels)``.

    Example:
      >>> estimator.train(input_fn(x, y, 100, repeat=True), max_steps=10)
    """
    def make():
        data = tf.compat.v1.data.Dataset.from_tensor_slices((images, labels))
        if repeat:
            data = data.shuffle(len(labels), seed=0).repeat()
        return data.batch(batch)

    return make


def main(args, data):
    """Trains ``--max-steps`` updates, evaluates, prints three lines; returns the exit status.

    Args:
      args: the flags.
      data: an ``idx_data.Dataset``.

    Returns:
      0.

    Example:
      >>> sys.exit(main(*_cli.prepare(parse_args)))
    """
    _cli.graph_mode(tf)
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="gradaccum_estimator_")
    try:
        config = tf.estimator.RunConfig(model_dir=model_dir, tf_random_seed=args.seed,
                                        log_step_count_steps=None if not args.verbose else 100)
        estimator = tf.estimator.Estimator(make_model_fn(args), config=config)
        x, y = data.train_images[:args.train_examples], data.train_labels[:args.train_examples]
        k, micro = args.micro_batches, args.micro_batch
        print("Estimator.train(max_steps=%d) with GradientAccumulator(Adam %g, %d) on micro-batches of %d: "
              "each update is a batch of %d" % (args.max_steps, args.learning_rate, k, micro, micro * k))
        start = time.time()
        estimator.train(input_fn(x, y, micro, repeat=True), max_steps=args.max_steps)
        metrics = estimator.evaluate(input_fn(data.test_images, data.test_labels, 1000, repeat=False))
        print("global_step %d (updates; %d micro-batches), test loss %.4f, test accuracy %.4f, %.1f s"
              % (metrics["global_step"], metrics["global_step"] * k, metrics["loss"], metrics["accuracy"],
                 time.time() - start))
    finally:
        if args.model_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    if TF_VERSION >= (2, 16) or getattr(tf, "estimator", None) is None:
        fail("%s (this is TensorFlow %s); use examples/keras_fit.py or a session loop" % (NEEDS, tf.__version__))
    ARGS, DATA = _cli.prepare(parse_args)
    with _quiet.native_stderr(VERBOSE):
        STATUS = main(ARGS, DATA)
    sys.exit(STATUS)
