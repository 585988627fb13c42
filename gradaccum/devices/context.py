"""The tower context: what ``gradaccum.tower.minimize`` tells the layers it builds.

``tower.minimize`` builds ``model_fn`` once per device. While tower ``i`` is
being built, :func:`current` returns a :class:`TowerContext` naming the
tower's index, the devices of all towers, each tower's shard size (the weight
``tower.minimize`` gives the tower's gradients) and a shared
:class:`TowerGroup`. A layer that needs the whole batch (the synchronized
``gradaccum.batch_normalization``) uses it to find its peers in the other
towers: the L-th such layer call of every tower gets the same
:class:`LayerRecord`, holding the collective keys they share and what the
first tower's call left for the others.

Outside ``tower.minimize`` (and in a one-tower ``tower.minimize``, where there
is nobody to synchronise with) layers see ``None`` or a one-tower context and
behave like plain layers.

Between processes, ``gradaccum.collective.synchronized_batch_norm`` enters a
:class:`WorkerScope`; :func:`current_workers` returns it while the layers are
built, so that they sum their statistics over every worker (one tower per
worker: inside the scope a layer refuses a ``tower.minimize`` of several
towers).

Under the collective engine every group key is resolved by one leader for
the whole job, while each worker's towers are a group of their own: a
:class:`TowerGroup` built for worker ``r`` offsets its group key by
``r << 16`` (``tower.minimize`` reads ``r`` from a
``gradaccum.cluster.CollectiveAllReduce`` in its optimizer), so that two
workers' towers never claim the same group.

Variables: none. Collections: ``"gradaccum_collective_keys"``, a graph
collection holding one Python int, the last collective key handed out in
this graph (so that group and instance keys never repeat within a graph);
nothing is added until a synchronized layer asks for a key.
"""
import threading

from gradaccum._compat import tf

COLLECTIVE_KEYS = "gradaccum_collective_keys"
# Far from the small keys tf.distribute hands out, so that both can share a process.
_FIRST_KEY = 1 << 24
# A worker's towers' group key is offset by rank * _WORKER_STRIDE (keys stay int32 up to rank 32511).
_WORKER_STRIDE = 1 << 16

_STATE = threading.local()


def next_collective_key(graph=None):
    """Returns a collective group or instance key not used before in ``graph``.

    Args:
      graph: the graph; the default graph when ``None``.

    Returns:
      A positive Python int.

    Example:
      >>> instance_key = next_collective_key()
    """
    graph = graph or tf.compat.v1.get_default_graph()
    ref = graph.get_collection_ref(COLLECTIVE_KEYS)
    key = (ref[-1] if ref else _FIRST_KEY) + 1
    del ref[:]
    ref.append(key)
    return key


class LayerRecord(object):
    """What the L-th synchronized layer call of every tower shares.

    Attributes:
      keys: dict of collective instance keys, by purpose (``"sum"``, ...).
      first: whatever the first tower's call stored (``None`` until then).
    """

    def __init__(self, graph):
        self._graph = graph
        self.keys = {}
        self.first = None

    def key(self, purpose):
        """The instance key for ``purpose``, the same in every tower.

        Args:
          purpose: a string naming the collective (for example ``"sum"``).

        Returns:
          A Python int.

        Example:
          >>> instance_key = record.key("sum")
        """
        if purpose not in self.keys:
            self.keys[purpose] = next_collective_key(self._graph)
        return self.keys[purpose]


class TowerGroup(object):
    """The towers of one ``tower.minimize`` call.

    Args:
      devices: the towers' device strings, in tower order.
      sizes: each tower's shard size (Python ints or scalar int tensors).
      graph: the graph the towers are built in; the default graph when None.
      worker: this process's rank in a collective job (0 otherwise); it
        offsets the group key, which the job's leader resolves for every
        worker.
      workers: the number of workers in that job (1 otherwise).

    Example:
      >>> group = TowerGroup(["/gpu:0", "/gpu:1"], [64, 63])
    """

    def __init__(self, devices, sizes, graph=None, worker=0, workers=1):
        self.graph = graph or tf.compat.v1.get_default_graph()
        self.devices = list(devices)
        self.sizes = list(sizes)
        self._worker = worker
        self.workers = workers
        self._group_key = None
        self._records = []
        self._calls = [0] * len(self.devices)

    @property
    def group_key(self):
        """The collective group key of these towers' devices (handed out on first use)."""
        if self._group_key is None:
            self._group_key = next_collective_key(self.graph) + self._worker * _WORKER_STRIDE
        return self._group_key

    @property
    def count(self):
        """The number of towers."""
        return len(self.devices)

    @property
    def synchronized(self):
        """Whether a tower built so far made a synchronized layer call (every tower must then run)."""
        return bool(self._records)

    def next_record(self, index, what):
        """The record of tower ``index``'s next synchronized layer call.

        Args:
          index: the tower's index.
          what: a description of the call, for the error message.

        Returns:
          A :class:`LayerRecord`, the same object for the L-th call of every tower.

        Raises:
          ValueError: when a later tower makes more synchronized calls than
            the first (its ``model_fn`` builds another model).

        Example:
          >>> record = group.next_record(0, "batch_normalization")
        """
        call = self._calls[index]
        self._calls[index] += 1
        if call == len(self._records):
            if index:
                raise ValueError(
                    "`model_fn` built more synchronized layers in tower %d than in tower 0 (call %d: %s); "
                    "every tower must build the same model" % (index, call, what))
            self._records.append(LayerRecord(self.graph))
        return self._records[call]


class TowerContext(object):
    """Tower ``index`` of a :class:`TowerGroup`, while its ``model_fn`` runs.

    Attributes:
      group: the :class:`TowerGroup`.
      index: this tower's index (0 for the first tower).

    Example:
      >>> context = current()
      >>> context.index, context.group.count
    """

    def __init__(self, group, index):
        self.group = group
        self.index = index

    @property
    def size(self):
        """This tower's shard size: a Python int or a scalar int tensor."""
        return self.group.sizes[self.index]

    def __enter__(self):
        stack = _stack()
        stack.append(self)
        return self

    def __exit__(self, *exc_info):
        _stack().pop()
        return False


def current():
    """The :class:`TowerContext` of the tower being built, or ``None``.

    Returns:
      The innermost tower context of this thread whose graph is the default
      graph, or ``None`` outside ``tower.minimize``.

    Example:
      >>> context = current()
    """
    stack = _stack()
    if stack and stack[-1].group.graph is tf.compat.v1.get_default_graph():
        return stack[-1]
    return None


class WorkerScope(object):
    """The worker processes whose synchronized layers sum their statistics together.

    A context manager: while it is entered, :func:`current_workers` returns it
    for the graph that was the default one on entry. Built by
    ``gradaccum.collective.synchronized_batch_norm``, which checks the
    arguments.

    Args:
      size: the number of worker processes (1: the scope changes nothing).
      group_key: the collective group key of the workers' CPUs (one device
        per worker).
      device: this worker's CPU, where its collectives run.
      timeout_seconds: None, or the collectives' timeout (TF 2.x only).

    Example:
      >>> with WorkerScope(2, 0x6761, "/job:worker/replica:0/task:1/device:CPU:0"):
      ...     h = gradaccum.batch_normalization(x, training=True)
    """

    def __init__(self, size, group_key, device, timeout_seconds=None):
        self.size = size
        self.group_key = group_key
        self.device = device
        self.timeout_seconds = timeout_seconds
        self.graph = None

    def __enter__(self):
        self.graph = tf.compat.v1.get_default_graph()
        _stack("workers").append(self)
        return self

    def __exit__(self, *exc_info):
        _stack("workers").pop()
        return False


def current_workers():
    """The :class:`WorkerScope` of the default graph with more than one worker, or ``None``.

    Returns:
      The innermost entered scope of this thread whose graph is the default
      graph, when it has more than one worker; otherwise ``None``.

    Example:
      >>> workers = current_workers()
    """
    stack = _stack("workers")
    if stack and stack[-1].graph is tf.compat.v1.get_default_graph() and stack[-1].size > 1:
        return stack[-1]
    return None


def _stack(kind="towers"):
    if not hasattr(_STATE, kind):
        setattr(_STATE, kind, [])
    return getattr(_STATE, kind)
