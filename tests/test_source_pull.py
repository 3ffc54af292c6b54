"""The source loop: its pull-size policy, its rate limit, and the number of
buffers a source ships (a deterministic count instead of a timing: a source
that flushes per pull, or whose pull never grows, ships far more buffers than
its bytes need).

The buffer counts run with a buffer timeout far longer than the job, so only
full buffers, slow pulls and the end of input ship a buffer.
"""
from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf.runtime.pull import SLOW_PULL_NS, PullPolicy
from pyflowbuf.connectors.sources import RateLimiter, payload_nbytes, rate_limiter

# buffer_timeout=600 below means "no timed flush during the test" on purpose, so
# the warning for values that look like milliseconds is expected there.
pytestmark = pytest.mark.filterwarnings("ignore::pyflowbuf.errors.UnitWarning")

N = 1_000_000
SEG = 32 * 1024
INT64_RECORD = 4 + 8        # length prefix + payload


# ---------------------------------------------------------------- PullPolicy

FAST, SLOW = 1_000, SLOW_PULL_NS + 1


def test_pull_grows_by_doubling_to_max_batch():
    p = PullPolicy(1024, 1 << 20)
    sizes = [p.size]
    for _ in range(12):
        p.observe(p.size, FAST, p.size * 12)
        sizes.append(p.size)
    assert sizes[:12] == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024]
    assert not p.slow


def test_pull_halves_after_a_slow_pull_and_flags_it():
    p = PullPolicy(1024, 1 << 20)
    for _ in range(11):
        p.observe(p.size, FAST, 0)
    assert p.size == 1024
    p.observe(1024, SLOW, 0)
    assert (p.size, p.slow) == (512, True)
    p.observe(512, FAST, 0)
    assert (p.size, p.slow) == (1024, False)


def test_pull_is_capped_by_read_ahead_bytes():
    p = PullPolicy(1024, 4 * 32 * 1024)
    p.observe(1, FAST, 1 << 20)              # one 1 MiB record (an Arrow batch)
    assert p.size == 1
    p = PullPolicy(1024, 128 * 1024)
    for _ in range(20):
        p.observe(p.size, FAST, p.size * 1000)
    assert p.size == 131                     # 128 KiB / 1000 B


def test_pull_keeps_the_last_known_record_size_when_nothing_was_written():
    p = PullPolicy(1024, 10_000)
    p.observe(1, FAST, 1000)
    for _ in range(5):
        p.observe(p.size, FAST, 0)           # e.g. records filtered out in the chain
    assert p.size == 10


def test_flush_every_record_mode_pulls_one():
    p = PullPolicy(1, 1 << 20)
    for _ in range(5):
        p.observe(1, FAST, 12)
    assert p.size == 1


@given(st.integers(1, 4096), st.integers(1, 1 << 22),
       st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 22)), max_size=60))
def test_pull_size_stays_within_bounds(max_batch, read_ahead, pulls):
    p = PullPolicy(max_batch, read_ahead)
    for slow, written in pulls:
        before = p.size
        n = p.observe(before, SLOW if slow else FAST, written)
        assert n == p.size
        assert 1 <= n <= max_batch
        assert n <= max(1, before * 2)
        if slow:
            assert n <= max(1, before // 2)
        if p.bytes_per_record:
            assert n == 1 or n * p.bytes_per_record <= read_ahead


def test_pull_policy_validates():
    with pytest.raises(ValueError, match="max_batch"):
        PullPolicy(0, 100)
    with pytest.raises(ValueError, match="read_ahead_bytes"):
        PullPolicy(10, 0)


# ---------------------------------------------------------------- RateLimiter

def test_rate_limiter_validates_its_rates():
    for bad in ("fast", True, 0, -1, float("inf"), float("nan"), [10]):
        with pytest.raises(ValueError, match="records_per_s"):
            RateLimiter(records_per_s=bad)
        with pytest.raises(ValueError, match="bytes_per_s"):
            RateLimiter(bytes_per_s=bad)
    with pytest.raises(ValueError):
        RateLimiter()


def test_rate_limit_setting_is_checked():
    assert rate_limiter(None) is None
    assert rate_limiter(100).records_per_s == 100
    rl = RateLimiter(bytes_per_s=5)
    assert rate_limiter(rl) is rl
    for bad in ("fast", -3, True, object()):
        with pytest.raises(ValueError, match="rate_limit"):
            rate_limiter(bad)


def test_rate_share_per_subtask():
    rl = RateLimiter(records_per_s=300, bytes_per_s=3000).for_subtask(3)
    assert (rl.records_per_s, rl.bytes_per_s) == (100, 1000)


def test_payload_nbytes():
    assert payload_nbytes([b"abc", "héllo", 7, 1.5, None, (b"x", "yz"), {"k": 1}]) == 3 + 6 + 8 + 8 + 8 + 3 + 9
    np = pytest.importorskip("numpy")
    assert payload_nbytes([np.zeros(10, dtype="<i8")]) == 80


def test_bytes_per_s_limits_a_job():
    """50 KB at 100 KB/s take about half a second (they went through at once)."""
    records = [b"x" * 100] * 500
    env = fb.Environment(chaining=False)
    seen = []
    (env.from_collection(records, rate_limit=RateLimiter(bytes_per_s=100_000))
        .sink(seen.extend, batched=True))
    t0 = time.monotonic()
    env.execute(60)
    took = time.monotonic() - t0
    assert len(seen) == 500
    assert took >= 0.4, f"50 KB at 100 KB/s went through in {took:.2f} s"


def test_bytes_per_s_limits_a_fully_chained_job():
    records = ["y" * 100] * 300
    env = fb.Environment()
    seen = []
    env.from_collection(records, rate_limit=RateLimiter(bytes_per_s=100_000)).map(len).sink(seen.append)
    t0 = time.monotonic()
    env.execute(60)
    assert len(seen) == 300
    assert time.monotonic() - t0 >= 0.2


def test_records_per_s_limits_a_parallel_source_in_total():
    env = fb.Environment(parallelism=2)
    out = env.from_sequence(0, 400, rate_limit=400).collect()
    t0 = time.monotonic()
    env.execute(60)
    assert sorted(out.result) == list(range(400))
    assert time.monotonic() - t0 >= 0.7     # 400 records at 400/s in total, not per subtask


# ---------------------------------------------------------------- buffer counts

def _ideal_buffers(records, record_bytes=INT64_RECORD, segment=SEG):
    return math.ceil(records * record_bytes / segment)


def _source_metrics(env, source="sequence"):
    ms = [m for name, m in env.metrics().items() if name.startswith(source)]
    assert ms, env.metrics()
    return ms


def _check(env, channels, source="sequence"):
    ms = _source_metrics(env, source)
    buffers = sum(m["buffers_out"] for m in ms)
    records = sum(m["records_out"] for m in ms)
    assert records >= N
    ideal = _ideal_buffers(records)
    # full buffers, plus per channel: the partial one at the end and a few
    # flushes of slow pulls (a preempted pull on a loaded machine)
    allowed = ideal + channels * len(ms) * 16
    assert ideal <= buffers <= allowed, (
        f"the source shipped {buffers} buffers for {records} records; their bytes fill {ideal} "
        f"(allowed {allowed}): it flushes per pull or its pull never grows")
    return buffers


def _sequence_job(env, **kw):
    return env.from_sequence(0, N, parallelism=1, **kw)


def test_source_ships_full_buffers_chaining_off():
    env = fb.Environment(chaining=False, buffer_timeout=600)
    total = [0]
    (_sequence_job(env).map(lambda x: x + 1, kind="int64")
        .sink(lambda b: total.__setitem__(0, total[0] + len(b)), batched=True))
    env.execute(120)
    assert total[0] == N
    _check(env, channels=1)
    src = [t for t in env.last_execution.tasks if t.source is not None]
    assert len(src) == 1 and src[0].pulls
    # the pull grows to max_batch: a few small pulls at the start only
    assert N / src[0].pulls >= env.max_batch / 4, f"{src[0].pulls} pulls for {N} records"


@pytest.mark.parametrize("partition", ["rebalance", "key_by"])
def test_source_ships_full_buffers_to_parallel_consumers(partition):
    env = fb.Environment(parallelism=2, chaining=False, buffer_timeout=600)
    s = _sequence_job(env)
    s = s.rebalance() if partition == "rebalance" else s.key_by(lambda x: x)
    counts = s.map(lambda x: 1, kind="int64").collect(parallelism=1)
    env.execute(120)
    assert len(counts.result) == N
    _check(env, channels=2)


@pytest.mark.slow
def test_source_ships_full_buffers_with_workers():
    env = fb.Environment(parallelism=2, workers=2, buffer_timeout=600)
    out = _sequence_job(env).rebalance().map(lambda x: x * 2, kind="int64").filter(lambda x: x < 0)
    out.collect(parallelism=1)
    env.execute(180)
    _check(env, channels=2)


def test_buffer_timeout_flushes_are_counted_not_per_record():
    """A trickling source: each record waits, the pull shrinks to one and the
    partial buffer ships at once (slow pull), so latency stays low."""
    env = fb.Environment(chaining=False, buffer_timeout=600)

    def trickle():
        for i in range(20):
            time.sleep(0.01)
            yield i

    got = []
    env.from_generator(trickle, kind="int64").sink(got.append)
    env.execute(60)
    assert got == list(range(20))
    (m,) = _source_metrics(env, "generator")
    assert 10 <= m["buffers_out"] <= 21


def test_bad_rate_limit_is_refused_when_the_source_is_declared():
    env = fb.Environment()
    for bad in ("fast", 0, -5, True):
        with pytest.raises(ValueError, match="rate_limit"):
            env.from_sequence(0, 10, rate_limit=bad)
    assert env.nodes == []
