"""In-flight data of an unaligned checkpoint restored at another parallelism
(issue 21, point 3): redistributed by key group on keyed edges, refused
(pointing to a savepoint) on the others.

* A keyed job (sequence -> map -> event time -> key_by -> a running count, a
  keyed process function with event-time timers and a tumbling window, into
  ``write_text``) runs under backpressure with unaligned checkpoints, is
  cancelled after a checkpoint that holds in-flight data on its keyed edges
  (asserted from the checkpoint's layout), and is resumed at another
  parallelism: the committed output equals one uninterrupted run, per key,
  exactly once. Also with ``workers=2`` (the keyed edge crosses TCP, so the
  network senders' queued buffers are in the checkpoint too).
* The redistribution itself against a pure-Python model: records written by
  real RecordWriters into old channels (cut anywhere between what the
  receiver held and what the sender still had queued, with events between
  the buffers), each new subtask's share read back as its reader would.
* The refusals: in-flight data on a non-keyed edge; a checkpoint written
  before edges were recorded.
"""
from __future__ import annotations

import collections
import os
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.events import EVT_KIND, EVT_WATERMARK
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.checkpoint import keygroups as kg
from pyflowbuf.exchange.sides import kind_code
from pyflowbuf.runtime.inflight_rescale import KeyGroupSplit, decode_stream
from reference_model import ref_stable_hash
from test_rescale import KEYS, WINDOW, committed, expected

pytestmark = pytest.mark.timeout(300)


def slow(seconds):
    def fn(r):
        time.sleep(seconds)
        return r
    return fn


def slow_job(env, p, n, out, kinds=("reduce", "timers", "window"), delay=0.0, rate=None):
    """test_rescale's keyed job (the same operators, uids and output); with
    ``delay`` the running count's chain is slow (seconds a record), so the
    keyed exchange stays full and unaligned barriers overtake its buffers."""
    src = env.from_sequence(0, n, parallelism=p, rate_limit=rate).uid("numbers")
    keyed = (src.map(lambda x: (x % KEYS, x / 100.0, 1))
             .assign_timestamps(lambda r: r[1]).uid("event-time")
             .key_by(lambda r: r[0]))
    if "reduce" in kinds:
        (keyed.reduce(lambda a, b: (a[0], b[1], a[2] + b[2])).uid("counts").map(slow(delay))
              .map(lambda r: ("r", r[0], r[2])).write_text(os.path.join(out, "reduce")))
    if "timers" in kinds:
        def per_second(key, rec, state, ctx):
            b = int(rec[1])
            state[b] = state.get(b, 0) + 1
            ctx.register_event_time_timer(b + 1)

        def fire(key, t, state, ctx):
            b = int(t) - 1
            return [("t", key, b, state.pop(b, 0))]

        (keyed.process(per_second, on_timer=fire).uid("seconds")
              .write_text(os.path.join(out, "timers")))
    if "window" in kinds:
        (keyed.window(fb.Tumbling(WINDOW))
              .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]),
                      window_function=lambda key, w, r: ("w", key, w.start, r[2])).uid("windows")
              .write_text(os.path.join(out, "window")))


def keyed_inflight(storage) -> dict:
    """task key -> in-flight bytes on keyed edges, of the latest checkpoint."""
    meta = storage.latest()
    out = {}
    for k, s in meta.properties["layout"].items():
        if not s.get("inflight"):
            continue
        names = s["inflight_items"]
        keyed = [n for n in names if s["edges"]["in" if n.startswith("in/") else "out"][int(n.split("/")[1])]["keyed"]]
        if keyed and meta.tasks[k].inflight_bytes:
            out[k] = meta.tasks[k].inflight_bytes
    return out


def run_cancel_resume(tmp, p1, p2, n, workers=None, kinds=("reduce", "timers", "window")):
    out, ck = os.path.join(tmp, "out"), os.path.join(tmp, "ck")
    conf = dict(checkpoint_interval=0.25, checkpoint_dir=ck, checkpoint_alignment="unaligned", segment_size=4096)
    if workers:
        conf["workers"] = workers
    env = fb.Environment(parallelism=p1, **conf)
    # slower than its source (which is rate-limited, so it runs past a few checkpoints)
    slow_job(env, p1, n, out, kinds, delay=0.003, rate=3000)
    job = env.execute_async()
    deadline = time.monotonic() + 60
    while not any(c["status"] == "completed" and c["inflight_bytes"] for c in env.checkpoints()):
        assert not job.done and time.monotonic() < deadline, env.checkpoints()
        time.sleep(0.02)
    job.cancel()
    try:
        job.join(60)
    except errors.JobFailedError:
        pass
    storage = CheckpointStorage(ck)
    held = keyed_inflight(storage)
    # the restore must really move in-flight data of the keyed edges, or this proves nothing
    assert held, storage.latest().properties["layout"]
    env2 = fb.Environment(parallelism=p2, **conf)
    slow_job(env2, p2, n, out, kinds)
    env2.execute(180, restore_from="latest")
    return committed(out), held


@settings(max_examples=5, deadline=None)
@given(p1=st.integers(1, 4), p2=st.integers(1, 4))
def test_a_keyed_job_restored_from_inflight_data_at_another_parallelism_commits_each_result_once(
        tmp_path_factory, p1, p2):
    tmp = str(tmp_path_factory.mktemp("infl"))
    n = 3000
    got, _ = run_cancel_resume(tmp, p1, p2, n)
    want = expected(n)
    assert got == want, (p1, p2, sorted((want - got).items())[:5], sorted((got - want).items())[:5])
