"""Checkpoint benchmark: what aligned checkpoints cost when nothing fails, how
long they take with and without backpressure, and how long a recovery takes.

checkpoint_overhead_ratio
    records/s of a keyed-count job (source -> map -> map -> key_by -> reduce ->
    sink, chaining off, 5 tasks, 100 000 keys) with a checkpoint every second /
    the same job without checkpoints: the median of the per-repetition ratios
    of paired, interleaved runs. The full run sizes the input so that one run
    lasts at least 15 s (from the plain rate of a calibration run), as issue
    21 asks; the quick one runs 3 M records. Goal >= 0.95.
aligned_checkpoint_s_no_backpressure
    median duration (trigger to completion) of the checkpoints of that job.
savepoint_s
    median duration of savepoints (``job.savepoint()``: aligned, written
    self-contained to a directory of their own) of the same job.
aligned_checkpoint_s_backpressure_batched_sink
    the same job with the source rate-limited and a sink 20x slower than it
    (sleeping for its whole batch at once), default buffers and 32 KiB
    segments: the barrier waits behind every buffer queued ahead of it.
    Median of the checkpoints that completed.
unaligned_checkpoint_s_backpressure, unaligned_vs_aligned_checkpoint_time
    the same backpressured job with unaligned checkpoints: barriers overtake
    the queued buffers, which the checkpoint stores. The ratio is the aligned
    median over the unaligned one (goal >= 30, Flink's own measurement).
unaligned_inflight_bytes_over_pool
    the largest checkpoint's in-flight bytes / the network memory (goal <= 1).
unaligned_throughput_ratio
    records/s of the keyed count with unaligned checkpoints every second / none
    (goal >= 0.9). All four again with ``_workers2``: workers=2. The backpressured
    jobs run at parallelism 1, and a subtask's worker is ``subtask % workers``: all
    five run in worker 0, so the trigger and acknowledgements cross the control
    pipe and no exchange crosses TCP.
unaligned_checkpoint_ms_backpressure, aligned_checkpoint_s_backpressure
    issue 32: the backpressured job as Flink's benchmark has it, a sink 20x
    slower per record (``paced_sink``: paced by deadline, so it drains the
    rate/20 it claims, 10 k records/s; a priority event can come between two
    records): median unaligned checkpoint (goal <= 20 ms) and aligned one
    (goal <= 4.7 s, Flink 2.3's figure on this job). The 4.7 s goal is for
    this key, the unchained job (5 tasks, 4 exchanges): measured here side
    by side, Flink 2.3 takes 4.7-4.8 s on exactly that topology
    (``flink_aligned_checkpoint_s_backpressure``) and about 1 s with its
    default chaining, so the issue's 4.8 s was the unchained job's. Flink
    holds the same bytes in flight per exchange; its records are about twice
    the size of ours, so fewer of them wait ahead of a barrier
    (docs/checkpoints.md, "What bounds an aligned checkpoint under
    backpressure").
    ``..._batched_sink``: the same with the batched sink.
    ``aligned_checkpoint_s_backpressure_chained``: the aligned run with
    chaining on (2 tasks, 1 exchange: Flink's default topology for this
    job); in one process only. ``aligned_checkpoint_s_backpressure_debloat``:
    aligned with buffer debloating on (goal <= 1.5 s, its target being 1 s).
    ``unaligned_checkpoint_ms_slow_operator``: unaligned, with an operator at
    3 ms a record before the batched sink (goal <= 50 ms).
    ``checkpoint_phase_breakdown`` (and ``_aligned``, ``_aligned_debloat``,
    ``_slow_operator``): the phases of the median checkpoint (see
    docs/checkpoints.md, "Where a checkpoint's time goes"). All again with
    ``_workers2``.
flink_aligned_checkpoint_s_backpressure, ..._chained, flink_unaligned_checkpoint_ms_backpressure
    the same job on Flink 2.3 (benchmarks/flink_peer: a local MiniCluster,
    default network buffers, 32 KiB segments, a checkpoint every second to
    file://, the sink paced alike), run in this process's minutes:
    unchained (as ours), chained (Flink's default), and for unaligned
    checkpoints unchained with rebalance exchanges (Flink keeps a barrier
    aligned on a forward exchange). ``aligned_checkpoint_vs_flink``
    (``_chained``), ``unaligned_checkpoint_vs_flink``: ours / Flink's
    median, same topology. Skipped, with the reason in the note, where there
    is no JDK or no Maven to fetch Flink (``python benchmarks/flink_peer
    install`` fetches it once).
recovery_s, state_write_s
    a job builds about 100 MB of keyed state (quick: 30 MB), one checkpoint
    completes, then an operator fails: from the failure to the first record
    processed after the restore. Next to it the time that checkpoint took to
    write the state once (its duration).
exactly_once_ok
    1 when the failing job's result equals the same job's without a failure.
rescale_restore_vs_plain_restore
    a keyed job at parallelism 2 builds about 100 MB of keyed state (quick:
    30 MB) and stops with a savepoint; the time to restore it (read, check,
    decode and hand each subtask its key groups, before any task runs) at
    parallelism 4 / the same at parallelism 2. Goal <= 1.5: keyed state is
    stored per key group, so a subtask decodes only the groups it gets.

Run: ``python benchmarks/run.py checkpoint [--quick] [--json]``.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
import flink_peer  # noqa: E402
from common import Goal  # noqa: E402

import pyflowbuf as fb  # noqa: E402
from pyflowbuf.checkpoint import SavepointStorage  # noqa: E402

KEYS = 100_000           # keys of the keyed count (the backpressure runs use BP_KEYS)
BP_KEYS = 1000
MIN_RUN_S = 15.0         # the full run's overhead repetitions last at least this long
RESCALE_KEYS = 800_000   # about 100 MiB of keyed state (the size), quick or not


def params(quick: bool) -> dict:
    if quick:
        return dict(repeats=5, n=3_000_000, bp_seconds=20.0, bp_rate=200_000, phase_seconds=10.0,
                    state_keys=300_000, state_value=100, n_workers=1_000_000, min_run_s=None, rescale_keys=RESCALE_KEYS,
                    rescale_repeats=5)
    return dict(repeats=9, n=5_000_000, bp_seconds=60.0, bp_rate=200_000, phase_seconds=30.0,
                state_keys=1_000_000, state_value=100, n_workers=3_000_000, min_run_s=MIN_RUN_S, rescale_keys=RESCALE_KEYS,
                rescale_repeats=7)


def _keyed_count(env, source, keys=KEYS):
    return (source.map(lambda x: x + 1, kind="int64", name="map")
                  .map(lambda x: (x % keys, 1), kind="struct", name="pair")
                  .key_by(lambda kv: kv[0])
                  .reduce(lambda a, b: (a[0], a[1] + b[1]), name="count").uid("count"))


def overhead_case(n, checkpoints: list | None, tmp, seconds: list | None = None):
    def run():
        kw = {}
        if checkpoints is not None:
            kw = dict(checkpoint_interval=1.0, checkpoint_dir=tempfile.mkdtemp(dir=tmp))
        env = fb.Environment(chaining=False, **kw)
        seen = [0]
        _keyed_count(env, env.from_sequence(0, n)).sink(lambda b: seen.__setitem__(0, seen[0] + len(b)),
                                                       batched=True, name="sink")
        t0 = time.perf_counter()
        env.execute(600)
        dt = time.perf_counter() - t0
        assert seen[0] == n
        if seconds is not None:
            seconds.append(dt)
        if checkpoints is not None:
            checkpoints.extend(c["duration_s"] for c in env.checkpoints() if c["status"] == "completed")
        return n / dt
    return run


NUM_SEGMENTS = 512      # 16 MiB of network memory per process (segments of 32 KiB)


SLOW_OPERATOR_S = 0.003     # unaligned_checkpoint_ms_slow_operator: an operator at 3 ms a record


PACE_SLACK_S = 0.05     # a paced sink that was idle catches up by at most this (the Flink peer's too)


def paced_sink(rate: float):
    """``fn(record)`` for ``stream.sink``: slow per record, draining ``rate``
    records/s. Each record's deadline is the last one's plus 1/rate and the
    call sleeps only while it is ahead of it, so what a ``time.sleep``
    overshoots (50-80 us here) is made up by the next records instead of
    adding up: ``time.sleep(1 / rate)`` a record drained 5.4-5.7 k records/s
    of the 10 k asked. A sink that waited for input does not burst to catch up
    by more than PACE_SLACK_S. The Flink peer's sink (benchmarks/flink_peer)
    paces the same way."""
    period = 1.0 / rate
    clock, sleep = time.perf_counter, time.sleep
    deadline = [clock()]

    def record(_record):
        now = clock()
        due = max(deadline[0] + period, now - PACE_SLACK_S)
        deadline[0] = due
        if due > now:
            sleep(due - now)
    return record


def _sink_records_in(env) -> int:
    """Records into the task that holds the sink (with chaining ``count ->
    sink``: the reduce emits one record per input)."""
    return sum(m.get("records_in", 0) for m in env.metrics().values() if str(m.get("vertex", "")).endswith("sink"))


def backpressure_durations(seconds, rate, tmp, mode="aligned", workers=None, debloat=False,
                           sink="batched", slow_operator=False, chaining=False) -> dict:
    """A sink 20x slower than the rate-limited source: checkpoints under
    backpressure (the debloat bench runs it with buffer debloating on).
    ``sink``: "batched" sleeps for its whole batch at once, "per_record" is
    ``paced_sink`` (as Flink's sink is slow: a priority event can come between
    two records); ``slow_operator``: a map at SLOW_OPERATOR_S a record before
    the sink (heavy backpressure); ``chaining``: False runs 5 tasks and 4
    exchanges, True Flink's default chaining (source -> map -> pair, count ->
    sink: 2 tasks, 1 exchange). ``sink_records_per_s``: what the sink drained
    over the last two thirds of the run (the metrics' ``records_in``)."""
    env = fb.Environment(chaining=chaining, checkpoint_interval=1.0, checkpoint_dir=tempfile.mkdtemp(dir=tmp),
                         checkpoint_alignment=mode, workers=workers, parallelism=1, num_segments=NUM_SEGMENTS,
                         debloat=debloat)
    sink_rate = rate / 20

    def slow_sink(batch):
        time.sleep(len(batch) / sink_rate)

    def slow_map(kv):
        time.sleep(SLOW_OPERATOR_S)
        return kv

    stream = _keyed_count(env, env.from_sequence(0, None, rate_limit=rate), BP_KEYS)
    if slow_operator:
        stream = stream.map(slow_map, kind="struct", name="slow")
    if sink == "per_record":
        stream.sink(paced_sink(sink_rate), name="sink")
    else:
        stream.sink(slow_sink, batched=True, name="sink")
    job = env.execute_async()
    time.sleep(seconds / 3)
    n0, t0 = _sink_records_in(env), time.perf_counter()
    time.sleep(seconds - seconds / 3)
    n1, t1 = _sink_records_in(env), time.perf_counter()
    done = [c for c in env.checkpoints() if c["status"] == "completed"]
    job.cancel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.errors.WorkerSideEffectWarning)   # the sink counts nothing
        try:
            job.join(60)
        except fb.errors.JobFailedError:
            pass
    bp = max((m["backpressured_ms_per_s"] for m in env.metrics().values()), default=0.0)
    network_bytes = NUM_SEGMENTS * env.segment_size * (workers or 1)
    return {"durations": [c["duration_s"] for c in done], "bp": bp, "entries": done,
            "inflight_over_pool": max((c.get("inflight_bytes") or 0 for c in done), default=0) / network_bytes,
            "modes": sorted({c.get("alignment") for c in done}), "sink_records_per_s": (n1 - n0) / (t1 - t0)}


def throughput_case(n, mode, tmp, workers=None):
    """records/s of the keyed count with a checkpoint every second in ``mode``
    (None: no checkpoints)."""
    def run():
        kw = {}
        if mode is not None:
            kw = dict(checkpoint_interval=1.0, checkpoint_dir=tempfile.mkdtemp(dir=tmp), checkpoint_alignment=mode)
        env = fb.Environment(chaining=False, workers=workers, **kw)
        out = _keyed_count(env, env.from_sequence(0, n), BP_KEYS).filter(lambda kv: False, name="drop").collect()
        t0 = time.perf_counter()
        env.execute(600)
        dt = time.perf_counter() - t0
        assert out.result == []
        return n / dt
    return run


def unaligned_section(rep, p, tmp, workers=None, aligned=None):
    """Aligned and unaligned checkpoints under the same backpressure, and what
    unaligned checkpoints cost without it; ``workers=2``: in a worker process (at
    parallelism 1 every subtask of the backpressured job in the same one).
    ``aligned``: the aligned run of this configuration, if one was made."""
    sfx = "" if workers is None else f"_workers{workers}"
    where = "in one process" if workers is None else f"with workers={workers} (parallelism 1: one worker runs every subtask)"
    rep.section(f"aligned vs unaligned under backpressure (sink 20x slower), {where}")
    al = aligned or backpressure_durations(p["ua_seconds"], p["bp_rate"], tmp, "aligned", workers)
    ua = backpressure_durations(p["ua_seconds"], p["bp_rate"], tmp, "unaligned", workers)
    med_al = statistics.median(al["durations"]) if al["durations"] else float("nan")
    med_ua = statistics.median(ua["durations"]) if ua["durations"] else float("nan")
    if workers is not None:
        rep.add(f"aligned_checkpoint_s_backpressure_batched_sink{sfx}", med_al, "s",
                note=f"median of {len(al['durations'])} in {p['ua_seconds']} s")
    rep.add(f"unaligned_checkpoint_s_backpressure{sfx}", med_ua, "s",
            note=f"median of {len(ua['durations'])} in {p['ua_seconds']} s, modes {ua['modes']}; "
                 f"max backpressured {ua['bp']:.0f} ms/s")
    rep.add(f"unaligned_vs_aligned_checkpoint_time{sfx}", med_al / med_ua, "x", goal=Goal(">=", 30, "x"),
            note=f"aligned median {med_al:.3g} s ({len(al['durations'])} completed)")
    rep.add(f"unaligned_inflight_bytes_over_pool{sfx}", ua["inflight_over_pool"], "",
            goal=Goal("<=", 1.0, ""), note=f"largest checkpoint's in-flight bytes / {NUM_SEGMENTS} segments "
                                           f"x 32 KiB x {workers or 1} process(es)")
    rep.section(f"records/s with unaligned checkpoints every second vs none, {where}")
    n = p["n"] if workers is None else p["n_workers"]
    with common.progress("unaligned throughput", p["repeats"]) as adv:
        s = common.interleaved({"unaligned": throughput_case(n, "unaligned", tmp, workers),
                                "none": throughput_case(n, None, tmp, workers)}, p["repeats"], advance=adv)
    rep.add(f"unaligned_throughput_ratio{sfx}", s.ratio("unaligned", "none"), "x", goal=Goal(">=", 0.9, "x"),
            note=f"{s.median('unaligned'):.3g} vs {s.median('none'):.3g} records/s")


_BREAKDOWN = ("trigger_to_source_ms", "start_delay_ms", "alignment_ms", "inflight_wait_ms", "sync_ms",
              "write_queue_ms", "async_ms", "last_ack_ms", "metadata_ms", "commits_ms", "completion_ms",
              "bytes", "inflight_bytes")


def breakdown(entries) -> dict | None:
    """The phases of the median checkpoint (by duration) of ``entries``, with
    its duration and, per subtask, its start delay and write (None where the
    checkpoints have no phases: a build from before issue 32)."""
    done = sorted((e for e in entries if e.get("phases")), key=lambda e: e["duration_s"])
    if not done:
        return None
    e = done[(len(done) - 1) // 2]
    out = {"duration_ms": round(e["duration_s"] * 1000, 3), "alignment": e["alignment"]}
    out.update({k: e["phases"].get(k) for k in _BREAKDOWN})
    out["subtasks"] = {k: {f: v.get(f) for f in ("start_delay_ms", "alignment_ms", "sync_ms", "write_queue_ms",
                                                 "async_ms", "ack_ms", "inflight_bytes", "unaligned")}
                       for k, v in e["subtasks"].items()}
    return out


def phase_section(rep, p, tmp, workers=None) -> None:
    """Issue 32: checkpoints under backpressure as Flink's job has them (a sink
    slow per record), next to today's batched sink; with buffer debloating;
    with an operator slow per record; and the median checkpoint's phases."""
    sfx = "" if workers is None else f"_workers{workers}"
    where = "in one process" if workers is None else f"with workers={workers}"
    rep.section(f"checkpoints under backpressure, sink 20x slower per record (Flink's job), {where}")
    secs, rate = p["phase_seconds"], p["bp_rate"]
    runs = {
        "unaligned": dict(mode="unaligned", sink="per_record"),
        "unaligned_batched": dict(mode="unaligned", sink="batched"),
        "slow_operator": dict(mode="unaligned", sink="batched", slow_operator=True),
        "aligned": dict(mode="aligned", sink="per_record"),
        "aligned_debloat": dict(mode="aligned", sink="per_record", debloat=True),
    }
    if workers is None:
        # the topology Flink's job has by default, for the chained side of the Flink peer
        runs["aligned_chained"] = dict(mode="aligned", sink="per_record", chaining=True)
    # an aligned checkpoint takes seconds here: a longer run, for a median of several
    got = {name: backpressure_durations(secs * (3 if name.startswith("aligned") else 1), rate, tmp,
                                        workers=workers, **kw) for name, kw in runs.items()}

    def med(name):
        d = got[name]["durations"]
        return statistics.median(d) if d else float("nan")

    def note(name):
        g = got[name]
        d = sorted(g["durations"])
        spread = f", {d[0]:.3g}..{d[-1]:.3g} s" if d else ""
        run_s = secs * (3 if name.startswith("aligned") else 1)
        sink_rate = f", sink {g['sink_records_per_s']:,.0f} records/s" if runs[name].get("sink") == "per_record" else ""
        return f"median of {len(d)} in {run_s:g} s{spread}; max backpressured {g['bp']:.0f} ms/s{sink_rate}"

    rep.add(f"unaligned_checkpoint_ms_backpressure{sfx}", med("unaligned") * 1000, "ms",
            goal=Goal("<=", 20, "ms"), note=note("unaligned"))
    rep.add(f"unaligned_checkpoint_ms_backpressure_batched_sink{sfx}", med("unaligned_batched") * 1000, "ms",
            note=note("unaligned_batched"))
    rep.add(f"unaligned_checkpoint_ms_slow_operator{sfx}", med("slow_operator") * 1000, "ms",
            goal=Goal("<=", 50, "ms"), note=note("slow_operator") + f", an operator at {SLOW_OPERATOR_S * 1000:g} "
                                                                    "ms a record")
    rep.add(f"aligned_checkpoint_s_backpressure{sfx}", med("aligned"), "s", goal=Goal("<=", 4.7, "s"),
            note=note("aligned"))
    rep.add(f"aligned_checkpoint_s_backpressure_debloat{sfx}", med("aligned_debloat"), "s",
            goal=Goal("<=", 1.5, "s"), note=note("aligned_debloat"))
    if workers is None:
        rep.add("aligned_checkpoint_s_backpressure_chained", med("aligned_chained"), "s",
                note=note("aligned_chained") + "; chaining on: 2 tasks, 1 exchange")
        flink_section(rep, p, tmp, {name: got[name] for name in ("aligned", "aligned_chained", "unaligned")})
    for name in ("unaligned", "aligned", "aligned_debloat", "slow_operator"):
        b = breakdown(got[name]["entries"])
        key = f"checkpoint_phase_breakdown{sfx}" + ("" if name == "unaligned" else f"_{name}")
        rep.figures[key] = b
        rep.units[key] = "ms"
        if b is not None:
            rep.con.print(f"  {key}: " + ", ".join(f"{k} {b[k]}" for k in ("duration_ms",) + _BREAKDOWN
                                                 if b.get(k) is not None))


def _median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def _spread(xs, scale=1.0, unit="s") -> str:
    return f"{min(xs) * scale:.3g}..{max(xs) * scale:.3g} {unit}" if xs else "none completed"


def flink_section(rep, p, tmp, ours: dict) -> None:
    """Issue 32: the same backpressured job on Flink 2.3 (benchmarks/flink_peer),
    run here after ours, in both topologies; ``ours``: our runs of it
    (``aligned``, ``aligned_chained``, ``unaligned``). Skipped, with the reason
    in a note, where the peer cannot run (no JDK, no Maven to fetch Flink)."""
    rep.section("the same job on Flink 2.3 (benchmarks/flink_peer), sink 20x slower per record")
    try:
        prepared = flink_peer.prepare()
    except (flink_peer.FlinkPeerUnavailable, OSError) as e:
        rep.add("flink_aligned_checkpoint_s_backpressure", float("nan"), "s",
                note=f"Flink peer skipped: {str(e).splitlines()[0]}")
        return
    secs, rate = p["phase_seconds"], p["bp_rate"]
    runs = {"aligned": (3 * secs, "aligned", "unchained"), "aligned_chained": (3 * secs, "aligned", "chained"),
            "unaligned": (secs, "unaligned", "rebalance")}
    got = {}
    for name, (run_s, mode, topology) in runs.items():
        try:
            got[name] = flink_peer.run(rate, run_s, mode, topology, BP_KEYS, tmp=tmp, prepared=prepared)
        except (flink_peer.FlinkPeerFailed, OSError) as e:
            rep.con.print(f"  Flink peer {name}: {str(e).splitlines()[0]}")
            got[name] = None

    def fnote(name):
        g = got[name]
        if g is None:
            return "the peer failed (see above)"
        return (f"median of {len(g['durations'])} in {runs[name][0]:g} s, {_spread(g['durations'])}; "
                f"sink {g['sink_records_per_s']:,.0f} records/s; {runs[name][2]}")

    def fmed(name):
        return _median(got[name]["durations"]) if got[name] else float("nan")

    rep.add("flink_aligned_checkpoint_s_backpressure", fmed("aligned"), "s",
            note=fnote("aligned") + " (5 tasks, 4 exchanges, as ours)")
    rep.add("flink_aligned_checkpoint_s_backpressure_chained", fmed("aligned_chained"), "s",
            note=fnote("aligned_chained") + " (Flink's default: 2 tasks, 1 exchange)")
    rep.add("flink_unaligned_checkpoint_ms_backpressure", fmed("unaligned") * 1000, "ms",
            note=fnote("unaligned") + " (unchained, forward exchanges as rebalance: Flink keeps a barrier "
                                      "aligned on a forward one)")
    our = {k: _median(v["durations"]) for k, v in ours.items()}
    rep.add("aligned_checkpoint_vs_flink", our["aligned"] / fmed("aligned"), "x",
            note=f"ours / Flink's, same topology (unchained): {our['aligned']:.3g} s vs {fmed('aligned'):.3g} s")
    rep.add("aligned_checkpoint_vs_flink_chained", our["aligned_chained"] / fmed("aligned_chained"), "x",
            note=f"ours / Flink's, both chained: {our['aligned_chained']:.3g} s vs {fmed('aligned_chained'):.3g} s")
    rep.add("unaligned_checkpoint_vs_flink", our["unaligned"] / fmed("unaligned"), "x",
            note=f"ours / Flink's: {our['unaligned'] * 1000:.3g} ms vs {fmed('unaligned') * 1000:.3g} ms")


def recovery(keys, value_size, tmp) -> dict:
    """Build keyed state, let one checkpoint complete, fail, time the restore."""
    marks = {}
    n = keys * 4

    def failing(x):
        # fails once, at the first record after a checkpoint holding the whole
        # state completed (the map runs as one subtask: nothing else calls it
        # in the failed attempt afterwards)
        if "failed_at" not in marks:
            if x >= keys and marks.get("checkpointed"):
                marks["failed_at"] = time.monotonic()
                raise RuntimeError("injected failure")
        elif "first_after" not in marks:
            marks["first_after"] = time.monotonic()
        return x

    def job(fail: bool):
        env = fb.Environment(chaining=False, checkpoint_interval=0.5, restart_attempts=1,
                             checkpoint_dir=tempfile.mkdtemp(dir=tmp))
        pad = "v" * value_size
        out = (env.from_sequence(0, n)
                  .map(failing if fail else (lambda x: x), kind="int64", name="maybe_fail")
                  .map(lambda x: (x % keys, pad + str(x)), kind="struct", name="value")
                  .key_by(lambda kv: kv[0])
                  .reduce(lambda a, b: b, name="last").uid("last")
                  .filter(lambda kv: kv[0] < 100, name="few")
                  .collect())
        ex = env.execute_async()
        if fail:
            while not ex.done:
                ok = [c for c in env.checkpoints() if c["status"] == "completed" and c.get("state_bytes", 0)
                      >= keys * value_size]
                if ok:
                    marks["checkpointed"] = ok[-1]
                    break
                time.sleep(0.05)
        ex.join(600)
        return sorted(out.result), env

    got, env = job(True)
    want, _ = job(False)
    ck = marks.get("checkpointed") or {}
    return {"recovery_s": marks["first_after"] - marks["failed_at"] if "first_after" in marks else float("nan"),
            "state_write_s": ck.get("duration_s", float("nan")),
            "state_bytes": ck.get("state_bytes", 0),
            "exactly_once_ok": int(got == want and env.last_execution.restarts == 1)}


def savepoint_durations(n, count, tmp) -> list:
    """Savepoints of the keyed count while it runs, one after the other."""
    env = fb.Environment(chaining=False, checkpoint_interval=1.0, checkpoint_dir=tempfile.mkdtemp(dir=tmp))
    _keyed_count(env, env.from_sequence(0, n)).sink(lambda batch: None, batched=True)
    job = env.execute_async()
    took = []
    try:
        for i in range(count):
            if job.done:
                break
            t0 = time.perf_counter()
            job.savepoint(tempfile.mkdtemp(dir=tmp) + f"/sp-{i}")
            took.append(time.perf_counter() - t0)
    except fb.errors.FlowBufError:
        pass            # the job ended meanwhile: keep what was measured
    job.join(600)
    by_path = [c["duration_s"] for c in env.checkpoints() if c.get("savepoint") and c["status"] == "completed"]
    return by_path or took


def _state_job(env, keys, value_size, p):
    pad = "v" * value_size
    (env.from_sequence(0, None, parallelism=p).uid("numbers")
        .map(lambda x: (x % keys, pad + str(x)), kind="struct", name="value")
        .key_by(lambda kv: kv[0])
        .reduce(lambda a, b: b, name="last").uid("last")
        .filter(lambda kv: False, name="none")
        .sink(lambda batch: None, batched=True))


def rescale_restore(keys, value_size, repeats, tmp) -> dict:
    """Build keyed state at parallelism 2, stop with a savepoint, then time
    the restore of that savepoint at 2 and at 4 (interleaved)."""
    from pyflowbuf.runtime.job import JobExecution

    ck = tempfile.mkdtemp(dir=tmp)
    env = fb.Environment(parallelism=2, chaining=False, checkpoint_interval=300.0, checkpoint_dir=ck)
    _state_job(env, keys, value_size, 2)
    job = env.execute_async()
    while True:
        m = job.metrics()
        seen = sum(v.get("records_in", 0) for k, v in m.items() if k.startswith("last"))
        if seen >= 2 * keys or job.done:
            break
        time.sleep(0.2)
    sp = job.stop(savepoint=tempfile.mkdtemp(dir=tmp) + "/sp")
    meta = SavepointStorage(sp).latest()

    def restore(p):
        def run():
            env = fb.Environment(parallelism=p, chaining=False, checkpoint_interval=300.0,
                                 checkpoint_dir=tempfile.mkdtemp(dir=tmp))
            _state_job(env, keys, value_size, p)
            ex = JobExecution(env.job_spec())      # the runtime receives the job as a JobSpec
            ex.restore_from = sp
            ex.launcher.open()
            ex.launcher.build()                     # the deployment, as start() builds it before the restore
            t0 = time.perf_counter()
            ex._start_checkpointing([])
            took = time.perf_counter() - t0
            ex._stop_checkpointing()
            return took
        return run

    times = {"p2": [], "p4": []}
    for _ in range(repeats):
        times["p2"].append(restore(2)())
        times["p4"].append(restore(4)())
    p2, p4 = statistics.median(times["p2"]), statistics.median(times["p4"])
    return {"plain_s": p2, "rescale_s": p4, "ratio": p4 / p2, "state_bytes": meta.properties["operators"]["last"]
            ["state_bytes"]}


def main(quick: bool = False) -> dict:
    p = params(quick)
    with tempfile.TemporaryDirectory(prefix="pyflowbuf-bench-") as tmp:
        n = p["n"]
        if p["min_run_s"]:
            # size the input so that a plain run lasts at least MIN_RUN_S: the calibration
            # run's rate, with a margin for the load of a shared machine changing meanwhile
            rate = max(overhead_case(2_000_000, None, tmp)() for _ in range(2))
            n = max(n, int(rate * p["min_run_s"] * 1.6))
        p = dict(p, n=n)
        rep = common.Report("checkpoint", quick, params={**p, "keys": KEYS, "bp_keys": BP_KEYS, "chaining": False,
                                                          "segment_size": 32 * 1024, "checkpoint_interval_s": 1.0})
        rep.section(f"keyed count of {KEYS} keys, chaining off: a checkpoint every second vs none")
        durations: list = []
        run_s: dict = {"checkpointed": [], "plain": []}
        with common.progress("overhead", p["repeats"]) as adv:
            s = common.interleaved({"checkpointed": overhead_case(n, durations, tmp, run_s["checkpointed"]),
                                    "plain": overhead_case(n, None, tmp, run_s["plain"])}, p["repeats"],
                                   advance=adv)
        rep.add("checkpointed_records_per_s", s.median("checkpointed"), "records/s")
        rep.add("plain_records_per_s", s.median("plain"), "records/s")
        rep.add("checkpoint_overhead_ratio", s.ratio("checkpointed", "plain"), "x", goal=Goal(">=", 0.95, "x"),
                note=f"median of {p['repeats']} paired runs of {n:,} records, {KEYS:,} keys")
        rep.add("overhead_run_s", min(run_s["plain"]), "s",
                note=f"the shortest plain run (checkpointed: {min(run_s['checkpointed']):.3g} s)")
        rep.add("aligned_checkpoint_s_no_backpressure",
                statistics.median(durations) if durations else float("nan"), "s",
                note=f"median of {len(durations)} checkpoints")
        sps = savepoint_durations(p["n"], 5, tmp)
        rep.add("savepoint_s", statistics.median(sps) if sps else float("nan"), "s",
                note=f"median of {len(sps)} savepoints of the same job")

        rep.section("a sink 20x slower than the source: the barrier waits behind queued buffers")
        bp = backpressure_durations(p["bp_seconds"], p["bp_rate"], tmp)
        bp_durations = bp["durations"]
        rep.add("aligned_checkpoint_s_backpressure_batched_sink",
                statistics.median(bp_durations) if bp_durations else float("nan"), "s",
                note=f"median of {len(bp_durations)} completed in {p['bp_seconds']} s; max backpressured "
                     f"{bp['bp']:.0f} ms/s")
        p_ua = dict(p, ua_seconds=p["bp_seconds"])
        unaligned_section(rep, p_ua, tmp, aligned=bp)
        unaligned_section(rep, p_ua, tmp, workers=2)
        phase_section(rep, p, tmp)
        phase_section(rep, p, tmp, workers=2)

        rep.section("recovery from a failure with keyed state")
        r = recovery(p["state_keys"], p["state_value"], tmp)
        rep.add("recovery_s", r["recovery_s"], "s", note="failure -> first record processed after restore")
        rep.add("state_write_s", r["state_write_s"], "s", note="the checkpoint that wrote the state once")
        rep.add("recovery_state_mib", r["state_bytes"] / 2**20, "MiB")
        rep.add("exactly_once_ok", r["exactly_once_ok"], "", goal=Goal(">=", 1, ""))

        rep.section("restoring keyed state at another parallelism (key groups)")
        rs = rescale_restore(p["rescale_keys"], p["state_value"], p["rescale_repeats"], tmp)
        rep.add("rescale_restore_vs_plain_restore", rs["ratio"], "x", goal=Goal("<=", 1.5, "x"),
                note=f"2 -> 4: {rs['rescale_s']:.3g} s, 2 -> 2: {rs['plain_s']:.3g} s, "
                     f"{rs['state_bytes'] / 2**20:.0f} MiB of keyed state, median of {p['rescale_repeats']} each")
        rep.add("rescale_state_mib", rs["state_bytes"] / 2**20, "MiB")
    return rep.as_dict()


if __name__ == "__main__":
    result = main(quick="--quick" in sys.argv[1:])
    sys.stdout.write(json.dumps(common.jsonable(result), allow_nan=False, separators=(",", ":")) + "\n")
