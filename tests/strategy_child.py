"""One worker of the multi-process strategy tests: the accumulator under MultiWorkerMirroredStrategy.

Run with ``TF_CONFIG`` naming the task (two workers on loopback, one
replica each); :func:`run_workers` starts both and waits. ``--frontend``
picks what drives the strategy:

* ``session`` (test_strategy's test): test_strategy's model and
  ``GradientAccumulator(opt, K)`` in ``--form`` (``test_strategy.train_op``)
  in ``strategy.run`` (or ``experimental_run_v2``, or ``--runner
  call_for_each_replica``) in a ``tf.compat.v1.Session`` on the worker's
  server, fed the worker's own micro-batches (test_strategy's replica
  ``index``) for ``UPDATES`` updates. It also records, per run of the
  second update (the first run of all also syncs the workers, once), how
  many collective ops executed. It writes the
  variables, Adam's slots, ``global_step`` and the trace into
  ``<OUT>-worker<index>.npz``.
* ``estimator`` (test_strategy_frontends): its Estimator ``model_fn`` with
  ``RunConfig(train_distribute=MultiWorkerMirroredStrategy())``, trained by
  ``tf.estimator.train_and_evaluate`` (TensorFlow's way to train an
  Estimator on several workers). The worker's ``input_fn`` yields its own
  micro-batches: worker w takes micro-batches w, w + 2, w + 4, ..., as
  replica w of a two-device MirroredStrategy would. The chief writes its
  checkpoints into ``--model-dir``; the parent reads them.
* ``keras``: test_strategy_frontends' Keras model compiled under the strategy
  and ``fit`` on the same arrays on every worker, ``batch_size`` one run's
  global batch; TF's Keras gives each worker its share. Keras makes the
  session inside ``fit``, so a callback initialises the global step there.
  It writes every variable, by the reference's names, into
  ``<OUT>-worker<index>.npz``.
"""
import argparse
import json
import os

import numpy as np

import sharded_child

FRONTENDS = ("session", "estimator", "keras")


def run_workers(args, timeout=180):
    """Runs this program as the 2 workers of a loopback cluster with ``args`` (test_sharded's job runner);
    asserts that both exit 0."""
    from test_sharded import _run_job

    results = _run_job(2, list(args), timeout, child_script=os.path.abspath(__file__))
    assert [status for status, _, _ in results] == [0, 0], [err[-3000:] for _, _, err in results]


def _strategy(tf):
    v1 = getattr(tf.compat.v1.distribute.experimental, "MultiWorkerMirroredStrategy", None)
    return (v1 or tf.distribute.experimental.MultiWorkerMirroredStrategy)()


def _collectives(run_metadata):
    return sum(1 for device in run_metadata.step_stats.dev_stats for node in device.node_stats
               if node.timeline_label.split(" = ")[-1].startswith("Collective"))


def _session(tf, strategy, index, args):
    import gradaccum
    import test_strategy as shared

    config = strategy.update_config_proto(tf.compat.v1.ConfigProto())
    server = tf.distribute.Server(tf.train.ClusterSpec(json.loads(os.environ["TF_CONFIG"])["cluster"]),
                                  job_name="worker", task_index=index, config=config)
    with tf.Graph().as_default() as graph:
        x = tf.compat.v1.placeholder(tf.float64, [None, 3])
        y = tf.compat.v1.placeholder(tf.float64, [None, 1])
        built = {}
        with strategy.scope():
            step = tf.compat.v1.train.get_or_create_global_step()
            opt = gradaccum.GradientAccumulator(shared.OPTIMIZERS[args.optimizer](), shared.K)

            def loss_of(x, y):  # The strategy sums the replicas' gradients.
                built["variables"], loss = shared._model(x, y)
                return loss / float(strategy.num_replicas_in_sync)

            def replica_step():
                return shared.train_op(args.form, opt, step, loss_of, x, y)

            run = getattr(strategy, "run", None) or strategy.experimental_run_v2
            run = strategy.extended.call_for_each_replica if args.runner == "call_for_each_replica" else run
            train = strategy.group(run(replica_step))
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(server.target, graph=graph, config=config) as sess:
        sess.run(init)
        traced = [_train(tf, sess, train, feed, update == 1) for update, batches in enumerate(shared._data())
                  for feed in _feeds(batches[index * shared.K:(index + 1) * shared.K], x, y, args.form)]
        values = shared._fetch_state(sess, opt, built["variables"], step)
    np.savez("%s-worker%d.npz" % (args.out, index), trace=np.array([n for n in traced if n is not None]),
             **{"state_%d" % i: value for i, value in enumerate(values)})


def _feeds(mine, x, y, form):
    """This worker's feeds of one update: a run per micro-batch, or (subdivisions) its whole window."""
    if form == "subdivisions":
        return [{x: np.concatenate([b[0] for b in mine]), y: np.concatenate([b[1] for b in mine])}]
    return [{x: b[0], y: b[1]} for b in mine]


def _train(tf, sess, train, feed, traced):
    """Runs ``train``; ``traced``: returns how many collective ops executed (else ``None``)."""
    if not traced:
        sess.run(train, feed)
        return None
    metadata = tf.compat.v1.RunMetadata()
    options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
    sess.run(train, feed, options=options, run_metadata=metadata)
    return _collectives(metadata)


def _estimator(tf, strategy, index, args):
    import test_strategy_frontends as shared

    def input_fn():  # This worker's micro-batches: its replica's share of each run.
        x, y = tf.constant(shared.X), tf.constant(shared.Y)
        data = tf.compat.v1.data.Dataset.from_tensor_slices((shared.STARTS[index::2], np.asarray(shared.SIZES)[index::2]))
        return data.map(lambda start, size: (x[start:start + size], y[start:start + size])).repeat()

    estimator = tf.estimator
    config = estimator.RunConfig(model_dir=args.model_dir, tf_random_seed=0, train_distribute=strategy,
                                 log_step_count_steps=10 ** 6, save_summary_steps=10 ** 6)
    k = shared.R * shared.K // strategy.num_replicas_in_sync
    est = estimator.Estimator(shared._estimator_model_fn(args.optimizer, k, "minimize"), config=config)
    estimator.train_and_evaluate(est, estimator.TrainSpec(input_fn, max_steps=shared.UPDATES),
                                 estimator.EvalSpec(input_fn, steps=1))


def _keras(tf, strategy, index, args):
    import gradaccum
    import test_strategy_frontends as shared

    keras = shared._keras()
    keras.backend.set_floatx("float64")
    run_batch = 4  # One run's global batch: 2 examples per worker.
    with strategy.scope():
        step = tf.compat.v1.train.get_or_create_global_step()
        model = keras.Sequential([
            shared._dense(keras, "hidden", "w1", "b1", activation="tanh", input_shape=(3,)),
            shared._dense(keras, "out", "w2", "b2")])
        opt = gradaccum.GradientAccumulator(shared.OPTIMIZERS[args.optimizer](), shared.KERAS_GLOBAL // run_batch)
        model.compile(optimizer=opt, loss="mse")

    class InitialiseStep(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):  # Keras initialises only its own variables and the optimizer's.
            tf.compat.v1.keras.backend.get_session().run(tf.compat.v1.variables_initializer([step]))

    rows = slice(0, shared.UPDATES * shared.KERAS_GLOBAL)
    model.fit(shared.X[rows], shared.Y[rows], batch_size=run_batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[InitialiseStep()])
    variables = {shared._reference_name(var.op.name): var for var in tf.compat.v1.global_variables()}
    variables.pop(None, None)
    values = tf.compat.v1.keras.backend.get_session().run(variables)
    np.savez("%s-worker%d.npz" % (args.out, index), **{name.replace("/", "|"): v for name, v in values.items()})


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--frontend", choices=FRONTENDS, default="session")
    parser.add_argument("--optimizer", default="adam", help="sgd or adam")
    parser.add_argument("--form", default="minimize", help="session: a test_strategy.train_op form")
    parser.add_argument("--runner", default="run", choices=("run", "call_for_each_replica"), help="session")
    parser.add_argument("--out", help="session and keras: the prefix of each worker's .npz")
    parser.add_argument("--model-dir", help="estimator: the job's model_dir")
    args = parser.parse_args(argv)
    tf = sharded_child.start_tensorflow()
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    strategy = _strategy(tf)
    {"session": _session, "estimator": _estimator, "keras": _keras}[args.frontend](tf, strategy, index, args)
    return 0


if __name__ == "__main__":
    sharded_child.exit_now(main())
