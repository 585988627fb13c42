"""Optimizers users wrote themselves, through GradientAccumulator: a conformance suite.

The plain optimizer is the reference. At k = 1 the wrapper must give its
results and create the same variables; at k = 4 one window of micro-batches
must equal one plain step on their concatenation, with equal micro-batches
(no ``weight``) and uneven ones (``weight`` = rows), in float64, over several
updates, on the model's variables and on every variable of the optimizer's
state. ``global_step`` counts applied windows whether the optimizer
increments it (TF's style) or ignores it (BERT's style); skipped windows do
not count. The optimizers themselves are in ``tests/user_optimizers.py``;
``tf.contrib.opt``'s are checked on TF 1.x only.
"""
import functools

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from user_optimizers import AdamWeightDecay, CountingSGD, Lamb

v1 = tf.compat.v1
STEPS = 3
ROWS = 8
EQUAL = [2, 2, 2, 2]
UNEVEN = [1, 2, 4, 1]
EXCLUDE = ["LayerNorm", "bias"]
CONTRIB = getattr(tf, "contrib", None)
needs_contrib = pytest.mark.skipif(
    CONTRIB is None, reason="tf.contrib.opt exists only in TensorFlow 1.x (run this file under TF 1.15)")

USER = {
    "bert_adamw": lambda: AdamWeightDecay(0.05, weight_decay_rate=0.01, exclude_from_weight_decay=EXCLUDE),
    "lamb": lambda: Lamb(0.05, weight_decay_rate=0.01),
    "counting_sgd": lambda: CountingSGD(0.1),
}
# Built lazily: tf.contrib is only there on TF 1.x.
CONTRIB_OPTIMIZERS = {
    "AdamW": lambda: CONTRIB.opt.AdamWOptimizer(0.01, learning_rate=0.05),
    "LazyAdam": lambda: CONTRIB.opt.LazyAdamOptimizer(0.05),
    "MovingAverage": lambda: CONTRIB.opt.MovingAverageOptimizer(v1.train.AdamOptimizer(0.05), 0.9),
    "Nadam": lambda: CONTRIB.opt.NadamOptimizer(0.05),
    "AddSign": lambda: CONTRIB.opt.AddSignOptimizer(0.05),
    # The decay reads global_step: the step the optimizer sees must be the window count.
    "PowerSign": lambda: CONTRIB.opt.PowerSignOptimizer(0.05, sign_decay_fn=linear_decay),
    "LARS": lambda: CONTRIB.opt.LARSOptimizer(0.5, momentum=0.9, weight_decay=0.01, eeta=0.1),
}


def linear_decay(global_step):
    """From 1 at step 0 to 0.7 at step 3: the window count decides the size of each step."""
    return 1.0 - 0.1 * tf.cast(global_step, tf.float32)


class Model(object):
    """A tanh layer, a "LayerNorm" scale and an output layer; ``sparse`` adds an embedding lookup."""

    def __init__(self, sparse=False):
        rng = np.random.RandomState(7)
        self.x = v1.placeholder(tf.float64, [None, 3], name="x")
        self.y = v1.placeholder(tf.float64, [None, 1], name="y")
        self.ids = v1.placeholder(tf.int32, [None], name="ids") if sparse else None
        inputs = self.x
        if sparse:
            # Its own generator: the other variables start the same with or without it.
            table = v1.get_variable("embedding/table", initializer=np.random.RandomState(8).randn(6, 3) * 0.5)
            inputs = inputs + tf.gather(table, self.ids)
        kernel = v1.get_variable("layer/kernel", initializer=rng.randn(3, 4) * 0.5)
        bias = v1.get_variable("layer/bias", initializer=np.full(4, 0.1))
        gamma = v1.get_variable("LayerNorm/gamma", initializer=np.linspace(0.8, 1.2, 4))
        out = v1.get_variable("out/kernel", initializer=rng.randn(4, 1) * 0.5)
        hidden = tf.tanh(tf.matmul(inputs, kernel) + bias) * gamma
        self.loss = tf.reduce_mean(tf.square(tf.matmul(hidden, out) - self.y))
        self.step = v1.train.get_or_create_global_step()

    def feed(self, batch, rows=slice(None)):
        fed = {self.x: batch["x"][rows], self.y: batch["y"][rows]}
        if self.ids is not None:
            fed[self.ids] = batch["ids"][rows]
        return fed


def batches(steps=STEPS):
    rng = np.random.RandomState(3)
    # Ids 0-4 only: row 5 of the table never gets a gradient (a lazy optimizer leaves it alone).
    return [{"x": rng.randn(ROWS, 3), "y": rng.randn(ROWS, 1), "ids": rng.randint(0, 5, ROWS)}
            for _ in range(steps)]


def micro_slices(sizes):
    ends = np.cumsum(sizes)
    return [slice(end - size, end) for size, end in zip(sizes, ends)]


def train(make_optimizer, k=None, sizes=None, sparse=False, data=None, gated=False, **options):
    """Trains ``len(data)`` updates; returns ``(values, global_step after each run, wrapper's values)``.

    ``k`` None: the plain optimizer, one run per full batch. Otherwise the
    wrapper, one run per micro-batch of ``sizes`` (``weight`` = rows when the
    sizes differ). ``gated``: the update is built after the gradients (see
    :func:`minimize`). Values are by variable name; the wrapper's own state
    variables are apart, in the third item.
    """
    data = batches() if data is None else data
    with tf.Graph().as_default():
        v1.set_random_seed(1)
        model = Model(sparse)
        optimizer = make_optimizer()
        wrapper, slices, weight = None, [slice(None)], None
        if k is not None:
            wrapper = gradaccum.GradientAccumulator(optimizer, k, **options)
            slices = micro_slices(sizes)
            weight = tf.shape(model.x)[0] if len(set(sizes)) > 1 else None
        train_op = minimize(wrapper or optimizer, model, weight, gated)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            steps = []
            for batch in data:
                for rows in slices:
                    sess.run(train_op, model.feed(batch, rows))
                    steps.append(sess.run(model.step))
            own = [] if wrapper is None else wrapper.state_variables
            names = {v.name for v in own}
            found = [v for v in v1.global_variables() if v.name not in names and v is not model.step]
            values = dict(zip([v.op.name for v in found], sess.run(found)))
            return values, steps, dict(zip([v.op.name for v in own], sess.run(own)))


def minimize(optimizer, model, weight, gated):
    """``optimizer.minimize``; ``gated``: ``apply_gradients`` under the gradients' control.

    TF 1.15's AdamWOptimizer decays a variable in an op that waits for nothing,
    so in a plain ``minimize`` the forward pass may read the variable before or
    after its decay, and the result changes from run to run. Built after the
    gradients, the decay always follows them: the math AdamW means.
    """
    options = {} if weight is None else {"weight": weight}
    if not gated:
        return optimizer.minimize(model.loss, model.step, **options)
    grads_and_vars = optimizer.compute_gradients(model.loss)
    with tf.control_dependencies([grad for grad, _ in grads_and_vars if grad is not None]):
        return optimizer.apply_gradients(grads_and_vars, model.step, **options)


def assert_same_state(actual, expected):
    assert sorted(actual) == sorted(expected), "the variables differ"
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], rtol=1e-10, atol=1e-12, err_msg=name)


@functools.lru_cache(maxsize=None)
def plain(make_optimizer, sparse=False, gated=False):
    """The plain optimizer's values after ``STEPS`` full batches (computed once per optimizer)."""
    return train(make_optimizer, sparse=sparse, gated=gated)[0]


@functools.lru_cache(maxsize=None)
def initial_values():
    """The model's variables before training, by name."""
    with tf.Graph().as_default():
        Model(sparse=True)
        found = v1.global_variables()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            return dict(zip([v.op.name for v in found], sess.run(found)))


def assert_moved(values, name):
    """Guards against a vacuous comparison: the variable left its initial value."""
    assert not np.allclose(initial_values()[name], values[name]), name + " never moved"


def window_steps(k):
    """``global_step`` after each run when every window of k runs is applied."""
    return [(run + 1) // k for run in range(STEPS * k)]


# ------------------------------------------------------------ user-written optimizers


@pytest.mark.parametrize("name", sorted(USER))
def test_k1_is_the_plain_optimizer(name):
    expected = plain(USER[name])
    actual, steps, _ = train(USER[name], 1, [ROWS])
    assert_same_state(actual, expected)
    assert_moved(actual, "layer/kernel")
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("sizes", [EQUAL, UNEVEN], ids=["equal", "uneven_weight"])
@pytest.mark.parametrize("name", sorted(USER))
def test_k4_equals_the_full_batch(name, sizes):
    expected = plain(USER[name])
    actual, steps, _ = train(USER[name], 4, sizes)
    assert_same_state(actual, expected)
    assert_moved(actual, "out/kernel")
    # Once per applied window, whether the optimizer ignores global_step or increments it.
    assert steps == window_steps(4)


def test_bert_style_state_and_exclusions():
    """The moments live in get_variable variables; excluded names are not decayed.

    One update, from the same start: only the decay can tell the two runs apart.
    """
    decayed, _, _ = train(USER["bert_adamw"], 4, EQUAL, data=batches(1))
    undecayed, _, _ = train(lambda: AdamWeightDecay(0.05, exclude_from_weight_decay=EXCLUDE), 4, EQUAL,
                            data=batches(1))
    assert {"layer/kernel/adam_m", "layer/kernel/adam_v", "LayerNorm/gamma/adam_v"} <= set(decayed)
    for name in ["layer/bias", "LayerNorm/gamma", "layer/bias/adam_m"]:
        np.testing.assert_allclose(decayed[name], undecayed[name], rtol=1e-12, err_msg=name)
    for name in ["layer/kernel", "out/kernel"]:
        assert not np.allclose(decayed[name], undecayed[name]), name + " was not decayed"


@pytest.mark.parametrize("name", sorted(USER))
def test_skipped_window_is_not_applied_or_counted(name):
    data = batches()
    data[1]["y"] = data[1]["y"].copy()
    data[1]["y"][3] = np.nan  # the second window's gradients are not finite
    expected, _, _ = train(USER[name], data=[data[0], data[2]])
    actual, steps, own = train(USER[name], 4, EQUAL, data=data, skip_nonfinite=True)
    assert_same_state(actual, expected)
    assert steps == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2]
    assert own["GradientAccumulator/skipped_windows"] == 1


@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", ["bert_adamw", "counting_sgd"])
def test_one_apply_gradients_call_per_train_op(name, k):
    """Plain TF calls ``apply_gradients`` once per ``minimize``: so does the wrapper."""
    with tf.Graph().as_default():
        model = Model()
        optimizer = USER[name]()
        wrapper = gradaccum.GradientAccumulator(optimizer, k)
        wrapper.minimize(model.loss, model.step)
        assert optimizer.calls == 1
        if name == "counting_sgd":  # BERT's optimizer, plain, cannot be built twice either
            wrapper.minimize(model.loss * 2.0, model.step)
            assert optimizer.calls == 2


def counted(name):
    """``(optimizer, the optimizer counting apply_gradients calls)``: itself, or the one it wraps."""
    if name == "MovingAverage":
        inner = CountingSGD(0.1)
        return CONTRIB.opt.MovingAverageOptimizer(inner, 0.9), inner
    optimizer = USER[name]()
    return optimizer, optimizer


@pytest.mark.parametrize("name", ["bert_adamw", "counting_sgd", pytest.param("MovingAverage", marks=needs_contrib)])
def test_manual_apply_op_shares_the_state(name):
    """``apply_op`` applies the two micro-batches fed so far, as one full-batch step on them.

    It runs without a feed, so it cannot be the train op's apply: reading it
    calls ``apply_gradients`` once more, sharing every variable of the first.
    """
    data = batches(1)
    expected, _, _ = train(lambda: counted(name)[0], data=[{key: value[:4] for key, value in data[0].items()}])
    with tf.Graph().as_default():
        model = Model()
        optimizer, counter = counted(name)
        wrapper = gradaccum.GradientAccumulator(optimizer, 4)
        wrapper.minimize(model.loss, model.step)
        before = {v.name for v in v1.global_variables()}
        apply_op, again = wrapper.apply_op, wrapper.apply_op
        assert apply_op is again
        assert {v.name for v in v1.global_variables()} == before, "apply_op created state of its own"
        calls = counter.calls
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for rows in micro_slices([2, 2]):
                sess.run(wrapper.accumulate_op, model.feed(data[0], rows))
            sess.run(apply_op)
            own = {v.name for v in wrapper.state_variables}
            found = [v for v in v1.global_variables() if v.name not in own and v is not model.step]
            actual = dict(zip([v.op.name for v in found], sess.run(found)))
            assert sess.run(model.step) == 1
    assert_same_state(actual, expected)
    assert calls == 2  # one for the train op, one for the feed-free manual apply


# ------------------------------------------------------------ tf.contrib.opt (TF 1.x)


@needs_contrib
@pytest.mark.parametrize("k, sizes", [(1, [ROWS]), (4, EQUAL), (4, UNEVEN)], ids=["k1", "k4_equal", "k4_uneven_weight"])
@pytest.mark.parametrize("name", sorted(CONTRIB_OPTIMIZERS))
def test_contrib_optimizer(name, k, sizes):
    """AdamW's reference is built after the gradients (see :func:`minimize`); at k = 1 the
    wrapper is the plain optimizer and is built so too, at k = 4 it needs nothing of the kind."""
    sparse = name == "LazyAdam"
    expected = plain(CONTRIB_OPTIMIZERS[name], sparse, gated=name == "AdamW")
    actual, steps, _ = train(CONTRIB_OPTIMIZERS[name], k, sizes, sparse=sparse, gated=name == "AdamW" and k == 1)
    assert_same_state(actual, expected)
    assert_moved(actual, "layer/kernel")
    assert steps == window_steps(k)


@needs_contrib
def test_lazy_adam_leaves_untouched_rows():
    """No micro-batch looks up row 5: the window's sparse gradient must not touch it either."""
    actual, _, _ = train(CONTRIB_OPTIMIZERS["LazyAdam"], 4, UNEVEN, sparse=True)
    table = initial_values()["embedding/table"]
    np.testing.assert_array_equal(actual["embedding/table"][5], table[5])
    assert not np.allclose(actual["embedding/table"][:5], table[:5])
    slots = [name for name in actual if name.startswith("embedding/table/")]
    assert slots and all(not actual[name][5].any() for name in slots), slots


@needs_contrib
def test_moving_average_swapping_saver(tmp_path):
    """The averages move once per window, and the swapping saver writes them as the variables."""
    data = batches()
    with tf.Graph().as_default():
        model = Model()
        optimizer = CONTRIB_OPTIMIZERS["MovingAverage"]()
        wrapper = gradaccum.GradientAccumulator(optimizer, 4)
        train_op = wrapper.minimize(model.loss, model.step, weight=tf.shape(model.x)[0])
        saver = optimizer.swapping_saver()
        trained = v1.trainable_variables()
        averages = [v1.get_default_graph().get_tensor_by_name(v.op.name + "/ExponentialMovingAverage:0")
                    for v in trained]
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in data:
                for rows in micro_slices(UNEVEN):
                    sess.run(train_op, model.feed(batch, rows))
            expected = dict(zip([v.op.name for v in trained], sess.run(averages)))
            path = saver.save(sess, str(tmp_path / "averaged"))
    with tf.Graph().as_default():
        Model()
        trained = v1.trainable_variables()
        with v1.Session() as sess:
            v1.train.Saver(trained).restore(sess, path)
            restored = dict(zip([v.op.name for v in trained], sess.run(trained)))
    reference = plain(CONTRIB_OPTIMIZERS["MovingAverage"])
    for name in expected:
        np.testing.assert_allclose(restored[name], expected[name], rtol=1e-12, err_msg=name)
        np.testing.assert_allclose(restored[name], reference[name + "/ExponentialMovingAverage"], rtol=1e-10,
                                   err_msg=name)
