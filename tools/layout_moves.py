"""The module moves of issue 19 item 1 (layers as folders) and issue 28, the
names moved between modules (issue 28 item 5), and the rewrite
that carries imports and mentions over to the new paths.

    python tools/layout_moves.py rewrite [PATHS...]   # rewrite in place (idempotent)
    python tools/layout_moves.py check [PATHS...]     # exit 1 if an old path is still named
    python tools/layout_moves.py table                # old -> new, one a line

Without PATHS, ``rewrite`` first moves (``git mv``) any module file still at
an old path (one a merged branch added, see ARRIVING; ``check`` reports it),
and both walk the default roots: pyflowbuf/, tests/, benchmarks/, docs/,
examples/, tools/ and README.md (files ending .py, .md, .pyi, .pxd).
They rewrite and look for:

* dotted module paths (``pyflowbuf.runtime.watermarks``, also inside strings
  such as monkeypatch targets, and followed by an attribute);
* ``from pyflowbuf.runtime import watermarks [as x]`` (one line, no
  parentheses), split by new package where needed;
* file paths (``pyflowbuf/runtime/watermarks.py``, ``runtime/watermarks.py``);
* names moved out of a module that stays (``NAMES``): in one-line
  ``from`` imports and dotted mentions (``check`` also reports them in a
  parenthesized import, to carry by hand).

A line that carries the mark ``layout_moves: keep`` is left as it is.

Meant to be run again after a branch cut before the moves is merged, for the
imports it added.
"""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

# old module -> new module. Bottom-up by the layer it went to.
MOVES = {
    # the exchange (with pyflowbuf.net, the remote side)
    "pyflowbuf.runtime.exchange": "pyflowbuf.exchange.sides",
    "pyflowbuf.runtime.debloat": "pyflowbuf.exchange.debloat",
    # checkpoint: barrier handling, in-flight data, key groups (beside storage, codec, container)
    "pyflowbuf.runtime.alignment": "pyflowbuf.checkpoint.alignment",
    "pyflowbuf.runtime.inflight": "pyflowbuf.checkpoint.inflight",
    "pyflowbuf.runtime.keygroups": "pyflowbuf.checkpoint.keygroups",
    # operators: the operator contract and the basic operators
    "pyflowbuf.runtime.operators": "pyflowbuf.operators.basic",
    "pyflowbuf.runtime.side_outputs": "pyflowbuf.operators.side_outputs",
    # time: clock, watermarks, timers and the keyed process operator
    "pyflowbuf.runtime.processing_time": "pyflowbuf.time.processing_time",
    "pyflowbuf.runtime.watermarks": "pyflowbuf.time.watermarks",
    "pyflowbuf.runtime.timers": "pyflowbuf.time.timers",
    # connectors: sources, sinks and the sinks' output directory
    "pyflowbuf.runtime.sources": "pyflowbuf.connectors.sources",
    "pyflowbuf.runtime.sinks": "pyflowbuf.connectors.sinks",
    "pyflowbuf.runtime.outputs": "pyflowbuf.connectors.outputs",
    # cluster: one job over many processes, and the control of a running job
    "pyflowbuf.runtime.cluster": "pyflowbuf.cluster.driver",
    "pyflowbuf.runtime.worker": "pyflowbuf.cluster.worker",
    "pyflowbuf.runtime.control": "pyflowbuf.cluster.control",
    "pyflowbuf.net.control": "pyflowbuf.cluster.control_channel",
    # issue 28: the job description one package low, checkpointing in one package
    "pyflowbuf.runtime.graph": "pyflowbuf.jobgraph.graph",
    "pyflowbuf.runtime.checkpointing": "pyflowbuf.checkpointing.coordinator",
    "pyflowbuf.runtime.restore": "pyflowbuf.checkpointing.restore",
    "pyflowbuf.runtime.inflight_rescale": "pyflowbuf.checkpointing.inflight",
    "pyflowbuf.runtime.task.checkpoints": "pyflowbuf.checkpointing.subtask",
    "pyflowbuf.runtime.jobdir": "pyflowbuf.checkpointing.jobdir",
    "pyflowbuf.runtime.key_kinds": "pyflowbuf.checkpointing.key_kinds",
    # issue 28 item 3: in-flight data (capture, replay, rescale) in one module of checkpointing
    "pyflowbuf.checkpointing.inflight_rescale": "pyflowbuf.checkpointing.inflight",
}
# Modules that branches cut before the moves add to the old flat folder: moved
# (git mv) by ``rewrite`` once a merge brings them, like the ones above.
ARRIVING = {
    "pyflowbuf.runtime.filesystems": "pyflowbuf.connectors.filesystems",    # f-spark: fsspec paths of files
}
MOVES.update(ARRIVING)

# Issue 28 item 5, operators filed by what they do: classes and functions
# that left a module which stays, as old dotted name -> new dotted name.
# ``rewrite`` carries ``from old_module import name`` (one line) and dotted
# mentions over; ``check`` reports what is left (a parenthesized import too).
_OPS, _PROCESS = "pyflowbuf.operators", "pyflowbuf.time.process"
NAMES = {
    **{f"{_OPS}.basic.{n}": f"{_OPS}.contracts.{n}" for n in ("Output", "Operator", "_is_dataframe")},
    **{f"{_OPS}.basic.{n}": f"{_OPS}.keyed.{n}" for n in ("_Keyed", "_PerKeyState", "KeyedReduce")},
    **{f"{_OPS}.basic.{n}": f"{_PROCESS}.{n}" for n in (
        "_KeyDictState", "KeyedProcess", "_process_per_key", "_copy_key_dicts", "CoProcess", "KeyedCoProcess")},
    **{f"pyflowbuf.time.timers.{n}": f"{_PROCESS}.{n}" for n in (
        "_stamp", "Context", "ProcessContext", "ProcessOperator", "RuntimeContext", "_binds",
        "process_function_parts", "plain_process_function_parts", "KeyedProcessFunction", "takes_context",
        "KeyedProcessOperator", "KeyedCoProcessOperator")},
}

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("pyflowbuf", "tests", "benchmarks", "docs", "examples", "tools", "README.md")
SUFFIXES = (".py", ".md", ".pyi", ".pxd")
SELF = os.path.abspath(__file__)


def _path(module: str) -> str:
    return module.replace(".", "/")[len("pyflowbuf/"):] + ".py"


def _dotted_re(old: str):
    # not the tail of a longer name, not followed by more of an identifier
    return re.compile(r"(?<![\w.])" + re.escape(old) + r"(?!\w)")


def _file_re(old: str):
    # pyflowbuf/runtime/x.py or runtime/x.py, not the tail of another path
    return re.compile(r"(?<![\w./])(pyflowbuf/)?" + re.escape(_path(old)) + r"(?!\w)")


_MOVED = {**MOVES, **NAMES}
_DOTTED = [(_dotted_re(o), n) for o, n in _MOVED.items()]
_FILES = [(_file_re(o), _path(n)) for o, n in MOVES.items()]
_FROM = re.compile(r"^(?P<indent>[ \t]*)from (?P<pkg>pyflowbuf(?:\.\w+)*) import (?P<names>[\w ,]+?)"
                   r"(?P<tail>[ \t]*(?:#.*)?)$", re.M)


def _split_from(m: re.Match) -> str:
    """``from pkg import a, b as c``: each moved name imported from its new package."""
    pkg, indent, tail = m["pkg"], m["indent"], m["tail"]
    groups: dict = {}
    for part in (p.strip() for p in m["names"].split(",")):
        if not part:
            continue
        name, _, alias = (x.strip() for x in part.partition(" as "))
        new = _MOVED.get(f"{pkg}.{name}")
        if new is None:
            groups.setdefault(pkg, []).append(part)
            continue
        new_pkg, new_name = new.rsplit(".", 1)
        alias = alias or (name if new_name != name else "")
        groups.setdefault(new_pkg, []).append(f"{new_name} as {alias}" if alias else new_name)
    if list(groups) == [pkg]:
        return m.group(0)
    lines = [f"{indent}from {p} import {', '.join(names)}" for p, names in groups.items()]
    lines[0] += tail
    return "\n".join(lines)


# a line that names an old path on purpose (this tool's own tests) carries this mark
KEEP = "layout_moves: keep"


def _rewrite_line(line: str) -> str:
    if KEEP in line:
        return line
    line = _FROM.sub(_split_from, line)
    for rx, new in _DOTTED:
        line = rx.sub(new, line)
    for rx, new in _FILES:
        line = rx.sub(lambda m, new=new: (m[1] or "") + new, line)
    # again: a name (NAMES) imported from a module the dotted paths just moved
    return _FROM.sub(_split_from, line)


def rewrite_text(text: str) -> str:
    return "".join(_rewrite_line(line) for line in text.splitlines(keepends=True))


def old_mentions(text: str, path: str = "") -> list:
    """``(line, old)`` of every old path still named in ``text``."""
    found = []
    lines = text.split("\n")
    for old in _MOVED:
        for rx in (_dotted_re(old), _file_re(old)) if old in MOVES else (_dotted_re(old),):
            for m in rx.finditer(text):
                found.append((text.count("\n", 0, m.start()) + 1, m.group(0)))
    if path.endswith(".py"):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            tree = None
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    if f"{node.module}.{a.name}" in _MOVED:
                        found.append((node.lineno, f"from {node.module} import {a.name}"))
    return sorted({(n, what) for n, what in found if KEEP not in lines[n - 1]})


def files(paths=None):
    for p in paths or [os.path.join(REPO, r) for r in ROOTS]:
        if os.path.isfile(p):
            if p.endswith(SUFFIXES) and os.path.abspath(p) != SELF:
                yield p
            continue
        for d, dirs, names in os.walk(p):
            dirs[:] = sorted(x for x in dirs if x not in ("__pycache__", "build", ".venv") and not x.startswith("."))
            for f in sorted(names):
                full = os.path.join(d, f)
                if f.endswith(SUFFIXES) and os.path.abspath(full) != SELF:
                    yield full


def move_files() -> list:
    """``git mv`` each old module file that is still there (a merged branch
    added or kept it) to its new path; the moves done, as (old, new) paths."""
    done = []
    for old, new in MOVES.items():
        src, dst = (os.path.join(REPO, "pyflowbuf", _path(m)) for m in (old, new))
        if os.path.exists(src):
            if os.path.exists(dst):
                raise SystemExit(f"both {src} and {dst} exist: merge them by hand, then run again")
            subprocess.check_call(["git", "mv", src, dst], cwd=REPO)
            done.append((src, dst))
            print(f"moved {os.path.relpath(src, REPO)} -> {os.path.relpath(dst, REPO)}")
    return done


def main(argv) -> int:
    if not argv or argv[0] not in ("rewrite", "check", "table"):
        print(__doc__)
        return 2
    cmd, paths = argv[0], argv[1:]
    if cmd == "table":
        for old, new in _MOVED.items():
            print(f"{old} -> {new}")
        return 0
    bad = 0
    if cmd == "rewrite" and not paths:
        move_files()
    elif cmd == "check":
        for old in MOVES:
            if os.path.exists(os.path.join(REPO, "pyflowbuf", _path(old))):
                print(f"pyflowbuf/{_path(old)}: still at its old path (run rewrite)")
                bad += 1
    for path in files(paths):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if cmd == "rewrite":
            new = rewrite_text(text)
            if new != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
                print(f"rewrote {os.path.relpath(path, REPO)}")
        else:
            for line, what in old_mentions(text, path):
                print(f"{os.path.relpath(path, REPO)}:{line}: {what}")
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
