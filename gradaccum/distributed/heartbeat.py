"""Liveness: :class:`Heartbeat` bounds the wait for a peer task that stopped answering.

A session blocked in an all-reduce or a remote step cannot be interrupted
from Python, so a peer silent for ``timeout_seconds`` (SIGKILL, SIGSTOP, a
lost host) ends this process with one line. Both engines use it;
:mod:`gradaccum.cluster` re-exports it, where users look for it.

This module creates no variables and adds nothing to graph collections; a
:class:`Heartbeat` builds its probe ops in graphs of its own.
"""
import os
import sys
import threading
import time

from gradaccum import _validate
from gradaccum._compat import tf
from gradaccum.distributed import tfconfig

HEARTBEAT_EXIT_STATUS = 75
DEFAULT_HEARTBEAT_SECONDS = 30.0


def _task_address(config, task):
    return config.cluster[task[0]][task[1]]


def _exit_with_message(message):
    """The default failure action: one line on stderr, then exit at once.

    The main thread may be blocked inside ``session.run`` (an all-reduce, a
    remote step), which neither a Python exception nor ``Session.close`` can
    interrupt (both tried on TF 1.15 and 2.21): only leaving the process does.
    """
    sys.stderr.write("gradaccum: %s\n" % message)
    sys.stderr.flush()
    os._exit(HEARTBEAT_EXIT_STATUS)


class Heartbeat(object):
    """Fails this process within a bound when a peer task stops answering.

    One thread per peer runs a tiny op (``tf.timestamp``) on that peer every
    ``interval_seconds``, in a session of its own on this task's server; a
    checker thread calls ``on_failure`` with one line when a peer has not
    answered for ``timeout_seconds`` (a killed peer, a stopped one, a lost
    host). Its last answer came before it went silent, so this process ends
    at most ``timeout_seconds + 1`` s after the peer stopped (31 s by
    default), even inside an all-reduce. A slow peer that still answers is
    not a failure. Before a peer's first answer, it has
    ``startup_timeout_seconds`` to come up.

    Args:
      server: this task's server from :func:`start_server`.
      config: a :class:`ClusterConfig`.
      peers: ``(job, index)`` pairs to watch; default every other task.
      timeout_seconds: how long a peer may stay silent, a number > 0
        (default 30).
      interval_seconds: pause between probes; default ``timeout_seconds / 6``
        clipped to [0.5, 10].
      startup_timeout_seconds: how long a peer may take to answer first.
      on_failure: called once with the message; default: print
        ``gradaccum: <message>`` on stderr and ``os._exit(75)``.

    Attributes:
      started: ``time.time()`` of :meth:`start`, or None before it.
      failure: None, or the one-line message passed to ``on_failure``.

    Raises:
      TypeError: for a timeout that is not a number.
      ValueError: for a bad timeout, a peer that is not a task of the cluster,
        or an evaluator's ``config``.

    Example:
      >>> with cluster.Heartbeat(server, config, timeout_seconds=30):
      ...     train(sess)
    """

    def __init__(self, server, config, peers=None, timeout_seconds=DEFAULT_HEARTBEAT_SECONDS, interval_seconds=None,
                 startup_timeout_seconds=300.0, on_failure=None):
        self._timeout = _validate.check_seconds(timeout_seconds, "timeout_seconds")
        self._startup = _validate.check_seconds(startup_timeout_seconds, "startup_timeout_seconds")
        interval = min(max(self._timeout / 6.0, 0.5), 10.0) if interval_seconds is None else interval_seconds
        self._interval = _validate.check_seconds(interval, "interval_seconds")
        if getattr(config, "is_evaluator", False):
            raise ValueError("`config` must be a training task's (an evaluator has no server and no peers), got %s"
                             % config.task_name)
        everyone = tfconfig.tasks(config.cluster)
        me = (config.task_type, config.task_index)
        self._peers = [t for t in everyone if t != me] if peers is None else [tuple(p) for p in peers]
        for peer in self._peers:
            if peer not in everyone or peer == me:
                raise ValueError("`peers` must name other tasks of the cluster as (job, index), got %s"
                                 % _validate.describe(peer))
        self._server, self._config = server, config
        self._on_failure = _exit_with_message if on_failure is None else on_failure
        self._answered = {}
        self._errors = {}
        self._stop = threading.Event()
        self._threads = []
        self.failure = None
        self.started = None

    def start(self):
        """Starts the probe and checker threads (daemons); sets ``started``; returns ``self``."""
        self.started = time.time()
        targets = [(self._probe, (peer,)) for peer in self._peers] + [(self._check, ())]
        for target, args in targets:
            thread = threading.Thread(target=target, args=args, name="gradaccum-heartbeat")
            thread.daemon = True
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, wait_seconds=5.0):
        """Stops watching; waits up to ``wait_seconds`` for the threads to end.

        Threads still inside TensorFlow when the interpreter exits abort it
        (``FATAL: exception not rethrown``), so a normal end waits for them; a
        probe stuck on a silent peer is abandoned after ``wait_seconds``.
        """
        self._stop.set()
        deadline = time.time() + wait_seconds
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.time()))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc_info):
        self.stop()

    def _probe(self, peer):
        job, index = peer
        proto = tf.compat.v1.ConfigProto(device_filters=[
            "/job:%s/task:%d" % (self._config.task_type, self._config.task_index), "/job:%s/task:%d" % peer])
        options = tf.compat.v1.RunOptions(timeout_in_ms=int(self._timeout * 1000))
        with tf.Graph().as_default() as graph:
            with tf.device("/job:%s/replica:0/task:%d/cpu:0" % (job, index)):
                stamp = tf.timestamp()  # Stateful: never folded away, so it runs on the peer.
        session = None
        try:
            while not self._stop.is_set():
                try:
                    session = session or tf.compat.v1.Session(self._server.target, graph=graph, config=proto)
                    session.run(stamp, options=options)
                    self._answered[peer] = time.time()
                except tf.errors.OpError as exc:
                    self._errors[peer] = "%s: %s" % (type(exc).__name__, exc.message.splitlines()[0][:160])
                self._stop.wait(self._interval)
        finally:
            if session is not None:
                session.close()

    def _silent_peer(self, now):
        for peer in self._peers:
            last = self._answered.get(peer)
            if last is None and now - self.started > self._startup:
                return peer, "did not answer within the startup timeout of %g s" % self._startup
            if last is not None and now - last > self._timeout:
                return peer, "has not answered for %.0f s (heartbeat timeout %g s)" % (now - last, self._timeout)
        return None, None

    def _check(self):
        while not self._stop.wait(min(self._interval, 1.0)):
            peer, what = self._silent_peer(time.time())
            if peer is not None:
                error = self._errors.get(peer)
                self.failure = "%s: %s:%d at %s %s%s; stopping" % (
                    self._config.task_name, peer[0], peer[1], _task_address(self._config, peer), what,
                    " (last error: %s)" % error if error else "")
                self._stop.set()
                self._on_failure(self.failure)
                return


# Its public home, where the API reference documents it and users import it.
Heartbeat.__module__ = "gradaccum.cluster"
