"""The web view in a real browser: headless Chromium from the system packages
(ci/setup.sh installs it), driven by Playwright for Python (never `playwright
install`: the system's chromium is launched). Each view is saved as a
screenshot in out/ui-screenshots/ (docs/images/ holds the ones the docs show)."""
import os
import shutil
import time

import pytest

import pyflowbuf as fb

from pipeline_helpers import cancel_and_join, wait_for

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright
except ImportError:             # the test extra has it
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (ci/setup.sh installs the Debian package "
                                                "`chromium`; `apt-get install -y chromium chromium-driver`)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright is not installed (pip install -e '.[test]')"),
]
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="workers=N forks worker processes")
SHOTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "out", "ui-screenshots")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
WAIT_MS = 120_000               # only a hang reaches it


class Browser:
    """One page in a fresh headless Chromium; every console error and page
    error is kept, and a test that saw one fails."""

    def __init__(self):
        self._pw = sync_playwright().start()
        self.browser = self._pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        self.page = self.browser.new_page(viewport={"width": 1800, "height": 800})
        self.errors = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))

    def open(self, url, view):
        self.page.goto(url + "#" + view)

    def shot(self, name):
        os.makedirs(SHOTS, exist_ok=True)
        self.page.locator("body").screenshot(path=os.path.join(SHOTS, name + ".png"))

    def close(self):
        try:
            self.browser.close()
        finally:
            self._pw.stop()


@pytest.fixture
def browser_after():
    """A browser opened after the job started (a forked worker must not
    inherit the browser's pipes), closed at the end of the test."""
    opened = []

    def open_browser():
        b = Browser()
        opened.append(b)
        return b
    yield open_browser
    for b in opened:
        b.close()
    for b in opened:
        assert not b.errors, f"errors in the browser console: {b.errors}"


def slow_sink(batch):
    time.sleep(0.0005 * len(batch))      # ~2000 records/s per subtask: far below what the source offers


def test_a_slow_sink_turns_red_its_upstream_black_and_top_n_names_it(browser_after):
    # three chains, as the docs' picture: the backpressure travels up two exchanges
    # small buffers and batches, as in the seed experiment: a wait for a buffer ends well within a
    # sample (the time of a wait is counted when it ends)
    env = fb.Environment(parallelism=2, metrics_interval=0.5, ui_port=0, name="slow-sink", debloat=True,
                         max_batch=64, segment_size=4096)
    (env.from_sequence(0, None).map(lambda x: x * 2, name="double")
        .rebalance().map(lambda x: x + 1, name="parse")
        .key_by(lambda x: x % 16).sink(slow_sink, batched=True, name="slow sink"))
    job = env.execute_async()
    try:
        b = browser_after()
        b.open(job.ui_url, "graph")
        # within a few seconds of the first samples (a loaded machine may take longer to start)
        b.page.wait_for_selector('.node[data-id="2"][data-shade="red"]', timeout=WAIT_MS)
        b.page.wait_for_selector('.node[data-id="1"][data-shade="black"]', timeout=WAIT_MS)
        b.page.wait_for_selector('.node[data-id="0"][data-shade="black"]', timeout=WAIT_MS)
        assert b.page.get_attribute('.node[data-id="1"]', "data-level") == "HIGH"
        labels = b.page.text_content("#graph")
        assert "REBALANCE" in labels and "HASH" in labels
        b.page.wait_for_function("() => document.querySelector('#graph').textContent.includes('in flight')",
                                 timeout=WAIT_MS)
        try:    # for the picture only: the source past its first long wait for a buffer
            b.page.wait_for_selector('.node[data-id="0"][data-shade="black"]:not([data-out="0"])', timeout=20_000)
        except PlaywrightTimeout:
            pass
        b.shot("graph")

        b.open(job.ui_url, "top")
        b.page.wait_for_selector('.top-busy tr.top-row[data-task^="slow sink"]', timeout=WAIT_MS)
        b.page.wait_for_selector('.top-bp tr.top-row:first-child[data-task^="parse"], '
                                 '.top-bp tr.top-row:first-child[data-task^="sequence -> double"]', timeout=WAIT_MS)
        b.shot("top-n")

        b.page.click('.top-busy tr.top-row[data-task^="slow sink"]')
        b.page.wait_for_selector('tr.subtask[data-task="slow sink (2/2)"]', timeout=WAIT_MS)
        assert b.page.locator("tr.subtask").count() == 2
        b.shot("subtasks")
    finally:
        cancel_and_join(job)
    # the final state, and that the job ended
    b.page.wait_for_selector("#banner:not([hidden])", timeout=WAIT_MS)
    assert "ended" in b.page.inner_text("#banner")
    assert b.page.inner_text("#job-state") == "CANCELED"
    b.page.close()          # before the server: a poll cut off is a console error
    job.ui.close()


def test_checkpoints_fill_the_table_and_a_timeline_has_one_row_per_subtask(tmp_path, browser_after):
    env = fb.Environment(parallelism=3, metrics_interval=0.5, ui_port=0, name="checkpointed",
                         checkpoint_interval=0.5, checkpoint_dir=str(tmp_path / "chk"))
    (env.from_sequence(0, None, rate_limit=3000)
        .key_by(lambda x: x % 11).map(lambda x: x, name="keyed")
        .rebalance().sink(lambda b: None, batched=True, name="sink"))
    job = env.execute_async()
    try:
        b = browser_after()
        wait_for(lambda: sum(c["status"] == "completed" for c in env.checkpoints()) >= 3, "three checkpoints",
                 job=job)
        b.open(job.ui_url, "checkpoints")
        b.page.wait_for_function("() => document.querySelectorAll('tr.checkpoint').length >= 3", timeout=WAIT_MS)
        b.shot("checkpoints")
        done = [c for c in env.checkpoints() if c["status"] == "completed"][-1]
        b.page.click(f'tr.checkpoint[data-id="{done["id"]}"]')
        b.page.wait_for_selector("tr.timeline-row", timeout=WAIT_MS)
        rows = b.page.locator("tr.timeline-row")
        assert rows.count() == 9 == len(done["subtasks"])           # 3 chains x parallelism 3
        keys = [rows.nth(i).get_attribute("data-key") for i in range(rows.count())]
        assert sorted(keys) == sorted(done["subtasks"])
        acks = [done["subtasks"][k]["ack_ms"] for k in keys]
        assert acks == sorted(acks, reverse=True)                   # slowest first
        b.shot("checkpoint-timeline")
    finally:
        cancel_and_join(job)
    b.page.close()          # before the server: a poll cut off is a console error
    job.ui.close()


def test_watermarks_of_every_operator_on_one_screen(browser_after):
    env = fb.Environment(parallelism=2, metrics_interval=0.5, ui_port=0, name="event-time")
    start = time.time() - 5
    (env.from_sequence(0, None, rate_limit=2000)
        .map(lambda i: start + i / 2000.0, kind="float64", name="stamp")
        .assign_timestamps(lambda t: t, out_of_orderness=0.5)
        .rebalance().map(lambda t: t, name="forward").sink(lambda b: None, batched=True, name="sink"))
    job = env.execute_async()
    try:
        b = browser_after()
        b.open(job.ui_url, "watermarks")
        b.page.wait_for_function(
            "() => [...document.querySelectorAll('tr.watermark td:nth-child(3)')].every(td => td.textContent.endsWith(' s'))",
            timeout=WAIT_MS)
        assert b.page.locator("tr.watermark").count() == len(env.plan()[0])
        b.shot("watermarks")
    finally:
        cancel_and_join(job)
    b.page.close()          # before the server: a poll cut off is a console error
    job.ui.close()


@needs_fork
@pytest.mark.filterwarnings("ignore::pyflowbuf.errors.WorkerSideEffectWarning")   # the sink keeps nothing
def test_workers_show_every_subtask_with_its_worker(browser_after):
    env = fb.Environment(parallelism=4, workers=2, metrics_interval=0.5, ui_port=0, name="two-workers")
    (env.from_sequence(0, None, rate_limit=5000).map(lambda x: x, name="map")
        .rebalance().sink(lambda b: None, batched=True, name="sink"))
    job = env.execute_async()
    try:
        b = browser_after()
        b.open(job.ui_url, "subtasks")
        b.page.wait_for_function(
            "() => document.querySelectorAll('tr.subtask').length === 8 && "
            "[...document.querySelectorAll('tr.subtask')].every(r => r.dataset.worker !== '')", timeout=WAIT_MS)
        workers = {b.page.locator("tr.subtask").nth(i).get_attribute("data-task"):
                   b.page.locator("tr.subtask").nth(i).get_attribute("data-worker") for i in range(8)}
        assert set(workers.values()) == {"0", "1"}
        # placement: subtask i of every operator runs on worker i % 2
        for task, w in workers.items():
            assert int(task.split("(")[1].split("/")[0]) % 2 == (int(w) + 1) % 2, (task, w)
        b.shot("subtasks-workers")
    finally:
        cancel_and_join(job)
    b.page.close()          # before the server: a poll cut off is a console error
    job.ui.close()


class FakeJob:
    """A job handle as the view reads one, for a graph too big to run here:
    50 operator chains at parallelism 16 (800 subtasks), every one reporting."""

    done = False
    ran = True
    coordinator = None

    def __init__(self, env):
        self.spec = env.job_spec()         # what the view reads: the job as it runs
        vertices, _ = env.plan()
        self._metrics = {}
        for v in vertices:
            for i in range(v.parallelism):
                bp = 900.0 if v.id < 25 else 0.0
                self._metrics[f"{v.name} ({i + 1}/{v.parallelism})"] = {
                    "state": "RUNNING", "level": "HIGH" if bp else "OK", "busy_ms_per_s": 1000.0 - bp - 50,
                    "idle_ms_per_s": 50.0, "backpressured_ms_per_s": bp, "records_in": 10 ** 6,
                    "records_out": 10 ** 6, "records_in_per_s": 1e5, "records_out_per_s": 1e5, "bytes_in": 8e6,
                    "bytes_out": 8e6, "in_pool_usage": 0.5, "out_pool_usage": 0.9, "vertex": v.name, "subtask": i}

    def metrics(self):
        return dict(self._metrics)

    def checkpoints(self):
        return []


def test_fifty_chains_at_parallelism_sixteen_render(browser_after):
    from pyflowbuf import ui
    env = fb.Environment(parallelism=16, name="wide")
    s = env.from_sequence(0, 10)
    for i in range(49):
        s = s.map(lambda x: x, name=f"op{i}").rebalance()
    s.sink(lambda b: None, batched=True, name="sink")
    assert sum(v.parallelism for v in env.plan()[0]) == 800
    job = FakeJob(env)
    server = ui.serve(job)
    try:
        b = browser_after()
        b.open(server.url, "graph")
        b.page.wait_for_function("() => document.querySelectorAll('.node').length === 50", timeout=WAIT_MS)
        b.open(server.url, "subtasks")
        b.page.wait_for_function("() => document.querySelectorAll('tr.subtask').length === 800", timeout=WAIT_MS)
        b.open(server.url, "top")
        b.page.wait_for_function("() => document.querySelectorAll('tr.top-row').length === 30", timeout=WAIT_MS)
        # the cost of one refresh of the biggest view, in the browser (reported, not asserted: a timed
        # test races the machine; benchmarks/ui.py measures what serving costs the job)
        took = b.page.evaluate("""async () => { const t = performance.now();
            const r = await fetch('/api/subtasks'); await r.json(); return performance.now() - t; }""")
        print(f"/api/subtasks of 800 subtasks: {took:.0f} ms fetched and parsed")
    finally:
        b.page.close()
        server.close()
