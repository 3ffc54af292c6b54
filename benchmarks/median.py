#!/usr/bin/env python
"""Medians of several saved runs of one benchmark, for the README tables.

    python benchmarks/median.py benchmarks/results/pipeline-quick-*.json

Prints, for every numeric figure, the median, the range and the number of
runs, and the commits the runs came from (a table should cite one commit).
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    runs = [json.loads(Path(p).read_text()) for p in paths]
    keys: dict[str, list] = {}
    for r in runs:
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                keys.setdefault(k, []).append(v)
    commits = sorted({(r.get("commit") or "?")[:10] + ("-dirty" if r.get("dirty") else "") for r in runs})
    print(f"{len(runs)} runs of {sorted({r.get('benchmark') for r in runs})} at {', '.join(commits)}")
    width = max(map(len, keys), default=0)
    for k, vs in keys.items():
        med = statistics.median(vs)
        print(f"{k:<{width}}  median {med:>14.6g}   range {min(vs):.6g} .. {max(vs):.6g}   n={len(vs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
