"""Buffer debloating's target is shared by the exchanges of a path (issue 32).

An aligned barrier crosses the exchanges of a path one after another, so the
times their gates hold add up: with each gate holding the whole target (1 s),
the keyed count's four exchanges made its aligned checkpoints under
backpressure about 2 s long, and 13 s for the first one. Each gate now holds
``target / exchanges``, the exchanges of the longest path through it: every
path's gates together hold at most the target. Counted here: the share each
gate gets and the bytes it then wants in flight, no timing."""
import threading
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

import pyflowbuf as fb
from pyflowbuf.exchange.debloat import path_exchanges


def _graph(n, pairs):
    vs = [SimpleNamespace(id=i) for i in range(n)]
    inputs = {}
    edges = []
    for a, b in pairs:
        k = inputs.get(b, 0)
        inputs[b] = k + 1
        edges.append(SimpleNamespace(source=vs[a], target=vs[b], input_index=k))
    return edges


def _paths(n, edges):
    """Every source-to-sink path, as lists of edges."""
    outs = {}
    has_in = {e.target.id for e in edges}
    for e in edges:
        outs.setdefault(e.source.id, []).append(e)

    def walk(v):
        if v not in outs:
            yield []
            return
        for e in outs[v]:
            for rest in walk(e.target.id):
                yield [e] + rest
    for v in range(n):
        if v not in has_in and v in outs:
            yield from walk(v)


def test_a_chain_of_four_exchanges_gives_each_gate_a_quarter():
    edges = _graph(5, [(0, 1), (1, 2), (2, 3), (3, 4)])
    assert path_exchanges(edges) == {(1, 0): 4, (2, 0): 4, (3, 0): 4, (4, 0): 4}


def test_a_union_takes_the_longest_path_of_each_input():
    # 0 -> 1 -> 3 and 2 -> 3 (a union at 3, inputs 0 and 1), then 3 -> 4
    edges = _graph(5, [(0, 1), (1, 3), (2, 3), (3, 4)])
    got = path_exchanges(edges)
    assert got == {(1, 0): 3, (3, 0): 3, (3, 1): 2, (4, 0): 3}   # 2 -> 3 -> 4: two exchanges


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 7).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                         .filter(lambda p: p[0] < p[1]), min_size=1, max_size=12, unique=True))))
def test_every_path_holds_at_most_the_target(graph):
    """The invariant: on every source-to-sink path of a DAG, the shares of
    its gates add up to at most the whole target, and to exactly it on a
    longest path."""
    n, pairs = graph
    edges = _graph(n, pairs)
    share = path_exchanges(edges)
    paths = list(_paths(n, edges))
    longest = max(len(p) for p in paths)
    for p in paths:
        total = sum(1 / share[e.target.id, e.input_index] for e in p)
        assert total <= 1 + 1e-9
        if len(p) == longest:
            assert total == pytest.approx(1.0)


def test_the_keyed_counts_gates_want_a_quarter_of_the_target_in_flight():
    """The benchmark's job (source, map, pair, key_by + reduce, sink: four
    exchanges): the job's own debloat timer gives every gate a quarter of
    the 1 s target, so a gate measuring 60 000 bytes/s wants 15 000 bytes in
    flight (before: 60 000 at each of the four gates)."""
    env = fb.Environment(chaining=False, debloat=True, debloat_period=30)
    release = threading.Event()
    (env.from_sequence(0, None).map(lambda x: x + 1, kind="int64", name="map")
        .map(lambda x: (x % 10, 1), kind="struct", name="pair")
        .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1]), name="count")
        .sink(lambda batch: release.wait(60), batched=True, name="sink"))
    job = env.execute_async()
    try:
        timer = job._debloat_timer
        with timer.lock:
            timer.tick()          # the period (30 s) is longer than the test: this is the first
        gates = {t.vertex.name: g for t, gs, _, _ in timer._gates.values() for g in gs}
        assert sorted(gates) == ["count", "map", "pair", "sink"]
        for name, g in gates.items():
            assert g.exchanges == 4, name
            assert g.debloater.config.target == pytest.approx(0.25), name
        d = gates["sink"].debloater
        d.update(60_000, 1.0, 4)
        assert d.desired_bytes == pytest.approx(15_000)
    finally:
        release.set()
        job.cancel()
        try:
            job.join(60)
        except fb.errors.JobFailedError:
            pass


def test_one_exchange_keeps_the_whole_target():
    edges = _graph(2, [(0, 1)])
    assert path_exchanges(edges) == {(1, 0): 1}
    assert path_exchanges([]) == {}



def test_a_chain_longer_than_the_recursion_limit():
    n = 3000
    share = path_exchanges(_graph(n, [(i, i + 1) for i in range(n - 1)]))
    assert set(share.values()) == {n - 1}
