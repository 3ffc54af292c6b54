"""What a job tells its caller and what it leaves behind: the Prometheus
port it bound, the output of print() under workers=, and the worker
processes and threads of an execute_iter generator closed early."""
import contextlib
import io
import logging
import os
import threading
import time
import urllib.request

import pytest

import pyflowbuf as fb
from pyflowbuf import errors

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="workers= forks")


# ---- prometheus_port=0 ----

@pytest.mark.parametrize("workers", [None, pytest.param(2, marks=needs_fork)])
def test_prometheus_port_zero_exposes_and_logs_the_port_it_bound(workers, caplog):
    env = fb.Environment(prometheus_port=0, workers=workers, name="free-port", metrics_interval=0.05)
    env.from_sequence(0, None, rate_limit=2000).map(lambda x: x, kind="int64").collect()
    with caplog.at_level(logging.INFO, logger="pyflowbuf"):
        job = env.execute_async()
    try:
        port = job.prometheus_port
        assert isinstance(port, int) and port > 0
        url = f"http://127.0.0.1:{port}/metrics"
        assert any(url in r.getMessage() and "free-port" in r.getMessage() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        deadline = time.monotonic() + 20
        body = ""
        while 'job="free-port"' not in body and time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=5) as resp:
                body = resp.read().decode()
            time.sleep(0.05)
        assert 'job="free-port"' in body
    finally:
        job.cancel()
        job.join(30)


def test_prometheus_port_is_none_without_an_exporter():
    env = fb.Environment()
    env.from_collection([1]).collect()
    assert env.execute(timeout=30).prometheus_port is None
