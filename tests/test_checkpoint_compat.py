"""Checkpoint compatibility: every variable keeps its name, shape and dtype.

``tests/data/checkpoint_names.json`` pins the sorted ``[name, shape, dtype]`` of all
global variables (model, the wrapped optimizer's slots and non-slot variables, the
accumulator's state) of each configuration below, as gradaccum 0.1.0 (commit 321f4aa)
creates them. They were the same on TF 1.15 and TF 2.21, in both behaviours (reference
or resource variables keep their names), so one list serves all; a behaviour or version
that named them otherwise would fail here. For each configuration the test writes a checkpoint of
plain variables with exactly the pinned names and known values, builds the
configuration with the gradaccum under test, checks that its variables are exactly the
pinned ones, restores with ``tf.compat.v1.train.Saver`` and compares every value: a
checkpoint written by that release restores into this one.

Regenerate the pinned names (only with the release they pin, e.g.
``PYTHONPATH=<checkout of 321f4aa>``), in the tf1 behaviour::

    python tests/test_checkpoint_compat.py --regenerate
"""
import json
import os
import random
import sys

if __name__ == "__main__":  # As conftest.py does under pytest.
    import importlib.util

    if importlib.util.find_spec("tf_keras") is not None:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import gradaccum  # noqa: E402
from gradaccum import tower  # noqa: E402

v1 = tf.compat.v1
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "checkpoint_names.json")
DEVICES = ["/cpu:0", "/cpu:1"]


def _adam(rate=0.01):
    return v1.train.AdamOptimizer(rate)


def _model(x, ids):
    """A dense variable ``w`` and an embedding ``emb`` (its gradient is ``IndexedSlices``)."""
    w = v1.get_variable("w", [4, 3], initializer=v1.initializers.random_normal(seed=1))
    emb = v1.get_variable("emb", [6, 4], initializer=v1.initializers.random_normal(seed=2))
    return tf.reduce_mean(tf.square(tf.matmul(tf.gather(emb, ids) + x, w)))


def _inputs():
    return v1.placeholder(tf.float32, [None, 4], name="x"), v1.placeholder(tf.int32, [None], name="ids")


def _accumulated(k=4, **kwargs):
    def build():
        x, ids = _inputs()
        step = v1.train.get_or_create_global_step()
        rate = 0.01 * k.learning_rate_multiplier if isinstance(k, gradaccum.AdaptiveBatch) else 0.01
        opt = gradaccum.GradientAccumulator(_adam(rate), k, **kwargs)
        opt.minimize(_model(x, ids), global_step=step, weight=tf.shape(x)[0])
    return build


def _variable_k():
    return _accumulated(k=v1.Variable(4, dtype=tf.int64, trainable=False, name="k"))()


def _towers():
    x, ids = _inputs()
    step = v1.train.get_or_create_global_step()
    opt = gradaccum.GradientAccumulator(_adam(), 2)
    tower.minimize(opt, _model, [x, ids], devices=DEVICES, global_step=step)


def _batch_norm():
    x, ids = _inputs()
    step = v1.train.get_or_create_global_step()
    w = v1.get_variable("w", [4, 3], initializer=v1.initializers.random_normal(seed=1))
    h = gradaccum.batch_normalization(tf.matmul(x, w), True, name="bn")
    loss = tf.reduce_mean(tf.square(h - 1.0))
    gradaccum.GradientAccumulator(_adam(), 2).minimize(loss, global_step=step, weight=tf.shape(x)[0])


CONFIGS = {
    "a_k4_sparse_dense": _accumulated(),
    "b_statistics_skip_nonfinite": _accumulated(statistics=True, skip_nonfinite=True),
    "c_k_variable": _variable_k,
    "c_k_step_schedule": lambda: _accumulated(k=gradaccum.step_schedule([10, 20], [2, 4, 8]))(),
    "c_k_batch_ramp": lambda: _accumulated(k=gradaccum.batch_ramp(8, 8, 64, 32, micro_batch_size=4))(),
    "d_adaptive_batch": lambda: _accumulated(k=gradaccum.AdaptiveBatch(4, max_micro_batches=8))(),
    "e_k1_skip_nonfinite": _accumulated(k=1, skip_nonfinite=True),
    "f_tower_two_cpus_k2": _towers,
    "g_batch_norm_k2": _batch_norm,
}


def _build(config):
    """A fresh graph holding ``config`` (fixed seeds) and its sorted ``[name, shape, dtype]``."""
    graph = tf.Graph()
    random.seed(0)
    with graph.as_default():
        v1.set_random_seed(0)
        CONFIGS[config]()
    variables = graph.get_collection(v1.GraphKeys.GLOBAL_VARIABLES)
    return graph, variables, sorted([v.op.name, v.shape.as_list(), v.dtype.base_dtype.name] for v in variables)


def _session(graph):
    return v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 2}))


def _value(index, shape, dtype):
    """Distinct known values: ``arange`` offset by the variable's index."""
    values = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) + 100 * (index + 1)
    return (values % 2 == 1) if dtype == "bool" else values.astype(dtype)


def _pinned():
    with open(DATA) as data:
        return json.load(data)["configurations"]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_release_checkpoint_restores(config, tmp_path):
    pinned = [(name, tuple(shape), dtype) for name, shape, dtype in _pinned()[config]]
    path = str(tmp_path / "release.ckpt")
    saved = {}
    with tf.Graph().as_default() as graph:  # (1) The release's checkpoint, from plain variables.
        for index, (name, shape, dtype) in enumerate(pinned):
            value = _value(index, shape, dtype)
            saved[name] = (v1.Variable(value, name="saved_%d" % index), value)
        saver = v1.train.Saver({name: variable for name, (variable, _) in saved.items()})
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            saver.save(sess, path)

    graph, variables, current = _build(config)  # (2) This gradaccum's graph restores it.
    current = [(name, tuple(shape), dtype) for name, shape, dtype in current]
    names, pinned_names = set(c[0] for c in current), set(p[0] for p in pinned)
    assert names == pinned_names, "variables renamed, added or removed: missing %s, new %s" % (
        sorted(pinned_names - names), sorted(names - pinned_names))
    assert current == pinned, "shapes or dtypes changed: %s" % sorted(set(current) ^ set(pinned))
    with graph.as_default(), _session(graph) as sess:
        v1.train.Saver().restore(sess, path)
        restored = sess.run({v.op.name: v for v in variables})
    for name, (_, value) in saved.items():
        np.testing.assert_array_equal(restored[name], value, err_msg=name)


def regenerate():
    """Writes ``DATA``: every configuration's sorted ``[name, shape, dtype]``, from the gradaccum imported."""
    configs = [(config, _build(config)[2]) for config in sorted(CONFIGS)]
    origin = "gradaccum %s, TensorFlow %s" % (gradaccum.__version__, tf.__version__)
    lines = ['{"pinned_from": %s,' % json.dumps(origin), ' "configurations": {']
    for index, (config, entries) in enumerate(configs):  # One variable a line: a diff names it.
        lines.append("  %s: [" % json.dumps(config))
        lines += ["   %s," % json.dumps(entry) for entry in entries]
        lines[-1] = lines[-1].rstrip(",")
        lines.append("  ]" + ("," if index < len(configs) - 1 else ""))
    if not os.path.isdir(os.path.dirname(DATA)):
        os.makedirs(os.path.dirname(DATA))
    with open(DATA, "w") as data:
        data.write("\n".join(lines + [" }", "}", ""]))
    print("pinned %d configurations from %s" % (len(configs), gradaccum.__file__))

if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/test_checkpoint_compat.py --regenerate")
    v1.disable_v2_behavior()
    regenerate()
