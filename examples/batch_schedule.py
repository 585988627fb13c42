"""Grow the batch on a schedule: gradaccum.batch_ramp, from 500 to 5,000 examples, on Fashion-MNIST.

batch_ramp(start, increment, ramp_examples, batch_size, micro_batch_size) is Megatron-LM's batch
ramp: the batch grows by `increment` each time another share of `ramp_examples` has been trained
on. It is a function of global_step (the examples of every window are known), so a checkpoint
resumes it. The loop asks the graph how many micro-batches each window holds (opt.window_size).
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
    parser.add_argument("--ramp", default="500,500,60000",
                        help="START,INCREMENT,EXAMPLES: the batch grows from START by INCREMENT over "
                             "EXAMPLES examples (500,500,60000)")
    parser.add_argument("--batch-size", type=int, default=5000, help="the final batch (5000)")
    parser.add_argument("--micro-batch", type=int, default=100, help="examples per micro-batch (100)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over the training set (2)")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="Adam's (1e-3)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden units of the MLP (256)")
    parser.add_argument("--train-examples", type=int, default=None, help="use only the first N")
    parser.add_argument("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args()
    try:
        start, increment, examples = (int(part) for part in args.ramp.split(","))
        args.schedule = gradaccum.batch_ramp(start, increment, examples, args.batch_size, args.micro_batch)
    except ValueError as error:  # the library names the argument that is wrong
        fail("`--ramp` %r: %s" % (args.ramp, error))
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

    adam = tf.compat.v1.train.AdamOptimizer(args.learning_rate)
    opt = gradaccum.GradientAccumulator(adam, num_micro_batches=args.schedule)  # k = schedule(global_step)
    train_op = opt.minimize(loss, global_step=step, weight=tf.shape(images)[0])

    micro, batches, start = args.micro_batch, [], time.time()
    rng = np.random.RandomState(0)
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for epoch in range(args.epochs):
            order, position, first_update = rng.permutation(len(y_train)), 0, len(batches)
            while True:
                k = int(sess.run(opt.window_size))  # read from global_step when the window starts
                if position + k * micro > len(order):
                    break  # the window starts in the next epoch, with the same k
                for _ in range(k):
                    chosen = order[position:position + micro]
                    sess.run(train_op, {images: x_train[chosen], labels: y_train[chosen]})
                    position += micro
                batches.append(k * micro)
            test = sess.run(accuracy, {images: data.test_images, labels: data.test_labels})
            epoch_batches = batches[first_update:] or [0]
            print("epoch %d: %d updates, batch %d to %d, test accuracy %.4f" % (
                epoch + 1, len(batches) - first_update, min(epoch_batches), max(epoch_batches), test), flush=True)
        print("done: %d updates (global_step %d), batches %s, %.0f s" % (
            len(batches), sess.run(step), " ".join("%dx%d" % (batches.count(b), b) for b in sorted(set(batches))),
            time.time() - start))


if __name__ == "__main__":
    main(parse_args())
