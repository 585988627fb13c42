"""Train on several processes: collective workers, each reading its own shard of every batch.

  python -m gradaccum.launch --workers 2 -- python examples/workers.py

Every worker builds the same graph and runs --subdivisions / P of each update's micro-batches
(worker r runs micro-batches r, r + P, ...). gradaccum.cluster.CollectiveAllReduce inside the
accumulator sums the window over the workers once per update, so every update is the one of the
whole batch: the trained variables equal one process's. cluster.from_environment() finds the
cluster (TF_CONFIG, else Slurm's srun); without one this is a single process.
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


from gradaccum import cluster  # noqa: E402


def fail(message):
    sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]), message))
    sys.exit(2)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = fail  # one line, without the usage block
    parser.add_argument("--batch-size", type=int, default=1000, help="examples per update, all workers (1000)")
    parser.add_argument("--subdivisions", type=int, default=10, help="micro-batches per update (10)")
    parser.add_argument("--updates", type=int, default=60, help="updates to train (60, one epoch)")
    parser.add_argument("--hidden", type=int, default=128, help="hidden units of the MLP (128)")
    parser.add_argument("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    parser.add_argument("--save", help="save the trained variables to this checkpoint prefix (worker 0)")
    parser.add_argument("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args()
    for flag in ("batch_size", "subdivisions", "updates", "hidden"):
        if getattr(args, flag) < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if args.batch_size % args.subdivisions:
        fail("`--batch-size` %d is not a multiple of `--subdivisions` %d" % (args.batch_size, args.subdivisions))
    return args


def main(args):
    config = cluster.from_environment()  # None: a single process
    rank, size = (0, 1) if config is None else (config.compute_tasks.index((config.task_type, config.task_index)),
                                                 len(config.compute_tasks))
    if args.subdivisions % size:
        fail("`--subdivisions` %d must be a multiple of the %d workers" % (args.subdivisions, size))
    try:
        data = fashion_mnist_data.load(args.data_dir, log=print if rank == 0 else lambda line: None)
    except ValueError as error:
        fail(error)
    micro = args.batch_size // args.subdivisions
    if args.updates * args.batch_size > len(data.train_labels):
        fail("`--updates` %d of %d examples is more than the %d training examples"
             % (args.updates, args.batch_size, len(data.train_labels)))
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    tf.compat.v1.set_random_seed(0)  # the same initial values everywhere; worker 0's are broadcast anyway
    session_config, target = tf.compat.v1.ConfigProto(), ""
    if size > 1:
        session_config = cluster.collective_session_config(config)
        target = cluster.start_server(config, session_config).target
        cluster.wait_for_tasks(config, timeout_seconds=120)

    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
    labels = tf.compat.v1.placeholder(tf.int32, [None])
    hidden = tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(images), args.hidden, tf.nn.relu)
    logits = tf.compat.v1.layers.dense(hidden, 10)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.float32))
    step = tf.compat.v1.train.get_or_create_global_step()
    adam = tf.compat.v1.train.AdamOptimizer(1e-3)
    if size > 1:
        adam = cluster.CollectiveAllReduce(adam, config)  # sums each window over the workers
    opt = gradaccum.GradientAccumulator(adam, args.subdivisions // size)  # this worker's share of a window
    train_op = opt.minimize(loss, global_step=step, weight=tf.shape(images)[0])
    broadcast = cluster.broadcast_variables(config) if size > 1 else tf.no_op()

    start, order = time.time(), np.random.RandomState(0).permutation(len(data.train_labels))
    mine = [order[i * micro:(i + 1) * micro] for i in range(rank, args.updates * args.subdivisions, size)]
    with tf.compat.v1.Session(target, config=session_config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(broadcast)  # worker 0's initial values to everyone
        for chosen in mine:  # this worker's own micro-batches, in order
            sess.run(train_op, {images: data.train_images[chosen], labels: data.train_labels[chosen]})
        if rank == 0:
            test = sess.run(accuracy, {images: data.test_images, labels: data.test_labels})
            print("done: global_step %d, %d workers x %d micro-batches of %d per update, test accuracy %.4f, "
                  "%.0f s" % (sess.run(step), size, args.subdivisions // size, micro, test, time.time() - start))
            if args.save:
                tf.compat.v1.train.Saver().save(sess, args.save, write_meta_graph=False)


if __name__ == "__main__":
    main(parse_args())
