"""Tests for gradaccum.tower: towers equal one device, placement, batch norm, errors.

Every test builds its own ``tf.Graph`` and runs on four CPU devices made with
``ConfigProto(device_count={"CPU": 4})``.
"""
import warnings

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import tower

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
}
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS


def _session(graph):
    return tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(device_count={"CPU": 4}))


def _device(name):
    return tf.compat.v1.DeviceSpec.from_string(name).to_string()


def _values(sess):
    variables = tf.compat.v1.global_variables()
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


# ------------------------------------------------------- a model without BN


def _variable(name, value):
    return tf.compat.v1.get_variable(name, dtype=tf.float64, initializer=np.asarray(value, np.float64))


def _mlp(x, ids, y):
    """float64 MLP with an embedding (sparse gradient); fixed initial values."""
    rng = np.random.RandomState(0)
    emb = _variable("emb", rng.randn(6, 2))
    w1 = _variable("w1", rng.randn(5, 4) * 0.5)
    b1 = _variable("b1", np.zeros(4))
    w2 = _variable("w2", rng.randn(4, 3) * 0.5)
    hidden = tf.tanh(tf.matmul(tf.concat([x, tf.gather(emb, ids)], 1), w1) + b1)
    logits = tf.matmul(hidden, w2)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _mlp_batches(sizes, seed=1):
    rng = np.random.RandomState(seed)
    return [(rng.randn(n, 3), rng.randint(0, 6, n), rng.randint(0, 3, n)) for n in sizes]


def _mlp_inputs(batch):
    return [tf.compat.v1.placeholder(tf.float64, [batch, 3]), tf.compat.v1.placeholder(tf.int32, [batch]),
            tf.compat.v1.placeholder(tf.int32, [batch])]


def _train(build, batches, inputs_batch=None):
    """Builds a graph with ``build(inputs) -> (train_op, loss)``, runs one step per batch.

    Returns the initial values of every variable, and the loss and the values
    after each step.
    """
    graph = tf.Graph()
    history = []
    with graph.as_default():
        inputs = _mlp_inputs(inputs_batch)
        train_op, loss = build(inputs)
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            initial = _values(sess)
            for batch in batches:
                _, loss_value = sess.run([train_op, loss], dict(zip(inputs, batch)))
                history.append((loss_value, _values(sess)))
    return initial, history


def _one_device(make_optimizer):
    def build(inputs):
        loss = _mlp(*inputs)
        return make_optimizer().minimize(loss), loss
    return build


def _towers(make_optimizer, devices=DEVICES, **kwargs):
    def build(inputs):
        result = tower.minimize(make_optimizer(), _mlp, inputs, devices=devices, **kwargs)
        return result.train_op, result.loss
    return build


def _assert_same_history(actual, expected, rtol=1e-7):
    assert len(actual) == len(expected) == 4
    for (loss, values), (want_loss, want_values) in zip(actual, expected):
        np.testing.assert_allclose(loss, want_loss, rtol=rtol)
        # Same variable names (model, slots, beta powers): checkpoints interchange.
        assert sorted(values) == sorted(want_values)
        assert set(["emb", "w1", "b1", "w2"]) <= set(values)
        for key in want_values:
            np.testing.assert_allclose(values[key], want_values[key], rtol=rtol, atol=1e-12, err_msg=key)


@pytest.mark.parametrize("batch, static", [(12, True), (13, False), (3, True), (3, False)],
                         ids=["12-static", "13-unknown", "3-static", "3-unknown"])
@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_four_towers_equal_one_device(opt, batch, static):
    """13 splits 4/3/3/3; 3 leaves tower 3 empty (weight 0): still the full-batch update.

    ``static``: the placeholders have the batch size in their shape (split
    sizes computed in Python), or ``None`` (computed in the graph).
    """
    batches = _mlp_batches([batch] * 4)
    inputs_batch = batch if static else None
    initial, expected = _train(_one_device(OPTIMIZERS[opt]), batches, inputs_batch)
    _, actual = _train(_towers(OPTIMIZERS[opt]), batches, inputs_batch)
    _assert_same_history(actual, expected)
    assert not np.allclose(expected[-1][1]["w1"], initial["w1"])  # Training moved.


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_towers_with_accumulator_equal_one_device_on_full_batch(opt):
    """4 towers x 3 uneven micro-batches (8, 5, 7 examples) = one step on all 20."""
    sizes = [8, 5, 7, 6, 9, 4]
    micro = _mlp_batches(sizes)
    full = [tuple(np.concatenate(parts) for parts in zip(*micro[i:i + 3])) for i in (0, 3)]
    initial, expected = _train(_one_device(OPTIMIZERS[opt]), full)

    def build(inputs):
        opt_k = gradaccum.GradientAccumulator(OPTIMIZERS[opt](), num_micro_batches=3)
        step = tf.compat.v1.train.get_or_create_global_step()
        result = tower.minimize(opt_k, _mlp, inputs, devices=DEVICES, global_step=step)
        return result.train_op, result.loss

    start, actual = _train(build, micro)
    for window in (0, 1):
        before = actual[3 * window - 1][1] if window else start
        for mid in (3 * window, 3 * window + 1):  # Mid-window runs leave the model alone.
            np.testing.assert_array_equal(actual[mid][1]["w1"], before["w1"])
            assert actual[mid][1]["global_step"] == window
        applied = actual[3 * window + 2][1]
        assert applied["global_step"] == window + 1
        for key in ("emb", "w1", "b1", "w2"):
            np.testing.assert_allclose(applied[key], expected[window][1][key], rtol=1e-7, err_msg=key)


# -------------------------------------------------------------- placement


@pytest.mark.parametrize("variables_device", ["/cpu:0", None])
def test_placement_variables_and_towers(variables_device):
    devices = ["/cpu:1", "/cpu:2", "/cpu:3"]
    want_vars = _device(variables_device or devices[0])
    graph = tf.Graph()
    with graph.as_default():
        inputs = _mlp_inputs(None)
        result = tower.minimize(OPTIMIZERS["adam"](), _mlp, inputs, devices=devices,
                                variables_device=variables_device)
        variables = tf.compat.v1.global_variables()
        assert len(tf.compat.v1.trainable_variables()) == 4  # Shared, not copied per tower.
        assert sorted(set(_device(v.device) for v in variables)) == [want_vars]  # Slots included.
        pinned = set(b"loc:@" + v.op.name.encode() for v in variables)
        for index, (built, device) in enumerate(zip(result.towers, devices)):
            assert (built.device, built.scope) == (device, "tower_%d/" % index)
            ops = [op for op in graph.get_operations() if op.name.startswith(built.scope)]
            # TensorFlow puts variable reads (and ops colocated with a variable) by the variable.
            near_var = [op for op in ops
                        if op.type == "ReadVariableOp" or pinned & set(op.colocation_groups())]
            compute = [op for op in ops if op not in near_var]
            assert sorted(set(_device(op.device) for op in compute)) == [_device(device)]
            assert len([op for op in compute if op.type == "MatMul"]) >= 6  # Forward and gradients.
            assert set(_device(op.device) for op in near_var) <= set(["", want_vars])
        for var in tf.compat.v1.trainable_variables():
            prefix = "tower/average_gradients/%s/" % var.op.name
            averages = [op for op in graph.get_operations() if op.name.startswith(prefix)]
            assert averages and set(_device(op.device) for op in averages) == set([want_vars])
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = dict(zip(inputs, _mlp_batches([7])[0]))
            assert np.isfinite(sess.run([result.train_op, result.loss], feed)[1])


def test_default_devices_and_name():
    """No GPU here: ``devices=None`` means one tower on /cpu:0."""
    with tf.Graph().as_default():
        result = tower.minimize(OPTIMIZERS["sgd"](), _loss_model, np.ones((4, 3), np.float32), name="replica")
        assert [(t.device, t.scope) for t in result.towers] == [("/cpu:0", "replica_0/")]
        assert result.loss.op.name.startswith("replica/")


# ------------------------------------------------------------ batch norm

# tf_keras 2.15 autograph-converts the legacy layers' code on first use (tens of
# seconds here); these models have no Python control flow on tensors to convert.
_no_autograph = tf.autograph.experimental.do_not_convert


def _bn_stats_model(training):
    """Batch norm straight on the input, so its statistics are the data's."""
    @_no_autograph
    def model_fn(x, y):
        h = tf.compat.v1.layers.batch_normalization(x, momentum=0.999, training=training)
        logits = tf.compat.v1.layers.dense(h, 2, kernel_initializer=tf.compat.v1.constant_initializer(0.1))
        return tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
    return model_fn


def _bn_data():
    """16 examples, 4 per tower; shard i has its own mean and spread."""
    rng = np.random.RandomState(3)
    x = np.concatenate([i * 3.0 + (i + 1) * rng.randn(4, 3) for i in range(4)]).astype(np.float32)
    return x, rng.randint(0, 2, 16).astype(np.int32)


def _moving_stats(sess):
    found = dict((v.op.name, v) for v in tf.compat.v1.global_variables())
    return sess.run([found["batch_normalization/moving_mean"], found["batch_normalization/moving_variance"]])


_REFERENCE = {}


def _reference_stats(shards):
    """Moving statistics after one update from each shard alone, on one device (cached)."""
    key = tuple(shard.tobytes() for shard in shards)
    if key not in _REFERENCE:
        _REFERENCE[key] = _compute_reference_stats(shards)
    return _REFERENCE[key]


def _compute_reference_stats(shards):
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        _bn_stats_model(True)(x, tf.zeros([tf.shape(x)[0]], tf.int32))
        with _session(graph) as sess:
            init = tf.compat.v1.global_variables_initializer()
            found = []
            for shard in shards:
                sess.run(init)
                sess.run(tf.compat.v1.get_collection(UPDATE_OPS), {x: shard})
                found.append(_moving_stats(sess))
    return found


@pytest.mark.parametrize("update_ops, training", [
    ("first", "bool"), ("first", "placeholder"), ("all", "bool"), ("all", "placeholder"),
    ([], "placeholder"), (None, "placeholder")])
def test_update_ops_choice_moves_moving_statistics(update_ops, training):
    """[] (and the deprecated None): statistics stay at init; "first": shard 0's update; "all": every shard's."""
    x_value, y_value = _bn_data()
    shards = np.split(x_value, 4)
    graph = tf.Graph()
    with graph.as_default():
        x, y = tf.constant(x_value), tf.constant(y_value)
        is_training = tf.compat.v1.placeholder_with_default(True, []) if training == "placeholder" else True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = tower.minimize(OPTIMIZERS["sgd"](), _bn_stats_model(is_training), [x, y],
                                    devices=DEVICES, update_ops=update_ops)
        deprecations = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
        if update_ops is None:
            assert deprecations == [
                "tower.minimize(update_ops=None) is deprecated: it runs no update ops; say update_ops=[] (none), "
                "'first' or 'all' (every UPDATE_OPS op the model built), which mean the same in minimize, "
                "apply_gradients, tower.minimize and subdivisions.minimize"]
        else:
            assert deprecations == []
        assert [len(graph.get_collection(UPDATE_OPS, t.scope)) for t in result.towers] == [2] * 4
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(result.train_op)
            mean, variance = _moving_stats(sess)
    initial = [np.zeros(3), np.ones(3)]
    single = _reference_stats(shards)
    if update_ops in (None, []):
        np.testing.assert_array_equal(mean, initial[0])
        np.testing.assert_array_equal(variance, initial[1])
    elif update_ops == "first":
        np.testing.assert_allclose(mean, single[0][0], rtol=1e-6)
        np.testing.assert_allclose(variance, single[0][1], rtol=1e-6)
    else:
        # Every tower's update applies; the towers run concurrently, so only the
        # first-order sum of their moves is order-free (momentum 0.999: 0.1 %).
        for got, start, which in ((mean, initial[0], 0), (variance, initial[1], 1)):
            moves = sum(stats[which] - start for stats in single)
            np.testing.assert_allclose(got - start, moves, rtol=1e-2)
            assert not np.allclose(got, single[0][which], rtol=1e-2)


def _quadrant_data(count, seed):
    """8x8 images, far from mean 0 / variance 1 (so BN statistics matter); class = bright quadrant."""
    rng = np.random.RandomState(seed)
    labels = rng.randint(0, 3, count)
    images = rng.randn(count, 8, 8, 1) * 0.7
    for image, label in zip(images, labels):
        row, col = divmod(int(label), 2)
        image[row * 4:row * 4 + 4, col * 4:col * 4 + 4] += 1.5
    return (100.0 + 3.0 * images).astype(np.float32), labels.astype(np.int32)


@_no_autograph
def _cnn(images, training):
    # The input batch norm's statistics do not depend on the weights, so its
    # moving averages converge; without them, inference sees inputs near 100.
    h = tf.compat.v1.layers.batch_normalization(images, momentum=0.8, training=training)
    h = tf.compat.v1.layers.conv2d(h, 4, 3, padding="same", use_bias=False)
    h = tf.nn.relu(tf.compat.v1.layers.batch_normalization(h, momentum=0.8, training=training))
    h = tf.compat.v1.layers.max_pooling2d(h, 2, 2)
    return tf.compat.v1.layers.dense(tf.compat.v1.layers.flatten(h), 3)


def _with_flag(feed, flag, value):
    if flag is not None:
        feed[flag] = value
    return feed


def _accuracy(logits, labels):
    return tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.float32))


@pytest.mark.parametrize("towers, training, update_ops", [
    (2, "placeholder", "first"), (4, "bool", "all"), (3, "placeholder", [])])
def test_batch_norm_cnn_trains_and_evaluates(towers, training, update_ops):
    """Seed 004: the loss falls, the moving statistics move, inference matches training mode.

    With ``update_ops=[]`` (seed 004's bug) the statistics stay at their
    initial values and inference mode is far worse: the check has teeth.
    """
    train_x, train_y = _quadrant_data(48 * 60, seed=4)
    test_x, test_y = _quadrant_data(300, seed=5)
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(7)
        images = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        flag = tf.compat.v1.placeholder(tf.bool, []) if training == "placeholder" else None

        def model_fn(images, labels):
            logits = _cnn(images, True if flag is None else flag)
            return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)

        result = tower.minimize(tf.compat.v1.train.AdamOptimizer(0.01), model_fn, [images, labels],
                                devices=DEVICES[:towers], update_ops=update_ops)
        modes = {}
        for mode in (True, False):  # Evaluation nets share the trained variables.
            with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True):
                modes[mode] = _accuracy(_cnn(images, mode if flag is None else flag), labels)
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            losses = []
            for step in range(60):
                batch = slice(step * 48, (step + 1) * 48)
                feed = _with_flag({images: train_x[batch], labels: train_y[batch]}, flag, True)
                losses.append(sess.run([result.train_op, result.loss], feed)[1])
            moving = sess.run([v for v in tf.compat.v1.global_variables() if "/moving_" in v.op.name])
            accuracy = dict((mode, sess.run(op, _with_flag({images: test_x, labels: test_y}, flag, mode)))
                            for mode, op in modes.items())
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5])
    assert accuracy[True] >= 0.9
    assert len(moving) == 4  # Mean and variance of two batch-norm layers, shared by the towers.
    initial = [np.zeros_like(value) if index % 2 == 0 else np.ones_like(value)
               for index, value in enumerate(moving)]
    if update_ops == []:
        for value, start in zip(moving, initial):
            np.testing.assert_array_equal(value, start)
        assert accuracy[False] < accuracy[True] - 0.3
    else:
        for value, start in zip(moving, initial):
            assert not np.allclose(value, start)
        # The input layer's statistics are the data's.
        np.testing.assert_allclose(moving[0], [train_x.mean()], rtol=0.01)
        np.testing.assert_allclose(moving[1], [train_x.var()], rtol=0.1)
        assert abs(accuracy[False] - accuracy[True]) <= 0.05


def test_update_ops_run_on_every_micro_batch_with_accumulator():
    """With GradientAccumulator(3), BN statistics move on each run; the weights every third."""
    x_value, _ = _bn_data()
    micro = [x_value[i::3][:4] for i in range(3)]  # Three micro-batches of 4 examples.
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3])
        y = tf.constant([0, 1, 0, 1])  # Each tower's shard holds both classes.
        opt = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), num_micro_batches=3)
        result = tower.minimize(opt, _bn_stats_model(True), [x, y], devices=DEVICES[:2])
        kernel = [v for v in tf.compat.v1.trainable_variables() if v.op.name == "dense/kernel"][0]
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            start = sess.run(kernel)
            seen = []
            for batch in micro:
                sess.run(result.train_op, {x: batch})
                seen.append((_moving_stats(sess), sess.run(kernel)))
    np.testing.assert_array_equal(seen[1][1], start)
    assert not np.allclose(seen[2][1], start)
    # Tower 0 of micro-batch i holds its first 2 examples; its update alone, in sequence.
    previous = [np.zeros(3), np.ones(3)]
    for (stats, _), batch in zip(seen, micro):
        moved = _reference_stats([batch[:2]])[0]
        # The reference moved init to 0.999 * init + 0.001 * stat; from `previous` instead:
        expected = [p * 0.999 + (m - 0.999 * init) for p, m, init in
                    zip(previous, moved, [np.zeros(3), np.ones(3)])]
        np.testing.assert_allclose(stats[0], expected[0], rtol=1e-5)
        np.testing.assert_allclose(stats[1], expected[1], rtol=1e-5)
        previous = stats


# ------------------------------------------------------- average_gradients


def _two_vars():
    with tf.compat.v1.device("/cpu:1"):
        a = _variable("a", np.zeros((2, 2)))
    with tf.compat.v1.device("/cpu:2"):
        b = _variable("b", np.zeros(3))
    return a, b


def _const(value):
    return tf.constant(np.asarray(value, dtype=np.float64))


@pytest.mark.parametrize("weights", ["none", "numbers", "tensors"])
def test_average_gradients_weighted(weights):
    shares = {"none": [1.0, 1.0], "numbers": [1.0, 3.0], "tensors": [5.0, 15.0]}[weights]
    graph = tf.Graph()
    with graph.as_default():
        a, b = _two_vars()
        ga = [np.arange(4.0).reshape(2, 2), np.ones((2, 2))]
        gb = [np.array([1.0, 2.0, 3.0]), np.array([4.0, 5.0, -1.0])]
        tower_grads = [[(_const(ga[i]), a), (_const(gb[i]), b)] for i in range(2)]
        given = {"none": None, "numbers": shares, "tensors": [tf.constant(5), tf.constant(15)]}[weights]
        averaged = tower.average_gradients(tower_grads, weights=given)
        assert [var.op.name for _, var in averaged] == ["a", "b"]
        with _session(graph) as sess:
            got = sess.run([grad for grad, _ in averaged])
    share = np.array(shares) / np.sum(shares)
    np.testing.assert_allclose(got[0], share[0] * ga[0] + share[1] * ga[1], rtol=1e-12)
    np.testing.assert_allclose(got[1], share[0] * gb[0] + share[1] * gb[1], rtol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_average_gradients_zero_weight_ignores_nan(dtype):
    """A tower of weight 0 (an empty shard) adds nothing, even a NaN."""
    graph = tf.Graph()
    with graph.as_default():
        a = tf.compat.v1.get_variable("a", initializer=np.zeros((2, 2), dtype), dtype=tf.as_dtype(dtype))
        size = tf.compat.v1.placeholder(tf.int32, [])
        grads = [tf.constant(np.ones((2, 2), dtype)), tf.constant(np.full((2, 2), np.nan, dtype))]
        averaged = tower.average_gradients([[(grads[0], a)], [(grads[1], a)]], weights=[3, size])
        with _session(graph) as sess:
            np.testing.assert_array_equal(sess.run(averaged[0][0], {size: 0}), np.ones((2, 2)))
            assert np.isnan(sess.run(averaged[0][0], {size: 1})).all()


def test_average_gradients_none_dropped_or_zero():
    graph = tf.Graph()
    with graph.as_default():
        a, b = _two_vars()
        with tf.compat.v1.device("/cpu:3"):
            c = _variable("c", np.zeros(1))
        tower_grads = [[(None, a), (_const([1.0, 2.0, 3.0]), b), (None, c)],
                       [(_const(np.ones((2, 2))), a), (None, b), (None, c)]]
        averaged = tower.average_gradients(tower_grads, weights=[1.0, 3.0])
        assert [var.op.name for _, var in averaged] == ["a", "b"]  # c has no gradient anywhere.
        with _session(graph) as sess:
            got_a, got_b = sess.run([grad for grad, _ in averaged])
    np.testing.assert_allclose(got_a, 0.75 * np.ones((2, 2)), rtol=1e-12)
    np.testing.assert_allclose(got_b, 0.25 * np.array([1.0, 2.0, 3.0]), rtol=1e-12)


def test_average_gradients_indexed_slices_stay_sparse_and_placed():
    graph = tf.Graph()
    with graph.as_default():
        with tf.compat.v1.device("/cpu:2"):
            emb = _variable("emb", np.zeros((5, 2)))
        shape = tf.constant([5, 2])
        slices = [tf.IndexedSlices(_const([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 3]), shape),
                  tf.IndexedSlices(_const([[10.0, 20.0]]), tf.constant([3]), shape)]
        (grad, var), = tower.average_gradients([[(slices[0], emb)], [(slices[1], emb)]], weights=[2, 6])
        assert var is emb and isinstance(grad, tf.IndexedSlices)
        assert _device(grad.values.device) == _device("/cpu:2")
        with _session(graph) as sess:
            values, indices, dense = sess.run([grad.values, grad.indices, tf.convert_to_tensor(grad)])
    np.testing.assert_allclose(values, [[0.25, 0.5], [0.75, 1.0], [7.5, 15.0]], rtol=1e-12)
    np.testing.assert_array_equal(indices, [0, 3, 3])
    np.testing.assert_allclose(dense, [[0.25, 0.5], [0, 0], [0, 0], [8.25, 16.0], [0, 0]], rtol=1e-12)


def test_average_gradients_placed_with_variables():
    graph = tf.Graph()
    with graph.as_default():
        a, b = _two_vars()
        tower_grads = [[(_const(np.ones((2, 2))), a), (_const(np.ones(3)), b)]] * 3
        averaged = tower.average_gradients(tower_grads)
        for grad, var in averaged:
            assert _device(grad.device) == _device(var.device) != _device("/cpu:0")
            assert grad.op.name.startswith("average_gradients/%s/" % var.op.name)


def test_average_gradients_errors():
    graph = tf.Graph()
    with graph.as_default():
        a, b = _two_vars()
        g = _const(np.ones((2, 2)))
        with pytest.raises(ValueError, match=r"disagree on the variable list: tower 1 lacks \['a:0'\] "
                                             r"and has extra \['b:0'\]"):
            tower.average_gradients([[(g, a)], [(g, b)]])
        with pytest.raises(ValueError, match="`weights` must be None or a list with one weight per tower"):
            tower.average_gradients([[(g, a)], [(g, a)]], weights=[1.0])
        with pytest.raises(ValueError,
                           match=r"`weights` must be finite numbers >= 0, not all zero, got \[1.0, -1.0\]"):
            tower.average_gradients([[(g, a)], [(g, a)]], weights=[1.0, -1.0])
        with pytest.raises(ValueError, match="`tower_grads` must hold at least one tower, got"):
            tower.average_gradients([])
        with pytest.raises(TypeError, match="`tower_grads` must be a list"):
            tower.average_gradients(None)
        with pytest.raises(TypeError, match=r"`tower_grads\[0\]` must pair gradients with variables"):
            tower.average_gradients([[(g, g)]])


# ---------------------------------------------------------------- errors


def _loss_model(x):
    w = tf.compat.v1.get_variable("w", initializer=tf.ones([3, 1]))
    return tf.reduce_mean(tf.matmul(x, w))


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param(dict(optimizer="sgd"), TypeError,
                 r"`optimizer` must be a tf.compat.v1.train.Optimizer, got str: 'sgd'", id="optimizer"),
    pytest.param(dict(model_fn=3), TypeError, r"`model_fn` must be callable, got 3", id="model_fn"),
    pytest.param(dict(devices=[]), ValueError,
                 r"`devices` must be a non-empty list of device strings, got \[\]", id="devices-empty"),
    pytest.param(dict(devices="/cpu:0"), TypeError,
                 r"`devices` must be a non-empty list of device strings, got '/cpu:0'", id="devices-str"),
    pytest.param(dict(devices=["cpu zero"]), ValueError,
                 r"`devices` must be a device string such as .*'cpu zero'", id="devices-bad"),
    pytest.param(dict(variables_device=0), TypeError,
                 r"`variables_device` must be a device string .*got 0", id="variables_device"),
    pytest.param(dict(update_ops="last"), ValueError,
                 r"`update_ops` must be 'first', 'all' or a list of ops \(\[\]: none\), got 'last'", id="update_ops"),
    pytest.param(dict(name=""), ValueError, r"`name` must be a non-empty string, got ''", id="name"),
    pytest.param(dict(inputs=[]), ValueError,
                 r"`inputs` must be a tensor or a non-empty list of tensors, got \[\]", id="inputs-empty"),
    pytest.param(dict(inputs=object), TypeError, r"`inputs` must be tensors, got <class 'object'>",
                 id="inputs-object"),
    pytest.param(dict(inputs=1.0), ValueError,
                 r"`inputs` must have a leading \(batch\) dimension, got the scalar 1.0", id="inputs-scalar"),
    pytest.param(dict(inputs=[np.ones((4, 3)), np.ones(5)]), ValueError,
                 r"`inputs` must have the same leading \(batch\) dimension, got \[4, 5\]",
                 id="inputs-leading"),
    pytest.param(dict(inputs=np.ones((0, 3))), ValueError,
                 r"`inputs` must hold at least one example, got a batch of 0", id="batch-0"),
    pytest.param(dict(inputs=np.ones((3, 3)), update_ops="all"), ValueError,
                 r"`inputs` must hold at least 4 examples, one per tower, with update_ops='all'.*"
                 r"got a batch of 3", id="batch-below-towers-all"),
    pytest.param(dict(model_fn=lambda x: 1.0), TypeError,
                 r"`model_fn` must return a scalar loss tensor, got 1.0 in tower 0", id="loss-not-tensor"),
    pytest.param(dict(model_fn=lambda x: tf.reduce_sum(tf.cast(x, tf.int32))), TypeError,
                 r"`model_fn` must return a floating-point loss, got dtype int32 in tower 0", id="loss-int"),
    pytest.param(dict(model_fn=lambda x: _loss_model(x) * tf.ones([2])), ValueError,
                 r"`model_fn` must return a scalar loss \(the mean over its shard\), got shape \(2,\) "
                 r"in tower 0", id="loss-not-scalar"),
])
def test_minimize_errors(kwargs, error, match):
    args = dict(optimizer=OPTIMIZERS["sgd"](), model_fn=_loss_model, inputs=np.ones((8, 3), np.float32),
                devices=DEVICES)
    args.update(kwargs)
    with tf.Graph().as_default(), pytest.raises(error, match=match):
        tower.minimize(args.pop("optimizer"), args.pop("model_fn"), args.pop("inputs"), **args)


def _counter_model(x):
    counter = tf.Variable(0.0, name="counter")  # Not shared: a new one per tower.
    return _loss_model(x) + counter


def _keras_model(x):
    return tf.reduce_mean(tf.keras.layers.Dense(1)(x))  # Keras ignores variable_scope reuse.


@pytest.mark.parametrize("model_fn, names", [
    (_counter_model, r"\['tower_1/counter:0'\]"),
    (_keras_model, r"\['tower_1/dense_1/bias:0', 'tower_1/dense_1/kernel:0'\]"),
], ids=["tf.Variable", "keras"])
def test_later_tower_creating_variables_is_an_error(model_fn, names):
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"`model_fn` created variables in tower 1 that tower 0 did not: "
                                             + names):
            tower.minimize(OPTIMIZERS["sgd"](), model_fn, np.ones((8, 3), np.float32), devices=DEVICES)


@pytest.mark.parametrize("update_ops", ["all", "first"])
def test_unknown_batch_checked_at_run_time_before_any_update(update_ops):
    """Documented: fewer examples than towers work except with "all"; 0 never does.

    A failing check stops the run before any update op: nothing changes.
    """
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        y = tf.compat.v1.placeholder(tf.int32, [None])
        result = tower.minimize(OPTIMIZERS["sgd"](), _bn_stats_model(True), [x, y], devices=DEVICES,
                                update_ops=update_ops)
        x_value, y_value = _bn_data()
        too_few = [0, 3] if update_ops == "all" else [0]
        message = "at least 4 examples, one per tower" if update_ops == "all" else "at least one example"
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            before = _values(sess)
            for count in too_few:
                with pytest.raises(tf.errors.InvalidArgumentError, match="`inputs` must hold " + message):
                    sess.run(result.train_op, {x: x_value[:count], y: y_value[:count]})
            differs = "`inputs` must have the same leading .batch. dimension; input 1 differs"
            with pytest.raises(tf.errors.InvalidArgumentError, match=differs):
                sess.run(result.train_op, {x: x_value, y: y_value[:8]})
            after = _values(sess)
            for key in before:
                np.testing.assert_array_equal(after[key], before[key], err_msg=key)
            smallest = 4 if update_ops == "all" else 3  # With "first", tower 3 gets no example.
            loss = sess.run([result.train_op, result.loss], {x: x_value[:smallest], y: y_value[:smallest]})[1]
            assert np.isfinite(loss) and all(np.isfinite(value).all() for value in _values(sess).values())
            assert not np.allclose(_moving_stats(sess)[0], 0.0)
