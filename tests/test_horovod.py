"""GradientAccumulator over Horovod: one all-reduce per applied update.

Skipped when ``horovod.tensorflow`` is not importable (it builds against
TensorFlow 2.15, not 2.21; see docs/guides/distributed.md). The recipe under test is the
guide's: ``GradientAccumulator(cluster.AllReduceOnApply(opt, hvd_allreduce), k)``.
Each rank trains the seed's parabola net on its half of the 50 points with k
micro-batches per update; the result must equal one process's full-batch run,
and the all-reduce must have run once per variable per update, never per
micro-batch.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

hvd = pytest.importorskip("horovod.tensorflow",
                          reason="horovod is not installed (see docs/guides/distributed.md: Horovod)")

pytestmark = pytest.mark.timeout(150)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLE = os.path.join(_ROOT, "examples", "parabola_sync.py")
_STEPS = 60
_WEIGHTS = ["hidden/weights", "hidden/biases", "output/weights", "output/biases"]

# One Horovod rank: trains its half with accumulation and saves rank<r>.npz.
_RANK_SCRIPT = textwrap.dedent("""
    import importlib.util, os, sys
    import numpy as np
    spec = importlib.util.spec_from_file_location("parabola_sync", sys.argv[1])
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # Sets the TF mode from GRADACCUM_TF_MODE.
    import tensorflow as tf
    import horovod.tensorflow as hvd
    from gradaccum import GradientAccumulator, cluster

    steps, k, out_dir = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    hvd.init()
    x, y = example.parabola()
    mine = np.array_split(np.arange(len(x)), hvd.size())[hvd.rank()]
    xs = tf.compat.v1.placeholder(tf.float32, [None, 1])
    ys = tf.compat.v1.placeholder(tf.float32, [None, 1])
    loss = example.make_model_fn(example.initial_weights(0))(xs, ys)
    reduces = tf.compat.v1.get_variable("reduces", initializer=0, trainable=False)

    def all_reduce(grad):
        with tf.control_dependencies([reduces.assign_add(1)]):
            return hvd.allreduce(grad, op=hvd.Average)

    global_step = tf.compat.v1.train.get_or_create_global_step()
    opt = GradientAccumulator(
        cluster.AllReduceOnApply(tf.compat.v1.train.GradientDescentOptimizer(1e-2), all_reduce), k)
    train_op = opt.minimize(loss, global_step=global_step, weight=tf.shape(xs)[0])
    with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(hvd.broadcast_global_variables(0))
        for _ in range(steps):
            for part in np.array_split(mine, k):
                sess.run(train_op, {xs: x[part], ys: y[part]})
        values = sess.run({v.op.name: v for v in tf.compat.v1.trainable_variables()})
        values.update(sess.run({"reduces": reduces, "global_step": global_step}))
    np.savez(os.path.join(out_dir, "rank%d.npz" % hvd.rank()),
             **{name.replace("/", "__"): value for name, value in values.items()})
""")


def _run_ranks(tmp_path, ranks, k):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_SCRIPT)
    args = [sys.executable, str(script), _EXAMPLE, str(_STEPS), str(k), str(tmp_path)]
    if ranks > 1:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        args = [horovodrun, "-np", str(ranks), "-H", "localhost:%d" % ranks, "--gloo",
                "--start-timeout", "60"] + args
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120,
                          universal_newlines=True, env=dict(os.environ, PYTHONPATH=_ROOT))
    assert done.returncode == 0, done.stdout[-3000:]
    return [dict(np.load(str(tmp_path / ("rank%d.npz" % r)))) for r in range(ranks)]


@pytest.mark.parametrize("ranks", [
    1,
    pytest.param(2, marks=pytest.mark.distributed),
])
def test_accumulated_allreduce_matches_the_full_batch_run(ranks, parabola_reference, tmp_path):
    reference = parabola_reference(_STEPS)
    k = 2
    for rank in _run_ranks(tmp_path, ranks, k):
        for name in _WEIGHTS:
            np.testing.assert_allclose(rank[name.replace("/", "__")], reference[name.replace("/", "__")],
                                       rtol=1e-5, atol=1e-6, err_msg=name)
        assert int(rank["global_step"]) == _STEPS
        # One all-reduce per variable per applied update, not per micro-batch.
        assert int(rank["reduces"]) == len(_WEIGHTS) * _STEPS
