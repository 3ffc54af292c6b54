"""The logical graph (one Node per API call) and its plan: chains of forward
operators with equal parallelism fused into one JobVertex (operator chaining)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

PARTITIONERS = ("forward", "rebalance", "hash", "broadcast")


@dataclass(eq=False)
class Node:
    id: int
    name: str
    parallelism: int
    make_operator: Callable[[], Any] | None = None   # None for sources
    source: Any = None                               # a Source factory for sources
    input: "Node | None" = None
    partitioner: str = "forward"                     # how records reach this node from `input`
    key_fn: Callable | None = None                   # for the hash partitioner
    kind: Any = None                                 # output record kind (None: inferred)
    is_sink: bool = False
    is_iterator: bool = False                        # records go back to the caller
    zero_copy: bool = False                          # iterator sink: hand out views over segments
    rate_limit: Any = None
    collect_parts: dict | None = None                # a collect() sink's results, by subtask
    user_sink: bool = False                          # sink(fn): its effects stay in the process running it
    consumers: list = field(default_factory=list)


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
    def is_iterator(self) -> bool:
        return self.head.is_iterator


@dataclass(eq=False)
class JobEdge:
    source: JobVertex
    target: JobVertex
    partitioner: str
    key_fn: Callable | None
    kind: Any                      # resolved record kind (a Serializer or a NumPy dtype) or None

    @property
    def pointwise(self) -> bool:
        return self.partitioner == "forward"


def plan(nodes: list, chaining: bool) -> tuple[list, list]:
    """Group nodes into JobVertices and connect them with JobEdges."""
    vertex_of: dict = {}
    vertices: list = []
    edges: list = []
    for node in nodes:
        up = node.input
        if up is not None and node.partitioner == "forward" and up.parallelism != node.parallelism:
            raise ValueError(
                f"forward partitioning from {up.name!r} (parallelism {up.parallelism}) to "
                f"{node.name!r} (parallelism {node.parallelism}) needs equal parallelism; "
                "use rebalance() or set the same parallelism")
        chainable = (
            chaining and up is not None and node.partitioner == "forward"
            and len(up.consumers) == 1 and not node.is_iterator and not up.is_sink
        )
        if chainable:
            v = vertex_of[up.id]
            v.nodes.append(node)
        else:
            v = JobVertex(len(vertices), [node], node.parallelism)
            vertices.append(v)
            if up is not None:
                edges.append(JobEdge(vertex_of[up.id], v, node.partitioner, node.key_fn, up.kind))
        vertex_of[node.id] = v
    return vertices, edges
