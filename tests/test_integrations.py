"""GradientAccumulator inside the tools TF1 users train with.

Keras ``Model.fit`` (``tf.keras`` up to TF 2.15, ``tf_keras`` from 2.16),
``tf.estimator`` (TF <= 2.15), tf-slim's ``create_train_op``
(``tf.contrib.slim`` on TF 1.15, the ``tf-slim`` package on 2.x) and
``MonitoredTrainingSession``. Each integration trains a small MLP and must
equal the full-batch run, for Adam and Momentum, with k = 1 and k = 4; and
each has a "broken" case, an accumulator whose k is forced to 1 while the
framework still feeds micro-batches, that must fail the same comparison
(so the comparison can tell). A test skips only where its framework does
not exist for the running TensorFlow.
"""
import contextlib
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
import forkserver

TF_VERSION = tuple(int(part) for part in tf.__version__.split(".")[:2])
EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")

N_IN, HIDDEN, N_OUT = 5, 4, 2
FULL = 16  # examples per applied update
UPDATES = 3
_RNG = np.random.RandomState(0)
X = _RNG.randn(24, N_IN).astype(np.float32)
Y = _RNG.randn(24, N_OUT).astype(np.float32)
# Initial weights (kernel, bias, kernel, bias), the same for every run.
W0 = [(0.5 * _RNG.randn(N_IN, HIDDEN)).astype(np.float32), np.zeros(HIDDEN, np.float32),
      (0.5 * _RNG.randn(HIDDEN, N_OUT)).astype(np.float32), np.zeros(N_OUT, np.float32)]
OPTIMIZERS = {
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.05),
    "momentum": lambda: tf.compat.v1.train.MomentumOptimizer(0.05, 0.9),
}
# (accumulator k, micro-batch size, must equal the full batch): k = 1 and k = 4,
# then k = 4's micro-batches through an accumulator broken to k = 1.
CASES = [(1, FULL, True), (4, FULL // 4, True), (1, FULL // 4, False)]
CASE_IDS = ["k1", "k4", "k4-forced-to-1"]


# ------------------------------------------------------------------ helpers


def _absent(framework, reason):
    """Skips: ``framework`` does not exist here. CI lists in ``GRADACCUM_REQUIRE_INTEGRATIONS``
    (comma-separated: keras, estimator, slim) what must exist, and then this fails instead."""
    required = os.environ.get("GRADACCUM_REQUIRE_INTEGRATIONS", "").split(",")
    if framework in required:
        pytest.fail("%s is required here (GRADACCUM_REQUIRE_INTEGRATIONS) but absent: %s" % (framework, reason))
    pytest.skip(reason)


@contextlib.contextmanager
def _fresh_session():
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as sess:
        tf.compat.v1.set_random_seed(0)
        yield sess


def _optimizer(opt_name, k):
    opt = OPTIMIZERS[opt_name]()
    return opt if k is None else gradaccum.GradientAccumulator(opt, k)


def _stream(micro, start, count):
    """Micro-batches ``start`` .. ``start + count - 1`` cycling over the first FULL examples."""
    rows = np.concatenate([np.arange(i * micro, (i + 1) * micro) % FULL for i in range(start, start + count)])
    return X[rows], Y[rows]


def _mlp_loss(x, y):
    """tanh MLP with W0 as initial weights (variables ``mlp/*``); the mean squared error."""
    with tf.compat.v1.variable_scope("mlp"):
        w1, b1, w2, b2 = [tf.compat.v1.get_variable(name, initializer=value)
                          for name, value in zip(["w1", "b1", "w2", "b2"], W0)]
    out = tf.matmul(tf.tanh(tf.matmul(x, w1) + b1), w2) + b2
    return tf.compat.v1.losses.mean_squared_error(y, out)


def _placeholders():
    return (tf.compat.v1.placeholder(tf.float32, [None, N_IN], name="x"),
            tf.compat.v1.placeholder(tf.float32, [None, N_OUT], name="y"))


MODEL_VARIABLES = ["mlp/w1", "mlp/b1", "mlp/w2", "mlp/b2"]


def _manual(opt_name, micro, k, updates=UPDATES, micro_clip=None, window_clip=None):
    """The reference: numpy averages k micro-batch gradients, a plain optimizer applies them.

    ``micro_clip`` clips each micro-batch gradient by norm per variable (what
    tf-slim's ``clip_gradient_norm`` does); ``window_clip`` clips the average
    by global norm (what ``GradientAccumulator(clip_norm=...)`` does).
    """
    with _fresh_session() as sess:
        x, y = _placeholders()
        opt = OPTIMIZERS[opt_name]()
        grads, variables = zip(*opt.compute_gradients(_mlp_loss(x, y)))
        if micro_clip is not None:
            grads = [tf.clip_by_norm(grad, micro_clip) for grad in grads]
        fed = [tf.compat.v1.placeholder(tf.float32, var.shape) for var in variables]
        applied = tf.clip_by_global_norm(fed, window_clip)[0] if window_clip is not None else fed
        train = opt.apply_gradients(list(zip(applied, variables)),
                                    global_step=tf.compat.v1.train.get_or_create_global_step())
        sess.run(tf.compat.v1.global_variables_initializer())
        for update in range(updates):
            per_micro = [sess.run(grads, dict(zip((x, y), _stream(micro, update * k + i, 1)))) for i in range(k)]
            sess.run(train, dict(zip(fed, [np.mean(parts, axis=0) for parts in zip(*per_micro)])))
        return sess.run(list(variables))


_REFERENCES = {}


def _reference(opt_name):
    """Weights after UPDATES full-batch updates of the plain optimizer (cached)."""
    if opt_name not in _REFERENCES:
        _REFERENCES[opt_name] = _manual(opt_name, FULL, 1)
    return _REFERENCES[opt_name]


def _max_difference(weights, reference):
    return max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(weights, reference))


def _check_against_full_batch(weights, reference, should_equal):
    """Equal within float32 tolerance, or (a broken accumulator) clearly not."""
    assert len(weights) == len(reference)
    if should_equal:
        for got, want in zip(weights, reference):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert _max_difference(weights, reference) > 1e-3, "a k forced to 1 went unnoticed"


class _RunCounter(tf.compat.v1.train.SessionRunHook):
    """Counts ``session.run`` calls of the training loop."""

    def __init__(self):
        self.runs = 0

    def after_run(self, run_context, run_values):
        self.runs += 1


# -------------------------------------------------------------------- Keras


def _keras():
    """Keras 2: ``tf.keras`` up to TF 2.15, the ``tf_keras`` package from TF 2.16 on."""
    if TF_VERSION < (2, 16):
        return tf.keras
    if importlib.util.find_spec("tf_keras") is None:
        _absent("keras", "TF >= 2.16 without tf_keras: Keras 3 takes no TF1 optimizer (pip install tf-keras)")
    import tf_keras

    return tf_keras


def _keras_model(keras, opt):
    model = keras.Sequential([keras.layers.Dense(HIDDEN, activation="tanh", input_shape=(N_IN,)),
                              keras.layers.Dense(N_OUT)])
    model.compile(optimizer=opt, loss="mse")
    model.set_weights(W0)
    return model


def _keras_fit(opt_name, k, batch_size, epochs=UPDATES):
    keras = _keras()
    with _fresh_session() as sess:
        model = _keras_model(keras, _optimizer(opt_name, k))
        model.fit(X[:FULL], Y[:FULL], batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        return model.get_weights(), sess.run(model.optimizer.iterations)


_KERAS_REFERENCES = {}


@pytest.mark.parametrize("k, micro, should_equal", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_keras_fit_equals_full_batch(opt_name, k, micro, should_equal):
    if opt_name not in _KERAS_REFERENCES:
        _KERAS_REFERENCES[opt_name] = _keras_fit(opt_name, None, FULL)[0]
    weights, iterations = _keras_fit(opt_name, k, micro)
    _check_against_full_batch(weights, _KERAS_REFERENCES[opt_name], should_equal)
    # Keras's `iterations` is the global step the TF optimizer increments: it counts updates.
    assert iterations == UPDATES * FULL // micro // k


@pytest.mark.parametrize("source", ["arrays", "dataset"])
def test_keras_window_carries_over_epoch_end(source):
    """24 examples in micro-batches of 4 are 6 per epoch: with k = 4 the second
    window takes micro-batches 5 and 6 of epoch 1 and 1 and 2 of epoch 2."""
    keras = _keras()
    one_update = _keras_fit("adam", None, FULL, epochs=1)[0]
    with _fresh_session():
        reference = _keras_model(keras, OPTIMIZERS["adam"]())
        two_epochs = np.concatenate([np.arange(24), np.arange(24)])
        reference.fit(X[two_epochs], Y[two_epochs], batch_size=FULL, epochs=1, shuffle=False, verbose=0)
        three_updates = reference.get_weights()
    with _fresh_session() as sess:
        opt = _optimizer("adam", 4)
        model = _keras_model(keras, opt)
        if source == "arrays":
            fit = dict(x=X, y=Y, batch_size=4, shuffle=False)
        else:  # steps_per_epoch counts micro-batches (train-op runs), not updates.
            data = tf.compat.v1.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat()
            fit = dict(x=data, steps_per_epoch=6)
        model.fit(epochs=1, verbose=0, **fit)
        assert sess.run([model.optimizer.iterations, opt.micro_step]) == [1, 2]
        _check_against_full_batch(model.get_weights(), one_update, True)
        model.fit(epochs=2, initial_epoch=1, verbose=0, **fit)
        assert sess.run([model.optimizer.iterations, opt.micro_step]) == [3, 0]
        _check_against_full_batch(model.get_weights(), three_updates, True)


def test_keras_saver_checkpoint_resumes_the_window_exactly(tmp_path):
    """h5 and SavedModel keep no TF1 optimizer state; a TF Saver on Keras's session does."""
    keras = _keras()
    prefix = str(tmp_path / "ckpt")
    with _fresh_session():
        model = _keras_model(keras, _optimizer("adam", 4))
        model.fit(X, Y, batch_size=4, epochs=3, shuffle=False, verbose=0)
        uninterrupted = model.get_weights()
    with _fresh_session() as sess:
        model = _keras_model(keras, _optimizer("adam", 4))
        model.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)  # 1 update + 2 micro-batches
        tf.compat.v1.train.Saver().save(sess, prefix)
    with _fresh_session() as sess:
        opt = _optimizer("adam", 4)
        model = _keras_model(keras, opt)
        model.fit(X, Y, epochs=0, verbose=0)  # trains nothing; creates the optimizer's variables
        tf.compat.v1.train.Saver().restore(sess, prefix)
        assert sess.run(opt.micro_step) == 2
        model.fit(X, Y, batch_size=4, epochs=3, initial_epoch=1, shuffle=False, verbose=0)
        resumed = model.get_weights()
    for got, want in zip(resumed, uninterrupted):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["h5", "savedmodel"])
def test_keras_save_and_load_model_keep_the_weights_only(fmt, tmp_path):
    keras = _keras()
    if fmt == "savedmodel" and TF_VERSION < (2, 0):
        pytest.skip("TF 1.15's Keras cannot load a SavedModel in graph mode after training with a TF1 optimizer")
    path = str(tmp_path / ("model.h5" if fmt == "h5" else "saved_model"))
    with _fresh_session():
        model = _keras_model(keras, _optimizer("adam", 4))
        model.fit(X, Y, batch_size=4, epochs=1, shuffle=False, verbose=0)
        trained = model.get_weights()
        if fmt == "h5":
            model.save(path)  # Keras leaves TF1 optimizers out, with a warning
        else:  # a SavedModel with a TF1 optimizer (ours or TF's) cannot be loaded in graph mode
            model.save(path, save_format="tf", include_optimizer=False)
    with _fresh_session():
        loaded = keras.models.load_model(path)
        assert loaded.optimizer is None  # the window, the slots and `iterations` are not in the file
        for got, want in zip(loaded.get_weights(), trained):
            np.testing.assert_array_equal(got, want)


_KERAS3_CHILD = """
import os, sys
import tensorflow as tf
if os.environ.get("GRADACCUM_TF_MODE") == "tf1":
    tf.compat.v1.disable_v2_behavior()
import keras
import gradaccum
assert keras.__version__.startswith("3."), keras.__version__
model = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(1)])
try:
    model.compile(optimizer=gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(0.1), 4), loss="mse")
except ValueError as exc:
    print("ValueError: %s" % exc)
    sys.exit(3)
"""


def test_keras3_rejects_the_accumulator_in_compile():
    if TF_VERSION < (2, 16) or importlib.util.find_spec("keras") is None:
        pytest.skip("Keras 3 exists from TF 2.16 on")
    env = dict(os.environ, TF_USE_LEGACY_KERAS="0")
    done = subprocess.run([sys.executable, "-c", _KERAS3_CHILD], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=180)
    if "startswith" in done.stderr:
        pytest.skip("the installed `keras` package is not Keras 3")
    assert done.returncode == 3, done.stderr[-2000:]
    assert "Could not interpret optimizer identifier" in done.stdout
    assert "GradientAccumulator" in done.stdout
    assert "tf_keras" in done.stdout and "gradient_accumulation_steps" in done.stdout


# ---------------------------------------------------------------- Estimator


def _estimator_module():
    module = getattr(tf, "estimator", None) if TF_VERSION < (2, 16) else None
    if module is None:
        _absent("estimator", "tf.estimator exists only up to TF 2.15 (running TF %s)" % tf.__version__)
    return module


def _estimator_model_fn(opt_name, k):
    estimator = _estimator_module()

    def model_fn(features, labels, mode):
        loss = _mlp_loss(features, labels)
        if mode == estimator.ModeKeys.EVAL:
            return estimator.EstimatorSpec(mode, loss=loss)
        opt = _optimizer(opt_name, k)
        train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_global_step(),
                                weight=tf.shape(labels)[0])  # see test_a_run_failing_at_its_input_adds_nothing
        return estimator.EstimatorSpec(mode, loss=loss, train_op=train_op)

    return model_fn


def _estimator(opt_name, k, model_dir):
    estimator = _estimator_module()
    config = estimator.RunConfig(model_dir=str(model_dir), tf_random_seed=0, log_step_count_steps=10 ** 6,
                                 save_summary_steps=10 ** 6)
    return estimator.Estimator(_estimator_model_fn(opt_name, k), config=config)


def _input_fn(x, y, micro, repeat):
    def input_fn():
        data = tf.compat.v1.data.Dataset.from_tensor_slices((x, y)).batch(micro)
        return data.repeat() if repeat else data

    return input_fn


def _estimator_weights(est):
    return [est.get_variable_value(name) for name in MODEL_VARIABLES]


@pytest.mark.parametrize("k, micro, should_equal", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_estimator_train_max_steps_counts_updates(opt_name, k, micro, should_equal, tmp_path):
    est = _estimator(opt_name, k, tmp_path)
    runs = _RunCounter()
    est.train(_input_fn(X[:FULL], Y[:FULL], micro, repeat=True), max_steps=UPDATES, hooks=[runs])
    assert runs.runs == UPDATES * k  # max_steps counts applied updates, k runs each
    assert est.get_variable_value("global_step") == UPDATES
    _check_against_full_batch(_estimator_weights(est), _reference(opt_name), should_equal)


def test_estimator_resumes_a_window_from_its_checkpoint_and_evaluates(tmp_path):
    one_call = _estimator("adam", 4, tmp_path / "one")
    one_call.train(_input_fn(*_stream(4, 0, 12), micro=4, repeat=False))
    two_calls = _estimator("adam", 4, tmp_path / "two")
    two_calls.train(_input_fn(*_stream(4, 0, 6), micro=4, repeat=False))  # ends mid-window
    assert two_calls.get_variable_value("global_step") == 1
    two_calls.train(_input_fn(*_stream(4, 6, 6), micro=4, repeat=False))  # restores the window
    assert two_calls.get_variable_value("global_step") == UPDATES
    weights = _estimator_weights(two_calls)
    for got, want in zip(weights, _estimator_weights(one_call)):
        np.testing.assert_array_equal(got, want)
    _check_against_full_batch(weights, _reference("adam"), True)
    metrics = two_calls.evaluate(_input_fn(X[:FULL], Y[:FULL], FULL, repeat=False))
    w1, b1, w2, b2 = weights
    expected = np.mean((np.tanh(X[:FULL] @ w1 + b1) @ w2 + b2 - Y[:FULL]) ** 2)
    assert metrics["global_step"] == UPDATES
    np.testing.assert_allclose(metrics["loss"], expected, rtol=1e-5)


# ------------------------------------------------------------------ tf-slim


def _slim():
    if TF_VERSION < (2, 0):
        return tf.contrib.slim
    if importlib.util.find_spec("tf_slim") is None:
        _absent("slim", "the tf-slim package is not installed (pip install tf-slim, or '.[test]')")
    import tf_slim

    return tf_slim


def _slim_train(opt, micro, runs, **create_kwargs):
    """Runs tf-slim's train op ``runs`` times on successive micro-batches; returns (weights, sess values)."""
    slim = _slim()
    with _fresh_session() as sess:
        x, y = _placeholders()
        counter = tf.compat.v1.get_variable("update_runs", initializer=0, trainable=False)
        tf.compat.v1.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, counter.assign_add(1))
        train_op = slim.learning.create_train_op(_mlp_loss(x, y), opt, **create_kwargs)
        sess.run(tf.compat.v1.global_variables_initializer())
        for i in range(runs):
            sess.run(train_op, dict(zip((x, y), _stream(micro, i, 1))))
        step = sess.run(tf.compat.v1.train.get_global_step())
        return sess.run(tf.compat.v1.trainable_variables()), step, sess.run(counter)


@pytest.mark.parametrize("k, micro, should_equal", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_slim_create_train_op_equals_full_batch(opt_name, k, micro, should_equal):
    runs = UPDATES * FULL // micro
    weights, step, update_runs = _slim_train(_optimizer(opt_name, k), micro, runs)
    _check_against_full_batch(weights, _reference(opt_name), should_equal)
    assert step == runs // k
    assert update_runs == runs  # UPDATE_OPS run with every micro-batch


def test_slim_explicit_update_ops_replace_the_collection():
    _, step, update_runs = _slim_train(_optimizer("momentum", 4), 4, 12, update_ops=[])
    assert (step, update_runs) == (UPDATES, 0)


def test_slim_clip_gradient_norm_clips_each_micro_batch():
    from tensorflow.python.framework import ops

    _slim()
    if TF_VERSION >= (2, 0) and not hasattr(ops, "IndexedSlices"):
        pytest.skip("tf-slim's own clip_gradient_norm fails on TF %s with or without gradaccum (it reads "
                    "tensorflow.python.framework.ops.IndexedSlices, which is gone)" % tf.__version__)
    clip = 0.05
    weights, _, _ = _slim_train(_optimizer("momentum", 4), 4, 12, clip_gradient_norm=clip)
    per_micro = _manual("momentum", 4, 4, micro_clip=clip)
    _check_against_full_batch(weights, per_micro, True)
    # ... which is not the full batch clipped: that differs, so the clip did act.
    _check_against_full_batch(weights, _manual("momentum", FULL, 1, micro_clip=clip), False)


def test_accumulator_clip_norm_clips_the_average_under_slim():
    clip = 0.05
    opt = gradaccum.GradientAccumulator(OPTIMIZERS["momentum"](), 4, clip_norm=clip)
    weights, _, _ = _slim_train(opt, 4, 12)
    full_batch_clipped = _manual("momentum", FULL, 1, window_clip=clip)
    _check_against_full_batch(weights, full_batch_clipped, True)
    _check_against_full_batch(full_batch_clipped, _reference("momentum"), False)  # the clip acts


# ---------------------------------------------------- MonitoredTrainingSession


def _monitored_train(opt_name, k, micro, checkpoint_dir, first_micro_batch=0, max_runs=None):
    """Trains under MonitoredTrainingSession until StopAtStepHook(UPDATES) or ``max_runs``.

    Returns the number of runs, the accumulator's ``micro_step`` right after the
    (re)start (k > 1 only), and the weights of the final checkpoint.
    """
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        x, y = _placeholders()
        opt = _optimizer(opt_name, k)
        train_op = opt.minimize(_mlp_loss(x, y), global_step=tf.compat.v1.train.get_or_create_global_step())
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=UPDATES)]
        runs, restored_micro_step = 0, None
        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=str(checkpoint_dir), hooks=hooks,
                                                         save_summaries_steps=None) as sess:
            if k > 1:
                restored_micro_step = sess.run(opt.micro_step)
            while not sess.should_stop() and (max_runs is None or runs < max_runs):
                sess.run(train_op, dict(zip((x, y), _stream(micro, first_micro_batch + runs, 1))))
                runs += 1
    weights = [tf.train.load_variable(str(checkpoint_dir), name) for name in MODEL_VARIABLES]
    return runs, restored_micro_step, weights


@pytest.mark.parametrize("k, micro, should_equal", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_monitored_session_stop_at_step_counts_updates(opt_name, k, micro, should_equal, tmp_path):
    runs, _, weights = _monitored_train(opt_name, k, micro, tmp_path)
    assert runs == UPDATES * k  # last_step counts applied updates, k runs each
    _check_against_full_batch(weights, _reference(opt_name), should_equal)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_monitored_session_restart_resumes_the_window_bit_exactly(opt_name, tmp_path):
    _, _, uninterrupted = _monitored_train(opt_name, 4, 4, tmp_path / "one")
    runs, _, _ = _monitored_train(opt_name, 4, 4, tmp_path / "two", max_runs=6)  # 1 update + 2
    assert runs == 6
    runs, micro_step, resumed = _monitored_train(opt_name, 4, 4, tmp_path / "two", first_micro_batch=6)
    assert (micro_step, runs) == (2, 6)  # the CheckpointSaverHook saved the half window
    for got, want in zip(resumed, uninterrupted):
        np.testing.assert_array_equal(got, want)
    _check_against_full_batch(resumed, _reference(opt_name), True)


@pytest.mark.parametrize("weighted", [False, True], ids=["weight-None", "weight-batch-size"])
def test_a_run_failing_at_its_input_adds_nothing(weighted):
    """Estimator and MonitoredTrainingSession loops over tf.data end with an
    OutOfRangeError inside a run: that run must leave the window as it was."""
    with _fresh_session() as sess:
        x, y = tf.compat.v1.data.make_one_shot_iterator(
            tf.compat.v1.data.Dataset.from_tensor_slices((X[:24], Y[:24])).batch(4)).get_next()
        opt = _optimizer("momentum", 4)
        train_op = opt.minimize(_mlp_loss(x, y), weight=tf.shape(x)[0] if weighted else None)
        sess.run(tf.compat.v1.global_variables_initializer())
        for _ in range(6):  # one window applied, two micro-batches left
            sess.run(train_op)
        with pytest.raises(tf.errors.OutOfRangeError):
            sess.run(train_op)
        micro_step, weight_sum = sess.run([opt.micro_step, opt.weight_sum])
    assert (micro_step, weight_sum) == (2, 8 if weighted else 2)


# ----------------------------------------------------------------- examples


def _run_example(script, *args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(EXAMPLES_DIR)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    return subprocess.run(forkserver.command() + [os.path.join(EXAMPLES_DIR, script)] + list(args), env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True,
                          timeout=300)


def test_keras_fit_example_equals_plain_full_batches():
    _keras()
    done = _run_example("keras_fit.py", "--micro-batch", "50", "--micro-batches", "4", "--epochs", "1",
                        "--train-examples", "800", "--hidden", "16", "--compare", "--offline")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 1: 4 updates so far" in done.stdout, done.stdout
    difference = float(done.stdout.split("largest weight difference")[1].split()[0])
    assert difference < 1e-4, done.stdout


def test_examples_reject_a_bad_flag_in_one_line():
    done = _run_example("keras_fit.py", "--micro-batches", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == "keras_fit.py: error: argument --micro-batches: `--micro-batches` must be an " \
                                  "int >= 1, got '0'"


def test_estimator_example_trains_max_steps_updates():
    done = _run_example("estimator.py", "--micro-batch", "50", "--micro-batches", "4", "--max-steps", "5",
                        "--train-examples", "800", "--hidden", "16", "--offline")
    if TF_VERSION >= (2, 16):
        assert done.returncode == 2
        assert done.stderr.strip().splitlines() == [
            "estimator.py: error: needs tf.estimator, which exists only up to TensorFlow 2.15 (this is "
            "TensorFlow %s); use examples/keras_fit.py or a session loop" % tf.__version__]
        return
    assert done.returncode == 0, done.stderr[-2000:]
    assert "global_step 5 (updates; 20 micro-batches)" in done.stdout, done.stdout
