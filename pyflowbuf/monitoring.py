"""Backpressure monitoring front ends: Prometheus gauges, a live terminal
table, and a plain-text table.

All three read the snapshots that :class:`pyflowbuf.runtime.metrics.MetricsSampler`
takes every ``metrics_interval`` seconds: ``{task_name: {busy_ms_per_s,
idle_ms_per_s, backpressured_ms_per_s, records_in/out(_per_s), bytes_in/out(_per_s),
in_pool_usage, out_pool_usage, level, vertex, subtask, state}}``. The sampler
creates them when the job's Environment asks for them::

    env = Environment(prometheus_port=9249)   # gauges on http://127.0.0.1:9249/metrics
    env = Environment(live_view=True)         # a rich table refreshed on each sample

Each is also a plain callable taking one snapshot, with ``close()``, so it
can be used on its own (``job.sampler.listeners.append(LiveView("job"))``).
Flink's levels: OK when backpressured <= 10 % of the time, LOW <= 50 %, HIGH above.
"""
from __future__ import annotations

import logging
import os
import threading

from pyflowbuf import errors

log = logging.getLogger("pyflowbuf.monitoring")

__all__ = ["PrometheusExporter", "LiveView", "snapshot_table", "LEVELS", "LEVEL_CODES", "LEVEL_STYLES",
           "backpressure_level"]

#: Backpressure level by the share of time backpressured: OK up to 10 %, LOW up to 50 %, HIGH above.
LEVELS = ((0.10, "OK"), (0.50, "LOW"))
#: Numeric value of the level gauge.
LEVEL_CODES = {"OK": 0, "LOW": 1, "HIGH": 2}
#: Colour of each level in the live view.
LEVEL_STYLES = {"OK": "green", "LOW": "yellow", "HIGH": "red"}

# (snapshot key, gauge suffix, help text)
_GAUGES = (
    ("busy_ms_per_s", "busy_ms_per_s", "Time busy (not idle, not backpressured), ms per second"),
    ("idle_ms_per_s", "idle_ms_per_s", "Time waiting for input, ms per second"),
    ("backpressured_ms_per_s", "backpressured_ms_per_s",
     "Time waiting for an output buffer, ms per second"),
    ("records_in", "records_in", "Records read since the task started"),
    ("records_out", "records_out", "Records written since the task started"),
    ("records_in_per_s", "records_in_per_s", "Records read per second over the last sample"),
    ("records_out_per_s", "records_out_per_s", "Records written per second over the last sample"),
    ("bytes_in", "bytes_in", "Bytes read from the network stack since the task started"),
    ("bytes_out", "bytes_out", "Bytes written to the network stack since the task started"),
    ("buffers_out", "buffers_out", "Buffers shipped since the task started (far more than bytes_out "
     "/ segment size means a flush per record)"),
    ("remote_buffers_in", "remote_buffers_in", "Buffers received over TCP from other workers since the "
     "task started"),
    ("bytes_in_per_s", "bytes_in_per_s", "Bytes read per second over the last sample"),
    ("bytes_out_per_s", "bytes_out_per_s", "Bytes written per second over the last sample"),
    ("in_pool_usage", "in_pool_usage", "Input buffers queued / input capacity (0..1)"),
    ("out_pool_usage", "out_pool_usage", "Output pool segments in use / pool cap (0..1)"),
    ("last_checkpoint", "last_checkpoint", "Id of the last checkpoint this task snapshotted"),
    ("checkpoint_alignment_ms", "checkpoint_alignment_ms",
     "Time the task spent aligning barriers for its last checkpoint, ms"),
    # buffer debloating (present only when it is on)
    ("debloat_buffer_size", "debloat_buffer_size", "Debloated buffer size of the task's input gates, bytes"),
    ("debloat_time_to_consume_s", "debloat_time_to_consume_s",
     "Estimated time to consume the in-flight buffers of the task's input gates, s"),
    ("debloat_inflight_bytes", "debloat_inflight_bytes", "Bytes queued in the task's input gates"),
    ("debloat_segments_held", "debloat_segments_held", "Segments held for the task's input gates"),
)
# checkpoint-level gauges: (history key, gauge suffix, help text)
_CHECKPOINT_GAUGES = (
    ("id", "last_id", "Id of the last checkpoint that ended"),
    ("duration_s", "last_duration_seconds", "Trigger to completion of the last checkpoint, seconds"),
    ("state_bytes", "last_state_bytes", "Bytes of state in the last completed checkpoint"),
    ("max_alignment_ms", "last_max_alignment_ms", "Longest alignment of any task in the last checkpoint, ms"),
    ("inflight_bytes", "last_inflight_bytes",
     "Bytes of in-flight data (buffers overtaken by unaligned barriers) in the last completed checkpoint"),
    ("unaligned", "last_unaligned",
     "How the last completed checkpoint was taken: 0 aligned, 1 unaligned, 2 switched by the alignment timeout"),
)
# the phases of the last completed checkpoint (its entry's "phases": the
# slowest subtask's figure of each, then the coordinator's), ms
_PHASE_GAUGES = ("trigger_to_source_ms", "start_delay_ms", "alignment_ms", "inflight_wait_ms", "sync_ms",
                 "write_queue_ms", "async_ms", "last_ack_ms", "metadata_ms", "commits_ms", "completion_ms")
_LABELS = ("job", "task", "vertex")
_TIME_KEYS = ("busy_ms_per_s", "idle_ms_per_s", "backpressured_ms_per_s")
_NAN = float("nan")


def backpressure_level(ratio: float) -> str:
    """The level (OK / LOW / HIGH) of a task backpressured ``ratio`` of the time."""
    for limit, name in LEVELS:
        if ratio <= limit:
            return name
    return "HIGH"


def _is_live(m: dict) -> bool:
    """Whether the ms/s figures mean anything: once a task has ended its
    counters stop, and the sampler reports it as busy 1000 ms/s."""
    return m.get("state", "RUNNING") in ("RUNNING", "CREATED")


def _ms(m: dict, key: str) -> str:
    return f"{m.get(key, 0):.0f}" if _is_live(m) else "-"


def _level_of(m: dict) -> str:
    level = m.get("level")
    if level in LEVEL_CODES:
        return level
    return backpressure_level(m.get("backpressured_ms_per_s", 0.0) / 1000.0)


class PrometheusExporter:
    """Per-task gauges served over HTTP for Prometheus to scrape.

    Off unless asked for (``Environment(prometheus_port=...)``). Binds
    ``addr`` (127.0.0.1 by default: expose it on purpose, not by accident);
    ``port=0`` takes a free port, read it back from :attr:`port`. Each exporter
    has its own registry, so several jobs in one process do not collide.
    Gauges are named ``pyflowbuf_task_<metric>`` and labelled job/task/vertex;
    ``pyflowbuf_task_backpressure_level`` is 0 (OK), 1 (LOW) or 2 (HIGH).
    """

    def __init__(self, port: int = 9249, job_name: str = "job", *, addr: str = "127.0.0.1",
                 registry=None, serve: bool = True):
        import prometheus_client as pc  # optional dependency (extra "monitor")

        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise errors.ConfigurationError(
                f"prometheus_port must be an int in 0..65535 (0: a free port), got {port!r}")
        self.job_name = job_name
        self.addr = addr
        self.registry = registry if registry is not None else pc.CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._gauges = {
            key: pc.Gauge(f"pyflowbuf_task_{suffix}", doc, _LABELS, registry=self.registry)
            for key, suffix, doc in _GAUGES
        }
        self._level = pc.Gauge("pyflowbuf_task_backpressure_level",
                               "Backpressure level: 0 OK (<= 10 %), 1 LOW (<= 50 %), 2 HIGH",
                               _LABELS, registry=self.registry)
        self._running = pc.Gauge("pyflowbuf_task_running", "1 while the task is RUNNING, else 0",
                                 _LABELS, registry=self.registry)
        self._checkpoint = {
            key: pc.Gauge(f"pyflowbuf_checkpoint_{suffix}", doc, ("job",), registry=self.registry)
            for key, suffix, doc in _CHECKPOINT_GAUGES
        }
        self._checkpoints = pc.Counter("pyflowbuf_checkpoints", "Checkpoints that ended, by status",
                                       ("job", "status"), registry=self.registry)
        self._phase = pc.Gauge("pyflowbuf_checkpoint_last_phase_ms",
                               "A phase of the last completed checkpoint, ms: the slowest subtask's "
                               "(trigger_to_source, start_delay, alignment, inflight_wait, sync, write_queue, "
                               "async), then the coordinator's (last_ack, metadata, commits, completion)",
                               ("job", "phase"), registry=self.registry)
        self._subtask_phase = pc.Gauge("pyflowbuf_checkpoint_subtask_phase_ms",
                                       "A phase of one subtask in the last completed checkpoint, ms",
                                       ("job", "task", "phase"), registry=self.registry)
        self._server = self._thread = None
        self.port = None
        if serve:
            try:
                started = pc.start_http_server(port, addr=addr, registry=self.registry)
            except OSError as exc:
                raise errors.PortUnavailableError(
                    exc.errno, f"prometheus_port={port}: cannot serve Prometheus metrics on {addr}:{port}: "
                    f"{exc.strerror or exc}; choose another port, or 0 for a free one") from exc
            # prometheus-client >= 0.17 returns (server, thread); older ones None
            if started is not None:
                self._server, self._thread = started
                self.port = self._server.server_address[1]
            else:  # pragma: no cover - old prometheus-client
                self.port = port
            # with port=0 this line (and the job's prometheus_port) is the
            # only way to learn where to scrape
            log.info("pyflowbuf: job %r: Prometheus metrics on %s", job_name, self.url)

    @property
    def url(self) -> str | None:
        return None if self.port is None else f"http://{self.addr}:{self.port}/metrics"

    def __call__(self, snapshot: dict) -> None:
        with self._lock:
            for task, m in snapshot.items():
                labels = (self.job_name, task, str(m.get("vertex", task)))
                live = _is_live(m)
                for key, gauge in self._gauges.items():
                    value = m.get(key)
                    if key in _TIME_KEYS and not live:
                        value = _NAN     # an ended task is neither busy nor idle
                    if value is not None:
                        gauge.labels(*labels).set(float(value))
                self._level.labels(*labels).set(LEVEL_CODES[_level_of(m)])
                self._running.labels(*labels).set(1.0 if m.get("state") == "RUNNING" else 0.0)

    def checkpoint(self, entry: dict) -> None:
        with self._lock:
            self._checkpoints.labels(self.job_name, entry.get("status", "unknown")).inc()
            if entry.get("status") != "completed":
                return
            values = dict(entry, max_alignment_ms=max(entry.get("alignment_ms", {}).values(), default=0.0),
                          unaligned={"aligned": 0, "unaligned": 1, "switched": 2}.get(entry.get("alignment"), 0))
            for key, gauge in self._checkpoint.items():
                if values.get(key) is not None:
                    gauge.labels(self.job_name).set(float(values[key]))
            phases = entry.get("phases") or {}
            for key in _PHASE_GAUGES:
                if phases.get(key) is not None:
                    self._phase.labels(self.job_name, key[:-3]).set(float(phases[key]))
            for task, sub in (entry.get("subtasks") or {}).items():
                for key in _PHASE_GAUGES:
                    if isinstance(sub.get(key), (int, float)):
                        self._subtask_phase.labels(self.job_name, task, key[:-3]).set(float(sub[key]))

    def close(self) -> None:
        """Stop serving (the gauges keep their last values)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


# ---- plain text ----
_COLUMNS = (
    # header, width, formatter
    ("task", None, None),
    ("state", 9, lambda m: str(m.get("state", ""))),
    ("level", 5, _level_of),
    ("busy", 6, lambda m: _ms(m, "busy_ms_per_s")),
    ("idle", 6, lambda m: _ms(m, "idle_ms_per_s")),
    ("backpr", 6, lambda m: _ms(m, "backpressured_ms_per_s")),
    ("rec in/s", 10, lambda m: _si(m.get("records_in_per_s", 0))),
    ("rec out/s", 10, lambda m: _si(m.get("records_out_per_s", 0))),
    ("in pool", 7, lambda m: f"{100 * m.get('in_pool_usage', 0):.0f}%"),
    ("out pool", 8, lambda m: f"{100 * m.get('out_pool_usage', 0):.0f}%"),
)


def _si(x: float) -> str:
    x = float(x)
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def snapshot_table(snapshot: dict) -> str:
    """One snapshot as a fixed-width text table (busy/idle/backpressured in ms
    per second), one row per task."""
    names = list(snapshot)
    w0 = max([len("task")] + [len(n) for n in names])
    header = ["task".ljust(w0)] + [h.rjust(w) for h, w, _ in _COLUMNS[1:]]
    lines = ["  ".join(header)]
    for name in names:
        m = snapshot[name]
        row = [name.ljust(w0)] + [f(m).rjust(w) for _, w, f in _COLUMNS[1:]]
        lines.append("  ".join(row))
    return "\n".join(lines)


# ---- rich live view ----
class LiveView:
    """A rich table of every task, redrawn on each snapshot.

    On a terminal it updates in place (rich ``Live``); when the console is
    not a terminal (a pipe, a log file, CI) nothing is redrawn and the last
    table is printed once at ``close()`` - or every ``print_every`` snapshots
    if set - so logs stay readable.
    """

    def __init__(self, job_name: str = "job", *, console=None, print_every: int | None = None):
        from rich.console import Console  # optional dependency (extra "monitor")

        self.job_name = job_name
        if console is None:
            console = Console()
            if not console.is_terminal and "COLUMNS" not in os.environ:
                console = Console(width=120)    # a log file: no need to squeeze
        self.console = console
        self.print_every = print_every
        self._live = None
        self._lock = threading.Lock()
        self._count = 0
        self._last = None
        self._closed = False
        self._last_checkpoint = None

    def render(self, snapshot: dict):
        """The rich Table for one snapshot."""
        from rich import box  # optional dependency (extra "monitor")
        from rich.table import Table
        from rich.text import Text

        caption = "busy / idle / backpr.: ms per second"
        c = self._last_checkpoint
        if c is not None:
            caption += (f"; {c.get('kind', 'checkpoint')} {c['id']} {c['status']} "
                        f"({c.get('alignment', 'aligned')}) in "
                        f"{c['duration_s']:.3f} s, {_si(c.get('state_bytes') or 0)}B of state, "
                        f"{_si(c.get('inflight_bytes') or 0)}B in flight, max alignment "
                        f"{max(c.get('alignment_ms', {}).values(), default=0.0):.1f} ms")
        table = Table(title=f"pyflowbuf job {self.job_name!r}", title_justify="left",
                      caption=caption, caption_justify="left",
                      box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        table.add_column("task", no_wrap=True, overflow="ellipsis", max_width=32)
        table.add_column("state", no_wrap=True)
        table.add_column("level", no_wrap=True)
        debloat = any(m.get("debloat_buffer_size") is not None for m in snapshot.values())
        heads = ("busy", "idle", "backpr.", "in\nrec/s", "out\nrec/s", "in\npool", "out\npool")
        if debloat:     # buffer debloating: the size announced upstream, the data in flight
            heads += ("buffer", "in\nflight", "to\nconsume")
        for h in heads:
            table.add_column(h, justify="right", no_wrap=True)
        for name, m in snapshot.items():
            level = _level_of(m)
            cells = [
                name, str(m.get("state", "")), Text(level, style=f"bold {LEVEL_STYLES[level]}"),
                _ms(m, "busy_ms_per_s"), _ms(m, "idle_ms_per_s"),
                Text(_ms(m, "backpressured_ms_per_s"), style=LEVEL_STYLES[level]),
                _si(m.get("records_in_per_s", 0)), _si(m.get("records_out_per_s", 0)),
                f"{100 * m.get('in_pool_usage', 0):.0f}%", f"{100 * m.get('out_pool_usage', 0):.0f}%",
            ]
            if debloat:
                size = m.get("debloat_buffer_size")
                cells += ["" if size is None else f"{_si(size)}B",
                          "" if size is None else f"{_si(m.get('debloat_inflight_bytes') or 0)}B",
                          "" if size is None else f"{m.get('debloat_time_to_consume_s') or 0:.2f} s"]
            table.add_row(*cells)
        return table

    def checkpoint(self, entry: dict) -> None:
        """Shown in the caption from the next redraw on."""
        self._last_checkpoint = entry

    def __call__(self, snapshot: dict) -> None:
        with self._lock:
            if self._closed:
                return
            table = self.render(snapshot)
            self._last = table
            self._count += 1
            if self.console.is_terminal and not self.console.is_dumb_terminal:
                if self._live is None:
                    from rich.live import Live  # optional dependency (extra "monitor")
                    self._live = Live(table, console=self.console, auto_refresh=False,
                                      redirect_stdout=False, redirect_stderr=False)
                    self._live.start(refresh=True)
                else:
                    self._live.update(table, refresh=True)
            elif self.print_every and self._count % self.print_every == 0:
                self.console.print(table)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._live is not None:
                self._live.stop()          # leaves the last table on screen
                self._live = None
            elif self._last is not None and not (self.print_every and self._count % self.print_every == 0):
                self.console.print(self._last)
