"""Command-line entry point: ``python -m pyflowbuf demo|bench ...``."""
import argparse
import subprocess
import sys
from pathlib import Path


def main(argv=None):
    parser = argparse.ArgumentParser(prog="pyflowbuf", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="run the end-to-end demonstration")
    demo.add_argument("--quick", action="store_true", help="a shorter run")
    bench = sub.add_parser("bench", help="run a benchmark from benchmarks/")
    bench.add_argument("name")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.cmd == "bench":
        script = Path(__file__).resolve().parent.parent / "benchmarks" / "run.py"
        return subprocess.call([sys.executable, str(script), args.name, *args.rest])
    from pyflowbuf.demo import run_demo

    return run_demo(quick=args.quick)


if __name__ == "__main__":
    sys.exit(main())
