"""How many records a source subtask takes from its source in one pull.

A pull is one crossing from the source into the chain and then into the core,
so it should be as large as possible while the source keeps up, and small
when the source trickles (a socket, Spark's iterator producing a batch): a
record pulled is a record held outside the pool, where backpressure cannot
reach it, and a record that waits in a half-filled batch is latency.

The rules live here, in one small object, rather than as loop variables of
the task: a name reused for a second meaning inside that loop once sent every
pull down the flush-per-record path (a 20x slowdown that no test saw).
"""
from __future__ import annotations

# A pull that took longer than this waited on its source rather than computed.
SLOW_PULL_NS = 2_000_000


class PullPolicy:
    """Decides the size of the next pull from what the last one showed.

    * Start at one record and double after every fast pull, up to ``max_batch``.
    * Halve after a slow pull (one that took over ``slow_pull_ns``); the caller
      also ships its partly filled buffers then (``slow``), so a trickle is not
      held back until the buffer timeout.
    * Cap by bytes: once the bytes per record are known, a pull never holds more
      than ``read_ahead_bytes`` (Arrow batches of megabytes come one at a time).
    * Cap by a rate limiter's ``pull_cap`` so a throttled source is not bursty.
    """

    __slots__ = ("max_batch", "read_ahead_bytes", "slow_pull_ns", "limiter",
                 "size", "slow", "bytes_per_record")

    def __init__(self, max_batch: int, read_ahead_bytes: int, *, slow_pull_ns: int = SLOW_PULL_NS,
                 limiter=None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        if not read_ahead_bytes > 0:
            raise ValueError(f"read_ahead_bytes must be > 0, got {read_ahead_bytes!r}")
        self.max_batch = max_batch
        self.read_ahead_bytes = read_ahead_bytes
        self.slow_pull_ns = slow_pull_ns
        self.limiter = limiter
        self.size = 1
        self.slow = False
        self.bytes_per_record: float | None = None

    def observe(self, records: int, pull_ns: int, bytes_written: int) -> int:
        """Account for one pull of ``records`` that took ``pull_ns`` and whose
        records took ``bytes_written`` bytes in output buffers (0 when nothing
        was serialized, e.g. a fully chained job); returns the next size."""
        self.slow = pull_ns > self.slow_pull_ns
        n = max(1, self.size // 2) if self.slow else min(self.max_batch, self.size * 2)
        if bytes_written > 0 and records > 0:
            self.bytes_per_record = bytes_written / records
        if self.bytes_per_record:
            n = max(1, min(n, int(self.read_ahead_bytes // self.bytes_per_record)))
        if self.limiter is not None:
            n = max(1, min(n, self.limiter.pull_cap()))
        self.size = n
        return n

    def __repr__(self):
        return (f"PullPolicy(size={self.size}, max_batch={self.max_batch}, slow={self.slow}, "
                f"bytes_per_record={self.bytes_per_record})")
