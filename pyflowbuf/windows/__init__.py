"""Windows: assigners, triggers, aggregate functions, and the operators.

    environment = fb.Environment()
    counts = (environment.from_iterable(words)                        # (word, seconds)
                .assign_timestamps(lambda r: r[1], out_of_orderness=0.5)
                .key_by(lambda r: r[0])
                .window(fb.Tumbling(60.0))
                .aggregate(fb.windows.Count(), window_function=lambda k, w, n: (k, w.start, n))
                .collect())

A window is ``TimeWindow(start, end)``, holding timestamps ``start <= t < end``.
It fires once the watermark reaches ``end``; with ``allowed_lateness(s)`` its
state is kept until the watermark reaches ``end + s``, and each record that
arrives in between fires it again with the updated result (Flink's
EventTimeTrigger). A record whose every window is past that point is late:
dropped and counted (``late_records_dropped`` in ``Environment.metrics()``), or sent to
the stream ``result.late()`` returns.

Windows over Arrow/pandas batch streams are computed a batch at a time with
pyarrow compute (``key_by("column")`` with ``assign_timestamps("column")``,
then ``aggregate({"out": ("column", "sum"), ...})``): see ``ArrowWindowOperator``.

Besides event time, windows can follow processing time
(``TumblingProcessingTime``, ``SlidingProcessingTime``,
``SessionProcessingTime``) or counts (``CountWindow``), and
``window(assigner, trigger=...)`` changes when they fire
(``ContinuousEventTimeTrigger`` for early results, ``CountTrigger``,
``PurgingTrigger``); a window function that takes one more argument gets a
``WindowContext`` whose ``firing`` says "early", "on_time", "late" or
"partial". ``stream.window_all(assigner)`` windows an unkeyed stream in one
subtask. See docs/event-time.md.

What lives where: ``assigners`` (``TimeWindow``, ``RecordRange`` and the
assigners), ``triggers``, ``aggregates`` (``AggregateFunction``, ``Count``,
``Sum``), and the runtime operators: ``operator`` (``WindowOperator``,
``TriggerWindowOperator``, ``CountWindowOperator``), ``arrow``
(``ArrowWindowOperator``), ``joins`` (``WindowJoinOperator``,
``IntervalJoinOperator``). The API side (``WindowedStream``, ``AllWindowedStream``, ``WindowResult``,
``JoinedStreams``, ``IntervalJoin``) is in ``pyflowbuf.api``.
"""
import importlib
import warnings

from pyflowbuf.windows.aggregates import AggregateFunction, Count, Sum
from pyflowbuf.windows.arrow import ArrowWindowOperator, check_arrow_spec  # noqa: F401
from pyflowbuf.windows.assigners import (CountWindow, RecordRange, Session, SessionProcessingTime, Sliding,
                                         SlidingProcessingTime, TimeWindow, Tumbling, TumblingProcessingTime,
                                         WindowAssigner)
from pyflowbuf.windows.joins import IntervalJoinOperator, WindowJoinOperator  # noqa: F401
from pyflowbuf.windows.operator import (AGGREGATE, PROCESS, REDUCE, CountWindowOperator,  # noqa: F401
                                        TriggerWindowOperator, WindowContext, WindowOperator, WindowSpec)
from pyflowbuf.windows.triggers import (ContinuousEventTimeTrigger, CountTrigger, EventTimeTrigger,
                                        ProcessingTimeTrigger, PurgingTrigger, Trigger)

__all__ = ["TimeWindow", "RecordRange", "WindowAssigner", "Tumbling", "Sliding", "Session",
           "TumblingProcessingTime", "SlidingProcessingTime", "SessionProcessingTime", "CountWindow",
           "Trigger", "EventTimeTrigger", "ProcessingTimeTrigger", "ContinuousEventTimeTrigger", "CountTrigger",
           "PurgingTrigger", "WindowContext", "AggregateFunction", "Count", "Sum"]

# The API classes of windows and joins were importable from here before
# issue 19; for one release the old spelling works, with a warning. (Looked up
# by name at run time: the API layer sits above this one.)
_MOVED = ("WindowedStream", "WindowResult", "JoinedStreams", "IntervalJoin")


def __getattr__(name):
    if name not in _MOVED:
        raise AttributeError(f"module 'pyflowbuf.windows' has no attribute {name!r}")
    warnings.warn(f"pyflowbuf.windows.{name} moved to pyflowbuf.api.{name} (also pyflowbuf.{name}); the old "
                  "spelling will be removed in the next release", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("pyflowbuf.api"), name)
