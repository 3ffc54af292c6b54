"""The JSON the web view serves, built from what a job already reports:
``job.metrics()`` (the latest sample of every subtask), ``job.checkpoints()``
(the history, with per-subtask phases) and the job's plan (vertices = operator
chains, edges = exchanges). Nothing here touches a running task: every figure
is read from those public snapshots, so serving the page costs the job only
the sampler's work it does anyway.

Every function takes the ``JobView`` (``view_of``): the one place that knows
how to ask a job handle for its plan, its state and where its subtasks run.
"""
from __future__ import annotations

import heapq
import math
import socket
import time

from pyflowbuf.net import tls as _tls

# the figures of a subtask copied as they are from its metrics sample
SUBTASK_FIELDS = (
    "state", "level", "busy_ms_per_s", "idle_ms_per_s", "backpressured_ms_per_s",
    "records_in", "records_out", "records_in_per_s", "records_out_per_s",
    "bytes_in", "bytes_out", "bytes_in_per_s", "bytes_out_per_s", "buffers_out", "remote_buffers_in",
    "credit_available", "sender_backlog",
    "in_pool_usage", "out_pool_usage", "last_checkpoint", "checkpoint_alignment_ms",
    "debloat_buffer_size", "debloat_time_to_consume_s", "debloat_inflight_bytes", "debloat_segments_held",
)
# Rates the view sends in whole units (the page shows none finer: records per
# second as integers, bytes per second not at all): a 17-digit float costs JSON
# encoding three times an integer's, and these are 4 of a subtask row's floats,
# the most costly part of an answer at 800 subtasks. Rounded half up, as the
# page's Math.round does.
WHOLE_FIELDS = frozenset(("records_in_per_s", "records_out_per_s", "bytes_in_per_s", "bytes_out_per_s"))
# the figures of a checkpoint in the history table, copied as they are
CHECKPOINT_FIELDS = ("id", "kind", "status", "trigger_time", "duration_s", "alignment", "acknowledged",
                     "tasks", "state_bytes", "size", "inflight_bytes", "savepoint")
# one subtask's phases in a checkpoint's timeline, copied as they are
PHASE_FIELDS = ("source", "unaligned", "start_delay_ms", "alignment_ms", "inflight_wait_ms", "sync_ms",
                "write_queue_ms", "async_ms", "ack_ms", "bytes", "state_bytes", "inflight_bytes")
# Top N: how many of each ranking by default (what the page shows), the most
# one request may ask for, and the rankings: (name in the answer, the figure ranked by)
TOP_N = 10
TOP_N_MAX = 1000
TOP_RANKINGS = (("backpressured", "backpressured_ms_per_s"), ("busy", "busy_ms_per_s"), ("idle", "idle_ms_per_s"))
_LEVEL_RANK = {"OK": 0, "LOW": 1, "HIGH": 2}
_LIVE = ("RUNNING", "CREATED")


def _num(x):
    """JSON has no infinities or NaN: None for those."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _whole(x):
    """A rate in whole units for the JSON (``WHOLE_FIELDS``); None for inf and NaN."""
    if x.__class__ is float:
        return math.floor(x + 0.5) if x - x == 0 else None
    return x


def task_key(vertex_id: int, index: int) -> str:
    """A subtask's name in checkpoints (``checkpointing.coordinator.task_key``)."""
    return f"v{vertex_id}-{index}"


def task_name(vertex, index: int) -> str:
    """A subtask's name in metrics: ``"<vertex> (i/p)"``, as the runtime names it."""
    return f"{vertex.name} ({index + 1}/{vertex.parallelism})"


class JobView:
    """What the web view reads of a job handle (a ``JobExecution`` or
    ``ClusterExecution``): its plan, its public ``metrics()`` and
    ``checkpoints()``, whether it ended, and where each subtask runs. The only
    place here that names the handle's attributes."""

    def __init__(self, job, plan=None):
        self.job = job
        if plan is None:
            plan = _plan_of(job)
        self.vertices, self.edges = plan
        self.name = _job_name(job)
        self.started_wall = time.time()
        self.host = socket.gethostname()
        self._by_name = {}
        self._by_key = {}
        # each vertex's subtasks' (metrics name, checkpoint key), named once, not per poll
        self.names = {v.id: [(task_name(v, i), task_key(v.id, i)) for i in range(v.parallelism)]
                      for v in self.vertices}
        for v in self.vertices:
            for i, (name, key) in enumerate(self.names[v.id]):
                self._by_name[name] = (v, i)
                self._by_key[key] = name

    def metrics(self) -> dict:
        return self.job.metrics()

    def checkpoints(self) -> list:
        return self.job.checkpoints()

    def state(self) -> str:
        job = self.job
        if not job.done:
            return "RUNNING" if getattr(job, "ran", True) else "CREATED"
        if getattr(job, "failure", None) is not None:
            return "FAILED"
        if getattr(job, "stopped_with_savepoint", None) is not None:
            return "STOPPED"
        if getattr(job, "cancelled", False):
            return "CANCELED"
        return "FINISHED"

    def failure(self) -> str | None:
        f = getattr(self.job, "failure", None)
        if f is None:
            return None
        task, op, exc, _ = f
        return f"operator {op!r} in task {task!r} raised {type(exc).__name__}: {exc}"

    def placement(self) -> dict:
        """task name -> (worker, host) where known: threads in this process
        have no worker; with workers the calling process's metrics relay
        knows which worker sent each task's sample, and the job which host
        each worker's exchange server is on."""
        sampler = getattr(self.job, "sampler", None)
        workers_of = getattr(sampler, "workers", None)
        if workers_of is None:
            return {}
        addresses = getattr(self.job, "addresses", None) or {}
        out = {}
        for task, w in workers_of().items():
            addr = addresses.get(w)
            host = addr[0] if addr else None
            if host in ("127.0.0.1", "::1", "localhost"):
                host = self.host            # a worker forked here: this host's name
            out[task] = (w, host)
        return out

    def tls_config(self):
        """The TLSConfig of the view's HTTPS server, None when the job has TLS
        off. With workers or a SparkCluster the driver holds the job's
        ``AttemptTLS`` (``tls``): the user's certificate, or for ``tls=True``
        one issued by the job's CA for the view. A job of threads has only
        its spec's setting: the view makes that CA itself."""
        attempts = getattr(self.job, "tls", None)
        if not hasattr(attempts, "for_server"):
            spec = getattr(self.job, "spec", None)
            setting = getattr(spec, "tls", None)
            if setting is None or setting is False:
                return None
            attempts = self._own_tls = getattr(self, "_own_tls", None) or _tls.AttemptTLS(setting, self.name)
        return attempts.for_server(f"{self.name} web view")

    def name_of_key(self, key: str) -> str:
        return self._by_key.get(key, key)


def _plan_of(job):
    spec = getattr(job, "spec", None)       # the JobSpec every execution runs
    if spec is not None:
        return spec.plan()
    raise TypeError(f"{job!r} has no plan: pass plan=(vertices, edges) to pyflowbuf.ui.serve")


def _job_name(job) -> str:
    spec = getattr(job, "spec", None)
    return spec.name if spec is not None and spec.name else "job"


def job_info(view: JobView) -> dict:
    job = view.job
    started = getattr(job, "started", None)
    ended = getattr(job, "ended", None)
    now = time.monotonic()
    duration = None if started is None else round((ended if ended is not None else now) - started, 3)
    return {
        "name": view.name,
        "state": view.state(),
        "ended": bool(job.done),
        "failure": view.failure(),
        "duration_s": duration,
        "now": time.time(),
        "host": view.host,
        "workers": getattr(job, "workers", None) if isinstance(getattr(job, "workers", None), int) else None,
        "vertices": len(view.vertices),
        "subtasks": sum(v.parallelism for v in view.vertices),
        "restarts": getattr(job, "restarts", 0),
        "checkpointing": getattr(job, "coordinator", None) is not None,
    }


def _live(m: dict) -> bool:
    return m.get("state", "RUNNING") in _LIVE


def subtasks(view: JobView, metrics: dict | None = None, vertex_id: int | None = None) -> list:
    """One row per subtask (of ``vertex_id``, or all), in plan order: its
    figures as its metrics sample has them, the rates in whole units
    (``WHOLE_FIELDS``), infinities and NaN as None."""
    if metrics is None:
        metrics = view.metrics()
    where = view.placement()
    rows = []
    for v in view.vertices:
        if vertex_id is not None and v.id != vertex_id:
            continue
        for i, (name, key) in enumerate(view.names[v.id]):
            m = metrics.get(name)
            row = {"task": name, "vertex": v.name, "vertex_id": v.id, "subtask": i, "key": key,
                   "reported": m is not None}
            if m is not None:
                # (inline, not _num: 800 subtasks x 25 fields each poll) inf - inf and nan - nan are nan
                for k in SUBTASK_FIELDS:
                    if k in m:
                        x = m[k]
                        if x.__class__ is float:
                            if x - x != 0:
                                x = None
                            elif k in WHOLE_FIELDS:
                                x = math.floor(x + 0.5)
                        row[k] = x
                wm = m.get("watermark")
                row["watermark"] = _num(wm)
                row["watermark_end"] = wm == math.inf
            w = where.get(name)
            row["worker"] = None if w is None else w[0]
            row["host"] = view.host if w is None else (w[1] or view.host)
            rows.append(row)
    return rows


def _ranked_by(field):
    def key(entry):
        x = entry[2].get(field)
        # a figure not reported (None, NaN, missing) ranks below every reported one
        return -x if x.__class__ in (int, float) and x - x == 0 else math.inf
    return key


def top(view: JobView, metrics: dict | None = None, n: int = TOP_N) -> dict:
    """The ``n`` running subtasks of the whole job with the most backpressured,
    busy and idle time, most first (ties in plan order): a row each with the
    figure ranked by, its level, records in per second, and where it runs.
    ``running`` counts the running subtasks ranked; a ranking holds fewer than
    ``n`` when fewer run. Built here, not in the page: an answer of 3 x n rows,
    not every subtask's."""
    if metrics is None:
        metrics = view.metrics()
    running = []
    for v in view.vertices:
        for i, (name, _) in enumerate(view.names[v.id]):
            m = metrics.get(name)
            if m is not None and _live(m):
                running.append((v, i, m, name))
    where = view.placement() if running else {}
    out = {"n": n, "running": len(running)}
    for kind, field in TOP_RANKINGS:
        rows = []
        for v, i, m, name in heapq.nsmallest(n, running, key=_ranked_by(field)):     # stable: ties in plan order
            w = where.get(name)
            rows.append({"task": name, "vertex_id": v.id, "subtask": i, "worker": None if w is None else w[0],
                         field: _num(m.get(field)), "level": m.get("level"),
                         "records_in_per_s": _whole(m.get("records_in_per_s"))})
        out[kind] = rows
    return out


def graph(view: JobView, metrics: dict | None = None) -> dict:
    """Nodes (operator chains) with the figures of their subtasks: the
    maximum busy and backpressured time over the running ones (the node's
    colour, as Flink's), records per second summed, the worst level; edges
    with their partitioner and the in-flight bytes and announced buffer size
    of the gate they feed (with debloating on)."""
    if metrics is None:
        metrics = view.metrics()
    nodes = []
    for v in view.vertices:
        busy = bp = idle = 0.0
        rin = rout = 0.0
        level = None
        states: dict = {}
        live = 0
        for name, _ in view.names[v.id]:
            m = metrics.get(name)
            if m is None:
                continue
            st = m.get("state", "RUNNING")
            states[st] = states.get(st, 0) + 1
            rin += m.get("records_in_per_s", 0.0) or 0.0
            rout += m.get("records_out_per_s", 0.0) or 0.0
            if not _live(m):
                continue
            live += 1
            busy = max(busy, m.get("busy_ms_per_s", 0.0))
            bp = max(bp, m.get("backpressured_ms_per_s", 0.0))
            idle = max(idle, m.get("idle_ms_per_s", 0.0))
            lv = m.get("level", "OK")
            if level is None or _LEVEL_RANK.get(lv, 0) > _LEVEL_RANK.get(level, 0):
                level = lv
        nodes.append({
            "id": v.id, "name": v.name, "parallelism": v.parallelism,
            "operators": [n.name for n in v.nodes],
            "max_busy_ms_per_s": busy, "max_backpressured_ms_per_s": bp, "max_idle_ms_per_s": idle,
            "level": level, "live_subtasks": live, "states": states,
            "records_in_per_s": rin, "records_out_per_s": rout,
        })
    edges = []
    for e in view.edges:
        inflight = size = None
        gate = e.input_index
        for name, _ in view.names[e.target.id]:
            m = metrics.get(name)
            for g in (m or {}).get("debloat") or ():
                if g.get("gate") == gate:
                    inflight = (inflight or 0) + g.get("inflight_bytes", 0)
                    size = g.get("buffer_size") if size is None else min(size, g.get("buffer_size"))
        edges.append({"source": e.source.id, "target": e.target.id, "partitioner": e.partitioner,
                      "input": gate, "side_output": e.tag,
                      "inflight_bytes": inflight, "buffer_size": size})
    return {"nodes": nodes, "edges": edges}


def checkpoint_history(view: JobView) -> list:
    out = []
    for c in view.checkpoints():
        row = {k: _num(c.get(k)) for k in CHECKPOINT_FIELDS}
        if c.get("savepoint"):
            row["kind"] = "savepoint"
        elif c.get("alignment"):
            row["kind"] = c["alignment"]       # aligned / unaligned / switched by the timeout
        row["checkpoint_kind"] = c.get("kind")
        row["phases"] = {k: _num(v) for k, v in (c.get("phases") or {}).items()}
        row["failure"] = c.get("failure") or c.get("reason")
        out.append(row)
    return out


def checkpoint_detail(view: JobView, checkpoint_id: int) -> dict | None:
    """One checkpoint with its timeline: a row per subtask, slowest first
    (by the time from trigger to its acknowledgement)."""
    for c in view.checkpoints():
        if c.get("id") == checkpoint_id:
            break
    else:
        return None
    rows = []
    for key, p in (c.get("subtasks") or {}).items():
        row = {"key": key, "task": view.name_of_key(key)}
        for k in PHASE_FIELDS:
            row[k] = _num(p.get(k))
        rows.append(row)
    rows.sort(key=lambda r: -(r.get("ack_ms") or 0.0))
    head = {k: _num(c.get(k)) for k in CHECKPOINT_FIELDS}
    head["phases"] = {k: _num(v) for k, v in (c.get("phases") or {}).items()}
    head["timeline"] = rows
    return head


def watermarks(view: JobView, metrics: dict | None = None) -> list:
    """Per operator chain: its subtasks' current watermark (the last each sent
    downstream, event-time seconds), the minimum over them, and its lag behind
    wall-clock time."""
    if metrics is None:
        metrics = view.metrics()
    now = time.time()
    out = []
    for v in view.vertices:
        subs = []
        for i in range(v.parallelism):
            m = metrics.get(task_name(v, i)) or {}
            subs.append(m.get("watermark"))
        known = [w for w in subs if w is not None]
        low = min(known) if len(known) == len(subs) and known else None
        out.append({
            "id": v.id, "name": v.name, "event_time": any(w is not None for w in subs) or
            any("watermark" in (metrics.get(task_name(v, i)) or {}) for i in range(v.parallelism)),
            "watermark": _num(low), "watermark_end": low == math.inf,
            "lag_s": None if low is None or not math.isfinite(low) else round(now - low, 3),
            "subtasks": [_num(w) for w in subs],
        })
    return out
