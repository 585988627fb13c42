"""Where a model function's towers compute and where their variables live.

Both forms, :func:`gradaccum.tower.minimize` and
:func:`gradaccum.subdivisions.minimize`, take ``devices`` and
``variables_device`` and mean the same by them: ``devices=None`` is every
visible GPU, or the CPU when there is none; ``variables_device`` is where
variable ops go (``"/cpu:0"``, a parameter-server layout, by default;
``None``: the first device). This module creates no variables and no
collections.
"""
import collections

from gradaccum import _compat
from gradaccum import _validate
from gradaccum._compat import tf

# Op types that hold state: placed on `variables_device` (parameter-server layout).
VARIABLE_OP_TYPES = frozenset([
    "Variable", "VariableV2", "VarHandleOp", "AutoReloadVariable",
    "MutableHashTable", "MutableHashTableV2", "MutableHashTableOfTensors",
    "MutableHashTableOfTensorsV2", "MutableDenseHashTable", "MutableDenseHashTableV2",
])

Placement = collections.namedtuple("Placement", ["devices", "variables_device"])
Placement.__doc__ = """Checked placement of a model function's towers.

Attributes:
  devices: one device string per tower, as given (or the visible GPUs).
  variables_device: the device string of the variables.
"""


def placement(devices, variables_device):
    """Checks ``devices`` and ``variables_device``; returns a :data:`Placement`.

    Args:
      devices: ``None`` (every visible GPU, else ``["/cpu:0"]``) or a
        non-empty list of device strings, one tower each.
      variables_device: a device string, or ``None`` for the first device.

    Returns:
      A :data:`Placement`.

    Raises:
      TypeError: for a non-list ``devices`` or a non-string device.
      ValueError: for an empty ``devices`` or a malformed device string.

    Example:
      >>> placement(["/gpu:0", "/gpu:1"], "/cpu:0").devices
      ['/gpu:0', '/gpu:1']
    """
    if devices is None:
        devices = _compat.visible_gpus() or ["/cpu:0"]
    elif not isinstance(devices, (list, tuple)):
        raise TypeError("`devices` must be a non-empty list of device strings, got %s"
                        % _validate.describe(devices))
    elif not devices:
        raise ValueError("`devices` must be a non-empty list of device strings, got %s"
                         % _validate.describe(devices))
    devices = [check_device(device, "devices") for device in devices]
    variables_device = devices[0] if variables_device is None else check_device(variables_device,
                                                                                 "variables_device")
    return Placement(devices, variables_device)


def check_device(device, arg):
    """Returns ``device`` when it is a device string TF parses; raises naming ``arg`` otherwise.

    Args:
      device: the value given.
      arg: the argument's name, for the message.

    Returns:
      ``device``.

    Raises:
      TypeError: when it is not a string.
      ValueError: when TF cannot parse it.

    Example:
      >>> check_device("/gpu:0", "devices")
      '/gpu:0'
    """
    if not isinstance(device, str):
        raise TypeError("`%s` must be a device string such as \"/gpu:0\", got %s"
                        % (arg, _validate.describe(device)))
    try:
        tf.compat.v1.DeviceSpec.from_string(device)
    except ValueError:
        raise ValueError("`%s` must be a device string such as \"/gpu:0\", got %s"
                         % (arg, _validate.describe(device))) from None
    return device


def device_function(compute_device, variables_device):
    """Places variable ops on ``variables_device`` and every other op on ``compute_device``.

    A device the op already has (from a ``tf.device`` inside ``model_fn``, or
    a variable read colocated with its variable) wins over this choice.

    Args:
      compute_device: device string of the tower's ops.
      variables_device: device string of its variable ops.

    Returns:
      A device function for ``tf.device``.

    Example:
      >>> with tf.compat.v1.device(device_function("/gpu:1", "/cpu:0")):
      ...     loss = model_fn(images)
    """
    compute = tf.compat.v1.DeviceSpec.from_string(compute_device)
    variables = tf.compat.v1.DeviceSpec.from_string(variables_device)

    def choose(op):
        op_type = op.type if hasattr(op, "type") else op.op  # An Operation or a NodeDef.
        target = variables if op_type in VARIABLE_OP_TYPES else compute
        return target.make_merged_spec(tf.compat.v1.DeviceSpec.from_string(op.device or "")).to_string()

    return choose
