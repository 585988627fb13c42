"""One task of an in-graph job whose other tasks exit the moment ``cluster.serve`` returns.

Run under ``python -m gradaccum.launch --workers P --ps N -- python
stop_signal_child.py``. The chief places one op on every task, runs it once,
sends the stop signal, closes its session and prints ``closed, missed: [...]``.
Every other task ``os._exit(0)``s as soon as ``serve`` returns, as a task whose
exit is quick does. Before ``serve`` waited for its chief to exit, TensorFlow
1.15's chief hung in its session's close (``LocalMaster::CloseSession``) when a
task it had run ops on exited during that close.
"""
from sharded_child import exit_now, start_tensorflow


def one_op_per_task(tf, cluster, config):
    """The chief's graph: a variable (1.0) on the variables' device, ``square(total + 1)`` on every compute task
    (4.0 each), and a :class:`cluster.StopSignal`; returns ``(parts, stop)``."""
    with tf.device(cluster.variables_device(config)):
        total = tf.compat.v1.get_variable("total", initializer=1.0)
    parts = []
    for device in cluster.worker_devices(config):
        with tf.device(device):
            parts.append(tf.square(total + 1.0))
    return parts, cluster.StopSignal(config)


def main():
    tf = start_tensorflow()
    from gradaccum import cluster

    config = cluster.from_environment()
    server = cluster.start_server(config)
    if not config.is_chief:
        cluster.serve(server, config, poll_seconds=0.1)
        exit_now(0)
    cluster.wait_for_tasks(config, timeout_seconds=60, poll_seconds=0.1)
    with tf.Graph().as_default():
        parts, stop = one_op_per_task(tf, cluster, config)
        with tf.compat.v1.Session(server.target, config=cluster.session_config(config)) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            print("parts %s" % [float(part) for part in sess.run(parts)])
            missed = stop.send(sess)
    print("closed, missed: %s" % missed)
    exit_now(0)


if __name__ == "__main__":
    main()
