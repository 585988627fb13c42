"""Seed 002: fit y = x^2 with a 1-5-1 tanh net, synchronously across processes.

One process (no ``TF_CONFIG``): plain full-batch gradient descent, as in the
seed::

    python examples/parabola_sync.py --steps 2000

P processes on one machine, each computing the gradient of its 1/P of the 50
points; the chief (worker 0) averages them (weighted by shard size) and
applies them once per step, so the run matches the single-process one::

    python -m gradaccum.launch --workers 3 -- python examples/parabola_sync.py --steps 2000

With ``--engine collective`` there is no chief feeding the others: every
process builds the same graph, computes the gradient of its own share of the
points (``--shards 30,20`` chooses uneven shares), and the processes sum
``size * gradient`` and the sizes with TensorFlow's collective all-reduce,
once per update; worker 0's initial values are broadcast first::

    python -m gradaccum.launch --workers 3 -- python examples/parabola_sync.py --engine collective

Either way a peer that dies or stops answering ends the others within
``--heartbeat-timeout`` seconds (30 by default), with one line.

Several machines: start the same command on each with its own ``TF_CONFIG``
(see the README). ``--accumulate k`` adds a ``GradientAccumulator``: each step
is k micro-batches of 50/k points; ``--accumulate-schedule 3,1,5`` gives step
i its own k (the last one after), and ``--adaptive-batch`` lets
``gradaccum.AdaptiveBatch`` choose k from the gradient noise scale (every
worker decides alike). ``--checkpoint-dir`` makes the chief save
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

from gradaccum import AdaptiveBatch, GradientAccumulator, cluster, step_schedule, tower  # noqa: E402

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


def collective(args, config):
    """True when this process trains with the collective engine (each worker its own graph)."""
    return config is not None and args.engine == "collective"


def rank_of(config):
    """This process's index among the compute tasks (chief first), and their number."""
    tasks = config.compute_tasks if config is not None else [None]
    return (tasks.index((config.task_type, config.task_index)) if config is not None else 0), len(tasks)


def my_points(args, config):
    """The indices of the points this process computes on: all, or its collective shard."""
    if not collective(args, config):
        return np.arange(NUM_POINTS)
    rank, size = rank_of(config)
    if args.shards is None:
        return np.array_split(np.arange(NUM_POINTS), size)[rank]
    return np.arange(sum(args.shards[:rank]), sum(args.shards[:rank + 1]))


def build(args, config):
    """Builds the graph; returns a dict of the tensors and ops the loop needs."""
    xs = tf.compat.v1.placeholder(tf.float32, [None, 1], name="xs")
    ys = tf.compat.v1.placeholder(tf.float32, [None, 1], name="ys")
    local = config is None or collective(args, config)  # Every op of this graph runs in this process.
    chief_device = "/cpu:0" if local else "/job:%s/task:%d/cpu:0" % config.chief
    var_device = "/cpu:0" if local else cluster.variables_device(config)
    with tf.device(var_device):
        global_step = tf.compat.v1.train.get_or_create_global_step()
    k, rate = window_sizes(args)
    optimizer = tf.compat.v1.train.GradientDescentOptimizer(args.learning_rate * rate)
    if collective(args, config):
        optimizer = cluster.CollectiveAllReduce(optimizer, config)
    accumulating = not isinstance(k, int) or k > 1
    if accumulating:
        optimizer = GradientAccumulator(optimizer, k)
    seed = args.seed + (rank_of(config)[0] if args.worker_seeds and collective(args, config) else 0)
    model_fn = make_model_fn(initial_weights(seed))
    broadcast = None
    if collective(args, config):  # Each worker's own graph; the same graph everywhere.
        loss = model_fn(xs, ys)
        if accumulating:
            train_op = optimizer.minimize(loss, global_step=global_step, weight=tf.shape(xs)[0])
        else:
            train_op = optimizer.apply_gradients(optimizer.compute_gradients(loss), global_step,
                                                 weight=tf.shape(xs)[0])
        broadcast = cluster.broadcast_variables(config)
    elif config is None:  # The seed's plain graph: the reference the cluster runs must match.
        loss = model_fn(xs, ys)
        weight = {"weight": tf.shape(xs)[0]} if accumulating else {}
        train_op = optimizer.minimize(loss, global_step=global_step, **weight)
    else:
        result = tower.minimize(optimizer, model_fn, [xs, ys], global_step=global_step,
                                devices=cluster.worker_devices(config, args.device), variables_device=var_device)
        train_op, loss = result.train_op, result.loss
    with tf.device(chief_device):  # Checkpoints are written on the chief's disk.
        saver = tf.compat.v1.train.Saver(max_to_keep=3) if args.checkpoint_dir else None
    stop = cluster.StopSignal(config) if config is not None and not collective(args, config) else None
    size = optimizer.window_size if isinstance(optimizer, GradientAccumulator) else tf.constant(1, tf.int64)
    return dict(xs=xs, ys=ys, global_step=global_step, train_op=train_op, loss=loss, saver=saver, stop=stop,
                window_size=size,
                broadcast=broadcast, chief=config is None or config.is_chief,
                init=tf.compat.v1.global_variables_initializer(),
                variables=dict((v.op.name, v) for v in tf.compat.v1.trainable_variables()))


def window_sizes(args):
    """``(num_micro_batches, learning-rate factor)`` for the accumulator, from the flags."""
    if args.adaptive_batch:
        policy = AdaptiveBatch(micro_batch_size=40, max_micro_batches=10, rule="sgd")  # k grows from 2 to 8 here
        return policy, tf.cast(policy.learning_rate_multiplier, tf.float32)
    if args.accumulate_schedule:
        sizes = args.accumulate_schedule
        return step_schedule(list(range(1, len(sizes))), sizes), 1.0
    return args.accumulate, 1.0


def restore_or_init(sess, graph, args):
    """Restores the newest checkpoint of ``--checkpoint-dir`` (chief), else initializes.

    With the collective engine every worker then takes worker 0's values.
    """
    path = tf.train.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir and graph["chief"] else None
    if path is None:
        sess.run(graph["init"])
    else:
        graph["saver"].restore(sess, path)
        print("restored global_step %d from %s" % (sess.run(graph["global_step"]), path))
    if graph["broadcast"] is not None:
        sess.run(graph["broadcast"])


def train_step(sess, graph, x, y, k, mine, trace=None):
    """Runs one update (k micro-batches of the points ``mine``); returns the full-batch loss before it.

    ``trace``: a list that gets, per run, the number of collective
    all-reduces that ran (from the run's step stats).
    """
    before = sess.run(graph["loss"], {graph["xs"]: x, graph["ys"]: y}) if len(mine) < len(x) else None
    total = 0.0
    for part in np.array_split(mine, k):
        options, metadata = (None, None) if trace is None else (
            tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE), tf.compat.v1.RunMetadata())
        _, loss = sess.run([graph["train_op"], graph["loss"]], {graph["xs"]: x[part], graph["ys"]: y[part]},
                           options=options, run_metadata=metadata)
        total += loss * len(part)  # The weights stay put within a window.
        if trace is not None:
            trace.append(len({node.node_name for dev in metadata.step_stats.dev_stats for node in dev.node_stats
                              if " = CollectiveReduce(" in node.timeline_label}))
    return total / len(x) if before is None else before


def save(sess, graph, args, step):
    """Writes a checkpoint of every global variable, named by ``step``."""
    graph["saver"].save(sess, os.path.join(args.checkpoint_dir, "model.ckpt"), global_step=step)
    print("saved checkpoint at global_step %d" % step)


def train(sess, graph, args):
    """Trains up to ``--steps`` global steps; returns the recorded history."""
    x, y = parabola()
    restore_or_init(sess, graph, args)
    step = int(sess.run(graph["global_step"]))
    steps, losses, sizes, trace = [], [], [], [] if args.trace_collectives else None
    while step < args.steps:
        sizes.append(int(sess.run(graph["window_size"])))
        loss = train_step(sess, graph, x, y, sizes[-1], graph["mine"], trace)
        steps.append(step)
        losses.append(loss)
        if step % args.log_every == 0 and graph["chief"]:
            print("global_step %d loss %.6f" % (step, loss))
        step = int(sess.run(graph["global_step"]))
        if args.checkpoint_dir and graph["chief"] and (step % args.checkpoint_every == 0 or step == args.steps):
            save(sess, graph, args, step)
    final_loss, devices = traced_loss(sess, graph, x, y)
    print("global_step %d loss %.6f (final)" % (step, final_loss))
    weights = sess.run(graph["variables"])
    return dict(weights, global_steps=np.array(steps, np.int64), losses=np.array(losses, np.float64),
                final_step=np.int64(step), devices=np.array(devices), window_sizes=np.array(sizes, np.int64),
                collective_runs=np.array(trace if trace is not None else [], np.int64))


def traced_loss(sess, graph, x, y):
    """Evaluates the full-batch loss; also returns the devices that computed it."""
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    metadata = tf.compat.v1.RunMetadata()
    loss = sess.run(graph["loss"], {graph["xs"]: x, graph["ys"]: y}, options=options, run_metadata=metadata)
    return loss, sorted(set(stats.device for stats in metadata.step_stats.dev_stats))


def run(args, config, server):
    """Builds the graph and trains in this process (single process, in-graph chief, or collective worker)."""
    with tf.Graph().as_default() as g:
        graph = build(args, config)
        graph["mine"] = my_points(args, config)
    target = "" if server is None else server.target
    if config is None:
        session_config = None
    elif collective(args, config):
        session_config = cluster.collective_session_config(config)
    else:
        session_config = cluster.session_config(config)
    heartbeat = None if config is None else cluster.Heartbeat(server, config, timeout_seconds=args.heartbeat_timeout)
    with tf.compat.v1.Session(target, graph=g, config=session_config) as sess:
        if heartbeat is not None:
            heartbeat.start()
        history = train(sess, graph, args)
        if heartbeat is not None:
            heartbeat.stop()
        if graph["stop"] is not None:
            missed = graph["stop"].send(sess)
            if missed:
                print("could not signal %s to stop" % ", ".join(missed))
    if args.out:
        out = args.out if graph["chief"] else "%s-worker%d.npz" % (os.path.splitext(args.out)[0], rank_of(config)[0])
        np.savez(out, **dict((k.replace("/", "__"), v) for k, v in history.items()))


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, "%s: error: %s\n" % (self.prog, message))


def _sizes(text):
    """argparse type: comma-separated ints >= 1."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("must be ints >= 1 separated by commas, got %r" % text)
    return sizes


def _largest_k(args):
    """The most micro-batches a step can have under these flags."""
    if args.adaptive_batch:
        return 10
    return max(args.accumulate_schedule) if args.accumulate_schedule else args.accumulate


def _shard_sizes(text):
    """argparse type: comma-separated ints >= 1 summing to the number of points."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or sum(sizes) != NUM_POINTS:
        raise argparse.ArgumentTypeError("must be ints >= 1 separated by commas, summing to %d, got %r"
                                         % (NUM_POINTS, text))
    return sizes


def _positive_float(text):
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError("must be a number > 0, got %r" % text)
    return value


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
    parser.add_argument("--accumulate-schedule", type=_sizes, default=None,
                        help="micro-batches of step 0, 1, ... (the last one after), e.g. 3,1,5,2")
    parser.add_argument("--adaptive-batch", action="store_true",
                        help="micro-batches chosen from the gradient noise scale (gradaccum.AdaptiveBatch)")
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--log-every", type=_positive_int, default=50)
    parser.add_argument("--checkpoint-dir", default=None, help="chief saves here and resumes from here")
    parser.add_argument("--checkpoint-every", type=_positive_int, default=50)
    parser.add_argument("--device", default="cpu:0", help="device of each task's tower, e.g. gpu:0")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for all tasks")
    parser.add_argument("--out", default=None, help="write the loss history and final weights (.npz)")
    parser.add_argument("--engine", choices=("ingraph", "collective"), default="ingraph",
                        help="several processes: the chief's one graph (ingraph) or each its own (collective)")
    parser.add_argument("--shards", type=_shard_sizes, default=None,
                        help="collective: points per worker, e.g. 30,20 (default: as even as possible)")
    parser.add_argument("--worker-seeds", action="store_true",
                        help="collective: worker r draws its initial weights with seed + r (the broadcast fixes it)")
    parser.add_argument("--heartbeat-timeout", type=_positive_float, default=30.0,
                        help="seconds a silent peer is waited for before this process fails")
    parser.add_argument("--trace-collectives", action="store_true",
                        help="count the all-reduces of every run (into --out as collective_runs)")
    return parser.parse_args(argv)


def check_collective(args, config):
    """Fails in one line on a cluster or flags the collective engine cannot run."""
    if "ps" in config.cluster:
        raise ValueError("`--engine collective` takes no ps task, got %d (run the launcher with --ps 0)"
                         % len(config.cluster["ps"]))
    size = rank_of(config)[1]
    if args.shards is not None and len(args.shards) != size:
        raise ValueError("`--shards` must give one size per worker (%d), got %d" % (size, len(args.shards)))
    smallest = min(args.shards) if args.shards is not None else NUM_POINTS // size
    if _largest_k(args) > smallest:
        raise ValueError("`--accumulate` must be <= %d (each worker's smallest share), got %d"
                         % (smallest, _largest_k(args)))


def main(argv=None):
    """Runs one process of the job; returns its exit status."""
    args = parse_args(argv)
    try:
        config = cluster.from_environment()
        if _largest_k(args) > NUM_POINTS:
            raise ValueError("`--accumulate` must be <= %d (one point per micro-batch), got %d"
                             % (NUM_POINTS, _largest_k(args)))
        if collective(args, config):
            check_collective(args, config)
            server = cluster.start_server(config, cluster.collective_session_config(config))
            cluster.wait_for_tasks(config, timeout_seconds=args.startup_timeout)
        elif config is not None:
            cluster.worker_devices(config, args.device)  # Fails early on a bad --device.
            server = cluster.start_server(config)
            if not config.is_chief:
                cluster.serve(server, config, startup_timeout_seconds=args.startup_timeout,
                              heartbeat_timeout_seconds=args.heartbeat_timeout)
                return 0
            cluster.wait_for_tasks(config, timeout_seconds=args.startup_timeout)
        run(args, config, server if config is not None else None)
        return 0
    except (ValueError, cluster.ClusterError) as exc:
        print("parabola_sync.py: error: %s" % exc, file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except tf.errors.OpError as exc:  # A task died under the running session.
        print("parabola_sync.py: error: training failed: %s" % cluster.describe_op_error(exc), file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
