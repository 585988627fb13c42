"""Find the largest micro-batch that fits in memory: gradaccum.find_micro_batch, then train with it.

find_micro_batch(run_step, target_batch) runs one accumulate step at growing micro-batch sizes,
bisects below the first that raises ResourceExhaustedError, keeps 90% of the largest that ran,
and splits the target batch into k equal micro-batches; every variable a try changed is written
back. On a GPU the cap is the device's memory. A CPU has none, so here each try measures its peak
memory (Linux's VmHWM) and raises ResourceExhaustedError past --memory-mb, as a GPU would at its
limit. k is a variable of the graph, set once the micro-batch is found.
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
    parser.add_argument("--batch-size", type=int, default=5000, help="examples per update (5000)")
    parser.add_argument("--memory-mb", type=int, default=100, help="memory a micro-step may use (100)")
    parser.add_argument("--updates", type=int, default=3, help="updates to train with the choice (3)")
    parser.add_argument("--width", type=int, default=16, help="channels of the first conv layer (16)")
    parser.add_argument("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args()
    for flag in ("batch_size", "memory_mb", "updates", "width"):
        if getattr(args, flag) < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    return args


def peak_memory_bytes(reset=False):
    """This process's peak resident memory since the last reset (Linux)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak becomes the current size
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def main(args):
    try:
        data = fashion_mnist_data.load(args.data_dir)
    except ValueError as error:
        fail(error)
    if args.batch_size > len(data.train_labels):
        fail("`--batch-size` %d is more than the %d training examples" % (args.batch_size, len(data.train_labels)))
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    tf.compat.v1.set_random_seed(0)
    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
    labels = tf.compat.v1.placeholder(tf.int32, [None])
    net = images
    for layer, stride in enumerate((1, 2, 2, 1), 1):
        net = tf.compat.v1.layers.conv2d(net, args.width * layer, 3, stride, "same", activation=tf.nn.relu)
    logits = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(net), 10)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    step = tf.compat.v1.train.get_or_create_global_step()
    k = tf.compat.v1.Variable(1, dtype=tf.int64, trainable=False, name="num_micro_batches")
    opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(1e-3), num_micro_batches=k)
    train_op = opt.minimize(loss, global_step=step, weight=tf.shape(images)[0])

    def run_step(size):  # one accumulate step on `size` examples; never applies
        before = peak_memory_bytes(reset=True)
        sess.run(opt.accumulate_op, {images: data.train_images[:size], labels: data.train_labels[:size]})
        if peak_memory_bytes() - before > args.memory_mb * 2 ** 20:
            raise tf.errors.ResourceExhaustedError(None, None, "%d examples need more than --memory-mb" % size)

    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        start = time.time()
        choice = gradaccum.find_micro_batch(run_step, args.batch_size, session=sess)
        print("found in %.0f s: %d micro-batches of %d for a batch of %d (largest that ran: %d, smallest that "
              "ran out of memory: %s)" % (time.time() - start, choice.num_micro_batches, choice.micro_batch_size,
                                         args.batch_size, choice.largest_that_ran, choice.smallest_that_failed))
        k.load(choice.num_micro_batches, sess)
        micro, order = choice.micro_batch_size, np.random.RandomState(0).permutation(len(data.train_labels))
        for update in range(args.updates):
            losses = []
            for i in range(choice.num_micro_batches):
                chosen = order[(update * choice.num_micro_batches + i) * micro:][:micro]
                losses.append(sess.run([train_op, loss], {images: data.train_images[chosen],
                                                          labels: data.train_labels[chosen]})[1])
            print("update %d: global_step %d, batch %d, loss %.4f" % (
                update + 1, sess.run(step), micro * choice.num_micro_batches, np.mean(losses)), flush=True)


if __name__ == "__main__":
    main(parse_args())
