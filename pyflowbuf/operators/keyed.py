"""Keyed operators without timers: the rolling reduce of ``key_by(...)``
(``reduce``, and ``sum``/``min``/``max``, which the API builds on it), with
per-key state stored per key group and recorded per changed key for
incremental checkpoints. The keyed process operators (state and timers) are
``pyflowbuf/time/process.py``."""
from __future__ import annotations

from pyflowbuf.operators.contracts import Operator


class _Keyed(Operator):
    """Keyed operators: ``fn`` applied with per-key state held in the task."""

    def __init__(self, name, key_fn, fn):
        super().__init__(name)
        self.key_fn = key_fn
        self.fn = fn
        self.state: dict = {}


class _PerKeyState:
    """Keyed state as one map ``self.state`` (key -> value), stored per key
    group and recorded per changed key (incremental checkpoints)."""

    keyed_state = True
    tracks_changes = True

    def keyed_parts(self, state):
        return {"state": (state or {}, None)}, {}, None

    def from_keyed_parts(self, maps, timers, commons):
        return maps.get("state", {})


class KeyedReduce(_PerKeyState, _Keyed):
    """Rolling reduce per key; emits the updated aggregate for every input."""

    def process_batch(self, batch):
        key_fn, fn, state = self.key_fn, self.fn, self.state
        out = []
        touched = self.touched
        if touched is None:
            for x in batch:
                k = key_fn(x)
                if k in state:
                    x = fn(state[k], x)
                state[k] = x
                out.append(x)
        else:           # incremental checkpoints: a second loop keeps the plain one free of the test
            mark = touched.add
            for x in batch:
                k = key_fn(x)
                mark(k)
                if k in state:
                    x = fn(state[k], x)
                state[k] = x
                out.append(x)
        return self._checked(out)

    def process_ts(self, batch, ts):
        return self.process_batch(batch), ts

    def snapshot_state(self):
        return dict(self.state)

    def restore_state(self, state):
        self.state = dict(state or {})
