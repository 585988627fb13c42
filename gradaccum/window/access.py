"""``WindowAccess``: a ``GradientAccumulator``'s window state, read after building.

The accumulator builds one window per train op (``gradaccum.window.pipeline``); this
base class answers for the one in the current graph: its counters, caches,
manual ops and size. It creates no variables and adds nothing to any
collection.
"""
from gradaccum._compat import tf
from gradaccum.window.statistics import GradientStatistics

_K1 = "with num_micro_batches=1 it keeps no window (no cache, no counter); run its train op"
_MISSING = {
    "skipped_windows": "nothing can skip a window here (k = 1 without `weight`, `skip_nonfinite`, "
                       "a reducer or statistics)",
    "statistics": "create it with GradientAccumulator(..., statistics=True)",
}


class WindowAccess(object):
    """The window state of a ``GradientAccumulator``, after ``minimize``/``apply_gradients``.

    Each property reads the window of the one train op built in the current
    graph; with several, take the one you mean from :attr:`windows`. Under a
    ``tf.distribute`` strategy one train op has a window per replica, all
    moving alike: the properties read the first replica's of this process.

    Example:
      >>> train_op = opt.minimize(loss)
      >>> sess.run(opt.micro_step)
    """

    _windows = ()

    @property
    def windows(self):
        """The ``Window`` of every train op built, in build order (all graphs)."""
        return list(self._windows)

    @property
    def window_size(self):
        """int64 scalar tensor: the micro-batches to feed for the window in progress,
        or for the next one when none is (a constant for an int k)."""
        return self._window_field("size")

    @property
    def window_ended(self):
        """bool scalar tensor: True when no window is in progress, so after a train-op
        run, True when that run applied its window (or skipped it: see
        :attr:`skipped_windows`)."""
        return self._window_field("ended")

    @property
    def accumulate_op(self):
        """Adds the current micro-batch's gradients; never applies (manual pattern)."""
        return self._window_field("accumulate_op")

    @property
    def apply_op(self):
        """Applies ``cache / weight_sum`` whatever the count, increments
        ``global_step`` and resets. Needs no feed; never recomputes gradients.
        A window whose weight is zero is skipped and counted instead."""
        return self._window_field("apply_op")

    @property
    def zero_op(self):
        """Resets the caches, ``micro_step`` and ``weight_sum`` without applying."""
        return self._window_field("zero_op")

    @property
    def micro_step(self):
        """int64 variable: micro-batches added since the last apply or reset."""
        return self._window_field("micro_step")

    @property
    def weight_sum(self):
        """tf.Variable: the weight added since the last apply or reset."""
        return self._window_field("weight_sum")

    @property
    def skipped_windows(self):
        """int64 variable: windows not applied because their total weight was zero
        or their sum was not finite (``skip_nonfinite``, or a wrapped loss-scale
        optimizer's overflow)."""
        return self._window_field("skipped_windows")

    @property
    def accumulators(self):
        """The cache variables, one per variable with a gradient (none with k = 1)."""
        return list(self._single_window().accumulators)

    @property
    def statistics(self):
        """The window's ``gradaccum.statistics.GradientStatistics`` (``statistics=True``)."""
        found = [o for o in self._single_window().observers if isinstance(o, GradientStatistics)]
        if not found:
            self._missing("statistics")
        return found[0]

    @property
    def state_variables(self):
        """This accumulator's own variables in the current graph, sorted by name.

        Every window's caches, row flags, counters, statistics and policy:
        what ``variables()`` adds to the wrapped optimizer's. They are in
        ``GLOBAL_VARIABLES``, so ``Saver()`` and
        ``global_variables_initializer()`` include them; code that initialises
        or saves only ``opt.optimizer.variables()`` must add these.
        """
        graph = tf.compat.v1.get_default_graph()
        return sorted((v for v in self._own_variables() if v.graph is graph), key=lambda v: v.name)

    def _own_variables(self):
        found, seen = [], set()
        for window in self._windows:
            for var in window.state_variables():
                if id(var) not in seen:  # A policy or an observer given serves every window.
                    seen.add(id(var))
                    found.append(var)
        return found

    def _single_window(self):
        if not self._windows:
            raise ValueError("GradientAccumulator %r has no train op yet: call `minimize` or "
                             "`apply_gradients` first" % self.get_name())
        graph = tf.compat.v1.get_default_graph()
        found = [w for w in self._windows if w.train_op.graph is graph] or self._windows
        # Under a strategy every replica's window moves alike: the first replica's answers.
        found = [w for w in found if not getattr(w, "replica", None)]
        if len(found) > 1:
            raise ValueError("GradientAccumulator %r built %d train ops, each with its own window: "
                             "take the one you mean from `windows`" % (self.get_name(), len(found)))
        return found[0]

    def _window_field(self, field):
        value = getattr(self._single_window(), field)
        if value is None:
            self._missing(field)
        return value

    def _missing(self, field):
        why = _MISSING.get(field) or self._single_window().no_state or _K1
        raise ValueError("GradientAccumulator %r has no `%s`: %s" % (self.get_name(), field, why))
