"""Child process for the exact-resume test (not collected by pytest).

``python resume_child.py PHASE DIR``, for both patterns (``fused``: the
train op; ``manual``: zero, accumulate, apply). Phase ``first`` writes
``DIR/PATTERN_never_stopped.npz`` from an uninterrupted run, then runs the
same schedule up to the middle of the second window and saves a checkpoint.
Phase ``second`` restores it in this fresh process, finishes the schedule and
writes ``DIR/PATTERN_resumed.npz``.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if os.environ.get("GRADACCUM_TF_MODE", "tf1") == "tf1":
    tf.compat.v1.disable_v2_behavior()
else:
    tf.compat.v1.disable_eager_execution()

import gradaccum  # noqa: E402

v1 = tf.compat.v1
K, WINDOWS, STOP_AFTER = 4, 3, 6  # stop 2 micro-batches into the second window


def schedule(pattern):
    """The session.run calls of the whole run: (what, micro-batch index)."""
    steps = []
    for _ in range(WINDOWS):
        if pattern == "manual":
            steps.append(("zero", None))
        steps.extend(("accumulate" if pattern == "manual" else "train", i) for i in range(K))
        if pattern == "manual":
            steps.append(("apply", None))
    return steps


def build():
    rng = np.random.RandomState(5)
    x = v1.placeholder(tf.float32, [None, 3])
    y = v1.placeholder(tf.float32, [None, 1])
    w = v1.get_variable("w", initializer=rng.randn(3, 4).astype(np.float32))
    v = v1.get_variable("v", initializer=rng.randn(4, 1).astype(np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(tf.tanh(tf.matmul(x, w)), v) - y))
    step = v1.train.get_or_create_global_step()
    opt = gradaccum.GradientAccumulator(v1.train.AdamOptimizer(0.05), K)
    ops = {"train": opt.minimize(loss, global_step=step, weight=tf.shape(x)[0])}
    ops.update(zero=opt.zero_op, accumulate=opt.accumulate_op, apply=opt.apply_op)
    return x, y, ops, [w, v, step] + opt.accumulators + opt.optimizer.variables()


def run(sess, graph_parts, steps):
    x, y, ops, _ = graph_parts
    rng = np.random.RandomState(11)
    data = rng.randn(K, 3, 3).astype(np.float32), rng.randn(K, 3, 1).astype(np.float32)
    for what, index in steps:
        feed = {} if index is None else {x: data[0][index], y: data[1][index]}
        sess.run(ops[what], feed)


def session():
    # One thread: identical reductions in both processes, so bits can be compared.
    config = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1)
    return v1.Session(config=config)


def save_state(sess, parts, path):
    values = sess.run(parts[3])
    np.savez(path, **{"a%d" % i: value for i, value in enumerate(values)})


def main(phase, directory):
    for pattern in ("fused", "manual"):
        run_pattern(pattern, phase, directory)


def run_pattern(pattern, phase, directory):
    steps = schedule(pattern)
    stop = [i for i, (what, _) in enumerate(steps) if what in ("train", "accumulate")][STOP_AFTER - 1] + 1
    ckpt = os.path.join(directory, pattern + "_ckpt")
    prefix = os.path.join(directory, pattern + "_")
    with tf.Graph().as_default():
        parts = build()
        saver = v1.train.Saver()
        with session() as sess:
            if phase == "first":
                sess.run(v1.global_variables_initializer())
                run(sess, parts, steps)
                save_state(sess, parts, prefix + "never_stopped.npz")
                sess.run(v1.global_variables_initializer())
                run(sess, parts, steps[:stop])
                saver.save(sess, ckpt)
            else:
                saver.restore(sess, ckpt)
                run(sess, parts, steps[stop:])
                save_state(sess, parts, prefix + "resumed.npz")


if __name__ == "__main__":
    main(*sys.argv[1:3])
