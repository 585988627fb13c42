"""Tests for what gradaccum.tower.minimize is fed: fewer examples than towers,
sparse inputs, one batch per tower from a callable, per-example outputs.

The empty-shard cases run in a child process (``tower_empty_child.py``): a
kernel that aborts on an empty batch would otherwise end the suite.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import tower
import forkserver

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tower_empty_child as child  # noqa: E402

v1 = tf.compat.v1
DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]


def _session(graph):
    return v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 3}))


# ------------------------------------------------------------ empty shards


@pytest.fixture(scope="module")
def empty_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("empty") / "runs.npz")
    # The session's environment as it is: another TF_CPP_MIN_LOG_LEVEL would run a fresh Python, not a fork.
    done = subprocess.run(forkserver.command() + [os.path.join(HERE, "tower_empty_child.py"), out],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert done.returncode == 0, done.stdout.decode()[-3000:]  # An abort is a failure here.
    return dict(np.load(out))


def _at(runs, case, step):
    prefix = case + "/"
    return dict((key[len(prefix):-len("@%d" % step)], value) for key, value in runs.items()
                if key.startswith(prefix) and key.endswith("@%d" % step))


@pytest.mark.parametrize("case", child.CASES)
def test_towers_without_examples_run_nothing_and_weigh_zero(empty_runs, case):
    """Batches of 1 (and 2) on 2 or 3 towers: the model never sees an empty shard, and
    the loss, outputs, variables and Adam slots equal one device's on the same batches.

    With an accumulator (windows of 2 runs) they equal one device's on each window.
    """
    static = case.endswith("static")
    accumulated = "accumulated" in case
    np.testing.assert_allclose(empty_runs[case + "/eval_loss"], empty_runs["one/eval_loss"], rtol=1e-9)
    steps = 2 if static else len(child.SIZES)
    for step in range(steps):
        got, want = _at(empty_runs, case, step), _at(empty_runs, "one", step)
        assert got["outputs"].shape == (child.SIZES[step],)
        if not accumulated or step == 0:  # Accumulated, later runs see other weights.
            np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-9)
            np.testing.assert_allclose(got["outputs"], want["outputs"], rtol=1e-9)
        if accumulated:
            if step % 2 == 0:
                continue
            want = _at(empty_runs, "merged", step // 2)  # A window's end: one device's update on it.
        names = [key for key in want if key not in ("loss", "outputs")]
        assert len(names) >= 7 and set(names) <= set(got)  # Model, Adam's slots and beta powers.
        for name in names:  # The fused LSTM (TF 1.15) is float32, the rest float64.
            rtol = 1e-9 if want[name].dtype == np.float64 else 1e-5
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-12, err_msg=name)
    assert not np.allclose(_at(empty_runs, "one", 1)["w1"], _at(empty_runs, "one", 0)["w1"])


# ---------------------------------------------- sparse inputs, per-example outputs


def _sparse_model(x, features, y):
    """float64: dense features and a sparse bag of 6 features; returns the loss and per-example logits."""
    rng = np.random.RandomState(0)
    w = v1.get_variable("w", dtype=tf.float64, initializer=rng.randn(3, 2))
    w_sparse = v1.get_variable("w_sparse", dtype=tf.float64, initializer=rng.randn(6, 2))
    logits = tf.matmul(x, w) + tf.sparse.sparse_dense_matmul(features, w_sparse)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return loss, {"logits": logits, "labels": (y,)}


def _sparse_batches(sizes, seed=2):
    """Batches of (x, sparse features as a SparseTensorValue, labels); rows hold 0 to 3 features."""
    rng = np.random.RandomState(seed)
    batches = []
    for size in sizes:
        cells = sorted(set((row, col) for row in range(size) for col in rng.randint(0, 6, rng.randint(0, 4))))
        indices = np.array(cells, np.int64).reshape(-1, 2)
        features = v1.SparseTensorValue(indices, rng.randn(len(cells)), np.array([size, 6], np.int64))
        batches.append((rng.randn(size, 3), features, rng.randint(0, 2, size).astype(np.int32)))
    return batches


def _run_sparse(towers, batches):
    graph = tf.Graph()
    runs = []
    with graph.as_default():
        inputs = [v1.placeholder(tf.float64, [None, 3]), v1.sparse_placeholder(tf.float64, [None, 6]),
                  v1.placeholder(tf.int32, [None])]
        opt = v1.train.AdamOptimizer(0.1)
        if towers:
            result = tower.minimize(opt, _sparse_model, inputs, devices=DEVICES[:towers])
            train_op, loss, outputs = result.train_op, result.loss, result.outputs
        else:
            loss, outputs = _sparse_model(*inputs)
            train_op = opt.minimize(loss)
        variables = v1.global_variables()
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                fetched = sess.run([train_op, loss, outputs], dict(zip(inputs, batch)))[1:]
                runs.append(fetched + [dict((v.op.name, value) for v, value in zip(variables, sess.run(variables)))])
    return runs


@pytest.mark.parametrize("towers", [2, 3])
def test_sparse_inputs_split_by_rows_and_outputs_in_batch_order(towers):
    """A SparseTensor is split by rows like the dense inputs (7 examples: 3/2/2; 2 leaves one
    tower empty); the outputs come back in batch order; all equals one device."""
    batches = _sparse_batches([7, 2, 5, 1])
    want, got = _run_sparse(0, batches), _run_sparse(towers, batches)
    for (loss, outputs, values), (want_loss, want_outputs, want_values), batch in zip(got, want, batches):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
        np.testing.assert_allclose(outputs["logits"], want_outputs["logits"], rtol=1e-12)
        np.testing.assert_array_equal(outputs["labels"][0], batch[2])
        assert sorted(values) == sorted(want_values) and len(values) == 8  # w, w_sparse, their slots, powers.
        for name in want_values:
            np.testing.assert_allclose(values[name], want_values[name], rtol=1e-10, err_msg=name)


# ------------------------------------------------------ one batch per tower


def _dense_model(x, y):
    rng = np.random.RandomState(0)
    w = v1.get_variable("w", dtype=tf.float64, initializer=rng.randn(3, 2))
    logits = tf.matmul(x, w)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)), logits


def _one_device_dense(x_value, y_value, updates):
    """One device, one SGD update per slice: the loss and logits before each, the weights after."""
    with tf.Graph().as_default() as graph:
        x, y = v1.placeholder(tf.float64, [None, 3]), v1.placeholder(tf.int32, [None])
        loss, logits = _dense_model(x, y)
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            found = []
            for examples in updates:
                feed = {x: x_value[examples], y: y_value[examples]}
                found.append(sess.run([loss, logits], feed))
                sess.run(train_op, feed)
                found[-1].append(sess.run(v1.trainable_variables()[0]))
    return found


@pytest.mark.parametrize("accumulate", [False, True], ids=["plain", "accumulated"])
def test_callable_inputs_one_batch_per_tower_weighted_by_its_size(accumulate):
    """Two towers pull 4 + 4, then 4 + 2 examples from an iterator: each update equals one
    device's on the towers' examples together, tower 0's first (accumulated: on all 14)."""
    rng = np.random.RandomState(3)
    x_value, y_value = rng.randn(14, 3), rng.randint(0, 2, 14).astype(np.int32)
    graph = tf.Graph()
    with graph.as_default():
        dataset = tf.data.Dataset.from_tensor_slices((x_value, y_value)).batch(4)
        get_next = v1.data.make_one_shot_iterator(dataset).get_next
        opt = v1.train.GradientDescentOptimizer(0.5)
        if accumulate:
            opt = gradaccum.GradientAccumulator(opt, num_micro_batches=2)
        result = tower.minimize(opt, _dense_model, get_next, devices=DEVICES[:2])
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            start = sess.run(v1.trainable_variables()[0])
            got = [sess.run([result.train_op, result.loss, result.outputs])[1:] + [
                sess.run(v1.trainable_variables()[0])] for _ in range(2)]
    runs = [slice(0, 8), slice(8, 14)]
    want = _one_device_dense(x_value, y_value, [slice(0, 14)] if accumulate else runs)
    assert got[1][1].shape == (6, 2)
    np.testing.assert_allclose(got[0][0], want[0][0] if not accumulate else _one_device_dense(
        x_value, y_value, runs[:1])[0][0], rtol=1e-12)
    if accumulate:
        np.testing.assert_array_equal(got[0][2], start)  # Mid-window: no update yet.
        np.testing.assert_allclose(got[1][2], want[0][2], rtol=1e-12)
        return
    for (loss, outputs, w), (want_loss, want_logits, want_w) in zip(got, want):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-12)
        np.testing.assert_allclose(outputs, want_logits, rtol=1e-12)  # Tower 0's examples first.
        np.testing.assert_allclose(w, want_w, rtol=1e-12)
    assert not np.allclose(want[1][2], start)


# ----------------------------------------------------------------- errors


def _loss_only(x):
    w = v1.get_variable("w", initializer=tf.ones([3, 1]))
    return tf.reduce_mean(tf.matmul(x, w))


def _batches_of(*given):
    """A callable returning ``given``'s items in turn; an int ``n`` is a batch of n examples."""
    given = iter(given)
    return lambda: (lambda item: np.ones((item, 3), np.float32) if isinstance(item, int) else item)(next(given))


@pytest.mark.parametrize("model_fn, inputs, update_ops, error, match", [
    pytest.param(lambda x: gradaccum.ModelResult(_loss_only(x), outputs=tf.reduce_sum(x)), np.ones((4, 3), np.float32),
                 "first", TypeError,
                 r"`model_fn` must return a loss or ModelResult\(loss, outputs=...\), outputs a tensor or a nested "
                 r"structure of tensors with a leading \(batch\) dimension, got <tf.Tensor .*shape=\(\) .* in tower 0",
                 id="scalar-output"),
    pytest.param(_loss_only, _batches_of(2, [np.ones((2, 3)), np.ones((2, 1))]), "first", ValueError,
                 r"`inputs\(\)` must return the same number of inputs for every tower, got 1 for tower 0 and 2 "
                 r"for tower 1", id="callable-mismatch"),
    pytest.param(_loss_only, _batches_of(2, 0), "all", ValueError,
                 r"`inputs\(\)` must give every tower at least one example with update_ops='all' .*got none for "
                 r"tower 1", id="callable-all-empty"),
    pytest.param(_loss_only, _batches_of(0, 2), "first", ValueError,
                 r"`inputs\(\)` must give the first tower at least one example, got none for tower 0",
                 id="callable-first-empty"),
])
def test_feed_errors(model_fn, inputs, update_ops, error, match):
    with tf.Graph().as_default(), pytest.raises(error, match=match):
        tower.minimize(v1.train.GradientDescentOptimizer(0.1), model_fn, inputs, devices=DEVICES[:2],
                       update_ops=update_ops)


def test_result_still_unpacks_as_three():
    with tf.Graph().as_default():
        result = tower.minimize(v1.train.GradientDescentOptimizer(0.1), _loss_only, np.ones((4, 3), np.float32),
                                devices=DEVICES[:2])
        train_op, loss, towers = result
        assert (train_op, loss, towers) == tuple(result) and len(result) == 3 and result.outputs is None
        assert result._replace(loss=None).outputs is None
        assert len(towers) == 2


@pytest.mark.parametrize("update_ops", ["first", "all"])
def test_callable_inputs_empty_batches_checked_at_run_time(update_ops):
    """Each tower's own batch: the first must have an example (with "all", each must); with
    "first" an empty later batch weighs 0 and runs no model, so the update is tower 0's alone."""
    rng = np.random.RandomState(5)
    x_value, y_value = rng.randn(3, 3), rng.randint(0, 2, 3).astype(np.int32)
    graph = tf.Graph()
    with graph.as_default():
        feeds = [(v1.placeholder(tf.float64, [None, 3]), v1.placeholder(tf.int32, [None])) for _ in range(2)]
        given = iter(feeds)
        result = tower.minimize(v1.train.GradientDescentOptimizer(0.5), _dense_model, lambda: next(given),
                                devices=DEVICES[:2], update_ops=update_ops)
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            empty = (x_value[:0], y_value[:0])
            message = ("every tower at least one example" if update_ops == "all"
                       else "the first tower at least one example")
            refused = [[empty, (x_value, y_value)]] + ([[(x_value, y_value), empty]] if update_ops == "all" else [])
            for batches in refused:
                with pytest.raises(tf.errors.InvalidArgumentError, match=r"`inputs\(\)` must give " + message):
                    sess.run(result.train_op, dict(zip(sum(feeds, ()), sum(batches, ()))))
            if update_ops == "first":
                sess.run(result.train_op, dict(zip(sum(feeds, ()), (x_value, y_value) + empty)))
                got = sess.run(v1.trainable_variables()[0])
    if update_ops == "first":
        np.testing.assert_allclose(got, _one_device_dense(x_value, y_value, [slice(0, 3)])[0][2], rtol=1e-12)
