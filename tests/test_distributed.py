"""Multi-process tests: examples/parabola_sync.py under gradaccum.launch, on loopback.

The reference is the single-process, full-batch run of the same example (the
seed's plain graph, no towers), run in this process. Every launch is a
subprocess with a timeout; every test checks that no process it started is
left. Run only these with ``-m distributed``, skip them with
``-m "not distributed"``.
"""
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from gradaccum._compat import tf
import forkserver

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLE = os.path.join(_ROOT, "examples", "parabola_sync.py")
_WEIGHTS = ["hidden__weights", "hidden__biases", "output__weights", "output__biases"]
_STEPS = 150
_RUN_TIMEOUT = 150


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    env.pop("TF_CONFIG", None)
    return env


# `-m gradaccum.launch` loads no TensorFlow (the package imports lazily).
_LAUNCH_MODULE = [sys.executable, "-m", "gradaccum.launch"]


def _command(workers, args, ps=0, launcher_args=(), python=None):
    """The launcher's command line; its tasks fork from one TensorFlow import unless ``python`` is given."""
    python = forkserver.command() if python is None else python
    return (_LAUNCH_MODULE + ["--workers", str(workers), "--ps", str(ps)] + list(launcher_args)
            + ["--"] + python + [_EXAMPLE] + args)


def _descendants(pid):
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _assert_gone(pids):
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    assert left == []


class _Job(object):
    """A launcher subprocess whose output lines are collected by threads."""

    def __init__(self, workers, args, ps=0, launcher_args=(), command=None, python=None):
        command = _command(workers, args, ps, launcher_args, python) if command is None else command
        self.process = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, universal_newlines=True)
        self.lines = queue.Queue()
        self.out, self.err = [], []
        self.pids = set()
        self._readers = [self._read(self.process.stdout, self.out), self._read(self.process.stderr, self.err)]

    def _read(self, stream, store):
        def pump():
            for line in stream:
                store.append(line)
                self.lines.put(line)
        thread = threading.Thread(target=pump)
        thread.daemon = True
        thread.start()
        return thread

    def wait_for_line(self, pattern, timeout):
        """Returns the first match of ``pattern`` in a new line, or fails at the deadline."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            self.pids.update(_descendants(self.process.pid))
            try:
                match = re.search(pattern, self.lines.get(timeout=0.2))
            except queue.Empty:
                continue
            if match:
                return match
        self.kill()
        pytest.fail("no line matching %r within %s s; stderr: %s" % (pattern, timeout, "".join(self.err)[-2000:]))

    def wait(self, timeout):
        """Waits for the launcher; returns its status (kills it and fails on timeout)."""
        deadline = time.time() + timeout
        while self.process.poll() is None and time.time() < deadline:
            self.pids.update(_descendants(self.process.pid))
            time.sleep(0.1)
        if self.process.poll() is None:
            self.kill()
            for reader in self._readers:
                reader.join(10)
            out, err = self.text()
            pytest.fail("launcher still running after %s s; stdout: %s\nstderr: %s"
                        % (timeout, out[-2000:], err[-4000:]))
        for reader in self._readers:
            reader.join(10)
        return self.process.returncode

    def kill(self):
        for pid in list(self.pids) + [self.process.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(10)

    def text(self):
        return "".join(self.out), "".join(self.err)


def _launch(workers, args, ps=0):
    """Runs a job to its end; returns (stdout, stderr) after checking nothing is left and status 0."""
    job = _Job(workers, args, ps)
    status = job.wait(_RUN_TIMEOUT)
    _assert_gone(job.pids | {job.process.pid})
    out, err = job.text()
    assert status == 0, "stdout: %s\nstderr: %s" % (out[-3000:], err[-3000:])
    return out, err


def _program_of(pid, timeout=30):
    """The pid of the process that runs the program of the task whose process is ``pid``.

    A fresh Python runs it itself. A client of tests/forkserver.py stands in
    for a process forked from the server, which writes to the same standard
    output: that one is what a test stops, as a stand-in cannot pass SIGSTOP on.
    """
    stand_in = [sys.executable, forkserver.command()[1]]
    output = os.readlink("/proc/%d/fd/1" % pid)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if psutil.Process(pid).cmdline()[:2] != stand_in:
            return pid  # A fresh Python (no server, or it fell back to one).
        for proc in psutil.process_iter():
            try:
                if proc.pid != pid and proc.cmdline()[:3] == stand_in + ["--serve"] \
                        and os.readlink("/proc/%d/fd/1" % proc.pid) == output:
                    return proc.pid
            except (psutil.Error, OSError):
                continue  # Gone meanwhile, or not ours to read.
        time.sleep(0.1)
    pytest.fail("no program forked for the stand-in %d within %s s" % (pid, timeout))


def wait_until_gone(pid, seconds):
    """Whether ``pid`` ended (or is a zombie) within ``seconds``, polled every 50 ms."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _stop_and_wait(job, pid, timeout=60):
    """SIGSTOPs the program of the task whose process is ``pid``; returns (status, seconds from the stop to the
    launcher's end, stdout, stderr) after checking that nothing of the job is left, the stopped program included."""
    program = _program_of(pid)
    os.kill(program, signal.SIGSTOP)
    stopped = time.time()
    status = job.wait(timeout)
    elapsed = time.time() - stopped
    # A forked program is not the launcher's descendant: the server kills it once its stand-in is killed.
    wait_until_gone(program, 5)
    _assert_gone(job.pids | {job.process.pid, program})
    out, err = job.text()
    return status, elapsed, out, err


def _assert_matches(run, ref, first_step=0):
    """Loss trajectory and final weights agree with the reference to float32 precision."""
    steps = run["global_steps"]
    np.testing.assert_array_equal(steps, np.arange(first_step, int(run["final_step"])))
    np.testing.assert_allclose(run["losses"], ref["losses"][steps], rtol=1e-5, atol=1e-6)
    for name in _WEIGHTS:
        np.testing.assert_allclose(run[name], ref[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("workers, ps", [
    pytest.param(2, 0, marks=pytest.mark.one_behaviour(reason="the tf2 session runs 3 workers and a ps, the same path")),
    (3, 1)])
def test_workers_match_the_single_process_full_batch_run(workers, ps, parabola_reference, tmp_path):
    out_file = str(tmp_path / "run.npz")
    out, _ = _launch(workers, ["--steps", str(_STEPS), "--out", out_file], ps)
    run, ref = dict(np.load(out_file)), parabola_reference(_STEPS)
    _assert_matches(run, ref)
    assert float(ref["losses"][-1]) < 0.5 * float(ref["losses"][0])  # It does learn.
    # Every worker computed its share: each task's CPU ran ops of the traced loss.
    ran = " ".join(str(d) for d in run["devices"])
    for index in range(workers):
        assert "/job:worker/replica:0/task:%d/" % index in ran
    printed = re.findall(r"^\[worker:0\] global_step (\d+) loss ([\d.]+)$", out, re.M)
    assert [int(step) for step, _ in printed] == list(range(0, _STEPS, 50))
    np.testing.assert_allclose([float(loss) for _, loss in printed], ref["losses"][::50], atol=2e-6)


def test_accumulation_on_top_matches_one_process_on_the_same_batch(parabola_reference, tmp_path):
    out_file = str(tmp_path / "run.npz")
    _launch(2, ["--steps", str(_STEPS), "--accumulate", "2", "--out", out_file])
    _assert_matches(dict(np.load(out_file)), parabola_reference(_STEPS))


@pytest.mark.one_behaviour
def test_killed_worker_stops_the_job_and_a_restart_resumes_from_the_checkpoint(parabola_reference, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    job = _Job(2, ["--steps", "100000", "--checkpoint-dir", ckpt, "--checkpoint-every", "50"])
    worker_pid = int(job.wait_for_line(r"started worker:1 \(pid (\d+)\)", 60).group(1))
    job.wait_for_line(r"^\[worker:0\] saved checkpoint at global_step 100$", 120)
    os.kill(worker_pid, signal.SIGKILL)
    status = job.wait(60)
    _assert_gone(job.pids | {job.process.pid})
    assert status == 137  # As a shell reports the root cause's SIGKILL.
    assert "gradaccum.launch: worker:1 (pid %d) died with signal 9 (SIGKILL); stopping the other tasks\n" \
        % worker_pid in job.text()[1]

    saved = int(re.search(r"-(\d+)$", tf.train.latest_checkpoint(ckpt)).group(1))
    assert saved >= 100 and saved % 50 == 0
    out_file = str(tmp_path / "resumed.npz")
    out, _ = _launch(2, ["--steps", str(saved + 50), "--checkpoint-dir", ckpt, "--out", out_file])
    assert re.search(r"^\[worker:0\] restored global_step %d from .*model\.ckpt-%d$" % (saved, saved), out, re.M)
    _assert_matches(dict(np.load(out_file)), parabola_reference(saved + 50), first_step=saved)


@pytest.mark.one_behaviour
def test_the_chief_closes_its_session_and_ends_when_the_other_tasks_exit_at_once_after_the_stop_signal():
    # A worker and a ps os._exit(0) as soon as cluster.serve returns. The chief closes its session right after
    # StopSignal.send: a task it ran ops on must not exit during that close (TF 1.15 hung in it every time).
    child = os.path.join(_ROOT, "tests", "stop_signal_child.py")
    job = _Job(2, None, command=_LAUNCH_MODULE + ["--workers", "2", "--ps", "1", "--"] + forkserver.command() + [child])
    status = job.wait(60)
    _assert_gone(job.pids | {job.process.pid})
    out, err = job.text()
    assert status == 0, "stdout: %s\nstderr: %s" % (out[-3000:], err[-3000:])
    assert "[worker:0] parts [4.0, 4.0]\n[worker:0] closed, missed: []\n" in out, out
    assert "still running" not in err, err  # The others returned from serve once the chief had ended.


@pytest.mark.one_behaviour
def test_a_stopped_worker_ends_the_in_graph_job_within_the_heartbeat_bound():
    # Session timeouts do not end a chief's run that waits on a stopped worker;
    # the chief's cluster.Heartbeat does, within its timeout + 1 s.
    # The tasks fork from one TensorFlow import; the worker's program, not its stand-in, is stopped.
    job = _Job(2, ["--steps", "100000", "--heartbeat-timeout", "3", "--log-every", "10"],
               launcher_args=["--grace", "1"])
    worker_pid = int(job.wait_for_line(r"started worker:1 \(pid (\d+)\)", 60).group(1))
    job.wait_for_line(r"^\[worker:0\] global_step 20 loss", 120)
    status, elapsed, out, err = _stop_and_wait(job, worker_pid)
    assert status == 75  # The chief's: cluster.HEARTBEAT_EXIT_STATUS.
    assert elapsed < 3 + 1 + 1 + 6, elapsed  # Heartbeat bound, launcher grace, slack for a loaded machine.
    assert re.search(r"^\[worker:0\] gradaccum: worker:0: worker:1 at 127\.0\.0\.1:\d+ has not answered for \d+ s "
                     r"\(heartbeat timeout 3 s\); stopping$", out, re.M), out[-3000:]
    assert "gradaccum.launch: chief worker:0 (pid" in err and "ended with exit status 75" in err
