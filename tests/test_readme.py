"""Every ```python and ```bash block of README.md, run or checked as a user would.

The rule (also stated in the README's "Quick start"):

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
* Blocks without a language (program output) are not code.

The blocks choose their own TensorFlow behaviour, so they run in the
``--tf-mode=tf1`` session only; the ``tf2`` session checks the bash blocks.
"""
import collections
import os
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TIMEOUT = 120  # Seconds per block: a block should take < 20 s, TensorFlow's import included.
SKIP_MARKERS = ("<!-- norun -->", "<!-- command:example -->", "<!-- command:test -->")
RUN_MARKER = "<!-- run -->"

Block = collections.namedtuple("Block", ["language", "line", "marker", "heading", "code"])


def readme_blocks(path=README):
    """Returns the fenced blocks of ``path`` as ``Block``s (``marker``: the line above the fence)."""
    blocks, heading, previous, fence = [], "", "", None
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if fence is None and stripped.startswith("```"):
            fence = (stripped[3:].strip(), number, previous, heading, [])
        elif fence is not None and stripped.startswith("```"):
            # Blocks inside list items are indented as a whole: dedent them.
            code = textwrap.dedent("\n".join(fence[4]) + "\n")
            blocks.append(Block(fence[0], fence[1], fence[2], fence[3], code))
            fence, previous = None, stripped
        elif fence is not None:
            fence[4].append(line)
        else:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            if stripped:
                previous = stripped
    return blocks


BLOCKS = [block for block in readme_blocks() if block.language in ("python", "bash")]


def _id(block):
    return "%s@L%d-%s" % (block.language, block.line, re.sub(r"[^A-Za-z0-9]+", "_", block.heading)[:40])


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
    assert proc.returncode == 0, "exit %d\n--- stdout\n%s\n--- stderr\n%s" % (
        proc.returncode, proc.stdout[-3000:], proc.stderr[-5000:])


def _example_flags(script):
    """The option strings of ``examples/<script>``, with ``_cli``'s shared ones where it builds on them."""
    path = os.path.join(ROOT, "examples", script)
    with open(path, encoding="utf-8") as handle:
        source = "".join(line for line in handle if ">>>" not in line)  # Not the docstrings' examples.
    flags = set(re.findall(r"""add(?:_argument)?\(\s*["'](--[a-z0-9-]+)""", source))
    if script != "_cli.py" and "_cli.small_model_parser(" in source:
        flags |= _example_flags("_cli.py")
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


def test_readme_has_blocks_to_run():
    languages = collections.Counter(block.language for block in BLOCKS)
    assert languages["python"] >= 5 and languages["bash"] >= 3, languages


@pytest.mark.parametrize("block", BLOCKS, ids=[_id(block) for block in BLOCKS])
def test_readme_block(block, tmp_path, tf_mode):
    if block.marker in SKIP_MARKERS:
        pytest.skip("marked %s" % block.marker)
    if block.language == "bash" and block.marker != RUN_MARKER:
        _check_bash(block)
        return
    if tf_mode != "tf1":
        pytest.skip("README blocks choose their own TensorFlow behaviour: run in the tf1 session only")
    if block.language == "python":
        path = tmp_path / "readme_block.py"
        path.write_text(block.code, encoding="utf-8")
        _run([sys.executable, str(path)], str(tmp_path))
    else:
        _run(["bash", "-euo", "pipefail", "-c", block.code], ROOT)


def test_parser_sees_markers_and_headings(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("# Top\n\n## Part\n<!-- norun -->\n```python\nx = 1\n```\n\nText\n\n```bash\necho hi\n```\n"
                    "```\noutput\n```\n* item:\n\n  ```python\n  if x:\n      y = 2\n  ```\n", encoding="utf-8")
    blocks = readme_blocks(str(path))
    assert [(b.language, b.line, b.marker, b.heading, b.code) for b in blocks] == [
        ("python", 5, "<!-- norun -->", "Part", "x = 1\n"),
        ("bash", 11, "Text", "Part", "echo hi\n"),
        ("", 14, "```", "Part", "output\n"),
        ("python", 19, "* item:", "Part", "if x:\n    y = 2\n"),
    ]


def test_bash_check_catches_a_bad_flag_and_a_missing_file():
    bad_flag = Block("bash", 1, "", "", "python examples/fashion_mnist_subdivision.py --max-step 3\n")
    with pytest.raises(AssertionError, match=r"passes \['--max-step'\]"):
        _check_bash(bad_flag)
    with pytest.raises(AssertionError, match=r"nothing.py names a missing file"):
        _check_bash(Block("bash", 1, "", "", "python examples/nothing.py\n"))
    _check_bash(Block("bash", 1, "", "", "python examples/compare_batches.py --epochs 2 --width 8\n"))

