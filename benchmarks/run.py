#!/usr/bin/env python
"""Run one pyflowbuf benchmark.

    python benchmarks/run.py NAME [--quick] [--json]
    python benchmarks/run.py --list

NAME picks ``benchmarks/bench_<NAME>.py``; any such file with a
``main(quick: bool) -> dict`` is found without editing this script. The bench
prints its figures while it runs; at the end a table of the returned dict is
printed and, with ``--json``, the last line of stdout is that dict as exactly
one JSON object (NaN/inf become null).
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import common  # noqa: E402

_NAME = re.compile(r"^[A-Za-z0-9_]+$")


def available() -> list[str]:
    """Names of the benches in this folder (``bench_<name>.py``)."""
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py") if _NAME.match(p.stem))


def load(name: str):
    module = importlib.import_module(f"bench_{name}")
    if not callable(getattr(module, "main", None)):
        raise SystemExit(f"run.py: benchmarks/bench_{name}.py has no main(quick) function")
    return module


def main(argv: list[str] | None = None) -> int:
    names = available()
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py", description="Run a pyflowbuf benchmark.",
        epilog="available: " + (", ".join(names) or "(none)"))
    parser.add_argument("name", nargs="?", help="which benchmark (bench_<name>.py)")
    parser.add_argument("--quick", action="store_true", help="short run (smaller workloads, fewer repetitions)")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON on the last line of stdout")
    parser.add_argument("--list", action="store_true", help="list the available benchmarks and exit")
    args = parser.parse_args(argv)

    if args.list:
        print("\n".join(names))
        return 0
    if args.name is None or args.name not in names:
        what = "no benchmark given" if args.name is None else f"unknown benchmark {args.name!r}"
        print(f"run.py: {what}; available: {', '.join(names) or '(none)'}", file=sys.stderr)
        return 2

    module = load(args.name)
    t0 = time.perf_counter()
    result = module.main(quick=args.quick)
    elapsed = time.perf_counter() - t0
    if not isinstance(result, dict):
        print(f"run.py: bench_{args.name}.main() returned {type(result).__name__}, not a dict", file=sys.stderr)
        return 1
    result = dict(result)
    result.setdefault("machine", common.machine_info())
    result["benchmark"] = args.name
    result["quick"] = bool(args.quick)
    result["elapsed_s"] = round(elapsed, 2)

    common.render_result(result, title=f"{args.name} ({'quick' if args.quick else 'full'} run, {elapsed:.1f} s)")
    if args.json:
        sys.stdout.flush()
        sys.stdout.write(json.dumps(common.jsonable(result), allow_nan=False, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
