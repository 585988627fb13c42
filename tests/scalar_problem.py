"""A test problem whose gradient is exactly what is fed: ``loss = sum(c * w)``."""
import collections

import tensorflow as tf

import gradaccum

v1 = tf.compat.v1
ScalarProblem = collections.namedtuple("ScalarProblem", "c weight w step acc train_op")


def scalar_problem(k, opt, dtype=tf.float64, initial=(10.0, 20.0), **kwargs):
    """Builds ``GradientAccumulator(opt, k, **kwargs)`` on ``w`` with gradient ``c``.

    ``weight`` is a placeholder that defaults to 1, so a run without it
    weighs like ``weight=None``.
    """
    c = v1.placeholder(dtype, [2], name="c")
    weight = v1.placeholder_with_default(tf.constant(1.0, dtype), [], name="weight")
    w = v1.get_variable("w", initializer=tf.constant(initial, dtype))
    step = v1.train.get_or_create_global_step()
    acc = gradaccum.GradientAccumulator(opt, k, **kwargs)
    train_op = acc.minimize(tf.reduce_sum(c * w), global_step=step, weight=weight)
    return ScalarProblem(c, weight, w, step, acc, train_op)
