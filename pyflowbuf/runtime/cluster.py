"""Jobs across worker processes on one host: subtask i of every operator runs
in worker i % workers, and exchanges between workers go over the TCP layer
(pyflowbuf.net) with credit-based flow control. This is what gives Python
operators more than one core.

The driver (the calling process) forks the workers, so the job graph and its
functions need no pickling; it hands out the workers' addresses, relays
cancellation, gathers metrics, collected results and the first real failure,
and leaves no process behind: workers die with the driver (PR_SET_PDEATHSIG)
and are killed if they outlive a cancelled job's grace period.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
import traceback
import warnings

from pyflowbuf import errors
from pyflowbuf.net import ConnectionManager, NetworkServer, new_secret
from pyflowbuf.runtime.job import CANCEL_GRACE_S, Execution, JobExecution, check_output_pools
from pyflowbuf.runtime.metrics import MetricsRelay, close_listeners, make_listeners

DRIVER = -1
START_TIMEOUT_S = 60.0
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

    def __init__(self, secret, env, exclusive_buffers=EXCLUSIVE_BUFFERS, floating_buffers=FLOATING_BUFFERS):
        self.secret = secret
        self.env = env
        self.exclusive_buffers = exclusive_buffers
        self.floating_buffers = floating_buffers
        # the handshake announces this as the largest buffer a consumer must take
        self.server = NetworkServer(secret, host=env.bind_host, max_buffer_size=env.segment_size)
        self.manager = ConnectionManager(secret, credit_based=env.credit_based)
        self.addresses: dict = {}
        self.exports: list = []

    def start_server(self):
        return self.server.start()

    def _check_kind(self, kind):
        from pyflowbuf.serializers import get_serializer

        if not self.env.allow_pickle and get_serializer(kind).in_process_only:
            raise ValueError(
                f"a stream of kind {kind!r} would cross processes, and decoding it (unpickling) runs "
                "code the sender chose: give the operator a kind= that crosses processes (int64, "
                "float64, str, bytes, struct for tuples, lists and dicts of plain values, arrow, "
                "pandas, numpy) or pass Environment(allow_pickle=True) if every worker is trusted")

    def export(self, partition_id, subpartition, queue, kind, on_error):
        self._check_kind(kind)
        self.server.export(partition_id, subpartition, queue, kind=kind,
                           allow_pickle=self.env.allow_pickle, on_release=on_error)
        self.exports.append((partition_id, subpartition))

    def connect(self, network_pool, gate, specs, kind, on_error):
        self._check_kind(kind)
        excl, floating = self.manager.create_input_pools(
            network_pool, len(specs), self.exclusive_buffers, self.floating_buffers)
        channels = []
        for (worker, pid, sub, queue), pool in zip(specs, excl):
            ch = self.manager.create_channel(
                tuple(self.addresses[worker]), pid, sub, queue, pool, floating, kind=kind,
                allow_pickle=self.env.allow_pickle, on_error=lambda _ch, exc: on_error(exc))
            ch.attach_gate(gate)
            channels.append(ch)
        return channels

    def exports_drained(self) -> bool:
        return all(self.server.export_state(p, s) in ("finished", "released", None) for p, s in self.exports)

    def close(self):
        for closer in (self.manager.close, self.server.close):
            try:
                closer()
            except Exception:
                pass


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel for the caller's first frame outside
    pyflowbuf, so the warning points at the user's execute() or join()."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(2), 2      # the frame of the function that warns is level 1
    while frame is not None and frame.f_code.co_filename.startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def _die_with_parent():
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _secondary(exc, op) -> bool:
    """Failures that follow another one (cancellation, a peer going away)."""
    return op == "remote exchange" or isinstance(exc, (errors.CancelledError, errors.ConnectionLostError))


def _collected(env) -> dict:
    return {n.id: dict(n.collect_parts) for n in env.nodes if n.collect_parts is not None}


def _worker_main(env, me, workers, secret, conn):
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when to stop
    remote = None
    try:
        remote = RemoteContext(secret, env)
        job = JobExecution(env, placement(workers), me, remote)
        conn.send(("ready", remote.start_server()))
        msg = conn.recv()
        if msg[0] != "go":
            return
        remote.addresses = msg[1]
        job.start()

        def listen():
            try:
                while True:
                    if conn.recv()[0] == "cancel":
                        job.cancel()
            except (EOFError, OSError):
                job.cancel()   # the driver is gone
        threading.Thread(target=listen, name="pyflowbuf: worker control", daemon=True).start()
        while not job._done.wait(env.metrics_interval):
            conn.send(("metrics", job.metrics()))
        try:
            job.join()
        except errors.JobFailedError:
            task, op, exc, tb = job.failure
            conn.send(("failed", task, op, f"{type(exc).__name__}: {exc}", tb, _secondary(exc, op),
                       job.metrics()))
            return
        # consumers elsewhere may still be reading our exports
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not job.cancelled and not remote.exports_drained() and time.monotonic() < deadline:
            time.sleep(0.01)
        # job.metrics() is the final sample now: join() returned after it
        conn.send(("done", _collected(env), job.summary(), job.metrics()))
    except BaseException as exc:  # noqa: BLE001 - report everything to the driver
        try:
            conn.send(("failed", f"worker {me}", "worker", f"{type(exc).__name__}: {exc}",
                       traceback.format_exc(), False))
        except Exception:
            pass
    finally:
        if remote is not None:
            remote.close()
        try:
            conn.close()
        finally:
            os._exit(0)


class ClusterExecution(Execution):
    """Same surface as JobExecution (start/join/cancel/iterate/metrics/summary/done)."""

    def __init__(self, env):
        if "fork" not in mp.get_all_start_methods():
            raise RuntimeError("workers= needs the 'fork' start method (Linux, macOS)")
        self.env = env
        self.workers = env.workers
        self.secret = new_secret()
        self.cancelled = False
        self.failure = None
        self._failure_secondary = True
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._procs: list = []
        self._conns: dict = {}
        self._summaries: dict = {}
        self._results: dict = {}
        self._finished_workers: set = set()
        self.local = None
        self.network_pool = None
        self.sampler = None              # a MetricsRelay once started
        self.started = self.ended = None
        # Every process checks its own pools too, but by then the others are
        # running: refuse a deadlocking setting here, before any fork.
        vertices, edges = env.plan()
        place = placement(self.workers)
        processes = [(lambda v, i, w=w: place(v, i) == w, (EXCLUSIVE_BUFFERS, FLOATING_BUFFERS))
                     for w in range(self.workers)]
        if any(v.is_iterator for v in vertices):
            processes.append((lambda v, i: place(v, i) == DRIVER, (EXCLUSIVE_BUFFERS, FLOATING_BUFFERS)))
        check_output_pools(env, edges, processes)
        self._worker_sinks = sorted({n.name for n in env.nodes if n.user_sink})

    # ---- lifecycle ----
    def start(self):
        # The listeners live here, not in the workers: one Prometheus port,
        # one log, one live view for the whole job; a busy port is refused
        # before any worker is forked.
        self.sampler = MetricsRelay(self.env.metrics_interval, make_listeners(self.env))
        ctx = mp.get_context("fork")
        self.started = time.monotonic()
        try:
            self._start_workers(ctx)
        except BaseException:
            close_listeners(self.sampler.listeners)
            raise
        self._monitor = threading.Thread(target=self._watch, name="pyflowbuf: driver", daemon=True)
        self._monitor.start()
        return self

    def _start_workers(self, ctx):
        addresses = {}
        try:
            for w in range(self.workers):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(self.env, w, self.workers, self.secret, child),
                                   name=f"pyflowbuf-worker-{w}", daemon=True)
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns[parent] = w
            deadline = time.monotonic() + START_TIMEOUT_S
            for c, w in self._conns.items():
                if not c.poll(max(0.0, deadline - time.monotonic())):
                    raise errors.FlowBufError(f"worker {w} did not start within {START_TIMEOUT_S} s")
                msg = c.recv()
                if msg[0] != "ready":
                    raise errors.JobFailedError(f"worker {w} failed to start: {msg[3]}\n{msg[4]}")
                addresses[w] = msg[1]
            if any(v.is_iterator for v in self.env.plan()[0]):
                self.local = JobExecution(self.env, placement(self.workers), DRIVER,
                                          RemoteContext(self.secret, self.env))
                self.local.remote.addresses = addresses
            self.ran = True
            for c in self._conns:
                c.send(("go", addresses))
        except BaseException:
            self.cancelled = True     # the workers are not part of a job: no grace period
            self._kill()
            for c in self._conns:
                c.close()
            if self.local is not None:
                self.local.remote.close()
            raise

    def _watch(self):
        conns = dict(self._conns)
        relay = self.sampler
        while conns:
            ready = mp.connection.wait(list(conns), timeout=min(0.5, relay.seconds_to_next()))
            relay.tick()
            for c in ready:
                w = conns[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    if w not in self._finished_workers:
                        code = self._procs[w].exitcode
                        self._fail(f"worker {w}", "worker process",
                                   f"worker {w} exited unexpectedly (exit code {code})", "", secondary=False)
                    continue
                if msg[0] == "metrics":
                    relay.update(w, msg[1])
                elif msg[0] == "done":
                    self._finished_workers.add(w)
                    for node_id, parts in msg[1].items():
                        self._results.setdefault(node_id, {}).update(parts)
                    self._summaries[w] = msg[2]
                    relay.update(w, msg[3])
                elif msg[0] == "failed":
                    self._finished_workers.add(w)
                    if len(msg) > 6:
                        relay.update(w, msg[6])
                    self._fail(*msg[1:5], secondary=msg[5])
        self.ended = time.monotonic()
        try:
            relay.close()       # the final merged sample, the last thing the job records
        finally:
            self._done.set()

    def _fail(self, task, op, text, tb, secondary):
        with self._lock:
            if secondary and self.cancelled and self.failure is None:
                return  # a peer going away because the job was cancelled is no failure
            replace = self.failure is None or (self._failure_secondary and not secondary)
            if replace:
                self.failure = (task, op, text, tb)
                self._failure_secondary = secondary
        self.cancel()

    def cancel(self):
        if self.cancelled:
            return
        self.cancelled = True
        for c in list(self._conns):
            try:
                c.send(("cancel",))
            except (OSError, ValueError):
                pass
        if self.local is not None:
            self.local.cancel()

    def _kill(self):
        for p in self._procs:
            p.join(CANCEL_GRACE_S if p.is_alive() and not self.cancelled else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)

    def _close(self):
        self._kill()
        for c in self._conns:
            c.close()
        for node in self.env.nodes:
            if node.collect_parts is not None and node.id in self._results:
                node.collect_parts.clear()
                node.collect_parts.update(self._results[node.id])
        if self.local is not None:
            self.local.remote.close()

    def _finished_ok(self):
        if self._worker_sinks:
            names = ", ".join(repr(n) for n in self._worker_sinks)
            warnings.warn(
                f"job {self.env.name!r}: sink(fn) {names} ran in worker processes (workers="
                f"{self.workers}), on the workers' copies of the caller's objects: what the function did "
                "to them (appending to a list, counting) is not seen in this process. Bring records "
                "back with collect() or to_iterator(), or write them where both can reach.",
                errors.WorkerSideEffectWarning, stacklevel=_caller_stacklevel())

    def raise_if_failed(self):
        if self.failure is not None:
            task, op, text, tb = self.failure
            raise errors.JobFailedError(
                f"job {self.env.name!r} failed: operator {op!r} in task {task!r} raised {text}"
                f"\n\nOriginal traceback (in the worker process):\n{tb}")

    def iterate(self, sink_node):
        self.start()
        try:
            yield from self.local.iterate(sink_node)
        except errors.CancelledError:
            if self.failure is None:
                raise
        finally:
            if not self._done.is_set():
                self.cancel()
        self.join()

    # ---- inspection ----
    @property
    def tasks(self):
        return []

    def metrics(self) -> dict:
        return {} if self.sampler is None else self.sampler.latest()

    def summary(self) -> dict:
        out = {}
        for snap in list(self._summaries.values()):
            out.update(snap)
        return out
