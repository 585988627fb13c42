"""``python -m sphinx ARGS`` as a program file (not collected by pytest).

tests/test_docs.py runs the builds through tests/forkserver.py, which forks
programs given by their file: the build's autodoc then finds TensorFlow
imported already, instead of paying its import once per build.
"""
import sys

from sphinx.cmd.build import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
