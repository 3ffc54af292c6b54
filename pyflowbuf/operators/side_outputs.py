"""Side outputs in a task: what ``ctx.output(tag, value)`` appends to.

An operator whose node declares side outputs (``process(...,
side_outputs=[tag])``, and every window operator for ``late()``) gets a
``SideOutputs`` from its task. Each declared tag has a buffer when a stream
reads it (``side_output(tag)``) and none when nobody does (its records are
dropped, as Flink drops the records of a tag nobody asked for). The task
ships the buffers to the tag's outputs, ResultPartitions like any other,
after every batch, every watermark and every timer, before any barrier or
end of input can follow: side records are checkpointed and replayed exactly
as main records are.

Operators that declare nothing have no ``SideOutputs`` and their tasks keep
no routes: a stream without side outputs pays nothing for them.
"""
from __future__ import annotations

from pyflowbuf import errors
from pyflowbuf.serializers import kind_label, short_repr

# The side output every window operator declares: its late records
# (WindowResult.late()); a name users cannot declare on a window.
LATE = "late"


class SideOutputs:
    """The side outputs of one operator instance.

    ``routes``: tag name -> (the declared tag, a list that collects its
    records, or None when no stream reads the tag). ``times``: tag name ->
    a list that collects the records' event times, for the tags whose
    stream carries timestamps (a side record keeps the time of the record
    or timer it was made for, as a main output record does)."""

    __slots__ = ("operator", "routes", "times")

    def __init__(self, operator: str, routes: dict, times: dict | None = None):
        self.operator = operator
        self.routes = routes
        self.times = times or None

    def output(self, tag, value, t=None) -> None:
        """Emit ``value`` to side output ``tag``; ``t``: its event time (kept
        where the tag's stream carries timestamps)."""
        try:
            declared, buf = self.routes[tag.name]
        except (KeyError, AttributeError, TypeError):
            raise self.unknown(tag) from None
        if declared is not tag and declared != tag:
            raise self.unknown(tag)
        if buf is not None:
            buf.append(value)
            if self.times is not None:
                times = self.times.get(tag.name)
                if times is not None:
                    times.append(t)

    def times_of(self, name: str):
        """The list collecting tag ``name``'s record times (None: its stream
        carries none, or nobody reads it)."""
        return None if self.times is None else self.times.get(name)

    def buffer(self, name: str):
        """The list collecting tag ``name``'s records (None: nobody reads it)."""
        route = self.routes.get(name)
        return None if route is None else route[1]

    def unknown(self, tag) -> Exception:
        return unknown_tag(self.operator, tag, [t for t, _ in self.routes.values()])


def unknown_tag(operator: str, tag, declared) -> Exception:
    """The error of ``ctx.output(tag, ...)`` for a tag ``operator`` did not
    declare (or for something that is no tag)."""
    names = ", ".join(repr(t) for t in declared) or "none"
    if not hasattr(tag, "name") or not hasattr(tag, "kind"):
        return TypeError(
            f"operator {operator!r}: ctx.output takes an OutputTag and a value, got {short_repr(tag)} "
            f"({type(tag).__name__}) as the tag; its declared side outputs: {names}")
    same = [t for t in declared if t.name == tag.name]
    if same:
        return errors.ConfigurationError(
            f"operator {operator!r}: ctx.output got {tag!r}, but the side output {tag.name!r} it declared "
            f"carries {kind_label(same[0].kind) if same[0].kind is not None else 'an inferred kind'}: "
            "two tags of one name must have one kind; use the declared tag")
    return errors.ConfigurationError(
        f"operator {operator!r}: ctx.output to {tag!r}, which it did not declare; its declared side "
        f"outputs: {names}. Declare every tag it emits to: process(..., side_outputs=[tag, ...])")
