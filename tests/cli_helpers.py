"""Shared by the command-line test modules (test_cli, test_control): a
command run in this process, the environment of a command run as its own
process, and the keyed count those tests' jobs write."""
import contextlib
import glob
import io
import os

from pyflowbuf.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a `python -m pyflowbuf ...` process imports this checkout's package
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))
KEYS = 10


def cli(*argv):
    """Run one command in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def expected_lines(n):
    """What the keyed count writes in one run (no stop, no failure), each line once."""
    return sorted(f"{k},{i}" for k in range(KEYS) for i in range(1, n // KEYS + 1))


def committed_lines(out_dir):
    lines = []
    for path in glob.glob(os.path.join(out_dir, "part-*")):    # not the hidden in-progress ones
        with open(path) as f:
            lines += f.read().splitlines()
    return sorted(lines)
