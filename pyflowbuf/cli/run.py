"""``pyflowbuf run``: load a job module, take its Environment, run it.

A job module declares its job and does not run it (bytewax's convention):
either one ``Environment`` at module level, or a function that builds and
returns one, named as ``job.py:build``. The module is loaded under its own name
(not ``__main__``), so a ``if __name__ == "__main__": env.execute()`` at its
end keeps ``python job.py`` working and stays out of the way here."""
from __future__ import annotations

import importlib
import importlib.util
import os
import posixpath
import re
import signal
import sys
import threading
import time
import traceback

import fsspec

from pyflowbuf.api import Environment
from pyflowbuf.cli.checkpoints import CliError
from pyflowbuf.errors import FlowBufError
from pyflowbuf.runtime import overrides
from pyflowbuf.checkpointing.coordinator import DEFAULT_CHECKPOINT_DIR
from pyflowbuf.cluster.control import local_path

_CHK_DIR = re.compile(r"^chk-(0|[1-9][0-9]*)$")


class JobCodeError(Exception):
    """The job's own code raised while it was loaded or built: shown with the
    traceback of that code (pyflowbuf's frames left out)."""

    def __init__(self, message, exc, path):
        super().__init__(message)
        self.exc = exc
        self.path = path

    def details(self) -> str:
        exc = self.exc
        if isinstance(exc, FlowBufError):
            where = _user_line(exc.__traceback__, self.path)
            return f"{type(exc).__name__}: {exc}" + (f" ({where})" if where else "")
        tb = exc.__traceback__
        while tb is not None and not _is_user(tb.tb_frame.f_code.co_filename, self.path):
            tb = tb.tb_next
        return "".join(traceback.format_exception(type(exc), exc, tb or exc.__traceback__)).rstrip()


def _is_user(filename, path) -> bool:
    if path is not None:
        return os.path.abspath(filename) == path
    return not filename.startswith(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) \
        and "importlib" not in filename


def _user_line(tb, path):
    where = None
    while tb is not None:
        if _is_user(tb.tb_frame.f_code.co_filename, path):
            where = f"{os.path.basename(tb.tb_frame.f_code.co_filename)}, line {tb.tb_lineno}"
        tb = tb.tb_next
    return where


def split_spec(spec: str) -> tuple[str, str | None]:
    """``job.py``, ``job.py:build``, ``package.module:build`` -> (where, attribute)."""
    head, sep, tail = spec.rpartition(":")
    if sep and head and tail.isidentifier():
        return head, tail
    return spec, None


def _load_file(path: str):
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise CliError(f"{path}: no such job file")
    stem = os.path.splitext(os.path.basename(path))[0]
    name = stem if stem.isidentifier() else "pyflowbuf_job"
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
        name = f"pyflowbuf_job_{abs(hash(path)):x}"        # never shadow a module already loaded (json.py...)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    # as `python job.py` would: the job's own directory first, for its sibling modules
    directory = os.path.dirname(path)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    sys.modules[name] = module     # worker processes (fork) and pickled records find it by this name
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise JobCodeError(f"{os.path.basename(path)} raised while it was loaded", e, path) from e
    return module, path


def _load_module(name: str):
    # as `python -m` does: modules of the working directory are importable
    # (the console script's sys.path starts with its bin/ directory instead)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            raise CliError(f"{name}: no such job file or module") from None
        raise JobCodeError(f"module {name} raised while it was imported", e, None) from e
    except Exception as e:
        raise JobCodeError(f"module {name} raised while it was imported", e, None) from e
    return module, os.path.abspath(module.__file__) if getattr(module, "__file__", None) else None


def load_job(spec: str, *, parallelism: int | None = None, workers: int | None = None) -> Environment:
    """The Environment ``spec`` names, built with the overrides in force (they
    must be: an operator's parallelism is fixed when it is declared)."""
    where, attr = split_spec(spec)
    label = os.path.basename(where) if where.endswith(".py") else where
    with overrides.overriding(parallelism=parallelism, workers=workers):
        if where.endswith(".py") or os.sep in where or os.path.isfile(where):
            module, path = _load_file(where)
        else:
            module, path = _load_module(where)
        env = _pick(module, attr, label, path)
    for setting, wanted in (("parallelism", parallelism), ("workers", workers)):
        if wanted is not None and getattr(env, setting) != wanted:
            raise CliError(
                f"--{setting} {wanted} did not reach the Environment of {spec} ({setting}={getattr(env, setting)!r}): "
                f"it was built before `pyflowbuf run` loaded the job (in a module imported earlier?) or "
                f"its code set {setting} after building it; build the Environment in the job module itself")
    if env.last_execution is not None or getattr(env, "_claimed_by", None) is not None:
        raise CliError(f"the Environment of {spec} already ran while the module was loaded (an execute() at "
                       f"module level): put it under `if __name__ == \"__main__\":` so that `pyflowbuf run` "
                       "starts the job")
    return env


def _pick(module, attr, label, path) -> Environment:
    if attr is not None:
        if not hasattr(module, attr):
            raise CliError(f"{label} has no attribute {attr!r}")
        obj = getattr(module, attr)
        if isinstance(obj, Environment):
            return obj
        if not callable(obj):
            raise CliError(f"{label}:{attr} is a {type(obj).__name__}, not an Environment or a function "
                           "that returns one")
        try:
            env = obj()
        except Exception as e:
            raise JobCodeError(f"{label}:{attr}() raised", e, path) from e
        if not isinstance(env, Environment):
            raise CliError(f"{label}:{attr}() returned {type(env).__name__}, not a pyflowbuf Environment")
        return env
    found: dict[int, list] = {}
    for name, obj in vars(module).items():
        if isinstance(obj, Environment):
            found.setdefault(id(obj), [obj]).append(name)
    if not found:
        raise CliError(f"{label} has no Environment at module level: declare one there "
                       f"(env = pyflowbuf.Environment(...)), or name a function that returns one: {label}:build")
    if len(found) > 1:
        names = ", ".join("=".join(v[1:]) for v in found.values())
        first = next(iter(found.values()))[1]
        raise CliError(f"{label} has {len(found)} Environments at module level ({names}): name the one to run, "
                       f"e.g. {label}:{first}")
    return next(iter(found.values()))[0]


def restore_arg(value: str | None, env: Environment, spec: str):
    """``--restore``: latest, a checkpoint id, or a directory: a chk-<id> of
    the job's checkpoint_dir, a savepoint, or a checkpoint copied elsewhere,
    as ``execute(restore_from=...)`` takes them."""
    if value is None:
        return None
    if not env.checkpoint_config.enabled:
        raise CliError(f"--restore needs checkpointing, and the Environment of {spec} has checkpoint_interval=None")
    if value == "latest":
        return "latest"
    if value.isdigit():
        return int(value)
    fs, p = fsspec.core.url_to_fs(value)
    p = p.rstrip("/")
    if posixpath.basename(p) == "_metadata":
        p = posixpath.dirname(p)
    if not fs.exists(p):
        raise CliError(f"--restore {value}: no such checkpoint or savepoint directory")
    if not fs.exists(f"{p}/_metadata"):
        raise CliError(f"--restore {value}: not a complete checkpoint or savepoint (it has no _metadata); "
                       "`pyflowbuf checkpoints list` shows what a checkpoint directory holds")
    return fs.unstrip_protocol(p) if "://" in value else p


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill``, ``docker stop``) while a job runs: handled as Ctrl-C is."""


def _raise_terminated(signum, frame):
    raise Terminated()


def run(env: Environment, spec: str, restore, *, report, savepoint_on_stop=None, drain=False) -> dict:
    """Run the job to its end; Ctrl-C or SIGTERM cancels it (``status``
    cancelled, ``signal`` SIGINT or SIGTERM), or, with ``savepoint_on_stop``,
    stops it with a final savepoint there (``status`` stopped, ``savepoint``
    its path; a savepoint that fails cancels the job; ``drain``: event time
    ends first, as ``job.stop(drain=True)``). Returns the summary."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return _run(env, spec, restore, report, savepoint_on_stop, drain)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(env, spec, restore, report, savepoint_on_stop=None, drain=False) -> dict:
    t0 = time.monotonic()
    job = None
    outcome = {"job": env.name, "spec": spec, "parallelism": env.parallelism, "workers": env.workers,
               "checkpoint_dir": (os.fspath(env.checkpoint_config.directory or DEFAULT_CHECKPOINT_DIR)
                                  if env.checkpoint_config.enabled else None),
               "restore": restore}
    try:
        job = env.execute_async(restore_from=restore)
        report(f"job {env.name!r} started (parallelism {env.parallelism}"
               + (f", {env.workers} worker processes" if env.workers else "") + ")" + _restored(job))
        if job.ui_url is not None:
            report(f"web view: {job.ui_url}")
        if job.control is not None:
            host, port = job.control.address
            tls = " (mutual TLS)" if job.control.tls is not None else ""
            report(f"control endpoint on {host}:{port}{tls}: `pyflowbuf savepoint {outcome['checkpoint_dir']}` takes a "
                   f"savepoint, `pyflowbuf stop {outcome['checkpoint_dir']}` stops the job with one")
        if savepoint_on_stop is not None:
            # join() cancels the job on Ctrl-C; here the job must stay up for its savepoint
            while not job.done:
                job._done.wait(0.5)
        job.join()
        outcome["status"] = "finished"
        if job.stopped_with_savepoint is not None:      # by `pyflowbuf stop`, from elsewhere
            outcome["status"] = "stopped"
            path = next((c.get("path") for c in env.checkpoints() if c.get("id") == job.stopped_with_savepoint), None)
            outcome["savepoint"] = None if path is None else local_path(path)
    except KeyboardInterrupt as e:
        outcome["signal"] = "SIGTERM" if isinstance(e, Terminated) else "SIGINT"
        running = job if job is not None else env.last_execution
        if savepoint_on_stop is not None and running is not None and not running.done:
            report(f"stopping with a savepoint in {savepoint_on_stop}" + (" (draining event time first)" if drain else ""))
            try:
                outcome["savepoint"] = running.stop(savepoint=savepoint_on_stop, drain=drain, timeout=120)
                outcome["status"] = "stopped"
                return outcome
            except Exception as exc:    # noqa: BLE001 - reported; the job is cancelled below
                report(f"the savepoint failed ({type(exc).__name__}: {exc}); cancelling the job")
        if running is not None and not running.done:
            running.cancel()          # join() cancels too; this covers an interrupt before it was reached
            try:
                running.join(timeout=30)
            except BaseException:
                pass
        outcome["status"] = "cancelled"
    finally:
        outcome["duration_s"] = round(time.monotonic() - t0, 3)
        running = job if job is not None else env.last_execution
        outcome["restored_from"] = getattr(running, "restored_from", None)
        outcome["checkpoints"] = env.checkpoints()
    return outcome


def _restored(job) -> str:
    cid = getattr(job, "restored_from", None)
    return f", restored from checkpoint {cid}" if cid is not None else ""


def summary(outcome: dict) -> str:
    done = [c for c in outcome["checkpoints"] if c.get("status") == "completed"]
    text = f"job {outcome['job']!r} {outcome['status']} after {outcome['duration_s']:.2f} s"
    if outcome.get("restored_from") is not None:
        text += f" (restored from checkpoint {outcome['restored_from']})"
    if outcome.get("checkpoint_dir") is not None:
        text += (f"; {len(done)} checkpoint{'s' if len(done) != 1 else ''} completed"
                 + (f", the latest chk-{done[-1]['id']}" if done else "") + f" in {outcome['checkpoint_dir']}")
    return text
