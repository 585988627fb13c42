"""Test configuration: picks the TensorFlow behaviour before TensorFlow loads.

The suite runs once per behaviour, each in its own process:

* ``--tf-mode=tf1`` (default): ``tf.compat.v1.disable_v2_behavior()``, that is
  reference variables and v1 control flow, what TensorFlow 1.15 runs;
* ``--tf-mode=tf2``: ``tf.compat.v1.disable_eager_execution()`` only, that is
  resource variables and control flow v2 in a graph.

``GRADACCUM_TF_MODE`` sets the default. ``TF_USE_LEGACY_KERAS=1`` is set before
TensorFlow is imported, when ``tf_keras`` is installed, so that
``tf.compat.v1.layers`` works on TF >= 2.16.
"""
import gc
import importlib.util
import os
import random

# tf.compat.v1.layers needs tf_keras on TF >= 2.16; TF 1.15 to 2.15 have Keras 2 built in,
# and there the variable would break tf.compat.v1.layers if tf_keras is absent.
if importlib.util.find_spec("tf_keras") is not None:
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
# 3, as the examples set it before TensorFlow loads: a program forked from the fork server logs as the server's
# TensorFlow import was told to (it reads the variable once), so the programs and the server must agree.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

MODES = ("tf1", "tf2")
_SHARED = {}  # "server": the xdist controller's fork server


def pytest_addoption(parser):
    parser.addoption(
        "--tf-mode",
        default=os.environ.get("GRADACCUM_TF_MODE", "tf1"),
        choices=MODES,
        help="tf1: disable_v2_behavior(); tf2: disable_eager_execution() only",
    )


def _xdist_controller(config):
    """True in pytest-xdist's controller: it hands tests to its workers and runs none itself."""
    return (not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None))
            and getattr(config.option, "dist", "no") != "no")


def pytest_configure(config):
    mode = config.getoption("--tf-mode")
    os.environ["GRADACCUM_TF_MODE"] = mode  # Subprocesses started by tests follow.
    if _xdist_controller(config):
        # It imports no TensorFlow (5 s of CPU that no test would use). It starts the one fork server that
        # its workers share: they inherit the variable that names it.
        import forkserver

        _SHARED["server"] = forkserver.ForkServer().start(wait=False)
        os.environ[forkserver.ENV_VAR] = _SHARED["server"].path
        return
    if getattr(config.option, "loadgroup", False):  # A pytest-xdist worker under --dist loadgroup.
        config.pluginmanager.register(_GroupsTakeEffect(), "gradaccum-groups-take-effect")
    import tensorflow as tf

    if mode == "tf1":
        tf.compat.v1.disable_v2_behavior()
    else:
        tf.compat.v1.disable_eager_execution()


class _GroupsTakeEffect(object):
    """In a pytest-xdist worker under ``--dist loadgroup``: a test whose group did not take effect fails.

    pytest-xdist marks a grouped test by a suffix of its node id, which
    pytest 9.2 no longer lets a plugin change: the tests would then run as
    if ungrouped, two multi-process tests at once and each module fixture
    once per worker, slower and with no word said.
    """

    def __init__(self):
        self.lost = set()

    @pytest.hookimpl(trylast=True)  # After pytest-xdist's own hook.
    def pytest_collection_modifyitems(self, items):
        self.lost = set(item.nodeid for item in items
                        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid)

    def pytest_runtest_setup(self, item):
        if item.nodeid in self.lost:
            pytest.fail("--dist loadgroup did not group this test with pytest %s (pytest-xdist issue 1386): "
                        "install pytest<9.2, as pip install '.[test]' does" % pytest.__version__, pytrace=False)


def pytest_collection_finish(session):
    """TensorFlow's modules, the test modules and their items live as long as the session: its garbage
    collections need not walk those 300,000 objects again and again (the tf2 session's full collections
    took 13 s of CPU instead of 17 s with TensorFlow's frozen)."""
    gc.freeze()


def pytest_unconfigure(config):
    if "server" in _SHARED:
        _SHARED.pop("server").close()


@pytest.hookimpl(tryfirst=True)  # Before pytest-xdist reads the groups.
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n N --dist loadgroup``, keeps together on one worker what must not be split.

    * The multi-process tests (marker ``distributed``) run one at a time, on
      one worker: each starts 2 or 3 TensorFlow processes, which fill 2 cores,
      and several of them check that a job ends within a time bound.
    * The tests of a module that share a module-scoped fixture (a reference
      run, a job run once for several tests, a site build) run on one worker,
      so that it is made once, not once per worker.
    * A module may group tests itself (``pytest.mark.xdist_group``) for a
      resource they share that is not a fixture: the docs' ```python blocks
      fork from one server of their own.

    Every other test goes to whichever worker is free. Without pytest-xdist
    the marks change nothing.

    A test marked ``one_behaviour`` skips in the ``--tf-mode=tf2`` session:
    what it proves (a launcher's or a job's handling of processes, signals,
    restarts, a cluster's variables) does not depend on the behaviour, and
    its variables and graphs are the code paths that other tests check in
    both sessions. A parametrisation marked ``one_behaviour(reason=...)``
    repeats, in the tf2 session, the code path of another one that runs
    there: the reason names it.
    """
    if config.getoption("--tf-mode") != "tf1":
        for item in items:
            marker = item.get_closest_marker("one_behaviour")
            if marker is not None:
                why = marker.kwargs.get("reason", "what it proves does not depend on the TensorFlow behaviour")
                item.add_marker(pytest.mark.skip(reason="one_behaviour: %s; it runs in the tf1 session" % why))
    for item in items:
        if item.get_closest_marker("distributed") is not None:
            group = "distributed"
        elif any(defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values() if defs):
            group = item.nodeid.split("::")[0]
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.fixture(scope="session", autouse=True)
def _programs_fork_from_one_tensorflow_import():
    """Serves ``forkserver.command()``: programs that tests start fork from one TensorFlow import.

    A test's child run as ``forkserver.command() + [program, args...]``
    instead of ``[sys.executable, program, args...]`` starts in about 0.1 s
    instead of 6 s of CPU (``tests/forkserver.py``); every other test is as
    before. The variable that names the server is set for this session.
    """
    import forkserver

    if os.environ.get(forkserver.ENV_VAR):  # Under pytest-xdist: the controller's, shared by its workers.
        yield forkserver.ForkServer(path=os.environ[forkserver.ENV_VAR])
        return
    server = forkserver.ForkServer().start(wait=False)  # Its import overlaps the first tests; clients queue.
    os.environ[forkserver.ENV_VAR] = server.path
    yield server
    os.environ.pop(forkserver.ENV_VAR, None)
    server.close()


@pytest.fixture(scope="session")
def fork_server(_programs_fork_from_one_tensorflow_import):
    """Runs Python programs forked from one process that imported TensorFlow (``tests/forkserver.py``): the
    session's server; a program whose TensorFlow import variables differ gets a server of its own."""
    import forkserver

    server = forkserver.ForkServer(path=_programs_fork_from_one_tensorflow_import.path)
    yield server
    server.close()


def pytest_report_header(config):
    return "gradaccum: TensorFlow %s, mode %s" % (_tensorflow_version(), config.getoption("--tf-mode"))


def _tensorflow_version():
    """The installed TensorFlow's version, read without importing it (the xdist controller does not)."""
    try:
        from importlib import metadata
    except ImportError:  # Python 3.7
        import importlib_metadata as metadata
    for name in ("tensorflow", "tensorflow-gpu", "tensorflow-cpu", "tensorflow-intel"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "(version unknown)"


@pytest.fixture(autouse=True)
def _seeded_python_random():
    """Seeds Python's ``random`` before every test.

    Under TF2 behaviour the initialisers of ``tf.compat.v1.layers`` come from
    tf-keras, which ignores the graph seed and draws op seeds from Python's
    ``random``: unseeded, every run would start from other weights.
    ``GRADACCUM_TEST_SEED`` picks another seed, to probe the tolerances.
    """
    random.seed(int(os.environ.get("GRADACCUM_TEST_SEED", "0")))


@pytest.fixture
def tf_mode(request):
    """The TensorFlow behaviour this run uses: ``"tf1"`` or ``"tf2"``."""
    return request.config.getoption("--tf-mode")


@pytest.fixture(scope="module")
def parabola_example():
    """``examples/parabola_sync.py`` loaded as a module (it is a script, not a package)."""
    import example_module

    return example_module.load("parabola_sync")


@pytest.fixture(scope="module")
def parabola_reference(parabola_example, tmp_path_factory):
    """Returns ``run(steps)``: the single-process, full-batch parabola run's npz (cached)."""
    import numpy as np

    cache = {}

    def run(steps):
        if steps not in cache:
            out = str(tmp_path_factory.mktemp("reference") / "single.npz")
            saved = os.environ.pop("TF_CONFIG", None)  # a reference is one process
            try:
                assert parabola_example.main(["--steps", str(steps), "--out", out]) == 0
            finally:
                if saved is not None:
                    os.environ["TF_CONFIG"] = saved
            cache[steps] = dict(np.load(out))
        return cache[steps]

    return run
