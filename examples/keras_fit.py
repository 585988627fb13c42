"""Keras ``Model.fit`` with gradient accumulation: a Fashion-MNIST MLP, batch = k micro-batches.

``model.compile(optimizer=gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(lr), k))``
and ``model.fit(x, y, batch_size=micro)``: Keras runs the train op once per
micro-batch, the accumulator applies once every k of them, so every update is
the update of a batch of ``k * micro`` examples. Keras's ``optimizer.iterations``
is the ``global_step`` the wrapped optimizer increments: it counts updates.
When an epoch's micro-batches are not a multiple of k, the last window of the
epoch carries over into the next one.

This needs Keras 2 in graph mode: ``tf.keras`` on TF 1.15 to 2.15, the
``tf_keras`` package on TF >= 2.16 (Keras 3 takes no TF1 optimizer; it has
its own ``gradient_accumulation_steps`` for eager code). ``--compare`` trains
the same model again with plain Adam on full batches and prints the largest
weight difference (float32 rounding only).

Data: ``idx_data.load_dataset`` (``--data-dir``, the Keras cache,
``/usr/share/datasets/fashion-mnist``, a download unless ``--offline``, else
scikit-learn's digits), announced in one line. Bad flags exit with one line
and status 2. Quiet by default; ``--verbose`` shows TensorFlow's logs.
``GRADACCUM_TF_MODE=tf2`` uses ``disable_eager_execution()`` only instead of
``disable_v2_behavior()``.

Graph state: the Keras model's variables, Keras's ``iterations`` (the
global step), Adam's slots and beta powers, and the accumulator's state
(see ``gradaccum.accumulator``).

Example:
  python examples/keras_fit.py --micro-batch 50 --micro-batches 4 --epochs 1 --train-examples 2000
"""
import random
import sys
import time

import _quiet

VERBOSE = __name__ == "__main__" and "--verbose" in sys.argv[1:]
_quiet.before_import(VERBOSE)

import numpy as np  # noqa: E402

import _cli  # noqa: E402
from _cli import fail  # noqa: E402


def parse_args(argv=None):
    """Parses the flags; bad input exits with one line and status 2.

    Args:
      argv: the arguments, without the program name.

    Returns:
      An ``argparse.Namespace``.

    Example:
      >>> args = parse_args(["--epochs", "1"])
    """
    parser = _cli.small_model_parser(__doc__.splitlines()[0],
                                     "examples per micro-batch: Model.fit's batch_size (default 100)",
                                     "initial weights (default 0)")
    parser.add_argument("--epochs", type=_cli.positive_int("--epochs"), default=2, help="default 2")
    parser.add_argument("--compare", action="store_true",
                        help="also train on full batches with plain Adam and print the weight difference")
    return _cli.parse_checked(parser, argv)



if __name__ == "__main__":
    ARGS, DATA = _cli.prepare(parse_args)

with _quiet.native_stderr(VERBOSE):
    import tensorflow as tf  # noqa: E402

    import gradaccum  # noqa: E402

    if VERBOSE is False and __name__ == "__main__":
        _quiet.after_import(tf)


def keras_module():
    """Returns Keras 2: ``tf.keras`` up to TF 2.15, else ``tf_keras``; exits in one line without it.

    Returns:
      The Keras module.

    Example:
      >>> keras = keras_module()
    """
    keras = tf.keras
    version = getattr(keras, "__version__", "2")
    if not version.startswith("2"):
        fail("Keras %s cannot train with a TF1 optimizer: install tf-keras (`pip install tf-keras`), which "
             "this script then uses (TF_USE_LEGACY_KERAS=1)" % version)
    return keras


def build_model(keras, optimizer, hidden, seed):
    """An MLP 784-hidden-10 compiled with ``optimizer`` and a mean cross-entropy.

    Args:
      keras: the Keras 2 module.
      optimizer: a ``tf.compat.v1.train.Optimizer`` (a ``GradientAccumulator``).
      hidden: hidden units.
      seed: seed of the initial weights.

    Returns:
      The compiled ``keras.Sequential``.

    Example:
      >>> model = build_model(keras, opt, 128, seed=0)
    """
    init = keras.initializers.glorot_uniform
    model = keras.Sequential([
        keras.layers.Flatten(input_shape=(28, 28, 1)),
        keras.layers.Dense(hidden, activation="relu", kernel_initializer=init(seed=seed)),
        keras.layers.Dense(10, kernel_initializer=init(seed=seed + 1)),
    ])
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train(args, data, accumulate=True, log=print):
    """Trains in a fresh graph and session; returns the final weights.

    Args:
      args: the flags.
      data: an ``idx_data.Dataset``.
      accumulate: True: ``GradientAccumulator`` with ``batch_size`` = the
        micro-batch; False: plain Adam with ``batch_size`` = the whole batch.
      log: called with one line per epoch and one at the end.

    Returns:
      The list of weight arrays.

    Example:
      >>> weights = train(parse_args([]), data)
    """
    keras, k = keras_module(), args.micro_batches
    x, y = data.train_images[:args.train_examples], data.train_labels[:args.train_examples]
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        tf.compat.v1.set_random_seed(args.seed)
        optimizer = tf.compat.v1.train.AdamOptimizer(args.learning_rate)
        if accumulate:
            optimizer = gradaccum.GradientAccumulator(optimizer, k)
        model = build_model(keras, optimizer, args.hidden, args.seed)
        batch_size = args.micro_batch if accumulate else args.micro_batch * k
        for epoch in range(args.epochs):
            start = time.time()
            history = model.fit(x, y, batch_size=batch_size, epochs=epoch + 1, initial_epoch=epoch,
                                shuffle=False, verbose=0)
            _, accuracy = model.evaluate(data.test_images, data.test_labels, batch_size=1000, verbose=0)
            log("epoch %d: %d updates so far (Keras iterations), train loss %.4f, test accuracy %.4f, %.1f s"
                % (epoch + 1, sess.run(model.optimizer.iterations), history.history["loss"][-1], accuracy,
                   time.time() - start))
        return model.get_weights()


def main(args, data):
    """Trains with accumulation (and, with ``--compare``, without); returns the exit status.

    Args:
      args: the flags.
      data: an ``idx_data.Dataset``.

    Returns:
      0.

    Example:
      >>> sys.exit(main(*_cli.prepare(parse_args)))
    """
    random.seed(args.seed)  # tf-keras draws initialiser seeds from Python's random under TF2 behaviour
    _cli.graph_mode(tf)
    n, micro, k = len(data.train_labels[:args.train_examples]), args.micro_batch, args.micro_batches
    if args.compare and n % (micro * k):
        fail("`--compare` needs the %d training examples to be a multiple of the batch, `--micro-batch` times "
             "`--micro-batches` (%d), so that plain batches and windows cover the same examples (set "
             "`--train-examples`)" % (n, micro * k))
    per_epoch = -(-n // micro)
    print("Model.fit(batch_size=%d) with GradientAccumulator(Adam %g, %d): each update is a batch of %d; "
          "%d micro-batches per epoch%s" % (micro, args.learning_rate, k, micro * k, per_epoch,
                                            "" if per_epoch % k == 0 else " (not a multiple of %d: the last "
                                            "window of an epoch carries over into the next)" % k))
    weights = train(args, data)
    if args.compare:
        plain = train(args, data, accumulate=False, log=lambda line: None)
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, plain))
        print("plain Adam on batches of %d: largest weight difference %.2g" % (micro * k, difference))
    return 0


if __name__ == "__main__":
    with _quiet.native_stderr(VERBOSE):
        STATUS = main(ARGS, DATA)
    sys.exit(STATUS)
