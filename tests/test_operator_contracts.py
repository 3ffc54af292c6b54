"""The declared contracts (issue 28, point 4): every operator, source, sink
and output the runtime runs satisfies its contract, the optional parts are
declared on the contract with the value that means "not used", and nothing
in the package probes for them with getattr/hasattr."""
import importlib
import inspect
import os
import pkgutil
import re

import pytest

import pyflowbuf as fb
import pyflowbuf.connectors.sinks as sinks
import pyflowbuf.connectors.sources as srcs
from pyflowbuf.connectors.contracts import SinkOperator, SourceOperator
from pyflowbuf.exchange.sides import OutputSide
from pyflowbuf.operators.contracts import Operator, Output
from pyflowbuf.time.timers import TimerOperator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _all_modules():
    import pyflowbuf
    for m in pkgutil.walk_packages(pyflowbuf.__path__, "pyflowbuf."):
        if m.name.endswith("__main__") or ".demo" in m.name or m.name.startswith("pyflowbuf.experiments"):
            continue
        try:
            importlib.import_module(m.name)
        except ImportError:         # an optional dependency
            pass


def _subclasses(cls):
    _all_modules()
    out, todo = set(), [cls]
    while todo:
        for s in todo.pop().__subclasses__():
            if s.__module__.startswith("pyflowbuf.") and s not in out:
                out.add(s)
                todo.append(s)
    return sorted(out, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _bare(cls):
    """An instance without running ``__init__``: what the class itself declares."""
    return cls.__new__(cls)


# The optional parts each contract declares, with the value meaning "not used".
OPERATOR_PARTS = {"timestamped": False, "passes_records": False, "on_watermark": None, "metrics": None,
                  "event_time": False, "timers": None, "fire_processing": None, "clock": None, "key_fn": None,
                  "key_fns": None, "commit_directory": None, "type_name": None, "node_id": None, "uid": None, "side": None,
                  "chain_output": None, "fired_ts": None, "out_kind": None}
SOURCE_PARTS = {"what": None, "wakeup": None, "not_rewindable_because": None, "rescale_positions": None,
                "rewindable": False}

OPERATORS = [c for c in _subclasses(Operator) if not inspect.isabstract(c)]
SOURCES = _subclasses(srcs.Source)
SINKS = [c for c in OPERATORS if not c.__name__.startswith("_") and c.__module__ in ("pyflowbuf.connectors.sinks", "pyflowbuf.connectors.console",
                                                                   "pyflowbuf.connectors.api")]


def test_the_contracts_declare_their_optional_parts_with_their_defaults():
    class Nothing(Operator):
        def process_batch(self, batch):
            return batch

    op = Nothing("x")
    assert {p: getattr(op, p) for p in OPERATOR_PARTS} == OPERATOR_PARTS
    src = srcs.Source()
    assert {p: getattr(src, p) for p in SOURCE_PARTS} == SOURCE_PARTS
    assert op.commit_directory is None and op.prepare_commit(1) == []     # a sink part that commits nothing


def test_an_operator_without_process_batch_is_refused_when_built():
    class Half(Operator):
        pass

    with pytest.raises(TypeError, match="process_batch"):
        Half("h")


def test_every_concrete_operator_class_is_found():
    names = {c.__name__ for c in OPERATORS}
    assert {"Map", "Filter", "FlatMap", "MapBatch", "Forward", "Union", "CoMap", "KeyedReduce", "KeyedProcess",
            "CoProcess", "KeyedCoProcess", "ProcessOperator", "KeyedProcessOperator", "KeyedCoProcessOperator",
            "TimestampsAssigner", "WindowOperator", "TriggerWindowOperator", "CountWindowOperator",
            "ArrowWindowOperator", "WindowJoinOperator", "IntervalJoinOperator", "CollectSink", "FunctionSink",
            "ConnectorSinkOperator", "PrintSink"} <= names


@pytest.mark.parametrize("cls", OPERATORS, ids=lambda c: c.__name__)
def test_each_operator_class_satisfies_the_operator_contract(cls):
    assert issubclass(cls, Operator) and not inspect.isabstract(cls)
    op = _bare(cls)
    for part in OPERATOR_PARTS:
        assert hasattr(cls, part), f"{cls.__name__} lacks {part}"
    assert callable(op.process_batch) and cls.process_batch is not Operator.process_batch
    # a part it declares to use is used the way the runtime calls it
    for part in ("on_watermark", "metrics", "fire_processing", "clock"):
        value = getattr(op, part)
        assert value is None or callable(value), (cls.__name__, part)
    if cls.event_time:
        assert callable(op.on_watermark), cls.__name__
    if issubclass(cls, TimerOperator):
        assert callable(op.fire_processing), cls.__name__


def test_each_sink_the_api_makes_satisfies_the_sink_contract(tmp_path):
    pytest.importorskip("pyarrow")
    env = fb.Environment()
    s = env.from_collection([{"a": 1}])
    handles = [s.collect(), s.sink(print), s.print(), s.write_text(str(tmp_path / "t")),
               s.write_parquet(str(tmp_path / "p"))]
    ops = [h._node.make_operator() for h in handles]
    made = {type(op): op for op in ops}
    assert set(made) == set(SINKS)
    for cls, op in made.items():
        assert isinstance(op, SinkOperator), cls.__name__
    assert made[sinks.CollectSink].commit_directory is None
    # the part-file sinks are connector sinks, named in checkpoints as before
    assert [type(op.sink).__name__ for op in ops[3:]] == [op.type_name for op in ops[3:]] == \
        ["TextFileSink", "ParquetFileSink"]


def _members(protocol) -> set:
    return set(protocol.__annotations__) | {n for n, v in vars(protocol).items() if inspect.isfunction(v)}


@pytest.mark.parametrize("cls", SOURCES, ids=lambda c: c.__name__)
def test_each_source_class_satisfies_the_source_contract(cls):
    # on the class: some parts are properties of a built source (rewindable)
    assert _members(SourceOperator) >= {"next_batch", "wakeup", "rescale_positions", "seek"}
    missing = [m for m in _members(SourceOperator) if not hasattr(cls, m)]
    assert not missing, f"{cls.__name__} lacks {missing}"


def test_the_sources_a_job_makes_satisfy_the_contract_and_their_parts_are_used(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x\ny\n")
    made = [srcs.IterableSource([1]), srcs.SequenceSource(0, 3), srcs.ArraySource([]),
            srcs.TextFileSource(str(path))]
    assert all(isinstance(s, SourceOperator) for s in made)
    assert made[1].rescale_positions is not None and made[0].rescale_positions is None
    assert made[0].wakeup is None
    # the declared part, not a probe, gives a source's name in its errors
    assert "IterableSource" in str(srcs.incompatible(made[0], "why"))
    assert not isinstance(object(), SourceOperator)


def test_the_outputs_satisfy_the_output_contract():
    from pyflowbuf.runtime.task.chain import ChainOutput
    from pyflowbuf.testing import _HarnessOutput

    methods = ("post", "schedule", "emit", "emit_watermark", "emit_idle")
    for cls in (ChainOutput, _HarnessOutput):
        assert isinstance(_bare(cls), Output)
        missing = [m for m in methods if getattr(cls, m) is getattr(Output, m)]
        assert not missing, f"{cls.__name__} does not define {missing}"
    assert not isinstance(object(), Output)


def test_an_output_side_is_built_complete(monkeypatch):
    from pyflowbuf._core.channel import BufferQueue
    from pyflowbuf._core.memory import NetworkBufferPool
    from pyflowbuf.exchange.sides import EdgeKind

    nbp = NetworkBufferPool(16, 4096)
    queues = [BufferQueue(nbp) for _ in range(2)]
    side = OutputSide(nbp.create_pool(2, 8), queues, "hash", lambda x: x, EdgeKind("int64"), 1 << 20,
                      max_parallelism=128, consumer="sum", tag="odd", source_node=7, remote=[False, True],
                      key_codec_error=None)
    assert (side.max_parallelism, side.consumer, side.tag, side.source_node, side.remote) == (
        128, "sum", "odd", 7, [False, True])
    side.produced_by("map")
    assert side.producer == "map"
    with pytest.raises(ValueError, match="remote names 1 subpartitions, the side has 2"):
        OutputSide(nbp.create_pool(2, 8), queues, "hash", None, EdgeKind("int64"), 1 << 20, remote=[True])
    # nothing outside exchange/sides.py sets what the constructor takes
    setters = re.compile(r"\b\w+\.(max_parallelism|consumer|tag|source_node|remote|key_codec_error|producer)"
                         r"\s*=[^=]")
    found = []
    for d, _, names in os.walk(os.path.join(ROOT, "pyflowbuf", "runtime")):
        for n in names:
            if n.endswith(".py"):
                with open(os.path.join(d, n), encoding="utf-8") as f:
                    found += [f"{n}:{i}: {line.strip()}" for i, line in enumerate(f, 1)
                              if setters.search(line) and "self." not in line]
    assert not found, found


def test_a_job_runs_every_operator_through_its_declared_parts():
    # a chain of declared parts end to end: uid and node from place(), a
    # keyed reduce, a process function, a window with its timers
    env = fb.Environment(parallelism=2)
    out = (env.from_collection([(i % 3, i, float(i)) for i in range(30)])
           .assign_timestamps(lambda r: r[2], watermark_interval=0)
           .key_by(lambda r: r[0]).reduce(lambda a, b: (a[0], a[1] + b[1], b[2])).uid("r")
           .key_by(lambda r: r[0]).window(fb.Tumbling(10.0)).reduce(lambda a, b: b)
           .collect())
    env.execute(60)
    assert sorted(r[0] for r in out.result) == [0, 0, 0, 1, 1, 1, 2, 2, 2]


# ------------------------------------------------ no probing for a declared part

DECLARED = sorted(set(OPERATOR_PARTS) | set(SOURCE_PARTS) | {
    # OutputSide's, given to its constructor or its declared setup steps
    "max_parallelism", "consumer", "tag", "source_node", "remote", "key_codec_error", "producer",
    "overtaken_listener"})
_PROBE = re.compile(r"\b(?:getattr|hasattr)\((?P<obj>[^,()]+),\s*[\"'](?P<part>%s)[\"']" % "|".join(DECLARED))
# probes of objects that are not the runtime's operators, sources or outputs
_NOT_A_CONTRACT = {
    ("pyflowbuf/runtime/task/event_time.py", "event_time"),     # a graph node's flag (jobgraph)
}


def test_nothing_in_the_package_probes_a_declared_part():
    found = []
    for d, _, names in os.walk(os.path.join(ROOT, "pyflowbuf")):
        for n in names:
            if not n.endswith(".py"):
                continue
            path = os.path.join(d, n)
            rel = os.path.relpath(path, ROOT)
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    for m in _PROBE.finditer(line):
                        if (rel, m["part"]) not in _NOT_A_CONTRACT:
                            found.append(f"{rel}:{i}: {line.strip()}")
    assert not found, ("these parts are declared (operators/contracts.py, connectors/sources.py Source, "
                       "exchange/sides.py OutputSide): read them as attributes\n" + "\n".join(found))


def test_the_probe_scan_sees_a_probe():
    assert _PROBE.search('w = getattr(self.source, "wakeup", None)')
    assert _PROBE.search("if hasattr(op, 'clock'):")
    assert not _PROBE.search('close = getattr(self._it, "close", None)')


# ------------------------------------------------ operators/README.md's table

def test_the_readme_says_where_each_operator_lives():
    """Each row of "Where each API method's operator lives" names a module
    that defines that class, and every public operator class has a row."""
    with open(os.path.join(ROOT, "pyflowbuf", "operators", "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Where each API method's operator lives", 1)[1]
    rows = re.findall(r"^\| (.+?) \| `([\w/]+)\.py` \| `(\w+)` \|$", table, re.M)
    assert len(rows) >= 25
    for method, module, cls in rows:
        mod = importlib.import_module("pyflowbuf." + module.replace("/", "."))
        assert getattr(mod, cls).__module__ == mod.__name__, (method, module, cls)
    public = {c.__name__ for c in OPERATORS if not c.__name__.startswith("_")}
    assert public == {cls for _, _, cls in rows}
