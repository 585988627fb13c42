"""Child process for the micro-batch finder test (not collected by pytest).

``python finder_child.py BUDGET_MB``: builds an accumulator whose memory per
example is about 3 MB, caps this process's address space at its current size
plus ``BUDGET_MB`` (``RLIMIT_AS``), runs ``gradaccum.find_micro_batch`` for a
target batch of 4,096, then checks what the test asserts on: the chosen
micro-batch runs, the search left every variable as it found it, and twice
the choice does not run. Prints one JSON line with the choice, then tries the
double and prints a second one: ``{"double_fails": ...}``. TensorFlow 1.15
sometimes dies of SIGSEGV instead of raising ``ResourceExhaustedError`` on
an allocation well over the cap; the first line is out by then.
"""
import json
import os
import resource
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
WIDTH = 250000  # float32 columns per example: 1 MB per example per copy
TARGET = 4096


def virtual_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def main(budget_mb):
    x = v1.placeholder(tf.float32, [None, 1])
    w = v1.get_variable("w", initializer=np.linspace(-1, 1, WIDTH).astype(np.float32))
    loss = tf.reduce_mean(tf.tanh(tf.tile(x, [1, WIDTH]) * w))
    opt = gradaccum.GradientAccumulator(v1.train.AdamOptimizer(0.1), 8)
    opt.minimize(loss, weight=tf.shape(x)[0])
    sess = v1.Session(config=v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=1))
    sess.run(v1.global_variables_initializer())

    def run_step(size):
        sess.run(opt.accumulate_op, {x: np.ones([size, 1], np.float32)})

    run_step(1)  # warm: kernels and thread pools exist before the cap
    before = sess.run(v1.global_variables())
    cap = virtual_bytes() + budget_mb * 2 ** 20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    # With oneDNN on (the test turns it off), each size that fails waits about 10 s: a coarse bisection
    # (two failures, not six) proves the same, a choice that runs and a double that does not.
    choice = gradaccum.find_micro_batch(run_step, TARGET, session=sess, precision=0.5)
    untouched = all(np.array_equal(a, b) for a, b in zip(before, sess.run(v1.global_variables())))
    run_step(choice.micro_batch_size)
    print(json.dumps(dict(choice._asdict(), untouched=untouched)), flush=True)
    try:
        run_step(2 * choice.micro_batch_size)
        double_fails = False
    except tf.errors.ResourceExhaustedError:
        double_fails = True
    print(json.dumps({"double_fails": double_fails}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1])))
