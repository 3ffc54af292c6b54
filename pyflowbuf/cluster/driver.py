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

Launchers: ``ClusterExecution`` is the driver's part (coordinator, fencing,
restarts, metrics, collect) and takes the workers from a launcher:
``WorkerLauncher`` (the above: forked processes, pipes) or
``pyflowbuf.spark.cluster.SparkLauncher`` (Spark barrier tasks on executors,
talking to the driver over ``pyflowbuf.cluster.control_channel``: authenticated TCP,
no pickle). Both derive from ``Launcher``, which declares the calls (``check``,
``open``, ``launch``, ``exit_report``, ``lost``, ``stop``, ``end_attempt``,
``finished``, ``close``); ``run_worker`` (``pyflowbuf.cluster.worker``) is the worker's
part under either. What the driver shares with a job run in one process (the
coordinator's start, the restore point, restored commits, the restart
decision, the loop of attempts, the coordinator's calls, the failure message)
is ``pyflowbuf.runtime.execution.Execution``; the driver adds the workers'
messages (``_await_attempt``), fencing and collect.
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
from pyflowbuf import checkpointing as ckpt
from pyflowbuf.connectors import filesystems as fsx
from pyflowbuf.cluster.locations import check_shared_locations
from pyflowbuf.checkpointing import restore as restore_mod
from pyflowbuf.connectors import outputs as sink_outputs
from pyflowbuf.runtime.deployment import check_output_pools
from pyflowbuf.runtime.job import CANCEL_GRACE_S, Execution, JobExecution
from pyflowbuf.runtime.metrics import MetricsRelay, close_listeners, make_listeners
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



# failures a restart would meet again, by the type name a worker reports
NOT_RESTARTED = ("KeyKindError:",)

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


class Launcher:
    """Where a job's workers run, for ``ClusterExecution`` (the driver's part:
    coordinator, fencing, restarts, metrics, collect). The execution calls, in
    order: ``check`` (refusals, before anything starts), ``open`` (first in
    ``start``, before the execution starts a thread), then per attempt
    ``launch`` (its workers as ``{channel: worker index}``), ``lost``,
    ``exit_report``, ``stop`` and ``end_attempt``; ``finished`` once no
    attempt follows (the job ended, failed or was cancelled, or its start
    failed), and ``close`` when the caller joins. ``WorkerLauncher`` forks
    processes (through a zygote); ``pyflowbuf.spark.cluster.SparkLauncher``
    runs Spark barrier tasks."""

    what = "workers"
    workers: int
    start_timeout: float = START_TIMEOUT_S

    def check(self, execution) -> None:
        """Refusals before anything starts."""

    def open(self, execution) -> None:
        """Before the execution starts any thread of its own."""

    def launch(self, execution, attempt) -> dict:
        raise NotImplementedError

    def exit_report(self, w):
        raise NotImplementedError

    def stop(self, graceful: bool) -> None:
        raise NotImplementedError

    def lost(self):
        """(text, traceback) once the attempt was lost in a way its channels do not show; else None."""
        return None

    def end_attempt(self) -> None:
        """After stop(): forget the attempt (a restart follows)."""

    def finished(self, graceful: bool) -> None:
        """No attempt follows: what was kept for restarts can go."""

    def close(self) -> None:
        """After stop(), when the caller joins."""


class WorkerLauncher(Launcher):
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

    def open(self, execution):
        """The zygote, forked now: the job graph is complete and nothing of
        this execution runs a thread yet."""
        if self.zygote is None:
            self.zygote = Zygote(_forked_worker(self.spec))

    def launch(self, execution, attempt) -> dict:
        """Have the zygote fork one attempt's workers; returns ``{channel: worker index}``."""
        conns = {}
        reads = []
        try:
            if self.zygote is None:
                raise errors.FlowBufError("WorkerLauncher.launch before open(): no zygote to fork the workers")
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
                               "secret": execution.secret, "outputs": outputs,
                               "tls": execution.tls.for_attempt(attempt)}
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
            self.stop(graceful=False)
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

    def stop(self, graceful: bool):
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

    def end_attempt(self):
        """After stop(): forget the attempt's processes (a restart follows)."""
        self._close_crash_logs()
        self.pids = []

    def finished(self, graceful: bool):
        """No worker is forked again: the workers end (as ``stop``), then the zygote."""
        self.stop(graceful)
        if self.zygote is not None:
            self.zygote.close()

    def _close_crash_logs(self):
        for f in self._crash_logs:
            f.close()
        self._crash_logs = []

    def close(self):
        """After stop(): every worker has exited, so its output is all in the pipe."""
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


class ClusterExecution(Execution):
    """Same surface as JobExecution (start/join/cancel/iterate/metrics/summary/done)."""

    traceback_where = " (in the worker process)"     # a failure's traceback is a worker's text

    def __init__(self, spec, launcher=None):
        # how the workers start: forked here (workers=N), or elsewhere (a
        # pyflowbuf.spark.SparkCluster's barrier tasks); the driver's part
        # (coordinator, fencing, restarts, metrics, collect) is the same
        self.launcher = launcher if launcher is not None else WorkerLauncher(spec)
        self.spec = spec
        self.workers = self.launcher.workers
        self.secret = new_secret()
        self.tls = AttemptTLS(spec.tls, spec.name)   # each attempt's TLSConfig, or None
        self.cancelled = False
        self.failure = None
        self._failure_secondary = True
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._conns: dict = {}
        self.addresses: dict = {}            # worker -> (host, port) of its exchange server
        # Fencing: every message between driver and workers and every
        # connection between workers carries its attempt; what belongs to an
        # earlier attempt is ignored (messages) or refused (connections).
        # The coordinator fences its own calls (triggers, completions) the
        # same way: see CheckpointCoordinator.attach.
        self.attempt = 0
        self._summaries: dict = {}
        self._collected = CollectedRecords()
        self._finished_workers: set = set()
        self._send_lock = threading.Lock()   # the coordinator's thread and the driver's both send
        self.local = None
        self.network_pool = None
        self.sampler = None              # a MetricsRelay once started
        self.started = self.ended = None
        self.startup_s = None
        vertices, edges = spec.plan()
        check_every_process(spec, vertices, edges, self.workers)
        self._worker_sinks = sorted({n.name for n in spec.nodes if n.user_sink})
        self.vertices = vertices
        # checkpoints: the coordinator lives here, for every worker's tasks
        self.checkpoint_config = ckpt.CheckpointSettings.from_env(spec)
        self.restart_failures: list = []   # (task, operator, error text) of each failure recovered
        self._task_keys = ckpt.graph_task_keys(vertices)
        # (the coordinator, the restore point, restarts: runtime/execution.py)
        self.launcher.check(self)

    # ---- lifecycle ----
    def start(self):
        # The listeners live here, not in the workers: one Prometheus port,
        # one log, one live view for the whole job; a busy port is refused
        # before any worker is forked.
        # First, before this execution starts a thread (the exporter's, the
        # coordinator's, the relays', the monitor's): the launcher's zygote
        self.launcher.open(self)
        try:
            self.sampler = MetricsRelay(self.spec.metrics_config.interval, make_listeners(self.spec))
        except BaseException:
            self.launcher.finished(graceful=False)
            raise
        self.started = time.monotonic()
        try:
            restore_id = self._start_checkpointing() if self.checkpoint_config is not None else None
            # before the workers start: each fork request carries what it decided
            self._prepare_outputs(restoring=restore_id is not None)
            self._start_workers(restore_id)
            # from execute() to every worker running (forked, or Spark tasks scheduled and reporting)
            self.startup_s = time.monotonic() - self.started
        except BaseException:
            close_listeners(self.sampler.listeners)
            if self.coordinator is not None:
                self.coordinator.stop()
            self._release_directory()
            self.launcher.finished(graceful=False)
            raise
        if self.coordinator is not None:
            self.coordinator.start()
        self._monitor = threading.Thread(target=self._watch, name="pyflowbuf: driver", daemon=True)
        self._monitor.start()
        return self

    def _start_workers(self, restore_id=None):
        addresses = {}
        attempt = self.attempt
        launcher = self.launcher
        try:
            self._conns = launcher.launch(self, attempt)
            deadline = time.monotonic() + launcher.start_timeout
            for c, w in self._conns.items():
                if not c.poll(max(0.0, deadline - time.monotonic())):
                    raise errors.FlowBufError(f"worker {w} did not start within {launcher.start_timeout} s")
                try:
                    _, msg = c.recv()
                except (EOFError, OSError):
                    raise self._died_starting(w) from None
                if msg[0] != "ready":
                    raise errors.JobFailedError(f"worker {w} failed to start: {msg[3]}\n{msg[4]}")
                addresses[w] = tuple(msg[1])
            self.addresses = addresses      # what each worker's exchange server announced
            if any(v.is_iterator for v in self.spec.plan()[0]):
                self.local = JobExecution(self.spec, placement(self.workers), DRIVER,
                                          RemoteContext(attempt_secret(self.secret, attempt), self.spec,
                                                        tls=self.tls.for_attempt(attempt)))
                self.local.remote.addresses = addresses
            self.ran = True
            with self._send_lock:
                for c, w in self._conns.items():
                    try:
                        c.send((attempt, ("go", addresses, restore_id, getattr(self, "check_key_kinds", True))))
                    except OSError:
                        raise self._died_starting(w) from None
            if self.coordinator is not None:
                self.coordinator.attach(self, self._task_keys)
        except BaseException:
            self.cancelled = True     # the workers are not part of a job: no grace period
            launcher.stop(graceful=False)
            for c in self._conns:
                c.close()
            launcher.close()
            if self.local is not None:
                self.local.remote.close()
            raise

    def _restart_failed(self, exc):
        # (a start that fails kills whatever workers it forked)
        self.failure = ("job", "recovery", f"{type(exc).__name__}: {exc}", traceback.format_exc())
        self._failure_secondary = False
        self.cancelled = True

    def _no_attempt_follows(self):
        try:
            # no restart follows: the workers end, and what forked them
            self.launcher.finished(graceful=not self.cancelled)
        except Exception:  # noqa: BLE001 - _close stops what is left
            log.exception("pyflowbuf: job %r: ending its workers failed", self.spec.name)
        self.ended = time.monotonic()
        self._release_directory()       # (done already, unless the end itself failed)
        self.sampler.close()            # the final merged sample, the last thing the job records

    def _await_attempt(self):
        """Relay one attempt's messages until every worker of it has ended."""
        conns = dict(self._conns)
        attempt = self.attempt
        relay = self.sampler
        while conns:
            ready = mp.connection.wait(list(conns), timeout=min(0.5, relay.seconds_to_next()))
            relay.tick()
            lost = self.launcher.lost()
            if lost is not None and not self.cancelled:
                # the workers' platform ended the attempt while channels stay open
                self._fail("driver", "worker launcher", *lost, secondary=False, attempt=attempt)
            for c in ready:
                w = conns[c]
                try:
                    sent_attempt, msg = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    if w not in self._finished_workers:
                        text, tb = self.launcher.exit_report(w)
                        self._fail(f"worker {w}", "worker process", text, tb, secondary=False, attempt=attempt)
                    continue
                try:
                    self._handle(w, msg, sent_attempt)
                except Exception as exc:  # noqa: BLE001 - a message the driver cannot act on fails the job
                    self._fail("driver", "checkpoint coordinator", f"{type(exc).__name__}: {exc}",
                               traceback.format_exc(), secondary=False, attempt=attempt)

    def _died_starting(self, w):
        text, tb = self.launcher.exit_report(w)
        return errors.FlowBufError(f"{text}, before the job started" + (f"\n{tb}" if tb else ""))

    def _handle(self, w, msg, attempt=None):
        if attempt is not None and attempt != self.attempt:
            # a worker of an attempt already given up (a late word of a
            # process killed for the restart): nothing of it counts now
            log.debug("pyflowbuf: ignored %r of worker %d of attempt %d (now %d)", msg[0], w, attempt,
                      self.attempt)
            return
        what = msg[0]
        relay = self.sampler
        if what == "metrics":
            relay.update(w, msg[1])
        elif what == "collected":
            self._collected.add(w, msg[1], self.restarts)
        elif what == "ack":
            _, key, n, handle, alignment_ms, commits, summary = msg
            self.coordinator.acknowledge(key, n, TaskStateHandle.from_dict(handle), alignment_ms, commits, summary)
        elif what == "decline":
            self.coordinator.decline(msg[1], msg[2], msg[3])
        elif what == "finished":
            _, key, state, commits, snapshotted, summary = msg
            self.coordinator.task_finished(key, state, commits, snapshotted, summary)
        elif what == "done":
            self._finished_workers.add(w)
            self._collected.add(w, msg[1], self.restarts)
            self._summaries[w] = msg[2]
            relay.update(w, msg[3])
        elif what == "failed":
            self._finished_workers.add(w)
            if len(msg) > 6:
                relay.update(w, msg[6])
            self._fail(*msg[1:5], secondary=msg[5])
        else:
            raise errors.ProtocolError(f"unknown message {what!r} from worker {w}")

    def _fail(self, task, op, text, tb, secondary, attempt=None):
        with self._lock:
            if attempt is not None and attempt != self.attempt:
                return  # the failure of an attempt already restarted
            if secondary and self.cancelled and self.failure is None:
                return  # a peer going away because the job was cancelled is no failure
            replace = self.failure is None or (self._failure_secondary and not secondary)
            if replace:
                self.failure = (task, op, text, tb)
                self._failure_secondary = secondary
        self.cancel(_user=False)

    def cancel(self, _user=True):
        if _user:
            # the caller's cancel (or join's timeout), even during a recovery:
            # no restart; failures cancel with _user=False
            self._user_cancelled = True
            if self._jobdir is not None:
                self._jobdir.ending()
        if self.cancelled:
            return
        self.cancelled = True
        self._send(("cancel",))
        if self.local is not None:
            self.local.cancel()

    def _send(self, msg):
        with self._send_lock:
            for c in list(self._conns):
                try:
                    c.send((self.attempt, msg))
                except (OSError, ValueError):
                    pass    # that worker has ended; its end is reported on its pipe

    # ---- checkpoints and recovery ----
    def _start_checkpointing(self):
        """The coordinator, before any worker is forked; returns the id of the
        checkpoint to restore (``restore_from``), or None."""
        config = self.checkpoint_config
        # refused here, before a worker exists, rather than as a worker's failure
        for v in self.vertices:
            if v.head.source is not None:
                ckpt.check_rewindable(config, v.head.name, v.head.source())
        # the directory is held here, by the driver, for every worker (checkpointing/jobdir.py)
        return self._restore_point(self._open_checkpointing(self.sampler.listeners))

    def _restore_point(self, meta):
        if meta is None:
            restore_mod.started_fresh(self)
            self.restored_from = None
            return None
        storage = ckpt.storage_of(self.coordinator.storage, meta)
        # told to the workers, which restore it (a restart's own checkpoint is not checked)
        self.check_key_kinds = restore_mod.checks_key_kinds(self, meta)
        if restore_mod.is_current(meta):
            # by operator id; each worker reads its own subtasks' state
            self._restore_plan(storage, meta)
        else:
            ckpt.check_graph(meta, self._task_keys, storage.url)
            # the sources' identities, here before any worker starts
            sources = {ckpt.task_key(v, i): (v.head.name, v.head.source())
                       for v in self.vertices if v.head.source is not None for i in range(v.parallelism)}
            ckpt.check_sources(meta, ckpt.read_states(storage, meta, set(sources)), sources)
        self._commit_restored(meta)
        self.restored_from = meta.checkpoint_id
        return ckpt.restore_location(self.coordinator.storage, meta)

    def _release_directory(self):
        if self._jobdir is not None:
            self._jobdir.release()

    def _restartable(self, failure) -> bool:
        # not a job with an iterator (records handed out would be handed out
        # again), nor a failure a restart would meet again (a worker's text names its type)
        return self.local is None and not str(failure[2]).startswith(NOT_RESTARTED)

    def _restart(self) -> bool:
        """After a failure every worker of the attempt has ended (or is killed
        now): fork a new set restoring the latest complete checkpoint. A worker
        took its segments with it; the new ones start with a fresh pool.
        False when the job was cancelled meanwhile (nothing restarted)."""
        task, op, text, _ = self.failure
        log.info("pyflowbuf: job %r: %s in task %s failed (%s); restarting (%d of %d)", self.spec.name, op,
                 task, text, self.restarts + 1, self.checkpoint_config.restart_attempts)
        self._begin_restart(self._task_keys)       # nothing to trigger until the new workers run
        self._kill()
        with self._send_lock:
            for c in self._conns:
                c.close()
            self._conns = {}
        self.launcher.end_attempt()
        self._finished_workers = set()
        meta = self._restart_point()
        restore_id = self._restore_point(meta)
        with self._lock:
            if self._user_cancelled:
                return False        # cancelled while recovering: the job ends with its failure
            self.attempt += 1       # from here on, what the stopped attempt says is ignored
            # a new secret too: a worker of the stopped attempt (a task Spark
            # has not ended yet) cannot derive the new attempt's
            self.secret = new_secret()
            self.failure = None
            self._failure_secondary = True
            self.cancelled = False
        self._start_workers(restore_id)
        return True

    def _kill(self):
        self.launcher.stop(graceful=not self.cancelled)

    def _close(self):
        self._kill()
        for c in self._conns:
            c.close()
        self.launcher.close()       # every worker has ended: its output is all in
        monitor = getattr(self, "_monitor", None)
        if monitor is not None and self._done.is_set() and monitor is not threading.current_thread():
            monitor.join(CANCEL_GRACE_S)    # it has set _done: only its last lines are left
        self._collected.hand_over(self.spec.nodes)
        if self.local is not None:
            self.local.remote.close()

    def _finished_ok(self):
        if self._worker_sinks:
            names = ", ".join(repr(n) for n in self._worker_sinks)
            warnings.warn(
                f"job {self.spec.name!r}: sink(fn) {names} ran in worker processes (workers="
                f"{self.workers}), on the workers' copies of the caller's objects: what the function did "
                "to them (appending to a list, counting) is not seen in this process. Bring records "
                "back with collect() or to_iterator(), or write them where both can reach.",
                errors.WorkerSideEffectWarning, stacklevel=_caller_stacklevel())

    def iterate(self, sink_node):
        self.start()
        ended = False
        try:
            yield from self.local.iterate(sink_node)
            ended = True
        except errors.CancelledError:
            if self.failure is None:
                raise
            ended = True        # a worker failed: join() below raises its error
        finally:
            if not ended:
                # the caller closed the generator (a break) or an error left
                # it: cancel, then reap every worker and close the local
                # exchange, as join() would; nothing outlives the generator
                self._stop_now()
        self.join()

    # ---- inspection ----
    @property
    def tasks(self):
        return []

    def summary(self) -> dict:
        out = {}
        for snap in list(self._summaries.values()):
            out.update(snap)
        return out
