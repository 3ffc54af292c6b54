"""pyflowbuf: Flink-style network buffers and backpressure for Python pipelines.

The names here are the user's API: build a job on an ``Environment``, shape
it with the stream classes, configure it with the config objects
(``CheckpointConfig``, ``NetworkConfig``, ...), time it with the window assigners. The network
core (``Buffer``, ``BufferQueue``, ``RecordWriter``, ...) lives in
``pyflowbuf._core.memory``, ``pyflowbuf._core.channel`` and
``pyflowbuf._core.serde``; ``pyflowbuf.testing`` drives one operator in a test.
"""
import importlib
import warnings

from pyflowbuf._version import __version__
from pyflowbuf._core.serde import stable_hash
from pyflowbuf._validation import stable_key
from pyflowbuf import errors
from pyflowbuf.config import CheckpointConfig, DebloatConfig, MetricsConfig, NetworkConfig, RestartConfig
from pyflowbuf.api import (AllWindowedStream, CollectSink, ConnectedStreams, DataSink, Environment, IntervalJoin,
                           IteratorSink, JoinedStreams, KeyedStream, OutputTag, Stream, WindowedStream, WindowResult)
from pyflowbuf.connectors.sources import RateLimiter
from pyflowbuf.connectors.api import Sink, Source, SourceReader
from pyflowbuf import windows
from pyflowbuf.windows import (AggregateFunction, ContinuousEventTimeTrigger, Count, CountTrigger, CountWindow,
                               EventTimeTrigger, ProcessingTimeTrigger, PurgingTrigger, RecordRange, Session,
                               SessionProcessingTime, Sliding, SlidingProcessingTime, Sum, TimeWindow, Tumbling,
                               TumblingProcessingTime, WindowContext)
from pyflowbuf.time.process import KeyedProcessFunction

__all__ = [
    "__version__", "errors", "stable_hash", "stable_key",
    "Environment", "CheckpointConfig", "RestartConfig", "NetworkConfig", "DebloatConfig", "MetricsConfig",
    "Stream", "KeyedStream", "ConnectedStreams", "CollectSink", "DataSink", "IteratorSink", "RateLimiter",
    "WindowedStream", "AllWindowedStream", "WindowResult", "JoinedStreams", "IntervalJoin",
    "windows", "Tumbling", "Sliding", "Session", "TimeWindow", "AggregateFunction", "Count", "Sum",
    "TumblingProcessingTime", "SlidingProcessingTime", "SessionProcessingTime", "CountWindow", "RecordRange",
    "EventTimeTrigger", "ProcessingTimeTrigger", "ContinuousEventTimeTrigger", "CountTrigger", "PurgingTrigger",
    "WindowContext",
    "KeyedProcessFunction", "OutputTag", "Source", "SourceReader", "Sink",
]

# The core classes were importable from here before issue 19; for one release
# the old spelling still works, with a warning that names the new path.
_MOVED = {
    "Buffer": "pyflowbuf._core.memory", "LocalBufferPool": "pyflowbuf._core.memory",
    "NetworkBufferPool": "pyflowbuf._core.memory", "Notifier": "pyflowbuf._core.memory",
    "BufferQueue": "pyflowbuf._core.channel", "InputGate": "pyflowbuf._core.channel",
    "RecordReader": "pyflowbuf._core.serde", "RecordWriter": "pyflowbuf._core.serde",
}


def __getattr__(name):
    if name == "spark":
        # optional (needs pyspark at run time): loaded when first asked for
        return importlib.import_module("pyflowbuf.spark")
    module = _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'pyflowbuf' has no attribute {name!r}")
    warnings.warn(
        f"pyflowbuf.{name} is deprecated and will be removed in the next release: it is a class of the "
        f"network core, not of the job API; import it as 'from {module} import {name}'",
        DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
