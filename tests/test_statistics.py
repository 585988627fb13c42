"""Gradient statistics (noise scale) and summaries: known answers, towers, graph identity.

The known-answer problem is linear regression, ``loss_n = (x_n . w - y_n)^2 / 2``
on a fixed data set with Gaussian inputs and label noise, at fixed weights (the
learning rate is 0, so the true gradient does not move). The per-example
gradients ``g_n = (x_n . w - y_n) x_n`` are computed in numpy: ``G`` is their
mean, ``tr(Sigma)`` their mean squared distance from it, and micro-batches are
drawn with replacement, so the estimates are unbiased for exactly these.
"""
import glob
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import statistics

v1 = tf.compat.v1
DIM = 8
# 160 windows of 16 small batches of 4 examples (B_big = 64). Simulating the
# estimator in numpy (200 seeds) on this data, one window's B_simple scatters
# by about 27% (relative SD): n = 16 small batches give a noisy tr(Sigma). The
# moving average (decay 0.99) over 160 windows weighs like ~130 independent
# windows, so the final estimate scatters by about 27% / sqrt(130) ~ 2.3%
# (2.8% with the uneven sizes below), and the 10% tolerance is about 4 standard
# deviations (the worst of the 200 simulated runs was off by 8%). With 20
# windows the scatter would be ~6% and the test would fail now and then: the
# number of windows is what sets the tolerance.
WINDOWS = 160
SMALL_BATCHES = 16
SHARD = 4


def _regression(seed=0, n=4096):
    """Data, weights and the exact B_simple from per-example gradients."""
    rng = np.random.RandomState(seed)
    x = rng.randn(n, DIM)
    w_star = rng.randn(DIM)
    y = x.dot(w_star) + rng.randn(n)
    w0 = w_star + 0.5 * rng.randn(DIM)
    per_example = (x.dot(w0) - y)[:, None] * x
    mean = per_example.mean(axis=0)
    trace = ((per_example - mean) ** 2).sum(axis=1).mean()
    return x.astype(np.float32), y.astype(np.float32), w0, trace / mean.dot(mean)


def _model_fn(w0, dtype=tf.float32):
    def model_fn(x, y):
        w = v1.get_variable("w", initializer=tf.constant(w0, dtype))
        return tf.reduce_mean(0.5 * tf.square(tf.linalg.matvec(x, w) - y))
    return model_fn


def _session(graph):
    return v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 4}))


def _towers_estimate(towers, order, x_data, y_data, w0):
    """Runs WINDOWS windows, ``towers`` shards of SHARD examples per micro-batch; returns B_simple."""
    k = SMALL_BATCHES // towers
    graph = tf.Graph()
    with graph.as_default():
        v1.set_random_seed(0)
        x = v1.placeholder(tf.float32, [towers * SHARD, DIM])
        y = v1.placeholder(tf.float32, [towers * SHARD])
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), k, statistics=True)
        devices = ["/cpu:%d" % i for i in range(towers)]
        train_op = gradaccum.tower.minimize(opt, _model_fn(w0), [x, y], devices=devices).train_op
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            run = sess.make_callable(train_op, [x, y])
            for window in order:
                for micro in window.reshape(k, towers * SHARD):  # tower t gets shard t of the micro-batch
                    run(x_data[micro], y_data[micro])
            return sess.run([opt.statistics.noise_scale, opt.statistics.windows])


def test_noise_scale_matches_exact_value_and_is_the_same_for_1_2_4_towers():
    x_data, y_data, w0, exact = _regression()
    order = np.random.RandomState(1).randint(0, len(x_data), size=(WINDOWS, SMALL_BATCHES * SHARD))
    estimates = {}
    for towers in (1, 2, 4):
        estimates[towers], windows = _towers_estimate(towers, order, x_data, y_data, w0)
        assert windows == WINDOWS
    # The same small batches (the shards) and windows in each layout: the same estimate.
    np.testing.assert_allclose([estimates[2], estimates[4]], [estimates[1]] * 2, rtol=1e-4)
    np.testing.assert_allclose(estimates[1], exact, rtol=0.10)


def test_uneven_micro_batches_use_their_real_sizes():
    x_data, y_data, w0, exact = _regression(seed=2)
    sizes = [1, 7, 2, 6, 3, 5, 4, 4] * 2  # B_big = 64 as above, 16 small batches of 1 to 7
    rng = np.random.RandomState(3)
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float32, [None, DIM])
        y = v1.placeholder(tf.float32, [None])
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), len(sizes), statistics=True)
        train_op = opt.minimize(_model_fn(w0)(x, y), weight=tf.shape(x)[0])
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            run = sess.make_callable(train_op, [x, y])
            for _ in range(WINDOWS):
                for size in sizes:
                    micro = rng.randint(0, len(x_data), size=size)
                    run(x_data[micro], y_data[micro])
            estimate, mean_estimate, weight = sess.run(
                [opt.statistics.noise_scale, opt.statistics.mean_noise_scale, opt.statistics.window_weight])
    assert weight == 64
    # Uneven sizes scatter a little more than even ones (2.8%, see above).
    np.testing.assert_allclose([estimate, mean_estimate], [exact, exact], rtol=0.10)


def _window_numbers(grads, weights):
    """The numpy version of one window's pieces and estimates."""
    weights = np.asarray(weights, np.float64)
    total, n = weights.sum(), len(weights)
    small = sum(w * g.dot(g) for g, w in zip(grads, weights)) / total
    mean = sum(w * g for g, w in zip(grads, weights)) / total
    big = mean.dot(mean)
    return small, big, (n * big - small) / (n - 1), total * (small - big) / (n - 1)


def test_pieces_and_moving_averages_are_exact():
    rng = np.random.RandomState(4)
    x_data, y_data = rng.randn(9, 3), rng.randn(9)
    w0 = rng.randn(3)
    sizes = [2, 3, 4]  # one window of three uneven micro-batches
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float64, [None, 3])
        y = v1.placeholder(tf.float64, [None])
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), 3, statistics=True)
        train_op = opt.minimize(_model_fn(w0, tf.float64)(x, y), weight=tf.shape(x)[0])
        stats = opt.statistics
        names = ["last_small_sq_norm", "last_big_sq_norm", "last_small_weight_sum", "last_small_batches"]
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            results = []
            for scale in (1.0, -2.0):  # two windows, the second with other labels
                grads = []
                for start, size in zip([0, 2, 5], sizes):
                    xs, ys = x_data[start:start + size], scale * y_data[start:start + size]
                    grads.append(((xs.dot(w0) - ys)[:, None] * xs).mean(axis=0))
                    sess.run(train_op, {x: xs, y: ys})
                results.append(_window_numbers(grads, sizes))
                small, big, gradient_sq, noise_trace = results[-1]
                np.testing.assert_allclose(sess.run([stats.variable(n) for n in names]), [small, big, 9, 3],
                                           rtol=1e-12)
            decay = stats.decay
            ema = [(decay * (1 - decay) * first + (1 - decay) * second) / (decay * (1 - decay) + (1 - decay))
                   for first, second in zip(results[0][2:], results[1][2:])]
            np.testing.assert_allclose(
                sess.run([stats.gradient_sq_norm, stats.noise_trace, stats.noise_scale, stats.windows]),
                [ema[0], ema[1], ema[1] / ema[0], 2], rtol=1e-12)
            mean = [results[0][i] + results[1][i] for i in (2, 3)]
            np.testing.assert_allclose(sess.run(stats.mean_noise_scale), mean[1] / mean[0], rtol=1e-12)


def test_sparse_gradients_with_duplicate_indices_count_as_dense():
    rng = np.random.RandomState(5)
    table = rng.randn(10, 3)
    ids = [np.array([1, 1, 4, 1, 7]), np.array([4, 4, 0])]
    coefficients = [rng.randn(5, 3), rng.randn(3, 3)]
    with tf.Graph().as_default() as graph:
        index = v1.placeholder(tf.int32, [None])
        coefficient = v1.placeholder(tf.float64, [None, 3])
        embedding = v1.get_variable("embedding", initializer=table)
        loss = tf.reduce_sum(tf.gather(embedding, index) * coefficient)
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), 2, statistics=True)
        train_op = opt.minimize(loss)
        assert isinstance(opt.compute_gradients(loss)[0][0], tf.IndexedSlices)
        dense = []
        for i, c in zip(ids, coefficients):
            grad = np.zeros_like(table)
            np.add.at(grad, i, c)
            dense.append(grad.ravel())
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {index: ids[0], coefficient: coefficients[0]})
            np.testing.assert_allclose(sess.run(opt.statistics.variable("small_sq_norm_sum")),
                                       dense[0].dot(dense[0]), rtol=1e-12)
            sess.run(train_op, {index: ids[1], coefficient: coefficients[1]})
            small, big, _, _ = _window_numbers(dense, [1, 1])
            np.testing.assert_allclose(
                sess.run([opt.statistics.variable("last_small_sq_norm"), opt.statistics.variable("last_big_sq_norm")]),
                [small, big], rtol=1e-12)


def _dense_layers(rows, known):
    """Four weight gradients that are products ``a^T d`` over the micro-batch's rows, one per
    combination of transposes, and a vector one; ``(x, loss, variables)``."""
    x = v1.placeholder(tf.float32, [rows if known else None, 60])
    w1, w2 = v1.get_variable("w1", [60, 50]), v1.get_variable("w2", [40, 50])
    w3, w4 = v1.get_variable("w3", [64, 40]), v1.get_variable("w4", [40, 64])
    w5 = v1.get_variable("w5", [40])
    out = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2, transpose_b=True)  # [rows, 40]
    loss = (tf.reduce_sum(tf.square(tf.matmul(w3, out, transpose_b=True)))
            + tf.reduce_sum(tf.square(tf.matmul(w4, out, transpose_a=True, transpose_b=True)))
            + tf.reduce_sum(tf.square(tf.linalg.matvec(out, w5))))
    return x, loss, [w1, w2, w3, w4, w5]


# A dense layer's weight gradient is ``a^T d``: a few rows give its squared
# norm from their Gram matrices, without reading the gradient; many rows (or
# a shape known only when run) read it, or choose when run.
@pytest.mark.parametrize("rows, known, gram", [(3, True, True), (40, True, False), (3, False, None),
                                               (40, False, None)])
def test_squared_norms_of_dense_layer_gradients_are_exact(rows, known, gram):
    data = np.random.RandomState(7).randn(2, rows, 60).astype(np.float32)
    with tf.Graph().as_default() as graph:
        v1.set_random_seed(7)
        x, loss, variables = _dense_layers(rows, known)
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), 3, statistics=True)
        grads_and_vars = opt.compute_gradients(loss, variables)
        train_op = opt.apply_gradients(grads_and_vars, weight=tf.cast(tf.shape(x)[0], tf.float32))
        if gram is not None:
            read = [any("/statistics/" in op.name for op in grad.consumers()) for grad, _ in grads_and_vars]
            assert read == [not gram] * 4 + [True]
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            expected = 0.0
            for micro_batch in data:
                grads = sess.run([grad for grad, _ in grads_and_vars], {x: micro_batch})
                expected += rows * sum(np.sum(np.square(g.astype(np.float64))) for g in grads)
                sess.run(train_op, {x: micro_batch})
            np.testing.assert_allclose(sess.run(opt.statistics.variable("small_sq_norm_sum")), expected,
                                       rtol=1e-5)


@pytest.mark.parametrize("known", [True, False])
def test_rows_whose_gradients_nearly_cancel_keep_their_norm(known):
    """Rows ``a`` and ``a + 1e-3 r`` with errors ``e`` and ``-e``: the gradient's squared norm is
    about 0.02, each row's own about 2e5 (summed in float32, the Gram matrices would lose it)."""
    rng = np.random.RandomState(8)
    a, r, e = 3 * rng.randn(30).astype(np.float32), rng.randn(30), 3 * rng.randn(50).astype(np.float32)
    x_data, y_data = np.stack([a, (a + 1e-3 * r).astype(np.float32)]), np.stack([e, -e])
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float32, [2 if known else None, 30])
        y = v1.placeholder(tf.float32, [2 if known else None, 50])
        w = v1.get_variable("w", initializer=tf.zeros([30, 50]))
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), 2, statistics=True)
        train_op = opt.minimize(tf.reduce_sum(tf.matmul(x, w) * y), weight=tf.shape(x)[0])
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {x: x_data, y: y_data})
            grad = x_data.astype(np.float64).T.dot(y_data.astype(np.float64))
            np.testing.assert_allclose(sess.run(opt.statistics.variable("small_sq_norm_sum")),
                                       2 * np.sum(np.square(grad)), rtol=1e-3)


class _TwinWorkers(gradaccum.Reducer):
    """A window reducer as if a second worker had summed the same window."""

    def __init__(self, learning_rate):
        super(_TwinWorkers, self).__init__(v1.train.GradientDescentOptimizer(learning_rate), "TwinWorkers")

    def reduce(self, sums_and_vars, total, extras):
        return [(2 * grad, var) for grad, var in sums_and_vars], 2 * total, [2 * value for value in extras]


def _estimates(small, big, count, weight, window_weight):
    """Solves E[small] = G2 + S count/weight, E[big] = G2 + S/window_weight for (G2, S)."""
    inv_small, inv_big = count / weight, 1.0 / window_weight
    noise_trace = (small - big) / (inv_small - inv_big)
    return big - noise_trace * inv_big, noise_trace


@pytest.mark.parametrize("k", [1, 2])
def test_a_reduced_window_is_the_big_batch(k):
    """With a reducer the big batch is every worker's window; here one micro-batch per worker suffices."""
    rng = np.random.RandomState(6)
    x_data, y_data, w0 = rng.randn(5, 3), rng.randn(5), rng.randn(3)
    sizes = [2, 3][:k]
    with tf.Graph().as_default() as graph:
        x = v1.placeholder(tf.float64, [None, 3])
        y = v1.placeholder(tf.float64, [None])
        opt = gradaccum.GradientAccumulator(_TwinWorkers(0.0), k, statistics=True)
        train_op = opt.minimize(_model_fn(w0, tf.float64)(x, y), weight=tf.shape(x)[0])
        stats = opt.statistics
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            grads = []
            for start, size in zip([0, 2], sizes):
                xs, ys = x_data[start:start + size], y_data[start:start + size]
                grads.append(((xs.dot(w0) - ys)[:, None] * xs).mean(axis=0))
                sess.run(train_op, {x: xs, y: ys})
            small, big, _, _ = _window_numbers(grads, sizes)
            weight = float(sum(sizes))
            expected = _estimates(small, big, k, weight, 2 * weight)
            np.testing.assert_allclose(
                sess.run([stats.window_weight, stats.windows, stats.gradient_sq_norm, stats.noise_trace]),
                [2 * weight, 1, expected[0], expected[1]], rtol=1e-12, atol=1e-12)


def test_one_micro_batch_gives_an_estimate_only_with_towers():
    x_data, y_data, w0, _ = _regression(n=64)
    for towers, windows in [(1, 0), (2, 5)]:
        with tf.Graph().as_default() as graph:
            x = v1.placeholder(tf.float32, [8, DIM])
            y = v1.placeholder(tf.float32, [8])
            opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), 1, statistics=True)
            train_op = gradaccum.tower.minimize(opt, _model_fn(w0), [x, y],
                                                devices=["/cpu:%d" % i for i in range(towers)]).train_op
            with _session(graph) as sess:
                sess.run(v1.global_variables_initializer())
                for start in range(0, 40, 8):
                    sess.run(train_op, {x: x_data[start:start + 8], y: y_data[start:start + 8]})
                found = sess.run([opt.statistics.windows, opt.statistics.window_weight,
                                  opt.statistics.variable("last_small_batches")])
                assert found == [windows, 8, towers]
                assert np.isnan(sess.run(opt.statistics.noise_scale)) == (windows == 0)


def test_one_micro_batch_without_weight_counts_one_and_gives_no_estimate():
    with tf.Graph().as_default() as graph:
        w = v1.get_variable("w", initializer=1.0)
        x = v1.placeholder(tf.float32, [None])
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 1, statistics=True)
        train_op = opt.minimize(tf.reduce_mean(w * x))
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(3):
                sess.run(train_op, {x: [2.0, 4.0]})
            assert sess.run([opt.statistics.windows, opt.statistics.window_weight,
                             opt.statistics.variable("last_small_sq_norm")]) == [0, 1, 9]
            assert sess.run(w) == pytest.approx(1.0 - 3 * 0.1 * 3.0)  # the updates themselves are untouched


def _scalar_accumulator(skip_nonfinite=False):
    x = v1.placeholder(tf.float32, [None])
    weight = v1.placeholder(tf.float32, [])
    w = v1.get_variable("w", initializer=1.0)
    opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.0), 2,
                                        skip_nonfinite=skip_nonfinite, statistics=True)
    return x, weight, opt, opt.minimize(tf.reduce_mean(w * x), weight=weight)


def test_skipped_and_reset_windows_are_not_counted():
    window_vars = ["small_sq_norm_sum", "small_weight_sum", "small_batches"]
    with tf.Graph().as_default() as graph:
        x, weight, opt, train_op = _scalar_accumulator(skip_nonfinite=True)
        stats = opt.statistics
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            for value, w in [(1.0, 0.0), (2.0, 0.0),  # zero weight: skipped
                             (np.nan, 1.0), (2.0, 1.0)]:  # not finite: skipped
                sess.run(train_op, {x: [value], weight: w})
            assert sess.run([opt.skipped_windows, stats.windows]) == [2, 0]
            # Nothing of the skipped windows is left, not even the NaN.
            np.testing.assert_array_equal(sess.run([stats.variable(n) for n in window_vars]), [0, 0, 0])
            sess.run(train_op, {x: [3.0], weight: 2.0})
            sess.run(opt.zero_op)
            np.testing.assert_array_equal(sess.run([stats.variable(n) for n in window_vars]), [0, 0, 0])
            sess.run(train_op, {x: [3.0], weight: 1.0})
            sess.run(train_op, {x: [1.0], weight: 3.0})  # |G_small|^2 = (9 + 3) / 4, |G_big|^2 = 1.5^2
            np.testing.assert_allclose(
                sess.run([stats.windows, stats.window_weight, stats.variable("last_small_sq_norm"),
                          stats.variable("last_big_sq_norm")]), [1, 4, 3.0, 2.25])


def test_a_window_applied_with_overflowed_gradients_leaves_the_averages_alone():
    """Without skip_nonfinite (a loss-scale optimizer inside skips such a window itself)."""
    with tf.Graph().as_default() as graph:
        x, weight, opt, train_op = _scalar_accumulator()
        stats = opt.statistics
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            for value in [3.0, 1.0, np.inf, 1.0, 3.0, 1.0]:  # the second window overflows
                sess.run(train_op, {x: [value], weight: 1.0})
            assert sess.run([opt.skipped_windows, stats.windows]) == [0, 2]
            np.testing.assert_allclose(sess.run([stats.gradient_sq_norm, stats.noise_trace]),
                                       _estimates(5.0, 4.0, 2, 2.0, 2.0), rtol=1e-6)


def _graph_nodes(graph, drop):
    """(name, op type) of every node, the control-flow-v2 branch functions' included."""
    graph_def = graph.as_graph_def()
    nodes = [(node.name, node.op) for node in graph_def.node]
    for function in graph_def.library.function:  # Function names carry a counter: compare their contents.
        nodes.extend(("<function>/" + node.name, node.op) for node in function.node_def)
    return sorted(node for node in nodes if not drop(node[0]))


def _build_for_identity(stats_flag, towers=2):
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [8, DIM])
        y = v1.placeholder(tf.float32, [8])
        kwargs = {} if stats_flag is None else {"statistics": stats_flag}
        opt = gradaccum.GradientAccumulator(v1.train.AdamOptimizer(0.1), 3, skip_nonfinite=True, **kwargs)
        gradaccum.tower.minimize(opt, _model_fn(np.zeros(DIM)), [x, y],
                                 devices=["/cpu:%d" % i for i in range(towers)])
    return graph


def test_statistics_off_adds_no_op(monkeypatch):
    def no_statistics(*args, **kwargs):
        raise AssertionError("statistics.create called with statistics off")
    is_statistics = lambda name: any(re.match(r"statistics(_\d+)?$", part) for part in name.split("/"))  # noqa: E731
    on = _build_for_identity(True)
    assert any(is_statistics(name) for name, _ in _graph_nodes(on, drop=lambda name: False))
    monkeypatch.setattr(statistics, "create", no_statistics)
    default = _graph_nodes(_build_for_identity(None), drop=lambda name: False)
    off = _graph_nodes(_build_for_identity(False), drop=lambda name: False)
    assert off == default
    assert not any(is_statistics(name) for name, _ in off)
    # With it on, every other op is the same: statistics only adds its own.
    assert _graph_nodes(on, drop=is_statistics) == off


def test_variables_are_checkpointed_state(tmp_path):
    with tf.Graph().as_default() as graph:
        x, weight, opt, train_op = _scalar_accumulator()
        stats = opt.statistics
        assert set(v.name for v in stats.variables) <= set(v.name for v in opt.variables())
        assert not set(stats.variables) & set(v1.trainable_variables())
        assert all(v.name.startswith("GradientAccumulator/statistics/") for v in stats.variables)
        saver = v1.train.Saver()
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            for value in [1.0, 2.0, 3.0, 5.0, 4.0]:  # two windows and one micro-batch
                sess.run(train_op, {x: [value], weight: 1.0})
            saved = sess.run(stats.variables)
            path = saver.save(sess, str(tmp_path / "model"))
        with _session(graph) as sess:
            saver.restore(sess, path)
            np.testing.assert_array_equal(sess.run(stats.variables), saved)
    assert saved[[v.name for v in stats.variables].index("GradientAccumulator/statistics/windows:0")] == 2


def _events(directory):
    values = {}
    for path in sorted(glob.glob(os.path.join(str(directory), "events.out.tfevents.*"))):
        for event in v1.train.summary_iterator(path):
            for value in event.summary.value:
                values.setdefault(value.tag, []).append((event.step, value.simple_value))
    return values


def _summary_problem(learning_rate):
    x = v1.placeholder(tf.float32, [None])
    w = v1.get_variable("w", initializer=1.0)
    step = v1.train.get_or_create_global_step()
    opt = gradaccum.GradientAccumulator(v1.train.MomentumOptimizer(learning_rate, 0.5), 2, statistics=True)
    train_op = opt.minimize(tf.reduce_mean(w * x * x), global_step=step, weight=tf.shape(x)[0])
    return x, opt, train_op


def test_summaries_with_file_writer(tmp_path):
    with tf.Graph().as_default() as graph:
        x, opt, train_op = _summary_problem(v1.placeholder_with_default(0.25, []))
        summary_op = gradaccum.summaries(opt)
        assert len(v1.get_collection(v1.GraphKeys.SUMMARIES)) == 5
        writer = v1.summary.FileWriter(str(tmp_path), graph)
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {x: [1.0, 3.0]})  # d/dw mean(x^2) = 5
            sess.run(train_op, {x: [2.0]})  # = 4; window of 3 examples: 14 / 3
            writer.add_summary(sess.run(summary_op), 1)
        writer.close()
    events = _events(tmp_path)
    small, big, gradient_sq, noise_trace = _window_numbers([np.array([5.0]), np.array([4.0])], [2, 1])
    expected = {"gradaccum/effective_batch": 3.0, "gradaccum/gradient_norm": 14.0 / 3,
                "gradaccum/skipped_windows": 0.0, "gradaccum/learning_rate": 0.25,
                "gradaccum/noise_scale": noise_trace / gradient_sq}
    assert sorted(events) == sorted(expected)
    for tag, value in expected.items():
        assert events[tag][0][0] == 1
        np.testing.assert_allclose(events[tag][0][1], value, rtol=1e-5, err_msg=tag)


def test_summaries_with_monitored_training_session(tmp_path):
    with tf.Graph().as_default():
        x, opt, train_op = _summary_problem(0.1)
        gradaccum.summaries(opt, name="accum")
        with v1.train.MonitoredTrainingSession(checkpoint_dir=str(tmp_path), save_summaries_steps=1,
                                               save_checkpoint_secs=None, log_step_count_steps=None) as sess:
            for _ in range(6):  # three windows, one update each
                sess.run(train_op, {x: [1.0, 2.0]})
    events = _events(tmp_path)
    assert {"accum/effective_batch", "accum/gradient_norm", "accum/skipped_windows", "accum/noise_scale",
            "accum/learning_rate"} <= set(events)
    assert [value for _, value in events["accum/effective_batch"]][-1] == 4
    np.testing.assert_allclose(events["accum/learning_rate"][-1][1], 0.1, rtol=1e-6)
    assert max(step for step, _ in events["accum/gradient_norm"]) >= 2


def test_learning_rate_is_found_through_wrappers():
    with tf.Graph().as_default(), _session(None) as sess:
        adam = v1.train.AdamOptimizer(0.003)
        wrapped = gradaccum.GradientAccumulator(adam, 2)
        callable_rate = v1.train.GradientDescentOptimizer(lambda: tf.constant(0.5))
        rates = [statistics.learning_rate(opt) for opt in (adam, wrapped, callable_rate)]
        np.testing.assert_allclose(sess.run(rates), [0.003, 0.003, 0.5], rtol=1e-6)
        assert statistics.learning_rate(object()) is None


def test_errors_name_the_argument():
    with tf.Graph().as_default():
        with pytest.raises(TypeError, match="`accumulator` must be a gradaccum.GradientAccumulator, got 3"):
            gradaccum.summaries(3)
        plain = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2)
        with pytest.raises(ValueError, match="has no train op yet"):
            gradaccum.summaries(plain)
        w = v1.get_variable("w", initializer=1.0)
        plain.minimize(w * w)
        with pytest.raises(ValueError, match=r"has no `statistics`: create it with .*statistics=True"):
            gradaccum.summaries(plain)
        with pytest.raises(ValueError, match=r"`decay` must be a number in \[0, 1\), got 1.5"):
            statistics.create([(None, w)], tf.float32, decay=1.5)
        with pytest.raises(ValueError, match="`name` must be one of"):
            statistics.create([(None, w)], tf.float32).variable("nope")
