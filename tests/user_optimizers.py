"""Optimizers written the way users write them, for ``test_user_optimizers``.

Each one stands for a family of hand-written TF1 optimizers found in public
training code, written here in our own words:

* :class:`AdamWeightDecay`: BERT's style. It overrides ``apply_gradients``
  entirely, keeps its moments in ``tf.compat.v1.get_variable`` variables
  created on the spot (no reuse), decays weights decoupled from the gradient
  except for excluded names, and ignores ``global_step``.
* :class:`Lamb`: the layer-wise adaptive style. It overrides only
  ``_apply_dense``/``_resource_apply_dense``, keeps its moments in slots and
  its bias-correction powers in non-slot variables, and scales each update by
  the trust ratio ``||w|| / ||update||``.
* :class:`CountingSGD`: TF's gradient descent that counts how many times its
  ``apply_gradients`` is called (it increments ``global_step`` as TF does).
"""
import re

import tensorflow as tf

v1 = tf.compat.v1


class AdamWeightDecay(v1.train.Optimizer):
    """Adam without bias correction, plus decoupled weight decay; ignores ``global_step``.

    Args:
      learning_rate: float or scalar tensor (a schedule of ``global_step``).
      weight_decay_rate: the decay added to the Adam step of decayed variables.
      beta_1: decay of the first moment.
      beta_2: decay of the second moment.
      epsilon: added to the root of the second moment.
      exclude_from_weight_decay: regular expressions; a variable whose name
        matches one is not decayed.
      name: the optimizer's name.

    Example:
      >>> opt = AdamWeightDecay(1e-3, 0.01, exclude_from_weight_decay=["bias"])
    """

    def __init__(self, learning_rate, weight_decay_rate=0.0, beta_1=0.9, beta_2=0.999, epsilon=1e-6,
                 exclude_from_weight_decay=None, name="AdamWeightDecay"):
        super(AdamWeightDecay, self).__init__(False, name)
        self.learning_rate = learning_rate
        self.weight_decay_rate = weight_decay_rate
        self.beta_1 = beta_1
        self.beta_2 = beta_2
        self.epsilon = epsilon
        self.exclude_from_weight_decay = list(exclude_from_weight_decay or [])
        self.calls = 0

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """Builds the update; ``global_step`` is accepted and left alone, as BERT does."""
        self.calls += 1
        updates = []
        for grad, param in grads_and_vars:
            if grad is None or param is None:
                continue
            base = re.sub(r":\d+$", "", param.name)
            dtype = param.dtype.base_dtype
            # Created here, on every call, with no reuse: a second call for the
            # same variables raises "already exists", as BERT's does.
            m = v1.get_variable(base + "/adam_m", shape=param.shape.as_list(), dtype=dtype, trainable=False,
                                initializer=v1.zeros_initializer())
            v = v1.get_variable(base + "/adam_v", shape=param.shape.as_list(), dtype=dtype, trainable=False,
                                initializer=v1.zeros_initializer())
            lr = tf.cast(self.learning_rate, dtype)
            next_m = self.beta_1 * m + (1.0 - self.beta_1) * grad
            next_v = self.beta_2 * v + (1.0 - self.beta_2) * tf.square(grad)
            step = next_m / (tf.sqrt(next_v) + self.epsilon)
            if self._decays(base):
                step += self.weight_decay_rate * param
            updates.extend([v1.assign(param, param - lr * step), v1.assign(m, next_m), v1.assign(v, next_v)])
        return tf.group(*updates, name=name)

    def _decays(self, name):
        if not self.weight_decay_rate:
            return False
        return not any(re.search(pattern, name) for pattern in self.exclude_from_weight_decay)


class Lamb(v1.train.Optimizer):
    """Adam's bias-corrected step plus weight decay, scaled per variable by the trust ratio.

    Args:
      learning_rate: float.
      beta_1: decay of the first moment (slot ``m``).
      beta_2: decay of the second moment (slot ``v``).
      epsilon: added to the root of the second moment.
      weight_decay_rate: decay added to the step before the trust ratio.
      name: the optimizer's name (the slots are ``<var>/<name>``, ``<var>/<name>_1``).

    Example:
      >>> train_op = Lamb(0.01, weight_decay_rate=0.01).minimize(loss, global_step)
    """

    def __init__(self, learning_rate, beta_1=0.9, beta_2=0.999, epsilon=1e-6, weight_decay_rate=0.0,
                 name="Lamb"):
        super(Lamb, self).__init__(False, name)
        self._lr = learning_rate
        self._beta_1 = beta_1
        self._beta_2 = beta_2
        self._epsilon = epsilon
        self._decay = weight_decay_rate

    def _create_slots(self, var_list):
        first = min(var_list, key=lambda var: var.name)
        self._create_non_slot_variable(initial_value=self._beta_1, name="beta1_power", colocate_with=first)
        self._create_non_slot_variable(initial_value=self._beta_2, name="beta2_power", colocate_with=first)
        for var in var_list:
            self._zeros_slot(var, "m", self._name)
            self._get_or_make_slot(var, tf.zeros(var.shape, var.dtype.base_dtype), "v", self._name + "_1")

    def _powers(self):
        # The graph that holds the variables, as TF's Adam finds it: inside a
        # tf.cond of control flow v2 the default graph is the branch's.
        with v1.init_scope():
            graph = v1.get_default_graph()
        return (self._get_non_slot_variable("beta1_power", graph=graph),
                self._get_non_slot_variable("beta2_power", graph=graph))

    def _update(self, grad, var):
        dtype = var.dtype.base_dtype
        beta1_power, beta2_power = [tf.cast(power, dtype) for power in self._powers()]
        m = v1.assign(self.get_slot(var, "m"), self._beta_1 * self.get_slot(var, "m") + (1 - self._beta_1) * grad)
        v = v1.assign(self.get_slot(var, "v"),
                      self._beta_2 * self.get_slot(var, "v") + (1 - self._beta_2) * tf.square(grad))
        step = (m / (1 - beta1_power)) / (tf.sqrt(v / (1 - beta2_power)) + self._epsilon) + self._decay * var
        var_norm, step_norm = tf.norm(var), tf.norm(step)
        # A zero norm (a fresh zero bias) would make the ratio 0 or nan: use 1 there.
        usable = tf.logical_and(var_norm > 0, step_norm > 0)
        ratio = tf.where(usable, var_norm / tf.where(usable, step_norm, tf.ones_like(step_norm)),
                         tf.ones_like(var_norm))
        return v1.assign_sub(var, tf.cast(self._lr, dtype) * ratio * step)

    def _apply_dense(self, grad, var):
        return self._update(grad, var)

    def _resource_apply_dense(self, grad, var):
        return self._update(grad, var)

    def _finish(self, update_ops, name_scope):
        with tf.control_dependencies(update_ops):
            beta1_power, beta2_power = self._powers()
            with v1.colocate_with(beta1_power):
                moved = [v1.assign(beta1_power, beta1_power * self._beta_1),
                         v1.assign(beta2_power, beta2_power * self._beta_2)]
        return tf.group(*(list(update_ops) + moved), name=name_scope)


class CountingSGD(v1.train.GradientDescentOptimizer):
    """TF's gradient descent, counting the calls of ``apply_gradients`` in ``calls``.

    Example:
      >>> opt = CountingSGD(0.1)
      >>> _ = opt.minimize(loss)
      >>> opt.calls
      1
    """

    def __init__(self, learning_rate, name="CountingSGD"):
        super(CountingSGD, self).__init__(learning_rate, name=name)
        self.calls = 0

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """TF's ``apply_gradients`` (which increments ``global_step``), counted."""
        self.calls += 1
        return super(CountingSGD, self).apply_gradients(grads_and_vars, global_step, name)
