"""``python -m gradaccum.launch``: the one-machine launcher.

The command line only: the module is :mod:`gradaccum.distributed.launch`, which
``gradaccum.launch`` names too.
"""
import sys

from gradaccum.distributed.launch import main

if __name__ == "__main__":
    sys.exit(main())
