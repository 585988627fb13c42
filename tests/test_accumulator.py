"""Numbers for GradientAccumulator: equivalence, untouched state, counters, errors."""
import functools

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum.window import update_ops as _update_ops
from gradaccum import statistics as statistics_module
from scalar_problem import scalar_problem

v1 = tf.compat.v1
BATCH = 12

OPTIMIZERS = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.train.MomentumOptimizer(0.1, 0.9),
    "nesterov": lambda: v1.train.MomentumOptimizer(0.1, 0.9, use_nesterov=True),
    "adam": lambda: v1.train.AdamOptimizer(0.05),
    "rmsprop": lambda: v1.train.RMSPropOptimizer(0.05),
    "rmsprop_momentum": lambda: v1.train.RMSPropOptimizer(0.05, momentum=0.9),
    "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
    "adadelta": lambda: v1.train.AdadeltaOptimizer(1.0),
    "ftrl": lambda: v1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.01),
}
# Equal micro-batches with weight=None, and uneven ones weighted by their size.
SPLITS = {"equal": ([3, 3, 3, 3], False), "uneven": ([5, 4, 2, 1], True)}
TOLERANCE = {np.float64: dict(rtol=1e-10, atol=1e-12), np.float32: dict(rtol=1e-5, atol=1e-6)}


def _data(dtype, n=BATCH):
    rng = np.random.RandomState(7)
    return rng.randn(n, 4).astype(dtype), rng.randn(n, 2).astype(dtype)


def _mlp(dtype):
    """A 4-5-2 tanh net with fixed weights; returns (x, y, loss, variables)."""
    rng = np.random.RandomState(1)
    x = v1.placeholder(dtype, [None, 4], name="x")
    y = v1.placeholder(dtype, [None, 2], name="y")
    w1 = v1.get_variable("w1", initializer=rng.randn(4, 5).astype(dtype))
    b1 = v1.get_variable("b1", initializer=rng.randn(5).astype(dtype))
    w2 = v1.get_variable("w2", initializer=rng.randn(5, 2).astype(dtype))
    hidden = tf.tanh(tf.matmul(x, w1) + b1)
    loss = tf.reduce_mean(tf.square(tf.matmul(hidden, w2) - y))
    return x, y, loss, [w1, b1, w2]


def _slices(sizes):
    ends = np.cumsum(sizes)
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def _train(opt_name, dtype, sizes=None, weighted=False, updates=3, apply=False):
    """Runs ``updates`` applied updates; sizes=None is plain full-batch training.

    ``apply``: build with ``compute_gradients`` + ``apply_gradients`` instead of ``minimize``.
    """
    X, Y = _data(dtype)
    with tf.Graph().as_default():
        x, y, loss, variables = _mlp(dtype)
        step = v1.train.get_or_create_global_step()
        if sizes is None:
            train_op = OPTIMIZERS[opt_name]().minimize(loss, global_step=step)
            feeds = [{x: X, y: Y}]
        else:
            opt = gradaccum.GradientAccumulator(OPTIMIZERS[opt_name](), len(sizes))
            weight = tf.shape(x)[0] if weighted else None
            if apply:
                train_op = opt.apply_gradients(opt.compute_gradients(loss), step, weight=weight)
            else:
                train_op = opt.minimize(loss, global_step=step, weight=weight)
            feeds = [{x: X[s], y: Y[s]} for s in _slices(sizes)]
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(updates):
                for feed in feeds:
                    sess.run(train_op, feed)
            return sess.run(variables), sess.run(step)


@pytest.fixture(scope="module")
def full_batch():
    """``full_batch(opt_name, dtype, updates=3)``: plain full-batch training's ``(variables, step)``.

    Each is made once per worker and shared by every split and form that compares with it; a module
    fixture, so that the tests that share them run on one worker (``tests/conftest.py``). Its arrays are
    read-only: a test cannot change what the next one compares with.
    """
    return _full_batch


@functools.lru_cache(maxsize=None)
def _full_batch(opt_name, dtype, updates=3):
    values, step = _train(opt_name, dtype, updates=updates)
    for value in values:
        value.setflags(write=False)
    return tuple(values), step


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_accumulated_equals_full_batch(opt_name, split, dtype, full_batch):
    sizes, weighted = SPLITS[split]
    expected, expected_step = full_batch(opt_name, dtype)
    actual, actual_step = _train(opt_name, dtype, sizes, weighted)
    assert actual_step == expected_step == 3
    initial, _ = full_batch(opt_name, dtype, updates=0)
    for got, want, start in zip(actual, expected, initial):
        assert not np.allclose(want, start), "the reference did not move: the test would prove nothing"
        np.testing.assert_allclose(got, want, **TOLERANCE[dtype])


@pytest.mark.parametrize("apply", [False, True], ids=["minimize", "apply_gradients"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_weight_in_backprop_and_weight_in_the_kernel_both_equal_full_batch(opt_name, apply, full_batch):
    """``minimize`` folds ``weight`` into ``grad_loss``; ``apply_gradients`` gets finished gradients
    and multiplies in the accumulate kernel."""
    expected, _ = full_batch(opt_name, np.float64)
    actual, _ = _train(opt_name, np.float64, [5, 4, 2, 1], weighted=True, apply=apply)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, **TOLERANCE[np.float64])


def test_grad_loss_and_weight_both_scale_the_gradients():
    with tf.Graph().as_default():
        c = v1.placeholder(tf.float64, [2])
        w = v1.get_variable("w", initializer=np.array([1.0, 2.0]))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2)
        train_op = acc.minimize(tf.reduce_sum(c * w), grad_loss=tf.constant(2.0, tf.float64), weight=3)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {c: [1.0, -5.0]})
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [6.0, -30.0])
            assert sess.run(acc.weight_sum) == 3.0


def test_uneven_micro_batches_need_the_weight(full_batch):
    """Without weights the mean of micro-batch means is not the full-batch mean."""
    expected, _ = full_batch("sgd", np.float64)
    unweighted, _ = _train("sgd", np.float64, [5, 4, 2, 1], weighted=False)
    assert not np.allclose(unweighted[0], expected[0], rtol=1e-6)


def test_exact_mean_of_fed_gradients():
    with tf.Graph().as_default():
        c, _, w, step, acc, train_op = scalar_problem(4, v1.train.GradientDescentOptimizer(1.0))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for value in [1.0, 2.0, 3.0, 4.0]:
                sess.run(train_op, {c: [value, -value]})
            np.testing.assert_array_equal(sess.run(w), [10.0 - 2.5, 20.0 + 2.5])
            assert sess.run(step) == 1


def test_weights_give_weighted_mean():
    with tf.Graph().as_default():
        c, weight, w, _, acc, train_op = scalar_problem(2, v1.train.GradientDescentOptimizer(1.0))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {c: [1.0, 0.0], weight: 3.0})
            sess.run(train_op, {c: [5.0, 0.0], weight: 1.0})
            np.testing.assert_array_equal(sess.run(w), [10.0 - 2.0, 20.0])


def _state(sess, acc, variables, step):
    slots = [acc.get_slot(v, name) for v in variables for name in acc.optimizer.get_slot_names()]
    extra = [v for v in acc.optimizer.variables() if v not in slots]
    return sess.run(variables + slots + extra + [step])


@pytest.mark.parametrize("opt_name", ["adam", "momentum", "rmsprop_momentum"])
def test_state_untouched_between_applies(opt_name):
    X, Y = _data(np.float32)
    with tf.Graph().as_default():
        x, y, loss, variables = _mlp(np.float32)
        step = v1.train.get_or_create_global_step()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS[opt_name](), 3)
        train_op = acc.minimize(loss, global_step=step)
        assert acc.optimizer.get_slot_names(), "the wrapped optimizer has slots to watch"
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for update in range(2):
                before = _state(sess, acc, variables, step)
                for micro in range(3):
                    sess.run(train_op, {x: X[micro::3], y: Y[micro::3]})
                    after = _state(sess, acc, variables, step)
                    if micro < 2:  # test_every_slot_moves_on_apply covers the applying run
                        for old, new in zip(before, after):
                            np.testing.assert_array_equal(new, old)
                    assert sess.run(acc.micro_step) == (micro + 1) % 3
                assert sess.run(step) == update + 1


def test_every_slot_moves_on_apply():
    """The untouched check above is only meaningful if the apply does move the state."""
    X, Y = _data(np.float32)
    with tf.Graph().as_default():
        x, y, loss, variables = _mlp(np.float32)
        step = v1.train.get_or_create_global_step()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 2)
        train_op = acc.minimize(loss, global_step=step)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            before = _state(sess, acc, variables, step)
            sess.run(train_op, {x: X[:6], y: Y[:6]})
            sess.run(train_op, {x: X[6:], y: Y[6:]})
            for old, new in zip(before, _state(sess, acc, variables, step)):
                assert not np.array_equal(old, new)


def test_accumulators_hold_the_weighted_sum_and_the_next_window_starts_afresh():
    with tf.Graph().as_default():
        c, weight, w, step, acc, train_op = scalar_problem(3, v1.train.AdamOptimizer(0.1))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {c: [1.0, 2.0], weight: 2.0})
            sess.run(train_op, {c: [3.0, 4.0], weight: 1.0})
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [5.0, 8.0])
            assert sess.run([acc.micro_step, acc.weight_sum]) == [2, 3.0]
            sess.run(train_op, {c: [0.0, 0.0], weight: 1.0})
            assert sess.run([acc.micro_step, acc.weight_sum, step]) == [0, 0.0, 1]
            # No pass zeroes the cache: the next window's first micro-batch overwrites it.
            sess.run(train_op, {c: [1.0, 1.0], weight: 3.0})
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [3.0, 3.0])
            assert sess.run([acc.micro_step, acc.weight_sum, step]) == [1, 3.0, 1]


def test_variable_without_gradient_gets_no_accumulator():
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=np.array([1.0, 2.0]))
        unused = v1.get_variable("unused", initializer=np.array([3.0]))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2)
        grads = acc.compute_gradients(tf.reduce_sum(w * w), var_list=[w, unused])
        assert grads[1][0] is None
        train_op = acc.apply_gradients(grads)
        assert len(acc.accumulators) == 1 and acc.get_slot(unused, "accum") is None
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run([train_op])
            sess.run([train_op])
            np.testing.assert_array_equal(sess.run(unused), [3.0])
            np.testing.assert_array_equal(sess.run(w), [1.0 - 2.0, 2.0 - 4.0])


def _embedding_train(opt_fn, k, updates=3):
    """Sparse gradients from tf.gather; the ids repeat within and across micro-batches."""
    ids_data = np.array([0, 2, 2, 5, 0, 3, 5, 5, 1, 3, 0, 2])
    targets = np.linspace(-1.0, 1.0, 12 * 3).reshape(12, 3)
    with tf.Graph().as_default():
        ids = v1.placeholder(tf.int32, [None])
        target = v1.placeholder(tf.float64, [None, 3])
        table = v1.get_variable("table", initializer=np.random.RandomState(3).randn(8, 3))
        loss = tf.reduce_mean(tf.square(tf.gather(table, ids) - target))
        opt = opt_fn() if k is None else gradaccum.GradientAccumulator(opt_fn(), k)
        train_op = opt.minimize(loss, weight=tf.shape(ids)[0]) if k else opt.minimize(loss)
        assert isinstance(opt.compute_gradients(loss)[0][0], tf.IndexedSlices)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(updates):
                for part in _slices([12 // (k or 1)] * (k or 1)):
                    sess.run(train_op, {ids: ids_data[part], target: targets[part]})
            shapes = {v.op.name: v.shape.as_list() for v in opt.variables()}
            return sess.run(table), shapes


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "momentum", "adagrad"])
def test_sparse_gradients_equal_full_batch(opt_name):
    expected, _ = _embedding_train(OPTIMIZERS[opt_name], None)
    actual, _ = _embedding_train(OPTIMIZERS[opt_name], 4)
    np.testing.assert_allclose(actual, expected, rtol=1e-10, atol=1e-12)
    # Rows 4, 6 and 7 are never looked up: the full batch leaves them alone.
    initial = np.random.RandomState(3).randn(8, 3)
    np.testing.assert_array_equal(actual[[4, 6, 7]], initial[[4, 6, 7]])


def test_sparse_cache_is_the_variable_size():
    _, shapes = _embedding_train(OPTIMIZERS["sgd"], 4, updates=0)
    # However many micro-batches: the variable's size, one flag per row, three counters.
    assert shapes == {"table/GradientAccumulator": [8, 3], "table/GradientAccumulator_touched": [8],
                      "GradientAccumulator/micro_step": [], "GradientAccumulator/weight_sum": [],
                      "GradientAccumulator/skipped_windows": []}


def test_state_variables_are_global_non_trainable_colocated_and_outside_control_deps():
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None])
        w = v1.get_variable("w", initializer=np.array([1.0, 2.0], np.float32))
        needs_feed = v1.assign_add(v1.get_variable("n", initializer=0.0, trainable=False),
                                   tf.reduce_sum(x))
        acc = gradaccum.GradientAccumulator(v1.train.MomentumOptimizer(0.1, 0.9), 2)
        with tf.control_dependencies([needs_feed]):
            acc.minimize(tf.reduce_sum(w * w), update_ops=[])
        own = [acc.micro_step, acc.weight_sum, acc.skipped_windows] + acc.accumulators
        trainable = v1.trainable_variables()
        for var in own:
            assert var in v1.global_variables() and not any(var is t for t in trainable)
            assert b"loc:@w" in var.op.colocation_groups()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())  # no feed: initializers wait for nothing
            sess.run([acc.apply_op, acc.zero_op])  # nor do the manual ops


def test_op_names_and_train_op_collection():
    with tf.Graph().as_default():
        _, _, _, _, acc, train_op = scalar_problem(2, v1.train.AdamOptimizer(0.1))
        assert train_op.name == "GradientAccumulator/train"
        assert acc.accumulate_op.name == "GradientAccumulator/accumulate/accumulate"
        assert acc.apply_op.name == "GradientAccumulator/apply"
        assert acc.zero_op.name == "GradientAccumulator/zero"
        assert acc.micro_step.op.name == "GradientAccumulator/micro_step"
        assert acc.accumulators[0].op.name == "w/GradientAccumulator"
        # Checkpoint names match plain training for the wrapped optimizer's state.
        names = {v.op.name for v in acc.variables()}
        assert {"beta1_power", "beta2_power", "w/Adam", "w/Adam_1"} <= names
        assert v1.get_collection(v1.GraphKeys.TRAIN_OP) == [train_op]


def test_manual_pattern_equals_full_batch_and_apply_needs_no_feed(full_batch):
    X, Y = _data(np.float64)
    expected, _ = full_batch("adam", np.float64, updates=2)
    with tf.Graph().as_default():
        x, y, loss, variables = _mlp(np.float64)
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        acc.minimize(loss, weight=tf.shape(x)[0])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(2):
                sess.run(acc.zero_op)
                for part in _slices([3, 3, 3, 3]):
                    sess.run(acc.accumulate_op, {x: X[part], y: Y[part]})
                # Seed 001's bug: fetching apply with a feed must not add the last batch again.
                sess.run(acc.apply_op, {x: X[9:], y: Y[9:]})
            for got, want in zip(sess.run(variables), expected):
                np.testing.assert_allclose(got, want, rtol=1e-10)


def test_manual_apply_uses_whatever_count_was_added():
    with tf.Graph().as_default():
        c, _, w, step, acc, _ = scalar_problem(5, v1.train.GradientDescentOptimizer(1.0))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(acc.accumulate_op, {c: [2.0, 4.0]})
            sess.run(acc.accumulate_op, {c: [4.0, 8.0]})
            sess.run(acc.apply_op)
            np.testing.assert_array_equal(sess.run(w), [10.0 - 3.0, 20.0 - 6.0])
            assert sess.run([step, acc.micro_step]) == [1, 0]
            sess.run(acc.accumulate_op, {c: [2.0, 4.0]})
            sess.run(acc.zero_op)
            sess.run(acc.apply_op)  # nothing left to apply: skipped, not divided by zero
            np.testing.assert_array_equal(sess.run(w), [10.0 - 3.0, 20.0 - 6.0])
            assert sess.run([step, acc.skipped_windows]) == [1, 1]


def test_zero_weight_window_is_skipped_and_counted():
    with tf.Graph().as_default():
        c, weight, w, step, acc, train_op = scalar_problem(2, v1.train.AdamOptimizer(0.1))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(2):
                sess.run(train_op, {c: [1.0, 1.0], weight: 0.0})
            np.testing.assert_array_equal(sess.run(w), [10.0, 20.0])
            assert sess.run([step, acc.skipped_windows, acc.micro_step]) == [0, 1, 0]
            sess.run(acc.accumulate_op, {c: [2.0, 3.0], weight: 1.0})
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [2.0, 3.0])


def test_clip_norm_clips_the_average_once():
    grads = [[3.0, 4.0], [9.0, 12.0]]  # mean (6, 8), norm 10; each alone is under 15
    with tf.Graph().as_default():
        c = v1.placeholder(tf.float64, [2])
        w = v1.get_variable("w", initializer=np.array([0.0, 0.0]))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2, clip_norm=5.0)
        train_op = acc.minimize(tf.reduce_sum(c * w))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for grad in grads:
                sess.run(train_op, {c: grad})
            np.testing.assert_allclose(sess.run(w), [-3.0, -4.0], rtol=1e-12)


@pytest.mark.parametrize("update_ops, expected_runs", [(None, 4), ([], 0)])
def test_update_ops_run_on_every_micro_batch(update_ops, expected_runs):
    with tf.Graph().as_default():
        c = v1.placeholder(tf.float64, [2])
        w = v1.get_variable("w", initializer=np.array([1.0, 1.0]))
        counter = v1.get_variable("counter", initializer=np.float64(0.0), trainable=False)
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, v1.assign_add(counter, 1.0 + 0 * tf.reduce_sum(c)))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2)
        train_op = acc.minimize(tf.reduce_sum(c * w), update_ops=update_ops)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(4):
                sess.run(train_op, {c: [1.0, 2.0]})
            sess.run(acc.apply_op)  # the update op needs a feed: apply_op must not run it
            assert sess.run(counter) == expected_runs


def test_checkpoint_in_the_middle_of_a_window_continues_exactly(tmp_path, full_batch):
    X, Y = _data(np.float64)
    parts = _slices([3, 3, 3, 3])

    def build():
        x, y, loss, variables = _mlp(np.float64)
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        step = v1.train.get_or_create_global_step()
        return x, y, variables, step, acc.minimize(loss, global_step=step), v1.train.Saver()

    schedule = parts * 2
    expected, _ = full_batch("adam", np.float64, updates=2)
    with tf.Graph().as_default():
        x, y, variables, step, train_op, saver = build()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for part in schedule[:6]:
                sess.run(train_op, {x: X[part], y: Y[part]})
            path = saver.save(sess, str(tmp_path / "ckpt"))
    with tf.Graph().as_default():
        x, y, variables, step, train_op, saver = build()
        with v1.Session() as sess:
            saver.restore(sess, path)
            for part in schedule[6:]:
                sess.run(train_op, {x: X[part], y: Y[part]})
            for got, want in zip(sess.run(variables), expected):
                np.testing.assert_allclose(got, want, rtol=1e-10)
            assert sess.run(step) == 2


def test_slots_and_variables_are_forwarded():
    with tf.Graph().as_default():
        _, _, w, _, acc, _ = scalar_problem(2, v1.train.AdamOptimizer(0.1))
        assert acc.get_slot(w, "m") is acc.optimizer.get_slot(w, "m") is not None
        # Our caches are no slots: they never shadow a slot name of the wrapped optimizer.
        assert acc.get_slot(w, "accum") is None
        assert acc.get_slot_names() == acc.optimizer.get_slot_names() == ["m", "v"]
        names = [v.op.name for v in acc.variables()]
        assert names == sorted(names) and "GradientAccumulator/micro_step" in names
        assert "beta1_power" in names and len(names) == len(set(names))
        assert acc.variables() == sorted(acc.optimizer.variables() + acc.state_variables, key=lambda v: v.name)
        assert acc.accumulators[0] in acc.state_variables


def test_half_precision_variables_accumulate_in_float32():
    with tf.Graph().as_default():
        c = v1.placeholder(tf.float16, [2])
        w = v1.get_variable("w", initializer=np.array([1.0, 1.0], np.float16))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 4)
        train_op = acc.minimize(tf.reduce_sum(c * w))
        assert acc.accumulators[0].dtype.base_dtype == tf.float32
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            # 2049 is not a float16: a float16 running sum would round it away.
            for value in [2048.0, 1.0, -2048.0, 1.0]:
                sess.run(train_op, {c: [value, 0.0]})
            np.testing.assert_array_equal(sess.run(w), np.array([0.5, 1.0], np.float16))


# ------------------------------------------------------------------- errors


class NotAnOptimizer(object):
    pass


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(optimizer=NotAnOptimizer()), TypeError, r"`optimizer` must be a tf.compat.v1.train.Optimizer, "
                                                  r"got NotAnOptimizer"),
    (dict(optimizer="adam"), TypeError, r"`optimizer` .* got str: 'adam'"),
    (dict(num_micro_batches=0), ValueError, r"`num_micro_batches` must be an int >= 1, got 0"),
    (dict(num_micro_batches=-2), ValueError, r"`num_micro_batches` .* got -2"),
    (dict(num_micro_batches=2.0), ValueError, r"`num_micro_batches` .* got 2.0"),
    (dict(num_micro_batches=True), ValueError, r"`num_micro_batches` .* got True"),
    (dict(num_micro_batches="4"), ValueError, r"`num_micro_batches` .* got '4'"),
    (dict(clip_norm=0), ValueError, r"`clip_norm` must be None or a finite number > 0, got 0"),
    (dict(clip_norm=-1.5), ValueError, r"`clip_norm` .* got -1.5"),
    (dict(clip_norm="1"), TypeError, r"`clip_norm` must be None or a number > 0, got '1'"),
    (dict(name=""), ValueError, r"`name` must be a non-empty string, got ''"),
])
def test_constructor_errors(kwargs, error, message):
    args = dict(optimizer=v1.train.GradientDescentOptimizer(0.1), num_micro_batches=2)
    args.update(kwargs)
    optimizer = args.pop("optimizer")
    with pytest.raises(error, match=message):
        gradaccum.GradientAccumulator(optimizer, **args)


def test_nesting_is_an_error():
    inner = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2)
    with pytest.raises(TypeError, match=r"`optimizer` is already a GradientAccumulator \(num_micro_batches=2\)"):
        gradaccum.GradientAccumulator(inner, 3)


def _build_error(build):
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=np.array([1.0, 2.0]))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2)
        build(acc, w)


@pytest.mark.parametrize("build, error, message", [
    (lambda acc, w: acc.minimize(tf.reduce_sum(w), weight=tf.ones([3])), ValueError,
     r"`weight` must be a scalar, got shape \(3,\)"),
    (lambda acc, w: acc.minimize(tf.reduce_sum(w), weight="big"), TypeError,
     r"`weight` must have a numeric dtype, got string"),
    (lambda acc, w: acc.minimize(tf.reduce_sum(w), weight=True), TypeError, r"`weight` .* got True"),
    (lambda acc, w: acc.minimize(tf.reduce_sum(w), var_list=[]), ValueError,
     r"`var_list` must not be empty, got \[\]"),
    (lambda acc, w: acc.minimize(tf.reduce_sum(w), var_list=[w, "b"]), TypeError,
     r"`var_list` must hold only variables, got 'b'"),
    (lambda acc, w: acc.apply_gradients([(None, w)]), ValueError,
     r"`grads_and_vars` has no gradient for any variable: \['w'\]"),
    (lambda acc, w: acc.apply_gradients([(tf.ones([2]), "w")]), TypeError,
     r"`grads_and_vars` must pair gradients with variables, got 'w'"),
    (lambda acc, w: acc.apply_gradients(5), TypeError, r"`grads_and_vars` must be a list"),
])
def test_build_errors(build, error, message):
    with pytest.raises(error, match=message):
        _build_error(build)


def test_two_train_ops_have_their_own_windows():
    with tf.Graph().as_default():
        c = v1.placeholder(tf.float64, [2])
        w = v1.get_variable("w", initializer=np.array([1.0, 2.0]))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2)
        first = acc.minimize(tf.reduce_sum(c * w))
        second = acc.minimize(tf.reduce_sum(-c * w))
        assert [win.train_op for win in acc.windows] == [first, second]
        assert v1.get_collection(v1.GraphKeys.TRAIN_OP) == [first, second]
        with pytest.raises(ValueError, match=r"built 2 train ops, each with its own window: take the one"):
            acc.micro_step  # noqa: B018
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(first, {c: [1.0, 1.0]})
            sess.run(second, {c: [4.0, 4.0]})
            assert sess.run([win.micro_step for win in acc.windows]) == [1, 1]
            sess.run(first, {c: [3.0, 3.0]})  # first's window: mean 2
            np.testing.assert_array_equal(sess.run(w), [-1.0, 0.0])
            sess.run(second, {c: [2.0, 2.0]})  # second's window: mean of -4, -2
            np.testing.assert_array_equal(sess.run(w), [2.0, 3.0])


def test_properties_before_building_are_an_error():
    acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2)
    with pytest.raises(ValueError, match=r"has no train op yet: call `minimize` or `apply_gradients` first"):
        acc.accumulate_op  # noqa: B018


# ------------------------------------------------ interfaces with other modules


class FakeWindowStatistics(gradaccum.WindowObserver):
    """A window-statistics observer: counts its hooks' runs; ``applied`` records ``w`` as it sees it."""

    def __init__(self, w):
        self.counts = dict((name, v1.get_variable("fake_" + name, initializer=np.float64(0.0), trainable=False))
                           for name in ("update", "accumulate", "finalize", "reset"))
        self.seen = v1.get_variable("fake_seen", initializer=np.zeros(2), trainable=False)
        self._w = w
        self.update_op = self.counts["update"].assign_add(1.0).op
        v1.add_to_collection(_update_ops.WINDOW_STATISTICS, self)
        v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, self.update_op)

    def added(self, micro_batch):
        return self.counts["accumulate"].assign_add(1.0).op

    def applied(self, update):
        return tf.group(self.counts["finalize"].assign_add(1.0), self.seen.assign(self._w.read_value()))

    def reset(self):
        return self.counts["reset"].assign_add(1.0).op

    def values(self, sess):
        return dict((name, sess.run(var)) for name, var in self.counts.items())


def _with_window_statistics(k, **minimize_kwargs):
    c = v1.placeholder(tf.float64, [2])
    weight = v1.placeholder_with_default(tf.constant(1.0, tf.float64), [])
    w = v1.get_variable("w", initializer=np.array([10.0, 20.0]))
    fake = FakeWindowStatistics(w)
    counter = v1.get_variable("plain_counter", initializer=np.float64(0.0), trainable=False)
    v1.add_to_collection(v1.GraphKeys.UPDATE_OPS, counter.assign_add(1.0).op)
    acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), k)
    train_op = acc.minimize(tf.reduce_sum(c * w), weight=weight, **minimize_kwargs)
    return c, weight, w, fake, counter, acc, train_op


def test_window_statistics_accumulate_per_micro_step_and_finalize_after_the_apply():
    with tf.Graph().as_default():
        c, weight, w, fake, counter, acc, train_op = _with_window_statistics(3)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for value in (1.0, 2.0, 3.0):
                sess.run(train_op, {c: [value, 0.0]})
            assert fake.values(sess) == dict(update=0.0, accumulate=3.0, finalize=1.0, reset=0.0)
            assert sess.run(counter) == 3.0  # a plain update op still runs on every micro-step
            np.testing.assert_array_equal(sess.run(fake.seen), [8.0, 20.0])  # w after the apply
            for _ in range(3):  # a zero-weight window is skipped: reset, no finalize
                sess.run(train_op, {c: [1.0, 0.0], weight: 0.0})
            sess.run(acc.accumulate_op, {c: [1.0, 0.0]})
            sess.run(acc.zero_op)
            assert fake.values(sess) == dict(update=0.0, accumulate=7.0, finalize=1.0, reset=2.0)


def test_window_statistics_with_k1_are_the_plain_update_ops():
    with tf.Graph().as_default():
        c, _, w, fake, counter, acc, train_op = _with_window_statistics(1)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(2):
                sess.run(train_op, {c: [1.0, 0.0]})
            assert fake.values(sess) == dict(update=2.0, accumulate=0.0, finalize=0.0, reset=0.0)
            assert sess.run(counter) == 2.0


def test_apply_gradients_runs_only_the_update_ops_it_is_given():
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=np.array([1.0, 2.0]))
        fake = FakeWindowStatistics(w)
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2)
        grads = acc.compute_gradients(tf.reduce_sum(w))
        without = acc.apply_gradients(grads)
        given = acc.apply_gradients(grads, update_ops=[fake.update_op])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(without)
            assert fake.values(sess)["accumulate"] == 0.0
            sess.run(given)
            sess.run(given)
            assert fake.values(sess) == dict(update=0.0, accumulate=2.0, finalize=1.0, reset=0.0)


class FakeReducer(gradaccum.Reducer):
    """A reducer that "reduces" by multiplying sums and weight; counts its reductions' runs."""

    def __init__(self, learning_rate, sum_factor, weight_factor):
        super(FakeReducer, self).__init__(v1.train.GradientDescentOptimizer(learning_rate), "FakeReducer")
        self._factors = sum_factor, weight_factor
        self.seen_sums = []
        self.counter = v1.get_variable("reductions", initializer=np.int64(0), trainable=False)

    def reduce(self, sums_and_vars, total, extras):
        self.seen_sums.append([g for g, _ in sums_and_vars])
        with tf.control_dependencies([self.counter.assign_add(1)]):
            scaled = [(_scaled(g, self._factors[0]), v) for g, v in sums_and_vars]
            return scaled, total * tf.cast(self._factors[1], total.dtype), extras


def _scaled(grad, factor):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
    return grad * factor


@pytest.mark.parametrize("k", [1, 3])
def test_reducer_reduces_once_per_window_and_its_result_is_applied(k):
    with tf.Graph().as_default():
        c, weight, w, step, acc, train_op = scalar_problem(k, FakeReducer(1.0, 2.0, 2.0))
        assert acc.optimizer.seen_sums and all(g.dtype == tf.float64 for g in acc.optimizer.seen_sums[0])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for value, size in [(1.0, 3.0), (5.0, 1.0), (2.0, 2.0)] * (2 if k == 1 else 1):
                sess.run(train_op, {c: [value, 0.0], weight: size})
            assert sess.run(acc.optimizer.counter) == (6 if k == 1 else 1)
            if k == 3:  # (3 * 1 + 1 * 5 + 2 * 2) / 6 = 2: doubling sums and weight changes nothing
                np.testing.assert_array_equal(sess.run(w), [8.0, 20.0])
                assert sess.run(step) == 1
            else:  # each micro-batch is its own window
                np.testing.assert_array_equal(sess.run(w), [10.0 - 2 * 8.0, 20.0])


@pytest.mark.parametrize("k", [1, 3])
def test_reducer_with_zero_total_weight_skips(k):
    with tf.Graph().as_default():
        c, _, w, step, acc, train_op = scalar_problem(k, FakeReducer(1.0, 1.0, 0.0))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(k):
                sess.run(train_op, {c: [1.0, 1.0]})
            np.testing.assert_array_equal(sess.run(w), [10.0, 20.0])
            assert sess.run([step, acc.skipped_windows]) == [0, 1]


def test_reducer_gets_sparse_sums():
    ids = np.array([0, 2, 2])
    with tf.Graph().as_default():
        table = v1.get_variable("table", initializer=np.ones([4, 2]))
        index = v1.placeholder(tf.int32, [None])
        acc = gradaccum.GradientAccumulator(FakeReducer(1.0, 2.0, 2.0), 2)
        train_op = acc.minimize(tf.reduce_sum(tf.gather(table, index)))
        assert isinstance(acc.optimizer.seen_sums[0][0], tf.IndexedSlices)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {index: ids[:1]})
            sess.run(train_op, {index: ids[1:]})
            # mean of the two micro-batches' gradients: row 0 gets 1/2, row 2 gets 2/2
            np.testing.assert_array_equal(sess.run(table)[:, 0], [0.5, 1.0, 0.0, 1.0])


class FakeStatistics(statistics_module.GradientStatistics):
    """Counts observe_small/observe_big/discard runs; observe_big records ``w``."""

    def __init__(self, pairs, dtype):  # pylint: disable=super-init-not-called
        self.created = (len(pairs), dtype)
        self.counts = dict((name, tf.compat.v1.Variable(np.float64(0.0), trainable=False, name="fake_" + name))
                           for name in ("small", "big", "discard"))
        self.seen = tf.compat.v1.Variable(np.zeros(2), trainable=False, name="fake_seen")
        self._variables = sorted(list(self.counts.values()) + [self.seen], key=lambda v: v.name)
        self.small_batches = []
        self._w = pairs[0][1]

    @property
    def variables(self):
        return self._variables

    def small_sums(self):
        return []

    def observe_small(self, grads, weight, small_batches=None):
        self.small_batches.append(small_batches)
        return self.counts["small"].assign_add(1.0).op

    def observe_big(self, averaged_grads, window_weight, small_sums=None):
        return tf.group(self.counts["big"].assign_add(tf.cast(window_weight, tf.float64)),
                        self.seen.assign(self._w.read_value()))

    def discard(self):
        return self.counts["discard"].assign_add(1.0).op


@pytest.fixture
def fake_statistics(monkeypatch):
    made = []

    def create(pairs, dtype):
        made.append(FakeStatistics(pairs, dtype))
        return made[-1]

    monkeypatch.setattr(statistics_module, "create", create)
    return made


@pytest.mark.parametrize("k", [1, 3])
def test_statistics_are_observed_per_micro_step_and_per_applied_window(k, fake_statistics):
    with tf.Graph().as_default():
        c, weight, w, step, acc, train_op = scalar_problem(k, v1.train.GradientDescentOptimizer(1.0),
                                                           statistics=True)
        (stats,) = fake_statistics
        assert acc.statistics is stats and stats.created == (1, tf.float64)
        assert set(stats.variables) <= set(acc.variables())
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(k):
                sess.run(train_op, {c: [1.0, 0.0], weight: 2.0})
            values = sess.run([stats.counts["small"], stats.counts["big"], stats.counts["discard"]])
            assert values == [k, 2.0 * k if k == 1 else 6.0, 0.0]
            np.testing.assert_array_equal(sess.run(stats.seen), [10.0, 20.0])  # before the apply
            for _ in range(k):
                sess.run(train_op, {c: [1.0, 0.0], weight: 0.0})
            assert sess.run(stats.counts["discard"]) == 1.0
            if k > 1:
                sess.run(acc.zero_op)
                assert sess.run(stats.counts["discard"]) == 2.0


def test_small_batches_reach_the_statistics(fake_statistics):
    with tf.Graph().as_default():
        w = v1.get_variable("w", initializer=np.array([1.0, 2.0]))
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2, statistics=True)
        grads = acc.compute_gradients(tf.reduce_sum(w))
        towers = [(grads, 3.0), (grads, 2.0)]
        acc.apply_gradients(grads, weight=5.0, small_batches=towers)
        assert fake_statistics[0].small_batches == [towers]


def test_without_statistics_the_graph_is_unchanged(fake_statistics):
    def ops(**kwargs):
        with tf.Graph().as_default() as graph:
            scalar_problem(3, v1.train.AdamOptimizer(0.1), **kwargs)
            return [(op.name, op.type) for op in graph.get_operations()]

    assert ops() == ops(statistics=False)
    assert not fake_statistics and not any("fake" in name for name, _ in ops())
    assert len(ops(statistics=True)) > len(ops())


def test_statistics_must_be_a_bool():
    with pytest.raises(TypeError, match=r"`statistics` must be a bool, got 'yes'"):
        gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2, statistics="yes")


EAGER_SCRIPT = """
import tensorflow as tf
import gradaccum
if not tf.executing_eagerly():  # TF 1.x starts in graph mode
    tf.compat.v1.enable_eager_execution()
v = tf.Variable([1.0, 2.0])
acc = gradaccum.GradientAccumulator(tf.compat.v1.train.GradientDescentOptimizer(0.1), %d)
for build in (lambda: acc.minimize(lambda: tf.reduce_sum(v * v)),
              lambda: acc.apply_gradients([(tf.ones([2]), v)])):
    try:
        build()
        print("BUILT")
    except RuntimeError as error:
        print("ERROR", error)
"""


@pytest.mark.one_behaviour(reason="the child runs eagerly, as a fresh Python starts, whatever the session's "
                                  "behaviour: the tf1 session's run is the same run")
@pytest.mark.parametrize("k", [1, 4])
def test_eager_execution_is_one_error_naming_the_fix(k, tmp_path):
    import subprocess

    import forkserver

    program = tmp_path / "eager.py"
    program.write_text(EAGER_SCRIPT % k)
    # Forked from a server that imported TensorFlow and nothing else: eager, as a fresh Python.
    result = subprocess.run(forkserver.command() + [str(program)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            universal_newlines=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ERROR", "BUILT"))]
    assert len(lines) == 2, result.stdout + result.stderr
    for line in lines:
        assert line.startswith("ERROR GradientAccumulator builds TF1 graph-mode train ops, but eager")
        assert "tf.compat.v1.disable_eager_execution()" in line and "tf.compat.v1.disable_v2_behavior()" in line


# ----------------------------------------------------- memory passes (issue 13)


def _reachable(fetch):
    """Every op one run of ``fetch`` may execute (both branches of each v1 cond)."""
    seen, todo = set(), [fetch]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return seen


def _uses(tensor, ops):
    """The ops in ``ops`` that use ``tensor``, seen through the Switch/Identity ops of v1 conds."""
    found = []
    for op in tensor.consumers():
        if op not in ops:
            continue
        if op.type in ("Switch", "Identity"):
            for output in op.outputs:
                found.extend(_uses(output, ops))
        else:
            found.append(op)
    return found


def _cache_passes(weighted, skip_nonfinite=False):
    """Builds k = 4 on a float32 MLP with v1 control flow (a flat graph whose ops are those of either
    TF behaviour) and returns, per cache, the ops of one micro-step that touch it."""
    with tf.Graph().as_default(), gradaccum._compat.v1_control_flow():
        x, y, loss, variables = _mlp(np.float32)
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4, skip_nonfinite=skip_nonfinite)
        grads_and_vars = acc.compute_gradients(loss)
        train_op = acc.apply_gradients(grads_and_vars, weight=tf.shape(x)[0] if weighted else None)
        ops = _reachable(train_op)
        result = []
        for (grad, _), cache in zip(grads_and_vars, acc.accumulators):
            touching = _uses(cache.handle, ops)
            reads = [op for op in touching if op.type != "AssignVariableOp"]
            writes = [op for op in touching if op.type == "AssignVariableOp"]
            read_by = [op.type for read in reads if read.type == "ReadVariableOp"
                       for op in _uses(read.outputs[0], ops)]
            zeros_from = [op.inputs[1].op.type for op in writes]
            grad_used_by = [op.type for op in _uses(grad, ops)]
            result.append((sorted(op.type for op in reads), read_by, zeros_from, grad_used_by))
        return result


@pytest.mark.parametrize("weighted", [False, True], ids=["weight_none", "weight_given"])
def test_one_micro_step_makes_one_pass_per_cache_and_one_division_at_the_end(weighted):
    kernel = "ResourceApplyGradientDescent" if weighted else "AssignAddVariableOp"
    first = "Mul" if weighted else "AssignVariableOp"
    for reads, read_by, written_from, grad_used_by in _cache_passes(weighted):
        # The accumulate kernel (cache += weight * grad, fused) and the window end's one read.
        assert reads == sorted([kernel, "ReadVariableOp"])
        assert read_by == ["RealDiv"]  # the division is the only pass over the cache at the end
        # One write: a window's first micro-batch, w * g (g itself, through the cond's Switch).
        # No fill of zeros: no pass resets the cache, on applied or skipped windows.
        assert written_from == (["Mul"] if weighted else ["Switch"])
        # The weight is the add kernel's scalar; w * g exists only on the first micro-batch.
        assert sorted(grad_used_by) == sorted([kernel, first])


def _minimize_cache_kernels(**kwargs):
    """``minimize(loss, weight=batch size)`` with k = 4 on the float32 MLP: per cache, the ops of one
    micro-step that write it or add to it (every op on it but the window end's read)."""
    with tf.Graph().as_default(), gradaccum._compat.v1_control_flow():
        x, y, loss, variables = _mlp(np.float32)
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4, **kwargs)
        ops = _reachable(acc.minimize(loss, weight=tf.shape(x)[0]))
        return [[op for op in _uses(cache.handle, ops) if op.type != "ReadVariableOp"] for cache in acc.accumulators]


def test_weight_given_to_minimize_costs_no_pass_over_the_gradients():
    """The weight rides on backprop (``grad_loss``): each gradient goes straight into the
    write or the add kernel, with no product and no weighted kernel."""
    for kernels in _minimize_cache_kernels():
        assert sorted(op.type for op in kernels) == ["AssignAddVariableOp", "AssignVariableOp"]
        assert [op.inputs[1].op.type for op in kernels] == ["Switch", "Switch"]


@pytest.mark.parametrize("kwargs", [{"accumulation_dtype": tf.float64}, {"statistics": True}],
                         ids=["wider_caches", "statistics"])
def test_weight_stays_in_the_add_kernel_where_backprop_cannot_carry_it_exactly(kwargs):
    for kernels in _minimize_cache_kernels(**kwargs):
        assert sorted(op.type for op in kernels) == ["AssignVariableOp", "ResourceApplyGradientDescent"]


def test_skip_nonfinite_adds_one_read_of_the_sums_only():
    for reads, read_by, _, _ in _cache_passes(True, skip_nonfinite=True):
        assert reads == ["ReadVariableOp", "ResourceApplyGradientDescent"]
        assert sorted(read_by) == ["IsFinite", "RealDiv"]
