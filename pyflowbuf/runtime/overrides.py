"""Environment settings imposed from outside the job's code: ``pyflowbuf run
--parallelism N --workers N`` (pyflowbuf/cli) loads a job module inside
``overriding(...)``, and every Environment built meanwhile takes those values
over the ones its code passed.

They must be in place when the Environment is built, not later: an operator's
parallelism is fixed when the operator is declared (``map(..., parallelism=None)``
reads the Environment's default then, and the forward/rebalance choice of its
input follows from it), so changing ``Environment.parallelism`` after the streams are
declared would change nothing, or only some of them."""
from __future__ import annotations

import contextlib
import contextvars

# the settings an override may name: read by Environment.__init__ only
OVERRIDABLE = ("parallelism", "workers")

_CURRENT: contextvars.ContextVar[dict] = contextvars.ContextVar("pyflowbuf_environment_overrides", default={})


def current() -> dict:
    """The overrides in force in this context (a copy; empty outside ``overriding``)."""
    return dict(_CURRENT.get())


@contextlib.contextmanager
def overriding(**settings):
    """Every Environment built inside the block takes ``settings`` (a subset of
    ``OVERRIDABLE``; a None value leaves that setting to the job)."""
    unknown = set(settings) - set(OVERRIDABLE)
    if unknown:
        raise TypeError(f"cannot override {sorted(unknown)}: only {OVERRIDABLE}")
    token = _CURRENT.set({k: v for k, v in settings.items() if v is not None})
    try:
        yield
    finally:
        _CURRENT.reset(token)
