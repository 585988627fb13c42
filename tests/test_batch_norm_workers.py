"""Tests for gradaccum.collective.synchronized_batch_norm: batch norm over every worker's batch.

The multi-process tests run ``tests/bn_worker_child.py`` under
``gradaccum.launch`` on loopback (two workers, uneven batches of 5 and 3
examples, float64) and compare every worker's variables with one process
training on the union of the workers' micro-batches: the TF layer and the
plain optimizer for k = 1, ``gradaccum.batch_normalization`` under a plain
``GradientAccumulator`` for k = 2 (window statistics). The same runs without
the scope must not match. The single-process tests check the errors and that
one worker (or ``None``) leaves the layer as it is.
"""
import contextlib
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

import bn_worker_child as child
import gradaccum
from gradaccum import _compat, cluster, launch, tower
import forkserver
from test_distributed import _Job, _assert_gone

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bn_worker_child.py")
_SIZES = [5, 3]
_STEPS = 3
_RUN_TIMEOUT = 100
UPDATE_OPS = tf.compat.v1.GraphKeys.UPDATE_OPS


def _config(workers=2, index=0, ps=0, job="worker"):
    """A task's config; nothing listens on its ports (graph building only)."""
    spec = launch.build_cluster(workers, ps, "127.0.0.1", list(range(4001, 4001 + workers + ps)))
    return cluster.parse_tf_config(launch.tf_config_for(spec, job, index))


# ------------------------------------------------------------ one process


def test_bad_config_or_timeout_is_one_clear_error():
    with pytest.raises(TypeError, match=r"^`config` must be a gradaccum.cluster.ClusterConfig or None, "
                                        r"got 'worker:0'$"):
        cluster.synchronized_batch_norm("worker:0")
    with pytest.raises(ValueError, match=r"^`config` must be a chief or worker task's \(ps and evaluator tasks "
                                         r"take no part in collectives\), got ps:0$"):
        cluster.synchronized_batch_norm(_config(2, 0, ps=1, job="ps"))
    with pytest.raises(ValueError, match=r"`timeout_seconds` must be None or a finite number > 0, got 0"):
        cluster.synchronized_batch_norm(None, timeout_seconds=0)
    assert gradaccum.synchronized_batch_norm is cluster.synchronized_batch_norm
    assert gradaccum.collective.synchronized_batch_norm is cluster.synchronized_batch_norm


def _graph(config, training=True):
    """A training-mode layer and its gradient; returns ``(graph, [(name, op type, device)])``."""
    graph = tf.Graph()
    scope = contextlib.ExitStack() if config == "outside" else cluster.synchronized_batch_norm(config)
    with graph.as_default(), scope:
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        y = gradaccum.batch_normalization(x, training)
        tf.gradients(tf.reduce_sum(y ** 3), [x] + tf.compat.v1.trainable_variables())
    return graph, [(node.name, node.op, node.device) for node in graph.as_graph_def().node]


@pytest.mark.parametrize("config", [None, _config(1)], ids=["none", "one-worker"])
def test_one_worker_is_the_plain_layer_op_for_op(config):
    _, want = _graph("outside")
    _, got = _graph(config)
    assert got == want
    assert not any(op == "CollectiveReduce" for _, op, _ in got)


def test_two_workers_sum_on_the_worker_cpu_forwards_and_backwards_and_not_in_inference():
    graph, nodes = _graph(_config(2, index=1))
    collectives = [node for node in graph.as_graph_def().node if node.op == "CollectiveReduce"]
    assert len(collectives) == 4  # Sums and count, sums of squares; and their gradients.
    for node in collectives:
        assert node.device == "/job:worker/replica:0/task:1/device:CPU:0"
        assert node.attr["group_size"].i == 2
        assert node.attr["group_key"].i == gradaccum.collective.GROUP_KEY
    keys = sorted(node.attr["instance_key"].i for node in collectives)
    assert keys == list(range(keys[0], keys[0] + 4)) and keys[0] > 1 << 24  # Apart from CollectiveAllReduce's.
    _, inference = _graph(_config(2, index=1), training=False)
    assert not any(op == "CollectiveReduce" for _, op, _ in inference)


def test_several_towers_inside_the_scope_are_refused():
    with tf.Graph().as_default(), cluster.synchronized_batch_norm(_config(2)):
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        with pytest.raises(ValueError, match=r"`gradaccum.batch_normalization` cannot synchronize 2 towers "
                                             r"inside `synchronized_batch_norm` \(2 workers\)"):
            tower.minimize(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                           lambda x: tf.reduce_mean(gradaccum.batch_normalization(x, True)), [x],
                           devices=["/cpu:0", "/cpu:1"])


def _tower_group_keys(config):
    """Group keys of the towers' batch-norm collectives, two CPU towers, under ``config``'s engine."""
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        optimizer = tf.compat.v1.train.GradientDescentOptimizer(0.1)
        if config is not None:
            optimizer = gradaccum.GradientAccumulator(cluster.CollectiveAllReduce(optimizer, config), 2)
        tower.minimize(optimizer, lambda x: tf.reduce_mean(gradaccum.batch_normalization(x, True)), [x],
                       devices=["/cpu:0", "/cpu:1"])
    return sorted(set(node.attr["group_key"].i for node in graph.as_graph_def().node
                      if node.op == "CollectiveReduce" and node.attr["group_size"].i == 2
                      and node.attr["group_key"].i != gradaccum.collective.GROUP_KEY))


def test_each_workers_towers_are_a_collective_group_of_their_own():
    """The job's leader resolves every group key: two workers' towers must not share one.

    TF 1.15's leader crashes on such groups: there they are refused, in one line.
    """
    if not _compat.TOWER_GROUPS_BESIDE_WORKERS:
        with pytest.raises(ValueError, match=r"^`gradaccum.batch_normalization` cannot synchronize 2 towers of "
                                             r"each of 2 collective workers on TensorFlow 1\.15\.\d+ \(its "
                                             r"collective leader crashes\): use TensorFlow 2.x, one tower per "
                                             r"worker, or tf.compat.v1.layers.batch_normalization \(call "
                                             r"batch_normalization\)$"):
            _tower_group_keys(_config(2, index=1))
        return
    plain = _tower_group_keys(None)
    assert len(plain) == 1 and plain[0] > 1 << 24
    assert _tower_group_keys(_config(2, index=0)) == plain
    assert _tower_group_keys(_config(2, index=1)) == [plain[0] + (1 << 16)]


# ------------------------------------------------------------ several processes


@tf.autograph.experimental.do_not_convert
def _tf_layer(inputs, training, **kwargs):
    return tf.compat.v1.layers.batch_normalization(inputs, training=training, **kwargs)


def _reference(k, opt, sizes=tuple(_SIZES)):
    """One process on the union of the workers' micro-batches: every variable after training."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float64, [None, child.FEATURES])
        y = tf.compat.v1.placeholder(tf.int32, [None])
        step = tf.compat.v1.train.get_or_create_global_step()
        if k == 1:  # The TF layer and the plain optimizer.
            loss = child.model(x, y, _tf_layer)
            with tf.control_dependencies(tf.compat.v1.get_collection(UPDATE_OPS)):
                train_op = child.OPTIMIZERS[opt]().minimize(loss, global_step=step)
        else:  # Window statistics: our layer under a one-process accumulator.
            loss = child.model(x, y, gradaccum.batch_normalization)
            train_op = gradaccum.GradientAccumulator(child.OPTIMIZERS[opt](), k).minimize(
                loss, global_step=step, weight=tf.shape(x)[0])
        variables = tf.compat.v1.global_variables()
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for window in child.batches(sizes, k, _STEPS):
                for micro in window:
                    sess.run(train_op, {x: np.concatenate([part[0] for part in micro]),
                                        y: np.concatenate([part[1] for part in micro])})
            return dict((v.op.name.replace("/", "__"), value) for v, value in zip(variables, sess.run(variables)))


def _workers(tmp_path, k, opt, sync, towers=1, sizes=tuple(_SIZES)):
    """Runs the two workers (``towers`` CPU towers each); returns each worker's variables."""
    out = str(tmp_path / ("%s_%d" % ("sync" if sync else "local", towers)))
    command = [sys.executable, "-m", "gradaccum.launch", "--workers", "2", "--", *forkserver.command(), _CHILD,
               "--out", out, "--k", str(k), "--opt", opt, "--steps", str(_STEPS), "--towers", str(towers),
               "--sizes", ",".join(map(str, sizes))] + ([] if sync else ["--no-sync"])
    job = _Job(2, None, command=command)
    status = job.wait(_RUN_TIMEOUT)
    _assert_gone(job.pids | {job.process.pid})
    assert status == 0, job.text()[1][-3000:]
    return [dict(np.load("%s_%d.npz" % (out, rank))) for rank in range(2)]


def _compared(reference):
    return sorted(key for key in reference if key in ("dense0", "dense1", "global_step") or key.endswith(
        ("__gamma", "__beta", "__moving_mean", "__moving_variance")))


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("k, opt", [(1, "sgd"), (2, "adam")])
def test_workers_with_uneven_batches_equal_one_process_on_the_union(k, opt, tmp_path):
    """Trainable variables and moving statistics of every worker: those of one process on the union.

    Teeth: without the scope (each worker's own statistics) they are far off.
    """
    reference = _reference(k, opt)
    keys = _compared(reference)
    assert len(keys) == 11 and reference["global_step"] == _STEPS
    synced = _workers(tmp_path, k, opt, sync=True)
    for rank, got in enumerate(synced):
        for key in keys:
            np.testing.assert_allclose(got[key], reference[key], rtol=1e-9, atol=1e-12,
                                       err_msg="worker %d: %s" % (rank, key))
    # Every variable, optimizer slots and window counters included: equal copies. Not the caches:
    # each holds its own worker's last sums, which the next window's first micro-batch overwrites.
    caches = [key for key in synced[0] if key.endswith("__GradientAccumulator")]
    assert len(caches) == (6 if k > 1 else 0) and all(got.get("GradientAccumulator__micro_step", 0) == 0
                                                      for got in synced)
    for key in sorted(set(synced[0]) - set(caches)):
        np.testing.assert_allclose(synced[1][key], synced[0][key], rtol=1e-12, atol=1e-15, err_msg=key)
    local = _workers(tmp_path, k, opt, sync=False)
    for key in ("batch_normalization__moving_mean", "batch_normalization__moving_variance", "dense0"):
        off = np.max(np.abs(local[0][key] - reference[key])) / np.max(np.abs(reference[key]))
        assert off > 1e-2, (key, off)


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("k, opt", [(1, "sgd"), (2, "adam")])
def test_a_worker_with_an_empty_batch_contributes_nothing(k, opt, tmp_path):
    """Worker 1 runs every micro-batch with 0 examples: both workers equal one process on worker 0's data."""
    sizes = (5, 0)
    reference = _reference(k, opt, sizes)
    for rank, got in enumerate(_workers(tmp_path, k, opt, sync=True, sizes=sizes)):
        for key in _compared(reference):
            np.testing.assert_allclose(got[key], reference[key], rtol=1e-9, atol=1e-12,
                                       err_msg="worker %d: %s" % (rank, key))


@pytest.mark.distributed
@pytest.mark.timeout(150)
def test_two_towers_per_worker_equal_one_tower_per_worker(tmp_path):
    """Outside the scope each worker normalises over its own batch, whether on one tower or two.

    Before each worker's towers got a group key of their own, worker 1's
    towers joined worker 0's group at the leader, and both workers failed.
    """
    if not _compat.TOWER_GROUPS_BESIDE_WORKERS:
        pytest.skip("refused on TF 1.15, whose leader crashes (test_each_workers_towers_are_a_collective_group...)")
    one = _workers(tmp_path, 2, "adam", sync=False, towers=1)
    two = _workers(tmp_path, 2, "adam", sync=False, towers=2)
    for rank in range(2):
        assert sorted(two[rank]) == sorted(one[rank])
        for key in one[rank]:
            np.testing.assert_allclose(two[rank][key], one[rank][key], rtol=1e-9, atol=1e-12,
                                       err_msg="worker %d: %s" % (rank, key))
