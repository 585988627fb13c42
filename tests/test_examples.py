"""Tests of examples/: what each script prints and computes, not how its source reads.

Every script runs in a subprocess as a user runs it, on small IDX files written
here (``--data-dir``), with a tiny model and a few updates; the tests check the
lines it promises, its ``--json``, and that bad flags are one line without a
traceback. ``test_main_example_on_real_fashion_mnist`` needs the Debian package
``dataset-fashion-mnist``: it skips without it, and fails instead when
``GRADACCUM_REQUIRE_FASHION_MNIST=1`` (CI installs the package and sets it).
The numeric tests build the main example's own graph in this process: its
subdivided training equals full-batch training on the variables, and
``workers.py`` under the launcher equals one process.
"""
import glob
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL_DATA = "/usr/share/datasets/fashion-mnist"

import example_module  # noqa: E402
import forkserver  # noqa: E402

example = example_module.load("fashion_mnist_subdivision")  # It puts examples/ on sys.path, for the next.
EXAMPLES = example_module.EXAMPLES_DIR
import fashion_mnist_data  # noqa: E402


def test_loading_an_example_leaves_the_test_process_as_it_was():
    """The example quiets itself on import (TF_CPP_MIN_LOG_LEVEL, stderr to /dev/null): not this process.

    Left behind, every program a later test starts would inherit the variable and pay a TensorFlow import of
    its own instead of forking from the session's (tests/forkserver.py), and this process's stderr would be lost.
    """
    environ, stderr = dict(os.environ), os.fstat(2)
    loaded = example_module.load("fashion_mnist_subdivision", "fashion_mnist_subdivision_loaded_again")
    assert loaded.VERBOSE is False and loaded.build is not None
    assert dict(os.environ) == environ
    assert (os.fstat(2).st_dev, os.fstat(2).st_ino) == (stderr.st_dev, stderr.st_ino)


def write_fashion(directory, num_train=80, num_test=20, seed=0, gz=True):
    """The four Fashion-MNIST files with random images and labels 0..9; returns the arrays."""
    rng = np.random.RandomState(seed)
    arrays = {"train_images": rng.randint(0, 256, (num_train, 28, 28)).astype(np.uint8),
              "train_labels": (np.arange(num_train) % 10).astype(np.uint8),
              "test_images": rng.randint(0, 256, (num_test, 28, 28)).astype(np.uint8),
              "test_labels": (np.arange(num_test) % 10).astype(np.uint8)}
    os.makedirs(str(directory), exist_ok=True)
    for part, name in fashion_mnist_data.FILES.items():
        fashion_mnist_data.write_idx(os.path.join(str(directory), name + (".gz" if gz else "")), arrays[part])
    return arrays


def run(script, args, cwd, timeout=300, env=None, fresh=False):
    """Runs ``examples/<script>`` with ``args``; HOME and the Debian data place point at ``cwd`` (no data).

    The script runs forked from one TensorFlow import (``tests/forkserver.py``),
    or with ``fresh=True`` in a fresh Python: for what only a fresh import
    shows, such as TensorFlow's log lines. A script that chooses its TensorFlow behaviour itself (all but those that
    read ``GRADACCUM_TF_MODE``) runs the same program in both sessions: the
    test skips in the ``--tf-mode=tf2`` session, as the docs' programs do.
    """
    with open(os.path.join(EXAMPLES, script), encoding="utf-8") as handle:
        follows_session = "GRADACCUM_TF_MODE" in handle.read()
    if os.environ.get("GRADACCUM_TF_MODE") == "tf2" and not follows_session:
        pytest.skip("examples/%s chooses its own TensorFlow behaviour: run in the tf1 session only" % script)
    environ = dict(os.environ, HOME=str(cwd), GRADACCUM_SYSTEM_DATASETS=str(cwd))
    environ.update(env or {})
    environ.pop("KERAS_HOME", None)
    python = [sys.executable] if fresh else forkserver.command()
    return subprocess.run(python + [os.path.join(EXAMPLES, script)] + [str(a) for a in args],
                          cwd=str(cwd), env=environ, timeout=timeout, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, universal_newlines=True)


def progress_lines(stderr):
    """progressbar2's lines; anything else on stderr is TensorFlow's noise."""
    lines = [line.strip() for line in re.split("[\r\n]", stderr) if line.strip()]
    noise = [line for line in lines if not line.startswith("update ")]
    assert not noise, noise[:5]
    return lines


@pytest.fixture
def data_dir(tmp_path):
    write_fashion(tmp_path / "data")
    return tmp_path / "data"


# ------------------------------------------------------------- the data module


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_files_round_trip_big_endian(tmp_path, dtype, suffix):
    array = (np.arange(24).reshape(2, 3, 4) * 7 - 20).astype(dtype)
    path = str(tmp_path / ("a-idx3" + suffix))
    fashion_mnist_data.write_idx(path, array)
    np.testing.assert_array_equal(fashion_mnist_data.read_idx(path), array)
    assert fashion_mnist_data.parse_idx(b"\x00\x00\x0b\x01\x00\x00\x00\x02\x01\x02\xff\xfe").tolist() == [258, -2]


@pytest.mark.parametrize("raw, message", [
    (b"\x08\x03\x00\x00", r"has a bad header"),
    (b"\x00\x00\x08\x03\x00\x00\x00\x02", r"is truncated in its header"),
    (b"\x00\x00\x08\x02\x00\x00\x00\x02\x00\x00\x00\x02\x01\x02\x03", r"is truncated: shape \[2, 2\] needs 4 data"),
    (b"\x00\x00\x08\x01\x00\x00\x00\x01\x01\x02", r"is too long: shape \[1\] needs 1 data bytes, found 2"),
])
def test_corrupt_idx_files_are_errors_naming_the_file(tmp_path, raw, message):
    path = str(tmp_path / "bad-idx.gz")
    import gzip
    with gzip.open(path, "wb") as handle:
        handle.write(raw)
    with pytest.raises(ValueError, match=r"IDX file '%s' %s" % (re.escape(path), message)):
        fashion_mnist_data.read_idx(path)
    with open(path, "wb") as handle:
        handle.write(b"not gzip")
    with pytest.raises(ValueError, match=r"IDX file '%s' cannot be read" % re.escape(path)):
        fashion_mnist_data.read_idx(path)


@pytest.mark.parametrize("present, expected", [
    (("given", "system", "cache", "download"), "given"),
    (("system", "cache", "download"), "system"),
    (("cache", "download"), "cache"),
    (("download",), "download"),
    ((), "digits"),
])
def test_the_loader_takes_the_first_place_that_has_the_data_and_says_where(tmp_path, monkeypatch, present,
                                                                            expected):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.setenv("GRADACCUM_SYSTEM_DATASETS", str(tmp_path / "share"))
    places = {"given": tmp_path / "given", "system": tmp_path / "share" / "fashion-mnist",
              "cache": tmp_path / "home" / ".keras" / "datasets" / "fashion-mnist"}
    for number, (name, place) in enumerate(sorted(places.items()), 1):
        if name in present:
            write_fashion(place, num_train=10 * number)
        else:  # three of the four files do not count
            write_fashion(place, num_train=10 * number)
            os.remove(str(place / "t10k-labels-idx1-ubyte.gz"))
    downloaded = fashion_mnist_data._dataset((np.zeros((40, 28, 28)), np.zeros(40)), (np.zeros((5, 28, 28)),
                                             np.zeros(5)), "fashion-mnist", fashion_mnist_data.DOWNLOAD_URL)

    def download():
        if "download" not in present:
            raise OSError("URL fetch failure: no network")
        return downloaded

    monkeypatch.setattr(fashion_mnist_data, "download", download)
    lines = []
    data = fashion_mnist_data.load(str(places["given"]) if "given" in present else None, log=lines.append)
    assert len(lines) == 1
    if expected == "digits":
        assert data.name == "digits" and data.train_images.shape == (1500, 28, 28, 1)
        assert lines[0].startswith("data: scikit-learn's 8x8 digits upscaled to 28x28 (NOT Fashion-MNIST) from "
                                   "sklearn.datasets.load_digits, 1500 train / 297 test examples; Fashion-MNIST "
                                   "not in %s nor in %s; download failed: URL fetch failure: no network; "
                                   % (places["system"], places["cache"]))
        assert lines[0].endswith(fashion_mnist_data.HOW_TO_GET)
    elif expected == "download":
        assert data is downloaded and lines[0] == (
            "data: Fashion-MNIST downloaded from %s into %s, 40 train / 5 test examples"
            % (fashion_mnist_data.DOWNLOAD_URL, places["cache"]))
    else:
        number = sorted(places).index(expected) + 1
        assert lines[0] == "data: Fashion-MNIST from %s, %d train / 20 test examples" % (places[expected],
                                                                                        10 * number)
        assert data.train_images.dtype == np.float32 and data.train_images.max() <= 1.0
        assert data.train_labels.dtype == np.int32 and data.source == str(places[expected])


# ------------------------------------------------------------ the main example

EPOCH = re.compile(r"^epoch (\d+): step (\d+), train loss (\d+\.\d{4}), test accuracy ([01]\.\d{4}), \d+\.\d s$")


def test_main_example_prints_its_lines_quietly_and_writes_its_json(tmp_path, data_dir):
    proc = run("fashion_mnist_subdivision.py", ["--data-dir", data_dir, "--width", "2", "--batch-size", "40",
                                                "--subdivisions", "4", "--epochs", "2", "--json",
                                                tmp_path / "run.json"], tmp_path, fresh=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[:2] == ["data: Fashion-MNIST from %s, 80 train / 20 test examples" % data_dir,
                         "batch 40 = 4 micro-batches of 10; 4 updates, 2 per epoch"]
    epochs = [EPOCH.match(line) for line in lines[2:4]]
    assert all(epochs), lines
    assert [(int(m.group(1)), int(m.group(2))) for m in epochs] == [(1, 2), (2, 4)]
    assert re.match(r"^test accuracy [01]\.\d{4} after 4 updates of 40, \d+ s, peak memory \d+ MB$", lines[4])
    assert len(lines) == 5
    assert progress_lines(proc.stderr)[-1].startswith("update 4/4 |")
    figures = json.load(open(str(tmp_path / "run.json")))
    assert figures == dict(figures, dataset="fashion-mnist", source=str(data_dir), train_examples=80,
                           test_examples=20, updates=4, batch_size=40, micro_batch_size=10)
    assert figures["test_accuracy"] == [float(m.group(4)) for m in epochs]
    assert figures["final_test_accuracy"] == figures["test_accuracy"][-1]
    assert 0 < figures["seconds"] < 300 and 100 < figures["peak_memory_mb"] < 1e5
    # The same seed, the same run.
    again = run("fashion_mnist_subdivision.py", ["--data-dir", data_dir, "--width", "2", "--batch-size", "40",
                                                 "--subdivisions", "4", "--epochs", "2"], tmp_path)
    assert [line.rsplit(",", 1)[0] for line in again.stdout.splitlines()[2:4]] == \
        [line.rsplit(",", 1)[0] for line in lines[2:4]]


@pytest.mark.parametrize("form", [[], ["--one-run"]], ids=["fused", "one-run"])
def test_main_example_verbose_lets_tensorflow_speak_and_logdir_writes_once_per_update(tmp_path, data_dir, form):
    # The fused form runs fresh, for TensorFlow's lines at import too; the one-run form forks (the logs after
    # the import, such as the deprecation warnings, still show), and a fork's exit skips the interpreter's
    # teardown: the last update's summaries are there only if the example closed its writer.
    proc = run("fashion_mnist_subdivision.py", ["--data-dir", data_dir, "--width", "1", "--batch-size", "40",
                                                "--subdivisions", "2", "--epochs", "1", "--verbose",
                                                "--logdir", tmp_path / "runs"] + form, tmp_path, fresh=not form)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spoken = [line for line in proc.stderr.splitlines() if not line.startswith("update ")]
    assert any("tensorflow" in line.lower() for line in spoken), proc.stderr[-3000:]  # TensorFlow's lines
    steps = []
    for path in glob.glob(str(tmp_path / "runs" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            steps += [event.step for value in event.summary.value if value.tag == "gradaccum/effective_batch"]
    assert sorted(steps) == [1, 2]


def test_main_example_trains_on_the_digits_when_no_fashion_mnist_is_found(tmp_path, monkeypatch):
    # No Fashion-MNIST anywhere and no network: an unroutable proxy makes the download fail at once.
    proc = run("fashion_mnist_subdivision.py", ["--width", "1", "--epochs", "1", "--subdivisions", "50"], tmp_path,
               env={"HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("data: scikit-learn's 8x8 digits upscaled to 28x28 (NOT Fashion-MNIST)")
    assert lines[0].endswith(fashion_mnist_data.HOW_TO_GET)
    assert lines[1] == "batch 1500 = 50 micro-batches of 30; 1 updates, 1 per epoch"


def test_main_example_on_real_fashion_mnist(tmp_path):
    """The Debian package's files, found without --data-dir: 60,000 + 10,000 examples."""
    if not os.path.isdir(REAL_DATA):
        if os.environ.get("GRADACCUM_REQUIRE_FASHION_MNIST") == "1":
            pytest.fail("%s is missing but GRADACCUM_REQUIRE_FASHION_MNIST=1" % REAL_DATA)
        pytest.skip("Fashion-MNIST is not installed: apt-get install dataset-fashion-mnist")
    proc = run("fashion_mnist_subdivision.py", ["--width", "1", "--batch-size", "6000", "--subdivisions", "2",
                                                "--epochs", "1", "--json", tmp_path / "real.json"], tmp_path,
               env={"GRADACCUM_SYSTEM_DATASETS": os.path.dirname(REAL_DATA)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == ("data: Fashion-MNIST from %s, 60000 train / 10000 test examples"
                                           % REAL_DATA)
    figures = json.load(open(str(tmp_path / "real.json")))
    assert (figures["dataset"], figures["source"], figures["train_examples"], figures["test_examples"],
            figures["updates"]) == ("fashion-mnist", REAL_DATA, 60000, 10000, 10)
    assert figures["final_test_accuracy"] > 0.3  # ten updates of a tiny CNN: far better than chance


def _trained(subdivisions, micro_batches, updates, one_run=False, start=None):
    """The example's graph (width 2) trained for ``updates`` updates; returns every variable's value.

    ``start``: ``(names, values)`` to begin from instead of the initializers'.
    """
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(7)
        random.seed(7)  # under TF2 behaviour tf-keras's initialisers draw their seeds from Python's random
        model = example.build(2, subdivisions, lambda step: example.learning_rate(step, 0.01, 2, 10),
                              one_run=one_run)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            given = dict(zip(*start)) if start else {}
            for var in tf.compat.v1.global_variables():
                if var.op.name in given:
                    var.load(given[var.op.name], sess)
            values = [sess.run(tf.compat.v1.global_variables())]
            for update in range(updates):
                for images, labels in micro_batches(update):
                    # Inference-mode batch norm: the loss is a mean over independent examples.
                    sess.run(model["train_op"], {model["images"]: images, model["labels"]: labels,
                                                 model["is_training"]: False})
                values.append(sess.run(tf.compat.v1.global_variables()))
            names = [v.op.name for v in tf.compat.v1.global_variables()]
    return names, values


def test_the_examples_subdivided_training_equals_full_batch_training():
    """Three uneven micro-batches (5, 3, 7 examples) per update, weighted by their sizes, equal one
    full batch of 15 per update: every variable, Adam's slots and global_step, after each of 3 updates."""
    rng = np.random.RandomState(3)
    batches = [(rng.rand(15, 28, 28, 1).astype(np.float32), rng.randint(0, 10, 15).astype(np.int32))
               for _ in range(3)]
    cuts = [(0, 5), (5, 8), (8, 15)]
    names, split = _trained(3, lambda u: [(batches[u][0][a:b], batches[u][1][a:b]) for a, b in cuts], 3)
    full_names, full = _trained(1, lambda u: [batches[u]], 3)
    shared = [n for n in names if n in full_names]  # k = 1 has no window state
    assert len(shared) >= 20 and "global_step" in shared
    for update in range(1, 4):
        got = dict(zip(names, split[update]))
        want = dict(zip(full_names, full[update]))
        for name in shared:
            np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name)
        assert want["global_step"] == update
        moved = max(np.abs(want[n] - dict(zip(full_names, full[update - 1]))[n]).max() for n in shared
                    if n.startswith("model/") and "kernel" in n)
        assert moved > 1e-3  # each update moves the kernels far more than the tolerance


def test_the_examples_one_run_training_equals_full_batch_training():
    """--one-run: each batch of 15 in one run, split into 3 micro-batches of 5 in a loop inside the graph."""
    rng = np.random.RandomState(4)
    batches = [(rng.rand(15, 28, 28, 1).astype(np.float32), rng.randint(0, 10, 15).astype(np.int32))
               for _ in range(3)]
    full_names, full = _trained(1, lambda u: [batches[u]], 3)
    names, one_run = _trained(3, lambda u: [batches[u]], 3, one_run=True, start=(full_names, full[0]))
    shared = [n for n in names if n in full_names]
    assert len(shared) >= 20 and "global_step" in shared
    got, want = dict(zip(names, one_run[-1])), dict(zip(full_names, full[-1]))
    for name in shared:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-5, atol=2e-6, err_msg=name)
    assert got["global_step"] == 3


# ------------------------------------------------------------- bad flags


@pytest.mark.parametrize("script, args, message", [
    ("fashion_mnist_subdivision.py", ["--batch-size", "100", "--subdivisions", "3"],
     "`--batch-size` 100 is not a multiple of `--subdivisions` 3"),
    ("fashion_mnist_subdivision.py", ["--epochs", "0"], "`--epochs` must be an int >= 1, got 0"),
    ("fashion_mnist_subdivision.py", ["--learning-rate", "x"], "argument --learning-rate: invalid float value: 'x'"),
    ("fashion_mnist_subdivision.py", ["--bogus"], "unrecognized arguments: --bogus"),
    ("fashion_mnist_subdivision.py", ["--json", "/no/such/dir/run.json"], "argument --json: can't open"),
    ("fashion_mnist_subdivision.py", ["--data-dir", "{tmp}"], "`--data-dir` '{tmp}' does not hold Fashion-MNIST"),
    ("adaptive_batch.py", ["--max-micro-batches", "1"], "`--max-micro-batches` must be an int >= 2, got 1"),
    ("batch_schedule.py", ["--ramp", "500,250,10"], "`--ramp` '500,250,10': `increment` must be a multiple"),
    ("towers.py", ["--batch-size", "10", "--towers", "3"], "`--batch-size` 10 must be a multiple of"),
    ("find_micro_batch.py", ["--memory-mb", "0"], "`--memory-mb` must be an int >= 1, got 0"),
    ("workers.py", ["--batch-size", "10", "--subdivisions", "3"], "`--batch-size` 10 is not a multiple of"),
    ("keras_fit.py", ["--micro-batches", "0"], "argument --micro-batches: `--micro-batches` must be an int >= 1"),
    ("bert_style_finetune.py", ["--warmup-proportion", "1.5"], "`--warmup-proportion` must be in [0, 1], got 1.5"),
    ("compare_batches.py", ["--rows", "fixed-5000,huge"], "`--rows`: unknown row 'huge' (known: fixed-5000, "),
])
def test_a_bad_flag_is_one_line_without_traceback(tmp_path, script, args, message):
    args = [arg.format(tmp=tmp_path) for arg in args]
    proc = run(script, args, tmp_path, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("%s: error: %s" % (script, message.format(tmp=tmp_path))), proc.stderr


# --------------------------------------------------------- the feature scripts


def test_adaptive_batch_changes_the_batch_with_the_noise_scale(tmp_path, data_dir):
    write_fashion(data_dir, num_train=400, num_test=20)
    proc = run("adaptive_batch.py", ["--data-dir", data_dir, "--epochs", "2", "--micro-batch", "10",
                                     "--max-micro-batches", "8", "--hidden", "8"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    pattern = (r"^epoch (\d): (\d+) updates, batch (\d+) to (\d+), noise scale (\d+ examples|not measured yet), "
               r"learning rate "
               r"x [\d.]+, test accuracy [01]\.\d{4}$")
    epochs = [re.match(pattern, line) for line in lines[1:3]]
    assert all(epochs), lines
    sizes = [int(m.group(g)) for m in epochs for g in (3, 4)]
    assert min(sizes) >= 20 and max(sizes) <= 80 and all(size % 10 == 0 for size in sizes)
    updates = sum(int(m.group(2)) for m in epochs)
    assert re.match(r"^done: %d updates \(global_step %d\) of \d+ examples on average, \d+ s$" % (updates, updates),
                    lines[3]), lines[3]


def test_batch_schedule_follows_the_ramp(tmp_path, data_dir):
    write_fashion(data_dir, num_train=400, num_test=20)
    proc = run("batch_schedule.py", ["--data-dir", data_dir, "--ramp", "20,20,200", "--batch-size", "60",
                                     "--micro-batch", "10", "--epochs", "2", "--hidden", "8"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.match(r"^epoch 1: \d+ updates, batch 20 to 60, test accuracy [01]\.\d{4}$", lines[1]), lines
    assert re.match(r"^epoch 2: \d+ updates, batch 60 to 60, test accuracy [01]\.\d{4}$", lines[2]), lines
    # gradaccum.batch_ramp(20, 20, 200, 60, 10): 20 until 100 examples, 40 until 200, then 60; an
    # epoch's last window that does not fit waits for the next epoch (400 examples: 5x20 + 3x40 + 3x60).
    assert re.match(r"^done: 17 updates \(global_step 17\), batches 5x20 3x40 9x60, \d+ s$", lines[3]), lines[3]


def test_towers_train_on_two_devices(tmp_path, data_dir):
    proc = run("towers.py", ["--data-dir", data_dir, "--batch-size", "40", "--subdivisions", "2", "--width", "2",
                             "--epochs", "2"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1] == "batch 40 = 2 micro-batches of 20, each split over /cpu:0, /cpu:1"
    for epoch, line in enumerate(lines[2:4], 1):
        assert re.match(r"^epoch %d: global_step %d, train loss \d+\.\d{4}, test loss \d+\.\d{4} \(batch "
                        r"statistics\)$" % (epoch, 2 * epoch), line), line
    assert re.match(r"^done: 4 updates on 2 towers, \d+ s$", lines[4])


def test_find_micro_batch_finds_one_that_fits_and_trains_with_it(tmp_path, data_dir):
    proc = run("find_micro_batch.py", ["--data-dir", data_dir, "--batch-size", "40", "--width", "2",
                                       "--updates", "2"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    found = re.match(r"^found in \d+ s: (\d+) micro-batches of (\d+) for a batch of 40 \(largest that ran: (\d+), "
                     r"smallest that ran out of memory: (\d+|None)\)$", lines[1])
    assert found, lines
    k, micro = int(found.group(1)), int(found.group(2))
    assert k * micro >= 40 and micro <= int(found.group(3))
    assert [re.sub(r"loss .*", "", line) for line in lines[2:]] == [
        "update 1: global_step 1, batch %d, " % (k * micro), "update 2: global_step 2, batch %d, " % (k * micro)]


def test_keras_fit_equals_plain_full_batches(tmp_path, data_dir):
    proc = run("keras_fit.py", ["--data-dir", data_dir, "--micro-batch", "10", "--micro-batches", "4",
                                "--epochs", "1", "--hidden", "8", "--compare"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[1] == "Model.fit(batch_size=10) with GradientAccumulator(Adam 0.001, 4): each update is a batch of 40"
    assert lines[2].startswith("epoch 1: 2 updates so far (Keras iterations), train loss ")
    assert float(lines[3].split("largest weight difference ")[1]) < 1e-5


def test_estimator_trains_max_steps_updates_or_says_it_needs_tf_estimator(tmp_path, data_dir):
    proc = run("estimator.py", ["--data-dir", data_dir, "--micro-batch", "10", "--micro-batches", "4",
                                "--max-steps", "3", "--hidden", "8"], tmp_path)
    version = tuple(int(part) for part in tf.__version__.split(".")[:2])
    if version >= (2, 16):
        assert proc.returncode == 2 and proc.stderr == (
            "estimator.py: error: needs tf.estimator, which exists only up to TensorFlow 2.15 (this is TensorFlow "
            "%s); use examples/keras_fit.py or a session loop\n" % tf.__version__)
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.match(r"^global_step 3 \(updates; 12 micro-batches\), test loss", proc.stdout.splitlines()[-1])


def test_bert_style_finetune_counts_windows_and_follows_the_schedule(tmp_path):
    proc = run("bert_style_finetune.py", ["--train-steps", "12", "--micro-batches", "4", "--micro-batch", "16",
                                          "--warmup-proportion", "0.25", "--learning-rate", "5e-3", "--hidden", "16",
                                          "--json", tmp_path / "run.json"], tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.match(r"^data: scikit-learn's bundled digits from \S+digits\.csv\.gz: 1797 images of 8x8, 1437 to "
                    r"train, 360 to test$", lines[0]), lines[0]
    assert lines[-1].startswith("global_step 12 after 48 micro-batches (one per applied window); test accuracy ")
    figures = json.load(open(str(tmp_path / "run.json")))
    assert figures["global_step"] == 12 and figures["micro_batches_run"] == 48
    # BERT's schedule on the step before each update: warm-up over 3 updates, then linear decay to 0 at 12.
    expected = [5e-3 * step / 3 if step < 3 else 5e-3 * (1 - step / 12.0) for step in range(12)]
    np.testing.assert_allclose(figures["learning_rates"], expected, rtol=1e-6, atol=1e-9)
    assert np.mean(figures["losses"][-3:]) < np.mean(figures["losses"][:3]) - 0.05, figures["losses"]


def test_compare_batches_runs_every_row_over_the_seeds_and_redraws_from_its_json(tmp_path, data_dir):
    proc = run("compare_batches.py", ["--data-dir", data_dir, "--rows", "fixed-500,adaptive", "--seeds", "2",
                                      "--epochs", "2", "--micro-batch", "4", "--width", "1", "--out-dir", tmp_path],
               tmp_path)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    for line, (row, seed) in zip(lines[1:5], [("fixed-500", 0), ("fixed-500", 1), ("adaptive", 0), ("adaptive", 1)]):
        assert re.match(r"^%s, seed %d: test accuracy [01]\.\d{4} after \d+ updates, \d+ s \(CPU \d+ s\)$"
                        % (row, seed), line), line
    result = json.load(open(str(tmp_path / "compare_batches.json")))
    assert [row["name"] for row in result["rows"]] == ["fixed-500", "adaptive"]
    fixed = result["rows"][0]["runs"]
    assert [run["seed"] for run in fixed] == [0, 1]
    assert [run["updates"] for run in fixed] == [[4, 8], [4, 8]] and fixed[0]["batch"] == [20, 20]
    assert fixed[0]["test_accuracy"] != fixed[1]["test_accuracy"] or fixed[0] != fixed[1]  # two seeds, two runs
    adaptive = result["rows"][1]["runs"]
    assert all(8 <= batch <= 200 for run in adaptive for batch in run["batch"])
    assert all(run["wall_seconds"] > 0 and run["cpu_seconds"] > 0 for run in fixed + adaptive)
    table = (tmp_path / "compare_batches.md").read_text().splitlines()
    assert table[2].startswith("| 20 (5 x 4) | 2 | ") and table[3].startswith("| adaptive, 2 to 50 x 4 | 2 | ")
    os.remove(str(tmp_path / "compare_batches.png"))
    again = run("compare_batches.py", ["--replot", "--out-dir", tmp_path], tmp_path)
    assert again.returncode == 0 and again.stdout.splitlines() == table
    assert (tmp_path / "compare_batches.png").stat().st_size > 10000


# ----------------------------------------------------------------- workers


def _checkpoint(prefix):
    reader = tf.train.load_checkpoint(str(prefix))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


@pytest.mark.one_behaviour
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_two_workers_under_the_launcher_train_the_variables_of_one_process(tmp_path, data_dir):
    flags = ["--data-dir", data_dir, "--batch-size", "20", "--subdivisions", "4", "--updates", "4",
             "--hidden", "8"]
    one = run("workers.py", flags + ["--save", tmp_path / "one"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    assert re.match(r"^done: global_step 4, 1 workers x 4 micro-batches of 5 per update", one.stdout.splitlines()[1])
    env = dict(os.environ, HOME=str(tmp_path), GRADACCUM_SYSTEM_DATASETS=str(tmp_path))
    job = subprocess.run([sys.executable, "-m", "gradaccum.launch", "--workers", "2", "--no-port-warning", "--",
                          *forkserver.command(), os.path.join(EXAMPLES, "workers.py")] + [str(f) for f in flags]
                         + ["--save", str(tmp_path / "two")], env=env, cwd=ROOT, timeout=240,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "[worker:0] done: global_step 4, 2 workers x 2 micro-batches of 5 per update" in job.stdout
    assert not [line for line in job.stdout.splitlines() if line.startswith("[worker:1]")]
    ours, reference = _checkpoint(tmp_path / "two"), _checkpoint(tmp_path / "one")
    compared = [name for name in reference if "dense" in name and "GradientAccumulator" not in name]
    assert len(compared) >= 4 and ours["global_step"] == reference["global_step"] == 4
    for name in compared:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert not np.allclose(ours["dense/kernel/Adam"], 0)  # training moved the weights
