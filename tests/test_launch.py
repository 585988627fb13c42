"""Tests of gradaccum.launch: helpers, and process supervision with tiny non-TF tasks.

The supervised tasks are short Python snippets (no TensorFlow), run by
``launch.main`` in this process, so each case takes well under a second unless
it waits for a grace period on purpose. All run in the tf1 session only. The
longest: 20 restarts after a chief's kill, 20 runs of a worker's failure
followed 40 ms later by the chief's kill (about 10 s each), and a chief that
saves with TensorFlow, plainly or sharded, and is killed inside
``saver.save`` (``distributed``, about 5 s each).
"""
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import forkserver
import gradaccum
from gradaccum import cluster, launch
from gradaccum.distributed import checkpoint_files

# The launcher and its tasks here do not use the session's TensorFlow behaviour: tf1 session only.
pytestmark = [pytest.mark.timeout(60), pytest.mark.one_behaviour]

# Each task prints its TF_CONFIG task and then behaves as argv[1] says.
_TASK = textwrap.dedent("""
    import json, os, random, signal, socket, subprocess, sys, time

    def listen(workers):
        # The chief listens on its own port and accepts every other worker.
        host, port = workers[0].rsplit(":", 1)
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, int(port)))
        server.listen(len(workers))
        return [server.accept()[0] for _ in workers[1:]]  # Held open until the chief ends.

    def connect(workers):
        host, port = workers[0].rsplit(":", 1)
        for _ in range(500):
            try:
                return socket.create_connection((host, int(port)))
            except OSError:
                time.sleep(0.01)

    def chief_killed(chief, workers):
        # The chief accepts every other worker, then is SIGKILLed at a random
        # moment of the launcher's poll; each other worker sees its connection
        # end and exits 1 about 30 ms later (a collective's UnavailableError).
        if chief:
            peers = listen(workers)
            time.sleep(random.uniform(0.0, 0.1))
            os.kill(os.getpid(), signal.SIGKILL)
        connect(workers).recv(1)
        time.sleep(0.03)
        sys.exit(1)

    def worker1_fails_then_chief_killed(chief, workers):
        # worker:1 exits 1 at a random moment of the launcher's poll; the
        # chief sees its connection end and is SIGKILLed 40 ms later.
        if chief:
            listen(workers)[0].recv(1)
            time.sleep(0.04)
            os.kill(os.getpid(), signal.SIGKILL)
        peer = connect(workers)
        time.sleep(random.uniform(0.0, 0.1))
        sys.exit(1)

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    name = "%s:%d" % (task["type"], task["index"])
    chief = name == "worker:0"
    mode = sys.argv[1]
    print("task", name, "cluster", json.dumps(json.loads(os.environ["TF_CONFIG"])["cluster"], sort_keys=True))
    print("second line", end="")
    sys.stdout.flush()
    if mode == "chief_status_3":
        sys.exit(3 if chief else 0)
    if mode == "worker1_dies":
        if name == "worker:1":
            time.sleep(0.5)
            sys.exit(7)
        time.sleep(120)
    if mode == "last_worker_dies_once":  # Dies in the first attempt only (a file marks it), as a preempted task.
        marker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "died")
        if name == "worker:%d" % (len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]) - 1) \
                and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), 9)
        time.sleep(1.0)
    if mode == "others_hang":
        if not chief:
            time.sleep(120)
    if mode == "all_hang":
        time.sleep(120)
    if mode == "noisy":
        print()
        for line in NOISE:
            print(line)
        print("real output")
        sys.stdout.flush()
    if mode == "chief_killed":
        chief_killed(chief, json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    if mode == "worker1_fails_then_chief_killed":
        worker1_fails_then_chief_killed(chief, json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
    if mode == "grandchild":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("grandchild", child.pid)
        sys.stdout.flush()
        time.sleep(120)
""")


# TensorFlow's log noise as TF 2.21 and TF 1.15 print it; the launcher leaves it out unless --verbose.
_NOISE = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1795423289.130120    6697 port.cc:153] oneDNN custom operations are on. You may see ...",
    "E0000 00:00:1795424085.489083   14476 cuda_platform.cc:52] failed call to cuInit: UNKNOWN ERROR (303)",
    "2026-11-23 08:45:12.123456: I tensorflow/core/platform/cpu_feature_guard.cc:142] Your CPU supports AVX2",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
    "appropriate compiler flags.",
    "WARNING:tensorflow:From /x/v2_compat.py:98: disable_resource_variables (from tensorflow.python.ops) "
    "is deprecated and will be removed in a future version.",
    "Instructions for updating:",
    "non-resource variables are not supported in the long term",
    "WARNING:tensorflow:From /x.py:3: The name tf.Session is deprecated. Please use tf.compat.v1.Session instead.",
    "",
    "/x/example.py:88: UserWarning: `tf.layers.conv2d` is deprecated and will be removed in a future version.",
    "  h = tf.compat.v1.layers.conv2d(x, 8, 3)",
]


def _run(args, mode, script_dir):
    """Runs launch.main in-process; returns (status, stdout text, stderr text)."""
    script = os.path.join(str(script_dir), "task.py")
    with open(script, "w") as handle:
        handle.write("NOISE = %r\n" % (_NOISE,) + _TASK)
    out, err = io.BytesIO(), io.StringIO()
    status = launch.main(args + ["--", sys.executable, script, mode], stdout=out, stderr=err)
    return status, out.getvalue().decode(), err.getvalue()


def _started_pids(err):
    return [int(pid) for pid in re.findall(r"started \S+ \(pid (\d+)\)", err)]


def _assert_all_gone(pids):
    alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == []


def test_pick_free_ports_are_distinct_and_bindable():
    ports = launch.pick_free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        sock = socket.socket()
        sock.bind(("127.0.0.1", port))
        sock.close()


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_pick_free_ports_rejects_bad_count(count):
    with pytest.raises(ValueError, match=r"`count` must be an int >= 1, got %s" % re.escape(repr(count))):
        launch.pick_free_ports(count)


def test_build_cluster_and_tf_config_round_trip_through_the_parser():
    built = launch.build_cluster(2, 1, "127.0.0.1", [4001, 4002, 4003])
    assert built == {"worker": ["127.0.0.1:4001", "127.0.0.1:4002"], "ps": ["127.0.0.1:4003"]}
    config = cluster.parse_tf_config(launch.tf_config_for(built, "ps", 0))
    assert (config.cluster, config.task_name, config.is_chief) == (built, "ps:0", False)
    assert launch.build_cluster(1, 0, "h", [9]) == {"worker": ["h:9"]}


@pytest.mark.parametrize("workers, ps, ports, match", [
    (0, 0, [], r"`workers` must be an int >= 1, got 0"),
    (1, -1, [1], r"`ps` must be an int >= 0, got -1"),
    (2, 0, [1], r"`ports` must hold 2 ports, got \[1\]"),
])
def test_build_cluster_rejects_bad_counts(workers, ps, ports, match):
    with pytest.raises(ValueError, match=match):
        launch.build_cluster(workers, ps, "127.0.0.1", ports)


@pytest.mark.parametrize("returncode, text, status", [
    (0, "exit status 0", 0),
    (3, "exit status 3", 3),
    (-9, "signal 9 (SIGKILL)", 137),
    (-15, "signal 15 (SIGTERM)", 143),
])
def test_describe_status_and_shell_status(returncode, text, status):
    assert launch.describe_status(returncode) == text
    assert launch.shell_status(returncode) == status


def test_copy_prefixed_prefixes_every_line_and_ends_the_last_one():
    sink = io.BytesIO()
    launch.copy_prefixed(io.BytesIO(b"a\n\nb c\nlast"), sink, b"[worker:1] ", threading.Lock())
    assert sink.getvalue() == b"[worker:1] a\n[worker:1] \n[worker:1] b c\n[worker:1] last\n"


class _BrokenSink(object):
    def __init__(self):
        self.writes = 0

    def write(self, data):
        self.writes += 1
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_copy_prefixed_drains_the_source_after_the_sink_breaks():
    source, sink = io.BytesIO(b"one\ntwo\nthree\n"), _BrokenSink()
    launch.copy_prefixed(source, sink, b"[ps:0] ", threading.Lock())
    assert (sink.writes, source.read()) == (1, b"")


def test_parse_args_takes_the_command_after_the_separator():
    args = launch.parse_args(["--workers", "3", "--ps", "1", "--", "python", "t.py", "--steps", "5"])
    assert (args.workers, args.ps, args.command) == (3, 1, ["python", "t.py", "--steps", "5"])


@pytest.mark.parametrize("argv, match", [
    (["--workers", "2"], "no command given"),
    (["--workers", "0", "--", "python"], r"`--workers` must be >= 1 and `--ps` >= 0, got 0 and 0"),
    (["--workers", "2", "--grace", "0", "--", "python"], r"`--grace` must be in \(0, 30\]"),
    (["--", "python"], "the following arguments are required: --workers"),
    (["--workers", "2", "--min-workers", "1", "--", "python"],
     r"`--min-workers` and `--checkpoint-dir` need `--max-restarts`; usage"),
    (["--workers", "2", "--max-restarts", "1", "--min-workers", "3", "--", "python"],
     r"`--min-workers` must be in \[1, --workers\] = \[1, 2\], got 3; usage"),
    (["--workers", "2", "--max-restarts", "-1", "--", "python"], r"`--max-restarts` must be >= 0, got -1; usage"),
    (["--workers", "2", "--max-restarts", "1", "--checkpoint-prefix", "model.ckpt", "--", "python"],
     r"`--checkpoint-prefix` needs `--checkpoint-dir`; usage"),
    (["--workers", "2", "--max-restarts", "1", "--checkpoint-dir", "/c", "--checkpoint-prefix", "sub/model.ckpt", "--",
      "python"], r"`--checkpoint-prefix` must be a file name without a directory, such as model.ckpt, "
                 r"got 'sub/model.ckpt'; usage"),
])
def test_parse_args_errors_are_one_line(argv, match, capsys):
    with pytest.raises(SystemExit) as info:
        launch.parse_args(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and err.startswith("gradaccum.launch: error:")
    assert re.search(match, err)


def test_help_says_what_the_launcher_deletes_and_what_it_exits_with(capsys):
    with pytest.raises(SystemExit) as info:
        launch.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert info.value.code == 0
    assert ("after a failure the launcher deletes there (and in its shard-<r>-of-<P>/ directories, nowhere else) "
            "TensorFlow's temporary files of the job's interrupted saves under --checkpoint-prefix, and says which "
            "in one line") in text
    assert "--checkpoint-prefix NAME with --checkpoint-dir: the file name the job saves under there" in text
    assert ("Exit status: the chief's when the job ends without a failure; when a task fails, that of the task "
            "that failed first") in text


def test_the_prefix_defaults_to_model_ckpt():
    args = launch.parse_args(["--workers", "2", "--max-restarts", "1", "--checkpoint-dir", "/c", "--", "python"])
    assert (args.checkpoint_dir, args.checkpoint_prefix) == ("/c", "model.ckpt")


def test_every_task_gets_its_tf_config_and_a_prefix(tmp_path):
    status, out, err = _run(["--workers", "2", "--ps", "1"], "ok", tmp_path)
    assert status == 0
    clusters = {}
    for name in ("worker:0", "worker:1", "ps:0"):
        line = re.search(r"^\[%s\] task %s cluster (.*)$" % (name, name), out, re.M)
        clusters[name] = json.loads(line.group(1))
        assert "[%s] second line\n" % name in out
    assert len({json.dumps(c, sort_keys=True) for c in clusters.values()}) == 1
    ports = [int(a.rsplit(":", 1)[1]) for a in clusters["ps:0"]["worker"] + clusters["ps:0"]["ps"]]
    assert len(set(ports)) == 3
    assert all(line.startswith(("[worker:0] ", "[worker:1] ", "[ps:0] ")) for line in out.splitlines())
    _assert_all_gone(_started_pids(err))


def test_exits_with_the_chief_status(tmp_path):
    status, _, err = _run(["--workers", "2"], "chief_status_3", tmp_path)
    assert status == 3
    assert "chief worker:0 (pid %d) ended with exit status 3" % _started_pids(err)[0] in err
    _assert_all_gone(_started_pids(err))


def test_a_dead_worker_stops_the_job_and_is_named_in_one_line(tmp_path):
    status, _, err = _run(["--workers", "3", "--grace", "2"], "worker1_dies", tmp_path)
    pids = _started_pids(err)
    assert status == 7  # The root cause's own status.
    lines = [line for line in err.splitlines() if "died" in line]
    assert lines == ["gradaccum.launch: worker:1 (pid %d) died with exit status 7; stopping the other tasks"
                     % pids[1]]
    _assert_all_gone(pids)


def _clusters(out):
    """The cluster each attempt's chief printed, in order."""
    return [json.loads(c) for c in re.findall(r"^\[worker:0\] task worker:0 cluster (.*)$", out, re.M)]


def test_a_death_restarts_the_job_on_fresh_ports_with_one_worker_fewer_and_says_so_in_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-12"\n'
                                     'all_model_checkpoint_paths: "model.ckpt-12"\n')
    args = ["--workers", "3", "--max-restarts", "2", "--min-workers", "2", "--grace", "1", "--checkpoint-dir",
            str(ckpt)]
    status, out, err = _run(args, "last_worker_dies_once", tmp_path)
    assert status == 0, err
    restarts = [line for line in err.splitlines() if "restart" in line]
    assert restarts == ["gradaccum.launch: restart 1 of 2: worker:2 died with signal 9 (SIGKILL); restarting 2 "
                        "workers from global step 12"]
    first, second = _clusters(out)
    assert (len(first["worker"]), len(second["worker"])) == (3, 2)
    assert not set(first["worker"]) & set(second["worker"])  # fresh ports
    _assert_all_gone(_started_pids(err))


def test_without_min_workers_a_restart_keeps_p_and_the_launcher_gives_up_after_n(tmp_path):
    status, out, err = _run(["--workers", "2", "--max-restarts", "1", "--grace", "1"], "worker1_dies", tmp_path)
    assert status == 7
    said = [line for line in err.splitlines() if "restart" in line or "giving up" in line]
    assert said == ["gradaccum.launch: restart 1 of 1: worker:1 died with exit status 7; restarting 2 workers "
                    "from the newest checkpoint",
                    "gradaccum.launch: giving up: worker:1 died with exit status 7 after 1 restart"]
    assert [len(c["worker"]) for c in _clusters(out)] == [2, 2]
    _assert_all_gone(_started_pids(err))


def test_the_newest_checkpoint_step_is_an_ordinary_ones_or_a_step_every_shard_of_one_count_holds(tmp_path):
    def state(folder, *steps):
        folder.mkdir(parents=True)
        (folder / "checkpoint").write_text("".join('all_model_checkpoint_paths: "/x/model.ckpt-%d"\n' % s
                                                   for s in steps))

    assert launch.newest_checkpoint_step(str(tmp_path / "none")) is None
    state(tmp_path / "shard-0-of-2", 3, 6, 9)
    state(tmp_path / "shard-1-of-2", 3, 6)  # killed while saving 9
    assert launch.newest_checkpoint_step(str(tmp_path)) == 6
    state(tmp_path / "shard-0-of-3", 12)  # an incomplete count does not count
    state(tmp_path / "shard-1-of-3", 12)
    assert launch.newest_checkpoint_step(str(tmp_path)) == 6
    state(tmp_path / "ordinary", 4, 8)
    assert launch.newest_checkpoint_step(str(tmp_path / "ordinary")) == 8


def test_tasks_still_running_after_the_chief_are_stopped(tmp_path):
    status, _, err = _run(["--workers", "2", "--ps", "1", "--shutdown-timeout", "0.5"], "others_hang", tmp_path)
    assert status == 0
    assert "worker:1, ps:0 still running 0.5 s after the chief finished; stopping them" in err
    _assert_all_gone(_started_pids(err))


def _cmdline(process):
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # It exited meanwhile.
        return ""


def _signal_when_grandchildren_run(count, stop):
    """SIGTERMs this process once ``count`` grandchildren sleep (or after 30 s)."""
    me = psutil.Process()
    for _ in range(300):
        sleepers = [p for p in me.children(recursive=True) if "time.sleep(120)" in _cmdline(p)]
        if len(sleepers) >= count or stop.wait(0.1):
            break
    if not stop.is_set():
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_signal_to_the_launcher_kills_tasks_and_grandchildren(tmp_path):
    stop = threading.Event()
    watcher = threading.Thread(target=_signal_when_grandchildren_run, args=(2, stop))
    watcher.start()
    try:
        status, out, err = _run(["--workers", "2", "--grace", "1"], "grandchild", tmp_path)
    finally:
        stop.set()
        watcher.join()
    grandchildren = [int(pid) for pid in re.findall(r"grandchild (\d+)", out)]
    assert status == 128 + signal.SIGTERM
    assert "received SIGTERM; stopping all tasks" in err
    assert len(grandchildren) == 2
    _assert_all_gone(_started_pids(err) + grandchildren)


def test_a_group_is_alive_while_an_orphaned_member_runs_and_not_once_it_is_killed():
    # The leader starts a sleeper and exits: the sleeper is an orphan in the
    # leader's group. Killed, it may stay a zombie (a container's init may
    # never reap it); the launcher must not wait for that.
    code = ("import subprocess, sys; "
            "print(subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']).pid, flush=True)")
    leader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True,
                              universal_newlines=True)
    orphan = int(leader.stdout.readline())
    leader.wait(10)
    leader.stdout.close()
    try:
        assert psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE
        assert launch._group_alive(leader.pid)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
    assert launch._wait_until(lambda: not launch._group_alive(leader.pid), 5.0)
    _assert_all_gone([orphan])


def test_a_command_that_cannot_start_is_one_line(tmp_path):
    out, err = io.BytesIO(), io.StringIO()
    missing = str(tmp_path / "no_such_program")
    status = launch.main(["--workers", "2", "--no-port-warning", "--", missing], stdout=out, stderr=err)
    assert status == 127
    assert err.getvalue() == "gradaccum.launch: cannot start %r: No such file or directory\n" % missing


def test_tasks_die_when_the_launcher_is_killed(tmp_path):
    script = str(tmp_path / "task.py")
    with open(script, "w") as handle:
        handle.write(_TASK)
    launcher = subprocess.Popen(  # `-m` loads no TensorFlow: it starts in a fraction of a second.
        [sys.executable, "-m", "gradaccum.launch", "--workers", "2", "--", sys.executable, script, "all_hang"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        tasks = []
        for _ in range(300):  # Up to 30 s for both tasks to start.
            tasks = psutil.Process(launcher.pid).children()
            if len(tasks) == 2:
                break
            time.sleep(0.1)
        assert len(tasks) == 2
    finally:
        launcher.kill()  # SIGKILL: no handler, no atexit runs in the launcher.
        launcher.wait(10)
    gone, alive = psutil.wait_procs(tasks, timeout=10)
    assert alive == [] and len(gone) == 2


def test_tensorflow_log_noise_is_left_out_unless_verbose(tmp_path):
    status, out, _ = _run(["--workers", "2"], "noisy", tmp_path)
    assert status == 0
    for name in ("worker:0", "worker:1"):
        lines = [line for line in out.splitlines() if line.startswith("[%s] " % name)]
        assert lines[1:] == ["[%s] second line" % name, "[%s] real output" % name], lines
    status, out, _ = _run(["--workers", "1", "--verbose"], "noisy", tmp_path)
    assert [line[len("[worker:0] "):] for line in out.splitlines()][2:] == _NOISE + ["real output"]


def _launch_module(args):
    """Runs ``python -X importtime -m gradaccum.launch args``; returns (status, stderr, seconds)."""
    start = time.time()
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "gradaccum.launch"] + args,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
    return done.returncode, done.stderr, time.time() - start


@pytest.mark.parametrize("args", [["--workers", "two", "--", "python"], ["--workers", "2"], []])
def test_a_bad_flag_is_one_usage_line_without_tensorflow_or_runpy_warning(args):
    status, err, seconds = _launch_module(args)
    imported = [line for line in err.splitlines() if line.startswith("import time:")]
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert status == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("gradaccum.launch: error: ")
    assert lines[0].endswith("; usage: python -m gradaccum.launch --workers P [--ps N] [--host H] [--grace S] "
                             "[--shutdown-timeout S] [--max-restarts N [--min-workers M] [--checkpoint-dir DIR "
                             "[--checkpoint-prefix NAME]]] [--verbose] [--no-port-warning] -- COMMAND [ARG ...]")
    assert imported and not any(re.search(r"\| +(tensorflow|numpy)\b", line) for line in imported)
    assert "RuntimeWarning" not in err
    assert seconds < 3.0  # About 0.1 s on an idle machine; this one is shared.


def test_importing_the_package_defers_everything_but_the_tensorflow_check():
    code = ("import sys; import gradaccum; print(sorted(m for m in sys.modules if m.startswith('gradaccum')));"
            "gradaccum.GradientAccumulator; print('gradaccum.window.accumulator' in sys.modules)")
    done = subprocess.run(forkserver.command() + ["-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          universal_newlines=True, timeout=120)
    assert done.stdout.splitlines() == ["['gradaccum', 'gradaccum._compat', 'gradaccum._version']", "True"]


def _up_non_loopback_interfaces():
    """Measured independently of the launcher: interfaces that are up and hold no loopback address."""
    addresses = psutil.net_if_addrs()
    return sorted(name for name, stats in psutil.net_if_stats().items()
                  if stats.isup and not any(a.address in ("127.0.0.1", "::1") for a in addresses.get(name, ())))


def test_non_loopback_interfaces_are_the_ones_that_are_up_and_not_loopback():
    assert launch.non_loopback_interfaces() == _up_non_loopback_interfaces()


def test_port_warning_names_the_ports_and_interfaces_or_is_none():
    spec = {"worker": ["127.0.0.1:4001", "127.0.0.1:4002"], "ps": ["127.0.0.1:4003"]}
    assert launch.port_warning(spec, []) is None
    assert launch.port_warning(spec, ["eth0", "wlan0"]) == (
        "warning: TensorFlow listens on every interface, not only the --host address: the tasks' ports "
        "(4001, 4002, 4003) are open on eth0, wlan0 too, without authentication, and whoever reaches them can run "
        "any op in the tasks; close them with a firewall or keep the machine on a private network "
        "(--no-port-warning hides this line)")


@pytest.mark.parametrize("flags", [[], ["--no-port-warning"]])
def test_the_launcher_warns_once_about_open_ports_unless_silenced(flags):
    done = subprocess.run([sys.executable, "-m", "gradaccum.launch", "--workers", "2"] + flags
                          + ["--", sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=60)
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("gradaccum.launch: warning:")]
    ports = re.findall(r"started worker:\d \(pid \d+\) at 127\.0\.0\.1:(\d+)", done.stderr)
    interfaces = _up_non_loopback_interfaces()
    if flags or not interfaces:
        assert warnings == []
    else:  # This machine, and CI's, have one (eth0).
        assert warnings == ["gradaccum.launch: " + launch.port_warning(
            {"worker": ["127.0.0.1:%s" % port for port in ports]}, interfaces)]
        assert done.stderr.index("warning:") < done.stderr.index("started worker:0")


def test_a_killed_chief_is_named_as_the_cause_not_the_workers_that_fail_after_it(tmp_path):
    # 20 kills: 19 restarts, then the launcher gives up. Each other worker
    # exits 1 about 30 ms after the chief dies, inside the launcher's poll.
    start = time.time()
    status, _, err = _run(["--workers", "3", "--max-restarts", "19", "--grace", "1"], "chief_killed", tmp_path)
    seconds = time.time() - start
    said = [line for line in err.splitlines() if "restart" in line or "giving up" in line]
    blamed = [re.search(r"(?:: |giving up: )(\S+) died with", line).group(1) for line in said]
    print("\n%d of %d chief kills blamed on the chief, in %.1f s" % (blamed.count("worker:0"), len(said), seconds))
    assert blamed == ["worker:0"] * 20, "\n".join(said)
    assert said == ["gradaccum.launch: restart %d of 19: worker:0 died with signal 9 (SIGKILL); restarting 3 "
                    "workers from the newest checkpoint" % number for number in range(1, 20)] + [
        "gradaccum.launch: giving up: worker:0 died with signal 9 (SIGKILL) after 19 restarts"]
    stopping = [line for line in err.splitlines() if line.endswith("; stopping the other tasks")]
    assert len(stopping) == 20 and all(line.startswith("gradaccum.launch: chief worker:0 (pid ") for line in stopping)
    assert status == 137  # As a shell reports the chief's SIGKILL.
    _assert_all_gone(_started_pids(err))


def test_a_chief_killed_40_ms_after_a_worker_failed_is_the_root_cause_in_20_of_20_runs(tmp_path):
    # worker:1 exits 1 at a random moment of the launcher's poll and the chief
    # is SIGKILLed 40 ms later, inside the 0.1 s window: the chief is the root
    # cause whatever the poll's phase. 20 runs: 19 restarts, then giving up.
    start = time.time()
    status, _, err = _run(["--workers", "2", "--max-restarts", "19", "--grace", "1"],
                          "worker1_fails_then_chief_killed", tmp_path)
    said = [line for line in err.splitlines() if "restart" in line or "giving up" in line]
    print("\n%d runs in %.1f s" % (len(said), time.time() - start))
    assert said == ["gradaccum.launch: restart %d of 19: worker:0 died with signal 9 (SIGKILL); restarting 2 "
                    "workers from the newest checkpoint" % number for number in range(1, 20)] + [
        "gradaccum.launch: giving up: worker:0 died with signal 9 (SIGKILL) after 19 restarts"], "\n".join(said)
    stopping = [line for line in err.splitlines() if line.endswith("; stopping the other tasks")]
    assert len(stopping) == 20 and all(line.startswith("gradaccum.launch: chief worker:0 (pid ") for line in stopping)
    assert status == 137
    _assert_all_gone(_started_pids(err))


class _FakeProcess(object):
    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


class _FakeTask(object):
    """A task whose end the test sets: its status and the time its reaper recorded."""

    def __init__(self, name, pid):
        self.name, self.process, self.ended_at, self.pump = name, _FakeProcess(pid), None, None

    def end(self, returncode, ended_at):
        self.process.returncode = returncode
        self.ended_at = ended_at

    def signal_group(self, signum):
        pass

    def ended(self):
        return self.ended_at is not None

    def gone(self):
        return True


@pytest.mark.parametrize("seen_after, chief_after, status, line", [
    # The launcher looks 0, 20 or 35 ms after worker:1's end, before the chief's kill at 40 ms.
    (0.0, 0.04, 137, "chief worker:0 (pid 100) ended with signal 9 (SIGKILL); stopping the other tasks"),
    (0.02, 0.04, 137, "chief worker:0 (pid 100) ended with signal 9 (SIGKILL); stopping the other tasks"),
    (0.035, 0.04, 137, "chief worker:0 (pid 100) ended with signal 9 (SIGKILL); stopping the other tasks"),
    # A kill 120 ms after the first failure, outside the window, is not the root cause.
    (0.0, 0.12, 1, "worker:1 (pid 101) died with exit status 1; stopping the other tasks"),
])
def test_the_root_cause_does_not_depend_on_when_the_launcher_looks(seen_after, chief_after, status, line):
    err = io.StringIO()
    launcher = launch.Launcher(["unused"], workers=2, stdout=io.BytesIO(), stderr=err)
    chief, worker = launcher.tasks = [_FakeTask("worker:0", 100), _FakeTask("worker:1", 101)]
    failed = time.monotonic() - seen_after
    worker.end(1, failed)
    killer = threading.Timer(chief_after - seen_after, chief.end, args=(-9, failed + chief_after))
    killer.start()
    try:
        assert launcher.supervise() == status
    finally:
        killer.cancel()
    assert err.getvalue() == "gradaccum.launch: %s\n" % line
    assert launcher.died == ((chief, -9) if status == 137 else (worker, 1))


@pytest.mark.parametrize("failures, first", [
    ([("worker:1", 1, 10.034), ("worker:0", -9, 10.0), ("worker:2", 1, 10.041)], ["worker:0", "worker:1", "worker:2"]),
    ([("worker:2", 1, 10.041), ("worker:1", 1, 10.0), ("worker:0", -9, 10.03)], ["worker:0", "worker:1", "worker:2"]),
    ([("worker:1", 1, 10.0), ("worker:0", -9, 10.5)], ["worker:1", "worker:0"]),  # A later kill is not the cause.
    ([("worker:2", 3, 10.05), ("worker:1", 7, 10.0)], ["worker:1", "worker:2"]),
    ([("ps:0", -15, 10.08), ("worker:0", -9, 10.02), ("worker:1", 1, 10.0)], ["worker:0", "worker:1", "ps:0"]),
    ([("worker:1", 1, 10.0)], ["worker:1"]),
])
def test_tasks_that_ended_in_one_poll_are_ordered_by_their_end_and_a_signalled_one_first(failures, first):
    ordered = launch.root_cause_first(failures)
    assert [name for name, _, _ in ordered] == first
    assert sorted(ordered) == sorted(failures)


# A checkpoint directory after interrupted saves (names as TF 1.15 to 2.21 write
# them): each file, and the prefix whose clean-up removes it ("any": every
# prefix's, the `checkpoint` state file's temporary; None: no clean-up does).
_HEX = "fe0e5cb880384518919dbdd6cdb3e267"
_SAVE_FILES = {
    "model.ckpt-4.data-00000-of-00001.tempstate4878854028441751831": "model.ckpt",
    "model.ckpt-4.index.tempstate12": "model.ckpt",
    "model.ckpt.index.tempstate77": "model.ckpt",  # saved without global_step
    "model.ckpt-4.meta.tmp" + _HEX: "model.ckpt",
    "checkpoint.tmp" + _HEX: "any",
    "model.ckpt-5_temp/part-00000-of-00002.index": "model.ckpt",  # a sharded save, TF 2.x
    "model.ckpt-5_temp/part-00001-of-00002.data-00000-of-00001.tempstate1042768425798761765": "model.ckpt",
    "model.ckpt-6_temp_%s/part-00000-of-00001.data-00000-of-00001" % _HEX: "model.ckpt",  # TF 1.15
    "shard-0-of-2/model.ckpt-4.index.tempstate99": "model.ckpt",  # a ShardedAllReduce worker's save
    "shard-0-of-2/checkpoint.tmp" + _HEX: "any",
    "eval.ckpt-4.index.tempstate7": "eval.ckpt",  # another prefix's save, in the same directory
    "eval.ckpt-4.meta.tmp" + _HEX: "eval.ckpt",
    "eval.ckpt-8_temp/part-00000-of-00001.index": "eval.ckpt",
    "shard-0-of-2/eval.ckpt-4.index.tempstate5": "eval.ckpt",
    # What no clean-up removes: complete checkpoints, other files, look-alikes.
    "checkpoint": None, "model.ckpt-3.data-00000-of-00001": None, "model.ckpt-3.index": None,
    "model.ckpt-3.meta": None, "events.out.tfevents.1.host": None, "shard-0-of-2/checkpoint": None,
    "shard-0-of-2/model.ckpt-3.index": None,
    "notes.tempstate123": None, "notes.tmp": None, "tempstate": None, "data.tmp" + _HEX: None,
    "results_temp/part-00000-of-00002.index": None, "eval_temp/results.txt": None,
    "other_job/model.ckpt-9.index.tempstate99": None, "other_job/checkpoint.tmp" + _HEX: None,
    "other_job/model.ckpt-9_temp/part-00000-of-00002.index": None,
    "model.ckpt2-4.index.tempstate7": None, "model.ckpt.best-4.data-00000-of-00001.tempstate7": None,
    "modelXckpt-4.index.tempstate7": None, "model.ckpt-4.index.tempstate": None,
    "model.ckpt-4.index.tempstate12.bak": None, "model.ckpt-x.index.tempstate12": None,
    "model.ckpt-3.index.bak": None, "model.ckpt-4.index.tmp" + _HEX: None, "checkpoint.tmp" + _HEX[:31]: None,
    "model.ckpt-7_temp/part-00000-of-00002.index": None, "model.ckpt-7_temp/notes.txt": None,
    "shard-x-of-2/model.ckpt-4.index.tempstate5": None, "shard-0-of-2/nested/model.ckpt-4.index.tempstate5": None,
}


def _make_files(root, names):
    for name in names:
        path = os.path.join(str(root), name)
        if not os.path.isdir(os.path.dirname(path)):
            os.makedirs(os.path.dirname(path))
        open(path, "w").close()


def _listing(root):
    return sorted(os.path.relpath(os.path.join(folder, name), str(root))
                  for folder, _, files in os.walk(str(root)) for name in files)


def _removed_by(prefix):
    """The relative paths the clean-up for ``prefix`` removes: files, then the sharded saves' directories."""
    files = sorted(name for name, owner in _SAVE_FILES.items() if owner in (prefix, "any"))
    return files + sorted(set(os.path.dirname(name) for name in files if "_temp" in os.path.dirname(name)))


@pytest.mark.parametrize("prefix", ["model.ckpt", "eval.ckpt"])
def test_only_the_temporaries_of_the_jobs_own_prefix_are_removed_nothing_in_other_directories(tmp_path, prefix):
    _make_files(tmp_path, _SAVE_FILES)
    removed = launch.remove_save_temporaries(str(tmp_path), prefix)
    assert _listing(tmp_path) == sorted(set(_SAVE_FILES) - set(_removed_by(prefix)))
    assert sorted(os.path.relpath(path, str(tmp_path)) for path in removed) == sorted(_removed_by(prefix))
    assert os.path.isdir(str(tmp_path / "results_temp")) and os.path.isdir(str(tmp_path / "other_job"))
    assert launch.remove_save_temporaries(str(tmp_path / "missing"), prefix) == []


@pytest.mark.parametrize("prefix, error, match", [
    ("", ValueError, r"`prefix` must be a file name without a directory, such as 'model.ckpt', got ''"),
    ("other_job/model.ckpt", ValueError, r"`prefix` must be a file name without a directory, .*'other_job/model"),
    ("..", ValueError, r"`prefix` must be a file name without a directory, .*got '\.\.'"),
    (None, TypeError, r"`prefix` must be a str \(a file name such as 'model.ckpt'\), got None"),
])
def test_a_prefix_that_is_not_a_file_name_is_refused(tmp_path, prefix, error, match):
    _make_files(tmp_path, ["other_job/model.ckpt-9.index.tempstate99"])
    with pytest.raises(error, match=match):
        launch.remove_save_temporaries(str(tmp_path), prefix)
    with pytest.raises(error, match=match):  # At once, not after the job's first failure.
        launch.Launcher(["unused"], workers=1, checkpoint_dir=str(tmp_path), checkpoint_prefix=prefix)
    assert _listing(tmp_path) == ["other_job/model.ckpt-9.index.tempstate99"]


def test_a_symbolic_link_to_a_shard_directory_is_not_followed(tmp_path):
    _make_files(tmp_path, ["elsewhere/model.ckpt-4.index.tempstate5"])
    (tmp_path / "ckpt").mkdir()
    os.symlink(str(tmp_path / "elsewhere"), str(tmp_path / "ckpt" / "shard-0-of-1"))
    assert launch.remove_save_temporaries(str(tmp_path / "ckpt")) == []
    assert _listing(tmp_path / "elsewhere") == ["model.ckpt-4.index.tempstate5"]


def test_the_line_names_each_file_removed_and_a_sharded_save_once():
    removed = ["/c/model.ckpt-4.index.tempstate12", "/c/model.ckpt-5_temp/part-00000-of-00002.index",
               "/c/model.ckpt-5_temp/part-00001-of-00002.index", "/c/model.ckpt-5_temp",
               "/c/shard-0-of-2/checkpoint.tmp" + _HEX]
    assert checkpoint_files.describe_removed("/c", sorted(removed)) == (
        "removed 4 temporary files of interrupted saves from /c: model.ckpt-4.index.tempstate12, "
        "model.ckpt-5_temp/ (2 part files), shard-0-of-2/checkpoint.tmp" + _HEX)
    assert checkpoint_files.describe_removed("/c", removed[:1]) == (
        "removed 1 temporary file of interrupted saves from /c: model.ckpt-4.index.tempstate12")
    assert checkpoint_files.describe_removed("/c", []) is None


def test_other_prefixes_are_those_the_state_files_name(tmp_path):
    _make_files(tmp_path, ["shard-0-of-1/x"])
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "/c/model.ckpt-3"\n'
                                         'all_model_checkpoint_paths: "/c/model.ckpt-3"\n')
    (tmp_path / "shard-0-of-1" / "checkpoint").write_text('model_checkpoint_path: "ckpt-7"\n')
    assert checkpoint_files.other_prefixes(str(tmp_path), "model.ckpt") == ["ckpt"]
    assert checkpoint_files.other_prefixes(str(tmp_path), "ckpt") == ["model.ckpt"]


@pytest.mark.parametrize("prefix", [None, "eval.ckpt"])
def test_a_restart_removes_the_temporaries_of_the_jobs_interrupted_saves_and_says_so(tmp_path, prefix):
    ckpt = tmp_path / "ckpt"
    _make_files(ckpt, _SAVE_FILES)
    (ckpt / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-3"\n')
    args = ["--workers", "1", "--max-restarts", "1", "--grace", "1", "--checkpoint-dir", str(ckpt)]
    status, _, err = _run(args + (["--checkpoint-prefix", prefix] if prefix else []), "last_worker_dies_once",
                          tmp_path)
    assert status == 0, err
    assert "restart 1 of 1: worker:0 died with signal 9 (SIGKILL); restarting 1 worker from global step 3" in err
    gone = _removed_by(prefix or "model.ckpt")
    assert _listing(ckpt) == sorted(set(_SAVE_FILES) - set(gone))
    said = [line for line in err.splitlines() if "temporary file" in line or "names" in line]
    expected = ["gradaccum.launch: " + checkpoint_files.describe_removed(
        str(ckpt), sorted(os.path.join(str(ckpt), name) for name in gone))]
    if prefix:  # The job's state file names model.ckpt: its temporaries stay, and the launcher says why.
        expected.append("gradaccum.launch: the checkpoint state in %s names model.ckpt, not --checkpoint-prefix "
                        "eval.ckpt: the temporary files of those saves are not deleted" % ckpt)
    assert said == expected


# The chief saves with TensorFlow and is SIGKILLed inside saver.save, while its
# save's temporary files exist; restarted, it lists the checkpoint directory.
_SAVE_TASK = textwrap.dedent("""
    import os, signal, sys, threading, time
    ckpt, sharded = sys.argv[1], sys.argv[2] == "sharded"
    marker = os.path.join(os.path.dirname(ckpt), "killed")
    if os.path.exists(marker):
        listed = [os.path.relpath(os.path.join(folder, name), ckpt)
                  for folder, dirs, files in os.walk(ckpt) for name in dirs + files]
        print("restarted with", " ".join(sorted(listed)))
        sys.exit(0)
    import tensorflow as tf

    def ours():
        names = [name for name in os.listdir(ckpt) if name.startswith("model.ckpt-")]
        for name in list(names):  # A sharded save's directory, model.ckpt-<step>_temp*/.
            if os.path.isdir(os.path.join(ckpt, name)):
                names += [name + "/" + part for part in os.listdir(os.path.join(ckpt, name))]
        return names

    def kill_inside_the_save():
        while True:
            try:
                names = [name for name in ours() if ".tempstate" in name]
            except OSError:  # A directory went while it was listed.
                continue
            if names:
                print("killed while", " ".join(names), "existed", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.0002)

    with tf.Graph().as_default():
        tf.compat.v1.get_variable("weights", initializer=tf.zeros([4000000]))
        saver = tf.compat.v1.train.Saver(sharded=sharded)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            saver.save(sess, os.path.join(ckpt, "model.ckpt"), global_step=1)
            open(marker, "w").close()
            threading.Thread(target=kill_inside_the_save, daemon=True).start()
            for step in range(2, 200):
                saver.save(sess, os.path.join(ckpt, "model.ckpt"), global_step=step)
    print("never killed")
""")
# What the job did not write: it stays, beside the job's own interrupted save.
_NOT_THE_JOBS = ["notes.tempstate123", "results_temp/part-00000-of-00002.index",
                 "other_job/model.ckpt-9.index.tempstate99", "eval.ckpt-4.index.tempstate7",
                 "model.ckpt2-4.index.tempstate7"]


@pytest.mark.distributed
@pytest.mark.parametrize("save", ["plain", "sharded"])
def test_a_chief_killed_inside_saver_save_restarts_with_its_temporaries_removed_and_no_other_file(tmp_path, save):
    ckpt, script = tmp_path / "ckpt", tmp_path / "save_task.py"
    _make_files(ckpt, _NOT_THE_JOBS)
    script.write_text(_SAVE_TASK)
    out, err = io.BytesIO(), io.StringIO()
    status = launch.main(["--workers", "1", "--max-restarts", "1", "--checkpoint-dir", str(ckpt), "--",
                          sys.executable, str(script), str(ckpt), save], stdout=out, stderr=err)
    out, err = out.getvalue().decode(), err.getvalue()
    assert status == 0, out[-2000:] + err
    assert "restart 1 of 1: worker:0 died with signal 9 (SIGKILL); restarting 1 worker from global step 1" in err
    interrupted = re.search(r"^\[worker:0\] killed while (.*) existed$", out, re.M).group(1).split()
    listed = re.search(r"^\[worker:0\] restarted with (.*)$", out, re.M).group(1).split()
    assert interrupted and not set(interrupted) & set(listed)
    assert not [name for name in listed if name.startswith("model.ckpt-") and (".tempstate" in name or "_temp" in name
                                                                             or ".tmp" in name)], listed
    assert {"checkpoint", "model.ckpt-1.index", "model.ckpt-1.data-00000-of-00001"} <= set(listed)
    assert set(_NOT_THE_JOBS) <= set(listed)
    removed = [line for line in err.splitlines() if "temporary file" in line]
    assert len(removed) == 1, err
    named = re.search(r"of interrupted saves from %s: (.*)$" % re.escape(str(ckpt)), removed[0]).group(1)
    assert all(name.split("/")[0] in named for name in interrupted), (named, interrupted)
    _assert_all_gone(_started_pids(err))
