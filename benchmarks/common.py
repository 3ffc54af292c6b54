"""Shared helpers for the pyflowbuf benchmarks (``benchmarks/bench_*.py``).

Principle 6 of DESIGN.md: every claim is a ratio against a peer or a limit
measured in the same run, on a noisy machine. So the helpers here

* time with ``time.perf_counter`` (``timed``),
* take medians over repetitions (``median_of``) and, for ratios, run ours and
  the peer *interleaved* in every repetition (rotating their order) and report
  the median of the per-repetition ratios (``interleaved`` / ``Samples.ratio``),
  so both sides see the same background load,
* describe the machine (``machine_info``),
* show progress on stderr (``progress``) and print results as they come
  (``Report``), and render any result dict as a table (``render_result``).

Bench modules import this as ``import common`` (``run.py`` and pytest put
``benchmarks/`` on ``sys.path``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Mapping

perf_counter = time.perf_counter

# --------------------------------------------------------------------------- timing


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds one call of ``fn(*args, **kwargs)`` takes (perf_counter)."""
    t0 = perf_counter()
    fn(*args, **kwargs)
    return perf_counter() - t0


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """Keep the cyclic GC out of a timed section (applied to ours and peers alike)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def median_of(fn: Callable[[], float], repeats: int = 5, warmup: int = 1) -> float:
    """Median of ``repeats`` calls of ``fn`` (which returns a measurement, e.g. a
    rate or seconds), after ``warmup`` discarded calls."""
    for _ in range(warmup):
        fn()
    with no_gc():
        values = [float(fn()) for _ in range(repeats)]
    return statistics.median(values)


def rate(count: float, seconds: float) -> float:
    return count / seconds if seconds > 0 else math.inf


@dataclasses.dataclass
class Samples:
    """Per-repetition measurements of several cases run side by side.

    ``runs[name]`` is a list (one entry per repetition) of dicts of metrics
    (each case returns e.g. ``{"rate": ..., "write_s": ...}``)."""

    runs: dict[str, list[dict[str, float]]]

    def values(self, name: str, key: str = "rate") -> list[float]:
        return [r[key] for r in self.runs[name]]

    def median(self, name: str, key: str = "rate") -> float:
        return statistics.median(self.values(name, key))

    def spread(self, name: str, key: str = "rate") -> float:
        """(max - min) / median: how noisy the repetitions were."""
        v = self.values(name, key)
        m = statistics.median(v)
        return (max(v) - min(v)) / m if m else math.nan

    def ratios(self, a: str, b: str, key: str = "rate") -> list[float]:
        return [ra[key] / rb[key] for ra, rb in zip(self.runs[a], self.runs[b])]

    def ratio(self, a: str, b: str, key: str = "rate") -> float:
        """Median over repetitions of ``a / b`` (paired: same repetition)."""
        return statistics.median(self.ratios(a, b, key))


def interleaved(cases: Mapping[str, Callable[[], Mapping[str, float] | float]], repeats: int,
                warmup: int = 1, advance: Callable[[], None] | None = None) -> Samples:
    """Run every case once per repetition, rotating the order each time so no
    case always runs first (or right after the same neighbour). A case returns
    a float (taken as ``{"rate": value}``) or a dict of metrics."""
    names = list(cases)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    for _ in range(warmup):
        for n in names:
            cases[n]()
    with no_gc():
        for i in range(repeats):
            k = i % len(names)
            for n in names[k:] + names[:k]:
                out = cases[n]()
                runs[n].append(dict(out) if isinstance(out, Mapping) else {"rate": float(out)})
            if advance is not None:
                advance()
    return Samples(runs)


# --------------------------------------------------------------------------- machine


def _cpuinfo() -> dict[str, str]:
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # first processor block is enough
                k, _, v = line.partition(":")
                info.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return info


def machine_info() -> dict[str, Any]:
    """CPU model, cores, memory, Python/NumPy/pyflowbuf versions and the load
    at the time of the call (the machine is shared: load says how noisy)."""
    import numpy

    cpu = _cpuinfo()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = os.cpu_count()
    info: dict[str, Any] = {
        "cpu_model": cpu.get("model name") or platform.processor() or platform.machine(),
        "cpu_mhz": float(cpu["cpu MHz"]) if "cpu MHz" in cpu else None,
        "cpu_cache": cpu.get("cache size"),
        "logical_cores": os.cpu_count(),
        "usable_cores": affinity,
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": numpy.__version__,
        "gil_switch_interval_s": sys.getswitchinterval(),
    }
    try:
        import psutil

        info["physical_cores"] = psutil.cpu_count(logical=False)
        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
        # CPU busy (all processes) over a short window: how shared the machine is now.
        info["cpu_busy_percent"] = psutil.cpu_percent(interval=0.3)
    except Exception:  # psutil is optional
        pass
    try:
        import pyflowbuf

        info["pyflowbuf"] = pyflowbuf.__version__
    except Exception:
        info["pyflowbuf"] = None
    try:
        info["loadavg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def describe_machine(m: Mapping[str, Any]) -> str:
    parts = [f"{m.get('cpu_model')}", f"{m.get('usable_cores')}/{m.get('logical_cores')} cores usable"]
    if m.get("memory_gib"):
        parts.append(f"{m['memory_gib']} GiB")
    parts += [str(m.get("os")), str(m.get("python")), f"numpy {m.get('numpy')}",
              f"pyflowbuf {m.get('pyflowbuf')}"]
    if "loadavg_1m" in m:
        parts.append(f"load {m['loadavg_1m']}")
    if "cpu_busy_percent" in m:
        parts.append(f"CPU busy {m['cpu_busy_percent']:.0f}% before start")
    return ", ".join(parts)


# --------------------------------------------------------------------------- goals & formatting


@dataclasses.dataclass(frozen=True)
class Goal:
    """A target from the issue: ``op`` is ``">="`` or ``"<="``."""

    op: str
    value: float
    unit: str = ""

    def met(self, v: float) -> bool:
        return v >= self.value if self.op == ">=" else v <= self.value

    def text(self) -> str:
        return f"{self.op} {fmt_value(self.value, self.unit)}"

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "value": self.value, "unit": self.unit}


def _si(v: float) -> str:
    for scale, suffix in ((1e9, " G"), (1e6, " M"), (1e3, " k")):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g} "


def guess_unit(key: str) -> str:
    if "_vs_" in key or key.endswith("_ratio") or key.startswith("ratio"):
        return "x"
    if "bytes_per_s" in key:
        return "B/s"
    if key.endswith("_per_s") or "_per_s_" in key:
        return "/s"
    if key.endswith("_s"):
        return "s"
    return ""


def fmt_value(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if unit == "x":
        return f"{v:.3g}x"
    if unit == "s":
        return f"{v:.3g} s"
    if unit == "%":
        return f"{v:.1f} %"
    return f"{_si(v)}{unit}".rstrip()


def jsonable(obj: Any) -> Any:
    """Make a result JSON-safe: NaN/inf become None, tuples lists, others str."""
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    try:
        import numpy

        if isinstance(obj, numpy.generic):
            return jsonable(obj.item())
    except ImportError:
        pass
    return str(obj)


# --------------------------------------------------------------------------- console output


def console(stderr: bool = False):
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    # A fixed width when piped keeps tables from wrapping at 80 columns.
    return Console(file=stream, width=None if stream.isatty() else 132, highlight=False)


@contextlib.contextmanager
def progress(description: str, total: int | None) -> Iterator[Callable[[], None]]:
    """A transient progress bar on stderr (only when stderr is a terminal);
    yields a function to call once per step."""
    if not sys.stderr.isatty():
        yield lambda: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console(stderr=True), transient=True) as prog:
        task = prog.add_task(description, total=total)
        yield lambda: prog.advance(task)


class Report:
    """Collects a benchmark's figures and prints each as it is measured.

    ``add(key, value, unit, goal=...)`` prints a line (value, goal, met or
    missed) and records it; ``as_dict()`` is what a bench's ``main`` returns:
    the flat figures plus ``machine``, ``goals``, ``units`` and ``params``."""

    def __init__(self, name: str, quick: bool, params: Mapping[str, Any] | None = None):
        self.name = name
        self.quick = quick
        self.figures: dict[str, Any] = {}
        self.units: dict[str, str] = {}
        self.goals: dict[str, Goal] = {}
        self.notes: dict[str, str] = {}
        self.params: dict[str, Any] = dict(params or {})
        self.machine = machine_info()
        self.con = console()
        self.con.print(f"[bold]{name}[/bold] ({'quick' if quick else 'full'} run) on {describe_machine(self.machine)}",
                       soft_wrap=True)

    def section(self, title: str) -> None:
        self.con.print(f"\n[bold cyan]{title}[/bold cyan]")

    def add(self, key: str, value: float, unit: str = "", goal: Goal | None = None,
            note: str = "", spread: float | None = None) -> float:
        self.figures[key] = value
        self.units[key] = unit
        if goal is not None:
            self.goals[key] = goal
        if note:
            self.notes[key] = note
        status = ""
        if goal is not None:
            status = "[green]met[/green]" if goal.met(value) else "[red]MISSED[/red]"
        line = f"  {key:<42} {fmt_value(value, unit):>16}"
        line += f"   goal {goal.text():<18} {status}" if goal else " " * 35
        if spread is not None and math.isfinite(spread):
            line += f"  [dim](range ±{spread * 50:.0f}%)[/dim]"
        if note:
            line += f"  [dim]{note}[/dim]"
        self.con.print(line, soft_wrap=True)
        return value

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.figures)
        out["goals"] = {k: {**g.as_dict(), "met": g.met(self.figures[k])} for k, g in self.goals.items()}
        out["units"] = dict(self.units)
        out["notes"] = dict(self.notes)
        out["params"] = dict(self.params)
        out["machine"] = self.machine
        return out


_META_KEYS = {"machine", "goals", "units", "notes", "params", "benchmark", "quick", "elapsed_s"}


def render_result(result: Mapping[str, Any], title: str = "") -> None:
    """Print any bench result dict as a table: key, value, goal, status. Works
    for dicts without ``goals``/``units`` too (units are guessed from keys)."""
    from rich.table import Table

    goals = result.get("goals") or {}
    units = result.get("units") or {}
    table = Table(title=title or None, show_lines=False)
    table.add_column("key")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    table.add_column("status")

    def rows(prefix: str, d: Mapping[str, Any]):
        for k, v in d.items():
            key = f"{prefix}{k}"
            if not prefix and k in _META_KEYS:
                continue
            if isinstance(v, Mapping):
                yield from rows(key + ".", v)
            else:
                yield key, v

    n_met = n_goals = 0
    for key, v in rows("", result):
        unit = units.get(key, guess_unit(key))
        g = goals.get(key)
        goal_txt = status = ""
        if isinstance(g, Mapping) and "value" in g:
            goal_txt = f"{g.get('op', '>=')} {fmt_value(g['value'], g.get('unit', unit))}"
            met = g.get("met")
            if met is None and isinstance(v, (int, float)):
                met = Goal(g.get("op", ">="), g["value"]).met(v)
            n_goals += 1
            n_met += bool(met)
            status = "[green]met[/green]" if met else "[red]MISSED[/red]"
        table.add_row(key, fmt_value(v, unit), goal_txt, status)
    con = console()
    con.print()
    con.print(table)
    if n_goals:
        con.print(f"goals met: {n_met}/{n_goals}")
