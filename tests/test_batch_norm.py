"""Tests for gradaccum.batch_normalization: the TF layer outside, the whole batch across towers and windows.

Every test builds its own ``tf.Graph``; the sessions have four CPU devices
(``ConfigProto(device_count={"CPU": 4})``). References are
``tf.compat.v1.layers.batch_normalization`` on one device and the whole batch
(or the whole window).
"""
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import _compat
from gradaccum import tower
from test_tower import _quadrant_data

DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"]
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.3),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
}
# tf_keras 2.15 autograph-converts the legacy layers' code on first use (slow);
# nothing here has Python control flow on tensors.
_no_autograph = tf.autograph.experimental.do_not_convert


def _session(graph):
    return tf.compat.v1.Session(graph=graph, config=tf.compat.v1.ConfigProto(device_count={"CPU": 4}))


@_no_autograph
def _tf_layer(inputs, training, **kwargs):
    if _compat.TF_VERSION < (2, 0) and inputs.dtype.base_dtype == tf.float64:
        # TF 1.15's layer tries its float32-only fused kernel on 4-D float64 and fails;
        # fused=False is the path TF 2.x takes for float64 by default.
        kwargs["fused"] = False
    return tf.compat.v1.layers.batch_normalization(inputs, training=training, **kwargs)


LAYERS = {"tf": _tf_layer, "ours": gradaccum.batch_normalization}


def _values(sess):
    variables = tf.compat.v1.global_variables()
    return dict(zip([v.op.name for v in variables], sess.run(variables)))


def _assert_values_close(actual, expected, rtol, atol=1e-12, keys=None):
    for key in keys or sorted(expected):
        np.testing.assert_allclose(actual[key], expected[key], rtol=rtol, atol=atol, err_msg=key)


def _max_difference(actual, expected, keys):
    return max(float(np.max(np.abs(actual[key] - expected[key]))) for key in keys)


# ------------------------------------------------ outside: exactly the TF layer


_LOCAL_CASES = [
    # (shape, dtype, axis, training): which kernel path the TF layer takes is in the id.
    pytest.param((6, 3, 3, 2), np.float32, -1, "true", id="4d-float32-fused"),
    pytest.param((6, 3, 3, 2), np.float32, -1, "placeholder", id="4d-float32-fused-placeholder"),
    pytest.param((6, 2, 3, 3), np.float32, 1, "true", id="4d-float32-fused-channels-first"),
    pytest.param((6, 3, 3, 2), np.float16, -1, "true", id="4d-float16-fused"),
    pytest.param((6, 3, 3, 2), np.float64, -1, "true", id="4d-float64-nonfused"),
    pytest.param((6, 3, 3, 2), np.float32, 2, "true", id="4d-float32-axis2-nonfused"),
    pytest.param((7, 3), np.float64, -1, "placeholder", id="2d-float64-nonfused-placeholder"),
    pytest.param((7, 3), np.float32, -1, "false", id="2d-float32-inference"),
    pytest.param((6, 3, 3, 2), np.float32, -1, "false", id="4d-float32-fused-inference"),
]


def _local_run(layer, shape, dtype, axis, training, **kwargs):
    """Two training runs (output, gradients, update ops), then the variables."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(dtype, shape)
        flag = tf.compat.v1.placeholder(tf.bool, []) if training == "placeholder" else None
        mode = {"true": True, "false": False, "placeholder": flag}[training]
        y = LAYERS[layer](x, mode, axis=axis, momentum=0.9, **kwargs)
        loss = tf.reduce_sum(tf.cast(y, tf.float64) ** 3)
        grads = tf.gradients(loss, [x] + tf.compat.v1.trainable_variables())
        updates = tf.compat.v1.get_collection(UPDATE_OPS)
        names = [v.op.name for v in tf.compat.v1.global_variables()]
        x_value = (np.random.RandomState(0).randn(*shape) * 3 + 5).astype(dtype)
        feed = {x: x_value} if flag is None else {x: x_value, flag: True}
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            found = sess.run([y] + grads, feed)
            for _ in range(2):
                sess.run(updates, feed)
            return names, len(updates) > 0, found, _values(sess)


@pytest.mark.parametrize("shape, dtype, axis, training", _LOCAL_CASES)
def test_outside_towers_equals_tf_layer_bit_for_bit(shape, dtype, axis, training):
    if _compat.TF_VERSION < (2, 0) and axis == 1 and len(shape) == 4:
        pytest.skip("TF 1.15's fused kernel has no NCHW implementation on CPU")
    want_names, want_updates, want, want_values = _local_run("tf", shape, dtype, axis, training)
    names, updates, got, values = _local_run("ours", shape, dtype, axis, training)
    assert names == want_names  # gamma, beta, moving_mean, moving_variance: checkpoints interchange.
    assert updates == want_updates == (training != "false")
    for index, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg="output/gradient %d" % index)
    for key in want_values:
        np.testing.assert_array_equal(values[key], want_values[key], err_msg=key)
    if training != "false":
        assert not np.allclose(values[names[-2]], 0.0)  # The moving mean moved.


def test_names_scale_center_and_reuse_like_tf_layer():
    def build(layer):
        with tf.Graph().as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, 4])
            LAYERS[layer](x, True)
            LAYERS[layer](x, True, center=False, name="named")
            LAYERS[layer](x, True, scale=False)
            with tf.compat.v1.variable_scope("outer"):
                LAYERS[layer](x, True)
            with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True):
                LAYERS[layer](x, False, center=False, name="named")
            return ([(v.op.name, tuple(v.shape.as_list())) for v in tf.compat.v1.global_variables()],
                    [v.op.name for v in tf.compat.v1.trainable_variables()])

    assert build("ours") == build("tf")


@pytest.mark.parametrize("kwargs, error, match", [
    pytest.param(dict(inputs=np.ones((4, 3), np.int32)), TypeError,
                 r"`inputs` must have dtype float16, bfloat16, float32 or float64, got int32", id="int-input"),
    pytest.param(dict(inputs="x"), TypeError, r"`inputs` must have dtype .* got string", id="str-input"),
    pytest.param(dict(inputs=np.ones(4, np.float32)), ValueError,
                 r"`inputs` must have a known rank >= 2 .*got shape \(4,\)", id="rank-1"),
    pytest.param(dict(axis=2), ValueError, r"`axis` must be a channel axis in \[-2, 2\) .* got 2", id="axis-big"),
    pytest.param(dict(axis=-3), ValueError, r"`axis` must be a channel axis .* got -3", id="axis-small"),
    pytest.param(dict(axis=0), ValueError, r"`axis` must be .*other than the batch axis 0.* got 0", id="axis-batch"),
    pytest.param(dict(axis=[1]), TypeError, r"`axis` must be an int \(the channel axis\), got \[1\]", id="axis-list"),
    pytest.param(dict(momentum=1.0), ValueError, r"`momentum` must be a number in \[0, 1\), got 1.0", id="momentum-1"),
    pytest.param(dict(momentum=-0.1), ValueError, r"`momentum` must be a number in \[0, 1\), got -0.1",
                 id="momentum-negative"),
    pytest.param(dict(momentum="0.9"), TypeError, r"`momentum` must be a number in \[0, 1\), got '0.9'",
                 id="momentum-str"),
    pytest.param(dict(epsilon=0.0), ValueError, r"`epsilon` must be a finite number > 0, got 0.0", id="epsilon"),
    pytest.param(dict(center=1), TypeError, r"`center` must be a bool, got 1", id="center"),
    pytest.param(dict(training="yes"), TypeError,
                 r"`training` must be a Python bool or a scalar tf.bool tensor, got 'yes'", id="training"),
    pytest.param(dict(name=""), ValueError, r"`name` must be a non-empty string, got ''", id="name"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(inputs=np.ones((4, 3), np.float32), training=True)
    args.update(kwargs)
    with tf.Graph().as_default(), pytest.raises(error, match=match):
        gradaccum.batch_normalization(args.pop("inputs"), args.pop("training"), **args)
    with tf.Graph().as_default():  # Nothing half-built.
        with pytest.raises(ValueError, match=r"`inputs` must have a static size along `axis` 1"):
            gradaccum.batch_normalization(tf.compat.v1.placeholder(tf.float32, [None, None]), True)
        assert not tf.compat.v1.global_variables()


def test_update_fed_training_false_writes_nothing():
    """The per-run update with ``training`` fed False leaves the moving statistics alone (even where
    TF 1.15's fused CPU kernel returns uninitialised batch statistics)."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 3, 3, 2])
        flag = tf.compat.v1.placeholder(tf.bool, [])
        y = gradaccum.batch_normalization(x, flag)
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            feed = {x: np.random.RandomState(0).randn(4, 3, 3, 2) + 3, flag: False}
            sess.run([y] + tf.compat.v1.get_collection(UPDATE_OPS), feed)
            mean, variance = sess.run(tf.compat.v1.global_variables()[-2:])
    np.testing.assert_array_equal(mean, np.zeros(2))
    np.testing.assert_array_equal(variance, np.ones(2))


def test_tower_building_more_layers_than_tower_0_is_an_error():
    def model_fn(x):
        h = gradaccum.batch_normalization(x, True, name="bn")
        if tf.compat.v1.get_default_graph().get_name_scope().startswith("tower_1"):
            h = gradaccum.batch_normalization(h, True, name="bn")  # Reuses tower 0's variables.
        return tf.reduce_mean(h)

    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"`model_fn` built more synchronized layers in tower 1 than in "
                                             r"tower 0 \(call 1: bn\); every tower must build the same model"):
            tower.minimize(OPTIMIZERS["sgd"](), model_fn, np.ones((4, 3), np.float32), devices=DEVICES[:2])


# ------------------------------------------------------ towers: the whole batch


def _constant_variable(name, value):
    return tf.compat.v1.get_variable(name, dtype=tf.float64, initializer=np.asarray(value, np.float64))


def _cnn(layer, training=True):
    """float64 CNN with batch norm on the input, after a conv and after a dense layer."""
    rng = np.random.RandomState(0)
    kernel = _constant_variable("conv", rng.randn(3, 3, 2, 4) * 0.3)
    dense = _constant_variable("dense", rng.randn(4, 5) * 0.5)
    out = _constant_variable("out", rng.randn(5, 3) * 0.5)
    bn = LAYERS[layer]

    def model_fn(images, labels):
        h = bn(images, training, momentum=0.8)
        h = tf.nn.conv2d(h, kernel, [1, 1, 1, 1], "SAME")
        h = tf.nn.relu(bn(h, training, momentum=0.8))
        h = tf.matmul(tf.reduce_mean(h, [1, 2]), dense)
        h = tf.nn.relu(bn(h, training, momentum=0.8, epsilon=1e-2))
        logits = tf.matmul(h, out)
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))

    return model_fn


def _cnn_batches(sizes, seed=1):
    """Images far from mean 0 / variance 1, per-channel offsets: statistics matter."""
    rng = np.random.RandomState(seed)
    return [(5.0 + rng.randn(n, 6, 6, 2) * [1.0, 3.0] + [0.0, 2.0], rng.randint(0, 3, n)) for n in sizes]


def _cnn_train(build, batches, opt):
    """Builds ``build(optimizer, model_fn, inputs) -> (train_op, loss)``; one run per batch."""
    graph = tf.Graph()
    with graph.as_default():
        images = tf.compat.v1.placeholder(tf.float64, [None, 6, 6, 2])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        train_op, loss = build(OPTIMIZERS[opt](), [images, labels])
        history = []
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            initial = _values(sess)
            for batch in batches:
                history.append((sess.run([train_op, loss], dict(zip([images, labels], batch)))[1], _values(sess)))
    return initial, history


def _one_device(layer="tf"):
    def build(opt, inputs):
        loss = _cnn(layer)(*inputs)
        with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS)):
            return opt.minimize(loss), loss
    return build


def _on_towers(count, layer="ours"):
    def build(opt, inputs):
        result = tower.minimize(opt, _cnn(layer), inputs, devices=DEVICES[:count])
        return result.train_op, result.loss
    return build


_MODEL = ["conv", "dense", "out"] + ["batch_normalization%s/%s" % (suffix, name)
                                     for suffix in ("", "_1", "_2") for name in ("gamma", "beta")]
_MOVING = ["batch_normalization%s/%s" % (suffix, name)
           for suffix in ("", "_1", "_2") for name in ("moving_mean", "moving_variance")]


_REFERENCE = {}


def _reference(sizes, opt):
    """One device, TF layer, whole batches (cached: several tests compare with it)."""
    if (tuple(sizes), opt) not in _REFERENCE:
        _REFERENCE[tuple(sizes), opt] = _cnn_train(_one_device(), _cnn_batches(sizes), opt)
    return _REFERENCE[tuple(sizes), opt]


@pytest.mark.parametrize("towers, sizes, opt", [(2, [7, 8, 9], "sgd"), (4, [11, 3, 13], "adam")],
                         ids=["2-towers-uneven-sgd", "4-towers-uneven-and-empty-adam"])
def test_towers_equal_one_device_with_tf_layer_on_whole_batch(towers, sizes, opt):
    """Variables, Adam's slots and moving statistics after 3 steps: float64 to 1e-9.

    Splits: 4/3, 4/4, 5/4 on 2 towers; 3/3/3/2, 1/1/1/0 (an empty tower,
    weight 0), 4/3/3/3 on 4. The same model with per-tower statistics (the TF
    layer in each tower) does not match.
    """
    initial, expected = _reference(sizes, opt)
    _, synced = _cnn_train(_on_towers(towers), _cnn_batches(sizes), opt)
    assert sorted(synced[-1][1]) == sorted(expected[-1][1])  # Same names: checkpoints interchange.
    for (loss, values), (want_loss, want_values) in zip(synced, expected):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-9)
        _assert_values_close(values, want_values, rtol=1e-9, atol=1e-11)
    assert _max_difference(expected[-1][1], initial, _MODEL) > 1e-2  # Training moved.
    assert _max_difference(expected[-1][1], initial, _MOVING) > 1e-1
    if towers == 2:  # Teeth: per-tower statistics.
        _, per_tower = _cnn_train(_on_towers(towers, layer="tf"), _cnn_batches(sizes), opt)
        assert _max_difference(per_tower[-1][1], expected[-1][1], _MODEL) > 1e-4
        assert _max_difference(per_tower[-1][1], expected[-1][1], _MOVING) > 1e-3


def test_update_ops_all_runs_the_same_single_update_as_first():
    """Only tower 0 builds the update (from the global statistics): "all" = "first" = one device."""
    def build(opt, inputs):
        result = tower.minimize(opt, _cnn("ours"), inputs, devices=DEVICES[:2], update_ops="all")
        graph = tf.compat.v1.get_default_graph()
        assert [len(graph.get_collection(UPDATE_OPS, t.scope)) for t in result.towers] == [3, 0]
        return result.train_op, result.loss

    _, expected = _reference([7, 8, 9], "sgd")
    _, every = _cnn_train(build, _cnn_batches([7, 8, 9]), "sgd")
    _assert_values_close(every[-1][1], expected[-1][1], rtol=1e-9, atol=1e-11)


def test_gradient_through_shared_statistics_matches_finite_differences():
    """The all-reduce's gradient, weighted for uneven shards (5 = 3 + 2), against central differences."""
    rng = np.random.RandomState(2)
    x_value, w_value = rng.randn(5, 3) * 2 + 1, rng.randn(3, 2)
    graph = tf.Graph()
    with graph.as_default():
        w = _constant_variable("w", w_value)

        def model_fn(x):
            h = gradaccum.batch_normalization(tf.matmul(x, w), True)
            return tf.reduce_mean(tf.sin(3.0 * h) * [1.0, -2.0])

        result = tower.minimize(OPTIMIZERS["sgd"](), model_fn, tf.constant(x_value), devices=DEVICES[:2])
        grads = [dict((v.op.name, g) for g, v in t.grads_and_vars)["w"] for t in result.towers]
        averaged = tower.average_gradients([[(g, w)] for g in grads], weights=[3, 2])[0][0]
        value = tf.compat.v1.placeholder(tf.float64, w_value.shape)
        load = w.assign(value)
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            analytic = sess.run(averaged)
            numeric = np.zeros_like(w_value)
            for index in np.ndindex(*w_value.shape):
                losses = []
                for step in (1e-6, -1e-6):
                    moved = w_value.copy()
                    moved[index] += step
                    sess.run(load, {value: moved})
                    losses.append(sess.run(result.loss))
                numeric[index] = (losses[0] - losses[1]) / 2e-6
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    assert np.abs(analytic).max() > 0.1


def _float32_cnn(layer, training):
    """The tower tests' CNN with fixed weights: fused batch norm on 4-D float32 inputs."""
    rng = np.random.RandomState(0)
    kernel = tf.compat.v1.get_variable("conv", initializer=(rng.randn(3, 3, 1, 4) * 0.3).astype(np.float32))
    dense = tf.compat.v1.get_variable("dense", initializer=(rng.randn(64, 3) * 0.2).astype(np.float32))

    def logits_fn(images):
        h = LAYERS[layer](images, training, momentum=0.8)
        h = tf.nn.conv2d(h, kernel, [1, 1, 1, 1], "SAME")
        h = tf.nn.relu(LAYERS[layer](h, training, momentum=0.8))
        h = tf.nn.max_pool2d(h, 2, 2, "VALID")
        return tf.matmul(tf.reshape(h, [-1, 64]), dense)

    return logits_fn


def _accuracy(logits, labels):
    return tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.float32))


def _train_and_evaluate(layer, towers, steps, batch=48):
    """Seed 004: a ``training`` placeholder, Adam, then inference mode on held-out data."""
    train_x, train_y = _quadrant_data(batch * steps, seed=4)
    test_x, test_y = _quadrant_data(300, seed=5)
    graph = tf.Graph()
    with graph.as_default():
        images = tf.compat.v1.placeholder(tf.float32, [None, 8, 8, 1])
        labels = tf.compat.v1.placeholder(tf.int32, [None])
        flag = tf.compat.v1.placeholder(tf.bool, [])
        net = _float32_cnn(layer, flag)

        def model_fn(images, labels):
            return tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, net(images))

        result = tower.minimize(tf.compat.v1.train.AdamOptimizer(0.01), model_fn, [images, labels],
                                devices=DEVICES[:towers])
        with tf.compat.v1.variable_scope(tf.compat.v1.get_variable_scope(), reuse=True):
            accuracy = _accuracy(net(images), labels)  # Shares the trained variables.
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for step in range(steps):
                part = slice(step * batch, (step + 1) * batch)
                sess.run(result.train_op, {images: train_x[part], labels: train_y[part], flag: True})
            values = _values(sess)
            return values, sess.run(accuracy, {images: test_x, labels: test_y, flag: False})


def test_fused_path_on_towers_equals_tf_fused_layer_in_float32():
    """4-D float32: the moving variance carries n/(n-1) with n the whole batch's count, as the fused kernel's."""
    expected, _ = _train_and_evaluate("tf", 1, steps=3)
    synced, _ = _train_and_evaluate("ours", 4, steps=3)
    moving = [key for key in expected if "/moving_" in key]
    assert len(moving) == 4
    _assert_values_close(synced, expected, rtol=2e-4, atol=1e-5)
    # Teeth: the biased variance would be off by (n-1)/n = 1 - 1/3072 in the input layer's update.
    np.testing.assert_allclose(synced["batch_normalization/moving_variance"],
                               expected["batch_normalization/moving_variance"], rtol=1e-5)


def test_seed_004_towers_train_and_evaluate_like_one_device():
    one_values, one_accuracy = _train_and_evaluate("tf", 1, steps=40)
    values, accuracy = _train_and_evaluate("ours", 2, steps=40)
    assert one_accuracy >= 0.9 and accuracy >= 0.9
    assert abs(accuracy - one_accuracy) <= 0.05
    # The input layer's moving statistics are the data's (the model's only input statistics).
    np.testing.assert_allclose(values["batch_normalization/moving_mean"],
                               one_values["batch_normalization/moving_mean"], rtol=1e-3)


# ------------------------------------------ windows: the moving statistics of the whole window


_MOVING_FIRST = ["batch_normalization/moving_mean", "batch_normalization/moving_variance"]


def _window_data(sizes, windows, shape, dtype, seed=3, offset=0.0, spread=1.0):
    """``windows`` lists of micro-batches ``(x, y)``; each micro-batch has its own shift,
    so the spread between micro-batch means matters (a mean of their variances is wrong)."""
    rng = np.random.RandomState(seed)
    data = []
    for _ in range(windows):
        micro = []
        for index, size in enumerate(sizes):
            shift = offset + 2.0 * index * np.linspace(1.0, -1.0, shape[-1])
            x = (shift + spread * rng.randn(size, *shape) * np.linspace(0.5, 2.0, shape[-1])).astype(dtype)
            micro.append((x, rng.randint(0, 2, size).astype(np.int32)))
        data.append(micro)
    return data


def _whole(window):
    return tuple(np.concatenate(parts) for parts in zip(*window))


def _first_layer_model(layer, x, y, momentum=0.9):
    """Batch norm straight on the input, so its statistics are the data's whatever the weights."""
    h = LAYERS[layer](x, True, momentum=momentum)
    features = int(np.prod(x.shape.as_list()[1:]))
    rng = np.random.RandomState(5)
    kernel = tf.compat.v1.get_variable("kernel", dtype=x.dtype,
                                       initializer=rng.randn(features, 2).astype(x.dtype.as_numpy_dtype))
    logits = tf.matmul(tf.reshape(h, [-1, features]), kernel)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))


def _placeholders(shape, dtype):
    return tf.compat.v1.placeholder(dtype, [None] + list(shape)), tf.compat.v1.placeholder(tf.int32, [None])


def _run_window(data, shape, dtype, opt, k, build, momentum=0.9):
    """Runs every micro-batch of ``data``; returns the variables after each run."""
    graph = tf.Graph()
    with graph.as_default():
        x, y = _placeholders(shape, dtype)
        train_op = build(OPTIMIZERS[opt](), x, y, k, momentum)
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for micro in (m for window in data for m in window):
                sess.run(train_op, {x: micro[0], y: micro[1]})
                seen.append(_values(sess))
    return seen


def _accumulated(layer="ours", **kwargs):
    def build(optimizer, x, y, k, momentum):
        opt = gradaccum.GradientAccumulator(optimizer, num_micro_batches=k, **kwargs)
        step = tf.compat.v1.train.get_or_create_global_step()
        return opt.minimize(_first_layer_model(layer, x, y, momentum), global_step=step, weight=tf.shape(x)[0])
    return build


def _full_batch(optimizer, x, y, k, momentum):
    loss = _first_layer_model("tf", x, y, momentum)
    with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS)):
        return optimizer.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())


def _simulated(data, axes, fused, how, momentum=0.9):
    """Moving statistics after each window, in numpy: "window" (pooled), "micro" (every
    micro-batch, today's TF layer under accumulation) or "mean_of_variances"."""
    decay = (np.float32(1) - np.float32(momentum)) if fused else np.float32(1 - momentum)
    decay = float(decay)
    mean, variance = 0.0, 1.0
    found = []

    def update(mean, variance, batch_mean, batch_variance):
        return mean - (mean - batch_mean) * decay, variance - (variance - batch_variance) * decay

    for window in data:
        xs = [np.asarray(x, np.float64) for x, _ in window]
        if how == "micro":
            for x in xs:
                n = x.size / x.shape[-1]
                mean, variance = update(mean, variance, x.mean(axes), x.var(axes) * (n / (n - 1) if fused else 1))
        else:
            whole = np.concatenate(xs)
            n = whole.size / whole.shape[-1]
            batch_variance = whole.var(axes) * (n / (n - 1) if fused else 1)
            if how == "mean_of_variances":
                batch_variance = np.mean([x.var(axes) for x in xs], axis=0)
            mean, variance = update(mean, variance, whole.mean(axes), batch_variance)
        found.append((mean, variance))
    return found


@pytest.mark.parametrize("shape, dtype, opt, rtol", [
    pytest.param((3,), np.float64, "sgd", 1e-9, id="2d-float64-nonfused-sgd"),
    pytest.param((3,), np.float64, "adam", 1e-9, id="2d-float64-nonfused-adam"),
    pytest.param((3, 3, 2), np.float32, "adam", 2e-6, id="4d-float32-fused-adam"),
])
def test_window_moving_statistics_equal_full_batch_steps(shape, dtype, opt, rtol):
    """k = 4 uneven micro-batches, 3 windows: the moving statistics of one TF-layer step per window.

    Teeth: per-micro-batch updates and a mean of micro-batch variances are
    computed too, and are far outside the tolerance.
    """
    data = _window_data([5, 3, 6, 2], 3, shape, dtype)
    fused = len(shape) == 3
    ours = _run_window(data, shape, dtype, opt, 4, _accumulated())
    full = _run_window([[_whole(window)] for window in data], shape, dtype, opt, 1, _full_batch)
    axes = tuple(range(len(shape)))
    simulated = dict((how, _simulated(data, axes, fused, how)) for how in ("window", "micro", "mean_of_variances"))
    for window in range(3):
        got, want = ours[4 * window + 3], full[window]
        _assert_values_close(got, want, rtol=rtol, atol=1e-7 * rtol, keys=_MOVING_FIRST)
        before = ours[4 * window - 1] if window else None
        for mid in range(4 * window, 4 * window + 3):  # Mid-window runs leave the moving statistics alone.
            for key, start in zip(_MOVING_FIRST, (0.0, 1.0)):
                np.testing.assert_array_equal(ours[mid][key], before[key] if before else np.full(shape[-1], start))
        for how, stats in simulated.items():
            moved = [abs(stats[window][i] - want[key]).max() / abs(want[key]).max()
                     for i, key in enumerate(_MOVING_FIRST)]
            if how == "window":
                assert max(moved) < 10 * rtol  # The simulation is right...
            else:
                assert max(moved) > 1e-2, how  # ...and the alternatives are far off.
    assert ours[-1]["global_step"] == 3


def test_window_variance_is_stable_in_float32_far_from_zero():
    """Mean 1e4 times the spread: the pairwise combination keeps float32 accuracy.

    Momentum 0, so the moving statistics are the pooled window's. Teeth:
    E[x^2] - E[x]^2 over raw float32 sums is computed too, and is far off.
    (Without adding back the float32 micro-batch means' rounding, the spread
    between them puts the variance about 3e-4 off.)
    """
    data = _window_data([7, 4, 9, 5], 1, (3,), np.float32, offset=1e4, spread=0.5)
    ours = _run_window(data, (3,), np.float32, "sgd", 4, _accumulated(), momentum=0.0)[-1]
    whole = _whole(data[0])[0]
    want_mean, want_variance = whole.astype(np.float64).mean(0), whole.astype(np.float64).var(0)
    np.testing.assert_allclose(ours["batch_normalization/moving_mean"], want_mean, rtol=1e-6)
    np.testing.assert_allclose(ours["batch_normalization/moving_variance"], want_variance, rtol=1e-6)
    sums = [np.float32(0)] * 2
    for x, _ in data[0]:
        sums = [sums[0] + x.sum(0, dtype=np.float32), sums[1] + (x * x).sum(0, dtype=np.float32)]
    count = np.float32(len(whole))
    naive = sums[1] / count - (sums[0] / count) ** 2
    assert np.abs(naive - want_variance).max() > 0.1 * want_variance.max()


@pytest.mark.parametrize("skipper", ["skip_nonfinite", "loss_scale"])
def test_window_skipped_leaves_moving_statistics_and_next_window_is_exact(skipper):
    """A non-finite window (``skip_nonfinite``, or the overflow that the wrapped loss-scale
    optimizer skips on its own) moves nothing; the next window is still its own pooled step."""
    # TF's loss-scale optimizer takes float32 losses only.
    dtype, rtol = (np.float32, 1e-5) if skipper == "loss_scale" else (np.float64, 1e-9)
    data = _window_data([4, 6, 5], 3, (3,), dtype)
    graph = tf.Graph()
    with graph.as_default():
        x, y = _placeholders((3,), tf.as_dtype(dtype))
        scale = tf.compat.v1.placeholder_with_default(tf.constant(1.0, tf.as_dtype(dtype)), [])
        if skipper == "loss_scale":
            inner = tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer(OPTIMIZERS["sgd"](), "dynamic")
            opt = gradaccum.GradientAccumulator(inner, num_micro_batches=3)
        else:
            opt = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), num_micro_batches=3, skip_nonfinite=True)
        train_op = opt.minimize(_first_layer_model("ours", x, y) * scale, weight=tf.shape(x)[0])
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for window, micro_batches in enumerate(data):
                for index, (x_value, y_value) in enumerate(micro_batches):
                    nan = window == 1 and index == 1
                    sess.run(train_op, {x: x_value, y: y_value, scale: np.nan if nan else 1.0})
                seen.append(_values(sess))
            assert sess.run(opt.skipped_windows) == 1
    if skipper == "loss_scale":  # The loss-scale optimizer itself saw the overflow, and halved its scale.
        (key,) = [key for key in seen[0] if key.endswith("current_loss_scale")]
        assert seen[1][key] == seen[0][key] / 2, (seen[0][key], seen[1][key])
    expected = _simulated([data[0], data[2]], (0,), False, "window")
    for key, index in zip(_MOVING_FIRST, (0, 1)):
        np.testing.assert_array_equal(seen[1][key], seen[0][key])  # The skipped window moved nothing.
        np.testing.assert_allclose(seen[0][key], expected[0][index], rtol=rtol)
        np.testing.assert_allclose(seen[2][key], expected[1][index], rtol=rtol)


def test_window_resumes_mid_window_bit_exactly(tmp_path):
    """The window's statistics are checkpointed: save after 2 of 4 micro-batches, restore, finish."""
    data = _window_data([5, 3, 6, 2], 2, (3,), np.float64)
    micro = [m for window in data for m in window]

    def run(batches, restore=None, save=None):
        graph = tf.Graph()
        with graph.as_default():
            x, y = _placeholders((3,), tf.float64)
            train_op = _accumulated()(OPTIMIZERS["adam"](), x, y, 4, 0.9)
            names = sorted(v.op.name for v in tf.compat.v1.global_variables())
            saver = tf.compat.v1.train.Saver()
            with _session(graph) as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                if restore:
                    saver.restore(sess, restore)
                for x_value, y_value in batches:
                    sess.run(train_op, {x: x_value, y: y_value})
                if save:
                    saver.save(sess, save)
                return _values(sess), names

    straight, names = run(micro)
    assert set(["batch_normalization/window_count", "batch_normalization/window_mean",
                "batch_normalization/window_m2"]) <= set(names)
    path = str(tmp_path / "mid")
    run(micro[:6], save=path)  # Window 2, after 2 of its 4 micro-batches.
    resumed, _ = run(micro[6:], restore=path)
    for key in straight:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


def test_k_1_and_no_accumulator_equal_tf_layer_exactly():
    data = _window_data([6], 3, (3,), np.float64)
    want = _run_window(data, (3,), np.float64, "adam", 1, _full_batch)
    got = _run_window(data, (3,), np.float64, "adam", 1, _accumulated())
    for a, b in zip(got, want):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert not any("window_" in key for key in got[-1])  # No window variables: checkpoints interchange.


def test_towers_times_window_equal_one_device_on_whole_window():
    """2 towers x k = 3 uneven micro-batches: moving statistics of one TF-layer step on the whole
    window; variables of one device accumulating the same micro-batches (each micro-batch
    normalised with its own statistics, across the towers)."""
    data = _window_data([5, 4, 6], 2, (3,), np.float64)

    def on_towers(optimizer, x, y, k, momentum):
        opt = gradaccum.GradientAccumulator(optimizer, num_micro_batches=k)
        step = tf.compat.v1.train.get_or_create_global_step()
        model_fn = lambda x, y: _first_layer_model("ours", x, y, momentum)  # noqa: E731
        return tower.minimize(opt, model_fn, [x, y], devices=DEVICES[:2], global_step=step).train_op

    towers = _run_window(data, (3,), np.float64, "adam", 3, on_towers)
    full = _run_window([[_whole(window)] for window in data], (3,), np.float64, "adam", 1, _full_batch)
    one_device = _run_window(data, (3,), np.float64, "adam", 3, _accumulated())
    for window in range(2):
        got = towers[3 * window + 2]
        _assert_values_close(got, full[window], rtol=1e-9, keys=_MOVING_FIRST)
        _assert_values_close(got, one_device[3 * window + 2], rtol=1e-9, keys=["kernel", "global_step"])
    assert not np.allclose(towers[-1]["kernel"], towers[0]["kernel"])


@pytest.fixture(scope="module")
def example():
    """``examples/fashion_mnist_subdivision.py`` loaded as a module."""
    import example_module

    return example_module.load("fashion_mnist_subdivision", "fashion_mnist_subdivision_for_bn")


def test_every_layer_of_example_cnn_gets_its_pooled_window_statistics(example):
    """Learning rate 0, k = 3 uneven micro-batches, 2 windows: each of the five batch-norm layers'
    moving statistics are one update from the statistics of all the inputs it saw in the window.

    Teeth: today's per-micro-batch updates, computed from the same inputs, are far off.
    """
    seen_inputs = []

    def recording(inputs, **kwargs):
        seen_inputs.append(inputs)
        return gradaccum.batch_normalization(inputs, **kwargs)

    rng = np.random.RandomState(6)
    data = [[(rng.rand(n, 12, 12, 1).astype(np.float32), rng.randint(0, 10, n).astype(np.int32))
             for n in (4, 3, 5)] for _ in range(2)]
    graph = tf.Graph()
    with graph.as_default():
        x, y = _placeholders((12, 12, 1), tf.float32)
        logits = example.build_logits(x, True, 2, batch_norm=recording, momentum=0.9)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        opt = gradaccum.GradientAccumulator(tf.compat.v1.train.GradientDescentOptimizer(0.0), 3)
        train_op = opt.minimize(loss, weight=tf.shape(x)[0])
        assert len(seen_inputs) == 5
        moving = [[v for v in tf.compat.v1.global_variables() if v.op.name == "model/bn%d/%s" % (i, name)][0]
                  for i in range(1, 6) for name in ("moving_mean", "moving_variance")]
        with _session(graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            activations, found = [], []
            for window in data:
                activations.append([sess.run([train_op] + seen_inputs, {x: xv, y: yv})[1:] for xv, yv in window])
                found.append(sess.run(moving))
    for layer in range(5):
        per_window = [[(micro[layer], None) for micro in window] for window in activations]
        for how, far in (("window", False), ("micro", True)):
            expected = _simulated(per_window, (0, 1, 2), True, how)
            for window in range(2):
                for index in (0, 1):
                    got, want = found[window][2 * layer + index], expected[window][index]
                    if far:
                        assert np.abs(got - want).max() > 1e-3 * np.abs(want).max(), (layer, how)
                    else:
                        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, err_msg=str(layer))


@pytest.mark.parametrize("how", ["update_ops", "control_dependencies"])
def test_apply_gradients_users_choose_window_or_per_micro_batch(how):
    """``apply_gradients(..., update_ops=UPDATE_OPS)``: window statistics; the user's own
    ``control_dependencies(UPDATE_OPS)``: per-micro-batch updates (docs/guides/batch_norm.md)."""
    data = _window_data([5, 3, 6], 2, (3,), np.float64)

    def build(optimizer, x, y, k, momentum):
        opt = gradaccum.GradientAccumulator(optimizer, num_micro_batches=k)
        grads_and_vars = opt.compute_gradients(_first_layer_model("ours", x, y, momentum))
        update_ops = tf.compat.v1.get_collection(UPDATE_OPS)
        if how == "update_ops":
            return opt.apply_gradients(grads_and_vars, weight=tf.shape(x)[0], update_ops=update_ops)
        with tf.control_dependencies(update_ops):
            return opt.apply_gradients(grads_and_vars, weight=tf.shape(x)[0])

    got = _run_window(data, (3,), np.float64, "sgd", 3, build)
    want = _simulated(data, (0,), False, "window" if how == "update_ops" else "micro")
    for window in range(2):
        for index, key in enumerate(_MOVING_FIRST):
            np.testing.assert_allclose(got[3 * window + 2][key], want[window][index], rtol=1e-9)
