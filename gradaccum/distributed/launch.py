"""One-machine launcher for a multi-process TensorFlow job.

Usage (``gradaccum-launch`` is the same command)::

    python -m gradaccum.launch --workers P [--ps N] [--verbose] -- python script.py args

starts ``P`` worker processes (``worker:0`` is the chief) and ``N`` ps
processes of the same command, each with its own ``TF_CONFIG`` on free
loopback ports, and prefixes every line they print with ``[worker:1]``. The
collective engine needs no ps task (``--ps 0``, the default). TensorFlow's
log noise (C++ log lines, the absl notice, ``WARNING:tensorflow`` deprecation
blocks, ``tf.compat.v1.layers`` deprecation warnings) is left out of that
output unless ``--verbose`` (which also leaves ``TF_CPP_MIN_LOG_LEVEL``
alone; otherwise the tasks get ``2`` unless it is set).

Exit status: the chief's, when the job ends without a failure. When a task
ends with a non-zero status, the launcher names in one line the task that
failed first, the root cause, and its status (the others' collectives fail
some milliseconds after a task dies: those echoes are not named), stops the
others (SIGTERM, then SIGKILL after ``--grace`` seconds) and exits with the
root cause's status, whichever task it is (128 + N for a signal N, as a
shell reports it: 137 for SIGKILL). The root cause is the task that ended
first, except that a task killed by a signal counts as first when it ended
within 0.1 s of the first failure (a signal comes from outside the job,
never as an echo). Each task is reaped by a thread that records when it
ended, and once the launcher sees a failure it waits until 0.1 s (and a
little more, for those threads) after it before deciding, from the recorded
times only: the answer does not depend on when the launcher looked.

With ``--max-restarts N`` the launcher then restarts the whole job instead,
on fresh ports, up to N times: with the same number of workers, or with
``--min-workers M`` one worker fewer each time a task dies, never below M.
The tasks resume from their last checkpoint (see ``gradaccum.membership``);
one line per restart names the root cause, its status, the number of
workers now and, with ``--checkpoint-dir``, the global step of the newest
checkpoint there. After N restarts it gives up with the status above.

After a failure, with ``--checkpoint-dir DIR``, the launcher deletes the
temporary files that the job's saves interrupted by the failure left in DIR
and in its ``shard-<r>-of-<P>/`` directories: only TensorFlow's temporary
names for the job's checkpoint prefix (``--checkpoint-prefix``,
``model.ckpt`` by default), nothing in any other directory (see
:mod:`gradaccum.distributed.checkpoint_files`), and says in one line what
it deleted. When the job's ``checkpoint`` state file names another prefix,
it says so in one line instead of guessing.

Each task runs in its own process group, which is killed on every way out
(normal exit, signal, exception, and via ``atexit``), and the launcher
returns only once every process of those groups has ended (a task's own
children included); on Linux a task also gets SIGKILL when the launcher
itself is killed. Every wait is bounded.

TensorFlow's gRPC server listens on every interface of the machine
(``0.0.0.0``), whatever host ``TF_CONFIG`` names, and has no option to
listen on one address only (TF 1.15 to 2.x). So when the machine has a
network interface other than loopback the launcher says once, on stderr,
that the tasks' ports are open there and how to close them;
``--no-port-warning`` leaves that line out.

This module does not use TensorFlow and creates no variables or collections.
"""
import argparse
import atexit
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

from gradaccum.distributed import tfconfig
from gradaccum.distributed.checkpoint_files import describe_removed, newest_checkpoint_step, other_prefixes
from gradaccum.distributed.checkpoint_files import check_prefix, remove_save_temporaries

_PREFIX = "gradaccum.launch: "
_USAGE = "python -m gradaccum.launch --workers P [--ps N] [--host H] [--grace S] [--shutdown-timeout S] " \
         "[--max-restarts N [--min-workers M] [--checkpoint-dir DIR [--checkpoint-prefix NAME]]] [--verbose] " \
         "[--no-port-warning] -- COMMAND [ARG ...]"
_EPILOG = ("Exit status: the chief's when the job ends without a failure; when a task fails, that of the task "
           "that failed first (128 + N for a signal N; a task killed by a signal within 0.1 s of the first "
           "failure counts as first). With --max-restarts and --checkpoint-dir, the launcher deletes files: see "
           "--checkpoint-dir.")
_IFF_UP, _IFF_LOOPBACK = 0x1, 0x8  # Linux's interface flags, as /sys/class/net/<name>/flags shows them.
# TensorFlow's log noise: C++ log lines (absl and TF 1.15 formats; fatal ones are
# kept), the absl notice, Python-side TF and absl warnings, deprecation warnings.
_NOISE = re.compile(
    rb"^(?:[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] "
    rb"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] \S+:\d+\] "
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    rb"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags"
    rb"|WARNING:(?:tensorflow|absl):"
    rb"|\S+\.py:\d+: (?:User|Deprecation|Future)Warning: .*deprecat)", re.IGNORECASE)
_POLL_SECONDS = 0.1
# A task killed by a signal up to this long after the first failure is the root cause.
_BLAME_WINDOW_SECONDS = 0.1
# How long past the window the launcher still waits before deciding: a reaping thread
# records a task's end a little after it (a busy machine delays threads).
_SETTLE_SECONDS = 0.05
_PR_SET_PDEATHSIG = 1


def pick_free_ports(count, host="127.0.0.1"):
    """Returns ``count`` distinct ports that were free on ``host`` a moment ago.

    All sockets are held open together, so the ports differ; they are closed
    before returning, so another process could still take one (rare).

    Args:
      count: how many ports, an int >= 1.
      host: the interface to bind.

    Returns:
      A list of ints.

    Raises:
      ValueError: when ``count`` is not an int >= 1.

    Example:
      >>> pick_free_ports(2)
      [40211, 37915]
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError("`count` must be an int >= 1, got %r" % (count,))
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def build_cluster(workers, ps, host, ports):
    """Builds the ``cluster`` part of ``TF_CONFIG`` for one machine.

    Args:
      workers: number of worker tasks (>= 1); ``worker:0`` is the chief.
      ps: number of ps tasks (>= 0).
      host: the host of every address.
      ports: ``workers + ps`` ports, workers first.

    Returns:
      A dict such as ``{"worker": ["127.0.0.1:4001"], "ps": ["127.0.0.1:4002"]}``.

    Raises:
      ValueError: when the counts or the number of ports are wrong.

    Example:
      >>> build_cluster(2, 0, "127.0.0.1", [4001, 4002])
      {'worker': ['127.0.0.1:4001', '127.0.0.1:4002']}
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError("`workers` must be an int >= 1, got %r" % (workers,))
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
        raise ValueError("`ps` must be an int >= 0, got %r" % (ps,))
    if len(ports) != workers + ps:
        raise ValueError("`ports` must hold %d ports, got %r" % (workers + ps, ports))
    addresses = ["%s:%d" % (host, port) for port in ports]
    cluster = {"worker": addresses[:workers]}
    if ps:
        cluster["ps"] = addresses[workers:]
    return cluster


def tf_config_for(cluster, job, index):
    """Returns the ``TF_CONFIG`` JSON of task ``job:index`` of ``cluster``.

    Args:
      cluster: as returned by :func:`build_cluster`.
      job: ``"worker"`` or ``"ps"``.
      index: the task's index in its job.

    Returns:
      A JSON string, as :func:`gradaccum.cluster.make_tf_config` builds it.

    Example:
      >>> tf_config_for({"worker": ["127.0.0.1:4001"]}, "worker", 0)
      '{"cluster": {"worker": ["127.0.0.1:4001"]}, "task": {"type": "worker", "index": 0}}'
    """
    return tfconfig.tf_config_json(cluster, job, index)


def _interface_flags(name):
    try:
        with open("/sys/class/net/%s/flags" % name) as handle:
            return int(handle.read().strip(), 16)
    except (OSError, ValueError):
        return None


def non_loopback_interfaces():
    """Names of this machine's network interfaces that are up and not loopback.

    Read from ``/sys/class/net`` on Linux; elsewhere every interface not
    named ``lo*`` counts.

    Returns:
      A sorted list of names, such as ``["eth0"]``; empty on a machine that
      only has loopback.

    Example:
      >>> non_loopback_interfaces()
      ['eth0']
    """
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        return []
    found = []
    for name in names:
        flags = _interface_flags(name)
        if (not name.startswith("lo")) if flags is None else (flags & _IFF_UP and not flags & _IFF_LOOPBACK):
            found.append(name)
    return sorted(found)


def port_warning(cluster, interfaces):
    """The one line that says the tasks' ports are open beyond loopback, or None.

    Args:
      cluster: as returned by :func:`build_cluster`.
      interfaces: the names from :func:`non_loopback_interfaces`.

    Returns:
      A one-line string, or None when ``interfaces`` is empty.

    Example:
      >>> port_warning({"worker": ["127.0.0.1:4001"]}, ["eth0"])[:44]
      'warning: TensorFlow listens on every interfa'
    """
    if not interfaces:
        return None
    tasks = tfconfig.tasks(cluster, ("worker", "ps"))
    ports = ", ".join(cluster[job][index].rpartition(":")[2] for job, index in tasks)
    return ("warning: TensorFlow listens on every interface, not only the --host address: the tasks' ports "
            "(%s) are open on %s too, without authentication, and whoever reaches them can run any op in "
            "the tasks; close them with a firewall or keep the machine on a private network "
            "(--no-port-warning hides this line)" % (ports, ", ".join(interfaces)))


def describe_status(returncode):
    """Says how a process ended, for a one-line message.

    Args:
      returncode: ``Popen.returncode`` (negative: killed by that signal).

    Returns:
      ``"exit status 3"`` or ``"signal 9 (SIGKILL)"``.

    Example:
      >>> describe_status(-15)
      'signal 15 (SIGTERM)'
    """
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return "signal %d (%s)" % (-returncode, name)
    return "exit status %s" % (returncode,)


def shell_status(returncode):
    """Maps ``Popen.returncode`` to a shell exit status (a signal N gives 128 + N).

    Args:
      returncode: ``Popen.returncode``.

    Returns:
      An int in 0..255.

    Example:
      >>> shell_status(-9)
      137
    """
    return 128 - returncode if returncode < 0 else min(returncode, 255)


def root_cause_first(failures, window=_BLAME_WINDOW_SECONDS):
    """Orders failed tasks so that the one that failed first, the root cause, leads.

    The others usually failed because of it: when a task dies, the others'
    collectives fail some milliseconds later and they exit with an error. So
    the order is the order of their ends, except that a task killed by a
    signal goes first when it ended within ``window`` seconds of the first
    (a signal comes from outside the job, never as an echo of a failed peer,
    and the times are taken by threads that wake up a little late). The
    answer depends on the times only: the launcher calls it once the window
    after the first failure has passed.

    Args:
      failures: ``(task, returncode, ended_at)`` tuples: any task object, its
        ``Popen.returncode`` (negative: killed by that signal) and the
        ``time.monotonic()`` at which it ended.
      window: seconds, >= 0.

    Returns:
      The same tuples, the root cause first.

    Example:
      >>> root_cause_first([("worker:1", 1, 10.034), ("worker:0", -9, 10.0)])[0]
      ('worker:0', -9, 10.0)
    """
    ordered = sorted(failures, key=lambda failure: failure[2])
    signalled = [failure for failure in ordered if failure[1] < 0 and failure[2] - ordered[0][2] <= window]
    if signalled:
        ordered.remove(signalled[0])
        ordered.insert(0, signalled[0])
    return ordered


class NoiseFilter(object):
    """Tells which lines of one task's output are TensorFlow's log noise.

    A noise line starts a block: a ``WARNING:tensorflow`` deprecation's
    ``Instructions for updating:`` line and the line after it, the source line
    Python's ``warnings`` prints after a deprecation warning, and blank lines
    right after noise belong to it.

    Example:
      >>> keep = NoiseFilter()
      >>> keep(b"W0000 00:00:1.0  7 port.cc:1] oneDNN custom operations are on\\n")
      False
    """

    def __init__(self):
        self._after = b""  # What the previous line was: b"", b"noise", b"warning", b"instructions".

    def __call__(self, line):
        """Returns True when ``line`` (bytes, with or without newline) is to be printed."""
        text = line.rstrip(b"\r\n")
        after, self._after = self._after, b""
        if _NOISE.match(text):
            self._after = b"warning" if b"Warning: " in text else b"noise"
            return False
        if after == b"instructions" or (after == b"warning" and text.startswith(b"  ")):
            self._after = b"noise"
            return False
        if after in (b"noise", b"warning") and (text == b"Instructions for updating:" or not text.strip()):
            self._after = b"instructions" if text else b"noise"
            return False
        return True


def copy_prefixed(source, sink, prefix, lock, keep=None):
    """Copies ``source`` to ``sink`` line by line, each line after ``prefix``.

    A last line without a newline gets one, so prefixes always start a line.
    When ``sink`` breaks (a closed pipe), reading goes on without writing, so
    the task never blocks on a full pipe.

    Args:
      source: a binary stream to read until EOF (a task's stdout).
      sink: a binary stream to write to; flushed after each line.
      prefix: bytes put before every line, e.g. ``b"[worker:1] "``.
      lock: a ``threading.Lock`` shared by all writers of ``sink``.
      keep: None (every line), or a callable ``line -> bool`` such as a
        :class:`NoiseFilter`.

    Example:
      >>> copy_prefixed(process.stdout, sys.stdout.buffer, b"[worker:1] ", lock)
    """
    writing = True
    for line in iter(source.readline, b""):
        if keep is not None and not keep(line):
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            try:
                if writing:
                    sink.write(prefix + line)
                    sink.flush()
            except (OSError, ValueError):  # Closed or broken sink: keep draining.
                writing = False


def _find_prctl():
    """Returns libc's ``prctl`` on Linux, else None (the group kill still applies)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


# Looked up once in the parent: the forked child only calls it (no dlopen after fork).
_PRCTL = _find_prctl()


def _die_with_parent():
    """Runs in the child before exec: SIGKILL it when the launcher dies."""
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _group_alive(pgid):
    """True while a process of group ``pgid`` lives; zombies do not count.

    A task's children outlive it for a moment after a group kill, and the
    launcher must not return before they are gone. Orphaned zombies are left
    for init to reap (in a container it may never), so ``killpg(pgid, 0)``
    alone would wait for ever: on Linux /proc tells the states apart.
    """
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    if not os.path.isdir("/proc"):
        return True
    for entry in os.listdir("/proc"):
        try:
            with open("/proc/%s/stat" % entry) as handle:
                fields = handle.read().rsplit(")", 1)[1].split()  # The name may hold spaces.
        except (OSError, IndexError):
            continue  # Not a process, or gone meanwhile.
        if fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _wait_until(done, seconds):
    """Polls ``done()`` until it is true (returns True) or ``seconds`` pass (False)."""
    deadline = time.time() + seconds
    while not done():
        if time.time() >= deadline:
            return False
        time.sleep(_POLL_SECONDS)
    return True


class _Task(object):
    """One started process, its name, its output pump and the time it ended."""

    def __init__(self, name, command, env):
        self.name = name
        self.process = subprocess.Popen(
            command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=_die_with_parent if _PRCTL is not None else None)
        self.pump = None
        self.ended_at = None  # time.monotonic() when the waiter reaped the process.

    def start_waiter(self):
        """Reaps the process in a thread as soon as it exits, and records when.

        A poll every 0.1 s cannot tell which of two tasks that ended 30 ms apart
        ended first; a thread blocked in ``wait`` for each task can. It waits
        for this pid only, so other children of the launcher's process are
        left alone (``Popen.poll`` meanwhile returns None, then the status).
        """
        def wait():
            self.process.wait()
            self.ended_at = time.monotonic()

        waiter = threading.Thread(target=wait, name="wait-" + self.name)
        waiter.daemon = True
        waiter.start()

    def start_pump(self, sink, lock, quiet=True):
        keep = NoiseFilter() if quiet else None
        self.pump = threading.Thread(target=copy_prefixed, name="pump-" + self.name,
                                     args=(self.process.stdout, sink, ("[%s] " % self.name).encode(), lock, keep))
        self.pump.daemon = True
        self.pump.start()

    def signal_group(self, signum):
        try:
            os.killpg(self.process.pid, signum)  # The group outlives its leader's exit.
        except (ProcessLookupError, PermissionError):
            pass

    def ended(self):
        """True when the task's process has exited (it is reaped)."""
        return self.process.poll() is not None

    def gone(self):
        """True when the task's process and every process of its group have ended."""
        return self.ended() and not _group_alive(self.process.pid)


class Launcher(object):
    """Starts the tasks of one job and supervises them until the job ends.

    Args:
      command: the argv list every task runs.
      workers: number of worker tasks (``worker:0`` is the chief).
      ps: number of ps tasks.
      host: the address the tasks reach each other at (TensorFlow listens on
        every interface whatever it is).
      grace_seconds: SIGTERM-to-SIGKILL delay when stopping tasks.
      shutdown_seconds: how long the other tasks may run after the chief ended.
      stdout: binary stream for the tasks' prefixed output.
      stderr: text stream for the launcher's own one-line messages.
      verbose: when False, TensorFlow's log noise is left out of the tasks'
        output and ``TF_CPP_MIN_LOG_LEVEL`` defaults to 2 in their environment.
      max_restarts: None (a task that dies ends the job), or how many times
        the whole job restarts on fresh ports when a task dies.
      min_workers: None (restart with as many workers), or the fewest workers
        to restart with: each restart has one worker fewer, down to this.
      checkpoint_dir: where the job saves: a restart line names its newest
        step, and after a failure the temporary files of the job's
        interrupted saves there are deleted (see
        :func:`gradaccum.distributed.checkpoint_files.remove_save_temporaries`).
      checkpoint_prefix: the file name the job's ``Saver`` saves under in
        ``checkpoint_dir`` (``model.ckpt`` for ``model.ckpt-<step>``): only
        the temporary files of saves under it are deleted.

    Example:
      >>> status = Launcher(["python", "train.py"], workers=2, ps=0).run()
    """

    def __init__(self, command, workers, ps=0, host="127.0.0.1", grace_seconds=5.0,
                 shutdown_seconds=15.0, stdout=None, stderr=None, verbose=False, max_restarts=None,
                 min_workers=None, checkpoint_dir=None, checkpoint_prefix="model.ckpt"):
        self.command = list(command)
        self.verbose = verbose
        self.ps, self.host = ps, host
        self.cluster = build_cluster(workers, ps, host, pick_free_ports(workers + ps, host))
        self.max_restarts, self.min_workers, self.checkpoint_dir = max_restarts, min_workers, checkpoint_dir
        check_prefix(checkpoint_prefix)  # Refused now, not after the job's first failure.
        self.checkpoint_prefix = checkpoint_prefix
        self._named_other_prefixes = False
        self.restarts = 0
        self.died = None  # The (task, returncode) that ended the last attempt (the root cause), if a task died.
        self.grace_seconds = grace_seconds
        self.shutdown_seconds = shutdown_seconds
        self.stdout = stdout if stdout is not None else sys.stdout.buffer
        self.stderr = stderr if stderr is not None else sys.stderr
        self.tasks = []
        self.received = None
        self._lock = threading.Lock()

    def say(self, message):
        """Writes one launcher line to ``stderr``."""
        with self._lock:
            self.stderr.write(_PREFIX + message + "\n")
            self.stderr.flush()

    def start(self):
        """Starts every task; pumps start after all forks (``preexec_fn`` and threads do not mix)."""
        for job, index in tfconfig.tasks(self.cluster, ("worker", "ps")):
            env = dict(os.environ, TF_CONFIG=tf_config_for(self.cluster, job, index), PYTHONUNBUFFERED="1")
            if not self.verbose:
                env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
            task = _Task("%s:%d" % (job, index), self.command, env)
            self.tasks.append(task)
            self.say("started %s (pid %d) at %s" % (task.name, task.process.pid, self.cluster[job][index]))
        for task in self.tasks:
            task.start_pump(self.stdout, self._lock, quiet=not self.verbose)
            task.start_waiter()

    def stop(self, tasks=None):
        """SIGTERM to every task's process group, SIGKILL after the grace period."""
        tasks = self.tasks if tasks is None else tasks
        for signum, wait in ((signal.SIGTERM, self.grace_seconds), (signal.SIGKILL, 5.0)):
            for task in tasks:
                task.signal_group(signum)
            if _wait_until(lambda: all(task.gone() for task in tasks), wait):
                break
        for task in self.tasks:
            if task.pump is not None:
                task.pump.join(2.0)  # A grandchild may hold the pipe: bounded.

    def _failures(self):
        """The tasks that ended with a non-zero status, as (task, returncode, ended_at), the root cause first."""
        return root_cause_first([(task, task.process.returncode, task.ended_at) for task in self.tasks
                                 if task.ended_at is not None and task.process.returncode != 0])

    def supervise(self):
        """Waits for the job to end; returns the launcher's exit status."""
        chief = self.tasks[0]
        while True:
            if self.received is not None:
                self.say("received %s; stopping all tasks" % signal.Signals(self.received).name)
                self.stop()
                return 128 + self.received
            failures = self._failures()
            if failures:  # Before the chief's normal end: a task that failed meanwhile is a failure of the job.
                return self._fail(self._settled_failures(failures))
            if chief.ended_at is not None:
                return self._finish(chief)
            time.sleep(_POLL_SECONDS)

    def _settled_failures(self, failures):
        """All failures once the blame window after the first has passed, the root cause first.

        A task killed by a signal up to the window after the first failure is
        the root cause. Deciding as soon as the first failure is seen would
        depend on where in its poll the launcher saw it; waiting the window,
        then deciding from the recorded ends, does not.
        """
        first = min(ended_at for _, _, ended_at in failures)
        delay = first + _BLAME_WINDOW_SECONDS + _SETTLE_SECONDS - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return self._failures()

    def _fail(self, failures):
        """Names the root cause of ``failures`` in one line and stops the other tasks.

        The tasks that failed after it are left out: they failed because of
        it, and naming them sends an operator after the wrong task.

        Returns:
          The root cause's shell status (128 + the signal's number for a
          signal, as a shell reports it), whichever task it is: a chief that
          failed because another task did must not pass on its echo.
        """
        (root, status, _), chief = failures[0], self.tasks[0]
        if root is chief:
            self.say("chief %s (pid %d) ended with %s; stopping the other tasks"
                     % (root.name, root.process.pid, describe_status(status)))
        else:
            self.say("%s (pid %d) died with %s; stopping the other tasks"
                     % (root.name, root.process.pid, describe_status(status)))
        self.died = (root, status)
        self.stop()
        return shell_status(status)

    def _finish(self, chief):
        status = chief.process.returncode
        others = self.tasks[1:]
        if status != 0:  # The chief ended between _failures() and here.
            return self._fail(self._settled_failures(self._failures()))
        if not _wait_until(lambda: all(task.ended() for task in others), self.shutdown_seconds):
            late = [t.name for t in others if not t.ended()]
            self.say("%s still running %g s after the chief finished; stopping them"
                     % (", ".join(late), self.shutdown_seconds))
        self.stop()
        return shell_status(status)

    def run(self):
        """Starts, supervises (restarting when asked to) and always cleans up; returns the exit status."""
        atexit.register(self._kill_all)
        try:
            while True:
                self.died = None
                self.start()
                status = self.supervise()
                if self.died is None or self.received is not None or self.max_restarts is None:
                    return status
                if self.checkpoint_dir is not None:  # Every task has ended: no save is in progress.
                    self._remove_save_temporaries()
                if self.restarts >= self.max_restarts:
                    self.say("giving up: %s died with %s after %d restart%s"
                             % (self.died[0].name, describe_status(self.died[1]), self.restarts,
                                "" if self.restarts == 1 else "s"))
                    return status
                self._restart()
        finally:
            self._kill_all()
            atexit.unregister(self._kill_all)

    def _remove_save_temporaries(self):
        """Deletes what the job's interrupted saves left in its checkpoint directory; says what in one line."""
        removed = remove_save_temporaries(self.checkpoint_dir, self.checkpoint_prefix)
        line = describe_removed(self.checkpoint_dir, removed)
        if line is not None:
            self.say(line)
        others = [] if self._named_other_prefixes else other_prefixes(self.checkpoint_dir, self.checkpoint_prefix)
        if others:  # Said once: the job may save under a prefix the launcher was not told.
            self._named_other_prefixes = True
            self.say("the checkpoint state in %s names %s, not --checkpoint-prefix %s: the temporary files of "
                     "those saves are not deleted" % (self.checkpoint_dir, ", ".join(others),
                                                       self.checkpoint_prefix))

    def _restart(self):
        """Builds the next attempt's cluster (fresh ports, perhaps one worker fewer) and says so in one line."""
        self.restarts += 1
        workers = len(self.cluster["worker"])
        if self.min_workers is not None:
            workers = max(self.min_workers, workers - 1)
        self.cluster = build_cluster(workers, self.ps, self.host, pick_free_ports(workers + self.ps, self.host))
        self.tasks = []
        step = newest_checkpoint_step(self.checkpoint_dir) if self.checkpoint_dir else None
        where = ("from the newest checkpoint" if self.checkpoint_dir is None
                 else "from global step %d" % step if step is not None else "from the start (no checkpoint yet)")
        task, returncode = self.died
        self.say("restart %d of %d: %s died with %s; restarting %d worker%s %s"
                 % (self.restarts, self.max_restarts, task.name, describe_status(returncode), workers,
                    "" if workers == 1 else "s", where))

    def _kill_all(self):
        for task in self.tasks:
            task.signal_group(signal.SIGKILL)
        _wait_until(lambda: all(task.gone() for task in self.tasks), 5.0)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, "%serror: %s; usage: %s\n" % (_PREFIX, message, _USAGE))


def parse_args(argv):
    """Parses the launcher's command line.

    Args:
      argv: the arguments after the program name.

    Returns:
      An ``argparse.Namespace`` with ``workers``, ``ps``, ``host``, ``grace``, ``verbose``,
      ``shutdown_timeout``, ``no_port_warning``, ``max_restarts``, ``min_workers``,
      ``checkpoint_dir``, ``checkpoint_prefix`` and ``command`` (a non-empty list).

    Raises:
      SystemExit: with status 2 and one error line for bad arguments.

    Example:
      >>> parse_args(["--workers", "2", "--", "python", "train.py"]).command
      ['python', 'train.py']
    """
    parser = _OneLineParser(prog="python -m gradaccum.launch", usage=_USAGE, epilog=_EPILOG,
                            description="Run one TensorFlow job as several local processes.")
    parser.add_argument("--workers", type=int, metavar="P", required=True,
                        help="worker processes; worker:0 is the chief")
    parser.add_argument("--ps", type=int, metavar="N", default=0, help="parameter-server processes (default 0)")
    parser.add_argument("--host", default="127.0.0.1", metavar="H",
                        help="address the tasks reach each other at (TensorFlow listens on every interface)")
    parser.add_argument("--grace", type=float, metavar="S", default=5.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--verbose", action="store_true", help="keep TensorFlow's log noise in the output")
    parser.add_argument("--shutdown-timeout", type=float, metavar="S", default=15.0,
                        help="seconds the other tasks may run after the chief ended")
    parser.add_argument("--no-port-warning", action="store_true",
                        help="do not warn that the tasks' ports are open on every interface")
    parser.add_argument("--max-restarts", type=int, metavar="N", default=None,
                        help="restart the whole job up to N times when a task dies (default: never)")
    parser.add_argument("--min-workers", type=int, metavar="M", default=None,
                        help="with --max-restarts: one worker fewer per restart, never below M")
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="with --max-restarts: the job's checkpoint directory; a restart names its newest "
                             "step, and after a failure the launcher deletes there (and in its shard-<r>-of-<P>/ "
                             "directories, nowhere else) TensorFlow's temporary files of the job's interrupted "
                             "saves under --checkpoint-prefix, and says which in one line")
    parser.add_argument("--checkpoint-prefix", default=None, metavar="NAME",
                        help="with --checkpoint-dir: the file name the job saves under there, without -<step> "
                             "(default model.ckpt); other prefixes' files are never deleted")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every task runs")
    args = parser.parse_args(argv)
    _check_restarts(parser, args)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: put it after `--`, e.g. -- python train.py")
    if args.workers < 1 or args.ps < 0:
        parser.error("`--workers` must be >= 1 and `--ps` >= 0, got %d and %d" % (args.workers, args.ps))
    if not 0 < args.grace <= 30 or not 0 <= args.shutdown_timeout <= 600:
        parser.error("`--grace` must be in (0, 30] and `--shutdown-timeout` in [0, 600], got %s and %s"
                     % (args.grace, args.shutdown_timeout))
    args.command = command
    return args


def _check_restarts(parser, args):
    """One usage line for restart flags that do not fit together; sets the default checkpoint prefix."""
    if args.max_restarts is None:
        if args.min_workers is not None or args.checkpoint_dir is not None:
            parser.error("`--min-workers` and `--checkpoint-dir` need `--max-restarts`")
    if args.checkpoint_prefix is not None and args.checkpoint_dir is None:
        parser.error("`--checkpoint-prefix` needs `--checkpoint-dir`")
    args.checkpoint_prefix = "model.ckpt" if args.checkpoint_prefix is None else args.checkpoint_prefix
    try:
        check_prefix(args.checkpoint_prefix)
    except ValueError:
        parser.error("`--checkpoint-prefix` must be a file name without a directory, such as model.ckpt, got %r"
                     % args.checkpoint_prefix)
    if args.max_restarts is None:
        return
    if args.max_restarts < 0:
        parser.error("`--max-restarts` must be >= 0, got %d" % args.max_restarts)
    if args.min_workers is not None and not 1 <= args.min_workers <= args.workers:
        parser.error("`--min-workers` must be in [1, --workers] = [1, %d], got %d"
                     % (args.workers, args.min_workers))


def _install_handlers(launcher):
    """Records SIGINT/SIGTERM/SIGHUP for the supervise loop; returns the old handlers."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def record(signum, _frame):
        launcher.received = signum

    return {signum: signal.signal(signum, record) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}


def main(argv=None, stdout=None, stderr=None):
    """Runs the launcher; returns its exit status (the chief's, or the root cause's when a task fails).

    Args:
      argv: command-line arguments, ``sys.argv[1:]`` by default.
      stdout: binary stream for the tasks' output (default: ``sys.stdout.buffer``).
      stderr: text stream for the launcher's messages (default: ``sys.stderr``).

    Returns:
      The exit status.

    Example:
      >>> main(["--workers", "2", "--", "python", "examples/parabola_sync.py"])
      0
    """
    args = parse_args(sys.argv[1:] if argv is None else argv)
    launcher = Launcher(args.command, args.workers, args.ps, args.host, args.grace, args.shutdown_timeout,
                        stdout=stdout, stderr=stderr, verbose=args.verbose, max_restarts=args.max_restarts,
                        min_workers=args.min_workers, checkpoint_dir=args.checkpoint_dir,
                        checkpoint_prefix=args.checkpoint_prefix)
    warning = None if args.no_port_warning else port_warning(launcher.cluster, non_loopback_interfaces())
    if warning is not None:
        launcher.say(warning)
    previous = _install_handlers(launcher)
    try:
        return launcher.run()
    except OSError as exc:  # The command cannot be started: one line, not a traceback.
        # os.strerror: Python 3.7 appends the file name to exc.strerror.
        launcher.say("cannot start %r: %s" % (args.command[0], os.strerror(exc.errno) if exc.errno else exc))
        return 127
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)

