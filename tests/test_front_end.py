"""One front end for a model function: the same arguments mean the same in both forms.

``tower.minimize`` (one run per micro-batch) and ``subdivisions.minimize``
(one run per update) read ``model_fn``'s result, ``update_ops``,
``var_list`` and ``devices`` alike, and reach the accumulator's window
through its builder. Each check reads variables (and the optimizer's slots)
after several updates against plain TF on the whole batch, or an error by
its message.
"""
import warnings

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from test_subdivisions import (OPTIMIZERS, _assert_equal_values, _batches, _model, _placeholders, _plain, _values,
                               _window_bn_model, MODEL_AND_AVERAGES)

v1 = tf.compat.v1


def _train_subdivided(make_model, batches, devices=None, config=None, **kwargs):
    """``subdivisions.minimize`` with Adam, k = 2 per tower; returns every variable and slot after ``batches``."""
    with tf.Graph().as_default():
        feeds = _placeholders()[:2] + _placeholders()[2:]
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 2)
        result = gradaccum.subdivisions.minimize(acc, make_model, feeds, devices=devices,
                                                 global_step=v1.train.get_or_create_global_step(), **kwargs)
        with v1.Session(config=config) as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(result.train_op, dict(zip(feeds, batch)))
            return _values(sess, acc)


def test_var_list_trains_only_those_variables_in_the_one_run_form():
    """GPT-2's --only_train_transformer_layers in one run per update: the others stay, the listed equal TF's."""
    batches = _batches()
    with tf.Graph().as_default():
        feeds = _placeholders()
        loss = _model(*feeds)
        opt = OPTIMIZERS["adam"]()
        train_op = opt.minimize(loss, var_list=[v for v in v1.trainable_variables() if v.op.name in ("w", "table")])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(train_op, dict(zip(feeds, batch)))
            expected = _values(sess, opt)

    def listed():  # The variables exist once the first micro-batch is built.
        return [v for v in v1.trainable_variables() if v.op.name in ("w", "table")]

    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        result = gradaccum.subdivisions.minimize(acc, _model, feeds, var_list=listed)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(result.train_op, dict(zip(feeds, batch)))
            _assert_equal_values(_values(sess, acc), expected)


def test_window_batch_norm_on_towers_with_the_default_update_ops():
    """Two towers of two micro-batches each equal the fused train op on the same four micro-batches."""
    batches = [(b[0], b[2]) for b in _batches()]
    with tf.Graph().as_default():
        feeds = [v1.placeholder(tf.float64, [None, 4]), v1.placeholder(tf.float64, [None])]
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 4)
        train = acc.minimize(_window_bn_model(*feeds), weight=tf.shape(feeds[1])[0])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                for start, stop in ((0, 6), (6, 12), (12, 18), (18, 23)):  # The towers' micro-batches.
                    sess.run(train, {f: b[start:stop] for f, b in zip(feeds, batch)})
            expected = _named(sess)
    with tf.Graph().as_default():
        feeds, train = _window_bn_one_run_on_two_towers()
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": 2})) as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(train, dict(zip(feeds, batch)))
            got = _named(sess)
    _assert_equal_values(got, expected)
    assert not np.allclose(got["bn/moving_mean"], 0.0)


def _window_bn_one_run_on_two_towers():
    """``_window_bn_model`` in the one-run form on two CPU towers, k = 2: ``(feeds, train_op)``."""
    feeds = [v1.placeholder(tf.float64, [None, 4]), v1.placeholder(tf.float64, [None])]
    acc = gradaccum.GradientAccumulator(OPTIMIZERS["adam"](), 2)
    return feeds, gradaccum.subdivisions.minimize(acc, _window_bn_model, feeds, devices=["/cpu:0", "/cpu:1"]).train_op


def _named(sess):
    found = [v for v in v1.global_variables() if v.op.name in MODEL_AND_AVERAGES]
    return dict(zip([v.op.name for v in found], sess.run(found)))


class _FirstGradient(gradaccum.WindowObserver):
    """Records the first gradient and the weight that ``added`` sees, per micro-batch."""

    def __init__(self):
        self.seen = []

    def added(self, micro_batch):
        grad = micro_batch.grads_and_vars[0][0]
        self.seen.append((tf.convert_to_tensor(grad), micro_batch.weight))
        return []


def _gradient_four(x):
    """A loss whose gradient with respect to its one variable is 4.0 on any batch."""
    v = v1.get_variable("v", dtype=tf.float32, initializer=np.float32(1.0))
    return tf.reduce_mean(4.0 * v * tf.ones_like(x[:, 0]))


@pytest.mark.parametrize("form", ["fused", "one-run"])
def test_an_observer_sees_each_micro_batch_s_own_gradient_and_its_weight(form):
    """A micro-batch of 5 examples whose gradient is 4.0 reads 4.0 and weight 5, with ``weight`` and no statistics."""
    observer = _FirstGradient()
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float32, [None, 2])
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.1), 2, observers=[observer])
        if form == "fused":
            train = acc.minimize(_gradient_four(x), weight=tf.shape(x)[0])
            feed = np.ones((5, 2), np.float32)
        else:
            train = gradaccum.subdivisions.minimize(acc, _gradient_four, [x]).train_op
            feed = np.ones((10, 2), np.float32)  # Two micro-batches of 5.
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            seen = sess.run([observer.seen[0], train], {x: feed})[0]
    grad, weight = seen
    assert grad == pytest.approx(4.0) and weight == 5


def test_window_accessors_after_the_one_run_form_say_what_to_use():
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), 4)
        gradaccum.subdivisions.minimize(acc, _model, _placeholders())
        for field in ("micro_step", "apply_op", "zero_op"):
            with pytest.raises(ValueError, match=r"GradientAccumulator 'GradientAccumulator' has no `%s`: the "
                               r"one-run form \(subdivisions.minimize\) keeps no window between runs: each run "
                               r"of its train op is one whole update" % field):
                getattr(acc, field)


@pytest.mark.parametrize("form", ["tower", "one-run"])
def test_a_pair_from_model_fn_is_deprecated_in_both_forms(form):
    """The pair still means what it meant in each form, with one FutureWarning that names ModelResult."""
    meaning = "(loss, outputs)" if form == "tower" else "(loss, weight)"
    with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), 2)
        if form == "tower":
            result = gradaccum.tower.minimize(acc, lambda x, ids, y: (_model(x, ids, y), 2 * x), feeds,
                                              devices=["/cpu:0"])
            assert result.outputs is not None
        else:
            gradaccum.subdivisions.minimize(acc, lambda x, ids, y: (_model(x, ids, y), tf.shape(y)[0]), feeds)
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert messages == ["`model_fn` returned a pair, read as %s here; the two forms read a pair differently, so "
                        "return gradaccum.ModelResult(loss, %s=...) instead (a pair is deprecated)"
                        % (meaning, meaning[7:-1])]


def test_model_result_carries_the_outputs_in_tower_minimize():
    x = np.arange(12.0).reshape(6, 2)
    with tf.Graph().as_default():
        inputs = tf.constant(x)

        def model_fn(shard):
            v = v1.get_variable("v", dtype=tf.float64, initializer=np.ones(2))
            return gradaccum.ModelResult(tf.reduce_mean(tf.tensordot(shard, v, 1)), outputs=2.0 * shard)

        result = gradaccum.tower.minimize(OPTIMIZERS["sgd"](), model_fn, inputs, devices=["/cpu:0", "/cpu:1"])
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": 2})) as sess:
            sess.run(v1.global_variables_initializer())
            np.testing.assert_array_equal(sess.run(result.outputs), 2.0 * x)


@pytest.mark.parametrize("call, caller, meaning", [
    ("minimize", "GradientAccumulator.minimize", "every UPDATE_OPS op"),
    ("apply_gradients", "apply_gradients", "no update ops"),
    ("subdivisions", "subdivisions.minimize", "no update ops"),
])
def test_update_ops_none_is_deprecated_everywhere_with_its_old_meaning(call, caller, meaning):
    with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), 2)
        if call == "subdivisions":
            gradaccum.subdivisions.minimize(acc, _model, feeds, update_ops=None)
        elif call == "minimize":
            acc.minimize(_model(*feeds), update_ops=None)
        else:
            acc.apply_gradients(acc.compute_gradients(_model(*feeds)), update_ops=None)
    messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(messages) == 1 and messages[0].startswith("%s(update_ops=None) is deprecated: it runs %s; say "
                                                         "update_ops=[] (none), 'first' or 'all'"
                                                         % (caller.split(".")[-1] if call != "subdivisions"
                                                            else caller, meaning)), messages


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(update_ops=[tf.no_op]), ValueError, r"`update_ops` must be 'first', 'all' or \[\] in "
                                              r"subdivisions.minimize, got a list of 1 ops"),
    (dict(devices=[]), ValueError, r"`devices` must be a non-empty list of device strings, got \[\]"),
    (dict(devices=["/cpu:0"], variables_device=3), TypeError, r"`variables_device` must be a device string"),
])
def test_the_one_run_form_checks_as_the_towers_do(kwargs, error, message):
    with tf.Graph().as_default():
        kwargs = dict(kwargs)
        if "update_ops" in kwargs:
            kwargs["update_ops"] = [tf.no_op()]
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), 2)
        with pytest.raises(error, match=message):
            gradaccum.subdivisions.minimize(acc, _model, _placeholders(), **kwargs)


def test_variables_device_none_is_the_first_device_in_both_forms():
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), 2)
        gradaccum.subdivisions.minimize(acc, _model, _placeholders(), devices=["/cpu:1"], variables_device=None)
        assert {v.device for v in v1.trainable_variables()} == {"/device:CPU:1"}


def test_window_batch_norm_needs_an_example_in_every_tower_when_it_runs():
    """A fed batch smaller than the towers would normalise an empty shard: one clear error, nothing applied."""
    with tf.Graph().as_default():
        feeds, train = _window_bn_one_run_on_two_towers()
        with v1.Session(config=v1.ConfigProto(device_count={"CPU": 2})) as sess:
            sess.run(v1.global_variables_initializer())
            before = _named(sess)
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="`inputs` must give every tower an example with window batch norm"):
                sess.run(train, {feeds[0]: np.ones((1, 4)), feeds[1]: np.ones(1)})
            _assert_equal_values(_named(sess), before)
