"""BERT-style fine-tuning with gradient accumulation: AdamWeightDecay, warm-up and clipping.

What a BERT user writes, kept as BERT's ``optimization.create_optimizer``
has it, with three changes for accumulation:

* the optimizer is wrapped: ``gradaccum.GradientAccumulator(AdamWeightDecay(...),
  k, clip_norm=1.0)``, and ``minimize`` gets ``weight`` = the micro-batch's size;
* clipping by global norm 1.0 moves into the accumulator (``clip_norm``): it
  clips the window's averaged gradient once, just before it is applied, as
  BERT clips its full batch. Clipping in the loss's gradients would clip each
  micro-batch on its own;
* BERT's hand-written ``global_step`` increment goes: its optimizer ignores
  ``global_step``, and the accumulator increments it once per applied window.
  Kept, it would count micro-batches, and the warm-up would end k times early.

The learning rate warms up linearly from 0 for ``--warmup-proportion`` of the
updates, then decays linearly to 0 at ``--train-steps``, on ``global_step``.
The model is a one-layer transformer encoder with BERT's variable names
(``LayerNorm``, ``bias``: not decayed) on scikit-learn's bundled digits, each
8x8 image read as 8 tokens of 8 pixels. It runs in seconds on a CPU.

Bad flags exit with one line and status 2. Quiet by default; ``--verbose``
shows TensorFlow's logs. ``--json PATH`` writes the run's figures.
``GRADACCUM_TF_MODE=tf2`` uses ``disable_eager_execution()`` only.

Example:
  python examples/bert_style_finetune.py --micro-batch 32 --micro-batches 4 --train-steps 100
"""
import json
import os
import re
import sys

import _quiet

VERBOSE = __name__ == "__main__" and "--verbose" in sys.argv[1:]
_quiet.before_import(VERBOSE)

import numpy as np  # noqa: E402

import _cli  # noqa: E402
from _cli import fail  # noqa: E402

NUM_TOKENS, TOKEN_WIDTH, NUM_CLASSES = 8, 8, 10


def parse_args(argv=None):
    """Parses the flags; bad input exits with one line and status 2.

    Args:
      argv: the arguments, without the program name.

    Returns:
      An ``argparse.Namespace``.

    Example:
      >>> args = parse_args(["--train-steps", "20"])
    """
    parser = _cli.OneLineParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--micro-batch", type=_cli.positive_int("--micro-batch"), default=32, help="examples per micro-batch (32)")
    add("--micro-batches", type=_cli.positive_int("--micro-batches"), default=4,
        help="micro-batches per update, the accumulator's k (4)")
    add("--train-steps", type=_cli.positive_int("--train-steps"), default=100,
        help="updates, BERT's num_train_steps (100)")
    add("--warmup-proportion", type=float, default=0.1, help="share of the updates that warm up (0.1)")
    add("--learning-rate", type=float, default=3e-3, help="peak learning rate (3e-3)")
    add("--weight-decay", type=float, default=0.01, help="decoupled weight decay rate (0.01)")
    add("--hidden", type=_cli.positive_int("--hidden"), default=32, help="width of the encoder (32)")
    add("--seed", type=int, default=0, help="initial weights and batch order (0)")
    add("--json", default=None, help="write the run's figures to this file")
    add("--verbose", action="store_true", help="show TensorFlow's logs")
    args = parser.parse_args(argv)
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    if not 0 <= args.warmup_proportion <= 1:
        fail("`--warmup-proportion` must be in [0, 1], got %r" % args.warmup_proportion)
    if not args.weight_decay >= 0:
        fail("`--weight-decay` must be >= 0, got %r" % args.weight_decay)
    return args


def load_digits(log=print):
    """scikit-learn's bundled digits as 8 tokens of 8 pixels in [0, 1]; a 80/20 split.

    Returns:
      ``(train_x, train_y, test_x, test_y)``.

    Example:
      >>> train_x, train_y, test_x, test_y = load_digits()
    """
    try:
        from sklearn import datasets
    except ImportError:
        fail("this example trains on scikit-learn's bundled digits: pip install scikit-learn")
    digits = datasets.load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    order = np.random.RandomState(0).permutation(len(images))
    cut = int(0.8 * len(images))
    train, test = order[:cut], order[cut:]
    path = os.path.join(os.path.dirname(datasets.__file__), "data", "digits.csv.gz")
    log("data: scikit-learn's bundled digits from %s: %d images of 8x8, %d to train, %d to test"
        % (path, len(images), len(train), len(test)))
    return images[train], digits.target[train], images[test], digits.target[test]


if __name__ == "__main__":
    ARGS = parse_args()

with _quiet.native_stderr(VERBOSE):
    import tensorflow as tf  # noqa: E402

    import gradaccum  # noqa: E402

    if VERBOSE is False and __name__ == "__main__":
        _quiet.after_import(tf)

v1 = tf.compat.v1


class AdamWeightDecayOptimizer(v1.train.Optimizer):
    """BERT's optimizer, in our words: Adam without bias correction, plus decoupled weight decay.

    It overrides ``apply_gradients`` entirely, creates its moments with
    ``tf.compat.v1.get_variable`` (``<variable>/adam_m``, ``<variable>/adam_v``)
    and ignores ``global_step``.

    Args:
      learning_rate: float or scalar tensor.
      weight_decay_rate: decay added to the step of every variable not excluded.
      beta_1: decay of the first moment.
      beta_2: decay of the second moment.
      epsilon: added to the root of the second moment.
      exclude_from_weight_decay: regular expressions of names not to decay.
      name: the optimizer's name.

    Example:
      >>> opt = AdamWeightDecayOptimizer(1e-3, 0.01, exclude_from_weight_decay=["LayerNorm", "bias"])
    """

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                 exclude_from_weight_decay=None, name="AdamWeightDecayOptimizer"):
        super(AdamWeightDecayOptimizer, self).__init__(False, name)
        self.learning_rate = learning_rate
        self.weight_decay_rate = weight_decay_rate
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.exclude_from_weight_decay = list(exclude_from_weight_decay or [])

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Builds the update of every variable with a gradient; ``global_step`` is not touched."""
        updates = []
        for grad, param in grads_and_vars:
            if grad is None or param is None:
                continue
            base = re.sub(r":\d+$", "", param.name)
            shape, dtype = param.shape.as_list(), param.dtype.base_dtype
            m = v1.get_variable(base + "/adam_m", shape, dtype, v1.zeros_initializer(), trainable=False)
            v = v1.get_variable(base + "/adam_v", shape, dtype, v1.zeros_initializer(), trainable=False)
            next_m = self.beta_1 * m + (1.0 - self.beta_1) * grad
            next_v = self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad)
            step = next_m / (tf.sqrt(next_v) + self.epsilon)
            if self.weight_decay_rate and not any(re.search(p, base) for p in self.exclude_from_weight_decay):
                # Decoupled: the decay is added to the step, not to the loss, so Adam does not rescale it.
                step += self.weight_decay_rate * param
            updates.extend([param.assign(param - self.learning_rate * step), m.assign(next_m), v.assign(next_v)])
        return tf.group(*updates, name=name)


def create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps, num_micro_batches, weight,
                     weight_decay=0.01):
    """BERT's ``create_optimizer`` through a GradientAccumulator; returns ``(train_op, learning_rate)``.

    Example:
      >>> train_op, lr = create_optimizer(loss, 2e-5, 1000, 100, 4, tf.shape(x)[0])
    """
    global_step = v1.train.get_or_create_global_step()
    learning_rate = v1.train.polynomial_decay(init_lr, global_step, num_train_steps, end_learning_rate=0.0,
                                              power=1.0)
    if num_warmup_steps:
        step = tf.cast(global_step, tf.float32)
        warmup = init_lr * step / float(num_warmup_steps)
        learning_rate = tf.where(step < num_warmup_steps, warmup, learning_rate)
    optimizer = AdamWeightDecayOptimizer(learning_rate, weight_decay_rate=weight_decay,
                                         exclude_from_weight_decay=["LayerNorm", "layer_norm", "bias"])
    # clip_norm: the window's average is clipped once, as BERT clips its full batch.
    accumulator = gradaccum.GradientAccumulator(optimizer, num_micro_batches, clip_norm=1.0)
    # No `global_step.assign_add(1)` here: the accumulator counts applied windows.
    train_op = accumulator.minimize(loss, global_step=global_step, weight=weight)
    return train_op, learning_rate


def dense(inputs, units, name, activation=None):
    with v1.variable_scope(name):
        kernel = v1.get_variable("kernel", [inputs.shape[-1], units],
                                 initializer=v1.truncated_normal_initializer(stddev=0.02))
        bias = v1.get_variable("bias", [units], initializer=v1.zeros_initializer())
        outputs = tf.tensordot(inputs, kernel, 1) + bias
    return outputs if activation is None else activation(outputs)


def layer_norm(inputs, name="LayerNorm"):
    with v1.variable_scope(name):
        gamma = v1.get_variable("gamma", [inputs.shape[-1]], initializer=v1.ones_initializer())
        beta = v1.get_variable("beta", [inputs.shape[-1]], initializer=v1.zeros_initializer())
        mean, variance = tf.nn.moments(inputs, [-1], keepdims=True)
        return (inputs - mean) * tf.math.rsqrt(variance + 1e-6) * gamma + beta


def encoder(tokens, hidden):
    """A one-layer, one-head transformer encoder and a classifier; returns the logits."""
    with v1.variable_scope("bert"):
        with v1.variable_scope("embeddings"):
            positions = v1.get_variable("position_embeddings", [NUM_TOKENS, hidden],
                                        initializer=v1.truncated_normal_initializer(stddev=0.02))
            x = layer_norm(dense(tokens, hidden, "token_projection") + positions)
        with v1.variable_scope("encoder/layer_0"):
            query, key, value = [dense(x, hidden, name) for name in ("query", "key", "value")]
            scores = tf.matmul(query, key, transpose_b=True) / np.sqrt(hidden)
            attended = tf.matmul(tf.nn.softmax(scores), value)
            x = layer_norm(x + dense(attended, hidden, "attention_output"), "attention_output/LayerNorm")
            inner = dense(x, 2 * hidden, "intermediate", tf.nn.relu)
            x = layer_norm(x + dense(inner, hidden, "output"), "output/LayerNorm")
        pooled = dense(tf.reduce_mean(x, axis=1), hidden, "pooler", tf.tanh)
    return dense(pooled, NUM_CLASSES, "cls")


def build(args):
    """The graph: placeholders, loss, train op, learning rate and accuracy."""
    v1.set_random_seed(args.seed)
    tokens = v1.placeholder(tf.float32, [None, NUM_TOKENS, TOKEN_WIDTH], name="tokens")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    logits = encoder(tokens, args.hidden)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    warmup = int(round(args.warmup_proportion * args.train_steps))
    train_op, learning_rate = create_optimizer(loss, args.learning_rate, args.train_steps, warmup,
                                               args.micro_batches, tf.shape(tokens)[0], args.weight_decay)
    correct = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    return dict(tokens=tokens, labels=labels, loss=loss, train_op=train_op, learning_rate=learning_rate,
                accuracy=correct, global_step=v1.train.get_global_step(), warmup=warmup)


def train(args, data):
    """Runs ``--train-steps`` windows; returns the figures of the run."""
    train_x, train_y, test_x, test_y = data
    graph = build(args)
    rng = np.random.RandomState(args.seed)
    order, position = rng.permutation(len(train_x)), 0
    figures = dict(learning_rates=[], losses=[], warmup_updates=graph["warmup"], micro_batches_run=0)
    report_every = max(1, args.train_steps // 5)
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for update in range(args.train_steps):
            # global_step is constant inside a window: this is the rate its update uses.
            figures["learning_rates"].append(float(sess.run(graph["learning_rate"])))
            losses = []
            for _ in range(args.micro_batches):
                if position + args.micro_batch > len(order):
                    order, position = rng.permutation(len(train_x)), 0
                rows = order[position:position + args.micro_batch]
                position += args.micro_batch
                feed = {graph["tokens"]: train_x[rows], graph["labels"]: train_y[rows]}
                losses.append(sess.run([graph["loss"], graph["train_op"]], feed)[0])
                figures["micro_batches_run"] += 1
            figures["losses"].append(float(np.mean(losses)))
            if (update + 1) % report_every == 0 or update + 1 == args.train_steps:
                print("update %d/%d: learning rate %.6f, loss %.4f" % (
                    update + 1, args.train_steps, figures["learning_rates"][-1], figures["losses"][-1]))
        figures["global_step"] = int(sess.run(graph["global_step"]))
        figures["test_accuracy"] = float(sess.run(graph["accuracy"], {graph["tokens"]: test_x,
                                                                      graph["labels"]: test_y}))
    return figures


def main(args):
    """Loads the digits, trains, prints the summary; returns the exit status.

    Example:
      >>> sys.exit(main(parse_args()))
    """
    _cli.graph_mode(tf)
    data = load_digits()
    print("AdamWeightDecay (decay %g, not on LayerNorm or bias) through GradientAccumulator(k=%d, clip_norm=1.0): "
          "each update is %d micro-batches of %d; learning rate %g, warm-up over %d%% of %d updates"
          % (args.weight_decay, args.micro_batches, args.micro_batches, args.micro_batch, args.learning_rate,
             round(100 * args.warmup_proportion), args.train_steps))
    figures = train(args, data)
    figures["updates"] = args.train_steps
    print("global_step %d after %d micro-batches (one per applied window); test accuracy %.4f"
          % (figures["global_step"], figures["micro_batches_run"], figures["test_accuracy"]))
    if args.json:
        try:
            with open(args.json, "w") as handle:
                json.dump(figures, handle, indent=1)
        except OSError as exc:
            fail("`--json` %r cannot be written: %s" % (args.json, exc.strerror), status=1)
    return 0


if __name__ == "__main__":
    with _quiet.native_stderr(VERBOSE):
        STATUS = main(ARGS)
    sys.exit(STATUS)
