"""Tests of gradaccum.collective (between-graph all-reduce) and cluster.Heartbeat.

The single-process tests build graphs (and run the P = 1 case); the
``distributed`` ones run examples/parabola_sync.py ``--engine collective``
under the launcher on loopback and compare with the single-process full-batch
run (the ``parabola_reference`` fixture): every worker reads its own uneven
share of the 50 points and starts from its own random weights
(``--worker-seeds``), so equality also shows that ``broadcast_variables``
gave every worker worker 0's values.
"""
import json
import re
import socket
import subprocess
import time

import numpy as np
import pytest

import gradaccum
from gradaccum import cluster, launch
from gradaccum._compat import tf
import forkserver
from test_distributed import _EXAMPLE, _WEIGHTS, _Job, _assert_matches, _env, _launch, _stop_and_wait

pytestmark = pytest.mark.timeout(180)

_STEPS = 12
_HEARTBEAT = 3.0


def _config(workers=2, index=0, chief=False, ps=0):
    spec = {"worker": ["127.0.0.1:%d" % (4000 + i) for i in range(workers)]}
    if chief:
        spec["chief"] = ["127.0.0.1:3999"]
    if ps:
        spec["ps"] = ["127.0.0.1:%d" % (5000 + i) for i in range(ps)]
    task = {"type": "ps", "index": 0} if index == "ps" else {"type": "worker", "index": index}
    return cluster.parse_tf_config(json.dumps({"cluster": spec, "task": task}))


def test_names_are_importable_where_users_look():
    assert cluster.CollectiveAllReduce is gradaccum.CollectiveAllReduce is gradaccum.collective.CollectiveAllReduce
    assert cluster.broadcast_variables is gradaccum.collective.broadcast_variables
    assert cluster.collective_session_config is gradaccum.collective.collective_session_config
    assert cluster.AllReduceOnApply is gradaccum.AllReduceOnApply
    assert cluster.worker_devices is gradaccum.ingraph.worker_devices
    assert cluster.Heartbeat is gradaccum.Heartbeat


def test_collective_session_config_names_the_leader_and_only_this_task():
    base = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    proto = cluster.collective_session_config(_config(3, 2), base)
    assert proto.experimental.collective_group_leader == "/job:worker/replica:0/task:0"
    assert list(proto.device_filters) == ["/job:worker/task:2"] and proto.device_count["CPU"] == 2
    assert list(base.device_filters) == [] and not base.experimental.collective_group_leader
    with_chief = cluster.collective_session_config(_config(2, 1, chief=True))
    assert with_chief.experimental.collective_group_leader == "/job:chief/replica:0/task:0"
    with pytest.raises(ValueError, match=r"`config` must be a chief or worker task's .*, got ps:0"):
        cluster.collective_session_config(_config(2, "ps", ps=1))
    with pytest.raises(TypeError, match=r"^`config` must be a gradaccum.cluster.ClusterConfig of a chief or "
                                        r"worker task, got None$"):
        cluster.collective_session_config(None)


def test_bad_arguments_are_one_clear_line():
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(TypeError, match=r"`config` must be a gradaccum.cluster.ClusterConfig or None, got 'x'"):
        cluster.CollectiveAllReduce(sgd, "x")
    with pytest.raises(TypeError, match=r"`optimizer` must be a tf.compat.v1.train.Optimizer, got str"):
        cluster.CollectiveAllReduce("sgd", None)
    with pytest.raises(ValueError, match=r"`timeout_seconds` must be None or a finite number > 0, got 0"):
        cluster.CollectiveAllReduce(sgd, None, timeout_seconds=0)
    with pytest.raises(ValueError, match=r"`buffer_bytes` must be an int >= 1, got 0"):
        cluster.CollectiveAllReduce(sgd, None, buffer_bytes=0)
    with tf.Graph().as_default():
        flag = tf.compat.v1.get_variable("flag", initializer=True)
        with pytest.raises(ValueError, match=r"`variables` must have dtypes .*, got 'flag' of bool"):
            cluster.broadcast_variables(_config(2), [flag])


def _sparse_problem():
    """Weights (dense) and an embedding (sparse gradient); returns (placeholders, loss, variables)."""
    ids = tf.compat.v1.placeholder(tf.int32, [None])
    x = tf.compat.v1.placeholder(tf.float32, [None, 2])
    w = tf.compat.v1.get_variable("w", initializer=[[0.5], [-1.0]])
    emb = tf.compat.v1.get_variable("emb", initializer=np.arange(10, dtype=np.float32).reshape(5, 2) / 10.0)
    pred = tf.matmul(x * tf.gather(emb, ids), w)
    return (ids, x), tf.reduce_mean(tf.square(pred - 1.0)), [w, emb]


def _train(make_optimizer, batches, k):
    """Trains on ``batches`` (one feed per run); returns the final variable values."""
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(0)
        (ids, x), loss, variables = _sparse_problem()
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = make_optimizer()
        if k > 1 or isinstance(opt, gradaccum.GradientAccumulator):
            train = opt.minimize(loss, step, weight=tf.shape(x)[0])
        elif isinstance(opt, cluster.CollectiveAllReduce):
            train = opt.apply_gradients(opt.compute_gradients(loss), step, weight=tf.shape(x)[0])
        else:
            train = opt.minimize(loss, step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for feed_ids, feed_x in batches:
                sess.run(train, {ids: feed_ids, x: feed_x})
            return sess.run(variables + [step])


def test_one_process_is_the_wrapped_optimizer_exactly_dense_and_sparse():
    rng = np.random.RandomState(0)
    data = [(rng.randint(0, 5, size=n), rng.normal(size=(n, 2)).astype(np.float32)) for n in (3, 5, 2, 4, 4, 6)]
    full = [(np.concatenate([d[0] for d in data[i:i + 3]]), np.concatenate([d[1] for d in data[i:i + 3]]))
            for i in (0, 3)]
    adam = lambda: tf.compat.v1.train.AdamOptimizer(0.1)  # noqa: E731  Sparse updates touch only fed rows.
    want = _train(adam, full, 1)
    alone = _train(lambda: cluster.CollectiveAllReduce(adam(), None), full, 1)
    windowed = _train(lambda: gradaccum.GradientAccumulator(cluster.CollectiveAllReduce(adam(), None), 3), data, 3)
    for got in (alone, windowed):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


class _PeerWithWeight(cluster.CollectiveAllReduce):
    """One process whose "other worker" adds weight 1 and zero sums: an empty window here still applies."""

    def reduce(self, sums_and_vars, total, extras):
        return list(sums_and_vars), total + 1.0, list(extras)


def test_an_empty_window_contributes_zeros_not_the_last_windows_sums():
    """No pass zeroes the caches; the manual ``apply_op`` of an empty window must still send zeros."""
    with tf.Graph().as_default():
        c = tf.compat.v1.placeholder(tf.float64, [2])
        w = tf.compat.v1.get_variable("w", initializer=np.array([1.0, 2.0]))
        opt = gradaccum.GradientAccumulator(
            _PeerWithWeight(tf.compat.v1.train.GradientDescentOptimizer(1.0), None), 2)
        train_op = opt.minimize(tf.reduce_sum(c * w))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for value in ([3.0, 4.0], [5.0, 6.0]):  # a window: sums (8, 10), weight 2 + 1
                sess.run(train_op, {c: value})
            after_window = sess.run(w)
            np.testing.assert_allclose(after_window, [1.0 - 8.0 / 3, 2.0 - 10.0 / 3])
            assert np.any(sess.run(opt.accumulators[0])) and sess.run(opt.micro_step) == 0
            sess.run(opt.apply_op)  # empty here: the peer's weight 1 over zero sums, a zero update
            np.testing.assert_array_equal(sess.run(w), after_window)


def test_one_buffer_per_dtype_split_above_buffer_bytes_and_sparse_densified():
    with tf.Graph().as_default():
        _, loss, (w, emb) = _sparse_problem()
        extra = tf.compat.v1.get_variable("extra", initializer=np.ones([300], np.float64))
        loss += tf.cast(tf.reduce_sum(extra * extra), tf.float32)
        opt = cluster.CollectiveAllReduce(tf.compat.v1.train.GradientDescentOptimizer(0.1), _config(2),
                                          buffer_bytes=1024)
        grads = opt.compute_gradients(loss)
        assert isinstance(dict((v, g) for g, v in grads)[emb], tf.IndexedSlices)
        reduced, total = opt.reduce_window(grads, tf.constant(3.0))
        reduces = [op for op in tf.compat.v1.get_default_graph().get_operations() if op.type == "CollectiveReduce"]
    # float32: w (2) + emb densified (10) + its 5 row flags + the weight = 18 values, one message;
    # float64: 300 values = 2400 bytes, split into 3 messages of <= 1024 bytes. Plus the first-run sync.
    assert opt.all_reduces_per_update == 4 and len(reduces) == 5
    assert opt.bytes_per_update == 18 * 4 + 300 * 8
    assert sorted(op.get_attr("instance_key") for op in reduces) == list(range(reduces[0].get_attr("instance_key"),
                                                                               reduces[0].get_attr("instance_key") + 5))
    emb_sum = dict((v, g) for g, v in reduced)[emb]
    assert isinstance(emb_sum, tf.IndexedSlices) and total.shape.ndims == 0
    assert all(op.device.endswith("/job:worker/replica:0/task:0/device:CPU:0") for op in reduces)


@pytest.mark.parametrize("k", [1, 2])
def test_all_reduce_on_apply_refuses_skip_nonfinite_in_one_line(k):
    """A skipped window is decided per rank behind AllReduceOnApply: one rank skipping would hang the others.

    ``tf.identity`` stands in for Horovod's all-reduce, as in test_cluster.py: no Horovod needed."""
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=[1.0, 2.0])
        loss = tf.reduce_sum(w * w)
        opt = gradaccum.GradientAccumulator(
            cluster.AllReduceOnApply(tf.compat.v1.train.GradientDescentOptimizer(0.1), tf.identity), k,
            skip_nonfinite=True)
        with pytest.raises(ValueError) as refused:
            opt.minimize(loss)
        message = str(refused.value)
        assert "\n" not in message
        assert re.match(r"`skip_nonfinite=True` cannot be combined with AllReduceOnApply: a skipped window is "
                        r"decided per rank, so ranks can disagree and the others wait in the all-reduce for "
                        r"ever; leave skip_nonfinite off and wrap a loss-scale optimizer inside AllReduceOnApply "
                        r".* or use CollectiveAllReduce", message), message
        # Without it, and CollectiveAllReduce with it, build as before.
        gradaccum.GradientAccumulator(
            cluster.AllReduceOnApply(tf.compat.v1.train.GradientDescentOptimizer(0.1), tf.identity), k,
            name="plain").minimize(loss)
        gradaccum.GradientAccumulator(
            cluster.CollectiveAllReduce(tf.compat.v1.train.GradientDescentOptimizer(0.1), None), k,
            skip_nonfinite=True, name="collective").minimize(loss)


def _ancestors(op):
    seen, todo = set(), [op]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend([t.op for t in node.inputs] + list(node.control_inputs))
    return seen


@pytest.mark.parametrize("k", [1, 2])
def test_first_run_flag_is_set_only_after_the_sync_all_reduce(k):
    """The flag's own initializer must not run with the train op: it raced with IsVariableInitialized,
    and a worker that saw the flag set skipped the sync its peers were waiting in. A second graph
    gets a flag of another name: a server keeps variables by name across sessions."""
    names = []
    for _ in range(2):
        with tf.Graph().as_default() as graph:
            _, loss, _ = _sparse_problem()
            opt = gradaccum.GradientAccumulator(
                cluster.CollectiveAllReduce(tf.compat.v1.train.GradientDescentOptimizer(0.1), _config(2)), k)
            ancestors = _ancestors(opt.minimize(loss))
            flag = [op for op in graph.get_operations() if re.search(r"_first_run/synced_\d+$", op.name)]
            assert len(flag) == 1
            names.append(flag[0].name)
            assert graph.get_operation_by_name(flag[0].name + "/Assign") not in ancestors  # Its initializer.
            sets = [op for op in ancestors if op.type in ("Assign", "AssignVariableOp")
                    and op.name.startswith(flag[0].name.rsplit("/", 1)[0] + "/sync_once/")]
            assert len(sets) == 1
            sync = [op for op in _ancestors(sets[0]) if op.type == "CollectiveReduce"]
            assert len(sync) == 1 and names[-1].endswith("_%d" % sync[0].get_attr("instance_key"))
    assert names[0] != names[1]


def _heartbeat_config():
    ports = launch.pick_free_ports(2)
    spec = {"worker": ["127.0.0.1:%d" % p for p in ports]}
    return spec, cluster.parse_tf_config(launch.tf_config_for(spec, "worker", 0))


def test_heartbeat_names_a_peer_that_never_answers_and_is_quiet_with_a_live_one():
    spec, config = _heartbeat_config()
    server = cluster.start_server(config)
    failures = []
    with socket.socket() as mute:  # Accepts connections, never speaks gRPC: like a stopped process.
        mute.bind(("127.0.0.1", int(spec["worker"][1].rsplit(":", 1)[1])))
        mute.listen(8)
        beat = cluster.Heartbeat(server, config, timeout_seconds=1.0, startup_timeout_seconds=1.5,
                                 on_failure=failures.append).start()
        deadline = time.time() + 20
        while not failures and time.time() < deadline:
            time.sleep(0.1)
        beat.stop(wait_seconds=0.1)
    assert failures == ["worker:0: worker:1 at %s did not answer within the startup timeout of 1.5 s; stopping"
                        % spec["worker"][1]]
    assert beat.failure == failures[0]


def test_heartbeat_stays_quiet_while_the_peer_answers():
    spec, config = _heartbeat_config()
    server = cluster.start_server(config)
    cluster.start_server(cluster.parse_tf_config(launch.tf_config_for(spec, "worker", 1)))
    failures = []
    with cluster.Heartbeat(server, config, timeout_seconds=1.0, interval_seconds=0.2, startup_timeout_seconds=1.0,
                           on_failure=failures.append) as beat:
        time.sleep(2.5)  # More than twice the timeout: only answers keep it quiet.
    assert failures == [] and beat.failure is None
    assert all(not thread.is_alive() for thread in beat._threads)
    with pytest.raises(ValueError, match=r"`peers` must name other tasks of the cluster .*, got \('ps', 0\)"):
        cluster.Heartbeat(server, config, peers=[("ps", 0)])
    with pytest.raises(TypeError, match=r"`timeout_seconds` must be a number of seconds > 0, got None"):
        cluster.Heartbeat(server, config, timeout_seconds=None)


def test_describe_op_error_keeps_the_cause_and_the_tasks_on_one_line():
    message = ("Graph execution error:\n\nDetected at node 'CollectiveReduce' defined at (most recent call last):\n"
               "  File \"train.py\", line 3, in <module>\nrecvmsg:Connection reset by peer\n"
               "Additional GRPC error information from remote target /job:worker/replica:0/task:1 while calling "
               "/tensorflow.WorkerService/RecvBuf:\n\t [[{{node CollectiveReduce}}]]")
    assert cluster.describe_op_error(tf.errors.UnavailableError(None, None, message)) == (
        "UnavailableError: recvmsg:Connection reset by peer (tasks named: worker:1)")
    assert cluster.describe_op_error(ValueError("bad\nthing")) == "ValueError: bad"


# ------------------------------------------------------------ multi-process


def _collective_args(out, shards, k, steps=_STEPS, extra=()):
    return ["--engine", "collective", "--steps", str(steps), "--shards", shards, "--accumulate", str(k),
            "--worker-seeds", "--trace-collectives", "--heartbeat-timeout", str(_HEARTBEAT), "--log-every", "4",
            "--out", out] + list(extra)


# 2 workers are the same engine and graphs as 3: the tf2 session runs the 3 workers' cases (k = 1 and 3) only.
_TF2_RUNS_3_WORKERS = pytest.mark.one_behaviour(reason="the tf2 session runs 3 workers with the same k, the same path")


@pytest.mark.distributed
@pytest.mark.parametrize("workers, shards, k", [
    pytest.param(2, "30,20", 1, marks=_TF2_RUNS_3_WORKERS), pytest.param(2, "30,20", 3, marks=_TF2_RUNS_3_WORKERS),
    (3, "10,25,15", 1), (3, "10,25,15", 3)])
def test_workers_on_their_own_uneven_shares_match_one_process_on_the_union(workers, shards, k,
                                                                           parabola_reference, tmp_path):
    out = str(tmp_path / "run.npz")
    printed, _ = _launch(workers, _collective_args(out, shards, k))
    run, ref = dict(np.load(out)), parabola_reference(_STEPS)
    _assert_matches(run, ref)
    for rank in range(1, workers):  # Every worker ends with the chief's weights, to the bit.
        other = dict(np.load(str(tmp_path / ("run-worker%d.npz" % rank))))
        for name in _WEIGHTS:
            np.testing.assert_array_equal(other[name], run[name], err_msg=name)
    # One all-reduce per applied update, none on the other micro-batches; the
    # first run of each process adds the one-number sync.
    runs = run["collective_runs"]
    expected = np.zeros(_STEPS * k, np.int64)
    expected[k - 1::k] = 1
    expected[0] += 1
    np.testing.assert_array_equal(runs, expected)
    assert re.search(r"^\[worker:0\] global_step 8 loss [\d.]+$", printed, re.M)


@pytest.mark.distributed
def test_workers_on_a_schedule_of_window_sizes_match_one_process_on_the_union(parabola_reference, tmp_path):
    """k = 3, 1, 5, 2, then 2: every window is still one full-batch step on the 50 points."""
    out = str(tmp_path / "run.npz")
    _launch(2, _collective_args(out, "30,20", 1, extra=["--accumulate-schedule", "3,1,5,2"]))
    run = dict(np.load(out))
    _assert_matches(run, parabola_reference(_STEPS))
    other = dict(np.load(str(tmp_path / "run-worker1.npz")))
    np.testing.assert_array_equal(run["window_sizes"], [3, 1, 5] + [2] * (_STEPS - 3))
    np.testing.assert_array_equal(other["window_sizes"], run["window_sizes"])
    for name in _WEIGHTS:
        np.testing.assert_array_equal(other[name], run[name], err_msg=name)


@pytest.mark.distributed
def test_workers_under_the_adaptive_policy_agree_on_every_window_size(tmp_path):
    """Each worker decides from the statistics reduced with the window: the same k everywhere, or a hang."""
    out = str(tmp_path / "run.npz")
    _launch(2, _collective_args(out, "30,20", 1, steps=20, extra=["--adaptive-batch"]))
    run, other = dict(np.load(out)), dict(np.load(str(tmp_path / "run-worker1.npz")))
    assert len(set(run["window_sizes"].tolist())) > 2, run["window_sizes"]
    np.testing.assert_array_equal(other["window_sizes"], run["window_sizes"])
    for name in _WEIGHTS + ["losses"]:
        np.testing.assert_array_equal(other[name], run[name], err_msg=name)


@pytest.mark.one_behaviour
@pytest.mark.distributed
def test_a_stopped_worker_ends_the_job_within_the_bound_and_a_restart_resumes(parabola_reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    args = ["--engine", "collective", "--checkpoint-dir", ckpt, "--checkpoint-every", "5",
            "--heartbeat-timeout", str(_HEARTBEAT)]
    # The tasks fork from one TensorFlow import; worker 2's program, not its stand-in, is stopped.
    job = _Job(3, args + ["--steps", "100000"], launcher_args=["--grace", "1"])
    stopped_pid = int(job.wait_for_line(r"started worker:2 \(pid (\d+)\)", 60).group(1))
    job.wait_for_line(r"^\[worker:0\] saved checkpoint at global_step 10$", 150)
    status, elapsed, out, err = _stop_and_wait(job, stopped_pid)
    assert status != 0
    # Heartbeat bound (timeout + 1 s), then the launcher's SIGTERM grace before SIGKILL.
    assert elapsed < _HEARTBEAT + 1 + 1 + 6, (elapsed, err[-2000:])
    assert re.search(r"^\[worker:[01]\] gradaccum: worker:[01]: worker:2 at 127\.0\.0\.1:\d+ has not answered "
                     r"for \d+ s \(heartbeat timeout %g s\); stopping$" % _HEARTBEAT, out, re.M), out[-3000:]

    saved = int(re.search(r"-(\d+)$", tf.train.latest_checkpoint(ckpt)).group(1))
    out_file = str(tmp_path / "resumed.npz")
    printed, _ = _launch(3, args + ["--steps", str(saved + 6), "--out", out_file])
    assert re.search(r"^\[worker:0\] restored global_step %d from .*model\.ckpt-%d$" % (saved, saved), printed, re.M)
    _assert_matches(dict(np.load(out_file)), parabola_reference(saved + 6), first_step=saved)


@pytest.mark.one_behaviour
@pytest.mark.distributed
def test_a_killed_worker_ends_the_other_without_a_launcher(tmp_path):
    spec = launch.build_cluster(2, 0, "127.0.0.1", launch.pick_free_ports(2))
    command = forkserver.command() + [_EXAMPLE, "--engine", "collective", "--steps", "100000", "--log-every", "20",
               "--heartbeat-timeout", str(_HEARTBEAT)]
    procs = [subprocess.Popen(command, env=dict(_env(), TF_CONFIG=launch.tf_config_for(spec, "worker", i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
             for i in range(2)]
    try:
        for line in procs[0].stdout:  # Both are training once the chief logs.
            if line.startswith("global_step 20 "):
                break
        procs[1].kill()
        killed = time.time()
        status = procs[0].wait(_HEARTBEAT + 30)
        elapsed = time.time() - killed
        err = procs[0].stderr.read()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    assert status != 0 and elapsed < _HEARTBEAT + 1 + 5, (status, elapsed, err[-2000:])
    # One line naming the peer: the heartbeat's, or the failed all-reduce's.
    assert re.search(r"^(gradaccum: worker:0: worker:1 at .* has not answered for \d+ s .*; stopping"
                     r"|parabola_sync.py: error: training failed: \w+Error: .*\(tasks named: .*worker:1.*\))$",
                     err, re.M), err[-3000:]
