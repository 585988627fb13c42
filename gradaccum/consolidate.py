"""``python -m gradaccum.consolidate``: a sharded checkpoint merged into a plain one.

The command line only: the module is :mod:`gradaccum.distributed.consolidate`, which
``gradaccum.consolidate`` names too.
"""
import sys

from gradaccum.distributed.consolidate import main

if __name__ == "__main__":
    sys.exit(main())
