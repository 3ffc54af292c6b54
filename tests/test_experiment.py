"""The backpressure experiment (seed 001), quick mode: the producer follows the
consumer, memory stays within the configured 2 buffers, nothing is lost."""
from __future__ import annotations

import csv
import time

import pytest

from pyflowbuf.experiments import backpressure as bp
from pyflowbuf.experiments.throttle import Pacer, Speed


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bp")
    t0 = time.monotonic()
    res = bp.run_experiment(out, quick=True)
    res["elapsed"] = time.monotonic() - t0
    return res


def _phase_rows(result, name):
    return [r for r in result["samples"] if r["phase"] == name]


def test_quick_mode_is_quick(result):
    assert result["elapsed"] < 20
    assert result["interval"] == bp.QUICK["interval"]


def test_outputs_written(result):
    with open(result["csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(result["samples"])
    assert set(bp.CSV_FIELDS) == set(rows[0])
    phases = [p[0] for p in bp.PHASES]
    assert [ph["phase"] for ph in result["phases"]] == phases
    assert {r["phase"] for r in rows} == {"calibration", *phases}
    with open(result["png"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_producer_follows_consumer_after_one_interval(result):
    # within an interval the producer can be ahead by what the pool holds (2
    # buffers of int64 records): that much of a difference is no lag, and on a
    # busy machine a stalled interval makes both rates small
    slack = bp.BUFFERS * bp.SEGMENT_SIZE / 12 / result["interval"]
    for name, _, _ in bp.PHASES:
        for r in _phase_rows(result, name)[1:]:        # after the transition interval
            c = r["consumer_records_per_s"]
            assert c > 0
            assert abs(r["producer_records_per_s"] - c) <= max(0.10 * c, slack), (name, r)


def test_slowing_the_consumer_slows_the_producer(result):
    by = {ph["phase"]: ph for ph in result["phases"]}
    slow = [by[n] for n, _, c in bp.PHASES if c < 100]
    fast = [by[n] for n, _, c in bp.PHASES if c == 100]
    slow_p = sum(ph["producer_pct"] for ph in slow) / len(slow)
    fast_p = sum(ph["producer_pct"] for ph in fast) / len(fast)
    assert slow_p * 1.3 < fast_p, result["phases"]
    for ph in slow:
        # the producer is held at the consumer's pace, waiting for buffers
        assert abs(ph["producer_pct"] - ph["consumer_pct"]) < 5
        assert ph["producer_backpressured_ms_per_s"] > 400, ph
        assert ph["consumer_pct"] < 45, ph                  # set to 30 %
    for ph in fast:
        assert ph["producer_backpressured_ms_per_s"] < min(s["producer_backpressured_ms_per_s"] for s in slow)


def test_memory_stays_within_the_configured_buffers(result):
    assert result["out_pool_max_size"] == bp.BUFFERS == 2
    assert result["memory_polls"] > 100
    assert 1 <= result["max_out_pool_in_use"] <= 2
    # every segment in use belongs to the producer's pool: nothing else buffers data
    assert result["max_network_pool_in_use"] <= 2
    for r in result["samples"]:
        assert r["out_pool_in_use_max"] <= 2 and r["network_pool_in_use_max"] <= 2


def test_nothing_dropped(result):
    n = result["records_produced"]
    assert n > 0
    assert result["records_consumed"] == n
    assert result["records_written"] == n
    assert result["last_record"] == n            # records 1..n, in order
    assert result["order_breaks"] == 0


def test_bad_parameters(tmp_path):
    with pytest.raises(ValueError):
        bp.run_experiment(tmp_path, interval=0)
    with pytest.raises(ValueError):
        bp.run_experiment(tmp_path, quick=True, phase_seconds=0.01)
    with pytest.raises(ValueError):
        bp.run_experiment(tmp_path, quick=True, phases=[("x", 60, 130)])
    with pytest.raises(ValueError):
        bp.run_experiment(tmp_path, quick=True, phases=[])
    with pytest.raises(SystemExit):
        bp.main(["--out", str(tmp_path), "--interval", "-1"])


def test_pacer_holds_a_fraction_of_the_rate():
    speed = Speed(0.5)
    pacer = Pacer(speed, max_rate=100_000)
    t0 = time.monotonic()
    for _ in range(100):
        pacer(100)                               # 10,000 records at 50,000/s: 0.2 s
    elapsed = time.monotonic() - t0
    assert 0.18 <= elapsed < 0.5
    speed.set(1.0)
    t0 = time.monotonic()
    for _ in range(100):
        pacer(100)
    assert time.monotonic() - t0 < 0.05          # full speed: no sleeping
    with pytest.raises(ValueError):
        Speed(0)
    assert Pacer(Speed(0.3))(1000) is None       # no max_rate yet (calibrating): no-op


def test_the_web_view_serves_while_the_experiment_runs_and_closes_after(tmp_path, capsys):
    """``ui=True`` (the demo's step): the URL is printed while the job runs,
    and the port is free again once the experiment returned."""
    import re
    import socket
    import urllib.request

    seen = {}
    real_sleep = time.sleep

    def sleep_and_look(seconds):
        # the experiment's loop sleeps between samples: look at the page then
        out = capsys.readouterr().out
        m = re.search(r"web view, live while the experiment runs: (http://127\.0\.0\.1:(\d+)/)", out)
        if m and "status" not in seen:
            seen["url"], seen["port"] = m.group(1), int(m.group(2))
            with urllib.request.urlopen(seen["url"] + "api/job", timeout=10) as r:
                seen["status"] = r.status
        real_sleep(seconds)

    bp.time.sleep = sleep_and_look
    try:
        bp.run_experiment(tmp_path, quick=True, phase_seconds=0.5, interval=0.25, calibration_seconds=0.5,
                          phases=[("slow", 100, 20)], plot=False, ui=True)
    finally:
        bp.time.sleep = real_sleep
    assert seen.get("status") == 200, seen
    with socket.socket() as s:
        # SO_REUSEADDR: the page's closed connections may linger in TIME_WAIT; a listener may not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", seen["port"]))
        s.listen()                                # the view closed with the experiment
