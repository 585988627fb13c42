"""Fashion-MNIST for the examples, found wherever it is, in one line.

``load(data_dir=None, download=True)`` returns a ``Dataset`` (images float32
``[N, 28, 28, 1]`` in [0, 1], labels int32) from the first place that holds
the four standard IDX files (``.gz`` or not):

1. ``data_dir``, when given (a missing or corrupt file there is an error);
2. ``/usr/share/datasets/fashion-mnist``, from Debian's and Ubuntu's package
   ``dataset-fashion-mnist`` (``GRADACCUM_SYSTEM_DATASETS`` replaces
   ``/usr/share/datasets``);
3. the Keras cache, ``$KERAS_HOME/datasets/fashion-mnist`` (``~/.keras`` by default);
4. a download by ``tf.keras.datasets.fashion_mnist.load_data()`` (10 s timeout);
5. otherwise scikit-learn's 8x8 digits, upscaled to 28x28, with a line
   saying how to get Fashion-MNIST.

It prints one line: what it loaded, how many examples, from where.
A directory counts only when it holds all four files; a corrupt file is an
error (a ``ValueError`` naming it), never a reason to fall back.
"""
import collections
import contextlib
import gzip
import io
import os
import socket
import struct
import zlib

import numpy as np

FILES = collections.OrderedDict([
    ("train_images", "train-images-idx3-ubyte"), ("train_labels", "train-labels-idx1-ubyte"),
    ("test_images", "t10k-images-idx3-ubyte"), ("test_labels", "t10k-labels-idx1-ubyte")])
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
DOWNLOAD_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/"
DIGITS_SOURCE = "sklearn.datasets.load_digits"
HOW_TO_GET = ("to train on Fashion-MNIST: `apt-get install dataset-fashion-mnist` (Debian/Ubuntu), "
              "or put the four IDX files in a directory and pass `--data-dir`")

Dataset = collections.namedtuple(
    "Dataset", ["train_images", "train_labels", "test_images", "test_labels", "name", "source"])
Dataset.__doc__ = """The four arrays, ``name`` ("fashion-mnist" or "digits") and ``source``
(the directory or URL the files came from, or ``DIGITS_SOURCE``)."""


def parse_idx(raw, name="<bytes>"):
    """The array in the bytes of an IDX file; a ``ValueError`` naming ``name`` if they are not one.

    Example:
      >>> parse_idx(b"\\x00\\x00\\x08\\x01\\x00\\x00\\x00\\x02\\x07\\x09")
      array([7, 9], dtype=uint8)
    """
    if len(raw) < 4 or raw[:2] != b"\x00\x00" or raw[2] not in IDX_DTYPES:
        raise ValueError("IDX file %r has a bad header %r (expected 0x0000, a dtype code, a rank)"
                         % (name, raw[:4]))
    rank, dtype = raw[3], np.dtype(IDX_DTYPES[raw[2]])
    if len(raw) < 4 + 4 * rank:
        raise ValueError("IDX file %r is truncated in its header" % name)
    dims = struct.unpack(">%dI" % rank, raw[4:4 + 4 * rank])
    expected, found = int(np.prod(dims)) * dtype.itemsize, len(raw) - 4 - 4 * rank
    if found != expected:
        raise ValueError("IDX file %r is %s: shape %s needs %d data bytes, found %d" % (
            name, "truncated" if found < expected else "too long", list(dims), expected, found))
    return np.frombuffer(raw, dtype, offset=4 + 4 * rank).reshape(dims).astype(dtype.newbyteorder("="))


def read_idx(path):
    """Reads one IDX file (gzipped when its name ends in ``.gz``); a ``ValueError`` naming it."""
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as handle:
            raw = handle.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise ValueError("IDX file %r cannot be read: %s" % (path, exc)) from None
    return parse_idx(raw, path)


def write_idx(path, array):
    """Writes ``array`` (uint8, int8, int16, int32, float32 or float64) as an IDX file."""
    codes = {np.dtype(dtype).newbyteorder("="): code for code, dtype in IDX_DTYPES.items()}
    array = np.asarray(array)
    header = struct.pack(">HBB%dI" % array.ndim, 0, codes[array.dtype], array.ndim, *array.shape)
    with (gzip.open if path.endswith(".gz") else open)(path, "wb") as handle:
        handle.write(header + array.astype(IDX_DTYPES[codes[array.dtype]]).tobytes())


def find_files(directory):
    """``{part: path}`` of the four files in ``directory`` (``.gz`` preferred), or None if one is missing."""
    paths = {}
    for part, name in FILES.items():
        found = [p for p in (os.path.join(directory, name + s) for s in (".gz", "")) if os.path.isfile(p)]
        if not found:
            return None
        paths[part] = found[0]
    return paths


def _dataset(train, test, name, source, scale=255.0):
    def images(array):
        return (np.asarray(array, np.float32) / np.float32(scale))[..., np.newaxis]

    return Dataset(images(train[0]), np.asarray(train[1], np.int32), images(test[0]),
                   np.asarray(test[1], np.int32), name, source)


def load_dir(directory):
    """Loads the four files in ``directory``; a ``ValueError`` names what is missing or wrong."""
    paths = find_files(directory)
    if paths is None:
        raise ValueError("`--data-dir` %r does not hold Fashion-MNIST: it needs %s (.gz or not)"
                         % (directory, ", ".join(FILES.values())))
    arrays = {part: read_idx(path) for part, path in paths.items()}
    for split in ("train", "test"):
        images, labels = arrays[split + "_images"], arrays[split + "_labels"]
        if images.ndim != 3 or images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
            raise ValueError("IDX files %r and %r must hold [N, 28, 28] images and N labels, got %s and %s"
                             % (paths[split + "_images"], paths[split + "_labels"],
                                list(images.shape), list(labels.shape)))
    return _dataset((arrays["train_images"], arrays["train_labels"]),
                    (arrays["test_images"], arrays["test_labels"]), "fashion-mnist", directory)


def system_dir():
    """Where ``apt-get install dataset-fashion-mnist`` puts the files."""
    return os.path.join(os.environ.get("GRADACCUM_SYSTEM_DATASETS") or "/usr/share/datasets", "fashion-mnist")


def keras_cache_dir():
    """Where ``tf.keras`` caches Fashion-MNIST."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets", "fashion-mnist")


def download(timeout=10.0):
    """Downloads Fashion-MNIST through ``tf.keras`` into its cache (imports TensorFlow)."""
    import tensorflow as tf

    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)  # urlretrieve has no timeout of its own.
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # Keras's progress bar.
            train, test = tf.keras.datasets.fashion_mnist.load_data()
    finally:
        socket.setdefaulttimeout(previous)
    return _dataset(train, test, "fashion-mnist", DOWNLOAD_URL)


def load_digits(test_size=297):
    """scikit-learn's 1,797 8x8 digits, each pixel a 3x3 block plus a 2-pixel border; a fixed split."""
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    images = np.pad(np.kron(digits.images, np.ones((1, 3, 3))), ((0, 0), (2, 2), (2, 2)), "constant")
    order = np.random.RandomState(0).permutation(len(images))
    train, test = order[:-test_size], order[-test_size:]
    return _dataset((images[train], digits.target[train]), (images[test], digits.target[test]),
                    "digits", DIGITS_SOURCE, scale=16.0)


def describe(data):
    """The one line that says what ``data`` is and where it came from."""
    what = ("Fashion-MNIST" if data.name == "fashion-mnist"
            else "scikit-learn's 8x8 digits upscaled to 28x28 (NOT Fashion-MNIST)")
    where = "downloaded from %s into %s" % (data.source, keras_cache_dir()) if data.source == DOWNLOAD_URL \
        else "from %s" % data.source
    return "data: %s %s, %d train / %d test examples" % (what, where, len(data.train_labels),
                                                          len(data.test_labels))


def load(data_dir=None, download_ok=True, log=print):
    """Loads Fashion-MNIST from the first place that has it, else the digits; logs one line.

    Raises:
      ValueError: when ``data_dir`` lacks the files, or a file found is corrupt.

    Example:
      >>> data = load()   # data: Fashion-MNIST from /usr/share/datasets/fashion-mnist, ...
    """
    if data_dir is not None:
        data = load_dir(data_dir)
        log(describe(data))
        return data
    looked = []
    for directory in (system_dir(), keras_cache_dir()):
        if find_files(directory) is not None:
            data = load_dir(directory)
            log(describe(data))
            return data
        looked.append(directory)
    reason = "not in %s" % " nor in ".join(looked)
    if download_ok:
        try:
            data = download()
            log(describe(data))
            return data
        except Exception as exc:  # Offline, a proxy, a timeout: fall back.
            reason += "; download failed: %s" % (" ".join(str(exc).split())[:160] or type(exc).__name__)
    data = load_digits()
    log("%s; Fashion-MNIST %s; %s" % (describe(data), reason, HOW_TO_GET))
    return data
