"""GradientAccumulator in a tf.distribute strategy's replica context, driven in a session.

Each replica accumulates its own micro-batches; the run that ends a window
reduces once through the strategy and applies once. Checked against one
device trained on the global batch (every replica's micro-batches of the
window, uneven sizes), on the variables, the optimizer's slots and
``global_step`` after several updates, float64.
"""
import numpy as np
import pytest
import tensorflow as tf

import gradaccum
import strategy_child
from gradaccum._compat import TF_VERSION

K = 3  # micro-batches per replica per update
UPDATES = 3
DEVICES = ["/cpu:0", "/cpu:1"]
# Examples in each micro-batch, per replica: uneven, so the weights matter.
SIZES = [[4, 2, 3], [1, 4, 2]]
STRATEGIES = {
    "mirrored": lambda: tf.distribute.MirroredStrategy(DEVICES),
    "central_storage": lambda: tf.distribute.experimental.CentralStorageStrategy(DEVICES),
    "one_device": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    "default": lambda: None,
}
OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1),
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.1),
}
_LOSS_SCALED = getattr(getattr(tf.compat.v1, "mixed_precision", None), "MixedPrecisionLossScaleOptimizer", None) or \
    tf.compat.v1.train.experimental.MixedPrecisionLossScaleOptimizer
# Not in the strategy grid: one test of its own.
EXTRA_OPTIMIZERS = {
    "loss_scaled_sgd": lambda: _LOSS_SCALED(tf.compat.v1.train.GradientDescentOptimizer(0.1), "dynamic"),
}


def _config():
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    # Keeps the reduction's AddN ops under their own names in a trace.
    config.graph_options.rewrite_options.arithmetic_optimization = 2  # RewriterConfig.OFF
    return config


def _data(nan_window=None):
    """Per update, the micro-batches in replica order: ``[(x, y), ...]`` (2 replicas x K)."""
    rng = np.random.RandomState(7)
    updates = []
    for update in range(UPDATES):
        batches = []
        for replica in range(2):
            for i in range(K):
                n = SIZES[replica][i]
                x, y = rng.randn(n, 3), rng.randn(n, 1)
                if update == nan_window and replica == 1 and i == 0:
                    x[0, 0] = np.nan
                batches.append((x, y))
        updates.append(batches)
    return updates


def _model(x, y, sparse=False):
    """Mean squared error of a dense layer, in the inputs' dtype; ``sparse``: plus a looked-up bias."""
    dtype = x.dtype.base_dtype
    w = tf.compat.v1.get_variable("w", dtype=dtype, initializer=tf.constant(
        np.array([[0.3], [-0.2], [0.5]]), dtype))
    b = tf.compat.v1.get_variable("b", dtype=dtype, initializer=tf.constant(np.array([0.1]), dtype))
    prediction, variables = tf.matmul(x, w) + b, [w, b]
    if sparse:  # An IndexedSlices gradient: the rows the micro-batch's ids pick, some of 5 rows never.
        table = tf.compat.v1.get_variable("table", dtype=dtype, initializer=tf.constant(np.zeros([5, 1]), dtype))
        ids = tf.math.floormod(tf.cast(tf.floor(tf.abs(x[:, 0]) * 2.0), tf.int32), 4)
        prediction, variables = prediction + tf.gather(table, ids), variables + [table]
    return variables, tf.reduce_mean(tf.square(prediction - y))


def _fetch_state(sess, opt, variables, step):
    """The variables, every slot of each, and the step, as numpy values."""
    slots = [opt.get_slot(v, name) for v in variables for name in sorted(opt.get_slot_names())]
    return sess.run(list(variables) + slots + [step])


def _one_device(optimizer, data, clip_norm=None, skip=(), dtype=tf.float64, sparse=False):
    """The reference: one device, each update on the global batch (every replica's micro-batches)."""
    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(dtype, [None, 3])
        y = tf.compat.v1.placeholder(dtype, [None, 1])
        variables, loss = _model(x, y, sparse)
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = dict(OPTIMIZERS, **EXTRA_OPTIMIZERS)[optimizer]()
        grads_and_vars = opt.compute_gradients(loss)
        if clip_norm is not None:
            grads, _ = tf.clip_by_global_norm([g for g, _ in grads_and_vars], clip_norm)
            grads_and_vars = list(zip(grads, variables))
        train = opt.apply_gradients(grads_and_vars, global_step=step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for update, batches in enumerate(data):
                if update in skip:
                    continue
                sess.run(train, {x: np.concatenate([b[0] for b in batches]),
                                 y: np.concatenate([b[1] for b in batches])})
            return _fetch_state(sess, opt, variables, step)


def train_op(form, opt, step, loss_of, x, y):
    """A replica's train op: ``opt`` in ``form``, on ``loss_of(x, y)``, weighted by the examples.

    ``form``: ``minimize``, ``apply_gradients`` (``compute_gradients`` then
    ``apply_gradients``) or ``subdivisions`` (one run per update: the
    replica's whole window in ``x``, ``y``, split in the graph). A plain
    optimizer (no accumulator) minimizes, unweighted.
    """
    if form == "subdivisions":
        return gradaccum.subdivisions.minimize(opt, loss_of, [x, y], global_step=step).train_op
    loss = loss_of(x, y)
    if not isinstance(opt, gradaccum.GradientAccumulator):
        return opt.minimize(loss, global_step=step)
    weight = tf.shape(x)[0]
    if form == "apply_gradients":
        return opt.apply_gradients(opt.compute_gradients(loss), global_step=step, weight=weight)
    return opt.minimize(loss, global_step=step, weight=weight)


class _Job(object):
    """A graph with the accumulator built in each replica through ``strategy.run``, and its session."""

    def __init__(self, strategy_name, optimizer, k=None, plain=False, form="minimize", runner="run",
                 dtype=tf.float64, wrap=None, sparse=False, **kwargs):
        self.form, self.runner, self.sparse = form, runner, sparse
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.strategy = STRATEGIES[strategy_name]()
            scope = self.strategy.scope() if self.strategy is not None else tf.distribute.get_strategy().scope()
            self.replicas = self.strategy.num_replicas_in_sync if self.strategy is not None else 1
            self.x = [tf.compat.v1.placeholder(dtype, [None, 3]) for _ in range(self.replicas)]
            self.y = [tf.compat.v1.placeholder(dtype, [None, 1]) for _ in range(self.replicas)]
            with scope:
                self.step = tf.compat.v1.train.get_or_create_global_step()
                inner = dict(OPTIMIZERS, **EXTRA_OPTIMIZERS)[optimizer]()
                k = K * 2 // self.replicas if k is None else k
                self.opt = inner if plain else gradaccum.GradientAccumulator(inner, k, **kwargs)
                self.opt = wrap(inner) if wrap is not None else self.opt
                self.train = self._build()
            self.sess = tf.compat.v1.Session(config=_config())
            self.sess.run(tf.compat.v1.global_variables_initializer())

    def _build(self):
        built = {}

        def replica_step():
            if self.replicas == 1:
                x, y = self.x[0], self.y[0]
            else:
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                x = tf.switch_case(replica, [lambda i=i: self.x[i] for i in range(self.replicas)])
                y = tf.switch_case(replica, [lambda i=i: self.y[i] for i in range(self.replicas)])
            return self._form(x, y, built)

        if self.strategy is None:
            train = replica_step()
        elif self.runner == "call_for_each_replica":
            train = self.strategy.group(self.strategy.extended.call_for_each_replica(replica_step))
        else:
            run = getattr(self.strategy, "run", None) or self.strategy.experimental_run_v2
            train = self.strategy.group(run(replica_step))
        self.variables = built["variables"]
        return train

    def _form(self, x, y, built):
        # The strategy sums the replicas' gradients: each replica's loss carries 1/R.
        def loss_of(x, y):
            variables, loss = _model(x, y, self.sparse)
            built["variables"] = variables
            return loss / float(self.replicas)

        return train_op(self.form, self.opt, self.step, loss_of, x, y)

    def feeds(self, batches):
        """One feed per run: replica r gets its i-th micro-batch on run i (one replica: all in turn).

        The one-run form gets each replica's micro-batches together, in one run.
        """
        if self.form == "subdivisions":
            whole = [batches[:K], batches[K:]] if self.replicas == 2 else [batches]
            return [{placeholder: np.concatenate([b[part] for b in mine])
                     for mine, xs in zip(whole, zip(self.x, self.y)) for part, placeholder in enumerate(xs)}]
        if self.replicas == 1:
            return [{self.x[0]: x, self.y[0]: y} for x, y in batches]
        return [{self.x[0]: batches[i][0], self.y[0]: batches[i][1],
                 self.x[1]: batches[K + i][0], self.y[1]: batches[K + i][1]} for i in range(K)]

    def train_on(self, data, **run_kwargs):
        for batches in data:
            for feed in self.feeds(batches):
                self.sess.run(self.train, feed, **run_kwargs)

    def state(self):
        return _fetch_state(self.sess, self.opt, self.variables, self.step)


def _assert_close(got, want, rtol=1e-9):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * 1e-3)


# A refusal happens as the train op is built, before a variable or a condition of the behaviour's kind
# matters; the accepted path is the Mirrored grid's, which runs in the tf2 session.
_REFUSAL = pytest.mark.one_behaviour(reason="a refusal by name at build time; the Mirrored grid "
                                            "(test_accumulated_under_a_strategy_...) builds the accepted path")


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_accumulated_under_a_strategy_equals_one_device_on_the_global_batch(strategy, optimizer):
    data = _data()
    job = _Job(strategy, optimizer)
    job.train_on(data)
    got = job.state()
    _assert_close(got, _one_device(optimizer, data))
    assert got[-1] == UPDATES
    if job.strategy is not None and job.replicas > 1:  # Every replica's copy moved alike.
        for var in job.variables:
            copies = job.sess.run(list(job.strategy.experimental_local_results(var)))
            for copy in copies[1:]:
                np.testing.assert_array_equal(copy, copies[0])


@pytest.mark.parametrize("form, runner", [("apply_gradients", "run"), ("minimize", "call_for_each_replica"),
                                          ("subdivisions", "run")])
def test_every_entry_point_under_a_strategy_equals_one_device(form, runner):
    data = _data()
    job = _Job("mirrored", "adam", form=form, runner=runner, k=K if form == "subdivisions" else None)
    job.train_on(data)
    _assert_close(job.state(), _one_device("adam", data))


@pytest.mark.parametrize("nan_window", [None, 1])
def test_a_wrapped_loss_scale_optimizer_under_a_strategy_equals_one_device(nan_window):
    data = _data(nan_window)  # float32: TF's loss scale is float32.
    job = _Job("mirrored", "loss_scaled_sgd", dtype=tf.float32)
    job.train_on(data)
    # A non-finite window: the loss-scale optimizer skips it (and lowers its scale), as on one device.
    _assert_close(job.state(), _one_device("loss_scaled_sgd", data, dtype=tf.float32), rtol=1e-6)
    assert job.sess.run([w.skipped_windows for w in job.opt.windows]) == [0 if nan_window is None else 1] * 2
    with job.graph.as_default():  # TF's loss scale object (private, as gradaccum._compat reads it).
        scale = job.sess.run(job.opt.optimizer._loss_scale())
    assert scale == (2.0 ** 15 if nan_window is None else 2.0 ** 14)  # Halved once, for the one skipped window.


def test_a_window_checkpoint_restores_mid_window_under_the_strategy_and_at_its_end_without(tmp_path):
    data = _data()
    whole = _Job("mirrored", "adam")
    whole.train_on(data)
    # Stopped after the first micro-batch of the second window, saved, resumed in a new graph.
    first = _Job("mirrored", "adam")
    first.train_on(data[:1])
    with first.graph.as_default():
        saver = tf.compat.v1.train.Saver()
        end_of_window = saver.save(first.sess, str(tmp_path / "end"))
        first.sess.run(first.train, first.feeds(data[1])[0])
        mid_window = saver.save(first.sess, str(tmp_path / "mid"))
    resumed = _Job("mirrored", "adam")
    with resumed.graph.as_default():
        tf.compat.v1.train.Saver().restore(resumed.sess, mid_window)
    for feed in resumed.feeds(data[1])[1:]:
        resumed.sess.run(resumed.train, feed)
    resumed.train_on(data[2:])
    _assert_close(resumed.state(), whole.state())
    # At a window's end, the model and Adam's state restore into one device without the strategy.
    alone = _Job("default", "adam")
    with alone.graph.as_default():
        tf.compat.v1.train.Saver(gradaccum.plain_variables(alone.opt)).restore(alone.sess, end_of_window)
    _assert_close(alone.state(), _one_device("adam", data[:1]))


@pytest.mark.parametrize("clip_norm", [None, 0.05])
def test_sparse_gradients_under_a_strategy_equal_one_device(clip_norm):
    data = _data()
    job = _Job("mirrored", "adam", sparse=True, clip_norm=clip_norm)
    assert [t is not None for t in job.opt.windows[0].touched] == [False, False, True]  # The table's is sparse.
    job.train_on(data)
    want = _one_device("adam", data, clip_norm=clip_norm, sparse=True)
    _assert_close(job.state(), want)
    table = job.state()[2]
    assert table[4, 0] == 0.0 and np.all(table[:4, 0] != 0.0)  # Row 4 never looked up: never touched.


def test_nothing_moves_before_the_window_ends():
    data = _data()
    job = _Job("mirrored", "adam")
    before = job.state()
    feeds = job.feeds(data[0])
    assert [w.replica for w in job.opt.windows] == [0, 1]
    for i, feed in enumerate(feeds[:-1]):
        job.sess.run(job.train, feed)
        _assert_close(job.state(), before)
        # The accessors read the first replica's window; every replica's counts alike.
        assert job.sess.run([job.opt.micro_step, job.opt.window_ended]) == [i + 1, False]
        assert job.sess.run([w.micro_step for w in job.opt.windows]) == [i + 1, i + 1]
    job.sess.run(job.train, feeds[-1])
    assert job.state()[-1] == 1
    assert job.sess.run([job.opt.micro_step, job.opt.window_size, job.opt.window_ended]) == [0, K, True]


@pytest.mark.one_behaviour(reason="test_sparse_gradients_under_a_strategy_equal_one_device[0.05] clips the "
                                  "global average under Mirrored in the tf2 session, against one device")
def test_clip_norm_clips_the_global_average():
    data = _data()
    job = _Job("mirrored", "sgd", clip_norm=0.05)
    job.train_on(data)
    _assert_close(job.state(), _one_device("sgd", data, clip_norm=0.05))
    # Not the unclipped update: the clip was active.
    assert not np.allclose(job.state()[0], _one_device("sgd", data)[0])


def test_skip_nonfinite_skips_the_same_window_on_every_replica():
    data = _data(nan_window=1)  # Replica 1's first micro-batch of the second window holds a NaN.
    job = _Job("mirrored", "adam", skip_nonfinite=True)
    job.train_on(data)
    _assert_close(job.state(), _one_device("adam", data, skip=(1,))[:-1] + [UPDATES - 1])
    skipped = [w.skipped_windows for w in job.opt.windows]
    assert len(skipped) == 2 and job.sess.run(skipped) == [1, 1]


def test_a_schedule_k_is_read_per_window_under_a_strategy():
    data = _data()
    job = _Job("mirrored", "sgd", k=lambda global_step: tf.constant(K, tf.int64) + 0 * global_step)
    job.train_on(data)
    _assert_close(job.state(), _one_device("sgd", data))


def _executed(run_metadata, kind):
    return [node.node_name for device in run_metadata.step_stats.dev_stats for node in device.node_stats
            if node.timeline_label.split(" = ")[-1].startswith(kind)]


def _reductions(job, data):
    """Per run of one update, the reduction ops (``AddN`` outside backprop) that executed."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    counts = []
    for feed in job.feeds(data[0]):
        metadata = tf.compat.v1.RunMetadata()
        job.sess.run(job.train, feed, options=options, run_metadata=metadata)
        counts.append(len([name for name in _executed(metadata, "AddN") if "gradients" not in name]))
    return counts


def test_a_trace_shows_one_reduction_per_update():
    data = _data()
    plain = _reductions(_Job("mirrored", "sgd", k=1, plain=True), data)
    ours = _reductions(_Job("mirrored", "sgd"), data)
    variables = 2
    assert plain == [variables] * K  # The plain strategy reduces every gradient on every run.
    # Ours: nothing until the window's last run, then every sum once, with the weight.
    assert ours == [0] * (K - 1) + [variables + 1]


@_REFUSAL
@pytest.mark.parametrize("kwargs", [{"statistics": True}, {"observers": [gradaccum.WindowObserver()]}])
def test_what_a_strategy_cannot_combine_is_refused_by_name(kwargs):
    with pytest.raises(ValueError, match="cannot combine statistics, an adaptive policy or observers with a "
                                         "tf.distribute strategy \\(MirroredStrategy\\)"):
        _Job("mirrored", "sgd", **kwargs)


@_REFUSAL
def test_a_reducer_under_a_strategy_is_refused_by_name():
    class Summing(gradaccum.Reducer):
        pass

    with pytest.raises(ValueError, match="cannot combine a Reducer \\(Summing\\) with a tf.distribute strategy"):
        _Job("mirrored", "sgd", plain=True, k=1, wrap=lambda inner: gradaccum.GradientAccumulator(
            Summing(inner, "summing"), 2))


@_REFUSAL
def test_the_manual_apply_op_is_refused_under_a_strategy():
    job = _Job("mirrored", "sgd")
    with pytest.raises(ValueError, match="no manual apply_op under a tf.distribute strategy"):
        job.opt.windows[0].apply_op  # noqa: B018 (the property builds it)


@_REFUSAL
@pytest.mark.parametrize("extended,why", [
    ("TPUExtended", "its train step is compiled for the TPU, where the window.s variables and conditions do not run"),
    ("SomeNewExtended", "gradaccum does not know whether its replicas apply one reduced update in step"),
])
def test_a_strategy_not_known_to_apply_in_step_is_refused_by_name(extended, why):
    """The rule for a strategy the library has not seen: refused, by its name. No TPU here: a stand-in class."""
    class Strategy(tf.distribute.MirroredStrategy):
        pass

    with tf.Graph().as_default():
        strategy = Strategy(DEVICES)
        Strategy.__name__ = extended.replace("Extended", "Strategy")
        strategy.extended.__class__ = type(extended, (type(strategy.extended),), {})
        with strategy.scope():
            w = tf.compat.v1.get_variable("w", [2], dtype=tf.float32)
            opt = gradaccum.GradientAccumulator(tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)
            run = getattr(strategy, "run", None) or strategy.experimental_run_v2
            with pytest.raises(ValueError, match="cannot accumulate under %s: %s; use MirroredStrategy" % (
                    Strategy.__name__, why)):
                run(lambda: opt.minimize(tf.reduce_sum(w * w)))


@_REFUSAL
def test_a_parameter_server_strategy_is_refused_by_name():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec({"worker": ["localhost:1"], "ps": ["localhost:2"]}), task_type="worker", task_id=0,
        num_accelerators={"GPU": 0})
    kind = getattr(tf.compat.v1.distribute.experimental, "ParameterServerStrategy")
    with tf.Graph().as_default():
        strategy = kind(resolver)
        with strategy.scope():
            w = tf.compat.v1.get_variable("w", [2], dtype=tf.float32)
            opt = gradaccum.GradientAccumulator(tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)
            run = getattr(strategy, "run", None) or strategy.experimental_run_v2
            with pytest.raises(ValueError, match="cannot accumulate under ParameterServerStrategy.*asynchronously"):
                run(lambda: opt.minimize(tf.reduce_sum(w * w)))


# Under MultiWorkerMirroredStrategy: the entry points beyond minimize in strategy.run share its strategy
# code, and the Mirrored grid runs every form in the tf2 session.
_ALSO_TF1 = pytest.mark.one_behaviour(reason="minimize in strategy.run covers this strategy's code path")


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("form,runner,optimizer", [
    ("minimize", "run", "adam"),
    pytest.param("apply_gradients", "run", "sgd", marks=_ALSO_TF1),
    pytest.param("minimize", "call_for_each_replica", "sgd", marks=_ALSO_TF1),
    pytest.param("subdivisions", "run", "adam", marks=_ALSO_TF1),
])
def test_multi_worker_mirrored_workers_match_one_device_and_reduce_once_per_update(form, runner, optimizer,
                                                                                    tmp_path):
    """Two processes on loopback, one replica each (strategy_child.py), against one device on the union."""
    out = str(tmp_path / "mwms")
    strategy_child.run_workers(["--out", out, "--form", form, "--runner", runner, "--optimizer", optimizer])
    want = _one_device(optimizer, _data())
    for worker in range(2):
        got = np.load("%s-worker%d.npz" % (out, worker))
        _assert_close([got["state_%d" % i] for i in range(len(want))], want)
        # The second update's runs: nothing crosses processes until the window's last run, then one all-reduce.
        assert list(got["trace"]) == ([1] if form == "subdivisions" else [0] * (K - 1) + [1])


@_REFUSAL
def test_window_batch_norm_under_a_strategy_is_refused_by_name():
    with tf.Graph().as_default():
        strategy = STRATEGIES["mirrored"]()
        x = tf.compat.v1.placeholder(tf.float32, [None, 3])
        with strategy.scope():
            opt = gradaccum.GradientAccumulator(tf.compat.v1.train.GradientDescentOptimizer(0.1), 2)

            def replica_step():
                h = gradaccum.batch_normalization(x, True)
                w = tf.compat.v1.get_variable("w", [3, 1])
                return opt.minimize(tf.reduce_mean(tf.matmul(h, w)))

            run = getattr(strategy, "run", None) or strategy.experimental_run_v2
            # TF 1.15 refuses first: the layer's moving statistics are mirrored variables without aggregation.
            refused = ("cannot combine window batch norm with a tf.distribute strategy \\(MirroredStrategy\\)"
                       if TF_VERSION >= (2, 0)
                       else "You must specify an aggregation method to update a MirroredVariable")
            with pytest.raises(ValueError, match=refused):
                run(replica_step)
