"""Argument checks shared by every public entry point.

Each check raises ``TypeError`` or ``ValueError`` with a message that names the
argument in backticks and shows the value received, and returns the value
(possibly converted) so callers can write ``x = check_...(x, "x")``. This
module creates no variables and no collections.
"""
import numbers

from gradaccum._compat import tf


def describe(value):
    """Returns a short ``repr`` of ``value`` for an error message.

    Args:
      value: anything.

    Returns:
      A string of at most about 200 characters.

    Example:
      >>> describe([1, 2])
      '[1, 2]'
    """
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def check_optimizer(optimizer, arg="optimizer"):
    """Checks that ``optimizer`` is a ``tf.compat.v1.train.Optimizer``.

    Args:
      optimizer: the value to check.
      arg: the argument's name, for the message.

    Returns:
      ``optimizer``.

    Raises:
      TypeError: for anything else, naming the type received.

    Example:
      >>> check_optimizer(tf.compat.v1.train.AdamOptimizer(1e-3))
    """
    if not isinstance(optimizer, tf.compat.v1.train.Optimizer):
        raise TypeError(
            "`%s` must be a tf.compat.v1.train.Optimizer, got %s: %s"
            % (arg, type(optimizer).__name__, describe(optimizer))
        )
    return optimizer


def check_name(name, arg="name"):
    """Checks that ``name`` is a non-empty string (a name scope).

    Args:
      name: the value to check.
      arg: the argument's name, for the message.

    Returns:
      ``name``.

    Raises:
      ValueError: for anything else.

    Example:
      >>> check_name("GradientAccumulator")
      'GradientAccumulator'
    """
    if not isinstance(name, str) or not name:
        raise ValueError("`%s` must be a non-empty string, got %s" % (arg, describe(name)))
    return name


def check_positive_int(value, arg):
    """Checks that ``value`` is a Python int >= 1 (a bool is not an int here).

    Args:
      value: the value to check.
      arg: the argument's name, for the message.

    Returns:
      ``value``.

    Raises:
      ValueError: for a bool, a non-integer or a number below 1.

    Example:
      >>> check_positive_int(8, "num_micro_batches")
      8
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError("`%s` must be an int >= 1, got %s" % (arg, describe(value)))
    return int(value)


def check_positive_number(value, arg, allow_none=True):
    """Checks that ``value`` is a real number > 0 (or ``None``, when ``allow_none``).

    Args:
      value: the value to check.
      arg: the argument's name, for the message.
      allow_none: whether ``None`` is accepted (and named in the messages).

    Returns:
      ``value`` as a float, or ``None``.

    Raises:
      TypeError: for a bool or a non-number (``None`` too, unless ``allow_none``).
      ValueError: for a number <= 0, NaN or infinity.

    Example:
      >>> check_positive_number(1.0, "clip_norm")
      1.0
    """
    if value is None and allow_none:
        return None
    either = "None or " if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError("`%s` must be %sa number > 0, got %s" % (arg, either, describe(value)))
    if not 0 < float(value) < float("inf"):
        raise ValueError("`%s` must be %sa finite number > 0, got %s" % (arg, either, describe(value)))
    return float(value)


def check_seconds(value, arg):
    """Checks a duration: a finite number > 0, returned as a float.

    Args:
      value: the value to check.
      arg: the argument's name, for the message.

    Returns:
      ``value`` as a float.

    Raises:
      TypeError: for None, a bool or a non-number.
      ValueError: for a number <= 0, NaN or infinity.

    Example:
      >>> check_seconds(60, "timeout_seconds")
      60.0
    """
    if value is None:
        raise TypeError("`%s` must be a number of seconds > 0, got None" % arg)
    return check_positive_number(value, arg, allow_none=False)


def check_scalar_tensor(value, arg, allow_none=False):
    """Converts ``value`` to a numeric tensor and checks that it is a scalar.

    Args:
      value: a Python number or a tensor.
      arg: the argument's name, for the message.
      allow_none: whether ``None`` passes through unchanged.

    Returns:
      A scalar ``tf.Tensor`` (or ``None`` when allowed).

    Raises:
      TypeError: for ``None`` (unless allowed), a bool, a callable, or a
        non-numeric dtype.
      ValueError: for a tensor whose static shape is not a scalar.

    Example:
      >>> check_scalar_tensor(tf.shape(images)[0], "weight")
    """
    if value is None and allow_none:
        return None
    if value is None or isinstance(value, bool) or callable(value):
        raise TypeError("`%s` must be a scalar numeric tensor, got %s" % (arg, describe(value)))
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        raise TypeError("`%s` must be a scalar numeric tensor, got %s" % (arg, describe(value))) from None
    dtype = tensor.dtype.base_dtype
    if not (dtype.is_floating or dtype.is_integer) or dtype == tf.bool:
        raise TypeError("`%s` must have a numeric dtype, got %s (%s)" % (arg, dtype.name, describe(value)))
    if tensor.shape.ndims is not None and tensor.shape.ndims != 0:
        raise ValueError("`%s` must be a scalar, got shape %s (%s)" % (arg, tensor.shape, describe(value)))
    return tensor


def check_var_list(var_list, arg="var_list"):
    """Checks an optional (nested) list of variables as TF's ``compute_gradients`` reads it.

    TF flattens ``var_list`` (a single variable is a list of one) and accepts
    tensors there (``apply_gradients`` then raises ``NotImplementedError``);
    so does this check. Its errors start as TF's do.

    Args:
      var_list: ``None``, a variable, or a (nested) list or tuple of
        ``tf.Variable`` or ``tf.Tensor``.
      arg: the argument's name, for the message.

    Returns:
      ``var_list`` as a flat list, or ``None``.

    Raises:
      TypeError: when it holds something other than a variable or tensor.
      ValueError: when it is empty ("No variables to optimize", as TF).

    Example:
      >>> check_var_list(tf.compat.v1.trainable_variables())
    """
    if var_list is None:
        return None
    items = tf.nest.flatten(var_list)
    if not items:
        raise ValueError("No variables to optimize. `%s` must not be empty, got %s" % (arg, describe(var_list)))
    for item in items:
        if not isinstance(item, (tf.Variable, tf.Tensor)):
            raise TypeError("`%s` must hold only variables, got %s" % (arg, describe(item)))
    return items


def check_bool(value, arg):
    """Checks that ``value`` is a Python bool.

    Args:
      value: the value to check.
      arg: the argument's name, for the message.

    Returns:
      ``value``.

    Raises:
      TypeError: for anything but ``True`` or ``False``.

    Example:
      >>> check_bool(True, "skip_nonfinite")
      True
    """
    if not isinstance(value, bool):
        raise TypeError("`%s` must be a bool, got %s" % (arg, describe(value)))
    return value
