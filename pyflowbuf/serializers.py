"""Serializers: how records of a typed stream become bytes in segments.

The core (RecordWriter/RecordReader) encodes five kinds in C, a batch per
call: ``bytes``, ``int64``, ``float64``, ``str`` and ``pickle``. Other kinds
(Arrow RecordBatches, pandas DataFrames, NumPy arrays) are Serializer objects
that turn a batch of records into bytes-like objects for the ``bytes`` kind and
back; the reader hands them zero-copy views when ``zero_copy_min`` is 0.
"""
from __future__ import annotations

from typing import Any, Callable

CORE_KINDS = ("bytes", "int64", "float64", "str", "pickle")


class Serializer:
    """Base class. Subclasses set ``name`` and override the batch methods.

    core_kind
        The C kind the encoded records travel as.
    zero_copy_min
        Reader setting: records at least this large come as memoryviews over
        the segment (0: always), so a decoder can wrap them without a copy.
    in_process_only
        True when decoding bytes from elsewhere would be unsafe (pickle): the
        network layer refuses such streams unless the user opts in.
    """

    name = "bytes"
    core_kind = "bytes"
    zero_copy_min = 4096
    in_process_only = False

    def encode_batch(self, records: list) -> list:
        return records

    def decode_batch(self, records: list) -> list:
        return records

    def __repr__(self):
        return f"{type(self).__name__}()"


class CoreSerializer(Serializer):
    """A kind the C core encodes itself; encode/decode are identities."""

    def __init__(self, kind: str):
        if kind not in CORE_KINDS:
            raise ValueError(f"kind must be one of {CORE_KINDS}, got {kind!r}")
        self.name = self.core_kind = kind
        self.in_process_only = kind == "pickle"

    def __repr__(self):
        return f"CoreSerializer({self.name!r})"


_REGISTRY: dict[str, Callable[[], Serializer]] = {k: (lambda k=k: CoreSerializer(k)) for k in CORE_KINDS}


def register_serializer(name: str, factory: Callable[[], Serializer]) -> None:
    """Make ``kind=name`` available to streams."""
    _REGISTRY[name] = factory


def get_serializer(kind: Any) -> Serializer:
    """A Serializer for ``kind``: a registered name or a Serializer instance."""
    if isinstance(kind, Serializer):
        return kind
    if kind in _REGISTRY:
        return _REGISTRY[kind]()
    _load_optional()
    if kind in _REGISTRY:
        return _REGISTRY[kind]()
    raise ValueError(f"unknown record kind {kind!r}; known: {sorted(_REGISTRY)} or a Serializer instance")


def _load_optional() -> None:
    """Register serializers whose dependencies are optional (pyarrow, pandas)."""
    try:
        from pyflowbuf import serializers_arrow  # noqa: F401  (registers on import)
    except ImportError:
        pass


def infer_kind(value: Any) -> str:
    """The kind a stream of ``value``-like records should use."""
    if isinstance(value, bool):
        return "pickle"
    if isinstance(value, int):
        return "int64" if -(1 << 63) <= value < (1 << 63) else "pickle"
    if isinstance(value, float):
        return "float64"
    if isinstance(value, str):
        return "str"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes"
    mod = type(value).__module__
    if mod.startswith("pyarrow"):
        return "arrow"
    if mod.startswith("pandas"):
        return "pandas"
    if mod.startswith("numpy"):
        return "numpy"
    return "pickle"
