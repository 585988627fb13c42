"""A window size that changes between windows: each window equals one full-batch step on its union.

``num_micro_batches`` as a variable, a constant tensor, a step schedule and a
batch ramp; the loop feeds ``sess.run(opt.window_size)`` micro-batches per
window. The reference is the plain optimizer, one step per window on the
window's examples concatenated, in its own graph from the same start. Dense
and sparse gradients, equal and uneven micro-batches (``weight`` = their
sizes), clipping, loss scaling and skipped windows; float64, both TF behaviours.
"""
import numpy as np
import pytest
import tensorflow as tf

import gradaccum

v1 = tf.compat.v1
RNG = np.random.RandomState(7)
X = RNG.randn(60, 3)
IDS = RNG.randint(0, 6, size=60).astype(np.int32)
Y = RNG.randn(60)
# Micro-batch sizes per window: k = 3, 1, 5, 2 (then 3 again), uneven sizes.
WINDOWS = [[4, 2, 3], [5], [1, 2, 2, 3, 1], [4, 4], [2, 3, 1]]
EQUAL = [[3] * len(w) for w in WINDOWS]
OPTIMIZERS = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.train.MomentumOptimizer(0.1, 0.9),
    "adam": lambda: v1.train.AdamOptimizer(0.05),
}


def _loss(x, ids, y):
    dtype = x.dtype  # Given explicitly: a tower's reuse checks it.
    w = v1.get_variable("w", dtype=dtype, initializer=np.array([[0.3], [-0.2], [0.1]], dtype.as_numpy_dtype))
    b = v1.get_variable("b", dtype=dtype, initializer=np.array([0.05], dtype.as_numpy_dtype))
    table = v1.get_variable("table", dtype=dtype,
                            initializer=np.linspace(-1, 1, 12).reshape(6, 2).astype(dtype.as_numpy_dtype))
    pred = tf.reshape(tf.matmul(x, w), [-1]) + b + tf.reduce_sum(tf.gather(table, ids), 1)
    return tf.reduce_mean(tf.square(pred - y))


def _placeholders(dtype=tf.float64):
    return (v1.placeholder(dtype, [None, 3], name="x"), v1.placeholder(tf.int32, [None], name="ids"),
            v1.placeholder(dtype, [None], name="y"))


def _model(dtype=tf.float64):
    feeds = _placeholders(dtype)
    loss = _loss(*feeds)
    return feeds, loss, v1.trainable_variables()


def _feed(feeds, start, size):
    x, ids, y = feeds
    return {x: X[start:start + size], ids: IDS[start:start + size], y: Y[start:start + size]}


def _reference(make_opt, windows, clip_norm=None, dtype=tf.float64):
    """Values after each window: the plain optimizer, one step on the window's union."""
    with tf.Graph().as_default():
        feeds, loss, variables = _model(dtype)
        opt = make_opt()
        grads_and_vars = opt.compute_gradients(loss, variables)
        if clip_norm is not None:
            # Plain TF: the global norm of IndexedSlices counts a repeated row's parts
            # apart, and the accumulator's clip measures exactly that.
            grads, _ = tf.clip_by_global_norm([g for g, _ in grads_and_vars], clip_norm)
            grads_and_vars = list(zip([tf.convert_to_tensor(g) for g in grads], variables))
        train_op = opt.apply_gradients(grads_and_vars)
        out, start = [], 0
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for sizes in windows:
                sess.run(train_op, _feed(feeds, start, sum(sizes)))
                start += sum(sizes)
                out.append(sess.run(variables))
        return out


def _accumulated(make_opt, windows, make_k, set_k=None, clip_norm=None, towers=0, dtype=tf.float64):
    """Values after each window and the sizes the loop read from ``window_size``."""
    with tf.Graph().as_default():
        step = v1.train.get_or_create_global_step()
        opt = gradaccum.GradientAccumulator(make_opt(), make_k(), clip_norm=clip_norm)
        if towers:
            feeds = _placeholders()
            devices = ["/cpu:%d" % i for i in range(towers)]
            train_op = gradaccum.tower.minimize(opt, _loss, list(feeds), devices=devices, global_step=step).train_op
            variables = v1.trainable_variables()
        else:
            feeds, loss, variables = _model(dtype)
            train_op = opt.minimize(loss, global_step=step, var_list=variables, weight=tf.shape(feeds[0])[0])
        out, sizes_read, start = [], [], 0
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": max(towers, 1)})) as sess:
            sess.run(v1.global_variables_initializer())
            for number, sizes in enumerate(windows):
                if set_k is not None:
                    set_k(sess, len(sizes))
                sizes_read.append(int(sess.run(opt.window_size)))
                for i, size in enumerate(sizes):
                    if set_k is not None and i == 1 and number + 1 < len(windows):
                        # A change in the middle of a window waits for the next one.
                        set_k(sess, len(windows[number + 1]))
                    assert sess.run(opt.window_ended) == (i == 0)
                    assert sess.run(opt.window_size) == len(sizes)
                    sess.run(train_op, _feed(feeds, start, size))
                    start += size
                assert sess.run(opt.window_ended)
                out.append(sess.run(variables))
            assert sess.run(step) == len(windows)
        return out, sizes_read


def _variable_k():
    holder = {}

    def make():
        holder["k"] = v1.Variable(1, dtype=tf.int64, trainable=False, name="k")
        holder["value"] = v1.placeholder(tf.int64, [])
        holder["assign"] = holder["k"].assign(holder["value"])
        return holder["k"]

    def set_k(sess, k):
        sess.run(holder["assign"], {holder["value"]: k})

    return make, set_k


def _schedule_k(windows):
    boundaries = list(np.cumsum([1] * (len(windows) - 1)))
    return lambda: gradaccum.step_schedule([int(b) for b in boundaries], [len(w) for w in windows])


def _assert_windows_equal(actual, expected, rtol=1e-10, atol=1e-12):
    assert len(actual) == len(expected)
    for got_window, want_window in zip(actual, expected):
        for got, want in zip(got_window, want_window):
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("windows", [WINDOWS, EQUAL], ids=["uneven", "equal"])
@pytest.mark.parametrize("source", ["variable", "schedule"])
def test_each_window_equals_one_full_batch_step_on_its_union(optimizer, windows, source):
    if source == "variable":
        make_k, set_k = _variable_k()
    else:
        make_k, set_k = _schedule_k(windows), None
    actual, sizes = _accumulated(OPTIMIZERS[optimizer], windows, make_k, set_k)
    assert sizes == [len(w) for w in windows]
    _assert_windows_equal(actual, _reference(OPTIMIZERS[optimizer], windows))


def test_towers_with_a_changing_k_equal_one_full_batch_step_per_window():
    make_k, set_k = _variable_k()
    actual, sizes = _accumulated(OPTIMIZERS["momentum"], WINDOWS, make_k, set_k, towers=2)
    assert sizes == [len(w) for w in WINDOWS]
    _assert_windows_equal(actual, _reference(OPTIMIZERS["momentum"], WINDOWS))


def test_clipping_applies_to_each_window_s_average():
    make_k, set_k = _variable_k()
    actual, _ = _accumulated(OPTIMIZERS["adam"], WINDOWS, make_k, set_k, clip_norm=0.05)
    _assert_windows_equal(actual, _reference(OPTIMIZERS["adam"], WINDOWS, clip_norm=0.05))


@pytest.mark.parametrize("loss_scale", [64.0, "dynamic"])
def test_a_loss_scaled_window_equals_the_unscaled_step_on_its_union(loss_scale):
    make_k, set_k = _variable_k()

    def make_opt():
        return v1.train.experimental.MixedPrecisionLossScaleOptimizer(OPTIMIZERS["momentum"](), loss_scale)

    # float32: TF's loss-scale optimizer multiplies the loss by a float32 scale.
    actual, sizes = _accumulated(make_opt, WINDOWS, make_k, set_k, dtype=tf.float32)
    assert sizes == [len(w) for w in WINDOWS]
    reference = _reference(OPTIMIZERS["momentum"], WINDOWS, dtype=tf.float32)
    _assert_windows_equal(actual, reference, rtol=1e-5, atol=1e-6)


def test_a_constant_tensor_k_equals_the_same_int_k():
    runs = []
    for make_k in (lambda: 3, lambda: tf.constant(3)):
        actual, sizes = _accumulated(OPTIMIZERS["adam"], EQUAL[:1] * 4, make_k)
        assert sizes == [3] * 4
        runs.append(actual)
    _assert_windows_equal(runs[1], runs[0])


def test_a_zero_weight_window_is_skipped_and_the_next_window_reads_its_own_k():
    with tf.Graph().as_default():
        weight = v1.placeholder(tf.float64, [])
        w = v1.get_variable("w", initializer=np.array([1.0]))
        step = v1.train.get_or_create_global_step()
        schedule = gradaccum.step_schedule([1], [2, 3])
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.5), schedule)
        train_op = opt.minimize(tf.reduce_sum(w * w), global_step=step, weight=weight)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(2):
                sess.run(train_op, {weight: 0.0})
            assert sess.run([step, opt.skipped_windows, opt.window_size]) == [0, 1, 2]
            np.testing.assert_allclose(sess.run(w), [1.0])
            for _ in range(2):
                sess.run(train_op, {weight: 1.0})
            np.testing.assert_allclose(sess.run(w), [0.0])  # w -= 0.5 * 2w
            assert sess.run([step, opt.window_size]) == [1, 3]


def test_batch_ramp_follows_megatron_s_rule_in_examples():
    start, increment, ramp, final, micro = 100, 100, 2500, 500, 50
    ramp_fn = gradaccum.batch_ramp(start, increment, ramp, final, micro)
    # Megatron: batch = start + floor(consumed / (ramp / n)) * increment, capped.
    per_increment = ramp / ((final - start) // increment)
    expected, consumed = [], 0
    for _ in range(40):
        batch = min(final, start + int(consumed // per_increment) * increment)
        expected.append(batch // micro)
        consumed += batch
    with tf.Graph().as_default():
        step = v1.placeholder(tf.int64, [])
        k = ramp_fn(step)
        with v1.Session() as sess:
            assert [int(sess.run(k, {step: s})) for s in range(40)] == expected
    assert expected[0] == 2 and expected[-1] == 10


@pytest.mark.parametrize("call, message", [
    (lambda: gradaccum.step_schedule([2, 1], [1, 2, 3]), "`boundaries` must be strictly increasing"),
    (lambda: gradaccum.step_schedule([1], [1]), "`num_micro_batches` must hold one more value"),
    (lambda: gradaccum.step_schedule([1], [1, 0]), "`num_micro_batches` must be an int >= 1, got 0"),
    (lambda: gradaccum.batch_ramp(100, 30, 1000, 200, 10), "`batch_size` must be `start` (100) plus"),
    (lambda: gradaccum.batch_ramp(100, 100, 1000, 300, 30), "`start` must be a multiple of `micro_batch_size`"),
    (lambda: gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), tf.constant(2.0)),
     "`num_micro_batches` must be an int >= 1 or a scalar integer tensor, got"),
    (lambda: gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), tf.constant([2, 3])),
     "`num_micro_batches` must be an int >= 1 or a scalar integer tensor, got"),
])
def test_bad_sizes_raise_one_clear_error(call, message):
    with tf.Graph().as_default():
        with pytest.raises(ValueError) as error:
            call()
    assert message in str(error.value)


def test_a_schedule_without_global_step_is_refused_and_a_k_below_one_fails_at_run_time():
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=np.array([1.0]))
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), gradaccum.step_schedule([], [2]))
        with pytest.raises(ValueError, match="pass `global_step` to minimize or apply_gradients, got None"):
            opt.minimize(tf.reduce_sum(w))
        k = v1.placeholder_with_default(tf.constant(2, tf.int64), [])
        train_op = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), k).minimize(
            tf.reduce_sum(w))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError, match="`num_micro_batches` must be >= 1"):
                sess.run(train_op, {k: 0})
