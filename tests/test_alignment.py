"""Barrier alignment as a model-based test: channels carry records and barriers
in order, a scheduler reads any channel the gate does not block, and the
snapshot of checkpoint n must hold exactly the records that came before
barrier n on every channel (no record after barrier n is processed before the
snapshot of n, none before it is missing). Barriers are forwarded in order."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pyflowbuf.checkpoint.alignment import ABORT, SNAPSHOT, BarrierAligner


class Channels:
    """Queues of ("rec", epoch) / ("barrier", n) / ("cancel", n) / ("end",) per channel."""

    def __init__(self, streams):
        self.q = {k: list(items) for k, items in streams.items()}
        self.blocked = set()

    def block(self, k):
        assert k not in self.blocked
        self.blocked.add(k)

    def resume(self, k):
        self.blocked.discard(k)

    def readable(self):
        return sorted(k for k, items in self.q.items() if items and k not in self.blocked)


def make_streams(n_channels, n_checkpoints, data):
    """Every channel: records between barriers 1..n_checkpoints, then its end."""
    streams = {}
    for c in range(n_channels):
        items = []
        for epoch in range(n_checkpoints + 1):
            items += [("rec", epoch)] * data.draw(st.integers(0, 4), label=f"records {c}/{epoch}")
            if epoch < n_checkpoints:
                items.append(("barrier", epoch + 1))
        items.append(("end",))
        streams[(c // 2, c % 2)] = items
    return streams


@given(st.integers(1, 5), st.integers(1, 4), st.data())
def test_alignment_snapshots_exactly_the_records_before_each_barrier(n_channels, n_checkpoints, data):
    streams = make_streams(n_channels, n_checkpoints, data)
    chans = Channels(streams)
    al = BarrierAligner(streams, chans.block, chans.resume)
    processed = []              # epochs of processed records, in order
    snapshots = {}              # checkpoint id -> records processed at its snapshot
    forwarded = []
    while True:
        ready = chans.readable()
        if not ready:
            break
        k = data.draw(st.sampled_from(ready), label="read")
        item = chans.q[k].pop(0)
        if item[0] == "rec":
            processed.append(item[1])
            continue
        actions = al.on_barrier(k, item[1]) if item[0] == "barrier" else al.on_channel_finished(k)
        for action, n in actions:
            assert action == SNAPSHOT
            snapshots[n] = list(processed)
            forwarded.append(n)
    # nothing is left blocked: every channel was read to its end
    assert all(not items for items in chans.q.values()), chans.q
    assert not chans.blocked and not al.aligning
    assert forwarded == sorted(forwarded) == list(range(1, n_checkpoints + 1))
    total = {e: sum(1 for items in streams.values() for it in items if it == ("rec", e))
             for e in range(n_checkpoints + 1)}
    for n, seen in snapshots.items():
        # the cut: every record of epochs < n, none of epochs >= n
        assert all(e < n for e in seen), (n, seen)
        assert len(seen) == sum(total[e] for e in range(n))


def test_one_channel_never_blocks():
    chans = Channels({(0, 0): []})
    al = BarrierAligner([(0, 0)], chans.block, chans.resume)
    assert al.on_barrier((0, 0), 1) == [(SNAPSHOT, 1)]
    assert not chans.blocked


def test_cancel_marker_resumes_and_later_barriers_of_it_are_ignored():
    keys = [(0, 0), (0, 1), (1, 0)]
    chans = Channels({k: [] for k in keys})
    al = BarrierAligner(keys, chans.block, chans.resume)
    assert al.on_barrier((0, 0), 1) == []
    assert chans.blocked == {(0, 0)}
    assert al.on_cancel((0, 1), 1) == [(ABORT, 1)]
    assert not chans.blocked and not al.aligning
    assert al.on_barrier((1, 0), 1) == []          # late barrier of the aborted checkpoint
    assert not chans.blocked
    assert al.on_cancel((1, 0), 1) == []           # forwarded once only
    # the next checkpoint aligns normally
    assert al.on_barrier((0, 0), 2) == []
    assert al.on_barrier((0, 1), 2) == []
    assert al.on_barrier((1, 0), 2) == [(SNAPSHOT, 2)]
    assert not chans.blocked


def test_newer_barrier_aborts_the_one_aligning():
    keys = [(0, 0), (0, 1)]
    chans = Channels({k: [] for k in keys})
    al = BarrierAligner(keys, chans.block, chans.resume)
    al.on_barrier((0, 0), 1)
    assert al.on_barrier((0, 1), 2) == [(ABORT, 1)]
    assert al.current == 2 and chans.blocked == {(0, 1)}
    assert al.on_barrier((0, 0), 1) == []          # 1 was given up
    assert al.on_barrier((0, 0), 2) == [(SNAPSHOT, 2)]


def test_a_channel_ending_completes_the_alignment():
    keys = [(0, 0), (0, 1)]
    chans = Channels({k: [] for k in keys})
    al = BarrierAligner(keys, chans.block, chans.resume)
    assert al.on_barrier((0, 0), 1) == []
    assert al.on_channel_finished((0, 1)) == [(SNAPSHOT, 1)]
    assert not chans.blocked
    assert al.on_barrier((0, 0), 2) == [(SNAPSHOT, 2)]   # one live channel left: no blocking


def test_coordinator_abort_while_aligning():
    keys = [(0, 0), (0, 1)]
    chans = Channels({k: [] for k in keys})
    al = BarrierAligner(keys, chans.block, chans.resume)
    al.on_barrier((0, 0), 3)
    assert al.abort(3) == [(ABORT, 3)]
    assert not chans.blocked
    assert al.alignment_ns == {}
