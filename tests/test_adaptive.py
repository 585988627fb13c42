"""AdaptiveBatch: the rule, exactness of every window it sizes, and resuming mid-window.

The rule is checked on a stand-in statistics object with a known noise
scale. End to end, a noisy linear problem drives k up; every window still
equals one plain SGD step on its union, at the learning rate times the
policy's multiplier read before the window. A checkpoint taken in the middle
of a window, restored in a fresh graph, continues bit-exactly (same k
sequence, same variables), with the policy and with a step schedule.
"""
import math

import numpy as np
import pytest
import tensorflow as tf

import gradaccum

v1 = tf.compat.v1
MICRO = 4


class FixedNoise(object):
    """Stands in for GradientStatistics: a noise scale fed through a placeholder."""

    def __init__(self):
        self.value = v1.placeholder(tf.float32, [])
        self.noise_scale = self.value


def _policy_after(noise_scales, **kwargs):
    """(k, multiplier) after each update of a fresh policy, fed the given noise scales."""
    with tf.Graph().as_default():
        policy = gradaccum.AdaptiveBatch(MICRO, **kwargs)
        stats = FixedNoise()
        update = policy.update(stats)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            out = [tuple(sess.run([policy.num_micro_batches(), policy.learning_rate_multiplier]))]
            for value in noise_scales:
                sess.run(update, {stats.value: value})
                out.append(tuple(sess.run([policy.num_micro_batches(), policy.learning_rate_multiplier])))
        return out


def _gain(noise, batch, base, rule):
    gain = (noise / base + 1) / (noise / batch + 1)
    return math.sqrt(gain) if rule == "adam" else gain


@pytest.mark.parametrize("rule", ["adam", "sgd"])
def test_k_follows_the_noise_scale_within_bounds_and_the_multiplier_is_adascale_s_gain(rule):
    # factor 2: target batch 2 * B_noise; micro-batches of 4; k in [2, 12].
    noise = [float("nan"), 16.0, 17.0, 30.0, 400.0, 1.0]
    got = _policy_after(noise, factor=2.0, max_micro_batches=12, rule=rule)
    ks = [k for k, _ in got]
    # nan: no estimate; 16 -> 32/4 = 8; 17 -> 8.5 rounds to 8 (no change); 30 -> 15, capped
    # at 12 (12/8 > 1.25: it moves); 400 -> the cap again; 1 -> 0.5 -> the floor, 2.
    assert ks == [2, 2, 8, 8, 12, 12, 2]
    base = 2 * MICRO
    expected = [1.0, 1.0] + [_gain(n, k * MICRO, base, rule) for n, k in zip(noise[1:], ks[2:])]
    np.testing.assert_allclose([m for _, m in got], expected, rtol=1e-6)


def test_small_changes_do_not_flap():
    got = _policy_after([24.0, 28.0, 20.0, 26.0, 34.0], threshold=0.25)
    # 24 -> 6; 28 -> 7 (7/6 < 1.25: stays 6); 20 -> 5 (6/5 < 1.25: stays); 26 -> 6.5 -> 6; 34 -> 8.5 -> 8 (8/6 > 1.25).
    assert [k for k, _ in got] == [2, 6, 6, 6, 6, 8]


@pytest.mark.parametrize("kwargs, message", [
    ({"min_micro_batches": 1}, "`min_micro_batches` must be >= 2"),
    ({"max_micro_batches": 1}, "`max_micro_batches` must be >= `min_micro_batches` (2), got 1"),
    ({"factor": 0}, "`factor`"),
    ({"threshold": -0.1}, "`threshold` must be a number >= 0, got -0.1"),
    ({"rule": "lamb"}, "`rule` must be one of ('sgd', 'adam'), got 'lamb'"),
])
def test_bad_arguments_raise_one_clear_error(kwargs, message):
    with pytest.raises(ValueError) as error:
        gradaccum.AdaptiveBatch(MICRO, **kwargs)
    assert message in str(error.value)


# ------------------------------------------------------------ end to end

RNG = np.random.RandomState(3)
DATA_X = RNG.randn(400, 2)
DATA_Y = DATA_X.dot([1.0, -2.0]) + 3.0 * RNG.randn(400)  # noisy: a large noise scale


def _build(k_source):
    x = v1.placeholder(tf.float64, [None, 2])
    y = v1.placeholder(tf.float64, [None])
    w = v1.get_variable("w", initializer=np.array([0.0, 0.0]))
    loss = tf.reduce_mean(tf.square(tf.linalg.matvec(x, w) - y))
    step = v1.train.get_or_create_global_step()
    if k_source == "policy":
        policy = gradaccum.AdaptiveBatch(MICRO, factor=0.5, max_micro_batches=8, rule="sgd")
        rate = 0.01 * tf.cast(policy.learning_rate_multiplier, tf.float64)
        source = policy
    else:
        rate, source = 0.01, gradaccum.step_schedule([2, 4], [3, 1, 5])
    opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(rate), source, statistics=True)
    train_op = opt.minimize(loss, global_step=step, weight=tf.shape(x)[0])
    return x, y, w, step, opt, train_op


def _run(sess, parts, micro_batches, start=0):
    """Runs micro-batches ``start..``; returns the sizes and multipliers read at each window start."""
    x, y, _, _, opt, train_op = parts
    sizes = []
    for index in range(start, micro_batches):
        if sess.run(opt.window_ended):
            sizes.append(int(sess.run(opt.window_size)))
        lo = index * MICRO
        sess.run(train_op, {x: DATA_X[lo:lo + MICRO], y: DATA_Y[lo:lo + MICRO]})
    return sizes


def test_every_window_the_policy_sizes_equals_one_sgd_step_on_its_union():
    with tf.Graph().as_default():
        parts = _build("policy")
        x, y, w, step, opt, train_op = parts
        policy = opt.num_micro_batches
        sizes, rates, values, start = [], [], [], 0
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            while start + 8 <= 100:
                k = int(sess.run(opt.window_size))
                rates.append(float(sess.run(policy.learning_rate_multiplier)))
                sizes.append(k)
                _run(sess, parts, start + k, start)
                start += k
                values.append(sess.run(w))
            assert sess.run(step) == len(sizes)
    assert len(set(sizes)) > 1, "the policy never changed k: %s" % sizes
    with tf.Graph().as_default():
        xr = v1.placeholder(tf.float64, [None, 2])
        yr = v1.placeholder(tf.float64, [None])
        lr = v1.placeholder(tf.float64, [])
        wr = v1.get_variable("w", initializer=np.array([0.0, 0.0]))
        loss = tf.reduce_mean(tf.square(tf.linalg.matvec(xr, wr) - yr))
        step_op = v1.train.GradientDescentOptimizer(lr).minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            lo = 0
            for k, rate, value in zip(sizes, rates, values):
                hi = lo + k * MICRO
                sess.run(step_op, {xr: DATA_X[lo:hi], yr: DATA_Y[lo:hi], lr: 0.01 * rate})
                lo = hi
                np.testing.assert_allclose(sess.run(wr), value, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("k_source", ["policy", "schedule"])
def test_a_checkpoint_mid_window_resumes_bit_exactly(k_source, tmp_path):
    total, stop = 60, 25
    with tf.Graph().as_default():
        parts = _build(k_source)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sizes_uninterrupted = _run(sess, parts, total)
            uninterrupted = sess.run([parts[2], parts[3]] + parts[4].state_variables)
    with tf.Graph().as_default():
        parts = _build(k_source)
        saver = v1.train.Saver()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sizes_before = _run(sess, parts, stop)
            assert sess.run(parts[4].micro_step) > 0, "the checkpoint must fall inside a window"
            path = saver.save(sess, str(tmp_path / "mid_window"))
    with tf.Graph().as_default():
        parts = _build(k_source)
        saver = v1.train.Saver()
        with v1.Session() as sess:
            saver.restore(sess, path)
            sizes_after = _run(sess, parts, total, stop)
            resumed = sess.run([parts[2], parts[3]] + parts[4].state_variables)
    assert sizes_before + sizes_after == sizes_uninterrupted
    assert len(set(sizes_uninterrupted)) > 1
    for got, want in zip(resumed, uninterrupted):
        np.testing.assert_array_equal(got, want)
