"""Compare batch sizes on Fashion-MNIST: fixed 5,000, 500 and 100, a ramp, and the adaptive batch.

Every row trains the main example's CNN (fashion_mnist_subdivision.build_logits) for --epochs on
the same data, once per seed, one row after the other in this one process, so that their times
are comparable. Micro-batches hold --micro-batch examples (100):

* fixed-5000: 50 micro-batches per update, Adam 0.003 after a 10-update warm-up, cosine decay;
* fixed-500: 5 micro-batches, Adam 0.001, warm-up 100 updates;
* fixed-100: no accumulation, Adam 0.001, warm-up 500 updates;
* ramp: gradaccum.batch_ramp from 500 to 5,000 examples over the first half of the examples;
* adaptive: gradaccum.AdaptiveBatch, 2 to 50 micro-batches (factor 1.25), Adam's 0.003 for
  5,000 scaled by the policy's learning-rate multiplier.

The ramp and adaptive rows drive their learning-rate schedule by the examples trained on, in
units of 5,000. Batch norm's momentum is 0.5 per 5,000 examples, the same per example in every
row. Per row it reports the mean and the range over the seeds of the final test accuracy and of
the updates, and the mean wall time, CPU time and peak memory. Everything goes into one JSON
(--out-dir/compare_batches.json); the PNG and the Markdown table are drawn from it, and
--replot redraws them from it without training.

  python examples/compare_batches.py --epochs 10 --seeds 3 --out-dir docs   # about an hour on 2 CPU cores
"""
import argparse
import datetime
import json
import os
import platform
import sys
import textwrap
import time

import numpy as np

import fashion_mnist_subdivision as example  # quiets TensorFlow's start-up as the example does
import fashion_mnist_data
import gradaccum
from fashion_mnist_subdivision import tf

ROWS = {"fixed-5000": "{big:,} (50 x {micro})", "fixed-500": "{mid:,} (5 x {micro})",
        "fixed-100": "{micro}, no accumulation", "ramp": "ramp {mid:,} to {big:,}",
        "adaptive": "adaptive, 2 to 50 x {micro}"}


def fail(message):
    sys.stderr.write("compare_batches.py: error: %s\n" % message)
    sys.exit(2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = fail  # one line, without the usage block
    add = parser.add_argument
    add("--epochs", type=int, default=10, help="epochs of every run (10)")
    add("--seeds", type=int, default=3, help="runs per row, seeds 0, 1, ... (3)")
    add("--rows", default=",".join(ROWS), help="which rows, comma-separated (all: %s)" % ",".join(ROWS))
    add("--micro-batch", type=int, default=100, help="examples per micro-batch (100)")
    add("--width", type=int, default=16, help="the CNN's width (16)")
    add("--train-examples", type=int, default=None, help="use only the first N (for a quick try)")
    add("--data-dir", help="a directory with the four Fashion-MNIST IDX files")
    add("--out-dir", default="docs", help="where compare_batches.json, .png and .md go (docs)")
    add("--replot", action="store_true", help="do not train: redraw from --out-dir/compare_batches.json")
    add("--verbose", action="store_true", help="show TensorFlow's log messages")
    args = parser.parse_args(argv)
    args.rows = args.rows.split(",")
    unknown = [row for row in args.rows if row not in ROWS]
    if unknown:
        fail("`--rows`: unknown row %r (known: %s)" % (unknown[0], ", ".join(ROWS)))
    for flag in ("epochs", "seeds", "micro_batch", "width"):
        if getattr(args, flag) < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if not os.path.isdir(args.out_dir):
        fail("`--out-dir` %r is not a directory" % args.out_dir)
    return args


def peak_memory_mb(reset=False):
    """This process's peak resident memory since the last reset, from Linux's VmHWM."""
    if reset:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024.0 for line in status if line.startswith("VmHWM:"))


def build(row, micro, width, epochs, num_train):
    """The row's graph: placeholders, the train op (with the examples count) and the accuracy."""
    images = tf.compat.v1.placeholder(tf.float32, [None, 28, 28, 1])
    labels = tf.compat.v1.placeholder(tf.int32, [None])
    is_training = tf.compat.v1.placeholder_with_default(True, [])
    k = {"fixed-5000": 50, "fixed-500": 5, "fixed-100": 1}.get(row)
    momentum = 0.5 ** ((k or 50) / 50.0)  # 0.5 per 50 micro-batches
    logits = example.build_logits(images, is_training, width, momentum=momentum)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    step = tf.compat.v1.train.get_or_create_global_step()
    seen = tf.compat.v1.Variable(0, dtype=tf.int64, trainable=False, name="examples_seen")
    if k is not None:  # a fixed batch: the schedule counts updates
        peak, warmup = (0.003, 10) if k == 50 else (0.001, 500 // k)
        rate = example.learning_rate(step, peak, warmup, num_train // (k * micro) * epochs)
        sizes = k
    else:  # a batch that changes: the schedule counts examples, in updates of 50 micro-batches
        big = 50 * micro
        rate = example.learning_rate(tf.cast(seen, tf.float32) / big, 0.003, 10, num_train * epochs // big)
        if row == "ramp":
            sizes = gradaccum.batch_ramp(5 * micro, 5 * micro, num_train * epochs // 2, big, micro)
        else:
            sizes = gradaccum.AdaptiveBatch(micro, factor=1.25, max_micro_batches=50, base_batch=big)
            rate *= sizes.learning_rate_multiplier
    opt = gradaccum.GradientAccumulator(tf.compat.v1.train.AdamOptimizer(rate), sizes)
    train_op = opt.minimize(loss, global_step=step, weight=tf.shape(images)[0])
    with tf.control_dependencies([train_op]):  # counted after the run: its update read the count before
        train_op = seen.assign_add(tf.cast(tf.shape(images)[0], tf.int64))
    correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1, output_type=tf.int32), labels), tf.int32))
    return dict(images=images, labels=labels, is_training=is_training, train_op=train_op, correct=correct,
                step=step, window_size=opt.window_size)


def train(row, seed, args, data):
    """One run: returns its accuracy, updates and mean batch per epoch, wall and CPU time, peak memory."""
    x, y = data.train_images[:args.train_examples], data.train_labels[:args.train_examples]
    start, cpu_start, micro = time.time(), time.process_time(), args.micro_batch
    peak_memory_mb(reset=True)
    run = dict(seed=seed, test_accuracy=[], updates=[], batch=[])
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(seed)
        model = build(row, micro, args.width, args.epochs, len(y))
        rng, left, done = np.random.RandomState(seed), 0, 0
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            for epoch in range(args.epochs):
                order, first = rng.permutation(len(y)), sess.run(model["step"])
                for i in range(len(y) // micro):  # a window may run on into the next epoch
                    if left == 0:
                        left = int(sess.run(model["window_size"]))
                    chosen = order[i * micro:(i + 1) * micro]
                    sess.run(model["train_op"], {model["images"]: x[chosen], model["labels"]: y[chosen]})
                    left, done = left - 1, done + 1
                updates = sess.run(model["step"])
                correct = sum(sess.run(model["correct"], {model["images"]: data.test_images[i:i + 1000],
                                                          model["labels"]: data.test_labels[i:i + 1000],
                                                          model["is_training"]: False})
                              for i in range(0, len(data.test_labels), 1000))
                run["test_accuracy"].append(correct / float(len(data.test_labels)))
                run["updates"].append(int(updates))
                run["batch"].append(round(len(order) // micro * micro / max(1, updates - first)))
    run.update(wall_seconds=round(time.time() - start, 1), cpu_seconds=round(time.process_time() - cpu_start, 1),
               peak_memory_mb=round(peak_memory_mb()))
    return run


def summarize(runs):
    """Mean and range over the seeds of the final accuracy and updates; mean times and memory."""
    accuracy = [run["test_accuracy"][-1] for run in runs]
    updates = [run["updates"][-1] for run in runs]
    return dict(accuracy=(np.mean(accuracy), min(accuracy), max(accuracy)),
                updates=(np.mean(updates), min(updates), max(updates)),
                wall=np.mean([r["wall_seconds"] for r in runs]), cpu=np.mean([r["cpu_seconds"] for r in runs]),
                memory=max(r["peak_memory_mb"] for r in runs))


def table(result):
    lines = ["| batch | seeds | final test accuracy: mean (range) | updates: mean (range) | wall time | CPU time "
             "| peak memory |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        s = summarize(row["runs"])
        lines.append("| %s | %d | %.4f (%.4f to %.4f) | %d (%d to %d) | %.0f s | %.0f s | %.0f MB |" % (
            row["label"], len(row["runs"]), s["accuracy"][0], s["accuracy"][1], s["accuracy"][2],
            s["updates"][0], s["updates"][1], s["updates"][2], s["wall"], s["cpu"], s["memory"]))
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_update, batch) = plt.subplots(1, 2, figsize=(12, 5))
    for row in result["rows"]:
        updates = np.mean([run["updates"] for run in row["runs"]], axis=0)
        accuracy = np.array([run["test_accuracy"] for run in row["runs"]])
        line, = by_update.plot(updates, accuracy.mean(axis=0), marker="o", markersize=3, label=row["label"])
        by_update.fill_between(updates, accuracy.min(axis=0), accuracy.max(axis=0), alpha=0.2,
                               color=line.get_color())
        batch.plot(range(1, len(updates) + 1), np.mean([run["batch"] for run in row["runs"]], axis=0),
                   marker="o", markersize=3, color=line.get_color())
    by_update.set(xlabel="updates (log scale)", xscale="log", ylabel="test accuracy (mean; band: range)")
    batch.set(xlabel="epoch", ylabel="examples per update (mean over the epoch)", yscale="log")
    by_update.legend(fontsize=8)
    title = "Fashion-MNIST, %s; %s" % (result["data"], result["measured"])
    figure.suptitle(textwrap.fill(title, 160), fontsize=9)
    figure.tight_layout(rect=(0, 0, 1, 0.92))
    figure.savefig(path, dpi=100)


def main(args):
    path = os.path.join(args.out_dir, "compare_batches.json")
    if args.replot:
        try:
            with open(path) as handle:
                result = json.load(handle)
        except (OSError, ValueError) as error:
            fail("cannot read %r: %s" % (path, error))
    else:
        try:
            data = fashion_mnist_data.load(args.data_dir)
        except ValueError as error:
            fail(error)
        tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
        result = dict(measured="%s, %s, %d CPU cores, TensorFlow %s, %d epochs" % (
            datetime.date.today().isoformat(), platform.machine(), os.cpu_count(), tf.__version__, args.epochs),
            data="%s (%d train examples)" % (data.source, len(data.train_labels[:args.train_examples])), rows=[])
        for row in args.rows:
            runs = []
            for seed in range(args.seeds):
                runs.append(train(row, seed, args, data))
                print("%s, seed %d: test accuracy %.4f after %d updates, %.0f s (CPU %.0f s)" % (
                    row, seed, runs[-1]["test_accuracy"][-1], runs[-1]["updates"][-1], runs[-1]["wall_seconds"],
                    runs[-1]["cpu_seconds"]), flush=True)
            label = ROWS[row].format(micro=args.micro_batch, mid=5 * args.micro_batch, big=50 * args.micro_batch)
            result["rows"].append(dict(name=row, label=label, runs=runs))
        with open(path, "w") as handle:
            json.dump(result, handle, indent=1)
    plot(result, os.path.join(args.out_dir, "compare_batches.png"))
    with open(os.path.join(args.out_dir, "compare_batches.md"), "w") as handle:
        handle.write(table(result))
    sys.stdout.write(table(result))


if __name__ == "__main__":
    main(parse_args())
