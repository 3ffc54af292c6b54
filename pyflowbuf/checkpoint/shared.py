"""Shared state of incremental checkpoints: the files of earlier checkpoints
that a checkpoint refers to.

An incremental checkpoint writes, per keyed operator, only the key groups
that changed since the last complete checkpoint; for every other group its
state file names the earlier checkpoint whose file (of the same task)
holds it. The checkpoint's ``_metadata`` lists those files in
``properties["references"]``::

    [{"checkpoint": 41, "task": "v3-0", "file": "v3-0-1f0c9a3be27d4c55.state",
      "size": 18234, "alignment": "aligned"}, ...]

A checkpoint is complete only while every file it lists, its own and those
it refers to, is there with its recorded size (and checksums, when
verified). Retention keeps the newest ``retained`` complete checkpoints;
an older one that a kept checkpoint still refers to is *retired*: its
``_metadata`` goes first (it is no longer a checkpoint one can restore),
then every file no kept checkpoint refers to, and a ``_retired`` note says
why the directory is still there. References are flat (a checkpoint names
the very file that holds a group, never a checkpoint that refers on), and
a group is re-written once its copy is ``INCREMENTAL_MAX_AGE`` checkpoints
old, so only a bounded number of directories is ever kept for them.

A savepoint is always written whole: it refers to nothing and can be moved.
"""
from __future__ import annotations

import re

RETIRED_FILE = "_retired"
_TASK_FILE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*-[0-9a-f]{16}\.state$")
_FIELDS = ("checkpoint", "task", "file", "size", "alignment")


def references(meta) -> list[dict]:
    """The files of earlier checkpoints ``meta`` refers to (validated: a
    ``_metadata`` read from storage is data, and names files to open)."""
    refs = meta.properties.get("references") or []
    if type(refs) is not list:
        raise ValueError("references is not a list")
    for r in refs:
        if (type(r) is not dict or set(r) != set(_FIELDS) or type(r["checkpoint"]) is not int
                or not 0 <= r["checkpoint"] < meta.checkpoint_id or type(r["task"]) is not str
                or type(r["file"]) is not str or not _TASK_FILE.match(r["file"])
                or type(r["size"]) is not int or r["size"] < 0 or r["alignment"] not in ("aligned", "unaligned")):
            raise ValueError(f"invalid reference {r!r}")
    return refs


def referenced_ids(meta) -> list[int]:
    """The ids of the checkpoints ``meta`` refers to."""
    try:
        return sorted({r["checkpoint"] for r in references(meta)})
    except ValueError:
        return []


def needed_files(metas) -> dict[int, set]:
    """Checkpoint id -> the names of its files that ``metas`` refer to."""
    out: dict[int, set] = {}
    for m in metas:
        for r in references(m):
            out.setdefault(r["checkpoint"], set()).add(r["file"])
    return out


def retire(storage, checkpoint_id: int, keep: set, why: str, log) -> None:
    """Checkpoint ``checkpoint_id`` leaves retention, but later checkpoints
    refer to its files ``keep``: drop its ``_metadata`` (first: a crash
    leaves a directory that is no checkpoint, never one that looks complete
    and lacks files), note why the directory stays, drop the other files."""
    fs = storage.fs
    directory = storage.checkpoint_path(checkpoint_id)
    log.info("retiring checkpoint %d (%s); keeping %d file(s) later checkpoints refer to",
             checkpoint_id, why, len(keep))
    try:
        try:
            fs.rm(f"{directory}/_metadata")
        except FileNotFoundError:
            pass
        note = f"{directory}/{RETIRED_FILE}"
        if not fs.exists(note):
            with fs.open(note, "wb") as f:
                f.write(("checkpoint %d left retention (%s); this directory keeps only the state files "
                         "that later incremental checkpoints refer to: %s\n"
                         % (checkpoint_id, why, ", ".join(sorted(keep)))).encode())
        for name in fs.ls(directory, detail=False):
            base = name.rstrip("/").rsplit("/", 1)[-1]
            if base not in keep and base != RETIRED_FILE:
                fs.rm(name, recursive=True)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not retire checkpoint %d at %s: %s", checkpoint_id, directory, e)


def is_retired(storage, checkpoint_id: int) -> bool:
    try:
        return storage.fs.exists(f"{storage.checkpoint_path(checkpoint_id)}/{RETIRED_FILE}")
    except OSError:
        return False
