"""``gradaccum.recompute`` beside its main path: each op gets a rule from what it means for gradients.

Every check builds one small float64 block twice, in fresh graphs with the
same seeds, plain and recomputed, and compares every variable's gradient
(``None`` included) or the variables after updates; a block that cannot be
recomputed must raise one ``ValueError`` naming the op and the reason.
Under ``--tf-mode=tf1`` the variables are TF1 reference variables, under
``--tf-mode=tf2`` resource variables.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
import forkserver

v1 = tf.compat.v1
X = np.linspace(-1.0, 1.0, 32).reshape(8, 4)
Y = np.linspace(0.5, -0.5, 8)


def _weights(name, index=0):
    return v1.get_variable(name, dtype=tf.float64,
                           initializer=np.linspace(-0.6, 0.6, 16).reshape(4, 4) * (index + 1) ** 0.5)


def _loss(h, y=Y):
    head = v1.get_variable("head", dtype=tf.float64, initializer=np.array([[0.3], [-0.2], [0.1], [0.5]]))
    return tf.reduce_mean(tf.square(tf.matmul(h, head)[:, 0] - y))


def _print(h, w):
    inner = v1.Print(tf.nn.tanh(tf.matmul(h, w)), [tf.reduce_sum(h)], "block sum: ")
    return h + inner * 2.0


def _print_around_output(h, w):
    return v1.Print(h + tf.nn.tanh(tf.matmul(h, w)), [tf.reduce_mean(h)], "block output: ")


def _gamma(h, w):
    alpha = tf.nn.softplus(tf.matmul(h, w)) + 0.5  # Reparameterised: d sample / d alpha exists.
    return h + tf.random.gamma([], alpha, dtype=tf.float64, seed=3) * 0.1


def _check_numerics(h, w):
    return h + tf.debugging.check_numerics(tf.nn.tanh(tf.matmul(h, w)), "block")


def _float_assertion(h, w):
    inner = tf.nn.tanh(tf.matmul(h, w))
    with tf.control_dependencies([tf.debugging.assert_less_equal(inner, tf.constant(1.0, tf.float64))]):
        return h + tf.identity(inner) * 2.0


def _tf_print(h, w):
    inner = tf.nn.tanh(tf.matmul(h, w))
    with tf.control_dependencies([tf.print("block:", tf.reduce_sum(inner), output_stream=sys.stderr)]):
        return h + tf.identity(inner) * 2.0


@tf.function
def _scaled_tanh(a):
    return tf.nn.tanh(a) * 2.0


def _function_call(h, w):
    return h + _scaled_tanh(tf.matmul(h, w))


def _custom_gradient(h, w):
    @tf.custom_gradient
    def clipped(a):
        return tf.nn.tanh(a), lambda dy: dy * (1.0 - tf.square(tf.nn.tanh(a)))
    return h + clipped(tf.matmul(h, w))


def _cond(h, w):
    return h + tf.cond(tf.reduce_sum(h) > -100.0, lambda: tf.nn.tanh(tf.matmul(h, w)), lambda: h)


def _while(h, w):
    _, out = tf.while_loop(lambda i, a: i < 2, lambda i, a: (i + 1, tf.nn.tanh(tf.matmul(a, w))), (0, h))
    return h + out


def _map_fn(h, w):
    return h + tf.map_fn(lambda row: tf.nn.tanh(row * w[0]), h)


BLOCKS = {"print": _print, "print_around_output": _print_around_output, "gamma": _gamma,
          "check_numerics": _check_numerics, "float_assertion": _float_assertion, "tf_print": _tf_print,
          "function_call": _function_call, "custom_gradient": _custom_gradient}
# TF 2 control flow (If, While): TF 1.x behaviour builds v1 control flow instead, refused by its own test.
TF2_CONTROL_FLOW = {"cond": _cond, "while_loop": _while, "map_fn": _map_fn}


def _model(block, recomputed, blocks=2):
    """``loss(x)`` of ``blocks`` residual blocks ``block(h, w)``, each in its own variable scope."""
    x = v1.placeholder(tf.float64, [None, 4])
    h = x
    for index in range(blocks):
        with v1.variable_scope("block_%d" % index):
            w = _weights("w", index)
            h = (gradaccum.recompute(block) if recomputed else block)(h, w)
    return x, _loss(h)


def _gradients(build, recomputed, **gradient_args):
    """``{variable name: gradient value or None}`` of the model ``build(recomputed)``."""
    with tf.Graph().as_default():
        v1.set_random_seed(7)
        x, loss = build(recomputed)
        variables = v1.global_variables()
        grads = v1.gradients(loss, variables, **gradient_args)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            values = sess.run([g for g in grads if g is not None], {x: X})
    values = iter(values)
    return {var.op.name: (None if grad is None else next(values)) for var, grad in zip(variables, grads)}


def _assert_same_gradients(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        if expected[name] is None:
            assert actual[name] is None, "%s: a gradient where the plain model has none" % name
        else:
            assert actual[name] is not None, "%s: the gradient is lost" % name
            np.testing.assert_allclose(actual[name], expected[name], rtol=1e-12, atol=1e-15, err_msg=name)
            assert np.any(expected[name] != 0), name  # The check would not see a lost gradient as zeros.


# ------------------------------------------------------------------ gradients flow through what is reused


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_every_gradient_equals_the_plain_blocks(kind):
    def build(recomputed):
        return _model(BLOCKS[kind], recomputed)
    _assert_same_gradients(_gradients(build, True), _gradients(build, False))


@pytest.mark.parametrize("kind", sorted(TF2_CONTROL_FLOW))
def test_tf2_control_flow_in_a_block_is_recomputed(kind, tf_mode):
    if tf_mode == "tf1":
        pytest.skip("TF 1.x behaviour builds v1 control flow, refused (test_recompute.py)")

    def build(recomputed):
        return _model(TF2_CONTROL_FLOW[kind], recomputed)
    _assert_same_gradients(_gradients(build, True), _gradients(build, False))


def _train(block, recomputed, updates=2, k=2):
    """The variables after ``updates`` updates of k micro-batches with ``GradientAccumulator.minimize``."""
    with tf.Graph().as_default():
        v1.set_random_seed(7)
        x, loss = _model(block, recomputed)
        acc = gradaccum.GradientAccumulator(v1.train.GradientDescentOptimizer(0.5), k)
        train_op = acc.minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            before = sess.run(v1.trainable_variables())
            for _ in range(updates * k):
                sess.run(train_op, {x: X})
            after = sess.run(v1.trainable_variables())
    return before, after


@pytest.mark.parametrize("kind", ["print", "print_around_output"])
def test_a_print_blocks_update_equals_the_plain_models(kind):
    before, expected = _train(BLOCKS[kind], False)
    _, actual = _train(BLOCKS[kind], True)
    for first, plain, recomputed in zip(before, expected, actual):
        assert np.abs(plain - first).max() > 1e-4  # Every variable moves in the plain model.
        np.testing.assert_allclose(recomputed, plain, rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------ outputs the loss does not use


def _with_unused_output(h, w):
    """A block that also returns a tensor the loss does not use, from a variable only it reads."""
    unused = v1.get_variable("unused", dtype=tf.float64, initializer=np.eye(4) * 0.5)
    inner = tf.nn.tanh(tf.matmul(h, w))
    return h + inner, tf.nn.softmax(tf.matmul(inner, unused))


def _unused_output_model(recomputed, use_extra=False):
    x = v1.placeholder(tf.float64, [None, 4])
    h, extras = x, []
    for index in range(3):
        with v1.variable_scope("block_%d" % index):
            block = gradaccum.recompute(_with_unused_output) if recomputed else _with_unused_output
            h, extra = block(h, _weights("w", index))
            extras.append(extra)
    loss = _loss(h)
    return x, loss + tf.reduce_sum(extras[1]) * 0.1 if use_extra else loss


@pytest.mark.parametrize("use_extra", [False, True])
def test_an_unused_output_gets_no_gradient_and_sends_none(use_extra):
    """Its variable's gradient is None, as in the plain model; used (one step beside), it is exact."""
    def build(recomputed):
        return _unused_output_model(recomputed, use_extra)
    expected = _gradients(build, False)
    assert [name for name in expected if expected[name] is None] == (
        ["block_0/unused", "block_2/unused"] if use_extra else ["block_%d/unused" % i for i in range(3)])
    _assert_same_gradients(_gradients(build, True), expected)


def test_an_unused_output_inside_the_one_run_loop_gets_no_gradient():
    """Inside ``subdivisions.minimize``'s loop TensorFlow fills in other zeros: the rule holds there too."""
    seen = {}

    class Recording(v1.train.GradientDescentOptimizer):
        def compute_gradients(self, *args, **kwargs):
            pairs = super(Recording, self).compute_gradients(*args, **kwargs)
            seen.update((var.op.name, grad) for grad, var in pairs)
            return pairs

    def model_fn(x, y):
        h = x
        for index in range(2):
            with v1.variable_scope("block_%d" % index):
                h, _ = gradaccum.recompute(_with_unused_output)(h, _weights("w", index))
        return _loss(h, y)

    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(Recording(0.1), 2)
        gradaccum.subdivisions.minimize(acc, model_fn, [tf.constant(X), tf.constant(Y)])
    assert len(seen) == 5, seen  # Two blocks' w and unused, the head.
    assert sorted(name for name, grad in seen.items() if grad is None) == ["block_0/unused", "block_1/unused"]


MEMORY_PROGRAM = r"""
import json, sys
import numpy as np
import tensorflow as tf
if sys.argv[1] == "tf1":
    tf.compat.v1.disable_v2_behavior()
else:
    tf.compat.v1.disable_eager_execution()
import gradaccum
v1 = tf.compat.v1
WIDTH, ROWS = 256, 1024  # An unused output of ROWS x WIDTH float32: 1 MB per block.

def block(h, index, extra):
    with v1.variable_scope("block_%d" % index):
        w = v1.get_variable("w", [WIDTH, WIDTH], initializer=v1.initializers.random_normal(stddev=0.05, seed=index))
        inner = tf.nn.relu(tf.matmul(h, w))
        wide = tf.nn.tanh(tf.concat([inner] * 4, 1))  # What recomputing saves: 4 MB per block.
        out = h + tf.reduce_mean(tf.reshape(wide, [-1, 4, WIDTH]), 1)
        return (out, tf.nn.softmax(inner * 2.0)) if extra else out

def peak(extra):
    with tf.Graph().as_default():
        h = x = v1.placeholder(tf.float32, [None, WIDTH])  # Dynamic: no zeros folded into a constant.
        for index in range(8):
            h = gradaccum.recompute(block)(h, index, extra)
            h = h[0] if extra else h
        loss = tf.reduce_mean(tf.square(h))
        train_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            data = np.ones([ROWS, WIDTH], np.float32)
            sess.run(train_op, {x: data})
            tf.config.experimental.reset_memory_stats("CPU:0")
            sess.run(train_op, {x: data})
            return tf.config.experimental.get_memory_info("CPU:0")["peak"]

print(json.dumps({"without": peak(False), "unused": peak(True)}))
"""


@pytest.mark.skipif(not hasattr(tf.config.experimental, "get_memory_info"),
                    reason="TensorFlow < 2.5 keeps no allocator statistics")
def test_an_unused_output_keeps_no_memory(tmp_path, tf_mode):
    """TensorFlow's allocator peak (its own counter: deterministic) with an unused 1 MB output per block."""
    program = tmp_path / "peak.py"
    program.write_text(MEMORY_PROGRAM)
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_ENABLE_ONEDNN_OPTS="0")
    done = subprocess.run(forkserver.command() + [str(program), tf_mode], env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(done.stdout.strip().splitlines()[-1])
    assert peaks["without"] > 4 * 2 ** 20, peaks  # The allocator counted: the measurement means something.
    assert peaks["unused"] <= peaks["without"] * 1.05, peaks


# ------------------------------------------------------------------ placement


def _two_device_block(h, w):
    with tf.device("/cpu:0"):
        inner = tf.nn.tanh(tf.matmul(h, w))
    with tf.device("/cpu:1"):
        w2 = v1.get_variable("w2", dtype=tf.float64, initializer=np.eye(4) * 0.7)
        return h + tf.nn.sigmoid(tf.matmul(inner, w2))


def test_a_two_device_block_keeps_each_copy_on_its_device_under_gradient_colocation():
    def run(recomputed):
        with tf.Graph().as_default() as graph:
            x, loss = _model(_two_device_block, recomputed)
            variables = v1.trainable_variables()
            grads = v1.gradients(loss, variables, colocate_gradients_with_ops=True)
            config = v1.ConfigProto(device_count={"CPU": 2}, allow_soft_placement=False)
            with v1.Session(config=config) as sess:  # Hard placement: a contradiction fails the run.
                sess.run(v1.global_variables_initializer())
                return graph, sess.run(grads, {x: X})

    graph, actual = run(True)
    _, expected = run(False)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    copies = [op for op in graph.get_operations() if "/recompute/" in op.name and op.type in ("Tanh", "Sigmoid")]
    assert sorted(op.type for op in copies) == ["Sigmoid", "Sigmoid", "Tanh", "Tanh"]
    for copy in copies:  # On its original's device, colocated with nothing (not with the IdentityN).
        assert copy.device == ("/device:CPU:0" if copy.type == "Tanh" else "/device:CPU:1"), copy.name
        assert copy.colocation_groups() == [("loc:@" + copy.name).encode()], copy.name


# ------------------------------------------------------------------ side inputs, ops without a gradient


def _resized(h, w, side):
    """A block whose side input reaches the output only through ``ResizeArea`` (which has no gradient)."""
    pooled = tf.cast(tf.reshape(v1.image.resize_area(side, [2, 2]), [1, 4]), tf.float64)
    return h + tf.nn.tanh(tf.matmul(h, w)) * pooled


def _side_input_model(recomputed, side_from_variable=False):
    x = v1.placeholder(tf.float64, [None, 4])
    side = tf.constant(np.linspace(0.1, 1.6, 16).reshape(1, 4, 4, 1), tf.float32)
    if side_from_variable:
        side = side * v1.get_variable("scale", dtype=tf.float32, initializer=np.float32(1.5))
    h = x
    for index in range(2):
        with v1.variable_scope("block_%d" % index):
            h = (gradaccum.recompute(_resized) if recomputed else _resized)(h, _weights("w", index), side)
    return x, _loss(h)


def test_a_side_input_through_an_op_without_gradient_trains():
    _assert_same_gradients(_gradients(_side_input_model, True), _gradients(_side_input_model, False))


def test_a_variable_behind_an_op_without_gradient_raises_as_in_the_plain_model():
    """Never a silent None: the plain model's LookupError, where its gradient is asked for."""
    for recomputed in (False, True):
        with tf.Graph().as_default():
            _, loss = _side_input_model(recomputed, side_from_variable=True)
            with pytest.raises(LookupError, match="No gradient defined for operation.*ResizeArea"):
                v1.gradients(loss, v1.trainable_variables())


# ------------------------------------------------------------------ refusals say what the op is


def _refused(block):
    with tf.Graph().as_default():
        with pytest.raises(ValueError) as error:
            _model(block, True, blocks=1)
        return str(error.value)


def _assign_then(read):
    def block(h, w):
        counter = v1.get_variable("counter", dtype=tf.float64, initializer=np.float64(0), trainable=False)
        with tf.control_dependencies([v1.assign_add(counter, 1.0)]):
            return read(h) * 2.0
    return block


@pytest.mark.parametrize("through", ["identity", "constant"])
def test_an_assignment_the_output_waits_for_is_refused_by_name(through):
    """The same assignment before ``tf.identity(h) * 2.0`` and before ``h * 2.0`` (the constant waits)."""
    message = _refused(_assign_then(tf.identity if through == "identity" else lambda h: h))
    assert "cannot recompute block 'block'" in message and "AssignAdd" in message
    assert "stateful" in message and ("changes a variable in place" in message or "acts on a resource" in message)


def _random_in_cond(h, w):
    return h + tf.cond(tf.reduce_sum(h) > 0, lambda: tf.random.uniform(tf.shape(h), dtype=tf.float64), lambda: h)


def test_tf2_control_flow_holding_a_random_op_is_refused_as_control_flow(tf_mode):
    if tf_mode == "tf1":
        pytest.skip("TF 1.x behaviour builds v1 control flow, refused as such (test_recompute.py)")
    message = _refused(_random_in_cond)
    assert "is TF 2 control flow" in message and "RandomUniform" in message and "run again" in message


def test_v1_control_flow_is_refused_as_v1_control_flow_not_as_stateful(tf_mode):
    if tf_mode == "tf2":
        pytest.skip("control flow v2 builds If ops (test_tf2_control_flow_in_a_block_is_recomputed)")
    message = _refused(_cond)
    assert "v1 control flow" in message and "stateful" not in message
