"""Checkpoints across adding or removing accumulation and towers.

A plain run (one device, Adam, ``global_step``) makes 4 updates on full
batches and saves after 2. Its checkpoint restores into an accumulated graph
(``gradaccum.plain_variables``), on one device or two towers, which then
finishes the run on micro-batches; and an accumulated run saved at a window
boundary restores into the plain graph, which finishes it. Either way the
model, Adam's slots and beta powers and ``global_step`` equal the plain run's.
"""
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import tower

v1 = tf.compat.v1
K = 2  # Micro-batches per full batch.


def _model(x, ids):
    rng = np.random.RandomState(0)
    w = v1.get_variable("w", dtype=tf.float64, initializer=rng.randn(3, 2))
    emb = v1.get_variable("emb", dtype=tf.float64, initializer=rng.randn(5, 3))  # Sparse gradient.
    return tf.reduce_mean(tf.square(tf.matmul(tf.gather(emb, ids) + x, w) - 1.0))


def _full_batches():
    rng = np.random.RandomState(4)
    return [(rng.randn(6, 3), rng.randint(0, 5, 6).astype(np.int32)) for _ in range(4)]


def _graph(accumulate, towers):
    """Builds the train op in a new graph: ``(graph, inputs, train_op, optimizer)``."""
    graph = tf.Graph()
    with graph.as_default():
        inputs = [v1.placeholder(tf.float64, [None, 3]), v1.placeholder(tf.int32, [None])]
        step = v1.train.get_or_create_global_step()
        opt = v1.train.AdamOptimizer(0.05)
        if accumulate:
            opt = gradaccum.GradientAccumulator(opt, num_micro_batches=K)
        if towers > 1:
            train_op = tower.minimize(opt, _model, inputs, devices=["/cpu:0", "/cpu:1"], global_step=step)[0]
        else:
            train_op = opt.minimize(_model(*inputs), global_step=step)
    return graph, inputs, train_op, opt


def _run(sess, built, batches, accumulate):
    """One update per full batch: ``K`` runs of its micro-batches when accumulated."""
    _, inputs, train_op, _ = built
    for batch in batches:
        parts = zip(*[np.array_split(value, K) for value in batch]) if accumulate else [batch]
        for part in parts:
            sess.run(train_op, dict(zip(inputs, part)))


def _values(sess, variables=None):
    variables = v1.global_variables() if variables is None else variables
    return dict((v.op.name, value) for v, value in zip(variables, sess.run(variables)))


def _session(graph):
    return v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 2}))


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """The plain run's checkpoint after 2 updates, and its values after 4."""
    path = str(tmp_path_factory.mktemp("plain") / "model.ckpt")
    built = _graph(False, 1)
    with built[0].as_default(), _session(built[0]) as sess:
        sess.run(v1.global_variables_initializer())
        _run(sess, built, _full_batches()[:2], False)
        v1.train.Saver().save(sess, path)
        _run(sess, built, _full_batches()[2:], False)
        return path, _values(sess)


def _assert_plain_run(values, want):
    assert sorted(values) == sorted(want) and len(want) == 9  # w, emb, 4 slots, 2 powers, global_step.
    assert values["global_step"] == 4
    for name in want:
        np.testing.assert_allclose(values[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)


@pytest.mark.parametrize("towers", [1, 2])
def test_plain_checkpoint_restores_into_accumulated_graph(plain_run, towers):
    path, want = plain_run
    built = _graph(True, towers)
    with built[0].as_default(), _session(built[0]) as sess:
        with pytest.raises(tf.errors.NotFoundError, match="GradientAccumulator/micro_step not found"):
            v1.train.Saver().restore(sess, path)  # Why plain_variables is needed.
        sess.run(v1.global_variables_initializer())  # The accumulator's state starts a window.
        v1.train.Saver(gradaccum.plain_variables(built[3])).restore(sess, path)
        _run(sess, built, _full_batches()[2:], True)
        _assert_plain_run(_values(sess, gradaccum.plain_variables(built[3])), want)


@pytest.mark.parametrize("towers", [1, 2])
def test_accumulated_checkpoint_restores_into_plain_graph(plain_run, towers, tmp_path):
    path = str(tmp_path / "accumulated.ckpt")
    built = _graph(True, towers)
    with built[0].as_default(), _session(built[0]) as sess:
        sess.run(v1.global_variables_initializer())
        _run(sess, built, _full_batches()[:2], True)  # Two whole windows: a boundary.
        v1.train.Saver().save(sess, path)
    built = _graph(False, 1)
    with built[0].as_default(), _session(built[0]) as sess:
        v1.train.Saver().restore(sess, path)  # The accumulator's state is left out.
        _run(sess, built, _full_batches()[2:], False)
        _assert_plain_run(_values(sess), plain_run[1])


def test_plain_variables_errors():
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match=r"`optimizer` must be a tf.compat.v1.train.Optimizer, got str"):
            gradaccum.plain_variables("adam")
        opt = gradaccum.GradientAccumulator(v1.train.AdamOptimizer(0.1), num_micro_batches=2)
        with pytest.raises(ValueError, match=r"`optimizer` must be, or wrap, a GradientAccumulator that has "
                                             r"built its train op in this graph, got <GradientAccumulator"):
            gradaccum.plain_variables(opt)
        opt.minimize(_model(tf.ones([2, 3], tf.float64), tf.zeros([2], tf.int32)))
        with pytest.raises(TypeError, match=r"`var_list` must be None or a list of variables, got 3"):
            gradaccum.plain_variables(opt, var_list=3)
        assert [v.op.name for v in gradaccum.plain_variables(opt)] == [
            "w", "emb", "beta1_power", "beta2_power", "w/Adam", "w/Adam_1", "emb/Adam", "emb/Adam_1"]
