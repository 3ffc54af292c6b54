"""What ``pyflowbuf checkpoints list|show|verify`` know about a checkpoint
directory, as plain data (the same dicts feed the tables and ``--json``).

Reading only: nothing here writes, renames or removes a file (a
``CheckpointStorage`` is opened on the directory, and none of its writing or
retention methods is called).

The metadata is read twice over: once by ``CheckpointStorage`` (which checks it
and the task files) and once as the raw dict it holds, so that fields this
version does not know (operator ids, key groups, a savepoint's kind, written by
a later release) are shown as they are instead of being dropped."""
from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass

import fsspec

from pyflowbuf.checkpoint.container import FILE_METADATA, SEC_METADATA, _decode_section, _MemSource, _parse
from pyflowbuf.checkpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, PickleNotAllowedError
from pyflowbuf.checkpoint.lock import LOCK_FILE, read_lock, stale_reason
from pyflowbuf.checkpoint.storage import METADATA_FILE, CheckpointStorage, SavepointStorage

_CHK_DIR = re.compile(r"^chk-(0|[1-9][0-9]*)$")

COMPLETE, TORN, CORRUPT, INCOMPLETE = "complete", "torn", "corrupt", "incomplete"

# task fields of format 1; anything else in a task entry is shown as an extra column
_TASK_FIELDS = ("checkpoint_id", "task_key", "file", "size", "state_bytes", "inflight_bytes", "alignment",
                "inflight_buffers")
_META_FIELDS = ("format", "checkpoint_id", "trigger_time", "completion_time", "duration", "status", "tasks",
                "properties")


class CliError(Exception):
    """A user-facing failure of a command: one line on stderr, exit code 1."""


@dataclass
class Target:
    """What a PATH argument names: a checkpoint directory (``checkpoint_id``
    None) or one ``chk-<id>`` inside it."""

    storage: CheckpointStorage
    checkpoint_id: int | None
    given: str


def _split(url: str):
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path.rstrip("/") or "/"


def _children(fs, path) -> list[str]:
    fs.invalidate_cache(path)
    return [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)]


def open_target(path, checkpoint_id: int | None = None) -> Target:
    """Resolve ``PATH`` (and an optional id): a ``chk-<id>`` directory, its
    ``_metadata`` file, a savepoint's directory, or a job's
    ``checkpoint_dir``. Anything else is a CliError that says what was found."""
    given = os.fspath(path)
    try:
        fs, p = _split(given)
        exists = fs.exists(p)
    except (ValueError, ImportError) as e:   # an unknown protocol, a missing fsspec backend
        raise CliError(f"{given}: {e}") from None
    if not exists:
        raise CliError(f"{given}: no such file or directory")
    if fs.isfile(p):
        if posixpath.basename(p) != METADATA_FILE:
            raise CliError(f"{given} is a file, not a checkpoint directory (a chk-<id> directory, or the "
                           "checkpoint_dir holding them)")
        p = posixpath.dirname(p)
    name = posixpath.basename(p)
    m = _CHK_DIR.match(name)
    if m:
        cid = int(m.group(1))
        if checkpoint_id is not None and checkpoint_id != cid:
            raise CliError(f"{given} is checkpoint {cid}, and the id given is {checkpoint_id}: give a chk-<id> "
                           "directory, or the checkpoint_dir and an id")
        return Target(CheckpointStorage(fs.unstrip_protocol(posixpath.dirname(p))), cid, given)
    names = _children(fs, p)
    ids = sorted(int(n[4:]) for n in names if _CHK_DIR.match(n))
    if not ids:
        if METADATA_FILE in names:
            # a savepoint, or a chk-<id> directory copied under another name: one checkpoint on its own
            storage = SavepointStorage(fs.unstrip_protocol(p))
            try:
                cid = storage.checkpoint_id
            except CorruptCheckpointError as e:
                raise CliError(f"{given}: its {METADATA_FILE} is damaged ({e}): the savepoint cannot be "
                               "read") from None
            if checkpoint_id is not None and checkpoint_id != cid:
                raise CliError(f"{given} holds checkpoint {cid} (a savepoint), and the id given is {checkpoint_id}")
            return Target(storage, cid, given)
        jobs = job_directories(fs, p, names)
        if jobs:
            raise CliError(f"{given} holds the checkpoint directories of {len(jobs)} job(s) "
                           f"({', '.join(j['name'] for j in jobs)}), not checkpoints: give one of them, "
                           f"e.g. {posixpath.join(given, jobs[0]['name'])}")
        raise CliError(f"{given} is not a checkpoint directory: it holds no chk-<id> directories "
                       f"and no {METADATA_FILE}")
    if checkpoint_id is not None and checkpoint_id not in ids:
        raise CliError(f"{given} holds no checkpoint {checkpoint_id} (it holds chk-{', chk-'.join(map(str, ids))})")
    return Target(CheckpointStorage(fs.unstrip_protocol(p)), checkpoint_id, given)


def job_directories(fs, path, names=None) -> list[dict]:
    """The jobs' checkpoint directories directly below ``path`` (as the
    default ``checkpoints/<job name>`` puts them): each one's directory
    name, path, the job it belongs to (its lock's or its newest metadata's),
    how many chk-<id> it holds, the newest, and the running job holding its
    lock (None when none does)."""
    out = []
    for name in sorted(names if names is not None else _children(fs, path)):
        sub = posixpath.join(path, name)
        try:
            if not fs.isdir(sub):
                continue
            children = _children(fs, sub)
        except (OSError, ValueError):
            continue
        ids = sorted(int(n[4:]) for n in children if _CHK_DIR.match(n))
        lock = read_lock(fs, sub) if LOCK_FILE in children else None
        if not ids and lock is None:
            continue
        storage = CheckpointStorage(fs.unstrip_protocol(sub))
        owners = storage.owners()
        job = owners[max(owners)] if owners else None
        running = None
        if lock is not None and stale_reason(lock) is None:
            running = {"job": lock.get("job"), "pid": lock.get("pid"), "host": lock.get("host")}
        out.append({"name": name, "path": fs.unstrip_protocol(sub), "job": job if job is not None else
                    (lock or {}).get("job"), "checkpoints": len(ids), "newest": ids[-1] if ids else None,
                    "running": running})
    return out


def list_jobs(path) -> dict | None:
    """``list`` on a directory that holds jobs' checkpoint directories (the
    default ``checkpoints``), not checkpoints: which jobs; None when it holds
    neither."""
    given = os.fspath(path)
    try:
        fs, p = _split(given)
        if not fs.isdir(p):
            return None
        names = _children(fs, p)
        if METADATA_FILE in names or any(_CHK_DIR.match(n) for n in names):
            return None         # a checkpoint directory itself
        jobs = job_directories(fs, p, names)
    except (ValueError, ImportError, OSError):
        return None
    return {"directory": fs.unstrip_protocol(p), "jobs": jobs} if jobs else None


def raw_metadata(storage: CheckpointStorage, cid: int) -> dict:
    """The ``_metadata`` of checkpoint ``cid`` as the dict it holds, every field
    kept; its checksums are checked. CheckpointNotFoundError without one,
    CorruptCheckpointError when it is damaged."""
    path = f"{storage.checkpoint_path(cid)}/{METADATA_FILE}"
    try:
        with storage.fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"checkpoint {cid} is not complete (no {METADATA_FILE})") from None
    try:
        sections = list(_parse(_MemSource(memoryview(data)), FILE_METADATA))
        if [s.kind for s in sections] != [SEC_METADATA]:
            raise ValueError("expected exactly one metadata section")
        raw = _decode_section(sections[0], False)
        if type(raw) is not dict:
            raise ValueError("the metadata is not a dict")
    except Exception as e:
        raise CorruptCheckpointError(f"{METADATA_FILE}: {e}", checkpoint_id=cid, path=path) from e
    return raw


def _files(storage: CheckpointStorage, cid: int) -> dict:
    """name -> size of the files in a checkpoint's directory (temporary ones too)."""
    directory = storage.checkpoint_path(cid)
    try:
        storage.fs.invalidate_cache(directory)
        entries = storage.fs.ls(directory, detail=True)
    except FileNotFoundError:
        return {}
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0)
            for e in entries if e.get("type") != "directory"}


def _tasks(raw: dict) -> list[dict]:
    tasks = raw.get("tasks")
    if isinstance(tasks, dict):       # keyed by task in some later format: keep the key
        return [dict(v, task_key=v.get("task_key", k)) if isinstance(v, dict) else {"task_key": k, "value": v}
                for k, v in tasks.items()]
    return [t for t in tasks if isinstance(t, dict)] if isinstance(tasks, list) else []


def _damage(raw: dict | None, files: dict) -> list[str]:
    """Task files the metadata lists that are missing or have another size."""
    out = []
    for t in _tasks(raw or {}):
        name, size = t.get("file"), t.get("size")
        if name not in files:
            out.append(f"{name} is missing")
        elif size is not None and files[name] != size:
            out.append(f"{name} has {files[name]} bytes, the metadata says {size}")
    return out


def _alignment(raw: dict) -> str:
    props = raw.get("properties") if isinstance(raw.get("properties"), dict) else {}
    if props.get("alignment") in ("aligned", "unaligned", "switched"):
        return props["alignment"]
    kinds = {t.get("alignment") for t in _tasks(raw)}
    return "unaligned" if "unaligned" in kinds else ("aligned" if kinds else "")


def kind_of(raw: dict) -> str:
    """``checkpoint`` or ``savepoint`` (properties["kind"]; metadata written
    before the field existed holds checkpoints)."""
    props = raw.get("properties") if isinstance(raw.get("properties"), dict) else {}
    return str(raw.get("kind") or props.get("kind") or "checkpoint")


def describe(storage: CheckpointStorage, cid: int, *, verify: bool) -> dict:
    """One checkpoint as ``list`` shows it. ``status``: complete, torn (a task
    file missing or of another size), corrupt (metadata or checksums damaged;
    checksums are read only with ``verify``), incomplete (no ``_metadata``:
    in progress, or abandoned by a job that stopped)."""
    files = _files(storage, cid)
    entry = {"id": cid, "path": storage.fs.unstrip_protocol(storage.checkpoint_path(cid)), "status": None,
             "kind": None, "trigger_time": None, "completion_time": None, "duration_s": None, "alignment": None,
             "tasks": None, "state_bytes": None, "inflight_bytes": None, "size": sum(files.values()),
             "reason": None}
    try:
        storage.load_metadata(cid, verify=verify)
        entry["status"] = COMPLETE
    except CheckpointNotFoundError as e:
        entry["status"], entry["reason"] = INCOMPLETE, str(e)
    except CorruptCheckpointError as e:
        entry["status"], entry["reason"] = CORRUPT, e.reason
    try:
        raw = raw_metadata(storage, cid)
    except (CheckpointNotFoundError, CorruptCheckpointError):
        raw = None
    if raw is not None:
        tasks = _tasks(raw)
        entry.update(kind=kind_of(raw), trigger_time=raw.get("trigger_time"),
                     completion_time=raw.get("completion_time"), duration_s=raw.get("duration"),
                     alignment=_alignment(raw), tasks=len(tasks),
                     state_bytes=sum(int(t.get("state_bytes") or 0) for t in tasks),
                     inflight_bytes=sum(int(t.get("inflight_bytes") or 0) for t in tasks))
        if entry["status"] == CORRUPT and _damage(raw, files):
            entry["status"] = TORN
    return entry


def list_checkpoints(target: Target, *, verify: bool = False) -> dict:
    ids = [target.checkpoint_id] if target.checkpoint_id is not None else target.storage.checkpoint_ids()
    return {"directory": target.storage.url,
            "checkpoints": [describe(target.storage, cid, verify=verify) for cid in ids]}


def _latest_with_metadata(storage: CheckpointStorage) -> int:
    """The newest checkpoint that has a ``_metadata`` (complete or damaged)."""
    for cid in sorted(storage.checkpoint_ids(), reverse=True):
        if storage.fs.exists(f"{storage.checkpoint_path(cid)}/{METADATA_FILE}"):
            return cid
    raise CliError(f"{storage.url} holds no complete checkpoint (every chk-<id> directory lacks its "
                   f"{METADATA_FILE}: in progress or abandoned)")


def summarize(v, depth: int = 0) -> str:
    """A value of a task's state in a few characters: its type and size, not its contents."""
    if v is None or isinstance(v, (bool, int, float)):
        return repr(v)
    if isinstance(v, str):
        return repr(v) if len(v) <= 40 else repr(v[:37]) + "..."
    if isinstance(v, (bytes, bytearray, memoryview)):
        return f"{len(v)} bytes"
    if isinstance(v, dict):
        return f"dict of {len(v)}"
    if isinstance(v, (list, tuple)):
        if depth == 0 and len(v) <= 8:
            return "[" + ", ".join(summarize(i, 1) for i in v) + "]"
        return f"{type(v).__name__} of {len(v)}"
    shape = getattr(v, "shape", None)
    if shape is not None:
        return f"{type(v).__name__} {getattr(v, 'dtype', '')} {tuple(shape)}"
    return type(v).__name__


def _operator_line(op: dict) -> str:
    """One operator of a task's state (format 2: state per operator id): its
    id, type, the size of its encoded state and its key groups."""
    blob = op.get("value", op.get("state"))
    line = f"{op.get('uid')} ({op.get('type')}): "
    line += "no state" if blob is None else (f"{len(blob)} bytes" if isinstance(blob, (bytes, bytearray))
                                             else summarize(blob))
    groups = op.get("key_groups")
    if op.get("keyed") and isinstance(groups, (list, tuple)) and len(groups) == 2:
        line += f", key groups {groups[0]}..{groups[1] - 1}"
    refs = op.get("refs")
    if op.get("keyed") and isinstance(refs, list) and isinstance(op.get("written"), list):
        # an incremental checkpoint: the groups it wrote, and where the others are
        held = ", ".join(f"{len(r.get('groups') or ())} in chk-{r.get('checkpoint')}" for r in refs
                         if isinstance(r, dict))
        line += f" (incremental: {len(op['written'])} groups written here, refers to {held})"
    return line


def _state_summary(storage: CheckpointStorage, meta, key) -> dict:
    try:
        state = storage.read_task_state(meta.checkpoint_id, key, metadata=meta).state
    except PickleNotAllowedError:
        return {"state": "pickled objects (not read: they would run code)"}
    if isinstance(state, dict) and isinstance(state.get("operators"), list) and state.get("format", 1) >= 2:
        out = {k: summarize(v) for k, v in state.items() if k != "operators"}
        out["operators"] = "; ".join(_operator_line(op) for op in state["operators"] if isinstance(op, dict))
        return out
    if isinstance(state, dict):
        return {str(k): summarize(v) for k, v in state.items()}
    return {"state": summarize(state)}


def show(target: Target, *, state: bool = False) -> dict:
    """One checkpoint in detail: what its metadata records per task (and per
    operator, where the metadata holds operators), every field kept, and which
    task files are missing or torn. Checksums are ``verify``'s business.
    Without an id, the newest checkpoint that has metadata. With ``state``,
    each task's state file is read too (all its checksums checked) and
    summarized: its top-level entries, their types and sizes."""
    storage = target.storage
    cid = target.checkpoint_id if target.checkpoint_id is not None else _latest_with_metadata(storage)
    entry = describe(storage, cid, verify=False)
    if entry["status"] == INCOMPLETE:
        raise CliError(f"checkpoint {cid} in {storage.url} is not complete: {entry['reason']}")
    raw = raw_metadata(storage, cid)          # damaged metadata: CorruptCheckpointError
    files = _files(storage, cid)
    props = raw.get("properties") if isinstance(raw.get("properties"), dict) else {}
    align_ms = props.get("alignment_ms") if isinstance(props.get("alignment_ms"), dict) else {}
    tasks = []
    for t in sorted(_tasks(raw), key=lambda t: _natural(str(t.get("task_key")))):
        row = {k: t.get(k) for k in _TASK_FIELDS if k != "checkpoint_id"}
        row["alignment_ms"] = align_ms.get(t.get("task_key"))
        name = t.get("file")
        row["on_disk"] = ("missing" if name not in files
                          else "ok" if t.get("size") in (None, files[name]) else f"{files[name]} bytes (torn)")
        row["extra"] = {k: v for k, v in t.items() if k not in _TASK_FIELDS}
        tasks.append(row)
    if state:
        if entry["status"] != COMPLETE:
            raise CliError(f"checkpoint {cid} is {entry['status']} ({entry['reason']}): its state is not read; "
                           "`show` without --state lists what its metadata records")
        meta = storage.load_metadata(cid, verify=False)
        for row in tasks:
            row["state"] = _state_summary(storage, meta, row["task_key"])
    known_props = {"job", "mode", "alignment", "alignment_ms", "commits", "kind"}
    return {**entry, "operators": _operators(props, tasks),
            "job": props.get("job"), "mode": props.get("mode"),
            "commits": len(props["commits"]) if isinstance(props.get("commits"), list) else None,
            "format": raw.get("format"),
            "tasks": tasks,
            "properties": {k: v for k, v in props.items() if k not in known_props},
            "extra": {k: v for k, v in raw.items() if k not in _META_FIELDS and k != "kind"}}


def _operators(props: dict, tasks: list) -> list:
    """Per operator id (a state format 2 checkpoint's ``operators`` and
    ``layout``): its name, type, parallelism, state bytes, the key groups of
    each subtask, and the in-flight bytes of the tasks that hold it (the
    channels into and out of a task are its chain's, not one operator's)."""
    ops, layout = props.get("operators"), props.get("layout")
    if not isinstance(ops, dict):
        return []
    derived = props.get("derived_ids") if isinstance(props.get("derived_ids"), dict) else {}
    scheme = props.get("id_scheme")
    layout = layout if isinstance(layout, dict) else {}
    inflight = {t["task_key"]: t.get("inflight_bytes") or 0 for t in tasks}
    out = []
    for uid, o in ops.items():
        if not isinstance(o, dict):
            continue
        subs = o.get("subtasks") if isinstance(o.get("subtasks"), dict) else {}
        groups = sorted(tuple(v["key_groups"]) for v in subs.values()
                        if isinstance(v, dict) and isinstance(v.get("key_groups"), list))
        holders = [k for k, t in layout.items() if isinstance(t, dict)
                   and (uid in (t.get("uids") or []) or t.get("source_uid") == uid)]
        out.append({"uid": uid, "id_from": id_from(uid, scheme, derived),
                    "name": o.get("name"), "type": o.get("type"), "parallelism": o.get("parallelism"),
                    "keyed": bool(o.get("keyed")), "stateful": bool(o.get("stateful")),
                    "state_bytes": o.get("state_bytes"), "key_groups": [list(g) for g in groups],
                    "inflight_bytes": sum(inflight.get(k, 0) for k in holders), "tasks": sorted(holders, key=_natural)})
    return sorted(out, key=lambda o: _natural(str(o["uid"])))


_LEGACY_ID = re.compile(r"^.+#[0-9]+'*$")


def id_from(uid, scheme, derived: dict) -> str:
    """Where an operator's id came from: "uid" (``.uid()``), "graph" (derived
    from its place in the graph, ``runtime.graph.assign_uids``), or "name#rank"
    (derived from its name and rank, by releases before ids were derived from
    the graph: such a checkpoint records no ``id_scheme``, and an id of that
    form is taken for a derived one)."""
    if scheme is None:
        return "name#rank" if _LEGACY_ID.match(str(uid)) else "uid"
    info = derived.get(uid)
    if not isinstance(info, dict):
        return "uid"
    return "graph" if str(info.get("scheme", "")).startswith("topology") else str(info.get("scheme"))


def verify(target: Target) -> dict:
    """Every checksum of one checkpoint, or of every checkpoint in the
    directory that has metadata (incomplete ones are listed, not verified)."""
    storage = target.storage
    ids = [target.checkpoint_id] if target.checkpoint_id is not None else storage.checkpoint_ids()
    results = [describe(storage, cid, verify=True) for cid in ids]
    for r in results:
        r["verified"] = r["status"] != INCOMPLETE
    if target.checkpoint_id is not None:
        bad = [r for r in results if r["status"] != COMPLETE]
    else:
        bad = [r for r in results if r["status"] in (TORN, CORRUPT)]
    return {"directory": storage.url, "ok": not bad, "checkpoints": results}


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s)]
