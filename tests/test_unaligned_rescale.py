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
  network senders' queued buffers are in the checkpoint too), with a filter
  added upstream and every chain changed, and for a keyed connect (two inputs).
* The redistribution itself against a pure-Python model: records written by
  real RecordWriters into old channels (spanning buffers, events between
  them), each new subtask's share read back as its reader would; and what it
  refuses (key groups that moved, a user event, a stream cut in a record).
* The refusals of a restore: in-flight data on a non-keyed edge; a
  checkpoint written before edges were recorded (the same job still restores).
* A snapshot while restored in-flight data is still being read is declined.
"""
from __future__ import annotations

import ast
import collections
import os
import re
import random
import time
from array import array
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.events import BARRIER, CANCEL_BARRIER, EVT_KIND, EVT_WATERMARK, USER_EVENT
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.checkpoint.storage import IncompatibleCheckpointError
from pyflowbuf.checkpoint import keygroups as kg
from pyflowbuf.exchange.sides import kind_code
from pyflowbuf.checkpointing import inflight
from pyflowbuf.checkpointing.inflight import split_by_key_group
from pyflowbuf.checkpointing.subtask import SubtaskCheckpoints
from pipeline_helpers import cancel_and_join
from reference_model import ref_stable_hash
from test_rescale import KEYS, WINDOW, committed, expected, per_second_counts

pytestmark = pytest.mark.timeout(300)


def slow(seconds):
    def fn(r):
        time.sleep(seconds)
        return r
    return fn


def slow_job(env, p, n, out, kinds=("reduce", "timers", "window"), delay=0.0, rate=None, extra=False):
    """test_rescale's keyed job (the same operators, uids and output); with
    ``delay`` the running count's chain is slow (seconds a record), so the
    keyed exchange stays full and unaligned barriers overtake its buffers.
    ``extra``: a stateless operator more before the key_by."""
    src = env.from_sequence(0, n, parallelism=p, rate_limit=rate).uid("numbers")
    timed = (src.map(lambda x: (x % KEYS, x / 100.0, 1))
             .assign_timestamps(lambda r: r[1]).uid("event-time"))
    if extra:
        timed = timed.filter(lambda r: r[2] == 1, name="extra")
    keyed = timed.key_by(lambda r: r[0])
    if "reduce" in kinds:
        (keyed.reduce(lambda a, b: (a[0], b[1], a[2] + b[2])).uid("counts").map(slow(delay))
              .map(lambda r: ("r", r[0], r[2])).write_text(os.path.join(out, "reduce")).uid("reduce-out"))
    if "timers" in kinds:
        per_second_counts(keyed).write_text(os.path.join(out, "timers")).uid("timers-out")
    if "window" in kinds:
        (keyed.window(fb.Tumbling(WINDOW))
              .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]),
                      window_function=lambda key, w, r: ("w", key, w.start, r[2])).uid("windows")
              .write_text(os.path.join(out, "window")).uid("window-out"))


def keyed_inflight(meta) -> dict:
    """task key -> in-flight bytes on keyed edges, of checkpoint ``meta``."""
    return {k: meta.tasks[k].inflight_bytes for k, s in meta.properties["layout"].items()
            if edge_inflight(s, "hash") and meta.tasks[k].inflight_bytes}


def edge_inflight(s, partitioner) -> list:
    """The in-flight items a task's layout ``s`` holds on edges of ``partitioner``."""
    if not s.get("inflight") or "edges" not in s:
        return []
    return [n for n in s["inflight_items"]
            if s["edges"]["in" if n.startswith("in/") else "out"][int(n.split("/")[1])]["partitioner"] == partitioner]


def run_cancel(env, ck, holds=keyed_inflight):
    """Run until the latest complete checkpoint ``holds`` the in-flight data
    wanted (under backpressure each later one does too), then cancel. The
    restore must really move such data, or the test proves nothing: asserted
    on the checkpoint that is latest once the job ended. Returns ``holds``."""
    job = env.execute_async()
    storage = CheckpointStorage(ck)
    deadline = time.monotonic() + 60
    while True:
        assert not job.done and time.monotonic() < deadline, env.checkpoints()
        meta = storage.latest() if any(c["status"] == "completed" for c in env.checkpoints()) else None
        if meta is not None and holds(meta):
            break
        time.sleep(0.05)
    cancel_and_join(job, failure_ok=True)
    meta = storage.latest()
    got = holds(meta)
    assert got, meta.properties["layout"]
    return got


def run_cancel_resume(tmp, p1, p2, n, workers=None, kinds=("reduce", "timers", "window"), changed=None):
    out, ck = os.path.join(tmp, "out"), os.path.join(tmp, "ck")
    conf = dict(checkpoint_interval=0.25, checkpoint_dir=ck, checkpoint_alignment="unaligned", segment_size=4096)
    if workers:
        conf["workers"] = workers
    env = fb.Environment(parallelism=p1, **conf)
    # slower than its source (which is rate-limited, so it runs past a few checkpoints)
    slow_job(env, p1, n, out, kinds, delay=0.003, rate=3000)
    held = run_cancel(env, ck)
    env2 = fb.Environment(parallelism=p2, **dict(conf, **(changed or {})))
    slow_job(env2, p2, n, out, kinds, extra=bool(changed))
    env2.execute(180, restore_from="latest")
    return committed(out), held


@settings(max_examples=6, deadline=None)
@given(p1=st.integers(1, 4), p2=st.integers(1, 4),
       more=st.sets(st.sampled_from(["timers", "window"])))
def test_a_keyed_job_restored_from_inflight_data_at_another_parallelism_commits_each_result_once(
        tmp_path_factory, p1, p2, more):
    """The running count (its chain slow), with a keyed process function
    with event-time timers and a tumbling window or not: their in-flight
    records hold event times, so a window fired before they were read, or a
    record replayed twice or never, would show in the committed output."""
    tmp = str(tmp_path_factory.mktemp("infl"))
    n = 3000
    kinds = ("reduce",) + tuple(sorted(more))
    got, _ = run_cancel_resume(tmp, p1, p2, n, kinds=kinds)
    want = expected(n, kinds)
    assert got == want, (p1, p2, sorted((want - got).items())[:5], sorted((got - want).items())[:5])


@settings(max_examples=6, deadline=None)
@given(p1=st.integers(1, 4), p2=st.integers(1, 4))
def test_with_workers_the_senders_queued_buffers_move_too(tmp_path_factory, p1, p2):
    """Two worker processes: the keyed exchange crosses TCP, so the network
    senders' queued buffers (``out/...``) are in-flight data too; each new
    subtask, in whichever worker it runs, reads its key groups' share."""
    tmp = str(tmp_path_factory.mktemp("infl-workers"))
    n = 3000
    got, _ = run_cancel_resume(tmp, p1, p2, n, workers=2, kinds=("reduce", "window"))
    want = expected(n, ("reduce", "window"))
    assert got == want, (p1, p2, sorted((want - got).items())[:5], sorted((got - want).items())[:5])


def test_a_stateless_operator_added_and_chains_changed_upstream(tmp_path):
    """Resumed with a filter more before the key_by and chaining off (every
    chain changed), at the same parallelism: the keyed edge's ends are other
    chains now, so its in-flight data is redistributed, not replayed in place."""
    n = 3000
    got, held = run_cancel_resume(str(tmp_path), 2, 2, n, kinds=("reduce", "timers"), changed={"chaining": False})
    assert got == expected(n, ("reduce", "timers"))


def test_in_flight_data_on_a_non_keyed_edge_is_still_refused(tmp_path):
    """A rebalance edge holds in-flight data too: refused at another
    parallelism, naming the task and the edge, pointing to a savepoint; the
    same job at the same parallelism restores (in place, as before)."""
    ck = str(tmp_path / "ck")
    conf = dict(checkpoint_interval=0.25, checkpoint_dir=ck, checkpoint_alignment="unaligned",
                segment_size=4096, chaining=False)

    def job(env, delay=0.003):
        (env.from_sequence(0, 6000, rate_limit=3000 if delay else None).uid("numbers")
            .rebalance().map(slow(delay), name="slow", parallelism=2)
            .map(lambda x: (x % KEYS, 1), name="pairs")
            .key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts").collect())

    env = fb.Environment(parallelism=1, **conf)
    job(env)
    run_cancel(env, ck, lambda meta: [k for k, s in meta.properties["layout"].items()
                                      if edge_inflight(s, "rebalance") and meta.tasks[k].inflight_bytes])
    env2 = fb.Environment(parallelism=3, **conf)
    job(env2, 0)
    env2.plan()
    slow_id = next(n.operator_uid for n in env2.nodes if n.name == "slow")     # (a derived id)
    with pytest.raises(errors.ConfigurationError,
                       match=r"not keyed.*the rebalance edge into operator '" + re.escape(slow_id) + r"' \(input 0\), "
                             r"held by task 'slow' \(v1-\d: in/0/0\).*cannot be redistributed.*savepoint"):
        env2.execute(60, restore_from="latest")


def test_a_checkpoint_without_edges_restores_only_into_the_same_tasks(tmp_path, monkeypatch):
    """A checkpoint written before in-flight data named its edges: refused at
    another parallelism (pointing to a savepoint), restored at the same."""
    monkeypatch.setattr(inflight, "edge_descriptions", lambda edges, vertex: None)
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    conf = dict(checkpoint_interval=0.25, checkpoint_dir=ck, checkpoint_alignment="unaligned", segment_size=4096)
    env = fb.Environment(parallelism=2, **conf)
    slow_job(env, 2, 3000, out, ("reduce",), delay=0.003, rate=3000)
    run_cancel(env, ck, lambda meta: meta.inflight_bytes)
    meta = CheckpointStorage(ck).latest()
    assert not any("edges" in s for s in meta.properties["layout"].values())
    env2 = fb.Environment(parallelism=3, **conf)
    slow_job(env2, 3, 3000, out, ("reduce",))
    with pytest.raises(errors.ConfigurationError, match="written before the edges.*savepoint"):
        env2.execute(60, restore_from="latest")
    env3 = fb.Environment(parallelism=2, **conf)
    slow_job(env3, 2, 3000, out, ("reduce",))
    env3.execute(120, restore_from="latest")
    assert committed(out) == expected(3000, ("reduce",))


# ---------------------------------------------------------------- the redistribution against a model

SEG = 256


def channel_items(records, times, cut_events, rng):
    """``records`` written by a real RecordWriter into one channel (small
    segments: records span buffers), with an EVT_KIND first and watermarks
    between some batches; the queued items, as a checkpoint captures them."""
    net = NetworkBufferPool(4096, SEG)
    q = BufferQueue(net)
    w = RecordWriter(net.create_pool(2048, 2048), [q], kind="struct", timestamped=times is not None)
    q.push_event(EVT_KIND, kind_code("struct"))
    i = 0
    while i < len(records):
        k = rng.randint(1, 6)
        w.write_batch(records[i:i + k], 0, None if times is None else array("d", times[i:i + k]))
        i += k
        if cut_events and rng.random() < 0.3:
            w.flush()
            w.broadcast_event(EVT_WATERMARK, i)
    w.flush()
    return q.copy_front(q.backlog)


def read_back(items, timestamped):
    """What a restored subtask's reader hands out of its replayed items."""
    reader = RecordReader(BufferQueue(NetworkBufferPool(4, SEG)), kind="struct", timestamped=timestamped)
    reader.replay([(0, it) for it in items])
    out = []
    while True:
        batch = reader.read_batch(4096, timeout=0)
        if not batch:
            assert reader.take_event() is None
            return out
        ts = list(reader.timestamps) if timestamped else [None] * len(batch)
        out.extend(zip(batch, ts))


@settings(max_examples=60, deadline=None)
@given(maxp=st.integers(4, 64), senders=st.integers(1, 3), receivers=st.integers(1, 3),
       new=st.integers(1, 4), timestamped=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_redistribution_matches_a_model(maxp, senders, receivers, new, timestamped, seed):
    """Per new subtask: the records of its key groups, channel by channel
    (old sender, then old receiver), each channel's in its order (one byte
    stream: records span its buffers); the events between buffers dropped;
    timestamps kept."""
    receivers = min(receivers, maxp)
    rng = random.Random(seed)
    group = lambda key: ref_stable_hash(key) % maxp   # noqa: E731  (the model's own hash)
    streams, sent = {}, {}
    for s in range(senders):
        for r in range(receivers):
            start, end = kg.key_group_range(maxp, receivers, r)
            keys = [k for k in range(400) if start <= group(k) < end][:12]
            recs = [(rng.choice(keys), s, i, "x" * rng.randint(0, 90)) for i in range(rng.randint(0, 40))]
            times = [float(rng.randint(0, 10_000)) for _ in recs] if timestamped else None
            items = channel_items(recs, times, True, rng)
            streams[(s, r)] = (items, None)
            sent[(s, r)] = list(zip(recs, times if times is not None else [None] * len(recs)))
    kind, split = split_by_key_group(streams, lambda rec: rec[0], maxp, receivers, timestamped)
    assert kind == "struct" or not any(sent.values())
    for j in range(new):
        start, end = kg.key_group_range(maxp, new, j)
        want = [rt for pair in sorted(sent) for rt in sent[pair] if start <= group(rt[0][0]) < end]
        got = read_back(split.items_for(start, end), timestamped)
        assert got == want, (j, len(got), len(want))



def test_what_cannot_be_redistributed_is_refused_by_name():
    """A key function that no longer gives the groups the records were routed
    by, a user event among the items, a stream cut inside a record."""
    maxp, rng = 16, random.Random(7)
    start, end = kg.key_group_range(maxp, 2, 1)
    key = next(k for k in range(100) if start <= ref_stable_hash(k) % maxp < end)
    recs = [(key, 0, i, "x" * 50) for i in range(20)]
    items = channel_items(recs, None, False, rng)
    streams = {(0, 1): (items, None)}
    kind, split = split_by_key_group(streams, lambda r: r[0], maxp, 2, False)
    assert len(split.frames) == 20 and kind == "struct"
    moved = next(k for k in range(100) if not start <= ref_stable_hash(k) % maxp < end)
    with pytest.raises(IncompatibleCheckpointError, match=r"channel 0 -> 1.*key group \d+, outside.*\[8, 16\)"
                                                                 r".*key_by function or the record kind changed"):
        split_by_key_group(streams, lambda r: moved, maxp, 2, False)
    with pytest.raises(errors.ConfigurationError, match="key_by function failed"):
        split_by_key_group(streams, lambda r: r[7], maxp, 2, False)
    user = items[:2] + [(2, USER_EVENT, 0, 5, None)] + items[2:]
    with pytest.raises(errors.ConfigurationError, match="user event"):
        split_by_key_group({(0, 1): (user, None)}, lambda r: r[0], maxp, 2, False)
    data = [it for it in items if it[4] is not None]
    cut = [data[0][:4] + (data[0][4][:-3],)]       # the first buffer, short of its last bytes
    with pytest.raises(IncompatibleCheckpointError, match="ends inside a record"):
        split_by_key_group({(0, 1): (cut, "struct")}, lambda r: r[0], maxp, 2, False)


def test_a_snapshot_while_restored_inflight_data_is_still_read_is_declined():
    """An unaligned snapshot of a task one of whose inputs still reads the
    in-flight data it was restored with (a barrier came on another input
    first) would hold the rest of it nowhere: it is declined, and its
    consumers get a cancel-barrier; once read, the snapshot is taken."""
    declined, sent, snapshots = [], [], []
    reader = SimpleNamespace(replaying=True, unread_prefix=lambda ch: None, start_recording=lambda ch: None)
    out = SimpleNamespace(broadcast_event=lambda kind, aux, flags=0, priority=False: sent.append((kind, aux)))
    task = SimpleNamespace(vertex=SimpleNamespace(id=1), index=0, operators=[], outputs=[out], finished_ns=0)
    sc = SubtaskCheckpoints(task, [SimpleNamespace(reader=reader, num_channels=1)])
    sc.coordinator = SimpleNamespace(decline=lambda key, n, why: declined.append((key, n, why)))
    sc.snapshot_unaligned = lambda n, inputs, how, *phases: snapshots.append(n)
    sc._snapshot_overtaking(5, [(0, 0)])
    assert declined and declined[0][:2] == ("v1-0", 5) and "replaying" in declined[0][2]
    assert sent == [(CANCEL_BARRIER, 5)] and snapshots == []
    reader.replaying = False
    sc._snapshot_overtaking(6, [(0, 0)])
    assert snapshots == [6] and sent[-1] == (BARRIER, 6)


def test_a_keyed_connect_moves_each_inputs_inflight_data_into_that_input(tmp_path):
    """Two keyed inputs of one operator (connect): each input's in-flight
    records go to the same input of the subtask owning their key group."""
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    n = 2000

    def job(env, p, delay=0.0, rate=None):
        def side(tag):
            def fn(key, rec, state):
                state[tag] = state.get(tag, 0) + 1
                return [(tag, key, state[tag])]
            return fn
        a = env.from_sequence(0, n, parallelism=p, rate_limit=rate).uid("a").map(lambda x: (x % KEYS, x))
        b = env.from_sequence(0, n, parallelism=p, rate_limit=rate).uid("b").map(lambda x: (x % 5, x))
        (a.key_by(lambda r: r[0]).connect(b.key_by(lambda r: r[0]))
          .process(side("a"), side("b"), kind="struct").uid("both")
          .map(slow(delay)).write_text(out))

    conf = dict(checkpoint_interval=0.25, checkpoint_dir=ck, checkpoint_alignment="unaligned", segment_size=4096)
    env = fb.Environment(parallelism=2, **conf)
    job(env, 2, delay=0.003, rate=2000)
    held = run_cancel(env, ck)
    env2 = fb.Environment(parallelism=3, **conf)
    job(env2, 3)
    env2.execute(120, restore_from="latest")
    got = committed_lines(out)
    want = collections.Counter(("a", k, i) for k, c in collections.Counter(x % KEYS for x in range(n)).items()
                               for i in range(1, c + 1))
    want.update(("b", k, i) for k, c in collections.Counter(x % 5 for x in range(n)).items() for i in range(1, c + 1))
    assert held and got == want, (sorted((want - got).items())[:5], sorted((got - want).items())[:5])


def committed_lines(out) -> collections.Counter:
    got: collections.Counter = collections.Counter()
    for name in os.listdir(out):
        if name.startswith("part-"):
            with open(os.path.join(out, name)) as fh:
                got.update(ast.literal_eval(line) for line in fh if line.strip())
    return got


def test_an_edge_whose_records_gained_timestamps_is_not_replayed_in_place(monkeypatch):
    """A side output's edge carries its records' times now; an older
    checkpoint stored that edge's bytes without them. Replayed in place they
    would be read as frames with an 8-byte time: the edge counts as changed
    (then refused where it is not keyed), never as the same edge."""
    from pyflowbuf.checkpointing import inflight as ir

    monkeypatch.setattr(ir, "_identity", lambda v: v)
    d = {"partitioner": "forward", "tag": "late", "out_index": 0, "timestamped": False,
         "from_chain": "a", "to_chain": "b"}
    e = SimpleNamespace(partitioner="forward", tag="late", out_index=0, timestamped=False, source="a", target="b")
    assert ir.InflightPlan._same_edge(d, e)
    e.timestamped = True
    assert not ir.InflightPlan._same_edge(d, e)
