"""``OutputTag``: the name and kind of a side output, and the checks of the
declarations that use tags (``process(..., side_outputs=[...])``,
``stream.side_output(tag)``)."""
from __future__ import annotations

from typing import Any

from pyflowbuf.errors import ConfigurationError
from pyflowbuf._validation import _check_kind, _kind_identity
from pyflowbuf.operators.side_outputs import LATE
from pyflowbuf.serializers import kind_label


class OutputTag:
    """A side output: a second (third, ...) stream a ``process`` function
    emits to besides its main output, with ``ctx.output(tag, value)``
    (Flink's ``OutputTag``).

    ``name`` identifies the side output within its operator; ``kind``
    declares its record kind as ``kind=`` does for ``map`` (None: inferred
    from its first record). Two tags are equal when name and kind are; two
    tags of one name and different kinds are refused where they meet.

    The operator declares the tags it emits to (``side_outputs=[tag, ...]``)
    and ``stream.side_output(tag)`` is the stream of a tag's records: they
    are checkpointed, exactly once, like any output. A declared tag nobody
    reads drops its records. As in PyFlink, a process function that takes
    a ctx need not declare its tags: declaring none, ``side_output(tag)``
    (or ``get_side_output(tag)``) declares the tag it asks for; declaring
    some, only those are its side outputs. ``ctx.output`` to a tag
    neither declared nor asked for fails the job.

    Example::

        import pyflowbuf as fb

        env = fb.Environment()
        odd = fb.OutputTag("odd", kind="int64")

        def split(x, ctx):
            if x % 2:
                ctx.output(odd, x)
            else:
                yield x

        evens = env.from_sequence(0, 10).process(split, side_outputs=[odd])
        even_out = evens.collect()
        odd_out = evens.side_output(odd).collect()
        env.execute()
        assert sorted(odd_out.result) == [1, 3, 5, 7, 9]
    """

    __slots__ = ("name", "kind", "_identity", "_hash")

    def __init__(self, name: str, kind: Any = None):
        if not isinstance(name, str) or not name:
            raise ConfigurationError(f"OutputTag takes a non-empty name (a str), got {name!r}")
        self.name = name
        self.kind = _check_kind(kind, f"OutputTag {name!r}")
        self._identity = None if kind is None else _kind_identity(kind)
        self._hash = hash(name)

    def __eq__(self, other):
        if self is other:
            return True
        if not isinstance(other, OutputTag):
            return NotImplemented
        return self.name == other.name and self._identity == other._identity

    def __hash__(self):
        return self._hash

    def __repr__(self):
        kind = "" if self.kind is None else f", kind={kind_label(self.kind)}"
        return f"OutputTag({self.name!r}{kind})"

    def __reduce__(self):
        return (OutputTag, (self.name, self.kind))


# the side output of every window operator, which a window's result.late() reads
LATE_TAG = OutputTag(LATE)


def declare_side_outputs(tags, what: str, *, reserved=()) -> dict:
    """``side_outputs=`` of a process declaration, checked: name -> tag."""
    if tags is None:
        return {}
    if isinstance(tags, OutputTag):
        tags = [tags]
    try:
        tags = list(tags)
    except TypeError:
        raise TypeError(f"{what}: side_outputs takes a list of OutputTag, got {type(tags).__name__}") from None
    out: dict = {}
    for tag in tags:
        if not isinstance(tag, OutputTag):
            raise TypeError(f"{what}: side_outputs takes OutputTag objects (fb.OutputTag(name, kind=...)), "
                            f"got {tag!r}")
        if tag.name in reserved:
            raise ConfigurationError(f"{what}: the side output name {tag.name!r} is reserved ({reserved[tag.name]}); "
                                     "choose another name")
        known = out.get(tag.name)
        if known is not None and known != tag:
            raise ConfigurationError(
                f"{what}: two side outputs named {tag.name!r} with different kinds ({_kind_text(known)} and "
                f"{_kind_text(tag)}): a name stands for one side output; rename one")
        out[tag.name] = tag
    return out


def _kind_text(tag) -> str:
    return "an inferred kind" if tag.kind is None else kind_label(tag.kind)


def declared_tag(node, tag, what: str):
    """The tag of ``node``'s side outputs that ``side_output(tag)`` names."""
    if not isinstance(tag, OutputTag):
        raise TypeError(f"{what} takes an OutputTag (fb.OutputTag(name, kind=...)), got {tag!r}")
    tags = node.side_tags
    if tags is None:
        raise ConfigurationError(
            f"{what}: {node.name!r} cannot emit side outputs: only process functions can "
            "(Stream.process, KeyedStream.process, a window's process, a keyed connect(...).process), "
            f"declared with side_outputs=[{tag!r}]; a window's late records are result.late()")
    window = node.window_late
    if window and tag.name == LATE:
        raise ConfigurationError(f"{what}: the late records of the window {node.name!r} are result.late()")
    known = tags.get(tag.name)
    if known is None and node.open_tags:
        # PyFlink's habit: ctx.output(tag, ...) with no declaration; asking
        # for the tag's stream declares it (before the job runs, so the
        # operator's ctx.output finds its route)
        tags[tag.name] = tag
        return tag
    if known is None:
        declared = [t for n, t in tags.items() if not (window and n == LATE)]
        raise ConfigurationError(
            f"{what}: {node.name!r} did not declare the side output {tag!r} (it declares "
            f"{', '.join(map(repr, declared)) or 'none'}): pass side_outputs=[..., {tag!r}] to its process()")
    if known != tag:
        raise ConfigurationError(
            f"{what}: {node.name!r} declares the side output {tag.name!r} with {_kind_text(known)}, "
            f"not {_kind_text(tag)}: two tags of one name must have one kind; use the declared tag")
    return known
