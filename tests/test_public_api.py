"""The public face of the package: what ``pyflowbuf`` exports, the old import
paths that still work for one release, and a docstring on every public
method of the job API."""
from __future__ import annotations

import importlib
import inspect
import warnings

import pytest

import pyflowbuf

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
    for name in ("Environment", "Stream", "KeyedStream", "ConnectedStreams", "CollectSink", "IteratorSink",
                 "Tumbling", "Sliding", "Session", "Count", "Sum", "KeyedProcessFunction", "errors"):
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
