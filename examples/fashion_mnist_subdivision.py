"""Train a batch-norm CNN on Fashion-MNIST with a batch of 5,000 split into 50 micro-batches.

The recipe, top to bottom: data, model, ``gradaccum.GradientAccumulator``, the micro-batch loop,
evaluation. The accumulator adds the gradients of 50 micro-batches of 100 and applies their average once:
the update of a 5,000 batch in about the memory of a 100 batch. The model is the user seed's
("subdivisions" is darknet's name): conv + batch-norm + leaky-ReLU blocks of ``width * 1 .. 5`` channels,
a dense layer, Adam with a warm-up and a cosine decay by ``global_step`` (applied updates).
``--width 128 --strides 2,2,1,1,1 --head mean`` is the seed's model (slow on a CPU).
The batch may also change: ``--batch-schedule`` (a ramp or steps) or ``--adaptive-batch`` (it follows the
gradient noise scale); the learning rate then follows the examples trained on. ``--subdivisions auto``
finds the micro-batch that fits in memory. ``_fashion_run`` holds the plumbing: flags (``--help``), data
loading, reporting, ``--json``, TensorBoard, collective workers (``gradaccum.launch``).
Reuse: ``build_logits(images, is_training, width)`` and ``build_training(config)``.
"""
import functools
import sys
import time

START_TIME = time.time()

import _quiet  # noqa: E402

VERBOSE = __name__ == "__main__" and "--verbose" in sys.argv[1:]
_quiet.before_import(VERBOSE)

import numpy as np  # noqa: E402

import _fashion_run as run  # noqa: E402
from _fashion_run import (BN_EPSILON, BN_MOMENTUM, STRIDES, Training, TrainingConfig, batch_norm_function,  # noqa
                          bn_momentum, config_from_args, default_bn_stats, fit_batch_to_data, learning_rate_at,
                          learning_rate_schedule, parse_args, peak_memory_mb, total_updates)

if __name__ == "__main__":  # Bad flags and bad files fail at once, before TensorFlow's slow import.
    ARGS, DATA = run.prepare(description=__doc__.split("\n")[0])

with _quiet.native_stderr(VERBOSE):
    import tensorflow as tf  # noqa: E402

    import gradaccum  # noqa: E402
    from gradaccum import cluster, tower  # noqa: E402

    if VERBOSE is False and __name__ == "__main__":
        _quiet.after_import(tf)
    tf.compat.v1.layers.Layer  # Loads tf-keras (TF >= 2.16) now, inside the quiet block.
QUIET = lambda: _quiet.native_stderr(VERBOSE or __name__ != "__main__")  # noqa: E731


# ----------------------------------------------------------------- model

# TF 2.15 does not list tf_keras as safe from autograph, and converting these straight-line layers costs seconds.
@tf.autograph.experimental.do_not_convert
def build_logits(images, is_training, width, batch_norm=None, momentum=BN_MOMENTUM["micro"], head="flatten",
                 strides=STRIDES):
    """Builds the CNN (float32 logits ``[N, 10]`` of ``images`` ``[N, 28, 28, 1]``); again, the same variables.

    Args:
      is_training: Python bool or bool tensor: batch statistics (and moving average updates) when True.
      width: int >= 1, channels of the first block; block i has ``width * i``.
      batch_norm: the batch-norm function (``batch_norm_function``); ``None`` means TF's v1 layer.
      momentum, head, strides: the moving averages' momentum; ``"flatten"`` or ``"mean"`` (the seed's global
        mean pool); one stride per block (five).

    Example:
      >>> logits = build_logits(images, is_training=True, width=16)
    """
    batch_norm = batch_norm or tf.compat.v1.layers.batch_normalization
    with tf.compat.v1.variable_scope("model", reuse=tf.compat.v1.AUTO_REUSE):
        net = images
        for block, stride in enumerate(strides, 1):
            net = tf.compat.v1.layers.conv2d(net, width * block, 3, stride, "same", use_bias=False,
                                             name="conv%d" % block)
            net = batch_norm(net, momentum=momentum, epsilon=BN_EPSILON, training=is_training, name="bn%d" % block)
            net = tf.nn.leaky_relu(net, name="leaky_relu%d" % block)
        net = (tf.reduce_mean(net, axis=[1, 2], name="global_mean_pool") if head == "mean" else
               tf.compat.v1.layers.flatten(net, name="flatten"))
        return tf.compat.v1.layers.dense(net, 10, name="logits")


def _learning_rate(config, global_step):
    """Adam's learning rate, and (for a batch that changes) the examples-trained-on variable it follows."""
    seen = None if config.base_batch is None else tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False,
                                                                        name="examples_seen")
    # A fixed batch follows the updates; a changing one the examples, in updates of the batch it was tuned for.
    step = global_step if seen is None else tf.cast(seen, tf.float32) / config.base_batch
    rate = learning_rate_schedule(step, config.learning_rate, config.warmup_updates, config.total_updates)
    if isinstance(config.subdivisions, gradaccum.AdaptiveBatch):  # Scaled to the batch the policy picks.
        rate *= config.subdivisions.learning_rate_multiplier
    return rate, seen


def _mean_loss(labels, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits), name="loss")


def build_training(config, optimizer=None, worker=None):
    """Builds the placeholders, the model, and its train op in the default graph; returns a ``Training``.

    Args:
      config: a ``TrainingConfig`` (any object with its attributes).
      optimizer: optional ``tf.compat.v1.train.Optimizer`` instead of Adam with ``learning_rate_schedule``.
      worker: a ``_workers.WorkerRun`` of a collective job, or None: the optimizer is then wrapped in
        ``cluster.CollectiveAllReduce`` inside the accumulator, which runs 1/P of the micro-batches.

    Example:
      >>> with tf.Graph().as_default():
      ...     training = build_training(TrainingConfig(16, 0.003, subdivisions=50, towers=1))
    """
    with tf.compat.v1.name_scope("inputs"):
        images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1], name="images")
        labels = tf.compat.v1.placeholder(tf.int32, [None], name="labels")
        is_training = tf.compat.v1.placeholder_with_default(True, [], name="is_training")
    global_step = tf.compat.v1.train.get_or_create_global_step()
    rate, examples_seen = _learning_rate(config, global_step)
    optimizer = optimizer or tf.compat.v1.train.AdamOptimizer(rate)
    accumulator, runs, workers = None, config.subdivisions, 1 if worker is None else worker.size
    if worker is not None:  # Summed over the workers once per update, inside the accumulator.
        optimizer, runs = cluster.CollectiveAllReduce(optimizer, worker.config), runs // worker.size
    if config.subdivisions is not None:  # statistics: the gradient noise scale, one more read per run.
        accumulator = gradaccum.GradientAccumulator(optimizer, num_micro_batches=runs, statistics=True)
    model = functools.partial(build_logits, width=config.width, batch_norm=batch_norm_function(config.bn_stats),
                              momentum=bn_momentum(config), head=config.head, strides=config.strides)
    if config.towers > 1:  # The batch split over devices; evaluation runs it whole on one.
        result = tower.minimize(accumulator or optimizer, lambda x, y: _mean_loss(y, model(x, is_training)),
                                [images, labels], devices=["/cpu:%d" % i for i in range(config.towers)],
                                global_step=global_step, update_ops="first")
        loss, train_op, logits = result.loss, result.train_op, model(images, is_training)
    else:
        logits = model(images, is_training)
        loss = _mean_loss(labels, logits)
    if config.towers == 1 and accumulator is not None:  # update_ops=None: batch norm's, per micro-batch or window.
        train_op = accumulator.minimize(loss, global_step=global_step, weight=tf.shape(images)[0], update_ops=None)
    elif config.towers == 1:
        with tf.control_dependencies(tf.compat.v1.get_collection(tf.compat.v1.GraphKeys.UPDATE_OPS)):
            train_op = optimizer.minimize(loss, global_step=global_step)
    if examples_seen is not None:  # Counted after the run: its update's learning rate reads the count before.
        with tf.control_dependencies([train_op]):
            train_op = tf.group(examples_seen.assign_add(tf.cast(tf.shape(images)[0], tf.int64)), name="train")
    window_size = (accumulator.window_size * workers if accumulator is not None and not isinstance(runs, int)
                   else tf.constant(runs or 1, tf.int64) * workers)
    return Training(images, labels, is_training, logits, loss, train_op, global_step, accumulator, rate,
                    window_size)


# ------------------------------------------------------- the micro-batch loop


def train_epoch(sess, training, data, shape, rng, window, on_update):
    """Runs an epoch of micro-batches, asking each update's size from the graph when it starts.

    P collective workers draw the same shuffle and worker r runs micro-batches r, r + P, ...; when the
    batch changes, an update may run on into the next epoch.

    Args:
      sess, training, data, shape: the session, a ``Training``, an ``idx_data.Dataset``, a ``RunShape``.
      rng, window: the shuffle's ``np.random.RandomState``; the ``Window`` the loop counts in (across epochs).
      on_update: called with ``(sess, mean loss)`` after each applied update.

    Returns:
      The mean loss of the micro-batches this process ran.

    Example:
      >>> loss = train_epoch(sess, training, data, shape, np.random.RandomState(0), window, on_update)
    """
    order, losses, micro = rng.permutation(len(data.train_labels)), [], shape.micro_batch
    for index in range(shape.runs_per_epoch):
        if window.left == 0:
            if window.updates == shape.max_updates:
                break
            window.start(int(sess.run(training.window_size)))
        window.left -= 1
        if index % shape.workers == shape.rank:
            chosen = order[index * micro:(index + 1) * micro]
            feed = {training.images: data.train_images[chosen], training.labels: data.train_labels[chosen]}
            window.losses.append(sess.run([training.train_op, training.loss], feed)[1])
        if window.left == 0:  # That run applied the update.
            losses += window.losses
            on_update(sess, window.applied(micro))
    return float(np.mean(losses + window.losses))


def evaluate(sess, training, images, labels, chunk):
    """Returns the accuracy and mean loss on ``images`` (``chunk`` examples per run), batch norm in inference mode.

    Example:
      >>> accuracy, loss = evaluate(sess, training, data.test_images, data.test_labels, 500)
    """
    correct, total_loss = 0, 0.0
    for start in range(0, len(labels), chunk):
        feed = {training.images: images[start:start + chunk], training.labels: labels[start:start + chunk],
                training.is_training: False}
        logits, loss = sess.run([training.logits, training.loss], feed)
        correct += int(np.sum(np.argmax(logits, 1) == labels[start:start + chunk]))
        total_loss += float(loss) * len(logits)
    return correct / float(len(labels)), total_loss / len(labels)


def train(args, data):
    """Trains and evaluates as the flags (``args``) say on ``data``, one line per epoch.

    Returns:
      The run's history (``_fashion_run.summary`` reads it); ``history["chief"]`` is False in the other
      workers of a collective job, which print nothing.

    Example:
      >>> history = train(*_fashion_run.prepare(["--max-steps", "2"]))
    """
    run.set_up(args)
    if args.subdivisions == "auto":
        run.find_subdivisions(args, data, build_training, QUIET())
    worker = run.start_worker(args, QUIET())
    shape = run.run_shape(args, len(data.train_labels), worker)
    config = config_from_args(args, shape.updates)
    with QUIET():
        training = build_training(config, worker=worker)
        services = run.RunServices(args, training, worker)
    history = run.new_history(args, config, shape, START_TIME)
    with run.session(args, worker, QUIET()) as sess:
        services.start()
        rng, window = np.random.RandomState(args.seed), run.Window()  # The same shuffle in every worker.
        progress = run.ProgressBar(shape.examples, run.planned_updates(shape, config), shape.rank)
        for epoch in range(shape.epochs):
            window.new_epoch()
            loss = train_epoch(sess, training, data, shape, rng, window,
                               lambda sess, loss: (progress.update(window.examples, loss), services.after_update(sess)))
            if window.left and epoch + 1 == shape.epochs:  # The data ends inside a window: apply what it holds.
                sess.run(training.accumulator.apply_op)
                progress.update(loss=window.applied(shape.micro_batch), examples=window.examples)  # In this order.
            progress.redraw()
            if shape.rank == 0:
                evaluation = evaluate(sess, training, data.test_images, data.test_labels, 500)
                run.record_epoch(sess, training, args, shape, history, window, loss, evaluation)
            if window.updates == shape.max_updates:
                break
        progress.finish()
        run.end_history(history, sess, training, window)
        services.finish(sess)
    return history


def main(args, data):
    """Trains, then prints the noise scale and the result and writes ``--json``; a failure is one line.

    Example:
      >>> main(*_fashion_run.prepare(["--max-steps", "2"]))
    """
    run.run_and_report(train, args, data)


if __name__ == "__main__":
    main(ARGS, DATA)
