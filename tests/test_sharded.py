"""Tests of gradaccum.sharded (ZeRO stages 1 and 2 over collective workers) and gradaccum.consolidate.

Stage 2 (``shard_cache=True``) runs the same jobs on the same model (its
sparse variable summed over the workers on every micro-batch, cached and
applied sparse by its owner), and its refusals are checked by message. Its
statistics (after every window) and AdaptiveBatch's window sizes are
compared with the unsharded engine's in the same processes, and what an
observer's hooks get in stage 2 is checked on the graph.

The single-process tests check the partition rule, one process (P = 1), the
errors, the graph a worker of two builds (slots, broadcasts, their order and
keys) and the consolidation of shards written without training. The
``distributed`` ones start loopback workers of tests/sharded_child.py
directly (float64, a sparse ``tf.gather`` variable, uneven shares and
micro-batches, a zero-weight window and a NaN window, with and without
``clip_norm``) and compare with the unsharded engine in the same processes and with one process on the union of
the data (this process), to 1e-9.
"""
import functools
import glob
import os
import subprocess

import numpy as np
import pytest

import gradaccum
from gradaccum import consolidate, observers, sharded
from gradaccum._compat import BROADCAST_FROM_ANY_TASK, loss_scale_optimizer_types, tf, v1_control_flow
import forkserver
from test_collective import _ancestors, _config
from test_distributed import _env

import sharded_child as child

pytestmark = pytest.mark.timeout(180)

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sharded_child.py")
_NAMES = [name for name, _ in child.initial_values()]
_TOL = dict(rtol=1e-9, atol=1e-9)


def _variables(sizes):
    """Float32 variables named a, b, ... of ``sizes`` elements (float64 where the size is negative)."""
    made = []
    for i, size in enumerate(sizes):
        dtype = tf.float64 if size < 0 else tf.float32
        made.append(tf.compat.v1.get_variable(chr(ord("a") + i), [abs(size)], dtype))
    return made


def test_partition_is_greedy_by_bytes_ties_by_name_then_lowest_rank():
    with tf.Graph().as_default():
        # bytes: a 400, b 240, c 200, d 160 (float64), e 40
        made = _variables([100, 60, 50, -20, 10])
        assert sharded.partition_variables(made, 2) == [0, 1, 1, 0, 1]  # loads 560 and 480
        assert sharded.partition_variables(made, 1) == [0] * 5
    with tf.Graph().as_default():
        a, b, c = _variables([8, -4, 8])  # all 32 bytes: by name a, b, c to ranks 0, 1, 2, then ...
        assert sharded.partition_variables([c, b, a], 3) == [2, 1, 0]
        assert sharded.partition_variables([c, b, a], 2) == [0, 1, 0]
    with tf.Graph().as_default():  # One dominant variable: its owner holds it alone.
        owners = sharded.partition_variables(_variables([1000, 10, 10, 10, 10]), 3)
        assert owners == [0, 1, 2, 1, 2]
        with pytest.raises(ValueError, match=r"^`num_workers` must be an int >= 1, got 0$"):
            sharded.partition_variables([], 0)
        unknown = tf.compat.v1.placeholder(tf.float32, [None])
        with pytest.raises(ValueError, match=r"^collective reduction needs fully defined shapes: variable 'v' has "):
            sharded.partition_variables([tf.compat.v1.Variable(unknown, validate_shape=False, name="v")], 2)


def test_bad_combinations_are_one_clear_line():
    sgd = tf.compat.v1.train.GradientDescentOptimizer(0.1)
    with pytest.raises(TypeError, match=r"`config` must be a gradaccum.cluster.ClusterConfig or None, got 'x'"):
        gradaccum.ShardedAllReduce(sgd, "x")
    with pytest.raises(TypeError, match=r"`optimizer` must be a tf.compat.v1.train.Optimizer, got str"):
        gradaccum.ShardedAllReduce("sgd", None)
    with pytest.raises(ValueError, match=r"^`optimizer` must not be a reducer or a GradientAccumulator .*"
                                         r"got GradientAccumulator$"):
        gradaccum.ShardedAllReduce(gradaccum.GradientAccumulator(sgd, 2), None)
    with pytest.raises(ValueError, match=r"got CollectiveAllReduce$"):
        gradaccum.ShardedAllReduce(gradaccum.CollectiveAllReduce(sgd, None), None)
    scaled = [t for t in loss_scale_optimizer_types() if "MixedPrecision" in t.__name__]
    if scaled:
        with pytest.raises(ValueError, match=r"^`optimizer` MixedPrecisionLossScaleOptimizer is a loss-scale "
                                             r"optimizer: ShardedAllReduce cannot shard its state"):
            gradaccum.ShardedAllReduce(scaled[0](sgd, "dynamic"), None)
    with tf.Graph().as_default():
        flag = tf.compat.v1.get_variable("flag", initializer=tf.constant(1, tf.int16))
        opt = gradaccum.ShardedAllReduce(sgd, _config(2))
        with pytest.raises(ValueError, match=r"broadcasts every trained variable: dtypes .*, got 'flag' of int16"):
            opt.apply_reduced([(tf.constant(1, tf.int16), flag)])
    with pytest.raises(ValueError, match=r"^`loss_scaling` must not be True with ShardedAllReduce: each worker "
                                         r"applies the wrapped optimizer to its own variables only, so a loss-scale "
                                         r"optimizer would test its own share for overflow"):
        gradaccum.GradientAccumulator(gradaccum.ShardedAllReduce(sgd, None), 2, loss_scaling=True)


def _stage2_graph(rank=0, workers=2, **accumulator):
    """Builds worker ``rank``'s stage-2 train op in a graph of its own (v1 control flow); returns (graph, reducer)."""
    graph = tf.Graph()
    with graph.as_default(), v1_control_flow():
        reducer = gradaccum.ShardedAllReduce(child.optimizer(tf, "adam"), _config(workers, rank), shard_cache=True)
        if accumulator:
            x = tf.compat.v1.placeholder(tf.float64, [None, 3])
            w = tf.compat.v1.get_variable("w", initializer=np.ones([3, 1]))
            b = tf.compat.v1.get_variable("b", initializer=np.zeros([1]))
            opt = gradaccum.GradientAccumulator(reducer, 3, **accumulator)
            opt.minimize(tf.reduce_sum(tf.matmul(x, w) + b), tf.compat.v1.train.get_or_create_global_step())
        else:
            child.build(tf, lambda: reducer)
    return graph, reducer


@pytest.mark.parametrize("case, message", [
    (dict(loss_scaling=True), r"^`loss_scaling` must not be True with ShardedAllReduce: each worker applies the "
                              r"wrapped optimizer to its own variables only, .* use skip_nonfinite=True$"),
    (dict(skip_nonfinite=True), r"^ShardedAllReduce\(shard_cache=True\) needs every worker to own a variable: 2 "
                                r"variables with gradients over `config`'s 3 workers leave rank 2 none$"),
])
def test_stage2_refuses_what_needs_the_whole_micro_batch_gradient(case, message):
    workers = 3 if "skip_nonfinite" in case else 2
    with pytest.raises(ValueError, match=message):
        _stage2_graph(workers=workers, **case)
    with pytest.raises(TypeError, match=r"^`shard_cache` must be a bool, got 'yes'$"):
        gradaccum.ShardedAllReduce(child.optimizer(tf, "sgd"), None, shard_cache="yes")


class _CachesItsShare(gradaccum.Reducer):
    """A user's reducer that sums each micro-batch itself (here: one worker, so the sum is its own)."""

    def reduce_micro_batch(self, grads_and_vars, weight):
        return [(g * tf.cast(weight, g.dtype), v) for g, v in grads_and_vars]


def test_the_window_refuses_loss_scaling_with_any_reducer_that_caches_a_share():
    with tf.Graph().as_default(), v1_control_flow():
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        w = tf.compat.v1.get_variable("w", initializer=np.ones([3, 1]))
        opt = gradaccum.GradientAccumulator(_CachesItsShare(child.optimizer(tf, "sgd"), "mine"), 3,
                                            loss_scaling=True)
        with pytest.raises(ValueError, match=r"^_CachesItsShare sums each micro-batch over the workers and caches a "
                                             r"share of the gradient \(shard_cache=True\): it cannot be combined "
                                             r"with loss scaling, which need"):
            opt.minimize(tf.reduce_sum(tf.matmul(x, w)), weight=tf.shape(x)[0])



class _Seen(gradaccum.WindowObserver):
    """Keeps what the window hands its hooks while the train op is built."""

    def __init__(self):
        self.micro_batches, self.updates = [], []

    def added(self, micro_batch):
        self.micro_batches.append(micro_batch)
        return []

    def applying(self, update):
        self.updates.append(update)
        return []


def test_a_stage2_observer_sees_local_micro_batches_and_the_whole_squared_norm_with_its_share():
    shares = []
    for rank in (0, 1):
        seen = _Seen()
        graph, reducer = _stage2_graph(rank, statistics=True, observers=[seen])
        (micro_batch,), (update,) = seen.micro_batches, seen.updates
        # added: this worker's own gradients of every variable, before the all-reduce.
        assert sorted(v.op.name for _, v in micro_batch.grads_and_vars) == ["b", "w"]
        reduces = [op for op in graph.get_operations() if op.type == "CollectiveReduce"]
        micro = [op for op in reduces if "_micro_batch/" in op.name]
        assert len(micro) == 1 and not any(micro[0] in _ancestors(g.op) for g, _ in micro_batch.grads_and_vars)
        # applying: the owned share, and the whole window's squared norm, from the window's exchange.
        share = sorted(v.op.name for _, v in update.grads_and_vars)
        assert share == sorted(n for n, r in reducer.owners.items() if r == rank) and len(share) == 1
        shares.extend(share)
        assert update.sq_norm is not None and update.sq_norm.shape.ndims == 0
        window = [op for op in reduces if "_reduce/" in op.name]
        assert len(window) == 1 and window[0] in _ancestors(update.sq_norm.op)
        # weight, the statistics' 3 small-batch sums, the share's squared norm (no skip_nonfinite here)
        assert window[0].inputs[0].shape.num_elements() == 5
    assert sorted(shares) == ["b", "w"]
    assert observers.WindowUpdate([], 1.0, [], []).sq_norm is None  # A user's 4-field update still builds.


def test_a_stage2_worker_caches_its_own_variables_and_all_reduces_every_micro_batch():
    keys = []
    for rank in (0, 1):
        graph, reducer = _stage2_graph(rank)
        with graph.as_default():
            names = [v.op.name for v in tf.compat.v1.global_variables()]
        mine = sorted(n for n, r in reducer.owners.items() if r == rank)
        assert sorted(reducer.owners) == sorted(_NAMES) and 0 < len(mine) < len(_NAMES)
        assert sorted(n.rsplit("/", 1)[0] for n in names if n.endswith("/GradientAccumulator")) == mine
        assert sorted(n[:-len("/Adam")] for n in names if n.endswith("/Adam")) == mine
        # The sparse variable is cached sparse by its owner: row flags, rows added by a scatter.
        touched = [n for n in names if n.endswith("/GradientAccumulator_touched")]
        assert touched == (["emb/GradientAccumulator_touched"] if "emb" in mine else [])
        ops = graph.get_operations()
        scatters = [op for op in ops if "Scatter" in op.type and "/accumulate/" in op.name]
        assert sorted(set(_source(op.inputs[0]) for op in scatters)) == (
            ["emb/GradientAccumulator", "emb/GradientAccumulator_touched"] if "emb" in mine else [])
        micro = [op for op in ops if op.type == "CollectiveReduce" and "_micro_batch/" in op.name]
        window = [op for op in ops if op.type == "CollectiveReduce" and "_reduce/" in op.name]
        assert len(micro) == 1 and len(window) == 1  # float64 only: one buffer each
        assert micro[0].inputs[0].shape.num_elements() == sum(  # emb travels dense, with a flag per row
            int(np.prod(value.shape)) for _, value in child.initial_values()) + child.ROWS
        assert reducer.micro_batch_bytes == 8 * micro[0].inputs[0].shape.num_elements()
        # The window's exchange carries the weight, the share's squared norm and its non-finite flag only.
        assert window[0].inputs[0].shape.num_elements() == 2
        keys.append(sorted(op.get_attr("instance_key") for op in ops if op.type.startswith("Collective")))
    assert [k - keys[0][0] for k in keys[0]] == [k - keys[1][0] for k in keys[1]]  # alike on both workers


def test_a_stage2_worker_caches_the_sparse_sums_over_the_rows_any_worker_touched_and_its_own_norm():
    """Rank 0 of 2 owns ``emb``; its peer is faked in the all-reduce: it touches row 2 with ones every time."""
    with tf.Graph().as_default():
        emb = tf.compat.v1.get_variable("emb", initializer=np.zeros([4, 3]))
        w = tf.compat.v1.get_variable("w", initializer=np.ones([3]))
        ids, weight = tf.compat.v1.placeholder(tf.int32, [None]), tf.compat.v1.placeholder(tf.float64, [])
        reducer = gradaccum.ShardedAllReduce(child.optimizer(tf, "adam"), _config(2, 0), shard_cache=True)
        # A micro-batch's packed buffer: emb's dense rows, emb's row flags, w (the window's end: its own).
        peer = np.concatenate([np.eye(4)[2].repeat(3), np.eye(4)[2], np.zeros(3)])
        reducer._all_reduce = lambda piece: piece + peer if piece.shape.num_elements() == peer.size else piece
        loss = tf.reduce_sum(tf.gather(emb, ids) * w)
        opt = gradaccum.GradientAccumulator(reducer, 3, clip_norm=1.0)
        opt.apply_gradients(list(zip(tf.gradients(loss, [emb, w]), [emb, w])), weight=weight)
        window = opt.windows[-1]
        assert [v.op.name for v in window.variables] == ["emb"] and window.touched[0] is not None
        sparse_sq = [v for v in window.state_variables() if v.op.name.endswith("/sparse_sq_norm")]
        with tf.compat.v1.Session(config=_PRUNED) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            # Row 1 twice at weight 2; row 3 at weight 0 (its sum is 0, it is touched); an empty micro-batch.
            for rows, value in (([1, 1], 2.0), ([3], 0.0), ([], 0.0)):
                sess.run(window.accumulate_op, {ids: rows, weight: value})
            cache, touched, norm = sess.run([window.accumulators[0], window.touched[0], sparse_sq[0]])
    np.testing.assert_array_equal(cache, [[0] * 3, [4] * 3, [3] * 3, [0] * 3])  # row 1: 2 rows x weight 2
    np.testing.assert_array_equal(touched, [0, 1, 1, 1])
    assert norm == 24.0  # this worker's own rows as given: 2^2 * (3 + 3), summed over the workers at the end


def reference(opt_name, shares, count, empty=None, nan=None, extra=0):
    """One process, plain optimizer, one run per applied window on the union of the workers' points.

    Returns the variables and the Adam state (:func:`sharded_child.slots`) by name. Each is computed
    once per session (float64 from fixed values: the same arguments give the same arrays); do not
    change what it returns.
    """
    return _reference(opt_name, tuple(shares), count, empty, nan, extra)


@functools.lru_cache(maxsize=None)
def _reference(opt_name, shares, count, empty, nan, extra):
    plan, skipped = child.windows(shares, count + extra, empty, nan)
    clip = child.CLIP_NORM if opt_name == "adamclip" else None
    with tf.Graph().as_default():
        graph = child.build(tf, lambda: child.optimizer(tf, opt_name), k=None, clip_norm=clip)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for w in range(count + extra):
                if w not in skipped:
                    sess.run(graph["train"], child.feed(graph, np.concatenate([p for ps in plan[w] for p in ps])))
            return sess.run(dict(graph["variables"], **child.slots(tf)))


@pytest.mark.parametrize("opt_name", ["adam", "sgd"])
def test_one_process_is_the_wrapped_optimizer_on_the_union(opt_name):
    plan, _ = child.windows([24], 4)
    with tf.Graph().as_default():
        graph = child.build(tf, lambda: gradaccum.ShardedAllReduce(child.optimizer(tf, opt_name), None))
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for window in plan:
                for points in window[0]:
                    sess.run(graph["train"], child.feed(graph, points))
            got, step = sess.run(graph["variables"]), sess.run(graph["step"])
    want = reference(opt_name, [24], 4)
    assert step == 4
    for name in _NAMES:
        np.testing.assert_allclose(got[name], want[name], err_msg=name, **_TOL)


def _build_worker(rank, workers=2, opt_name="adam"):
    """Builds (does not run) worker ``rank``'s train op in the default graph; returns (tensors, reducer)."""
    reducer = gradaccum.ShardedAllReduce(child.optimizer(tf, opt_name), _config(workers, rank))
    return child.build(tf, lambda: reducer), reducer


def _worker_graph(rank, workers=2, opt_name="adam"):
    """:func:`_build_worker` in a graph of its own; returns (graph, tensors, reducer).

    With v1 control flow, so that the collectives are ops of the graph in both
    behaviours (control flow v2 hides them in branch functions).
    """
    graph = tf.Graph()
    with graph.as_default(), v1_control_flow():
        built, reducer = _build_worker(rank, workers, opt_name)
    return graph, built, reducer


def _source(tensor):
    """The name of the op behind ``tensor``, through the cond's Switch and the Identity ops on the way."""
    while tensor.op.type in ("Switch", "RefSwitch", "Identity", "RefIdentity", "Enter", "RefEnter"):
        tensor = tensor.op.inputs[0]
    return tensor.op.name


def test_a_worker_builds_slots_for_its_variables_only_and_broadcasts_after_its_update():
    keys = []
    for rank in (0, 1):
        graph, built, reducer = _worker_graph(rank)
        with graph.as_default():
            names = [v.op.name for v in tf.compat.v1.global_variables()]
            owners = sharded.partition_variables([built["variables"][n] for n in _NAMES], 2)
        mine = sorted(n for n, r in zip(_NAMES, owners) if r == rank)
        assert reducer.owners == dict(zip(_NAMES, owners))
        assert sorted(n[:-len("/Adam")] for n in names if n.endswith("/Adam")) == mine
        assert sorted(n[:-len("/Adam_1")] for n in names if n.endswith("/Adam_1")) == mine
        assert names.count("beta1_power") == 1 and names.count("beta2_power") == 1
        ops = graph.get_operations()
        reduces = [op for op in ops if op.type == "CollectiveReduce" and "_broadcast/" in op.name]
        sends = [op for op in ops if op.type == "CollectiveBcastSend"] + (reduces if rank == 1 else [])
        recvs = [op for op in ops if op.type == "CollectiveBcastRecv"] + (reduces if rank == 0 else [])
        # Every variable is float64: one broadcast per owner, this worker sends one and receives one;
        # rank 1's is an all-reduce where TF cannot broadcast from a task that does not lead the group.
        assert (len(sends), len(recvs), reducer.broadcasts_per_update) == (1, 1, 2)
        assert len(reduces) == (0 if BROADCAST_FROM_ANY_TASK else 1)
        bytes_of = dict((n, built["variables"][n].shape.num_elements() * 8) for n in _NAMES)
        assert reducer.broadcast_bytes_per_update == sum(bytes_of[n] for n in _NAMES if owners[_NAMES.index(n)] == rank
                                                         or (owners[_NAMES.index(n)] == 1 and reduces))
        written = set(_source(op.inputs[0]) for op in _ancestors(sends[0]) if op.inputs and "_broadcast/" not in
                      op.name and any(word in op.type for word in ("Apply", "Assign", "Scatter")))
        assert sorted(written & set(_NAMES)) == mine  # The send waits for this worker's update, of its own.
        assert not any(op in _ancestors(recvs[0]) for op in ops if op.type in ("ApplyAdam", "ResourceApplyAdam"))
        collectives = sorted((op for op in ops if op.type.startswith("Collective")),
                             key=lambda op: op.get_attr("instance_key"))
        first = collectives[0].get_attr("instance_key")
        keys.append([(op.get_attr("instance_key") - first, op.type.replace("Send", "").replace("Recv", ""))
                     for op in collectives])  # (Send and Recv of one broadcast alike)
        step_adds = [op for op in ops if op.type in ("AssignAdd", "AssignAddVariableOp")
                     and _source(op.inputs[0]) == "global_step"]
        assert step_adds and all(recvs[0] in _ancestors(op) and sends[0] in _ancestors(op) for op in step_adds)
    assert keys[0] == keys[1]  # The same collectives, in the same order, with the same keys on both workers.


# A worker's graph names its collectives' device: place only what a run needs, none of them.
_PRUNED = tf.compat.v1.ConfigProto(graph_options=tf.compat.v1.GraphOptions(place_pruned_graph=True))


def _save_shard(rank, workers, directory, step=5, stage2=False, micro_step=0):
    """Worker ``rank``'s checkpoint with every variable set to a value of its own name (model alike)."""
    graph = _stage2_graph(rank, workers)[0] if stage2 else _worker_graph(rank, workers)[0]
    with graph.as_default(), tf.compat.v1.Session(config=_PRUNED) as sess:
        for var in tf.compat.v1.global_variables():
            value = np.zeros(var.shape, var.dtype.base_dtype.as_numpy_dtype)
            if var.dtype.base_dtype == tf.float64:
                value += len(var.op.name) + np.arange(value.size).reshape(value.shape)
            if var.op.name.endswith("/micro_step"):
                value += micro_step
            var.load(value, sess)
        tf.compat.v1.train.get_global_step().load(step, sess)
        saver = tf.compat.v1.train.Saver()
        shard = consolidate.shard_directory(directory, _config(workers, rank))
        return saver.save(sess, os.path.join(shard, "model.ckpt"), global_step=step)


def _restore_values(path, build_graph):
    with tf.Graph().as_default():
        build_graph()
        with tf.compat.v1.Session(config=_PRUNED) as sess:
            tf.compat.v1.train.Saver().restore(sess, path)
            return dict((v.op.name, sess.run(v)) for v in tf.compat.v1.global_variables())


def test_consolidated_shards_restore_into_one_unsharded_process_and_into_three_workers(tmp_path):
    directory = str(tmp_path / "ckpt")
    prefixes = [_save_shard(rank, 2, directory) for rank in (0, 1)]
    assert consolidate.sharded_checkpoints(directory) == (5, prefixes)
    assert consolidate.latest_shard(directory, _config(2, 1)) == prefixes[1]
    assert consolidate.main([directory, str(tmp_path / "out" / "model.ckpt")]) == 0
    out = str(tmp_path / "out" / "model.ckpt")
    plain = _restore_values(out, lambda: child.build(tf, lambda: child.optimizer(tf, "adam"), k=None))
    assert int(plain["global_step"]) == 5
    for name, value in plain.items():  # Each worker wrote len(name) + arange: the owner's slots came through.
        if value.dtype == np.float64:
            np.testing.assert_array_equal(value, len(name) + np.arange(value.size).reshape(value.shape), name)
    assert sum(name.endswith("/Adam") for name in plain) == len(_NAMES)
    third = _restore_values(out, lambda: _build_worker(2, 3))
    # A worker of three restores its share: b1, w2, scale, b2 (emb and w1 are ranks 0's and 1's).
    assert sorted(name[:-5] for name in third if name.endswith("/Adam")) == ["b1", "b2", "scale", "w2"]
    np.testing.assert_array_equal(third["w2/Adam"], plain["w2/Adam"])
    with pytest.raises(ValueError, match=r"holds shards of 2 workers, this job has 3: run `python -m gradaccum."):
        consolidate.latest_shard(directory, _config(3, 0))
    with pytest.raises(ValueError, match=r"^`step` 4 is not held by every shard of .* \(common steps: \[5\]\)$"):
        consolidate.consolidate(directory, out, step=4)
    with pytest.raises(ValueError, match=r"^`checkpoint_dir` '.*none' holds no step that every shard has$"):
        consolidate.consolidate(str(tmp_path / "none"), out)
    os.makedirs(os.path.join(directory, "shard-0-of-3"))
    with pytest.raises(ValueError, match=r"holds shards of 2 and 3 workers; keep one job's shards per directory"):
        consolidate.sharded_checkpoints(directory)


@pytest.mark.parametrize("micro_step", [0, 1])
def test_stage2_shards_consolidate_at_a_window_end_only(micro_step, tmp_path):
    directory, out = str(tmp_path / "ckpt"), str(tmp_path / "out" / "model.ckpt")
    for rank in (0, 1):
        _save_shard(rank, 2, directory, stage2=True, micro_step=micro_step)
    if micro_step:
        with pytest.raises(ValueError, match=r"^the shards were saved in the middle of a window of "
                                             r"'GradientAccumulator' by a job with shard_cache=True"):
            consolidate.consolidate(directory, out)
        return
    plain = _restore_values(consolidate.consolidate(directory, out), lambda: child.build(
        tf, lambda: child.optimizer(tf, "adam")))  # One process, unsharded: a cache per variable.
    caches = [name for name in plain if name.endswith(("/GradientAccumulator", "/GradientAccumulator_touched"))]
    assert sorted(name.rsplit("/", 1)[0] for name in caches) == sorted(_NAMES + ["emb"])
    for name in caches + [n + "/Adam" for n in _NAMES]:  # each from its owner's shard
        np.testing.assert_array_equal(plain[name], len(name) + np.arange(plain[name].size).reshape(
            plain[name].shape), name)


# ------------------------------------------------------------ multi-process

# 2 workers are the same engine and graphs as 3: the tf2 session runs the 3 workers' case only.
_TF2_RUNS_3_WORKERS = pytest.mark.one_behaviour(reason="the tf2 session runs the 3 workers' shares, the same path")


def _run_job(workers, args, timeout=150, child_script=_CHILD):
    """Starts ``workers`` loopback children; returns their (status, stdout, stderr), killing all on timeout."""
    from gradaccum import launch

    spec = launch.build_cluster(workers, 0, "127.0.0.1", launch.pick_free_ports(workers))
    procs = [subprocess.Popen(forkserver.command() + [child_script] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              universal_newlines=True,
                              env=dict(_env(), TF_CONFIG=launch.tf_config_for(spec, "worker", i)))
             for i in range(workers)]
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return results


def _load(out, run, rank):
    return dict(np.load("%s-%s-worker%d.npz" % (out, run, rank)))


def _assert_adam_state(got, want, sharded, run):
    """Each moment is held by its owner only (sharded) or by every worker, and equals one process's."""
    for key in (k for k in want if k.startswith("slot_")):
        holders = [values for values in got if key in values]
        assert len(holders) == (1 if sharded and not key.endswith("_power") else len(got)), (run, key)
        for values in holders:
            np.testing.assert_allclose(values[key], want[key], err_msg="%s %s" % (run, key), **_TOL)


@pytest.fixture(scope="module")
def engines_job(tmp_path_factory):
    """A function ``shares -> out prefix`` that runs each job once per module.

    Both stages (Adam, SGD, Adam with ``clip_norm``) then the unsharded engine
    (Adam), in the same processes: the unsharded run is the one both stages'
    tests compare with. Six windows, window 1 of zero weight and window 3
    with a NaN (both skipped).
    """
    done = {}

    def run(shares):
        if tuple(shares) not in done:
            runs = ["%s-%s" % (engine, opt_name) for engine in ("sharded", "stage2")
                    for opt_name in ("adam", "sgd", "adamclip")] + ["collective-adam"]
            out = str(tmp_path_factory.mktemp("engines") / "run")
            results = _run_job(len(shares), ["--runs", ",".join(runs), "--shares", ",".join(map(str, shares)),
                                             "--windows", "6", "--empty-window", "1", "--nan-window", "3",
                                             "--out", out])
            assert [status for status, _, _ in results] == [0] * len(shares), [e[-2000:] for _, _, e in results]
            done[tuple(shares)] = out
        return done[tuple(shares)]

    return run


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["sharded", "stage2"])
@pytest.mark.parametrize("shares", [pytest.param([9, 15], marks=_TF2_RUNS_3_WORKERS), [5, 12, 7]])
def test_sharded_workers_equal_the_unsharded_engine_and_one_process(shares, engine, engines_job):
    """Stage 1 (``sharded``) and stage 2 (``stage2``, ``shard_cache=True``) on the model with a sparse embedding,
    with and without ``clip_norm``: the model and Adam's state equal the unsharded engine's and one process's."""
    out, workers = engines_job(shares), len(shares)
    runs = [engine + "-adam", engine + "-sgd", engine + "-adamclip", "collective-adam"]
    for run in runs:
        engine, opt_name = run.split("-")
        want = reference(opt_name, shares, 6, empty=1, nan=3)
        got = [_load(out, run, rank) for rank in range(workers)]
        _assert_adam_state(got, want, engine != "collective", run)
        for rank, values in enumerate(got):
            assert (int(values["step"]), int(values["skipped"])) == (4, 2), (run, rank)  # alike everywhere
            for name in _NAMES:
                np.testing.assert_allclose(values[name], want[name], err_msg="%s %s" % (run, name), **_TOL)
                np.testing.assert_array_equal(values[name], got[0][name], err_msg="%s %s" % (run, name))
        if engine == "collective":
            unsharded = got
            continue
        owners = dict(zip(got[0]["owner_names"].tolist(), got[0]["owner_ranks"].tolist()))
        assert sorted(owners) == sorted(_NAMES) and set(owners.values()) == set(range(workers))
        for rank, values in enumerate(got):
            held = values["held_names"].tolist()
            slots = sorted(n.rsplit("/", 1)[0] for n in held if n.endswith(("/Adam", "/Adam_1")))
            mine = sorted(n for n in _NAMES if owners[n] == rank)
            assert slots == (sorted(mine * 2) if opt_name != "sgd" else []), (run, rank)
            caches = sorted(n.rsplit("/", 1)[0] for n in held if n.endswith("/GradientAccumulator"))
            assert caches == (mine if engine == "stage2" else sorted(_NAMES)), (run, rank)
            assert held.count("beta1_power") == (1 if opt_name != "sgd" else 0)
            assert values["owner_ranks"].tolist() == got[0]["owner_ranks"].tolist()
    for name in _NAMES:  # and the unsharded engine's Adam, in the same processes
        np.testing.assert_allclose(_load(out, runs[0], 0)[name], unsharded[0][name], **_TOL)
    clipped = _load(out, runs[2], 0)  # The clip bound: the whole gradient's norm, on every worker.
    assert not np.allclose(clipped["w1"], unsharded[0]["w1"], rtol=1e-6, atol=1e-6)


@pytest.mark.one_behaviour
@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["sharded", "stage2"])
def test_a_relaunch_after_sigkill_resumes_exactly_and_the_consolidation_continues_in_one_process(engine, tmp_path):
    out, ckpt = str(tmp_path / "run"), str(tmp_path / "ckpt")
    args = ["--runs", engine + "-adam", "--shares", "9,15", "--windows", "7", "--checkpoint-dir", ckpt,
            "--checkpoint-every", "3", "--out", out]
    killed = _run_job(2, args + ["--kill-at", "5"])
    assert killed[1][0] == -9 and killed[0][0] != 0, [(s, e[-1500:]) for s, _, e in killed]
    assert "saved global_step 3" in killed[0][1] and "saved global_step 6" not in killed[0][1]
    resumed = _run_job(2, args)
    assert [status for status, _, _ in resumed] == [0, 0], [err[-2000:] for _, _, err in resumed]
    assert all("restored global_step 3\n" in text for _, text, _ in resumed)
    want = reference("adam", [9, 15], 7)
    final = [_load(out, engine + "-adam", rank) for rank in (0, 1)]
    _assert_adam_state(final, want, True, engine)
    for name in _NAMES:
        for values in final:
            np.testing.assert_allclose(values[name], want[name], err_msg=name, **_TOL)

    ordinary = consolidate.consolidate(ckpt, str(tmp_path / "ordinary" / "model.ckpt"))
    assert sorted(glob.glob(os.path.join(ckpt, "shard-*-of-2"))) == [os.path.join(ckpt, "shard-%d-of-2" % r)
                                                                      for r in (0, 1)]
    plan, _ = child.windows([9, 15], 8)
    with tf.Graph().as_default():  # One unsharded process restores it and trains window 8: Adam's state is whole.
        graph = child.build(tf, lambda: child.optimizer(tf, "adam"), k=None)
        with tf.compat.v1.Session() as sess:
            tf.compat.v1.train.Saver().restore(sess, ordinary)
            assert int(sess.run(graph["step"])) == 7
            restored = sess.run(graph["variables"])
            sess.run(graph["train"], child.feed(graph, np.concatenate([p for ps in plan[7] for p in ps])))
            continued = sess.run(graph["variables"])
    want8 = reference("adam", [9, 15], 7, extra=1)
    for name in _NAMES:
        np.testing.assert_array_equal(restored[name], final[0][name], err_msg=name)
        np.testing.assert_allclose(continued[name], want8[name], err_msg=name, **_TOL)


_OBSERVED_RUNS = ["stage2-adamstats", "collective-adamstats", "stage2-adaptive", "collective-adaptive",
                  "stage2-adamclipstats", "collective-adamclipstats"]


@pytest.fixture(scope="module")
def observed_job(tmp_path_factory):
    """A function ``shares -> {run: [worker's npz values, ...]}`` that runs each job once per module.

    Adam with statistics, stage 2 then unsharded, in the same processes; on
    two workers SGD under AdaptiveBatch, and Adam with statistics and
    ``clip_norm`` (the observers' norm of the summed sparse rows, and the
    clip norm of the rows as given, reduced apart), too. Six windows, window 1 of zero
    weight and window 3 with a NaN (both skipped).
    """
    done = {}

    def run(shares):
        if tuple(shares) not in done:
            runs = _OBSERVED_RUNS if len(shares) == 2 else _OBSERVED_RUNS[:2]
            out = str(tmp_path_factory.mktemp("observed") / "run")
            results = _run_job(len(shares), ["--runs", ",".join(runs), "--shares", ",".join(map(str, shares)),
                                             "--windows", "6", "--empty-window", "1", "--nan-window", "3",
                                             "--out", out])
            assert [status for status, _, _ in results] == [0] * len(shares), [e[-2000:] for _, _, e in results]
            done[tuple(shares)] = dict((name, [_load(out, name, rank) for rank in range(len(shares))])
                                       for name in runs)
        return done[tuple(shares)]

    return run


def _statistics_of(values):
    """The statistics after every window, by name, and the noise scale they give."""
    stats = dict((name[len("stats_"):], value) for name, value in values.items() if name.startswith("stats_"))
    stats["noise_scale"] = stats["ema_noise_trace"] / stats["ema_gradient_sq"]
    return stats


def _assert_stage2_equals_unsharded(stage2, unsharded):
    """Every worker's model and statistics, after every window: alike everywhere, the unsharded engine's to 1e-9."""
    want = _statistics_of(unsharded[0])
    assert sorted(want) == sorted(["noise_scale", "windows"] + list(gradaccum.statistics._WINDOW)
                                  + list(gradaccum.statistics._LAST) + list(gradaccum.statistics._SMOOTHED))
    for workers in (stage2, unsharded):
        first = _statistics_of(workers[0])
        for got in workers:
            stats = _statistics_of(got)
            assert (int(got["step"]), int(got["skipped"])) == (4, 2)
            for name in want:
                np.testing.assert_allclose(stats[name], want[name], err_msg=name, **_TOL)
                np.testing.assert_array_equal(stats[name], first[name], err_msg=name)
            for name in _NAMES:
                np.testing.assert_allclose(got[name], unsharded[0][name], err_msg=name, **_TOL)
                np.testing.assert_array_equal(got[name], workers[0][name], err_msg=name)
    return want


@pytest.mark.distributed
@pytest.mark.parametrize("shares", [pytest.param([9, 15], marks=_TF2_RUNS_3_WORKERS), [5, 12, 7]])
def test_stage2_statistics_equal_the_unsharded_engines_on_every_worker(shares, observed_job):
    runs = observed_job(shares)
    want = _assert_stage2_equals_unsharded(runs["stage2-adamstats"], runs["collective-adamstats"])
    # Every applied window gave an estimate; the skipped ones (1, 3) changed nothing.
    np.testing.assert_array_equal(want["windows"], [1, 1, 2, 2, 3, 4])
    assert np.all(want["last_big_sq_norm"] > 0) and np.all(want["last_small_sq_norm"] > want["last_big_sq_norm"])
    np.testing.assert_array_equal(want["last_window_weight"], sum(shares))
    reference_adam = reference("adam", shares, 6, empty=1, nan=3)
    for name in _NAMES:  # Statistics change no update.
        np.testing.assert_allclose(runs["stage2-adamstats"][0][name], reference_adam[name], err_msg=name, **_TOL)


@pytest.mark.distributed
def test_stage2_adaptive_batch_chooses_the_unsharded_engines_window_sizes_on_every_worker(observed_job):
    runs = observed_job([9, 15])
    stage2, unsharded = runs["stage2-adaptive"], runs["collective-adaptive"]
    sizes = unsharded[0]["sizes"].tolist()
    assert sizes == [2, 3, 3, 6, 6, 6]  # The policy moved k twice; the skipped windows 1 and 3 kept it.
    for values in stage2 + unsharded:
        assert values["sizes"].tolist() == sizes
    want = _assert_stage2_equals_unsharded(stage2, unsharded)
    assert np.all(want["noise_scale"] > 0)


@pytest.mark.distributed
def test_stage2_statistics_with_clipping_and_a_sparse_gradient_equal_the_unsharded_engines(observed_job):
    runs = observed_job([9, 15])
    want = _assert_stage2_equals_unsharded(runs["stage2-adamclipstats"], runs["collective-adamclipstats"])
    reference_clipped = reference("adamclip", [9, 15], 6, empty=1, nan=3)
    for name in _NAMES:  # Clipped as one process clips, whatever the statistics read.
        np.testing.assert_allclose(runs["stage2-adamclipstats"][0][name], reference_clipped[name], err_msg=name,
                                   **_TOL)
    np.testing.assert_array_equal(want["windows"], [1, 1, 2, 2, 3, 4])
