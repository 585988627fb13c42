"""The documentation site (docs/) builds without a warning, and documents every public name.

The build is Sphinx's, as docs/README.md gives it, with warnings as errors and
nitpicky cross-references (``-W --keep-going -n``), into a temporary folder
(run as a program forked from the session's TensorFlow import, tests/forkserver.py):
a broken link or reference, a docstring that does not parse, or a public name
missing from the API pages (docs/api/) fails the suite. Sphinx 9 needs Python >= 3.11, so
the test skips, with the reason, below that or without the ``[docs]`` extra;
with ``GRADACCUM_REQUIRE_DOCS=1`` (CI's newest-TensorFlow step) it fails
instead. The site does not depend on the TensorFlow behaviour: it is built in
the ``--tf-mode=tf1`` session only.
"""
import os
import re
import shutil
import subprocess
import sys
import zlib

import pytest

import forkserver
import gradaccum

pytestmark = pytest.mark.slow  # Two Sphinx builds, about 20 s together.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
_SPHINX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sphinx_child.py")  # python -m sphinx
TIMEOUT = 300  # Seconds per build; one takes about 15 s on a 2-core machine.
# TensorFlow's start-up lines on stderr, which are not Sphinx's warnings.
NOISE = re.compile(r"^(WARNING: All log messages before absl|I0000 |W0000 |E0000 |.*cudart_stub)")


def _require_toolchain():
    reason = None
    if sys.version_info < (3, 11):
        reason = "the docs need Python >= 3.11 (Sphinx 9); this is Python %d.%d" % sys.version_info[:2]
    else:
        try:
            import furo  # noqa: F401
            import myst_parser  # noqa: F401
            import sphinx  # noqa: F401
        except ImportError as error:
            reason = "the docs toolchain is not installed (pip install '.[docs]'): %s" % error
    if reason is not None:
        if os.environ.get("GRADACCUM_REQUIRE_DOCS") == "1":
            pytest.fail("GRADACCUM_REQUIRE_DOCS=1, but " + reason)
        pytest.skip(reason)


def _build(source, out):
    """Runs Sphinx on ``source`` into ``out``; returns (exit status, Sphinx's warnings and errors)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("GRADACCUM_TF_MODE", None)
    command = forkserver.command() + [_SPHINX, "-W", "--keep-going", "-n", "-q", "-b", "html",
                                      "-d", os.path.join(out, ".doctrees"), source, out]
    proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=TIMEOUT)
    messages = [line for line in proc.stderr.splitlines() if not NOISE.match(line)]
    return proc.returncode, "\n".join(messages)


def read_inventory(path):
    """``{name: (role, uri)}`` from a Sphinx ``objects.inv`` (version 2), ``$`` in a uri expanded."""
    with open(path, "rb") as handle:
        header = [handle.readline() for _ in range(4)]
        assert header[0].startswith(b"# Sphinx inventory version 2"), header[0]
        lines = zlib.decompress(handle.read()).decode("utf-8").splitlines()
    entries = {}
    for line in lines:
        match = re.match(r"(.+?)\s+(\S+:\S+)\s+(-?\d+)\s+(\S*)\s+(.*)", line)
        if match:
            name, role, _, uri, _ = match.groups()
            entries.setdefault(name, (role, uri[:-1] + name if uri.endswith("$") else uri))
    return entries


@pytest.fixture(scope="module")
def site(request, tmp_path_factory):
    """(exit status, Sphinx's warnings, output folder) of one build of docs/ for the module's tests."""
    if request.config.getoption("--tf-mode") != "tf1":
        pytest.skip("the site does not depend on the TensorFlow behaviour: built in the tf1 session only")
    _require_toolchain()
    out = str(tmp_path_factory.mktemp("site"))
    status, messages = _build(DOCS, out)
    return status, messages, out


def test_site_builds_without_warnings(site):
    status, messages, out = site
    assert status == 0, "the docs build failed (exit %d); Sphinx said:\n%s" % (status, messages)
    for page in ("index.html", "api/index.html", "api/accumulation.html", "guides/add_accumulation.html"):
        assert os.path.isfile(os.path.join(out, page)), page


def test_every_public_name_is_in_the_api_page(site):
    out = site[2]
    inventory = os.path.join(out, "objects.inv")
    assert os.path.isfile(inventory), "no objects.inv: the build stopped early:\n%s" % site[1]
    entries = read_inventory(inventory)
    anchors = {}
    for path in os.listdir(os.path.join(out, "api")):
        if path.endswith(".html"):
            with open(os.path.join(out, "api", path), encoding="utf-8") as handle:
                anchors["api/" + path] = set(re.findall(r'id="([^"]+)"', handle.read()))
    missing = []
    for name in gradaccum.__all__:
        role, uri = entries.get("gradaccum." + name, ("", ""))
        page, _, anchor = uri.partition("#")
        if not (role.startswith("py:") and anchor in anchors.get(page, ())):
            missing.append("gradaccum.%s (%s)" % (name, role + " " + uri if uri else "not in objects.inv"))
    assert not missing, "not documented on the API pages (docs/api/*.md): %s" % ", ".join(missing)
    assert len(gradaccum.__all__) >= 20


def test_a_broken_reference_to_our_name_fails_the_build(tmp_path, request):
    """Nitpicky: only TensorFlow's names are excused; one of ours that does not exist is an error."""
    if request.config.getoption("--tf-mode") != "tf1":
        pytest.skip("the site does not depend on the TensorFlow behaviour: built in the tf1 session only")
    _require_toolchain()
    source = tmp_path / "src"
    source.mkdir()
    shutil.copy(os.path.join(DOCS, "conf.py"), str(source / "conf.py"))
    (source / "index.md").write_text(
        "# Page\n\n{py:class}`tf.Tensor`, {py:class}`gradaccum.NoSuchClass`.\n", encoding="utf-8")
    status, messages = _build(str(source), str(tmp_path / "out"))
    assert status != 0
    assert "reference target not found: gradaccum.NoSuchClass" in messages, messages
    assert "tf.Tensor" not in messages, messages
    # And a public name that no page documents is a warning of its own.
    assert "gradaccum.GradientAccumulator (in gradaccum.__all__) is not in the API reference" in messages, messages
