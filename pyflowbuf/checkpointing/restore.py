"""Restoring a checkpoint or savepoint into a job graph by operator id.

A checkpoint stores each subtask's state per operator id (``Stream.uid``, or
one derived from the operator's place in the graph: ``graph.assign_uids``),
keyed state split by key group (``pyflowbuf.checkpoint.keygroups``). A
restore maps that state to the operators of the job being started:

* ids first (``RestorePlan.map_ids``): a uid is itself; a derived id is
  checked against what the checkpoint recorded of it (``derived_ids``: its
  group, rank and what it fed), and refused where another operator of its
  type may have been inserted or removed beside it; a checkpoint written
  before ids were derived from the graph (no ``id_scheme``) holds ids of
  name and rank (``"reduce#0"``), read by that rule; an operator given a
  uid since finds the state of the id derived for it;

* an operator whose id is in the checkpoint gets its state: keyed state, the
  key groups of the new subtask's range, whatever the two parallelisms (up to
  ``max_parallelism``); per-subtask state, that subtask's (at another
  parallelism only where the operator knows how to redistribute it: sources'
  positions, file sinks' part numbers);
* an operator that is new starts empty; stateless operators may be added,
  removed, renamed or chained differently;
* state of an operator that is gone is refused, unless
  ``allow_non_restored_state=True`` drops it;
* ``max_parallelism`` cannot change (keys would move between groups);
* in-flight data of an unaligned checkpoint goes back into the channels it
  was captured in where its edge is unchanged, is redistributed by key group
  where a changed edge is keyed (``pyflowbuf.checkpointing.inflight``),
  and is refused on a changed edge that is not keyed, or from a checkpoint
  written before edges were recorded into any other job graph or
  parallelism: take a savepoint, which is always aligned.

The stored layout (format 2) of a subtask's STATE value::

    {"format": 2, "vertex": "src -> map", "subtask": 0, "parallelism": 2,
     "max_parallelism": 128, "finished": False,
     "source_uid": "numbers", "source": <position>, "source_identity": {...},
     "operators": [{"uid": "KeyedReduce-3f2a9c1b04de", "name": "reduce", "type": "KeyedReduce",
                    "keyed": True, "key_groups": [0, 64], "value": <dumps(keyed value)>},
                   {"uid": "Map-783c9e66ef27", "name": "map", "type": "Map", "state": None}, ...],
     "derived_ids": {"KeyedReduce-3f2a9c1b04de": {"scheme": "topology-1", ...}, ...}}

A keyed operator's entry also holds ``"key_kinds"``: the kinds of every key
in its state (``pyflowbuf.checkpointing.key_kinds``), repeated per operator in
``_metadata`` and checked against the first keys a restored operator
computes; ``"key_migrated"`` where the job declared ``Stream.migrate_keys``
(its keys are the new ones). A file sink's entry holds its ``"directory"``,
named when a restore drops its state and its pending commits.

A keyed value is ``{"maps": {name: {"columns": ..., "groups": uint16 array}},
"timers": {name: {"times": [...], "keys": [...], "groups": uint16 array}},
"common": ...}``: every entry with its key group beside it, in the order the
operator holds them (written in that order, which is the fast one), so a
restore at another parallelism picks its groups' entries without hashing a
key. A map is stored by columns (``pyflowbuf.checkpoint.columns``: numbers
as arrays); checkpoints before that stored ``"entries": {key: ...}``, which
is still read. Each operator's value (and a per-subtask state) is one
``container.dumps`` value, decoded once per restore whatever the number of
new subtasks that share it.

Incremental checkpoints (``pyflowbuf.checkpoint.shared``): a keyed entry
that lists ``"written": [groups]`` and ``"refs": [{"checkpoint": id,
"groups": [...]}]`` holds only the groups it wrote; the others are in the
same subtask's state file of each checkpoint it refers to, and a restore
merges them (``merge_keyed_values``).
A subtask that holds in-flight data adds to its summary in ``_metadata``
``"inflight_items"`` (the names of its items: ``in/<input>/<channel>``,
``out/<output>/<subpartition>``) and ``"edges"`` (its inputs' and outputs'
edges: ``inflight.edge_descriptions``).
The checkpoint's ``_metadata`` repeats the layout in plain fields
(``properties["state_format"]``, ``["max_parallelism"]``, ``["operators"]``:
per operator id its name, type, parallelism, key groups and state bytes per
subtask; ``["id_scheme"]`` and ``["derived_ids"]``: which ids were derived,
how), for tools that show a checkpoint without reading its task files.
"""
from __future__ import annotations

import logging
import os
import warnings
from operator import itemgetter

import numpy as np

from pyflowbuf import errors
from pyflowbuf.checkpoint.columns import decode_map, decode_rows, encode_map
from pyflowbuf.checkpoint.container import dumps, loads
from pyflowbuf.checkpoint.storage import CorruptCheckpointError, IncompatibleCheckpointError
from pyflowbuf.checkpoint import keygroups as kg
from pyflowbuf.connectors import api as connector_api
from pyflowbuf.connectors import outputs as sink_outputs
from pyflowbuf.jobgraph.graph import ID_SCHEME, LEGACY_SCHEME, assign_uids, is_stateful, operator_type
from pyflowbuf.checkpointing import assignment, key_kinds
from pyflowbuf.operators.contracts import type_name
from pyflowbuf.checkpointing.inflight import InflightPlan, decoded as decoded_inflight

log = logging.getLogger("pyflowbuf.checkpoint")

STATE_FORMAT = 2


# ---------------------------------------------------------------- writing

def task_key(vertex, index) -> str:
    """A subtask's name in checkpoints: stable across attempts and processes,
    for the same graph (vertex ids follow the order operators were declared)."""
    return f"v{vertex.id}-{index}"


def graph_task_keys(vertices) -> set:
    """The task keys of a whole job graph (the iterator sink is no task)."""
    return {task_key(v, i) for v in vertices if not v.is_iterator for i in range(v.parallelism)}


def chain_uids(vertex) -> list:
    """The operator ids of a vertex's operators (the nodes with an operator)."""
    return [n.operator_uid for n in vertex.nodes if n.make_operator is not None]


def stored_state(task, state: dict, max_parallelism: int, allow_pickle: bool) -> tuple[dict, dict]:
    """A snapshot (``SubtaskCheckpoints.snapshot``: raw operator states in
    chain order) in the stored layout, and its summary for ``_metadata``.
    Runs in the snapshot writer's thread, not the task's."""
    v, i = task.vertex, task.index
    start, end = assignment.key_groups(max_parallelism, v.parallelism, i)
    entries, summary_ops, referenced = [], {}, set()
    # operators that declared a key migration: their state now holds the new keys
    migrated = {n.operator_uid for n in v.nodes if n.key_migration is not None}
    increments = state.get("increments") or [None] * len(task.operators)
    for op, raw, inc in zip(task.operators, state["operators"], increments):
        uid = op.uid or op.name
        e = {"uid": uid, "name": op.name, "type": type_name(op)}
        info = {"name": op.name, "type": e["type"], "stateful": raw is not None, "keyed": False, "bytes": 0}
        if raw is not None and op.keyed_state:
            written, refs = (None, None) if inc is None or not inc[1] else inc
            value, present = keyed_value(op, raw, max_parallelism, start, end, uid, i, written)
            kinds = value.pop("key_kinds")
            blob = dumps(value, allow_pickle=allow_pickle)
            e.update(keyed=True, key_groups=[start, end], value=blob, key_kinds=kinds)
            info.update(keyed=True, key_groups=[start, end], groups=present, bytes=len(blob), key_kinds=kinds)
            if uid in migrated:
                e["key_migrated"] = info["key_migrated"] = True
            if refs:
                e["written"] = written
                e["refs"] = [{"checkpoint": c, "groups": gs} for c, gs in sorted(refs.items())]
                info["written_groups"] = len(written)
                info["refs"] = {str(c): len(gs) for c, gs in sorted(refs.items())}
                referenced.update(refs)
        else:
            blob = None if raw is None else dumps(raw, allow_pickle=allow_pickle)
            e["state"] = blob
            info["bytes"] = 0 if blob is None else len(blob)
        directory = op.commit_directory
        if directory is not None:
            # a restore that drops this sink's state names the directory of its pending commits
            e["directory"] = info["directory"] = directory
        entries.append(e)
        summary_ops[uid] = info
    out = dict(state)
    out.pop("increments", None)
    out.update(format=STATE_FORMAT, parallelism=v.parallelism, max_parallelism=max_parallelism,
               operators=entries, source_uid=v.head.operator_uid if task.source is not None else None)
    summary = {"vertex": v.name, "subtask": i, "parallelism": v.parallelism, "finished": bool(state["finished"]),
               "source_uid": out["source_uid"], "uids": [e["uid"] for e in entries], "operators": summary_ops}
    derived = derived_ids(v)
    if derived:
        out["derived_ids"] = summary["derived_ids"] = derived
    if referenced:
        summary["refs"] = sorted(referenced)
    return out, summary


def derived_ids(vertex) -> dict:
    """How the ids of a vertex's operators without a uid were derived
    (``graph.assign_uids``: scheme, group, rank, of, names, next), by id:
    what a restore checks its mapping against."""
    return {n.operator_uid: dict(n.id_info) for n in vertex.nodes
            if n.uid is None and n.id_info is not None and (n.make_operator is not None or n.source is not None)}


def keyed_value(op, raw, max_parallelism, start, end, uid, index, written=None):
    """A keyed operator's snapshot as stored: its maps in their own order
    with the key group of each entry beside them (``groups``, uint16), its
    timers as parallel lists with theirs, and the keyless rest. Returns it
    and the number of key groups it holds entries of. ``written``: only
    the entries of these key groups (an incremental checkpoint)."""
    maps, timers, common = op.keyed_parts(raw)
    value = {"maps": {}, "timers": {}, "common": common}
    indexes = []
    kinds = set()       # of every key held (not only the written groups'): checked on restore
    keep = None
    if written is not None:
        keep = np.zeros(end - start, dtype=bool)
        keep[np.asarray(written, dtype=np.int64) - start] = True
    for name, (d, key_of) in maps.items():
        ks = list(d)
        rks = ks if key_of is None else [key_of(k) for k in ks]
        idx = kg.group_index(rks, max_parallelism)
        kinds |= key_kinds.kinds_of(rks)
        indexes.append(idx)
        if keep is not None:
            d, idx = _pick_entries(d, idx, keep, start)
        # by columns: a map of tuples of numbers encodes as a few arrays (checkpoint.columns)
        value["maps"][name] = {"columns": encode_map(d), "groups": idx}
    for name, (snap, key_of) in timers.items():
        times, keys = kg.flatten_timers(snap)
        rks = keys if key_of is None else [key_of(k) for k in keys]
        idx = kg.group_index(rks, max_parallelism)
        kinds |= key_kinds.kinds_of(rks)
        indexes.append(idx)
        if keep is not None:
            sel = _picked(idx, keep, start)
            if sel is not None:
                times, keys, idx = [times[j] for j in sel], [keys[j] for j in sel], idx[sel]
        value["timers"][name] = {"times": times, "keys": keys, "groups": idx}
    present = np.concatenate(indexes) if indexes else np.empty(0, np.uint16)
    if present.size and (int(present.min()) < start or int(present.max()) >= end):
        stray = int(present[(present < start) | (present >= end)][0])
        raise errors.FlowBufError(
            f"operator {op.name!r} (uid {uid!r}) holds keys of key group {stray}, outside the groups "
            f"[{start}, {end}) of its subtask {index}: its input was not partitioned by key_by with this "
            "job's max_parallelism, so its state could not be restored where its keys go")
    value["key_kinds"] = sorted(kinds)
    return value, int(np.unique(present).size)


def map_entries(m) -> dict:
    """A stored keyed map's entries: by columns (``checkpoint.columns``), or
    a dict as checkpoints before them stored it."""
    return m["entries"] if "entries" in m else decode_map(m["columns"])


def _picked(idx, keep, start):
    """The positions of the entries whose group ``keep`` marks; None for all.
    (Groups outside the range are kept: the caller's range check refuses them.)"""
    rel = idx.astype(np.int64) - start
    inside = (rel >= 0) & (rel < keep.size)
    mask = ~inside
    mask[inside] = keep[rel[inside]]
    if mask.all():
        return None
    return np.flatnonzero(mask)


def _pick_entries(d: dict, idx, keep, start):
    sel = _picked(idx, keep, start)
    if sel is None:
        return d, idx
    if not len(sel):
        return {}, idx[:0]
    items = list(d.items())
    got = itemgetter(*sel.tolist())(items) if len(sel) > 1 else [items[int(sel[0])]]
    return dict(got), idx[sel]


def merge_keyed_values(parts) -> dict:
    """One stored keyed value from an incremental checkpoint's own value and
    those it refers to: ``parts`` is ``[(value, groups)]``, ``groups`` the key
    groups to take from that value (None: all of it). The groups of the parts
    are disjoint; timers come out in time order."""
    maps: dict = {}
    timers: dict = {}
    common = None
    for n, (v, groups) in enumerate(parts):
        if n == 0:
            common = v["common"]
        pick = None if groups is None else np.asarray(groups, dtype=np.int64)
        for name, m in v["maps"].items():
            d, g = map_entries(m), np.asarray(m["groups"])
            if pick is not None:
                sel = np.flatnonzero(np.isin(g, pick))
                if len(sel) != len(g):
                    items = list(d.items())
                    d = dict(itemgetter(*sel.tolist())(items)) if len(sel) > 1 else dict(items[j] for j in sel)
                    g = g[sel]
            acc = maps.setdefault(name, ({}, []))
            acc[0].update(d)
            acc[1].append(g)
        for name, t in v["timers"].items():
            times, keys, g = t["times"], t["keys"], np.asarray(t["groups"])
            if pick is not None:
                sel = np.flatnonzero(np.isin(g, pick)).tolist()
                times, keys, g = [times[j] for j in sel], [keys[j] for j in sel], g[sel]
            acc = timers.setdefault(name, ([], [], []))
            acc[0].extend(times)
            acc[1].extend(keys)
            acc[2].append(g)
    out = {"maps": {}, "timers": {}, "common": common}
    for name, (d, gs) in maps.items():
        out["maps"][name] = {"entries": d, "groups": np.concatenate(gs).astype(np.uint16)}
    for name, (times, keys, gs) in timers.items():
        order = sorted(range(len(times)), key=times.__getitem__)
        g = np.concatenate(gs).astype(np.uint16)
        out["timers"][name] = {"times": [times[j] for j in order], "keys": [keys[j] for j in order],
                               "groups": g[order] if order else g}
    return out


def keyed_restore(op, values, start=None, end=None):
    """The state of ``op`` from stored keyed values (``keyed_value``), each
    ``(value, owner)``: the entries of key groups ``[start, end)`` (all of
    them when ``start`` is None), merged. ``owner``: whether the subtask the
    value came from counts its keyless counters here (None: as stored)."""
    maps: dict = {}
    pairs: dict = {}
    commons = []
    for v, owner in values:
        for name, m in v["maps"].items():
            sel = _selection(m["groups"], start, end)
            if "entries" not in m and (sel is None or len(sel)):
                # a dict made here: the first is kept as it is (a copy would touch every entry again)
                got = decode_map(m["columns"]) if sel is None else decode_rows(m["columns"], sel)
                if name in maps:
                    maps[name].update(got)
                else:
                    maps[name] = got
                continue
            target = maps.setdefault(name, {})
            if sel is None:
                target.update(m["entries"])
            elif len(sel):
                sel = sel.tolist()
                items = list(m["entries"].items())
                # one C loop picks them (itemgetter of several gives a tuple, of one the item)
                target.update(itemgetter(*sel)(items) if len(sel) > 1 else [items[sel[0]]])
        for name, t in v["timers"].items():
            got = pairs.setdefault(name, [])
            sel = _selection(t["groups"], start, end)
            if sel is None:
                got.extend(zip(t["times"], t["keys"]))
            else:
                times, keys = t["times"], t["keys"]
                got.extend((times[j], keys[j]) for j in sel.tolist())
        common = v["common"]
        if isinstance(common, dict) and owner is not None:
            common = dict(common, owner=owner)
        commons.append(common)
    single = len(values) == 1
    timers = {name: kg.timers_from(got if single else sorted(got, key=_time_of)) for name, got in pairs.items()}
    return op.from_keyed_parts(maps, timers, commons)


def _time_of(pair):
    return pair[0]


def _selection(groups, start, end):
    """The positions of the entries in ``[start, end)`` (an int64 array); None for all of them."""
    if start is None:
        return None
    groups = np.asarray(groups)
    mask = (groups >= start) & (groups < end)
    if mask.all():
        return None
    return np.flatnonzero(mask)


def summary_of(stored: dict) -> dict:
    """``stored_state``'s summary, from the stored layout itself (a task
    restored as finished hands its stored state on to later checkpoints)."""
    ops = {}
    for e in stored["operators"]:
        info = {"name": e["name"], "type": e["type"], "keyed": bool(e.get("keyed")), "bytes": 0,
                "stateful": bool(e.get("keyed")) or e.get("state") is not None}
        if e.get("keyed"):
            info.update(key_groups=list(e["key_groups"]), bytes=len(e["value"]))
            for k in ("key_kinds", "key_migrated"):
                if k in e:
                    info[k] = e[k]
        elif e.get("state") is not None:
            info["bytes"] = len(e["state"])
        if "directory" in e:
            info["directory"] = e["directory"]
        ops[e["uid"]] = info
    out = {"vertex": stored["vertex"], "subtask": stored["subtask"], "parallelism": stored["parallelism"],
           "finished": bool(stored["finished"]), "source_uid": stored.get("source_uid"),
           "uids": [e["uid"] for e in stored["operators"]], "operators": ops, "inflight": False}
    if stored.get("derived_ids"):
        out["derived_ids"] = stored["derived_ids"]
    return out


def metadata_properties(summaries: dict, max_parallelism) -> dict:
    """The plain fields ``_metadata`` holds about the state: per operator id,
    its name, type, parallelism, and per subtask the key groups and bytes;
    ``id_scheme`` and ``derived_ids``: which ids were derived, and how
    (``graph.assign_uids``), the others being uids."""
    ops: dict = {}
    derived: dict = {}
    for task_key, s in sorted(summaries.items()):
        if s is None:
            continue
        derived.update(s.get("derived_ids") or {})
        if s.get("source_uid"):
            src = ops.setdefault(s["source_uid"], {"name": s["vertex"].split(" -> ")[0], "type": "source",
                                                   "parallelism": s["parallelism"], "keyed": False,
                                                   "stateful": True, "state_bytes": 0, "subtasks": {}})
            src["subtasks"][task_key] = {"subtask": s["subtask"], "bytes": 0}
        for uid, info in s["operators"].items():
            o = ops.setdefault(uid, {"name": info["name"], "type": info["type"], "parallelism": s["parallelism"],
                                     "keyed": False, "stateful": False, "state_bytes": 0, "subtasks": {}})
            o["keyed"] = o["keyed"] or info["keyed"]
            o["stateful"] = o["stateful"] or info["stateful"]
            o["state_bytes"] += info["bytes"]
            if info["keyed"]:
                _merge_key_kinds(o, info)
            if "directory" in info:
                o["directory"] = info["directory"]
            sub = {"subtask": s["subtask"], "bytes": info["bytes"]}
            if info.get("key_groups") is not None:
                sub["key_groups"] = info["key_groups"]
            o["subtasks"][task_key] = sub
    return {"state_format": STATE_FORMAT, "max_parallelism": max_parallelism, "operators": ops,
            "id_scheme": ID_SCHEME, "derived_ids": {uid: info for uid, info in derived.items() if uid in ops},
            "layout": {k: _without_ids(s) for k, s in summaries.items() if s is not None}}


def _without_ids(summary: dict) -> dict:
    # (derived_ids: once for the checkpoint, not once per subtask)
    if "derived_ids" not in summary:
        return summary
    return {k: v for k, v in summary.items() if k != "derived_ids"}


def _merge_key_kinds(o: dict, info: dict) -> None:
    """An operator's key kinds in ``_metadata``: those of all its subtasks;
    None where a subtask's state does not say (written before kinds were)."""
    if "key_kinds" not in info:
        o["key_kinds"] = None
    elif o.get("key_kinds", ()) is not None:
        o["key_kinds"] = sorted(set(o.get("key_kinds", ())) | set(info["key_kinds"]))
    if info.get("key_migrated"):
        o["key_migrated"] = True


# ---------------------------------------------------------------- restoring

class RestorePlan:
    """Maps a complete checkpoint's state onto a job graph (see the module
    docstring). ``check(vertices)`` refuses what cannot be restored before
    anything starts; ``task_restore(task)`` builds one subtask's restore."""

    def __init__(self, storage, meta, max_parallelism: int, allow_non_restored_state: bool = False,
                 check_key_kinds: bool = True):
        self.storage = storage
        # False where the checkpoint was written by this very execution (a restart): its keys are
        # those of the same key functions, and a kind first met after it is a new key, not a change
        self.check_key_kinds = check_key_kinds
        self.meta = meta
        self.max_parallelism = max_parallelism
        self.allow_non_restored = bool(allow_non_restored_state)
        props = meta.properties
        self.layout = props.get("layout") or {}
        self.operators = props.get("operators") or {}
        self.old_max = props.get("max_parallelism")
        self._cache: dict = {}
        self._decoded: dict = {}
        self._inflight = None       # the InflightPlan, once a graph asked
        # ids of operators without a uid: derived from the graph, or (written
        # before that) from name and rank; either way mapped to this job's ids
        # once its graph is known (map_ids)
        self.id_scheme = props.get("id_scheme", LEGACY_SCHEME)
        self.derived = props.get("derived_ids") or {}
        self._rename: dict = {}
        self._mapped = False

    @property
    def where(self) -> str:
        return f"checkpoint {self.meta.checkpoint_id} ({self.meta.path or self.storage.url})"

    # ---- reading ----
    def _read(self, task_key) -> dict:
        st = self._cache.get(task_key)
        if st is None:
            snap = self.storage.read_task_state(self.meta.checkpoint_id, task_key, metadata=self.meta)
            st = self._renamed_state(snap.state)
            if snap.inflight:
                st = dict(st)
                st["inflight"] = decoded_inflight(snap.inflight)
            self._cache[task_key] = st
        return st

    def _old_tasks_of(self, uid) -> list:
        """(task key, layout) of every old subtask holding operator or source ``uid``, by subtask index."""
        out = [(k, s) for k, s in self.layout.items() if uid in s["uids"] or s.get("source_uid") == uid]
        return sorted(out, key=lambda ks: ks[1]["subtask"])

    def _same_task(self, vertex, index, uids, source_uid):
        """The old subtask with exactly this task's operators and parallelism, if any."""
        for k, s in self.layout.items():
            if (s["subtask"] == index and s["parallelism"] == vertex.parallelism and s["uids"] == uids
                    and s.get("source_uid") == source_uid):
                return k
        return None

    # ---- operator ids ----
    def map_ids(self, vertices) -> None:
        """Map the checkpoint's operator ids onto this job's, once: an
        operator with a uid has its uid; one without has its derived id,
        found by the rule the checkpoint was written with (``id_scheme``: its
        place in the graph; before that, its name and rank, read as such only
        from such a checkpoint). An operator given a uid since keeps the state
        of the id derived for it, where the checkpoint holds nothing under
        that uid. A derived id the checkpoint holds stateful state of, whose
        operator cannot be told apart from another of its type (one of its
        type inserted, removed or reordered beside it or right after it) is
        refused: ``IncompatibleCheckpointError`` naming them and ``.uid()``."""
        if self._mapped or vertices is None:
            return
        self._mapped = True
        nodes = sorted({id(n): n for v in vertices for n in v.nodes}.values(), key=lambda n: n.id)
        legacy = self.id_scheme == LEGACY_SCHEME
        taken = {n.operator_uid for n in nodes}
        rename, pairs = {}, []
        for n in nodes:
            if n.make_operator is None and n.source is None:
                continue        # an iterator sink: nothing stored
            old = n.legacy_uid if legacy else n.derived_uid
            if n.uid is not None:
                # a uid given since: its state, if any, is under the id derived for it then
                if n.uid in self.operators or old not in self.operators or old in taken:
                    continue
                if not legacy and old not in self.derived:
                    continue
            if old in self.operators:
                pairs.append((old, n))
                if old != n.operator_uid:
                    rename[old] = n.operator_uid
        if not legacy:
            self._check_derived(pairs)
        if rename:
            self._rename = rename
            self.operators = {rename.get(k, k): v for k, v in self.operators.items()}
            self.layout = {k: _renamed_layout(s, rename) for k, s in self.layout.items()}
            self._cache.clear()

    def _check_derived(self, pairs) -> None:
        bad = []
        for old, n in pairs:
            info, new = self.derived.get(old), n.id_info
            if info is None or new is None or not self.operators.get(old, {}).get("stateful"):
                continue
            if info.get("of") != new.get("of"):
                bad.append(f"{n.name!r} (id {old!r}): {info.get('of')} operator(s) of its type read the same "
                           f"input(s) in the checkpoint, {new.get('of')} here")
            elif (info.get("of", 1) > 1 and info.get("names") != new.get("names")
                  and sorted(info.get("names") or []) == sorted(new.get("names") or [])):
                bad.append(f"{n.name!r} (id {old!r}): the operators of its type that read the same input(s) "
                           f"were declared in another order ({', '.join(info['names'])}; now "
                           f"{', '.join(new['names'])})")
            elif not set(info.get("next") or ()) <= set(new.get("next") or ()):
                was = ", ".join(info.get("next") or ()) or "nothing stateful"
                now = ", ".join(new.get("next") or ()) or "nothing stateful"
                bad.append(f"{n.name!r} (id {old!r}) fed {was} in the checkpoint and feeds {now} here: an "
                           f"operator of its type ({operator_type(n)}) may have been inserted or removed next to it")
        if bad:
            raise IncompatibleCheckpointError(
                f"{self.where}: the state of operator(s) without a uid cannot be mapped safely onto this job: "
                + "; ".join(bad) + ". Their ids are derived from their place in the graph, and this change "
                "could hand one operator's state to another. Restore into the job as it was with .uid('...') "
                "given to these operators (they keep their state), take a savepoint, then change the job")

    def _renamed_state(self, st):
        """A stored subtask state with the checkpoint's ids as this job's (``map_ids``)."""
        r = self._rename
        if not r or not isinstance(st, dict):
            return st
        st = dict(st)
        if st.get("source_uid") in r:
            st["source_uid"] = r[st["source_uid"]]
        st["operators"] = [dict(e, uid=r[e["uid"]]) if e.get("uid") in r else e for e in st.get("operators") or ()]
        return st

    # ---- checks, before anything starts ----
    def check(self, vertices) -> None:
        self.map_ids(vertices)
        where = self.where
        if self.old_max != self.max_parallelism:
            raise errors.ConfigurationError(
                f"{where} was taken with max_parallelism={self.old_max}, this job has max_parallelism="
                f"{self.max_parallelism}: a key's group is its hash modulo max_parallelism, so changing it would "
                f"move keys away from their state. Restore with Environment(max_parallelism={self.old_max})")
        new = {}
        for v in vertices:
            if v.is_iterator:
                continue
            if v.head.source is not None:
                new[v.head.operator_uid] = (v, None)
            for n in v.nodes:
                if n.make_operator is not None:
                    new[n.operator_uid] = (v, n)
        gone = sorted(uid for uid, o in self.operators.items() if o.get("stateful") and uid not in new)
        if gone:
            names = ", ".join(f"{uid!r} ({self.operators[uid]['name']})" for uid in gone)
            if not self.allow_non_restored:
                raise IncompatibleCheckpointError(
                    f"{where} holds state of operator id(s) {names}, which this job does not have. Give the "
                    "operator its uid again (Stream.uid), or drop that state on purpose with "
                    "execute(restore_from=..., allow_non_restored_state=True)")
            log.warning("pyflowbuf: %s: state of %s dropped (allow_non_restored_state=True)", where, names)
        for uid, (v, n) in new.items():
            old = self.operators.get(uid)
            if old is None or not old.get("stateful"):
                continue
            if n is not None:
                op_type = type_name(n.make_operator())
                if old["type"] != op_type:
                    raise IncompatibleCheckpointError(
                        f"{where}: operator id {uid!r} was a {old['type']} ({old['name']!r}) and is a {op_type} "
                        f"({n.name!r}) in this job: give each operator its own uid")
            elif old["type"] != "source":
                raise IncompatibleCheckpointError(
                    f"{where}: operator id {uid!r} was a {old['type']} and is a source in this job")
            if old["parallelism"] != v.parallelism and v.parallelism > self.max_parallelism:
                raise errors.ConfigurationError(
                    f"operator {uid!r}: parallelism {v.parallelism} is above max_parallelism={self.max_parallelism}")
        # in-flight data: back into the very channels it was captured in where
        # the edge is unchanged, by key group on a changed keyed edge, refused
        # elsewhere (pyflowbuf.checkpointing.inflight)
        plan = self._inflight_plan(vertices)
        if plan is not None:
            running = [v for v in vertices if not v.is_iterator]
            # (an older checkpoint's in-flight data does not say which edge it is on: its task's
            # queued output goes to receivers, so the whole graph must be the same, not the task alone)
            same_graph = (all(any(_holds_task(s, v) for v in running) for s in self.layout.values())
                          and all(any(_holds_task(s, v) for s in self.layout.values()) for v in running))
            plan.check(lambda s: same_graph and any(_holds_task(s, v) for v in running))
        # a task that had ended is restored as ended only into the same task
        for v in vertices:
            if v.is_iterator:
                continue
            uids = chain_uids(v)
            src = v.head.operator_uid if v.head.source is not None else None
            for i in range(v.parallelism):
                if self._same_task(v, i, uids, src) is not None:
                    continue
                for uid in uids + ([src] if src else []):
                    for k, s in self._old_tasks_of(uid):
                        # a source that read its share is only a position at the end; an
                        # operator that ended has emitted what it emits at the end already
                        if s.get("finished") and any(o.get("stateful") for o in s["operators"].values()):
                            raise errors.ConfigurationError(
                                f"{where}: task {s['vertex']!r} ({k}) had reached the end of its input and holds "
                                "state; a job whose stateful tasks had ended restores only into the same operators "
                                "at the same parallelism")

    def check_sources(self, vertices) -> None:
        """Each source whose id the checkpoint holds checks the identity of
        the input it recorded (before any worker process starts)."""
        self.map_ids(vertices)
        for v in vertices:
            if v.head.source is None:
                continue
            olds = self._old_tasks_of(v.head.operator_uid)
            if not olds:
                continue
            st = self._read(olds[0][0])
            if "source_identity" not in st:
                continue
            source = v.head.source()
            try:
                source.check_identity(st["source_identity"], st.get("source"))
            except IncompatibleCheckpointError as exc:
                raise IncompatibleCheckpointError(
                    f"checkpoint {self.meta.checkpoint_id}: source {v.head.name!r} (uid {v.head.operator_uid!r}): "
                    f"{exc}", source=v.head.name) from None

    # ---- one subtask ----
    def task_restore(self, task) -> dict:
        """The restore of one subtask (Subtask.restore), read from the
        checkpoint; its operators are the task's own (for their merge rules)."""
        v, i = task.vertex, task.index
        vertices = getattr(getattr(task, "job", None), "vertices", None)
        self.map_ids(vertices if vertices is not None else _graph_of(v))
        uids = chain_uids(v)
        src_uid = v.head.operator_uid if task.source is not None else None
        same = self._same_task(v, i, uids, src_uid)
        inflight = self._inflight_plan(vertices)
        migrations = self._migrations(v, uids)
        if same is not None:
            stored = self._read(same)
            restore = {"vertex": v.name, "finished": stored["finished"], "stored": stored,
                       "operators": [self._decode_entry(op, same, e) if uid not in migrations else
                                     self._operator_state(op, uid, v, i, migrations[uid])
                                     for op, e, uid in zip(task.operators, stored["operators"], uids)],
                       "source": stored.get("source")}
            self._arm_key_checks(task.operators, uids, migrations)
            for k in ("source_identity", "inflight", "input_kinds", "output_kinds"):
                if k in stored:
                    restore[k] = stored[k]
            if inflight is not None:
                self._rescaled_inflight(inflight, task, restore, same)
            return restore
        restore = {"vertex": v.name, "finished": False, "stored": None, "source": None,
                   "operators": [self._operator_state(op, uid, v, i, migrations.get(uid))
                                 for op, uid in zip(task.operators, uids)]}
        self._arm_key_checks(task.operators, uids, migrations)
        if src_uid is not None:
            olds = self._old_tasks_of(src_uid)
            if olds:
                states = [self._read(k) for k, _ in olds]
                identity = next((s.get("source_identity") for s in states if "source_identity" in s), None)
                if identity is not None:
                    restore["source_identity"] = identity
                restore["source"] = assignment.source_position(
                    [s.get("source") for s in states], i, v.parallelism,
                    task.source.rescale_positions, v.head.name, src_uid)
                restore["has_source"] = True
        if inflight is not None:
            self._rescaled_inflight(inflight, task, restore, None)
        return restore

    # ---- key kinds (pyflowbuf.checkpointing.key_kinds) ----
    def _migrations(self, v, uids) -> dict:
        """uid -> the key migration (``Stream.migrate_keys``) to apply to its
        stored state: declared on the operator, and the state is of a job
        that had not migrated it yet."""
        out = {}
        for n, uid in zip([n for n in v.nodes if n.make_operator is not None], uids):
            fn = n.key_migration
            old = self.operators.get(uid)
            if fn is not None and old is not None and old.get("keyed") and not old.get("key_migrated"):
                out[uid] = fn
        return out

    def _arm_key_checks(self, operators, uids, migrations) -> None:
        """Each restored keyed operator checks its first keys against the kinds
        of the keys its stored state holds (not after a declared migration:
        the migration says what the keys became)."""
        if not self.check_key_kinds:
            return
        for op, uid in zip(operators, uids):
            if not op.keyed_state or uid in migrations:
                continue
            old = self.operators.get(uid)
            if old is None or not old.get("key_kinds"):
                continue        # new, empty, or written before kinds were recorded: nothing to check
            key_kinds.arm(op, old["key_kinds"], self.where, uid)

    def _inflight_plan(self, vertices):
        """Where this checkpoint's in-flight data goes in the graph of
        ``vertices`` (None: it holds none), made once per restore."""
        if not any(s.get("inflight") for s in self.layout.values()):
            return None
        if self._inflight is None:
            if vertices is None:
                raise errors.FlowBufError(f"{self.where}: restoring in-flight data needs the job's graph")
            self._inflight = InflightPlan(self.layout, vertices, self.max_parallelism, self.where, self._read,
                                          self.storage.allow_pickle)
        return self._inflight

    def _rescaled_inflight(self, plan, task, restore, same) -> None:
        """A subtask's in-flight data where edges changed: the items of its old
        self on redistributed edges are left out (they go by key group), and
        what its key groups get of those edges comes in as ``key/<input>``,
        replayed before anything else on that input."""
        if same is not None and restore.get("inflight"):
            gone = plan.dropped(same)
            if gone:
                restore["inflight"] = {n: items for n, items in restore["inflight"].items() if n not in gone}
        moved = plan.for_subtask(task.vertex, task.index)
        if not moved:
            return
        inflight = dict(restore.get("inflight") or {})
        kinds = list(restore.get("input_kinds") or [])
        for a, (kind, items) in moved.items():
            inflight[f"key/{a}"] = items
            kinds.extend([None] * (a + 1 - len(kinds)))
            kinds[a] = kind
        restore["inflight"] = inflight
        restore["input_kinds"] = kinds

    def _decode_entry(self, op, task_key, e):
        if e is None:
            return None
        allow = self.storage.allow_pickle
        if e.get("keyed"):
            return keyed_restore(op, [(self._value(task_key, e), None)])
        blob = e.get("state")
        return None if blob is None else loads(blob, allow_pickle=allow)

    def _value(self, task_key, e):
        """A keyed entry's value, decoded once per restore (new subtasks whose
        ranges share an old subtask read it from here). An incremental
        checkpoint's entry holds the key groups it wrote and refers to the
        earlier checkpoints that hold the others: merged here."""
        got = self._decoded.get((task_key, e["uid"]))
        if got is None:
            allow = self.storage.allow_pickle
            got = loads(e["value"], allow_pickle=allow)
            refs = e.get("refs")
            if refs:
                parts = [(got, None)]
                for r in refs:
                    old = self._read_shared(r["checkpoint"], task_key)
                    oe = next((x for x in old["operators"] if x.get("uid") == e["uid"] and x.get("keyed")), None)
                    if oe is None:
                        raise CorruptCheckpointError(
                            f"{self.where}: task {task_key!r} refers to checkpoint {r['checkpoint']} for the key "
                            f"groups of operator {e['uid']!r}, whose state file there does not hold them",
                            checkpoint_id=self.meta.checkpoint_id, path=self.meta.path)
                    parts.append((loads(oe["value"], allow_pickle=allow), r["groups"]))
                got = merge_keyed_values(parts)
            self._decoded[(task_key, e["uid"])] = got
        return got

    def _migrated_value(self, op, task_key, e, fn):
        """A stored keyed value with every key ``k`` replaced by ``fn(k)`` and
        its key group computed again (decoded and migrated once per restore)."""
        got = self._decoded.get((task_key, e["uid"], "migrated"))
        if got is None:
            got = self._decoded[(task_key, e["uid"], "migrated")] = migrate_keyed_value(
                op, self._value(task_key, e), fn, self.max_parallelism, f"{self.where}: operator {e['uid']!r}")
        return got

    def _read_shared(self, checkpoint_id, task_key) -> dict:
        """The stored state of ``task_key`` in an earlier checkpoint this one refers to."""
        st = self._cache.get((checkpoint_id, task_key))
        if st is None:
            st = self._cache[(checkpoint_id, task_key)] = self._renamed_state(self.storage.read_shared_state(
                self.meta, checkpoint_id, task_key))
        return st

    def _operator_state(self, op, uid, v, i, migration=None):
        olds = self._old_tasks_of(uid)
        if not olds or not self.operators.get(uid, {}).get("stateful"):
            return None         # a new operator (or one that kept nothing): it starts empty
        allow = self.storage.allow_pickle
        entries = []
        for k, _ in olds:
            st = self._read(k)
            entries.append(next(e for e in st["operators"] if e["uid"] == uid))
        if any(e.get("keyed") for e in entries):
            # by key group (pyflowbuf.checkpointing.assignment)
            start, end = assignment.key_groups(self.max_parallelism, v.parallelism, i)
            keyed = [(k, e) for (k, _), e in zip(olds, entries) if e.get("keyed")]
            values = []
            for j, owner in assignment.keyed_sources([e["key_groups"] for _, e in keyed], start, end,
                                                     migrated=migration is not None):
                k, e = keyed[j]
                values.append((self._value(k, e) if migration is None else
                               self._migrated_value(op, k, e, migration), owner))
            if migration is not None:
                return _distinct_keys_restore(op, values, start, end, self.where, uid)
            return keyed_restore(op, values, start, end)
        states = [None if e.get("state") is None else loads(e["state"], allow_pickle=allow) for e in entries]
        return assignment.per_subtask_state(states, i, v.parallelism, op.rescale_state)


def migrate_keyed_value(op, value, fn, max_parallelism, where) -> dict:
    """``value`` (a stored keyed value) with each entry's record key ``k``
    as ``fn(k)``, and the key group of each entry of the new key. An entry
    whose key is part of a bigger one (a window's ``(key, start, end)``, a
    trigger timer's ``(0, (key, start, end))``) keeps the rest of it."""
    maps, timers, _ = op.keyed_parts(op.snapshot_state())

    def new_key(k):
        # (no memo by key: 3 and 3.0 are one dict key, and fn may tell them apart)
        try:
            n = fn(k)
        except Exception as exc:
            raise IncompatibleCheckpointError(
                f"{where}: its key migration failed on the stored key {k!r}: {type(exc).__name__}: {exc}") from exc
        try:
            hash(n)
        except TypeError:
            raise IncompatibleCheckpointError(
                f"{where}: its key migration turned the key {k!r} into {n!r}, which cannot be a key") from None
        return n

    def rekey(ek, key_of):
        if key_of is None:
            return new_key(ek)
        if len(ek) == 2 and type(ek[1]) is tuple:
            return (ek[0], (new_key(ek[1][0]),) + ek[1][1:])
        return (new_key(ek[0]),) + ek[1:]

    def key_of_part(parts, name, what):
        if name not in parts:
            raise IncompatibleCheckpointError(f"{where}: its stored {what} {name!r} is not one this operator keeps")
        return parts[name][1]

    out = {"maps": {}, "timers": {}, "common": value["common"]}
    for name, m in value["maps"].items():
        key_of = key_of_part(maps, name, "map")
        d = {rekey(ek, key_of): val for ek, val in map_entries(m).items()}
        if len(d) != len(m["groups"]):
            raise IncompatibleCheckpointError(
                f"{where}: its key migration maps {len(m['groups']) - len(d)} stored key(s) onto keys another "
                "stored key maps onto too: the state of two keys cannot be merged. Migrate one key to one key")
        ks = list(d)
        out["maps"][name] = {"entries": d, "groups": kg.group_index(
            ks if key_of is None else [key_of(k) for k in ks], max_parallelism)}
    for name, t in value["timers"].items():
        key_of = key_of_part(timers, name, "timers")
        keys = [rekey(ek, key_of) for ek in t["keys"]]
        out["timers"][name] = {"times": list(t["times"]), "keys": keys, "groups": kg.group_index(
            keys if key_of is None else [key_of(k) for k in keys], max_parallelism)}
    return out


def _distinct_keys_restore(op, values, start, end, where, uid):
    """``keyed_restore`` of migrated values, refusing two stored keys (of
    different old subtasks) that became one key."""
    for name in {n for v, _ in values for n in v["maps"]}:
        seen, total = set(), 0
        for v, _ in values:
            m = v["maps"].get(name)
            if m is None:
                continue
            sel = _selection(m["groups"], start, end)
            ks = list(m["entries"])
            if sel is not None:
                ks = [ks[j] for j in sel.tolist()]
            total += len(ks)
            seen.update(ks)
        if len(seen) != total:
            raise IncompatibleCheckpointError(
                f"{where}: operator {uid!r}: its key migration maps {total - len(seen)} stored key(s) onto keys "
                "another stored key maps onto too: the state of two keys cannot be merged. Migrate one key to one key")
    return keyed_restore(op, values, start, end)


def _graph_of(vertex) -> list:
    """The vertices (as lists of nodes) of the graph ``vertex`` is part of,
    found through its nodes' inputs and consumers, where a task knows no job."""
    seen, todo = {}, list(vertex.nodes)
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen[id(n)] = n
        todo.extend(i.node for i in n.inputs)
        todo.extend(n.consumers)
    return [_Nodes(list(seen.values()))]


class _Nodes:
    __slots__ = ("nodes",)

    def __init__(self, nodes):
        self.nodes = nodes


def _renamed_layout(s: dict, r: dict) -> dict:
    """A subtask's layout in ``_metadata`` with its ids renamed (``RestorePlan.map_ids``)."""
    s = dict(s)
    s["uids"] = [r.get(u, u) for u in s.get("uids") or ()]
    if s.get("source_uid") in r:
        s["source_uid"] = r[s["source_uid"]]
    s["operators"] = {r.get(k, k): v for k, v in (s.get("operators") or {}).items()}
    edges = s.get("edges")
    if isinstance(edges, dict):
        s["edges"] = {side: [_renamed_edge(d, r) for d in ds] for side, ds in edges.items()}
    return s


def _renamed_edge(d: dict, r: dict) -> dict:
    d = dict(d)
    if d.get("to") in r:
        d["to"] = r[d["to"]]
    for side in ("from_chain", "to_chain"):
        c = d.get(side)
        if isinstance(c, dict):
            c = dict(c)
            if c.get("source") in r:
                c["source"] = r[c["source"]]
            c["uids"] = [r.get(u, u) for u in c.get("uids") or ()]
            d[side] = c
    return d


def _holds_task(s: dict, v) -> bool:
    """Whether vertex ``v`` runs the chain an old subtask's layout ``s`` ran, at its parallelism."""
    return (s["uids"] == chain_uids(v) and s["parallelism"] == v.parallelism
            and s.get("source_uid") == (v.head.operator_uid if v.head.source is not None else None))


def check_operator_ids(spec) -> None:
    """Before a job starts: every operator's id (duplicates refused), every
    parallelism within ``max_parallelism``; with checkpointing on, an
    ``OperatorIdWarning`` for each stateful operator whose id is derived
    (inserting or removing an operator before it changes that id, and its
    state is then refused), pointing at the line of the user's code that
    declared it."""
    try:
        assign_uids(spec.nodes)
    except ValueError as exc:
        raise errors.ConfigurationError(str(exc)) from None
    kg.check_max_parallelism(spec.max_parallelism, [(n.name, n.parallelism) for n in spec.nodes])
    if spec.checkpoint_config.interval is None:
        return
    for n in spec.nodes:
        if n.uid is not None or n.make_operator is None or n.is_sink or not is_stateful(n):
            continue
        message = (f"stateful operator {n.name!r} has no uid: its state is stored under an id derived from its "
                   f"place in the graph ({n.derived_uid!r}), which changes when operators are inserted or removed "
                   "before it, and a restore then refuses its state. Give it a stable id with .uid('...') so "
                   "later versions of the job can restore it")
        filename, lineno = n.declared_at or ("<unknown>", 0)
        warnings.warn_explicit(message, errors.OperatorIdWarning, filename, lineno,
                               module=os.path.splitext(os.path.basename(filename))[0])


def commit_outputs(nodes, meta) -> list:
    """The part-file sinks a restored checkpoint's commits are checked
    against: this job's, each allowing the subtasks it had when the
    checkpoint was taken (a restore at a lower parallelism commits what the
    subtasks that are gone had pending). Their part files count as the
    sink's own from then on (``FileOutput.prepare`` in mode "error")."""
    ops = meta.properties.get("operators") or {}
    out = []
    for n in nodes:
        fo = n.file_output
        if fo is None:
            continue
        old = ops.get(n.operator_uid)
        if old is None:
            # a sink without a uid in a checkpoint written before ids were derived from the graph,
            # or one given a uid since (as RestorePlan.map_ids maps them)
            scheme = meta.properties.get("id_scheme", LEGACY_SCHEME)
            was = n.legacy_uid if scheme == LEGACY_SCHEME else n.derived_uid
            if n.uid is None or (was not in {m.operator_uid for m in nodes}
                                 and (scheme == LEGACY_SCHEME or was in (meta.properties.get("derived_ids") or {}))):
                old = ops.get(was)
        if old is not None and fo.parallelism is not None and old["parallelism"] > fo.parallelism:
            fo.parallelism = old["parallelism"]
        fo.uid = n.operator_uid
        fo.restored_state = bool(old and old.get("stateful")) if is_current(meta) else None
        out.append(fo)
    return out


def checks_key_kinds(execution, meta, first=True) -> bool:
    """Whether a restore of ``meta`` by ``execution`` checks key kinds: only
    for the checkpoint the execution started from (``first``: that start's
    own verdict, for a worker told by its driver), not for one the execution
    wrote itself and restores after a failure."""
    here = (meta.checkpoint_id, meta.path)
    started = execution.__dict__.setdefault("_key_kinds_checked_at", here)
    return bool(first) and here == started


def started_fresh(execution) -> None:
    """An execution that restored nothing at its start: what it restores
    later (after a failure) it wrote itself (``checks_key_kinds``)."""
    execution.__dict__.setdefault("_key_kinds_checked_at", None)


def restored_commits(meta, nodes, allow_non_restored_state: bool) -> list:
    """The sink commits of checkpoint ``meta`` that the driver carries out on
    a restore (``connectors/outputs.run_commits``): the final committables
    of sink subtasks that had ended, and, in a checkpoint written before the
    part-file sinks were connector sinks, their renames. The committables of
    running subtasks are in their sinks' state, committed by the restored
    subtasks. With ``allow_non_restored_state``, a part-file sink whose state
    is dropped (the job no longer has its operator id, and no sink of the
    job writes its directory) has its commits dropped too, with a
    ``NonRestoredStateWarning`` naming the sink and its directory: its
    pending parts stay there as they were, hidden ``.part-*.inprogress``
    files, never renamed; so do the final commits of a connector sink this
    job no longer declares."""
    commits = meta.properties.get("commits") or []
    if not allow_non_restored_state:
        return commits
    ops = meta.properties.get("operators") or {}
    current = {n.operator_uid for n in nodes}
    gone = {uid: o for uid, o in ops.items() if o.get("stateful") and uid not in current}
    if not gone:
        return commits
    here = {sink_outputs.directory_key(fo.path) for fo in sink_outputs.graph_outputs(nodes)}
    gone_dirs = {sink_outputs.directory_key(o["directory"]): uid for uid, o in gone.items() if o.get("directory")}
    # written before sinks recorded their directory: a commit into no sink's directory of this job
    # belongs to one of the sinks that are gone
    unknown = [uid for uid, o in gone.items() if not o.get("directory") and o["type"] in _PART_FILE_SINKS]
    dropped = {(uid, d): [] for d, uid in gone_dirs.items() if d not in here}
    keep, orphaned = [], []
    for action in commits:
        if isinstance(action, (list, tuple)) and action and action[0] == "connector":
            (keep if connector_api.committer(action) is not None else orphaned).append(action)
            continue
        d = sink_outputs.commit_directory(action)
        uid = gone_dirs.get(d) if d is not None and d not in here else None
        if uid is None and d is not None and d not in here and unknown:
            uid = " or ".join(unknown)
        if uid is None:
            keep.append(action)
        else:
            dropped.setdefault((uid, d), []).append(action)
    for (uid, d), actions in dropped.items():
        name = ops[uid]["name"] if uid in ops else "a sink"
        warnings.warn(
            f"checkpoint {meta.checkpoint_id}: the state of sink {name!r} (uid {uid!r}) is dropped "
            f"(allow_non_restored_state=True), and so are its pending commits into {d}: its parts written "
            "before the checkpoint that were not yet committed stay there as hidden '.part-*.inprogress' files "
            "(rename one without the leading '.' and the '.inprogress' to keep it)",
            errors.NonRestoredStateWarning, stacklevel=2)
    for action in orphaned:
        warnings.warn(
            f"checkpoint {meta.checkpoint_id}: the final commit of sink {action[1]!r}, which this job no longer "
            "has, is dropped with its state (allow_non_restored_state=True): what it wrote last stays uncommitted",
            errors.NonRestoredStateWarning, stacklevel=2)
    return keep


_PART_FILE_SINKS = ("TextFileSink", "ParquetFileSink")


def is_current(meta) -> bool:
    """Whether a checkpoint was written in the per-operator-id layout (format 2)."""
    return meta.properties.get("state_format") == STATE_FORMAT


def check_sources(meta, states, sources) -> None:
    """Refuse to restore a source from the position of other input: each
    source (``sources``: task key -> (name, Source), not yet opened) checks
    the identity its checkpointed state recorded. States from before
    identities were recorded are restored as they are."""
    for key, (name, source) in sources.items():
        state = states.get(key)
        if state is None or "source_identity" not in state:
            continue
        try:
            source.check_identity(state["source_identity"], state.get("source"))
        except IncompatibleCheckpointError as exc:
            raise IncompatibleCheckpointError(
                f"checkpoint {meta.checkpoint_id}: source {name!r} ({key}): {exc}", source=name) from None


# ---------------------------------------------------------------- checkpoints before operator ids

def read_states(storage, meta, keys=None) -> dict:
    """The task states of a complete checkpoint, by task key: every task's, or
    those of ``keys`` (the tasks of one worker process). A task's in-flight
    data (unaligned checkpoints) comes with its state, under "inflight":
    channel name -> items to replay."""
    out = {}
    for key in meta.tasks:
        if keys is not None and key not in keys:
            continue
        snap = storage.read_task_state(meta.checkpoint_id, key, metadata=meta)
        state = snap.state
        if snap.inflight:
            state = dict(state)
            state["inflight"] = decoded_inflight(snap.inflight)
        out[key] = state
    return out


def check_graph(meta, keys, url) -> None:
    """Refuse to restore a checkpoint taken of another graph or parallelism."""
    if set(meta.tasks) != set(keys):
        raise errors.ConfigurationError(
            f"checkpoint {meta.checkpoint_id} in {url} was taken of another job graph (tasks "
            f"{sorted(meta.tasks)}, this job has {sorted(keys)}); restoring into a different graph "
            "or parallelism is not supported")
