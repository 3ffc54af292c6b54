"""Buffer debloating, without a job: the formula against a reference written
from the issue's description, the announce decision, the output pool cap, the
writer's buffer cap, the arena giving pages back, and NewBufferSize reaching
the producer's queue over TCP."""
import math
import time

import pytest
from hypothesis import given, strategies as st

from pyflowbuf import Environment
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.serde import RecordReader, RecordWriter
from pyflowbuf.errors import ConfigurationError
from pyflowbuf.exchange.debloat import BufferDebloater, DebloatSettings, output_pool_cap

SEG = 32 * 1024


class Reference:
    """The issue's description, literally: throughput = bytes / busy time;
    desired = throughput * target; sample = desired / buffers, at most twice
    the last value; EMA with alpha = 2 / (samples + 1); clamp to [min, max];
    announce on a change >= threshold of the last announced size or at a bound."""

    def __init__(self, target=1.0, samples=20, threshold=0.25, lo=256, hi=SEG):
        self.target, self.alpha, self.threshold, self.lo, self.hi = target, 2 / (samples + 1), threshold, lo, hi
        self.value = float(hi)
        self.announced = hi
        self.throughput = 0.0

    def step(self, nbytes, busy_s, buffers):
        if busy_s > 0:
            self.throughput = nbytes / busy_s
        elif nbytes == 0:
            return None
        wanted = self.throughput * self.target / max(buffers, 1)
        if wanted > 2 * self.value:
            wanted = 2 * self.value
        self.value = self.value + self.alpha * (wanted - self.value)
        self.value = max(self.lo, min(self.hi, self.value))
        size = round(self.value)
        if size == self.announced:
            return None
        if size in (self.lo, self.hi) or abs(size - self.announced) >= self.threshold * self.announced:
            self.announced = size
            return size
        return None


def config(**kw):
    return DebloatSettings(**{"target": 1.0, "period": 0.2, "samples": 20, "threshold": 0.25,
                            "min_size": 256, "max_size": SEG, **kw})


measurements = st.lists(st.tuples(st.integers(0, 50_000_000), st.floats(0, 0.5), st.integers(0, 200)),
                        min_size=1, max_size=80)


@given(measurements, st.floats(0.05, 5), st.integers(1, 50), st.floats(0, 1), st.sampled_from([64, 256, 1024]))
def test_matches_the_reference(steps, target, samples, threshold, lo):
    d = BufferDebloater(config(target=target, samples=samples, threshold=threshold, min_size=lo))
    ref = Reference(target, samples, threshold, lo, SEG)
    for nbytes, busy, buffers in steps:
        assert d.update(nbytes, busy, buffers) == ref.step(nbytes, busy, buffers)
        assert d.announced == ref.announced
        assert lo <= d.size <= SEG


def test_throughput_step_down_then_up():
    d = BufferDebloater(config())
    # 8 buffers queued, 64 KB/s: the desired total is 64 KB, 8 KB a buffer
    sizes = [d.update(64_000 // 5, 0.2, 8) for _ in range(100)]
    assert d.size == pytest.approx(8000, rel=0.01)
    announced = [s for s in sizes if s is not None]
    assert announced and announced == sorted(announced, reverse=True)
    # the rate drops 16x: the size follows down to 500 B
    for _ in range(100):
        d.update(4_000 // 5, 0.2, 8)
    assert d.size == pytest.approx(500, rel=0.01)
    # and back up
    for _ in range(150):
        d.update(64_000 // 5, 0.2, 8)
    assert d.size == pytest.approx(8000, rel=0.01)


def test_growth_is_capped_at_twice_the_last_value():
    d = BufferDebloater(config(), initial_size=1000)
    alpha = 2 / 21
    d.update(10**12, 1.0, 1)        # wants far more than a segment
    # the sample is capped at 2000: one step moves alpha * (2000 - 1000)
    assert d.size == round(1000 + alpha * 1000)


def test_threshold_holds_back_small_changes():
    d = BufferDebloater(config(threshold=0.25))
    assert d.announced == SEG
    got = []
    for _ in range(3):
        got.append(d.update(int(0.7 * SEG), 1.0, 1))    # wants 70 % of a segment
    # 32768 -> 32003 -> 31311 -> 30684: all under 25 % of 32768 away
    assert got == [None, None, None] and d.announced == SEG and d.size < SEG
    for _ in range(20):
        if d.update(int(0.7 * SEG), 1.0, 1) is not None:
            break
    assert abs(d.announced - SEG) >= 0.25 * SEG


def test_clamp_and_bounds_are_announced():
    d = BufferDebloater(config(threshold=0.99))     # only a bound gets through
    last = None
    for _ in range(300):
        last = d.update(0, 1.0, 10) or last         # busy and no data: throughput 0
    assert d.size == 256 and last == 256 and d.announced == 256
    for _ in range(300):
        last = d.update(10**9, 1.0, 1) or last
    assert d.size == SEG and last == SEG


def test_idle_period_changes_nothing_and_time_to_consume():
    d = BufferDebloater(config())
    assert d.update(0, 0.0, 0) is None and d.size == SEG
    d.update(1_000_000, 0.5, 4)
    assert d.throughput == 2_000_000
    assert d.time_to_consume == pytest.approx(d.size * 4 / 2_000_000)
    with pytest.raises(ValueError):
        d.update(-1, 0.1, 1)


@given(st.floats(2_000, 5_000_000), st.integers(2, 64), st.floats(0.1, 3))
def test_inflight_converges_to_throughput_times_target(rate, buffers, target):
    """Steady backpressure: ``buffers`` buffers stay queued and the gate
    delivers ``rate`` B/s. The in-flight bytes (size * buffers) settle at
    rate * target, or at the bound the clamp allows."""
    d = BufferDebloater(config(target=target))
    for _ in range(400):
        d.update(int(rate * 0.2), 0.2, buffers)
    want = min(max(rate * target / buffers, 256), SEG) * buffers
    assert d.size * buffers == pytest.approx(want, rel=0.02, abs=buffers)


@given(st.floats(2_000, 50_000_000), st.integers(1, 8), st.integers(0, 4), st.integers(0, 200), st.floats(0.2, 2))
def test_pool_cap_with_debloater_converges(rate, nsub, lo_extra, floating, target):
    """The cap and the debloater together: under backpressure every segment
    under the cap is queued; in-flight bytes still settle at about rate *
    target when the pool allows it, and the pool never leaves [min, max]."""
    lo = nsub + lo_extra
    hi = lo + floating
    d = BufferDebloater(config(target=target))
    cap = hi
    for _ in range(400):
        d.update(int(rate * 0.2), 0.2, cap)
        cap = output_pool_cap(lo, hi, nsub, SEG, [(d.announced, d.desired_bytes / nsub)] * nsub)
        assert lo <= cap <= hi
    want = rate * target
    if 256 * cap < 0.8 * want and want < 0.8 * SEG * cap:      # no clamp binds
        assert cap * d.size == pytest.approx(want, rel=0.05)
    if math.ceil(want / SEG) < floating:
        # the wanted bytes fill fewer segments than the floating part: the
        # rest was given back (the minimum is kept whatever the need)
        assert cap < hi or hi <= max(lo + 1, nsub + 1)


@given(st.integers(0, 64), st.integers(1, 16), st.integers(0, 300),
       st.lists(st.tuples(st.integers(0, 2 * SEG), st.integers(0, 10**9)), min_size=1, max_size=16))
def test_pool_cap_never_below_the_minimum(lo, nsub, floating, chans):
    hi = lo + floating
    cap = output_pool_cap(lo, hi, nsub, SEG, chans)
    assert lo <= cap <= max(hi, lo)
    if hi >= nsub + 1:
        assert cap >= nsub + 1
    if all(desired >= hi * SEG for _, desired in chans):
        assert cap == hi


def test_pool_cap_follows_desired_bytes_at_once():
    # 4 subpartitions, (5, 16): 11 floating segments
    assert output_pool_cap(5, 16, 4, SEG, [(256, 1000)] * 4) == 6
    assert output_pool_cap(5, 16, 4, SEG, [(256, 3 * SEG)] * 4) == 16
    # unknown desired (remote consumer): the floating part scales with the size
    assert output_pool_cap(5, 16, 4, SEG, [(SEG // 2, 0)] * 4) == 5 + math.ceil(11 / 2)
    assert output_pool_cap(5, 16, 4, SEG, [(0, 0)] * 4) == 16


@given(st.integers(1, 4096), st.lists(st.integers(0, 3 * SEG), min_size=1, max_size=40))
def test_records_larger_than_the_buffer_size_go_through(size, lengths):
    net = NetworkBufferPool(64)
    # one thread writes and reads: a record of up to 3 segments, written while
    # up to 2 buffers wait queued and one is being filled, needs room for 6
    pool = net.create_pool(2, 8)
    q = BufferQueue(net)
    q.buffer_size = size
    gate = InputGate([q])
    w = RecordWriter(pool, [q], request_timeout=10)
    r = RecordReader(gate)
    recs = [bytes([i % 251]) * n for i, n in enumerate(lengths)]
    got = []
    for rec in recs:
        w.write(rec)
        while q.backlog >= 2:          # keep reading so the writer never waits long
            got += [bytes(x) for x in r.read_batch(100, timeout=0)]
    w.end_input()
    while not r.finished:
        got += [bytes(x) for x in r.read_batch(100, timeout=1)]
    assert got == recs
    del got, r
    assert pool.in_use == 0


def test_writer_ships_buffers_of_the_debloated_size():
    net = NetworkBufferPool(64)
    pool = net.create_pool(4, 64)
    q = BufferQueue(net)
    w = RecordWriter(pool, [q], kind="int64")
    q.buffer_size = 1200          # 100 records of 12 B per buffer
    w.write_batch(list(range(1000)))
    w.flush()
    sizes = []
    while True:
        b = q.pop_buffer()
        if b is None:
            break
        sizes.append(len(b))
        b.release()
    assert sizes == [1200] * 10
    q.buffer_size = 0             # back to whole segments
    w.write_batch(list(range(3000)))
    w.flush()
    b = q.pop_buffer()
    assert len(b) == SEG                     # records span whole segments again
    b.release()


def test_arena_gives_pages_back_and_takes_them_again():
    net = NetworkBufferPool(512)      # 16 MiB
    pool = net.create_pool(1, 512)
    bufs = [pool.request() for _ in range(512)]
    for b in bufs:
        b.write(b"x" * SEG)
    full = net.resident_bytes
    assert full >= 512 * SEG
    for b in bufs:
        b.recycle()
    released = net.release_memory(4096)
    assert released == 511 * (SEG - 4096) or released == 512 * (SEG - 4096)
    assert net.resident_bytes <= full - 400 * (SEG - 4096)
    assert net.available_segments == 512 and net.unreserved_segments == 511
    # the memory comes back as soon as something writes it
    bufs = [pool.request() for _ in range(512)]
    for b in bufs:
        b.write(b"y" * SEG)
        assert bytes(b)[-1:] == b"y"
    assert net.resident_bytes >= full - SEG
    for b in bufs:
        b.recycle()
    assert net.release_memory(SEG) == 0           # nothing past a whole segment
    with pytest.raises(ValueError):
        net.release_memory(-1)


def test_release_skips_segments_in_use_and_reserved():
    net = NetworkBufferPool(8)
    pool = net.create_pool(4, 8)
    bufs = [pool.request() for _ in range(6)]
    for b in bufs:
        b.write(b"z" * SEG)
    released = net.release_memory(0)
    # 2 free segments are unreserved (the pool's min of 4 is all in use)
    assert released == 2 * SEG
    for b in bufs:
        assert bytes(b) == b"z" * SEG               # in-use data untouched
        b.recycle()


@pytest.mark.parametrize("kw, name", [
    (dict(debloat="yes"), "debloat"),
    (dict(debloat_target=0), "debloat_target"),
    (dict(debloat_period=-1), "debloat_period"),
    (dict(debloat_period=float("nan")), "debloat_period"),
    (dict(debloat_samples=0), "debloat_samples"),
    (dict(debloat_samples=2.5), "debloat_samples"),
    (dict(debloat_threshold=1.5), "debloat_threshold"),
    (dict(min_buffer_size=0), "min_buffer_size"),
    (dict(min_buffer_size=64 * 1024), "min_buffer_size"),
])
def test_bad_settings_name_the_parameter(kw, name):
    with pytest.raises(ConfigurationError, match=name):
        Environment(**kw)


def test_defaults_are_flinks():
    env = Environment()
    assert (env.debloat, env.debloat_target, env.debloat_period, env.debloat_samples,
            env.debloat_threshold, env.min_buffer_size) == (False, 1.0, 0.2, 20, 0.25, 256)
    c = DebloatSettings.from_env(Environment(debloat=True))
    assert c.alpha == pytest.approx(2 / 21) and c.max_size == SEG


def test_new_buffer_size_reaches_the_producers_queue_over_tcp():
    from pyflowbuf.net import ConnectionManager, NetworkServer, new_secret

    secret = new_secret()
    net = NetworkBufferPool(128)
    srv = NetworkServer(secret)
    srv.start()
    mgr = ConnectionManager(secret)
    try:
        q_out = BufferQueue(net)
        pool = net.create_pool(4, 4)
        srv.export("p", 0, q_out, kind="int64")
        w = RecordWriter(pool, [q_out], kind="int64")
        excl, fl = mgr.create_input_pools(net, 1, 2, 8)
        q_in = BufferQueue(net)
        ch = mgr.create_channel(srv.address, "p", 0, q_in, excl[0], fl, kind="int64")
        gate = InputGate([q_in])
        ch.attach_gate(gate)
        reader = RecordReader(gate, kind="int64")
        w.write_batch([1, 2, 3])
        w.flush()
        deadline = time.monotonic() + 10
        got = []
        while len(got) < 3:
            got += reader.read_batch(10, timeout=0.1)
            assert time.monotonic() < deadline
        ch.announce_buffer_size(600)
        while q_out.buffer_size != 600:
            time.sleep(0.01)
            assert time.monotonic() < deadline
        w.write_batch(list(range(200)))     # 2400 B: buffers of 600 B cross the wire
        w.end_input()
        while not reader.finished:
            got += reader.read_batch(1000, timeout=0.5)
            assert time.monotonic() < deadline
        assert got == [1, 2, 3] + list(range(200))
        assert reader.buffers_in >= 1 + 4
    finally:
        mgr.close()
        srv.close()


def test_first_measurements_seed_the_average():
    """A gate that starts at the deployment's small size takes its first
    measurements as its average (the largest of the first three that
    measured a throughput): 8 KB a buffer after one period. Before, the
    sample was capped at twice the start and averaged in (256 B -> 280 B),
    and the size took some 10 s to reach what the job needed."""
    d = BufferDebloater(config(), initial_size=256, seed=True)
    assert d.announced == 256
    assert d.update(64_000 // 5, 0.2, 8) == 8000
    assert d.update(128_000 // 5, 0.2, 8) == 16000      # a start-up period measured too little
    assert d.update(64_000 // 5, 0.2, 8) is None and d.size == 16000
    # then the usual EMA
    d.update(64_000 // 5, 0.2, 8)
    assert d.size == round(16000 + (2 / 21) * (8000 - 16000))


def test_the_seeding_periods_are_short():
    """Channels start at the smallest size until a measurement sizes them,
    so a fast job ships tiny buffers until the first tick: the first
    ``SEEDS`` ticks come after a quarter period, then one a period. Counted:
    the timer's waits. Before, the first came after a whole period, and a
    600 k-record job shipped 8.5 k buffers of 256 B (222 without debloating)
    and ran at half speed (debloat_throughput_ratio 0.42-0.66)."""
    from pyflowbuf.exchange.debloat import DebloatTimer

    class Job:
        edges = ()

    waits = []

    class Clock:
        def wait(self, seconds):
            waits.append(seconds)
            return len(waits) > 5          # (stops the loop)

        def set(self):
            pass

    timer = DebloatTimer(Job(), config(period=0.2))
    timer._stop_event = Clock()
    timer.tick = lambda: setattr(timer, "ticks", timer.ticks + 1)
    timer.run()
    assert waits == pytest.approx([0.05] * BufferDebloater.SEEDS + [0.2] * (6 - BufferDebloater.SEEDS))


def test_a_period_without_a_throughput_does_not_seed():
    """Idle, or records with no busy time measured (a start-up trickle):
    no throughput is known, and a seed of 0 would start every buffer at the
    minimum, to grow back by 10 % a period (a fast job ran at half speed)."""
    d = BufferDebloater(config(), initial_size=256, seed=True)
    assert d.update(0, 0.0, 0) is None and d.size == 256
    assert d.update(743, 0.0, 0) is None and d.size == 256
    assert d.update(64_000 // 5, 0.2, 8) == 8000
