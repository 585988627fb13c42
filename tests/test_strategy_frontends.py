"""GradientAccumulator in the front ends that hand it a ``tf.distribute`` strategy: Estimator and Keras ``fit``.

Each front end trains a small float64 model for UPDATES updates, every
update from R * K micro-batches of uneven sizes, weighted by their examples,
with the loss written as the front end expects under a strategy. The
reference is one device, no strategy, no accumulator, fed each update's
micro-batches as one global batch. The variables, the wrapped optimizer's
slots and non-slot variables (Adam's m, v and beta powers) and the global
step must equal the reference's to 1e-9 relative.

* Estimator (``tf.estimator`` exists on TF 1.15 to 2.15): ``RunConfig(
  train_distribute=...)``. Its ``input_fn`` is called once and its batches go
  to the replicas in turn (the ``input_fn`` batch is one replica's
  micro-batch): run t of a ``MirroredStrategy`` over 2 devices feeds batch
  2t to replica 0 and 2t + 1 to replica 1. The v1 optimizer's
  ``compute_gradients`` divides a mean loss by the replica count there, so
  the ``model_fn`` writes the plain mean. Values are read from the
  checkpoints the Estimators write.
* Keras 2 ``fit`` under ``strategy.scope()`` with a v1 optimizer (see the
  comment of its section).
* Both under ``MultiWorkerMirroredStrategy``: two worker processes on
  loopback, one replica each (strategy_child.py), against the same reference.
"""
import os

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
import strategy_child
from test_integrations import TF_VERSION, _absent, _keras

DEVICES = ["/cpu:0", "/cpu:1"]
SESSION_CONFIG = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
R = 2  # replicas of the two-device strategies
K = 2  # micro-batches per replica and update
UPDATES = 3
# Examples in each micro-batch, in the order the input yields them; the
# update u takes micro-batches u * R * K .. (u + 1) * R * K - 1.
SIZES = [3, 1, 2, 4, 1, 5, 2, 2, 4, 3, 1, 1]
assert len(SIZES) == UPDATES * R * K
STARTS = np.cumsum([0] + SIZES[:-1])
_RNG = np.random.RandomState(0)
X = _RNG.randn(64, 3)  # Estimator: the first sum(SIZES); Keras: the first UPDATES * KERAS_GLOBAL
Y = _RNG.randn(64, 1)
W0 = {"w1": 0.5 * _RNG.randn(3, 4), "b1": 0.1 * _RNG.randn(4), "w2": 0.5 * _RNG.randn(4, 1), "b2": np.zeros(1)}
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.1),
}


def _model_loss(x, y):
    """A tanh MLP from W0 (float64 variables ``w1 b1 w2 b2``); the mean squared error."""
    b1, b2, w1, w2 = [tf.compat.v1.get_variable(name, dtype=tf.float64, initializer=tf.constant(W0[name]))
                      for name in sorted(W0)]
    out = tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) + b2
    return tf.reduce_mean(tf.square(out - y))


def _strategy(kind):
    return {"mirrored": lambda: tf.distribute.MirroredStrategy(DEVICES),
            "central_storage": lambda: tf.distribute.experimental.CentralStorageStrategy(DEVICES),
            "one_device": lambda: tf.distribute.OneDeviceStrategy(DEVICES[0])}[kind]()


def _checkpoint(model_dir):
    """``{name: value}`` of every variable in the newest checkpoint of ``model_dir``."""
    return {name: tf.train.load_variable(model_dir, name) for name, _ in tf.train.list_variables(model_dir)}


def _check_equal(got, want, opt_name):
    """Every variable of the reference (model, slots, beta powers, global step) equals, to 1e-9 relative."""
    expected = {"w1", "b1", "w2", "b2", "global_step"}
    if opt_name == "adam":
        expected |= {"beta1_power", "beta2_power"} | {"%s/Adam%s" % (v, s) for v in W0 for s in ("", "_1")}
    assert set(want) == expected
    missing = sorted(set(want) - set(got))
    assert not missing, "not in the accumulated run's checkpoint: %s (it has %s)" % (missing, sorted(got))
    assert got["global_step"] == want["global_step"] == UPDATES
    for name in sorted(want):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name)
    assert np.max(np.abs(got["w1"] - W0["w1"])) > 1e-2  # It trained.


# ---------------------------------------------------------------- Estimator


def _estimator_module():
    module = getattr(tf, "estimator", None) if TF_VERSION < (2, 16) else None
    if module is None:
        _absent("estimator", "tf.estimator exists only up to TF 2.15 (running TF %s)" % tf.__version__)
    return module


def _input_fn(group):
    """Batches of ``group`` micro-batches each, in order: micro-batches (group = 1) or global batches."""
    starts, sizes = STARTS[::group], np.add.reduceat(SIZES, np.arange(0, len(SIZES), group))

    def input_fn():
        x, y = tf.constant(X), tf.constant(Y)
        data = tf.compat.v1.data.Dataset.from_tensor_slices((starts, sizes))
        return data.map(lambda start, size: (x[start:start + size], y[start:start + size])).repeat()

    return input_fn


def _estimator_model_fn(opt_name, k, form):
    estimator = _estimator_module()

    def model_fn(features, labels, mode):
        assert mode == estimator.ModeKeys.TRAIN
        loss = _model_loss(features, labels)  # The optimizer divides it by the replica count.
        step = tf.compat.v1.train.get_global_step()
        opt = OPTIMIZERS[opt_name]()
        if k is None:
            train_op = opt.minimize(loss, global_step=step)
        elif form == "minimize":
            train_op = gradaccum.GradientAccumulator(opt, k).minimize(loss, global_step=step,
                                                                      weight=tf.shape(labels)[0])
        else:
            accumulator = gradaccum.GradientAccumulator(opt, k)
            grads_and_vars = accumulator.compute_gradients(loss)
            train_op = accumulator.apply_gradients(grads_and_vars, global_step=step, weight=tf.shape(labels)[0])
        return estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    return model_fn


def _estimator_train(model_dir, opt_name, k, form="minimize", strategy=None, group=1):
    """Trains UPDATES updates (``max_steps`` counts updates); returns the final checkpoint's values."""
    estimator = _estimator_module()
    config = estimator.RunConfig(model_dir=str(model_dir), tf_random_seed=0, train_distribute=strategy,
                                 session_config=SESSION_CONFIG, log_step_count_steps=10 ** 6,
                                 save_summary_steps=10 ** 6)
    est = estimator.Estimator(_estimator_model_fn(opt_name, k, form), config=config)
    est.train(_input_fn(group), max_steps=UPDATES)
    return _checkpoint(str(model_dir))


_ESTIMATOR_REFERENCES = {}


def _estimator_reference(opt_name, tmp_path, group=R * K):
    """One device, no strategy, the plain optimizer: each update's ``group`` micro-batches as one batch."""
    if (opt_name, group) not in _ESTIMATOR_REFERENCES:
        _ESTIMATOR_REFERENCES[opt_name, group] = _estimator_train(tmp_path / "reference", opt_name, None,
                                                                  group=group)
    return _ESTIMATOR_REFERENCES[opt_name, group]


@pytest.mark.parametrize("form", ["minimize", "compute_apply"])
@pytest.mark.parametrize("kind", ["mirrored", "central_storage", "one_device"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_estimator_under_a_strategy_equals_one_device_on_the_global_batch(opt_name, kind, form, tmp_path):
    strategy = _strategy(kind)
    k = R * K // strategy.num_replicas_in_sync  # One device takes every micro-batch of the update in turn.
    got = _estimator_train(tmp_path / "accumulated", opt_name, k, form, strategy)
    _check_equal(got, _estimator_reference(opt_name, tmp_path), opt_name)


def test_estimator_k1_under_mirrored_equals_one_device_on_each_runs_batches(tmp_path):
    """k = 1 (no caches): every run applies the R replicas' micro-batches, still reduced once, weighted."""
    got = _estimator_train(tmp_path / "accumulated", "adam", 1, strategy=_strategy("mirrored"))
    _check_equal(got, _estimator_reference("adam", tmp_path, group=R), "adam")


def test_the_strategies_page_estimator_program_trains_five_updates(tmp_path, fork_server):
    """The docs' test skips the page's Estimator program (it runs on the newest TensorFlow): it runs here."""
    _estimator_module()
    import test_doc_blocks

    blocks = [block for block in test_doc_blocks.read_blocks(os.path.join("docs", "guides", "strategies.md"))
              if block.language == "python" and "tf.estimator.Estimator(" in block.code]
    assert len(blocks) == 1 and blocks[0].marker == "<!-- norun -->"
    path = tmp_path / "estimator_program.py"
    path.write_text(blocks[0].code, encoding="utf-8")
    returncode, stdout, stderr = fork_server.run(str(path), str(tmp_path), test_doc_blocks._env(),
                                                 test_doc_blocks.TIMEOUT)
    test_doc_blocks._check_exit(returncode, stdout, stderr)
    assert "global_step: 5" in stdout


# -------------------------------------------------------------------- Keras
#
# Keras 2 ``fit`` under ``strategy.scope()`` with a v1 optimizer: TF 1.15's
# ``tf.keras`` wraps it in ``TFOptimizer``, which under a strategy applies with
# ``global_step=tf.train.get_global_step()`` (not ``iterations``): the script
# creates the global step in the scope. ``batch_size`` is the global batch of
# a run, split evenly over the replicas, and Keras divides each replica's mean
# loss by the replica count. Keras passes no ``weight``: every micro-batch
# weighs 1, so the micro-batches are even here. The reference is a plain
# session: plain Keras ``fit`` on the global batch differs from it by float32
# rounding (about 1e-7 relative), with or without a strategy.

KERAS_GLOBAL = 12  # examples per update: k = 3 runs of 4 (2 per replica)
KERAS_NAMES = {"hidden/kernel": "w1", "hidden/bias": "b1", "out/kernel": "w2", "out/bias": "b2",
               "training/beta1_power": "beta1_power", "training/beta2_power": "beta2_power",
               "global_step": "global_step"}


def _keras_run(opt_name, k, strategy):
    """Trains UPDATES updates of KERAS_GLOBAL examples in k runs each; returns values by the reference's names."""
    keras = _keras()
    floatx = keras.backend.floatx()
    keras.backend.set_floatx("float64")
    try:
        with tf.Graph().as_default(), tf.compat.v1.Session(config=SESSION_CONFIG) as sess, strategy.scope():
            step = tf.compat.v1.train.get_or_create_global_step()
            model = keras.Sequential([_dense(keras, "hidden", "w1", "b1", activation="tanh", input_shape=(3,)),
                                      _dense(keras, "out", "w2", "b2")])
            model.compile(optimizer=gradaccum.GradientAccumulator(OPTIMIZERS[opt_name](), k), loss="mse")
            sess.run(tf.compat.v1.variables_initializer([step]))  # Keras initialises its own variables only.
            model.fit(X[:UPDATES * KERAS_GLOBAL], Y[:UPDATES * KERAS_GLOBAL], batch_size=KERAS_GLOBAL // k,
                      epochs=1, shuffle=False, verbose=0)
            variables = {_reference_name(var.op.name): var for var in tf.compat.v1.global_variables()}
            variables.pop(None, None)
            return dict(zip(variables, sess.run(list(variables.values()))))
    finally:
        keras.backend.set_floatx(floatx)


def _reference_name(name):
    """The session reference's name of a Keras variable (model, slot, beta power, step), or ``None``."""
    layer, _, slot = name.partition("/Adam")
    if layer in KERAS_NAMES:
        return KERAS_NAMES[layer] + ("/Adam" + slot if name != layer else "")
    return None


def _dense(keras, name, kernel, bias, **kwargs):
    constant = keras.initializers.Constant
    return keras.layers.Dense(W0[bias].size, name=name, kernel_initializer=constant(W0[kernel]),
                              bias_initializer=constant(W0[bias]), **kwargs)


def _session_reference(opt_name, batch):
    """One device, a plain session and optimizer: UPDATES steps on X, Y in batches of ``batch``."""
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        x, y = tf.compat.v1.placeholder(tf.float64, [None, 3]), tf.compat.v1.placeholder(tf.float64, [None, 1])
        step = tf.compat.v1.train.get_or_create_global_step()
        train = OPTIMIZERS[opt_name]().minimize(_model_loss(x, y), global_step=step)
        sess.run(tf.compat.v1.global_variables_initializer())
        for update in range(UPDATES):
            rows = slice(update * batch, (update + 1) * batch)
            sess.run(train, {x: X[rows], y: Y[rows]})
        variables = {var.op.name: var for var in tf.compat.v1.global_variables()}
        return dict(zip(variables, sess.run(list(variables.values()))))


@pytest.mark.parametrize("kind", ["mirrored", "central_storage", "one_device"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_keras_fit_under_a_strategy_equals_one_device_on_the_global_batch(opt_name, kind):
    if kind == "central_storage" and TF_VERSION < (2, 0):
        pytest.skip("TF 1.15's Keras cannot build a layer under CentralStorageStrategy, with any optimizer: "
                    "its AggregatingVariable has no `trainable` (NotImplementedError in Layer.__setattr__)")
    strategy = _strategy(kind)
    k = KERAS_GLOBAL // 4  # 4 examples per run, over the replicas
    _check_equal(_keras_run(opt_name, k, strategy), _session_reference(opt_name, KERAS_GLOBAL), opt_name)


# ------------------------------------------------- across processes (MWMS)


@pytest.mark.distributed
@pytest.mark.one_behaviour(reason="an Estimator exists on TF <= 2.15 only, where CI runs the tf1 session")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_estimator_under_multi_worker_mirrored_equals_one_device_on_the_global_batch(opt_name, tmp_path):
    """``train_and_evaluate`` on two workers, each one replica fed its own micro-batches."""
    _estimator_module()
    model_dir = tmp_path / "accumulated"
    strategy_child.run_workers(["--frontend", "estimator", "--optimizer", opt_name, "--model-dir", str(model_dir)])
    want = _estimator_reference(opt_name, tmp_path)
    _check_equal(_checkpoint(str(model_dir)), want, opt_name)  # The chief's.
    others = [os.path.dirname(path) for path in tf.io.gfile.glob(str(model_dir / "*" / "checkpoint"))]
    for other in others:  # TF lets other workers save into a directory of their own: theirs must agree.
        _check_equal(_checkpoint(other), want, opt_name)


@pytest.mark.distributed
@pytest.mark.one_behaviour(reason="the Keras tests under MirroredStrategy cover the tf2 session's code path")
@pytest.mark.timeout(240)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_keras_fit_under_multi_worker_mirrored_equals_one_device_on_the_global_batch(opt_name, tmp_path):
    """Every worker fits the same arrays; each run's global batch of 4 spans both workers."""
    _keras()
    out = str(tmp_path / "keras")
    strategy_child.run_workers(["--frontend", "keras", "--optimizer", opt_name, "--out", out])
    want = _session_reference(opt_name, KERAS_GLOBAL)
    for worker in range(2):
        got = np.load("%s-worker%d.npz" % (out, worker))
        _check_equal({name.replace("|", "/"): got[name] for name in got.files}, want, opt_name)
