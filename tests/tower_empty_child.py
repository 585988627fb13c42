"""Child process for the empty-shard tests (not collected by pytest).

``python tower_empty_child.py OUT`` trains, on batches of one example, a
model whose kernels refuse an empty batch, once on one device and once per
case on 2 or 3 towers, and writes every case's losses, outputs and variables
to ``OUT`` (an ``.npz``). It runs apart from the suite because a kernel that
aborts on an empty batch (TF 1.15's fused LSTM) kills its process.
"""
import os
import sys

import numpy as np
import tensorflow as tf

import gradaccum
from gradaccum import tower

v1 = tf.compat.v1
SIZES = [1, 1, 2, 1]  # Examples per run: batches of 1 (static cases: the first two) leave towers empty.
# TF 1.15's fused LSTM aborts the process on an empty batch (given sequence lengths).
FUSED_LSTM = getattr(getattr(tf, "contrib", None), "rnn", None)
CASES = ["2-first-static", "2-none-unknown", "3-first-unknown", "3-none-static", "2-accumulated-unknown",
         "3-accumulated-static"]


def _refuse_empty(x):
    """``x`` once it is known to hold an example: an empty one fails the run."""
    check = tf.debugging.assert_positive(tf.shape(x)[0], message="the model ran on an empty batch")
    with tf.control_dependencies([check]):
        return tf.identity(x)


def model_fn(x, y):
    """float64 MLP (and on TF 1.15 a fused LSTM); returns the loss and per-example losses."""
    rng = np.random.RandomState(0)
    w1 = v1.get_variable("w1", dtype=tf.float64, initializer=rng.randn(3, 4) * 0.5)
    w2 = v1.get_variable("w2", dtype=tf.float64, initializer=rng.randn(4, 2) * 0.5)
    hidden = tf.tanh(tf.matmul(_refuse_empty(x), w1))
    if FUSED_LSTM is not None:
        steps = tf.cast(hidden, tf.float32)[None]  # [time 1, batch, 4]
        lengths = tf.fill([tf.shape(x)[0]], 1)
        cell = FUSED_LSTM.LSTMBlockFusedCell(4, name="fused_lstm")
        with v1.variable_scope(v1.get_variable_scope(), initializer=v1.truncated_normal_initializer(seed=2)):
            lstm, _ = cell(steps, dtype=tf.float32, sequence_length=lengths)
        hidden += 1e-3 * tf.cast(lstm[0], tf.float64)
    losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=tf.matmul(hidden, w2))
    return tf.reduce_mean(losses), {"losses": losses}


def _batches(merged=False):
    """The runs' batches; ``merged``: every two runs' examples as one batch (a window of 2)."""
    rng = np.random.RandomState(1)
    batches = [(rng.randn(n, 3), rng.randint(0, 2, n).astype(np.int32)) for n in SIZES]
    if merged:
        return [tuple(np.concatenate(parts) for parts in zip(*batches[i:i + 2])) for i in (0, 2)]
    return batches


def run(case):
    """Returns ``{name: array}``: the loss-only pass, each run's loss, outputs and variables.

    ``case``: ``"one"`` (one device), ``"merged"`` (one device, two runs' examples
    per run) or ``"<towers>-<first|none|accumulated>-<static|unknown>"``.
    """
    towers, update_ops, static = case.split("-") if "-" in case else (1, "first", "unknown")
    graph = tf.Graph()
    found = {}
    with graph.as_default():
        x = v1.placeholder(tf.float64, [1 if static == "static" else None, 3])
        y = v1.placeholder(tf.int32, [x.shape[0]])
        opt = v1.train.AdamOptimizer(0.1)
        if update_ops == "accumulated":
            opt, update_ops = gradaccum.GradientAccumulator(opt, num_micro_batches=2), "first"
        result = tower.minimize(opt, model_fn, [x, y], devices=["/cpu:%d" % i for i in range(int(towers))],
                                update_ops=[] if update_ops == "none" else update_ops)
        variables = [v for v in v1.global_variables() if "GradientAccumulator" not in v.op.name]
        batches = _batches(case == "merged")
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": 3})) as sess:
            sess.run(v1.global_variables_initializer())
            # A validation pass: the loss alone, without the train op.
            found["eval_loss"] = sess.run(result.loss, {x: batches[0][0], y: batches[0][1]})
            for step, (x_value, y_value) in enumerate(batches[:2] if static == "static" else batches):
                _, found["loss@%d" % step], found["outputs@%d" % step] = sess.run(
                    [result.train_op, result.loss, result.outputs["losses"]], {x: x_value, y: y_value})
                found.update(("%s@%d" % (v.op.name, step), value)
                             for v, value in zip(variables, sess.run(variables)))
    return found


def main(out):
    # The suite's TF behaviour, which conftest.py passes on in GRADACCUM_TF_MODE.
    mode = os.environ.get("GRADACCUM_TF_MODE", "tf1")
    (v1.disable_v2_behavior if mode == "tf1" else v1.disable_eager_execution)()
    results = {}
    for case in ["one", "merged"] + CASES:
        results.update(("%s/%s" % (case, key), value) for key, value in run(case).items())
    np.savez(out, **results)


if __name__ == "__main__":
    main(sys.argv[1])
