"""Tests for what gradaccum.tower.minimize is fed: fewer examples than towers,
sparse inputs, one batch per tower from a callable, per-example outputs.

The empty-shard cases run in a child process (``tower_empty_child.py``): a
kernel that aborts on an empty batch would otherwise end the suite.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import gradaccum
from gradaccum import tower

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tower_empty_child as child  # noqa: E402

v1 = tf.compat.v1
DEVICES = ["/cpu:0", "/cpu:1", "/cpu:2"]


def _session(graph):
    return v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": 3}))


# ------------------------------------------------------------ empty shards


@pytest.fixture(scope="module")
def empty_runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("empty") / "runs.npz")
    done = subprocess.run([sys.executable, os.path.join(HERE, "tower_empty_child.py"), out],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert done.returncode == 0, done.stdout.decode()[-3000:]  # An abort is a failure here.
    return dict(np.load(out))


def _at(runs, case, step):
    prefix = case + "/"
    return dict((key[len(prefix):-len("@%d" % step)], value) for key, value in runs.items()
                if key.startswith(prefix) and key.endswith("@%d" % step))


@pytest.mark.parametrize("case", child.CASES)
def test_towers_without_examples_run_nothing_and_weigh_zero(empty_runs, case):
    """Batches of 1 (and 2) on 2 or 3 towers: the model never sees an empty shard, and
    the loss, outputs, variables and Adam slots equal one device's on the same batches.

    With an accumulator (windows of 2 runs) they equal one device's on each window.
    """
    static = case.endswith("static")
    accumulated = "accumulated" in case
    np.testing.assert_allclose(empty_runs[case + "/eval_loss"], empty_runs["one/eval_loss"], rtol=1e-9)
    steps = 2 if static else len(child.SIZES)
    for step in range(steps):
        got, want = _at(empty_runs, case, step), _at(empty_runs, "one", step)
        assert got["outputs"].shape == (child.SIZES[step],)
        if not accumulated or step == 0:  # Accumulated, later runs see other weights.
            np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-9)
            np.testing.assert_allclose(got["outputs"], want["outputs"], rtol=1e-9)
        if accumulated:
            if step % 2 == 0:
                continue
            want = _at(empty_runs, "merged", step // 2)  # A window's end: one device's update on it.
        names = [key for key in want if key not in ("loss", "outputs")]
        assert len(names) >= 7 and set(names) <= set(got)  # Model, Adam's slots and beta powers.
        for name in names:  # The fused LSTM (TF 1.15) is float32, the rest float64.
            rtol = 1e-9 if want[name].dtype == np.float64 else 1e-5
            np.testing.assert_allclose(got[name], want[name], rtol=rtol, atol=1e-12, err_msg=name)
    assert not np.allclose(_at(empty_runs, "one", 1)["w1"], _at(empty_runs, "one", 0)["w1"])
