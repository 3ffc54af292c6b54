"""The input processor's one loop, for one input and for several: each input's
records and events reach the chain, the checkpoint side and event time in
that input's order, with its index, and no input is read past an event that
is still pending. Checked against the simplest model: per input, what came
out is what was sent."""
from __future__ import annotations

from array import array
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from pyflowbuf._core.channel import BARRIER
from pyflowbuf._core.events import EVT_WATERMARK
from pyflowbuf.config import NetworkConfig
from pyflowbuf.exchange.sides import MultiInput
from pyflowbuf.runtime.task.input import InputProcessor
from pyflowbuf.runtime.task.mailbox import Mailbox


class _Notifier:
    def prepare(self):
        return 0

    def cancel(self):
        pass

    def wait(self, token, timeout):
        return False

    def notify(self):
        pass


class _Side:
    """An InputSide that plays a script: a list of records is one read's
    batch, [] a read that timed out, ("event", e) an event that ends a read."""

    timestamped = True
    cancelled = False
    reader = None
    num_channels = 1

    def __init__(self, script, notifier):
        self.script = list(script)
        self.gate = SimpleNamespace(notifier=notifier)
        self.notifier = notifier
        self.pending = None
        self.finished = False
        self.ts = None

    @property
    def has_event(self):
        return self.pending is not None

    def read(self, max_records, timeout):
        assert self.pending is None, "read past a pending event"
        if not self.script:
            self.finished = True
            return []
        step = self.script.pop(0)
        if isinstance(step, tuple):
            self.pending = step[1]
            return []
        self.ts = array("d", [float(r[1]) for r in step])
        return list(step)

    def take_event(self):
        ev, self.pending = self.pending, None
        return ev


def _run(scripts, buffer_timeout=0.001):
    """What the processor handed on, in order: ("record", input, r) and
    ("barrier"/"watermark", input, aux)."""
    seen = []
    notifier = _Notifier()
    sides = [_Side(s, notifier) for s in scripts]
    input_side = sides[0] if len(sides) == 1 else MultiInput(sides)

    def process(batch, ts, input_index):
        assert list(ts) == [float(r[1]) for r in batch], "the times of another input's batch"
        seen.extend(("record", input_index, r) for r in batch)

    # (the runtime reads the job's spec, not its environment)
    job = SimpleNamespace(cancelled=False, spec=SimpleNamespace(network_config=NetworkConfig(buffer_timeout=buffer_timeout), max_batch=100),
                          event_handler=lambda task, ev, i: seen.append(("barrier", i, ev[2])))
    task = SimpleNamespace(job=job)
    chain = SimpleNamespace(process=process, timestamped=True)
    event_time = SimpleNamespace(on_event=lambda ev, i: seen.append(("watermark", i, ev[2])))
    checkpoints = SimpleNamespace(aligner=None)
    proc = InputProcessor(task, input_side, chain, Mailbox(input_side, []), checkpoints, event_time, [])
    proc.run()
    assert all(s.finished and not s.has_event for s in sides)
    return seen, proc


def _expected(script, i):
    out = []
    for step in script:
        if isinstance(step, tuple):
            ev = step[1]
            out.append(("barrier" if ev[1] == BARRIER else "watermark", i, ev[2]))
        else:
            out.extend(("record", i, r) for r in step)
    return out


# The idle read can end at an event: records 1, 2; a timed-out read; barrier
# 1 ends the idle read; behind it record 3 and barrier 2.
_SCRIPT = [[("a", 1), ("b", 2)], [], ("event", (0, BARRIER, 1, 0)), [("c", 3)], ("event", (0, BARRIER, 2, 0))]


def test_one_input_never_reads_past_an_event_that_ended_its_idle_read():
    seen, proc = _run([_SCRIPT])
    assert seen == _expected(_SCRIPT, 0)
    assert proc.records_in == 3


def test_an_event_on_one_of_several_inputs_is_handled_as_on_one_input():
    """The same script on input 1 of two (input 0 sends nothing): the same
    order, the same guard, the input index beside each item."""
    seen, _ = _run([[], _SCRIPT])
    assert seen == _expected(_SCRIPT, 1)


_record = st.tuples(st.sampled_from("abc"), st.integers(0, 9))
_event = st.tuples(st.just("event"), st.tuples(st.just(0), st.sampled_from([BARRIER, EVT_WATERMARK]),
                                               st.integers(1, 5), st.just(0)))
_step = st.one_of(st.lists(_record, min_size=1, max_size=4), st.just([]), _event)


@settings(max_examples=60, deadline=None)
@given(scripts=st.lists(st.lists(_step, max_size=8), min_size=1, max_size=3),
       per_record=st.booleans())
def test_each_input_arrives_in_its_own_order(scripts, per_record):
    seen, proc = _run(scripts, buffer_timeout=0 if per_record else 0.001)
    for i, script in enumerate(scripts):
        assert [x for x in seen if x[1] == i] == _expected(script, i)
    assert proc.records_in == sum(len(step) for s in scripts for step in s if isinstance(step, list))
