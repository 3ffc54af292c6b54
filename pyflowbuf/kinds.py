"""Record kinds: the ``Serializer`` interface, the seven kinds the C core
encodes itself (``CoreSerializer``), and the registry of named kinds.

``pyflowbuf.serializers`` looks kinds up here (``get_serializer``), loading the
optional batch kinds (``pyflowbuf.serializers_arrow``) the first time an unknown
name is asked for; those register themselves here when imported.
"""
from __future__ import annotations

from typing import Callable

CORE_KINDS = ("bytes", "int64", "float64", "str", "struct", "pickle", "number")


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

    def for_segment_size(self, segment_size: int) -> "Serializer":
        """This kind as it writes into segments of ``segment_size`` bytes. A
        job's output calls it with the job's segment size before it writes,
        so a kind that lays records out by segment (the batch kinds align
        their payloads) follows the job's ``segment_size``, not its own
        default. A kind that does not depend on it returns itself."""
        return self

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


def serializer_factory(name) -> Callable[[], Serializer] | None:
    """The factory registered for kind ``name``, or None."""
    return _REGISTRY.get(name)


def kind_names() -> list:
    """The registered kind names, sorted."""
    return sorted(_REGISTRY)
