"""Tasks with several inputs: ``union`` and ``connect`` (``process``, ``map``).

The plan (a node with several inputs heads its own task, one JobEdge per
input with its index), results against plain-Python references for every
partitioner, chaining on and off, different parallelisms and kinds, keyed state
shared by both inputs of a connect, the MultiInput that reads the gates
(fair, events in their place, one Notifier, block/resume, cancel), error paths
at declaration and at run time, worker processes, and every segment back in
its pool afterwards."""
from __future__ import annotations

import collections
import multiprocessing
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf._core.channel import BARRIER, BufferQueue, InputGate
from pyflowbuf._core.memory import NetworkBufferPool, Notifier
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf.errors import ConfigurationError, JobFailedError
from pyflowbuf.exchange.sides import EdgeKind, InputSide, MultiInput

from pipeline_helpers import assert_clean, run, worker_processes_left  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CHAINING = pytest.mark.parametrize("chaining", [True, False], ids=["chained", "unchained"])
HAS_FORK = "fork" in multiprocessing.get_all_start_methods()


def counts(records) -> collections.Counter:
    return collections.Counter(records)


# --------------------------------------------------------------------------- plan


def test_a_node_with_several_inputs_heads_its_own_vertex():
    env = fb.Environment(parallelism=2)
    a = env.from_sequence(0, 10).map(lambda x: x, name="ma")
    b = env.from_sequence(0, 10, name="seq_b")
    a.union(b).map(lambda x: x, name="after").collect()
    vertices, edges = env.plan()
    # a's map is forward with equal parallelism, yet not fused into the union
    assert [v.name for v in vertices] == ["sequence -> ma", "seq_b", "union -> after -> collect"]
    into = [e for e in edges if e.target.name.startswith("union")]
    assert [(e.source.name, e.input_index, e.partitioner) for e in into] == [
        ("sequence -> ma", 0, "forward"), ("seq_b", 1, "forward")]
    assert vertices[2].num_inputs == 2 and vertices[0].num_inputs == 0


def test_plan_without_chaining_and_partitioners_per_input():
    env = fb.Environment(parallelism=3, chaining=False)
    a = env.from_sequence(0, 10, parallelism=1)
    b = env.from_sequence(0, 10, parallelism=3)
    c = env.from_sequence(0, 10, parallelism=3)
    a.union(b.rebalance(), c.key_by(lambda x: x % 2)).collect()
    vertices, edges = env.plan()
    into = sorted((e.input_index, e.partitioner) for e in edges if e.target.name == "union")
    assert into == [(0, "rebalance"), (1, "rebalance"), (2, "hash")]
    assert len(vertices) == 5


def test_single_input_node_keeps_its_single_input_view():
    env = fb.Environment()
    s = env.from_sequence(0, 3)
    m = s.map(lambda x: x)
    assert m.node.input is s.node and m.node.partitioner == "forward" and m.node.key_fn is None
    assert s.node.input is None
    u = s.union(m)
    with pytest.raises(ValueError, match="2 inputs"):
        u.node.input


# --------------------------------------------------------------------------- union


@CHAINING
@pytest.mark.parametrize("pa,pb,pu", [(1, 1, 1), (1, 2, 2), (2, 3, 2), (3, 3, 3)])
def test_union_of_two_streams(chaining, pa, pb, pu):
    env = fb.Environment(parallelism=pu, chaining=chaining)
    a = env.from_sequence(0, 7000, parallelism=pa)
    b = env.from_sequence(100_000, 105_000, parallelism=pb)
    h = a.union(b).map(lambda x: x * 2).collect()
    run(env)
    assert counts(h.result) == counts([x * 2 for x in range(7000)] + [x * 2 for x in range(100_000, 105_000)])


@CHAINING
def test_union_of_three_streams_forward_rebalance_key_by(chaining):
    p = 3
    env = fb.Environment(parallelism=p, chaining=chaining)
    a = env.from_sequence(0, 3000, parallelism=3)                      # forward
    b = env.from_collection(list(range(10_000, 12_000)))               # rebalance 1 -> 3
    c = env.from_sequence(20_000, 26_000, parallelism=2)               # hash by key
    key = lambda x: x % 11                                             # noqa: E731
    h = a.union(b, c.key_by(key)).collect(parallelism=p)              # forward into collect: parts by subtask
    run(env)
    want = list(range(3000)) + list(range(10_000, 12_000)) + list(range(20_000, 26_000))
    assert counts(h.result) == counts(want)
    # the key_by input reached the union by key: each key in one subtask
    where = {}
    for sub, part in h._parts.items():
        for x in part:
            if x >= 20_000:
                assert where.setdefault(key(x), sub) == sub
    assert len(where) == 11
    # the forward input stayed on its subtask: sequence subtask i strides by p
    for sub, part in h._parts.items():
        assert all(x % p == sub for x in part if x < 3000)


def test_union_of_a_stream_with_itself_and_with_nothing():
    env = fb.Environment(parallelism=2)
    a = env.from_sequence(0, 1000)
    twice = a.union(a).collect()
    once = a.union().collect()
    run(env)
    assert counts(twice.result) == counts(list(range(1000)) * 2)
    assert sorted(once.result) == list(range(1000))


def test_union_with_broadcast_input():
    env = fb.Environment(parallelism=3)
    a = env.from_sequence(0, 500, parallelism=1)
    b = env.from_sequence(1000, 1100, parallelism=3)
    h = a.broadcast().union(b).collect(parallelism=1)
    run(env)
    assert counts(h.result) == counts(list(range(500)) * 3 + list(range(1000, 1100)))


@CHAINING
def test_union_of_rows_streams(chaining):
    dt = np.dtype([("a", "<i8"), ("b", "<f8")])
    def rows(lo, hi):
        r = np.zeros(hi - lo, dt)
        r["a"] = np.arange(lo, hi)
        r["b"] = r["a"] * 0.5
        return r
    env = fb.Environment(parallelism=2, chaining=chaining)
    a = env.from_arrays([rows(0, 1000), rows(1000, 2000)])
    b = env.from_arrays([rows(5000, 5500)])
    h = a.union(b).map_batches(lambda arr: arr[arr["a"] % 2 == 0]).collect(parallelism=1)
    run(env)
    got = np.sort(np.concatenate(h.result)["a"])
    want = np.array([x for x in list(range(2000)) + list(range(5000, 5500)) if x % 2 == 0])
    assert np.array_equal(got, want)


def test_union_with_buffer_timeout_zero_flushes_per_record():
    env = fb.Environment(parallelism=2, buffer_timeout=0)
    a = env.from_sequence(0, 300)
    b = env.from_collection([f"{i}" for i in range(200)]).map(int, kind="int64")
    h = a.union(b).map(lambda x: x + 1).collect()
    run(env)
    assert counts(h.result) == counts([x + 1 for x in range(300)] + [x + 1 for x in range(200)])


# --------------------------------------------------------------------------- kinds


def test_union_of_different_declared_kinds_is_refused_at_declaration():
    env = fb.Environment()
    ints = env.from_sequence(0, 10)
    strs = env.from_collection(["a", "b"])
    with pytest.raises(ConfigurationError, match=r"union 'union'.*'int64'.*'str'"):
        ints.union(strs)
    with pytest.raises(ConfigurationError, match="different record kinds"):
        ints.map(str, kind="str").union(ints.map(float, kind="float64"))
    dt1, dt2 = np.dtype("<i8"), np.dtype("<i4")
    with pytest.raises(ConfigurationError, match="rows of dtype"):
        env.from_arrays([np.zeros(3, dt1)]).union(env.from_arrays([np.zeros(3, dt2)]))
    # the same kind named two ways is one kind
    from pyflowbuf.serializers import get_serializer
    u = ints.union(ints.map(lambda x: x, kind=get_serializer("int64")))
    assert u.node.kind == "int64"


def test_union_kind_is_the_declared_one_and_undeclared_inputs_are_checked():
    env = fb.Environment(parallelism=2)
    ints = env.from_sequence(0, 100)
    undeclared = env.from_sequence(0, 100).map(lambda x: x * 10)
    u = undeclared.union(ints)
    assert u.node.kind == "int64"
    h = u.collect()
    run(env)
    assert counts(h.result) == counts(list(range(100)) + [x * 10 for x in range(100)])


@CHAINING
def test_union_of_undeclared_streams_that_disagree_fails_naming_the_union(chaining):
    env = fb.Environment(parallelism=1, chaining=chaining)
    a = env.from_sequence(0, 50).map(lambda x: x)
    b = env.from_sequence(0, 50).map(lambda x: f"s{x}")
    a.union(b, name="merge").map(lambda x: x).collect()
    with pytest.raises(JobFailedError, match="merge") as ei:
        env.execute(timeout=60)
    assert "RecordTypeError" in str(ei.value)
    assert_clean(env)


def test_connect_inputs_of_different_kinds():
    env = fb.Environment(parallelism=2)
    words = env.from_collection([f"w{i % 7}" for i in range(700)])
    nums = env.from_sequence(0, 500)
    arrs = env.from_arrays([np.arange(10, dtype=np.int64)])
    h = words.connect(nums).map(lambda w: ("w", w), lambda n: ("n", str(n))).collect()
    g = arrs.connect(words).map(lambda a: int(a.sum()), lambda w: len(w), kind="int64").collect()
    run(env)
    assert counts(h.result) == counts([("w", f"w{i % 7}") for i in range(700)] + [("n", str(n)) for n in range(500)])
    assert counts(g.result) == counts([45] + [2] * 700)


# --------------------------------------------------------------------------- connect


def join_reference(orders, payments):
    o = dict(orders)
    return counts((k, o[k], paid) for k, paid in payments if k in o)


def order_fn(key, order, state):
    state["amount"] = order[1]
    if "paid" in state:
        return [(key, order[1], state["paid"])]
    return None


def payment_fn(key, payment, state):
    state["paid"] = payment[1]
    if "amount" in state:
        return [(key, state["amount"], payment[1])]
    return None


@CHAINING
@pytest.mark.parametrize("p,po,pp", [(1, 1, 1), (2, 1, 1), (3, 1, 2), (2, 2, 2)])
def test_keyed_connect_joins_orders_and_payments(chaining, p, po, pp):
    n = 3000
    orders = [(k, k * 10) for k in range(n)]
    payments = [(k, k * 10 + 1) for k in range(0, 2 * n, 2)]    # half of them have no order
    env = fb.Environment(parallelism=p, chaining=chaining)
    if po == 1:
        o = env.from_collection(orders)
    else:
        o = env.from_sequence(0, n, parallelism=po).map(lambda k: (k, k * 10))
    if pp == 1:
        pay = env.from_collection(payments)
    else:
        pay = env.from_sequence(0, 2 * n, 2, parallelism=pp).map(lambda k: (k, k * 10 + 1))
    joined = (o.key_by(lambda r: r[0])
               .connect(pay.key_by(lambda r: r[0]))
               .process(order_fn, payment_fn, name="join")
               .collect())
    run(env)
    assert counts(joined.result) == join_reference(orders, payments)
    assert len(joined.result) == n // 2


def test_keyed_connect_with_different_key_functions_and_kinds():
    """Orders as 'id,amount' strings, payments as ints: the keys agree though
    the records and key functions do not."""
    env = fb.Environment(parallelism=3)
    o = env.from_collection([f"{k},{k * 3}" for k in range(1000)])
    pay = env.from_sequence(0, 1000, parallelism=2)
    out = (o.key_by(lambda s: int(s.split(",")[0]))
            .connect(pay.key_by(lambda k: k))
            .process(lambda k, s, st: order_fn(k, (k, int(s.split(",")[1])), st),
                     lambda k, x, st: payment_fn(k, (k, -x), st), kind="struct")
            .collect())
    run(env)
    assert counts(out.result) == counts((k, k * 3, -k) for k in range(1000))


@pytest.mark.parametrize("p", [1, 2, 3])
def test_unkeyed_connect_shares_one_state_dict_per_subtask(p):
    def bump(st):
        st["n"] = st.get("n", 0) + 1
        return st["n"]
    env = fb.Environment(parallelism=p)
    a = env.from_sequence(0, 2000, parallelism=1)
    b = env.from_sequence(0, 1500, parallelism=2)
    h = a.connect(b).process(lambda x, st: [bump(st)], lambda x, st: [-bump(st)]).collect()
    run(env)
    # one counter per subtask, counting the records of both inputs
    total = 0
    for part in h._parts.values():
        assert sorted(abs(v) for v in part) == list(range(1, len(part) + 1))
        total += len(part)
    assert total == 3500
    assert sum(1 for v in h.result if v < 0) == 1500


@CHAINING
def test_comap_and_operators_chained_after_it(chaining):
    env = fb.Environment(parallelism=2, chaining=chaining)
    a = env.from_sequence(0, 4000)
    b = env.from_collection([f"x{i}" for i in range(3000)])
    h = (a.connect(b)
          .map(lambda x: f"a{x}", lambda s: "b" + s[1:], name="co")
          .filter(lambda s: not s.endswith("7"))
          .map(str.upper)
          .collect())
    run(env)
    want = [f"A{x}" for x in range(4000)] + [f"B{i}" for i in range(3000)]
    assert counts(h.result) == counts(w for w in want if not w.endswith("7"))


def test_comap_of_keyed_and_unkeyed_streams_is_allowed():
    env = fb.Environment(parallelism=2)
    a = env.from_sequence(0, 100).key_by(lambda x: x % 3)
    b = env.from_sequence(100, 200)
    h = a.connect(b).map(lambda x: x, lambda x: x).collect()
    run(env)
    assert sorted(h.result) == list(range(200))


def test_two_input_operators_snapshot_and_restore_plain_state():
    from pyflowbuf.operators import basic as ops
    from pyflowbuf.time import process

    keyed = process.KeyedCoProcess("j", lambda r: r[0], lambda r: r[0], order_fn, payment_fn)
    keyed.open(0, 1)
    assert keyed.process_input([(1, 10), (2, 20)], 0) == []
    assert keyed.process_input([(1, 11)], 1) == [(1, 10, 11)]
    snap = keyed.snapshot_state()
    assert snap == {1: {"amount": 10, "paid": 11}, 2: {"amount": 20}}
    snap[2]["amount"] = 99                   # a snapshot is a copy
    fresh = process.KeyedCoProcess("j", lambda r: r[0], lambda r: r[0], order_fn, payment_fn)
    fresh.restore_state(keyed.snapshot_state())
    assert fresh.process_input([(2, 21)], 1) == [(2, 20, 21)]

    plain = process.CoProcess("c", lambda x, st: st.setdefault("a", []).append(x), lambda x, st: [len(st["a"])])
    plain.process_input([1, 2, 3], 0)
    assert plain.process_input([9], 1) == [3]
    other = process.CoProcess("c", plain.fns[0], plain.fns[1])
    other.restore_state(plain.snapshot_state())
    assert other.process_input([9], 1) == [3]
    assert ops.CoMap("m", abs, str).snapshot_state() is None
    with pytest.raises(TypeError, match="two inputs"):
        ops.CoMap("m", abs, str).process_batch([1])


# --------------------------------------------------------------------------- errors


def test_declaration_errors():
    env, other = fb.Environment(), fb.Environment()
    a = env.from_sequence(0, 10)
    b = other.from_sequence(0, 10)
    with pytest.raises(ConfigurationError, match="different Environments"):
        a.union(b)
    with pytest.raises(ConfigurationError, match="different Environments"):
        a.connect(b)
    with pytest.raises(TypeError, match="union takes Streams, got list"):
        a.union([a])
    with pytest.raises(TypeError, match="connect takes Streams"):
        a.connect(42)
    c = a.connect(env.from_sequence(0, 5))
    with pytest.raises(TypeError, match="fn2"):
        c.process(lambda x, s: None, "not callable")
    with pytest.raises(TypeError, match="fn1"):
        c.map(None, abs)
    with pytest.raises(ConfigurationError, match="parallelism"):
        c.map(abs, abs, parallelism=0)
    with pytest.raises(ConfigurationError, match="parallelism"):
        a.union(a, parallelism=-1)
    with pytest.raises(ConfigurationError, match="kind="):
        c.process(lambda x, s: None, lambda x, s: None, kind="no such kind")
    keyed = a.key_by(lambda x: x)
    with pytest.raises(ConfigurationError, match="first connected stream is keyed and the second is not"):
        keyed.connect(a).process(lambda k, x, s: None, lambda x, s: None)
    with pytest.raises(ConfigurationError, match="second connected stream is keyed"):
        a.connect(keyed).process(lambda x, s: None, lambda k, x, s: None)
    assert len(other.nodes) == 1 and len(env.nodes) == 2  # refused declarations added nothing


def test_forward_into_a_union_needs_equal_parallelism():
    env = fb.Environment(parallelism=2)
    a = env.from_sequence(0, 10, parallelism=1)
    a.forward().union(env.from_sequence(0, 10)).collect()
    with pytest.raises(ValueError, match="forward partitioning"):
        env.execute(timeout=30)


@CHAINING
@pytest.mark.parametrize("side", [0, 1])
def test_failure_in_either_function_fails_the_job_cleanly(chaining, side):
    def boom(key, x, state):
        if x == 777:
            raise KeyError("boom")
        return [x]

    def ok(key, x, state):
        return [x]

    fns = (boom, ok) if side == 0 else (ok, boom)
    env = fb.Environment(parallelism=2, chaining=chaining)
    a = env.from_sequence(0, 20_000).key_by(lambda x: x % 5)
    b = env.from_sequence(0, 20_000).key_by(lambda x: x % 5)
    a.connect(b).process(*fns, name="co_boom").map(lambda x: x).collect()
    with pytest.raises(JobFailedError, match="co_boom") as ei:
        env.execute(timeout=60)
    assert "KeyError" in str(ei.value) and "boom" in str(ei.value)
    job = env.last_execution
    assert all(t.state in ("FINISHED", "FAILED", "CANCELED") for t in job.tasks)
    assert_clean(env)


def test_non_iterable_result_of_co_process_is_a_record_type_error():
    env = fb.Environment()
    a = env.from_sequence(0, 10)
    a.connect(a).process(lambda x, s: "abc", lambda x, s: None, name="strs").collect()
    with pytest.raises(JobFailedError, match="RecordTypeError.*strs"):
        env.execute(timeout=30)
    assert_clean(env)


@pytest.mark.parametrize("waiting", [True, False], ids=["idle", "flowing"])
def test_cancel_stops_a_union(waiting):
    """Idle: the union task parks on its inputs' shared Notifier, and cancel
    must wake it there; flowing: it is busy reading both inputs."""
    env = fb.Environment(parallelism=2, segment_size=2048)
    rate = 50 if waiting else None
    a = env.from_sequence(0, None, rate_limit=rate)
    b = env.from_sequence(0, None, rate_limit=rate).map(lambda x: -x)
    a.union(b).key_by(lambda x: x % 3).reduce(lambda x, y: y).sink(lambda x: None)
    job = env.execute_async()
    time.sleep(0.5)
    assert not job.done
    t0 = time.monotonic()
    job.cancel()
    job.join(20)                     # a cancelled job ends without an error
    assert time.monotonic() - t0 < 10
    assert all(t.state == "CANCELED" for t in job.tasks), [(t.name, t.state) for t in job.tasks]
    assert_clean(env)


def test_metrics_of_a_union_task():
    env = fb.Environment(parallelism=1, chaining=False)
    a = env.from_sequence(0, 50_000)
    b = env.from_sequence(0, 30_000)
    a.union(b, name="u").sink(lambda batch: None, batched=True)
    run(env)
    m = env.metrics()
    u = [v for k, v in m.items() if v["vertex"] == "u"]
    assert len(u) == 1
    assert u[0]["records_in"] == 80_000
    assert u[0]["bytes_in"] >= 80_000 * 8


# --------------------------------------------------------------------------- property


@st.composite
def two_input_jobs(draw):
    inputs = []
    for _ in range(draw(st.integers(2, 3))):
        p = draw(st.integers(1, 3))
        lo = draw(st.integers(-50, 50))
        n = draw(st.integers(0, 300))
        part = draw(st.sampled_from(["default", "rebalance", "key_by", "broadcast", "forward"]))
        inputs.append((p, lo, n, part))
    op = draw(st.sampled_from(["union", "comap", "keyed_process", "process"]))
    if op != "union":
        inputs = inputs[:2]
    p = draw(st.integers(1, 3))
    chaining = draw(st.booleans())
    return inputs, op, p, chaining


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(job=two_input_jobs())
def test_random_union_and_connect_jobs_match_a_reference(job):
    inputs, op, p, chaining = job
    env = fb.Environment(parallelism=p, chaining=chaining, segment_size=1024)
    key = lambda x: x % 7  # noqa: E731
    streams, data = [], []
    for sp, lo, n, part in inputs:
        s = env.from_sequence(lo, lo + n, parallelism=sp)
        copies = 1
        if op == "keyed_process":
            part = "key_by"        # a keyed connect needs both inputs keyed
        elif part == "key_by" and op == "process":
            part = "default"       # and an unkeyed one neither
        if part == "rebalance":
            s = s.rebalance()
        elif part == "key_by":
            s = s.key_by(key)
        elif part == "broadcast":
            s, copies = s.broadcast(), p
        elif part == "forward" and sp == p:
            s = s.forward()
        streams.append(s)
        data.append(list(range(lo, lo + n)) * copies)
    if op == "union":
        h = streams[0].union(*streams[1:]).map(lambda x: x * 3 + 1).collect(parallelism=1)
        want = counts(x * 3 + 1 for d in data for x in d)
    elif op == "comap":
        h = streams[0].connect(streams[1]).map(lambda x: (0, x), lambda x: (1, -x)).collect()
        want = counts([(0, x) for x in data[0]] + [(1, -x) for x in data[1]])
    elif op == "keyed_process":
        def tick(k, x, state):
            state["n"] = state.get("n", 0) + 1
            return [(k, state["n"])]
        h = streams[0].connect(streams[1]).process(tick, tick).collect()
        # each record bumps its key's one counter, whichever input it came by:
        # key k's outputs are 1..n_k in any order
        per_key = counts(key(x) for d in data for x in d)
        want = counts((k, i) for k, n in per_key.items() for i in range(1, n + 1))
    else:
        def seen(tag):
            def fn(x, state):
                state[tag] = state.get(tag, 0) + 1
                return [(tag, x)]
            return fn
        h = streams[0].connect(streams[1]).process(seen("a"), seen("b")).collect()
        want = counts([("a", x) for x in data[0]] + [("b", x) for x in data[1]])
    run(env)
    assert counts(h.result) == want


# --------------------------------------------------------------------------- MultiInput


class _Producer:
    def __init__(self, nbp, nch=1, kind="int64"):
        self.queues = [BufferQueue(nbp) for _ in range(nch)]
        self.pool = nbp.create_pool(0, 4 * nch)
        self.writer = RecordWriter(self.pool, self.queues, kind=kind)


def _multi(nbp, producers, kinds=("int64", "int64")):
    notifier = Notifier()
    sides = [InputSide(InputGate(pr.queues, notifier), EdgeKind(k), 1 << 20, [pr.pool])
             for pr, k in zip(producers, kinds)]
    return MultiInput(sides)


def _drain(mi, max_records=100):
    got = []
    while True:
        i, batch = mi.read(max_records, 0)
        if not batch:
            ev = mi.take_event()
            if ev is None:
                return got
            got.append(("event", ev[0], ev[1][1], ev[1][2]))
            continue
        got.append((i, batch))


def test_multi_input_keeps_events_in_place():
    nbp = NetworkBufferPool(64, 1024)
    p0, p1 = _Producer(nbp), _Producer(nbp, kind="str")
    mi = _multi(nbp, [p0, p1], ("int64", "str"))
    p0.writer.write_batch(list(range(10)))
    p0.writer.flush()
    p1.writer.write_batch(["a", "b"])
    p1.writer.broadcast_event(BARRIER, aux=7)
    p1.writer.write_batch(["c"])
    p1.writer.flush()
    # input 1 stops at its barrier: nothing behind it is read, and no other
    # input either, until the task took the event
    assert _drain(mi) == [(0, list(range(10))), (1, ["a", "b"]), ("event", 1, BARRIER, 7), (1, ["c"])]
    p0.writer.broadcast_event(BARRIER, aux=8)
    p0.writer.write_batch([10])
    p0.writer.flush()
    assert mi.read(100, 0) == (0, [])
    assert mi.read(100, 0) == (0, [])            # still there until taken
    assert mi.take_event() == (0, (0, BARRIER, 8, 0))
    assert mi.read(100, 0) == (0, [10])
    assert not mi.finished
    p0.writer.end_input()
    p1.writer.end_input()
    assert mi.read(100, 0) == (-1, [])
    assert mi.finished
    assert mi.bytes_in > 0
    mi.release()


def test_multi_input_takes_the_inputs_in_turn():
    nbp = NetworkBufferPool(64, 1024)
    producers = [_Producer(nbp) for _ in range(3)]
    notifier = Notifier()
    mi = MultiInput([InputSide(InputGate(pr.queues, notifier), EdgeKind("int64"), 1 << 20, [pr.pool])
                     for pr in producers])
    for k, pr in enumerate(producers):
        pr.writer.write_batch([k] * 100)
        pr.writer.flush()
    got = _drain(mi, max_records=10)
    # a busy input does not starve the others: 10 records of each in turn
    assert [i for i, _ in got] == [0, 1, 2] * 10
    assert all(batch == [i] * 10 for i, batch in got)
    mi.release()


def test_multi_input_wakes_on_a_push_to_any_input_and_on_a_mail():
    nbp = NetworkBufferPool(64, 1024)
    p0, p1 = _Producer(nbp), _Producer(nbp)
    mi = _multi(nbp, [p0, p1])

    def later():
        time.sleep(0.2)
        p1.writer.write_batch([42])
        p1.writer.flush()
    t = threading.Thread(target=later)
    t.start()
    t0 = time.monotonic()
    i, batch = mi.read(10, 5.0)
    while not batch and time.monotonic() - t0 < 5:
        i, batch = mi.read(10, 5.0)
    t.join()
    assert (i, batch) == (1, [42])
    assert time.monotonic() - t0 < 2.5
    assert mi.idle_ns > 0
    # a notify with nothing to read (a mail) ends the wait early, empty
    threading.Timer(0.1, mi.notifier.notify).start()
    t0 = time.monotonic()
    assert mi.read(10, 5.0) == (-1, [])
    assert time.monotonic() - t0 < 2.5
    assert mi.read(10, 0.05) == (-1, [])     # a timeout
    mi.release()


def test_multi_input_block_resume_channel_finished_and_cancel():
    nbp = NetworkBufferPool(64, 1024)
    p0, p1 = _Producer(nbp, nch=2), _Producer(nbp)
    mi = _multi(nbp, [p0, p1])
    assert mi.num_inputs == 2 and mi.sides[0].num_channels == 2
    mi.block(0, 1)
    p0.writer.write_batch([5], channel=1)
    p0.writer.flush()
    assert mi.read(10, 0) == (-1, [])          # blocked: not read
    mi.resume(0, 1)
    assert mi.read(10, 0) == (0, [5])
    assert not mi.channel_finished(0, 0)
    p0.writer.end_input()
    assert mi.read(10, 0) == (-1, [])
    assert mi.channel_finished(0, 0) and mi.channel_finished(0, 1) and not mi.channel_finished(1, 0)
    assert not mi.finished
    threading.Timer(0.1, mi.cancel).start()
    with pytest.raises(errors.CancelledError):
        for _ in range(100):
            mi.read(10, 5.0)
    mi.release()
    assert mi.channel_finished(0, 1)             # still answers after release


def test_multi_input_needs_one_notifier():
    nbp = NetworkBufferPool(16, 1024)
    p0, p1 = _Producer(nbp), _Producer(nbp)
    sides = [InputSide(InputGate(pr.queues), EdgeKind("int64"), 1 << 20, [pr.pool]) for pr in (p0, p1)]
    with pytest.raises(ValueError, match="one Notifier"):
        MultiInput(sides)
    with pytest.raises(ValueError, match="at least two"):
        MultiInput(sides[:1])


def test_record_reader_channel_finished_and_num_channels():
    nbp = NetworkBufferPool(16, 1024)
    pr = _Producer(nbp, nch=3)
    r = RecordReader(InputGate(pr.queues), kind="int64")
    assert r.num_channels == 3
    pr.queues[1].push_event(0)                   # end-of-partition on channel 1 only
    assert r.read_batch(10, timeout=0) == []
    assert [r.channel_finished(c) for c in range(3)] == [False, True, False]
    with pytest.raises(IndexError):
        r.channel_finished(3)
    with pytest.raises(IndexError):
        r.channel_finished(-1)


# --------------------------------------------------------------------------- workers


def _no_children(timeout: float = 10.0) -> bool:
    return worker_processes_left(timeout) == []


@pytest.mark.skipif(not HAS_FORK, reason="needs fork")
def test_union_across_workers():
    env = fb.Environment(workers=2, parallelism=2)
    a = env.from_sequence(0, 20_000, parallelism=2)
    b = env.from_collection([f"{i}" for i in range(5000)]).map(int)   # inferred kind, in-band
    c = env.from_sequence(50_000, 60_000, parallelism=2).key_by(lambda x: x % 13)
    h = a.union(b.rebalance(), c).map(lambda x: x + 1).collect(parallelism=1)
    env.execute(timeout=90)
    want = [x + 1 for x in list(range(20_000)) + list(range(5000)) + list(range(50_000, 60_000))]
    assert counts(h.result) == counts(want)
    assert _no_children()


@pytest.mark.skipif(not HAS_FORK, reason="needs fork")
def test_keyed_connect_across_workers():
    n = 4000
    orders = [(k, k * 10) for k in range(n)]
    env = fb.Environment(workers=2, parallelism=2)
    o = env.from_collection(orders)
    pay = env.from_sequence(0, n, 3, parallelism=2).map(lambda k: (k, k * 10 + 1))
    joined = (o.key_by(lambda r: r[0])
               .connect(pay.key_by(lambda r: r[0]))
               .process(order_fn, payment_fn)
               .collect(parallelism=1))
    env.execute(timeout=90)
    assert counts(joined.result) == join_reference(orders, [(k, k * 10 + 1) for k in range(0, n, 3)])
    assert _no_children()


@pytest.mark.skipif(not HAS_FORK, reason="needs fork")
def test_connect_to_iterator_across_workers():
    env = fb.Environment(workers=2, parallelism=2)
    a = env.from_sequence(0, 3000)
    b = env.from_collection([f"s{i}" for i in range(1000)])
    it = a.connect(b).map(lambda x: -x - 1, lambda s: int(s[1:])).to_iterator()
    got = list(env.execute_iter(it))
    assert counts(got) == counts([-x - 1 for x in range(3000)] + list(range(1000)))
    assert _no_children()
