"""The public face of the package: what ``pyflowbuf`` exports, the old import
paths that still work for one release, and a docstring on every public
method of the job API."""
from __future__ import annotations

import importlib
import inspect
import warnings

import pytest

import pyflowbuf
from pyflowbuf import api, config, testing, windows

_CORE = {
    "Buffer": "pyflowbuf._core.memory", "LocalBufferPool": "pyflowbuf._core.memory",
    "NetworkBufferPool": "pyflowbuf._core.memory", "Notifier": "pyflowbuf._core.memory",
    "BufferQueue": "pyflowbuf._core.channel", "InputGate": "pyflowbuf._core.channel",
    "RecordReader": "pyflowbuf._core.serde", "RecordWriter": "pyflowbuf._core.serde",
}


def test_all_holds_the_users_api_and_every_name_resolves():
    for name in pyflowbuf.__all__:
        assert hasattr(pyflowbuf, name), name
    assert not set(_CORE) & set(pyflowbuf.__all__)
    for name in ("Environment", "Stream", "KeyedStream", "ConnectedStreams", "CollectSink", "IteratorSink", "DataSink",
                 "Tumbling", "Sliding", "Session", "Count", "Sum", "KeyedProcessFunction", "errors",
                 "CountWindow", "TumblingProcessingTime", "SlidingProcessingTime", "SessionProcessingTime",
                 "EventTimeTrigger", "ContinuousEventTimeTrigger", "CountTrigger", "PurgingTrigger",
                 "CheckpointConfig", "RestartConfig", "NetworkConfig", "DebloatConfig", "MetricsConfig"):
        assert name in pyflowbuf.__all__, name


def test_star_import_gives_no_core_class():
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("from pyflowbuf import *", ns)
    assert "Environment" in ns and not set(_CORE) & set(ns)


@pytest.mark.parametrize("name", sorted(_CORE))
def test_old_top_level_spelling_still_works_and_warns(name):
    new = getattr(importlib.import_module(_CORE[name]), name)
    with pytest.warns(DeprecationWarning, match=rf"from {_CORE[name]} import {name}"):
        old = getattr(pyflowbuf, name)
    assert old is new
    with pytest.warns(DeprecationWarning) as rec:
        exec(f"from pyflowbuf import {name}", {})
    # the warning points at the line that imports, not into pyflowbuf
    assert rec[0].filename == "<string>"


def test_unknown_attribute_is_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        pyflowbuf.no_such_name  # noqa: B018


# ---- docstrings: every public method says what it does, with an example ----

_DOCUMENTED = [
    api.Environment, api.Stream, api.KeyedStream, api.ConnectedStreams, api.CollectSink, api.IteratorSink,
    api.DataSink,
    windows.TimeWindow, windows.WindowAssigner, windows.Tumbling, windows.Sliding, windows.Session,
    windows.AggregateFunction, windows.Count, windows.Sum, api.WindowedStream, api.WindowResult,
    api.JoinedStreams, api.IntervalJoin, api.OutputTag, testing.OperatorHarness,
    api.AllWindowedStream, windows.TumblingProcessingTime, windows.SlidingProcessingTime,
    windows.SessionProcessingTime, windows.CountWindow, windows.RecordRange, windows.Trigger,
    windows.EventTimeTrigger, windows.ProcessingTimeTrigger, windows.ContinuousEventTimeTrigger,
    windows.CountTrigger, windows.PurgingTrigger, windows.WindowContext,
    config.CheckpointConfig, config.RestartConfig, config.NetworkConfig, config.DebloatConfig, config.MetricsConfig,
]
_OURS = ("pyflowbuf.api", "pyflowbuf.windows", "pyflowbuf.testing", "pyflowbuf.config")


def _public(cls):
    """(name, docstring) of the methods and properties of ``cls`` that
    pyflowbuf defines (not those of object or tuple), inherited ones too."""
    for name in dir(cls):
        if name.startswith("_"):
            continue
        owner = next(k for k in cls.__mro__ if name in vars(k))
        raw = vars(owner)[name]
        if not owner.__module__.startswith(_OURS) or not (callable(raw) or isinstance(raw, property)):
            continue
        yield name, inspect.getdoc(getattr(cls, name))


def _examples(doc: str) -> list:
    """The code of each ``Example::`` block in ``doc``."""
    import textwrap

    out = []
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "Example::":
            continue
        indent = len(line) - len(line.lstrip())
        block = []
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            block.append(nxt)
        out.append(textwrap.dedent("\n".join(block)).strip("\n"))
    return out


@pytest.mark.parametrize("cls", _DOCUMENTED, ids=lambda c: c.__name__)
def test_every_public_method_has_a_docstring_with_an_example(cls):
    assert inspect.getdoc(cls), f"{cls.__name__} has no docstring"
    members = dict(_public(cls))
    missing = sorted(n for n, doc in members.items() if not doc)
    assert not missing, f"{cls.__name__}: no docstring on {missing}"
    no_example = sorted(n for n, doc in members.items() if not _examples(doc))
    assert not no_example, f"{cls.__name__}: no Example:: block in the docstring of {no_example}"


@pytest.mark.parametrize("cls", _DOCUMENTED, ids=lambda c: c.__name__)
def test_docstring_examples_are_python(cls):
    docs = [("", inspect.getdoc(cls))] + list(_public(cls))
    for name, doc in docs:
        for code in _examples(doc or ""):
            assert code, f"{cls.__name__}.{name}: an empty Example:: block"
            compile(code, f"<{cls.__name__}.{name} example>", "exec")
