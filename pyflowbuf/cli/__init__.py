"""The ``pyflowbuf`` command line (also ``python -m pyflowbuf``).

    pyflowbuf run job.py [--restore latest|ID|PATH] [--parallelism N] [--workers N] [--control-port P]
                         [--savepoint-on-stop PATH [--drain]] [--json]
    pyflowbuf checkpoints list DIR [--verify] [--json]
    pyflowbuf checkpoints show PATH [ID] [--json]
    pyflowbuf checkpoints verify PATH [ID] [--json]
    pyflowbuf savepoint (CHECKPOINT_DIR | --address HOST:PORT --secret-file F) [PATH] [--json]
    pyflowbuf stop (CHECKPOINT_DIR | --address HOST:PORT --secret-file F) [--savepoint PATH] [--drain] [--json]
        (both: [--tls-cert F [--tls-key F] --tls-ca F] for a job with its own tls=TLSConfig)
    pyflowbuf demo [--quick]
    pyflowbuf bench NAME [ARGS...]

Exit codes: 0 done, 1 an error (its reason in one line on stderr; ``--debug``
adds the traceback) or a damaged checkpoint, 2 a usage error, 130 a job
stopped by Ctrl-C (143 by SIGTERM). See docs/checkpoints.md, "Command line".

Example::

    from pyflowbuf.cli import main
    code = main(["checkpoints", "list", "checkpoints", "--json"])
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import traceback
from pathlib import Path

from pyflowbuf._version import __version__
from pyflowbuf.checkpoint.errors import CheckpointError
from pyflowbuf.cli import checkpoints as chk
from pyflowbuf.cli import control
from pyflowbuf.cli import render
from pyflowbuf.cli import run as runner
from pyflowbuf.cli.checkpoints import CliError
from pyflowbuf.demo import run_demo
from pyflowbuf.errors import FlowBufError, JobFailedError

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 1, 2, 130, 143


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {n}")
    return n


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535 (0: a free one), got {text!r}")
    return int(text)


def _checkpoint_id(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"a checkpoint id is an integer >= 0, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pyflowbuf", description="pyflowbuf: run jobs, inspect their checkpoints, take savepoints of running "
                                      "jobs and stop them, run the demonstration.")
    parser.add_argument("--version", action="version", version=f"pyflowbuf {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", parents=[common], help="run the end-to-end demonstration")
    demo.add_argument("--quick", action="store_true", help="a shorter run")
    bench = sub.add_parser("bench", parents=[common], help="run a benchmark from benchmarks/")
    bench.add_argument("name")
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    run = sub.add_parser(
        "run", parents=[common], help="run a job module",
        description="Run the job a module declares: its one module-level Environment, or the Environment "
                    "a function returns (job.py:build). Ctrl-C cancels the job (exit code 130; SIGTERM: 143); "
                    "resume it with --restore latest.")
    run.add_argument("job", metavar="JOB", help="job.py, job.py:function, package.module[:function]")
    run.add_argument("--restore", metavar="latest|ID|PATH",
                     help="start from a checkpoint: latest (the newest of the job's checkpoint_dir; a fresh start "
                          "when there is none), a checkpoint id there, or a path: a chk-<id> directory, a "
                          "savepoint, a checkpoint copied elsewhere (as execute(restore_from=...) takes them)")
    run.add_argument("--parallelism", type=_positive, metavar="N",
                     help="the default parallelism of the job's operators (those without their own parallelism=)")
    run.add_argument("--workers", type=_positive, metavar="N", help="run in N worker processes")
    run.add_argument("--savepoint-on-stop", metavar="PATH",
                     help="on Ctrl-C or SIGTERM, stop the job with a final savepoint at PATH (a directory or an "
                          "fsspec URL) instead of cancelling it; resume with --restore PATH")
    run.add_argument("--drain", action="store_true",
                     help="with --savepoint-on-stop: end event time before the savepoint, so every window fires "
                          "and timers run (for a job that will not resume; as `pyflowbuf stop --drain`)")
    run.add_argument("--control-port", type=_port, metavar="PORT",
                     help="open the job's control endpoint on this port (0: a free one) for `pyflowbuf savepoint` "
                          "and `pyflowbuf stop`, as Environment(control_port=PORT)")
    run.add_argument("--ui", action="store_true",
                     help="serve the job's web view (graph, backpressure, checkpoints, watermarks); its URL is printed")
    run.add_argument("--ui-port", type=_port, default=0, metavar="PORT", help="the web view's port (default: a free one)")
    run.add_argument("--ui-host", default="127.0.0.1", metavar="HOST",
                     help="the address the web view binds (another than 127.0.0.1 puts an access token in the URL)")
    run.add_argument("--json", action="store_true",
                     help="end with one line of JSON: status, duration, restored checkpoint, checkpoint history")
    control.add_commands(sub, common, as_json)

    cps = sub.add_parser("checkpoints", help="list, show and verify checkpoints")
    csub = cps.add_subparsers(dest="action", required=True, metavar="ACTION")
    lst = csub.add_parser("list", parents=[common, as_json], help="the checkpoints in a checkpoint_dir",
                          description="Every chk-<id> directory: complete, torn (a task file missing or cut "
                                      "short), corrupt, or incomplete (in progress or abandoned). Checksums are "
                                      "read only with --verify.")
    lst.add_argument("path", metavar="DIR", help="the job's checkpoint_dir (a path or an fsspec URL)")
    lst.add_argument("--verify", action="store_true", help="also read every checksum (reads every file)")
    show = csub.add_parser("show", parents=[common, as_json], help="one checkpoint, per task",
                           description="What one checkpoint holds, per task: state bytes, in-flight bytes, "
                                       "alignment, and every field its metadata records.")
    show.add_argument("path", metavar="PATH", help="a chk-<id> directory, or the checkpoint_dir (the newest)")
    show.add_argument("id", nargs="?", type=_checkpoint_id, metavar="ID", help="a checkpoint id in PATH")
    show.add_argument("--state", action="store_true",
                      help="also read each task's state and summarize it (its operators' entries, types, sizes)")
    ver = csub.add_parser("verify", parents=[common, as_json], help="check every checksum",
                          description="Read every file of a checkpoint (or of every checkpoint in a "
                                      "checkpoint_dir) and check its checksums; exit code 1 when one is damaged.")
    ver.add_argument("path", metavar="PATH", help="a chk-<id> directory, or the checkpoint_dir (all of them)")
    ver.add_argument("id", nargs="?", type=_checkpoint_id, metavar="ID", help="a checkpoint id in PATH")
    return parser


def main(argv=None) -> int:
    """Run one command; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    debug = getattr(args, "debug", False)
    command = "checkpoints " + args.action if args.cmd == "checkpoints" else args.cmd
    try:
        return _COMMANDS[command](args)
    except KeyboardInterrupt:
        print(f"pyflowbuf {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except control.UsageError as e:
        print(f"pyflowbuf {command}: usage error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except runner.JobCodeError as e:
        if debug:
            traceback.print_exc()
        print(f"pyflowbuf {command}: error: {e}:\n{e.details()}", file=sys.stderr)
        return EXIT_ERROR
    except (CliError, FlowBufError, OSError, ValueError) as e:
        # CheckpointError, ConfigurationError, ... are FlowBufErrors; a file that cannot be read is an OSError
        if debug:
            traceback.print_exc()
        print(f"pyflowbuf {command}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as e:
        if debug:
            traceback.print_exc()
        print(f"pyflowbuf {command}: internal error: {type(e).__name__}: {_one_line(e)} "
              "(run again with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, JobFailedError):
        return text       # it carries the job's traceback, which is what there is to see
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(text.split())


# ---------------------------------------------------------------- commands

def _demo(args) -> int:
    return run_demo(quick=args.quick)


def _bench(args) -> int:
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "run.py"
    if not script.is_file():
        raise CliError(f"{script}: no such file (benchmarks/ is in the source checkout, not in the package)")
    return subprocess.call([sys.executable, str(script), args.name, *args.rest])


def _say(text: str) -> None:
    print(f"pyflowbuf run: {text}", file=sys.stderr, flush=True)


def _run(args) -> int:
    env = runner.load_job(args.job, parallelism=args.parallelism, workers=args.workers)
    restore = runner.restore_arg(args.restore, env, args.job)
    outcome = {}
    try:
        if args.control_port is not None:
            env.control_port = args.control_port       # checked with every setting when the job starts
        if args.ui:
            env.ui_port, env.ui_host = args.ui_port, args.ui_host
        if args.savepoint_on_stop is not None and not env.checkpoint_config.enabled:
            raise CliError(f"--savepoint-on-stop needs checkpointing, and the Environment of {args.job} has "
                           "checkpoint_interval=None")
        if args.drain and args.savepoint_on_stop is None:
            raise CliError("--drain ends event time before a final savepoint: it needs --savepoint-on-stop PATH")
        outcome = runner.run(env, args.job, restore, report=_say, savepoint_on_stop=args.savepoint_on_stop,
                             drain=args.drain)
    except JobFailedError as e:
        outcome = {"job": env.name, "spec": args.job, "status": "failed", "error": str(e),
                   "checkpoints": env.checkpoints()}
        if args.json:
            render.emit_json(outcome)
        raise
    if args.json:
        render.emit_json(outcome)
    _say(runner.summary(outcome))
    if outcome["status"] == "stopped":
        _say(f"stopped with a savepoint in {outcome['savepoint']}: resume with --restore {outcome['savepoint']}")
        return 0
    if outcome["status"] == "cancelled":
        by = "SIGTERM" if outcome["signal"] == "SIGTERM" else "Ctrl-C"
        _say(f"cancelled by {by}" + (": resume with --restore latest" if outcome["checkpoint_dir"] else ""))
        return EXIT_TERMINATED if by == "SIGTERM" else EXIT_INTERRUPTED
    return 0


def _list(args) -> int:
    jobs = None if args.verify else chk.list_jobs(args.path)
    if jobs is not None:
        if args.json:
            render.emit_json(jobs)
            return 0
        render.table(f"jobs' checkpoint directories in {jobs['directory']}",
                     [("directory", "left"), ("job", "left"), ("checkpoints", "right"), ("newest", "right"),
                      ("running", "left")],
                     [[j["name"], "" if j["job"] is None else str(j["job"]), str(j["checkpoints"]),
                       "" if j["newest"] is None else f"chk-{j['newest']}",
                       "" if j["running"] is None else f"pid {j['running']['pid']} on {j['running']['host']}"]
                      for j in jobs["jobs"]])
        print(f"`pyflowbuf checkpoints list {os.path.join(args.path, jobs['jobs'][0]['name'])}` lists one's "
              "checkpoints")
        return 0
    target = chk.open_target(args.path)
    if target.checkpoint_id is not None:
        raise CliError(f"{args.path} is one checkpoint (chk-{target.checkpoint_id}): `list` takes the "
                       "checkpoint_dir that holds it; `show` and `verify` take one checkpoint")
    data = chk.list_checkpoints(target, verify=args.verify)
    if args.json:
        render.emit_json(data)
        return 0
    rows = [[str(c["id"]), c["kind"] or "", c["status"], render.when(c["completion_time"]),
             render.seconds(c["duration_s"]), c["alignment"] or "", "" if c["tasks"] is None else str(c["tasks"]),
             render.size(c["state_bytes"]), render.size(c["inflight_bytes"]), render.size(c["size"])]
            for c in data["checkpoints"]]
    render.table(f"checkpoints in {data['directory']}" + (" (checksums verified)" if args.verify else ""),
                 [("id", "right"), ("kind", "left"), ("status", "left"), ("completed", "left"),
                  ("duration", "right"), ("alignment", "left"), ("tasks", "right"), ("state", "right"),
                  ("in-flight", "right"), ("on disk", "right")], rows)
    for c in data["checkpoints"]:
        if c["status"] in (chk.TORN, chk.CORRUPT):
            print(f"chk-{c['id']}: {c['status']}: {c['reason']}")
    return 0


_GROUP_FIELDS = ("operator_id", "uid", "operator")


def _show(args) -> int:
    target = chk.open_target(args.path, args.id)
    data = chk.show(target, state=args.state)
    damaged = data["status"] in (chk.TORN, chk.CORRUPT)
    if args.json:
        render.emit_json(data)
    else:
        pairs = [("checkpoint", f"{data['id']} ({data['kind']}, {data['status']})"), ("path", data["path"]),
                 ("job", data["job"] or ""), ("mode", data["mode"] or ""), ("alignment", data["alignment"] or ""),
                 ("triggered", render.when(data["trigger_time"])), ("completed", render.when(data["completion_time"])),
                 ("duration", render.seconds(data["duration_s"])), ("format", str(data["format"])),
                 ("state", render.size(data["state_bytes"])), ("in-flight", render.size(data["inflight_bytes"])),
                 ("on disk", render.size(data["size"]))]
        if data["commits"] is not None:
            pairs.append(("sink commits", str(data["commits"])))
        # (the operators and the per-task layout of state format 2: the operators table below)
        shown = ("operators", "layout", "derived_ids") if data["operators"] else ()
        pairs += [(k, render.value(v)) for k, v in data["properties"].items() if k not in shown]
        pairs += [(k, render.value(v)) for k, v in data["extra"].items() if not _is_table(v)]
        render.lines(pairs)
        print()
        tasks = data["tasks"]
        extra_cols = []
        for t in tasks:
            extra_cols += [k for k in t["extra"] if k not in extra_cols]
        group = next((f for f in _GROUP_FIELDS if f in extra_cols), None)
        if group is not None:       # per operator first, then its subtasks
            tasks = sorted(tasks, key=lambda t: (str(t["extra"].get(group)), chk._natural(str(t["task_key"]))))
            extra_cols.remove(group)
            extra_cols.insert(0, group)
        rows = [[str(t["task_key"])] + [render.value(t["extra"].get(k)) for k in extra_cols] +
                [t["alignment"] or "", render.size(t["state_bytes"]), render.size(t["inflight_bytes"]),
                 "" if t["inflight_buffers"] is None else str(t["inflight_buffers"]),
                 "" if t["alignment_ms"] is None else f"{t['alignment_ms']:.1f}",
                 render.size(t["size"]), t["on_disk"], str(t["file"])] for t in tasks]
        render.table(None, [("task", "left")] + [(k.replace("_", " "), "left") for k in extra_cols] +
                     [("alignment", "left"), ("state", "right"), ("in-flight", "right"), ("buffers", "right"),
                      ("aligning ms", "right"), ("file size", "right"), ("on disk", "left"), ("file", "left")], rows)
        if args.state:
            keys = []
            for t in tasks:
                keys += [k for k in t["state"] if k not in keys]
            render.table("state", [("task", "left")] + [(k.replace("_", " "), "left") for k in keys],
                         [[str(t["task_key"])] + [t["state"].get(k, "") for k in keys] for t in tasks])
        if data["operators"]:
            render.table("operators", [("operator id", "left"), ("id from", "left"), ("name", "left"),
                                       ("type", "left"), ("parallelism", "right"), ("state", "right"),
                                       ("key groups", "left"), ("in-flight (its tasks)", "right")],
                         [[str(o["uid"]), str(o["id_from"]), str(o["name"]), str(o["type"]), str(o["parallelism"]),
                           render.size(o["state_bytes"]) if o["stateful"] else "-",
                           " ".join(f"{a}..{b - 1}" for a, b in o["key_groups"]), render.size(o["inflight_bytes"])]
                          for o in data["operators"]])
        for key, v in data["extra"].items():       # e.g. operators of a later format: a table of their own
            if _is_table(v):
                _generic_table(key, v)
    if damaged:
        print(f"pyflowbuf checkpoints show: checkpoint {data['id']} is {data['status']}: {data['reason']}",
              file=sys.stderr)
        return EXIT_ERROR
    return 0


def _is_table(v) -> bool:
    items = list(v.values()) if isinstance(v, dict) else v
    return isinstance(items, list) and bool(items) and all(isinstance(i, dict) for i in items)


def _generic_table(title, v) -> None:
    rows = [dict(item, **({"name": k} if "name" not in item else {})) for k, item in v.items()] \
        if isinstance(v, dict) else list(v)
    cols = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    render.table(title, [(c, "left") for c in cols], [[render.value(r.get(c)) for c in cols] for r in rows])


def _verify(args) -> int:
    target = chk.open_target(args.path, args.id)
    data = chk.verify(target)
    if args.json:
        render.emit_json(data)
    else:
        rows = [[str(c["id"]), c["status"], "checksums ok" if c["status"] == chk.COMPLETE
                 else "not verified (no _metadata)" if c["status"] == chk.INCOMPLETE else c["reason"] or ""]
                for c in data["checkpoints"]]
        render.table(f"checksums of {data['directory']}", [("id", "right"), ("status", "left"), ("", "left")],
                     rows)
    if data["ok"]:
        return 0
    for c in data["checkpoints"]:
        if c["status"] != chk.COMPLETE and (target.checkpoint_id is not None or c["status"] != chk.INCOMPLETE):
            print(f"pyflowbuf checkpoints verify: checkpoint {c['id']} is {c['status']}: {c['reason']}",
                  file=sys.stderr)
    return EXIT_ERROR


_COMMANDS = {"demo": _demo, "bench": _bench, "run": _run, "checkpoints list": _list, "checkpoints show": _show,
             "checkpoints verify": _verify, "savepoint": lambda args: control.run(args, "savepoint"),
             "stop": lambda args: control.run(args, "stop")}
