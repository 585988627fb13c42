"""Fashion-MNIST for the examples: a small IDX reader and a loader with fallbacks.

The IDX format (http://yann.lecun.com/exdb/mnist/) is two zero bytes, a dtype
code, the number of dimensions, one big-endian uint32 per dimension, then the
data, big-endian. ``read_idx`` checks all of it and raises a ``ValueError``
naming the file for a bad magic number, an unknown dtype code, a truncated
header or body, trailing bytes, or a broken gzip stream.

``load_dataset`` looks for the four standard files (``.gz`` or uncompressed),
in this order:

1. ``data_dir``, when given (its files missing or corrupt is an error);
2. Keras's cache, ``$KERAS_HOME/datasets/fashion-mnist`` or
   ``~/.keras/datasets/fashion-mnist``;
3. ``/usr/share/datasets/fashion-mnist``, where Debian's and Ubuntu's package
   ``dataset-fashion-mnist`` puts them (``apt-get install dataset-fashion-mnist``;
   the environment variable ``GRADACCUM_SYSTEM_DATASETS`` replaces
   ``/usr/share/datasets``);
4. a download through ``tf.keras.datasets.fashion_mnist.load_data()``,
   bounded by a socket timeout;
5. otherwise it falls back to scikit-learn's 8x8 handwritten digits (they
   ship inside the package), upscaled to 28x28, and says how to get the data.

Either way it logs one line: what it loaded, how many examples, from where.
A directory in steps 2 and 3 counts only when it holds all four files; a
corrupt file there is an error, not a reason to fall back.

Images come back as float32 ``[N, 28, 28, 1]`` in ``[0, 1]``, labels as int32.
This module imports TensorFlow only to download; it creates no graph state.
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

# IDX dtype codes -> big-endian numpy dtypes.
IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

# Dataset part -> the standard Fashion-MNIST file name (without ``.gz``).
FASHION_FILES = collections.OrderedDict([
    ("train_images", "train-images-idx3-ubyte"),
    ("train_labels", "train-labels-idx1-ubyte"),
    ("test_images", "t10k-images-idx3-ubyte"),
    ("test_labels", "t10k-labels-idx1-ubyte"),
])

# Test examples held out from the 1,797 digits (a fixed split: 1,500 train).
DIGITS_TEST_SIZE = 297
DOWNLOAD_TIMEOUT_SECONDS = 10.0
# Where Debian's and Ubuntu's package dataset-fashion-mnist installs the four files (gzipped);
# GRADACCUM_SYSTEM_DATASETS moves the root (the tests point it at an empty directory).
SYSTEM_DATASETS = "/usr/share/datasets"
DEBIAN_PACKAGE = "dataset-fashion-mnist"
# Where tf.keras.datasets.fashion_mnist downloads from.
DOWNLOAD_URL = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/"
DIGITS_LOCATION = "sklearn.datasets.load_digits"
HOW_TO_GET = ("to train on Fashion-MNIST: `apt-get install %s` (Debian/Ubuntu), or put the four IDX files "
              "in a directory and pass `--data-dir`" % DEBIAN_PACKAGE)

Dataset = collections.namedtuple(
    "Dataset", ["train_images", "train_labels", "test_images", "test_labels", "source", "name", "location"])
Dataset.__doc__ = """Images float32 [N, 28, 28, 1] in [0, 1] and labels int32, with where they came from.

Attributes:
  train_images, train_labels, test_images, test_labels: the arrays.
  source: a one-line description, e.g. ``"Fashion-MNIST from /data"``.
  name: ``"fashion-mnist"`` or ``"digits"``.
  location: the directory or URL the files came from (``DIGITS_LOCATION`` for the digits).
"""


def _open_bytes(path):
    """Returns the whole (decompressed) content of ``path``."""
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as handle:
                return handle.read()
        with open(path, "rb") as handle:
            return handle.read()
    except (OSError, EOFError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError.
        if isinstance(exc, FileNotFoundError):
            raise ValueError("IDX file %r does not exist" % path) from None
        raise ValueError("IDX file %r is not a readable gzip/IDX file: %s" % (path, exc)) from None


def parse_idx(raw, name="<bytes>"):
    """Parses the bytes of one IDX file into a numpy array.

    Args:
      raw: the uncompressed content of the file.
      name: the file's name, for error messages.

    Returns:
      A numpy array with the file's shape and native-endian dtype.

    Raises:
      ValueError: for a bad magic number, an unknown dtype code, or a header
        or body shorter or longer than the dimensions say.

    Example:
      >>> parse_idx(b"\\x00\\x00\\x08\\x01\\x00\\x00\\x00\\x02\\x07\\x09")
      array([7, 9], dtype=uint8)
    """
    if len(raw) < 4:
        raise ValueError("IDX file %r is truncated: %d bytes, the header alone needs 4" % (name, len(raw)))
    zero, code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0:
        raise ValueError("IDX file %r has a bad magic number 0x%08X (expected 0x0000 followed by a dtype "
                         "code and a rank)" % (name, struct.unpack(">I", raw[:4])[0]))
    if code not in IDX_DTYPES:
        raise ValueError("IDX file %r has an unknown dtype code 0x%02X (known: %s)"
                         % (name, code, ", ".join("0x%02X" % c for c in sorted(IDX_DTYPES))))
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError("IDX file %r is truncated in its header: %d dimensions need %d bytes, found %d"
                         % (name, ndim, header, len(raw)))
    dims = struct.unpack(">%dI" % ndim, raw[4:header])
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    found = len(raw) - header
    if found != expected:
        what = "truncated" if found < expected else "longer than its header says"
        raise ValueError("IDX file %r is %s: shape %s of %s needs %d data bytes, found %d"
                         % (name, what, list(dims), dtype.name, expected, found))
    array = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return array.astype(dtype.newbyteorder("="))


def read_idx(path):
    """Reads one IDX file, gzip-compressed when its name ends in ``.gz``.

    Args:
      path: the file's path.

    Returns:
      A numpy array with the file's shape and dtype.

    Raises:
      ValueError: when the file is missing, not valid gzip, or not valid IDX.

    Example:
      >>> labels = read_idx("train-labels-idx1-ubyte.gz")  # uint8 [60000]
    """
    return parse_idx(_open_bytes(path), name=path)


def write_idx(path, array):
    """Writes ``array`` as an IDX file, gzip-compressed when ``path`` ends in ``.gz``.

    Args:
      path: the file to write.
      array: a numpy array whose dtype is one of the IDX dtypes.

    Raises:
      ValueError: when the dtype has no IDX code.

    Example:
      >>> write_idx("labels-idx1-ubyte.gz", np.array([7, 9], np.uint8))
    """
    array = np.asarray(array)
    codes = {dtype.newbyteorder("="): code for code, dtype in IDX_DTYPES.items()}
    if array.dtype not in codes:
        raise ValueError("`array` has dtype %s, which IDX cannot store (uint8, int8, int16, int32, "
                         "float32, float64)" % array.dtype)
    buffer = io.BytesIO()
    buffer.write(struct.pack(">HBB", 0, codes[array.dtype], array.ndim))
    buffer.write(struct.pack(">%dI" % array.ndim, *array.shape))
    buffer.write(array.astype(IDX_DTYPES[codes[array.dtype]]).tobytes())
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wb") as handle:
        handle.write(buffer.getvalue())


def find_fashion_files(directory):
    """Finds the four Fashion-MNIST files in ``directory``, ``.gz`` preferred.

    Args:
      directory: a directory path.

    Returns:
      ``(paths, missing)``: a dict part -> path of the files found, and the
      list of standard file names that are not there.

    Example:
      >>> paths, missing = find_fashion_files("~/.keras/datasets/fashion-mnist")
    """
    paths, missing = {}, []
    for part, name in FASHION_FILES.items():
        candidates = [os.path.join(directory, name + suffix) for suffix in (".gz", "")]
        found = [path for path in candidates if os.path.isfile(path)]
        if found:
            paths[part] = found[0]
        else:
            missing.append(name + ".gz")
    return paths, missing


def _check_pair(images, labels, images_path, labels_path):
    if images.ndim != 3 or images.shape[1:] != (28, 28) or images.dtype != np.uint8:
        raise ValueError("IDX file %r must hold uint8 images of shape [N, 28, 28], got %s %s"
                         % (images_path, images.dtype, list(images.shape)))
    if labels.ndim != 1 or labels.shape[0] != images.shape[0]:
        raise ValueError("IDX file %r must hold one label per image (%d), got shape %s"
                         % (labels_path, images.shape[0], list(labels.shape)))
    if labels.size and (labels.min() < 0 or labels.max() > 9):
        raise ValueError("IDX file %r must hold labels 0..9, found %d..%d"
                         % (labels_path, labels.min(), labels.max()))


def _normalised(images, labels, scale):
    """Images as float32 [N, 28, 28, 1] in [0, 1]; labels as int32."""
    images = (np.asarray(images, np.float32) / np.float32(scale))[..., np.newaxis]
    return images, np.asarray(labels, np.int32)


def _fashion_dataset(train, test, source, location):
    train_images, train_labels = _normalised(train[0], train[1], 255.0)
    test_images, test_labels = _normalised(test[0], test[1], 255.0)
    return Dataset(train_images, train_labels, test_images, test_labels, source, "fashion-mnist", location)


def load_fashion_dir(directory):
    """Loads Fashion-MNIST from the four IDX files in ``directory``.

    Args:
      directory: a directory holding the four standard files.

    Returns:
      A ``Dataset``.

    Raises:
      ValueError: when a file is missing, corrupt, or of the wrong shape.

    Example:
      >>> data = load_fashion_dir("/data/fashion-mnist")
    """
    paths, missing = find_fashion_files(directory)
    if missing:
        raise ValueError("`data_dir` (--data-dir) %r does not hold Fashion-MNIST: missing %s (.gz or "
                         "uncompressed)" % (directory, ", ".join(missing)))
    arrays = {part: read_idx(path) for part, path in paths.items()}
    for split in ("train", "test"):
        _check_pair(arrays[split + "_images"], arrays[split + "_labels"],
                    paths[split + "_images"], paths[split + "_labels"])
    return _fashion_dataset((arrays["train_images"], arrays["train_labels"]),
                            (arrays["test_images"], arrays["test_labels"]),
                            "Fashion-MNIST from %s" % directory, directory)


def keras_cache_dir():
    """Returns where ``tf.keras`` caches Fashion-MNIST (honours ``KERAS_HOME``).

    Returns:
      A directory path, which may not exist.

    Example:
      >>> keras_cache_dir()
      '/home/me/.keras/datasets/fashion-mnist'
    """
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    return os.path.join(home, "datasets", "fashion-mnist")


def _keras_load_data():
    # Imported here: reading local files must not pay for (or need) TensorFlow.
    import tensorflow as tf

    return tf.keras.datasets.fashion_mnist.load_data()


def download_fashion(timeout=DOWNLOAD_TIMEOUT_SECONDS):
    """Downloads Fashion-MNIST through ``tf.keras`` into its cache, within a timeout.

    Keras's progress output is swallowed so that a failure costs no extra lines.

    Args:
      timeout: seconds any one socket operation may block.

    Returns:
      A ``Dataset``.

    Raises:
      Exception: whatever the download raised (offline: a URL fetch failure).

    Example:
      >>> data = download_fashion()
    """
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)  # urlretrieve has no timeout of its own.
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            (train_images, train_labels), (test_images, test_labels) = _keras_load_data()
    finally:
        socket.setdefaulttimeout(previous)
    return _fashion_dataset((train_images, train_labels), (test_images, test_labels),
                            "Fashion-MNIST downloaded from %s into %s" % (DOWNLOAD_URL, keras_cache_dir()),
                            DOWNLOAD_URL)


def load_digits_28x28(test_size=DIGITS_TEST_SIZE):
    """Loads scikit-learn's 8x8 digits, upscaled to 28x28, with a fixed split.

    Each pixel becomes a 3x3 block (24x24) with a 2-pixel border, the way MNIST
    centres its digits; values 0..16 become 0..1.

    Args:
      test_size: examples held out for the test set.

    Returns:
      A ``Dataset`` (1,500 train and 297 test examples by default).

    Example:
      >>> data = load_digits_28x28()
    """
    from sklearn.datasets import load_digits  # Only the fallback needs scikit-learn.

    digits = load_digits()
    images = np.kron(digits.images, np.ones((1, 3, 3)))
    images = np.pad(images, ((0, 0), (2, 2), (2, 2)), mode="constant")
    order = np.random.RandomState(0).permutation(len(images))  # The same split on every run.
    train, test = order[:-test_size], order[-test_size:]
    train_images, train_labels = _normalised(images[train], digits.target[train], 16.0)
    test_images, test_labels = _normalised(images[test], digits.target[test], 16.0)
    source = "scikit-learn's 8x8 digits upscaled to 28x28 (NOT Fashion-MNIST)"
    return Dataset(train_images, train_labels, test_images, test_labels, source, "digits", DIGITS_LOCATION)


def _one_line(exc):
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def describe(data):
    """Returns the one line that says what ``data`` is and where it came from.

    Args:
      data: a ``Dataset``.

    Returns:
      A string without newline.

    Example:
      >>> describe(load_dataset("/data/fashion-mnist"))
      'data: Fashion-MNIST from /data/fashion-mnist, 60000 train / 10000 test examples'
    """
    return "data: %s, %d train / %d test examples" % (data.source, len(data.train_labels), len(data.test_labels))


def system_dir():
    """Returns where the Debian package ``dataset-fashion-mnist`` puts the files.

    Returns:
      ``$GRADACCUM_SYSTEM_DATASETS/fashion-mnist``, by default
      ``/usr/share/datasets/fashion-mnist``; the directory may not exist.

    Example:
      >>> system_dir()
      '/usr/share/datasets/fashion-mnist'
    """
    return os.path.join(os.environ.get("GRADACCUM_SYSTEM_DATASETS") or SYSTEM_DATASETS, "fashion-mnist")


def _first_local(candidates):
    """Loads the first ``(label, directory)`` holding all four files; returns ``(data, reasons)``."""
    reasons = []
    for label, directory in candidates:
        if not find_fashion_files(directory)[1]:
            return load_fashion_dir(directory), reasons
        reasons.append("%s %s" % (label, directory))
    return None, reasons


def load_dataset(data_dir=None, cache_dir=None, system_data=True, download=True, log=print):
    """Loads Fashion-MNIST from the first source that has it, else the digits.

    Args:
      data_dir: optional directory that must hold the four IDX files.
      cache_dir: where Keras caches the files; ``None`` means ``keras_cache_dir()``.
      system_data: whether to look where the Debian package puts them (``system_dir()``).
      download: whether to try ``tf.keras.datasets.fashion_mnist.load_data()``.
      log: called with exactly one line: ``describe(data)``, and for the
        digits fallback where it looked and how to get Fashion-MNIST.

    Returns:
      A ``Dataset``.

    Raises:
      ValueError: when ``data_dir`` lacks the files, or a file found is corrupt.

    Example:
      >>> data = load_dataset(data_dir=None)  # cache, /usr/share/datasets, download, digits
    """
    if data_dir is not None:
        data = load_fashion_dir(data_dir)
        log(describe(data))
        return data
    cache_dir = keras_cache_dir() if cache_dir is None else cache_dir
    candidates = [("no files in", cache_dir)] + ([("nor in", system_dir())] if system_data else [])
    data, reasons = _first_local(candidates)
    if data is None and download:
        try:
            data = download_fashion()
        except Exception as exc:  # Any failure to download means: fall back.
            reasons.append("download failed: %s" % _one_line(exc))
    if data is not None:
        log(describe(data))
        return data
    data = load_digits_28x28()
    log("%s; Fashion-MNIST not found (no --data-dir, %s); %s"
        % (describe(data), ", ".join(reasons), HOW_TO_GET))
    return data
