"""find_micro_batch: the search on a stand-in step, and for real under a memory cap in a child process."""
import json
import os
import signal
import subprocess
import sys

import pytest
import tensorflow as tf

import gradaccum
import forkserver

HERE = os.path.dirname(os.path.abspath(__file__))


def _fits_below(limit, tried):
    def run_step(size):
        tried.append(size)
        if size >= limit:
            raise tf.errors.ResourceExhaustedError(None, None, "OOM at %d" % size)
    return run_step


def test_doubles_then_bisects_below_the_first_failure_and_never_jumps_past_twice_what_ran():
    tried = []
    choice = gradaccum.find_micro_batch(_fits_below(300, tried), 5000)
    assert tried[:10] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert all(size <= 2 * max(s for s in tried[:i] if s < 300) for i, size in enumerate(tried) if i)
    assert choice.smallest_that_failed - choice.largest_that_ran <= 0.05 * choice.largest_that_ran
    assert choice.largest_that_ran < 300 <= choice.smallest_that_failed
    # 90% of what ran, then 5000 split evenly: k = ceil(5000 / usable), size = ceil(5000 / k).
    usable = int(choice.largest_that_ran * 0.9)
    assert choice.num_micro_batches == -(-5000 // usable)
    assert choice.micro_batch_size == -(-5000 // choice.num_micro_batches) <= usable


def test_a_target_that_fits_is_one_micro_batch():
    choice = gradaccum.find_micro_batch(_fits_below(10 ** 6, []), 5000, start=64)
    assert choice == gradaccum.MicroBatchChoice(5000, 1, 5000, None)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"run_step": None}, TypeError, "`run_step` must be callable"),
    ({"target_batch": 0}, ValueError, "`target_batch` must be an int >= 1, got 0"),
    ({"start": 10, "target_batch": 5}, ValueError, "`start` must be at most `target_batch` (5), got 10"),
    ({"margin": 1.5}, ValueError, "`margin` must be a number in (0, 1], got 1.5"),
    ({"precision": 1}, ValueError, "`precision` must be a number in (0, 1), got 1"),
    ({"var_list": []}, ValueError, "`var_list` needs `session`"),
    ({"run_step": _fits_below(1, [])}, ValueError, "not even `start`=1 examples fit in memory"),
])
def test_bad_input_raises_one_clear_error(kwargs, error, message):
    arguments = dict({"run_step": _fits_below(100, []), "target_batch": 1000}, **kwargs)
    with pytest.raises(error) as raised:
        gradaccum.find_micro_batch(arguments.pop("run_step"), arguments.pop("target_batch"), **arguments)
    assert message in str(raised.value)


@pytest.mark.slow
def test_under_a_memory_cap_the_choice_runs_and_its_double_does_not():
    # oneDNN off: with it on (TF 2.x's default on x86), each allocation over the cap waits about 10 s before
    # it fails (30 s of this child's 37 s were waits, 3 sizes failing); off, the same ResourceExhaustedError
    # comes at once. A TF_* variable makes the child a fresh Python (tests/forkserver.py): 6 s of import.
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0")
    done = subprocess.run(forkserver.command() + [os.path.join(HERE, "finder_child.py"), "600"], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True, timeout=300)
    lines = done.stdout.strip().splitlines()
    assert lines and lines[0].startswith("{"), done.stderr[-3000:]
    result = json.loads(lines[0])  # out only after the choice ran
    if len(lines) == 2:
        assert done.returncode == 0 and json.loads(lines[1]) == {"double_fails": True}, (lines, done.returncode)
    else:  # TF 1.15 may die allocating the double instead of raising: it did not run either.
        assert len(lines) == 1 and done.returncode in (-signal.SIGSEGV, -signal.SIGABRT), (
            done.returncode, done.stderr[-3000:])
    assert result["untouched"], result
    assert result["smallest_that_failed"] is not None
    assert 10 < result["micro_batch_size"] <= result["largest_that_ran"] < result["smallest_that_failed"]
    assert result["micro_batch_size"] * result["num_micro_batches"] >= 4096
