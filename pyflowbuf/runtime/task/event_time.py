"""Event time in a subtask: the valve over its input channels, the
watermark's way through its chain, and what it last sent downstream."""
from __future__ import annotations

from pyflowbuf._core.events import EVT_WATERMARK
from pyflowbuf.time import watermarks as _wm
from pyflowbuf.time.watermarks import END_OF_TIME, NO_WATERMARK


class EventTime:
    """The watermarks of one subtask.

    A watermark (or idle marker) from an input channel goes into the valve
    (``pyflowbuf.time.watermarks.WatermarkValve``), which combines the
    channels of every input; a rise goes through the chain: each event-time
    operator fires what it completes (through the rest of the chain) and may
    hold the watermark back; what is left goes to every output after those
    records. An assigner in the chain starts a watermark of its own after
    itself (``ChainOutput.emit_watermark``).
    """

    def __init__(self, job, chain, sides: list, outputs: list):
        self.job = job
        self.chain = chain
        self.sides = sides
        self.outputs = outputs
        self.valve = None
        self.wm_out = NO_WATERMARK      # the last watermark sent downstream
        self.idle_out = False

    def in_job(self) -> bool:
        """Whether any operator of the job keeps event time: only then does a
        task send watermarks (and +inf at its end)."""
        job = self.job
        flag = getattr(job, "_event_time", None)
        if flag is None:
            flag = job._event_time = any(n.event_time for n in job.spec.nodes)
        return flag

    def on_event(self, event, input_index: int) -> None:
        """A watermark (or idle marker) from one input channel: ``event`` is
        (channel, kind, aux, flags), channel counted within that input."""
        valve = self.valve
        sides = self.sides
        if valve is None:
            valve = self.valve = _wm.WatermarkValve(
                (i, ch) for i, side in enumerate(sides) for ch in range(side.num_channels))
        # channels that ended count as +inf (a task restored as finished sends none)
        for key, w in valve.channel_wm.items():
            if w != END_OF_TIME and sides[key[0]].channel_finished(key[1]):
                valve.on_channel_finished(key)
        key = (input_index, event[0])
        wm = _wm.decode(event[2])
        risen = valve.on_idle(key) if wm is None else valve.on_watermark(key, wm)
        if valve.idle:
            self.emit_idle()
            return
        if risen is not None:
            self.watermark_through(risen, 0, force=self.idle_out)
        elif self.idle_out:
            self.watermark_through(valve.current, 0, force=True)

    def watermark_through(self, wm, start: int, force: bool = False) -> None:
        """Watermark ``wm`` through the operators from index ``start`` on; then
        to the outputs, after the records it fired, if it rose (or ``force``)."""
        chain = self.chain
        ops = chain.operators
        for k in range(start, len(ops)):
            if wm is None:
                break       # held back: the operators after it see none
            op = ops[k]
            handler = op.on_watermark
            if handler is None:
                continue
            chain.current_operator = op.name
            more, wm = handler(wm)
            if more:
                chain.walk(more, chain.times_of(op, more), k + 1)
        chain.ship_side_outputs()
        if wm is not None and (wm > self.wm_out or force):
            self.wm_out = max(wm, self.wm_out)
            self.idle_out = False
            for out in self.outputs:
                out.broadcast_event(EVT_WATERMARK, _wm.encode(self.wm_out), 0, False)

    def finish(self) -> None:
        """End of input: every window fires, every event-time timer too."""
        if self.in_job():
            self.watermark_through(END_OF_TIME, 0)

    def emit_idle(self) -> None:
        """Tell the consumers this subtask is idle (once, until a watermark)."""
        if not self.idle_out:
            self.idle_out = True
            for out in self.outputs:
                out.broadcast_event(EVT_WATERMARK, _wm.IDLE_AUX, 0, False)
