"""The one place that knows about TensorFlow-version differences.

Everything else in gradaccum imports TensorFlow through :data:`tf` from this
module, so that a missing or too-old TensorFlow fails in one sentence and
version-dependent behaviour stays in one file. This module creates no
variables and no collections.
"""
import re

_INSTALL_HINT = (
    "gradaccum needs TensorFlow 1.15 or newer: install it with "
    "`pip install \"gradaccum[tf]\"` (newest TensorFlow 2.x) or "
    "`pip install tensorflow-gpu==1.15` (TensorFlow 1.x)"
)

try:
    import tensorflow as tf
except ImportError as exc:  # The user-facing sentence matters more than the chain.
    raise ImportError("%s; importing tensorflow failed with: %s" % (_INSTALL_HINT, exc)) from None

MIN_TF_VERSION = (1, 15)


def parse_version(text):
    """Returns the leading ``(major, minor)`` of a version string.

    Args:
      text: a version such as ``"2.21.0"`` or ``"1.15.5rc0"``.

    Returns:
      A tuple of two ints, or ``(0, 0)`` when ``text`` has no leading numbers.

    Example:
      >>> parse_version("1.15.5")
      (1, 15)
    """
    match = re.match(r"\s*(\d+)\.(\d+)", str(text))
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TF_VERSION = parse_version(getattr(tf, "__version__", "0.0"))
if TF_VERSION < MIN_TF_VERSION or not hasattr(tf, "compat") or not hasattr(tf.compat, "v1"):
    raise ImportError("%s; found TensorFlow %s" % (_INSTALL_HINT, getattr(tf, "__version__", "?")))

v1 = tf.compat.v1


def is_resource_variable(var):
    """Tells whether ``var`` is a resource variable (TF2 behaviour) or a ref variable.

    Args:
      var: a ``tf.Variable``.

    Returns:
      True for a resource variable.

    Example:
      >>> is_resource_variable(tf.compat.v1.get_variable("w", [2]))
    """
    # Ref variables carry a ``_ref`` dtype; resource variables a ``handle``.
    return hasattr(var, "handle") and not var.dtype._is_ref_dtype


def is_variable(value):
    """Tells whether ``value`` is a graph variable that an optimizer can update.

    Args:
      value: anything.

    Returns:
      True for a ``tf.Variable`` (ref or resource).

    Example:
      >>> is_variable(tf.compat.v1.get_variable("w", [2]))
      True
    """
    return isinstance(value, tf.Variable)


def visible_gpus():
    """Lists the names of the GPUs this process sees, as ``"/gpu:i"`` strings.

    Returns:
      A list of device strings, empty on a machine without GPUs.

    Example:
      >>> visible_gpus()
      []
    """
    devices = tf.config.experimental.list_physical_devices("GPU")
    return ["/gpu:%d" % i for i in range(len(devices))]


def in_control_flow(graph=None):
    """Tells whether ops are being built inside ``tf.cond`` or ``tf.while_loop``.

    Covers both v1 control-flow contexts and the function graphs of control
    flow v2.

    Args:
      graph: the graph to ask; the default graph when ``None``.

    Returns:
      True inside a conditional or loop body.

    Example:
      >>> in_control_flow()
      False
    """
    graph = graph or tf.compat.v1.get_default_graph()
    # Neither question has a public API in TF 1.15; both attributes exist
    # from 1.15 to 2.21.
    return graph._get_control_flow_context() is not None or bool(getattr(graph, "building_function", False))
