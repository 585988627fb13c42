"""The package itself: exports, the TensorFlow requirement, Python 3.7 syntax."""
import ast
import os
import subprocess
import sys

import pytest

import gradaccum

PACKAGE_DIR = os.path.dirname(os.path.abspath(gradaccum.__file__))
ROOT = os.path.dirname(PACKAGE_DIR)


def test_every_exported_name_exists():
    assert gradaccum.__all__ and len(set(gradaccum.__all__)) == len(gradaccum.__all__)
    for name in gradaccum.__all__:
        assert getattr(gradaccum, name) is not None, name


@pytest.mark.parametrize("filename", sorted(f for f in os.listdir(PACKAGE_DIR) if f.endswith(".py")))
def test_library_parses_as_python_37(filename):
    # On Python 3.7 itself the interpreter's own grammar is the check.
    grammar = {"feature_version": (3, 7)} if sys.version_info >= (3, 8) else {}
    with open(os.path.join(PACKAGE_DIR, filename)) as handle:
        ast.parse(handle.read(), filename, **grammar)


def _import_error(tmp_path, fake_tensorflow):
    """Imports gradaccum in a child whose ``tensorflow`` is ``fake_tensorflow``."""
    (tmp_path / "tensorflow.py").write_text(fake_tensorflow)
    code = ("try:\n import gradaccum\nexcept ImportError as exc:\n print(str(exc))\n"
            "else:\n print('imported')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, universal_newlines=True, timeout=120)
    return out.stdout.strip()


def test_import_without_tensorflow_says_what_to_install(tmp_path):
    message = _import_error(tmp_path, "raise ImportError('No module named tensorflow')\n")
    assert "\n" not in message
    assert message.startswith("gradaccum needs TensorFlow 1.15 or newer: install it with "
                              "`pip install \"gradaccum[tf]\"`")
    assert "tensorflow-gpu==1.15" in message and "No module named tensorflow" in message


def test_import_with_old_tensorflow_says_what_to_install(tmp_path):
    message = _import_error(tmp_path, "__version__ = '1.14.0'\n")
    assert "\n" not in message
    assert message.startswith("gradaccum needs TensorFlow 1.15 or newer")
    assert message.endswith("found TensorFlow 1.14.0")
