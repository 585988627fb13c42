"""The benchmarks' command-line parser: a bad flag is one line and exit status 2, without the usage block."""
import argparse
import os
import sys


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr, exit status 2.

    Example:
      >>> parser = OneLineParser(description="Runs the benchmarks.")
    """

    def error(self, message):
        sys.stderr.write("%s: error: %s\n" % (os.path.basename(sys.argv[0]) or self.prog,
                                              " ".join(str(message).split())))
        sys.exit(2)
