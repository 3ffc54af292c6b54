"""Buffer debloating: in-flight data sized by time, not bytes, and memory
given back.

Every ``debloat_period`` a consumer task measures each of its input gates
(on its mailbox, between batches) and a ``BufferDebloater`` turns the
measurement into a buffer size, the way Flink's BufferDebloater does:

- throughput = bytes the gate delivered / time the gate was not empty;
- buffers in use = the buffers queued over the gate's channels (at least 1);
- desired total = throughput * the gate's share of the target: the target
  divided by the exchanges on the longest source-to-sink path through the
  gate (``path_exchanges``; Flink gives every gate the whole target);
- size = EMA (alpha = 2 / (samples + 1)) of desired / buffers, the sample
  capped at twice the last value, clamped to [min_buffer_size, segment size];
- the size is announced upstream only when it moved by at least the
  threshold from the last announced one, or reached a bound.

A local channel's announcement lands in its BufferQueue (the producer's
RecordWriter caps each new buffer at it); a remote one travels as
NewBufferSize and the producer's network server sets the same field.

Beyond Flink, memory is given back: the consumer also tells each local
channel how many bytes it wants in flight (its share of the desired total),
and a per-process ``DebloatTimer`` lowers each output pool's floating
maximum to the segments those bytes need (a remote consumer's share is
estimated from its announced size). Segments above the cap go back to the
NetworkBufferPool as they are recycled, where other pools can have them, and
the arena hands the kernel the pages of free segments past the largest
announced size (``NetworkBufferPool.release_memory``), so resident memory
shrinks. A pool's minimum is never touched, and since the desired total
follows the measured throughput with no smoothing, the cap rises again in
the period after throughput does.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, replace

from pyflowbuf._core.memory import DEFAULT_SEGMENT_SIZE
from pyflowbuf.exchange.sides import MultiInput

# Free segments' pages are handed back again every this many periods while
# buffers are debloated: segments that were in use (full) at the last pass
# have come back to the free list since.
RELEASE_EVERY = 5
# A debloat mail not run after this many periods: the timer measures the
# task's gates itself.
STALE_PERIODS = 2


@dataclass(frozen=True)
class DebloatSettings:
    """What a job's debloaters run with: the Environment's ``DebloatConfig``
    (``min_size`` is its ``min_buffer_size``) and the segment size, the
    largest buffer."""

    target: float = 1.0
    period: float = 0.2
    samples: int = 20
    threshold: float = 0.25
    min_size: int = 256
    max_size: int = DEFAULT_SEGMENT_SIZE

    @property
    def alpha(self) -> float:
        return 2.0 / (self.samples + 1)

    @classmethod
    def from_env(cls, spec) -> "DebloatSettings":
        """From the job's ``JobSpec`` (any object with its settings)."""
        c = spec.debloat_config
        return cls(float(c.target), float(c.period), int(c.samples), float(c.threshold), int(c.min_buffer_size),
                   int(spec.network_config.segment_size))


class BufferDebloater:
    """The per-gate controller: plain arithmetic, no threads, no I/O.

    ``update`` takes one period's measurement and returns the size to
    announce upstream, or None when the change is below the threshold."""

    SEEDS = 3       # periods whose largest measurement starts a seeded average

    def __init__(self, config: DebloatSettings, initial_size: int | None = None, seed: bool = False):
        self.config = config
        start = config.max_size if initial_size is None else initial_size
        self._ema = float(min(max(start, config.min_size), config.max_size))
        # seed: the first measurements are the average, not samples of it
        # (a job's gates start at the deployment's small size, which says
        # nothing of what the job needs): the largest of the first SEEDS
        # periods that measured a throughput, since a period at start-up
        # (a trickle of records, a task still opening) measures too little,
        # and from a size too small the average grows by 10 % a period only
        self._seed = self.SEEDS if seed else 0
        self.size = round(self._ema)          # the last computed size
        self.announced = self.size            # the last size told upstream
        self.throughput = 0.0                 # bytes/s over the last period's busy time
        self.buffers_in_use = 1
        self.desired_bytes = 0.0
        self.time_to_consume = 0.0            # s: size * buffers in use / throughput

    def update(self, delivered_bytes: int, busy_seconds: float, buffers_in_use: int):
        if delivered_bytes < 0 or busy_seconds < 0 or buffers_in_use < 0:
            raise ValueError(f"negative measurement: {delivered_bytes} B, {busy_seconds} s, {buffers_in_use} buffers")
        c = self.config
        if busy_seconds > 0:
            self.throughput = delivered_bytes / busy_seconds
        elif delivered_bytes == 0:
            # idle the whole period: nothing is known about its throughput,
            # and shrinking on it would starve the first records of a burst
            return None
        # else (data with no busy time measured): keep the last throughput
        buffers = max(1, buffers_in_use)
        self.buffers_in_use = buffers
        self.desired_bytes = self.throughput * c.target
        if self._seed:
            if self.throughput <= 0:
                return None
            value = self.desired_bytes / buffers
            self._ema = value if self._seed == self.SEEDS else max(self._ema, value)
            self._seed -= 1
        else:
            sample = min(self.desired_bytes / buffers, 2.0 * self._ema)
            self._ema += c.alpha * (sample - self._ema)
        self._ema = min(max(self._ema, float(c.min_size)), float(c.max_size))
        self.size = size = round(self._ema)
        self.time_to_consume = size * buffers / self.throughput if self.throughput > 0 else 0.0
        last = self.announced
        if size == last:
            return None
        at_bound = size <= c.min_size or size >= c.max_size
        if not at_bound and abs(size - last) < c.threshold * last:
            return None
        self.announced = size
        return size


def output_pool_cap(lo: int, hi: int, nsub: int, segment_size: int, channels) -> int:
    """The max an output pool configured (``lo``, ``hi``) should have now.

    ``channels``: (announced buffer size, desired bytes) per subpartition
    queue, 0 meaning unknown. The floating part (hi - lo) shrinks to the
    segments the consumers' desired in-flight bytes fill; a channel whose
    consumer sent only a size (a remote one) counts its share of the
    floating segments scaled by size / segment size. Never below the
    minimum, nor below one segment per subpartition plus one floating
    segment (the writer keeps one buffer per subpartition and must not wait
    for its own consumers to pipeline)."""
    floating = hi - lo
    if floating <= 0:
        return hi
    channels = list(channels)
    n = max(1, len(channels))
    need = 0.0
    for size, desired in channels:
        if desired:
            need += desired
        elif size:
            need += floating * min(size, segment_size) / n
        else:
            need += floating * segment_size / n
    cap = min(floating, max(1, math.ceil(need / segment_size)))
    return min(hi, max(lo + cap, nsub + 1))


def path_exchanges(edges) -> dict:
    """For each input of each vertex, ``(vertex id, input index)``: the
    number of exchanges on the longest source-to-sink path through it.

    An aligned barrier crosses the exchanges of a path one after another
    (it enters a channel only once the task before it has read what was
    queued ahead of it), so the times their gates hold add up: four gates
    each holding the target made a checkpoint four targets long. A gate
    that takes ``target / exchanges`` keeps every path within the target.
    ``edges``: objects with ``source`` and ``target`` (each with an ``id``)
    and ``input_index``, the job graph's edges."""
    edges = list(edges)
    up = _longest(edges, lambda e: e.source.id, lambda e: e.target.id)
    down = _longest(edges, lambda e: e.target.id, lambda e: e.source.id)
    out: dict = {}
    for e in edges:
        n = up.get(e.source.id, 0) + 1 + down.get(e.target.id, 0)
        key = (e.target.id, e.input_index)
        out[key] = max(out.get(key, 1), n)
    return out


def _longest(edges, tail, head) -> dict:
    """Per vertex id: the most edges on a path ending there, edges going
    from ``tail(e)`` to ``head(e)`` (Kahn's order, no recursion: a job may
    have more vertices than Python's recursion limit). Vertices on a cycle
    are never ready and keep what reached them."""
    into: dict = {}
    outs: dict = {}
    for e in edges:
        into[head(e)] = into.get(head(e), 0) + 1
        into.setdefault(tail(e), 0)
        outs.setdefault(tail(e), []).append(e)
    depth = dict.fromkeys(into, 0)
    ready = [v for v, n in into.items() if n == 0]
    while ready:
        v = ready.pop()
        for e in outs.get(v, ()):
            h = head(e)
            depth[h] = max(depth[h], depth[v] + 1)
            into[h] -= 1
            if into[h] == 0:
                ready.append(h)
    return depth


class GateDebloat:
    """One input gate's debloater, fed by the consuming task's mailbox.

    ``exchanges``: how many exchanges the longest path through this gate
    crosses (``path_exchanges``); the gate holds that share of the target."""

    def __init__(self, side, config: DebloatSettings, multi=None, index: int = 0, exchanges: int = 1):
        if exchanges > 1:
            config = replace(config, target=config.target / exchanges)
        self.exchanges = exchanges
        self.side = side
        self.gate = side.gate
        self.multi = multi                       # a MultiInput's shared wait counts as idle too
        self.index = index
        self.queues = list(self.gate.channels)
        # from the size the channels were deployed with (initial_buffer_size)
        start = max((q.buffer_size for q in self.queues), default=0) or None
        self.debloater = BufferDebloater(config, start, seed=start is not None)
        remote = {id(ch.queue): ch for ch in getattr(side, "remote_channels", ())}
        self.remote = [remote.get(id(q)) for q in self.queues]
        self._records, self._bytes = self._counts()
        self._idle = self._idle_now()
        self._t = time.monotonic_ns()
        self.inflight_bytes = 0
        self.announcements = 0
        self.snapshot = self._snap()

    def _counts(self):
        r = self.side.reader
        if r is None:                      # released at the end
            return self._records, self._bytes
        return r.records_in, r.bytes_in

    def _idle_now(self) -> int:
        return self.side.idle_ns + (self.multi._wait_ns if self.multi is not None else 0)

    def tick(self):
        """Measure the period since the last tick, update the size, announce
        it (and the desired bytes) to the channels. Runs in the task thread."""
        now = time.monotonic_ns()
        gate = self.gate
        per_bytes = gate.queued_bytes_per_channel()
        inflight = sum(per_bytes)
        records, nbytes = self._counts()
        if records < self._records or nbytes < self._bytes:
            self._records = self._bytes = 0          # the side replaced its reader
        # Delivered bytes counted by records taken, at the bytes a record
        # costs in buffers: a slow consumer takes a whole buffer at once and
        # then nothing for many periods, which would read as no throughput.
        per_record = nbytes / records if records else 0.0
        delivered = int((records - self._records) * per_record) if records else nbytes - self._bytes
        idle = self._idle_now()
        busy_ns = max(0, (now - self._t) - (idle - self._idle))
        self._records, self._bytes, self._idle, self._t = records, nbytes, idle, now
        buffers = sum(gate.queued_per_channel())
        d = self.debloater
        size = d.update(delivered, busy_ns / 1e9, buffers)
        self.inflight_bytes = inflight
        share = int(d.desired_bytes / max(1, len(self.queues)))
        for q, remote in zip(self.queues, self.remote):
            if remote is None:
                q.desired_bytes = max(1, share)
            if size is not None:
                q.buffer_size = size      # a remote channel's queue: read by the release of pages
                if remote is not None and remote.active:
                    try:
                        remote.announce_buffer_size(size)
                    except Exception:     # a channel that failed reports through its own path
                        pass
        if size is not None:
            self.announcements += 1
        self.snapshot = self._snap()

    def _snap(self) -> dict:
        d = self.debloater
        pools = getattr(self.side, "producer_pools", ())
        return {
            "gate": self.index,
            "buffer_size": d.announced,
            "time_to_consume_s": round(d.time_to_consume, 4),
            "inflight_bytes": self.inflight_bytes,
            # local channels: the producers' pools; remote ones: the buffers received
            "segments_held": sum(p.in_use for p in pools) if pools else self.gate.queued_buffers,
            "throughput_bytes_per_s": round(d.throughput, 1),
            "buffers_in_use": d.buffers_in_use,
            # this gate's share of the target (the target / its path's exchanges)
            "target_s": round(d.config.target, 6),
        }


def initial_buffer_size(spec) -> int | None:
    """The buffer size a channel starts with when the job debloats (None:
    whole segments): the smallest, ``min_buffer_size``.

    Started at the segment size, every channel filled with 32 KiB buffers
    in the job's first second, and the debloater, falling about 10 % a
    period from there, took some 10 s to bring them down to what a slow
    sink needs (363 bytes): the first aligned checkpoint waited 16 s behind
    them. Started small, the channels hold little from the start, and the
    first measurement (a quarter period in: DebloatTimer) sets the size the
    job needs, larger or smaller (``BufferDebloater(seed=True)``)."""
    c = spec.debloat_config
    return int(c.min_buffer_size) if c.enabled else None


def gates_of(task, config: DebloatSettings, paths: dict | None = None) -> list:
    """GateDebloats for every input gate of ``task`` (none for a source);
    ``paths``: ``path_exchanges`` of the job's edges (None: each gate holds
    the whole target)."""
    inp = task.input
    if inp is None:
        return []
    paths = paths or {}
    vid = task.vertex.id
    if isinstance(inp, MultiInput):
        return [GateDebloat(s, config, inp, i, exchanges=paths.get((vid, i), 1)) for i, s in enumerate(inp.sides)]
    return [GateDebloat(inp, config, exchanges=paths.get((vid, 0), 1))]


class DebloatTimer(threading.Thread):
    """One per process and job: every period, posts a debloat mail to each
    task with an input (never a second one before the first ran), caps the
    output pools and gives free segments' pages back. It sleeps on an Event
    between periods."""

    def __init__(self, job, config: DebloatSettings):
        super().__init__(name="pyflowbuf: debloat", daemon=True)
        self.job = job
        self.config = config
        self._stop_event = threading.Event()
        self._gates: dict = {}        # id(task) -> (task, [GateDebloat], pending flag list)
        self._pools: dict = {}        # id(pool) -> (pool, lo, hi)
        self._keep = None             # the keep_bytes of the last page release
        self._since_release = 0
        self.released_bytes = 0
        self.ticks = 0
        self.lock = threading.Lock()  # held by a tick; the job takes it to count segments
        # each gate's share of the target: the exchanges of its longest path
        self.paths = path_exchanges(getattr(job, "edges", ()))

    def stop(self):
        self._stop_event.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join()

    # Channels start at the smallest buffer size (initial_buffer_size) until a
    # measurement sizes them: a fast job ships tiny buffers until then, so
    # the seeding periods are short; a quarter period still sees records flow.
    SEED_PERIOD_FRACTION = 0.25

    def _wait_s(self) -> float:
        if self.ticks < BufferDebloater.SEEDS:
            return self.config.period * self.SEED_PERIOD_FRACTION
        return self.config.period

    def _entry(self, t):
        entry = self._gates.get(id(t))
        if entry is None:
            entry = self._gates[id(t)] = (t, gates_of(t, self.config, self.paths), [0], threading.Lock())
        return entry

    def run(self):
        # The gates' measurements start now, not at the first tick: made there,
        # a gate measured nothing in its first period, and its channels kept
        # the smallest size one period longer.
        try:
            with self.lock:
                for t in list(self.job.tasks):
                    if t.input is not None:
                        self._entry(t)
        except Exception:   # (a job tearing down under it: the ticks make the entries)
            pass
        while not self._stop_event.wait(self._wait_s()):
            try:
                with self.lock:
                    self.tick()
            except Exception:   # the job may be tearing down under it; debloating is advisory
                if self._stop_event.is_set():
                    break

    def tick(self):
        self.ticks += 1
        job = self.job
        tasks = list(job.tasks)
        live = set()
        for t in tasks:
            if t.input is None:
                continue
            live.add(id(t))
            task, gates, pending, lock = self._entry(t)
            if task.finished_ns or job.cancelled:
                continue
            if pending[0]:
                pending[0] += 1
                if pending[0] > STALE_PERIODS and lock.acquire(blocking=False):
                    # The task is stuck in one batch (blocked on a full
                    # output, or a slow user function) and cannot run its
                    # mailbox: measure its gates from here; a tick only
                    # reads counters and queue lengths and sets sizes.
                    try:
                        task.debloat_tick(gates)
                    finally:
                        lock.release()
                continue
            pending[0] = 1

            def mail(task=task, gates=gates, pending=pending, lock=lock):
                pending[0] = 0
                if lock.acquire(blocking=False):
                    try:
                        task.debloat_tick(gates)
                    finally:
                        lock.release()
            task.post(mail)
        for k in [k for k in self._gates if k not in live]:
            del self._gates[k]
        capped = self._cap_pools(tasks)
        self._release_pages(capped)

    def _cap_pools(self, tasks) -> bool:
        """Set every output pool's max from its queues; True if one went down."""
        lowered = False
        seen = set()
        for t in tasks:
            for out in t.outputs:
                pool = out.pool
                seen.add(id(pool))
                entry = self._pools.get(id(pool))
                if entry is None:
                    entry = self._pools[id(pool)] = (pool, pool.min_size, pool.max_size)
                _, lo, hi = entry
                if pool.destroyed:
                    continue
                cap = output_pool_cap(lo, hi, len(out.queues), pool.segment_size,
                                      [(q.buffer_size, q.desired_bytes) for q in out.queues])
                cur = pool.max_size
                if cap != cur:
                    try:
                        pool.set_size(max_size=cap)
                    except Exception:     # destroyed meanwhile (the job ended)
                        continue
                    lowered = lowered or cap < cur
        for k in [k for k in self._pools if k not in seen]:
            del self._pools[k]
        return lowered

    def _release_pages(self, capped: bool) -> None:
        net = getattr(self.job, "network_pool", None)
        if net is None:
            return
        seg = net.segment_size
        # The smallest debloated size: a free segment's next writer may need
        # more, and takes the pages back by touching them (page faults, once
        # per segment per pass), a bounded cost; holding every page for the
        # one fast channel of a process would give nothing back.
        keep = min((q.buffer_size for q in getattr(self.job, "_queues", ()) if q.buffer_size), default=seg)
        if keep >= seg:
            self._keep = None
            return
        self._since_release += 1
        # at once when the sizes fell a lot (or caps went down after a while),
        # else every few periods: a pass visits every free segment
        due = self._keep is None or 2 * keep <= self._keep or self._since_release >= RELEASE_EVERY
        if due or (capped and self._since_release >= 2):
            self.released_bytes += net.release_memory(keep)
            self._keep = keep
            self._since_release = 0


def start_timer(job):
    """Start the job's DebloatTimer when its JobSpec has debloating on."""
    if not job.spec.debloat_config.enabled:
        return None
    timer = DebloatTimer(job, DebloatSettings.from_env(job.spec))
    timer.start()
    return timer


def stop_timer(job) -> None:
    timer = getattr(job, "_debloat_timer", None)
    if timer is not None:
        timer.stop()


class paused:
    """``with paused(job):`` no tick runs inside (a restart counts segments)."""

    def __init__(self, job):
        self.timer = getattr(job, "_debloat_timer", None)

    def __enter__(self):
        if self.timer is not None:
            self.timer.lock.acquire()
        return self

    def __exit__(self, *exc):
        if self.timer is not None:
            self.timer.lock.release()
        return False
