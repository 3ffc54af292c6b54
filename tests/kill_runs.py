"""Seeded worker-kill runs, many of them, outside pytest (a tool, not a test:
pytest collects test_*.py only).

Each run is the worker-kill test of its mode with its draws taken from a
seeded random generator: ``workers=2``, a job of random stages, and one
worker process killing itself (SIGKILL) at a random record. Modes: aligned
checkpoints (test_checkpoints_workers), unaligned, and unaligned with an
alignment timeout (test_unaligned). A run records whether the kill fired,
how many restarts the job made and why, and whether the output was exactly
once; a crash of a restarted worker shows as a second restart.

    PYTHONPATH=. python tests/kill_runs.py --runs 500 --out /tmp/kills.jsonl

prints one line per run and a summary; exits 1 if any run that killed a
worker did not end with exactly one restart and exactly-once output.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyflowbuf as fb  # noqa: E402
from pyflowbuf import errors  # noqa: E402
from test_checkpoints import KillWorkerOnce, check_exactly_once, random_job  # noqa: E402
from test_unaligned import N as UNALIGNED_N  # noqa: E402
from test_unaligned import slow_job  # noqa: E402

MODES = ("aligned", "unaligned", "alignment_timeout")
STAGES = ("forward", "rebalance", "key_by", "union")


def one_run(mode: str, seed: int, tmp: str) -> dict:
    rnd = random.Random(f"{mode}:{seed}")
    stages = [rnd.choice(STAGES) for _ in range(rnd.randint(1, 3))]
    fail_stage = min(rnd.randint(0, 2), len(stages) - 1)
    if mode == "aligned":
        n, kill_at = 3000, rnd.randint(1, 1400)
        env = fb.Environment(workers=2, parallelism=2, checkpoint_interval=0.02,
                             checkpoint_dir=os.path.join(tmp, "chk"), restart_attempts=3)
        kill = KillWorkerOnce(os.path.join(tmp, "killed"), kill_at)
        h = random_job(env, n, stages, 2, kill, fail_stage, os.path.join(tmp, "out"), 20_000)
    else:
        n, kill_at = UNALIGNED_N, rnd.randint(200, 2500)
        extra = {"alignment_timeout": 0.005} if mode == "alignment_timeout" else {}
        env = fb.Environment(workers=2, parallelism=2, checkpoint_interval=0.01,
                             checkpoint_dir=os.path.join(tmp, "chk"), restart_attempts=3, segment_size=256,
                             checkpoint_alignment="unaligned", **extra)
        kill = KillWorkerOnce(os.path.join(tmp, "killed"), kill_at)
        h = slow_job(env, n, stages, 2, kill, fail_stage, os.path.join(tmp, "out"))
    rec = {"mode": mode, "seed": seed, "stages": stages, "fail_stage": fail_stage, "kill_at": kill_at}
    t0 = time.monotonic()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
            env.execute(180)
        check_exactly_once(h, os.path.join(tmp, "out"), n)
        rec["exactly_once"] = True
    except BaseException as exc:  # noqa: BLE001 - recorded, the next run goes on
        if isinstance(exc, KeyboardInterrupt):
            raise
        rec["exactly_once"] = False
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        rec["traceback"] = traceback.format_exc()[-3000:]
    ex = env.last_execution
    rec["seconds"] = round(time.monotonic() - t0, 2)
    rec["killed"] = os.path.exists(os.path.join(tmp, "killed"))
    rec["restarts"] = getattr(ex, "restarts", None)
    rec["restart_failures"] = [list(f) for f in getattr(ex, "restart_failures", [])]
    return rec


def ok(rec: dict) -> bool:
    if not rec["exactly_once"] or rec["restarts"] != (1 if rec["killed"] else 0):
        return False
    # the one restart is for the kill, not for something that followed it
    return not rec["killed"] or "killed by SIGKILL" in rec["restart_failures"][0][2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=30, help="runs in total, spread evenly over the modes")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", help="append one JSON line per run to this file")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r} (one of {', '.join(MODES)})")
    counts = collections.Counter()
    restarts = {m: collections.Counter() for m in modes}
    bad = []
    out = open(args.out, "a") if args.out else None
    try:
        for i in range(args.runs):
            mode, seed = modes[i % len(modes)], args.first_seed + i // len(modes)
            tmp = tempfile.mkdtemp(prefix="fbkill-")
            try:
                rec = one_run(mode, seed, tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            counts[mode] += 1
            counts["killed"] += rec["killed"]
            restarts[mode][rec["restarts"]] += 1
            good = ok(rec)
            if not good:
                bad.append(rec)
            print(f"{i + 1:4d} {mode:17s} seed={seed:<4d} killed={int(rec['killed'])} restarts={rec['restarts']} "
                  f"exactly_once={int(rec['exactly_once'])} {rec['seconds']:6.1f}s"
                  + ("" if good else f"  <-- {rec.get('error') or rec['restart_failures']}"), flush=True)
            if out is not None:
                out.write(json.dumps(rec) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
        print(f"\nruns: {dict(counts)}")
        for m in modes:
            print(f"restarts per run, {m}: {dict(sorted(restarts[m].items(), key=str))}")
        print(f"runs with a second restart, a crash or output not exactly once: {len(bad)}")
        for rec in bad:
            print(f"  {rec['mode']} seed={rec['seed']}: restarts={rec['restarts']} "
                  f"{rec.get('error') or rec['restart_failures']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
