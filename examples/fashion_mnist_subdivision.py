"""Train a batch-norm CNN on Fashion-MNIST, a batch of 5,000 in 50 micro-batches of 100.

GradientAccumulator applies the average gradient of 50 micro-batches once: the update of a batch of 5,000 in
the memory of 100. global_step counts updates, as the schedule does. --one-run: one session.run per update."""
import argparse
import importlib.util
import json
import os
import resource
import sys
import time
import warnings

import numpy as np
import progressbar

START, VERBOSE, saved_stderr = time.time(), "--verbose" in sys.argv[1:], os.dup(2)
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


def build_logits(net, is_training, width, batch_norm=gradaccum.batch_normalization, momentum=0.5):
    """Five conv + batch-norm (moving statistics once per update) + leaky-ReLU blocks, then a dense layer."""
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        for block, stride in enumerate((1, 2, 2, 1, 1), 1):
            net = tf.compat.v1.layers.conv2d(net, width * block, 3, stride, "same", use_bias=False,
                                             name="conv%d" % block)
            net = batch_norm(net, momentum=momentum, epsilon=1e-5, training=is_training, name="bn%d" % block)
            net = tf.nn.leaky_relu(net)
        return tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(net), 10, name="logits")


def learning_rate(step, peak, warmup, total):
    """A linear warm-up to ``peak`` over ``warmup`` updates, then a cosine decay to 0 at ``total``."""
    step = tf.cast(step, tf.float32)
    decay = tf.compat.v1.train.cosine_decay(peak, step - warmup, max(1, total - warmup))
    return tf.where(step < warmup, peak * (step + 1) / warmup, decay)


def build(width, k, rate, statistics=False, one_run=False):
    """The placeholders, the model, the loss and the train op (run once per micro-batch, or per update)."""
    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
    labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
    is_training = tf.compat.v1.placeholder_with_default(True, [], name="is_training")

    def model_fn(images, labels):
        logits = build_logits(images, is_training, width)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    loss = None if one_run else model_fn(images, labels)
    step = tf.compat.v1.train.get_or_create_global_step()
    opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(rate(step)), k, statistics=statistics)
    if one_run:  # the whole batch in one run, split into micro-batches in a tf.while_loop
        train_op, loss, _ = gradaccum.subdivisions.minimize(opt, model_fn, [images, labels], global_step=step)
    else:
        train_op = opt.minimize(loss, global_step=step, weight=tf.shape(images)[0])  # and batch norm's updates
    logits = build_logits(images, is_training, width)  # the same variables, for the test set
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.int32))
    return dict(images=images, labels=labels, is_training=is_training, loss=loss, train_op=train_op,
                correct=correct, step=step, opt=opt)


def fail(message):
    sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]), message))
    sys.exit(2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = fail  # one line, without the usage block
    add = parser.add_argument
    add("--epochs", type=int, default=10, help="passes over the training set (10)")
    add("--batch-size", type=int, default=5000, help="examples per update (5000)")
    add("--subdivisions", type=int, default=50, help="micro-batches per update (50)")
    add("--learning-rate", type=float, default=0.003, help="Adam's peak learning rate (0.003)")
    add("--width", type=int, default=16, help="channels of the first block (16)")
    add("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    add("--seed", type=int, default=0, help="initial weights and shuffling (0)")
    add("--one-run", action="store_true", help="one session.run per update, the batch split in a loop in it")
    add("--logdir", help="write TensorBoard summaries here, once per update")
    add("--json", type=argparse.FileType("w"), help="write the run's figures to this file")
    add("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args(argv)
    for flag in [flag for flag in ("epochs", "batch_size", "subdivisions", "width") if getattr(args, flag) < 1]:
        fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if args.batch_size % args.subdivisions:
        fail("`--batch-size` %d is not a multiple of `--subdivisions` %d" % (args.batch_size, args.subdivisions))
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    return args


def main(args):
    try:
        data = fashion_mnist_data.load(args.data_dir)
    except ValueError as error:
        fail(error)
    n, m, k = len(data.train_labels), len(data.test_labels), args.subdivisions
    batch = min(args.batch_size, n - n % k)  # the digits fallback has 1,500 training examples
    micro, per_epoch, total = batch // k, n // batch, n // batch * args.epochs
    print("batch %d = %d micro-batches of %d; %d updates, %d per epoch" % (batch, k, micro, total, per_epoch))
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    tf.compat.v1.set_random_seed(args.seed)
    model = build(args.width, k, lambda step: learning_rate(step, args.learning_rate, 10, total),
                  statistics=args.logdir is not None, one_run=args.one_run)
    writer = args.logdir and (tf.compat.v1.summary.FileWriter(args.logdir), gradaccum.summaries(model["opt"]))
    rng, accuracies, x, y = np.random.RandomState(args.seed), [], model["images"], model["labels"]
    with tf.compat.v1.Session() as sess, progressbar.ProgressBar(max_value=total, redirect_stdout=True, widgets=[
            "update ", progressbar.Counter(), "/%d " % total, progressbar.Bar(), " ", progressbar.ETA()]) as bar:
        sess.run(tf.compat.v1.global_variables_initializer())
        for epoch in range(args.epochs):
            epoch_start, order, losses = time.time(), rng.permutation(n), []
            for update in range(per_epoch):
                for chosen in np.split(order[update * batch:(update + 1) * batch], 1 if args.one_run else k):
                    feed = {x: data.train_images[chosen], y: data.train_labels[chosen]}  # the last run updates
                    losses.append(sess.run([model["train_op"], model["loss"]], feed)[1])
                step = sess.run(model["step"])
                if writer:
                    writer[0].add_summary(sess.run(writer[1]), step)
                bar.update(step)
            feeds = ({x: data.test_images[i:i + 1000], y: data.test_labels[i:i + 1000], model["is_training"]: False}
                     for i in range(0, m, 1000))
            accuracies.append(sum(sess.run(model["correct"], feed) for feed in feeds) / float(m))
            print("epoch %d: step %d, train loss %.4f, test accuracy %.4f, %.1f s" % (
                epoch + 1, step, np.mean(losses), accuracies[-1], time.time() - epoch_start))
            bar.update(step, force=True)  # prints the line above the bar now
    if writer:
        writer[0].close()  # writes the last update's summaries now, not whenever the interpreter's exit gets to it
    seconds, peak = round(time.time() - START, 1), round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)
    print("test accuracy %.4f after %d updates of %d, %.0f s, peak memory %.0f MB" % (
        accuracies[-1], step, batch, seconds, peak))
    if args.json:
        json.dump(dict(dataset=data.name, source=data.source, train_examples=n, test_examples=m, batch_size=batch,
                       updates=int(step), test_accuracy=accuracies, final_test_accuracy=accuracies[-1],
                       seconds=seconds, peak_memory_mb=peak, micro_batch_size=micro), args.json, indent=1)


if __name__ == "__main__":
    main(parse_args())
