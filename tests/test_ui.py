"""The web view (pyflowbuf.ui): its JSON against env.metrics() and
env.checkpoints() field by field, the refusals (4xx, the job runs on), the
ways to open it, and the page itself in a real headless Chromium."""
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.ui import model

from pipeline_helpers import cancel_and_join, wait_for

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="workers=N forks worker processes")
SHOTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out", "ui-screenshots")


def get(url, what=""):
    with urllib.request.urlopen(url + what, timeout=30) as r:
        return json.loads(r.read())


def status_of(url, method="GET"):
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def slow(x):
    time.sleep(0.002)
    return x


def checkpointed_job(tmp_path, *, n=None, rate=4000, **kw):
    env = fb.Environment(parallelism=2, metrics_interval=0.2, checkpoint_interval=0.3,
                         checkpoint_dir=str(tmp_path / "chk"), name="ui-checkpoints", **kw)
    (env.from_sequence(0, n, rate_limit=rate)
        .key_by(lambda x: x % 7).map(lambda x: x, name="keyed")
        .rebalance().sink(lambda b: None, batched=True, name="sink"))
    return env


# ---------------------------------------------------------------- the JSON, field by field

def test_json_endpoints_match_metrics_and_checkpoints_field_by_field(tmp_path):
    env = checkpointed_job(tmp_path, n=6000, ui_port=0)
    job = env.execute_async()
    try:
        url = job.ui_url
        assert url.startswith("http://127.0.0.1:") and job.ui.token is None
        wait_for(lambda: sum(c["status"] == "completed" for c in env.checkpoints()) >= 2, "two checkpoints", job=job)
        job.join(120)
        time.sleep(0.3)                           # past the answer cache: the final state
        metrics, history = env.metrics(), env.checkpoints()
        info = get(url, "api/job")
        assert info["state"] == "FINISHED" and info["ended"] and info["checkpointing"]
        assert info["subtasks"] == len(metrics) == 6

        rows = get(url, "api/subtasks")
        assert [r["task"] for r in rows] == list(metrics)
        for r in rows:
            m = metrics[r["task"]]
            assert r["vertex"] == m["vertex"] and r["subtask"] == m["subtask"]
            compared = [k for k in model.SUBTASK_FIELDS if k in m and k not in model.WHOLE_FIELDS]
            assert {k: r[k] for k in compared} == {k: m[k] for k in compared}
            for k in model.WHOLE_FIELDS:          # rates in whole units, rounded half up
                assert isinstance(r[k], int) and r[k] == math.floor(m[k] + 0.5), k
            assert r["worker"] is None and r["host"] == socket.gethostname()
        assert [r["task"] for r in get(url, "api/subtasks?vertex=1")] == [t for t in metrics if t.startswith("keyed")]

        graph = get(url, "api/graph")
        vertices, edges = env.plan()
        assert [n["name"] for n in graph["nodes"]] == [v.name for v in vertices]
        assert [(e["source"], e["target"], e["partitioner"]) for e in graph["edges"]] == \
            [(e.source.id, e.target.id, e.partitioner) for e in edges]
        for node, v in zip(graph["nodes"], vertices):
            mine = [metrics[model.task_name(v, i)] for i in range(v.parallelism)]
            assert node["records_out_per_s"] == pytest.approx(sum(m["records_out_per_s"] for m in mine))
            assert node["states"] == {"FINISHED": v.parallelism} and node["live_subtasks"] == 0

        table = get(url, "api/checkpoints")
        assert [c["id"] for c in table] == [c["id"] for c in history]
        for row, c in zip(table, history):
            for k in ("id", "status", "trigger_time", "duration_s", "state_bytes", "size", "inflight_bytes",
                      "acknowledged", "tasks"):
                assert row[k] == c.get(k), k
            assert row["kind"] == ("savepoint" if c.get("savepoint") else c["alignment"])
            assert row["phases"] == c["phases"]
        done = [c for c in history if c["status"] == "completed"][-1]
        detail = get(url, f"api/checkpoints/{done['id']}")
        assert len(detail["timeline"]) == len(done["subtasks"]) == 6
        acks = [r["ack_ms"] for r in detail["timeline"]]
        assert acks == sorted(acks, reverse=True)            # slowest first
        for r in detail["timeline"]:
            p = done["subtasks"][r["key"]]
            assert {k: r[k] for k in model.PHASE_FIELDS} == {k: p.get(k) for k in model.PHASE_FIELDS}
            assert r["task"] in metrics

        wms = get(url, "api/watermarks")
        assert [w["name"] for w in wms] == [v.name for v in vertices]
        assert not any(w["event_time"] for w in wms)          # no assign_timestamps: no watermarks
    finally:
        if not job.done:
            cancel_and_join(job)
        job.ui.close()


def test_watermarks_are_in_the_metrics_and_the_view():
    env = fb.Environment(parallelism=2, metrics_interval=0.1, ui_port=0, name="ui-wm")
    now = time.time()
    (env.from_sequence(0, None, rate_limit=2000)
        .map(lambda i: now - 30 + i / 1000.0, kind="float64")
        .assign_timestamps(lambda t: t, out_of_orderness=0.0)
        .rebalance().sink(lambda b: None, batched=True))
    job = env.execute_async()
    try:
        def rising():
            wms = get(job.ui_url, "api/watermarks")
            return all(w["watermark"] is not None for w in wms) and wms
        wms = wait_for(rising, "a watermark in every operator chain", job=job)
        metrics = env.metrics()
        for w in wms:
            assert w["event_time"]
            assert 0 < w["lag_s"] < 3600                    # event time is behind the wall clock
            assert min(w["subtasks"]) <= w["watermark"] <= max(w["subtasks"])
        assert all(m["watermark"] is None or m["watermark"] > now - 60 for m in metrics.values())
    finally:
        cancel_and_join(job)
        job.ui.close()


# ---------------------------------------------------------------- refusals

def test_bad_requests_unknown_paths_and_writes_get_4xx_and_the_job_runs_on():
    env = fb.Environment(parallelism=2, metrics_interval=0.1, ui_port=0, name="ui-refusals")
    env.from_sequence(0, None, rate_limit=5000).rebalance().sink(lambda b: None, batched=True)
    job = env.execute_async()
    try:
        url = job.ui_url
        wait_for(lambda: env.metrics(), "a first sample", job=job)
        for path, code in [("nope", 404), ("api/nope", 404), ("api/checkpoints/abc", 400),
                           ("api/checkpoints/99999", 404), ("api/subtasks?vertex=x", 400),
                           ("api/subtasks?vertex=42", 400), ("api/checkpoints/" + "9" * 40, 400),
                           ("static/../server.py", 404), ("%ff%fe", 404)]:
            assert status_of(url + path) == code, path
        for method in ("POST", "PUT", "DELETE"):
            assert status_of(url + "api/job", method) == 405
        # a request line that is not HTTP
        with socket.create_connection(("127.0.0.1", job.ui.port), timeout=10) as s:
            s.sendall(b"\x00\x01garbage\r\n\r\n")
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
            assert b"Error code: 400" in answer
        # a page elsewhere that renamed itself to 127.0.0.1 sends its own Host
        req = urllib.request.Request(url + "api/job", headers={"Host": "evil.example:80"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req, timeout=10)
        assert info.value.code == 403
        before = sum(m["records_out"] for m in env.metrics().values())
        wait_for(lambda: sum(m["records_out"] for m in env.metrics().values()) > before + 100,
                 "records after the refusals", job=job)
        assert not job.done and get(url, "api/job")["state"] == "RUNNING"
    finally:
        cancel_and_join(job)
        job.ui.close()


def test_another_host_takes_a_token_compared_in_constant_time():
    env = fb.Environment(metrics_interval=0.1, name="ui-token")
    env.from_sequence(0, None, rate_limit=2000).sink(lambda b: None, batched=True)
    job = env.execute_async()
    try:
        url = job.serve_ui(0, host="0.0.0.0")
        token = job.ui.token
        assert token and len(token) >= 32 and url.endswith("/?token=" + token) and job.ui_url == url
        base = f"http://127.0.0.1:{job.ui.port}/"
        assert get(base, f"api/job?token={token}")["state"] == "RUNNING"
        assert status_of(base + f"?token={token}") == 200
        for bad in ("", "?token=", "?token=" + token[:-1], "?token=" + token + "x", "?token=%ff"):
            assert status_of(base + "api/job" + bad) == 403, bad
            assert status_of(base + bad) == 403, bad
        assert status_of(base + "static/app.js") == 200          # public code, no figures
        assert not job.done
    finally:
        cancel_and_join(job)
        job.ui.close()


@pytest.mark.parametrize("bad", [-1, 70000, "80", 1.5, True])
def test_bad_ui_port_is_refused_by_the_environment(bad):
    with pytest.raises(errors.ConfigurationError, match="ui_port"):
        fb.Environment(ui_port=bad)


def test_a_busy_ui_port_fails_before_the_job_starts():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        calls = []
        env = fb.Environment(ui_port=s.getsockname()[1])
        env.from_sequence(0, 100).sink(calls.append)
        with pytest.raises(errors.PortUnavailableError, match="ui_port"):
            env.execute(timeout=30)
        assert calls == [] and env.last_execution is None


def test_the_view_shows_the_final_state_while_the_handle_lives_and_goes_with_it():
    import gc
    env = fb.Environment(ui_port=0, name="ui-final")
    env.from_sequence(0, 1000).sink(lambda b: None, batched=True)
    job = env.execute(timeout=60)
    port = job.ui.port
    info = get(job.ui_url, "api/job")
    assert info["ended"] and info["state"] == "FINISHED"
    del job, env, info
    gc.collect()

    def closed():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return False
        except OSError:
            return True
    wait_for(closed, "the port closed once the handle was gone", timeout=30)


def test_pyflowbuf_run_ui_prints_the_url(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import pyflowbuf as fb
        env = fb.Environment(name="cli-ui")
        env.from_sequence(0, 1000).sink(lambda b: None, batched=True)
    """))
    out = subprocess.run([sys.executable, "-m", "pyflowbuf", "run", str(script), "--ui"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    assert "web view: http://127.0.0.1:" in out.stderr


def test_the_page_ships_as_package_data():
    from importlib import resources
    for name in ("index.html", "app.js", "app.css"):
        assert resources.files("pyflowbuf.ui").joinpath("static", name).read_bytes()
    html = resources.files("pyflowbuf.ui").joinpath("static", "index.html").read_text()
    assert "http://" not in html and "https://" not in html          # no CDN: works offline
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml")) as f:
        assert '"ui/static/*"' in f.read()
    with open(os.path.join(root, "MANIFEST.in")) as f:
        assert "pyflowbuf/ui/static" in f.read()


@needs_fork
@pytest.mark.filterwarnings("ignore::pyflowbuf.errors.WorkerSideEffectWarning")   # the sink keeps nothing
def test_workers_name_each_subtasks_worker_and_host():
    env = fb.Environment(parallelism=4, workers=2, metrics_interval=0.1, ui_port=0, name="ui-workers")
    env.from_sequence(0, None, rate_limit=4000).rebalance().sink(lambda b: None, batched=True, name="sink")
    job = env.execute_async()
    try:
        def all_reported():
            rows = get(job.ui_url, "api/subtasks")
            return all(r["reported"] and r["worker"] is not None for r in rows) and rows
        rows = wait_for(all_reported, "every subtask's sample from its worker", job=job)
        assert len(rows) == 8 and get(job.ui_url, "api/job")["workers"] == 2
        metrics = env.metrics()
        for r in rows:
            assert r["worker"] == r["subtask"] % 2              # cluster.worker.placement
            assert r["host"] == socket.gethostname()           # forked here
            assert r["task"] in metrics
        # credit: the sink's inputs from the other worker's sources hold credit; a source has no input
        by_kind = {name: [r for r in rows if (r["task"].startswith("sink")) == (name == "sink")]
                   for name in ("sink", "source")}
        assert all(r["credit_available"] is None and r["sender_backlog"] is None for r in by_kind["source"])
        assert all(isinstance(r["credit_available"], int) and r["credit_available"] >= 0
                   and isinstance(r["sender_backlog"], int) for r in by_kind["sink"]), by_kind["sink"]
        assert all(metrics[r["task"]]["credit_available"] is not None for r in by_kind["sink"])
    finally:
        cancel_and_join(job)
        job.ui.close()


def test_infinite_and_nan_figures_are_null_in_the_json():
    # JSON has no infinities: a browser's JSON.parse refuses "Infinity"
    from pyflowbuf import ui
    env = fb.Environment(name="ui-inf")
    env.from_sequence(0, 10).sink(lambda b: None, batched=True)

    class Job:
        done, ran, coordinator = False, True, None

        def __init__(self):
            self.spec = env.job_spec()

        def metrics(self):
            return {"sequence -> sink (1/1)": {"state": "RUNNING", "debloat_time_to_consume_s": math.inf,
                                                "busy_ms_per_s": math.nan, "records_in": 5,
                                                "records_in_per_s": math.inf, "bytes_out_per_s": math.nan,
                                                "watermark": math.inf}}

        def checkpoints(self):
            return [{"id": 1, "status": "completed", "duration_s": math.inf, "phases": {"sync_ms": math.nan},
                     "subtasks": {"v0-0": {"ack_ms": math.inf}}}]

    job = Job()
    server = ui.serve(job)
    try:
        rows = get(server.url, "api/subtasks")
        assert rows[0]["debloat_time_to_consume_s"] is None and rows[0]["busy_ms_per_s"] is None
        assert rows[0]["records_in"] == 5 and rows[0]["watermark"] is None and rows[0]["watermark_end"]
        assert rows[0]["records_in_per_s"] is None and rows[0]["bytes_out_per_s"] is None
        assert get(server.url, "api/checkpoints")[0]["duration_s"] is None
        assert get(server.url, "api/checkpoints/1")["timeline"][0]["ack_ms"] is None
        assert get(server.url, "api/watermarks")[0]["watermark_end"]
    finally:
        server.close()


# ---------------------------------------------------------------- one request per refresh, kept alive

class _SampledJob:
    """A job handle whose metrics are a sample the test replaces, as the
    runtime's sampler does once per interval."""
    done, ran, coordinator = False, True, None

    def __init__(self, env):
        self.spec = env.job_spec()
        self.sample = {}
        self.resample(1)

    def resample(self, records):
        self.sample = {f"{v.name} ({i + 1}/{v.parallelism})": {"state": "RUNNING", "records_in": records,
                                                               "busy_ms_per_s": 10.0}
                       for v in self.spec.plan()[0] for i in range(v.parallelism)}

    def metrics(self):
        return dict(self.sample)        # a copy of the sample, its per-subtask dicts shared

    def checkpoints(self):
        return []


def test_live_answers_each_view_in_one_request_as_its_endpoints_do(tmp_path):
    env = checkpointed_job(tmp_path, n=3000, ui_port=0)
    job = env.execute_async()
    try:
        wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()), "a checkpoint", job=job)
        job.join(120)
        time.sleep(0.3)                           # past the answer cache: the final state
        url = job.ui_url
        cid = [c for c in env.checkpoints() if c["status"] == "completed"][-1]["id"]
        for query, part, endpoint in [("view=graph", "graph", "api/graph"),
                                      ("view=subtasks", "subtasks", "api/subtasks"),
                                      ("view=subtasks&vertex=1", "subtasks", "api/subtasks?vertex=1"),
                                      ("view=top", "top", "api/top"),
                                      ("view=top&n=3", "top", "api/top?n=3"),
                                      ("view=checkpoints", "checkpoints", "api/checkpoints"),
                                      (f"view=checkpoints&checkpoint={cid}", "checkpoint", f"api/checkpoints/{cid}"),
                                      ("view=watermarks", "watermarks", "api/watermarks")]:
            live = get(url, "api/live?" + query)
            assert live[part] == get(url, endpoint), query
            info = get(url, "api/job")
            assert {k: v for k, v in live["job"].items() if k != "now"} == {k: v for k, v in info.items() if k != "now"}
        vertices, _ = env.plan()
        assert get(url, "api/live?view=subtasks")["vertices"] == \
            [{"id": v.id, "name": v.name, "parallelism": v.parallelism} for v in vertices]
        for query, code in [("view=nope", 400), ("view=subtasks&vertex=x", 400),
                            ("view=checkpoints&checkpoint=abc", 400), ("view=checkpoints&checkpoint=99999", 404),
                            ("view=top&n=0", 400), ("view=top&n=x", 400), ("view=top&n=-1", 400),
                            ("view=top&n=1001", 400), ("view=top&n=%C2%B2", 400)]:
            assert status_of(url + "api/live?" + query) == code, query
    finally:
        if not job.done:
            cancel_and_join(job)
        job.ui.close()


def test_answers_are_built_once_per_metrics_sample_and_shared(monkeypatch):
    from pyflowbuf import ui
    env = fb.Environment(parallelism=2, name="ui-shared")
    env.from_sequence(0, 10).rebalance().sink(lambda b: None, batched=True)
    job = _SampledJob(env)
    built = []
    real = model.subtasks
    monkeypatch.setattr(model, "subtasks", lambda *a, **k: built.append(1) or real(*a, **k))
    server = ui.serve(job)
    try:
        first = [get(server.url, "api/live?view=subtasks") for _ in range(3)]
        assert len(built) == 1 and first[0]["subtasks"] == first[2]["subtasks"]
        assert first[0]["subtasks"][0]["records_in"] == 1
        job.resample(7)                        # the runtime's next sample
        assert get(server.url, "api/subtasks")[0]["records_in"] == 7 and len(built) == 2
        ranked = []
        real_top = model.top
        monkeypatch.setattr(model, "top", lambda *a, **k: ranked.append(1) or real_top(*a, **k))
        tops = [get(server.url, "api/live?view=top")["top"] for _ in range(3)]
        assert len(ranked) == 1 and tops[0] == tops[2] and tops[0]["running"] == 4
    finally:
        server.close()


def test_a_page_polls_over_one_kept_alive_connection_that_closes_with_the_view():
    import http.client
    from pyflowbuf import ui
    env = fb.Environment(parallelism=2, name="ui-keepalive")
    env.from_sequence(0, 10).rebalance().sink(lambda b: None, batched=True)
    job = _SampledJob(env)
    server = ui.serve(job)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/api/live?view=graph")
        first = conn.getresponse()
        assert first.status == 200 and first.version == 11 and json.loads(first.read())["graph"]["nodes"]
        sock = conn.sock
        for view in ("subtasks", "top", "watermarks", "checkpoints"):
            conn.request("GET", "/api/live?view=" + view)
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["job"]["state"] == "RUNNING"
            assert conn.sock is sock                       # the same connection, kept alive
        # a write's body is not read: the connection closes rather than take it for a request
        conn.request("POST", "/api/job", body=b"GET /api/job HTTP/1.1\r\n\r\n")
        r = conn.getresponse()
        assert r.status == 405 and r.getheader("Connection") == "close"
        r.read()
        conn.close()
        conn.request("GET", "/api/job")
        assert conn.getresponse().status == 200
        server.close()                         # the page's open connection goes with the view
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            conn.request("GET", "/api/job")
            conn.getresponse().read()
    finally:
        conn.close()
        server.close()


# ---------------------------------------------------------------- HTTPS beyond loopback when the job has TLS on

def _https_client(ca_pem):
    import ssl
    ctx = ssl.create_default_context(cadata=ca_pem.decode("ascii"))
    ctx.check_hostname = False          # the job's certificates name no host (as its TLS connections)
    return ctx


def _peer_fingerprint(port, ctx):
    import hashlib
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw) as tls:
            return hashlib.sha256(tls.getpeercert(binary_form=True)).hexdigest()


def test_beyond_loopback_with_tls_the_view_is_https_and_plain_http_is_refused():
    env = fb.Environment(parallelism=2, metrics_interval=0.1, tls=True, ui_port=0, ui_host="0.0.0.0",
                         name="ui-https")
    env.from_sequence(0, None, rate_limit=5000).rebalance().sink(lambda b: None, batched=True)
    job = env.execute_async()
    try:
        ui_ = job.ui
        assert job.ui_url.startswith("https://") and job.ui_url.endswith("/?token=" + ui_.token)
        base = f"https://127.0.0.1:{ui_.port}/"
        ctx = _https_client(ui_.ca_pem)
        with urllib.request.urlopen(base + "api/job?token=" + ui_.token, timeout=30, context=ctx) as r:
            assert json.loads(r.read())["state"] == "RUNNING"
        with pytest.raises(urllib.error.HTTPError) as info:      # the token, as over HTTP
            urllib.request.urlopen(base + "api/job", timeout=30, context=ctx)
        assert info.value.code == 403
        assert _peer_fingerprint(ui_.port, ctx) == ui_.fingerprint
        # another CA's client refuses the view's certificate
        from pyflowbuf.net.tls import JobCertificates
        other = _https_client(JobCertificates("another job").for_attempt(0).ca)
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(base + "api/job?token=" + ui_.token, timeout=30, context=other)
        # plain HTTP on the HTTPS port: a 400 that says where to go, the connection closed
        with socket.create_connection(("127.0.0.1", ui_.port), timeout=10) as s:
            s.sendall(f"GET /api/job?token={ui_.token} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            answer = b""
            while chunk := s.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 400") and b"served over HTTPS only: open https://" in answer
        assert b"RUNNING" not in answer
        # a client that connects and says nothing holds one thread, not the view
        idle = socket.create_connection(("127.0.0.1", ui_.port), timeout=10)
        try:
            with urllib.request.urlopen(base + "api/live?view=graph&token=" + ui_.token, timeout=30,
                                        context=ctx) as r:
                assert json.loads(r.read())["job"]["state"] == "RUNNING"
        finally:
            idle.close()
        before = sum(m["records_out"] for m in env.metrics().values())
        wait_for(lambda: sum(m["records_out"] for m in env.metrics().values()) > before + 100,
                 "records after the refusals", job=job)
        assert not job.done
    finally:
        cancel_and_join(job)
        job.ui.close()


def test_loopback_stays_http_with_tls_unless_https_is_asked_for():
    from pyflowbuf import ui
    from pyflowbuf.net.tls import JobCertificates
    own = JobCertificates("user").for_attempt(0)         # a user's own TLSConfig (PEM in memory)
    env = fb.Environment(parallelism=1, tls=own, ui_port=0, name="ui-loopback-tls")
    env.from_sequence(0, None, rate_limit=2000).sink(lambda b: None, batched=True)
    job = env.execute_async()
    try:
        assert job.ui_url.startswith("http://127.0.0.1:") and job.ui.ssl_context is None
        assert get(job.ui_url, "api/job")["state"] == "RUNNING"
        server = ui.serve(job, https=True)                 # asked for: HTTPS on loopback, the user's certificate
        try:
            assert server.url.startswith("https://127.0.0.1:") and server.token is None
            assert server.ca_pem == own.ca and server.fingerprint in own.fingerprints
            with urllib.request.urlopen(server.url + "api/job", timeout=30, context=_https_client(own.ca)) as r:
                assert json.loads(r.read())["state"] == "RUNNING"
        finally:
            server.close()
    finally:
        cancel_and_join(job)
        job.ui.close()
    plain = fb.Environment(name="ui-no-tls")
    plain.from_sequence(0, 10).sink(lambda b: None, batched=True)
    job = plain.execute_async()
    job.join(60)
    with pytest.raises(errors.ConfigurationError, match="https=True needs the job's TLS on"):
        ui.serve(job, https=True)


@needs_fork
@pytest.mark.filterwarnings("ignore::pyflowbuf.errors.WorkerSideEffectWarning")   # the sink keeps nothing
def test_workers_with_tls_serve_https_with_a_certificate_of_the_jobs_ca():
    env = fb.Environment(parallelism=2, workers=2, metrics_interval=0.1, tls=True, ui_port=0,
                         ui_host="0.0.0.0", name="ui-https-workers")
    env.from_sequence(0, None, rate_limit=2000).rebalance().sink(lambda b: None, batched=True)
    job = env.execute_async()
    try:
        assert job.ui_url.startswith("https://")
        assert job.ui.ca_pem == job.tls.for_attempt(0).ca           # the CA the workers' connections trust
        assert job.ui.fingerprint not in job.tls.for_attempt(0).fingerprints   # a certificate of its own
        url = f"https://127.0.0.1:{job.ui.port}/api/subtasks?token={job.ui.token}"

        def rows():
            with urllib.request.urlopen(url, timeout=30, context=_https_client(job.ui.ca_pem)) as r:
                got = json.loads(r.read())
            return all(x["worker"] is not None for x in got) and got
        assert len(wait_for(rows, "every subtask with its worker, over HTTPS", job=job)) == 4
    finally:
        cancel_and_join(job)
        job.ui.close()


@needs_fork
def test_a_forked_worker_does_not_hold_a_pages_kept_alive_connection():
    import http.client
    from pyflowbuf import ui
    env = fb.Environment(parallelism=1, name="ui-fork")
    env.from_sequence(0, 10).sink(lambda b: None, batched=True)
    job = _SampledJob(env)                  # the view lives as long as its job handle
    server = ui.serve(job)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request("GET", "/api/job")
        conn.getresponse().read()
        wait_for(lambda: server._conns, "the connection's handler")
        fds = [s.fileno() for s in server._conns]
        pid = os.fork()
        if pid == 0:                        # a worker forked while a page is open
            held = 0
            for fd in fds:
                try:
                    os.fstat(fd)
                    held += 1
                except OSError:
                    pass
            os._exit(held)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        conn.request("GET", "/api/job")     # the parent's side is untouched
        assert conn.getresponse().status == 200
    finally:
        conn.close()
        server.close()


def test_refused_and_silent_https_clients_leave_no_connection_behind(monkeypatch):
    from pyflowbuf import ui
    from pyflowbuf.ui import server as ui_server
    monkeypatch.setattr(ui_server, "HANDSHAKE_S", 0.5)
    env = fb.Environment(parallelism=1, tls=True, name="ui-https-leaks")
    env.from_sequence(0, 10).sink(lambda b: None, batched=True)
    job = env.execute_async()
    job.join(60)
    server = ui.serve(job, https=True)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")          # plain HTTP
            while s.recv(4096):
                pass
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=10)   # says nothing
        wait_for(lambda: silent.recv(1) == b"", "the silent client dropped after the handshake timeout")
        silent.close()
        with urllib.request.urlopen(server.url + "api/job", timeout=30, context=_https_client(server.ca_pem)) as r:
            assert json.loads(r.read())["state"] == "FINISHED"
        wait_for(lambda: not server._conns, "every connection gone from the view's set")
    finally:
        server.close()


# ---------------------------------------------------------------- Top N, ranked by the server

def reference_top(vertices, metrics, n):
    """Top N as the page ranked it before the server did, in plain Python:
    the running subtasks in plan order, sorted (stably) by each figure, most
    first, a figure not reported (None, NaN, missing) last; the first n."""
    running = [(v, i, metrics[model.task_name(v, i)]) for v in vertices for i in range(v.parallelism)
               if model.task_name(v, i) in metrics
               and metrics[model.task_name(v, i)].get("state", "RUNNING") in ("RUNNING", "CREATED")]

    def figure(m, field):
        x = m.get(field)
        return x if isinstance(x, (int, float)) and math.isfinite(x) else -math.inf
    out = {"n": n, "running": len(running)}
    for kind, field in (("backpressured", "backpressured_ms_per_s"), ("busy", "busy_ms_per_s"),
                        ("idle", "idle_ms_per_s")):
        ranked = sorted(running, key=lambda e: -figure(e[2], field))
        out[kind] = [{"task": model.task_name(v, i), "vertex_id": v.id, "subtask": i, "worker": None,
                      field: m.get(field) if isinstance(m.get(field), (int, float)) and math.isfinite(m.get(field))
                      else None,
                      "level": m.get("level"), "records_in_per_s": math.floor(m["records_in_per_s"] + 0.5)}
                     for v, i, m in ranked[:n]]
    return out


_figure = st.one_of(st.floats(0, 1000, allow_nan=False), st.integers(0, 1000), st.sampled_from([0.0, 500.0]),
                    st.none(), st.just(math.nan))
_subtask = st.one_of(st.none(), st.fixed_dictionaries(
    {"state": st.sampled_from(["RUNNING", "RUNNING", "CREATED", "FINISHED", "CANCELED"]),
     "level": st.sampled_from(["OK", "LOW", "HIGH"]), "records_in_per_s": st.floats(0, 1e6)},
    optional={"busy_ms_per_s": _figure, "idle_ms_per_s": _figure, "backpressured_ms_per_s": _figure}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(1, 12))
def test_top_n_is_the_ranking_of_env_metrics(data, n):
    # the server's Top N against a ranking of the same sample computed here;
    # ties (the many 0.0 and 500.0) in plan order, unreported figures last
    from pyflowbuf import ui
    job = _SampledJob(_TOP_ENV)
    vertices = job.spec.plan()[0]
    sample = {}
    for v in vertices:
        for i in range(v.parallelism):
            m = data.draw(_subtask)
            if m is not None:
                sample[model.task_name(v, i)] = m
    job.sample = sample
    server = ui.UiServer(job)
    try:
        got = json.loads(server.answer("/api/top", {"n": [str(n)]})[2])
        assert got == reference_top(vertices, job.metrics(), n)
        if n == model.TOP_N:
            assert json.loads(server.answer("/api/top", {})[2]) == got       # the page's default
    finally:
        server.close()


def _wide_env():
    env = fb.Environment(parallelism=4, name="ui-top")
    s = env.from_sequence(0, 10)
    for i in range(3):
        s = s.map(lambda x: x, name=f"op{i}").rebalance()
    s.sink(lambda b: None, batched=True, name="sink")
    return env


_TOP_ENV = _wide_env()


def test_top_n_of_a_running_job_names_its_slow_sink():
    env = fb.Environment(parallelism=2, metrics_interval=0.2, ui_port=0, name="ui-top-job")
    (env.from_sequence(0, None).rebalance()
        .sink(lambda b: time.sleep(0.001 * len(b)), batched=True, name="slow sink"))
    job = env.execute_async()
    try:
        url = job.ui_url

        def sink_busiest():
            top = get(url, "api/live?view=top")["top"]
            return top["running"] == 4 and top["busy"][0]["task"].startswith("slow sink") and top
        top = wait_for(sink_busiest, "the slow sink the busiest subtask", job=job)
        assert len(top["busy"]) == len(top["idle"]) == len(top["backpressured"]) == 4      # fewer run than n
        assert top["n"] == model.TOP_N
        vertices = env.plan()[0]
        metrics = env.metrics()
        ranked = model.top(job.ui.view, metrics, 3)
        assert ranked == reference_top(vertices, metrics, 3)
        assert len(get(url, "api/top?n=1")["busy"]) == 1
    finally:
        cancel_and_join(job)
        job.ui.close()
