"""Jobs across worker processes on one host: subtask i of every operator runs
in worker i % workers, and exchanges between workers go over the TCP layer
(pyflowbuf.net) with credit-based flow control. This is what gives Python
operators more than one core.

The driver (the calling process) forks a zygote before the execution starts a
thread, and the zygote forks the workers (``pyflowbuf.cluster.zygote``), so the
job graph and its functions need no pickling; the driver hands out the workers' addresses, relays
cancellation, gathers metrics, collected results and the first real failure,
and leaves no process behind: workers die with the zygote, the zygote with the
driver (EOF on its socket, PR_SET_PDEATHSIG), and workers are killed if they
outlive a cancelled job's grace period.

Checkpoints (``checkpoint_interval``): the coordinator runs in the driver and
reaches the workers' tasks through control messages on each worker's pipe
(trigger, complete, abort); each worker's tasks write their own state files
to ``checkpoint_dir`` and acknowledge through a proxy of the coordinator
(``WorkerCoordinator``). Barriers cross TCP as events, in order with the
buffers and without credit. On a failure (a task, or a worker process that
died) the driver stops every worker and has the zygote fork a new set restoring the latest
complete checkpoint, up to ``restart_attempts``. ``collect()`` records reach
the driver ahead of each acknowledgement (``CollectShipper``), so the driver
holds every record a checkpoint covers and keeps exactly those on a restore.

Placement: the job runs as the one execution (``runtime.execution.JobExecution``:
coordinator, restarts, restore, the failure rule, metrics) on a launcher
derived from ``RemoteLauncher``, which holds the driver's side of the
workers (their connections, the ready/go handshake, their messages, fencing
by attempt, collect, exit reports) and reports to the execution through
``runtime.launcher.AttemptEvents``: ``WorkerLauncher`` (the above: forked
processes, pipes; ``ForkLauncher`` is its earlier name) or
``pyflowbuf.spark.cluster.SparkLauncher`` (Spark barrier tasks on executors,
talking to the driver over ``pyflowbuf.cluster.control_channel``:
authenticated TCP, no pickle). ``run_worker`` (``pyflowbuf.cluster.worker``)
is the worker's part under either. ``ClusterExecution`` is the earlier name
of the execution (``JobExecution``) a job with workers gets.
"""
from __future__ import annotations

import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
import logging
import warnings

from pyflowbuf import errors
from pyflowbuf.checkpoint.storage import TaskStateHandle
from pyflowbuf.net import new_secret
from pyflowbuf.net.tls import AttemptTLS
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.cluster.locations import check_shared_locations
from pyflowbuf.connectors import outputs as sink_outputs
from pyflowbuf.runtime.deployment import check_output_pools
from pyflowbuf.runtime.execution import CANCEL_GRACE_S, JobExecution
from pyflowbuf.runtime import launcher as placements
from pyflowbuf.runtime.metrics import MetricsRelay
from pyflowbuf.cluster.zygote import Zygote, apply_output_decisions, output_decisions, set_process_name
from pyflowbuf.cluster.worker import (DRIVER, EXCLUSIVE_BUFFERS, FLOATING_BUFFERS, RemoteContext, attempt_secret,
                                      placement, run_worker)

log = logging.getLogger("pyflowbuf.cluster")

START_TIMEOUT_S = 60.0
# a worker whose pipe closed is exiting: how long the driver waits to learn how
EXIT_STATUS_WAIT_S = 5.0
# what of a crashed worker's faulthandler output goes into the failure
CRASH_LOG_LIMIT = 16 * 1024


def _caller_stacklevel() -> int:
    """warnings.warn's stacklevel for the caller's first frame outside
    pyflowbuf, so the warning points at the user's execute() or join()."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(2), 2      # the frame of the function that warns is level 1
    while frame is not None and frame.f_code.co_filename.startswith(root):
        frame, level = frame.f_back, level + 1
    return level



class OutputRelay(threading.Thread):
    """Carries what the workers print to the caller's ``sys.stdout``.

    A forked worker's ``sys.stdout`` is a copy of the caller's, which in a
    notebook or under ``redirect_stdout`` is an object whose output the
    worker's copy never delivers. Each worker gets a pipe as its
    ``sys.stdout`` instead; this thread reads the pipes and writes whole
    lines to the ``sys.stdout`` the caller has at that moment. Bounded: a
    pipe holds what the kernel allows, a worker that prints faster than
    the caller's stdout takes it waits in its write, and the relay holds at
    most ``MAX_LINE`` bytes of an unfinished line per worker; per worker the
    lines keep their order. It ends when every worker's end of its pipe is closed
    (the workers exited), so all they printed is out before join() returns."""

    CHUNK = 1 << 16         # bytes read at a time
    MAX_LINE = 1 << 20      # a longer line goes out in parts (other workers' lines may come between)

    def __init__(self, fds):
        super().__init__(name="pyflowbuf: worker output", daemon=True)
        self._fds = list(fds)
        self._stop_event = threading.Event()

    def run(self):
        import codecs
        import selectors

        sel = selectors.DefaultSelector()
        partial = {}
        # per pipe: a character cut by a chunk boundary is completed by the next
        decoders = {fd: codecs.getincrementaldecoder("utf-8")("replace") for fd in self._fds}
        try:
            for fd in self._fds:
                sel.register(fd, selectors.EVENT_READ)
                partial[fd] = b""
            while partial and not self._stop_event.is_set():
                for key, _ in sel.select(0.2):
                    fd = key.fd
                    try:
                        data = os.read(fd, self.CHUNK)
                    except OSError:
                        data = b""
                    if not data:            # the worker (and whatever it forked) closed its end
                        sel.unregister(fd)
                        self._write(decoders[fd].decode(partial.pop(fd), final=True))
                        continue
                    data = partial[fd] + data
                    cut = data.rfind(b"\n") + 1
                    if cut == 0 and len(data) < self.MAX_LINE:
                        partial[fd] = data  # part of a line: wait for its end
                        continue
                    if cut == 0:
                        cut = len(data)
                    partial[fd] = data[cut:]
                    self._write(decoders[fd].decode(data[:cut]))
            for fd, rest in partial.items():
                self._write(decoders[fd].decode(rest, final=True))
        finally:
            sel.close()
            for fd in self._fds:
                try:
                    os.close(fd)
                except OSError:
                    pass

    @staticmethod
    def _write(text):
        out = sys.stdout
        if not text or out is None:
            return
        try:
            out.write(text)
            out.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stdout must not break the job
            pass

    def close(self, timeout):
        """Wait for the workers' output; a process they forked that still
        holds a pipe open is not waited for beyond ``timeout``."""
        self.join(timeout)
        self._stop_event.set()
        self.join()


def _print_to_pipe(fd):
    """In a worker: ``sys.stdout`` becomes its pipe to the OutputRelay."""
    sys.stdout = open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")


def describe_exit(code) -> str:
    """A worker's exit status in words: ``killed by SIGSEGV (exit code -11)``."""
    if code is None:
        return "still running after it closed its pipe (exit code unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}"


def _worker_main(spec, me, workers, secret, conn, attempt=0, crash_log=None, output=None, tls=None):
    """A worker process (forked by the zygote): its part of the job, then exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver decides when to stop
    if crash_log is not None:
        # a fatal signal (SIGSEGV, SIGABRT, ...) leaves the threads' stacks
        # where the driver reads them when it reports the worker's death
        faulthandler.enable(file=crash_log, all_threads=True)
    if output is not None:
        _print_to_pipe(output)
    try:
        run_worker(spec, me, workers, secret, conn, attempt, tls=tls)
    finally:
        try:
            sys.stdout.flush()      # os._exit skips it: what was printed must reach the relay
        except Exception:  # noqa: BLE001
            pass
        os._exit(0)


def _forked_worker(spec):
    """What the zygote runs in each worker it forks: the request's values
    (``WorkerLauncher.launch``) applied to the zygote's copy of the job."""
    def run(payload, fds):
        conn_fd, out_fd, crash_fd = fds
        set_process_name(f"pfb-worker-{payload['me']}")
        apply_output_decisions(sink_outputs.graph_outputs(spec.nodes), payload["outputs"])
        # looked up now: the module's function as it was when the zygote was forked
        _worker_main(spec, payload["me"], payload["workers"], payload["secret"],
                     mp.connection.Connection(conn_fd), payload["attempt"], crash_fd, out_fd, payload.get("tls"))
    return run


class RemoteLauncher(placements.Launcher):
    """The driver's side of a job's workers, wherever they run: a placement
    (``runtime.launcher.Launcher``) for the one execution. It holds the
    workers' connections (one per worker and attempt), the ready/go
    handshake, the workers' messages, fencing by attempt, the collected
    records (``CollectedRecords``), the exit reports, and the driver's own
    share of the job (an iterator sink runs here), and reports to the
    execution through ``AttemptEvents``.

    Where the workers run is a subclass's: ``start_workers`` (one attempt's
    workers, as ``{channel: worker index}``), ``exit_report``, ``lost``,
    ``stop_workers``, ``forget_attempt``, ``release`` and ``close_workers``;
    ``WorkerLauncher`` forks processes (through a zygote),
    ``pyflowbuf.spark.cluster.SparkLauncher`` runs Spark barrier tasks."""

    what = "workers"
    traceback_where = " (in the worker process)"     # a failure's traceback is a worker's text
    workers: int
    start_timeout: float = START_TIMEOUT_S

    def check(self, execution) -> None:
        """Refusals before any worker starts; the attempt's secret and TLS."""
        super().check(execution)
        spec = execution.spec
        self._conns: dict = {}
        self.addresses = {}                 # worker -> (host, port) of its exchange server
        self._summaries: dict = {}
        self._collected = CollectedRecords()
        self._finished_workers: set = set()
        self._send_lock = threading.Lock()  # the coordinator's thread and the driver's both send
        self.local = None                   # the driver's share of the job: an iterator sink's
        execution.secret = new_secret()
        execution.tls = AttemptTLS(spec.tls, spec.name)   # each attempt's TLSConfig, or None
        check_every_process(spec, execution.vertices, execution.edges, self.workers)
        self._worker_sinks = sorted({n.name for n in spec.nodes if n.user_sink})

    # ---- what a placement of workers says ----
    def start_workers(self, attempt) -> dict:
        """One attempt's workers, started: ``{channel: worker index}``."""
        raise NotImplementedError

    def exit_report(self, w):
        """(text, traceback): why worker ``w`` ended without a word."""
        raise NotImplementedError

    def stop_workers(self, graceful: bool) -> None:
        """Every worker of the attempt has ended when this returns."""
        raise NotImplementedError

    def lost(self):
        """(text, traceback) once the attempt was lost in a way its channels do not show; else None."""
        return None

    def forget_attempt(self) -> None:
        """After stop_workers(): forget the attempt (a restart follows)."""

    def release(self, graceful: bool) -> None:
        """No attempt follows: what was kept for restarts can go."""

    def close_workers(self) -> None:
        """After stop_workers(), when the caller joins."""

    # ---- the placement, for the execution ----
    def sampler(self, listeners):
        # the listeners live here, not in the workers: one Prometheus port,
        # one log, one live view for the whole job
        return MetricsRelay(self.execution.spec.metrics_config.interval, listeners)

    def sources(self):
        # checked here, before a worker exists, rather than as a worker's failure
        return [(v.head.name, v.head.source()) for v in self.execution.vertices if v.head.source is not None]

    def launch(self, restore_id) -> None:
        """Start the attempt's workers, wait for each one's ready (its
        exchange's address), then tell every one to go."""
        ex = self.execution
        addresses = {}
        attempt = ex.attempt
        try:
            self._conns = self.start_workers(attempt)
            deadline = time.monotonic() + self.start_timeout
            for c, w in self._conns.items():
                if not c.poll(max(0.0, deadline - time.monotonic())):
                    raise errors.FlowBufError(f"worker {w} did not start within {self.start_timeout} s")
                try:
                    _, msg = c.recv()
                except (EOFError, OSError):
                    raise self._died_starting(w) from None
                if msg[0] != "ready":
                    raise errors.JobFailedError(f"worker {w} failed to start: {msg[3]}\n{msg[4]}")
                addresses[w] = tuple(msg[1])
            self.addresses = addresses      # what each worker's exchange server announced
            if any(v.is_iterator for v in ex.vertices):
                self.local = JobExecution(ex.spec, placement(self.workers), DRIVER,
                                          RemoteContext(attempt_secret(ex.secret, attempt), ex.spec,
                                                        tls=ex.tls.for_attempt(attempt)))
                self.local.remote.addresses = addresses
            with self._send_lock:
                for c, w in self._conns.items():
                    try:
                        c.send((attempt, ("go", addresses, restore_id, ex.check_key_kinds)))
                    except OSError:
                        raise self._died_starting(w) from None
            ex.attempt_ready()
        except BaseException:
            # the workers are not part of a job: no grace period
            self.stop_workers(graceful=False)
            for c in self._conns:
                c.close()
            self.close_workers()
            if self.local is not None:
                self.local.remote.close()
            raise

    def _died_starting(self, w):
        text, tb = self.exit_report(w)
        return errors.FlowBufError(f"{text}, before the job started" + (f"\n{tb}" if tb else ""))

    def await_attempt(self) -> None:
        """Relay one attempt's messages until every worker of it has ended."""
        ex = self.execution
        conns = dict(self._conns)
        attempt = ex.attempt
        relay = ex.sampler
        while conns:
            ready = mp.connection.wait(list(conns), timeout=min(0.5, relay.seconds_to_next()))
            relay.tick()
            lost = self.lost()
            if lost is not None and not ex.cancelled:
                # the workers' platform ended the attempt while channels stay open
                ex.subtask_failed("driver", "worker launcher", *lost, secondary=False, attempt=attempt)
            for c in ready:
                w = conns[c]
                try:
                    sent_attempt, msg = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    if w not in self._finished_workers:
                        text, tb = self.exit_report(w)
                        ex.subtask_failed(f"worker {w}", "worker process", text, tb, secondary=False,
                                          attempt=attempt)
                    continue
                try:
                    self._handle(w, msg, sent_attempt)
                except Exception as exc:  # noqa: BLE001 - a message the driver cannot act on fails the job
                    ex.subtask_failed("driver", "checkpoint coordinator", f"{type(exc).__name__}: {exc}",
                                      traceback.format_exc(), secondary=False, attempt=attempt)

    def _handle(self, w, msg, attempt=None):
        ex = self.execution
        if attempt is not None and attempt != ex.attempt:
            # a worker of an attempt already given up (a late word of a
            # process killed for the restart): nothing of it counts now
            log.debug("pyflowbuf: ignored %r of worker %d of attempt %d (now %d)", msg[0], w, attempt, ex.attempt)
            return
        what = msg[0]
        relay = ex.sampler
        if what == "metrics":
            relay.update(w, msg[1])
        elif what == "collected":
            self._collected.add(w, msg[1], ex.restarts)
        elif what == "ack":
            _, key, n, handle, alignment_ms, commits, summary = msg
            ex.subtask_acknowledged(key, n, TaskStateHandle.from_dict(handle), alignment_ms, commits, summary)
        elif what == "decline":
            ex.subtask_declined(msg[1], msg[2], msg[3])
        elif what == "finished":
            _, key, state, commits, snapshotted, summary = msg
            ex.subtask_finished(key, state, commits, snapshotted, summary)
        elif what == "done":
            self._finished_workers.add(w)
            self._collected.add(w, msg[1], ex.restarts)
            self._summaries[w] = msg[2]
            relay.update(w, msg[3])
        elif what == "failed":
            self._finished_workers.add(w)
            if len(msg) > 6:
                relay.update(w, msg[6])
            ex.subtask_failed(*msg[1:5], secondary=msg[5])
        else:
            raise errors.ProtocolError(f"unknown message {what!r} from worker {w}")

    def cancel(self) -> None:
        self.send(("cancel",))
        if self.local is not None:
            self.local.cancel()

    def send(self, msg) -> None:
        with self._send_lock:
            for c in list(self._conns):
                try:
                    c.send((self.execution.attempt, msg))
                except (OSError, ValueError):
                    pass    # that worker has ended; its end is reported on its pipe

    def restartable(self) -> bool:
        # not a job with an iterator: records handed out would be handed out again
        return not any(v.is_iterator for v in self.execution.vertices)

    def stop_attempt(self) -> None:
        """A worker took its segments with it: the next ones start with fresh pools."""
        self.stop_workers(graceful=not self.execution.cancelled)
        with self._send_lock:
            for c in self._conns:
                c.close()
            self._conns = {}
        self.forget_attempt()
        self._finished_workers = set()
        # a new secret too: a worker of the stopped attempt (a task Spark
        # has not ended yet) cannot derive the next attempt's
        self.execution.secret = new_secret()

    def finished(self, graceful: bool) -> None:
        # no restart follows: the workers end, and what started them
        self.release(graceful)

    def close(self) -> None:
        self.stop_workers(graceful=not self.execution.cancelled)
        for c in self._conns:
            c.close()
        self.close_workers()        # every worker has ended: its output is all in
        self._collected.hand_over(self.execution.spec.nodes)
        if self.local is not None:
            self.local.remote.close()

    def joined_ok(self) -> None:
        if self._worker_sinks:
            names = ", ".join(repr(n) for n in self._worker_sinks)
            warnings.warn(
                f"job {self.execution.spec.name!r}: sink(fn) {names} ran in worker processes (workers="
                f"{self.workers}), on the workers' copies of the caller's objects: what the function did "
                "to them (appending to a list, counting) is not seen in this process. Bring records "
                "back with collect() or to_iterator(), or write them where both can reach.",
                errors.WorkerSideEffectWarning, stacklevel=_caller_stacklevel())

    def records(self):
        yield from self.local.iterate(None)

    def summary(self) -> dict:
        out = {}
        for snap in list(self._summaries.values()):
            out.update(snap)
        return out


class WorkerLauncher(RemoteLauncher):
    """Starts a job's workers as processes forked by a zygote
    (``pyflowbuf.cluster.zygote``), itself forked from the driver before the
    execution starts a thread; each worker talks to the driver on a
    ``multiprocessing`` pipe (the job needs no pickling: the zygote holds it).
    What the workers print reaches the caller's ``sys.stdout``
    (OutputRelay); a worker that dies is reported with its exit status (the
    zygote reaps it) and its faulthandler output."""

    what = "worker processes"

    def __init__(self, spec):
        if "fork" not in mp.get_all_start_methods():
            raise RuntimeError("workers= needs the 'fork' start method (Linux, macOS)")
        self.spec = spec
        self.workers = spec.workers
        self.start_timeout = START_TIMEOUT_S
        self.zygote = None
        self.pids: list = []                 # the current attempt's workers, by index
        self._outputs: list = []             # an OutputRelay per set of workers started
        self._crash_logs: list = []          # per worker: its faulthandler file (its descriptor goes with the fork)

    def open(self):
        """The zygote, forked now: the job graph is complete and nothing of
        this execution runs a thread yet."""
        if self.zygote is None:
            self.zygote = Zygote(_forked_worker(self.spec))

    def start_workers(self, attempt) -> dict:
        """Have the zygote fork one attempt's workers; returns ``{channel: worker index}``."""
        conns = {}
        reads = []
        try:
            if self.zygote is None:
                raise errors.FlowBufError("WorkerLauncher.start_workers before open(): no zygote to fork the workers")
            # what the driver decided since the zygote was forked goes with each request
            outputs = output_decisions(sink_outputs.graph_outputs(self.spec.nodes))
            for w in range(self.workers):
                parent, child = mp.Pipe()
                out_r, out_w = os.pipe()
                reads.append(out_r)
                crash_log = tempfile.TemporaryFile(prefix=f"pyflowbuf-worker-{w}-")
                self._crash_logs.append(crash_log)
                conns[parent] = w
                try:
                    payload = {"me": w, "workers": self.workers, "attempt": attempt,
                               "secret": self.execution.secret, "outputs": outputs,
                               "tls": self.execution.tls.for_attempt(attempt)}
                    self.pids.append(self.zygote.fork(payload, [child.fileno(), out_w, crash_log.fileno()]))
                finally:
                    child.close()
                    os.close(out_w)     # the worker holds its own: EOF once it exits
            relay = OutputRelay(reads)
            reads = []                  # the relay closes the read ends
            relay.start()
            self._outputs.append(relay)
            return conns
        except BaseException:
            self.stop_workers(graceful=False)
            for c in conns:
                c.close()
            for fd in reads:
                os.close(fd)
            raise

    def exit_report(self, w):
        """Why worker ``w`` ended without saying goodbye: its exit status (a
        signal by name) and what faulthandler wrote of its threads' stacks."""
        crash_log = self._crash_logs[w]
        # its pipe closed as it died: the status follows at once
        code = self.zygote.wait(self.pids[w], EXIT_STATUS_WAIT_S) if w < len(self.pids) else None
        text = f"worker {w} exited unexpectedly: {describe_exit(code)}"
        tb = ""
        try:
            crash_log.seek(0)
            out = crash_log.read(CRASH_LOG_LIMIT + 1).decode("utf-8", "replace")
        except (OSError, ValueError):
            out = ""
        if out.strip():
            cut = "\n[... cut]" if len(out) > CRASH_LOG_LIMIT else ""
            tb = f"faulthandler output of worker {w}:\n{out[:CRASH_LOG_LIMIT]}{cut}"
        return text, tb

    def stop_workers(self, graceful: bool):
        """Every worker of the attempt has ended when this returns (killed
        after the grace period if need be)."""
        zygote = self.zygote
        if zygote is None:
            return
        for pid in self.pids:
            running = zygote.wait(pid, 0) is None
            if zygote.wait(pid, CANCEL_GRACE_S if running and graceful else 0.5) is None:
                zygote.kill(pid)
                zygote.wait(pid, 5)

    def forget_attempt(self):
        """After stop_workers(): forget the attempt's processes (a restart follows)."""
        self._close_crash_logs()
        self.pids = []

    def release(self, graceful: bool):
        """No worker is forked again: the workers end (as ``stop_workers``), then the zygote."""
        self.stop_workers(graceful)
        if self.zygote is not None:
            self.zygote.close()

    def _close_crash_logs(self):
        for f in self._crash_logs:
            f.close()
        self._crash_logs = []

    def close_workers(self):
        """After stop_workers(): every worker has exited, so its output is all in the pipe."""
        relays, self._outputs = self._outputs, []
        for relay in relays:
            relay.close(5.0)
        self._close_crash_logs()
        if self.zygote is not None:
            self.zygote.close()


ForkLauncher = WorkerLauncher       # its earlier name


def check_every_process(spec, vertices, edges, workers) -> None:
    """Every process checks its own pools too, but by then the others are
    running: refuse a deadlocking setting here, before any worker starts."""
    place = placement(workers)
    processes = [(lambda v, i, w=w: place(v, i) == w, (EXCLUSIVE_BUFFERS, FLOATING_BUFFERS))
                 for w in range(workers)]
    if any(v.is_iterator for v in vertices):
        processes.append((lambda v, i: place(v, i) == DRIVER, (EXCLUSIVE_BUFFERS, FLOATING_BUFFERS)))
    check_output_pools(spec, edges, processes)
    directory = spec.checkpoint_config.directory
    if spec.checkpoint_config.enabled and directory is not None and fsx.is_process_local(directory):
        # each worker would write its task states into its own memory, where
        # neither the driver's coordinator nor a restarted worker finds them
        raise errors.ConfigurationError(
            f"checkpoint_dir {os.fspath(directory)!r} is in one process's memory, and this job's tasks run in "
            f"{workers} other processes: use a directory every process reaches (a local path, file://, s3://, ...)")
    check_shared_locations(spec, workers)


class CollectedRecords:
    """The ``collect()`` records the driver holds, per node and subtask, from
    the workers' increments (``CollectShipper``): an increment replaces the
    records from its start on, so a restored attempt drops what the failed
    one collected after its checkpoint; a gap means records a checkpoint
    covers were lost, and fails the job."""

    def __init__(self):
        self.results: dict = {}      # node id -> {subtask: [records]}
        self.base: dict = {}         # (node id, subtask) -> index of the first record held

    def add(self, w, increments, restarts):
        for nid, subs in increments.items():
            parts = self.results.setdefault(nid, {})
            for sub, (start, records) in subs.items():
                have = parts.setdefault(sub, [])
                base = self.base.get((nid, sub), 0)
                at = start - base
                if not 0 <= at <= len(have):
                    if have or restarts:
                        raise errors.FlowBufError(
                            f"worker {w} sent collected records of subtask {sub} from #{start}, but the "
                            f"driver holds #{base} to #{base + len(have)}: records a checkpoint covers were lost")
                    # restore_from a checkpoint of an earlier run: the records it
                    # covers were that run's results (as for a job in one process)
                    self.base[(nid, sub)] = base = start
                    at = 0
                del have[at:]
                have.extend(records)

    def hand_over(self, nodes):
        """Into the collect sinks' results, where the caller reads them."""
        for node in nodes:
            if node.collect_parts is not None and node.id in self.results:
                node.collect_parts.clear()
                node.collect_parts.update(self.results[node.id])


def ClusterExecution(spec, launcher=None) -> JobExecution:
    """The earlier name of a job's execution on workers: now the one
    ``JobExecution``, placed by ``launcher`` (default: forked workers,
    ``WorkerLauncher``)."""
    return JobExecution(spec, launcher=launcher if launcher is not None else WorkerLauncher(spec))


Launcher = RemoteLauncher           # the earlier name of the worker launchers' base
