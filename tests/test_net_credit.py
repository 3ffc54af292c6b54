"""Credit-based flow control: SenderView and ReceiverCredit, driven without
sockets over real pools and queues, including a model-based (stateful) test."""
import struct
from collections import deque

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.channel import BARRIER, END_OF_PARTITION
from pyflowbuf.errors import InsufficientBuffersError, ProtocolError
from pyflowbuf.net.credit import BACKLOG, DATA, EVENT, ReceiverCredit, SenderView

SEG = 256


def _data(pool, q, value, priority=False):
    b = pool.request()
    assert b is not None
    with b.memory() as m:
        m[:8] = struct.pack("<q", value)
    b.set_meta(8)
    q.push_buffer(b, priority)


def _value(buf):
    return struct.unpack_from("<q", memoryview(buf))[0]


def _drain(q):
    """What the server does with a released view's queue."""
    while (x := q.pop_buffer()) is not None:
        if type(x) is not tuple:
            x.recycle()


@pytest.fixture
def nbp():
    return NetworkBufferPool(64, SEG)


def test_data_only_against_credit_events_for_free(nbp):
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    v = SenderView(q, b"r" * 16, 0, initial_credit=1)
    _data(pool, q, 1)
    _data(pool, q, 2)
    out = v.poll()
    assert out[0] == DATA and _value(out[1]) == 1 and out[2] == 0 and out[3] == 1
    out[1].recycle()
    assert v.credit == 0
    assert v.poll() is None           # data waits for credit
    q.push_event(BARRIER, 7)
    assert v.poll() is None           # the event is behind data: order is kept
    v.add_credit(1)
    out = v.poll()
    assert out[0] == DATA and _value(out[1]) == 2 and out[2] == 1
    out[1].recycle()
    out = v.poll()
    assert out[0] == EVENT and out[1] == (BARRIER, 7, 0) and v.credit == 0   # no credit spent
    with pytest.raises(ProtocolError):
        v.add_credit(0)


def test_priority_event_overtakes_data_waiting_for_credit(nbp):
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    v = SenderView(q, b"r" * 16, 0, initial_credit=0)
    _data(pool, q, 1)
    assert v.poll()[0] == BACKLOG
    q.push_event(BARRIER, 9, 0, True)
    out = v.poll()
    assert out[0] == EVENT and out[1] == (BARRIER, 9, 0) and out[4] is True and out[2] == 0
    v.release()
    assert v.poll() is None and pool.in_use == 1   # nothing is taken before it can be sent
    _drain(q)
    assert pool.in_use == 0


def test_backlog_announcement_only_with_zero_exclusive_buffers(nbp):
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    v = SenderView(q, b"r" * 16, 0, initial_credit=0)
    assert v.poll() is None
    _data(pool, q, 1)
    _data(pool, q, 2)
    out = v.poll()
    assert out[0] == BACKLOG and out[3] == 2
    assert v.poll() is None          # told once until it changes
    _data(pool, q, 3)
    assert v.poll()[3] == 3
    v.add_credit(3)
    for i in (1, 2, 3):
        out = v.poll()
        assert out[0] == DATA and _value(out[1]) == i and out[3] == 3 - i
        out[1].recycle()
    # with exclusive credit the sender never announces: the receiver's
    # recycled exclusive buffers always bring credit back
    q2 = BufferQueue(nbp)
    v2 = SenderView(q2, b"s" * 16, 0, initial_credit=1)
    _data(pool, q2, 1)
    _data(pool, q2, 2)
    v2.poll()[1].recycle()
    assert v2.poll() is None
    v2.release()
    assert v2.poll() is None
    _drain(q2)
    assert pool.in_use == 0


def test_block_on_barrier_until_resume(nbp):
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    v = SenderView(q, b"r" * 16, 0, initial_credit=5, block_on_barrier=True)
    q.push_event(BARRIER, 1)
    _data(pool, q, 1)
    assert v.poll()[0] == EVENT
    assert v.blocked and v.poll() is None
    v.resume()
    out = v.poll()
    assert out[0] == DATA
    out[1].recycle()


def test_tcp_mode_ignores_credit(nbp):
    pool = nbp.create_pool(4, 4)
    q = BufferQueue(nbp)
    v = SenderView(q, b"r" * 16, 0, initial_credit=0, credit_based=False)
    for i in range(3):
        _data(pool, q, i)
    for i in range(3):
        out = v.poll()
        assert out[0] == DATA
        out[1].recycle()


def test_receiver_exclusive_floating_and_swap(nbp):
    excl = nbp.create_pool(2, 2)
    fl = nbp.create_pool(0, 3)
    rc = ReceiverCredit(excl, fl, 2)
    assert rc.setup() == 2 and rc.available == 2
    b1, b2 = rc.take(), rc.take()
    assert rc.take() is None
    rc.backlog = 3                       # wants backlog + 2 = 5 available
    assert rc.replenish() == 3 and rc.waiting_floating  # 3 floating, the pool cap
    assert rc.announce() == 3 and rc.unannounced == 0
    rc.backlog = 0
    b1.recycle()                         # an exclusive buffer back while 3 floating are idle
    assert rc.replenish() == 0           # swapped: a floating one went back to the gate
    assert fl.in_use == 2 and rc.available == 3
    b2.recycle()
    rc.replenish()
    assert fl.in_use == 1 and rc.available == 3
    rc.release()
    assert excl.in_use == 0 and fl.in_use == 0


def test_receiver_setup_fails_without_guaranteed_buffers(nbp):
    excl = nbp.create_pool(1, 2)
    other = nbp.create_pool(0, 64)
    held = [other.request() for _ in range(nbp.unreserved_segments)]
    with pytest.raises(InsufficientBuffersError):
        ReceiverCredit(excl, None, 2).setup()
    assert excl.in_use == 0
    for b in held:
        b.recycle()
    with pytest.raises(ValueError):
        ReceiverCredit(None, None, 0)


def test_should_announce_holds_back_only_while_the_sender_has_credit(nbp):
    excl = nbp.create_pool(4, 4)
    rc = ReceiverCredit(excl, None, 4)
    rc.setup()
    bufs = [rc.take() for _ in range(3)]     # sender still has 1 credit
    bufs.pop().recycle()
    rc.replenish()
    assert rc.unannounced == 1 and rc.should_announce()   # 4-3 = 1 <= 1
    for b in bufs:
        b.recycle()
    rc.replenish()
    assert rc.announce() == 3


class CreditModel(RuleBasedStateMachine):
    """Producers, senders, a two-way 'network' of FIFOs, receivers and
    consumers for 1-3 channels sharing one floating pool. Rules fire in any
    order; the invariants check the credit accounting after every step, and
    the teardown drains everything and checks that nothing deadlocks and every
    buffer comes back."""

    @initialize(exclusive=st.integers(0, 3), floating=st.integers(0, 4), channels=st.integers(1, 3),
                producer_buffers=st.integers(1, 4))
    def setup(self, exclusive, floating, channels, producer_buffers):
        if exclusive == 0 and floating == 0:
            floating = 1
        self.nbp = NetworkBufferPool(128, SEG)
        self.E = exclusive
        self.F = floating
        self.fp = self.nbp.create_pool(0, floating) if floating else None
        self.ch = []
        for i in range(channels):
            out_pool = self.nbp.create_pool(producer_buffers, producer_buffers)
            send_q, recv_q = BufferQueue(self.nbp), BufferQueue(self.nbp)
            excl = self.nbp.create_pool(exclusive, exclusive) if exclusive else None
            rc = ReceiverCredit(excl, self.fp, exclusive)
            view = SenderView(send_q, bytes([i]) * 16, i, rc.setup())
            self.ch.append(dict(out_pool=out_pool, send_q=send_q, recv_q=recv_q, excl=excl, rc=rc, view=view,
                                to_recv=deque(), to_send=deque(), produced=0, consumed=0, ended=False,
                                done=False, expected_seq=0, stalled=False, events=0, released=False,
                                dropped_credit=0))

    idx = st.integers(0, 2)

    def _c(self, i):
        return self.ch[i % len(self.ch)]

    # --- producer
    @rule(i=idx)
    def produce(self, i):
        c = self._c(i)
        if c["ended"]:
            return
        b = c["out_pool"].request()
        if b is None:
            return                      # backpressure: the producer's pool is dry
        with b.memory() as m:
            m[:8] = struct.pack("<q", c["produced"])
        b.set_meta(8)
        c["send_q"].push_buffer(b)
        c["produced"] += 1

    @rule(i=idx)
    def produce_barrier(self, i):
        c = self._c(i)
        if not c["ended"]:
            c["send_q"].push_event(BARRIER, c["produced"])

    @rule(i=idx)
    def end(self, i):
        c = self._c(i)
        if not c["ended"]:
            c["send_q"].push_event(END_OF_PARTITION)
            c["ended"] = True

    # --- sender
    @rule(i=idx)
    def send(self, i):
        self._send(self._c(i))

    def _send(self, c):
        out = c["view"].poll()
        if out is None:
            return False
        what, item, seq, backlog, prio = out
        if what == DATA:
            c["to_recv"].append(("data", seq, backlog, bytes(memoryview(item))))
            item.recycle()
        elif what == EVENT:
            c["to_recv"].append(("event", seq, backlog, item))
            if item[0] == END_OF_PARTITION:
                c["view"].finished = True
        else:
            c["to_recv"].append(("backlog", None, backlog, None))
        return True

    # --- receiver
    @rule(i=idx)
    def deliver(self, i):
        self._deliver(self._c(i))

    def _deliver(self, c):
        if not c["to_recv"]:
            return False
        what, seq, backlog, payload = c["to_recv"].popleft()
        rc = c["rc"]
        if what != "backlog":
            assert seq == c["expected_seq"], "sequence gap"
            c["expected_seq"] += 1
        if what == "data":
            b = rc.take()
            assert b is not None, "data arrived without a reserved buffer: the sender overran its credit"
            with b.memory() as m:
                m[:len(payload)] = payload
            b.set_meta(len(payload))
            c["recv_q"].push_buffer(b)
        elif what == "event":
            c["recv_q"].push_event(*payload)
        rc.backlog = backlog
        return True

    @rule(i=idx)
    def control(self, i):
        self._control(self._c(i))

    def _control(self, c):
        rc = c["rc"]
        if c["released"]:
            return False
        rc.replenish()
        if rc.should_announce():
            c["to_send"].append(rc.announce())
            return True
        return False

    @rule(i=idx)
    def deliver_credit(self, i):
        self._deliver_credit(self._c(i))

    def _deliver_credit(self, c):
        if not c["to_send"]:
            return False
        n = c["to_send"].popleft()
        if c["view"].finished:
            c["dropped_credit"] += n     # the server ignores credit for a finished view
        else:
            c["view"].add_credit(n)
        return True

    # --- consumer
    @rule(i=idx)
    def toggle_stall(self, i):
        c = self._c(i)
        c["stalled"] = not c["stalled"]

    @rule(i=idx)
    def consume(self, i):
        c = self._c(i)
        if not c["stalled"]:
            self._consume(c)

    def _consume(self, c):
        x = c["recv_q"].pop_buffer()
        if x is None:
            return False
        if type(x) is tuple:
            if x[0] == END_OF_PARTITION:
                c["done"] = True
                c["rc"].release()        # the client's control thread does this on retire
                c["released"] = True
            else:
                c["events"] += 1
            return True
        assert _value(x) == c["consumed"], "records out of order"
        c["consumed"] += 1
        x.recycle()
        return True

    # --- invariants
    @invariant()
    def credit_accounting(self):
        if not hasattr(self, "ch"):
            return
        for c in self.ch:
            if c["released"] or c["view"].finished:
                continue
            v, rc = c["view"], c["rc"]
            assert v.credit >= 0
            in_flight_data = sum(1 for m in c["to_recv"] if m[0] == "data")
            assert rc.available == v.credit + sum(c["to_send"]) + rc.unannounced + in_flight_data
            if c["excl"] is not None:
                assert c["excl"].in_use <= self.E
        if self.fp is not None:
            assert self.fp.in_use <= self.F

    def teardown(self):
        if not hasattr(self, "ch"):
            return
        for c in self.ch:
            if not c["ended"]:
                c["send_q"].push_event(END_OF_PARTITION)
                c["ended"] = True
            c["stalled"] = False
        for _ in range(2000):
            progress = False
            for c in self.ch:
                for step in (self._send, self._deliver, self._control, self._deliver_credit, self._consume):
                    progress |= bool(step(c))
            if all(c["done"] for c in self.ch):
                break
            assert progress, "deadlock: no step can make progress before every channel finished"
        assert all(c["done"] for c in self.ch)
        for c in self.ch:
            assert c["consumed"] == c["produced"]
            assert c["out_pool"].in_use == 0                  # every sent buffer was recycled
            assert c["view"].buffers_sent == c["produced"]
            rc = c["rc"]
            # every credit given was used for a buffer or is still with the sender
            assert rc.granted == (c["view"].buffers_sent + c["view"].credit + sum(c["to_send"])
                                  + c["dropped_credit"])
            if c["excl"] is not None:
                assert c["excl"].in_use == 0                  # every exclusive buffer came back
        if self.fp is not None:
            assert self.fp.in_use == 0


TestCreditModel = CreditModel.TestCase
TestCreditModel.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow])


def test_zero_exclusive_many_channels_one_floating_buffer_never_deadlocks():
    """FLINK-16641: with 0 exclusive buffers only BacklogAnnouncement lets a
    channel ask for buffers; 3 channels sharing a single floating buffer must
    all finish."""
    m = CreditModel()
    m.setup(exclusive=0, floating=1, channels=3, producer_buffers=4)
    for _ in range(40):
        for c in m.ch:
            m.produce(m.ch.index(c))
    m.teardown()
