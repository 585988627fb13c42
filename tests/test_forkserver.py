"""tests/forkserver.py runs a program as ``python program.py`` would: what the docs' blocks and the
multi-process tests rely on.

One server for the module (its TensorFlow import is the only slow part); each
test checks one thing a fresh process gives a program: its own ``__main__``,
argv, working directory and environment, its stdout and stderr, its exit
status or signal, signals sent to it, and a kill or timeout that ends it and
what it started.
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import forkserver
from test_distributed import wait_until_gone

pytestmark = pytest.mark.one_behaviour  # The harness, not the library: the same in both behaviours.

ENV = dict(os.environ, FORKSERVER_PROBE="probe")  # One environment: the server restarts for another.


@pytest.fixture(scope="module")
def server():
    handle = forkserver.ForkServer(ENV).start()
    yield handle
    handle.close()


def _program(tmp_path, code):
    path = tmp_path / "program.py"
    path.write_text(textwrap.dedent(code), encoding="utf-8")
    return str(path)


def test_program_runs_as_main_in_its_folder_with_its_environment(server, tmp_path):
    script = _program(tmp_path, """
        import os, sys
        import helper  # Beside the program: sys.path[0] is the program's folder.
        assert __name__ == "__main__" and sys.modules["__main__"].__file__ == sys.argv[0] == __file__
        print(os.getcwd(), os.environ["FORKSERVER_PROBE"], helper.VALUE, "tensorflow" in sys.modules)
        sys.stderr.write("to stderr\\n")
    """)
    (tmp_path / "helper.py").write_text("VALUE = 7\n", encoding="utf-8")
    returncode, stdout, stderr = server.run(script, str(tmp_path), ENV, 60)
    assert (returncode, stdout, stderr.splitlines()[-1]) == (0, "%s probe 7 True\n" % tmp_path, "to stderr"), stderr


def test_minus_c_runs_as_python_minus_c_does(server, tmp_path):
    """``forkserver.command() + ["-c", code, args...]``: the same argv, path, globals and traceback as a fresh
    ``python -c``."""
    code = textwrap.dedent("""
        import os, sys
        import helper  # From the working directory: sys.path[0] is "".
        print(sys.argv, repr(sys.path[0]), __name__, "__file__" in globals(), helper.VALUE, os.getcwd())
        raise ValueError("from -c")
    """)
    (tmp_path / "helper.py").write_text("VALUE = 7\n", encoding="utf-8")
    runs = [subprocess.run(python + ["-c", code, "an argument"], cwd=str(tmp_path), env=server.environ(ENV),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
            for python in ([sys.executable], forkserver.command())]
    # The traceback's frame and message (Python 3.13 also prints the line's source, which the fork does not).
    fresh, forked = [(run.returncode, run.stdout, [line for line in run.stderr.splitlines()
                                                   if line.startswith(("  File", "ValueError"))]) for run in runs]
    assert forked == fresh
    assert fresh == (1, "['-c', 'an argument'] '' __main__ False 7 %s\n" % tmp_path,
                     ['  File "<string>", line 5, in <module>', "ValueError: from -c"])


def test_programs_do_not_see_each_others_state(server, tmp_path):
    script = _program(tmp_path, """
        import sys, tensorflow as tf
        assert not hasattr(sys, "forkserver_mark"), "state left by the previous program"
        fresh = tf.__version__.startswith("2")  # Eager by default on TF 2, graph mode on TF 1.15.
        assert tf.executing_eagerly() == fresh, "a behaviour chosen by the previous program"
        sys.forkserver_mark = True
        if fresh:
            tf.compat.v1.disable_eager_execution()
        else:
            tf.compat.v1.enable_eager_execution()
    """)
    for _ in range(2):
        assert server.run(script, str(tmp_path), ENV, 60)[0] == 0


def test_a_file_left_open_is_written_at_exit_as_in_a_fresh_process(server, tmp_path):
    script = _program(tmp_path, "HANDLE = open('left_open.txt', 'w')\nHANDLE.write('written')\n")
    assert server.run(script, str(tmp_path), ENV, 60)[0] == 0
    assert (tmp_path / "left_open.txt").read_text() == "written"


def test_a_program_collects_its_own_garbage_and_not_the_server_s_import(server, tmp_path):
    """The server froze its import's objects (``gc.freeze``): a collection in the program skips them,
    and collects the cycles the program makes as a fresh process would."""
    script = _program(tmp_path, """
        import gc, weakref
        assert gc.isenabled() and gc.get_freeze_count() > 10000, gc.get_freeze_count()
        class Node(object):
            pass
        node = Node()
        node.self = node
        alive = weakref.ref(node)
        del node
        gc.collect()
        assert alive() is None, "the program's cycle was not collected"
        print(len(gc.get_objects()) < gc.get_freeze_count())
    """)
    assert server.run(script, str(tmp_path), ENV, 60) == (0, "True\n", "")


def test_a_program_has_the_signal_dispositions_of_a_fresh_process(server, tmp_path):
    """The server wakes on SIGCHLD through a pipe (``signal.set_wakeup_fd``): its programs inherit neither
    the handler nor the pipe, and wait for their own children as a fresh process does."""
    script = _program(tmp_path, """
        import signal, subprocess, sys
        print(signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL, signal.set_wakeup_fd(-1))
        print(subprocess.run([sys.executable, "-c", "raise SystemExit(7)"]).returncode)
    """)
    assert server.run(script, str(tmp_path), ENV, 60) == (0, "True -1\n7\n", "")


@pytest.mark.parametrize("code, want_status, want_stderr", [
    ("import sys\nsys.exit(3)\n", 3, ""),
    ("import sys\nsys.exit('bad input')\n", 1, "bad input\n"),
    ("def f():\n    raise ValueError('broken')\nf()\n", 1, "ValueError: broken\n"),
], ids=["exit-3", "exit-message", "exception"])
def test_exit_status_and_message_are_a_fresh_processes(server, tmp_path, code, want_status, want_stderr):
    script = _program(tmp_path, code)
    fresh = subprocess.run([sys.executable, script], cwd=str(tmp_path), env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, universal_newlines=True, timeout=60)
    returncode, _, stderr = server.run(script, str(tmp_path), ENV, 60)
    assert returncode == fresh.returncode == want_status
    assert stderr.endswith(want_stderr) and fresh.stderr.endswith(want_stderr)
    if "raise" in code:  # The same traceback: the program's frames, not the server's.
        assert stderr == fresh.stderr, (stderr, fresh.stderr)


def _starting_a_child(tmp_path, then):
    """A program that starts a child which writes ``survived`` 3 s later, prints "started <its pid>", then runs
    ``then``."""
    marker = tmp_path / "survived"
    script = _program(tmp_path, textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3); open(%r, 'w').close()"])
        print("started", child.pid, flush=True)
    """) % str(marker) + then)
    return script, marker


def _child_of(started_line):
    """The pid in a "started <pid>" line."""
    assert re.match(r"^started \d+\n$", started_line), started_line
    return int(started_line.split()[1])


def test_timeout_kills_the_program_and_what_it_started(server, tmp_path):
    script, marker = _starting_a_child(tmp_path, "time.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as info:
        server.run(script, str(tmp_path), ENV, 1)
    assert wait_until_gone(_child_of(info.value.output), 10), "the program's child still runs"
    assert not marker.exists(), "the program's child outlived the timeout"
    assert server.run(_program(tmp_path, "pass\n"), str(tmp_path), ENV, 60)[0] == 0


def test_arguments_and_pythonunbuffered_reach_the_program_and_the_client_relays_sigterm(server, tmp_path):
    script = _program(tmp_path, """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(sys.argv[1])))
        print("ready")  # Unflushed: PYTHONUNBUFFERED makes it arrive now, as in a fresh process.
        time.sleep(60)
    """)
    env = dict(server.environ(ENV), PYTHONUNBUFFERED="1")
    client = subprocess.Popen(forkserver.command() + [script, "7"], env=env,
                              stdout=subprocess.PIPE, universal_newlines=True)
    assert client.stdout.readline() == "ready\n"
    client.terminate()
    assert client.wait(30) == 7


def test_a_program_killed_by_a_signal_kills_its_client_with_it(server, tmp_path):
    script = _program(tmp_path, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    assert server.run(script, str(tmp_path), ENV, 60)[0] == -signal.SIGKILL


def test_a_killed_client_takes_its_program_and_what_it_started(server, tmp_path):
    script, marker = _starting_a_child(tmp_path, "time.sleep(3)\nopen(%r, 'w').close()\n" % str(tmp_path / "survived"))
    client = subprocess.Popen(forkserver.command() + [script], env=server.environ(ENV),
                              stdout=subprocess.PIPE, universal_newlines=True)
    child = _child_of(client.stdout.readline())
    client.kill()
    assert client.wait(30) == -signal.SIGKILL
    assert client.stdout.read() == ""  # Every writer of the pipe has gone: the program and its child.
    assert wait_until_gone(child, 10), "the program's child still runs"
    assert not marker.exists(), "the program or its child outlived its client"


@pytest.mark.parametrize("change", ["another-tf-variable", "no-server"])
def test_another_tensorflow_import_variable_or_no_server_runs_a_fresh_python(server, tmp_path, change):
    script = _program(tmp_path, "import os, sys\nprint('tensorflow' in sys.modules, os.getppid())\n")
    env = server.environ(ENV)
    if change == "no-server":
        del env[forkserver.ENV_VAR]
    else:
        env["TF_FORKSERVER_PROBE"] = "1"  # A TF_ variable: TensorFlow's import could read it.
    client = subprocess.Popen(forkserver.command() + [script], env=env, stdout=subprocess.PIPE,
                              universal_newlines=True)
    out, _ = client.communicate(timeout=60)
    assert out == "False %d\n" % os.getpid()  # Exec'd in place: this test's child, no TensorFlow loaded.


def test_a_client_killed_before_the_server_answers_leaves_it_serving(tmp_path):
    cold = forkserver.ForkServer(ENV).start(wait=False)  # Still importing TensorFlow: the client waits.
    try:
        script, marker = _starting_a_child(tmp_path, "time.sleep(60)\n")
        client = subprocess.Popen(forkserver.command() + [script], env=cold.environ(ENV), stdout=subprocess.DEVNULL)
        time.sleep(0.5)
        client.kill()
        client.wait(10)
        cold.start()  # Ready: it has read the dead client's request by now, or will next.
        (tmp_path / "next").mkdir()
        assert cold.run(_program(tmp_path / "next", "print('served')\n"), str(tmp_path), ENV, 60) == (0, "served\n", "")
        time.sleep(4)
        assert not marker.exists(), "the dead client's program ran"
    finally:
        cold.close()
