"""One run per update: ``subdivisions.minimize`` equals one plain step on the whole batch.

The reference is the plain optimizer, one ``minimize`` step per batch on the
whole batch, in its own graph from the same start. Every check reads the
variables and the optimizer's slots after several updates. A batch of 23 in
k = 4 micro-batches gives uneven sizes (6, 6, 6, 5); the model has a dense
layer, a matrix and a ``tf.gather`` table (a sparse gradient), in float64.
"""
import os

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum._compat import TF_VERSION
from user_optimizers import AdamWeightDecay, Lamb

v1 = tf.compat.v1
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "subdivisions_child.py")
RNG = np.random.RandomState(3)
X = RNG.randn(23, 4)
IDS = RNG.randint(0, 5, size=23).astype(np.int32)
Y = RNG.randn(23)
UPDATES = 3
OPTIMIZERS = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.train.MomentumOptimizer(0.1, 0.9),
    "adam": lambda: v1.train.AdamOptimizer(0.05),
    "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
    "rmsprop": lambda: v1.train.RMSPropOptimizer(0.05),
    "ftrl": lambda: v1.train.FtrlOptimizer(0.1),
    "adadelta": lambda: v1.train.AdadeltaOptimizer(1.0),
    # Written for dense gradients, as BERT's are: trained on _dense_model.
    "bert_adamw": lambda: AdamWeightDecay(0.05, weight_decay_rate=0.01, exclude_from_weight_decay=["b"]),
    "lamb": lambda: Lamb(0.05, weight_decay_rate=0.01),
}
DENSE_ONLY = ("bert_adamw", "lamb")


def _model(x, ids, y, sparse=True):
    """Mean squared error of a dense layer, a matrix and a gathered table (float64).

    ``sparse=False`` looks the table up by a one-hot product: a dense
    gradient, for optimizers written for dense gradients only (BERT's).
    """
    w = v1.get_variable("w", dtype=tf.float64, initializer=np.array([[0.3], [-0.2], [0.1], [0.5]]))
    b = v1.get_variable("b", dtype=tf.float64, initializer=np.array([0.05]))
    table = v1.get_variable("table", dtype=tf.float64, initializer=np.linspace(-1, 1, 10).reshape(5, 2))
    hidden = v1.layers.dense(x, 3, activation=tf.nn.tanh, name="dense",
                             kernel_initializer=v1.constant_initializer(np.linspace(-0.5, 0.5, 12).reshape(4, 3)))
    pred = tf.matmul(x, w)[:, 0] + b + tf.reduce_sum(hidden, 1) + tf.reduce_sum(_lookup(table, ids, sparse), 1)
    return tf.reduce_mean(tf.square(pred - y))


def _lookup(table, ids, sparse):
    return tf.gather(table, ids) if sparse else tf.matmul(tf.one_hot(ids, 5, dtype=table.dtype.base_dtype), table)


def _dense_model(x, ids, y):
    return _model(x, ids, y, sparse=False)


def _placeholders():
    return [v1.placeholder(tf.float64, [None, 4]), v1.placeholder(tf.int32, [None]),
            v1.placeholder(tf.float64, [None])]


def _batches(updates=UPDATES):
    """The whole batch per update: the examples rolled, so that every update sees another order."""
    return [(np.roll(X, u, 0), np.roll(IDS, u), np.roll(Y, u)) for u in range(updates)]


def _values(sess, opt):
    """Every variable and every slot of the (wrapped) optimizer, by name (not the accumulator's own state)."""
    found = {v.op.name: v for v in v1.global_variables()
             if not any(part in v.op.name for part in ("GradientAccumulator", "subdivisions", "adaptive_batch"))}
    return dict(zip(found, sess.run(list(found.values()))))


_PLAIN_RUNS = {}


def _plain(make_opt, batches, clip_norm=None, model=_model):
    """The plain optimizer's variables, slots and losses after one step per batch, handed out as copies: the
    same arguments (the same batches' bytes) give the same run, made once per process for the dozen tests that
    compare with it."""
    key = (make_opt, clip_norm, model, tuple((a.dtype.str, a.shape, a.tobytes()) for batch in batches for a in batch))
    if key not in _PLAIN_RUNS:
        _PLAIN_RUNS[key] = _plain_run(make_opt, batches, clip_norm, model)
    values, losses = _PLAIN_RUNS[key]
    return {name: np.array(value, copy=True) for name, value in values.items()}, list(losses)


def _plain_run(make_opt, batches, clip_norm, model):
    with tf.Graph().as_default():
        feeds = _placeholders()
        loss = model(*feeds)
        opt = make_opt()
        step = v1.train.get_or_create_global_step()
        if clip_norm is None:
            train_op = opt.minimize(loss, global_step=step)
        else:
            grads, variables = zip(*opt.compute_gradients(loss))
            clipped, _ = tf.clip_by_global_norm(grads, clip_norm)
            train_op = opt.apply_gradients(zip(clipped, variables), global_step=step)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([loss, train_op], dict(zip(feeds, batch)))[0] for batch in batches]
            return _values(sess, opt), losses


def _subdivided(make_opt, batches, k=4, model=_model, **kwargs):
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(make_opt(), k, **kwargs)
        step = v1.train.get_or_create_global_step()
        result = gradaccum.subdivisions.minimize(acc, model, feeds, global_step=step)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([result.loss, result.train_op], dict(zip(feeds, batch)))[0] for batch in batches]
            return _values(sess, acc), losses, acc, sess.run(acc.skipped_windows)


def _assert_equal_values(actual, expected, rtol=1e-9, atol=1e-12):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=atol, err_msg=name)


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_equals_one_full_batch_step_per_run(opt_name):
    batches = _batches()
    model = _dense_model if opt_name in DENSE_ONLY else _model
    expected, expected_losses = _plain(OPTIMIZERS[opt_name], batches, model=model)
    actual, losses, _, _ = _subdivided(OPTIMIZERS[opt_name], batches, model=model)
    assert actual.pop("global_step") == UPDATES  # Counted also where the optimizer ignores it (BERT's).
    expected.pop("global_step")
    _assert_equal_values(actual, expected)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-12)


@pytest.mark.parametrize("k", [1, 5, 23])
def test_any_k_up_to_the_batch_size_is_exact(k):
    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["adam"], batches)
    actual, _, _, _ = _subdivided(OPTIMIZERS["adam"], batches, k=k)
    _assert_equal_values(actual, expected)


def test_clip_norm_clips_as_tf_clips_the_full_batch():
    """The sparse rows count as given (repeated rows too), as ``tf.clip_by_global_norm`` counts them."""
    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["momentum"], batches, clip_norm=0.5)
    unclipped, _ = _plain(OPTIMIZERS["momentum"], batches)
    actual, _, _, _ = _subdivided(OPTIMIZERS["momentum"], batches, clip_norm=0.5)
    _assert_equal_values(actual, expected)
    assert not np.allclose(unclipped["w"], expected["w"])  # The clip acted.


def test_window_size_is_read_once_per_run():
    """k from a variable: each run splits its batch into the k it reads; every run equals the full batch."""
    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["adam"], batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        k = v1.get_variable("k", initializer=2, dtype=tf.int32, trainable=False, use_resource=True)
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), k)
        result = gradaccum.subdivisions.minimize(acc, _model, feeds,
                                                 global_step=v1.train.get_or_create_global_step())
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch, size in zip(batches, (2, 7, 23)):
                sess.run(k.assign(size))
                _, read = sess.run([result.train_op, result.num_micro_batches], dict(zip(feeds, batch)))
                assert read == size
            actual = _values(sess, acc)
    del actual["k"]
    _assert_equal_values(actual, expected)


def test_window_size_may_follow_a_schedule_of_global_step():
    """k = 2, then 5, then 23 (one example each) as the step moves: each run reads the k of its step."""
    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["momentum"], batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["momentum"](), gradaccum.step_schedule([1, 2], [2, 5, 23]))
        result = gradaccum.subdivisions.minimize(acc, _model, feeds, global_step=v1.train.get_or_create_global_step())
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            read = [sess.run([result.num_micro_batches, result.train_op], dict(zip(feeds, b)))[0] for b in batches]
            actual = _values(sess, acc)
    assert read == [2, 5, 23]
    _assert_equal_values(actual, expected)


class _CountingReducer(gradaccum.Reducer):
    """One process's reducer that counts the exchanges it builds and keeps the total weight it was given."""

    def __init__(self, optimizer):
        super(_CountingReducer, self).__init__(optimizer, "counting")
        self.built = 0
        self.given_total = v1.get_variable("given_total", [], tf.float64, trainable=False, use_resource=True)

    def reduce(self, sums_and_vars, total, extras):
        self.built += 1
        with tf.control_dependencies([self.given_total.assign(total)]):
            return list(sums_and_vars), tf.identity(total), list(extras)


def test_a_reducer_exchanges_once_per_run_after_the_loop():
    """The window's sums reach the reducer once, after the loop: the whole batch's weight, 23."""
    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["adam"], batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        reducer = _CountingReducer(OPTIMIZERS["adam"]())
        acc = gradaccum.GradientAccumulator(reducer, 4)
        result = gradaccum.subdivisions.minimize(acc, _model, feeds, global_step=v1.train.get_or_create_global_step())
        assert reducer.built == 1
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(result.train_op, dict(zip(feeds, batch)))
                assert sess.run(reducer.given_total) == len(Y)
            actual = _values(sess, acc)
    del actual["given_total"]
    _assert_equal_values(actual, expected)


def test_model_fn_may_give_the_weight():
    """A weight from ``model_fn`` (here twice the size) weighs the micro-batches; equal weights cancel."""
    def weighted_model(x, ids, y):
        return gradaccum.ModelResult(_model(x, ids, y), weight=2 * tf.shape(y)[0])

    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["adam"], batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        result = gradaccum.subdivisions.minimize(acc, weighted_model, feeds,
                                                 global_step=v1.train.get_or_create_global_step())
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(result.train_op, dict(zip(feeds, batch)))
            _assert_equal_values(_values(sess, acc), expected)


def test_callable_input_pulls_k_micro_batches_per_run():
    """A ``tf.data`` iterator batched at the micro-batch size: 4 pulls of 5 per run, 3 runs, then the end."""
    batches = [tuple(column[:20] for column in batch) for batch in _batches()]
    expected, _ = _plain(OPTIMIZERS["adam"], batches)
    stream = tuple(np.concatenate(column) for column in zip(*batches))
    with tf.Graph().as_default():
        iterator = v1.data.make_one_shot_iterator(v1.data.Dataset.from_tensor_slices(stream).batch(5))
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        result = gradaccum.subdivisions.minimize(acc, _model, iterator.get_next,
                                                 global_step=v1.train.get_or_create_global_step())
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(UPDATES):
                sess.run(result.train_op)
            _assert_equal_values(_values(sess, acc), expected)
            with pytest.raises(tf.errors.OutOfRangeError):
                sess.run(result.train_op)


def _dense_net(x, y):
    """Two layers (reference variables under TF1 behaviour): what an early apply would disturb."""
    hidden = v1.layers.dense(x, 16, activation=tf.nn.tanh, name="h",
                             kernel_initializer=v1.glorot_uniform_initializer(seed=1))
    out = v1.layers.dense(hidden, 1, name="out", kernel_initializer=v1.glorot_uniform_initializer(seed=2))
    return tf.reduce_mean(tf.square(out[:, 0] - y))


def _train_dense_net(subdivide, x, y):
    with tf.Graph().as_default():
        feeds = [v1.placeholder(tf.float64, [None, 8]), v1.placeholder(tf.float64, [None])]
        opt = v1.train.AdamOptimizer(0.05)
        if subdivide:
            train_op = gradaccum.subdivisions.minimize(gradaccum.GradientAccumulator(opt, 8), _dense_net,
                                                       feeds).train_op
        else:
            train_op = opt.minimize(_dense_net(*feeds))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(UPDATES):
                sess.run(train_op, dict(zip(feeds, (x, y))))
            return sess.run(v1.trainable_variables())


def test_no_apply_overtakes_a_backward_pass_in_repeated_runs():
    """Five fresh runs of 3 updates: every one equals the full batch (an unordered apply was off by 1e-2)."""
    rng = np.random.RandomState(5)
    x, y = rng.randn(64, 8), rng.randn(64)
    expected = _train_dense_net(False, x, y)
    for _ in range(5):
        for got, want in zip(_train_dense_net(True, x, y), expected):
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("towers, k", [(2, 3), (3, 2)])
def test_towers_each_loop_over_their_shard(towers, k):
    """23 examples over 2 towers of 3 micro-batches (12: 4, 4, 4; 11: 4, 4, 3), or 3 towers of 2."""
    batches = _batches()
    expected, expected_losses = _plain(OPTIMIZERS["adam"], batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), k)
        devices = ["/cpu:%d" % i for i in range(towers)]
        result = gradaccum.subdivisions.minimize(acc, _model, feeds, devices=devices,
                                                 global_step=v1.train.get_or_create_global_step())
        assert len(v1.trainable_variables()) == 5  # Shared, not copied.
        config = v1.ConfigProto(device_count={"CPU": towers})
        with v1.Session(config=config) as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([result.loss, result.train_op], dict(zip(feeds, b)))[0] for b in batches]
            _assert_equal_values(_values(sess, acc), expected)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-12)


# ------------------------------------------------------------------ the window's features


def test_skip_nonfinite_skips_the_run_and_counts_it():
    bad = list(_batches(1)[0])
    bad[2] = bad[2].copy()
    bad[2][7] = np.nan
    batches = [_batches(1)[0], tuple(bad), _batches(2)[1]]
    expected, _ = _plain(OPTIMIZERS["adam"], [batches[0], batches[2]])
    actual, _, _, skipped = _subdivided(OPTIMIZERS["adam"], batches, skip_nonfinite=True)
    assert skipped == 1
    assert actual.pop("global_step") == 2
    expected.pop("global_step")
    _assert_equal_values(actual, expected)


def test_loss_scaling_skips_an_overflow_and_lowers_the_scale():
    """float16 compute inside a dynamic loss-scale optimizer: an overflowing batch is skipped, then one applies."""
    def model(x):
        w = v1.get_variable("w", initializer=np.array([[0.5], [-0.25]], np.float32))
        return tf.reduce_mean(tf.cast(tf.matmul(x, tf.cast(w, tf.float16)), tf.float32) ** 2)

    normal = np.array([[1.0, 2.0], [0.5, -1.0], [0.25, 0.5]], np.float16)
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float16, [None, 2])
        scaled = v1.train.experimental.MixedPrecisionLossScaleOptimizer(v1.train.MomentumOptimizer(0.01, 0.9),
                                                                          "dynamic")
        acc = gradaccum.GradientAccumulator(scaled, 3)
        step = v1.train.get_or_create_global_step()
        result = gradaccum.subdivisions.minimize(acc, model, x, global_step=step)
        (scale,) = [v for v in v1.global_variables() if v.op.name.endswith("current_loss_scale")]
        (w,) = v1.trainable_variables()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            before = sess.run([w, scale])
            sess.run(result.train_op, {x: normal * np.float16(200.0)})  # overflows float16 at scale 2**15
            np.testing.assert_array_equal(sess.run(w), before[0])
            assert sess.run(scale) == before[1] / 2 and sess.run(acc.skipped_windows) == 1
            sess.run(result.train_op, {x: normal})
            got = sess.run([w, step])
    value = np.array([[0.5], [-0.25]])
    grad = np.mean([2 * (r @ value) * r[:, None] for r in normal.astype(np.float64)], axis=0)
    np.testing.assert_allclose(got[0], value - 0.01 * grad, rtol=1e-3)
    assert got[1] == 1


def _fused_statistics(batches, k=4):
    """The fused train op's statistics on the same micro-batches (6, 6, 6, 5): the reference."""
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), k, statistics=True)
        train_op = acc.minimize(_model(*feeds), global_step=v1.train.get_or_create_global_step(),
                                weight=tf.shape(feeds[2])[0])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                for start, stop in ((0, 6), (6, 12), (12, 18), (18, 23)):
                    sess.run(train_op, {f: b[start:stop] for f, b in zip(feeds, batch)})
            return sess.run(acc.statistics.variables), _values(sess, acc)


def test_statistics_see_each_micro_batch_as_the_fused_train_op_does():
    batches = _batches()
    expected_stats, expected = _fused_statistics(batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4, statistics=True)
        result = gradaccum.subdivisions.minimize(acc, _model, feeds, global_step=v1.train.get_or_create_global_step())
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(result.train_op, dict(zip(feeds, batch)))
            stats = sess.run(acc.statistics.variables)
            actual = _values(sess, acc)
    for got, want in zip(stats, expected_stats):
        np.testing.assert_allclose(got, want, rtol=1e-9)
    assert stats[[v.op.name.endswith("windows") for v in acc.statistics.variables].index(True)] == UPDATES
    _assert_equal_values(actual, expected)


def _adaptive(subdivide, updates=6, micro=4):
    """AdaptiveBatch over micro-batches of 4 of a 200-example stream: the k it chooses and the end state."""
    rng = np.random.RandomState(11)
    x, ids, y = rng.randn(400, 4), rng.randint(0, 5, 400).astype(np.int32), rng.randn(400)
    with tf.Graph().as_default():
        feeds = _placeholders()
        step = v1.train.get_or_create_global_step()
        policy = gradaccum.AdaptiveBatch(micro_batch_size=micro, min_micro_batches=2, max_micro_batches=8, rule="sgd")
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), policy)
        if subdivide:
            result = gradaccum.subdivisions.minimize(acc, _model, feeds, global_step=step)
            size, train_op = result.num_micro_batches, result.train_op
        else:
            train_op = acc.minimize(_model(*feeds), global_step=step, weight=tf.shape(feeds[2])[0])
            size = acc.window_size
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            start, sizes = 0, []
            for _ in range(updates):
                k = int(sess.run(size))
                sizes.append(k)
                if subdivide:
                    window = slice(start, start + k * micro)
                    sess.run(train_op, {f: a[window] for f, a in zip(feeds, (x, ids, y))})
                for i in range(0 if subdivide else k):
                    part = slice(start + i * micro, start + (i + 1) * micro)
                    sess.run(train_op, {f: a[part] for f, a in zip(feeds, (x, ids, y))})
                start += k * micro
            return sizes, _values(sess, acc), sess.run(acc.statistics.variables)


def test_adaptive_batch_chooses_as_the_fused_train_op_does():
    """The policy reads the statistics of the loop's micro-batches and sets the next run's k."""
    sizes, values, stats = _adaptive(True)
    expected_sizes, expected_values, expected_stats = _adaptive(False)
    assert sizes == expected_sizes and len(set(sizes)) > 1, sizes
    _assert_equal_values(values, expected_values)
    for got, want in zip(stats, expected_stats):
        np.testing.assert_allclose(got, want, rtol=1e-9)


def _bn_model(x, y):
    h = v1.layers.batch_normalization(x, training=True, name="bn", momentum=0.5)
    w = v1.get_variable("w", dtype=tf.float64, initializer=np.array([[0.3], [-0.2], [0.1], [0.5]]))
    return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - y))


MODEL_AND_AVERAGES = ["bn/beta", "bn/gamma", "bn/moving_mean", "bn/moving_variance", "w"]


def _window_bn_model(x, y):
    h = gradaccum.batch_normalization(x, training=True, name="bn", momentum=0.5)
    w = v1.get_variable("w", dtype=tf.float64, initializer=np.array([[0.3], [-0.2], [0.1], [0.5]]))
    return tf.reduce_mean(tf.square(tf.matmul(h, w)[:, 0] - y))


@pytest.mark.parametrize("model, updates", [(_bn_model, 2), (_window_bn_model, 1)],
                         ids=["tf-batch-norm", "window-batch-norm"])
def test_update_ops_run_as_the_fused_train_op_runs_them(model, updates):
    """TF's batch norm moves its averages on every micro-batch; window batch norm once, from the pooled window."""
    batches = [(b[0], b[2]) for b in _batches()]
    results = []
    for subdivide in (True, False):
        with tf.Graph().as_default():
            feeds = [v1.placeholder(tf.float64, [None, 4]), v1.placeholder(tf.float64, [None])]
            acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
            if subdivide:
                train = gradaccum.subdivisions.minimize(acc, model, feeds).train_op
                # The first micro-batch's only.
                assert len(v1.get_collection(v1.GraphKeys.UPDATE_OPS)) == updates
            else:
                train = acc.minimize(model(*feeds), weight=tf.shape(feeds[1])[0])
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for batch in batches:
                    if subdivide:
                        sess.run(train, dict(zip(feeds, batch)))
                        continue
                    for start, stop in ((0, 6), (6, 12), (12, 18), (18, 23)):
                        sess.run(train, {f: b[start:stop] for f, b in zip(feeds, batch)})
                model_variables = [v for v in v1.global_variables() if v.op.name in MODEL_AND_AVERAGES]
                results.append(dict(zip([v.op.name for v in model_variables], sess.run(model_variables))))
    _assert_equal_values(results[0], results[1])
    assert sorted(results[0]) == sorted(MODEL_AND_AVERAGES)
    assert not np.allclose(results[0]["bn/moving_mean"], 0.0)  # The averages moved.


def test_no_window_state_between_runs():
    """No caches, no micro_step: only the skip counter, so every checkpoint is at a window boundary."""
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        result = gradaccum.subdivisions.minimize(acc, _model, feeds)
        assert [v.op.name for v in acc.state_variables] == ["GradientAccumulator/skipped_windows"]
        assert acc.accumulators == []
        assert result.train_op in v1.get_collection(v1.GraphKeys.TRAIN_OP)
        assert sorted(v.op.name for v in v1.trainable_variables()) == ["b", "dense/bias", "dense/kernel",
                                                                         "table", "w"]


def test_monitored_session_hooks_count_updates(tmp_path):
    """``StopAtStepHook(last_step=3)`` stops after 3 runs, which are 3 updates; the checkpoint holds them."""
    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["adam"], batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        step = v1.train.get_or_create_global_step()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        result = gradaccum.subdivisions.minimize(acc, _model, feeds, global_step=step)
        runs = 0
        with v1.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), save_summaries_steps=None,
                                               hooks=[v1.train.StopAtStepHook(last_step=UPDATES)]) as sess:
            while not sess.should_stop():
                sess.run(result.train_op, dict(zip(feeds, batches[runs])))
                runs += 1
    assert runs == UPDATES
    checkpoint = tf.train.latest_checkpoint(str(tmp_path))
    for name in ("global_step", "w", "table", "dense/kernel", "beta1_power"):
        np.testing.assert_allclose(tf.train.load_variable(checkpoint, name), expected[name], rtol=1e-9)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_two_collective_workers_equal_one_process_on_the_union(tmp_path):
    """Worker 0 feeds 14 examples, worker 1 9, each in 3 micro-batches; one all-reduce after the loop.

    The engines: the collective one, with ``clip_norm``, stage 1 sharding, and
    the collective one with the model recomputed in each worker's backward pass.

    With ``clip_norm`` the sparse rows' squared norm travels with the sums, so
    the workers clip by the norm ``tf.clip_by_global_norm`` measures on the union.
    """
    from test_sharded import _run_job

    out = str(tmp_path / "run")
    for status, _, stderr in _run_job(2, ["--out", out], child_script=_CHILD):
        assert status == 0, stderr[-3000:]
    plain = _plain(OPTIMIZERS["adam"], _batches())[0]
    clipped = _plain(OPTIMIZERS["adam"], _batches(), clip_norm=0.5)[0]
    assert not np.allclose(plain["w"], clipped["w"])  # The clip acts.
    for engine, expected in (("collective", plain), ("clip", clipped), ("stage1", plain), ("recompute", plain)):
        for rank in (0, 1):
            got = dict(np.load("%s-%s-worker%d.npz" % (out, engine, rank)))
            # Stage 1 keeps Adam's moments on their owner only: compare the model there.
            names = [n for n in expected if engine != "stage1" or "Adam" not in n and "power" not in n]
            for name in names:
                np.testing.assert_allclose(got[name.replace("/", "__")], expected[name], rtol=1e-9, atol=1e-12,
                                           err_msg="%s worker %d %s" % (engine, rank, name))


# ------------------------------------------------------------------ errors


def _build(acc=None, inputs=None, model=_model, **kwargs):
    feeds = _placeholders() if inputs is None else inputs
    acc = acc or gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), 4)
    return feeds, gradaccum.subdivisions.minimize(acc, model, feeds, **kwargs)


@pytest.mark.parametrize("static", [True, False], ids=["static", "fed"])
@pytest.mark.parametrize("size, towers", [(3, 1), (2, 3), (1, 2)])
def test_a_batch_smaller_than_k_x_towers_is_exact_without_an_empty_micro_batch(size, towers, static):
    """Each tower takes min(k, its shard) micro-batches; a tower without examples runs no model."""
    batches = [tuple(part[:size] for part in batch) for batch in _batches()]
    expected, _ = _plain(OPTIMIZERS["adam"], batches)
    with tf.Graph().as_default():
        feeds = _placeholders()
        devices = ["/cpu:%d" % i for i in range(towers)]
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        step = v1.train.get_or_create_global_step()
        if static:
            inputs = [v1.placeholder_with_default(tf.constant(b, f.dtype), [size] + f.shape.as_list()[1:])
                      for f, b in zip(feeds, batches[0])]
            feeds = inputs
        result = gradaccum.subdivisions.minimize(acc, _model, feeds, devices=devices, global_step=step)
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": towers})) as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(result.train_op, dict(zip(feeds, batch)))
            _assert_equal_values(_values(sess, acc), expected)


def test_an_empty_batch_is_an_error_when_it_runs():
    with tf.Graph().as_default():
        feeds, result = _build()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError, match="`inputs` must hold at least one example"):
                sess.run(result.train_op, {f: b[:0] for f, b in zip(feeds, _batches(1)[0])})


def test_an_empty_static_batch_is_an_error_when_built():
    with tf.Graph().as_default():
        inputs = [tf.constant(X[:0]), tf.constant(IDS[:0]), tf.constant(Y[:0])]
        with pytest.raises(ValueError, match=r"`inputs` must hold at least 1 example, got a batch of 0"):
            _build(inputs=inputs)


def _sparse_model(x, ids, y):
    """``_model`` with ``x`` given as a ``tf.SparseTensor``: its product through sparse_dense_matmul."""
    w = v1.get_variable("w", dtype=tf.float64, initializer=np.array([[0.3], [-0.2], [0.1], [0.5]]))
    table = v1.get_variable("table", dtype=tf.float64, initializer=np.linspace(-1, 1, 10).reshape(5, 2))
    pred = tf.sparse.sparse_dense_matmul(x, w)[:, 0] + tf.reduce_sum(tf.gather(table, ids), 1)
    return tf.reduce_mean(tf.square(pred - y))


@pytest.mark.parametrize("towers", [1, 2])
def test_sparse_inputs_are_sliced_exactly(towers):
    """A ``tf.SparseTensor`` batch in micro-batches (rows renumbered) equals the dense batch's full step."""
    batches = [(np.where(np.abs(b[0]) > 0.5, b[0], 0.0),) + tuple(b[1:]) for b in _batches()]

    def dense_model(x, ids, y):
        return _sparse_model(tf.sparse.from_dense(x), ids, y)

    expected, _ = _plain(OPTIMIZERS["adam"], batches, model=dense_model)
    with tf.Graph().as_default():
        x = v1.sparse_placeholder(tf.float64, [None, 4])
        feeds = [x] + _placeholders()[1:]
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 3)
        devices = ["/cpu:%d" % i for i in range(towers)]
        result = gradaccum.subdivisions.minimize(acc, _sparse_model, feeds, devices=devices,
                                                 global_step=v1.train.get_or_create_global_step())
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": towers})) as sess:
            sess.run(v1.global_variables_initializer())
            for dense, ids, y in batches:
                indices = np.argwhere(dense != 0)
                value = tf.compat.v1.SparseTensorValue(indices, dense[dense != 0], dense.shape)
                sess.run(result.train_op, {x: value, feeds[1]: ids, feeds[2]: y})
            _assert_equal_values(_values(sess, acc), expected)


@pytest.mark.parametrize("towers, k", [(1, 4), (2, 3)])
def test_per_example_outputs_come_back_in_batch_order(towers, k):
    """``ModelResult.outputs`` of every micro-batch of every tower, concatenated: the whole batch's, in order."""
    def model(x, ids, y):
        return gradaccum.ModelResult(_model(x, ids, y), outputs={"twice": 2.0 * x, "ids": ids})

    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), k)
        result = gradaccum.subdivisions.minimize(acc, model, feeds, devices=["/cpu:%d" % i for i in range(towers)])
        train_op, loss, k_run = result  # Still a 3-tuple.
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": towers})) as sess:
            sess.run(v1.global_variables_initializer())
            outputs, _ = sess.run([result.outputs, train_op], dict(zip(feeds, _batches(1)[0])))
    np.testing.assert_array_equal(outputs["twice"], 2.0 * X)
    np.testing.assert_array_equal(outputs["ids"], IDS)


@pytest.mark.parametrize("arguments, error, message", [
    ({"acc": v1.train.GradientDescentOptimizer(0.1)}, TypeError, "must be a gradaccum.GradientAccumulator"),
    ({"model": "loss"}, TypeError, "`model_fn` must be callable, got 'loss'"),
    ({"update_ops": "some"}, ValueError,
     "`update_ops` must be 'first', 'all' or a list of ops \\(\\[\\]: none\\), got 'some'"),
    ({"model": lambda x, ids, y: tf.square(y)}, ValueError, "must return a scalar loss"),
    ({"model": lambda x, ids, y: gradaccum.ModelResult(_model(x, ids, y), weight="two")}, TypeError,
     "`weight` must have a numeric dtype, got string"),
], ids=["optimizer", "model_fn", "update_ops", "non-scalar", "weight"])
def test_bad_arguments_are_one_clear_error(arguments, error, message):
    with tf.Graph().as_default():
        with pytest.raises(error, match=message):
            _build(**arguments)


def test_stage_2_sharding_is_refused():
    with tf.Graph().as_default():
        sharded = gradaccum.ShardedAllReduce(OPTIMIZERS["sgd"](), None, shard_cache=True)
        with pytest.raises(ValueError, match=r"ShardedAllReduce\(shard_cache=True\) reduces every micro-batch"):
            _build(acc=gradaccum.GradientAccumulator(sharded, 4))


@pytest.mark.skipif(os.environ.get("GRADACCUM_TF_MODE") == "tf2" or TF_VERSION >= (2, 16),
                    reason="tf.estimator: TF <= 2.15; its model_fn is tested once, in TF1 behaviour")
def test_estimator_max_steps_counts_updates(tmp_path):
    estimator = tf.estimator
    batches = _batches()
    expected, _ = _plain(OPTIMIZERS["adam"], batches)

    def model_fn(features, labels, mode):
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        result = gradaccum.subdivisions.minimize(acc, lambda x, ids, y: _model(x, ids, y),
                                                 [features["x"], features["ids"], labels],
                                                 global_step=v1.train.get_global_step())
        return estimator.EstimatorSpec(mode, loss=result.loss, train_op=result.train_op)

    def input_fn():
        x, ids, y = (np.concatenate(column) for column in zip(*batches))
        return tf.data.Dataset.from_tensor_slices(({"x": x, "ids": ids}, y)).batch(len(Y)).repeat()

    config = estimator.RunConfig(model_dir=str(tmp_path), log_step_count_steps=10 ** 6, save_summary_steps=10 ** 6)
    est = estimator.Estimator(model_fn, config=config)
    est.train(input_fn, max_steps=UPDATES)
    assert est.get_variable_value("global_step") == UPDATES
    for name in ("w", "b", "table", "dense/kernel"):
        np.testing.assert_allclose(est.get_variable_value(name), expected[name], rtol=1e-9)
