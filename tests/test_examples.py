"""Tests of examples/: the IDX reader, the data loader, the command line and the model.

The command-line errors run the script in a subprocess (they fail before
TensorFlow is imported, so they are fast); two short end-to-end runs check
the printed epoch lines. The numeric tests build the example's graph in this
process and compare subdivided with full-batch training on real variables.
"""
import functools
import gzip
import os
import re
import socket
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPT = os.path.join(EXAMPLES, "fashion_mnist_subdivision.py")
sys.path.insert(0, EXAMPLES)

import fashion_mnist_subdivision as example  # noqa: E402
import idx_data  # noqa: E402

EPOCH_LINE = re.compile(r"^epoch (\d+): step (\d+), train loss (\d+\.\d{4}), test accuracy ([01]\.\d{4}), "
                        r"\d+\.\d s, peak memory \d+ MB$")


# ----------------------------------------------------------------- helpers


def write_fashion(directory, num_train=80, num_test=20, gz=True, seed=0):
    """Writes the four Fashion-MNIST files with random content; returns the arrays."""
    rng = np.random.RandomState(seed)
    arrays = {
        "train_images": rng.randint(0, 256, (num_train, 28, 28)).astype(np.uint8),
        "train_labels": (np.arange(num_train) % 10).astype(np.uint8),
        "test_images": rng.randint(0, 256, (num_test, 28, 28)).astype(np.uint8),
        "test_labels": (np.arange(num_test) % 10).astype(np.uint8),
    }
    os.makedirs(str(directory), exist_ok=True)
    for part, name in idx_data.FASHION_FILES.items():
        idx_data.write_idx(os.path.join(str(directory), name + (".gz" if gz else "")), arrays[part])
    return arrays


def run_script(args, home, timeout=240):
    """Runs the example with ``HOME`` = ``home`` (an empty Keras cache); returns the process."""
    env = dict(os.environ, HOME=str(home))
    env.pop("KERAS_HOME", None)
    return subprocess.run([sys.executable, SCRIPT] + list(args), env=env, cwd=str(home), timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)


def own_lines(text):
    """The lines of ``text`` that are not TensorFlow's or the progress bar's."""
    noise = ("WARNING", "I0000", "E0000", "W0000", "Instructions for updating", "non-resource variables",
             "Colocations handled")
    return [line for line in text.splitlines()
            if line.strip() and not line.startswith(noise)
            and not re.match(r"^(epoch \d+ micro-batch |\d{4}-\d\d-\d\d )", line)]


# -------------------------------------------------------------- IDX reader


@pytest.mark.parametrize("dtype", ["uint8", "int8", "int16", "int32", "float32", "float64"])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip(tmp_path, dtype, suffix):
    array = (np.arange(2 * 3 * 4).reshape(2, 3, 4) * 7 - 20).astype(dtype)
    path = str(tmp_path / ("a-idx3" + suffix))
    idx_data.write_idx(path, array)
    read = idx_data.read_idx(path)
    assert read.dtype == np.dtype(dtype) and read.shape == (2, 3, 4)
    np.testing.assert_array_equal(read, array)
    with open(path, "rb") as handle:
        assert handle.read(2) == (b"\x1f\x8b" if suffix else b"\x00\x00")  # gzip magic, IDX magic


def test_parse_idx_is_big_endian():
    raw = b"\x00\x00\x0b\x01" + b"\x00\x00\x00\x02" + b"\x01\x02\xff\xfe"
    np.testing.assert_array_equal(idx_data.parse_idx(raw), np.array([258, -2], np.int16))


_HEADER_2x2 = b"\x00\x00\x08\x02\x00\x00\x00\x02\x00\x00\x00\x02"


@pytest.mark.parametrize("raw, message", [
    (b"", r"is truncated: 0 bytes, the header alone needs 4"),
    (b"\x08\x03\x00\x00" + b"\x00" * 12, r"bad magic number 0x08030000"),
    (b"\x00\x00\x07\x01\x00\x00\x00\x01\x05", r"unknown dtype code 0x07"),
    (b"\x00\x00\x08\x03\x00\x00\x00\x02", r"truncated in its header: 3 dimensions need 16 bytes, found 8"),
    (_HEADER_2x2 + b"\x01\x02\x03", r"is truncated: shape \[2, 2\] of uint8 needs 4 data bytes, found 3"),
    (_HEADER_2x2 + b"\x01\x02\x03\x04\x05", r"longer than its header says: .* needs 4 data bytes, found 5"),
])
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_idx_rejects_corrupt_files(tmp_path, raw, message, suffix):
    path = str(tmp_path / ("bad-idx" + suffix))
    with (gzip.open if suffix else open)(path, "wb") as handle:
        handle.write(raw)
    with pytest.raises(ValueError, match=r"IDX file '%s' .*%s" % (re.escape(path), message)):
        idx_data.read_idx(path)


@pytest.mark.parametrize("make, message", [
    (lambda good: b"this is not gzip at all", r"is not a readable gzip/IDX file: Not a gzipped file"),
    (lambda good: good[:len(good) // 2], r"is not a readable gzip/IDX file: Compressed file ended"),
])
def test_read_idx_rejects_broken_gzip(tmp_path, make, message):
    path = str(tmp_path / "labels-idx1-ubyte.gz")
    idx_data.write_idx(path, np.arange(1000, dtype=np.int32))
    with open(path, "rb") as handle:
        good = handle.read()
    with open(path, "wb") as handle:
        handle.write(make(good))
    with pytest.raises(ValueError, match=r"IDX file '%s' %s" % (re.escape(path), message)):
        idx_data.read_idx(path)


def test_read_idx_missing_file_and_write_idx_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"IDX file '.*nothing-here' does not exist"):
        idx_data.read_idx(str(tmp_path / "nothing-here"))
    with pytest.raises(ValueError, match=r"`array` has dtype int64, which IDX cannot store"):
        idx_data.write_idx(str(tmp_path / "x"), np.zeros(3, np.int64))


# ------------------------------------------------------------------ loader


@pytest.mark.parametrize("gz", [True, False])
def test_load_from_data_dir_normalises(tmp_path, gz):
    arrays = write_fashion(tmp_path / "data", gz=gz)
    data = idx_data.load_dataset(str(tmp_path / "data"), cache_dir=str(tmp_path / "empty"), download=False)
    assert data.train_images.shape == (80, 28, 28, 1) and data.train_images.dtype == np.float32
    np.testing.assert_allclose(data.train_images[..., 0], arrays["train_images"] / 255.0, rtol=1e-6)
    np.testing.assert_allclose(data.test_images[..., 0], arrays["test_images"] / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(data.train_labels, arrays["train_labels"])
    assert data.test_labels.dtype == np.int32 and data.source == "Fashion-MNIST from %s" % (tmp_path / "data")


def _never_download():
    raise AssertionError("must not download")


def test_search_order_data_dir_then_home_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.setattr(idx_data, "_keras_load_data", _never_download)
    cache = tmp_path / "home" / ".keras" / "datasets" / "fashion-mnist"
    assert idx_data.keras_cache_dir() == str(cache)
    cached = write_fashion(cache, num_train=30, seed=1)
    given = write_fashion(tmp_path / "given", num_train=40, seed=2)
    notices = []
    from_dir = idx_data.load_dataset(str(tmp_path / "given"), log=notices.append)
    np.testing.assert_array_equal(from_dir.train_labels, given["train_labels"])
    from_cache = idx_data.load_dataset(None, log=notices.append)
    np.testing.assert_allclose(from_cache.train_images[..., 0], cached["train_images"] / 255.0, rtol=1e-6)
    assert from_cache.source == "Fashion-MNIST from %s" % cache and notices == []


def test_keras_home_moves_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "kh"))
    assert idx_data.keras_cache_dir() == str(tmp_path / "kh" / "datasets" / "fashion-mnist")


def test_missing_or_inconsistent_files_are_errors(tmp_path):
    write_fashion(tmp_path / "d")
    os.remove(str(tmp_path / "d" / "t10k-labels-idx1-ubyte.gz"))
    with pytest.raises(ValueError, match=r"`data_dir` \(--data-dir\) '.*d' does not hold Fashion-MNIST: "
                                         r"missing t10k-labels-idx1-ubyte.gz \(.gz or uncompressed\)$"):
        idx_data.load_dataset(str(tmp_path / "d"), download=False)
    idx_data.write_idx(str(tmp_path / "d" / "t10k-labels-idx1-ubyte.gz"), np.zeros(19, np.uint8))
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte.gz' must hold one label per image \(20\)"):
        idx_data.load_dataset(str(tmp_path / "d"), download=False)
    idx_data.write_idx(str(tmp_path / "d" / "t10k-labels-idx1-ubyte.gz"), np.full(20, 10, np.uint8))
    with pytest.raises(ValueError, match=r"must hold labels 0..9, found 10..10"):
        idx_data.load_dataset(str(tmp_path / "d"), download=False)


def test_corrupt_cache_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    write_fashion(tmp_path / "cache")
    with open(str(tmp_path / "cache" / "train-images-idx3-ubyte.gz"), "wb") as handle:
        handle.write(gzip.compress(b"\x01\x02\x08\x03" + b"\x00" * 12))
    monkeypatch.setattr(idx_data, "_keras_load_data", _never_download)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz' has a bad magic number"):
        idx_data.load_dataset(None, cache_dir=str(tmp_path / "cache"))


def test_fallback_to_digits_says_so_in_one_line(tmp_path, monkeypatch):
    timeouts = []

    def offline():
        timeouts.append(socket.getdefaulttimeout())
        print("Downloading data from https://example.invalid/train-labels-idx1-ubyte.gz")
        raise OSError("URL fetch failure: [Errno -2] Name or\nservice not known")

    monkeypatch.setattr(idx_data, "_keras_load_data", offline)
    notices, before = [], socket.getdefaulttimeout()
    data = idx_data.load_dataset(None, cache_dir=str(tmp_path), log=notices.append)
    assert timeouts == [idx_data.DOWNLOAD_TIMEOUT_SECONDS] and socket.getdefaulttimeout() == before
    assert len(notices) == 1 and "\n" not in notices[0]
    assert notices[0] == (
        "Fashion-MNIST not found (no --data-dir and no files in %s; download failed: URL fetch failure: "
        "[Errno -2] Name or service not known): falling back to scikit-learn's 8x8 digits upscaled to "
        "28x28 (NOT Fashion-MNIST), 1500 train / 297 test examples" % tmp_path)
    assert data.train_images.shape == (1500, 28, 28, 1) and data.test_images.shape == (297, 28, 28, 1)
    assert sorted(set(data.test_labels.tolist())) == list(range(10))


def test_digits_are_the_real_digits_upscaled_and_split_the_same_way():
    from sklearn.datasets import load_digits

    first, second = idx_data.load_digits_28x28(), idx_data.load_digits_28x28()
    np.testing.assert_array_equal(first.train_images, second.train_images)
    images = np.concatenate([first.train_images, first.test_images])[..., 0]
    labels = np.concatenate([first.train_labels, first.test_labels])
    assert images.min() == 0.0 and images.max() == 1.0
    assert np.all(images[:, :2] == 0) and np.all(images[:, 26:] == 0)
    blocks = images[:, 2:26, 2:26].reshape(-1, 8, 3, 8, 3)
    np.testing.assert_array_equal(blocks, np.broadcast_to(blocks[:, :, :1, :, :1], blocks.shape))
    digits = load_digits()
    key = lambda image, label: image.astype(np.int64).tobytes() + bytes([label])  # noqa: E731
    ours = sorted(key(image, label) for image, label in zip(blocks[:, :, 0, :, 0] * 16, labels))
    theirs = sorted(key(image, label) for image, label in zip(digits.images, digits.target))
    assert ours == theirs


def test_download_success_is_used_and_timeout_restored(tmp_path, monkeypatch):
    train = (np.full((3, 28, 28), 51, np.uint8), np.array([1, 2, 3], np.uint8))
    test = (np.zeros((2, 28, 28), np.uint8), np.array([4, 5], np.uint8))
    monkeypatch.setattr(idx_data, "_keras_load_data", lambda: (train, test))
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "kh"))
    notices, before = [], socket.getdefaulttimeout()
    data = idx_data.load_dataset(None, log=notices.append)
    assert notices == [] and data.source.startswith("Fashion-MNIST downloaded by tf.keras into ")
    np.testing.assert_allclose(data.train_images, np.full((3, 28, 28, 1), 0.2), rtol=1e-6)
    assert socket.getdefaulttimeout() == before


def test_no_download_when_told(tmp_path, monkeypatch):
    monkeypatch.setattr(idx_data, "_keras_load_data", _never_download)
    notices = []
    idx_data.load_dataset(None, cache_dir=str(tmp_path), download=False, log=notices.append)
    assert len(notices) == 1 and "no files in %s)" % tmp_path in notices[0]


# ------------------------------------------------------------ command line


def test_defaults_and_batch_fitting():
    args = example.parse_args([])
    assert (args.batch_size, args.subdivisions, args.max_steps, args.epochs) == (5000, 50, 60, None)
    assert example.parse_args(["--epochs", "2"]).max_steps is None
    notices = []
    assert example.fit_batch_to_data(example.parse_args([]), 1500, notices.append).batch_size == 1500
    assert example.fit_batch_to_data(example.parse_args(["--subdivisions", "7", "--batch-size", "5005"]),
                                     1500, notices.append).batch_size == 1498
    assert example.fit_batch_to_data(example.parse_args(["--no-subdivisions"]), 1500,
                                     notices.append).batch_size == 1500
    assert example.fit_batch_to_data(example.parse_args([]), 60000, notices.append).batch_size == 5000
    prefix = "note: `--batch-size` %d is larger than the 1500 training examples: using "
    assert notices == [
        prefix % 5000 + "1500 (50 micro-batches of 30)",
        prefix % 5005 + "1498 (7 micro-batches of 214)",
        prefix % 5000 + "1500 (1 micro-batch of 1500)",
    ]


def _corrupt_dir(tmp_path):
    write_fashion(tmp_path / "corrupt")
    with open(str(tmp_path / "corrupt" / "train-labels-idx1-ubyte.gz"), "wb") as handle:
        handle.write(gzip.compress(b"\x12\x34\x08\x01\x00\x00\x00\x50" + b"\x00" * 80))
    return str(tmp_path / "corrupt")


def _truncated_dir(tmp_path):
    write_fashion(tmp_path / "truncated", gz=False)
    path = str(tmp_path / "truncated" / "t10k-images-idx3-ubyte")
    with open(path, "rb") as handle:
        raw = handle.read()
    with open(path, "wb") as handle:
        handle.write(raw[:-10])
    return str(tmp_path / "truncated")


@pytest.mark.parametrize("make_args, expected", [
    (lambda p: ["--subdivisions", "0"], r"`--subdivisions` must be an int >= 1, got 0$"),
    (lambda p: ["--batch-size", "40", "--subdivisions", "50"],
     r"`--subdivisions` 50 is larger than `--batch-size` 40: each micro-batch needs an example$"),
    (lambda p: ["--batch-size", "100", "--subdivisions", "3"],
     r"`--batch-size` 100 is not divisible by `--subdivisions` 3: .* \(try `--batch-size` 99 or 102\)$"),
    (lambda p: ["--subdivisions", "many"], r"argument --subdivisions: invalid int value: 'many'$"),
    (lambda p: ["--width", "0"], r"`--width` must be an int >= 1, got 0$"),
    (lambda p: ["--towers", "-1"], r"`--towers` must be an int >= 1, got -1$"),
    (lambda p: ["--max-steps", "0"], r"`--max-steps` must be an int >= 1, got 0$"),
    (lambda p: ["--learning-rate", "0"], r"`--learning-rate` must be > 0, got 0.0$"),
    (lambda p: ["--bogus"], r"unrecognized arguments: --bogus$"),
    (lambda p: ["--data-dir", str(p / "absent")], r"`--data-dir` '.*absent' is not a directory$"),
    (lambda p: ["--data-dir", str(p)], r"`data_dir` \(--data-dir\) '.*' does not hold Fashion-MNIST: missing "
                                       r"train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, "),
    (lambda p: ["--data-dir", _corrupt_dir(p)],
     r"train-labels-idx1-ubyte.gz' has a bad magic number 0x12340801"),
    (lambda p: ["--data-dir", _truncated_dir(p)],
     r"t10k-images-idx3-ubyte' is truncated: shape \[20, 28, 28\]"),
    (lambda p: ["--data-dir", str(p / "small"), "--batch-size", "100", "--subdivisions", "50"],
     r"`--subdivisions` 50 is larger than the 8 training examples$"),
])
def test_bad_input_is_one_line_without_traceback(tmp_path, make_args, expected):
    write_fashion(tmp_path / "small", num_train=8, num_test=4)
    proc = run_script(make_args(tmp_path), tmp_path, timeout=60)
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(lines) == 1, lines
    assert lines[0].startswith("fashion_mnist_subdivision.py: error: ")
    assert re.search(expected, lines[0]), lines[0]


def _epoch_lines(stdout):
    found = [EPOCH_LINE.match(line) for line in stdout.splitlines() if line.startswith("epoch ")]
    assert all(found), stdout
    return [(int(m.group(1)), int(m.group(2)), float(m.group(3)), float(m.group(4))) for m in found]


def test_end_to_end_on_small_idx_files(tmp_path):
    write_fashion(tmp_path / "data", num_train=80, num_test=20)
    args = ["--data-dir", str(tmp_path / "data"), "--width", "2", "--batch-size", "40",
            "--subdivisions", "4", "--max-steps", "3"]
    proc = run_script(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = _epoch_lines(proc.stdout)
    # 80 examples in batches of 40: two updates in epoch 1, the third in epoch 2.
    assert [(e, s) for e, s, _, _ in epochs] == [(1, 2), (2, 3)]
    assert all(0 < loss < 10 and 0 <= acc <= 1 for _, _, loss, acc in epochs)
    assert own_lines(proc.stdout)[:3] == [
        "data: Fashion-MNIST from %s, 80 train / 20 test examples" % (tmp_path / "data"),
        "model: width 2 (channels 2..10, 0.00163 M parameters), Adam 0.01, 1 tower(s)",
        "batch 40 = 4 micro-batches of 10 through GradientAccumulator; 2 update(s) per epoch; "
        "stop after 3 updates",
    ]
    assert own_lines(proc.stdout)[-1].startswith("done: 3 updates in ")
    assert "Traceback" not in proc.stderr and re.search(r"epoch 1 micro-batch 8/8 ", proc.stderr)
    # The same --seed, the same losses: under TF2 behaviour too, where the
    # initialisers ignore the graph seed unless Python's random is seeded.
    assert _epoch_lines(run_script(args, tmp_path).stdout) == epochs


def test_end_to_end_fallback_plain_full_batch_on_two_towers(tmp_path):
    proc = run_script(["--offline", "--no-subdivisions", "--width", "2", "--max-steps", "1", "--towers", "2"],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = own_lines(proc.stdout)
    assert lines[0].startswith("Fashion-MNIST not found (no --data-dir and no files in %s" % tmp_path)
    assert lines[0].endswith("falling back to scikit-learn's 8x8 digits upscaled to 28x28 "
                             "(NOT Fashion-MNIST), 1500 train / 297 test examples")
    assert lines[1] == ("note: `--batch-size` 5000 is larger than the 1500 training examples: using 1500 "
                        "(1 micro-batch of 1500)")
    assert "batch 1500 = plain training, no accumulator" in proc.stdout and "2 tower(s)" in proc.stdout
    assert [(e, s) for e, s, _, _ in _epoch_lines(proc.stdout)] == [(1, 1)]


# ------------------------------------------------------------ the numbers


def _unfused_batch_norm():
    """Batch norm built unfused: the same function, another kernel.

    TF 1.15's CPU fused kernel leaves its batch-statistics outputs
    uninitialised in inference mode, and the moving-average update multiplies
    them by (1 - momentum) = 0, which keeps a NaN. Only running the train op
    with ``is_training=False``, as the exactness test below does, meets it.
    """
    original = tf.compat.v1.layers.batch_normalization
    return mock.patch.object(tf.compat.v1.layers, "batch_normalization",
                             functools.partial(original, fused=False))


class _Trainer(object):
    """The example's graph in a session of its own, trained in inference mode one update at a time."""

    def __init__(self, config, optimizer):
        self.parts = config.subdivisions or 1
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.compat.v1.set_random_seed(3)
            with _unfused_batch_norm():
                self.training = example.build_training(config, optimizer=optimizer)
            self.variables = dict((v.op.name, v) for v in tf.compat.v1.global_variables())
            init = tf.compat.v1.global_variables_initializer()
        session_config = tf.compat.v1.ConfigProto(device_count={"CPU": config.towers})
        self.sess = tf.compat.v1.Session(graph=self.graph, config=session_config)
        self.sess.run(init)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.sess.close()

    def values(self):
        """Every global variable's value, by name."""
        return self.sess.run(self.variables)

    def load(self, values):
        """Sets the variables named in ``values`` (all must exist here)."""
        with self.graph.as_default():
            for name, value in values.items():
                self.variables[name].load(value, self.sess)

    def update(self, images, labels):
        """One update: the batch in ``parts`` micro-batches, one run each."""
        for part in range(self.parts):
            chunk = slice(part * len(labels) // self.parts, (part + 1) * len(labels) // self.parts)
            feed = {self.training.images: images[chunk], self.training.labels: labels[chunk],
                    self.training.is_training: False}
            self.sess.run(self.training.train_op, feed)


OPTIMIZERS = {
    "sgd": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5),
    # Adam divides by |g|: with the default epsilon a gradient that sums to
    # float32 noise gets a full-size step of noise's sign. epsilon = 1e-3 keeps
    # the step smooth in g there (with the default, one start in ten was 6e-6 off).
    "adam": lambda: tf.compat.v1.train.AdamOptimizer(0.01, epsilon=1e-3),
}


def _batches():
    rng = np.random.RandomState(0)
    # 26 examples in 4 micro-batches of 6, 7, 6, 7: only weighting by size is exact.
    return [(rng.rand(26, 28, 28, 1).astype(np.float32), rng.randint(0, 10, 26).astype(np.int32))
            for _ in range(3)]


@pytest.mark.parametrize("optimizer, subdivisions, towers", [("sgd", 4, 1), ("adam", 4, 1), ("sgd", 4, 2)])
def test_subdivided_training_equals_full_batch_with_inference_batch_norm(optimizer, subdivisions, towers):
    # With batch norm in inference mode every example is independent, so the
    # weighted mean of micro-batch gradients is exactly the full-batch gradient.
    # (With batch statistics it is not: each micro-batch normalises by its own.)
    # SGD catches a wrong scale (a sum instead of a mean); Adam would hide it.
    with _Trainer(example.TrainingConfig(2, 0.01, subdivisions=None, towers=1), OPTIMIZERS[optimizer]()) as plain, \
            _Trainer(example.TrainingConfig(2, 0.01, subdivisions, towers), OPTIMIZERS[optimizer]()) as accumulated:
        before = plain.values()
        # The plain graph's variables (Adam's slots and powers, global_step) keep their
        # names; the accumulator adds its own, which carry over from update to update.
        assert set(before) < set(accumulated.variables) and "model/conv5/kernel" in before
        for images, labels in _batches():
            # Each update starts from the plain run's state: float32 sums in another
            # order differ in the last bits, and over several updates a leaky ReLU
            # whose input sits at 0 amplifies that (seen: 1% of an update's size).
            accumulated.load(before)
            plain.update(images, labels)
            accumulated.update(images, labels)
            expected, actual = plain.values(), accumulated.values()
            for name in expected:
                np.testing.assert_allclose(actual[name], expected[name], rtol=2e-5, atol=2e-6, err_msg=name)
            # The update is thousands of times the tolerance: the comparison has teeth.
            assert max(np.abs(expected[n] - before[n]).max() for n in expected if n.startswith("model/")) > 5e-3
            before = expected
    assert expected["global_step"] == 3


def test_batch_norm_moving_averages_update_on_every_micro_batch():
    rng = np.random.RandomState(1)
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(2)
        training = example.build_training(example.TrainingConfig(2, 0.01, subdivisions=3, towers=1))
        graph = tf.compat.v1.get_default_graph()
        conv1 = graph.get_tensor_by_name("model/conv1/Conv2D:0")
        moving_mean = [v for v in tf.compat.v1.global_variables() if v.op.name == "model/bn1/moving_mean"][0]
        kernel = [v for v in tf.compat.v1.global_variables() if v.op.name == "model/conv1/kernel"][0]
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            expected, kernel_before = sess.run(moving_mean), sess.run(kernel)
            for run in range(3):
                feed = {training.images: rng.rand(5, 28, 28, 1).astype(np.float32),
                        training.labels: rng.randint(0, 10, 5).astype(np.int32)}
                _, conv_out = sess.run([training.train_op, conv1], feed)
                batch_mean = conv_out.mean(axis=(0, 1, 2))
                expected = example.BN_MOMENTUM * expected + (1 - example.BN_MOMENTUM) * batch_mean
                np.testing.assert_allclose(sess.run(moving_mean), expected, rtol=1e-5, atol=1e-7)
                assert sess.run(training.global_step) == (1 if run == 2 else 0)
                assert np.array_equal(sess.run(kernel), kernel_before) == (run < 2)
