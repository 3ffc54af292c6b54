"""One attempt of one process's share of a job, deployed: its
NetworkBufferPool, the exchanges (a BufferQueue per channel, the output and
input sides over them, remote channels to other processes) and the subtasks
placed here; and the sizing rules of the output pools that memory follows."""
from __future__ import annotations

import functools

from pyflowbuf import errors
from pyflowbuf.checkpoint.codec import encode_value
from pyflowbuf.checkpoint.errors import UnsupportedStateError
from pyflowbuf._core.channel import BufferQueue, InputGate
from pyflowbuf._core.memory import NetworkBufferPool, Notifier
from pyflowbuf.exchange.debloat import initial_buffer_size
from pyflowbuf.exchange.sides import EdgeKind, InputSide, MultiInput, OutputSide
from pyflowbuf.connectors.sources import rate_limiter
from pyflowbuf.runtime.task import Subtask


def output_pool_size(spec, nsub: int) -> tuple:
    """(min, max) segments of an output pool feeding ``nsub`` subpartitions."""
    ob = spec.network_config.output_buffers
    if ob is not None:
        return ob
    return nsub + 1, 2 * nsub + 8


def subpartitions(edge) -> int:
    return 1 if edge.pointwise else edge.target.parallelism


def segments_needed(spec, edges, here, remote_buffers=None) -> int:
    """Segments for every output pool of this process at its cap, plus the
    exclusive and floating buffers of its remote input channels
    (``remote_buffers``: (exclusive per channel, floating per gate)): memory
    is bounded by construction and no pool ever waits on another pool's share."""
    total = 0
    for e in edges:
        up, down = e.source, e.target
        total += sum(here(up, i) for i in range(up.parallelism)) * output_pool_size(spec, subpartitions(e))[1]
        if remote_buffers is not None:
            exclusive, floating = remote_buffers
            for j in range(down.parallelism):
                if here(down, j):
                    n = sum(not here(up, i) for i in range(up.parallelism) if not e.pointwise or i == j)
                    if n:
                        total += n * exclusive + floating
    return total


def check_output_pools(spec, edges, processes) -> None:
    """Refuse output pools that can deadlock, before anything starts.

    A RecordWriter holds one buffer per subpartition and asks for the next one
    only after shipping a full one, so a pool of ``subpartitions`` segments
    always progresses (its consumers recycle what it shipped) and a smaller
    max never does once records reach every subpartition. Flink's default
    min is one more; this writer does not need it (events travel beside the
    buffers, not in pool segments), and the tests run pools of exactly one
    segment per subpartition. When ``num_segments`` cannot hold every pool at
    its max, pools compete for the segments above their guaranteed min, and a
    pool whose min is below its subpartitions can wait forever on segments
    that other blocked pools hold.
    ``processes``: (here(vertex, subtask), remote_buffers) per process."""
    net = spec.network_config
    for e in edges:
        nsub = subpartitions(e)
        lo, hi = output_pool_size(spec, nsub)
        where = (f"the output pool of {e.source.name!r} feeding {e.target.name!r} "
                 f"({e.partitioner}, {nsub} subpartition{'s' if nsub > 1 else ''} per producer)")
        if hi < nsub:
            raise errors.ConfigurationError(
                f"output_buffers={net.output_buffers!r} caps {where} at {hi} segment{'s' if hi > 1 else ''}; "
                f"its RecordWriter holds a buffer per subpartition, so the job would deadlock: give "
                f"output_buffers a max of at least {nsub}, e.g. output_buffers=({min(lo, nsub)}, {nsub}), "
                "or leave it unset for Flink's (subpartitions + 1, 2 * subpartitions + 8)")
    if net.num_segments is None:
        return      # sized for every pool at its max: the mins do not matter
    for here, remote_buffers in processes:
        needed = segments_needed(spec, edges, here, remote_buffers)
        if net.num_segments >= needed:
            continue
        for e in edges:
            nsub = subpartitions(e)
            lo, _ = output_pool_size(spec, nsub)
            if lo < nsub and any(here(e.source, i) for i in range(e.source.parallelism)):
                raise errors.ConfigurationError(
                    f"output_buffers={net.output_buffers!r} guarantees the output pool of {e.source.name!r} "
                    f"feeding {e.target.name!r} ({nsub} subpartitions) a min of {lo} segment"
                    f"{'s' if lo > 1 else ''}, and num_segments={net.num_segments} is too few for every "
                    f"pool to reach its max ({needed} needed), so pools compete for the rest and this one "
                    f"can wait forever on segments that other blocked pools hold: give output_buffers a min "
                    f"of at least {nsub}, or num_segments >= {needed} (or leave num_segments unset)")


class Deployment:
    """What ``JobExecution`` runs in one attempt (a restart deploys anew):
    built from the job's plan, its placement (only the subtasks placed on
    this process) and its ``remote`` context (channels to other processes)."""

    def __init__(self, job):
        self.job = job
        conf = job.spec.network_config
        num_segments = conf.num_segments or max(job._segments_needed() + 16, 64)
        self.network_pool = NetworkBufferPool(num_segments, conf.segment_size)
        self.queues: list = []       # every BufferQueue, to give back what is left in them
        self.exported: set = set()   # ids of queues a remote consumer drains
        self.notifiers: dict = {}    # (vertex id, subtask) -> the one Notifier all its gates wake
        self.inputs: dict = {}       # (vertex id, subtask) -> {input index: InputSide}
        self.outputs: dict = {}      # (vertex id, subtask) -> [OutputSide]
        self.tasks: list = []
        self.iterator_input = None
        for k, e in enumerate(job.edges):
            self._exchange(k, e)
        self._subtasks()

    def _exchange(self, k, e):
        """Edge ``k``'s channels, output sides and input sides in this process."""
        job, spec, net, here = self.job, self.job.spec, self.network_pool, self.job._here
        conf = spec.network_config
        notifiers, outputs, inputs = self.notifiers, self.outputs, self.inputs
        up, down = e.source, e.target
        kind = EdgeKind(e.kind)
        # A kind fixed by the graph is checked on both ends of a remote
        # channel; an inferred one travels in-band (EVT_KIND) as bytes.
        wire_kind = kind.value.core_kind if kind.fixed and not kind.is_rows else "bytes"
        needed = [(i, j) for i in range(up.parallelism) for j in range(down.parallelism)
                  if not e.pointwise or i == j]
        queues = {}
        start_size = initial_buffer_size(spec)
        for i, j in needed:
            if here(up, i) or here(down, j):
                q = queues[i, j] = BufferQueue(net)
                if start_size is not None:
                    q.buffer_size = start_size
                self.queues.append(q)
                if not here(down, j):
                    job.remote.export(f"{k}/{i}", j, q, wire_kind, job._remote_failed)
                    self.exported.add(id(q))
        pools = {}
        for i in range(up.parallelism):
            if not here(up, i):
                continue
            mine = [queues[i, j] for (a, j) in needed if a == i]
            lo, hi = job._output_pool_size(len(mine))
            # Unaligned checkpoints: a task waits for an output buffer
            # between batches, where it can take an overtaking barrier, so
            # a freed buffer must wake it (the one Notifier of its inputs).
            waker = None
            if _waits_between_batches(job, up):
                waker = notifiers.setdefault((up.id, i), Notifier())
            pools[i] = pool = net.create_pool(lo, hi, waker)
            codec_error = None
            if job.checkpoint_config is not None:
                codec_error = functools.partial(key_codec_error, allow_pickle=spec.allow_pickle)
            side = OutputSide(pool, mine, e.partitioner, e.key_fn, kind, conf.max_record_size,
                              timestamped=e.timestamped, max_parallelism=spec.max_parallelism,
                              consumer=down.head.name,
                              # a side output's edge: the task routes that node's side records here
                              tag=e.tag, source_node=None if e.tag is None else e.source_node.id,
                              remote=[id(q) in self.exported for q in mine], key_codec_error=codec_error)
            outputs.setdefault((up.id, i), []).append(side)
        for j in range(down.parallelism):
            if not here(down, j):
                continue
            sides = inputs.setdefault((down.id, j), {})
            if e.input_index in sides:
                raise ValueError(f"two edges feed input {e.input_index} of {down.name!r}")
            producers = [i for (i, b) in needed if b == j]
            chans = [queues[i, j] for i in producers]
            remote_from = [i for i in producers if not here(up, i)]
            notifier = notifiers.get((down.id, j))
            if notifier is None:
                notifier = notifiers[down.id, j] = Notifier()
            gate = InputGate(chans, notifier)
            remote_channels = []
            if remote_from:
                remote_channels = job.remote.connect(
                    net, gate, [(job.placement(up, i), f"{k}/{i}", j, queues[i, j]) for i in remote_from],
                    wire_kind, job._remote_failed)
            sides[e.input_index] = InputSide(
                gate, kind, conf.max_record_size, [pools[i] for i in producers if i in pools],
                remote_channels=remote_channels, allow_pickle=spec.allow_pickle,
                owned=down.is_iterator and not down.head.zero_copy, timestamped=e.timestamped)

    def _subtasks(self):
        job, here, inputs, outputs, notifiers = self.job, self.job._here, self.inputs, self.outputs, self.notifiers
        for v in job.vertices:
            for i in range(v.parallelism):
                if not here(v, i):
                    continue
                if v.is_iterator:
                    self.iterator_input = inputs[(v.id, 0)][0]
                    continue
                head = v.head
                ops = [n.make_operator() for n in v.nodes if n.make_operator is not None]
                for n, op in zip([n for n in v.nodes if n.make_operator is not None], ops):
                    op.place(n.id, n.operator_uid, n.kind, n.timestamped)
                source = head.source() if head.source is not None else None
                limiter = rate_limiter(head.rate_limit)
                if limiter is not None:
                    limiter = limiter.for_subtask(v.parallelism)
                sides = inputs.get((v.id, i), {})
                if v.num_inputs > 1:
                    input_side = MultiInput([sides[k] for k in range(v.num_inputs)])
                else:
                    # one input: the task reads its InputSide directly, nothing in between
                    input_side = sides.get(0)
                task = Subtask(job, v, i, ops, outputs.get((v.id, i), []),
                               source=source, input_side=input_side, rate_limiter=limiter)
                if _waits_between_batches(job, v):
                    task.notifier = notifiers.get((v.id, i))
                self.tasks.append(task)


def _waits_between_batches(job, vertex) -> bool:
    """Whether the subtasks of ``vertex`` wait for an output buffer between
    batches, woken by a freed buffer or a mail, rather than inside a write:
    every task with unaligned checkpoints (an overtaking barrier gets
    through), and a source whenever checkpoints are on: blocked inside a
    write, a source saw a checkpoint's trigger only once a buffer came back
    (0.02 to 0.47 s under backpressure, up to 16 s while the channels filled
    at start-up), and every checkpoint starts at the sources."""
    if job._gate_output:
        return True
    c = job.spec.checkpoint_config
    return c is not None and c.enabled and vertex.head.source is not None


def key_codec_error(key, allow_pickle=False):
    """Why a job's checkpoints could not store ``key`` (its state is stored
    under it), or None: checked with the first keys a key_by routes."""
    try:
        encode_value(key, allow_pickle=allow_pickle)
    except UnsupportedStateError as exc:
        return str(exc)
    return None
