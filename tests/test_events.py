"""Event codes are defined once (csrc/fb_events.h) and reach Python through
pyflowbuf._core.events; the other modules import them from there."""
import pathlib
import re

from pyflowbuf._core import channel, events
from pyflowbuf.exchange import sides as exchange

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = ("END_OF_PARTITION", "BARRIER", "CANCEL_BARRIER", "END_OF_DATA", "USER_EVENT",
         "EVT_KIND", "EVT_WATERMARK", "BARRIER_UNALIGNED")


def test_event_codes_keep_their_values():
    # they travel over the network and are stored with in-flight input in checkpoints
    assert tuple(getattr(events, n) for n in NAMES) == (0, 1, 4, 8, 16, 17, 18, 1)


def test_event_kinds_are_distinct_and_user_events_above_the_core():
    kinds = [getattr(events, n) for n in NAMES if n != "BARRIER_UNALIGNED"]
    assert len(set(kinds)) == len(kinds)
    assert events.USER_EVENT < events.EVT_KIND and events.USER_EVENT < events.EVT_WATERMARK


def test_old_import_paths_give_the_same_codes():
    for name in ("END_OF_PARTITION", "BARRIER", "CANCEL_BARRIER", "END_OF_DATA", "USER_EVENT",
                 "BARRIER_UNALIGNED"):
        assert getattr(channel, name) == getattr(events, name), name
    assert (exchange.EVT_KIND, exchange.EVT_WATERMARK) == (events.EVT_KIND, events.EVT_WATERMARK)


def test_no_python_module_defines_an_event_code():
    pattern = re.compile(r"^(%s)\s*=" % "|".join(NAMES), re.M)
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "pyflowbuf").rglob("*.py")
                 if pattern.search(p.read_text(encoding="utf-8"))]
    assert offenders == []
