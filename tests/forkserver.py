"""Runs ``python program.py args`` as a fresh process would, without paying TensorFlow's import each time.

Importing TensorFlow and tearing its modules down at exit cost about 6 s of
CPU per Python process on a 2-core machine: more than most test programs'
own work. Here one server process imports TensorFlow (and only that: no
behaviour chosen, no Keras loaded, no graph or session made), listens on a
Unix socket, and ``os.fork()``s one child per program.

The client, ``forkserver.command() + [program, args...]`` (that is
``python tests/forkserver.py program args...``; ``-c CODE`` in place of
``program`` runs as ``python -c CODE`` does), starts in a fraction of a
second, hands the server its standard streams, arguments, working directory
and environment (``GRADACCUM_TEST_FORKSERVER`` names the socket), and stays
as the program's stand-in, so launchers, timeouts and kills see it as the
program:

* it exits with the program's status, or dies of the program's signal;
* it relays SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and SIGCONT;
* when it dies (SIGKILL too), the server kills the program's process group.
  SIGSTOP cannot be relayed: a test that stops a worker runs a fresh Python.

The child starts as ``python program.py`` would: its own ``__main__``,
``sys.argv``, ``sys.path``, working directory, environment, streams,
session and process group, reseeded ``random`` and NumPy generators. It ends
as the interpreter would (non-daemon threads joined, ``atexit`` handlers
run, streams flushed) but skips tearing down TensorFlow's modules, and its
garbage collections skip the objects of the server's import (``gc.freeze``).

It falls back to a fresh ``python program.py`` when no server listens, when
``os.fork`` is missing, or when a variable that TensorFlow's import reads
(``TF_*`` but ``TF_CONFIG``, ``CUDA_VISIBLE_DEVICES``) differs from the
server's. Python 3.7 syntax: TF 1.15's CI runs it.
"""
import _io
import atexit
import gc
import io
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import reduction

ENV_VAR = "GRADACCUM_TEST_FORKSERVER"
_HERE = os.path.abspath(__file__)
_POLL = 1.0  # Seconds between the server's checks that its parent lives (an ended program wakes it at once).
_INLINE = "<string>"  # The file name of a ``-c`` program's code, in tracebacks as in python -c.
_REQUEST_SECONDS = 10  # A client sends its request at once; one that does not in this time is dropped.
_RELAYED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT")


def command():
    """The argv prefix that runs a program through the server: use it where ``[sys.executable]`` would be."""
    return [sys.executable, _HERE]


def import_signature(env):
    """The variables TensorFlow's import reads: a program whose values differ runs as a fresh process."""
    return sorted((name, value) for name, value in env.items()
                  if (name.startswith("TF_") and name != "TF_CONFIG") or name == "CUDA_VISIBLE_DEVICES")


# ---------------------------------------------------------------------------------------------------------
# Parent side


class ForkServer(object):
    """One server process, importing TensorFlow under ``env`` (default: this process's environment).

    With ``path``, the handle of a server that another process started and
    owns (it listens at ``path``, under this process's environment):
    :meth:`start` and :meth:`close` leave that server alone.
    """

    def __init__(self, env=None, path=None):
        self.env = dict(os.environ if env is None else env)
        self._folder = None if path else tempfile.mkdtemp(prefix="forkserver-")
        self.path = path or os.path.join(self._folder, "socket")  # Short: a socket has at most 107 bytes.
        self._proc = None

    def start(self, wait=True):
        """Starts the server; returns self.

        It listens at once (clients queue) and imports TensorFlow; with
        ``wait`` this returns once that is done, so that a program's first
        seconds are its own (a timeout, a test that reads it at once).
        """
        if self._proc is None and self._folder is not None and hasattr(os, "fork"):
            self._proc = subprocess.Popen([sys.executable, _HERE, "--serve", self.path], env=self.env,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
        ready = self.path + ".ready" if wait else self.path
        deadline = time.monotonic() + 120
        while not os.path.exists(ready) and self._may_become_ready() and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def _may_become_ready(self):
        """Another process's server may still be importing; one of ours only while its process lives."""
        if self._folder is None:
            return True
        return self._proc is not None and self._proc.poll() is None

    def environ(self, env):
        """``env`` with the variable that points this server's clients at it."""
        return dict(env, **{ENV_VAR: self.path})

    def run(self, script, cwd, env, timeout, args=()):
        """Runs ``python script args`` in ``cwd``; returns ``(returncode, stdout, stderr)``.

        Raises:
          subprocess.TimeoutExpired: the program ran longer than ``timeout`` seconds (it is killed).
        """
        if import_signature(env) != import_signature(self.env):
            self.close()  # The server's TensorFlow was imported under other variables: match them.
            self.__init__(env)
        self.start()
        argv = command() + [script] + [str(a) for a in args]
        try:
            proc = subprocess.run(argv, cwd=cwd, env=self.environ(env), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, universal_newlines=True, timeout=timeout)
        except subprocess.TimeoutExpired as expired:  # Its output is bytes, even in text mode.
            raise subprocess.TimeoutExpired(argv, timeout, _text(expired.output), _text(expired.stderr))
        return proc.returncode, proc.stdout, proc.stderr

    def close(self):
        """Stops the server; the programs still running are killed."""
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._proc = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)


def _text(data):
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


# ---------------------------------------------------------------------------------------------------------
# Client side: the program's stand-in


def _client(argv):
    path = os.environ.get(ENV_VAR)
    sock = None
    if path and hasattr(os, "fork"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock = None
    if sock is None:
        _exec_fresh(argv)
    # Signals that arrive before the program's pid is known are passed on once it is.
    target, pending = {}, []
    for name in _RELAYED:
        signal.signal(getattr(signal, name), lambda number, _frame: (
            _relay(target["pid"], number) if "pid" in target else pending.append(number)))
    fds = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
    reduction.sendfds(sock, fds)
    request = json.dumps(dict(argv=argv, cwd=os.getcwd(), env=dict(os.environ))).encode("utf-8")
    sock.sendall(struct.pack("!I", len(request)) + request)
    answers = sock.makefile("r")
    first = json.loads(answers.readline() or "{}")
    if "pid" not in first:  # The server cannot run it as the program expects (or is gone).
        for number in pending:  # What they would have done to `python program.py`.
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        _exec_fresh(argv)
    target["pid"] = first["pid"]
    for number in pending:
        _relay(target["pid"], number)
    line = answers.readline()
    if not line:
        sys.stderr.write("forkserver: the server went away while %s ran\n" % argv[0])
        os._exit(1)
    status = json.loads(line)["status"]
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        if number not in (signal.SIGKILL, signal.SIGSTOP):  # Those two have no handler to reset.
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
    os._exit(os.WEXITSTATUS(status))


def _exec_fresh(argv):
    os.execv(sys.executable, [sys.executable] + list(argv))


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _relay(pid, number):
    try:
        os.kill(pid, number)
    except OSError:
        pass  # It has ended: its status is on its way.


# ---------------------------------------------------------------------------------------------------------
# Server side


def serve(path):
    """Listens on ``path`` and forks one program per client until terminated or orphaned."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)  # Clients queue here while TensorFlow loads.
    import tensorflow  # noqa: F401  What every program would import first: the cost paid once.

    # The import's objects live as long as the program: a program's collections need not walk them. Walking
    # them took half the CPU of a small program (0.19 of 0.40 s), and writing their GC headers copied the
    # server's memory pages into each child.
    gc.freeze()

    open(path + ".ready", "w").close()

    signature, base_path, parent = import_signature(os.environ), list(sys.path), os.getppid()
    server_path = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base_path = [base_path[0]] + [p for p in base_path[1:] if os.path.abspath(p) not in server_path]
    programs, killed = {}, set()  # pid -> the client's connection; pids whose client has gone
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    wakeup = _wake_on_child_exit()
    try:
        while os.getppid() == parent:
            watched = [listener, wakeup] + [conn for pid, conn in programs.items() if pid not in killed]
            for sock in select.select(watched, [], [], _POLL)[0]:
                if sock is listener:
                    _accept(listener, programs, killed, signature, base_path, wakeup)
                elif sock == wakeup:  # A file descriptor: an int, compared by value.
                    _drain(wakeup)  # A program ended: reaped below.
                else:  # A client sends nothing after its request: readable means it has gone.
                    pid = next(p for p, conn in programs.items() if conn is sock)
                    _kill_group(pid)
                    killed.add(pid)
            _reap(programs, killed)
    finally:
        for pid in programs:
            _kill_group(pid)


def _wake_on_child_exit():
    """A pipe's read end that becomes readable when a program ends (SIGCHLD).

    Its status then reaches the client at once, not at the select's next timeout: with a 50 ms timeout, a
    short program took 95 ms from its client's start to its end instead of 65 ms, for hundreds of programs
    a session.
    """
    read_end, write_end = os.pipe()
    for fd in (read_end, write_end):
        os.set_blocking(fd, False)  # set_wakeup_fd requires it; a full pipe already wakes the server.
    signal.set_wakeup_fd(write_end)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # The byte written to the pipe is what wakes the server.
    return read_end


def _drain(fd):
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _accept(listener, programs, killed, signature, base_path, wakeup):
    conn = listener.accept()[0]
    conn.settimeout(_REQUEST_SECONDS)  # A stopped or starved client must not hold up the others.
    try:
        fds = reduction.recvfds(conn, 3)
        size = struct.unpack("!I", _read_exactly(conn, 4))[0]
        request = json.loads(_read_exactly(conn, size).decode("utf-8"))
    except (OSError, EOFError, RuntimeError, ValueError, struct.error):
        conn.close()  # The client died (or stalled) while asking: nothing to run.
        return
    conn.settimeout(None)
    if import_signature(request["env"]) != signature:
        _send(conn, '{"fallback": "TensorFlow import variables differ"}\n')
        conn.close()
    else:
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in list(programs.values()) + [conn]:
                other.close()
            os.close(wakeup)
            _become(request, fds, base_path)  # Never returns.
        programs[pid] = conn
        if not _send(conn, '{"pid": %d}\n' % pid):  # Its client died while it asked (a timeout, a kill).
            _kill_group(pid)
            killed.add(pid)
    for fd in fds:
        os.close(fd)


def _send(conn, line):
    """Sends ``line`` to a client; False when the client has gone."""
    try:
        conn.sendall(line.encode("ascii"))
        return True
    except OSError:
        return False


def _read_exactly(conn, size):
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("the client went away")
        data += chunk
    return data


def _reap(programs, killed):
    while programs:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = programs.pop(pid, None)
        killed.discard(pid)
        if conn is not None:
            _send(conn, '{"status": %d}\n' % status)  # Unless its client has gone.
            conn.close()


def _kill_group(pid):
    """Kills a program and its process group: the program first, which may not have called setsid() yet."""
    for kill in (os.kill, os.killpg):
        try:
            kill(pid, signal.SIGKILL)
        except OSError:
            pass  # Gone already, or no group of its own yet (then it had started nothing).


# ---------------------------------------------------------------------------------------------------------
# The forked child: becomes ``python program args`` and never returns


def _become(request, fds, base_path):
    os.setsid()  # Its own process group: when its client goes, the server kills what it started too.
    # The program's signals are its own, and so are its children: none of the server's handlers or wake-up pipe.
    for number in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    os.close(signal.set_wakeup_fd(-1))
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # Python objects above the fds: fresh, as `python program.py` makes them (PYTHONUNBUFFERED too).
    sys.stdin = open(0, closefd=False)
    sys.stdout = _output_stream(1, "strict")
    sys.stderr = _output_stream(2, "backslashreplace")
    program_path = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    main, filename = _main_module(request["argv"], program_path + base_path[1:])
    _reseed()
    code = 1
    try:
        if filename == _INLINE:
            source = request["argv"][1]
        else:
            with open(filename, "rb") as handle:
                source = handle.read()
        exec(compile(source, filename, "exec", dont_inherit=True), main.__dict__)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        kind, error, trace = sys.exc_info()
        # As the interpreter reports it, without this helper's frame.
        sys.excepthook(kind, error.with_traceback(trace.tb_next), trace.tb_next)
    finally:
        _exit(code)


def _main_module(argv, path):
    """Sets ``sys.argv``, ``sys.path`` and ``__main__`` as ``python argv...`` does; returns ``(__main__,
    filename)``. ``argv`` is ``[script, args...]`` or ``["-c", code, args...]`` (filename ``_INLINE``)."""
    main = type(sys)("__main__")
    main.__dict__.update(__builtins__=__builtins__, __cached__=None, __package__=None, __spec__=None)
    if argv[0] == "-c":  # No file; sys.path[0] is "", the working directory, as it is for python -c.
        sys.argv, sys.path[:], filename = ["-c"] + list(argv[2:]), [""] + path, _INLINE
    else:
        sys.argv, sys.path[:], filename = list(argv), [os.path.dirname(os.path.abspath(argv[0]))] + path, argv[0]
        main.__file__ = filename
    sys.modules["__main__"] = main
    return main, filename


def _output_stream(fd, errors):
    """``sys.stdout`` or ``sys.stderr`` as the interpreter makes it for the program's environment."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    binary = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    # Python >= 3.9 line-buffers stderr even when it is not a terminal.
    line_buffering = os.isatty(fd) or (fd == 2 and sys.version_info >= (3, 9))
    return io.TextIOWrapper(binary, encoding=sys.__stdout__.encoding, errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)


def _reseed():
    """A fresh process draws new seeds; a forked one would repeat the server's."""
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _exit_code(code):
    """The exit status the interpreter gives ``sys.exit(code)``, printing a message as it does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    sys.stderr.write("%s\n" % (code,))
    return 1


def _exit(code):
    """Ends as the interpreter does, without tearing TensorFlow's modules down (about 2 s of CPU)."""
    shutdown = getattr(threading, "_shutdown", None)  # Joins non-daemon threads, as at a normal exit.
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    # A normal exit finalizes the files still open (argparse.FileType's, say), which flushes them: flush
    # every one, the standard streams included. Every io class derives from _io._IOBase: a C type, so the
    # scan skips io.IOBase's ABC checks, which took 0.2 s of CPU per program for each new type they met.
    # gc.get_objects() lists the program's objects only: the server's were frozen before the fork.
    for stream in [obj for obj in gc.get_objects() if isinstance(obj, _io._IOBase)] + [sys.stdout, sys.stderr]:
        try:
            if not stream.closed and stream.writable():
                stream.flush()
        except Exception:  # noqa: BLE001  A file that cannot flush would not have at a normal exit either.
            pass
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    elif len(sys.argv) < 2:
        sys.exit("usage: forkserver.py PROGRAM [ARGS...] | -c CODE [ARGS...] | --serve SOCKET")
    else:
        _client(sys.argv[1:])
