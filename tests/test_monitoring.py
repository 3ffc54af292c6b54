"""Backpressure monitoring: levels, the JSON-lines log, Prometheus gauges, the
live view, and the behaviour they must show (a slow sink puts its upstream at
HIGH; a fast one leaves everything OK)."""
from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from pyflowbuf import monitoring
from pyflowbuf.api import Environment
from pyflowbuf.runtime.metrics import backpressure_level
from pyflowbuf.connectors.sources import RateLimiter
from pipeline_helpers import cancel_and_join, wait_for

METRIC_KEYS = {"busy_ms_per_s", "idle_ms_per_s", "backpressured_ms_per_s", "records_in", "records_out",
               "records_in_per_s", "records_out_per_s", "bytes_in", "bytes_out", "bytes_in_per_s",
               "bytes_out_per_s", "in_pool_usage", "out_pool_usage", "level", "vertex", "subtask", "state"}


def _slow_sink(batch):
    time.sleep(0.002)


# ---- levels ----
@pytest.mark.parametrize("ratio, level", [
    (0.0, "OK"), (0.05, "OK"), (0.10, "OK"), (0.1001, "LOW"), (0.3, "LOW"), (0.50, "LOW"),
    (0.5001, "HIGH"), (0.9, "HIGH"), (1.0, "HIGH"),
])
def test_backpressure_level_boundaries(ratio, level):
    assert backpressure_level(ratio) == level


@given(st.floats(0, 1), st.floats(0, 1))
def test_backpressure_level_is_monotonic(a, b):
    order = {"OK": 0, "LOW": 1, "HIGH": 2}
    lo, hi = sorted((a, b))
    assert order[backpressure_level(lo)] <= order[backpressure_level(hi)]
    assert monitoring.LEVEL_CODES[backpressure_level(a)] == order[backpressure_level(a)]


# ---- behaviour ----
def test_slow_sink_puts_upstream_at_high_and_sink_busy():
    env = Environment(metrics_interval=0.2, chaining=False, name="slow")
    env.from_sequence(0, None).sink(_slow_sink, batched=True)
    job = env.execute_async()
    try:
        wait_for(lambda: len(job.sampler.history) >= 4, "4 metric samples")
        snap = job.metrics()
    finally:
        cancel_and_join(job)
    src, sink = snap["sequence (1/1)"], snap["sink (1/1)"]
    assert src["level"] == "HIGH", src
    assert src["backpressured_ms_per_s"] > 500
    assert src["out_pool_usage"] > 0.5          # the producer's pool is (nearly) exhausted
    assert sink["busy_ms_per_s"] > 500, sink     # sleeping in user code is busy time
    assert sink["level"] == "OK"                 # a sink has no output to wait for
    for m in (src, sink):
        total = m["busy_ms_per_s"] + m["idle_ms_per_s"] + m["backpressured_ms_per_s"]
        assert total == pytest.approx(1000, abs=1)


def test_fast_sink_shows_ok():
    env = Environment(metrics_interval=0.2, chaining=False, name="fast")
    seen = []
    env.from_sequence(0, None, rate_limit=RateLimiter(records_per_s=20_000)).sink(seen.append)
    job = env.execute_async()
    try:
        wait_for(lambda: len(job.sampler.history) >= 4, "4 metric samples")
        snaps = [s for _, s in job.sampler.history[1:]]
    finally:
        cancel_and_join(job)
    assert seen
    for snap in snaps:
        for name, m in snap.items():
            assert m["level"] == "OK", (name, m)
            assert m["backpressured_ms_per_s"] <= 100
        assert snap["sink (1/1)"]["idle_ms_per_s"] > 500   # waiting for input


# ---- JSON lines ----
def test_json_lines_log_has_one_object_per_task_per_sample(tmp_path):
    log = tmp_path / "metrics.jsonl"
    env = Environment(metrics_interval=0.1, chaining=False, metrics_log=log, name="logged")
    out = (env.from_sequence(0, 6000, rate_limit=RateLimiter(records_per_s=10_000))
           .map(lambda x: x + 1).collect())
    env.execute(timeout=20)
    assert len(out.result) == 6000
    objs = [json.loads(line) for line in log.read_text().splitlines()]
    tasks = {"sequence (1/1)", "map (1/1)", "collect (1/1)"}
    assert len(objs) >= 3 * len(tasks) and len(objs) % len(tasks) == 0
    for i in range(0, len(objs), len(tasks)):
        group = objs[i:i + len(tasks)]
        assert {o["task"] for o in group} == tasks          # each sample: every task once
        assert len({o["ts"] for o in group}) == 1
    for o in objs:
        assert METRIC_KEYS | {"ts", "job", "task"} <= set(o), set(o) ^ METRIC_KEYS
        assert o["job"] == "logged"
        assert o["level"] in ("OK", "LOW", "HIGH")
    assert objs[-1]["records_in"] > 0


# ---- Prometheus ----
def _exporter(job):
    found = [x for x in job.sampler.listeners if isinstance(x, monitoring.PrometheusExporter)]
    assert len(found) == 1
    return found[0]


def _scrape(url):
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def test_prometheus_off_by_default():
    env = Environment(metrics_interval=0.1)
    env.from_sequence(0, 10).collect()
    job = env.execute_async()
    job.join(10)
    assert not any(isinstance(x, monitoring.PrometheusExporter) for x in job.sampler.listeners)


def test_prometheus_endpoint_serves_task_gauges():
    env = Environment(metrics_interval=0.1, chaining=False, prometheus_port=0, name="prom")
    env.from_sequence(0, None).sink(_slow_sink, batched=True)
    job = env.execute_async()
    try:
        exp = _exporter(job)
        assert exp.addr == "127.0.0.1" and exp.port > 0
        assert exp.url.startswith("http://127.0.0.1:")
        src = 'job="prom",task="sequence (1/1)",vertex="sequence"'
        body = wait_for(lambda: (lambda b: b if f"pyflowbuf_task_backpressure_level{{{src}}} 2.0" in b else "")(
            _scrape(exp.url)), "the source at HIGH in a scrape")
        assert f"pyflowbuf_task_backpressure_level{{{src}}} 2.0" in body, body
        sink = 'job="prom",task="sink (1/1)",vertex="sink"'
        for name in ("busy_ms_per_s", "idle_ms_per_s", "backpressured_ms_per_s", "records_in",
                     "records_out_per_s", "bytes_out", "in_pool_usage", "out_pool_usage"):
            assert f"pyflowbuf_task_{name}{{{src}}}" in body, name
            assert f"pyflowbuf_task_{name}{{{sink}}}" in body, name
        assert f"pyflowbuf_task_backpressure_level{{{sink}}} 0.0" in body
        assert f"pyflowbuf_task_running{{{sink}}} 1.0" in body
    finally:
        cancel_and_join(job)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        _scrape(exp.url)                        # close() shut the server down


def test_prometheus_exporter_bad_port():
    with pytest.raises(ValueError, match="port"):
        monitoring.PrometheusExporter(70000, "x")
    with pytest.raises(ValueError, match="port"):
        monitoring.PrometheusExporter("9249", "x")


def test_prometheus_exporter_without_server_sets_gauges():
    exp = monitoring.PrometheusExporter(0, "j", serve=False)
    exp({"t (1/1)": {"vertex": "t", "busy_ms_per_s": 12.5, "backpressured_ms_per_s": 600.0,
                     "state": "RUNNING"}})
    reg = exp.registry
    labels = {"job": "j", "task": "t (1/1)", "vertex": "t"}
    assert reg.get_sample_value("pyflowbuf_task_busy_ms_per_s", labels) == 12.5
    # no "level" key: derived from backpressured time (600 ms/s -> HIGH)
    assert reg.get_sample_value("pyflowbuf_task_backpressure_level", labels) == 2.0
    exp.close()


# ---- text and live view ----
SNAP = {
    "source (1/1)": {"vertex": "source", "subtask": 0, "state": "RUNNING", "level": "HIGH",
                     "busy_ms_per_s": 30.0, "idle_ms_per_s": 0.0, "backpressured_ms_per_s": 970.0,
                     "records_in_per_s": 5.9e5, "records_out_per_s": 5.9e5, "in_pool_usage": 0.0,
                     "out_pool_usage": 1.0},
    "sink (1/1)": {"vertex": "sink", "subtask": 0, "state": "RUNNING", "level": "OK",
                   "busy_ms_per_s": 1000.0, "idle_ms_per_s": 0.0, "backpressured_ms_per_s": 0.0,
                   "records_in_per_s": 5.9e5, "records_out_per_s": 0.0, "in_pool_usage": 1.0,
                   "out_pool_usage": 0.0},
}


def test_snapshot_table_plain_text():
    text = monitoring.snapshot_table(SNAP)
    lines = text.splitlines()
    assert len(lines) == 3
    assert "busy" in lines[0] and "backpr" in lines[0]
    assert lines[1].startswith("source (1/1)") and "HIGH" in lines[1] and "970" in lines[1]
    assert lines[2].startswith("sink (1/1)") and " OK " in lines[2] and "1000" in lines[2]
    assert "590.00k" in lines[1] and "100%" in lines[1]
    assert monitoring.snapshot_table({}).splitlines()[0].startswith("task")


def test_live_view_non_tty_console():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=120)
    view = monitoring.LiveView("j", console=console)
    view(SNAP)
    view(SNAP)
    assert buf.getvalue() == ""          # no redraws into a file ...
    view.close()
    out = buf.getvalue()                 # ... the last table once at the end
    assert "source (1/1)" in out and "HIGH" in out and "sink (1/1)" in out
    assert out.count("source (1/1)") == 1
    view(SNAP)                           # after close: ignored, no error
    view.close()


def test_live_view_print_every_on_non_tty():
    buf = io.StringIO()
    view = monitoring.LiveView("j", console=Console(file=buf, force_terminal=False, width=120), print_every=2)
    for _ in range(4):
        view(SNAP)
    view.close()
    assert buf.getvalue().count("source (1/1)") == 2


def test_live_view_on_terminal_colours_levels():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system="standard", width=120)
    view = monitoring.LiveView("j", console=console)
    view(SNAP)
    view(SNAP)
    view.close()
    out = buf.getvalue()
    assert "HIGH" in out and "\x1b[" in out
    assert "\x1b[1;31mHIGH" in out        # bold red
    assert "\x1b[1;32mOK" in out          # bold green
    low = {"x (1/1)": dict(SNAP["sink (1/1)"], level="LOW")}
    buf2 = io.StringIO()
    view2 = monitoring.LiveView("j", console=Console(file=buf2, force_terminal=True,
                                                     color_system="standard", width=120))
    view2(low)
    view2.close()
    assert "\x1b[1;33mLOW" in buf2.getvalue()   # bold yellow


def test_live_view_in_a_job_without_tty(capsys):
    env = Environment(metrics_interval=0.05, live_view=True, name="live")
    out = env.from_sequence(0, 20_000, rate_limit=RateLimiter(records_per_s=100_000)).collect()
    env.execute(timeout=20)
    assert len(out.result) == 20_000
    captured = capsys.readouterr().out
    assert "sequence -> collect (1/1)" in captured


def test_ended_tasks_show_no_time_figures():
    # Once a task has ended its counters stop and the sampler reports busy
    # 1000 ms/s; the views show "-" and Prometheus NaN instead.
    done = {"t (1/1)": dict(SNAP["sink (1/1)"], state="FINISHED", busy_ms_per_s=1000.0, vertex="t")}
    row = monitoring.snapshot_table(done).splitlines()[1]
    assert "FINISHED" in row and "1000" not in row and " - " in row
    exp = monitoring.PrometheusExporter(0, "j", serve=False)
    exp(done)
    labels = {"job": "j", "task": "t (1/1)", "vertex": "t"}
    value = exp.registry.get_sample_value("pyflowbuf_task_busy_ms_per_s", labels)
    assert value != value                                   # NaN
    assert exp.registry.get_sample_value("pyflowbuf_task_running", labels) == 0.0
    assert exp.registry.get_sample_value("pyflowbuf_task_records_in_per_s", labels) == 5.9e5


def test_live_view_shows_debloat_columns_when_debloating():
    snap = {k: dict(v) for k, v in SNAP.items()}
    snap["sink (1/1)"].update(debloat_buffer_size=2048, debloat_inflight_bytes=65536,
                              debloat_time_to_consume_s=0.95)
    buf = io.StringIO()
    view = monitoring.LiveView("j", console=Console(file=buf, force_terminal=False, width=200))
    view(snap)
    view.close()
    out = buf.getvalue()
    assert "buffer" in out and "2.05kB" in out and "65.54kB" in out and "0.95 s" in out
    buf = io.StringIO()
    view = monitoring.LiveView("j", console=Console(file=buf, force_terminal=False, width=200))
    view(SNAP)                                       # debloating off: no such columns
    view.close()
    assert "buffer" not in buf.getvalue()
