"""Runs Python programs as ``python program.py`` would, without paying TensorFlow's import each time.

The server is one long-lived child process that imports TensorFlow (and only
that: no behaviour chosen, no Keras loaded, no graph or session made) and then
``os.fork()``s once per program. Each program so starts in a fresh process
state, as if it had run ``import tensorflow`` as its first line: its own
``__main__``, ``sys.argv``, working directory, environment, stdout and stderr
files, exit status (uncaught exception: 1, ``sys.exit(n)``: n), and a timeout
after which its whole process group is killed. Importing TensorFlow costs about
3 s of each docs program's 4 to 8 s on a 2-core machine.

Parent side: ``ForkServer().run(path, cwd, env, timeout)`` returns
``(returncode, stdout, stderr)`` like ``subprocess.run``, or raises
``subprocess.TimeoutExpired``. Where ``os.fork`` is missing (Windows) or the
server dies, ``run`` falls back to a fresh ``python path`` process.

Server side (``python forkserver.py``): one JSON request per line on stdin,
one JSON answer per line on stdout. Python 3.7 syntax: TF 1.15's CI runs it.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

_POLL = 0.02  # Seconds between checks of a running program: short next to a program's seconds.


def _exit_code(status):
    """``subprocess``'s returncode for a ``waitpid`` status: the exit code, or minus the killing signal."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _child(request):
    """In the forked child: becomes ``python <script>`` in a fresh state, runs it, returns its exit code."""
    os.setsid()  # Its own process group: a timeout kills what the program started too.
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    # Python objects above the fds: fresh, as `python script.py` makes them (line-buffered or not alike).
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    script = request["script"]
    sys.argv = [script]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    main = type(sys)("__main__")
    main.__dict__.update(__file__=script, __builtins__=__builtins__, __cached__=None, __package__=None,
                         __spec__=None)
    sys.modules["__main__"] = main
    with open(script, "rb") as handle:
        code = compile(handle.read(), script, "exec", dont_inherit=True)
    try:
        exec(code, main.__dict__)
    except SystemExit:
        raise  # The interpreter turns it into the exit code and message, as for a fresh process.
    except BaseException:
        kind, error, trace = sys.exc_info()
        # As the interpreter reports it, without this helper's frame.
        sys.excepthook(kind, error.with_traceback(trace.tb_next), trace.tb_next)
        return 1
    return 0


def _wait(pid, timeout):
    """Waits for ``pid``; returns ``(returncode, timed_out)``, killing its process group on a timeout."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            _kill_group(pid)
            _, status = os.waitpid(pid, 0)
            return _exit_code(status), True
        time.sleep(_POLL)
    _kill_group(pid)  # What the program left running would otherwise outlive the test.
    return _exit_code(status), False


def _kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass  # The group is gone already.


def serve(requests=sys.stdin, answers=sys.stdout):
    """The server's loop: forks one child per request line; returns the child's exit code in the child."""
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return _child(request)
        returncode, timed_out = _wait(pid, request["timeout"])
        answers.write(json.dumps({"returncode": returncode, "timed_out": timed_out}) + "\n")
        answers.flush()
    return None


class ForkServer(object):
    """The parent's handle on one server process, started on the first ``run`` with ``env``."""

    def __init__(self):
        self._proc = None
        self._env = None

    def _start(self, env):
        if not hasattr(os, "fork"):
            return
        self._env = dict(env)
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], env=self._env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, universal_newlines=True)

    def run(self, script, cwd, env, timeout):
        """Runs ``script`` as ``python script`` in ``cwd``; returns ``(returncode, stdout, stderr)``.

        Raises:
          subprocess.TimeoutExpired: the program ran longer than ``timeout`` seconds (it is killed).
        """
        if self._proc is None or self._proc.poll() is not None or env != self._env:
            self.close()  # The server's TensorFlow was imported under its environment: match it.
            self._start(env)
        if self._proc is None:
            return _fresh(script, cwd, env, timeout)
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            request = dict(script=script, cwd=cwd, env=env, stdout=out, stderr=err, timeout=timeout)
            try:
                self._proc.stdin.write(json.dumps(request) + "\n")
                self._proc.stdin.flush()
                answer = json.loads(self._proc.stdout.readline())
            except (OSError, ValueError):
                self.close()  # The server died (not the program): run this one the slow way.
                return _fresh(script, cwd, env, timeout)
            stdout, stderr = _read(out), _read(err)
        if answer["timed_out"]:
            raise subprocess.TimeoutExpired([sys.executable, script], timeout, stdout, stderr)
        return answer["returncode"], stdout, stderr

    def close(self):
        if self._proc is not None:
            self._proc.stdin.close()
            self._proc.wait()
            self._proc.stdout.close()
            self._proc = None


def _read(path):
    with open(path, encoding="utf-8", errors="replace") as handle:
        return handle.read()


def _fresh(script, cwd, env, timeout):
    proc = subprocess.run([sys.executable, script], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True, timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr


if __name__ == "__main__":
    import tensorflow  # noqa: F401  What every program would import first: the cost paid once.

    sys.exit(serve())
