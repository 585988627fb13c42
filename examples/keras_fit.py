"""Keras Model.fit with gradient accumulation: an MLP on Fashion-MNIST, batch = k micro-batches.

model.compile(optimizer=gradaccum.GradientAccumulator(AdamOptimizer(lr), k)) and
model.fit(x, y, batch_size=micro): Keras runs the train op once per micro-batch, and every k-th
run applies the update of the k * micro examples; optimizer.iterations counts updates. Keras 2
in graph mode: tf.keras on TF 1.15 to 2.15, tf-keras on TF >= 2.16 (Keras 3 takes no TF1 optimizer).
--compare trains again with plain Adam on whole batches and prints the largest weight difference."""
import argparse
import random
import importlib.util
import os
import sys
import time
import warnings

import numpy as np

VERBOSE, saved_stderr = "--verbose" in sys.argv[1:], os.dup(2)
if importlib.util.find_spec("tf_keras"):  # tf.compat.v1.layers on TensorFlow >= 2.16
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
if not VERBOSE:  # TF >= 2.16 prints C++ start-up lines whatever TF_CPP_MIN_LOG_LEVEL says
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    warnings.filterwarnings("ignore")
try:
    import tensorflow as tf
    tf.compat.v1.layers.Layer  # tf-keras loads here, quietly too
finally:
    os.dup2(saved_stderr, 2)
tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO if VERBOSE else tf.compat.v1.logging.ERROR)

import gradaccum  # noqa: E402
import fashion_mnist_data  # noqa: E402


def fail(message):
    sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]), message))
    sys.exit(2)


def positive(flag):
    def parse(text):
        if not text.isdigit() or int(text) < 1:
            raise argparse.ArgumentTypeError("`%s` must be an int >= 1, got %r" % (flag, text))
        return int(text)
    return parse


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = fail  # one line, without the usage block
    add = parser.add_argument
    add("--micro-batch", type=positive("--micro-batch"), default=100, help="Model.fit's batch_size (100)")
    add("--micro-batches", type=positive("--micro-batches"), default=4, help="micro-batches per update (4)")
    add("--epochs", type=positive("--epochs"), default=2, help="passes over the training set (2)")
    add("--train-examples", type=positive("--train-examples"), default=None, help="use only the first N")
    add("--hidden", type=positive("--hidden"), default=128, help="hidden units (128)")
    add("--learning-rate", type=float, default=1e-3, help="Adam's (1e-3)")
    add("--compare", action="store_true", help="train again with plain Adam on whole batches and compare")
    add("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    add("--offline", action="store_true", help="do not try to download Fashion-MNIST")
    add("--seed", type=int, default=0, help="initial weights (0)")
    add("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args()
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    return args


def train(args, x, y, test, accumulate=True, log=print):
    """Trains in a fresh graph and session; returns the final weights."""
    keras, k = tf.keras, args.micro_batches
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        tf.compat.v1.set_random_seed(args.seed)
        optimizer = tf.compat.v1.train.AdamOptimizer(args.learning_rate)
        if accumulate:
            optimizer = gradaccum.GradientAccumulator(optimizer, k)
        init = keras.initializers.glorot_uniform
        model = keras.Sequential([
            keras.layers.Flatten(input_shape=(28, 28, 1)),
            keras.layers.Dense(args.hidden, activation="relu", kernel_initializer=init(seed=args.seed)),
            keras.layers.Dense(10, kernel_initializer=init(seed=args.seed + 1))])
        model.compile(optimizer=optimizer, metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        for epoch in range(args.epochs):
            start = time.time()
            history = model.fit(x, y, batch_size=args.micro_batch * (1 if accumulate else k), epochs=epoch + 1,
                                initial_epoch=epoch, shuffle=False, verbose=0)
            accuracy = model.evaluate(test[0], test[1], batch_size=1000, verbose=0)[1]
            log("epoch %d: %d updates so far (Keras iterations), train loss %.4f, test accuracy %.4f, %.1f s"
                % (epoch + 1, sess.run(model.optimizer.iterations), history.history["loss"][-1], accuracy,
                   time.time() - start))
        return model.get_weights()


def main(args):
    if not getattr(tf.keras, "__version__", "2").startswith("2"):
        fail("Keras %s takes no TF1 optimizer: `pip install tf-keras`" % tf.keras.__version__)
    try:
        data = fashion_mnist_data.load(args.data_dir, download_ok=not args.offline)
    except ValueError as error:
        fail(error)
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    random.seed(args.seed)  # tf-keras's initialisers draw from Python's random
    x, y = data.train_images[:args.train_examples], data.train_labels[:args.train_examples]
    micro, k, test = args.micro_batch, args.micro_batches, (data.test_images, data.test_labels)
    if args.compare and len(y) % (micro * k):
        fail("`--compare` needs the %d training examples to be a multiple of the batch (%d): set "
             "`--train-examples`" % (len(y), micro * k))
    print("Model.fit(batch_size=%d) with GradientAccumulator(Adam %g, %d): each update is a batch of %d"
          % (micro, args.learning_rate, k, micro * k))
    weights = train(args, x, y, test)
    if args.compare:
        plain = train(args, x, y, test, accumulate=False, log=lambda line: None)
        difference = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, plain))
        print("plain Adam on batches of %d: largest weight difference %.2g" % (micro * k, difference))


if __name__ == "__main__":
    main(parse_args())
