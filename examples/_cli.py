"""Command-line helpers shared by the examples: bad input is one line and exit status 2.

A user who mistypes a flag should see one sentence naming the flag and the
value, not argparse's usage block or a traceback. This module creates no
TensorFlow state.
"""
import argparse
import os
import sys


def fail(message, status=2):
    """Prints ``message`` as one line on stderr and exits with ``status``.

    Args:
      message: the error, naming the flag in backticks (an exception is fine).
      status: the exit status: 2 for bad input (default), 1 for a failed run.

    Example:
      >>> fail("`--micro-batches` must be an int >= 1, got 0")
    """
    sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]) or "example",
                                          " ".join(str(message).split())))
    sys.exit(status)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, without the usage text.

    Example:
      >>> parser = OneLineParser(description="Trains a model.")
    """

    def error(self, message):
        fail(message)


def positive_int(flag):
    """Returns an argparse ``type`` that accepts an int >= 1 for ``flag``.

    Args:
      flag: the flag's name, for the message, e.g. ``"--epochs"``.

    Returns:
      A function from the flag's text to an int.

    Example:
      >>> parser.add_argument("--epochs", type=positive_int("--epochs"), default=2)
    """
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError("`%s` must be an int >= 1, got %r" % (flag, text))
        return value

    return parse


def small_model_parser(description, micro_batch_help, seed_help):
    """Returns a parser with the flags the small-model examples share.

    ``keras_fit.py`` and ``estimator.py`` train the same MLP on the same data;
    each adds its own flags (epochs, or steps and a model directory) after these.

    Args:
      description: the script's one-line description.
      micro_batch_help: the help text of ``--micro-batch``.
      seed_help: the help text of ``--seed``.

    Returns:
      A :class:`OneLineParser`; parse it with :func:`parse_checked`.

    Example:
      >>> parser = small_model_parser("Trains.", "examples per micro-batch", "graph seed")
    """
    parser = OneLineParser(description=description)
    add = parser.add_argument
    add("--micro-batch", type=positive_int("--micro-batch"), default=100, help=micro_batch_help)
    add("--micro-batches", type=positive_int("--micro-batches"), default=4,
        help="micro-batches per update, the accumulator's k (default 4)")
    add("--train-examples", type=positive_int("--train-examples"), default=None,
        help="use only the first N training examples (default: all)")
    add("--hidden", type=positive_int("--hidden"), default=128, help="hidden units (128)")
    add("--learning-rate", type=float, default=1e-3, help="Adam's (default 1e-3)")
    add("--data-dir", default=None, help="a directory with the four Fashion-MNIST files")
    add("--offline", action="store_true", help="do not try to download")
    add("--seed", type=int, default=0, help=seed_help)
    add("--verbose", action="store_true", help="show TensorFlow's logs")
    return parser


def parse_checked(parser, argv):
    """Parses ``argv`` with a :func:`small_model_parser` and checks the learning rate.

    Args:
      parser: the parser, with the script's own flags added.
      argv: the arguments, without the program name.

    Returns:
      An ``argparse.Namespace``; bad input exits with one line and status 2.

    Example:
      >>> args = parse_checked(parser, ["--epochs", "1"])
    """
    args = parser.parse_args(argv)
    if not args.learning_rate > 0:
        fail("`--learning-rate` must be > 0, got %r" % args.learning_rate)
    return args


def load_data(args, log):
    """Loads Fashion-MNIST as ``--data-dir`` and ``--offline`` say; a bad file is one line.

    Args:
      args: the parsed flags.
      log: called with the one-line description of what was loaded from where.

    Returns:
      An ``idx_data.Dataset``.

    Example:
      >>> data = load_data(args, print)
    """
    import idx_data  # Beside this file; imported here so that _cli stays light.

    try:
        return idx_data.load_dataset(args.data_dir, download=not args.offline, log=log)
    except ValueError as exc:
        fail(exc)


def prepare(parse_args, argv=None, log=print):
    """Parses the flags and loads the data, as a small-model example starts.

    Args:
      parse_args: the script's flag parser, called with ``argv``.
      argv: the arguments, without the program name.
      log: called with the one-line description of the data.

    Returns:
      ``(args, data)``: the flags and an ``idx_data.Dataset``.

    Example:
      >>> args, data = prepare(parse_args, ["--train-examples", "2000"])
    """
    args = parse_args(argv)
    return args, load_data(args, log)


def graph_mode(tf):
    """Enters graph mode as ``GRADACCUM_TF_MODE`` says: TF1 behaviour (default) or TF2's (``tf2``).

    ``tf2`` disables eager execution only, so variables are resource
    variables: the test suite's second behaviour.

    Args:
      tf: the ``tensorflow`` module (imported by the caller, after ``_quiet``).

    Example:
      >>> graph_mode(tf)
    """
    if os.environ.get("GRADACCUM_TF_MODE", "tf1") == "tf2":
        tf.compat.v1.disable_eager_execution()
    else:
        tf.compat.v1.disable_v2_behavior()
