"""Loads an example script as a module of the test process, leaving the process as it found it.

A script of ``examples/`` quiets TensorFlow before importing it: unless run
with ``--verbose`` it sets ``TF_CPP_MIN_LOG_LEVEL``, points file descriptor 2
at ``/dev/null`` and ignores warnings. Right for a program; imported into a
test process, it would change that process for every test after it: its
stderr lost, and every program a test starts would inherit the variable, so
that none of them could fork from the session's fork server, whose
TensorFlow was imported under the old value (``tests/forkserver.py``): each
would pay a TensorFlow import of its own.
"""
import importlib.util
import os
import sys
import warnings

EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load(name, module_name=None):
    """``examples/<name>.py`` as a module named ``module_name`` (default ``name``), registered in ``sys.modules``.

    Its helper modules (``idx_data``, ``_quiet``, ...) import from beside it;
    the environment, file descriptor 2 and the warning filters are as before.
    """
    if EXAMPLES_DIR not in sys.path:
        sys.path.insert(0, EXAMPLES_DIR)
    spec = importlib.util.spec_from_file_location(module_name or name, os.path.join(EXAMPLES_DIR, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    environ, stderr = dict(os.environ), os.dup(2)
    try:
        with warnings.catch_warnings():
            spec.loader.exec_module(module)
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
        os.environ.clear()
        os.environ.update(environ)
    sys.modules[spec.name] = module
    return module
