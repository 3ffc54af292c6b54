"""The logical graph (one Node per API call) and its plan: chains of forward
operators with equal parallelism fused into one JobVertex (operator chaining).

A node reads any number of inputs (none for a source, several for union and
connect); each input says how records reach the node from its upstream node:
from its main output, or from one of its side outputs (``tag``).

Timestamps travel with the records of a stream once ``assign_timestamps`` gave
them (``has_timestamps``): decided per node when the graph is declared, so a
stream without them pays nothing, and the plan marks each edge."""
from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from pyflowbuf import errors
from pyflowbuf.operators.contracts import Operator, type_name

PARTITIONERS = ("forward", "rebalance", "hash", "broadcast")


@dataclass(eq=False)
class Input:
    """One input of a node: the upstream node and how its records are partitioned."""
    node: "Node"
    partitioner: str = "forward"
    key_fn: Callable | None = None                   # for the hash partitioner
    tag: str | None = None                           # a side output of the node (its name), or the main output


@dataclass(eq=False)
class Node:
    id: int
    name: str
    parallelism: int
    make_operator: Callable[[], Any] | None = None   # None for sources
    source: Any = None                               # a Source factory for sources
    inputs: list = field(default_factory=list)       # [Input], in input-index order
    kind: Any = None                                 # output record kind (None: inferred)
    is_sink: bool = False
    is_iterator: bool = False                        # records go back to the caller
    zero_copy: bool = False                          # iterator sink: hand out views over segments
    rate_limit: Any = None
    collect_parts: dict | None = None                # a collect() sink's results, by subtask
    user_sink: bool = False                          # sink(fn): its effects stay in the process running it
    file_output: Any = None                          # write_text/write_parquet: its outputs.FileOutput
    side_tags: dict | None = None                    # name -> OutputTag: the side outputs it may emit to
    consumers: list = field(default_factory=list)
    timestamped: bool = False                        # its records carry timestamps (set by plan())
    uid: str | None = None                           # Stream.uid(): the operator id its state is stored under
    derived_uid: str | None = None                   # set by assign_uids: the id of its place in the graph
    legacy_uid: str | None = None                    # set by assign_uids: name#rank, as derived before ID_SCHEME
    id_info: dict | None = None                      # set by assign_uids: how derived_uid was derived
    declared_at: tuple | None = None                 # (file, line) of the user's code that declared it
    job_check: Callable | None = None                # (node, nodes) -> None, by plan() once ids are assigned
    # facts the Stream methods (api/) give a node, read by the plan and the runtime
    timestamps: Any = None                           # its records' timestamp function (assign_timestamps), or column
    assigns_timestamps: bool = False                 # assign_timestamps: chained into a source it follows
    drops_timestamps: bool = False                   # its output carries no timestamps (a count window)
    event_time: bool = False                         # it reads watermarks (event-time windows, timers, joins)
    window_late: bool = False                        # a window operator: its late records are a side output
    single_subtask: bool = False                     # runs at parallelism 1 only (windowAll, a global combine)
    open_tags: bool = False                          # may emit to side outputs it did not declare
    input_paths: list | None = None                  # the files a file source reads
    key_migration: Callable | None = None            # Stream.migrate_keys: old key -> new key, on restore
    side_readers: dict = field(default_factory=dict, repr=False)   # side output name -> the node reading it
    # what plan() and restores learn of its operator once (operator_type, is_stateful)
    _operator_type: str | None = field(default=None, repr=False)
    _state_kind: str | None = field(default=None, repr=False)
    _stateful: bool | None = field(default=None, repr=False)

    def __post_init__(self):
        if self.declared_at is None:
            self.declared_at = declaration_site()

    @property
    def operator_uid(self) -> str:
        """The id this operator's state is stored under in checkpoints."""
        return self.uid if self.uid is not None else self.derived_uid

    # The single-input view most of the code needs; a node with several inputs
    # has no one answer, so asking it is a bug, not a silent first-input pick.
    def _sole(self) -> Input | None:
        if len(self.inputs) > 1:
            raise ValueError(f"node {self.name!r} has {len(self.inputs)} inputs; use node.inputs")
        return self.inputs[0] if self.inputs else None

    @property
    def input(self) -> "Node | None":
        sole = self._sole()
        return None if sole is None else sole.node

    @property
    def partitioner(self) -> str:
        sole = self._sole()
        return "forward" if sole is None else sole.partitioner

    @property
    def key_fn(self) -> Callable | None:
        sole = self._sole()
        return None if sole is None else sole.key_fn


@dataclass(eq=False)
class JobVertex:
    id: int
    nodes: list
    parallelism: int

    @property
    def head(self) -> Node:
        return self.nodes[0]

    @property
    def tail(self) -> Node:
        return self.nodes[-1]

    @property
    def name(self) -> str:
        return " -> ".join(n.name for n in self.nodes)

    @property
    def num_inputs(self) -> int:
        """Input gates each subtask reads: one per JobEdge into this vertex."""
        return len(self.head.inputs)

    @property
    def is_iterator(self) -> bool:
        return self.head.is_iterator


@dataclass(eq=False)
class JobEdge:
    source: JobVertex
    target: JobVertex
    partitioner: str
    key_fn: Callable | None
    kind: Any                      # resolved record kind (a Serializer or a NumPy dtype) or None
    input_index: int = 0           # which input of the target's head node this edge feeds
    timestamped: bool = False      # every record travels with its event time
    tag: str | None = None         # a side output: its name, and the node of the source's chain emitting it
    source_node: "Node | None" = None

    @property
    def pointwise(self) -> bool:
        return self.partitioner == "forward"


def _own_timestamps(n: Node) -> bool | None:
    """Whether ``n`` decides its output's timestamps itself (True: it assigns
    them, False: there are none); None: as its inputs."""
    ts = n.timestamps
    if isinstance(n.kind, np.dtype) or isinstance(ts, str) or not n.inputs or n.drops_timestamps:
        return False    # (a side output's reader: as the operator emitting it)
    if ts is not None and n.assigns_timestamps:
        return True
    return None     # (a filter's or a late() stream's timestamp function is its input's)


def carried_timestamps(record):
    """The timestamp "function" of a stream whose times travel with its
    records: a job hands its operators the times, so only an operator run
    without them (an OperatorHarness) ever calls it."""
    raise errors.ConfigurationError(
        "this stream's timestamps travel with its records (assign_timestamps came before a map, flat_map, "
        "process, union or window), and this operator was fed records without their times: in an "
        "OperatorHarness, pass them with process(records, timestamps=[...])")


def has_timestamps(node: Node) -> bool:
    """Whether the records of ``node``'s output carry event timestamps: those
    of ``assign_timestamps(fn)``, and then of every operator after it whose
    inputs all carry them (map, filter, flat_map, process, union, connect,
    windows, joins: each gives its outputs a time). Not a source's, not an
    Arrow/pandas stream timed by a column (the windows read the column), not
    rows of a NumPy dtype (fixed-width, no room for one)."""
    seen: dict = {}
    stack = [node]
    while stack:
        n = stack[-1]
        if id(n) in seen:
            stack.pop()
            continue
        own = _own_timestamps(n)
        if own is None:
            todo = [i.node for i in n.inputs if id(i.node) not in seen]
            if todo:
                stack.extend(todo)
                continue
            own = all(seen[id(i.node)] for i in n.inputs)
        seen[id(n)] = own
        stack.pop()
    return seen[id(node)]
def set_uid(nodes: list, node, uid) -> None:
    """``node.uid = uid`` for ``Stream.uid`` and a sink's ``uid``: a
    non-empty str that no other node of the job has."""
    if not isinstance(uid, str) or not uid:
        raise TypeError(f"uid takes a non-empty str, got {uid!r}")
    for n in nodes:
        if n.uid == uid and n is not node:
            raise errors.ConfigurationError(f"uid {uid!r} is already the id of operator {n.name!r}")
    node.uid = uid


# How ids are derived for operators without a uid, as recorded in a
# checkpoint's metadata ("id_scheme"); checkpoints without it were written
# with LEGACY_SCHEME ids ("reduce#0": name and rank among that name).
ID_SCHEME = "topology-1"
LEGACY_SCHEME = "name-rank"

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def declaration_site() -> tuple | None:
    """(file, line) of the innermost caller outside pyflowbuf's own package:
    where the user declared the operator being made (a job run by
    ``pyflowbuf run`` or ``run_dataflow`` included). A warning about the
    operator points there (``warnings.warn_explicit``)."""
    f = sys._getframe(1)
    while f is not None:
        # (a dataclass's generated __init__ has no file of its own: its module tells)
        ours = f.f_code.co_filename.startswith(_PACKAGE_DIR) or \
            f.f_globals.get("__name__", "").partition(".")[0] == "pyflowbuf"
        if not ours:
            return f.f_code.co_filename, f.f_lineno
        f = f.f_back
    return None


def operator_type(node: Node) -> str:
    """The kind of operator a node runs, as its derived id and a
    checkpoint name it: its operator's class (``KeyedReduce``,
    ``CollectSink``), "source" or "iterator". Not its ``name``: a name is a
    label, renaming it keeps the operator's state."""
    t = node._operator_type
    if t is None:
        if node.make_operator is not None:
            op = node.make_operator()
            t = type_name(op)
            node._state_kind = _state_kind(op, t)
        else:
            t = "source" if node.source is not None else "iterator"
        node._operator_type = t
    return t


def _state_kind(op, t: str) -> str:
    """What a derived id hashes of an operator's kind: its class, and for a
    window (one class for them all) its function's kind and its assigner's
    class, so a window reduce turned into an aggregate or a tumbling
    window into a session window at the same place never gets the other's
    state. (Only names of types and constants: ids must be the same in
    every process and every run.)"""
    how, assigner = getattr(op, "how", None), getattr(op, "assigner", None)
    if isinstance(how, str) and assigner is not None:
        return f"{t}:{how}:{type(assigner).__name__}"
    return t


def is_stateful(node: Node) -> bool:
    """Whether a node may hold state in a checkpoint: a source (its
    position), a sink, an operator with keyed state or a snapshot of its own."""
    if node.make_operator is None:
        return node.source is not None
    if node.is_sink:
        return True
    s = node._stateful
    if s is None:
        cls = type(node.make_operator())
        s = node._stateful = bool(cls.keyed_state or cls.snapshot_state is not Operator.snapshot_state)
    return s


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=6).hexdigest()


def _next_stateful(node: Node) -> list:
    """The operator types of the first stateful nodes (or sinks) after
    ``node``, looking through stateless ones: what its output feeds. A
    restore compares them (``restore.RestorePlan``) to tell an operator from
    one of its kind inserted right before or after it."""
    out, seen, todo = set(), set(), list(node.consumers)
    while todo:
        c = todo.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        if c.is_sink or is_stateful(c):
            out.add(operator_type(c))
        else:
            todo.extend(c.consumers)
    return sorted(out)


def assign_uids(nodes: list) -> None:
    """Give every node its derived id (``derived_uid``, the id of its state
    when it has no ``uid``), from its place in the graph as Flink hashes
    its stream graph: its operator type, which nodes it reads (their derived
    ids, by input and side output) and its rank among the nodes of that type
    reading the same inputs (``"KeyedReduce-3f2a9c1b04de"``). So inserting or
    removing an operator changes the ids after it, and a restore refuses
    their state rather than hand it to another operator; the parallelism,
    chaining, partitioning and names are left out (a rescale, ``chaining=
    False``, a ``rebalance()`` or a rename keep the ids). An upstream node's
    derived id counts even when it has a uid, so giving operators uids
    later moves no other id.

    Each node also gets ``legacy_uid`` (name and rank among that name, the
    ids of checkpoints written before ``ID_SCHEME``) and ``id_info`` (what a
    checkpoint records to check a restore's mapping). Two explicit uids
    alike are refused: their state would be mixed."""
    seen: dict = {}
    for node in nodes:
        if node.uid is not None:
            other = seen.get(node.uid)
            if other is not None:
                raise ValueError(f"operators {other.name!r} and {node.name!r} both have uid {node.uid!r}: "
                                 "each operator needs its own")
            seen[node.uid] = node
    counts: dict = {}
    groups: dict = {}
    for node in nodes:          # declaration order: a node's inputs come before it
        k = counts.get(node.name, 0)
        counts[node.name] = k + 1
        legacy = f"{node.name}#{k}"
        while legacy in seen:
            legacy += "'"
        node.legacy_uid = legacy
        kind = operator_type(node)
        reads = ",".join(f"{i}:{inp.tag or ''}:{inp.node.derived_uid}" for i, inp in enumerate(node.inputs))
        group = _digest(f"{node._state_kind or kind}|{reads}")
        members = groups.setdefault(group, [])
        rank = len(members)
        members.append(node)
        derived = f"{kind}-{_digest(f'{group}#{rank}')}"
        while derived in seen:
            derived += "'"
        node.derived_uid = derived
        node.id_info = {"scheme": ID_SCHEME, "group": group, "rank": rank}
    for members in groups.values():
        names = [n.name for n in members]
        for n in members:
            n.id_info.update(of=len(members), names=names, next=_next_stateful(n))


def plan(nodes: list, chaining: bool) -> tuple[list, list]:
    """Group nodes into JobVertices and connect them with JobEdges.

    A node with several inputs always heads a vertex of its own (its task
    reads one gate per input); operators after it chain to it as usual. So
    does a node reading a side output: a chain is a line, and the side
    output of a node inside one leaves its vertex through an edge of its own
    (``JobEdge.tag``), while the node's main output may go on chaining."""
    assign_uids(nodes)
    for node in nodes:
        if node.job_check is not None:      # a check of the whole job (write_kafka: prefixes differ)
            node.job_check(node, nodes)
    vertex_of: dict = {}
    vertices: list = []
    edges: list = []
    for node in nodes:        # declaration order: a node's inputs come before it
        own = _own_timestamps(node)
        node.timestamped = own if own is not None else all(i.node.timestamped for i in node.inputs)
    for node in nodes:
        for inp in node.inputs:
            up = inp.node
            if inp.partitioner == "forward" and up.parallelism != node.parallelism:
                raise ValueError(
                    f"forward partitioning from {up.name!r} (parallelism {up.parallelism}) to "
                    f"{node.name!r} (parallelism {node.parallelism}) needs equal parallelism; "
                    "use rebalance() or set the same parallelism")
        up = node.inputs[0].node if len(node.inputs) == 1 else None
        # An assigner right after a source runs in the source's task even
        # without chaining: timestamps are assigned at the source, as by a
        # Flink source given a WatermarkStrategy, not in a task of their own.
        at_source = up is not None and up.source is not None and node.assigns_timestamps
        chainable = (
            (chaining or at_source) and up is not None and node.inputs[0].partitioner == "forward"
            and node.inputs[0].tag is None and _main_readers(up) == 1
            and not node.is_iterator and not up.is_sink
        )
        if chainable:
            v = vertex_of[up.id]
            v.nodes.append(node)
        else:
            v = JobVertex(len(vertices), [node], node.parallelism)
            vertices.append(v)
            for k, inp in enumerate(node.inputs):
                if inp.tag is None:
                    edges.append(JobEdge(vertex_of[inp.node.id], v, inp.partitioner, inp.key_fn,
                                         inp.node.kind, input_index=k,
                                         timestamped=inp.node.timestamped))
                else:   # a side output's reader carries the tag's kind
                    edges.append(JobEdge(vertex_of[inp.node.id], v, inp.partitioner, inp.key_fn,
                                         node.kind, input_index=k, tag=inp.tag, source_node=inp.node,
                                         timestamped=inp.node.timestamped))
        vertex_of[node.id] = v
    return vertices, edges


def _main_readers(node: Node) -> int:
    """How many inputs read ``node``'s main output (its side outputs' readers
    do not keep it from chaining)."""
    return sum(1 for c in node.consumers for inp in c.inputs if inp.node is node and inp.tag is None)
