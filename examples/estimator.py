"""A tf.estimator.Estimator whose model_fn trains through a GradientAccumulator (TF 1.15 to 2.15).

The input_fn yields micro-batches. Estimator.train(max_steps=N) stops after N applied updates
(N * k micro-batches): global_step counts updates. Checkpoints hold the accumulator's state, so a
train call that ends inside a window is resumed exactly by the next one."""
import argparse
import shutil
import tempfile
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
    add("--micro-batch", type=positive("--micro-batch"), default=100, help="examples per micro-batch (100)")
    add("--micro-batches", type=positive("--micro-batches"), default=4, help="micro-batches per update (4)")
    add("--max-steps", type=positive("--max-steps"), default=300, help="updates: train(max_steps=) (300)")
    add("--model-dir", help="checkpoint directory (default: a temporary one, removed at the end)")
    add("--train-examples", type=positive("--train-examples"), default=None, help="use only the first N")
    add("--hidden", type=positive("--hidden"), default=128, help="hidden units (128)")
    add("--learning-rate", type=float, default=1e-3, help="Adam's (1e-3)")
    add("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    add("--offline", action="store_true", help="do not try to download Fashion-MNIST")
    add("--seed", type=int, default=0, help="graph seed (0)")
    add("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args()
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    return args


def make_model_fn(args):
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
    data = tf.compat.v1.data.Dataset.from_tensor_slices
    return lambda: (data((images, labels)).shuffle(len(labels), seed=0).repeat() if repeat
                    else data((images, labels))).batch(batch)


def main(args):
    try:
        data = fashion_mnist_data.load(args.data_dir, download_ok=not args.offline)
    except ValueError as error:
        fail(error)
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    model_dir = args.model_dir or tempfile.mkdtemp(prefix="gradaccum_estimator_")
    try:
        config = tf.estimator.RunConfig(model_dir=model_dir, tf_random_seed=args.seed, log_step_count_steps=None)
        estimator = tf.estimator.Estimator(make_model_fn(args), config=config)
        x, y = data.train_images[:args.train_examples], data.train_labels[:args.train_examples]
        k, micro, start = args.micro_batches, args.micro_batch, time.time()
        print("Estimator.train(max_steps=%d) with GradientAccumulator(Adam %g, %d) on micro-batches of %d: "
              "each update is a batch of %d" % (args.max_steps, args.learning_rate, k, micro, micro * k))
        estimator.train(input_fn(x, y, micro, repeat=True), max_steps=args.max_steps)
        metrics = estimator.evaluate(input_fn(data.test_images, data.test_labels, 1000, repeat=False))
        print("global_step %d (updates; %d micro-batches), test loss %.4f, test accuracy %.4f, %.1f s"
              % (metrics["global_step"], metrics["global_step"] * k, metrics["loss"], metrics["accuracy"],
                 time.time() - start))
    finally:
        if args.model_dir is None:
            shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    if getattr(tf, "estimator", None) is None or tuple(map(int, tf.__version__.split(".")[:2])) >= (2, 16):
        fail("needs tf.estimator, which exists only up to TensorFlow 2.15 (this is TensorFlow %s); use "
             "examples/keras_fit.py or a session loop" % tf.__version__)
    main(parse_args())
