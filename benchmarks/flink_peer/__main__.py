"""``python benchmarks/flink_peer install|run``: see the package's docstring."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # benchmarks/

from flink_peer import main  # noqa: E402

sys.exit(main())
