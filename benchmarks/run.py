#!/usr/bin/env python
"""Run one pyflowbuf benchmark.

    python benchmarks/run.py NAME [--quick] [--json]
    python benchmarks/run.py --list

NAME picks ``benchmarks/bench_<NAME>.py``; any such file with a
``main(quick: bool) -> dict`` is found without editing this script. The bench
prints its figures while it runs; at the end a table of the returned dict is
printed and, with ``--json``, the last line of stdout is that dict as exactly
one JSON object (NaN/inf become null).

Every result records the commit it ran on (``commit``, with ``dirty`` when the
work tree had changes), the date and the machine. ``--save`` also writes it to
``benchmarks/results/NAME-DATE-COMMIT.json``: the README cites those files, so
a figure can always be traced to the code that produced it.
"""
from __future__ import annotations

import argparse
import importlib
import json
import datetime
import re
import subprocess
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


def commit_info() -> dict:
    """The commit the benchmark runs on, and whether the tree had changes."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    try:
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha or None, "dirty": dirty}


def save(result: dict) -> Path:
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    stamp = result["date"].replace(":", "").replace("-", "")[:15]
    commit = (result.get("commit") or "nocommit")[:10] + ("-dirty" if result.get("dirty") else "")
    path = out / f"{result['benchmark']}-{'quick-' if result['quick'] else ''}{stamp}-{commit}.json"
    path.write_text(json.dumps(common.jsonable(result), allow_nan=False, indent=1, sort_keys=True) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    names = available()
    parser = argparse.ArgumentParser(
        prog="benchmarks/run.py", description="Run a pyflowbuf benchmark.",
        epilog="available: " + (", ".join(names) or "(none)"))
    parser.add_argument("name", nargs="?", help="which benchmark (bench_<name>.py)")
    parser.add_argument("--quick", action="store_true", help="short run (smaller workloads, fewer repetitions)")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON on the last line of stdout")
    parser.add_argument("--save", action="store_true",
                        help="also write the result to benchmarks/results/NAME-DATE-COMMIT.json")
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
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    commit = commit_info()
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
    result["date"] = started
    result.update(commit)

    common.render_result(result, title=f"{args.name} ({'quick' if args.quick else 'full'} run, {elapsed:.1f} s)")
    if args.save:
        print(f"saved {save(result).relative_to(HERE.parent)}", file=sys.stderr)
    if args.json:
        sys.stdout.flush()
        sys.stdout.write(json.dumps(common.jsonable(result), allow_nan=False, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
