"""Output of the command line: tables (rich when installed, aligned plain text
otherwise) and ``--json``."""
from __future__ import annotations

import json
import math
import sys
import time

try:                                    # optional dependency (extra "monitor")
    from rich import box as _box
    from rich.console import Console as _Console
    from rich.table import Table as _Table
    from rich.text import Text as _Text
except ImportError:                     # pragma: no cover - exercised only without rich
    _Console = None


def size(n) -> str:
    """Bytes for people: 512 B, 1.5 KiB, 3.2 MiB."""
    if n is None:
        return ""
    n = int(n)
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    return str(n)  # pragma: no cover


def when(t) -> str:
    """Epoch seconds as local time."""
    if t is None or not isinstance(t, (int, float)) or not math.isfinite(t):
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def seconds(s) -> str:
    if s is None or not isinstance(s, (int, float)):
        return ""
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def value(v) -> str:
    """A field this version does not know, compactly: a [lo, hi] pair as
    ``lo..hi`` (key-group ranges), containers as JSON."""
    if v is None:
        return ""
    if isinstance(v, (list, tuple)) and len(v) == 2 and all(type(x) is int for x in v):
        return f"{v[0]}..{v[1]}"
    if isinstance(v, (list, tuple, dict)):
        return json.dumps(v, default=str, separators=(",", ":"))
    return str(v)


def emit_json(obj, out=None) -> None:
    """One JSON object on one line (after whatever a job printed, for ``run``)."""
    out = out or sys.stdout
    out.write(json.dumps(obj, default=str) + "\n")
    out.flush()


def table(title: str | None, columns: list, rows: list, out=None) -> None:
    """``columns``: (header, "left" | "right") pairs; ``rows``: lists of str."""
    out = out or sys.stdout
    if _Console is not None:
        # a pipe or a file gets every character of every cell: no width limit to wrap or cut at
        tty = hasattr(out, "isatty") and out.isatty()
        console = _Console(file=out, width=None if tty else 1000, highlight=False, soft_wrap=not tty)
        t = _Table(title=title, box=_box.SIMPLE_HEAD, title_justify="left", show_edge=False)
        for header, justify in columns:
            t.add_column(header, justify=justify, overflow="fold", no_wrap=not tty)
        for row in rows:
            t.add_row(*[_Text(c) for c in row])   # cells are data, not markup
        console.print(t)
        return
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, (h, _) in enumerate(columns)]

    def line(cells):
        return "  ".join(c.rjust(w) if j == "right" else c.ljust(w)
                         for c, w, (_, j) in zip(cells, widths, columns)).rstrip()
    if title:
        out.write(title + "\n")
    out.write(line([h for h, _ in columns]) + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for r in rows:
        out.write(line(r) + "\n")


def lines(pairs: list, out=None) -> None:
    """``name: value`` lines, aligned."""
    out = out or sys.stdout
    width = max((len(k) for k, _ in pairs), default=0)
    for k, v in pairs:
        out.write(f"{k + ':':<{width + 1}} {v}\n")

