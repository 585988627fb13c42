"""GradientAccumulator in long runs: resume, hooks, schedules, loss scaling, numerics."""
import collections
import os
import subprocess

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
import forkserver
from scalar_problem import scalar_problem

v1 = tf.compat.v1
HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------ resume


@pytest.fixture(scope="module")
def resumed_dir(tmp_path_factory):
    """Runs the child twice: stop and save mid-window, then restore in a fresh process."""
    directory = str(tmp_path_factory.mktemp("resume"))
    for phase in ("first", "second"):
        subprocess.run(forkserver.command() + [os.path.join(HERE, "resume_child.py"), phase, directory],
                       check=True, timeout=240)
    return directory


@pytest.mark.parametrize("pattern", ["fused", "manual"])
def test_resume_mid_window_in_a_fresh_process_is_bit_identical(pattern, resumed_dir):
    never_stopped = np.load(os.path.join(resumed_dir, pattern + "_never_stopped.npz"))
    resumed = np.load(os.path.join(resumed_dir, pattern + "_resumed.npz"))
    assert sorted(never_stopped.files) == sorted(resumed.files) and len(resumed.files) > 5
    for key in never_stopped.files:
        np.testing.assert_array_equal(resumed[key], never_stopped[key], err_msg=key)
    assert int(resumed["a2"]) == 3  # global_step: three windows applied


def _monitored_run(checkpoint_dir, micro_steps, k=3):
    with tf.Graph().as_default():
        c, _, w, step, acc, train_op = scalar_problem(k, v1.train.MomentumOptimizer(0.1, 0.9))
        values = [float(i % 5) for i in range(100)]
        with v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoint_dir, save_checkpoint_secs=None,
                                               save_checkpoint_steps=1000, log_step_count_steps=None,
                                               save_summaries_steps=None) as sess:
            start = sess.run(step) * k + sess.run(acc.micro_step)
            for i in range(start, start + micro_steps):
                sess.run(train_op, {c: [values[i], -values[i]]})
            return sess.run([w, step, acc.micro_step])


def test_monitored_training_session_resumes_mid_window(tmp_path):
    expected = _monitored_run(str(tmp_path / "straight"), 11)
    first = _monitored_run(str(tmp_path / "stopped"), 5)  # one window and 2 of the next
    assert (first[1], first[2]) == (1, 2)
    resumed = _monitored_run(str(tmp_path / "stopped"), 6)
    np.testing.assert_array_equal(resumed[0], expected[0])
    assert (resumed[1], resumed[2]) == (expected[1], expected[2]) == (3, 2)


def test_stop_at_step_hook_counts_applied_updates():
    with tf.Graph().as_default():
        c, _, _, step, _, train_op = scalar_problem(4, v1.train.GradientDescentOptimizer(0.1))
        with tf.control_dependencies([train_op]):
            step_after = tf.identity(step.read_value())
        hook = v1.train.StopAtStepHook(last_step=3)
        steps = []
        with v1.train.MonitoredSession(hooks=[hook]) as sess:
            while not sess.should_stop():
                steps.append(sess.run(step_after, {c: [1.0, 1.0]}))
        assert steps == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


def test_learning_rate_schedule_moves_once_per_update():
    with tf.Graph().as_default():
        c = v1.placeholder(tf.float64, [1])
        w = v1.get_variable("w", initializer=np.array([0.0]))
        step = v1.train.get_or_create_global_step()
        rate = v1.train.exponential_decay(1.0, step, decay_steps=1, decay_rate=0.5, staircase=True)
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(rate), 3)
        train_op = acc.minimize(tf.reduce_sum(c * w), global_step=step)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            rates = []
            for _ in range(3 * 3):
                sess.run(train_op, {c: [1.0]})
                rates.append(sess.run(rate))
            np.testing.assert_array_equal(rates, [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.25, 0.125])
            np.testing.assert_array_equal(sess.run(w), [-(1.0 + 0.5 + 0.25)])


# --------------------------------------------------------- mixed precision


LossScaled = collections.namedtuple("LossScaled", "x w step acc train_op scale momentum normal huge")


def _loss_scaled(k, huge, **kwargs):
    """float32 variables, float16 compute, dynamic loss scaling inside the accumulator."""
    x = v1.placeholder(tf.float16, [None, 2])
    w = v1.get_variable("w", initializer=np.array([[0.5], [-0.25]], np.float32))
    loss = tf.reduce_mean(tf.cast(tf.matmul(x, tf.cast(w, tf.float16)), tf.float32) ** 2)
    momentum = v1.train.MomentumOptimizer(0.01, 0.9)
    scaled = v1.train.experimental.MixedPrecisionLossScaleOptimizer(momentum, "dynamic")
    acc = gradaccum.GradientAccumulator(scaled, k, **kwargs)
    step = v1.train.get_or_create_global_step()
    train_op = acc.minimize(loss, global_step=step)
    (scale,) = [v for v in v1.global_variables() if v.op.name.endswith("current_loss_scale")]
    normal = np.array([[1.0, 2.0], [0.5, -1.0]], np.float16)
    # TF's loss-scale optimizer does not forward get_slot: ask the inner one.
    return LossScaled(x, w, step, acc, train_op, scale, momentum.get_slot(w, "momentum"),
                      normal, normal * np.float16(huge))


def test_overflow_in_one_micro_batch_skips_the_whole_window():
    with tf.Graph().as_default():
        x, w, step, acc, train_op, scale, momentum, normal, huge = _loss_scaled(3, 200.0)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            before = sess.run([w, momentum, scale])
            for batch in (normal, huge, normal):  # the loss scale (2**15) overflows float16 on `huge`
                sess.run(train_op, {x: batch})
            after = sess.run([w, momentum, scale, step])
            np.testing.assert_array_equal(after[0], before[0])
            np.testing.assert_array_equal(after[1], before[1])
            assert after[2] == before[2] / 2 and after[3] == 0
            assert sess.run(acc.micro_step) == 0
            sess.run(train_op, {x: normal})  # the overflowed sum is overwritten, not added to
            assert np.all(np.isfinite(sess.run(acc.accumulators[0])))
            for batch in (normal, normal):  # and the clean window applies
                sess.run(train_op, {x: batch})
            assert not np.array_equal(sess.run(w), before[0]) and sess.run(step) == 1
            assert np.all(np.isfinite(sess.run(w)))


@pytest.mark.parametrize("kwargs", [{"skip_nonfinite": True}, {"statistics": True}])
def test_overflow_is_the_loss_scale_optimizers_decision_and_counts_as_skipped(kwargs):
    """With ``skip_nonfinite`` the overflow still reaches the loss-scale optimizer (or its scale
    would never come down); the window counts as skipped and the noise statistics ignore it."""
    with tf.Graph().as_default():
        x, w, step, acc, train_op, scale, _, normal, huge = _loss_scaled(2, 200.0, **kwargs)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            before = sess.run([w, scale])
            for batch in (normal, huge):
                sess.run(train_op, {x: batch})
            assert sess.run(scale) == before[1] / 2 and sess.run(acc.skipped_windows) == 1
            np.testing.assert_array_equal(sess.run(w), before[0])
            if "statistics" in kwargs:
                assert sess.run(acc.statistics.windows) == 0
            for batch in (normal, normal):
                sess.run(train_op, {x: batch})
            assert sess.run(step) == 1 and sess.run(acc.skipped_windows) == 1
            if "statistics" in kwargs:
                assert sess.run(acc.statistics.windows) == 1


def test_loss_scaled_window_equals_unscaled_reference():
    with tf.Graph().as_default():
        x, w, _, _, train_op, _, _, normal, _ = _loss_scaled(2, 1.0)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(2):
                sess.run(train_op, {x: normal[:1]})
                sess.run(train_op, {x: normal[1:]})
            got = sess.run(w)
    # Reference in float64: Momentum on the mean gradient of the two rows.
    value, velocity = np.array([[0.5], [-0.25]]), 0.0
    rows = normal.astype(np.float64)
    for _ in range(2):
        grad = np.mean([2 * (r @ value) * r[:, None] for r in rows], axis=0)
        velocity = 0.9 * velocity + grad
        value = value - 0.01 * velocity
    np.testing.assert_allclose(got, value, rtol=1e-3)


def test_loss_scale_optimizer_outside_the_accumulator_is_an_error():
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=np.array([1.0], np.float32))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2)
        outer = v1.train.experimental.MixedPrecisionLossScaleOptimizer(acc, "dynamic")
        with pytest.raises(ValueError, match=r"must build its train op outside tf.cond and tf.while_loop; "
                                             r"to combine it with loss scaling, wrap"):
            outer.minimize(tf.reduce_sum(w * w))


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_half_precision_gradients_accumulate_in_float32(dtype):
    with tf.Graph().as_default():
        c = v1.placeholder(dtype, [2])
        w = v1.get_variable("w", initializer=tf.constant([1.0, 1.0], dtype))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 8)
        acc.minimize(tf.reduce_sum(c * w))
        assert acc.accumulators[0].dtype.base_dtype == tf.float32
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for value in [256.0] + [1.0] * 4:  # 256 + 1 rounds back to 256 in both half formats
                sess.run(acc.accumulate_op, {c: [value, 0.0]})
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [260.0, 0.0])


def test_skip_nonfinite_skips_and_counts_without_loss_scaling():
    with tf.Graph().as_default():
        c, _, w, step, acc, train_op = scalar_problem(2, v1.train.AdamOptimizer(0.1), skip_nonfinite=True)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for value in ([1.0, np.inf], [1.0, 1.0]):
                sess.run(train_op, {c: value})
            np.testing.assert_array_equal(sess.run(w), [10.0, 20.0])
            assert sess.run([step, acc.skipped_windows, acc.micro_step]) == [0, 1, 0]
            sess.run(train_op, {c: [1.0, 1.0]})  # the infinite sum is overwritten, not added to
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [1.0, 1.0])
            sess.run(train_op, {c: [1.0, 1.0]})
            assert sess.run([step, acc.skipped_windows]) == [1, 1]
            assert np.all(np.isfinite(sess.run(w))) and not np.array_equal(sess.run(w), [10.0, 20.0])


def test_without_skip_nonfinite_the_window_is_applied():
    with tf.Graph().as_default():
        c, _, w, step, acc, train_op = scalar_problem(1, v1.train.GradientDescentOptimizer(0.1))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {c: [np.nan, 0.0]})
            assert np.isnan(sess.run(w)[0]) and sess.run(acc.skipped_windows) == 0


# ---------------------------------------------------------------- numerics


def _average_at_large_k(accumulation_dtype, k=1024):
    rng = np.random.RandomState(0)
    # A large common offset and small differences: a float32 running sum
    # rounds every addition at the sum's scale and drifts.
    grads = (1.0e4 + rng.uniform(0.0, 0.5, size=(k, 2))).astype(np.float32)
    with tf.Graph().as_default():
        c, _, w, _, acc, train_op = scalar_problem(
            k, v1.train.GradientDescentOptimizer(1.0), tf.float32, accumulation_dtype=accumulation_dtype)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for grad in grads:
                sess.run(train_op, {c: grad})
            averaged = np.array([10.0, 20.0]) - sess.run(w).astype(np.float64)
    reference = grads.astype(np.float64).mean(axis=0)
    return np.max(np.abs(averaged - reference) / reference)


def test_large_k_float64_accumulation_stays_within_1e6():
    assert _average_at_large_k(tf.float64) < 1e-6


def test_large_k_float32_accumulation_loses_digits():
    """Why accumulation_dtype exists: the same data with float32 sums misses 1e-6."""
    assert _average_at_large_k(None) > 1e-6


@pytest.mark.parametrize("dtype", ["float16", tf.int32, "nonsense", np.float16])
def test_accumulation_dtype_errors(dtype):
    with pytest.raises(ValueError, match=r"`accumulation_dtype` must be None, tf.float32 or tf.float64, got"):
        gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2, accumulation_dtype=dtype)


def test_skip_nonfinite_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`skip_nonfinite` must be a bool, got 'yes'"):
        gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2, skip_nonfinite="yes")


# ------------------------------------------------ no growth, no interference


def test_training_adds_no_ops_after_the_first_step():
    with tf.Graph().as_default() as graph:
        c, _, w, step, acc, train_op = scalar_problem(3, v1.train.AdamOptimizer(0.1))
        apply_op = acc.apply_op  # built on first use, so before the graph is finalized
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            graph.finalize()  # any op added from here on raises
            for i in range(60):
                sess.run(train_op, {c: [1.0, float(i)]})
            sess.run(acc.accumulate_op, {c: [1.0, 1.0]})
            sess.run([apply_op])
            sess.run(acc.zero_op)
            assert sess.run(step) == 21


def test_apply_op_read_first_after_the_graph_is_finalized_says_what_to_do():
    with tf.Graph().as_default() as graph:
        acc = scalar_problem(3, v1.train.AdamOptimizer(0.1))[4]
        graph.finalize()
        with pytest.raises(RuntimeError, match="read `apply_op` once before the session starts"):
            acc.apply_op


def test_two_accumulators_in_one_graph_do_not_share_state():
    with tf.Graph().as_default():
        c = v1.placeholder(tf.float64, [1])
        gen = v1.get_variable("gen", initializer=np.array([0.0]))
        disc = v1.get_variable("disc", initializer=np.array([0.0]))
        g_acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2)
        d_acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 3)
        g_op = g_acc.minimize(tf.reduce_sum(c * gen), var_list=[gen])
        d_op = d_acc.minimize(tf.reduce_sum(-c * disc), var_list=[disc])
        assert g_acc.micro_step.op.name == "GradientAccumulator/micro_step"
        assert d_acc.micro_step.op.name == "GradientAccumulator_1/micro_step"
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for i in range(1, 7):  # interleaved: G twice per window of 2, D per window of 3
                sess.run(g_op, {c: [float(i)]})
                sess.run(d_op, {c: [10.0 * i]})
            np.testing.assert_array_equal(sess.run(gen), [-(1.5 + 3.5 + 5.5)])
            np.testing.assert_array_equal(sess.run(disc), [20.0 + 50.0])
            assert sess.run([g_acc.micro_step, d_acc.micro_step]) == [0, 0]
