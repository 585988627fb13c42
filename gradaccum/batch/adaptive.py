"""AdaptiveBatch: the next window's size from the gradient noise scale.

McCandlish et al. (2018) show that a batch near the *gradient noise scale*
``B_noise = tr(Sigma) / |G|^2`` (``gradaccum.statistics``) trades examples
for updates best: much smaller wastes updates, much larger wastes examples.
An accumulator given an :class:`AdaptiveBatch` as ``num_micro_batches``
measures ``B_noise`` on every window and, after each applied window, sets the
next window's micro-batch count to ``factor * B_noise / micro_batch_size``,
rounded and bounded, changed only when the batch would move by more than
``threshold`` (so that it does not flap). It also keeps a learning-rate
multiplier, the gain of AdaScale (Johnson et al., 2020, "AdaScale SGD"), as
AdaptDL/Pollux (Qiao et al., OSDI 2021) use it: with ``S = B / B0`` the
scale of the batch ``B`` over the batch ``B0`` the learning rate was tuned
for, and ``B_noise`` in examples,

    gain = (B_noise / B0 + 1) / (B_noise / B + 1),   1 <= gain <= S,

applied as is for SGD (``rule="sgd"``) and as its square root for Adam and
its kin (``rule="adam"``, Pollux's square-root rule). Multiply the wrapped
optimizer's learning rate by :attr:`AdaptiveBatch.learning_rate_multiplier`.

Every input of the decision is a variable updated once per applied window,
so the decision is deterministic: a checkpoint restores it, and workers that
reduce their statistics together decide alike.

Variables (created in the default graph on first use, under ``init_scope``:
global, non-trainable resource variables, so a ``Saver`` keeps them), in the
name scope ``name``: ``num_micro_batches`` (int64, starts at
``min_micro_batches``) and ``learning_rate_multiplier`` (float32, starts at
the gain of that batch, 1 with the default ``base_batch``). No collections.
"""
import math
import numbers

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.window.observers import WindowObserver
from gradaccum.window.state import state_variable
from gradaccum.window.statistics import GradientStatistics

_RULES = ("sgd", "adam")


class AdaptiveBatch(WindowObserver):
    """A window-size policy driven by the gradient noise scale (pass it as ``num_micro_batches``).

    It is two things to the accumulator: a window-size source (calling it
    with ``global_step`` gives the next window's k, so the accumulator needs
    ``global_step``), and a window observer (``gradaccum.observers``) that
    sets the next k after each applied window, from the window's statistics.

    Args:
      micro_batch_size: examples per micro-batch (an int >= 1): the noise
        scale is in examples when the accumulator's ``weight`` is the
        micro-batch's example count, as it should be here.
      factor: target batch = ``factor * B_noise`` examples (a number > 0).
      min_micro_batches: the smallest k, an int >= 2 (a window of one
        micro-batch gives no noise-scale estimate on one worker). The first
        windows use it.
      max_micro_batches: the largest k, an int >= ``min_micro_batches``.
      threshold: k changes only when the target batch differs from the
        current one by more than this fraction of it (a number >= 0):
        ``|target - k| > threshold * k``, up or down.
      base_batch: the batch, in examples, the learning rate was tuned for;
        ``None`` means ``min_micro_batches * micro_batch_size``.
      rule: ``"adam"`` (square root of the gain) or ``"sgd"`` (the gain).
      name: the variables' name scope.

    Raises:
      ValueError: for any argument out of its range, naming it.

    Example:
      >>> policy = gradaccum.AdaptiveBatch(micro_batch_size=100, max_micro_batches=50)
      >>> adam = tf.compat.v1.train.AdamOptimizer(1e-3 * policy.learning_rate_multiplier)
      >>> opt = gradaccum.GradientAccumulator(adam, num_micro_batches=policy)
      >>> train_op = opt.minimize(loss, global_step=step, weight=tf.shape(x)[0])
    """

    def __init__(self, micro_batch_size, *, factor=1.0, min_micro_batches=2, max_micro_batches=64,
                 threshold=0.25, base_batch=None, rule="adam", name="adaptive_batch"):
        self._micro = _validate.check_positive_int(micro_batch_size, "micro_batch_size")
        self._factor = _validate.check_positive_number(factor, "factor")
        self._min = _validate.check_positive_int(min_micro_batches, "min_micro_batches")
        if self._min < 2:
            raise ValueError("`min_micro_batches` must be >= 2 (one micro-batch per window gives no "
                             "noise-scale estimate), got %r" % (min_micro_batches,))
        self._max = _validate.check_positive_int(max_micro_batches, "max_micro_batches")
        if self._max < self._min:
            raise ValueError("`max_micro_batches` must be >= `min_micro_batches` (%d), got %r"
                             % (self._min, max_micro_batches))
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not threshold >= 0:
            raise ValueError("`threshold` must be a number >= 0, got %s" % _validate.describe(threshold))
        self._threshold = float(threshold)
        default_base = self._min * self._micro
        self._base = float(default_base if base_batch is None
                           else _validate.check_positive_number(base_batch, "base_batch"))
        if rule not in _RULES:
            raise ValueError("`rule` must be one of %s, got %s" % (_RULES, _validate.describe(rule)))
        self._rule = rule
        self._name = _validate.check_name(name)
        self._state = {}  # graph -> (k, multiplier)

    uses_statistics = True

    def __repr__(self):
        return ("AdaptiveBatch(micro_batch_size=%d, factor=%g, min_micro_batches=%d, max_micro_batches=%d, "
                "threshold=%g, base_batch=%g, rule=%r)" % (self._micro, self._factor, self._min, self._max,
                                                           self._threshold, self._base, self._rule))

    @property
    def micro_batch_size(self):
        """Examples per micro-batch."""
        return self._micro

    @property
    def variables(self):
        """The policy's variables in the default graph (created on first use)."""
        return list(self._variables())

    @property
    def learning_rate_multiplier(self):
        """float32 scalar tensor: the gain to multiply the learning rate by (see the module)."""
        return self._variables()[1].read_value()

    def __call__(self, global_step):
        """The next window's k: :meth:`num_micro_batches` (the window-size source)."""
        return self.num_micro_batches(global_step)

    def applied(self, update):
        """After an applied window: :meth:`update` from the window's statistics (an observer)."""
        stats = [o for o in update.observers if isinstance(o, GradientStatistics)]
        return [self.update(stats[0])]

    def num_micro_batches(self, global_step=None):
        """The k the next window gets (int64 scalar tensor); ``global_step`` is not used.

        Args:
          global_step: ignored: the policy follows the noise scale, not the step.

        Returns:
          An int64 scalar tensor.

        Example:
          >>> sess.run(policy.num_micro_batches())
          2
        """
        del global_step
        return self._variables()[0].read_value()

    def gain(self, noise_scale, batch):
        """The learning-rate multiplier for ``batch`` examples at ``noise_scale`` (tensors or numbers).

        Args:
          noise_scale: ``B_noise`` in examples (>= 0).
          batch: the batch in examples.

        Returns:
          A float32 tensor: the AdaScale gain, or its square root for ``rule="adam"``.

        Example:
          >>> sess.run(policy.gain(460.0, 500.0))
        """
        noise_scale = tf.cast(noise_scale, tf.float32)
        batch = tf.cast(batch, tf.float32)
        gain = (noise_scale / self._base + 1.0) / (noise_scale / batch + 1.0)
        return tf.sqrt(gain) if self._rule == "adam" else gain

    def update(self, statistics):
        """The op that sets the next window's k and the multiplier from ``statistics``.

        The accumulator runs it once per applied window, after the apply. A
        window without a usable estimate (none yet, or not finite or not
        positive) changes nothing.

        Args:
          statistics: the accumulator's ``gradaccum.statistics.GradientStatistics``.

        Returns:
          An op.

        Example:
          >>> op = policy.update(opt.statistics)
        """
        k_var, rate_var = self._variables()
        with tf.compat.v1.name_scope(self._name + "_update"):
            noise = tf.cast(statistics.noise_scale, tf.float32)
            usable = tf.logical_and(tf.math.is_finite(noise), noise > 0)
            noise = tf.compat.v1.where(usable, noise, tf.zeros_like(noise))
            current = k_var.read_value()
            target = tf.cast(tf.round(self._factor * noise / self._micro), tf.int64)
            target = tf.clip_by_value(target, self._min, self._max)
            # "More than the threshold", both ways: 20 -> 15 at 25% is not a change.
            change = tf.abs(tf.cast(target - current, tf.float64))
            material = change > self._threshold * tf.cast(current, tf.float64)
            new_k = tf.compat.v1.where(tf.logical_and(usable, material), target, current)
            new_rate = tf.compat.v1.where(usable, self.gain(noise, new_k * self._micro), rate_var.read_value())
            with tf.control_dependencies([new_k, new_rate]):
                return tf.group(k_var.assign(new_k, read_value=False), rate_var.assign(new_rate, read_value=False),
                                name="update")

    def _variables(self):
        # The outermost graph, not a cond branch's function graph: one state per model.
        with tf.compat.v1.init_scope():
            graph = tf.compat.v1.get_default_graph()
            if graph not in self._state:
                with tf.compat.v1.name_scope(self._name):
                    k = state_variable("num_micro_batches", [], tf.int64, initial=self._min)
                    rate = state_variable("learning_rate_multiplier", [], tf.float32, initial=self._start_rate())
                self._state[graph] = (k, rate)
        return self._state[graph]

    def _start_rate(self):
        # Without an estimate the gain is unknown: take the batch scale's
        # lower bound, 1, scaled as the rule scales it (the default base is
        # the starting batch, so this is 1).
        scale = self._min * self._micro / self._base
        return math.sqrt(min(1.0, scale)) if self._rule == "adam" else min(1.0, scale)

