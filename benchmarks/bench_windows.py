"""Windows benchmark: a keyed 1 s tumbling count in event time, against bytewax
and against a pandas groupby, each measured in the same run.

The job: records ``(key, t)`` with 1000 keys, event time advancing 10 000
records per second of event time, 10 % of the records shifted back by up to
0.3 s (out of order, none late: the watermark lags 0.5 s). Every engine must
give the same windows: the run checks their counts against each other.

tumbling_count_records_per_s
    ours, records path: ``from_iterable -> assign_timestamps -> key_by ->
    window(Tumbling(1.0)) -> aggregate(Count())``, parallelism 1; records over
    the wall time of ``execute`` (quick: 200k records, full: 1M).
bytewax_records_per_s, windows_vs_bytewax
    the same job on bytewax (``count_window`` with an ``EventClock`` and a
    ``TumblingWindower``, one worker) in its own virtual environment
    (``benchmarks/.venv-bytewax``, made on first use with ``pip install
    bytewax``), run as a subprocess that times ``run_main`` only (data
    loaded before). Null with the reason printed when bytewax cannot be
    installed. Goal >= 10x.
arrow_windows_records_per_s, arrow_windows_vs_pandas_groupby
    the vectorized path over Arrow RecordBatches (``assign_timestamps("ts")
    -> key_by("key") -> window -> aggregate({"count": ...})``) / pandas
    ``groupby([key, floor(ts)]).size()`` over the same batches (their
    conversion to pandas included), interleaved repetitions. Goal >= 0.5.

Run: ``python benchmarks/run.py windows [--quick] [--json]``.
"""
from __future__ import annotations

import json
import marshal
import os
import random
import subprocess
import sys
import tempfile
import time
import venv
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import Goal  # noqa: E402

import pyflowbuf as fb  # noqa: E402

HERE = Path(__file__).resolve().parent
BYTEWAX_VENV = HERE / ".venv-bytewax"
KEYS = 1000
EVENTS_PER_S = 10_000        # records per second of event time
OUT_OF_ORDER = 0.10          # share of records shifted back in time
MAX_SHIFT_S = 0.3            # by up to this much
LAG_S = 0.5                  # the watermark's bound (ours: out_of_orderness; bytewax: wait_for_system_duration)
WINDOW_S = 1.0


def params(quick: bool) -> dict:
    if quick:
        return dict(n=200_000, repeats=3, arrow_n=2_000_000, arrow_batch=65_536, bytewax_timeout=240)
    return dict(n=1_000_000, repeats=5, arrow_n=10_000_000, arrow_batch=65_536, bytewax_timeout=900)


# ---------------------------------------------------------------- the data

def make_records(n: int, seed: int = 7) -> list:
    """``(key, t)`` records: t advances EVENTS_PER_S records per second; 10 %
    are shifted back by up to MAX_SHIFT_S (< LAG_S, so none is late)."""
    rng = random.Random(seed)
    keys = [f"k{i}" for i in range(KEYS)]
    out = []
    for i in range(n):
        t = i / EVENTS_PER_S
        if rng.random() < OUT_OF_ORDER:
            t = max(0.0, t - rng.random() * MAX_SHIFT_S)
        out.append((keys[rng.randrange(KEYS)], t))
    return out


def reference_counts(records) -> dict:
    """Plain Python: the count per (key, window start)."""
    counts: dict = {}
    for k, t in records:
        w = (k, float(int(t // WINDOW_S) * WINDOW_S))
        counts[w] = counts.get(w, 0) + 1
    return counts


# ---------------------------------------------------------------- ours

def ours_records(records) -> tuple[float, dict]:
    from pyflowbuf.windows import Count

    env = fb.Environment(parallelism=1)
    out = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1], out_of_orderness=LAG_S)
              .key_by(lambda r: r[0])
              .window(fb.Tumbling(WINDOW_S))
              .aggregate(Count(), window_function=lambda key, w, n: (key, float(w.start), n))
              .collect())
    t0 = time.perf_counter()
    env.execute(600)
    dt = time.perf_counter() - t0
    return len(records) / dt, {(k, s): c for k, s, c in out.result}


def arrow_batches(n: int, batch: int, seed: int = 11) -> list:
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    t = np.arange(n) / EVENTS_PER_S
    shift = rng.random(n) < OUT_OF_ORDER
    t[shift] = np.maximum(0.0, t[shift] - rng.random(int(shift.sum())) * MAX_SHIFT_S)
    names = np.array([f"k{i}" for i in range(KEYS)], dtype=object)
    keys = pa.array(names[rng.integers(0, KEYS, n)], pa.string())
    ts = pa.array(t)
    return [pa.record_batch([keys.slice(i, batch), ts.slice(i, batch)], names=["key", "ts"])
            for i in range(0, n, batch)]


def ours_arrow(batches, n) -> tuple[float, dict]:
    env = fb.Environment(parallelism=1)
    out = (env.from_iterable(batches, kind="arrow")
              .assign_timestamps("ts", out_of_orderness=LAG_S)
              .key_by("key")
              .window(fb.Tumbling(WINDOW_S))
              .aggregate({"count": ("key", "count")})
              .collect())
    t0 = time.perf_counter()
    env.execute(600)
    dt = time.perf_counter() - t0
    counts = {}
    for b in out.result:
        d = b.to_pydict()
        for k, s, c in zip(d["key"], d["window_start"], d["count"]):
            counts[(k, float(s))] = counts.get((k, float(s)), 0) + c
    return n / dt, counts


def pandas_groupby(batches, n) -> tuple[float, dict]:
    import numpy as np
    import pandas as pd

    t0 = time.perf_counter()
    df = pd.concat([b.to_pandas() for b in batches], ignore_index=True)
    res = df.groupby([df["key"], np.floor(df["ts"] / WINDOW_S) * WINDOW_S]).size()
    dt = time.perf_counter() - t0
    return n / dt, {(k, float(s)): int(c) for (k, s), c in res.items()}


# ---------------------------------------------------------------- bytewax, in its own environment

BYTEWAX_JOB = r'''
import json, marshal, sys, time
from datetime import datetime, timedelta, timezone

import bytewax.operators as op
import bytewax.operators.windowing as win
from bytewax.dataflow import Dataflow
from bytewax.testing import TestingSink, TestingSource, run_main

path, lag, size = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
with open(path, "rb") as fh:
    records = marshal.load(fh)
epoch = datetime(1970, 1, 1, tzinfo=timezone.utc)
# timestamps as bytewax wants them (aware datetimes), made before the clock starts
items = [(k, epoch + timedelta(seconds=t)) for k, t in records]

flow = Dataflow("windows")
stream = op.input("in", flow, TestingSource(items, batch_size=1024))
clock = win.EventClock(lambda r: r[1], wait_for_system_duration=timedelta(seconds=lag))
windower = win.TumblingWindower(length=timedelta(seconds=size), align_to=epoch)
counted = win.count_window("count", stream, clock, windower, lambda r: r[0])
out = []
op.output("out", counted.down, TestingSink(out))
t0 = time.perf_counter()
run_main(flow)
dt = time.perf_counter() - t0
counts = [[key, wid, n] for key, (wid, n) in out]
json.dump({"records_per_s": len(records) / dt, "seconds": dt, "counts": counts}, sys.stdout)
'''


def bytewax_python() -> tuple[str | None, str]:
    """The bytewax environment's python, made on first use; (None, why) when
    bytewax cannot be installed here."""
    py = BYTEWAX_VENV / "bin" / "python"
    if py.exists():
        ok = subprocess.run([str(py), "-c", "import bytewax"], capture_output=True, text=True, timeout=120)
        if ok.returncode == 0:
            return str(py), ""
    try:
        if not py.exists():
            venv.EnvBuilder(with_pip=True, clear=True).create(str(BYTEWAX_VENV))
        res = subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "bytewax"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"could not make {BYTEWAX_VENV}: {exc}"
    if res.returncode != 0:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return None, "pip install bytewax failed: " + " | ".join(tail)
    return str(py), ""


class BytewaxUnavailable(Exception):
    """bytewax is there but its job cannot give a figure to compare."""


class BytewaxJob:
    """The bytewax job over ``records``: the records (a marshal file) and the
    script are written once; each call runs the job in a subprocess and
    returns its records/s, timed there around ``run_main`` only."""

    def __init__(self, py: str, records, tmp: str, timeout: float, want: dict):
        self.py, self.timeout, self.want = py, timeout, want
        self.data = os.path.join(tmp, "records.marshal")
        with open(self.data, "wb") as fh:
            marshal.dump(records, fh)
        self.script = os.path.join(tmp, "bytewax_job.py")
        with open(self.script, "w") as fh:
            fh.write(BYTEWAX_JOB)

    def __call__(self) -> float:
        try:
            res = subprocess.run([self.py, self.script, self.data, str(LAG_S), str(WINDOW_S)],
                                 capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise BytewaxUnavailable(f"the bytewax job ran over {self.timeout} s") from None
        if res.returncode != 0:
            raise BytewaxUnavailable("the bytewax job failed: " + " | ".join(res.stderr.strip().splitlines()[-3:]))
        got = json.loads(res.stdout)
        # bytewax numbers windows from align_to: window id i starts at i * size
        counts = {(k, float(wid * WINDOW_S)): n for k, wid, n in got["counts"]}
        if counts != self.want:
            raise BytewaxUnavailable("bytewax's counts differ from the plain-Python reference: not compared")
        return got["records_per_s"]


# ---------------------------------------------------------------- main

def main(quick: bool = False) -> dict:
    p = params(quick)
    rep = common.Report("windows", quick, params={**p, "keys": KEYS, "events_per_s": EVENTS_PER_S,
                                                   "out_of_order": OUT_OF_ORDER, "max_shift_s": MAX_SHIFT_S,
                                                   "watermark_lag_s": LAG_S, "window_s": WINDOW_S})
    rep.section(f"keyed {WINDOW_S:g} s tumbling count, records path, {p['n']:,} records, parallelism 1")
    records = make_records(p["n"])
    want = reference_counts(records)

    def ours():
        r, got = ours_records(records)
        if got != want:
            raise AssertionError("the windowed counts differ from the plain-Python reference")
        return r

    py, why = bytewax_python()
    cases = {"ours": ours}
    with tempfile.TemporaryDirectory(prefix="pyflowbuf-bench-windows-") as tmp:
        if py is not None:
            cases["bytewax"] = BytewaxJob(py, records, tmp, p["bytewax_timeout"], want)
        try:
            with common.progress("ours vs bytewax", p["repeats"]) as adv:
                s = common.interleaved(cases, p["repeats"], advance=adv)
        except BytewaxUnavailable as exc:
            why = str(exc)
            del cases["bytewax"]
            with common.progress("ours", p["repeats"]) as adv:
                s = common.interleaved(cases, p["repeats"], advance=adv)
    rep.add("tumbling_count_records_per_s", s.median("ours"), "records/s",
            note=f"median of {p['repeats']}, counts checked")
    if "bytewax" in cases:
        rep.add("bytewax_records_per_s", s.median("bytewax"), "records/s", note="same records, counts checked")
        rep.add("windows_vs_bytewax", s.ratio("ours", "bytewax"), "x", goal=Goal(">=", 10.0, "x"),
                note="median of the per-repetition ratios")
    else:
        print(f"  bytewax: no figure ({why})", file=sys.stderr)
        rep.add("bytewax_records_per_s", float("nan"), "records/s", note=why)
        rep.add("windows_vs_bytewax", float("nan"), "x", goal=Goal(">=", 10.0, "x"), note=why)

    rep.section(f"vectorized path over Arrow batches of {p['arrow_batch']:,} rows vs a pandas groupby, "
                f"{p['arrow_n']:,} records")
    batches = arrow_batches(p["arrow_n"], p["arrow_batch"])
    checked = {}

    def case(fn):
        def run():
            r, counts = fn(batches, p["arrow_n"])
            checked.setdefault(fn.__name__, counts)
            return r
        return run

    with common.progress("arrow vs pandas", p["repeats"]) as adv:
        s = common.interleaved({"arrow": case(ours_arrow), "pandas": case(pandas_groupby)}, p["repeats"],
                               advance=adv)
    if checked["ours_arrow"] != checked["pandas_groupby"]:
        raise AssertionError("the vectorized window counts differ from pandas'")
    rep.add("arrow_windows_records_per_s", s.median("arrow"), "records/s")
    rep.add("pandas_groupby_records_per_s", s.median("pandas"), "records/s")
    rep.add("arrow_windows_vs_pandas_groupby", s.ratio("arrow", "pandas"), "x", goal=Goal(">=", 0.5, "x"))
    return rep.as_dict()


if __name__ == "__main__":
    result = main(quick="--quick" in sys.argv[1:])
    sys.stdout.write(json.dumps(common.jsonable(result), allow_nan=False, separators=(",", ":")) + "\n")
