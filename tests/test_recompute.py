"""``gradaccum.recompute``: a recomputed block trains exactly as the plain block.

Each check builds the same float64 model twice, in fresh graphs from the
same seeds, once plain and once with its blocks wrapped in
``gradaccum.recompute``, and compares the variables and the optimizer's slots
after several updates, in the fused train op (one run per micro-batch) and
in ``subdivisions.minimize`` (the micro-batches in a ``tf.while_loop``).
Under ``--tf-mode=tf1`` the blocks' variables are TF1 reference variables,
under ``--tf-mode=tf2`` resource variables. Without dropout every value is
bit-identical on CPU; with dropout, Grappler rewrites the dropout product of
the two graphs differently (bit-identical with its meta-optimizer off), so
those compare to 1e-12.
"""
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum._compat import is_resource_variable
from test_subdivisions import DENSE_ONLY, OPTIMIZERS, _assert_equal_values, _batches, _placeholders, \
    _subdivided, _values

v1 = tf.compat.v1
K = 4


def _block(h, ids, index, sparse=True, dropout=False, batch_norm=None):
    """A residual block: dense + tanh, a table looked up by ``ids`` (a gather: sparse gradient)."""
    with v1.variable_scope("block_%d" % index):
        w = v1.get_variable("w", dtype=tf.float64,
                            initializer=np.linspace(-0.6, 0.6, 16).reshape(4, 4) * (index + 1) ** 0.5)
        table = v1.get_variable("table", dtype=tf.float64, initializer=np.linspace(-1, 1, 20).reshape(5, 4))
        inner = tf.matmul(h, w)
        if batch_norm == "tf":
            inner = v1.layers.batch_normalization(inner, training=True)
        elif batch_norm == "window":
            inner = gradaccum.batch_normalization(inner, training=True)
        inner = tf.nn.tanh(inner)
        rows = tf.gather(table, ids) if sparse else tf.matmul(tf.one_hot(ids, 5, dtype=tf.float64), table)
        inner = inner * rows
        if dropout:
            inner = tf.nn.dropout(inner, rate=0.25, seed=index + 1)
        return h + inner


def make_model(recomputed, blocks=3, **options):
    """A ``model_fn(x, ids, y)`` of ``blocks`` residual blocks, recomputed or not, and a linear head."""
    def model_fn(x, ids, y):
        block = gradaccum.recompute(_block) if recomputed else _block
        h = x
        for index in range(blocks):
            h = block(h, ids, index, **options)
        head = v1.get_variable("head", dtype=tf.float64, initializer=np.array([[0.3], [-0.2], [0.1], [0.5]]))
        return tf.reduce_mean(tf.square(tf.matmul(h, head)[:, 0] - y))
    return model_fn


def _fused(make_opt, batches, model_fn, k=K):
    """The fused train op: k runs per update, each micro-batch weighted by its size."""
    with tf.Graph().as_default():
        v1.set_random_seed(7)
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(make_opt(), k)
        step = v1.train.get_or_create_global_step()
        train_op = acc.minimize(model_fn(*feeds), global_step=step, weight=tf.shape(feeds[0])[0])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                for part in zip(*[np.array_split(array, k) for array in batch]):
                    sess.run(train_op, dict(zip(feeds, part)))
            return _values(sess, acc)


def _with_seed(model_fn):
    """``model_fn``, setting the graph's seed first (dropout's op seeds then match between graphs)."""
    def seeded(*tensors):
        if not hasattr(seeded, "done"):
            v1.set_random_seed(7)
            seeded.done = True
        return model_fn(*tensors)
    return seeded


def _assert_identical(actual, expected):
    assert sorted(actual) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(actual[name], expected[name], err_msg=name)


# ------------------------------------------------------------------ exactness


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_fused_train_op_is_bit_identical(opt_name):
    sparse = opt_name not in DENSE_ONLY
    batches = _batches(2)
    expected = _fused(OPTIMIZERS[opt_name], batches, make_model(False, blocks=2, sparse=sparse))
    actual = _fused(OPTIMIZERS[opt_name], batches, make_model(True, blocks=2, sparse=sparse))
    _assert_identical(actual, expected)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_one_run_per_update_is_bit_identical(opt_name):
    sparse = opt_name not in DENSE_ONLY
    batches = _batches(2)
    expected = _subdivided(OPTIMIZERS[opt_name], batches, model=make_model(False, blocks=2, sparse=sparse))[0]
    actual = _subdivided(OPTIMIZERS[opt_name], batches, model=make_model(True, blocks=2, sparse=sparse))[0]
    _assert_identical(actual, expected)


@pytest.mark.parametrize("form", ["fused", "subdivisions"])
def test_dropout_draws_the_same_values_in_the_recomputation(form):
    batches = _batches()
    if form == "fused":
        expected = _fused(OPTIMIZERS["adam"], batches, make_model(False, dropout=True))
        actual = _fused(OPTIMIZERS["adam"], batches, make_model(True, dropout=True))
    else:
        expected = _subdivided(OPTIMIZERS["adam"], batches, model=_with_seed(make_model(False, dropout=True)))[0]
        actual = _subdivided(OPTIMIZERS["adam"], batches, model=_with_seed(make_model(True, dropout=True)))[0]
    _assert_equal_values(actual, expected, rtol=1e-12, atol=1e-14)


def test_variables_are_reference_or_resource_as_the_mode_makes_them(tf_mode):
    with tf.Graph().as_default():
        loss = make_model(True)(*_placeholders())
        grads = v1.train.GradientDescentOptimizer(0.1).compute_gradients(loss)
        kinds = {is_resource_variable(var) for _, var in grads}
        assert kinds == {tf_mode == "tf2"}
        sparse = {var.op.name for grad, var in grads if isinstance(grad, tf.IndexedSlices)}
        assert sparse == {"block_%d/table" % i for i in range(3)}  # The gathers' gradients stay sparse.


# ------------------------------------------------------------------ update ops, towers


@pytest.mark.parametrize("batch_norm", ["tf", "window"])
@pytest.mark.parametrize("form", ["fused", "subdivisions"])
def test_batch_norm_updates_run_once_per_micro_batch(batch_norm, form):
    """Moving averages (and window statistics) equal the plain model's: no update op is recomputed."""
    batches = _batches(2)

    def run(recomputed):
        model_fn = make_model(recomputed, blocks=2, batch_norm=batch_norm)
        if form == "fused":
            return _fused(OPTIMIZERS["momentum"], batches, model_fn)
        return _subdivided(OPTIMIZERS["momentum"], batches, model=model_fn)[0]
    expected, actual = run(False), run(True)
    assert any("moving_mean" in name for name in expected)
    # The batch mean's gradient sums its paths in another order: equal to rounding, not bit for bit.
    _assert_equal_values(actual, expected, rtol=1e-12, atol=1e-15)


def _stateful_op_counts(model_fn):
    """The number of stateful ops of each type in the graph of ``model_fn`` with its gradients."""
    with tf.Graph().as_default() as graph:
        loss = model_fn(*_placeholders())
        v1.gradients(loss, v1.trainable_variables())
        counts = {}
        for op in graph.get_operations():
            if op.op_def.is_stateful and op.type not in ("VariableV2", "VarHandleOp", "ReadVariableOp"):
                counts[op.type] = counts.get(op.type, 0) + 1
        return counts


def test_no_update_op_is_copied_into_the_backward_pass():
    assert _stateful_op_counts(make_model(True, batch_norm="tf")) == _stateful_op_counts(
        make_model(False, batch_norm="tf"))


def _towers(recomputed, batches):
    with tf.Graph().as_default() as graph:
        feeds = _placeholders()
        opt = OPTIMIZERS["adam"]()
        step = v1.train.get_or_create_global_step()
        result = gradaccum.tower.minimize(opt, make_model(recomputed), feeds, devices=["/cpu:0", "/cpu:1"],
                                          global_step=step)
        config = v1.ConfigProto(device_count={"CPU": 2})
        with v1.Session(graph=graph, config=config) as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                sess.run(result.train_op, dict(zip(feeds, batch)))
            return _values(sess, opt)


def test_tower_minimize_on_two_devices_is_bit_identical():
    batches = _batches(2)
    _assert_identical(_towers(True, batches), _towers(False, batches))


# ------------------------------------------------------------------ order, not merged


def test_recomputation_waits_for_the_incoming_gradient_and_is_not_merged():
    with tf.Graph().as_default() as graph:
        feeds = _placeholders()
        loss = make_model(True)(*feeds)
        train_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        routers = [op for op in graph.get_operations() if op.type == "IdentityN"]
        assert len(routers) == 3
        # Every tensor the copy reads from the forward pass goes through an identity that waits for the
        # gradient of the block's output: nothing recomputes before it is needed.
        gates = [op for op in graph.get_operations()
                 if op.type == "Identity" and "/recompute/" in op.name and op.control_inputs]
        assert len(gates) >= 3 * 3  # Each block's input, table and kernel.
        for gate in gates:
            assert all("gradients" in control.name for control in gate.control_inputs), gate.name
        options = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
        metadata = v1.RunMetadata()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, dict(zip(feeds, _batches(1)[0])), options=options, run_metadata=metadata)
        ran = [node.node_name for dev in metadata.step_stats.dev_stats for node in dev.node_stats]
        # After Grappler, each block's forward matmul ran twice: in the forward pass and in the copy.
        assert len([name for name in ran if name.endswith("/recompute/MatMul")]) == 3, ran


# ------------------------------------------------------------------ errors


def _refused(block, *args):
    with tf.Graph().as_default():
        x = v1.placeholder(tf.float64, [None, 4])
        with pytest.raises(ValueError) as error:
            gradaccum.recompute(block)(x, *args)
        return str(error.value)


def test_stateful_op_in_the_block_is_refused_by_name():
    def counting(x):
        counter = v1.get_variable("counter", dtype=tf.float64, initializer=np.float64(0), trainable=False)
        with tf.control_dependencies([v1.assign_add(counter, 1.0)]):
            return tf.identity(x)
    message = _refused(counting)
    assert "stateful" in message and "'counting'" in message and "Assign" in message


def test_v1_control_flow_in_the_block_is_refused(tf_mode):
    if tf_mode == "tf2":
        pytest.skip("control flow v2 builds If/While ops, copied as they are")

    def branching(x):
        return tf.cond(tf.reduce_sum(x) > 0, lambda: x * 2.0, lambda: x)
    assert "v1 control flow" in _refused(branching)


def test_nested_blocks_are_refused():
    def outer(x):
        return gradaccum.recompute(tf.nn.tanh)(x) * 2.0
    assert "another recomputed block" in _refused(outer)


def test_a_block_without_tensor_outputs_and_a_non_callable_are_refused():
    assert "must return a tensor" in _refused(lambda x: None)
    with pytest.raises(TypeError, match="`block` must be callable, got"):
        gradaccum.recompute(3)


# ------------------------------------------------------------------ gradients=


def _tf_gradients(loss, variables, grad_loss):
    # tf.compat.v1.gradients: TF 2.x's tf.gradients colocates every gradient op with its forward op,
    # which tower.minimize's device functions contradict for ops that live beside a variable.
    return v1.gradients(loss, variables, grad_ys=grad_loss)


class _Recording(object):
    """A gradient function that records what it is given, then calls tf.compat.v1.gradients."""

    def __init__(self):
        self.calls = []

    def __call__(self, loss, variables, grad_loss):
        self.calls.append((loss, list(variables), grad_loss))
        return _tf_gradients(loss, variables, grad_loss)


def _accumulated(form, batches, model_fn, **accumulator_args):
    """Values after ``batches`` with an accumulator of k = 4 built with ``accumulator_args``, in ``form``."""
    def make_opt():
        return OPTIMIZERS["adam"]()
    if form == "subdivisions":
        return _subdivided(make_opt, batches, model=model_fn, **accumulator_args)
    if form == "towers":
        with tf.Graph().as_default() as graph:
            feeds = _placeholders()
            acc = gradaccum.GradientAccumulator(make_opt(), K, **accumulator_args)
            result = gradaccum.tower.minimize(acc, model_fn, feeds, devices=["/cpu:0", "/cpu:1"],
                                              global_step=v1.train.get_or_create_global_step())
            with v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 2})) as sess:
                sess.run(v1.global_variables_initializer())
                for batch in batches:
                    for part in zip(*[np.array_split(array, K) for array in batch]):
                        sess.run(result.train_op, dict(zip(feeds, part)))
                return (_values(sess, acc),)
    with tf.Graph().as_default():
        feeds = _placeholders()
        acc = gradaccum.GradientAccumulator(make_opt(), K, **accumulator_args)
        train_op = acc.minimize(model_fn(*feeds), global_step=v1.train.get_or_create_global_step(),
                                weight=tf.shape(feeds[0])[0])
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for batch in batches:
                for part in zip(*[np.array_split(array, K) for array in batch]):
                    sess.run(train_op, dict(zip(feeds, part)))
            return (_values(sess, acc),)


@pytest.mark.parametrize("form", ["fused", "subdivisions", "towers"])
def test_gradient_function_replaces_tensorflows_in_every_form(form):
    batches = _batches(2)
    expected = _accumulated(form, batches, make_model(False))[0]
    recording = _Recording()
    actual = _accumulated(form, batches, make_model(True), gradients=recording)[0]
    _assert_identical(actual, expected)
    assert recording.calls, "the function was not called"
    for loss, variables, grad_loss in recording.calls:
        assert len(variables) == 7  # 3 blocks x (kernel, table) and the head
        if grad_loss is not None:  # The micro-batch weight, carried by backprop: the loss's dtype and shape.
            assert grad_loss.dtype == loss.dtype and grad_loss.shape == loss.shape
    if form == "subdivisions":  # The first micro-batch, and the loop's body.
        assert len(recording.calls) == 2 and all(call[2] is not None for call in recording.calls)


def test_gradient_function_reaches_the_loop_under_a_reducer():
    """Inside the loop the reducer's wrapped optimizer differentiates: with the function too."""
    from test_subdivisions import _CountingReducer
    recording = _Recording()
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(_CountingReducer(OPTIMIZERS["sgd"]()), K, gradients=recording)
        gradaccum.subdivisions.minimize(acc, make_model(False), _placeholders())
    assert len(recording.calls) == 2


def test_gradient_function_errors():
    with pytest.raises(TypeError, match="`gradients` must be None or a callable .*got 'tf.gradients'"):
        gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), K, gradients="tf.gradients")
    with tf.Graph().as_default():
        acc = gradaccum.GradientAccumulator(OPTIMIZERS["sgd"](), K, gradients=lambda loss, variables, g: [None])
        with pytest.raises(ValueError, match="`gradients` must return a list of one gradient .* per variable, 7"):
            acc.minimize(make_model(False)(*_placeholders()))
    loss_scaled = [t for t in gradaccum._compat.loss_scale_optimizer_types()][0]
    innermost = loss_scaled.__new__(loss_scaled)  # A loss-scale optimizer whose inner one is out of reach.
    v1.train.Optimizer.__init__(innermost, False, "scaled")
    with pytest.raises(ValueError, match="`gradients` .* would replace the loss scaling of"):
        gradaccum.GradientAccumulator(innermost, K, gradients=_tf_gradients)


@pytest.mark.one_behaviour(reason="examples/recompute.py chooses the tf1 behaviour itself: the same program "
                                  "in both sessions")
def test_the_example_trains_exactly_the_plain_models_updates(tmp_path):
    """``examples/recompute.py --check``: every variable and slot equal to the plain model's, bit for bit."""
    import os
    import subprocess
    import sys

    pytest.importorskip("sklearn")  # The example's data when no Fashion-MNIST is found: sklearn's digits.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")  # TF 2.x's fused float32 kernels: float32 rounding
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "recompute.py"), "--updates", "2",
                           "--batch-size", "32", "--blocks", "2", "--width", "8", "--check", "--one-run"],
                          cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "largest difference of" in done.stdout and done.stdout.split("slots: ")[1].split()[0] == "0", done.stdout
