"""The window pipeline: the clip's norm, the window size's source, observers and their errors.

float64 and small models, in both TF behaviours (``--tf-mode``).
"""
import numpy as np
import pytest
import tensorflow as tf

import gradaccum

v1 = tf.compat.v1

ROWS, DIM = 6, 3
# Two windows of 4 micro-batches; token ids repeat within and across micro-batches.
IDS = np.array([[0, 0, 1], [1, 2, 2], [0, 3, 3], [5, 5, 5],
                [4, 4, 0], [2, 2, 2], [1, 1, 3], [0, 5, 4]])
TARGETS = np.random.RandomState(3).randn(len(IDS), 3)


def _embedding_model():
    """An embedding table read through ``tf.gather`` (sparse gradient) and a dense output."""
    ids = v1.placeholder(tf.int32, [None, 3])
    targets = v1.placeholder(tf.float64, [None, 3])
    table = v1.get_variable("table", initializer=np.random.RandomState(0).randn(ROWS, DIM))
    out = v1.get_variable("out", initializer=np.random.RandomState(1).randn(DIM))
    logits = tf.tensordot(tf.gather(table, ids), out, 1)
    loss = tf.reduce_mean(tf.square(logits - targets))
    return ids, targets, loss, [table, out]


def _full_batch_clipped(make_opt, clip_norm, windows):
    """Plain TensorFlow: clip_by_global_norm on the full batch's gradients, then apply."""
    with tf.Graph().as_default():
        ids, targets, loss, variables = _embedding_model()
        opt = make_opt()
        grads_and_vars = opt.compute_gradients(loss, variables)
        assert isinstance(grads_and_vars[0][0], tf.IndexedSlices)
        grads, norm = tf.clip_by_global_norm([g for g, _ in grads_and_vars], clip_norm)
        train_op = opt.apply_gradients(list(zip(grads, variables)))
        out, norms = [], []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for window in windows:
                feed = {ids: IDS[window], targets: TARGETS[window]}
                norms.append(sess.run(norm, feed))
                sess.run(train_op, feed)
                out.append(sess.run(variables))
    return out, norms


def _accumulated_clipped(make_opt, clip_norm, windows):
    with tf.Graph().as_default():
        ids, targets, loss, variables = _embedding_model()
        opt = gradaccum.GradientAccumulator(make_opt(), 4, clip_norm=clip_norm)
        train_op = opt.minimize(loss, weight=tf.shape(ids)[0])
        out = []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for window in windows:
                for part in np.array_split(window, 4):
                    sess.run(train_op, {ids: IDS[part], targets: TARGETS[part]})
                out.append(sess.run(variables))
    return out


OPTIMIZERS = {"sgd": lambda: v1.train.GradientDescentOptimizer(0.3),
              "adam": lambda: v1.train.AdamOptimizer(0.1)}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_the_clip_measures_repeated_embedding_rows_as_tensorflow_does(optimizer):
    """Uneven micro-batches with repeated rows: the clipped update equals plain TF's on the full batch."""
    windows = [np.arange(0, 7), np.arange(3, 8), np.arange(0, 8)]
    want, norms = _full_batch_clipped(OPTIMIZERS[optimizer], 0.5, windows)
    assert min(norms) > 0.5  # The clip acts in every window.
    got = _accumulated_clipped(OPTIMIZERS[optimizer], 0.5, windows)
    for got_window, want_window in zip(got, want):
        for g, w in zip(got_window, want_window):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


class _TwinWorkers(gradaccum.Reducer):
    """A reducer as if a second worker had summed the same window: sums, weight and extras doubled."""

    def reduce(self, sums_and_vars, total, extras):
        twice = [(tf.IndexedSlices(2 * g.values, g.indices, g.dense_shape) if isinstance(g, tf.IndexedSlices)
                  else 2 * g, v) for g, v in sums_and_vars]
        return twice, 2 * total, [2 * x for x in extras]


def _accumulated_across(build, windows, parts):
    """Runs ``build(loss, ids)`` -> train op over each window's micro-batches; the variables after each."""
    with tf.Graph().as_default():
        ids, targets, loss, variables = _embedding_model()
        train_op = build(loss, ids, targets)
        out = []
        with _session() as sess:
            sess.run(v1.global_variables_initializer())
            for window in windows:
                for part in np.array_split(window, parts):
                    sess.run(train_op, {ids: IDS[part], targets: TARGETS[part]})
                out.append(sess.run(variables))
    return out


def _session():
    return v1.Session(config=v1.ConfigProto(device_count={"CPU": 2}))


@pytest.mark.parametrize("where", ["reducer", "towers"])
def test_the_clip_measures_as_tensorflow_across_workers_and_towers(where):
    """Two workers (the reducer sums the extras with the window) and two towers clip as plain TF does."""
    windows = [np.arange(0, 7), np.arange(3, 8)]
    if where == "reducer":  # The twin worker's data is this worker's again: the full batch is the window twice.
        want, norms = _full_batch_clipped(OPTIMIZERS["sgd"], 0.5, [np.concatenate([w, w]) for w in windows])

        def build(loss, ids, targets):
            opt = gradaccum.GradientAccumulator(_TwinWorkers(OPTIMIZERS["sgd"](), "twin"), 2, clip_norm=0.5)
            return opt.minimize(loss, weight=tf.shape(ids)[0])
    else:
        want, norms = _full_batch_clipped(OPTIMIZERS["sgd"], 0.5, windows)

        def build(loss, ids, targets):
            def model_fn(ids_shard, targets_shard):
                table, out = v1.get_variable("table", dtype=tf.float64), v1.get_variable("out", dtype=tf.float64)
                logits = tf.tensordot(tf.gather(table, ids_shard), out, 1)
                return tf.reduce_mean(tf.square(logits - targets_shard))

            opt = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), 2, clip_norm=0.5)
            with v1.variable_scope(v1.get_variable_scope(), reuse=True):
                return gradaccum.tower.minimize(opt, model_fn, [ids, targets], devices=["/cpu:0", "/cpu:1"],
                                                variables_device="/cpu:0").train_op
    assert min(norms) > 0.5
    got = _accumulated_across(build, windows, 2)
    for got_window, want_window in zip(got, want):
        for g, w in zip(got_window, want_window):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_the_sparse_norm_differs_from_the_summed_gradient_s():
    """The check has teeth: clipping the densified full-batch gradient gives another update."""
    windows = [np.arange(0, 8)]
    want, _ = _full_batch_clipped(OPTIMIZERS["sgd"], 0.5, windows)
    with tf.Graph().as_default():
        ids, targets, loss, variables = _embedding_model()
        grads = tf.gradients(loss, variables)
        dense, _ = tf.clip_by_global_norm([tf.convert_to_tensor(g) for g in grads], 0.5)
        step = v1.train.GradientDescentOptimizer(0.3).apply_gradients(list(zip(dense, variables)))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(step, {ids: IDS, targets: TARGETS})
            other = sess.run(variables)
    assert np.max(np.abs(other[0] - want[0][0])) > 1e-4


def _scalar_window(num_micro_batches, global_step=True):
    x = v1.placeholder(tf.float64, [None])
    w = v1.get_variable("w", initializer=np.float64(1.0))
    step = v1.train.get_or_create_global_step() if global_step else None
    opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), num_micro_batches)
    train_op = opt.minimize(tf.reduce_mean(w * x), global_step=step, weight=tf.shape(x)[0])
    return x, w, opt, train_op


def test_a_variable_k_set_mid_window_takes_effect_at_the_next_window():
    with tf.Graph().as_default():
        k = v1.Variable(np.int64(2), trainable=False, name="k")
        x, w, opt, train_op = _scalar_window(k)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {x: [1.0]})
            sess.run(k.assign(0))  # Mid-window: the window in progress keeps its k = 2.
            assert sess.run(opt.window_size) == 2
            sess.run(train_op, {x: [3.0]})
            assert sess.run([opt.micro_step, v1.train.get_global_step()]) == [0, 1]
            np.testing.assert_allclose(sess.run(w), 1.0 - 2.0)
            with pytest.raises(tf.errors.InvalidArgumentError, match="`num_micro_batches` must be >= 1 for every"):
                sess.run(train_op, {x: [1.0]})  # The next window reads 0.
            sess.run(k.assign(3))
            for value in (1.0, 1.0, 1.0):
                sess.run(train_op, {x: [value]})
            assert sess.run(v1.train.get_global_step()) == 2


def test_a_fed_k_is_read_only_when_a_window_starts():
    with tf.Graph().as_default():
        k = v1.placeholder_with_default(np.int64(2), [])
        x, w, opt, train_op = _scalar_window(k)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {x: [1.0], k: 3})
            sess.run(train_op, {x: [1.0], k: 1})  # Ignored: the window holds k = 3.
            assert sess.run(opt.micro_step) == 2
            sess.run(train_op, {x: [1.0]})
            assert sess.run([opt.micro_step, v1.train.get_global_step()]) == [0, 1]


@pytest.mark.parametrize("schedule, message", [
    (lambda step: 2.5, r"`num_micro_batches` must give a scalar integer tensor for every window, got .*float"),
    (lambda step: True, r"`num_micro_batches` must give a scalar integer tensor for every window, got .*bool"),
    (lambda step: tf.constant([2, 3]), r"must give a scalar integer tensor for every window, got .*shape=\(2,\)"),
])
def test_a_schedule_must_give_a_scalar_integer(schedule, message):
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=message):
            _scalar_window(schedule)


def test_a_policy_needs_global_step():
    with tf.Graph().as_default():
        policy = gradaccum.AdaptiveBatch(micro_batch_size=10)
        with pytest.raises(ValueError, match=r"`num_micro_batches` AdaptiveBatch\(.*\) is a schedule of "
                                             r"`global_step` .*pass `global_step` .*got None"):
            _scalar_window(policy, global_step=False)


class _NoiseScale(object):
    def __init__(self, value):
        self.noise_scale = tf.constant(value, tf.float64)


@pytest.mark.parametrize("noise, expected", [(15.0, 20), (14.0, 14), (25.0, 20), (26.0, 26)])
def test_the_policy_changes_k_only_by_more_than_its_threshold(noise, expected):
    """20 -> 15 or 25 at 25% is not more than the threshold: k stays."""
    with tf.Graph().as_default():
        policy = gradaccum.AdaptiveBatch(micro_batch_size=1, max_micro_batches=64, threshold=0.25)
        k, _ = policy.variables
        update = policy.update(_NoiseScale(noise))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(k.assign(20))
            sess.run(update)
            assert sess.run(k) == expected


class _Counter(gradaccum.WindowObserver):
    """Counts each hook's runs."""

    def __init__(self):
        self.counts = dict((hook, v1.Variable(0, trainable=False, name="count_" + hook))
                           for hook in ("added", "applying", "applied", "skipped", "reset"))

    @property
    def variables(self):
        return list(self.counts.values())

    def _count(self, hook):
        return [self.counts[hook].assign_add(1)]

    def added(self, micro_batch):
        return self._count("added")

    def applying(self, update):
        return self._count("applying")

    def applied(self, update):
        return self._count("applied")

    def skipped(self):
        return self._count("skipped")

    def reset(self):
        return self._count("reset")


def test_an_observer_is_called_at_each_point_of_the_window():
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float64, [None])
        w = v1.get_variable("w", initializer=np.float64(1.0))
        counter = _Counter()
        opt = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2, observers=[counter])
        train_op = opt.minimize(tf.reduce_mean(w * x), weight=tf.shape(x)[0])
        assert set(counter.variables) <= set(opt.state_variables)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in ([1.0], [2.0], [1.0], []):  # The second window weighs 1 + 0: applied.
                sess.run(train_op, {x: batch})
            for batch in ([], []):  # Zero weight: skipped.
                sess.run(train_op, {x: batch})
            sess.run(train_op, {x: [1.0]})
            sess.run(opt.zero_op)
            counts = sess.run(counter.counts)
    assert counts == dict(added=7, applying=2, applied=2, skipped=1, reset=1)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(observers=[object()]), TypeError, r"`observers` must be None or a list of gradaccum.WindowObserver"),
    (dict(observers=_Counter), TypeError, r"`observers` must be None or a list of gradaccum.WindowObserver"),
    (dict(loss_scaling="yes"), TypeError, r"`loss_scaling` must be a bool, got 'yes'"),
])
def test_bad_observers_and_loss_scaling_are_one_error(kwargs, error, message):
    with tf.Graph().as_default():
        with pytest.raises(error, match=message):
            gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(1.0), 2, **kwargs)


class _OwnLossScaling(v1.train.GradientDescentOptimizer):
    """Skips a non-finite update itself, as a loss-scale optimizer does."""

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g, _ in grads_and_vars])
        apply = super(_OwnLossScaling, self).apply_gradients
        return tf.cond(finite, lambda: tf.group(apply(grads_and_vars, global_step)), tf.no_op)


@pytest.mark.parametrize("make, loss_scaling", [
    (lambda: v1.train.experimental.MixedPrecisionLossScaleOptimizer(v1.train.GradientDescentOptimizer(1.0),
                                                                     "dynamic"),
     None),
    (lambda: _OwnLossScaling(1.0), True),
], ids=["tf-by-type", "own-said"])
def test_loss_scaling_is_recognised_by_type_or_said(make, loss_scaling):
    """A loss-scale optimizer's overflow is counted as a skipped window, by type or by the argument."""
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None])
        w = v1.get_variable("w", initializer=1.0)
        opt = gradaccum.GradientAccumulator(make(), 2, loss_scaling=loss_scaling)
        train_op = opt.minimize(tf.reduce_mean(w * x), weight=tf.shape(x)[0])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in ([1.0], [np.inf], [1.0], [3.0]):
                sess.run(train_op, {x: batch})
            assert sess.run(opt.skipped_windows) == 1
            np.testing.assert_allclose(sess.run(w), 1.0 - 2.0)


def test_the_window_imports_no_feature_module():
    """Features plug in through the protocols: the pipeline never names them."""
    import ast
    import os

    path = os.path.join(os.path.dirname(gradaccum.__file__), "window", "pipeline.py")
    with open(path) as handle:
        tree = ast.parse(handle.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
            imported.update("%s.%s" % (node.module, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    features = ("window.statistics", "batch.adaptive", "devices.batch_norm", "distributed.collective",
                "distributed.cluster", "distributed.sharded", "devices.tower")
    assert not [name for name in imported for f in features if name == "gradaccum." + f], sorted(imported)
    assert not [name for name in imported if name.startswith(("gradaccum.batch", "gradaccum.devices",
                                                                "gradaccum.distributed"))], sorted(imported)
    assert "gradaccum.window.observers" in imported  # The protocol's records, not a feature.
