"""Tests of examples/: the IDX reader, the data loader, the command line and the model.

The command-line errors run the script in a subprocess (they fail before
TensorFlow is imported, so they are fast); short end-to-end runs check the
printed lines, the quiet stderr and ``--json``. The loader's search order is
checked on fake IDX trees (``GRADACCUM_SYSTEM_DATASETS`` points the Debian
package's place at one). ``test_end_to_end_on_real_fashion_mnist`` needs the
Debian package ``dataset-fashion-mnist``: it skips without it, and fails
instead when ``GRADACCUM_REQUIRE_FASHION_MNIST=1`` (CI installs the package
and sets it). The numeric tests build the example's graph in this process and
compare subdivided with full-batch training on real variables.
"""
import json
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
from test_statistics import _events  # noqa: E402

EPOCH_LINE = re.compile(r"^epoch (\d+): step (\d+), learning rate \S+, train loss (\d+\.\d{4}), test loss \d+\.\d{4}, "
                        r"test accuracy ([01]\.\d{4}), \d+\.\d s, peak memory \d+ MB$")
# progressbar2's line: the first update starts the clock, so its rate and ETA are not known yet.
PROGRESS_LINE = re.compile(r"^update (\d+)/(\d+|\?), loss (\d+\.\d{4}), (\d+|-) examples/s \[[# ]+\] "
                           r"ETA (\d+:\d\d:\d\d|--:--:--) *$")
REAL_DATA = "/usr/share/datasets/fashion-mnist"


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


def run_script(args, home, timeout=240, system_datasets=None):
    """Runs the example with ``HOME`` = ``home`` (an empty Keras cache); returns the process.

    ``system_datasets`` replaces ``/usr/share/datasets`` (default: ``home``, without Fashion-MNIST).
    """
    env = dict(os.environ, HOME=str(home), GRADACCUM_SYSTEM_DATASETS=str(system_datasets or home))
    env.pop("KERAS_HOME", None)
    return subprocess.run([sys.executable, SCRIPT] + list(args), env=env, cwd=str(home), timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)


def own_lines(text):
    """The lines of ``text`` that are not TensorFlow's or the progress bar's."""
    return [line for line in text.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]


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
    assert (data.name, data.location) == ("fashion-mnist", str(tmp_path / "data"))


def _never_download():
    raise AssertionError("must not download")


def _fake_sources(tmp_path, monkeypatch, present):
    """Fake IDX trees for the sources named in ``present``; returns ``{source: labels}``.

    Sources: ``given`` (--data-dir), ``cache`` (the Keras cache under a fake
    HOME), ``system`` (under a fake GRADACCUM_SYSTEM_DATASETS), ``download``
    (a fake tf.keras download); each has its own number of training examples.
    """
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.setenv("GRADACCUM_SYSTEM_DATASETS", str(tmp_path / "share"))
    places = {"given": tmp_path / "given", "cache": tmp_path / "home" / ".keras" / "datasets" / "fashion-mnist",
              "system": tmp_path / "share" / "fashion-mnist"}
    labels = {}
    for seed, source in enumerate(("given", "cache", "system"), 1):
        if source in present:
            labels[source] = write_fashion(places[source], num_train=10 * seed, seed=seed)["train_labels"]
        else:
            os.makedirs(str(places[source]))
            # An incomplete tree does not count: only all four files do.
            idx_data.write_idx(str(places[source] / "train-labels-idx1-ubyte.gz"), np.zeros(3, np.uint8))
    downloaded = (np.zeros((40, 28, 28), np.uint8), np.arange(40, dtype=np.uint8) % 10)
    monkeypatch.setattr(idx_data, "_keras_load_data", (lambda: (downloaded, downloaded)) if "download" in present
                        else _offline)
    labels["download"] = downloaded[1]
    return places, labels


def _offline():
    raise OSError("URL fetch failure: no network")


@pytest.mark.parametrize("present, expected", [
    (("given", "cache", "system", "download"), "given"),
    (("cache", "system", "download"), "cache"),
    (("system", "download"), "system"),
    (("download",), "download"),
    ((), "digits"),
])
def test_search_order(tmp_path, monkeypatch, present, expected):
    places, labels = _fake_sources(tmp_path, monkeypatch, present)
    assert idx_data.keras_cache_dir() == str(places["cache"]) and idx_data.system_dir() == str(places["system"])
    notices = []
    data = idx_data.load_dataset(str(places["given"]) if "given" in present else None, log=notices.append)
    assert len(notices) == 1, notices
    if expected == "digits":
        assert (data.name, data.location, len(data.train_labels)) == ("digits", idx_data.DIGITS_LOCATION, 1500)
        assert notices[0] == (
            "data: scikit-learn's 8x8 digits upscaled to 28x28 (NOT Fashion-MNIST), 1500 train / 297 test "
            "examples; Fashion-MNIST not found (no --data-dir, no files in %s, nor in %s, download failed: "
            "URL fetch failure: no network); to train on Fashion-MNIST: `apt-get install dataset-fashion-mnist` "
            "(Debian/Ubuntu), or put the four IDX files in a directory and pass `--data-dir`"
            % (places["cache"], places["system"]))
        return
    np.testing.assert_array_equal(data.train_labels, labels[expected])
    location = idx_data.DOWNLOAD_URL if expected == "download" else str(places[expected])
    assert (data.name, data.location) == ("fashion-mnist", location)
    assert notices == ["data: %s, %d train / %d test examples" % (data.source, len(labels[expected]),
                                                                   len(data.test_labels))]
    assert location in notices[0]


def test_system_data_can_be_skipped(tmp_path, monkeypatch):
    _fake_sources(tmp_path, monkeypatch, ("system",))
    notices = []
    data = idx_data.load_dataset(None, system_data=False, download=False, log=notices.append)
    assert data.name == "digits" and "nor in" not in notices[0]


def test_plain_and_gzipped_files_mix(tmp_path):
    write_fashion(tmp_path / "d", gz=False)
    os.remove(str(tmp_path / "d" / "t10k-labels-idx1-ubyte"))
    idx_data.write_idx(str(tmp_path / "d" / "t10k-labels-idx1-ubyte.gz"), (np.arange(20) % 10).astype(np.uint8))
    data = idx_data.load_fashion_dir(str(tmp_path / "d"))
    assert len(data.test_labels) == 20


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
    monkeypatch.setenv("GRADACCUM_SYSTEM_DATASETS", str(tmp_path))
    os.rename(str(tmp_path / "cache"), str(tmp_path / "fashion-mnist"))
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
    data = idx_data.load_dataset(None, cache_dir=str(tmp_path), system_data=False, log=notices.append)
    assert timeouts == [idx_data.DOWNLOAD_TIMEOUT_SECONDS] and socket.getdefaulttimeout() == before
    assert len(notices) == 1 and "\n" not in notices[0]
    assert notices[0] == (
        "data: scikit-learn's 8x8 digits upscaled to 28x28 (NOT Fashion-MNIST), 1500 train / 297 test examples; "
        "Fashion-MNIST not found (no --data-dir, no files in %s, download failed: URL fetch failure: "
        "[Errno -2] Name or service not known); %s" % (tmp_path, idx_data.HOW_TO_GET))
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
    data = idx_data.load_dataset(None, system_data=False, log=notices.append)
    assert notices == ["data: Fashion-MNIST downloaded from %s into %s, 3 train / 2 test examples"
                       % (idx_data.DOWNLOAD_URL, tmp_path / "kh" / "datasets" / "fashion-mnist")]
    assert data.location == idx_data.DOWNLOAD_URL
    np.testing.assert_allclose(data.train_images, np.full((3, 28, 28, 1), 0.2), rtol=1e-6)
    assert socket.getdefaulttimeout() == before


def test_no_download_when_told(tmp_path, monkeypatch):
    monkeypatch.setattr(idx_data, "_keras_load_data", _never_download)
    notices = []
    idx_data.load_dataset(None, cache_dir=str(tmp_path), system_data=False, download=False, log=notices.append)
    assert len(notices) == 1 and "no files in %s);" % tmp_path in notices[0]


# ------------------------------------------------------------ command line


def test_defaults_and_batch_fitting():
    args = example.parse_args([])
    assert (args.batch_size, args.subdivisions, args.max_steps, args.epochs) == (5000, 50, 120, None)
    assert (args.learning_rate, args.warmup_updates, args.bn_stats, args.json) == (0.003, 10, None, None)
    assert example.parse_args(["--epochs", "2"]).max_steps is None
    assert example.parse_args(["--logdir", "/tmp/runs"]).logdir == "/tmp/runs"
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
    (lambda p: ["--subdivisions", "many"], r"`--subdivisions` must be an int >= 1 or auto, got 'many'$"),
    (lambda p: ["--batch-schedule", "ramp:1,2"],
     r"`--batch-schedule` 'ramp:1,2': .*; expected ramp:START,INCREMENT,EXAMPLES .* or step:BATCH\[,BATCH@UPDATE"),
    (lambda p: ["--batch-schedule", "linear:5"], r"`--batch-schedule` 'linear:5': unknown kind 'linear'; expected "),
    (lambda p: ["--batch-schedule", "step:150,5000@3"],
     r"`--batch-schedule` 'step:150,5000@3': batch 150 is not a multiple of the micro-batch 100 \(--batch-size 5000 "
     r"/ --subdivisions 50\)$"),
    (lambda p: ["--batch-schedule", "step:500,1000@0"], r"'step:500,1000@0': the updates must increase from 1; "),
    (lambda p: ["--batch-schedule", "step:500@3"], r"'step:500@3': write BATCH first, then BATCH@UPDATE; "),
    (lambda p: ["--batch-schedule", "ramp:1000,1000,50000", "--batch-size", "4500", "--subdivisions", "45"],
     r"the ramp must climb from START by whole INCREMENTs to --batch-size 4500; "),
    (lambda p: ["--batch-schedule", "step:500", "--adaptive-batch"],
     r"`--batch-schedule` 'step:500' and `--adaptive-batch` both set the batch: choose one$"),
    (lambda p: ["--adaptive-batch", "--no-subdivisions"],
     r"`--adaptive-batch` does not combine with --no-subdivisions in this example$"),
    (lambda p: ["--batch-schedule", "step:500", "--subdivisions", "auto"],
     r"`--batch-schedule` does not combine with --subdivisions auto in this example$"),
    (lambda p: ["--subdivisions", "auto", "--no-subdivisions"],
     r"`--subdivisions` auto does not combine with --no-subdivisions in this example$"),
    (lambda p: ["--adaptive-batch", "--subdivisions", "1", "--batch-size", "100"],
     r"`--subdivisions` 1: --adaptive-batch needs at least 2 \(the largest batch's micro-batches\)$"),
    (lambda p: ["--width", "0"], r"`--width` must be an int >= 1, got 0$"),
    (lambda p: ["--towers", "-1"], r"`--towers` must be an int >= 1, got -1$"),
    (lambda p: ["--max-steps", "0"], r"`--max-steps` must be an int >= 1, got 0$"),
    (lambda p: ["--learning-rate", "0"], r"`--learning-rate` must be > 0, got 0.0$"),
    (lambda p: ["--warmup-updates", "-1"], r"`--warmup-updates` must be an int >= 0, got -1$"),
    (lambda p: ["--bn-momentum", "1"], r"`--bn-momentum` must be in \[0, 1\), got 1.0$"),
    (lambda p: ["--bn-stats", "both"], r"argument --bn-stats: invalid choice: 'both' \(choose from '?window'?, "),
    (lambda p: ["--json", str(p / "no" / "s.json")], r"`--json` '.*s.json': directory '.*no' does not exist$"),
    (lambda p: ["--bogus"], r"unrecognized arguments: --bogus$"),
    (lambda p: ["--no-subdivisions", "--logdir", str(p)],
     r"`--logdir` '.*': the summaries come from the accumulator, which --no-subdivisions leaves out$"),
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


def _check_quiet_progress(stderr, total):
    """stderr holds progress lines only (no TensorFlow noise), each with a real loss; a rate and an ETA
    from the second update on (none is made up before), and not a line per update (quiet redraws)."""
    lines = stderr.splitlines()
    assert lines and all(PROGRESS_LINE.match(line) for line in lines), stderr[-3000:]
    for index, line in enumerate(lines):
        done, of, loss, rate, eta = PROGRESS_LINE.match(line).groups()
        assert 1 <= int(done) <= total and of in (str(total), "?") and 0 < float(loss) < 10, line
        assert (rate == "-" and eta == "--:--:--") if int(done) == 1 else (int(rate) > 0 and eta != "--:--:--"), line
    assert PROGRESS_LINE.match(lines[0]).group(1) == "1" and PROGRESS_LINE.match(lines[-1]).group(1) == str(total)


def test_end_to_end_on_small_idx_files(tmp_path):
    write_fashion(tmp_path / "data", num_train=80, num_test=20)
    args = ["--data-dir", str(tmp_path / "data"), "--width", "2", "--batch-size", "40",
            "--subdivisions", "4", "--max-steps", "3", "--warmup-updates", "1", "--bn-stats", "micro",
            "--json", str(tmp_path / "run.json")]
    proc = run_script(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    epochs = _epoch_lines(proc.stdout)
    # 80 examples in batches of 40: two updates in epoch 1, the third in epoch 2.
    assert [(e, s) for e, s, _, _ in epochs] == [(1, 2), (2, 3)]
    assert all(0 < loss < 10 and 0 <= acc <= 1 for _, _, loss, acc in epochs)
    lines = own_lines(proc.stdout)
    assert lines[:3] == [
        "data: Fashion-MNIST from %s, 80 train / 20 test examples" % (tmp_path / "data"),
        "model: width 2 (channels 2..10, strides 1,2,2,1,1, flatten head, 0.00643 M parameters), batch norm "
        "micro statistics (momentum 0.9), 1 tower(s)",
        "batch 40 = 4 micro-batches of 10 through GradientAccumulator; 2 update(s) per epoch; 3 updates; "
        "Adam, learning rate 0.003 after 1 warm-up update(s), cosine decay to 0",
    ]
    assert re.match(r"^done: 3 updates in [\d.]+ s \([\d.]+ s training, [\d.]+ s CPU\), peak memory \d+ MB, "
                    r"test accuracy [01]\.\d{4}, [01]\.\d{4}$", lines[-1]), lines[-1]
    _check_quiet_progress(proc.stderr, 3)
    summary = json.load(open(str(tmp_path / "run.json")))
    assert list(summary)[:9] == ["dataset", "source", "train_examples", "test_examples", "updates",
                                 "test_accuracy", "final_test_accuracy", "seconds", "peak_rss_mb"]
    assert (summary["dataset"], summary["source"], summary["train_examples"], summary["test_examples"],
            summary["updates"]) == ("fashion-mnist", str(tmp_path / "data"), 80, 20, 3)
    assert summary["test_accuracy"] == [acc for _, _, _, acc in epochs] == pytest.approx(
        [summary["test_accuracy"][0], summary["final_test_accuracy"]], abs=5e-5)
    assert summary["examples_seen"] == [80, 120] and 0 < summary["peak_rss_mb"] < 1e5
    assert (summary["batch_per_epoch"], summary["updates_per_epoch"], summary["micro_batch_size"]) == ([40, 40],
                                                                                                      [2, 1], 10)
    assert 0 < summary["train_seconds"] < summary["seconds"]
    # The same --seed, the same losses: under TF2 behaviour too, where the
    # initialisers ignore the graph seed unless Python's random is seeded.
    assert _epoch_lines(run_script(args, tmp_path).stdout) == epochs


def test_verbose_lets_tensorflow_speak(tmp_path):
    write_fashion(tmp_path / "data", num_train=20, num_test=10)
    proc = run_script(["--data-dir", str(tmp_path / "data"), "--width", "1", "--batch-size", "20",
                       "--subdivisions", "2", "--max-steps", "1", "--verbose"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if not PROGRESS_LINE.match(line)]
    assert noise, proc.stderr  # TensorFlow's own lines, whatever the version prints.


def test_logdir_writes_the_accumulators_summaries_once_per_update(tmp_path):
    write_fashion(tmp_path / "data", num_train=20, num_test=10)
    proc = run_script(["--data-dir", str(tmp_path / "data"), "--width", "1", "--batch-size", "20",
                       "--subdivisions", "2", "--max-steps", "2", "--logdir", str(tmp_path / "runs")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = _events(tmp_path / "runs")
    assert events["gradaccum/effective_batch"] == [(1, 20.0), (2, 20.0)]
    assert [step for step, _ in events["gradaccum/noise_scale"]] == [1, 2]


def test_end_to_end_fallback_plain_full_batch_on_two_towers(tmp_path):
    proc = run_script(["--offline", "--no-subdivisions", "--width", "2", "--max-steps", "1", "--towers", "2",
                       "--bn-stats", "micro"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = own_lines(proc.stdout)
    assert lines[0].startswith("data: scikit-learn's 8x8 digits upscaled to 28x28 (NOT Fashion-MNIST), 1500 train "
                               "/ 297 test examples; Fashion-MNIST not found (no --data-dir, no files in %s"
                               % tmp_path)
    assert lines[0].endswith("; " + idx_data.HOW_TO_GET)
    assert lines[1] == ("note: `--batch-size` 5000 is larger than the 1500 training examples: using 1500 "
                        "(1 micro-batch of 1500)")
    assert "batch 1500 = plain training, no accumulator" in proc.stdout and "2 tower(s)" in proc.stdout
    assert [(e, s) for e, s, _, _ in _epoch_lines(proc.stdout)] == [(1, 1)]


def test_end_to_end_on_real_fashion_mnist(tmp_path):
    """The Debian package's files, found without --data-dir: 60,000 + 10,000 examples."""
    if not os.path.isdir(REAL_DATA):
        if os.environ.get("GRADACCUM_REQUIRE_FASHION_MNIST") == "1":
            pytest.fail("%s is missing but GRADACCUM_REQUIRE_FASHION_MNIST=1" % REAL_DATA)
        pytest.skip("Fashion-MNIST is not installed: apt-get install dataset-fashion-mnist")
    proc = run_script(["--offline", "--width", "2", "--batch-size", "1000", "--subdivisions", "2",
                       "--max-steps", "2", "--json", str(tmp_path / "real.json")], tmp_path,
                      system_datasets=os.path.dirname(REAL_DATA))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.load(open(str(tmp_path / "real.json")))
    assert (summary["dataset"], summary["source"], summary["train_examples"], summary["test_examples"],
            summary["updates"]) == ("fashion-mnist", REAL_DATA, 60000, 10000, 2)
    assert own_lines(proc.stdout)[0] == "data: Fashion-MNIST from %s, 60000 train / 10000 test examples" % REAL_DATA
    assert len(summary["test_accuracy"]) == 1 and 0 <= summary["final_test_accuracy"] <= 1
    assert 0 < summary["test_loss"][0] < 10


# ------------------------------------------------------------ elastic batches

ELASTIC = ["--width", "2", "--batch-size", "40", "--subdivisions", "4", "--epochs", "2"]  # Micro-batches of 10.


def _elastic_run(tmp_path, flags):
    """Runs the example on 80 training examples (8 micro-batches per epoch); returns stdout, --json, checkpoint."""
    write_fashion(tmp_path / "data", num_train=80, num_test=20)
    proc = run_script(["--data-dir", str(tmp_path / "data")] + ELASTIC + flags + [
        "--json", str(tmp_path / "run.json"), "--save", str(tmp_path / "model")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_quiet_progress(proc.stderr, json.load(open(str(tmp_path / "run.json")))["updates"])
    return proc.stdout, json.load(open(str(tmp_path / "run.json"))), _checkpoint_values(str(tmp_path / "model"))


def _expected_batches(k_at, runs_per_epoch=8, epochs=2, micro=10):
    """An independent model of the loop: update s has k_at(s) micro-batches, a window runs on into the next
    epoch, and the data's end applies what the last window holds. Returns the batches, updates per epoch."""
    batches, per_epoch, left, k = [], [], 0, 0
    for _ in range(epochs):
        before = len(batches)
        for _ in range(runs_per_epoch):
            if left == 0:
                k = left = k_at(len(batches))
            left -= 1
            if left == 0:
                batches.append(k * micro)
        per_epoch.append(len(batches) - before)
    if left:
        batches.append((k - left) * micro)
        per_epoch[-1] += 1
    return batches, per_epoch


def _ramp_k(step):
    import gradaccum

    ramp = gradaccum.batch_ramp(10, 10, 60, 40, micro_batch_size=10)  # The library's boundaries, in updates.
    return ramp.values[sum(1 for boundary in ramp.boundaries if step >= boundary)]


@pytest.mark.parametrize("schedule, k_at", [
    # k = 1, 1, 1, then 3 (its window runs on into epoch 2), then 2 to the end (the last window cut short).
    ("step:10,30@3,20@5", lambda step: 1 if step < 3 else 3 if step < 5 else 2),
    ("ramp:10,10,60", _ramp_k),
])
def test_batch_schedule_reports_the_batch_of_every_epoch(tmp_path, schedule, k_at):
    stdout, summary, checkpoint = _elastic_run(tmp_path, ["--batch-schedule", schedule])
    batches, per_epoch = _expected_batches(k_at)
    assert len(set(batches)) > 1  # Not vacuous: the batch changed.
    spans = [batches[sum(per_epoch[:i]):sum(per_epoch[:i + 1])] for i in range(2)]
    assert summary["batch_per_epoch"] == [int(round(np.mean(span))) for span in spans]
    assert summary["updates_per_epoch"] == per_epoch and summary["updates"] == len(batches)
    assert summary["examples_seen"] == [sum(spans[0]), 160] and summary["batch_schedule"] == schedule
    assert checkpoint["global_step"] == len(batches) and checkpoint["examples_seen"] == 160
    assert "batch per epoch: %s examples (mean per update); %d updates\n" % (
        ", ".join(str(b) for b in summary["batch_per_epoch"]), len(batches)) in stdout
    assert "batch by schedule %s = micro-batches of 10 through GradientAccumulator" % schedule in stdout


def test_adaptive_batch_reports_the_batches_its_policy_chose(tmp_path):
    import _fashion_run

    stdout, summary, checkpoint = _elastic_run(tmp_path, ["--adaptive-batch", "--logdir", str(tmp_path / "runs")])
    # The accumulator's own record of every applied window's examples (the last, cut short, is not summarised).
    applied = [batch for _, batch in _events(tmp_path / "runs")["gradaccum/effective_batch"]]
    applied += [160 - sum(applied)] if sum(applied) < 160 else []
    per_epoch = summary["updates_per_epoch"]
    assert len(applied) == summary["updates"] == sum(per_epoch) == checkpoint["global_step"]
    assert summary["batch_per_epoch"] == [int(round(np.mean(applied[:per_epoch[0]]))),
                                          int(round(np.mean(applied[per_epoch[0]:])))]
    assert all(20 <= batch <= 40 for batch in applied[:-1]) and summary["examples_seen"][-1] == 160
    assert 2 <= checkpoint["adaptive_batch/num_micro_batches"] <= 4
    factor = _fashion_run.ADAPTIVE_FACTOR
    assert summary["adaptive_batch"] == ("AdaptiveBatch(micro_batch_size=10, factor=%g, min_micro_batches=2, "
                                         "max_micro_batches=4, threshold=0.25, base_batch=40, rule='adam')" % factor)
    assert "batch from the gradient noise scale (gradaccum.AdaptiveBatch, factor %g) = 2..4 micro-batches of 10" \
        % factor in stdout


def test_subdivisions_auto_finds_a_micro_batch_that_runs(tmp_path):
    write_fashion(tmp_path / "data", num_train=80, num_test=20)
    proc = run_script(["--data-dir", str(tmp_path / "data"), "--width", "2", "--batch-size", "40", "--subdivisions",
                       "auto", "--max-steps", "2", "--json", str(tmp_path / "run.json")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Without a memory limit the whole batch runs at once: one micro-batch of 40.
    assert own_lines(proc.stdout)[1] == ("subdivisions auto: 1 micro-batch(es) of 40 for a batch of 40 (largest "
                                         "micro-batch that ran: 40)")
    summary = json.load(open(str(tmp_path / "run.json")))
    assert (summary["subdivisions"], summary["batch_size"], summary["updates"]) == (1, 40, 2)


def test_progress_bar_is_quiet_off_a_terminal_and_redraws_in_place_on_one():
    import io

    import _fashion_run

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream in (io.StringIO(), Terminal()):
        bar = _fashion_run.ProgressBar(100000, 1000, stream=stream)
        for update in range(1000):
            bar.update(100 * (update + 1), 0.5)
        bar.redraw()
        bar.finish()
        lines = [line.strip() for line in re.split("[\r\n]", stream.getvalue()) if line.strip()]
        # The first update (no rate yet) and the end: 1,000 updates within 0.5 s draw nothing in between.
        assert [PROGRESS_LINE.match(line).group(1) for line in lines] == ["1", "1000"], lines
        assert ("\r" in stream.getvalue()) == stream.isatty() and stream.getvalue().endswith("\n")


def test_the_example_reads_as_the_recipe():
    with open(SCRIPT) as handle:
        text = handle.read()
    assert len(text.splitlines()) <= 250
    # Top to bottom: data, model, the accumulator, the micro-batch loop, evaluation.
    steps = ["run.prepare(", "def build_logits(", "gradaccum.GradientAccumulator(", "def train_epoch(",
             "def evaluate("]
    assert [text.index(step) for step in steps] == sorted(text.index(step) for step in steps)
    sources = {}
    for name in os.listdir(EXAMPLES):
        if name.endswith(".py"):
            with open(os.path.join(EXAMPLES, name)) as handle:
                sources[name] = handle.read()
    assert [name for name, source in sources.items() if re.search(r"class Progress\(|\\r%s|\\033\[K", source)] == []
    assert "import progressbar" in sources["_fashion_run.py"]


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
                momentum = example.BN_MOMENTUM["micro"]
                expected = momentum * expected + (1 - momentum) * batch_mean
                np.testing.assert_allclose(sess.run(moving_mean), expected, rtol=1e-5, atol=1e-7)
                assert sess.run(training.global_step) == (1 if run == 2 else 0)
                assert np.array_equal(sess.run(kernel), kernel_before) == (run < 2)


def _moving_mean_and_conv1(training):
    graph = tf.compat.v1.get_default_graph()
    moving_mean = [v for v in tf.compat.v1.global_variables() if v.op.name == "model/bn1/moving_mean"][0]
    return moving_mean, graph.get_tensor_by_name("model/conv1/Conv2D:0")


def test_window_batch_norm_moves_once_per_update_from_the_whole_window():
    rng = np.random.RandomState(1)
    with tf.Graph().as_default():
        tf.compat.v1.set_random_seed(2)
        config = example.TrainingConfig(2, 0.01, subdivisions=3, towers=1, bn_stats="window", bn_momentum=0.5)
        # Learning rate 0: the convolution does not move, so the window's statistics are known.
        training = example.build_training(config, optimizer=tf.compat.v1.train.GradientDescentOptimizer(0.0))
        moving_mean, conv1 = _moving_mean_and_conv1(training)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            before, outputs = sess.run(moving_mean), []
            for run, size in enumerate((4, 5, 6)):  # Uneven micro-batches: pooled by example count.
                feed = {training.images: rng.rand(size, 28, 28, 1).astype(np.float32),
                        training.labels: rng.randint(0, 10, size).astype(np.int32)}
                outputs.append(sess.run([training.train_op, conv1], feed)[1])
                if run < 2:
                    np.testing.assert_array_equal(sess.run(moving_mean), before)
            window_mean = np.concatenate(outputs).mean(axis=(0, 1, 2))
            np.testing.assert_allclose(sess.run(moving_mean), 0.5 * before + 0.5 * window_mean, rtol=1e-5, atol=1e-6)
            # Teeth: three per-micro-batch updates would land elsewhere.
            per_micro = before
            for output in outputs:
                per_micro = 0.5 * per_micro + 0.5 * output.mean(axis=(0, 1, 2))
            assert np.abs(per_micro - window_mean * 0.5 - before * 0.5).max() > 1e-3


def test_learning_rate_schedule_matches_its_python_twin():
    with tf.Graph().as_default():
        step = tf.compat.v1.placeholder(tf.int64, [])
        rates = {args: example.learning_rate_schedule(step, *args) for args in
                 [(0.003, 10, 120), (0.003, 0, 50), (0.01, 5, None), (0.02, 0, None)]}
        with tf.compat.v1.Session() as sess:
            for args, rate in rates.items():
                for value in (0, 1, 4, 9, 10, 11, 60, 119, 120, 500):
                    np.testing.assert_allclose(sess.run(rate, {step: value}), example.learning_rate_at(value, *args),
                                               rtol=1e-6, atol=1e-9)
    at = functools.partial(example.learning_rate_at, peak=0.003, warmup_updates=10, total_updates=120)
    assert at(0) == pytest.approx(0.0003) and at(9) == pytest.approx(0.003) and at(10) == pytest.approx(0.003)
    assert at(65) == pytest.approx(0.0015) and at(120) == 0.0 and at(119) > 0
    assert all(at(s) >= at(s + 1) for s in range(10, 120))


def test_bad_strides_are_one_line(tmp_path):
    proc = run_script(["--strides", "2,2"], tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stderr == (
        "fashion_mnist_subdivision.py: error: `--strides` must be five strides of 1 or 2, like 1,2,2,1,1, "
        "got '2,2'\n")
    assert example.parse_args(["--strides", "2,2,1,1,1"]).strides == (2, 2, 1, 1, 1)


# ------------------------------------------------------------ compare_batches


def test_compare_batches_same_examples_and_replot(tmp_path):
    import compare_batches

    args, rest = compare_batches.parse_args(["--epochs", "3", "--bn-momentum", "0.5", "--width", "4",
                                             "--out-dir", str(tmp_path)])
    assert rest == ["--width", "4"]
    names = ("subdivided", "full", "small", "adaptive")
    flags = {name: compare_batches.run_flags(name, args, rest) for name in names}
    assert flags["subdivided"] == ["--batch-size", "5000", "--subdivisions", "50", "--epochs", "3",
                                   "--warmup-updates", "10", "--bn-momentum", "0.5", "--width", "4"]
    assert flags["full"][:3] == ["--batch-size", "5000", "--no-subdivisions"]
    assert flags["small"] == ["--batch-size", "100", "--no-subdivisions", "--epochs", "3", "--warmup-updates",
                              "500", "--learning-rate", "0.001", "--bn-momentum", "0.9862", "--width", "4"]
    # The adaptive run: the 5,000 runs' flags and learning rate, nothing tuned for the batch it picks.
    assert flags["adaptive"] == ["--batch-size", "5000", "--subdivisions", "50", "--adaptive-batch", "--epochs", "3",
                                 "--warmup-updates", "10", "--bn-momentum", "0.5", "--width", "4"]
    for index, name in enumerate(names):
        summary = {"updates": 36 * (50 if name == "small" else 1), "test_accuracy": [0.8, 0.85, 0.9 - index / 100.0],
                   "test_loss": [0.5, 0.4, 0.3], "examples_seen": [60000, 120000, 180000], "seconds": 100 + index,
                   "cpu_seconds": 190.0, "peak_rss_mb": 900.0 + 1000 * (name == "full"),
                   "source": "/usr/share/datasets/fashion-mnist", "batch_size": 100 if name == "small" else 5000}
        if name == "adaptive":
            summary.update(updates=500, batch_per_epoch=[200, 300, 600], updates_per_epoch=[300, 100, 100])
        with open(str(tmp_path / ("compare_%s.json" % name)), "w") as handle:
            json.dump(summary, handle)
    assert compare_batches.updates(summary) == [300, 400, 500]
    assert compare_batches.updates(dict(summary, updates_per_epoch=None)) == [12, 24, 36]
    compare_batches.main(["--replot", "--out-dir", str(tmp_path)])
    assert (tmp_path / "compare_batches.png").stat().st_size > 10000
    assert (tmp_path / "compare_batches.md").read_text().splitlines()[2:] == [
        "| 5,000 in 50 subdivisions of 100 | 5000 | 36 | 0.8500, 0.9000 | 0.3000 | 100 s | 190 s | 900 MB |",
        "| 5,000 at once | 5000 | 36 | 0.8500, 0.8900 | 0.3000 | 101 s | 190 s | 1900 MB |",
        "| 100, no accumulation | 100 | 1800 | 0.8500, 0.8800 | 0.3000 | 102 s | 190 s | 900 MB |",
        "| adaptive: 2 to 50 micro-batches of 100 by the noise scale | 200, 600 | 500 | 0.8500, 0.8700 | 0.3000 "
        "| 103 s | 190 s | 900 MB |",
    ]
    os.remove(str(tmp_path / "compare_full.json"))
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "compare_batches.py"), "--replot", "--out-dir",
                           str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    assert proc.returncode == 2 and proc.stderr == (
        "compare_batches.py: error: no summary %r to read: train run 'full' first\n"
        % str(tmp_path / "compare_full.json"))
    (tmp_path / "compare_full.json").write_text("{not json")
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "compare_batches.py"), "--replot", "--out-dir",
                           str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)
    assert proc.returncode == 2 and proc.stderr.startswith(
        "compare_batches.py: error: summary %r cannot be read: " % str(tmp_path / "compare_full.json"))
    assert len(proc.stderr.splitlines()) == 1


# ------------------------------------------------------------ collective workers


def _checkpoint_values(prefix):
    reader = tf.train.load_checkpoint(prefix)
    return dict((name, reader.get_tensor(name)) for name in reader.get_variable_to_shape_map())


def test_workers_must_share_the_micro_batches_evenly(tmp_path):
    spec = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]}, "task": {"type": "worker",
                                                                                           "index": 0}}
    env = dict(os.environ, TF_CONFIG=json.dumps(spec))
    proc = subprocess.run([sys.executable, SCRIPT, "--batch-size", "40", "--subdivisions", "4"], env=env,
                          cwd=str(tmp_path), timeout=60, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          universal_newlines=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "fashion_mnist_subdivision.py: error: `--subdivisions` 4 must be divisible by the 3 workers (each runs "
        "4/3 of every update's micro-batches), e.g. 3"]


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_two_collective_workers_train_the_variables_of_one_process(tmp_path):
    """Under the launcher each worker runs half of every update's micro-batches; the chief alone
    reports. The trained variables and Adam's slots equal one process's run of the same flags."""
    write_fashion(tmp_path / "data", num_train=80, num_test=20)
    common = ["--data-dir", str(tmp_path / "data"), "--width", "2", "--batch-size", "40", "--subdivisions", "4",
              "--max-steps", "3", "--warmup-updates", "1"]
    one = run_script(common + ["--save", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    env = dict(os.environ, HOME=str(tmp_path), GRADACCUM_SYSTEM_DATASETS=str(tmp_path))
    job = subprocess.run([sys.executable, "-m", "gradaccum.launch", "--workers", "2", "--", sys.executable, SCRIPT]
                         + common + ["--save", str(tmp_path / "two"), "--json", str(tmp_path / "two.json")],
                         env=env, cwd=ROOT, timeout=200, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         universal_newlines=True)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    worker_1 = [line for line in job.stdout.splitlines() if line.startswith("[worker:1]")]
    assert [line.split("]", 1)[1].split(":")[0].strip() for line in worker_1] == ["data"], worker_1
    assert "2 per worker on 2 workers" in job.stdout and json.load(open(str(tmp_path / "two.json")))["updates"] == 3
    ours, reference = _checkpoint_values(str(tmp_path / "two")), _checkpoint_values(str(tmp_path / "one"))
    compared = [name for name in reference if name.startswith("model/") and "moving_" not in name
                and "window_" not in name and not name.endswith("/GradientAccumulator")]
    assert len(compared) >= 30 and ours["global_step"] == reference["global_step"] == 3
    for name in compared:
        np.testing.assert_allclose(ours[name], reference[name], rtol=1e-5, atol=1e-7, err_msg=name)
    # Not vacuous: training moved every kernel away from where it started.
    assert not np.allclose(ours["model/conv1/kernel/Adam"], 0)


# ------------------------------------------------------- bert_style_finetune.py

BERT_SCRIPT = os.path.join(EXAMPLES, "bert_style_finetune.py")


def run_bert_example(args, cwd, timeout=240):
    return subprocess.run([sys.executable, BERT_SCRIPT] + list(args), cwd=str(cwd), timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, universal_newlines=True)


def test_bert_style_finetune_counts_windows_and_follows_the_schedule(tmp_path):
    """global_step is the number of applied windows (no hand-written increment), so the
    warm-up and the decay follow updates, not micro-batches; the loss comes down."""
    proc = run_bert_example(["--train-steps", "12", "--micro-batches", "4", "--micro-batch", "16",
                             "--warmup-proportion", "0.25", "--learning-rate", "5e-3", "--hidden", "16",
                             "--json", str(tmp_path / "run.json")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert re.match(r"^data: scikit-learn's bundled digits from \S+digits\.csv\.gz: 1797 images of 8x8, "
                    r"1437 to train, 360 to test$", lines[0]), lines[0]
    assert lines[-1].startswith("global_step 12 after 48 micro-batches (one per applied window); test accuracy ")
    figures = json.load(open(str(tmp_path / "run.json")))
    assert figures["global_step"] == figures["updates"] == 12 and figures["micro_batches_run"] == 48
    # BERT's schedule on the step before each update: warm-up over 3 updates, then linear decay to 0 at 12.
    expected = [5e-3 * step / 3 if step < 3 else 5e-3 * (1 - step / 12.0) for step in range(12)]
    np.testing.assert_allclose(figures["learning_rates"], expected, rtol=1e-6, atol=1e-9)
    assert np.mean(figures["losses"][-3:]) < np.mean(figures["losses"][:3]) - 0.05, figures["losses"]


@pytest.mark.parametrize("flag, value, message", [
    ("--warmup-proportion", "1.5", "`--warmup-proportion` must be in [0, 1], got 1.5"),
    ("--micro-batches", "0", "argument --micro-batches: `--micro-batches` must be an int >= 1, got '0'"),
    ("--learning-rate", "0", "`--learning-rate` must be > 0, got 0.0"),
])
def test_bert_style_finetune_bad_flags_are_one_line(tmp_path, flag, value, message):
    proc = run_bert_example([flag, value], tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == ["bert_style_finetune.py: error: " + message]
