"""Per-subtask metrics, sampled on a timer: Flink's busy / idle /
backpressured time in ms per second, records and bytes in and out, pool
usage, and the backpressure level (OK <= 10 %, LOW <= 50 %, HIGH above)."""
from __future__ import annotations

import json
import threading
import time

LEVELS = ((0.10, "OK"), (0.50, "LOW"))


def backpressure_level(ratio: float) -> str:
    for limit, name in LEVELS:
        if ratio <= limit:
            return name
    return "HIGH"


def _rates(prev: dict, cur: dict, dt_ns: int) -> dict:
    dt_ns = max(dt_ns, 1)
    idle = min(1.0, (cur["idle_ns"] - prev["idle_ns"]) / dt_ns)
    bp = min(1.0 - idle, (cur["backpressure_ns"] - prev["backpressure_ns"]) / dt_ns)
    per_s = 1e9 / dt_ns
    return {
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
        "in_pool_usage": round(cur["in_pool_usage"], 3),
        "out_pool_usage": round(cur["out_pool_usage"], 3),
        "level": backpressure_level(bp),
    }


_ZERO = {"idle_ns": 0, "backpressure_ns": 0, "records_in": 0, "records_out": 0,
         "bytes_in": 0, "bytes_out": 0, "in_pool_usage": 0.0, "out_pool_usage": 0.0}


class MetricsSampler(threading.Thread):
    """Samples every ``interval`` s; ``listeners`` get each snapshot (the
    JSON-lines log, Prometheus gauges and the live view hang off this)."""

    def __init__(self, job, interval: float):
        super().__init__(name="pyflowbuf: metrics", daemon=True)
        self.job = job
        self.interval = interval
        self._stop_event = threading.Event()
        self._lock = threading.Lock()
        self._prev: dict = {}
        self._first: dict = {}
        self._latest: dict = {}
        self.history: list = []           # (t, snapshot) pairs, bounded
        self.listeners: list = []
        self._t0 = time.monotonic_ns()
        self._prev_t = self._t0
        env = job.env
        if env.metrics_log:
            self.listeners.append(JsonLinesLog(env.metrics_log, env.name))
        if env.prometheus_port is not None or env.live_view:
            from pyflowbuf import monitoring
            if env.prometheus_port is not None:
                self.listeners.append(monitoring.PrometheusExporter(env.prometheus_port, env.name))
            if env.live_view:
                self.listeners.append(monitoring.LiveView(env.name))

    def _sample(self):
        now = time.monotonic_ns()
        snap = {}
        for t in self.job.tasks:
            cur = t.counters()
            prev = self._prev.get(t.task_name, _ZERO)
            m = _rates(prev, cur, now - self._prev_t)
            m["vertex"] = t.vertex.name
            m["subtask"] = t.index
            m["state"] = t.state
            snap[t.task_name] = m
            self._prev[t.task_name] = cur
        self._prev_t = now
        with self._lock:
            self._latest = snap
            self.history.append(((now - self._t0) / 1e9, snap))
            if len(self.history) > 3600:
                del self.history[:600]
        for listener in self.listeners:
            try:
                listener(snap)
            except Exception:  # an exporter must never break the job
                pass
        return snap

    def run(self):
        while not self._stop_event.wait(self.interval):
            self._sample()

    def stop(self):
        if self._stop_event.is_set():
            return
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join()
        # a final sample over a sliver of time gives noisy per-second rates
        if time.monotonic_ns() - self._prev_t >= self.interval * 0.25e9 or not self._latest:
            self._sample()
        for listener in self.listeners:
            close = getattr(listener, "close", None)
            if close:
                close()

    def latest(self) -> dict:
        with self._lock:
            return dict(self._latest)

    def summary(self) -> dict:
        """Whole-run figures per task (averages since start)."""
        end = self.job.ended or time.monotonic()
        out = {}
        for t in self.job.tasks:
            span_ns = max(1, (t.finished_ns or time.monotonic_ns()) - (t.started_ns or self._t0))
            m = _rates(_ZERO, t.counters(), span_ns)
            m["vertex"] = t.vertex.name
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

    def close(self):
        self.fh.close()
