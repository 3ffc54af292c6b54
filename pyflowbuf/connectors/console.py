"""``print()``: records to standard output."""
from __future__ import annotations

import sys
from typing import Any


from pyflowbuf.operators.contracts import Operator

# ---------------------------------------------------------------- print

class PrintSink(Operator):
    """``Stream.print()``: each record on stdout as ``str(record)``, after a
    prefix as PyFlink's print() writes it: ``"<subtask>> "`` (counted from 1)
    when the sink has several subtasks, ``"<prefix>> "`` or
    ``"<prefix>:<subtask>> "`` with a prefix, none otherwise. A batch is one
    write. Not transactional: after a restore, records since the checkpoint
    print again (at least once, as Flink's print sink)."""

    kind = "sink"

    def __init__(self, name, prefix: str | None = None, stream: Any = None):
        super().__init__(name)
        self.prefix = prefix
        self.stream = stream

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        label = self.prefix or ""
        if parallelism > 1:
            label = f"{label}:{subtask + 1}" if label else str(subtask + 1)
        self._head = f"{label}> " if label else ""

    def process_batch(self, batch):
        if batch:
            out = self.stream if self.stream is not None else sys.stdout
            head = self._head
            out.write("".join([f"{head}{r}\n" for r in batch]))
            out.flush()
        return []
