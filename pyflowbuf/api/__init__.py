"""The job API: build a graph of sources, operators and sinks, then run it.

    env = Environment(parallelism=2)
    counts = (env.from_collection(["a b", "b c"])
                 .flat_map(str.split)
                 .key_by(lambda w: w)
                 .reduce(lambda a, b: a)          # any rolling reduce
                 .collect())
    env.execute()
    counts.result

What lives where:

- ``environment``: ``Environment``, its settings, the graph, running it;
- ``sources``: the source declarations of the environment (``from_*``, ``read_*``);
- ``stream``: ``Stream``, ``KeyedStream``, ``ConnectedStreams``, ``WindowResult``;
- ``sinks``: the sink declarations of a stream and their handles;
- ``windowed``: ``WindowedStream`` and ``AllWindowedStream`` (``KeyedStream.window``,
  ``Stream.window_all``);
- ``side_outputs``: ``OutputTag`` and the checks of side output declarations;
- ``joined``: ``JoinedStreams`` and ``IntervalJoin``;
- ``_validation``: the argument checks they share.
"""
from pyflowbuf.api.environment import Environment
from pyflowbuf.api.side_outputs import OutputTag
from pyflowbuf.api.joined import IntervalJoin, JoinedStreams
from pyflowbuf.api.sinks import CollectSink, DataSink, IteratorSink
from pyflowbuf.api.stream import ConnectedStreams, KeyedStream, Stream, WindowResult
from pyflowbuf.api.windowed import AllWindowedStream, WindowedStream

__all__ = ["Environment", "Stream", "KeyedStream", "ConnectedStreams", "CollectSink", "DataSink", "IteratorSink",
           "WindowedStream", "AllWindowedStream", "WindowResult", "JoinedStreams", "IntervalJoin", "OutputTag"]
