"""Batch normalisation whose statistics are those of the whole batch: across towers and windows.

:func:`batch_normalization` is a drop-in for
``tf.compat.v1.layers.batch_normalization`` (same arguments for the common
case, same variables under the same scope names, same ``UPDATE_OPS``
mechanism). Outside ``gradaccum.tower.minimize`` and outside a
``GradientAccumulator`` window it builds the same computation as the TF layer,
on the same kernel path:

* a 4-D input (5-D from TF 2.5) of dtype float16, bfloat16 or float32 with
  the channel axis 1 or last takes TensorFlow's fused kernel, which folds
  Bessel's correction n/(n-1) into the moving variance (n = elements per
  channel);
* every other input (float64 in particular) takes the non-fused path, which
  writes the biased batch variance into the moving variance. (TF 1.15's own
  layer fails on a 4-D float64 input; this layer takes the non-fused path.)

**Towers (synchronized batch norm).** Inside ``tower.minimize`` with more than
one tower, training mode normalises every shard with the mean and variance of
the whole batch across all towers. We use TensorFlow's collective all-reduce
(``CollectiveReduce``, the mechanism behind ``tf.distribute``'s synchronized
batch norm), which runs between the devices of one session: each tower's
call is built independently (towers are built one after another, so tower 0
cannot see tower 1's tensors), and the L-th call of every tower joins the same
reduction through shared group and instance keys handed out by the tower
context (``gradaccum.devices.context``). Alternatives were rejected: gathering
the shards' statistics in one place needs every tower built before any is
normalised (a second pass over ``model_fn``), and a shifted-sum single pass
loses digits when the mean is far from the shift. Per layer and step, two
small vectors cross devices forwards (per-channel sums plus the count, then
the centred sums of squares: the two-pass variance of ``tf.nn.moments``), and
two backwards. ``CollectiveReduce`` has no gradient; ours is the all-reduce
of the upstream gradients, weighted: ``tower.minimize`` weights tower j's
gradients by its shard size ``w_j`` after differentiating tower j's own mean
loss, so tower j receives ``sum_i(w_i * g_i) / w_j`` and, once weighted, the
sum is exactly the full batch's gradient, uneven and empty shards included.
Only the first tower builds the moving-average update (from the global
statistics), so ``update_ops="first"`` and ``"all"`` run the same update, once
per run. All towers must run together: fetch ``train_op`` or the loss of
``tower.minimize``, never one tower's tensors alone.

**Workers.** Built inside ``gradaccum.collective.synchronized_batch_norm``
(between-graph training, one process per worker, each with its own graph),
training mode normalises with the mean and variance of every worker's batch
together: the same two-pass sums, all-reduced between the worker processes
on each worker's CPU (the collective group of ``CollectiveAllReduce``, with
the per-graph instance keys of ``gradaccum.devices.context``). The gradient
through the shared statistics is weighted as for towers, with ``w_j`` the
worker's example count (``tf.shape(inputs)[0]``): exact when the accumulator's
or ``CollectiveAllReduce``'s ``weight`` is that count. Every worker builds
the update of its own moving averages from the global statistics (and its
window pools the global ones), so the copies stay equal. One tower per
worker: several towers inside that scope raise ``ValueError``.

**Windows (issue 19).** A training-mode call also puts a window-statistics
object (``gradaccum.window.update_ops``'s interface) into the graph collection
``"gradaccum_window_statistics"``. Under a ``GradientAccumulator`` with
k > 1, instead of the per-run update the accumulator folds each micro-batch's
count, mean and sum of squared deviations into the window (Chan et al.'s
pairwise combination, never ``E[x^2] - E[x]^2``), and once per applied update
moves the moving averages from the pooled window, with TF's momentum and the
TF layer's variance path (Bessel with n = the window's element count per
channel where the fused kernel would be used). Skipped windows leave the moving
statistics alone. Micro-batches pool by their real example counts, whatever
``weight`` the accumulator is given.

Variables, per layer (the TF layer's, in ``tf.compat.v1.variable_scope(name,
default_name="batch_normalization")``): ``gamma`` (when ``scale``) and
``beta`` (when ``center``), trainable; ``moving_mean`` and
``moving_variance``, non-trainable, ``GLOBAL_VARIABLES`` only. float32 for
16- and 32-bit inputs, float64 for float64 inputs. Under an accumulator with
k > 1, the first use of a call's window statistics creates three more
non-trainable ``GLOBAL_VARIABLES`` (so that a checkpoint taken mid-window
resumes exactly), colocated with ``moving_mean``, all float64 (a window mean
far from zero keeps its digits): ``<scope>/window_count``,
``<scope>/window_mean`` and ``<scope>/window_m2``. Without an
accumulator they do not exist, and checkpoints interchange with the TF layer's.

Collections: the per-run update op (one op per call, updating both moving
averages) goes to ``UPDATE_OPS`` in training mode; the window-statistics
object to ``"gradaccum_window_statistics"``.
"""
import numbers

from gradaccum import _compat
from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.devices import context as tower_context
from gradaccum.window.observers import WindowObserver
from gradaccum.window.state import state_variable
from gradaccum.window.update_ops import WINDOW_STATISTICS

DEFAULT_NAME = "batch_normalization"
_FLOAT_DTYPES = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
_FUSED_DTYPES = (tf.float16, tf.bfloat16, tf.float32)


def batch_normalization(inputs, training, *, axis=-1, momentum=0.99, epsilon=1e-3, center=True,
                        scale=True, name=None):
    """Batch normalisation over the whole batch: one device, several towers, or a window.

    Drop-in for ``tf.compat.v1.layers.batch_normalization(inputs, training=...,
    axis=..., momentum=..., epsilon=..., center=..., scale=..., name=...)``.
    Outside ``gradaccum.tower.minimize`` and outside a ``GradientAccumulator``
    window it equals that layer (same kernel path, see the module docstring).
    Training mode uses the statistics of all towers' shards inside
    ``tower.minimize``, of all workers' batches inside
    ``synchronized_batch_norm``; under a ``GradientAccumulator`` the moving
    statistics move once per applied update, from the whole window.

    Args:
      inputs: a float16, bfloat16, float32 or float64 tensor of known rank >= 2
        whose channel dimension is static.
      training: a Python bool or a scalar ``tf.bool`` tensor (a placeholder).
      axis: int, the channel axis (not the batch axis 0).
      momentum: number in [0, 1), the moving averages' momentum.
      epsilon: number > 0 added to the variance.
      center: bool, whether to add the learned offset ``beta``.
      scale: bool, whether to multiply by the learned ``gamma``.
      name: ``None`` (unique ``"batch_normalization"``, ``"..._1"``, ...) or a
        variable scope name; reuse follows the enclosing variable scope.

    Returns:
      The normalised tensor, shape and dtype of ``inputs``.

    Raises:
      TypeError: for a non-float ``inputs``, a non-int ``axis``, a non-number
        ``momentum`` or ``epsilon``, a non-bool ``center``/``scale`` or a
        ``training`` that is neither a bool nor a scalar bool tensor.
      ValueError: for an unknown rank or rank < 2, an ``axis`` out of range or
        equal to the batch axis, a channel dimension that is not static,
        ``momentum`` outside [0, 1), ``epsilon`` <= 0, or an empty ``name``;
        inside ``tower.minimize``, when a later tower builds more of these
        layers than the first, or when it has several towers inside
        ``synchronized_batch_norm``.

    Example:
      >>> h = tf.compat.v1.layers.conv2d(images, 32, 3, use_bias=False)
      >>> h = tf.nn.relu(gradaccum.batch_normalization(h, training=is_training))
    """
    inputs = _check_inputs(inputs)
    axis = _check_axis(axis, inputs)
    momentum = _check_momentum(momentum)
    epsilon = _check_epsilon(epsilon)
    _validate.check_bool(center, "center")
    _validate.check_bool(scale, "scale")
    training = _check_training(training)
    if name is not None:
        _validate.check_name(name)
    with tf.compat.v1.variable_scope(name, default_name=DEFAULT_NAME) as scope:
        layer = _Layer(inputs, scope, axis, momentum, epsilon, center, scale, training)
        if _static_value(training) is False:
            return _inference(inputs, layer)
        peers = _peers(inputs, layer, tower_context.current())
        if peers is not None:
            return _train_synced(inputs, layer, peers)
        return _train_local(inputs, layer)


# ------------------------------------------------------------------ checks


def _check_inputs(inputs):
    try:
        tensor = tf.convert_to_tensor(inputs)
    except (TypeError, ValueError):
        raise TypeError("`inputs` must be a float tensor, got %s" % _validate.describe(inputs)) from None
    if tensor.dtype.base_dtype not in _FLOAT_DTYPES:
        raise TypeError("`inputs` must have dtype float16, bfloat16, float32 or float64, got %s (%s)"
                        % (tensor.dtype.base_dtype.name, _validate.describe(inputs)))
    if tensor.shape.ndims is None or tensor.shape.ndims < 2:
        raise ValueError("`inputs` must have a known rank >= 2 (batch and channels), got shape %s (%s)"
                         % (tensor.shape, _validate.describe(inputs)))
    return tensor


def _check_axis(axis, inputs):
    rank = inputs.shape.ndims
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise TypeError("`axis` must be an int (the channel axis), got %s" % _validate.describe(axis))
    if not -rank <= axis < rank or axis % rank == 0:
        raise ValueError("`axis` must be a channel axis in [%d, %d) other than the batch axis 0 for an "
                         "input of rank %d, got %s" % (-rank, rank, rank, _validate.describe(axis)))
    axis = int(axis) % rank
    if tf.compat.dimension_value(inputs.shape[axis]) is None:
        raise ValueError("`inputs` must have a static size along `axis` %d, got shape %s"
                         % (axis, inputs.shape))
    return axis


def _check_momentum(momentum):
    if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
        raise TypeError("`momentum` must be a number in [0, 1), got %s" % _validate.describe(momentum))
    if not 0 <= float(momentum) < 1:
        raise ValueError("`momentum` must be a number in [0, 1), got %s" % _validate.describe(momentum))
    return momentum


def _check_epsilon(epsilon):
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real):
        raise TypeError("`epsilon` must be a number > 0, got %s" % _validate.describe(epsilon))
    if not 0 < float(epsilon) < float("inf"):
        raise ValueError("`epsilon` must be a finite number > 0, got %s" % _validate.describe(epsilon))
    return epsilon


def _check_training(training):
    if isinstance(training, bool):
        return training
    message = "`training` must be a Python bool or a scalar tf.bool tensor, got %s" % _validate.describe(training)
    if not isinstance(training, (tf.Tensor, tf.Variable)):
        raise TypeError(message)
    if training.dtype.base_dtype != tf.bool or (training.shape.ndims not in (None, 0)):
        raise TypeError(message)
    return training


def _static_value(training):
    """True or False when known while building, else None (as TF's smart_cond decides)."""
    if isinstance(training, bool):
        return training
    if isinstance(training, tf.Variable):
        return None
    value = tf.get_static_value(training)
    return None if value is None else bool(value)


def _smart_cond(training, true_fn, false_fn):
    value = _static_value(training)
    if value is None:
        return tf.cond(training, true_fn, false_fn)
    return true_fn() if value else false_fn()


# ------------------------------------------------------------ the layer


class _Layer(object):
    """One call's configuration and variables (created here, as the TF layer does)."""

    def __init__(self, inputs, scope, axis, momentum, epsilon, center, scale, training):
        self.scope = scope
        self.axis = axis
        self.rank = inputs.shape.ndims
        self.channels = tf.compat.dimension_value(inputs.shape[axis])
        self.momentum, self.epsilon, self.training = momentum, epsilon, training
        dtype = inputs.dtype.base_dtype
        self.param_dtype = tf.float64 if dtype == tf.float64 else tf.float32
        self.fused = dtype in _FUSED_DTYPES and self.rank in _compat.FUSED_BATCH_NORM_RANKS and (
            axis in (1, self.rank - 1))
        self.reduction_axes = [i for i in range(self.rank) if i != axis]
        ones, zeros = tf.compat.v1.ones_initializer(), tf.compat.v1.zeros_initializer()
        self.gamma = self._variable("gamma", ones, True) if scale else None
        self.beta = self._variable("beta", zeros, True) if center else None
        self.moving_mean = self._variable("moving_mean", zeros, False)
        self.moving_variance = self._variable("moving_variance", ones, False)

    def _variable(self, name, initializer, trainable):
        return tf.compat.v1.get_variable(name, shape=[self.channels], dtype=self.param_dtype,
                                         initializer=initializer, trainable=trainable)

    def broadcast(self, vector):
        """Reshapes a per-channel vector to broadcast against the input."""
        if self.axis == self.rank - 1:
            return vector
        shape = [1] * self.rank
        shape[self.axis] = self.channels
        return tf.reshape(vector, shape)

    def decay(self):
        """``1 - momentum`` exactly as the TF layer's path rounds it (to float32), cast."""
        if self.fused:  # Keras: 1.0 - convert_to_tensor(momentum), in float32.
            decay = 1.0 - tf.convert_to_tensor(self.momentum, dtype=tf.float32)
        else:  # Keras: convert_to_tensor(1.0 - momentum), a Python float, so float32.
            decay = tf.convert_to_tensor(1.0 - self.momentum, dtype=tf.float32)
        return tf.cast(decay, self.param_dtype, name="decay")


def _inference(inputs, layer):
    if layer.fused:
        return _fused(inputs, layer, False)[0]
    return _normalize(inputs, layer.moving_mean, layer.moving_variance, layer)


def _normalize(inputs, mean, variance, layer):
    """The TF layer's non-fused normalisation (16-bit inputs computed in float32)."""
    dtype = inputs.dtype.base_dtype
    x = tf.cast(inputs, tf.float32) if dtype in (tf.float16, tf.bfloat16) else inputs

    def prepared(vector):
        return None if vector is None else layer.broadcast(tf.cast(vector, x.dtype))

    outputs = tf.nn.batch_normalization(x, prepared(mean), prepared(variance), prepared(layer.beta),
                                        prepared(layer.gamma), layer.epsilon)
    if x is not inputs:
        outputs = tf.cast(outputs, dtype)
    outputs.set_shape(inputs.shape)
    return outputs


def _fused(inputs, layer, training):
    """TensorFlow's fused kernel, as the TF layer calls it: ``(outputs, mean, variance)``."""
    gamma = layer.gamma if layer.gamma is not None else tf.ones([layer.channels], layer.param_dtype)
    beta = layer.beta if layer.beta is not None else tf.zeros([layer.channels], layer.param_dtype)
    channels_first = layer.axis == 1
    data_format = {4: ("NHWC", "NCHW"), 5: ("NDHWC", "NCDHW")}[layer.rank][int(channels_first)]

    def train():
        return tf.compat.v1.nn.fused_batch_norm(inputs, gamma, beta, epsilon=layer.epsilon,
                                                data_format=data_format, is_training=True)

    def infer():
        return tf.compat.v1.nn.fused_batch_norm(
            inputs, gamma, beta, mean=layer.moving_mean, variance=layer.moving_variance,
            epsilon=layer.epsilon, data_format=data_format, is_training=False)

    return _smart_cond(training, train, infer)


def _count(x, layer):
    """Elements per channel in ``x``, in the parameters' dtype."""
    size = tf.size(x, out_type=tf.int64) // layer.channels
    return tf.cast(size, layer.param_dtype, name="count")


def _train_local(inputs, layer):
    """One device: the TF layer's training computation and update, plus window statistics."""
    count = _count(inputs, layer)
    if layer.fused:
        outputs, mean, variance = _fused(inputs, layer, layer.training)
        # The kernel's variance carries n/(n-1): the sum of squared deviations is variance * (n-1).
        _add_statistics(layer, mean, variance, count, variance * (count - 1), inputs)
        return outputs
    x = tf.cast(inputs, tf.float32) if inputs.dtype.base_dtype in (tf.float16, tf.bfloat16) else inputs
    mean, variance = tf.nn.moments(tf.cast(x, layer.param_dtype), layer.reduction_axes)
    used_mean = _smart_cond(layer.training, lambda: mean, lambda: tf.convert_to_tensor(layer.moving_mean))
    used_variance = _smart_cond(layer.training, lambda: variance,
                                lambda: tf.convert_to_tensor(layer.moving_variance))
    _add_statistics(layer, mean, variance, count, variance * count, x)
    return _normalize(inputs, used_mean, used_variance, layer)


class _Peers(object):
    """Whom one training-mode call sums its statistics with, and how.

    Attributes:
      size: the number of devices in the collective group.
      group_key: the group's collective key.
      record: the ``LayerRecord`` holding the instance keys (shared by the
        L-th call of every tower; one per call between workers).
      first: whether this call builds the moving-average update.
      weight: this call's example count (the weight its gradients get), a
        scalar tensor of the parameters' dtype.
      device: ``None`` (the enclosing device: towers) or this worker's CPU.
      timeout_seconds: ``None`` or the collectives' timeout (TF 2.x only).
    """

    def __init__(self, size, group_key, record, first, weight, device=None, timeout_seconds=None):
        self.size, self.group_key, self.record, self.first = size, group_key, record, first
        self.weight, self.device, self.timeout_seconds = weight, device, timeout_seconds

    def all_reduce(self, value, key):
        """``value`` summed over the group; between workers on this worker's CPU."""
        return _compat.collective_sum(value, self.size, self.group_key, key, self.timeout_seconds, self.device)


def _peers(inputs, layer, context):
    """The :class:`_Peers` of this call: the towers or the workers; ``None`` when alone."""
    workers = tower_context.current_workers()
    if context is not None and context.group.count > 1:
        group = context.group
        _check_towers_can_sync(group, workers, layer)
        record = group.next_record(context.index, layer.scope.name)
        weight = tf.cast(context.size, layer.param_dtype, name="tower_weight")
        return _Peers(group.count, group.group_key, record, context.index == 0, weight)
    if workers is None:
        return None
    record = tower_context.LayerRecord(tf.compat.v1.get_default_graph())
    weight = tf.cast(tf.shape(inputs)[0], layer.param_dtype, name="worker_weight")
    return _Peers(workers.size, workers.group_key, record, True, weight, workers.device, workers.timeout_seconds)


def _check_towers_can_sync(group, workers, layer):
    """Refuses the tower groups that hang or crash, in one line naming the layer."""
    if workers is not None:
        # Tried (one group over every tower of every worker): it deadlocked intermittently
        # on TF 2.21, so it is refused rather than left to hang.
        raise ValueError("`gradaccum.batch_normalization` cannot synchronize %d towers inside "
                         "`synchronized_batch_norm` (%d workers): build one tower per worker process "
                         "(call %s)" % (group.count, workers.size, layer.scope.name))
    if group.workers > 1 and not _compat.TOWER_GROUPS_BESIDE_WORKERS:
        raise ValueError("`gradaccum.batch_normalization` cannot synchronize %d towers of each of %d "
                         "collective workers on TensorFlow %s (its collective leader crashes): use "
                         "TensorFlow 2.x, one tower per worker, or tf.compat.v1.layers.batch_normalization "
                         "(call %s)" % (group.count, group.workers, tf.__version__, layer.scope.name))


def _train_synced(inputs, layer, peers):
    """Towers or workers: mean and variance over every peer's batch, through collective all-reduces."""
    record = peers.record
    x = tf.cast(inputs, layer.param_dtype)
    local = tf.concat([tf.reduce_sum(x, layer.reduction_axes), tf.reshape(_count(x, layer), [1])], 0)
    totals = _synced_sum(local, peers, "sum")
    count = totals[-1]
    mean = tf.identity(totals[:-1] / count, name="mean")
    deviations = tf.math.squared_difference(x, tf.stop_gradient(layer.broadcast(mean)))
    m2 = _synced_sum(tf.reduce_sum(deviations, layer.reduction_axes), peers, "m2")
    variance = tf.identity(m2 / count, name="variance")
    if peers.first:
        # The fused kernel's moving variance carries Bessel's correction: keep that path's semantics.
        moving = variance * count / (count - 1) if layer.fused else variance
        record.first = _add_statistics(layer, mean, moving, count, m2)
    else:
        record.first.wait_for([mean, variance])
    used_mean = _smart_cond(layer.training, lambda: mean, lambda: tf.convert_to_tensor(layer.moving_mean))
    used_variance = _smart_cond(layer.training, lambda: variance,
                                lambda: tf.convert_to_tensor(layer.moving_variance))
    return _normalize(inputs, used_mean, used_variance, layer)


def _synced_sum(local, peers, purpose):
    """All-reduce sum over the peers, whose gradient carries the peers' weights.

    ``tower.minimize`` differentiates tower j's own mean loss and multiplies
    the result by ``w_j / sum(w)``; ``CollectiveAllReduce`` does the same
    with worker j's ``weight``. The whole batch's gradient with respect to
    peer j's contribution is ``sum_i(w_i * g_i) / sum(w)``, where ``g_i`` is
    the upstream gradient in peer i; so peer j passes on
    ``sum_i(w_i * g_i) / w_j``. An empty peer (``w_j = 0``) passes on 0 and
    contributes 0, even when its own upstream gradient is NaN.
    """
    key, grad_key = peers.record.key(purpose), peers.record.key(purpose + "_grad")

    @tf.custom_gradient
    def reduce(value):
        total = peers.all_reduce(value, key)

        def grad(upstream):
            weighted = tf.math.multiply_no_nan(upstream, peers.weight)
            return tf.math.divide_no_nan(peers.all_reduce(weighted, grad_key), peers.weight)

        return total, grad

    return reduce(local)


# --------------------------------------------------------- the statistics


def _add_statistics(layer, mean, moving_variance_value, count, m2, inputs=None):
    """Builds the per-run update and the window-statistics object; registers both."""
    stats = WindowStatistics(layer, mean, moving_variance_value, count, m2, inputs)
    graph = tf.compat.v1.get_default_graph()
    graph.add_to_collection(tf.compat.v1.GraphKeys.UPDATE_OPS, stats.update_op)
    graph.add_to_collection(WINDOW_STATISTICS, stats)
    return stats


def _assign_moving_average(variable, value, decay):
    """``variable -= (variable - value) * decay``, the TF layer's update (decay 0: unchanged, even for NaN)."""
    # Nested, not one ``with a, b:``: vermin reads that as 3.9's parenthesized form.
    with tf.compat.v1.name_scope("AssignMovingAvg") as scope:
        with tf.compat.v1.colocate_with(variable.op):
            dtype = variable.dtype.base_dtype
            delta = tf.math.multiply_no_nan(variable - tf.cast(value, dtype), decay)
            return tf.compat.v1.assign_sub(variable, delta, name=scope)


def _when(condition, decay):
    """``decay`` when ``condition`` (a Python or tensor bool) holds, else 0."""
    if condition is True:
        return decay
    return tf.compat.v1.where(condition, decay, tf.zeros_like(decay))


class WindowStatistics(WindowObserver):
    """One training-mode call's batch statistics, per run and per accumulation window.

    ``update_op`` is the TF layer's per-run update of the moving averages, in
    ``UPDATE_OPS``; the object itself is in ``gradaccum.window.update_ops``'
    collection, and a ``GradientAccumulator`` with k > 1 runs it as a window
    observer (``gradaccum.observers``) instead: :meth:`accumulate` on every
    micro-batch, :meth:`finalize` after an applied window, :meth:`reset` on
    a skipped or reset one. Built by :func:`batch_normalization`; not public.

    Args:
      layer: the call's ``_Layer``.
      mean: this run's batch mean per channel.
      moving_variance_value: the variance the TF layer's path writes into the
        moving variance (Bessel-corrected on the fused path).
      count: elements per channel in this run's batch (scalar tensor).
      m2: this run's sum of squared deviations from ``mean``, per channel.
      inputs: ``None``, or the batch the float32 ``mean`` was computed from:
        then the window adds back the mean's float32 rounding (one more
        reduction, only under an accumulator).

    Example:
      >>> plain, stats = gradaccum.window.update_ops.split_update_ops(update_ops)
      >>> stats[0].accumulate()
    """

    reads_gradients = False  # It pools batch statistics, never a gradient: the weight may ride in backprop.

    def __init__(self, layer, mean, moving_variance_value, count, m2, inputs=None):
        self._layer = layer
        self._mean, self._count, self._m2 = mean, count, m2
        self._inputs = inputs if layer.param_dtype != tf.float64 else None
        self._state = None
        with tf.compat.v1.name_scope("update"):
            decay = _when(_static_value(layer.training) or layer.training, layer.decay())
            self.update_op = tf.group(_assign_moving_average(layer.moving_mean, mean, decay),
                                      _assign_moving_average(layer.moving_variance, moving_variance_value, decay),
                                      name="update_moving_averages")

    def wait_for(self, tensors):
        """Makes ``update_op`` also run ``tensors`` (the other towers' statistics)."""
        _compat.add_control_inputs(self.update_op, tensors)

    def added(self, micro_batch):
        """:meth:`accumulate` (a window observer)."""
        del micro_batch
        return self.accumulate()

    def applied(self, update):
        """:meth:`finalize` (a window observer)."""
        del update
        return self.finalize()

    def share_window(self, other):
        """Folds this call's statistics into ``other``'s window from now on.

        The in-graph form (``gradaccum.subdivisions``) builds a layer once for
        its first micro-batch and once inside its loop: both calls pool into
        one window, which ``other`` finalizes.

        Args:
          other: the first call's ``WindowStatistics`` of the same layer.
        """
        self._state = other._variables()

    def accumulate(self):
        """Op folding this run's statistics into the window (Chan et al.'s pairwise update).

        Returns:
          An op; a run in inference mode (``training`` fed False) adds nothing.
        """
        count, mean, m2 = self._variables()
        with tf.compat.v1.name_scope("batch_norm_window"):
            training = self._layer.training
            n_b, mean_b, m2_b = [_masked(value, training) for value in self._float64_statistics()]
            n_a = count.read_value()
            n = n_a + n_b
            share = tf.math.divide_no_nan(n_b, n)
            cross = tf.math.divide_no_nan(n_a * n_b, n)
            delta = mean_b - mean.read_value()
            new_mean = mean.read_value() + delta * share
            new_m2 = m2.read_value() + m2_b + tf.square(delta) * cross
            with tf.control_dependencies([n, new_mean, new_m2]):  # Every read before any write.
                return tf.group(count.assign(n), mean.assign(new_mean), m2.assign(new_m2), name="accumulate")

    def _float64_statistics(self):
        """``(count, mean, m2)`` in float64; a float32 mean far from 0 gets its rounding back.

        A float32 mean of values near 1e4 is off by up to half an ulp (5e-4),
        which the spread between micro-batch means would carry into the
        window's variance; ``mean(x - mean32)`` is that rounding, computed
        almost exactly (the differences are small and exact).
        """
        count, mean, m2 = [tf.cast(value, tf.float64) for value in (self._count, self._mean, self._m2)]
        if self._inputs is None:
            return count, mean, m2
        x = tf.cast(self._inputs, self._layer.param_dtype)
        centred = x - self._layer.broadcast(tf.cast(self._mean, x.dtype))
        rounding = tf.cast(tf.reduce_mean(centred, self._layer.reduction_axes), tf.float64)
        return count, mean + rounding, m2 - count * tf.square(rounding)

    def finalize(self):
        """Op moving the averages once from the pooled window, then clearing the window.

        An empty window (no training-mode run) leaves the averages alone.
        """
        count, mean, m2 = self._variables()
        layer = self._layer
        with tf.compat.v1.name_scope("batch_norm_window"):
            n = count.read_value()
            denominator = n - 1.0 if layer.fused else n  # The fused kernel's n/(n-1).
            variance = m2.read_value() / denominator
            decay = _when(n > 0, layer.decay())
            moved = [_assign_moving_average(layer.moving_mean, mean.read_value(), decay),
                     _assign_moving_average(layer.moving_variance, variance, decay)]
            with tf.control_dependencies(moved):
                return tf.group(*self._clear(), name="finalize")

    def reset(self):
        """Op clearing the window without touching the moving averages."""
        with tf.compat.v1.name_scope("batch_norm_window"):
            return tf.group(*self._clear(), name="reset")

    def _clear(self):
        return [var.assign(tf.zeros_like(var.read_value())) for var in self._variables()]

    def _variables(self):
        """``(count, mean, m2)``, created on first use (only under an accumulator)."""
        if self._state is None:
            layer = self._layer
            with tf.compat.v1.init_scope():
                with tf.compat.v1.colocate_with(layer.moving_mean.op):
                    with tf.compat.v1.name_scope(layer.scope.name + "/"):
                        self._state = _window_variables(layer.channels)
        return self._state


def _window_variables(channels):
    """``(count, mean, m2)`` in float64: a mean far from 0 keeps its digits."""
    return (state_variable("window_count", [], tf.float64), state_variable("window_mean", [channels], tf.float64),
            state_variable("window_m2", [channels], tf.float64))


def _masked(value, training):
    """``value`` in training mode, zeros when ``training`` is fed False (even for NaN)."""
    if _static_value(training) is True:
        return value
    return tf.math.multiply_no_nan(value, tf.cast(training, value.dtype))
