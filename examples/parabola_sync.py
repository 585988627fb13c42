"""Seed 002: fit y = x^2 with a 1-5-1 tanh net, synchronously across processes.

One process (no ``TF_CONFIG``): plain full-batch gradient descent, as in the
seed::

    python examples/parabola_sync.py --steps 2000

P processes on one machine, each computing the gradient of its 1/P of the 50
points; the chief (worker 0) averages them (weighted by shard size) and
applies them once per step, so the run matches the single-process one::

    python -m gradaccum.launch --workers 3 -- python examples/parabola_sync.py --steps 2000

Several machines: start the same command on each with its own ``TF_CONFIG``
(see the README). ``--accumulate k`` adds a ``GradientAccumulator``: each step
is k micro-batches of 50/k points. ``--checkpoint-dir`` makes the chief save
checkpoints and resume from the newest one. ``GRADACCUM_TF_MODE=tf2`` runs
with resource variables (``disable_eager_execution`` only) instead of
``disable_v2_behavior``.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

if os.environ.get("GRADACCUM_TF_MODE", "tf1") == "tf2":
    tf.compat.v1.disable_eager_execution()
else:
    tf.compat.v1.disable_v2_behavior()

from gradaccum import GradientAccumulator, cluster, tower  # noqa: E402

NUM_POINTS = 50
LAYERS = (("hidden", 1, 5), ("output", 5, 1))


def initial_weights(seed):
    """The seed's random_normal initial values, drawn by numpy so every process agrees."""
    rng = np.random.RandomState(seed)
    values = {}
    for name, fan_in, fan_out in LAYERS:
        values[name + "/weights"] = rng.normal(size=(fan_in, fan_out)).astype(np.float32)
        values[name + "/biases"] = rng.normal(size=(1, fan_out)).astype(np.float32)
    return values


def parabola():
    """The seed's 50 points of y = x^2 on [-2, 2]."""
    x = np.linspace(-2, 2, NUM_POINTS, dtype=np.float32)[:, np.newaxis]
    return x, np.square(x)


def make_model_fn(weights):
    """Returns ``model_fn(xs, ys) -> mean squared error`` of the 1-5-1 tanh net."""
    def model_fn(xs, ys):
        outputs = xs
        for name, _, _ in LAYERS:
            with tf.compat.v1.variable_scope(name):
                kernel = tf.compat.v1.get_variable("weights", initializer=weights[name + "/weights"])
                bias = tf.compat.v1.get_variable("biases", initializer=weights[name + "/biases"])
                outputs = tf.matmul(outputs, kernel) + bias
                outputs = tf.tanh(outputs) if name == "hidden" else outputs
        return tf.reduce_mean(tf.reduce_sum(tf.square(ys - outputs), axis=1))
    return model_fn


def build(args, config):
    """Builds the graph; returns a dict of the tensors and ops the loop needs."""
    xs = tf.compat.v1.placeholder(tf.float32, [None, 1], name="xs")
    ys = tf.compat.v1.placeholder(tf.float32, [None, 1], name="ys")
    chief_device = "/cpu:0" if config is None else "/job:%s/task:%d/cpu:0" % config.chief
    var_device = "/cpu:0" if config is None else cluster.variables_device(config)
    with tf.device(var_device):
        global_step = tf.compat.v1.train.get_or_create_global_step()
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate)
    if args.accumulate > 1:
        optimizer = GradientAccumulator(optimizer, args.accumulate)
    model_fn = make_model_fn(initial_weights(args.seed))
    if config is None:  # The seed's plain graph: the reference the cluster runs must match.
        loss = model_fn(xs, ys)
        weight = {"weight": tf.shape(xs)[0]} if args.accumulate > 1 else {}
        train_op = optimizer.minimize(loss, global_step=global_step, **weight)
    else:
        result = tower.minimize(optimizer, model_fn, [xs, ys], global_step=global_step,
                                devices=cluster.worker_devices(config, args.device), variables_device=var_device)
        train_op, loss = result.train_op, result.loss
    with tf.device(chief_device):  # Checkpoints are written on the chief's disk.
        saver = tf.compat.v1.train.Saver(max_to_keep=3) if args.checkpoint_dir else None
    stop = cluster.StopSignal(config) if config is not None else None
    return dict(xs=xs, ys=ys, global_step=global_step, train_op=train_op, loss=loss, saver=saver, stop=stop,
                init=tf.compat.v1.global_variables_initializer(),
                variables=dict((v.op.name, v) for v in tf.compat.v1.trainable_variables()))


def restore_or_init(sess, graph, args):
    """Restores the newest checkpoint of ``--checkpoint-dir``, else initializes."""
    path = tf.train.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if path is None:
        sess.run(graph["init"])
        return
    graph["saver"].restore(sess, path)
    print("restored global_step %d from %s" % (sess.run(graph["global_step"]), path))


def train_step(sess, graph, x, y, k):
    """Runs one update (k micro-batches); returns the full-batch loss before it."""
    total = 0.0
    for part in np.array_split(np.arange(len(x)), k):
        _, loss = sess.run([graph["train_op"], graph["loss"]], {graph["xs"]: x[part], graph["ys"]: y[part]})
        total += loss * len(part)  # The weights stay put within a window.
    return total / len(x)


def save(sess, graph, args, step):
    """Writes a checkpoint of every global variable, named by ``step``."""
    graph["saver"].save(sess, os.path.join(args.checkpoint_dir, "model.ckpt"), global_step=step)
    print("saved checkpoint at global_step %d" % step)


def train(sess, graph, args):
    """Trains up to ``--steps`` global steps; returns the recorded history."""
    x, y = parabola()
    restore_or_init(sess, graph, args)
    step = int(sess.run(graph["global_step"]))
    steps, losses = [], []
    while step < args.steps:
        loss = train_step(sess, graph, x, y, args.accumulate)
        steps.append(step)
        losses.append(loss)
        if step % args.log_every == 0:
            print("global_step %d loss %.6f" % (step, loss))
        step = int(sess.run(graph["global_step"]))
        if args.checkpoint_dir and (step % args.checkpoint_every == 0 or step == args.steps):
            save(sess, graph, args, step)
    final_loss, devices = traced_loss(sess, graph, x, y)
    print("global_step %d loss %.6f (final)" % (step, final_loss))
    weights = sess.run(graph["variables"])
    return dict(weights, global_steps=np.array(steps, np.int64), losses=np.array(losses, np.float64),
                final_step=np.int64(step), devices=np.array(devices))


def traced_loss(sess, graph, x, y):
    """Evaluates the full-batch loss; also returns the devices that computed it."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    loss = sess.run(graph["loss"], {graph["xs"]: x, graph["ys"]: y}, options=options, run_metadata=metadata)
    return loss, sorted(set(stats.device for stats in metadata.step_stats.dev_stats))


def run(args, config, server):
    """Builds the graph and trains in this process (single process or chief)."""
    with tf.Graph().as_default() as g:
        graph = build(args, config)
    target = "" if server is None else server.target
    session_config = None if config is None else cluster.session_config(config)
    with tf.compat.v1.Session(target, graph=g, config=session_config) as sess:
        history = train(sess, graph, args)
        if graph["stop"] is not None:
            missed = graph["stop"].send(sess)
            if missed:
                print("could not signal %s to stop" % ", ".join(missed))
    if args.out:
        np.savez(args.out, **dict((k.replace("/", "__"), v) for k, v in history.items()))


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, "%s: error: %s\n" % (self.prog, message))


def _positive_int(text):
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError("must be an int >= 1, got %r" % text)
    return value


def parse_args(argv):
    """Parses the flags; a bad one prints one line and exits with status 2."""
    parser = _OneLineParser(prog="parabola_sync.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=_positive_int, default=2000, help="global steps to reach")
    parser.add_argument("--accumulate", type=_positive_int, default=1, help="micro-batches per update")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--log-every", type=_positive_int, default=50)
    parser.add_argument("--checkpoint-dir", default=None, help="chief saves here and resumes from here")
    parser.add_argument("--checkpoint-every", type=_positive_int, default=50)
    parser.add_argument("--device", default="cpu:0", help="device of each task's tower, e.g. gpu:0")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for all tasks")
    parser.add_argument("--out", default=None, help="write the loss history and final weights (.npz)")
    return parser.parse_args(argv)


def main(argv=None):
    """Runs one process of the job; returns its exit status."""
    args = parse_args(argv)
    try:
        config = cluster.load_tf_config()
        if args.accumulate > NUM_POINTS:
            raise ValueError("`--accumulate` must be <= %d (one point per micro-batch), got %d"
                             % (NUM_POINTS, args.accumulate))
        if config is not None:
            cluster.worker_devices(config, args.device)  # Fails early on a bad --device.
            server = cluster.start_server(config)
            if not config.is_chief:
                cluster.serve(server, config, startup_timeout_seconds=args.startup_timeout)
                return 0
            cluster.wait_for_tasks(config, timeout_seconds=args.startup_timeout)
        run(args, config, server if config is not None else None)
        return 0
    except (ValueError, cluster.ClusterError) as exc:
        print("parabola_sync.py: error: %s" % exc, file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except tf.errors.OpError as exc:  # A task died under the running session.
        lines = [line.strip() for line in exc.message.splitlines()
                 if line.strip() and not line.startswith("Graph execution error")]
        print("parabola_sync.py: error: training failed: %s: %s"
              % (type(exc).__name__, " ".join(lines[:2])), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
