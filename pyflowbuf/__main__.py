"""``python -m pyflowbuf ...``: the command line (pyflowbuf/cli), which the
``pyflowbuf`` console script runs too: ``run``, ``checkpoints``, ``demo``, ``bench``."""
import sys

from pyflowbuf.cli import main

if __name__ == "__main__":
    sys.exit(main())
