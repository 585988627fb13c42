"""Every ```python and ```bash block of README.md and docs/**/*.md, run or checked as a user would.

The rule (also stated in the README and the docs' README):

* A ```python block is a complete program. It is written to a file and run
  with this Python in a fresh process, in an empty directory, with
  ``TF_USE_LEGACY_KERAS`` and ``GRADACCUM_TF_MODE`` removed from the
  environment: the block itself must choose graph mode and set
  ``TF_USE_LEGACY_KERAS`` where it uses ``tf.compat.v1.layers``. It must exit
  with status 0 within ``TIMEOUT`` seconds.
* A ```bash block is run the same way (with ``bash -euo pipefail``, from the
  repository's root) only when the line above it is ``<!-- run -->``: blocks
  that are fast and change nothing outside a temporary directory. Every other
  ```bash block is checked without running it: ``bash -n`` accepts it, every
  ``examples/...`` file it names exists, and every ``--flag`` it passes to an
  example is one of that example's flags. (The others install packages,
  train for minutes, or need several hosts.)
* A block whose line above is ``<!-- norun -->`` is skipped (multi-host
  recipes, Horovod, a cluster's ``TF_CONFIG``); so are the README's two
  install commands (``<!-- command:example -->``, ``<!-- command:test -->``),
  which ``.ci/run`` runs in a fresh virtual environment.
* Blocks without a language (program output) are not code, nor are MyST
  directives (```` ```{toctree} ````, ```` ```{eval-rst} ````). A block in
  ```py, ```sh, ```shell or ```console would escape these rules: it fails.

The blocks choose their own TensorFlow behaviour, so they run in the
``--tf-mode=tf1`` session only; the ``tf2`` session checks the bash blocks.
A ```python block runs in a child forked from one process that has imported
TensorFlow and nothing else (``tests/forkserver.py``, the ``fork_server``
fixture): a fresh process state without paying the import for each block, as
if its first line were ``import tensorflow``.
Test ids name the file and the fence's line: ``docs/guides/towers.md:L42-python``.
"""
import collections
import glob
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 120  # Seconds per block: a block should take < 20 s, TensorFlow's import included.
SKIP_MARKERS = ("<!-- norun -->", "<!-- command:example -->", "<!-- command:test -->")
RUN_MARKER = "<!-- run -->"
EVASIVE_LANGUAGES = ("py", "python3", "sh", "shell", "console", "shell-session", "zsh")

Block = collections.namedtuple("Block", ["language", "line", "marker", "heading", "code", "path"])


def doc_files(root=ROOT):
    """README.md and every Markdown page under docs/ (not a build's output), relative to ``root``."""
    pages = glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True)
    pages = [os.path.relpath(p, root) for p in pages]
    return ["README.md"] + sorted(p for p in pages if "_build" not in p.split(os.sep))


def read_blocks(path):
    """Returns the fenced blocks of ``path`` as ``Block``s (``marker``: the line above the fence)."""
    blocks, heading, previous, fence = [], "", "", None
    with open(os.path.join(ROOT, path), encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = (stripped[3:].strip(), number, previous, heading, [])
        elif fence is not None and stripped.startswith("```"):
            # Blocks inside list items are indented as a whole: dedent them.
            code = textwrap.dedent("\n".join(fence[4]) + "\n")
            blocks.append(Block(fence[0], fence[1], fence[2], fence[3], code, path))
            fence, previous = None, stripped
        elif fence is not None:
            fence[4].append(line)
        else:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            if stripped:
                previous = stripped
    return blocks


ALL_BLOCKS = [block for path in doc_files() for block in read_blocks(path)]
BLOCKS = [block for block in ALL_BLOCKS if block.language in ("python", "bash")]


def _id(block):
    return "%s:L%d-%s" % (block.path.replace(os.sep, "/"), block.line, block.language)


def _env():
    env = dict(os.environ)
    for name in ("TF_USE_LEGACY_KERAS", "GRADACCUM_TF_MODE"):
        env.pop(name, None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _run(command, cwd):
    proc = subprocess.run(command, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=TIMEOUT)
    _check_exit(proc.returncode, proc.stdout, proc.stderr)


def _check_exit(returncode, stdout, stderr):
    assert returncode == 0, "exit %d\n--- stdout\n%s\n--- stderr\n%s" % (
        returncode, stdout[-3000:], stderr[-5000:])


def _example_flags(script, seen=None):
    """The option strings of ``examples/<script>`` and of the ``examples/_*.py`` helpers it imports."""
    seen = set() if seen is None else seen
    seen.add(script)
    path = os.path.join(ROOT, "examples", script)
    with open(path, encoding="utf-8") as handle:
        source = "".join(line for line in handle if ">>>" not in line)  # Not the docstrings' examples.
    flags = set(re.findall(r"""add(?:_argument)?\(\s*["'](--[a-z0-9-]+)""", source))
    for helper in re.findall(r"^\s*(?:from|import) (_\w+)", source, re.M):
        if helper + ".py" not in seen and os.path.isfile(os.path.join(ROOT, "examples", helper + ".py")):
            flags |= _example_flags(helper + ".py", seen)
    return flags


def _check_bash(block):
    proc = subprocess.run(["bash", "-n"], input=block.code, universal_newlines=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.returncode == 0, proc.stderr
    for line in block.code.replace("\\\n", " ").splitlines():
        line = line.split("#")[0] if not line.lstrip().startswith("TF_CONFIG") else line
        for script in re.findall(r"examples/([\w./-]+\.py)", line):
            assert os.path.isfile(os.path.join(ROOT, "examples", script)), "%s names a missing file" % script
            known = _example_flags(script)
            if script == "compare_batches.py":  # It passes the flags it does not know on to the example.
                known |= _example_flags("fashion_mnist_subdivision.py")
            tail = line.split("examples/" + script, 1)[1]
            unknown = [flag for flag in re.findall(r"(?<![\w-])(--[a-z0-9-]+)", tail) if flag not in known]
            assert not unknown, "line %r passes %s, not flags of %s" % (line.strip(), unknown, script)


def test_there_are_blocks_to_run():
    assert "docs/index.md" in [p.replace(os.sep, "/") for p in doc_files()]
    languages = collections.Counter(block.language for block in BLOCKS)
    assert languages["python"] >= 5 and languages["bash"] >= 3, languages
    assert any(b.path == "README.md" and b.language == "python" for b in BLOCKS), "README.md has no example"


def test_no_block_escapes_the_rules():
    evasive = ["%s (```%s)" % (_id(b), b.language) for b in ALL_BLOCKS if b.language.lower() in EVASIVE_LANGUAGES]
    assert not evasive, "write ```python or ```bash, so that the block is run or checked: %s" % evasive


def _param(block):
    """The ```python blocks run on one worker: they fork from a server of their own (their environment has
    no ``TF_USE_LEGACY_KERAS``), which each worker would otherwise start, a TensorFlow import each."""
    marks = [pytest.mark.xdist_group("doc_blocks_python")] if block.language == "python" else []
    return pytest.param(block, marks=marks, id=_id(block))


@pytest.mark.parametrize("block", [_param(block) for block in BLOCKS])
def test_block(block, tmp_path, tf_mode, fork_server):
    if block.marker in SKIP_MARKERS:
        pytest.skip("marked %s" % block.marker)
    if block.language == "bash" and block.marker != RUN_MARKER:
        _check_bash(block)
        return
    if tf_mode != "tf1":
        pytest.skip("doc blocks choose their own TensorFlow behaviour: run in the tf1 session only")
    if block.language == "python":
        path = tmp_path / "doc_block.py"
        path.write_text(block.code, encoding="utf-8")
        _check_exit(*fork_server.run(str(path), str(tmp_path), _env(), TIMEOUT))
    else:
        _run(["bash", "-euo", "pipefail", "-c", block.code], ROOT)


def test_parser_sees_markers_and_headings(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(tmp_path))
    (tmp_path / "docs" / "guides").mkdir(parents=True)
    (tmp_path / "docs" / "_build").mkdir()
    for name in ("README.md", "docs/index.md", "docs/guides/b.md", "docs/guides/a.md", "docs/_build/x.md"):
        (tmp_path / name).write_text("", encoding="utf-8")
    assert [p.replace(os.sep, "/") for p in doc_files(str(tmp_path))] == [
        "README.md", "docs/guides/a.md", "docs/guides/b.md", "docs/index.md"]
    (tmp_path / "README.md").write_text(
        "# Top\n\n## Part\n<!-- norun -->\n```python\nx = 1\n```\n\nText\n\n```bash\necho hi\n```\n"
        "```\noutput\n```\n* item:\n\n  ```python\n  if x:\n      y = 2\n  ```\n", encoding="utf-8")
    blocks = read_blocks("README.md")
    assert [(b.language, b.line, b.marker, b.heading, b.code) for b in blocks] == [
        ("python", 5, "<!-- norun -->", "Part", "x = 1\n"),
        ("bash", 11, "Text", "Part", "echo hi\n"),
        ("", 14, "```", "Part", "output\n"),
        ("python", 19, "* item:", "Part", "if x:\n    y = 2\n"),
    ]
    assert _id(blocks[3]) == "README.md:L19-python"


def test_bash_check_catches_a_bad_flag_and_a_missing_file():
    bad_flag = Block("bash", 1, "", "", "python examples/fashion_mnist_subdivision.py --max-step 3\n", "x.md")
    with pytest.raises(AssertionError, match=r"passes \['--max-step'\]"):
        _check_bash(bad_flag)
    with pytest.raises(AssertionError, match=r"nothing.py names a missing file"):
        _check_bash(Block("bash", 1, "", "", "python examples/nothing.py\n", "x.md"))
    _check_bash(Block("bash", 1, "", "", "python examples/compare_batches.py --epochs 2 --width 8\n", "x.md"))
