"""Tests of gradaccum.cluster in one process: TF_CONFIG, devices, servers, stop signal.

Servers started here are in-process ``tf.compat.v1.train.Server`` objects on
loopback ports; they live until the test process ends (TensorFlow cannot stop
one), which is harmless. The multi-process runs are in test_distributed.py.
"""
import contextlib
import json
import re
import socket
import subprocess
import threading
import time

import numpy as np
import psutil
import pytest

import forkserver
import stop_signal_child
import gradaccum
from gradaccum import cluster, launch
from gradaccum._compat import tf

pytestmark = pytest.mark.timeout(60)



def _tf_config(cluster_spec, task_type="worker", index=0):
    return json.dumps({"cluster": cluster_spec, "task": {"type": task_type, "index": index}})


def _config(cluster_spec, task_type="worker", index=0):
    return cluster.parse_tf_config(_tf_config(cluster_spec, task_type, index))


def _local_cluster(workers, ps=0):
    return launch.build_cluster(workers, ps, "127.0.0.1", launch.pick_free_ports(workers + ps))


@contextlib.contextmanager
def _listening_socket():
    """A plain socket listening on a free loopback port; yields (socket, address)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    try:
        yield sock, "127.0.0.1:%d" % sock.getsockname()[1]
    finally:
        sock.close()


def test_worker_only_cluster_has_worker_0_as_chief():
    spec = {"worker": ["h0:2222", "h1:2222", "h2:2222"]}
    chief, other = _config(spec, "worker", 0), _config(spec, "worker", 2)
    assert (chief.is_chief, chief.task_name, chief.address) == (True, "worker:0", "h0:2222")
    assert (other.is_chief, other.task_name, other.address) == (False, "worker:2", "h2:2222")
    assert other.compute_tasks == [("worker", 0), ("worker", 1), ("worker", 2)]
    assert cluster.worker_devices(other) == ["/job:worker/task:%d/cpu:0" % i for i in range(3)]
    assert cluster.variables_device(other) == "/job:worker/task:0/cpu:0"


def test_chief_job_computes_the_first_tower_and_holds_variables_without_ps():
    config = _config({"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, "worker", 0)
    assert not config.is_chief
    assert _config(config.cluster, "chief", 0).is_chief
    assert cluster.worker_devices(config, "gpu:0") == [
        "/job:chief/task:0/gpu:0", "/job:worker/task:0/gpu:0", "/job:worker/task:1/gpu:0"]
    assert cluster.variables_device(config) == "/job:chief/task:0/cpu:0"


def test_ps_holds_variables_and_devices_may_differ_per_task():
    config = _config({"worker": ["w0:1", "w1:1"], "ps": ["p0:1", "p1:1"]}, "ps", 1)
    assert not config.is_chief
    assert cluster.variables_device(config) == "/job:ps/task:0"
    assert cluster.variables_device(config, ps_task=1) == "/job:ps/task:1"
    assert cluster.worker_devices(config, ["GPU:1", "device:CPU:0"]) == [
        "/job:worker/task:0/gpu:1", "/job:worker/task:1/cpu:0"]


@pytest.mark.parametrize("device, match", [
    ("gpu", r"`device` entries must look like \"cpu:0\" or \"gpu:1\", got 'gpu'"),
    (["cpu:0"], r"`device` must be a device string or a list of 2 \(one per compute task\), got \['cpu:0'\]"),
    (7, r"`device` must be a device string or a list of 2 .*, got 7"),
])
def test_worker_devices_rejects_bad_device(device, match):
    with pytest.raises(ValueError, match=match):
        cluster.worker_devices(_config({"worker": ["a:1", "b:1"]}), device)


def test_variables_device_rejects_unknown_ps_task():
    with pytest.raises(ValueError, match=r"`ps_task` must be an int in 0..0, got 1"):
        cluster.variables_device(_config({"worker": ["a:1"], "ps": ["p:1"]}), ps_task=1)


_WORKERS = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


@pytest.mark.parametrize("text, match", [
    ("{not json", r"^`TF_CONFIG` is not valid JSON \(Expecting property name .*\), got '\{not json'$"),
    ("[1, 2]", r"^`TF_CONFIG` must be a JSON object with \"cluster\" and \"task\", got \[1, 2\]$"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), r"`cluster` must be a non-empty object.*got None"),
    (_tf_config({"worker": ["a:1"], "trainer": ["b:1"]}),
     r"cluster has unknown task type 'trainer' \(known: chief, worker, ps, evaluator; master is read as chief\)"),
    (_tf_config(_WORKERS, "boss", 0),
     r"task has unknown task type \(known: chief, worker, ps, evaluator; master is read as chief\), got 'boss'"),
    (_tf_config({"chief": ["a:1"], "master": ["b:1"]}, "chief"),
     r"cluster names its chief twice, as \"chief\" and \"master\", got \['chief', 'master'\]$"),
    (_tf_config({"evaluator": ["e:1"]}, "evaluator"), r"cluster needs a \"worker\" or \"chief\" job, got \[\]$"),
    (_tf_config(_WORKERS, "evaluator", -1), r"task index must be >= 0, got -1$"),
    (_tf_config(_WORKERS, "ps", 0), r"task type 'ps' is not a job of the cluster \(jobs: worker\), got 'ps'"),
    (_tf_config(_WORKERS, "worker", 2), r"task index is outside the cluster: job 'worker' has tasks 0..1, got 2$"),
    (_tf_config(_WORKERS, "worker", -1), r"task index is outside the cluster: .*, got -1$"),
    (_tf_config(_WORKERS, "worker", "1"), r"task index must be an int, got '1'$"),
    (_tf_config({"worker": ["localhost"]}), r"job 'worker' must list \"host:port\" .*, got 'localhost'$"),
    (_tf_config({"worker": ["h:99999"]}), r"port in 1..65535, got 'h:99999'$"),
    (_tf_config({"worker": []}), r"cluster job 'worker' must be a non-empty list of addresses, got \[\]$"),
    (_tf_config({"worker": ["h:1", "h:1"]}), r"cluster lists an address twice, got \['h:1', 'h:1'\]$"),
    (_tf_config({"ps": ["h:1"]}, "ps"), r"cluster needs a \"worker\" or \"chief\" job, got \['ps'\]$"),
    (_tf_config({"chief": ["a:1", "b:1"]}, "chief"), r"job \"chief\" must have exactly one address"),
])
def test_bad_tf_config_is_one_clear_line(text, match):
    with pytest.raises(ValueError, match=match) as info:
        cluster.parse_tf_config(text)
    assert "\n" not in str(info.value)


def test_load_tf_config_reads_the_environment():
    assert cluster.load_tf_config({}) is None
    assert cluster.load_tf_config({"TF_CONFIG": "  "}) is None
    config = cluster.load_tf_config({"TF_CONFIG": _tf_config(_WORKERS, "worker", 1)})
    assert (config.cluster, config.task_type, config.task_index) == (_WORKERS, "worker", 1)
    assert cluster.make_tf_config(_WORKERS, "worker", 1) == _tf_config(_WORKERS, "worker", 1)


def test_session_config_filters_devices_only_for_non_chief_tasks():
    base = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    chief = cluster.session_config(_config(_WORKERS, "worker", 0), base)
    worker = cluster.session_config(_config(_WORKERS, "worker", 1), base)
    assert list(chief.device_filters) == [] and chief.device_count["CPU"] == 2
    assert list(worker.device_filters) == ["/job:worker/task:1"] and worker.device_count["CPU"] == 2
    assert list(base.device_filters) == []


def test_busy_port_is_one_clear_line_before_tensorflow_starts():
    with _listening_socket() as (_, address):
        config = _config({"worker": [address]})
        with pytest.raises(cluster.ClusterError) as info:
            cluster.start_server(config)
    assert str(info.value) == ("cannot start worker:0: port %s of %r is already in use by another process"
                               % (address.rsplit(":", 1)[1], address))


def test_started_server_runs_a_graph_and_its_port_then_counts_as_busy():
    config = _config(_local_cluster(1))
    server = cluster.start_server(config)
    with tf.Graph().as_default():
        doubled = tf.constant([1.5, -2.0]) * 2.0
        with tf.compat.v1.Session(server.target, config=cluster.session_config(config)) as sess:
            np.testing.assert_allclose(sess.run(doubled), [3.0, -4.0])
    with pytest.raises(cluster.ClusterError, match="already in use by another process"):
        cluster.check_port_free(config)


def _serve_in_thread(server, config, **kwargs):
    """Runs cluster.serve in a thread; returns (thread, outcome dict)."""
    outcome = {}

    def target():
        try:
            cluster.serve(server, config, **kwargs)
            outcome["returned"] = True
        except cluster.ClusterError as exc:
            outcome["error"] = str(exc)

    thread = threading.Thread(target=target)
    thread.daemon = True
    thread.start()
    return thread, outcome


def test_stop_signal_ends_serve_in_every_other_task_once_the_chief_has_had_time_to_exit():
    # In one process the chief's server never goes away: serve returns chief_exit_timeout_seconds after the
    # signal, not before (tests/test_distributed.py checks that it returns once a chief process has ended).
    spec = _local_cluster(2, ps=1)
    chief = _config(spec, "worker", 0)
    servers = [cluster.start_server(_config(spec, job, i)) for job, i in (("worker", 0), ("worker", 1), ("ps", 0))]
    served = [_serve_in_thread(server, _config(spec, job, i), poll_seconds=0.2, chief_exit_timeout_seconds=1.5)
              for server, (job, i) in zip(servers[1:], (("worker", 1), ("ps", 0)))]
    with tf.Graph().as_default():
        parts, stop = stop_signal_child.one_op_per_task(tf, cluster, chief)
        with tf.compat.v1.Session(servers[0].target, config=cluster.session_config(chief)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            np.testing.assert_allclose(sess.run(parts), [4.0, 4.0])
            sent = time.time()  # Before the tasks' dequeue returns: their 1.5 s count from that.
            assert stop.send(sess) == []
            time.sleep(1.0)
            assert [thread.is_alive() for thread, _ in served] == [True, True]  # The chief is still up.
    for thread, outcome in served:
        thread.join(20)
        assert not thread.is_alive() and outcome == {"returned": True}
    assert 1.5 <= time.time() - sent < 10
    with pytest.raises(ValueError, match=r"^`chief_exit_timeout_seconds` must be a finite number > 0, got 0$"):
        cluster.serve(None, _config(spec, "worker", 1), chief_exit_timeout_seconds=0)


def test_serve_fails_in_one_line_when_the_chief_goes_away():
    with _listening_socket() as (fake_chief, chief_address):
        address = "127.0.0.1:%d" % launch.pick_free_ports(1)[0]
        config = _config({"worker": [chief_address, address]}, "worker", 1)
        thread, outcome = _serve_in_thread(cluster.start_server(config), config, poll_seconds=0.2)
        fake_chief.settimeout(20)
        fake_chief.accept()[0].close()  # serve has seen the chief once...
    thread.join(20)  # ...and the chief's port is closed now.
    assert not thread.is_alive()
    assert outcome == {"error": "worker:1: chief worker:0 at %s went away without sending the stop signal"
                                % chief_address}


def test_serve_fails_in_one_line_when_the_chief_never_comes_up():
    chief_port, own_port = launch.pick_free_ports(2)
    config = _config({"worker": ["127.0.0.1:%d" % chief_port, "127.0.0.1:%d" % own_port]}, "worker", 1)
    thread, outcome = _serve_in_thread(cluster.start_server(config), config, poll_seconds=0.2,
                                       startup_timeout_seconds=0.5)
    thread.join(20)
    assert outcome == {"error": "worker:1: chief worker:0 at 127.0.0.1:%d did not come up within the startup "
                                "timeout" % chief_port}
    with pytest.raises(ValueError, match=r"`config` must be a non-chief task's, got the chief worker:0"):
        cluster.serve(None, _config(config.cluster, "worker", 0))
    worker = _config(config.cluster, "worker", 1)
    with pytest.raises(ValueError, match=r"^`heartbeat_timeout_seconds` must be a finite number > 0, "
                                         r"got 0$"):
        cluster.serve(None, worker, heartbeat_timeout_seconds=0)
    with pytest.raises(TypeError, match=r"^`startup_timeout_seconds` must be a number of seconds > 0, got None$"):
        cluster.serve(None, worker, startup_timeout_seconds=None)


def test_wait_for_tasks_names_the_missing_task():
    with _listening_socket() as (_, up):
        down = "127.0.0.1:%d" % launch.pick_free_ports(1)[0]
        config = _config({"worker": [up], "ps": [down]})
        with pytest.raises(cluster.ClusterError, match=r"^timed out after 0 s waiting for ps:0 at %s$" % down):
            cluster.wait_for_tasks(config, timeout_seconds=0.3, poll_seconds=0.1)
        cluster.wait_for_tasks(_config({"worker": [up]}), timeout_seconds=5)


def test_all_reduce_on_apply_reduces_once_per_applied_update():
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=[1.0, 2.0])
        x = tf.compat.v1.placeholder(tf.float32, [2])
        calls = tf.compat.v1.get_variable("calls", initializer=0, trainable=False)
        global_step = tf.compat.v1.train.get_or_create_global_step()

        def all_reduce(grad):  # Stands in for hvd.allreduce: counts runs, scales by 3.
            with tf.control_dependencies([calls.assign_add(1)]):
                return grad * 3.0

        inner = cluster.AllReduceOnApply(tf.compat.v1.train.GradientDescentOptimizer(0.1), all_reduce)
        train_op = gradaccum.GradientAccumulator(inner, 2).minimize(tf.reduce_sum(w * x), global_step)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            seen = []
            for feed in ([1.0, 1.0], [3.0, 5.0], [2.0, 0.0], [0.0, 2.0]):
                sess.run(train_op, {x: feed})
                seen.append(sess.run([w, calls, global_step]))
    # The gradient of sum(w * x) is x: each window applies w -= 0.1 * 3 * mean(x).
    expected = [([1.0, 2.0], 0, 0), ([0.4, 1.1], 1, 1), ([0.4, 1.1], 1, 1), ([0.1, 0.8], 2, 2)]
    for (got_w, got_calls, got_step), (want_w, want_calls, want_step) in zip(seen, expected):
        np.testing.assert_allclose(got_w, want_w, rtol=1e-6)
        assert (got_calls, got_step) == (want_calls, want_step)


def test_all_reduce_on_apply_delegates_slots_and_checks_arguments():
    with tf.Graph().as_default():
        w = tf.compat.v1.get_variable("w", initializer=[1.0])
        momentum = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
        opt = cluster.AllReduceOnApply(momentum, tf.identity)
        opt.minimize(tf.reduce_sum(w * w))
        assert opt.get_slot_names() == ["momentum"]
        assert opt.get_slot(w, "momentum") is momentum.get_slot(w, "momentum")
        assert opt.variables() == momentum.variables()
    with pytest.raises(TypeError, match=r"`optimizer` must be a tf.compat.v1.train.Optimizer, got str: 'sgd'"):
        cluster.AllReduceOnApply("sgd", tf.identity)
    with pytest.raises(TypeError, match=r"`all_reduce` must be callable .*, got None"):
        cluster.AllReduceOnApply(momentum, None)
    with pytest.raises(ValueError, match=r"`name` must be a non-empty string, got ''"):
        cluster.AllReduceOnApply(momentum, tf.identity, name="")


@pytest.mark.parametrize("tf_config, match", [
    ("{oops", r"`TF_CONFIG` is not valid JSON"),
    (_tf_config(_WORKERS, "boss", 0), r"task has unknown task type .*, got 'boss'"),
    (_tf_config(_WORKERS, "worker", 5), r"task index is outside the cluster: job 'worker' has tasks 0..1, got 5"),
])
def test_example_prints_one_error_line_for_a_bad_tf_config(parabola_example, tf_config, match, monkeypatch,
                                                           capsys):
    monkeypatch.setenv("TF_CONFIG", tf_config)
    assert parabola_example.main(["--steps", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith("parabola_sync.py: error: ")
    assert re.search(match, captured.err)


def test_example_prints_one_error_line_for_a_busy_port(parabola_example, monkeypatch, capsys):
    with _listening_socket() as (_, address):
        monkeypatch.setenv("TF_CONFIG", _tf_config({"worker": [address]}))
        assert parabola_example.main(["--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert err == ("parabola_sync.py: error: cannot start worker:0: port %s of %r is already in use by another "
                   "process\n" % (address.rsplit(":", 1)[1], address))


def test_a_server_on_a_loopback_address_is_reachable_on_every_interface():
    # Why the launcher warns: TensorFlow binds 0.0.0.0 whatever host TF_CONFIG names.
    others = sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET and not a.address.startswith("127."))
    if not others:
        pytest.skip("this machine has no IPv4 address besides loopback")
    config = _config(_local_cluster(1))
    cluster.start_server(config)
    port = int(config.address.rsplit(":", 1)[1])
    socket.create_connection((others[0], port), timeout=5).close()
    listening = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(c.laddr.ip in ("0.0.0.0", "::") for c in listening), listening


def test_heartbeat_lives_in_its_own_module_and_cluster_and_ingraph_do_not_import_each_other():
    from gradaccum import ingraph
    from gradaccum.distributed import heartbeat

    assert cluster.Heartbeat is heartbeat.Heartbeat is gradaccum.Heartbeat
    assert cluster.HEARTBEAT_EXIT_STATUS == 75 and cluster.DEFAULT_HEARTBEAT_SECONDS == 30.0
    assert cluster.StopSignal is ingraph.StopSignal and cluster.ClusterError is gradaccum.ClusterError
    code = ("import sys, gradaccum.distributed.ingraph; "
            "print(' '.join(m for m in sys.modules if m.startswith('gradaccum.')))")
    done = subprocess.run(forkserver.command() + ["-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          universal_newlines=True, timeout=120)
    loaded = done.stdout.split()
    assert "gradaccum.distributed.heartbeat" in loaded and "gradaccum.distributed.cluster" not in loaded, loaded
