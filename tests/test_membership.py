"""Tests of gradaccum.membership (elastic membership) and the launcher's restarts.

The single-process tests check the assignment of examples (every P reads the
same examples per update, uneven micro-batches, never dropped or padded), its
``tf.data`` form, the newest step of a directory holding shards of two
worker counts, and the refusal of a mid-window checkpoint on another P. The
``distributed`` ones run tests/membership_child.py on loopback: a job of 2
workers stopped and resumed by a scheduler on 3 (a new ``TF_CONFIG``; and
srun's variables of a requeued Slurm job), and a job of 3 whose worker 2 is
SIGKILLed mid-window, restarted by ``gradaccum.launch --max-restarts 1
--min-workers 2`` on 2 (it prints the time from the kill to the first update
on 2 workers, and the largest difference). Each must equal one process
trained on the same global batches (this process), to 1e-9 on the model and
Adam's state, for the collective engine and ShardedAllReduce stages 1 and 2.
"""
import functools
import os
import re
import subprocess

import numpy as np
import pytest

import gradaccum
from gradaccum import membership
from gradaccum._compat import tf
import forkserver
from test_collective import _config
from test_distributed import _LAUNCH_MODULE, _env
from test_deploy import _Tasks, _free_port_pair, scontrol_dir  # noqa: F401  (a fixture)
from test_deploy import _env as _deploy_env
from test_sharded import _NAMES, _TOL, _run_job, _save_shard

import membership_child
import sharded_child as child

pytestmark = pytest.mark.timeout(180)

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "membership_child.py")
_B, _M, _SEED = membership_child.GLOBAL_BATCH, membership_child.MICRO_BATCH, membership_child.SEED


@pytest.mark.parametrize("batch, micro, workers", [(10, 2, 1), (10, 2, 2), (10, 2, 3), (7, 3, 2), (5, 1, 5),
                                                   (5, 1, 2), (24, 4, 3)])
def test_every_p_reads_the_same_examples_per_update_in_uneven_micro_batches(batch, micro, workers):
    k = membership.micro_batches_per_worker(batch, micro, workers)
    assert k == -(-batch // (workers * micro))
    for update in range(6):  # 24 examples: updates straddle epochs
        parts = [membership.assign_examples(update, batch, micro, workers, r, 24, _SEED) for r in range(workers)]
        assert all(len(mine) == k for mine in parts)
        flat = [part for mine in parts for part in mine]
        sizes = [len(part) for part in flat]
        assert max(sizes) <= micro and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
        np.testing.assert_array_equal(np.concatenate(flat), membership.update_examples(update, batch, 24, _SEED))


def test_the_stream_is_a_new_permutation_each_epoch_and_seeded():
    stream = np.concatenate([membership.update_examples(u, 10, 24, _SEED) for u in range(12)])  # 5 epochs
    epochs = stream[:120].reshape(5, 24)
    for order in epochs:
        np.testing.assert_array_equal(np.sort(order), np.arange(24))
    assert len(set(map(tuple, epochs))) == 5
    np.testing.assert_array_equal(membership.update_examples(3, 10, 24, None), np.arange(30, 40) % 24)
    assert not np.array_equal(membership.update_examples(0, 10, 24, 1), membership.update_examples(0, 10, 24, 2))


def test_bad_arguments_are_one_line_naming_the_argument():
    with pytest.raises(ValueError, match=r"^`global_batch` must be at least the number of workers \(4\), got 3$"):
        membership.micro_batches_per_worker(3, 2, 4)
    with pytest.raises(ValueError, match=r"^`rank` must be an int in \[0, 2\), got 2$"):
        membership.assign_examples(0, 4, 2, 2, 2, 10)
    with pytest.raises(ValueError, match=r"^`micro_batch_size` must be an int >= 1, got 0$"):
        membership.micro_batches_per_worker(4, 0, 2)
    with pytest.raises(ValueError, match=r"^`update` must be an int >= 0, got -1$"):
        membership.update_examples(-1, 4, 10)
    with pytest.raises(TypeError, match=r"^`seed` must be None or an int, got 1.5$"):
        membership.update_examples(0, 4, 10, 1.5)
    with tf.Graph().as_default():
        with pytest.raises(ValueError, match=r"^`global_batch` must be at least the number of workers \(3\), got 2$"):
            gradaccum.Membership(_config(workers=3), 2, 1, 10)


def test_the_dataset_gives_this_workers_micro_batches_with_their_sizes_as_weights():
    x = np.arange(24, dtype=np.float64) * 10
    with tf.Graph().as_default():
        mine = gradaccum.Membership(_config(workers=3, index=2), _B, _M, 24, seed=_SEED)
        assert (mine.num_workers, mine.rank, mine.num_micro_batches) == (3, 2, 2)
        batch, weight = tf.compat.v1.data.make_one_shot_iterator(
            mine.dataset({"x": x}, first_update=1, num_updates=2)).get_next()
        index, _ = tf.compat.v1.data.make_one_shot_iterator(mine.dataset(first_update=1)).get_next()
        with tf.compat.v1.Session() as sess:
            for update in (1, 2):
                for part in mine.micro_batches(update):
                    got, size, at = sess.run([batch, weight, index])
                    np.testing.assert_array_equal(got["x"], x[part])
                    np.testing.assert_array_equal(at, part)
                    assert size == len(part)
            with pytest.raises(tf.errors.OutOfRangeError):
                sess.run(batch)


def _save_one_micro_batch(directory, workers, micro_batches):
    """A P-worker job's chief checkpoint after ``micro_batches`` micro-batches of update 0 (one process)."""
    with tf.Graph().as_default():
        mine = gradaccum.Membership(_config(workers=workers), _B, 3, 24)
        graph = child.build(tf, lambda: child.optimizer(tf, "adam"), k=mine.num_micro_batches)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            mine.restore(sess, saver, directory, tf.compat.v1.global_variables_initializer())
            for points in mine.micro_batches(0)[:micro_batches]:
                sess.run(graph["train"], child.feed(graph, points))
            saver.save(sess, os.path.join(directory, "model.ckpt"), global_step=graph["step"])


def _restore(directory, workers):
    with tf.Graph().as_default():
        mine = gradaccum.Membership(_config(workers=workers), _B, 3, 24)
        graph = child.build(tf, lambda: child.optimizer(tf, "adam"), k=mine.num_micro_batches)
        with tf.compat.v1.Session() as sess:
            path = mine.restore(sess, tf.compat.v1.train.Saver(), directory, None)
            return path, int(sess.run(graph["step"])), int(sess.run(mine.variable))


_MIDDLE = r"^the checkpoint .*model\.ckpt-0 was saved by %d workers in the middle of a window " \
          r"\(GradientAccumulator/micro_step = 1\): %s; resume from a checkpoint saved at the end of a window$"


def test_a_mid_window_checkpoint_resumes_on_its_own_p_only_and_a_window_end_on_any(tmp_path):
    middle, chiefs, end = str(tmp_path / "middle"), str(tmp_path / "chiefs"), str(tmp_path / "end")
    _save_one_micro_batch(middle, 1, 1)  # one process: k = 4, one micro-batch in
    with pytest.raises(ValueError, match=_MIDDLE % (1, "it resumes only on that many workers, not on 3")):
        _restore(middle, 3)
    assert _restore(middle, 1)[1:] == (0, 1)
    _save_one_micro_batch(chiefs, 2, 1)  # the chief of 2: its own partial sums only, on any P
    for workers in (2, 3):
        with pytest.raises(ValueError, match=_MIDDLE % (2, "it holds the chief's partial sums only")):
            _restore(chiefs, workers)
    _save_one_micro_batch(end, 2, 2)  # k = 2: a window's end
    path, step, recorded = _restore(end, 3)
    assert (path.endswith("model.ckpt-1"), step, recorded) == (True, 1, 3)  # and P = 3 is now recorded


def test_shards_of_two_counts_give_the_newest_step_and_mid_window_shards_are_refused_on_another_p(tmp_path):
    directory = str(tmp_path)
    for rank in (0, 1):
        _save_shard(rank, 2, directory, step=5, micro_step=1)
    step, workers, prefixes = membership.newest_checkpoint(directory, 3)
    assert (step, workers, [os.path.basename(os.path.dirname(p)) for p in prefixes]) == (
        5, 2, ["shard-0-of-2", "shard-1-of-2"])
    membership.check_window_ended(prefixes, workers, 2)  # the same P: its own partial windows
    with pytest.raises(ValueError, match=r"^the checkpoint .*shard-0-of-2.*model\.ckpt-5 was saved by 2 workers "
                                         r"in the middle of a window \(.*/micro_step = 1\): it resumes only on "
                                         r"that many workers, not on 3;"):
        membership.check_window_ended(prefixes, workers, 3)
    for rank in (0, 1, 2):  # a job resumed on 3 saved a newer step, at a window's end
        _save_shard(rank, 3, directory, step=7)
    step, workers, prefixes = membership.newest_checkpoint(directory, 2)
    assert (step, workers, len(prefixes)) == (7, 3, 3)
    membership.check_window_ended(prefixes, workers, 2)


# ------------------------------------------------------------ multi-process


@functools.lru_cache(maxsize=None)
def _reference(updates):
    """One process, the plain optimizer, on each update's global batch: the model and Adam's state by key.

    Computed once per session (float64 from fixed values: the same for every engine and test); do not
    change what it returns.
    """
    with tf.Graph().as_default():
        graph = child.build(tf, lambda: child.optimizer(tf, "adam"), k=None)
        adam = child.slots(tf)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for update in range(updates):
                sess.run(graph["train"], child.feed(graph, membership.update_examples(update, _B, 24, _SEED)))
            return sess.run(dict(graph["variables"], **adam))


def _assert_equal_to_one_process(out, engine, workers, want):
    """Every worker's model equals one process's; each Adam slot, on whoever holds it, too. Returns the largest gap."""
    gap, held = 0.0, set()
    for rank in range(workers):
        got = dict(np.load("%s-%s-worker%d.npz" % (out, engine, rank)))
        assert int(got["step"]) == _UPDATES, (engine, rank)
        for key in [k for k in want if k in got]:
            np.testing.assert_allclose(got[key], want[key], err_msg="%s %s" % (engine, key), **_TOL)
            gap = max(gap, float(np.max(np.abs(got[key] - want[key]))))
            held.add(key)
    assert held == set(want), (engine, sorted(set(want) - held))  # nothing lost: every slot somewhere
    assert set(_NAMES) <= held
    return gap


_UPDATES = 6


@pytest.mark.one_behaviour
@pytest.mark.distributed
def test_a_scheduler_that_grows_the_job_from_2_to_3_workers_resumes_every_engine_exactly(tmp_path):
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    args = ["--engines", "collective,sharded,stage2", "--checkpoint-dir", ckpt, "--out", out]
    first = _run_job(2, args + ["--updates", "3"], child_script=_CHILD)
    assert [status for status, _, _ in first] == [0, 0], [err[-2000:] for _, _, err in first]
    second = _run_job(3, args + ["--updates", str(_UPDATES)], child_script=_CHILD)  # a new TF_CONFIG
    assert [status for status, _, _ in second] == [0, 0, 0], [err[-2000:] for _, _, err in second]
    for engine in ("collective", "sharded", "stage2"):
        assert "%s: 3 workers, k = 2, from global_step 3 (restored)" % engine in second[0][1], second[0][1]
        _assert_equal_to_one_process(out, engine, 3, _reference(_UPDATES))


@pytest.mark.one_behaviour
@pytest.mark.distributed
def test_a_slurm_job_requeued_on_3_tasks_after_2_resumes_exactly(scontrol_dir, tmp_path):
    """``from_environment()`` reads the requeued allocation's srun variables: the new P, the same global batch."""
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    for tasks_now, updates in ((2, 3), (3, _UPDATES)):
        base = _free_port_pair(tasks_now)
        with _Tasks(tmp_path) as tasks:
            names = ["p%d-task%d" % (tasks_now, rank) for rank in range(tasks_now)]
            for rank, name in enumerate(names):  # What srun sets for task `rank` of one node.
                tasks.start(name, [*forkserver.command(), _CHILD, "--updates", str(updates), "--checkpoint-dir", ckpt,
                                   "--out", out], _deploy_env(
                    PATH="%s%s%s" % (scontrol_dir, os.pathsep, os.environ["PATH"]), FAKE_HOSTS="127.0.0.1",
                    SLURM_PROCID=str(rank), SLURM_NTASKS=str(tasks_now), SLURM_NODEID="0",
                    SLURM_LOCALID=str(rank), SLURM_STEP_NODELIST="node01",
                    SLURM_STEP_TASKS_PER_NODE=str(tasks_now), GRADACCUM_PORT_BASE=str(base)))
            tasks.wait(names)
    assert "collective: 3 workers, k = 2, from global_step 3 (restored)" in tasks.output("p3-task0")
    _assert_equal_to_one_process(out, "collective", 3, _reference(_UPDATES))


def _launch_with_restarts(engine, tmp_path):
    """3 workers under the launcher; worker 2 is SIGKILLed mid-window of update 3; returns (stdout, stderr)."""
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    command = _LAUNCH_MODULE + ["--workers", "3", "--max-restarts", "1", "--min-workers", "2", "--grace", "2",
                                "--checkpoint-dir", os.path.join(ckpt, engine), "--", *forkserver.command(), _CHILD,
                                "--engines", engine, "--updates", str(_UPDATES), "--kill-at", "3",
                                "--checkpoint-dir", ckpt, "--out", out]
    proc = subprocess.run(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True, timeout=150)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    return out, proc.stdout, proc.stderr


@pytest.mark.one_behaviour
@pytest.mark.distributed
# Stage 1 resizes as stage 2 does (the 2 -> 3 test runs all three): two of them keep CI's time.
@pytest.mark.parametrize("engine", ["collective", "stage2"])
def test_a_worker_killed_mid_window_restarts_the_job_on_2_workers_which_equals_one_process(engine, tmp_path):
    out, printed, said = _launch_with_restarts(engine, tmp_path)
    assert re.search(r"^gradaccum\.launch: restart 1 of 1: worker:2 died with signal 9 \(SIGKILL\); restarting 2 "
                     r"workers from global step 3$", said, re.M), said
    assert "[worker:0] %s: 2 workers, k = 3, from global_step 3 (restored)" % engine in printed, printed[-3000:]
    gap = _assert_equal_to_one_process(out, engine, 2, _reference(_UPDATES))
    killed = float(re.search(r"^\[worker:2\] killed at ([\d.]+)$", printed, re.M).group(1))
    first = float(re.search(r"^\[worker:0\] first update on 2 workers at ([\d.]+)$", printed, re.M).group(1))
    print("\n%s, 3 -> 2 workers: %.2f s from the kill to the first update on 2 workers; largest difference "
          "from one process on the same global batches %.3g" % (engine, first - killed, gap))
