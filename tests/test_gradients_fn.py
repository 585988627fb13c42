"""``GradientAccumulator(gradients=fn)`` beside its plain use, and where gradaccum's warnings and outputs point.

* ``fn`` may call the wrapped optimizer's own ``compute_gradients`` (or the
  accumulator's): it gets TensorFlow's gradients, it does not call ``fn``
  again. Checked by numbers: ``fn`` doubles those gradients, and plain SGD
  at twice the learning rate gives the same variables after several updates,
  in the fused train op, ``subdivisions.minimize`` and ``tower.minimize``.
* TensorFlow's ``gate_gradients``, ``aggregation_method`` and
  ``colocate_gradients_with_ops`` reach a ``fn`` that declares them, as
  ``tf.gradients`` takes them, or are refused by name; ``GATE_GRAPH`` groups
  the function's gradients.
* The ``FutureWarning``s of deprecated arguments name the user's line, in
  every form.
* With a callable input and two towers, ``SubdividedTraining.outputs`` are
  in the order its docstring states.
"""
import linecache
import warnings

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from test_subdivisions import _assert_equal_values, _batches, _model, _placeholders, _values

v1 = tf.compat.v1
K = 4
LEARNING_RATE = 0.1
GATES = {"GATE_NONE": v1.train.Optimizer.GATE_NONE, "GATE_OP": v1.train.Optimizer.GATE_OP,
         "GATE_GRAPH": v1.train.Optimizer.GATE_GRAPH}
ADD_N = tf.AggregationMethod.ADD_N
TREE = tf.AggregationMethod.EXPERIMENTAL_TREE


def _session(graph):
    return v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 2}))


def _trained(form, batches, learning_rate, gradients=None):
    """Variables and slots after ``batches`` with SGD, k = 4, in ``form``; ``gradients(acc, sgd)`` makes ``fn``."""
    with tf.Graph().as_default() as graph:
        v1.set_random_seed(1)
        feeds = _placeholders()
        sgd = v1.train.GradientDescentOptimizer(learning_rate)
        holder = {}
        acc = gradaccum.GradientAccumulator(sgd, K, gradients=None if gradients is None else gradients(holder, sgd))
        holder["acc"] = acc
        step = v1.train.get_or_create_global_step()
        if form == "fused":
            train_op = acc.minimize(_model(*feeds), global_step=step, weight=tf.shape(feeds[0])[0])
        elif form == "subdivisions":
            train_op = gradaccum.subdivisions.minimize(acc, _model, feeds, global_step=step).train_op
        else:
            train_op = gradaccum.tower.minimize(acc, _model, feeds, devices=["/cpu:0", "/cpu:1"],
                                                global_step=step).train_op
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                parts = [batch] if form == "subdivisions" else zip(*[np.array_split(a, K) for a in batch])
                for part in parts:
                    sess.run(train_op, dict(zip(feeds, part)))
            return _values(sess, acc)


def _doubling(callee):
    """``fn`` that doubles the gradients of the wrapped optimizer's (or the accumulator's) ``compute_gradients``."""
    def make(holder, sgd):
        calls = []

        def gradients(loss, variables, grad_loss):
            calls.append(loss)
            optimizer = sgd if callee == "wrapped" else holder["acc"]
            pairs = optimizer.compute_gradients(loss, variables, grad_loss=grad_loss)
            assert [v for _, v in pairs] == list(variables)
            return [_doubled(g) for g, _ in pairs]
        make.calls = calls
        return gradients
    return make


def _doubled(grad):
    if isinstance(grad, tf.IndexedSlices):  # The table's gather.
        return tf.IndexedSlices(2.0 * grad.values, grad.indices, grad.dense_shape)
    return None if grad is None else 2.0 * grad


# ------------------------------------------------------------------ fn calls the optimizer


@pytest.mark.parametrize("callee", ["wrapped", "accumulator"])
@pytest.mark.parametrize("form", ["fused", "subdivisions", "towers"])
def test_fn_may_start_from_the_optimizers_own_gradients(form, callee):
    """Inside ``fn`` ``compute_gradients`` gives TensorFlow's gradients: doubled, they train as twice the rate."""
    batches = _batches(2)
    make = _doubling(callee)
    actual = _trained(form, batches, LEARNING_RATE, make)
    assert make.calls, "fn was not called"
    expected = _trained(form, batches, 2 * LEARNING_RATE)
    assert actual.pop("global_step") == expected.pop("global_step") == 2
    _assert_equal_values(actual, expected, rtol=1e-12, atol=1e-14)
    start = _trained(form, [], LEARNING_RATE)
    start.pop("global_step")
    assert all(not np.allclose(actual[name], start[name]) for name in ("w", "b", "table")), "nothing trained"


def test_the_optimizer_is_itself_again_after_the_call():
    """After the train op is built, the wrapped optimizer's ``compute_gradients`` is its class's again."""
    with tf.Graph().as_default():
        sgd = v1.train.GradientDescentOptimizer(LEARNING_RATE)
        acc = gradaccum.GradientAccumulator(sgd, K, gradients=_doubling("wrapped")({}, sgd))
        acc.minimize(_model(*_placeholders()))
        assert "compute_gradients" not in vars(sgd)


# ------------------------------------------------------------------ TensorFlow's arguments


class _Recording(object):
    """A gradient function that records its keyword arguments and passes them to ``tf.compat.v1.gradients``."""

    def __init__(self):
        self.options = []

    def __call__(self, loss, variables, grad_loss, **kwargs):
        self.options.append(kwargs)
        return v1.gradients(loss, variables, grad_ys=grad_loss, **kwargs)


def _named(loss, variables, grad_loss, gate_gradients, aggregation_method, colocate_gradients_with_ops):
    _named.options.append(dict(gate_gradients=gate_gradients, aggregation_method=aggregation_method,
                               colocate_gradients_with_ops=colocate_gradients_with_ops))
    return v1.gradients(loss, variables, grad_ys=grad_loss, gate_gradients=gate_gradients,
                        aggregation_method=aggregation_method,
                        colocate_gradients_with_ops=colocate_gradients_with_ops)


def _three(loss, variables, grad_loss):
    return v1.gradients(loss, variables, grad_ys=grad_loss)


def _fresh_named():
    _named.options = []
    return _named


# Which of TensorFlow's arguments reach ``fn``, or are refused, is decided from ``fn``'s signature as the
# train op is built, the same in both behaviours; the path that passes them on and trains runs in the tf2
# session too (test_tf_arguments_passed_on_train_as_tensorflow_does, every gate).
_ARGUMENTS = pytest.mark.one_behaviour(reason="arguments checked against fn's signature at build time; "
                                              "test_tf_arguments_passed_on_train_as_tensorflow_does trains "
                                              "with them in the tf2 session")


@_ARGUMENTS
@pytest.mark.parametrize("declares", ["kwargs", "named"])
@pytest.mark.parametrize("gate, method, colocate", [
    ("GATE_NONE", ADD_N, True), ("GATE_OP", None, False), ("GATE_GRAPH", TREE, True)])
def test_tf_arguments_reach_a_function_that_declares_them(declares, gate, method, colocate):
    fn = _Recording() if declares == "kwargs" else _fresh_named()
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(LEARNING_RATE), K, gradients=fn)
        acc.minimize(_model(*_placeholders()), gate_gradients=GATES[gate], aggregation_method=method,
                     colocate_gradients_with_ops=colocate)
    # As TensorFlow's compute_gradients passes them to tf.gradients: a bool for gating per op.
    assert fn.options == [dict(gate_gradients=gate == "GATE_OP", aggregation_method=method,
                               colocate_gradients_with_ops=colocate)]


@_ARGUMENTS
@pytest.mark.parametrize("argument, value, shown", [
    ("gate_gradients", v1.train.Optimizer.GATE_NONE, "Optimizer.GATE_NONE"),
    ("aggregation_method", ADD_N, repr(ADD_N)),
    ("aggregation_method", TREE, repr(TREE)),
    ("colocate_gradients_with_ops", True, "True"),
])
@pytest.mark.parametrize("call", ["minimize", "compute_gradients"])
def test_a_tf_argument_the_function_does_not_declare_is_refused(call, argument, value, shown):
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(LEARNING_RATE), K, gradients=_three)
        loss = _model(*_placeholders())
        with pytest.raises(ValueError, match=r"`gradients` .*_three.* takes no `%s`, and %s=%s is not the default "
                                             r"it is called with: declare a parameter `%s` \(or \*\*kwargs\)"
                           % (argument, argument, shown.replace(".", r"\."), argument)):
            getattr(acc, call)(loss, **{argument: value})


@_ARGUMENTS
def test_a_function_declaring_one_argument_gets_that_one_only():
    seen = []

    def colocating(loss, variables, grad_loss, colocate_gradients_with_ops):
        seen.append(colocate_gradients_with_ops)
        return v1.gradients(loss, variables, grad_ys=grad_loss)
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(LEARNING_RATE), K, gradients=colocating)
        loss = _model(*_placeholders())
        acc.minimize(loss, colocate_gradients_with_ops=True)
        with pytest.raises(ValueError, match="takes no `aggregation_method`"):
            acc.minimize(loss, aggregation_method=ADD_N)
    assert seen == [True]


@_ARGUMENTS
@pytest.mark.parametrize("gate", [3, -1, "GATE_OP", None])
def test_a_gate_gradients_tf_does_not_know_is_refused(gate):
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(LEARNING_RATE), K,
                                            gradients=_Recording())
        with pytest.raises(ValueError, match=r"`gate_gradients` must be Optimizer.GATE_NONE, GATE_OP or GATE_GRAPH "
                                             r"\(0, 1 or 2\), got"):
            acc.minimize(_model(*_placeholders()), gate_gradients=gate)


@pytest.mark.parametrize("fn", [_three, _Recording()], ids=["three_arguments", "kwargs"])
def test_gate_graph_groups_the_functions_gradients(fn):
    """As TensorFlow's ``GATE_GRAPH``: no gradient is handed on before every one is computed."""
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(LEARNING_RATE), K, gradients=fn)
        pairs = acc.compute_gradients(_model(*_placeholders()), gate_gradients=v1.train.Optimizer.GATE_GRAPH)
        grads = [grad for grad, _ in pairs]
        assert len(grads) == 5
        for grad in grads:
            tensor = grad.values if isinstance(grad, tf.IndexedSlices) else grad
            gate = [op for op in tensor.op.control_inputs if op.type == "NoOp"]
            assert len(gate) == 1, tensor.op
            waited = set(op.name for op in gate[0].control_inputs)
            assert len(waited) >= 5, waited  # The gradient ops of all five variables.


@pytest.mark.parametrize("gate", sorted(GATES))
def test_tf_arguments_passed_on_train_as_tensorflow_does(gate):
    """A function passing them on to ``tf.compat.v1.gradients`` gives TensorFlow's own ``minimize``'s values."""
    batches = _batches(2)
    options = dict(gate_gradients=GATES[gate], aggregation_method=TREE, colocate_gradients_with_ops=True)

    def train(gradients):
        with tf.Graph().as_default():
            feeds = _placeholders()
            acc = gradaccum.GradientAccumulator(v1.train.AdamOptimizer(0.05), 1, gradients=gradients)
            train_op = acc.minimize(_model(*feeds), global_step=v1.train.get_or_create_global_step(), **options)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                for batch in batches:
                    sess.run(train_op, dict(zip(feeds, batch)))
                return _values(sess, acc)
    recording = _Recording()
    _assert_equal_values(train(recording), train(None), rtol=0, atol=0)
    assert recording.options[0]["aggregation_method"] == TREE


# ------------------------------------------------------------------ the docs' example


def _folded(loss, variables, grad_loss, **kwargs):
    """The docs' ``fn``: the micro-batch weight folded into the loss, not passed as ``grad_ys``."""
    if grad_loss is not None:
        loss = tf.reduce_sum(loss * tf.stop_gradient(grad_loss))
    return v1.gradients(loss, variables, **kwargs)


@pytest.mark.parametrize("form", ["fused", "towers"])
def test_the_docs_folded_weight_trains_as_tensorflows_gradients(form):
    """The weight folded into the loss gives every variable the value of TensorFlow's gradients, bit for bit."""
    batches = _batches(2)
    seen = []

    def make(holder, sgd):
        def gradients(loss, variables, grad_loss, **kwargs):
            seen.append(grad_loss)
            return _folded(loss, variables, grad_loss, **kwargs)
        return gradients
    actual = _trained(form, batches, LEARNING_RATE, make)
    expected = _trained(form, batches, LEARNING_RATE)
    _assert_equal_values(actual, expected, rtol=0, atol=0)
    if form == "fused":  # The weight is carried by backprop there: the fold is exercised.
        assert seen and all(grad_loss is not None for grad_loss in seen)


# ------------------------------------------------------------------ warnings name the user's line


def _pair_model(x, ids, y):
    return _model(x, ids, y), tf.shape(y)[0]


def _pair_outputs_model(x, ids, y):
    return _model(x, ids, y), 2.0 * x


def _deprecated_call(call, acc, feeds):
    """Makes the call whose deprecation is checked; each on its own line, which the warning must name."""
    if call == "minimize":
        acc.minimize(_model(*feeds), update_ops=None)  # warned: minimize
    elif call == "apply_gradients":
        acc.apply_gradients(acc.compute_gradients(_model(*feeds)), update_ops=None)  # warned: apply_gradients
    elif call == "tower.minimize":
        gradaccum.tower.minimize(acc, _model, feeds, devices=["/cpu:0"], update_ops=None)  # warned: tower.minimize
    elif call == "subdivisions.minimize":
        gradaccum.subdivisions.minimize(acc, _model, feeds, update_ops=None)  # warned: subdivisions.minimize
    elif call == "tower pair":
        gradaccum.tower.minimize(acc, _pair_outputs_model, feeds, devices=["/cpu:0"])  # warned: tower pair
    else:
        gradaccum.subdivisions.minimize(acc, _pair_model, feeds)  # warned: subdivisions pair


@pytest.mark.one_behaviour(reason="the warning's stack level is Python's, the same in both behaviours; "
                                  "every form is built in the tf2 session by the tests above")
@pytest.mark.parametrize("call", ["minimize", "apply_gradients", "tower.minimize", "subdivisions.minimize",
                                  "tower pair", "subdivisions pair"])
def test_a_deprecation_warning_names_the_users_line(call):
    with tf.Graph().as_default(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(LEARNING_RATE), 2)
        _deprecated_call(call, acc, _placeholders())
    found = [(w.filename, w.lineno) for w in caught if issubclass(w.category, FutureWarning)]
    assert len(found) == 1, found
    filename, lineno = found[0]
    assert filename == __file__, found
    assert linecache.getline(filename, lineno).rstrip().endswith("# warned: %s" % call), found


# ------------------------------------------------------------------ outputs of a callable input


def _ids_model(ids):
    w = v1.get_variable("w", dtype=tf.float64, initializer=np.array([0.5]))
    return gradaccum.ModelResult(tf.reduce_mean(tf.cast(ids, tf.float64) * w), outputs=ids)


@pytest.mark.parametrize("towers", [1, 2])
def test_outputs_of_a_callable_input_come_in_the_documented_order(towers):
    """Tower after tower, each tower's k pulls in the order it made them (one tower: the source's order)."""
    doc = " ".join(gradaccum.subdivisions.SubdividedTraining.__doc__.split())
    assert ("A callable input: tower after tower, each tower's k micro-batches in the order that tower pulled "
            "them.") in doc
    pull, runs = 2, 3
    size = pull * K * towers  # Examples per run.
    with tf.Graph().as_default() as graph:
        source = v1.data.Dataset.from_tensor_slices(np.arange(size * runs, dtype=np.int64)).batch(pull)
        iterator = v1.data.make_one_shot_iterator(source)
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(LEARNING_RATE), K)
        result = gradaccum.subdivisions.minimize(acc, _ids_model, iterator.get_next,
                                                 devices=["/cpu:%d" % i for i in range(towers)])
        with _session(graph) as sess:
            sess.run(v1.global_variables_initializer())
            for run in range(runs):
                outputs = sess.run([result.train_op, result.outputs])[1]
                assert sorted(outputs) == list(range(run * size, (run + 1) * size))
                if towers == 1:
                    assert list(outputs) == list(range(run * size, (run + 1) * size))
                for rows in np.split(outputs, towers):  # One tower's k pulls: whole pulls, in pulled order.
                    pulls = rows.reshape(K, pull)
                    assert (pulls[:, 0] % pull == 0).all() and (np.diff(pulls, axis=1) == 1).all(), outputs
                    assert (np.diff(pulls[:, 0]) > 0).all(), outputs
