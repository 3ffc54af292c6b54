"""Configuration objects: the settings of an ``Environment``, grouped by
concern, each a frozen dataclass that checks itself when it is made.

    import pyflowbuf as fb

    environment = fb.Environment(
        parallelism=2,
        checkpoint=fb.CheckpointConfig(interval=1.0, directory="checkpoints"),
        restart=fb.RestartConfig(attempts=3),
        network=fb.NetworkConfig(buffer_timeout=0.01),
    )
    environment.checkpoint_config.interval    # 1.0; environment.checkpoint_interval reads the same field

Each setting has one home (a field of one object) and, for the jobs written
before these objects, a flat keyword of ``Environment`` (``FLAT``:
``checkpoint_interval`` is ``CheckpointConfig.interval``). A setting given both
ways is refused. The runtime reads the objects' fields; this module imports
nothing of the runtime or the API, so every layer can import it.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
import sys
import warnings
from hashlib import blake2b
from dataclasses import dataclass
from typing import Any

from pyflowbuf._core.memory import DEFAULT_SEGMENT_SIZE, MAX_SEGMENT_SIZE, MIN_SEGMENT_SIZE
from pyflowbuf.errors import ConfigurationError, UnitWarning

CHECKPOINTING_MODES = ("exactly_once", "at_least_once")
ALIGNMENTS = ("aligned", "unaligned")

# Where a job's checkpoints go when no directory is given: a directory per job
# below this one (``checkpoints/<job name>``), as Flink keeps each job's under
# its job id. The name, not a fresh id, so that the next run of the job (its
# ``restore_from="latest"``) finds them.
DEFAULT_CHECKPOINT_DIR = "checkpoints"

_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.-]")
_RESERVED_NAME = re.compile(r"^(chk-[0-9]+|savepoints)$")


def job_directory_name(job_name: str) -> str:
    """The directory a job's checkpoints get under ``checkpoints/`` by
    default: its name where the name is a plain, safe file name; otherwise
    the name's safe characters and a hash of the whole name, so that two
    names never share a directory and no name leaves it (``..``, ``/``).

    Example::

        job_directory_name("payments")      # 'payments'
        job_directory_name("clicks/v2")     # 'clicks_v2-' + 12 hex digits
    """
    safe = _UNSAFE_NAME.sub("_", job_name).strip("._-")[:64]
    if safe == job_name and not _RESERVED_NAME.match(safe):
        return safe
    digest = blake2b(job_name.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
    return f"{safe or 'job'}-{digest}"


def default_checkpoint_dir(job_name: str) -> str:
    """``checkpoints/<job_directory_name(job_name)>``: where the checkpoints of
    a job that names no ``checkpoint_dir`` go (relative to the working
    directory, as ``checkpoints`` always was)."""
    return f"{DEFAULT_CHECKPOINT_DIR}/{job_directory_name(job_name)}"

# ---- the argument checks every layer shares ----


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _positive_int(name, v):
    if not _int(v) or v < 1:
        raise ConfigurationError(f"{name} must be a positive int, got {v!r}")


def _seconds(name, v, *, zero=False, none=False, what="seconds"):
    if v is None and none:
        return
    ok = _number(v) and not math.isnan(v) and (0 <= v if zero else 0 < v) and v < math.inf
    if not ok:
        bound = ">= 0" if zero else "> 0"
        raise ConfigurationError(f"{name} must be {'None or ' if none else ''}{what} {bound}, got {v!r}")


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel for the first frame outside pyflowbuf (the
    user's ``Environment(...)`` or ``CheckpointConfig(...)`` line)."""
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = sys._getframe(2), 2

    def ours(f):        # pyflowbuf, or the dataclass machinery that makes a config object
        return f.f_code.co_filename.startswith(root) or f.f_code.co_filename == dataclasses.__file__ or (
            f.f_code.co_name == "__init__" and isinstance(f.f_locals.get("self"), _Config))
    while frame is not None and ours(frame):
        frame, level = frame.f_back, level + 1
    return level


class _Config:
    """What the configuration objects share: ``name(field)`` for messages,
    the milliseconds warning, and ``replace``."""

    # field -> the value from which it only makes sense as milliseconds
    # (Flink's unit for all of them): 1000 is "1 s" in Flink and "17 minutes"
    # here. A user who does mean that many seconds can filter UnitWarning.
    _SECONDS: dict = {}

    def _name(self, field: str) -> str:
        """``checkpoint_interval (CheckpointConfig.interval)``: both spellings."""
        flat = _FLAT_OF.get((type(self), field))
        own = f"{type(self).__name__}.{field}"
        return own if flat is None else f"{flat} ({own})"

    def _warn_milliseconds(self) -> None:
        for field, limit in self._SECONDS.items():
            v = getattr(self, field)
            if v is not None and v >= limit:
                warnings.warn(UnitWarning(
                    f"{self._name(field)}={v!r} is in seconds ({v / 60:.4g} minutes); values this large are "
                    f"usually milliseconds: for {v / 1000:g} s pass {v / 1000:g}. (If you mean seconds, "
                    "filter pyflowbuf.errors.UnitWarning.)"), stacklevel=_caller_stacklevel())

    def replace(self, **changes):
        """A copy with ``changes`` (checked as a new object is).

        Example::

            fast = fb.NetworkConfig().replace(buffer_timeout=0.001)
        """
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class CheckpointConfig(_Config):
    """Checkpoints (Flink's asynchronous barrier snapshots); off while
    ``interval`` is None. See docs/checkpoints.md.

    Parameters
    ----------
    interval : seconds between checkpoints; None: no checkpoints.
    directory : where the job's checkpoints go, a path or an fsspec URL, used
        as it is; one job at a time holds it (a lock), and a restore refuses
        another job's checkpoints there. None (default): a directory of the
        job's own, ``checkpoints/<job name>`` (``job_directory_name``); the
        Environment reports it (``Environment.checkpoint_dir``) once checkpoints are on.
    timeout : seconds after which a checkpoint that has not completed expires.
    retained : complete checkpoints kept (older ones are removed).
    mode : ``"exactly_once"`` (barriers aligned) or ``"at_least_once"``
        (Flink's CheckpointingMode).
    alignment : ``"aligned"`` (barriers wait behind queued data) or
        ``"unaligned"`` (barriers overtake it and the checkpoint stores it;
        needs exactly-once).
    alignment_timeout : with ``"unaligned"``, start each checkpoint aligned
        and switch it to unaligned after this many seconds (Flink's aligned
        checkpoint timeout); None or 0: unaligned from the start.
    incremental : write only the key groups of keyed state that changed since
        the last checkpoint and refer to earlier checkpoints for the rest
        (default True; savepoints are always whole, self-contained copies).

    Example::

        import pyflowbuf as fb

        env = fb.Environment(checkpoint=fb.CheckpointConfig(interval=1.0, directory="checkpoints",
                                                            alignment="unaligned", alignment_timeout=0.5))
    """

    interval: float | None = None
    directory: str | os.PathLike | None = None
    timeout: float = 600.0
    retained: int = 2
    mode: str = "exactly_once"
    alignment: str = "aligned"
    alignment_timeout: float | None = None
    incremental: bool = True

    _SECONDS = {"interval": 1000, "timeout": 100_000, "alignment_timeout": 1000}

    def __post_init__(self):
        n = self._name
        if self.interval is not None:
            _seconds(n("interval"), self.interval, what="None (off) or seconds")
        _seconds(n("timeout"), self.timeout)
        _positive_int(n("retained"), self.retained)
        if self.mode not in CHECKPOINTING_MODES:
            raise ConfigurationError(f"{n('mode')} must be one of {CHECKPOINTING_MODES}, got {self.mode!r}")
        if self.alignment not in ALIGNMENTS:
            raise ConfigurationError(f"{n('alignment')} must be one of {ALIGNMENTS}, got {self.alignment!r}")
        _seconds(n("alignment_timeout"), self.alignment_timeout, zero=True, none=True)
        if self.alignment_timeout is not None and self.alignment != "unaligned":
            raise ConfigurationError(
                f"{n('alignment_timeout')} switches a checkpoint from aligned to unaligned: it needs "
                f"{n('alignment')}='unaligned' (with alignment_timeout=0 every checkpoint is unaligned "
                "from the start)")
        if self.alignment == "unaligned" and self.mode != "exactly_once":
            raise ConfigurationError(
                f"{n('alignment')}='unaligned' needs {n('mode')}='exactly_once' (at-least-once "
                "checkpoints never block a channel, so there is nothing to overtake)")
        if self.directory is not None and not isinstance(self.directory, (str, os.PathLike)):
            raise ConfigurationError(f"{n('directory')} must be a path or an fsspec URL, got {self.directory!r}")
        if not isinstance(self.incremental, bool):
            raise ConfigurationError(f"{n('incremental')} must be True or False, got {self.incremental!r}")
        self._warn_milliseconds()

    @property
    def enabled(self) -> bool:
        """Whether checkpoints are taken (an interval is set).

        Example::

            fb.CheckpointConfig(interval=1.0).enabled     # True
        """
        return self.interval is not None


@dataclass(frozen=True)
class RestartConfig(_Config):
    """Recovery after a failure: restore the latest complete checkpoint and
    run on, up to ``attempts`` times per job (Flink's fixed restart
    strategy, without delay). Needs checkpoints.

    Example::

        env = fb.Environment(checkpoint=fb.CheckpointConfig(interval=1.0),
                             restart=fb.RestartConfig(attempts=3))
    """

    attempts: int = 0

    def __post_init__(self):
        if not _int(self.attempts) or self.attempts < 0:
            raise ConfigurationError(f"{self._name('attempts')} must be an int >= 0, got {self.attempts!r}")


@dataclass(frozen=True)
class NetworkConfig(_Config):
    """Memory and the exchange: segments, buffers, flushing, records, TCP.

    Parameters
    ----------
    segment_size : bytes per memory segment (power of two, 256 B .. 1 MiB).
    num_segments : size of the NetworkBufferPool; None: enough for every
        output pool at its cap, so memory is bounded by construction.
    buffer_timeout : seconds after which a partly filled buffer is shipped
        (Flink's execution.buffer-timeout); 0 ships per record.
    output_buffers : (min, max) segments per output pool; None: Flink's
        (subpartitions + 1, 2 * subpartitions + 8).
    max_record_size : bytes a serialized record may take (< 2**32).
    credit_based : False uses the pre-credit mode (TCP window only), to compare.
    bind_host : interface the workers' exchange listens on (loopback by default).

    Example::

        env = fb.Environment(network=fb.NetworkConfig(segment_size=4096, buffer_timeout=0.01))
    """

    segment_size: int = DEFAULT_SEGMENT_SIZE
    num_segments: int | None = None
    buffer_timeout: float = 0.1
    output_buffers: tuple | None = None
    max_record_size: int = 64 * 1024 * 1024
    credit_based: bool = True
    bind_host: str = "127.0.0.1"

    _SECONDS = {"buffer_timeout": 10}

    def __post_init__(self):
        n = self._name
        ss = self.segment_size
        _positive_int(n("segment_size"), ss)
        if ss & (ss - 1) or not MIN_SEGMENT_SIZE <= ss <= MAX_SEGMENT_SIZE:
            raise ConfigurationError(f"{n('segment_size')} must be a power of two between {MIN_SEGMENT_SIZE} and "
                                     f"{MAX_SEGMENT_SIZE}, got {ss}")
        if self.num_segments is not None:
            _positive_int(n("num_segments"), self.num_segments)
        _seconds(n("buffer_timeout"), self.buffer_timeout, zero=True)
        object.__setattr__(self, "buffer_timeout", float(self.buffer_timeout))
        ob = self.output_buffers
        if ob is not None:
            if not isinstance(ob, (tuple, list)) or len(ob) != 2:
                raise ConfigurationError(f"{n('output_buffers')} must be a (min, max) pair, got {ob!r}")
            lo, hi = ob
            _positive_int(f"{n('output_buffers')} max", hi)
            if not _int(lo) or not 0 <= lo <= hi:
                raise ConfigurationError(
                    f"{n('output_buffers')} must be (min, max) with 0 <= min <= max, got {ob!r}")
            object.__setattr__(self, "output_buffers", (lo, hi))
        _positive_int(n("max_record_size"), self.max_record_size)
        if self.max_record_size >= 1 << 32:
            raise ConfigurationError(f"{n('max_record_size')} must be < 2**32, got {self.max_record_size}")
        if not isinstance(self.bind_host, str) or not self.bind_host:
            raise ConfigurationError(f"{n('bind_host')} must be a host name or address, got {self.bind_host!r}")
        self._warn_milliseconds()


@dataclass(frozen=True)
class DebloatConfig(_Config):
    """Buffer debloating: in-flight data sized by time, and pool memory given
    back (see docs/pipelines.md, "Buffer debloating"). An Environment
    debloats when given a DebloatConfig (``enabled`` is True unless said
    otherwise) or ``debloat=True``; by default it does not, as in Flink.

    Parameters
    ----------
    enabled : debloat the job's input gates.
    target : seconds of in-flight data on a path from a source to a sink:
        each input gate holds throughput x target / N, N the exchanges of
        the longest path through it, since an aligned barrier crosses them
        one after another (Flink gives each gate the whole target).
    period : seconds between measurements.
    samples : measurements the buffer size's moving average spans.
    threshold : the fraction a new size must differ by to be announced.
    min_buffer_size : the smallest buffer size, in bytes (<= segment_size).

    Example::

        env = fb.Environment(debloat=fb.DebloatConfig(target=0.5, period=0.1))
    """

    enabled: bool = True
    target: float = 1.0
    period: float = 0.2
    samples: int = 20
    threshold: float = 0.25
    min_buffer_size: int = 256

    _SECONDS = {"target": 100, "period": 60}

    def __post_init__(self):
        n = self._name
        if not isinstance(self.enabled, bool):
            raise ConfigurationError(f"{n('enabled')} must be True or False, got {self.enabled!r}")
        _seconds(n("target"), self.target, what="a number of seconds")
        _seconds(n("period"), self.period, what="a number of seconds")
        if not _int(self.samples) or self.samples < 1:
            raise ConfigurationError(f"{n('samples')} must be an int >= 1, got {self.samples!r}")
        t = self.threshold
        if not _number(t) or math.isnan(t) or not 0 <= t <= 1:
            raise ConfigurationError(f"{n('threshold')} must be a fraction in [0, 1] (0.25 = 25 %), got {t!r}")
        m = self.min_buffer_size
        if not _int(m) or m < 1:
            raise ConfigurationError(f"{n('min_buffer_size')} must be an int >= 1 (bytes), got {m!r}")
        self._warn_milliseconds()


@dataclass(frozen=True)
class MetricsConfig(_Config):
    """Where the job's metric samples go (see docs/monitoring.md). With
    workers, the calling process serves them.

    Parameters
    ----------
    interval : seconds between samples.
    log : a file that each sample is appended to, as a JSON line.
    prometheus_port : serve Prometheus gauges on 127.0.0.1 at this port (0:
        a free one, which ``job.prometheus_port`` gives).
    live_view : a live table in the terminal.
    ui_port : serve the web view of the job (graph, backpressure, checkpoints,
        watermarks; pyflowbuf.ui) at this port (0: a free one, ``job.ui_url``
        gives the URL). None (default): no view.
    ui_host : the address the web view binds: 127.0.0.1 by default; any other
        exposes it to the network and puts an access token in its URL.

    Example::

        env = fb.Environment(metrics=fb.MetricsConfig(interval=0.5, log="metrics.jsonl"))
    """

    interval: float = 1.0
    log: str | os.PathLike | None = None
    prometheus_port: int | None = None
    live_view: bool = False
    ui_port: int | None = None
    ui_host: str = "127.0.0.1"

    _SECONDS = {"interval": 1000}

    def __post_init__(self):
        _seconds(self._name("interval"), self.interval)
        port = self.prometheus_port
        if port is not None and (not _int(port) or not 0 <= port <= 65535):
            raise ConfigurationError(
                f"{self._name('prometheus_port')} must be an int in 0..65535 (0: a free port), got {port!r}")
        if self.log is not None and not isinstance(self.log, (str, os.PathLike)):
            raise ConfigurationError(f"{self._name('log')} must be a path, got {self.log!r}")
        port = self.ui_port
        if port is not None and (not _int(port) or not 0 <= port <= 65535):
            raise ConfigurationError(
                f"{self._name('ui_port')} must be an int in 0..65535 (0: a free port), got {port!r}")
        if not isinstance(self.ui_host, str) or not self.ui_host:
            raise ConfigurationError(f"{self._name('ui_host')} must be a host name or address, got {self.ui_host!r}")
        self._warn_milliseconds()


# ---- the Environment's keywords ----

# keyword of Environment -> (its config class, the Environment attribute that holds it)
GROUPS = {
    "checkpoint": (CheckpointConfig, "checkpoint_config"),
    "restart": (RestartConfig, "restart_config"),
    "network": (NetworkConfig, "network_config"),
    "debloat": (DebloatConfig, "debloat_config"),
    "metrics": (MetricsConfig, "metrics_config"),
}

# flat keyword of Environment -> (group, field)
FLAT = {
    "segment_size": ("network", "segment_size"), "num_segments": ("network", "num_segments"),
    "buffer_timeout": ("network", "buffer_timeout"), "output_buffers": ("network", "output_buffers"),
    "max_record_size": ("network", "max_record_size"), "credit_based": ("network", "credit_based"),
    "bind_host": ("network", "bind_host"),
    "metrics_interval": ("metrics", "interval"), "metrics_log": ("metrics", "log"),
    "prometheus_port": ("metrics", "prometheus_port"), "live_view": ("metrics", "live_view"),
    "ui_port": ("metrics", "ui_port"), "ui_host": ("metrics", "ui_host"),
    "checkpoint_interval": ("checkpoint", "interval"), "checkpoint_dir": ("checkpoint", "directory"),
    "checkpoint_timeout": ("checkpoint", "timeout"), "checkpoints_retained": ("checkpoint", "retained"),
    "checkpointing_mode": ("checkpoint", "mode"), "checkpoint_alignment": ("checkpoint", "alignment"),
    "alignment_timeout": ("checkpoint", "alignment_timeout"), "incremental_checkpoints": ("checkpoint", "incremental"),
    "restart_attempts": ("restart", "attempts"),
    "debloat": ("debloat", "enabled"), "debloat_target": ("debloat", "target"),
    "debloat_period": ("debloat", "period"), "debloat_samples": ("debloat", "samples"),
    "debloat_threshold": ("debloat", "threshold"), "min_buffer_size": ("debloat", "min_buffer_size"),
}
# old spelling -> new one, kept for one release with a DeprecationWarning.
# checkpoint_mode ("aligned" / "unaligned") sat next to checkpointing_mode
# (exactly-once / at-least-once, Flink's CheckpointingMode): two settings
# whose names differ by three letters.
DEPRECATED = {"checkpoint_mode": "checkpoint_alignment"}

_FLAT_OF = {(GROUPS[g][0], f): flat for flat, (g, f) in FLAT.items()}
# what an Environment holds when a group is not given: debloating is off
DEFAULTS = {"checkpoint": CheckpointConfig(), "restart": RestartConfig(), "network": NetworkConfig(),
            "debloat": DebloatConfig(enabled=False), "metrics": MetricsConfig()}


class _Unset:
    """The default of a keyword that was not given (its value comes from the
    config object, or the object's default)."""

    def __repr__(self):
        return "<default>"

    def __reduce__(self):
        return "UNSET"


UNSET: Any = _Unset()


def resolve(groups: dict, flat: dict) -> dict:
    """The config object of every group from ``groups`` (keyword -> object or
    None; ``debloat`` may also be a bool) and the flat keywords that were
    given (``flat``: name -> value, deprecated spellings included). A setting
    given both as a field of an object and as a flat keyword is refused."""
    flat = dict(flat)
    for old, new in DEPRECATED.items():
        if old in flat:
            warnings.warn(f"Environment({old}=...) is deprecated and will be removed in the next release: "
                          f"use {new}= (or {_field_spelling(new)})", DeprecationWarning,
                          stacklevel=_caller_stacklevel())
            if new in flat:
                raise ConfigurationError(f"{old}= and {new}= are one setting: give only {new}=")
            flat[new] = flat.pop(old)
    debloat = groups.get("debloat")
    if isinstance(debloat, bool):       # debloat=True: the flat switch, not an object
        if "debloat" in flat:
            raise ConfigurationError("debloat given twice")
        flat["debloat"] = debloat
        groups = {**groups, "debloat": None}
    out = {}
    for group, (cls, _) in GROUPS.items():
        given = groups.get(group)
        fields = {FLAT[name][1]: v for name, v in flat.items() if FLAT[name][0] == group}
        if given is None:
            out[group] = DEFAULTS[group].replace(**fields) if fields else DEFAULTS[group]
            continue
        if not isinstance(given, cls):
            what = "True, False or a pyflowbuf.DebloatConfig" if group == "debloat" else f"a pyflowbuf.{cls.__name__}"
            raise ConfigurationError(f"{group}= takes {what}, got {given!r}")
        if fields:
            both = ", ".join(f"{_FLAT_OF[cls, f]}= (its {f})" for f in sorted(fields))
            raise ConfigurationError(
                f"Environment got {group}={cls.__name__}(...) and also {both}: one setting, given twice; "
                f"set it in the {cls.__name__} only")
        out[group] = given
    tuned = sorted(name for name in flat if FLAT[name][0] == "debloat" and name != "debloat")
    if tuned and not out["debloat"].enabled:
        # tuning a switched-off mechanism is almost always a forgotten debloat=True
        warnings.warn(f"Environment({', '.join(n + '=...' for n in tuned)}) tunes buffer debloating, which is off: "
                      "pass debloat=True as well (or drop the setting)", UserWarning,
                      stacklevel=_caller_stacklevel())
    return out


def _field_spelling(flat: str) -> str:
    group, field = FLAT[flat]
    return f"{group}={GROUPS[group][0].__name__}({field}=...)"


def check_together(network: NetworkConfig, debloat: DebloatConfig) -> None:
    """Settings of two objects that must agree."""
    if debloat.min_buffer_size > network.segment_size:
        raise ConfigurationError(
            f"min_buffer_size ({debloat.min_buffer_size}) must be <= segment_size ({network.segment_size}): "
            "a buffer is at most one segment")


class FlatSetting:
    """An Environment attribute under its flat name (``Environment.checkpoint_interval``),
    read from and written to the field of the config object that holds it.
    Writing replaces the object by a copy (checked as a new object is)."""

    def __init__(self, group: str, field: str, deprecated_as: str | None = None):
        self.attr = GROUPS[group][1]
        self.field = field
        self.deprecated_as = deprecated_as
        self.__doc__ = f"``{self.attr}.{field}`` ({GROUPS[group][0].__name__}.{field})"

    def __set_name__(self, owner, name):
        self.name = name

    def _warn(self):
        if self.deprecated_as is not None:
            warnings.warn(f"Environment.{self.name} is deprecated and will be removed in the next release: use "
                          f"{self.deprecated_as}", DeprecationWarning, stacklevel=3)

    def __get__(self, owner_obj, owner=None):
        if owner_obj is None:
            return self
        self._warn()
        return getattr(getattr(owner_obj, self.attr), self.field)

    def __set__(self, owner_obj, value):
        self._warn()
        if self.attr == "debloat_config" and isinstance(value, DebloatConfig):   # Environment.debloat = DebloatConfig()
            setattr(owner_obj, self.attr, value)
        else:
            # the object as given, not as read back: a default checkpoint
            # directory stays "the job's own" (it follows a later job name)
            held = vars(owner_obj).get("_given_" + self.attr) or getattr(owner_obj, self.attr)
            setattr(owner_obj, self.attr, held.replace(**{self.field: value}))


def flat_settings(cls):
    """Class decorator: every flat keyword (and deprecated spelling) becomes
    an attribute of ``cls`` that reads its config object's field."""
    for name, (group, field) in FLAT.items():
        d = FlatSetting(group, field)
        d.__set_name__(cls, name)
        setattr(cls, name, d)
    for old, new in DEPRECATED.items():
        d = FlatSetting(*FLAT[new], deprecated_as=new)
        d.__set_name__(cls, old)
        setattr(cls, old, d)
    return cls
