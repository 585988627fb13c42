"""Let the gradient noise scale choose the batch: gradaccum.AdaptiveBatch on Fashion-MNIST.

After every update the policy sets the next window's micro-batch count to factor * noise scale /
micro-batch (2 to --max-micro-batches), and scales Adam's learning rate, tuned for 2 micro-batches,
by the square root of AdaScale's gain. The loop asks the graph how many micro-batches the window
holds (opt.window_size) and checks that the last of them applied it (opt.window_ended).
"""
import argparse
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


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = fail  # one line, without the usage block
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set (3)")
    parser.add_argument("--micro-batch", type=int, default=25, help="examples per micro-batch (25)")
    parser.add_argument("--max-micro-batches", type=int, default=50, help="the largest window (50)")
    parser.add_argument("--factor", type=float, default=1.0, help="batch = factor * noise scale (1.0)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's, for 2 micro-batches")
    parser.add_argument("--hidden", type=int, default=256, help="hidden units of the MLP (256)")
    parser.add_argument("--train-examples", type=int, default=None, help="use only the first N")
    parser.add_argument("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args()
    for flag in ("epochs", "micro_batch", "hidden"):
        if getattr(args, flag) < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if args.max_micro_batches < 2:
        fail("`--max-micro-batches` must be an int >= 2, got %d" % args.max_micro_batches)
    if not (args.factor > 0 and args.learning_rate > 0):
        fail("`--factor` and `--learning-rate` must be > 0, got %r and %r" % (args.factor, args.learning_rate))
    return args


def main(args):
    try:
        data = fashion_mnist_data.load(args.data_dir)
    except ValueError as error:
        fail(error)
    x_train, y_train = data.train_images[:args.train_examples], data.train_labels[:args.train_examples]
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    tf.compat.v1.set_random_seed(0)
    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
    labels = tf.compat.v1.placeholder(tf.int32, [None])
    hidden = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(images), args.hidden, tf.nn.relu)
    logits = tf.compat.v1.layers.dense(hidden, 10)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.float32))
    step = tf.compat.v1.train.get_or_create_global_step()

    policy = gradaccum.AdaptiveBatch(micro_batch_size=args.micro_batch, factor=args.factor,
                                     max_micro_batches=args.max_micro_batches)
    adam = tf.compat.v1.train.AdamOptimizer(args.learning_rate * policy.learning_rate_multiplier)
    opt = gradaccum.GradientAccumulator(adam, num_micro_batches=policy)
    train_op = opt.minimize(loss, global_step=step, weight=tf.shape(images)[0])

    micro, batches, start = args.micro_batch, [], time.time()
    rng = np.random.RandomState(0)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for epoch in range(args.epochs):
            order, position, first_update = rng.permutation(len(y_train)), 0, len(batches)
            while True:
                k = int(sess.run(opt.window_size))  # this window's micro-batches, chosen by the policy
                if position + k * micro > len(order):
                    break  # the window starts in the next epoch, with the same k
                for _ in range(k):
                    chosen = order[position:position + micro]
                    sess.run(train_op, {images: x_train[chosen], labels: y_train[chosen]})
                    position += micro
                assert sess.run(opt.window_ended)  # the k-th run applied the update
                batches.append(k * micro)
            noise, gain, test = sess.run([opt.statistics.noise_scale, policy.learning_rate_multiplier, accuracy],
                                         {images: data.test_images, labels: data.test_labels})
            epoch_batches = batches[first_update:] or [0]
            noise = "%.0f examples" % noise if np.isfinite(noise) and noise > 0 else "not measured yet"
            print("epoch %d: %d updates, batch %d to %d, noise scale %s, learning rate x %.2f, test accuracy %.4f"
                  % (epoch + 1, len(batches) - first_update, min(epoch_batches), max(epoch_batches), noise, gain,
                     test), flush=True)
        print("done: %d updates (global_step %d) of %d examples on average, %.0f s" % (
            len(batches), sess.run(step), np.mean(batches), time.time() - start))


if __name__ == "__main__":
    main(parse_args())
