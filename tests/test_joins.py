"""Joins on event time against plain-Python references: the window join
(``a.join(b).where(ka).equal_to(kb).window(...).apply(fn)``) and the interval
join (``a.key_by(ka).interval_join(b.key_by(kb)).between(lo, hi).process(fn)``),
over random out-of-order streams, parallelism 1-3 and two worker processes."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.windows import Sliding, Tumbling


def side(rnd, n, keys, disorder, step=0.25, shift=0.0):
    return [(rnd.randrange(keys), i * step + shift - rnd.randint(0, disorder) * step) for i in range(n)]


def ref_window_join(left, right, size, slide=None):
    def windows(t):
        if slide is None:
            s = math.floor(t / size) * size
            return [(s, s + size)]
        out, k = [], math.floor(t / slide)
        while k * slide > t - size:
            out.append((k * slide, k * slide + size))
            k -= 1
        return out
    out = []
    for kl, tl in left:
        for kr, tr in right:
            if kl == kr:
                for w in set(windows(tl)) & set(windows(tr)):
                    out.append((kl, tl, tr))
    return sorted(out)


def ref_interval_join(left, right, lo, hi):
    return sorted((kl, tl, tr) for kl, tl in left for kr, tr in right if kl == kr and tl + lo <= tr <= tl + hi)


def both(env, left, right, ooo):
    a = env.from_iterable(left, name="left").assign_timestamps(lambda r: r[1], out_of_orderness=ooo)
    b = env.from_iterable(right, name="right").assign_timestamps(lambda r: r[1], out_of_orderness=ooo)
    return a, b


@settings(max_examples=6)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.booleans())
def test_window_join_matches_reference(seed, parallelism, sliding):
    rnd = random.Random(seed)
    left, right = side(rnd, rnd.randint(0, 120), 4, 3), side(rnd, rnd.randint(0, 120), 4, 3, shift=0.1)
    size, slide = (2.0, 0.5) if sliding else (1.0, None)
    env = fb.Environment(parallelism=parallelism)
    a, b = both(env, left, right, 1.0)
    out = (a.join(b).where(lambda r: r[0]).equal_to(lambda r: r[0])
             .window(Sliding(size, slide) if sliding else Tumbling(size))
             .apply(lambda l, r: (l[0], l[1], r[1])).collect())
    env.execute(timeout=60)
    assert sorted(out.result) == ref_window_join(left, right, size, slide)


@settings(max_examples=6)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3),
       st.tuples(st.integers(-8, 4), st.integers(0, 8)).map(lambda p: (p[0] * 0.25, (p[0] + p[1]) * 0.25)))
def test_interval_join_matches_reference(seed, parallelism, bounds):
    rnd = random.Random(seed)
    lo, hi = bounds
    left, right = side(rnd, rnd.randint(0, 150), 3, 4), side(rnd, rnd.randint(0, 150), 3, 4, shift=0.125)
    env = fb.Environment(parallelism=parallelism, max_batch=rnd.choice([1, 16, 1024]))
    a, b = both(env, left, right, 1.0)
    out = (a.key_by(lambda r: r[0]).interval_join(b.key_by(lambda r: r[0])).between(lo, hi)
             .process(lambda l, r: [(l[0], l[1], r[1])]).collect())
    env.execute(timeout=60)
    assert sorted(out.result) == ref_interval_join(left, right, lo, hi)


def test_interval_join_keeps_state_bounded():
    """Buffered records go once the watermark passes the time they can match."""
    from pyflowbuf.windows import IntervalJoinOperator
    op = IntervalJoinOperator("j", (lambda r: r[0], lambda r: r[0]), (lambda r: r[1], lambda r: r[1]),
                              -1.0, 1.0, lambda l, r: [(l, r)])
    op.open(0, 1)
    for t in range(100):
        op.process_input([("a", float(t))], 0)
        op.process_input([("a", float(t) + 0.5)], 1)
        op.on_watermark(float(t) - 0.5)
    assert sum(len(v) for v in op.buffers[0].values()) <= 4
    assert sum(len(v) for v in op.buffers[1].values()) <= 4
    # a record below the watermark is late: dropped, counted
    assert op.process_input([("a", 0.0)], 0) == []
    assert op.late_dropped == 1


@pytest.mark.parametrize("which", ["window", "interval"])
def test_joins_across_worker_processes(which):
    rnd = random.Random(9)
    left, right = side(rnd, 200, 5, 3), side(rnd, 200, 5, 3, shift=0.1)
    env = fb.Environment(parallelism=2, workers=2)
    a, b = both(env, left, right, 1.0)
    if which == "window":
        out = (a.join(b).where(lambda r: r[0]).equal_to(lambda r: r[0]).window(Tumbling(1.0))
                 .apply(lambda l, r: (l[0], l[1], r[1])).collect())
        want = ref_window_join(left, right, 1.0)
    else:
        out = (a.key_by(lambda r: r[0]).interval_join(b.key_by(lambda r: r[0]), -0.5, 0.25)
                 .process(lambda l, r: [(l[0], l[1], r[1])]).collect())
        want = ref_interval_join(left, right, -0.5, 0.25)
    env.execute(timeout=60)
    assert sorted(out.result) == want


def test_join_configuration_errors():
    env = fb.Environment()
    a = env.from_iterable([(1, 1.0)]).assign_timestamps(lambda r: r[1])
    b = env.from_iterable([(1, 1.0)])
    with pytest.raises(errors.ConfigurationError, match="where"):
        a.join(b).equal_to(lambda r: r[0])
    with pytest.raises(errors.ConfigurationError, match="no timestamps"):
        a.join(b).where(lambda r: r[0]).equal_to(lambda r: r[0]).window(Tumbling(1)).apply(lambda l, r: 0)
    with pytest.raises(errors.ConfigurationError, match="Tumbling or Sliding"):
        a.join(a).where(lambda r: r[0]).equal_to(lambda r: r[0]).window(fb.Session(1))
    with pytest.raises(errors.ConfigurationError, match="lower"):
        a.key_by(lambda r: r[0]).interval_join(a.key_by(lambda r: r[0])).between(2, 1)
    with pytest.raises(errors.ConfigurationError, match="keyed"):
        a.key_by(lambda r: r[0]).interval_join(b)
    with pytest.raises(errors.ConfigurationError, match="between"):
        a.key_by(lambda r: r[0]).interval_join(a.key_by(lambda r: r[0])).process(lambda l, r: None)
