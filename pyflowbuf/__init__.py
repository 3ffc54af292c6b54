"""pyflowbuf: Flink-style network buffers and backpressure for Python pipelines."""
from pyflowbuf._version import __version__
from pyflowbuf._core.memory import Buffer, LocalBufferPool, NetworkBufferPool, Notifier
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.serde import RecordReader, RecordWriter, stable_hash
from pyflowbuf import errors
from pyflowbuf.api import CollectSink, Environment, IteratorSink, KeyedStream, Stream
from pyflowbuf.runtime.sources import RateLimiter
from pyflowbuf import windows
from pyflowbuf.windows import Session, Sliding, TimeWindow, Tumbling
from pyflowbuf.runtime.timers import KeyedProcessFunction

__all__ = [
    "__version__", "Buffer", "BufferQueue", "InputGate", "LocalBufferPool", "NetworkBufferPool",
    "Notifier", "RecordReader", "RecordWriter", "errors", "stable_hash",
    "Environment", "Stream", "KeyedStream", "CollectSink", "IteratorSink", "RateLimiter",
    "windows", "Tumbling", "Sliding", "Session", "TimeWindow", "KeyedProcessFunction",
]
