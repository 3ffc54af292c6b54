"""A worker's part of a job spread over processes, under any launcher (forked
processes here, Spark barrier tasks in ``pyflowbuf.spark.cluster``): the
network side of its process (``RemoteContext``), the messages it sends the
driver (``_Sender``), the collected records it ships ahead of every
acknowledgement (``CollectShipper``), the checkpoint coordinator as its
tasks see it (``WorkerCoordinator``), and ``run_worker``, its whole life.
The driver's part is ``pyflowbuf.cluster.driver``."""
from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
import traceback

from pyflowbuf import errors
from pyflowbuf.checkpoint import CheckpointStorage, SavepointStorage
from pyflowbuf.net import ConnectionManager, NetworkServer
from pyflowbuf import checkpointing as ckpt
from pyflowbuf.checkpointing.gateway import CoordinatorGateway
from pyflowbuf.runtime.execution import CANCEL_GRACE_S, JobExecution, is_secondary
from pyflowbuf.connectors.sinks import CollectSink
from pyflowbuf.serializers import get_serializer

log = logging.getLogger("pyflowbuf.cluster")

DRIVER = -1          # the "worker" index of the calling process (an iterator sink runs there)
DRAIN_TIMEOUT_S = 120.0
# buffers of each remote input channel, and floating ones per gate (Flink's defaults)
EXCLUSIVE_BUFFERS = 2
FLOATING_BUFFERS = 8


def placement(workers: int):
    def place(vertex, subtask):
        return DRIVER if vertex.is_iterator else subtask % workers
    return place


class RemoteContext:
    """The network side of one process: a NetworkServer for its exports
    (started only if something is exported) and a ConnectionManager for its
    remote input channels."""

    def __init__(self, secret, spec, exclusive_buffers=EXCLUSIVE_BUFFERS, floating_buffers=FLOATING_BUFFERS,
                 *, host=None, port_range=None, tls=None):
        self.secret = secret
        self.tls = tls        # this attempt's TLSConfig, or None
        self.spec = spec
        self.exclusive_buffers = exclusive_buffers
        self.floating_buffers = floating_buffers
        self.host = spec.network_config.bind_host if host is None else host
        self.port_range = port_range
        # the handshake announces this as the largest buffer a consumer must take
        self.server = NetworkServer(secret, host=self.host, max_buffer_size=spec.network_config.segment_size,
                                    tls=tls)
        self.manager = ConnectionManager(secret, credit_based=spec.network_config.credit_based, tls=tls)
        self.addresses: dict = {}
        self.exports: list = []
        self.collected = None        # the worker's CollectShipper (checkpoints need it before tasks run)

    def start_server(self):
        if self.port_range is None:
            return self.server.start()
        # a firewall lets only these ports through: take the first free one
        lo, hi = self.port_range
        for port in range(lo, hi + 1):
            server = NetworkServer(self.secret, host=self.host, port=port, max_buffer_size=self.spec.network_config.segment_size,
                                   tls=self.tls)
            try:
                address = server.start()
            except OSError:
                server.close()
                continue
            self.server.close()
            self.server = server
            return address
        raise errors.PortUnavailableError(
            f"no free port in port_range={self.port_range!r} on {self.host} for the exchange's server")

    def _check_kind(self, kind):
        if not self.spec.allow_pickle and get_serializer(kind).in_process_only:
            raise ValueError(
                f"a stream of kind {kind!r} would cross processes, and decoding it (unpickling) runs "
                "code the sender chose: give the operator a kind= that crosses processes (int64, "
                "float64, str, bytes, struct for tuples, lists and dicts of plain values, arrow, "
                "pandas, numpy) or pass Environment(allow_pickle=True) if every worker is trusted")

    def export(self, partition_id, subpartition, queue, kind, on_error):
        self._check_kind(kind)
        self.server.export(partition_id, subpartition, queue, kind=kind,
                           allow_pickle=self.spec.allow_pickle, on_release=on_error)
        self.exports.append((partition_id, subpartition))

    def connect(self, network_pool, gate, specs, kind, on_error):
        self._check_kind(kind)
        excl, floating = self.manager.create_input_pools(
            network_pool, len(specs), self.exclusive_buffers, self.floating_buffers)
        channels = []
        for (worker, pid, sub, queue), pool in zip(specs, excl):
            ch = self.manager.create_channel(
                tuple(self.addresses[worker]), pid, sub, queue, pool, floating, kind=kind,
                allow_pickle=self.spec.allow_pickle, on_error=lambda _ch, exc: on_error(exc))
            ch.attach_gate(gate)
            channels.append(ch)
        return channels

    def tasks_armed(self, tasks):
        """The job armed its tasks for checkpoints; none runs yet."""
        if self.collected is not None:
            self.collected.restored(tasks)

    def exports_drained(self) -> bool:
        return all(self.server.export_state(p, s) in ("finished", "released", None) for p, s in self.exports)

    def close(self):
        for closer in (self.manager.close, self.server.close):
            try:
                closer()
            except Exception:
                pass



def attempt_secret(secret: bytes, attempt: int) -> bytes:
    """The shared secret of one attempt of a job: the job's secret bound to
    the attempt number, so that a connection of another attempt (a worker
    of an attempt that was stopped for a restart) fails authentication and
    can neither send into nor take from the processes of this one."""
    return hmac.new(secret, b"pyflowbuf attempt %d" % attempt, hashlib.sha256).digest()


class _Sender:
    """``conn.send`` for the threads of a worker (the control loop, task
    threads finishing, snapshot writers): one message at a time, each with
    the worker's attempt number (the driver ignores those of an attempt it
    has restarted), and a lock that lets a caller keep several messages
    together in order."""

    def __init__(self, conn, attempt=0):
        self.conn = conn
        self.attempt = attempt
        self.lock = threading.RLock()

    def __call__(self, msg):
        with self.lock:
            self.conn.send((self.attempt, msg))


class CollectShipper:
    """Ships a worker's ``collect()`` records to the driver as increments
    ``{node id: {subtask: (start, records)}}``: the driver replaces its list
    from ``start`` on. Increments go out ahead of every acknowledgement and
    final state on the same pipe, so by the time a checkpoint completes the
    driver holds every record it covers, even if the worker dies right
    after. A restored collect sink keeps the records its checkpoint counted:
    here they are placeholders (the driver has them), and the first increment
    (``start`` = that count) drops what the failed attempt collected after it."""

    def __init__(self, spec, send: _Sender):
        self.parts = {n.id: n.collect_parts for n in spec.nodes if n.collect_parts is not None}
        self.send = send
        self.shipped: dict = {}      # (node id, subtask) -> records the driver has

    def restored(self, tasks):
        sync: dict = {}
        for t in tasks:
            for i, op in enumerate(t.operators):
                if not isinstance(op, CollectSink):
                    continue
                state = t.restore["operators"][i] if t.restore is not None else None
                keep = state["records"] if state else 0
                # the sink keeps list[:keep] when it opens, then appends after it
                op.target[t.index] = [None] * keep
                self.shipped[(op.node_id, t.index)] = keep
                sync.setdefault(op.node_id, {})[t.index] = (keep, [])
        if sync:
            self.send(("collected", sync))

    def increments(self) -> dict:
        out: dict = {}
        for nid, parts in self.parts.items():
            # list() copies at once: a sink task may add its subtask meanwhile
            for sub, records in list(parts.items()):
                start = self.shipped.get((nid, sub), 0)
                end = len(records)       # sinks only append (after their restore)
                if end > start:
                    out.setdefault(nid, {})[sub] = (start, records[start:end])
                    self.shipped[(nid, sub)] = end
        return out

    def flush(self):
        with self.send.lock:
            inc = self.increments()
            if inc:
                self.send(("collected", inc))


class WorkerCoordinator(CoordinatorGateway):
    """The checkpoint coordinator as a worker's tasks see it: its config and
    storage (each task writes its own state file to the shared
    ``checkpoint_dir``), and acknowledgements, declines and final states
    sent to the driver, whose CheckpointCoordinator completes checkpoints."""

    def __init__(self, config, storage, send: _Sender, collected: CollectShipper):
        self.config = config
        self.storage = storage
        self._send = send
        self._collected = collected

    def _post(self, msg, with_records=False):
        try:
            with self._send.lock:
                if with_records:
                    self._collected.flush()
                self._send(msg)
        except (OSError, ValueError) as exc:
            # the driver is gone: the control thread sees it too and cancels the job
            log.debug("pyflowbuf: worker could not reach the driver: %s", exc)

    _savepoints: dict = {}

    def register_savepoint(self, checkpoint_id, path) -> None:
        """Checkpoint ``checkpoint_id`` is a savepoint into ``path`` (told with its trigger)."""
        self._savepoints = dict(self._savepoints)
        self._savepoints[checkpoint_id] = SavepointStorage(path, allow_pickle=self.storage.allow_pickle,
                                                           checkpoint_id=checkpoint_id)

    def storage_for(self, checkpoint_id):
        return self._savepoints.get(checkpoint_id, self.storage)

    def acknowledge(self, task_key, checkpoint_id, handle, alignment_ms, commits, summary=None) -> None:
        self._post(("ack", task_key, checkpoint_id, handle.to_dict(), alignment_ms, list(commits), summary), True)

    def decline(self, task_key, checkpoint_id, reason) -> None:
        self._post(("decline", task_key, checkpoint_id, str(reason)))

    def task_finished(self, task_key, state, commits, snapshotted: int = 0, summary=None) -> None:
        self._post(("finished", task_key, state, list(commits), snapshotted, summary), True)


def run_worker(spec, me, workers, secret, conn, attempt=0, *, host=None, port_range=None, info=None,
               join_control=False, tls=None):
    """Worker ``me``'s part of a job, talking to the driver on ``conn`` (a
    pipe, or a ``pyflowbuf.cluster.control_channel.ControlChannel``): announce the
    exchange's address, wait for every worker's and the checkpoint to
    restore, run the tasks placed here, answer the driver's control
    messages, report the end. Returns once everything it started (task
    threads, the exchange's sockets and threads, the control thread) is
    gone and ``conn`` is closed, so a process that runs worker after worker
    (a Spark Python worker) starts each one clean. ``info`` (executor,
    host) is added to every task's metrics. ``join_control``: wait for the
    control thread (a pipe's recv() is not woken by close(), so a forked
    worker, which exits at once, does not wait). ``tls``: the attempt's
    ``TLSConfig`` for the exchange (mutual TLS), or None."""
    remote = None
    listener = None
    send = _Sender(conn, attempt)

    def metrics(job):
        m = job.metrics()
        if info:
            for task in m.values():
                if isinstance(task, dict):
                    task.update(info)
        return m

    try:
        remote = RemoteContext(attempt_secret(secret, attempt), spec, host=host, port_range=port_range, tls=tls)
        remote.collected = shipper = CollectShipper(spec, send)
        job = JobExecution(spec, placement(workers), me, remote)
        config = ckpt.CheckpointSettings.from_env(spec)
        if config is not None:
            storage = CheckpointStorage(config.directory, retained=config.retained,
                                        allow_pickle=config.allow_pickle)
            job.checkpoint_config = config
            job.coordinator = WorkerCoordinator(config, storage, send, shipper)
        send(("ready", remote.start_server()))
        sent_attempt, msg = conn.recv()
        if msg[0] != "go" or sent_attempt != attempt:
            return
        remote.addresses = {int(w): tuple(a) for w, a in msg[1].items()}
        job.restore_from = msg[2]       # a checkpoint id the driver chose, or None
        job.check_key_kinds = msg[3] if len(msg) > 3 else True      # (runtime.restore.checks_key_kinds)
        job.start()

        def listen():
            try:
                while True:
                    sent_attempt, (what, *args) = conn.recv()
                    if sent_attempt != attempt:
                        continue        # (cannot happen: one channel per attempt) not ours
                    if what == "cancel":
                        job.cancel()
                    elif what == "trigger":
                        job.trigger_sources(*args)
                    elif what == "complete":
                        job.notify_complete(*args)
                    elif what == "abort":
                        job.abort_checkpoint(*args)
                    elif what == "unaligned":
                        job.switch_to_unaligned(*args)
            except (EOFError, OSError, errors.ProtocolError):
                job.cancel()   # the driver is gone
        listener = threading.Thread(target=listen, name="pyflowbuf: worker control", daemon=True)
        listener.start()
        while not job._done.wait(spec.metrics_config.interval):
            send(("metrics", metrics(job)))
        try:
            job.join()
        except errors.JobFailedError:
            task, op, exc, tb = job.failure
            send(("failed", task, op, f"{type(exc).__name__}: {exc}", tb, is_secondary(exc, op), metrics(job)))
            return
        # consumers elsewhere may still be reading our exports
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not job.cancelled and not remote.exports_drained() and time.monotonic() < deadline:
            time.sleep(0.01)
        # job.metrics() is the final sample now: join() returned after it
        with send.lock:
            send(("done", shipper.increments(), job.summary(), metrics(job)))
    except BaseException as exc:  # noqa: BLE001 - report everything to the driver
        try:
            # (a peer lost while connecting is secondary: the peer's own death says why)
            send(("failed", f"worker {me}", "worker", f"{type(exc).__name__}: {exc}",
                  traceback.format_exc(), is_secondary(exc, "worker")))
        except Exception:
            pass
    finally:
        if remote is not None:
            remote.close()
        conn.close()
        if listener is not None and join_control:
            listener.join(CANCEL_GRACE_S)   # the closed channel ends its recv()
