"""GradientAccumulator keeps TF's Optimizer contract: the plain optimizer is the reference.

Every case is built twice, with the plain optimizer and with the wrapper at
k = 1 or k = 3, in the TF behaviour of this run (conftest's ``--tf-mode``).
The plain optimizer runs once per step, the wrapper k times on the same feed:
the results must be equal, and where TF raises, the wrapper raises the same
exception type with a message that starts as TF's.
"""
import logging

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum.window import logfilter as hooks

v1 = tf.compat.v1
KS = [1, 3]
X = np.array([[1.0, 2.0], [0.5, -1.0], [2.0, 0.0]])

OPTIMIZERS = {
    "sgd": lambda: v1.train.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.train.MomentumOptimizer(0.1, 0.9),
    "adam": lambda: v1.train.AdamOptimizer(0.1),
    "adagrad": lambda: v1.train.AdagradOptimizer(0.1),
    "adadelta": lambda: v1.train.AdadeltaOptimizer(1.0),
    "ftrl": lambda: v1.train.FtrlOptimizer(0.1, l1_regularization_strength=0.01),
    "rmsprop": lambda: v1.train.RMSPropOptimizer(0.05, momentum=0.5),
}


class Model(object):
    """Two variables and a fed input; ``wrap(opt)`` is the plain optimizer or the wrapper."""

    def __init__(self, wrap, constraint=None):
        self.wrap = wrap
        self.x = v1.placeholder(tf.float64, [None, 2], name="x")
        self.w = v1.get_variable("w", initializer=np.array([[0.5], [-0.3]]), constraint=constraint)
        self.b = v1.get_variable("b", initializer=np.array([0.1]))
        self.out = tf.matmul(self.x, self.w) + self.b  # shape [n, 1]: a non-scalar loss
        self.loss = tf.reduce_mean(tf.square(self.out))
        self.variables = [self.w, self.b]


def _wrapper(k):
    return (lambda opt: opt) if k is None else (lambda opt: gradaccum.GradientAccumulator(opt, k))


def _outcome(build, k, steps=2):
    """Builds ``build(model)`` and trains ``steps`` steps: the values, or ``(error type, message)``."""
    with tf.Graph().as_default():
        v1.set_random_seed(1)
        try:
            model = Model(_wrapper(k))
            train_ops = build(model)
        except Exception as error:  # noqa: BLE001 - the type is what is compared
            return type(error), str(error)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(steps):
                for train_op in train_ops:
                    for _ in range(k or 1):
                        sess.run(train_op, {model.x: X})
            return sess.run(model.variables + [v for v in v1.global_variables() if "global_step" in v.name])


def assert_same(build, k, steps=2):
    expected = _outcome(build, None, steps)
    actual = _outcome(build, k, steps)
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple), "TF raised %r, the wrapper did not" % (expected,)
        assert actual[0] is expected[0], (actual, expected)
        start = expected[1].split(":")[0].split(",")[0][:40]
        assert actual[1].startswith(start), (actual, expected)
        return expected
    assert not isinstance(actual, tuple), "the wrapper raised %r, TF did not" % (actual,)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    return expected


# ------------------------------------------------------ what minimize accepts

MINIMIZE = {
    "scalar": lambda m, o: [m.wrap(o).minimize(m.loss)],
    "non_scalar": lambda m, o: [m.wrap(o).minimize(tf.square(m.out))],
    "grad_loss": lambda m, o: [m.wrap(o).minimize(tf.square(m.out), grad_loss=tf.constant([[1.0], [0.5], [2.0]],
                                                                                          tf.float64))],
    "callable": lambda m, o: [m.wrap(o).minimize(lambda: tf.reduce_sum(m.w * m.w) + tf.reduce_sum(m.b))],
    "var_list": lambda m, o: [m.wrap(o).minimize(m.loss, var_list=[m.w])],
    "single_var": lambda m, o: [m.wrap(o).minimize(m.loss, var_list=m.b)],
    "global_step": lambda m, o: [m.wrap(o).minimize(m.loss, global_step=v1.train.get_or_create_global_step())],
    "gating": lambda m, o: [m.wrap(o).minimize(
        m.loss, gate_gradients=v1.train.Optimizer.GATE_NONE, colocate_gradients_with_ops=True,
        aggregation_method=tf.AggregationMethod.EXPERIMENTAL_ACCUMULATE_N)],
    "compute_then_apply": lambda m, o: [m.wrap(o).apply_gradients(m.wrap(o).compute_gradients(m.loss))],
    "none_gradient_pair": lambda m, o: [m.wrap(o).apply_gradients(
        m.wrap(o).compute_gradients(tf.reduce_sum(m.w), var_list=[m.w, m.b]))],
}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("case", sorted(MINIMIZE))
@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_minimize_and_apply_accept_what_tf_accepts(opt_name, case, k):
    expected = assert_same(lambda m: MINIMIZE[case](m, OPTIMIZERS[opt_name]()), k)
    if case != "callable":  # TF's callable loss needs resource variables: there only the same outcome
        assert not isinstance(expected, tuple), expected


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_every_optimizer_updates_as_tf_does(opt_name, k):
    assert_same(lambda m: [m.wrap(OPTIMIZERS[opt_name]()).minimize(m.loss)], k, steps=3)


@pytest.mark.parametrize("k", KS)
def test_variable_constraints_apply(k):
    def build(m):
        return [m.wrap(v1.train.GradientDescentOptimizer(10.0)).minimize(m.loss)]

    def outcome(wrap_k):
        with tf.Graph().as_default():
            m = Model(_wrapper(wrap_k), constraint=lambda v: tf.clip_by_value(v, -0.2, 0.2))
            train_op = build(m)[0]
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for _ in range(wrap_k or 1):
                    sess.run(train_op, {m.x: X})
                return sess.run(m.w)

    expected = outcome(None)
    assert np.max(np.abs(expected)) == 0.2  # the constraint did clip
    np.testing.assert_allclose(outcome(k), expected, rtol=1e-12)


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("opt_name", ["sgd", "adagrad", "adam", "ftrl"])
def test_sparse_updates_as_tf(opt_name, k):
    def outcome(wrap_k):
        with tf.Graph().as_default():
            ids = v1.placeholder(tf.int32, [None])
            table = v1.get_variable("table", initializer=np.arange(12.0).reshape(6, 2) / 10)
            opt = _wrapper(wrap_k)(OPTIMIZERS[opt_name]())
            train_op = opt.minimize(tf.reduce_sum(tf.square(tf.gather(table, ids))))
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for _ in range(2 * (wrap_k or 1)):
                    sess.run(train_op, {ids: [0, 3, 3]})
                return sess.run(table)

    expected = outcome(None)
    np.testing.assert_allclose(outcome(k), expected, rtol=1e-12)
    np.testing.assert_array_equal(expected[[1, 2, 4, 5]], np.arange(12.0).reshape(6, 2)[[1, 2, 4, 5]] / 10)


# ------------------------------------------------------------------ errors

ERRORS = {
    "no_gradient": (lambda m, o: [m.wrap(o).minimize(tf.reduce_sum(m.x), var_list=[m.w])], ValueError,
                    "No gradients provided for any variable"),
    "no_gradient_for_listed": (lambda m, o: [m.wrap(o).minimize(5 * tf.reduce_sum(m.w), var_list=[m.b])],
                               ValueError, "No gradients provided for any variable"),
    "empty_var_list": (lambda m, o: [m.wrap(o).minimize(m.loss, var_list=[])], ValueError,
                       "No variables to optimize"),
    "apply_nothing": (lambda m, o: [m.wrap(o).apply_gradients([])], ValueError, "No variables provided"),
    "apply_only_none": (lambda m, o: [m.wrap(o).apply_gradients([(None, m.w)])], ValueError,
                        "No gradients provided for any variable"),
    "tensor_in_var_list": (lambda m, o: [m.wrap(o).minimize(m.loss, var_list=[m.w, m.out])],
                           NotImplementedError, ""),
    "apply_to_tensor": (lambda m, o: [m.wrap(o).apply_gradients([(tf.ones_like(m.out), m.out)])],
                        NotImplementedError, ""),
}


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_are_tfs(case, k):
    build, error, start = ERRORS[case]
    expected = assert_same(lambda m: build(m, v1.train.MomentumOptimizer(0.1, 0.9)), k)
    assert expected[0] is error and expected[1].startswith(start)


def test_no_trainable_variables_is_tfs_error():
    for k in [None] + KS:
        with tf.Graph().as_default():
            opt = _wrapper(k)(v1.train.GradientDescentOptimizer(0.1))
            with pytest.raises(ValueError, match=r"^No variables to optimize"):
                opt.minimize(tf.constant(1.0))


# ------------------------------------------------ slots, variables, collections


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("opt_name", ["adam", "adadelta", "ftrl", "momentum"])
def test_slots_and_variables_keep_tf_meaning(opt_name, k):
    def build(wrap_k):
        graph = tf.Graph()
        with graph.as_default():
            m = Model(_wrapper(wrap_k))
            opt = m.wrap(OPTIMIZERS[opt_name]())
            train_op = opt.minimize(m.loss)
            sess = v1.Session(graph=graph)
            sess.run(v1.global_variables_initializer())
            for _ in range(2 * (wrap_k or 1)):
                sess.run(train_op, {m.x: X})
            slots = dict(((v.op.name, name), opt.get_slot(v, name)) for v in m.variables
                         for name in opt.get_slot_names())
            names = [v.op.name for v in opt.variables()]
            values = dict((key, sess.run(slot)) for key, slot in slots.items())
            train_ops = v1.get_collection(v1.GraphKeys.TRAIN_OP)
            return opt, names, values, train_ops == [train_op], sess

    plain, plain_names, plain_values, plain_collection, sess = build(None)
    sess.close()
    acc, names, values, collection, sess = build(k)
    sess.close()
    assert acc.get_slot_names() == plain.get_slot_names()
    assert sorted(values) == sorted(plain_values) and plain_values
    for key, value in plain_values.items():  # Adadelta's and Ftrl's "accum" included
        np.testing.assert_allclose(values[key], value, rtol=1e-12)
    with acc.windows[0].train_op.graph.as_default():
        own = [v.op.name for v in acc.state_variables]
    assert names == sorted(plain_names + own)
    assert (own == []) == (k == 1)
    assert collection and plain_collection


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_k1_creates_no_state_and_needs_only_the_model_initialised(opt_name):
    def global_names(wrap_k):
        with tf.Graph().as_default():
            m = Model(_wrapper(wrap_k))
            train_op = m.wrap(OPTIMIZERS[opt_name]()).minimize(m.loss)
            names = sorted(v.op.name for v in v1.global_variables())
            if opt_name == "sgd":
                with v1.Session() as sess:
                    sess.run(v1.variables_initializer(m.variables))  # enough for TF's SGD
                    sess.run(train_op, {m.x: X})
            return names, train_op.name

    assert global_names(1) == global_names(None)


@pytest.mark.parametrize("k", KS)
def test_several_train_ops_share_slots_and_stay_exact(k):
    def build(m):
        opt = m.wrap(v1.train.MomentumOptimizer(0.1, 0.9))
        return [opt.minimize(m.loss, var_list=[m.w]), opt.minimize(m.loss * 2.0)]

    assert_same(build, k, steps=2)


@pytest.mark.parametrize("k", KS)
def test_one_wrapper_in_two_graphs(k):
    opt = gradaccum.GradientAccumulator(v1.train.AdamOptimizer(0.1), k)
    plain = v1.train.AdamOptimizer(0.1)
    results = []
    for optimizer, runs in [(plain, 1), (plain, 1), (opt, k), (opt, k)]:
        with tf.Graph().as_default():
            m = Model(lambda o: o)
            train_op = optimizer.minimize(m.loss)
            assert sorted(optimizer.variables(), key=lambda v: v.name) == optimizer.variables()
            assert all(v.graph is tf.compat.v1.get_default_graph() for v in optimizer.variables())
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for _ in range(2 * runs):
                    sess.run(train_op, {m.x: X})
                results.append(sess.run(m.variables))
    for got, want in zip(results[2] + results[3], results[0] + results[1]):
        np.testing.assert_allclose(got, want, rtol=1e-12)


# ------------------------------------------------------------- ref variables


@pytest.fixture
def ref_variables():
    """Old-style variables in this run's control flow (TF2 behaviour: control flow v2)."""
    was_resource = v1.resource_variables_enabled()
    v1.disable_resource_variables()
    yield
    if was_resource:
        v1.enable_resource_variables()


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("opt_name", ["adam", "momentum", "adadelta"])
def test_ref_variables_train_as_tf(opt_name, k, ref_variables):
    def build(m):
        assert m.w.dtype._is_ref_dtype
        return [m.wrap(OPTIMIZERS[opt_name]()).minimize(m.loss, global_step=v1.train.get_or_create_global_step())]

    assert_same(build, k)


# ------------------------------------------------------------------ hooks


class _Records(logging.Handler):
    def __init__(self):
        super(_Records, self).__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _monitored_warnings(tmp_dir, monkeypatch, micro_steps=12):
    from tensorflow.python.platform import tf_logging  # the "first n" counters, fresh for this run

    monkeypatch.setattr(tf_logging, "_log_counter_per_token", {})
    records = _Records()
    logger = tf.get_logger()
    # Another module may have quietened TensorFlow (the examples set ERROR on import).
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(records)
    try:
        with tf.Graph().as_default():
            m = Model(_wrapper(4))
            train_op = m.wrap(v1.train.GradientDescentOptimizer(0.1)).minimize(
                m.loss, global_step=v1.train.get_or_create_global_step())
            with v1.train.MonitoredTrainingSession(checkpoint_dir=tmp_dir, log_step_count_steps=1,
                                                   save_checkpoint_secs=None, save_summaries_steps=None) as sess:
                for _ in range(micro_steps):
                    sess.run(train_op, {m.x: X})
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return [text for text in records.messages if text.startswith(hooks.WARNING_START)]


def test_monitored_training_session_logs_no_global_step_warning(tmp_path, monkeypatch):
    assert _monitored_warnings(str(tmp_path / "quiet"), monkeypatch) == []
    hooks.remove_global_step_warning_filter()
    try:  # without the filter, TF's hook does warn: the check above can fail
        warned = _monitored_warnings_without_filter(str(tmp_path / "loud"), monkeypatch)
    finally:
        hooks.install_global_step_warning_filter()
    assert len(warned) == 5


def _monitored_warnings_without_filter(tmp_dir, monkeypatch):
    original = hooks.install_global_step_warning_filter
    monkeypatch.setattr(hooks, "install_global_step_warning_filter", lambda: None)
    try:
        return _monitored_warnings(tmp_dir, monkeypatch)
    finally:
        monkeypatch.setattr(hooks, "install_global_step_warning_filter", original)


def test_the_filter_drops_only_that_warning():
    record = logging.LogRecord("tensorflow", logging.WARNING, "f", 1, hooks.WARNING_START + ". Current", (), None)
    other = logging.LogRecord("tensorflow", logging.WARNING, "f", 1, "Something else", (), None)
    flt = hooks.GlobalStepWarningFilter()
    assert not flt.filter(record) and flt.filter(other)
