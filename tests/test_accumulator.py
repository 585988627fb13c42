"""Numbers for GradientAccumulator: equivalence, untouched state, counters, errors."""
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
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


def _train(opt_name, dtype, sizes=None, weighted=False, updates=3):
    """Runs ``updates`` applied updates; sizes=None is plain full-batch training."""
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
            train_op = opt.minimize(loss, global_step=step, weight=weight)
            feeds = [{x: X[s], y: Y[s]} for s in _slices(sizes)]
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(updates):
                for feed in feeds:
                    sess.run(train_op, feed)
            return sess.run(variables), sess.run(step)


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_accumulated_equals_full_batch(opt_name, split, dtype):
    sizes, weighted = SPLITS[split]
    expected, expected_step = _train(opt_name, dtype)
    actual, actual_step = _train(opt_name, dtype, sizes, weighted)
    assert actual_step == expected_step == 3
    initial, _ = _train(opt_name, dtype, updates=0)
    for got, want, start in zip(actual, expected, initial):
        assert not np.allclose(want, start), "the reference did not move: the test would prove nothing"
        np.testing.assert_allclose(got, want, **TOLERANCE[dtype])


def test_uneven_micro_batches_need_the_weight():
    """Without weights the mean of micro-batch means is not the full-batch mean."""
    expected, _ = _train("sgd", np.float64)
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


def test_accumulators_hold_the_weighted_sum_and_reset():
    with tf.Graph().as_default():
        c, weight, w, step, acc, train_op = scalar_problem(3, v1.train.AdamOptimizer(0.1))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {c: [1.0, 2.0], weight: 2.0})
            sess.run(train_op, {c: [3.0, 4.0], weight: 1.0})
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [5.0, 8.0])
            assert sess.run([acc.micro_step, acc.weight_sum]) == [2, 3.0]
            sess.run(train_op, {c: [0.0, 0.0], weight: 1.0})
            np.testing.assert_array_equal(sess.run(acc.accumulators[0]), [0.0, 0.0])
            assert sess.run([acc.micro_step, acc.weight_sum, step]) == [0, 0.0, 1]


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


def test_manual_pattern_equals_full_batch_and_apply_needs_no_feed():
    X, Y = _data(np.float64)
    expected, _ = _train("adam", np.float64, updates=2)
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
            assert not np.any(sess.run(acc.accumulators[0]))


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


def test_checkpoint_in_the_middle_of_a_window_continues_exactly(tmp_path):
    X, Y = _data(np.float64)
    parts = _slices([3, 3, 3, 3])

    def build():
        x, y, loss, variables = _mlp(np.float64)
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        step = v1.train.get_or_create_global_step()
        return x, y, variables, step, acc.minimize(loss, global_step=step), v1.train.Saver()

    schedule = parts * 2
    expected, _ = _train("adam", np.float64, updates=2)
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
        assert acc.get_slot(w, "accum") is acc.accumulators[0]
        assert acc.get_slot_names() == ["accum", "m", "v"]
        names = [v.op.name for v in acc.variables()]
        assert names == sorted(names) and "GradientAccumulator/micro_step" in names
        assert "beta1_power" in names and len(names) == len(set(names))


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
    (lambda acc, w: acc.minimize(w * w), ValueError, r"`loss` must be a scalar tensor, got shape \(2,\)"),
    (lambda acc, w: acc.minimize(lambda: tf.reduce_sum(w)), TypeError, r"`loss` must be a scalar tensor"),
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


def test_second_train_op_is_an_error():
    def build(acc, w):
        acc.minimize(tf.reduce_sum(w * w))
        acc.minimize(tf.reduce_sum(w))

    with pytest.raises(ValueError, match=r"already built a train op; make one GradientAccumulator per train op"):
        _build_error(build)


def test_properties_before_building_are_an_error():
    acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2)
    with pytest.raises(ValueError, match=r"has no train op yet: call `minimize` or `apply_gradients` first"):
        acc.accumulate_op  # noqa: B018
