"""Recompute activations: a 12-block residual MLP on Fashion-MNIST, every block wrapped in gradaccum.recompute.

Only each block's input is kept through the forward pass; a block runs again in the backward pass,
when its gradient arrives. The update is the plain model's: --check trains both, recomputed and plain,
from the same start and prints the largest difference of their variables and Adam's slots: 0 on CPU with
TF_ENABLE_ONEDNN_OPTS=0; with oneDNN's fused float32 kernels (TF 2.x's default), float32 rounding.
--one-run: one session.run per update (subdivisions.minimize), the micro-batches in a loop in the graph.
"""
import argparse
import importlib.util
import os
import resource
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


def seeded(number):
    """Kernels seeded by layer, not by op count (TF 1.15's default), so both models start alike."""
    return tf.compat.v1.glorot_uniform_initializer(seed=number)


def block(h, index, hidden):
    """``h + W2 relu(W1 h)``: the feed-forward half of a transformer layer."""
    with tf.compat.v1.variable_scope("block_%d" % index):
        inner = tf.compat.v1.layers.dense(h, hidden, tf.nn.relu, name="up", kernel_initializer=seeded(2 * index))
        return h + tf.compat.v1.layers.dense(inner, h.shape[-1], name="down", kernel_initializer=seeded(2 * index + 1))


def make_model_fn(blocks, width, recompute):
    def model_fn(images, labels):
        with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
            h = tf.compat.v1.layers.dense(tf.reshape(images, [-1, 28 * 28]), width, name="embed",
                                          kernel_initializer=seeded(1000))
            for index in range(blocks):
                if recompute:  # the one changed line: only h is kept, the block runs again in backprop
                    h = gradaccum.recompute(block)(h, index, 4 * width)
                else:
                    h = block(h, index, 4 * width)
            logits = tf.compat.v1.layers.dense(h, 10, name="logits", kernel_initializer=seeded(1001))
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    return model_fn


def train(args, data, recompute):
    """Trains ``args.updates`` updates; returns the final loss and every variable, by name."""
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(args.seed)
        images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        model_fn = make_model_fn(args.blocks, args.width, recompute)
        opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(1e-3), args.subdivisions)
        step = tf.compat.v1.train.get_or_create_global_step()
        if args.one_run:
            train_op, loss, _ = gradaccum.subdivisions.minimize(opt, model_fn, [images, labels], global_step=step)
        else:
            loss = model_fn(images, labels)
            train_op = opt.minimize(loss, global_step=step, weight=tf.shape(images)[0])
        rng = np.random.RandomState(args.seed)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for _ in range(args.updates):
                chosen = rng.choice(len(data.train_labels), args.batch_size, replace=False)
                for part in np.split(chosen, 1 if args.one_run else args.subdivisions):  # the last run updates
                    value = sess.run([train_op, loss], {images: data.train_images[part],
                                                        labels: data.train_labels[part]})[1]
            variables = tf.compat.v1.global_variables()
            return value, dict(zip([v.op.name for v in variables], sess.run(variables)))


def fail(message):
    sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]), message))
    sys.exit(2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = fail  # one line, without the usage block
    add = parser.add_argument
    add("--updates", type=int, default=20, help="updates to train (20)")
    add("--batch-size", type=int, default=1024, help="examples per update (1024)")
    add("--subdivisions", type=int, default=4, help="micro-batches per update (4)")
    add("--blocks", type=int, default=12, help="residual blocks, each recomputed (12)")
    add("--width", type=int, default=64, help="the blocks' width; their inner width is 4x (64)")
    add("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    add("--seed", type=int, default=0, help="initial weights and sampling (0)")
    add("--one-run", action="store_true", help="one session.run per update, the micro-batches in a loop in it")
    add("--check", action="store_true", help="also train the plain model and compare every variable")
    add("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args(argv)
    for flag in [flag for flag in ("updates", "batch_size", "subdivisions", "blocks", "width")
                 if getattr(args, flag) < 1]:
        fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if args.batch_size % args.subdivisions:
        fail("`--batch-size` %d is not a multiple of `--subdivisions` %d" % (args.batch_size, args.subdivisions))
    return args


def main(args):
    try:
        data = fashion_mnist_data.load(args.data_dir)
    except ValueError as error:
        fail(error)
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    start = time.time()
    loss, values = train(args, data, recompute=True)
    print("recomputed: %d updates of %d (%s), loss %.4f, %.0f s" % (
        args.updates, args.batch_size, "one run each" if args.one_run else "%d runs each" % args.subdivisions,
        loss, time.time() - start))
    if args.check:
        plain_loss, plain = train(args, data, recompute=False)
        difference = max(float(np.max(np.abs(values[name] - plain[name]))) for name in plain)
        print("plain: loss %.4f; largest difference of %d variables and slots: %.3g" % (
            plain_loss, len(plain), difference))
    print("peak memory %.0f MB" % (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0))


if __name__ == "__main__":
    main(parse_args())
