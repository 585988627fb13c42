"""Keeps TensorFlow's start-up noise out of the examples' output; import it before TensorFlow.

What a user of the examples would otherwise see before the first line of
their own output, on TensorFlow 2.21 (and in other words on 1.15 to 2.20):

* ``WARNING: All log messages before absl::InitializeLog() is called are
  written to STDERR``, then ``I0000 ... oneDNN custom operations are on``,
  ``Could not find cuda drivers`` or, where CUDA libraries are installed
  without a GPU, ``E0000 ... failed call to cuInit``: written by C++ code
  during ``import tensorflow`` and again when tf-keras loads, before
  ``TF_CPP_MIN_LOG_LEVEL`` is in force;
* ``cpu_feature_guard`` notices when the first session starts;
* ``WARNING:tensorflow:From ...: ... is deprecated`` from
  ``disable_v2_behavior`` and, on TF 1.x, from every ``tf.compat.v1.layers`` call;
* ``UserWarning: `tf.layers.conv2d` is deprecated`` from tf-keras.

``before_import`` sets the environment (``TF_USE_LEGACY_KERAS`` where tf-keras
is installed, so that ``tf.compat.v1.layers`` works on TF >= 2.16, and
``TF_CPP_MIN_LOG_LEVEL=3`` unless verbose); ``native_stderr`` swallows what C++
code writes to file descriptor 2 inside its block, replaying it if the block
raises; ``after_import`` turns down TensorFlow's Python logger and the
deprecation warnings. With ``verbose=True`` all three leave everything as is.
"""
import contextlib
import importlib.util
import logging
import os
import sys
import tempfile
import warnings


def before_import(verbose=False):
    """Sets the environment TensorFlow reads when it is imported.

    Args:
      verbose: keep TensorFlow's C++ log level as the user has it.

    Example:
      >>> before_import(verbose="--verbose" in sys.argv)
    """
    # TF 1.15 to 2.15 have Keras 2 built in, and there the variable would break
    # tf.compat.v1.layers if tf_keras is absent: set it only when tf_keras is there.
    if importlib.util.find_spec("tf_keras") is not None:
        os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


@contextlib.contextmanager
def native_stderr(verbose=False):
    """Inside the block, drops what anything (C++ included) writes to stderr.

    If the block raises, what was written is replayed on stderr first, so an
    error is never hidden.

    Args:
      verbose: do nothing.

    Yields:
      Nothing.

    Example:
      >>> with native_stderr():
      ...     import tensorflow as tf
    """
    if verbose:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    sink = tempfile.TemporaryFile()
    os.dup2(sink.fileno(), 2)
    failed = True
    try:
        yield
        failed = False
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if failed:
            sink.seek(0)
            os.write(2, sink.read())
        sink.close()


def after_import(tf, verbose=False):
    """Turns down TensorFlow's Python logger and the v1 layers' deprecation warnings.

    Args:
      tf: the ``tensorflow`` module.
      verbose: do nothing.

    Example:
      >>> after_import(tf)
    """
    if verbose:
        return
    tf.compat.v1.logging.set_verbosity(tf.compat.v1.logging.ERROR)
    logging.getLogger("absl").setLevel(logging.ERROR)
    # The v1 layers are used on purpose (graph mode is the point of these examples).
    warnings.filterwarnings("ignore", message=r"`tf\.layers\.", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
