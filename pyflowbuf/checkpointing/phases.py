"""The phases of a checkpoint: what each subtask measures of its part
(``start_phases`` when its first barrier came, ``phases_of`` in its
acknowledgement) and what the coordinator makes of them for the whole
checkpoint (``checkpoint_phases``, in each entry of ``Environment.checkpoints()``)."""
from __future__ import annotations

import time

# monotonic ns + this = wall-clock ns: the instants of a subtask's phases go
# to the coordinator as wall-clock times, which a worker process on the same
# host shares with the driver (monotonic clocks need not agree across hosts)
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def phases_of(ph: dict, write_ns: int, encoded_ns: int, written_ns: int, handle, fsync: bool) -> dict:
    """What one subtask reports of one checkpoint, in the acknowledgement
    (plain numbers: it crosses to the driver from a worker):
    ``barrier_at_ns`` (wall clock) when its first barrier came (a source:
    its trigger mail ran and it injected the barrier), ``ack_at_ns`` when
    its write was done and it acknowledged; ``alignment_ms`` the first
    barrier to the last, aligned (unaligned: 0, or how long it aligned before
    the alignment timeout switched it), ``inflight_wait_ms`` (unaligned)
    the first barrier to the last while in-flight input was recorded,
    ``sync_ms`` the snapshot in the task's thread, ``write_queue_ms`` the
    wait for a writer thread, ``async_ms`` the write (``encode_ms`` of it
    encoding, ``write_ms`` writing and, ``fsync`` True, syncing),
    ``bytes``/``state_bytes``/``inflight_bytes`` its file."""
    submit = ph.get("submit_ns", write_ns)
    return {"source": ph["source"], "unaligned": ph["unaligned"],
            "barrier_at_ns": ph["barrier_ns"] + _EPOCH_OFFSET_NS,
            "ack_at_ns": written_ns + _EPOCH_OFFSET_NS,
            "alignment_ms": ph["alignment_ns"] / 1e6,
            "inflight_wait_ms": ph.get("inflight_wait_ns", 0) / 1e6,
            "sync_ms": ph.get("sync_ns", 0) / 1e6,
            "write_queue_ms": max(0, write_ns - submit) / 1e6,
            "async_ms": (written_ns - write_ns) / 1e6,
            "encode_ms": (encoded_ns - write_ns) / 1e6,
            "write_ms": (written_ns - encoded_ns) / 1e6,
            "fsync": bool(fsync), "bytes": handle.size, "state_bytes": handle.state_bytes,
            "inflight_bytes": handle.inflight_bytes}


def start_phases(source: bool, barrier_ns: int, alignment_ns: int, unaligned: bool) -> dict:
    """The phases of one checkpoint at a subtask, started: the snapshot is
    taken next. ``barrier_ns`` (monotonic): when the first barrier came (a
    source: when its trigger mail ran)."""
    return {"source": source, "unaligned": unaligned,
            "barrier_ns": barrier_ns or time.monotonic_ns(), "alignment_ns": alignment_ns}


def _ms(ns) -> float:
    return round(max(0, ns) / 1e6, 3)


_PHASE_MAX = ("alignment_ms", "inflight_wait_ms", "sync_ms", "write_queue_ms", "async_ms", "write_ms")


def checkpoint_phases(p, completion=None) -> tuple[dict, dict]:
    """The phases of checkpoint ``p`` (the coordinator's pending record): per subtask (task key -> figures) and
    for the whole checkpoint (the slowest subtask's figure of each phase,
    then the coordinator's part). Where a subtask's figures are instants
    (its barrier, its acknowledgement) they count from the trigger.
    ``completion``: (the last acknowledgement handled, metadata written,
    commits carried out), wall-clock ns; None for a checkpoint that did not
    complete. A final state written for a subtask that had ended has no
    phases: it is listed with ``finished``."""
    t0 = p.trigger_at_ns
    subtasks: dict = {}
    for key in sorted(p.handles):
        ph = p.phases.get(key)
        acked = p.acked_at_ns.get(key, t0)
        if ph is None:
            subtasks[key] = {"finished": True, "ack_received_ms": _ms(acked - t0)}
            continue
        sub = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ph.items()
               if k not in ("barrier_at_ns", "ack_at_ns")}
        # a source: trigger -> barrier injected (its mail latency); else trigger -> first barrier
        sub["start_delay_ms"] = _ms(ph["barrier_at_ns"] - t0)
        sub["ack_ms"] = _ms(ph["ack_at_ns"] - t0)
        sub["ack_received_ms"] = _ms(acked - t0)
        if completion is not None:
            sub["ack_to_complete_ms"] = _ms(completion[2] - acked)
        subtasks[key] = sub
    measured = [s for s in subtasks.values() if "start_delay_ms" in s]
    phases: dict = {}
    if measured:
        sources = [s["start_delay_ms"] for s in measured if s["source"]]
        phases["trigger_to_source_ms"] = max(sources) if sources else None
        phases["start_delay_ms"] = max(s["start_delay_ms"] for s in measured)
        for k in _PHASE_MAX:
            phases[k] = round(max(s[k] for s in measured), 3)
        phases["bytes"] = sum(s["bytes"] for s in measured)
        phases["inflight_bytes"] = sum(s["inflight_bytes"] for s in measured)
        phases["unaligned_subtasks"] = sum(1 for s in measured if s["unaligned"])
        phases["fsync"] = all(s["fsync"] for s in measured)
    if p.acked_at_ns:
        phases["last_ack_ms"] = _ms(max(p.acked_at_ns.values()) - t0)
    if completion is not None:
        started, written, done = completion
        last = max(p.acked_at_ns.values(), default=started)
        phases["metadata_ms"] = _ms(written - started)
        phases["commits_ms"] = _ms(done - written)
        phases["completion_ms"] = _ms(done - last)
    return subtasks, phases
