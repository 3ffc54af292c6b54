"""In-flight data of unaligned checkpoints, all of it in one place: captured
at the snapshot, replayed after a restore, redistributed by key group when
the job changed. How it is stored (a 16-byte header per item) is the storage
layer's: ``pyflowbuf.checkpoint.inflight``.

**Names.** A subtask's in-flight items are stored per channel:
``in/<input>/<channel>`` (what it read from that channel between its snapshot
and barrier *n*, then what the barrier overtook in its queue),
``out/<output>/<subpartition>`` (what barrier *n* overtook in a network
sender's queue, for outputs read by another process) and, after a rescale
only, ``key/<input>`` (records redistributed to it by key group).

**Capture** (``InflightCapture`` per checkpoint, ``Captures`` per subtask,
driven by ``SubtaskCheckpoints`` in the subtask's thread): an unaligned snapshot starts recording every input channel
whose barrier has not come yet, beginning with what the reader holds of it
(``start_recording``); a channel's recording ends when its barrier comes
(``recorded``: with what the barrier overtook in the queue). A network sender
thread reports what barrier *n* overtook in a remote output. The checkpoint is
written once every part is in (``InflightCapture.ready``).

**Replay** (``replay``): a task restored from an unaligned checkpoint reads
its in-flight input again before anything new from the gate and sends its
in-flight output again before any new record.

**Rescale** (``InflightPlan``, for ``pyflowbuf.checkpointing.restore``): in a
changed job, each edge's in-flight data goes back in place, is redistributed
by key group, or is refused.

At checkpoint time a subtask that holds in-flight data records, beside its
state's summary (the checkpoint's ``_metadata`` layout), the edge of each of
its inputs and outputs (``edge_descriptions``): the operator id and input
index the edge feeds, its partitioner, its parallelisms on both ends, the
chains on both ends, its record kind and whether its records carry
timestamps; and the names of its in-flight items (``in/<input>/<channel>``,
``out/<output>/<subpartition>``).

At restore time (``InflightPlan``) each edge with in-flight data is either

* **in place**: both ends are the same chains at the same parallelism and
  the edge is the same output/input of them. Every item goes back into the
  very channel it was captured in, as before (no decoding);
* **redistributed**: the edge is keyed in the checkpoint and in this job
  (same receiving operator id and input). Each old channel (sender ``s`` ->
  receiver ``r``) is one byte stream: what receiver ``r`` held of it, then
  what sender ``s`` still had queued for it (the network sender's part). Its
  records are decoded, keyed with this job's key function and handed to the
  new subtask owning their key group, in the order they had on that channel;
  so every key keeps its order per old sender, as ``key_by`` guarantees;
* **refused** otherwise (a forward, rebalance or broadcast edge whose ends
  changed, a keyed edge gone or no longer keyed, a changed record kind or
  timestamps), with an error that points to a savepoint (always aligned).

A checkpoint written before edges were recorded restores its in-flight data
only into the same job graph at the same parallelism (its items do not say
which edge they are on, and a task's queued output goes to its receivers).

A new subtask reads its redistributed records before anything else on that
input, from every channel (``RecordReader.replay`` drains its replay queue
before it polls the gate). Per channel would not do: after a rescale the new
channels come from other subtasks than the old ones (a source's splits are
redistributed too), so a key's newer records, and watermarks past the
in-flight records' times, may arrive on any of them. Read first, the
in-flight records keep their place before every newer record of their key,
and no watermark of the restored run passes them (so no window fires without
them). Events among the in-flight items are dropped: a watermark (or idle
marker) only tells the receiver how far its old channel had come, and the
restored producers send their own, later ones, so dropping one can delay a
window, never fire it early, and never makes an in-flight record late (no new
watermark is read before them); a record-kind event only names the kind the
records are decoded with here; an end of partition or end of data is sent
again by every new producer when it ends; a barrier or cancel-barrier among
them is of a checkpoint older than the restored one. A user event cannot be
placed in another subtask's stream: it is refused.

Cost: every process that runs a new subtask of a redistributed edge decodes
all of that edge's in-flight data once (cached in the restore plan) and calls
the key function once per record; each new subtask then picks its records
with one mask over their key groups. In-flight data is bounded by the network
buffers (about buffers x segment size per channel), so this is bounded too.
"""
from __future__ import annotations

import struct
import threading

import numpy as np

from pyflowbuf import errors
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf._core.events import (BARRIER, CANCEL_BARRIER, END_OF_DATA, END_OF_PARTITION, EVT_KIND,
                                    EVT_WATERMARK)
from pyflowbuf._core.memory import NetworkBufferPool
from pyflowbuf._core.serde import RecordReader
from pyflowbuf.checkpoint import keygroups as kg
from pyflowbuf.checkpoint.inflight import decode_inflight, encode_inflight
from pyflowbuf.checkpoint.storage import IncompatibleCheckpointError
from pyflowbuf.checkpointing import assignment
from pyflowbuf.exchange.sides import kind_name
from pyflowbuf.kinds import CoreSerializer
from pyflowbuf.serializers import get_serializer

_RECORDS = 0                            # FB_DATA_RECORDS (csrc/fb_ring.h)
_LEN = struct.Struct("<I")
_ITEM_BYTES = 32 * 1024                 # redistributed records are replayed in items of about this size
_MAX_RECORD = (1 << 32) - 1             # the checkpoint's own records: the job's limit held when written
# events among redistributed in-flight data that are left out (why: the module docstring)
_DROPPED_EVENTS = (EVT_WATERMARK, END_OF_PARTITION, END_OF_DATA, BARRIER, CANCEL_BARRIER)


# ---------------------------------------------------------------- names

def input_channel(input_index: int, channel: int) -> str:
    return f"in/{input_index}/{channel}"


def parse_channel(name: str):
    """``(where, a, b)`` of an item name: 'in/<input>/<channel>',
    'out/<output>/<subpartition>', or 'key/<input>' (b = -1)."""
    where, *rest = name.split("/")
    if where == "key":
        return where, int(rest[0]), -1
    return where, int(rest[0]), int(rest[1])


def remote_outputs(outputs) -> list:
    """The item names of the subpartitions read by another process: what an
    unaligned barrier overtakes there comes from the network sender."""
    return [f"out/{o}/{s}" for o, out in enumerate(outputs)
            for s, remote in enumerate(out.remote) if remote]


# ---------------------------------------------------------------- capture

class InflightCapture:
    """One checkpoint of a subtask whose write waits for in-flight data: its
    input channels' (until barrier n arrived on each) and, for outputs sent to
    other processes, what barrier n overtook in the network sender."""

    def __init__(self, checkpoint_id, state, commits, alignment, inputs_open, outputs, phases=None):
        self.checkpoint_id = checkpoint_id
        self.phases = phases
        self.state = state
        self.commits = commits
        self.alignment = alignment
        self.channels: dict[str, list] = {}
        self.inputs_open = inputs_open
        self.waiting_outputs = set(outputs)
        self.alignment_ms = 0.0

    def add(self, name, items):
        if items:
            self.channels.setdefault(name, []).extend(items)

    @property
    def ready(self):
        return not self.inputs_open and not self.waiting_outputs

    def encoded(self) -> dict:
        """Its items as the storage writes them, per channel name."""
        return {name: encode_inflight(items) for name, items in self.channels.items()}


class Captures:
    """The checkpoints of one subtask whose write waits for in-flight data,
    by id. The subtask's thread adds them and what its input channels
    recorded; network sender threads report what barriers overtook in their
    queues, so every step holds the lock. A step that may have completed a
    capture returns it: the caller writes it once ``take_if_ready`` says so."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[int, InflightCapture] = {}

    def start(self, p: InflightCapture) -> None:
        with self._lock:
            self._pending[p.checkpoint_id] = p

    def input(self, checkpoint_id: int, name: str, items) -> None:
        """What input channel ``name`` recorded until its barrier came."""
        with self._lock:
            p = self._pending.get(checkpoint_id)
            if p is not None:
                p.add(name, items)

    def inputs_done(self, checkpoint_id: int, alignment_ns: int):
        """Every input channel delivered barrier n: the capture, or None."""
        with self._lock:
            p = self._pending.get(checkpoint_id)
            if p is None:
                return None
            p.inputs_open = False
            p.alignment_ms = alignment_ns / 1e6
            if p.phases is not None:
                if p.phases["unaligned"]:
                    # first barrier to last: the in-flight input was recorded meanwhile
                    p.phases["inflight_wait_ns"] = alignment_ns
                else:
                    p.phases["alignment_ns"] = alignment_ns
            return p

    def output(self, checkpoint_id: int, name: str, items):
        """From a network sender thread: what barrier n overtook in
        subpartition ``name`` (None: an aligned barrier passed, nothing
        overtaken). The capture, or None when it waits for no such word."""
        with self._lock:
            p = self._pending.get(checkpoint_id)
            if p is None or name not in p.waiting_outputs:
                return None
            p.waiting_outputs.discard(name)
            p.add(name, items)
            return p

    def drop(self, checkpoint_id: int) -> None:
        with self._lock:
            self._pending.pop(checkpoint_id, None)

    def take_if_ready(self, p: InflightCapture) -> bool:
        """Whether capture ``p`` is complete and still wanted; if so it leaves,
        with every older one (one checkpoint at a time: they can no longer
        complete)."""
        with self._lock:
            if not p.ready or self._pending.get(p.checkpoint_id) is not p:
                return False
            del self._pending[p.checkpoint_id]
            for n in [n for n in self._pending if n < p.checkpoint_id]:
                del self._pending[n]
            return True


def start_recording(sides, keys) -> dict:
    """An unaligned snapshot: record the input channels ``keys`` ((input,
    channel), barrier n not there yet) from now on; returns what their
    readers hold of each (a record cut by the snapshot) by item name."""
    inputs = {}
    for a, ch in keys:
        reader = sides[a].reader
        prefix = reader.unread_prefix(ch)
        inputs[input_channel(a, ch)] = [prefix] if prefix is not None else []
        reader.start_recording(ch)
    return inputs


def recorded(side, channel: int, overtaken: int = 0, prefix=None) -> list:
    """Barrier n came on ``channel`` of ``side``: what its reader recorded
    since the snapshot, after ``prefix`` (what was left of the buffer the
    reader was in when an overtaking barrier was taken) and followed by the
    ``overtaken`` items the barrier passed in the channel's queue."""
    items = side.reader.stop_recording(channel) if side.reader is not None else []
    if overtaken > 0:
        items = items + side.gate.channels[channel].copy_front(overtaken)
    if prefix is not None:
        items = [prefix] + items
    return items


def stop_recording(sides) -> None:
    """A checkpoint aborted: no channel records for it any more."""
    for side in sides:
        r = side.reader
        if r is not None:
            for ch in range(side.num_channels):
                if r.is_recording(ch):
                    r.stop_recording(ch)


def any_replaying(sides, keys) -> bool:
    """Whether one of the inputs of ``keys`` still reads restored in-flight data."""
    return any(sides[a].reader is not None and sides[a].reader.replaying for a, _ in keys)


# ---------------------------------------------------------------- replay

def decoded(stored: dict) -> dict:
    """A task file's in-flight sections (channel name -> views) as items to replay."""
    return {name: decode_inflight(views) for name, views in stored.items()}


def replay(restore, sides, outputs) -> None:
    """After a restore from an unaligned checkpoint: in-flight input is read
    again before anything new from the gate (each input's replayed items
    first, from every channel), in-flight output is sent again before any
    new record. Items of a channel go back into that channel; records
    redistributed by key group (``key/<input>``: whole records, no events)
    go through channel 0 of their input, ahead of everything else there."""
    inflight = restore["inflight"]
    in_kinds = restore.get("input_kinds") or []
    out_kinds = restore.get("output_kinds") or []
    replays = {}
    for name in sorted(inflight, key=parse_channel):
        where, a, b = parse_channel(name)
        items = inflight[name]
        if where == "key":
            if a >= len(sides):
                raise errors.ConfigurationError(
                    f"in-flight data redistributed to input {a} does not fit this task ({len(sides)} inputs)")
            # before this input's own channels' items (it has none: its whole edge moved)
            replays.setdefault(a, [])[:0] = [(0, item) for item in items]
        elif where == "in":
            if a >= len(sides) or b >= sides[a].num_channels:
                raise errors.ConfigurationError(
                    f"in-flight data for input channel {name} does not fit this job: restoring "
                    "an unaligned checkpoint into another parallelism is not supported")
            replays.setdefault(a, []).extend((b, item) for item in items)
        else:
            if a >= len(outputs) or b >= len(outputs[a].queues):
                raise errors.ConfigurationError(
                    f"in-flight data for output {name} does not fit this job: restoring "
                    "an unaligned checkpoint into another parallelism is not supported")
            outputs[a].replay(b, items, out_kinds[a] if a < len(out_kinds) else None)
    for a, pairs in replays.items():
        side = sides[a]
        kind = in_kinds[a] if a < len(in_kinds) else None
        if kind is not None and side.kind is None:
            side._configure(get_serializer(kind))
        side.reader.replay(pairs)


# ---------------------------------------------------------------- rescale: the edges, recorded at checkpoint time

def _chain_uids(v) -> list:
    return [n.operator_uid for n in v.nodes if n.make_operator is not None]


def _identity(v) -> dict:
    """A vertex as a restore recognises it: its source's id, its operators' ids, its parallelism."""
    return {"source": v.head.operator_uid if v.head.source is not None else None,
            "uids": _chain_uids(v), "parallelism": v.parallelism}


def _kind_of(kind):
    """The name of an edge's fixed record kind (None: inferred at run time)."""
    if kind is None:
        return None
    return getattr(kind, "name", None) or "rows"


def _describe(e, out_index: int) -> dict:
    return {"to": e.target.head.operator_uid, "input": e.input_index, "partitioner": e.partitioner,
            "keyed": e.partitioner == "hash", "tag": e.tag, "timestamped": bool(e.timestamped),
            "kind": _kind_of(e.kind), "senders": e.source.parallelism, "receivers": e.target.parallelism,
            "out_index": out_index, "from_chain": _identity(e.source), "to_chain": _identity(e.target)}


def edge_descriptions(edges, vertex) -> dict | None:
    """What a checkpoint records of ``vertex``'s edges (``JobEdge``s of its
    job, in the job's order): ``{"in": [per input index], "out": [per
    output]}``, in the order of the subtask's input sides and output sides."""
    if edges is None:
        return None
    outs = [e for e in edges if e.source is vertex]
    ins = sorted((e for e in edges if e.target is vertex), key=lambda e: e.input_index)
    return {"in": [_describe(e, [x for x in edges if x.source is e.source].index(e)) for e in ins],
            "out": [_describe(e, k) for k, e in enumerate(outs)]}


# ---------------------------------------------------------------- the new graph's edges

class _NewEdge:
    __slots__ = ("source", "target", "partitioner", "key_fn", "kind", "input_index", "timestamped", "tag",
                 "out_index")

    def __init__(self, source, target, inp, k):
        self.source, self.target = source, target
        self.partitioner, self.key_fn, self.tag, self.input_index = inp.partitioner, inp.key_fn, inp.tag, k
        # as graph.plan makes its JobEdges: a side output carries its reader's kind, and the times of
        # the operator emitting it
        self.kind = inp.node.kind if inp.tag is None else target.head.kind
        self.timestamped = bool(inp.node.timestamped)
        self.out_index = 0


def graph_edges(vertices) -> dict:
    """The edges of a planned graph by (receiving operator id, input index),
    with each one's index among its sender's outputs (``graph.plan`` appends
    a vertex's input edges as it makes the vertex, so this is its order)."""
    vertex_of = {n.id: v for v in vertices for n in v.nodes}
    out, count = {}, {}
    for v in vertices:
        for k, inp in enumerate(v.head.inputs):
            e = _NewEdge(vertex_of[inp.node.id], v, inp, k)
            e.out_index = count.get(e.source.id, 0)
            count[e.source.id] = e.out_index + 1
            out[(v.head.operator_uid, k)] = e
    return out


# ---------------------------------------------------------------- the plan

class InflightPlan:
    """Where the in-flight data of a checkpoint goes in a job graph (see the
    module docstring). ``read(task_key)`` gives an old subtask's stored state
    with its decoded in-flight items (``RestorePlan._read``)."""

    def __init__(self, layout: dict, vertices, max_parallelism: int, where: str, read, allow_pickle: bool):
        self.layout = layout
        self.max_parallelism = max_parallelism
        self.where = where
        self._read_state = read
        self.allow_pickle = allow_pickle
        self.new = graph_edges(vertices)
        self.legacy = []            # (task key, layout) of old-format tasks holding in-flight data
        self.holders: dict = {}     # edge id -> [(task key, item name, desc)]
        self.descs: dict = {}       # edge id -> its description
        for k, s in sorted(layout.items()):
            if not s.get("inflight"):
                continue
            edges = s.get("edges")
            names = s.get("inflight_items")
            if edges is None or names is None:
                self.legacy.append((k, s))
                continue
            for name in names:
                where_, a, _ = parse_channel(name)
                side = edges["in" if where_ == "in" else "out"]
                if a >= len(side):
                    raise IncompatibleCheckpointError(
                        f"{where}: task {k!r} holds in-flight item {name!r} of an edge its layout does not list")
                d = side[a]
                eid = (d["to"], d["input"])
                self.descs.setdefault(eid, d)
                self.holders.setdefault(eid, []).append((k, name, d))
        self.in_place = set()
        self.moved = set()          # edge ids redistributed by key group
        self._cache: dict = {}
        for eid, d in self.descs.items():
            e = self.new.get(eid)
            if e is not None and self._same_edge(d, e):
                self.in_place.add(eid)
            else:
                self.moved.add(eid)

    @staticmethod
    def _same_edge(d, e) -> bool:
        # (timestamps too: a side output's edge carries them since its records keep their times, so an
        # older checkpoint's side-output bytes, stored without, must not replay as frames with them)
        return (e.partitioner == d["partitioner"] and e.tag == d["tag"] and e.out_index == d["out_index"]
                and e.timestamped == d["timestamped"]
                and _identity(e.source) == d["from_chain"] and _identity(e.target) == d["to_chain"])

    # ---- before anything starts ----
    def check(self, same_task) -> None:
        """Refuse what cannot be restored: in-flight data of a changed edge
        that is not keyed (here or in the checkpoint), a keyed edge whose
        records would not read back the same, and old-format in-flight data
        outside its very task (``same_task(layout)``)."""
        where = self.where
        for k, s in self.legacy:
            if not same_task(s):
                raise errors.ConfigurationError(
                    f"{where} is an unaligned checkpoint whose task {s['vertex']!r} ({k}) holds in-flight data, "
                    "and this job's graph or parallelism differs (there, or where its output goes): in-flight "
                    "data cannot be redistributed "
                    "(this checkpoint was written before the edges of in-flight data were recorded). Take a "
                    "savepoint (job.savepoint() or job.stop(savepoint=...), always aligned) and restore that")
        hint = ("Take a savepoint (job.savepoint() or job.stop(savepoint=...), always aligned) and restore that, "
                "or restore into the same job at the same parallelism")

        def edge(eid):
            d = self.descs[eid]
            k, name, _ = self.holders[eid][0]
            return (f"the {d['partitioner']} edge into operator {d['to']!r} (input {d['input']}), held by task "
                    f"{self.layout[k]['vertex']!r} ({k}: {name})")
        plain = [edge(eid) for eid in sorted(self.moved) if not self.descs[eid]["keyed"]]
        if plain:
            raise errors.ConfigurationError(
                f"{where} is an unaligned checkpoint with in-flight data on {len(plain)} edge(s) that are not keyed "
                f"and whose ends differ in this job: {'; '.join(plain)}. In-flight data cannot be redistributed on "
                f"an edge that is not keyed (only key_by edges move it, by key group). {hint}")
        for eid in sorted(self.moved):
            d = self.descs[eid]
            e = self.new.get(eid)
            why = None
            if e is None:
                why = "this job has no such edge"
            elif e.partitioner != "hash":
                why = f"this job's edge there is {e.partitioner}, not key_by"
            elif e.timestamped != d["timestamped"]:
                why = ("its records carry timestamps in the checkpoint, not in this job" if d["timestamped"]
                       else "its records carry timestamps in this job, not in the checkpoint")
            elif e.target.parallelism > self.max_parallelism:
                why = f"the receiver's parallelism {e.target.parallelism} is above max_parallelism"
            else:
                new_kind = _kind_of(e.kind)
                old = d["kind"]
                if new_kind is not None and old is not None and new_kind != old:
                    why = f"its record kind was {old!r} and is {new_kind!r} here"
            if why is not None:
                raise errors.ConfigurationError(
                    f"{where} is an unaligned checkpoint with in-flight data on {edge(eid)}: it cannot be "
                    f"redistributed by key group, because {why}. {hint}")

    def dropped(self, task_key) -> set:
        """Names of a same-task restore's in-flight items that are redistributed instead."""
        return {name for eid in self.moved for k, name, _ in self.holders[eid] if k == task_key}

    def for_subtask(self, vertex, index) -> dict:
        """``{input index: (kind name, items)}``: the redistributed in-flight
        records of new subtask ``index`` of ``vertex``, per input."""
        out = {}
        head = vertex.head.operator_uid
        start, end = assignment.key_groups(self.max_parallelism, vertex.parallelism, index)
        for eid in sorted(self.moved):
            if eid[0] != head:
                continue
            kind, split = self._edge(eid)
            kind = kind or self.descs[eid]["kind"]
            fixed = _kind_of(self.new[eid].kind)
            if fixed is not None and kind is not None and fixed != kind and split.frames:
                raise errors.ConfigurationError(
                    f"{self.where}: the in-flight records into {eid[0]!r} (input {eid[1]}) are of kind {kind!r}, "
                    f"and this job's edge there carries {fixed!r}: they cannot be replayed into it. Take a "
                    "savepoint of the old job (always aligned) and restore that")
            items = split.items_for(start, end)
            if items:
                out[eid[1]] = (kind, items)
        return out

    # ---- decoding, once per edge in this process ----
    def _edge(self, eid):
        got = self._cache.get(eid)
        if got is None:
            got = self._cache[eid] = self._decode_edge(eid)
        return got

    def _decode_edge(self, eid):
        d = self.descs[eid]
        streams: dict = {}        # (sender, receiver) -> [held by the receiver, queued at the sender, kind]
        for k, name, _ in self.holders[eid]:
            st = self._read_state(k)
            where_, a, c = parse_channel(name)
            sub = self.layout[k]["subtask"]
            kinds = st.get("input_kinds" if where_ == "in" else "output_kinds") or []
            pair, part = ((c, sub), 0) if where_ == "in" else ((sub, c), 1)
            entry = streams.setdefault(pair, [[], [], None])
            entry[part] = st["inflight"].get(name) or []
            entry[2] = entry[2] or (kinds[a] if a < len(kinds) else None)
        streams = {pair: (held + queued, kind or d["kind"]) for pair, (held, queued, kind) in streams.items()}
        return split_by_key_group(streams, self.new[eid].key_fn, self.max_parallelism, d["receivers"],
                                  d["timestamped"], allow_pickle=self.allow_pickle,
                                  what=f"{self.where}: in-flight data into {eid[0]!r}")


def split_by_key_group(streams: dict, key_fn, max_parallelism: int, receivers: int, timestamped: bool,
                       allow_pickle: bool = False, what: str = "in-flight data"):
    """The records of a keyed edge's old channels by key group: ``streams``
    maps (old sender, old receiver) to that channel's in-flight items in
    order (what the receiver held, then what the sender had queued) and the
    name of its record kind. Returns (kind name, ``KeyGroupSplit``): the
    records channel by channel (senders, then receivers, in order), each
    channel's in its own order, keyed by ``key_fn`` as the receiving operator
    keys them. A record whose group the old receiver did not own is refused:
    the key function or the record kind changed, and moving it would put it
    beside state it never belonged to."""
    frames, groups, kind_seen = [], [], None
    for (s, r), (items, kind) in sorted(streams.items()):
        where = f"{what} (channel {s} -> {r})"
        recs, kind = decode_stream(items, kind, timestamped, allow_pickle, where)
        if not recs:
            continue
        kind_seen = kind_seen or kind
        try:
            keys = [key_fn(v) for _, v in recs]
            g = kg.group_index(keys, max_parallelism)
        except Exception as exc:
            raise errors.ConfigurationError(
                f"{where}: the key_by function failed on a record in flight ({exc!r}), so it cannot be "
                "redistributed by key group; take a savepoint of the old job instead") from exc
        start, end = kg.key_group_range(max_parallelism, receivers, r)
        stray = (g < start) | (g >= end)
        if stray.any():
            raise IncompatibleCheckpointError(
                f"{where}: a record in flight to old subtask {r} has key group {int(g[stray][0])}, outside "
                f"that subtask's groups [{start}, {end}): the key_by function or the record kind changed, so "
                "its in-flight data cannot be redistributed. Take a savepoint of the old job (always aligned) "
                "and restore that")
        frames.extend(f for f, _ in recs)
        groups.append(g)
    g = np.concatenate(groups) if groups else np.empty(0, np.uint16)
    return kind_seen, KeyGroupSplit(frames, g)


class KeyGroupSplit:
    """An edge's in-flight records as frames (length prefix, timestamp, payload:
    as a writer put them in a buffer) with their key groups, in order."""

    def __init__(self, frames: list, groups):
        self.frames = frames
        self.groups = np.asarray(groups, dtype=np.uint16)

    def items_for(self, start: int, end: int) -> list:
        """The frames of key groups ``[start, end)``, in order, packed whole
        into in-flight data items of about 32 KiB."""
        sel = np.flatnonzero((self.groups >= start) & (self.groups < end))
        items, part, size = [], [], 0
        frames = self.frames
        for j in sel.tolist():
            f = frames[j]
            if part and size + len(f) > _ITEM_BYTES:
                items.append((_RECORDS, 0, 0, 0, b"".join(part)))
                part, size = [], 0
            part.append(f)
            size += len(f)
        if part:
            items.append((_RECORDS, 0, 0, 0, b"".join(part)))
        return items


def _reader(items, kind):
    # replayed items are bytes: the records come back as bytes, never views of a segment
    r = RecordReader(BufferQueue(NetworkBufferPool(1, 4096)), kind=kind, max_record_size=_MAX_RECORD)
    r.replay([(0, it) for it in items])
    return r


def decode_stream(items, kind, timestamped: bool, allow_pickle: bool, what: str):
    """One old channel's in-flight items (data and events, in order) as
    ``([(frame, record)], kind)``: each record's frame exactly as it lay in
    the buffers (a record spanning buffers made whole), and the record as
    the receiving operator sees it. ``kind``: the record kind's name (an
    EVT_KIND event among the items names it too)."""
    raw = _reader(items, "bytes")
    payloads: list = []
    while True:
        batch = raw.read_batch(4096, timeout=0)
        if batch:
            payloads.extend(batch)
            continue
        ev = raw.take_event()
        if ev is None:
            break
        if ev[1] == EVT_KIND:
            kind = kind_name(ev[2])
        elif ev[1] not in _DROPPED_EVENTS:
            raise errors.ConfigurationError(
                f"{what} holds an event of kind {ev[1]} (a user event), which cannot be placed in the stream "
                "of another subtask: take a savepoint instead")
    if raw.unread_prefix(0) is not None:
        raise IncompatibleCheckpointError(f"{what} ends inside a record (a truncated stream)")
    if not payloads:
        return [], kind
    if kind is None:
        raise IncompatibleCheckpointError(f"{what} holds records whose kind the checkpoint does not name")
    try:
        ser = get_serializer(kind)
    except ValueError as exc:
        raise errors.ConfigurationError(f"{what}: {exc}; register that kind to restore it") from None
    if ser.core_kind == "pickle" and not allow_pickle:
        raise errors.ConfigurationError(
            f"{what} holds pickled records: moving them to other subtasks unpickles them from the checkpoint, "
            "which takes Environment(allow_pickle=True) (as pickled state does)")
    skip = 8 if timestamped else 0
    blob = b"".join(_LEN.pack(len(p) - skip) + p[skip:] for p in payloads)
    values = _reader([(_RECORDS, 0, 0, 0, blob)], ser.core_kind).read_batch(len(payloads), timeout=0)
    if len(values) != len(payloads):
        raise IncompatibleCheckpointError(f"{what}: {len(payloads)} records read back as {len(values)}")
    if type(ser) is not CoreSerializer:
        values = ser.decode_batch(values)
    return [(_LEN.pack(len(p)) + p, v) for p, v in zip(payloads, values)], kind
