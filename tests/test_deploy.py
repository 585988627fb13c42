"""Deploying: TFJob's TF_CONFIG, Slurm's srun variables, mpirun; all from docs/guides/deploying.md.

The guide's TFJob manifest, sbatch script, Horovod script and mpirun line are
read here, and the environments of the multi-process runs are derived from
them, so that the guide and the tests cannot drift apart. Each run is on
loopback, bounded in time, and compared with the single-process run of its
script by the trained weights: ``examples/workers.py`` on a tiny Fashion-MNIST
written here for the TFJob, ``examples/parabola_sync.py`` for the others. The
mpirun test skips where Horovod with MPI or ``mpirun`` is missing, and fails
instead when ``GRADACCUM_REQUIRE_HOROVOD_MPI`` is set (CI, after installing
them).
"""
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
import tensorflow as tf

from gradaccum import cluster, launch
import forkserver
from test_distributed import _program_of

pytestmark = pytest.mark.timeout(60)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GUIDE = os.path.join(_ROOT, "docs", "guides", "deploying.md")
_WEIGHTS = ["hidden__weights", "hidden__biases", "output__weights", "output__biases"]
_STEPS = 150
_RUN_SECONDS = 150
# A C++ log line of TensorFlow >= 2.16 (absl's format): "E0000 00:00:1796597403.270500   32192 file.cc:52] ...".
_CPP_LOG_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\] ")


def _own_lines(output):
    """A task's lines without TensorFlow's C++ log lines.

    Forked from the fork server's TensorFlow import, a task may log "E0000 ... failed call to cuInit" as its
    first session starts, which the same program run as a fresh Python does not print.
    """
    return [line for line in output.splitlines() if not _CPP_LOG_LINE.match(line)]


# examples/workers.py's flags for the TFJob run: 3 updates of 60 examples, 6 micro-batches of 10 (2 per task).
_WORKERS_FLAGS = {"--updates": "3", "--batch-size": "60", "--subdivisions": "6", "--hidden": "8"}


# --- Reading the guide --------------------------------------------------------------------------------------


def _blocks(language):
    """The guide's fenced blocks in ``language``, in order."""
    with open(_GUIDE, encoding="utf-8") as handle:
        text = handle.read()
    return [textwrap.dedent(code) for code in re.findall(r"^```%s\n(.*?)^```$" % language, text, re.M | re.S)]


def _manifest_documents():
    (manifest,) = _blocks("yaml")
    return manifest.split("\n---\n")


def _document(kind):
    (found,) = [doc for doc in _manifest_documents() if re.search(r"^kind: %s$" % kind, doc, re.M)]
    return found


def _tfjob():
    """``(name, {replica type: (replicas, command list)}, port)`` of the guide's TFJob.

    Read with a few patterns of the manifest's layout (PyYAML is not there on
    every TensorFlow this suite runs on); ``test_the_manifest_reader_agrees_with_yaml``
    checks them against a YAML parser.
    """
    doc = _document("TFJob")
    name = re.search(r"^metadata:\n  name: (\S+)$", doc, re.M).group(1)
    replicas = {}
    for match in re.finditer(r"^    (\w+):\n      replicas: (\d+)\n(.*?)(?=^    \w+:\n|\Z)", doc, re.M | re.S):
        # A flow sequence, on one line or several.
        command = json.loads(re.search(r"^ +command: (\[[^\]]*\])$", match.group(3), re.M).group(1))
        replicas[match.group(1)] = (int(match.group(2)), command)
    ports = set(re.findall(r"containerPort: (\d+)", doc))
    assert len(ports) == 1, ports
    return name, replicas, int(ports.pop())


def _configmap_file(filename):
    doc = _document("ConfigMap")
    lines = doc.split("\n")
    start = lines.index("  %s: |" % filename) + 1
    body = []
    for line in lines[start:]:
        if line.strip() and not line.startswith("    "):
            break
        body.append(line[4:])
    return "\n".join(body).rstrip() + "\n"


def _sbatch():
    """``(#SBATCH options dict, exported variables dict, srun command list)`` of the guide's script."""
    (script,) = [code for code in _blocks("bash") if "#SBATCH" in code]
    options = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", script, re.M))
    exported = dict(re.findall(r"^export (\w+)=(\S+)$", script, re.M))
    lines = script.replace("\\\n", " ").splitlines()  # Continued lines joined, as bash reads them.
    (srun,) = [shlex.split(line) for line in lines if line.startswith("srun ")]
    command = srun[next(i for i, word in enumerate(srun) if word == "python"):]
    return options, exported, command


def _with_flag(command, flag, value):
    """``command`` with the value after ``flag`` replaced (the flag must be there)."""
    index = command.index(flag)
    return command[:index + 1] + [value] + command[index + 2:]


def _local_command(command, steps, checkpoint_dir=None, out=None):
    """A guide's ``python examples/...`` command, run with this Python from the repository's root."""
    assert command[0] == "python"
    command = forkserver.command() + [os.path.join(_ROOT, command[1])] + command[2:]
    command = _with_flag(command, "--steps", str(steps))
    if checkpoint_dir is not None:
        command = _with_flag(command, "--checkpoint-dir", checkpoint_dir)
    return command + (["--out", out] if out else [])


# --- TFJob's TF_CONFIG --------------------------------------------------------------------------------------


def _operator_tf_config(name, replicas, port, task_type, index, address=None, namespace="default"):
    """The ``TF_CONFIG`` Kubeflow's training operator writes (the evaluator is left out of the cluster).

    ``address(job, i)``: the host:port to write instead of the operator's DNS name.
    """
    address = address or (lambda job, i: "%s-%s-%d.%s.svc:%d" % (name, job, i, namespace, port))
    spec = {kind.lower(): [address(kind.lower(), i) for i in range(count)]
            for kind, (count, _) in replicas.items() if kind != "Evaluator"}
    return json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}, "environment": "cloud"})


def test_the_guide_has_a_chief_two_workers_and_an_evaluator_and_a_network_policy():
    name, replicas, port = _tfjob()
    assert {kind: count for kind, (count, _) in replicas.items()} == {"Chief": 1, "Worker": 2, "Evaluator": 1}
    command = replicas["Chief"][1]
    assert command == replicas["Worker"][1] and command[:2] == ["python", "examples/workers.py"]
    # The evaluator reads the volume the chief saves to, and stops after the last update's checkpoint.
    evaluator = replicas["Evaluator"][1]
    assert evaluator[:2] == ["python", "/evaluator/evaluate.py"]
    assert os.path.dirname(command[command.index("--save") + 1]) == evaluator[2] == "/ckpt"
    assert evaluator[3] == command[command.index("--updates") + 1]
    updates, batch, subdivisions = [int(command[command.index(flag) + 1])
                                    for flag in ("--updates", "--batch-size", "--subdivisions")]
    assert subdivisions % 3 == 0 and batch % subdivisions == 0 and updates * batch <= 60000
    policy = _document("NetworkPolicy")
    assert policy.count("training.kubeflow.org/job-name: %s" % name) == 2 and "- port: %d" % port in policy


def test_the_manifest_reader_agrees_with_yaml():
    yaml = pytest.importorskip("yaml", reason="PyYAML is not installed with this TensorFlow")
    documents = {doc["kind"]: doc for doc in yaml.safe_load_all("\n---\n".join(_manifest_documents()))}
    name, replicas, port = _tfjob()
    tfjob = documents["TFJob"]
    assert tfjob["metadata"]["name"] == name
    specs = tfjob["spec"]["tfReplicaSpecs"]
    assert {kind: (spec["replicas"], spec["template"]["spec"]["containers"][0]["command"])
            for kind, spec in specs.items()} == replicas
    assert all(spec["template"]["spec"]["containers"][0]["name"] == "tensorflow" for spec in specs.values())
    assert documents["ConfigMap"]["data"]["evaluate.py"] == _configmap_file("evaluate.py")
    assert documents["NetworkPolicy"]["spec"]["ingress"][0]["ports"] == [{"port": port}]


def test_tfjob_tf_config_parses_for_every_replica_with_hosts_as_written():
    name, replicas, port = _tfjob()
    chief = cluster.parse_tf_config(_operator_tf_config(name, replicas, port, "chief", 0))
    assert chief.is_chief and not chief.is_evaluator
    assert chief.address == "%s-chief-0.default.svc:2222" % name
    assert chief.compute_tasks == [("chief", 0), ("worker", 0), ("worker", 1)]
    worker = cluster.parse_tf_config(_operator_tf_config(name, replicas, port, "worker", 1))
    assert (worker.task_name, worker.address) == ("worker:1", "%s-worker-1.default.svc:2222" % name)
    evaluator = cluster.parse_tf_config(_operator_tf_config(name, replicas, port, "evaluator", 0))
    assert (evaluator.is_evaluator, evaluator.is_chief, evaluator.address) == (True, False, None)
    assert evaluator.cluster == chief.cluster and evaluator.task_name == "evaluator:0"
    assert ("evaluator", 0) not in evaluator.compute_tasks
    hosts = ["w-0.ns.svc.cluster.local:2222", "10.1.2.3:2222", "[fd00::2]:2222", "my_host-1:2222"]
    assert cluster.parse_tf_config(cluster.make_tf_config({"worker": hosts}, "worker", 3)).address == hosts[3]


def test_master_is_read_as_the_chief_and_an_evaluator_job_is_dropped():
    text = json.dumps({"cluster": {"master": ["m:1"], "worker": ["w:1"], "evaluator": ["e:1"]},
                       "task": {"type": "master", "index": 0}, "environment": "cloud"})
    config = cluster.parse_tf_config(text)
    assert (config.cluster, config.task_name, config.is_chief) == ({"chief": ["m:1"], "worker": ["w:1"]},
                                                                   "chief:0", True)
    assert cluster.worker_devices(config) == ["/job:chief/task:0/cpu:0", "/job:worker/task:0/cpu:0"]


def test_sparse_cluster_is_one_error_that_says_what_to_use():
    text = json.dumps({"sparseCluster": {"worker": {"1": "w-1:2222"}}, "task": {"type": "worker", "index": 1}})
    with pytest.raises(ValueError) as info:
        cluster.from_environment({"TF_CONFIG": text})
    assert str(info.value) == (
        "`TF_CONFIG` has \"sparseCluster\" (TFJob's dynamic workers), but synchronous training needs every task "
        "to know all others: leave `enableDynamicWorker` unset in the TFJob, so that it writes \"cluster\", "
        "got ['sparseCluster', 'task']")


def test_an_evaluator_starts_no_server_and_is_watched_by_no_one():
    spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]}
    evaluator = cluster.parse_tf_config(json.dumps({"cluster": spec, "task": {"type": "evaluator", "index": 0}}))
    with pytest.raises(ValueError, match=r"^`config` must be a training task's: an evaluator runs no server, "
                                         r"got evaluator:0$"):
        cluster.start_server(evaluator)
    with pytest.raises(ValueError, match=r"^`config` must be a non-chief task's, got the evaluator evaluator:0$"):
        cluster.serve(None, evaluator)
    with pytest.raises(ValueError, match=r"an evaluator has no server and no peers\), got evaluator:0$"):
        cluster.Heartbeat(None, evaluator)
    with pytest.raises(ValueError, match=r"must be a chief or worker task's"):
        cluster.collective_session_config(evaluator)
    chief = cluster.parse_tf_config(cluster.make_tf_config(spec, "chief", 0))
    with pytest.raises(ValueError, match=r"^`peers` must name other tasks of the cluster as \(job, index\), "
                                         r"got \('evaluator', 0\)$"):
        cluster.Heartbeat(None, chief, peers=[("evaluator", 0)])


# --- Slurm ----------------------------------------------------------------------------------------------------


_FAKE_SCONTROL = textwrap.dedent("""\
    #!/bin/sh
    # Slurm's scontrol, as far as `scontrol show hostnames LIST` goes: prints $FAKE_HOSTS, one per line.
    echo "$@" >> "$(dirname "$0")/calls"
    [ "$1 $2" = "show hostnames" ] || exit 2
    [ -n "$FAKE_HOSTS" ] || { echo "scontrol: error: invalid hostlist $3" >&2; exit 1; }
    for host in $FAKE_HOSTS; do echo "$host"; done
""")


@pytest.fixture
def scontrol_dir(tmp_path):
    """A directory holding a fake ``scontrol``; its calls are appended to ``calls`` there."""
    folder = tmp_path / "bin"
    folder.mkdir()
    script = folder / "scontrol"
    script.write_text(_FAKE_SCONTROL)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return folder


def _slurm_env(folder, procid, ntasks=4, per_node="2(x2)", hosts="n1 n2", **extra):
    env = {"PATH": "%s%s%s" % (folder, os.pathsep, os.environ["PATH"]), "FAKE_HOSTS": hosts,
           "SLURM_PROCID": str(procid), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_TASKS": str(ntasks),
           "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_TASKS_PER_NODE": per_node}
    env.update(extra)
    return env


def test_slurm_tasks_are_workers_in_procid_order_with_ports_by_local_id(scontrol_dir):
    configs = [cluster.from_environment(_slurm_env(scontrol_dir, rank, SLURM_LOCALID=str(rank % 2),
                                                   SLURM_NODEID=str(rank // 2), GRADACCUM_PORT_BASE="7000"))
               for rank in range(4)]
    assert configs[0].cluster == {"worker": ["n1:7000", "n1:7001", "n2:7000", "n2:7001"]}
    assert [c.task_name for c in configs] == ["worker:0", "worker:1", "worker:2", "worker:3"]
    assert configs[0].is_chief and not configs[3].is_chief
    assert (scontrol_dir / "calls").read_text() == "show hostnames n[1-2]\n" * 4
    uneven = cluster.from_environment(_slurm_env(scontrol_dir, 3, per_node="3,1"))
    assert uneven.cluster == {"worker": ["n1:8888", "n1:8889", "n1:8890", "n2:8888"]}  # The default base.


def test_no_cluster_without_tf_config_or_slurm_and_for_one_slurm_task(scontrol_dir):
    assert cluster.from_environment({}) is None
    assert cluster.from_environment({"SLURM_PROCID": "0"}) is None  # Not under srun: no SLURM_NTASKS.
    assert cluster.from_environment(_slurm_env(scontrol_dir, 0, ntasks=1, per_node="1", hosts="n1")) is None
    # TF_CONFIG comes first.
    config = cluster.from_environment(dict(_slurm_env(scontrol_dir, 1), TF_CONFIG=cluster.make_tf_config(
        {"worker": ["a:1", "b:1"]}, "worker", 0)))
    assert config.task_name == "worker:0" and not (scontrol_dir / "calls").exists()


@pytest.mark.parametrize("changes, message", [
    (dict(SLURM_PROCID="x"), "`SLURM_PROCID` must be an int >= 0, got 'x'"),
    (dict(SLURM_NTASKS="0"), "`SLURM_NTASKS` must be an int >= 1, got '0'"),
    (dict(SLURM_PROCID="4"), "`SLURM_PROCID` must be < SLURM_NTASKS (4), got '4'"),
    (dict(SLURM_STEP_NUM_TASKS="3"), "`SLURM_STEP_NUM_TASKS` must equal SLURM_NTASKS (4), got '3'"),
    (dict(SLURM_STEP_NODELIST=""), "`SLURM_STEP_NODELIST` must be set (it is, in every task srun starts: run the "
                                   "job's tasks with srun), got ''"),
    (dict(SLURM_STEP_TASKS_PER_NODE="2(x)"), "`SLURM_STEP_TASKS_PER_NODE` must look like \"2(x3),1\" (tasks per "
                                             "node, in node order), got '2(x)'"),
    (dict(SLURM_STEP_TASKS_PER_NODE="2,1"), "`SLURM_STEP_TASKS_PER_NODE` must add up to SLURM_NTASKS (4), got '2,1'"),
    (dict(FAKE_HOSTS="n1 n2 n3"), "`SLURM_STEP_TASKS_PER_NODE` must give one count per node of SLURM_STEP_NODELIST "
                                  "'n[1-2]' (3: n1 n2 n3), got '2(x2)'"),
    (dict(SLURM_LOCALID="0"), "`SLURM_LOCALID` must be 1 for SLURM_PROCID 1 with SLURM_STEP_TASKS_PER_NODE '2(x2)': "
                              "the tasks must be laid out in blocks (srun --distribution=block, the default), got '0'"),
    (dict(SLURM_NODEID="1"), "`SLURM_NODEID` must be 0 for SLURM_PROCID 1 with SLURM_STEP_TASKS_PER_NODE '2(x2)': "
                             "the tasks must be laid out in blocks (srun --distribution=block, the default), got '1'"),
    (dict(GRADACCUM_PORT_BASE="65535"), "`GRADACCUM_PORT_BASE` must be a port in 1..65534 (task SLURM_LOCALID of a "
                                        "node listens on base + SLURM_LOCALID), got '65535'"),
    (dict(GRADACCUM_PORT_BASE="http"), "`GRADACCUM_PORT_BASE` must be a port in 1..65534 (task SLURM_LOCALID of a "
                                       "node listens on base + SLURM_LOCALID), got 'http'"),
])
def test_bad_slurm_variables_are_one_line_naming_the_variable(scontrol_dir, changes, message):
    with pytest.raises(ValueError) as info:
        cluster.from_environment(_slurm_env(scontrol_dir, 1, **changes))
    assert str(info.value) == message


def test_a_missing_or_failing_scontrol_is_one_line(scontrol_dir, tmp_path):
    env = _slurm_env(scontrol_dir, 1, PATH=str(tmp_path))  # No scontrol there.
    with pytest.raises(cluster.ClusterError) as info:
        cluster.from_environment(env)
    assert str(info.value) == ("cannot expand SLURM_STEP_NODELIST 'n[1-2]': `scontrol` is not on PATH (Slurm's "
                               "client tools must be installed where srun starts the tasks)")
    with pytest.raises(cluster.ClusterError) as info:
        cluster.from_environment(_slurm_env(scontrol_dir, 1, hosts=""))
    assert str(info.value) == ("cannot expand SLURM_STEP_NODELIST 'n[1-2]': `scontrol show hostnames` exited 1 "
                               "(scontrol: error: invalid hostlist n[1-2])")


def test_the_example_prints_one_line_for_bad_slurm_variables(parabola_example, scontrol_dir, monkeypatch, capsys):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name, value in _slurm_env(scontrol_dir, 1, SLURM_STEP_TASKS_PER_NODE="3").items():
        monkeypatch.setenv(name, value)
    assert parabola_example.main(["--steps", "1", "--engine", "collective"]) == 2
    assert capsys.readouterr().err == ("parabola_sync.py: error: `SLURM_STEP_TASKS_PER_NODE` must add up to "
                                       "SLURM_NTASKS (4), got '3'\n")


# --- Processes ------------------------------------------------------------------------------------------------


class _Tasks(object):
    """Started processes with their output in files; every one is killed on the way out."""

    def __init__(self, folder):
        self.folder, self.processes = folder, {}

    def start(self, name, command, env):
        output = open(os.path.join(str(self.folder), name + ".log"), "w")
        self.processes[name] = subprocess.Popen(command, env=env, cwd=_ROOT, stdout=output, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)
        output.close()
        return self.processes[name]

    def output(self, name):
        with open(os.path.join(str(self.folder), name + ".log")) as handle:
            return handle.read()

    def wait(self, names, seconds=_RUN_SECONDS):
        """Waits for ``names`` to exit; fails with their output unless all exit 0 in time."""
        deadline = time.time() + seconds
        for name in names:
            try:
                status = self.processes[name].wait(max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                status = "still running after %s s" % seconds
            if status != 0:
                pytest.fail("%s: %s\n%s" % (name, status, "\n".join(
                    "--- %s\n%s" % (n, self.output(n)[-3000:]) for n in self.processes)))

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
                process.wait(10)


def _env(**variables):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    for name in [name for name in env if name == "TF_CONFIG" or name.startswith("SLURM_")]:
        del env[name]
    env.update(variables)
    return env


def _assert_equal_to_one_process(out_files, reference):
    for path in out_files:
        run = dict(np.load(path))
        assert int(run["final_step"]) == _STEPS
        for name in _WEIGHTS:
            np.testing.assert_allclose(run[name], reference[name], rtol=1e-5, atol=1e-6, err_msg=path + " " + name)


def _fashion_mnist_data():
    """``examples/fashion_mnist_data.py``, the examples' loader, as a module."""
    spec = importlib.util.spec_from_file_location("fashion_mnist_data",
                                                  os.path.join(_ROOT, "examples", "fashion_mnist_data.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write_fashion(directory, num_train, num_test, seed=0):
    """The four gzipped IDX files of a random Fashion-MNIST in ``directory``; returns the arrays.

    As ``write_fashion`` of tests/test_examples.py, which cannot be imported here without loading the
    main example (it redirects stderr and sets TensorFlow's log level while it imports).
    """
    data, rng = _fashion_mnist_data(), np.random.RandomState(seed)
    arrays = {"train_images": rng.randint(0, 256, (num_train, 28, 28)).astype(np.uint8),
              "train_labels": (np.arange(num_train) % 10).astype(np.uint8),
              "test_images": rng.randint(0, 256, (num_test, 28, 28)).astype(np.uint8),
              "test_labels": (np.arange(num_test) % 10).astype(np.uint8)}
    os.makedirs(str(directory))
    for part, name in data.FILES.items():
        data.write_idx(os.path.join(str(directory), name + ".gz"), arrays[part])
    return arrays


def _workers_command(command, save):
    """The guide's ``workers.py`` command with this Python, ``_WORKERS_FLAGS`` and ``--save save``."""
    assert command[:2] == ["python", "examples/workers.py"]
    command = forkserver.command() + [os.path.join(_ROOT, command[1])] + command[2:]
    for flag, value in sorted(dict(_WORKERS_FLAGS, **{"--save": save}).items()):
        command = _with_flag(command, flag, value) if flag in command else command + [flag, value]
    return command


def _checkpoint(prefix):
    reader = tf.train.load_checkpoint(prefix)
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _test_accuracy(variables, images, labels):
    """The MLP's test accuracy, in numpy."""
    x = images.reshape(len(images), -1).astype(np.float32) / np.float32(255)
    hidden = np.maximum(x.dot(variables["dense/kernel"]) + variables["dense/bias"], 0)
    logits = hidden.dot(variables["dense_1/kernel"]) + variables["dense_1/bias"]
    return float(np.mean(np.argmax(logits, 1) == labels))


@pytest.mark.one_behaviour
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_tfjob_chief_two_workers_train_as_one_process_and_the_evaluator_is_not_waited_for(tmp_path):
    name, replicas, port = _tfjob()
    ports = iter(launch.pick_free_ports(3))
    local = {(kind.lower(), i): "127.0.0.1:%d" % next(ports)
             for kind, (count, _) in replicas.items() if kind != "Evaluator" for i in range(count)}
    # The image's /usr/share/datasets/fashion-mnist, the first place every pod's loader looks.
    datasets = tmp_path / "datasets"
    arrays = _write_fashion(datasets / "fashion-mnist", num_train=180, num_test=50)
    checkpoints = tmp_path / "ckpt"  # The volume.
    checkpoints.mkdir()
    (tmp_path / "one").mkdir()
    evaluator_script = tmp_path / "evaluate.py"
    evaluator_script.write_text(_configmap_file("evaluate.py"))
    started = time.time()
    with _Tasks(tmp_path) as tasks:
        count, command = replicas["Evaluator"]
        assert count == 1 and command[1:3] == ["/evaluator/evaluate.py", "/ckpt"]
        evaluator = tasks.start("evaluator", [*forkserver.command(), str(evaluator_script), str(checkpoints),
                                              _WORKERS_FLAGS["--updates"]],
                                _env(GRADACCUM_SYSTEM_DATASETS=str(datasets), TF_CONFIG=_operator_tf_config(
                                    name, replicas, port, "evaluator", 0, lambda job, i: local[job, i])))
        # Stopped while the job trains: nobody may wait for it. Its program, forked from one TensorFlow
        # import, is stopped: the stand-in cannot pass SIGSTOP on.
        program = _program_of(evaluator.pid)
        os.kill(program, signal.SIGSTOP)
        for job, index in sorted(local):
            # The workers mount no volume: a directory that does not exist, which they must not write.
            save = str(checkpoints / "mlp") if job == "chief" else str(tmp_path / "no-volume" / "mlp")
            tasks.start("%s-%d" % (job, index), _workers_command(replicas[job.capitalize()][1], save),
                        _env(GRADACCUM_SYSTEM_DATASETS=str(datasets), TF_CONFIG=_operator_tf_config(
                            name, replicas, port, job, index, lambda job, i: local[job, i])))
        # The reference: one process, the same flags, no TF_CONFIG.
        tasks.start("one", _workers_command(replicas["Chief"][1], str(tmp_path / "one" / "mlp")),
                    _env(GRADACCUM_SYSTEM_DATASETS=str(datasets)))
        tasks.wait(["chief-0", "worker-0", "worker-1", "one"], 120)
        trained = time.time() - started
        assert evaluator.poll() is None and psutil.Process(program).status() == psutil.STATUS_STOPPED  # Still.
        os.kill(program, signal.SIGCONT)
        tasks.wait(["evaluator"], 60)
    print("trained in %.1f s, then evaluated in %.1f s" % (trained, time.time() - started - trained))
    data_line = "data: Fashion-MNIST from %s, 180 train / 50 test examples" % (datasets / "fashion-mnist")
    chief = _own_lines(tasks.output("chief-0"))
    assert chief[0] == data_line and chief[1].startswith(
        "done: global_step 3, 3 workers x 2 micro-batches of 10 per update, test accuracy "), chief
    assert _own_lines(tasks.output("worker-0")) == _own_lines(tasks.output("worker-1")) == []  # Only the chief logs.
    assert not (tmp_path / "no-volume").exists()
    assert _own_lines(tasks.output("one"))[1].startswith("done: global_step 3, 1 workers x 6 micro-batches of 10")
    ours, reference = _checkpoint(str(checkpoints / "mlp")), _checkpoint(str(tmp_path / "one" / "mlp"))
    compared = [name for name in reference if name.startswith("dense") and "GradientAccumulator" not in name]
    assert len(compared) == 12 and ours["global_step"] == reference["global_step"] == 3, sorted(reference)
    for name in compared:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert not np.allclose(ours["dense/kernel/Adam"], 0)  # Training moved the weights.
    # Its own lines (TensorFlow >= 2.16 prints start-up lines on stderr whatever TF_CPP_MIN_LOG_LEVEL says).
    evaluated = [line for line in tasks.output("evaluator").splitlines() if line.startswith(("data:", "evaluator:"))]
    assert evaluated[0] == data_line and len(evaluated) == 2, evaluated
    step, accuracy = re.match(r"^evaluator: global_step (\d+) test accuracy (\d\.\d{4})$", evaluated[1]).groups()
    assert int(step) == 3
    assert float(accuracy) == round(_test_accuracy(ours, arrays["test_images"], arrays["test_labels"]), 4)


@pytest.mark.one_behaviour
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_a_master_and_a_worker_train_as_one_process(parabola_reference, tmp_path):
    addresses = ["127.0.0.1:%d" % port for port in launch.pick_free_ports(2)]
    spec, out = {"master": addresses[:1], "worker": addresses[1:]}, str(tmp_path / "run.npz")
    command = [*forkserver.command(), os.path.join(_ROOT, "examples", "parabola_sync.py"), "--engine", "collective",
               "--steps", str(_STEPS), "--out", out]
    with _Tasks(tmp_path) as tasks:
        for job in ("master", "worker"):
            tasks.start(job, command, _env(TF_CONFIG=json.dumps(
                {"cluster": spec, "task": {"type": job, "index": 0}, "environment": "cloud"})))
        tasks.wait(["master", "worker"])
    _assert_equal_to_one_process([out, str(tmp_path / "run-worker1.npz")], parabola_reference(_STEPS))


def _free_port_pair(count=2):
    """A base port such that base to base + count - 1 are free on every interface (TensorFlow binds them all)."""
    for _ in range(50):
        base = launch.pick_free_ports(1, "")[0]
        probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("", base + offset))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    pytest.fail("no %d consecutive free ports found" % count)


@pytest.mark.one_behaviour
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_srun_tasks_of_the_guides_sbatch_script_train_as_one_process(parabola_reference, scontrol_dir, tmp_path):
    options, exported, command = _sbatch()
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    assert (nodes, per_node) == (1, 2) and exported == {"GRADACCUM_PORT_BASE": "8888"}
    out = str(tmp_path / "run.npz")
    command = _local_command(command, _STEPS, str(tmp_path / "ckpt"), out)
    base = _free_port_pair()
    with _Tasks(tmp_path) as tasks:
        for rank in range(nodes * per_node):  # What srun sets for task `rank` (and no TF_CONFIG).
            tasks.start("task%d" % rank, command, _env(
                PATH="%s%s%s" % (scontrol_dir, os.pathsep, os.environ["PATH"]), FAKE_HOSTS="127.0.0.1",
                SLURM_PROCID=str(rank), SLURM_NTASKS=str(nodes * per_node), SLURM_NODEID="0",
                SLURM_LOCALID=str(rank), SLURM_STEP_NODELIST="node01", SLURM_STEP_TASKS_PER_NODE=str(per_node),
                GRADACCUM_PORT_BASE=str(base)))
        tasks.wait(["task0", "task1"])
    _assert_equal_to_one_process([out, str(tmp_path / "run-worker1.npz")], parabola_reference(_STEPS))
    assert (scontrol_dir / "calls").read_text() == "show hostnames node01\n" * 2


def _horovod_with_mpi():
    """None when this Python's Horovod runs under mpirun, else why not (one line)."""
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (Debian: apt-get install openmpi-bin)"
    done = subprocess.run([sys.executable, "-c", "import horovod.tensorflow as hvd; assert hvd.mpi_built(), "
                           "'built without MPI'"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True, timeout=120, env=_env())
    if done.returncode != 0:
        why = (done.stdout.strip().splitlines() or ["exit status %d" % done.returncode])[-1]
        return ("horovod.tensorflow with MPI is not importable here (%s): it must be built against this "
                "TensorFlow; Horovod 0.28.1 builds against TF 1.15 (with libopenmpi-dev), not against TF 2.21, "
                "whose headers lack highwayhash/arch_specific.h (included by xla/printer.h)" % why)
    return None


@pytest.mark.one_behaviour
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_the_guides_horovod_script_under_its_mpirun_line_trains_as_one_process(parabola_reference, tmp_path):
    missing = _horovod_with_mpi()
    if missing is not None and os.environ.get("GRADACCUM_REQUIRE_HOROVOD_MPI"):
        pytest.fail(missing + " (GRADACCUM_REQUIRE_HOROVOD_MPI is set: CI installed it)")
    if missing is not None:
        pytest.skip(missing)
    (script,) = [code for code in _blocks("python") if "import horovod.tensorflow as hvd" in code]
    (line,) = [code.strip() for code in _blocks("bash") if code.startswith("mpirun ")]
    (tmp_path / "hvd_parabola.py").write_text(script)
    words = shlex.split(line)
    assert words[:3] == ["mpirun", "-np", "2"] and words[-4:-2] == ["python", "hvd_parabola.py"]
    out = str(tmp_path / "rank0.npz")
    command = words[:-4] + [sys.executable, str(tmp_path / "hvd_parabola.py"), "--steps", str(_STEPS), "--out", out]
    with _Tasks(tmp_path) as tasks:
        tasks.start("mpirun", command, _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"))
        tasks.wait(["mpirun"])
    reference = parabola_reference(_STEPS)
    run = dict(np.load(out))
    for name in _WEIGHTS:
        np.testing.assert_allclose(run[name], reference[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert re.search(r"global_step %d loss" % _STEPS, tasks.output("mpirun"))
