"""Per-subtask metrics, sampled on a timer: Flink's busy / idle /
backpressured time in ms per second, records and bytes in and out, pool
usage, and the backpressure level (OK <= 10 %, LOW <= 50 %, HIGH above)."""
from __future__ import annotations

import json
import math
import threading
import time

from pyflowbuf import monitoring
# The levels live in monitoring, next to their gauge codes and colours; LEVELS
# stays importable from here, where it was defined before.
from pyflowbuf.monitoring import LEVELS, backpressure_level  # noqa: F401


def _debloat_figures(m: dict, gates) -> dict:
    """Buffer debloating (when on): per input gate, and the task's totals."""
    if gates:
        m["debloat"] = gates
        m["debloat_buffer_size"] = min(g["buffer_size"] for g in gates)
        m["debloat_time_to_consume_s"] = max(g["time_to_consume_s"] for g in gates)
        m["debloat_inflight_bytes"] = sum(g["inflight_bytes"] for g in gates)
        m["debloat_segments_held"] = sum(g["segments_held"] for g in gates)
    return m


def _rates(prev: dict, cur: dict, dt_ns: int) -> dict:
    dt_ns = max(dt_ns, 1)
    idle = min(1.0, (cur["idle_ns"] - prev["idle_ns"]) / dt_ns)
    bp = min(1.0 - idle, (cur["backpressure_ns"] - prev["backpressure_ns"]) / dt_ns)
    per_s = 1e9 / dt_ns
    return _debloat_figures({
        "busy_ms_per_s": round(1000 * max(0.0, 1.0 - idle - bp), 1),
        "idle_ms_per_s": round(1000 * idle, 1),
        "backpressured_ms_per_s": round(1000 * bp, 1),
        "records_in_per_s": (cur["records_in"] - prev["records_in"]) * per_s,
        "records_out_per_s": (cur["records_out"] - prev["records_out"]) * per_s,
        "bytes_in_per_s": (cur["bytes_in"] - prev["bytes_in"]) * per_s,
        "bytes_out_per_s": (cur["bytes_out"] - prev["bytes_out"]) * per_s,
        "records_in": cur["records_in"],
        "records_out": cur["records_out"],
        "bytes_in": cur["bytes_in"],
        "bytes_out": cur["bytes_out"],
        "buffers_out": cur.get("buffers_out", 0),
        "remote_buffers_in": cur.get("remote_buffers_in", 0),
        "credit_available": cur.get("credit_available"),
        "sender_backlog": cur.get("sender_backlog"),
        # checkpoints: the last one this task acknowledged and its alignment time
        "last_checkpoint": cur.get("last_checkpoint", 0),
        "checkpoint_alignment_ms": cur.get("checkpoint_alignment_ms", 0.0),
        "in_pool_usage": round(cur["in_pool_usage"], 3),
        "out_pool_usage": round(cur["out_pool_usage"], 3),
        "level": backpressure_level(bp),
    }, cur.get("debloat"))


_ZERO = {"idle_ns": 0, "backpressure_ns": 0, "records_in": 0, "records_out": 0,
         "bytes_in": 0, "bytes_out": 0, "buffers_out": 0, "in_pool_usage": 0.0, "out_pool_usage": 0.0}


def make_listeners(spec) -> list:
    """The listeners an Environment asks for, the Prometheus exporter first: it
    binds a port, the one thing here that can fail for reasons outside the job
    (PortUnavailableError), and must fail before anything else is opened."""
    listeners: list = []
    m = spec.metrics_config
    try:
        if m.prometheus_port is not None or m.live_view:
            if m.prometheus_port is not None:
                listeners.append(monitoring.PrometheusExporter(m.prometheus_port, spec.name))
            if m.live_view:
                listeners.append(monitoring.LiveView(spec.name))
        if m.log:
            listeners.append(JsonLinesLog(m.log, spec.name))
    except BaseException:
        close_listeners(listeners)
        raise
    return listeners


def close_listeners(listeners) -> None:
    for listener in listeners:
        close = getattr(listener, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # an exporter must never break the job
                pass


def _publish(listeners, snap) -> None:
    for listener in listeners:
        try:
            listener(snap)
        except Exception:  # an exporter must never break the job
            pass


def operator_ids(vertex) -> list:
    """The operator ids (``Stream.uid``) of a task's chain, source included."""
    return [n.operator_uid for n in vertex.nodes]


class MetricsSampler(threading.Thread):
    """Samples every ``interval`` s; ``listeners`` get each snapshot (the
    JSON-lines log, Prometheus gauges and the live view hang off this).
    ``stop()`` takes the final sample, the last thing the job records."""

    def __init__(self, job, interval: float, listeners: list | None = None):
        super().__init__(name="pyflowbuf: metrics", daemon=True)
        self.job = job
        self.interval = interval
        self._stop_event = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._lock = threading.Lock()
        self._prev: dict = {}
        self._older = None                # (counters, t) of the sample before the last
        self._latest: dict = {}
        self.history: list = []           # (t, snapshot) pairs, bounded
        self.listeners: list = make_listeners(job.spec) if listeners is None else listeners
        self._t0 = time.monotonic_ns()
        self._prev_t = self._t0

    def _sample(self, final=False):
        now = time.monotonic_ns()
        base, base_t = self._prev, self._prev_t
        if final and self._older is not None and now - base_t < self.interval * 0.25e9:
            # per-second rates over a sliver of time are noise: the final
            # figures span the interval before it as well
            base, base_t = self._older
        snap = {}
        counters = {}
        for t in self.job.tasks:
            cur = counters[t.task_name] = t.counters()
            m = _rates(base.get(t.task_name, _ZERO), cur, now - base_t)
            m["vertex"] = t.vertex.name
            m["operator_ids"] = operator_ids(t.vertex)    # the ids checkpoints store their state under
            m["subtask"] = t.index
            m["state"] = t.state
            extra = getattr(t, "operator_metrics", None)     # event time: late records
            if extra is not None:
                m.update(extra())
            event_time = t.event_time
            if event_time is not None and event_time.in_job():
                # the last watermark the subtask sent downstream (None: none yet; inf: input ended)
                wm = event_time.wm_out
                m["watermark"] = None if wm == -math.inf else wm
            snap[t.task_name] = m
        self._older = (self._prev, self._prev_t)
        self._prev, self._prev_t = counters, now
        with self._lock:
            self._latest = snap
            self.history.append(((now - self._t0) / 1e9, snap))
            if len(self.history) > 3600:
                del self.history[:600]
        _publish(self.listeners, snap)
        return snap

    def run(self):
        while not self._stop_event.wait(self.interval):
            self._sample()

    def stop(self):
        """Stop sampling, take the final sample and close the listeners. A
        second call (the watcher and join() both stop the sampler) waits for
        the first to finish, so whoever returns from it sees the final sample."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
            self._stop_event.set()
            if self.is_alive() and self is not threading.current_thread():
                self.join()
            try:
                self._sample(final=True)
            finally:
                close_listeners(self.listeners)

    def forget_counters(self) -> None:
        """A restarted job has new tasks whose counters start again from zero:
        rates are measured from them, not from the failed attempt's."""
        with self._lock:
            self._prev = {}
            self._older = None

    def latest(self) -> dict:
        with self._lock:
            return dict(self._latest)

    def summary(self) -> dict:
        """Whole-run figures per task (averages since start)."""
        out = {}
        for t in self.job.tasks:
            span_ns = max(1, (t.finished_ns or time.monotonic_ns()) - (t.started_ns or self._t0))
            m = _rates(_ZERO, t.counters(), span_ns)
            m["vertex"] = t.vertex.name
            m["operator_ids"] = operator_ids(t.vertex)
            m["state"] = t.state
            out[t.task_name] = m
        return out


class JsonLinesLog:
    """Appends one JSON object per task per sample."""

    def __init__(self, path, job_name):
        self.fh = open(path, "a", encoding="utf-8")
        self.job_name = job_name

    def __call__(self, snap):
        ts = time.time()
        for task, m in snap.items():
            self.fh.write(json.dumps({"ts": round(ts, 3), "job": self.job_name, "task": task, **m}) + "\n")
        self.fh.flush()

    def checkpoint(self, entry):
        """One line per checkpoint: ``{"ts", "job", "checkpoint": {...}}``, the
        entry of ``Environment.checkpoints()`` with its ``subtasks`` and ``phases``."""
        line = json.dumps({"ts": round(time.time(), 3), "job": self.job_name, "checkpoint": entry}, default=str)
        self.fh.write(line + "\n")
        self.fh.flush()

    def close(self):
        self.fh.close()


class MetricsRelay:
    """The calling process's side of the metrics of a job spread over worker
    processes: each worker samples its own tasks and sends the snapshots;
    this merges them, keeps the history and feeds the listeners (served here,
    once for the whole job) every ``interval``. ``close()`` publishes the
    final merged snapshot, built from each worker's final sample."""

    def __init__(self, interval: float, listeners: list):
        self.interval = interval
        self.listeners = listeners
        self.history: list = []
        self._parts: dict = {}
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._next = self._t0 + interval
        self._closing = self._closed = False

    def update(self, worker, snapshot: dict) -> None:
        with self._lock:
            if not self._closed:
                self._parts[worker] = snapshot

    def latest(self) -> dict:
        with self._lock:
            out: dict = {}
            for w in sorted(self._parts):
                out.update(self._parts[w])
            return out

    def workers(self) -> dict:
        """task name -> the worker whose sample holds it (the web view's column)."""
        with self._lock:
            return {task: w for w in sorted(self._parts) for task in self._parts[w]}

    def seconds_to_next(self) -> float:
        return max(0.0, self._next - time.monotonic())

    def tick(self) -> None:
        """Publish if a sample is due."""
        now = time.monotonic()
        if now >= self._next and not self._closed:
            self._next = now + self.interval
            self._publish()

    def _publish(self):
        snap = self.latest()
        if not snap:
            return
        with self._lock:
            self.history.append((time.monotonic() - self._t0, snap))
            if len(self.history) > 3600:
                del self.history[:600]
        _publish(self.listeners, snap)

    def stop(self) -> None:
        """As ``MetricsSampler.stop``: the final merged sample, the listeners closed."""
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._closing:
                return
            self._closing = True
        try:
            self._publish()
        finally:
            with self._lock:
                self._closed = True
            close_listeners(self.listeners)
