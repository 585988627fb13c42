"""Train on several devices in one process: gradaccum.tower.minimize, with synchronized batch norm.

Every micro-batch is split over --towers CPU devices (use "/gpu:%d" on GPUs); each tower runs the
model on its shard, and the towers' gradients are averaged, weighted by shard size, so the update
is the one of the whole batch. gradaccum.batch_normalization normalizes with the statistics of
all towers' shards, as one device would; wrapped in a GradientAccumulator, each run is one
micro-batch and every --subdivisions-th run applies the update.
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
    parser.add_argument("--towers", type=int, default=2, help="CPU devices, one tower each (2)")
    parser.add_argument("--batch-size", type=int, default=1000, help="examples per update (1000)")
    parser.add_argument("--subdivisions", type=int, default=2, help="micro-batches per update (2)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the training set (1)")
    parser.add_argument("--width", type=int, default=8, help="channels of the first conv layer (8)")
    parser.add_argument("--train-examples", type=int, default=None, help="use only the first N")
    parser.add_argument("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args()
    for flag in ("towers", "batch_size", "subdivisions", "epochs", "width"):
        if getattr(args, flag) < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if args.batch_size % (args.subdivisions * args.towers):
        fail("`--batch-size` %d must be a multiple of `--subdivisions` times `--towers` (%d)"
             % (args.batch_size, args.subdivisions * args.towers))
    return args


def model_fn(images, labels, width):
    """The mean loss of one tower's shard; the first tower creates the variables, the others reuse them."""
    net = images
    for layer, stride in enumerate((1, 2, 2), 1):
        net = tf.compat.v1.layers.conv2d(net, width * layer, 3, stride, "same", use_bias=False,
                                         name="conv%d" % layer)
        net = gradaccum.batch_normalization(net, training=True, momentum=0.9, name="bn%d" % layer)
        net = tf.nn.relu(net)
    logits = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(net), 10, name="logits")
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))


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
    step = tf.compat.v1.train.get_or_create_global_step()
    opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(2e-3), args.subdivisions)
    devices = ["/cpu:%d" % i for i in range(args.towers)]
    result = gradaccum.tower.minimize(opt, lambda x, y: model_fn(x, y, args.width), [images, labels],
                                      devices=devices, global_step=step)
    config = tf.compat.v1.ConfigProto(device_count={"CPU": args.towers})  # virtual CPU devices

    micro, updates, start = args.batch_size // args.subdivisions, len(y_train) // args.batch_size, time.time()
    print("batch %d = %d micro-batches of %d, each split over %s" % (args.batch_size, args.subdivisions, micro,
                                                                     ", ".join(devices)))
    with tf.compat.v1.Session(config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        for epoch in range(args.epochs):
            order, losses = np.random.RandomState(epoch).permutation(len(y_train)), []
            for run in range(updates * args.subdivisions):
                chosen = order[run * micro:(run + 1) * micro]
                losses.append(sess.run([result.train_op, result.loss],
                                       {images: x_train[chosen], labels: y_train[chosen]})[1])
            test_loss = np.mean([sess.run(result.loss, {images: data.test_images[i:i + 1000],
                                                        labels: data.test_labels[i:i + 1000]})
                                 for i in range(0, len(data.test_labels), 1000)])
            print("epoch %d: global_step %d, train loss %.4f, test loss %.4f (batch statistics)"
                  % (epoch + 1, sess.run(step), np.mean(losses), test_loss), flush=True)
        print("done: %d updates on %d towers, %.0f s" % (sess.run(step), args.towers, time.time() - start))


if __name__ == "__main__":
    main(parse_args())
