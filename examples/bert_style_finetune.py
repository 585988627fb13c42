"""BERT-style fine-tuning with gradient accumulation: AdamWeightDecay, warm-up and clipping.

BERT's optimization.create_optimizer, with three changes for accumulation:
* the optimizer is wrapped: GradientAccumulator(AdamWeightDecay(...), k, clip_norm=1.0), and
  minimize gets weight = the micro-batch's size;
* the global-norm clipping moves into the accumulator: clip_norm clips the window's average once;
* BERT's hand-written global_step increment goes: the accumulator counts applied windows.
The model: a one-layer transformer encoder with BERT's variable names, on scikit-learn's digits
(8 tokens of 8 pixels per image); the learning rate warms up, then decays linearly, in updates.
"""
import argparse
import json
import os
import re
import sys
import warnings

import numpy as np

VERBOSE, saved_stderr = "--verbose" in sys.argv[1:], os.dup(2)
if not VERBOSE:  # TF >= 2.16 prints C++ start-up lines whatever TF_CPP_MIN_LOG_LEVEL says
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    warnings.filterwarnings("ignore")
try:
    import tensorflow as tf
finally:
    os.dup2(saved_stderr, 2)
tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.INFO if VERBOSE else tf.compat.v1.logging.ERROR)

import gradaccum  # noqa: E402

NUM_TOKENS, TOKEN_WIDTH, NUM_CLASSES = 8, 8, 10


def fail(message, status=2):
    sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]), message))
    sys.exit(status)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.error = fail  # one line, without the usage block
    add = parser.add_argument
    add("--micro-batch", type=int, default=32, help="examples per micro-batch (32)")
    add("--micro-batches", type=int, default=4, help="micro-batches per update (4)")
    add("--train-steps", type=int, default=100, help="updates: num_train_steps (100)")
    add("--warmup-proportion", type=float, default=0.1, help="share of the updates that warm up (0.1)")
    add("--learning-rate", type=float, default=3e-3, help="peak learning rate (3e-3)")
    add("--hidden", type=int, default=32, help="width of the encoder (32)")
    add("--json", type=argparse.FileType("w"), help="write the run's figures to this file")
    add("--verbose", action="store_true", help="show TensorFlow's logs")
    args = parser.parse_args(argv)
    for flag in ("micro_batch", "micro_batches", "train_steps", "hidden"):
        if getattr(args, flag) < 1:
            fail("`--%s` must be an int >= 1, got %d" % (flag.replace("_", "-"), getattr(args, flag)))
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    if not 0 <= args.warmup_proportion <= 1:
        fail("`--warmup-proportion` must be in [0, 1], got %r" % args.warmup_proportion)
    return args


def load_digits():
    """scikit-learn's bundled digits as 8 tokens of 8 pixels in [0, 1]; a 80/20 split."""
    from sklearn import datasets

    digits = datasets.load_digits()
    images, order = (digits.images / 16.0).astype(np.float32), np.random.RandomState(0).permutation(1797)
    train, test = order[:1437], order[1437:]
    print("data: scikit-learn's bundled digits from %s: %d images of 8x8, %d to train, %d to test"
          % (os.path.join(os.path.dirname(datasets.__file__), "data", "digits.csv.gz"), len(images), 1437, 360))
    return images[train], digits.target[train], images[test], digits.target[test]


v1 = tf.compat.v1


class AdamWeightDecayOptimizer(v1.train.Optimizer):
    """BERT's optimizer, in our words: Adam without bias correction, plus decoupled weight decay."""

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                 exclude_from_weight_decay=None, name="AdamWeightDecayOptimizer"):
        super(AdamWeightDecayOptimizer, self).__init__(False, name)
        self.learning_rate, self.weight_decay_rate = learning_rate, weight_decay_rate
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


def create_optimizer(loss, init_lr, num_train_steps, num_warmup_steps, num_micro_batches, weight):
    """BERT's ``create_optimizer`` through a GradientAccumulator; returns ``(train_op, learning_rate)``."""
    global_step = v1.train.get_or_create_global_step()
    learning_rate = v1.train.polynomial_decay(init_lr, global_step, num_train_steps, end_learning_rate=0.0,
                                              power=1.0)
    if num_warmup_steps:
        step = tf.cast(global_step, tf.float32)
        learning_rate = tf.where(step < num_warmup_steps, init_lr * step / num_warmup_steps, learning_rate)
    optimizer = AdamWeightDecayOptimizer(learning_rate, weight_decay_rate=0.01,
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
        outputs = tf.tensordot(inputs, kernel, 1) + v1.get_variable("bias", [units],
                                                                    initializer=v1.zeros_initializer())
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
        pooled = dense(tf.reduce_mean(x, axis=1), hidden, "pooler", tf.tanh)
    return dense(pooled, NUM_CLASSES, "cls")


def main(args):
    tf.compat.v1.disable_v2_behavior()  # graph mode; TensorFlow 1.x needs no such line
    train_x, train_y, test_x, test_y = load_digits()
    v1.set_random_seed(0)
    tokens = v1.placeholder(tf.float32, [None, NUM_TOKENS, TOKEN_WIDTH], name="tokens")
    labels = v1.placeholder(tf.int64, [None], name="labels")
    logits = encoder(tokens, args.hidden)
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
    warmup = int(round(args.warmup_proportion * args.train_steps))  # counted in updates, as BERT's
    train_op, learning_rate = create_optimizer(loss, args.learning_rate, args.train_steps, warmup,
                                               args.micro_batches, tf.shape(tokens)[0])
    accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), labels), tf.float32))
    print("AdamWeightDecay through GradientAccumulator(k=%d, clip_norm=1.0), micro-batches of %d; warm-up "
          "over %d of %d updates" % (args.micro_batches, args.micro_batch, warmup, args.train_steps))
    rng, figures, runs = np.random.RandomState(0), dict(learning_rates=[], losses=[]), 0
    order, position = rng.permutation(len(train_x)), 0
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        for update in range(args.train_steps):
            # global_step is constant inside a window: this is the rate its update uses.
            figures["learning_rates"].append(float(sess.run(learning_rate)))
            losses = []
            for _ in range(args.micro_batches):
                if position + args.micro_batch > len(order):
                    order, position = rng.permutation(len(train_x)), 0
                rows = order[position:position + args.micro_batch]
                position, runs = position + args.micro_batch, runs + 1
                losses.append(sess.run([loss, train_op], {tokens: train_x[rows], labels: train_y[rows]})[0])
            figures["losses"].append(float(np.mean(losses)))
            if (update + 1) % max(1, args.train_steps // 5) == 0 or update + 1 == args.train_steps:
                print("update %d/%d: learning rate %.6f, loss %.4f" % (
                    update + 1, args.train_steps, figures["learning_rates"][-1], figures["losses"][-1]))
        figures.update(global_step=int(sess.run(v1.train.get_global_step())), micro_batches_run=runs,
                       test_accuracy=float(sess.run(accuracy, {tokens: test_x, labels: test_y})))
    print("global_step %d after %d micro-batches (one per applied window); test accuracy %.4f"
          % (figures["global_step"], runs, figures["test_accuracy"]))
    if args.json:
        json.dump(figures, args.json, indent=1)


if __name__ == "__main__":
    main(parse_args())
