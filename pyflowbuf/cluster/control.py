"""The control endpoint of a running job: how ``pyflowbuf savepoint`` and
``pyflowbuf stop`` reach a job from another process (Flink's ``flink
savepoint`` / ``flink stop`` against a job's REST port).

A job opens it only when asked (``Environment(control_port=0)``, 0 for a free
port; ``pyflowbuf run --control-port``), on ``bind_host`` (loopback by
default), and while it runs it writes a control file next to its checkpoints,
``<checkpoint_dir>/_control.json``, mode 0600: the address, the port, the
process and a fresh random secret. A client proves that it knows the secret
with the exchange's HMAC-SHA256 challenge (``pyflowbuf.net.protocol``, both
ends prove it) and then sends one request, a small JSON object in a frame of
``4-byte big-endian length + UTF-8 JSON``; the job answers with one, and
closes. Nothing read off the socket is unpickled.

With TLS (the job's ``Environment(tls=...)`` is set) the endpoint speaks
mutual TLS 1.3 first and the HMAC challenge runs inside it. ``tls=True``: the
endpoint makes a CA of its own (apart from the attempts' certificates, so a
control client's certificate opens no data connection and a worker's none
here) and two certificates, each pinned by the other side: the endpoint's,
and a client's that the control file carries (``"tls": {"mode":
"generated", "cert", "key", "ca", "fingerprint"}``, PEM text, in the same
mode-0600 file as the secret, gone with it). ``tls=TLSConfig(...)``: the
endpoint presents and trusts the user's files, and the file says only
``"tls": {"mode": "own"}``: a client brings a certificate of that CA
(``pyflowbuf savepoint --tls-cert/--tls-key/--tls-ca``). Without TLS the
file has ``"tls": null``.

Requests: ``{"op": "savepoint", "path": PATH or null, "timeout": s or null}``
(``job.savepoint(path)``) and ``{"op": "stop", "path": ..., "timeout": ...,
"drain": true or false}`` (``job.stop(savepoint=path, drain=...)``; no
``drain``: false). Answers: ``{"ok": true, "op": ..., "path":
the savepoint's directory, "checkpoint_id": n, "job": name}`` or ``{"ok":
false, "error": "CheckpointStateError", "message": "..."}``.

The file goes when the job ends (``join()``, ``stop()``, or within 0.1 s of
the end of a job nobody joins; at the latest when the process exits). A job
killed outright leaves it behind: the client sees from its process id (same
host) or from a refused connection that no job is behind it, and says so.

Example::

    environment = fb.Environment(checkpoint_interval=1.0, checkpoint_dir="ck", control_port=0)
    ...
    job = environment.execute_async()
    info = read_control_file("ck")
    answer = request(control_address(info), control_secret(info), {"op": "savepoint", "path": "/backups/sp1"},
                     tls=client_tls(info))      # None unless the job runs with tls=; see below
    answer["path"]           # '/backups/sp1'
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import socket
import struct
import threading
import time
import uuid
import weakref

from pyflowbuf import errors
from pyflowbuf.net import protocol as P
from pyflowbuf.net import tls as T
from pyflowbuf.checkpoint.lock import process_alive
from pyflowbuf.cluster.control_channel import _NO_BUFFERS, _check_nothing_staged
from pyflowbuf.checkpointing.coordinator import DEFAULT_CHECKPOINT_DIR

CONTROL_FILE = "_control.json"
FORMAT = 1
OPS = ("savepoint", "stop")
_LEN = struct.Struct(">I")
# a request or an answer is a few hundred bytes: a peer cannot make either end allocate more
MAX_MESSAGE = 64 * 1024
# connections served at once (each is a thread); more are closed at once
MAX_CONNECTIONS = 8
# the time a client has for the TLS and HMAC handshakes together (a module
# setting, so that tests can shorten it)
HANDSHAKE_TIMEOUT = P.DEFAULT_HANDSHAKE_TIMEOUT
# after the handshake, the time a client has to send its request
REQUEST_TIMEOUT = 10.0
CONNECT_TIMEOUT = 10.0
# how long the job's end waits for answers under way (the answer to `stop` is
# sent once the job has ended: a process exiting then would swallow it)
ANSWER_GRACE_S = 10.0
# how soon the endpoint of a job nobody joins sees that the job ended
_POLL_S = 0.1

_OPEN: "weakref.WeakSet[ControlEndpoint]" = weakref.WeakSet()   # endpoints of this process
_OPEN_LOCK = threading.Lock()


def _open_endpoints() -> list:
    with _OPEN_LOCK:
        return list(_OPEN)


class ControlError(errors.FlowBufError):
    """A control request failed: no job behind a control file, a refused
    secret, or the job's own answer (``error``: the job's exception type)."""

    def __init__(self, message, error=None):
        super().__init__(message)
        self.error = error


# ---------------------------------------------------------------- settings

def check_settings(port, checkpoint_config) -> None:
    """``control_port``: None (no endpoint) or a port in 0..65535, on a job
    with checkpoints (what it controls are savepoints) in a local
    ``checkpoint_dir`` (the control file holds a secret: it is written with
    mode 0600, which only a local file system keeps)."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise errors.ConfigurationError(
            f"control_port must be None (no control endpoint) or an int in 0..65535 (0: a free port), got {port!r}")
    if not checkpoint_config.enabled:
        raise errors.ConfigurationError(
            "control_port opens the endpoint `pyflowbuf savepoint` and `pyflowbuf stop` reach, and savepoints need "
            "checkpointing: set checkpoint_interval (and checkpoint_dir)")
    control_file_path(checkpoint_config.directory)


def control_file_path(checkpoint_dir) -> str:
    """The control file of a job with this ``checkpoint_dir`` (None: the default)."""
    directory = os.fspath(checkpoint_dir or DEFAULT_CHECKPOINT_DIR)
    if directory.startswith("file://"):
        directory = directory[len("file://"):]
    elif "://" in directory or "::" in directory:
        raise errors.ConfigurationError(
            f"control_port writes a control file holding a secret next to the checkpoints, readable by its user "
            f"only, which needs a local checkpoint_dir; {directory!r} is not one: run the job with a local "
            "checkpoint_dir, or without control_port")
    return os.path.join(os.path.abspath(directory), CONTROL_FILE)


# ---------------------------------------------------------------- the control file



def read_control_file(path) -> dict:
    """The control file at ``path``: the file itself, or the checkpoint_dir
    holding it. Raises ControlError when there is none or it is not one."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, CONTROL_FILE)
    elif not os.path.exists(path):
        raise ControlError(f"{path}: no such checkpoint directory or control file")
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        raise ControlError(
            f"no running job controls {os.path.dirname(path)}: it has no {CONTROL_FILE} (a job opens its control "
            "endpoint only when asked: Environment(control_port=0) or `pyflowbuf run --control-port 0`)") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ControlError(f"{path} is not a pyflowbuf control file: {e}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT or not all(
            k in info for k in ("address", "port", "secret", "pid", "host")):
        raise ControlError(f"{path} is not a pyflowbuf control file of format {FORMAT}")
    info["file"] = path
    return info


def check_alive(info) -> None:
    """A control file written on this host by a process that is gone is
    stale: ControlError saying so (a file of another host is tried)."""
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int) and not process_alive(info["pid"]):
        raise ControlError(
            f"{info['file']} is stale: the process that wrote it (pid {info['pid']}, job {info.get('job')!r}, "
            f"started {_when(info.get('started'))}) is gone, and no job is running there; remove the file")


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def control_address(info) -> tuple:
    """Where a client connects: the file's address, loopback for a wildcard."""
    host = info["address"]
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return host, int(info["port"])


def control_secret(info) -> bytes:
    return parse_secret(info["secret"], info.get("file", "the control file"))


class TLSCertificateNeeded(ControlError):
    """The endpoint of a control file speaks mutual TLS with the job's own
    certificates (``tls=TLSConfig(...)``): the client must bring one."""


# what a client of a TLS endpoint passes, said where it cannot know (a bare secret)
TLS_HINT = ("if the job runs with tls=, its endpoint speaks mutual TLS: give the control file (CHECKPOINT_DIR, or "
            "a copy of it as --secret-file) for tls=True, or --tls-cert FILE --tls-key FILE --tls-ca FILE for a "
            "job with its own TLSConfig")


def client_tls(info):
    """The TLSConfig a client presents to the endpoint of the control file
    ``info``: None for a plaintext endpoint; for ``tls=True`` the client
    certificate the file carries (held in memory, never written elsewhere).
    Raises TLSCertificateNeeded for a job with its own TLSConfig, and
    ControlError for a ``tls`` entry that is not one."""
    entry = info.get("tls")
    where = info.get("file", "the control file")
    if entry is None:
        return None
    mode = entry.get("mode") if isinstance(entry, dict) else None
    if mode == "own":
        raise TLSCertificateNeeded(
            f"job {info.get('job')!r} runs with tls=TLSConfig(...) (its own certificates), so its control endpoint "
            "speaks mutual TLS and takes a client certificate of the same CA: pass --tls-cert FILE --tls-ca FILE "
            "(and --tls-key FILE unless the key is in the cert file; --tls-fingerprint HEX to pin the job's "
            "certificate)", "TLSCertificateNeeded")
    if mode == "generated" and all(isinstance(entry.get(k), str) for k in ("cert", "key", "ca")) \
            and isinstance(entry.get("fingerprint"), list):
        try:
            return T.TLSConfig(entry["cert"].encode("ascii"), entry["key"].encode("ascii"),
                               entry["ca"].encode("ascii"), fingerprint=entry["fingerprint"])
        except (TypeError, ValueError, UnicodeEncodeError) as e:
            raise ControlError(f"{where}: its client certificate is not valid: {e}") from None
    raise ControlError(f"{where}: its \"tls\" entry is not one pyflowbuf writes (mode {mode!r})")


def parse_secret(text, where) -> bytes:
    try:
        secret = bytes.fromhex(text.strip())
    except (AttributeError, ValueError):
        raise ControlError(f"{where}: the secret is not hexadecimal") from None
    if len(secret) < 16:
        raise ControlError(f"{where}: the secret is {len(secret)} bytes; a control secret has at least 16")
    return secret


def _write_private(path: str, info: dict) -> None:
    """Write ``info`` to ``path`` readable by this user only, atomically: a
    reader sees the old file or the whole new one, never a part."""
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)         # whatever the umask
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ---------------------------------------------------------------- frames

def _recv_exactly(sock, n: int, deadline) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            sock.settimeout(left)
        k = sock.recv_into(view[got:])
        if k == 0:
            raise errors.ProtocolError(f"the peer closed the control connection after {got} of {n} bytes")
        got += k
    return bytes(buf)


def send_message(sock, obj: dict) -> None:
    data = json.dumps(obj).encode("utf-8")
    if len(data) > MAX_MESSAGE:
        raise errors.ProtocolError(f"a control message of {len(data)} bytes is over the limit of {MAX_MESSAGE}")
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_message(sock, deadline=None) -> dict:
    """One JSON object; ProtocolError for anything else (or an oversized frame)."""
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size, deadline))
    if n > MAX_MESSAGE:
        raise errors.ProtocolError(f"a control frame announced {n} bytes, over the limit of {MAX_MESSAGE}")
    body = _recv_exactly(sock, n, deadline)
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise errors.ProtocolError(f"a control message that is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise errors.ProtocolError(f"a control message must be a JSON object, got {type(obj).__name__}")
    return obj


# ---------------------------------------------------------------- the job's end

class ControlEndpoint:
    """A job's control endpoint. ``open(spec)`` (the job's ``JobSpec``) binds the port and writes the
    control file (before the job starts, so a busy port or a directory that
    cannot be written is refused before anything runs); ``serve(job)``
    answers requests once the job runs; ``close()`` (idempotent) removes the
    file and the port.

    Each connection is served by a thread of its own (at most
    ``MAX_CONNECTIONS`` at once): a savepoint may take as long as the job's
    ``checkpoint_timeout``, and a stranger that never finishes the handshake
    is dropped after ``handshake_timeout``."""

    def __init__(self, spec, *, handshake_timeout: float | None = None):
        check_settings(spec.control_port, spec.checkpoint_config)
        self.path = control_file_path(spec.checkpoint_config.directory)
        self.host = spec.network_config.bind_host
        self.handshake_timeout = HANDSHAKE_TIMEOUT if handshake_timeout is None else handshake_timeout
        # this endpoint's TLSConfig (None: plaintext), and what the control file
        # hands a client of tls=True; a bad certificate file is refused before the job runs
        self.tls, self._client_tls = _endpoint_tls(spec.tls, spec.name)
        if self.tls is not None:
            self.tls.context(True)
        self.secret = P.new_secret()
        self.token = uuid.uuid4().hex
        self.pid = os.getpid()
        self.job = None
        self.refused = 0
        self.errors: list = []          # (peer, exception) of the latest failed connections
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._shut_lock = threading.Lock()
        self._closed = threading.Event()
        self._active = 0
        self._answering: set = set()        # threads with a request read and its answer not yet sent
        self._thread = None
        self._check_no_other_job()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((self.host, spec.control_port))
            sock.listen(16)
        except OSError as exc:
            sock.close()
            raise errors.PortUnavailableError(
                exc.errno, f"control_port={spec.control_port}: cannot listen on {self.host}:{spec.control_port}: "
                f"{exc.strerror or exc}; choose another port, or 0 for a free one") from exc
        self._sock = sock
        self.address = sock.getsockname()[:2]
        try:
            self._write_file(spec.name)
        except OSError as exc:
            sock.close()
            raise errors.ConfigurationError(
                f"control_port: cannot write the control file {self.path}: {exc.strerror or exc}") from exc
        with _OPEN_LOCK:
            _OPEN.add(self)

    @classmethod
    def open(cls, spec) -> "ControlEndpoint | None":
        """The endpoint ``spec.control_port`` asks for, bound; None without one."""
        return None if spec.control_port is None else cls(spec)

    @property
    def port(self) -> int:
        return self.address[1]

    def _check_no_other_job(self) -> None:
        try:
            info = read_control_file(self.path)
        except ControlError:
            return      # none, or not one: this job's replaces it
        except OSError as exc:
            raise errors.ConfigurationError(
                f"control_port: cannot read the control file {self.path}: {exc.strerror or exc}") from exc
        here = info.get("host") == socket.gethostname()
        if here and info["pid"] == self.pid:        # a job of this process: still running?
            running = any(e.token == info.get("token") and not e.closed and (e.job is None or not e.job.done)
                          for e in _open_endpoints())
        else:                                       # (a file of another host is replaced)
            running = here and isinstance(info["pid"], int) and process_alive(info["pid"])
        if running:
            raise errors.ConfigurationError(
                f"{self.path}: job {info.get('job')!r} (pid {info['pid']}) is running with this checkpoint_dir and "
                "its control endpoint; two jobs must not share a checkpoint_dir (if that process is no pyflowbuf "
                "job, remove the file)")

    def _write_file(self, job_name) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        _write_private(self.path, {
            "format": FORMAT, "job": job_name, "pid": self.pid, "host": socket.gethostname(),
            "address": self.address[0], "port": self.port, "secret": self.secret.hex(), "token": self.token,
            "started": time.time(), "checkpoint_dir": os.path.dirname(self.path), "tls": self._tls_entry()})

    def _tls_entry(self):
        if self.tls is None:
            return None
        if self._client_tls is None:
            return {"mode": "own"}
        c = self._client_tls
        return {"mode": "generated", "cert": c.cert.decode("ascii"), "key": c.key.decode("ascii"),
                "ca": c.ca.decode("ascii"), "fingerprint": sorted(c.fingerprints)}

    def serve(self, job) -> None:
        """Answer requests about ``job`` until ``close()`` or the job's end."""
        self.job = job
        self._thread = threading.Thread(target=self._accept_loop, name="pyflowbuf: control endpoint", daemon=True)
        self._thread.start()

    def close(self, wait: float = ANSWER_GRACE_S) -> None:
        """Remove the file, stop listening, and wait (at most ``wait`` s) for
        the answers under way to go out, except the caller's own."""
        with self._shut_lock:       # a second caller returns once the file is gone, not before
            if not self._closed.is_set():
                self._closed.set()
                self._shut()
        me = threading.current_thread()
        deadline = time.monotonic() + wait
        with self._idle:
            while self._answering - {me}:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)

    def _shut(self) -> None:
        if os.getpid() == self.pid:
            self._remove_file()
        try:
            # refuse new connections now: a close alone waits for the accept
            # thread's select() to let go, and one that lands meanwhile is reset
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with _OPEN_LOCK:
            _OPEN.discard(self)

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _remove_file(self) -> None:
        try:
            with open(self.path, encoding="utf-8") as f:
                if json.load(f).get("token") != self.token:
                    return      # another job's file now
            os.unlink(self.path)
        except (OSError, ValueError):
            pass

    def _accept_loop(self) -> None:
        sock = self._sock
        while not self._closed.is_set():
            if self.job.done:
                self.close()
                return
            try:
                ready, _, _ = select.select([sock], [], [], _POLL_S)
                if not ready:
                    continue
                conn, peer = sock.accept()
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                continue
            with self._lock:
                busy = self._active >= MAX_CONNECTIONS
                if not busy:
                    self._active += 1
            if busy:
                self._refuse(peer, errors.ProtocolError(f"more than {MAX_CONNECTIONS} control connections at once"))
                conn.close()
                continue
            threading.Thread(target=self._serve_one, args=(conn, peer), name="pyflowbuf: control request",
                             daemon=True).start()

    def _refuse(self, peer, exc) -> None:
        with self._lock:
            self.refused += 1
            self.errors = (self.errors + [(peer, exc)])[-16:]

    def _serve_one(self, conn, peer) -> None:
        sock = conn
        try:
            P.configure_socket(conn)
            deadline = time.monotonic() + self.handshake_timeout
            if self.tls is not None:        # TLS first, the secret's challenge inside it
                sock = T.handshake_socket(conn, self.tls, server_side=True, peer=peer, deadline=deadline)
            reader = P.FrameReader(sock, _NO_BUFFERS)
            P.server_handshake(sock, reader, self.secret, _NO_BUFFERS, deadline=deadline)
            _check_nothing_staged(reader)
            req = recv_message(sock, time.monotonic() + REQUEST_TIMEOUT)
            sock.settimeout(None)
            with self._lock:
                self._answering.add(threading.current_thread())
            answer = self._answer(req)
            send_message(sock, answer)
        except (errors.ProtocolError, OSError) as exc:      # TLSError, AuthenticationError, socket.timeout too
            self._refuse(peer, exc)
        finally:
            sock.close()
            conn.close()
            with self._idle:
                self._active -= 1
                self._answering.discard(threading.current_thread())
                self._idle.notify_all()

    def _answer(self, req: dict) -> dict:
        op = req.get("op")
        path, timeout, drain = req.get("path"), req.get("timeout"), req.get("drain", False)
        bad = None
        if op not in OPS:
            bad = f"unknown op {op!r} (one of {', '.join(OPS)})"
        elif not isinstance(drain, bool) or (drain and op != "stop"):
            bad = f"drain must be true or false, and true only with op 'stop', got {drain!r}"
        elif path is not None and (not isinstance(path, str) or not path):
            bad = f"path must be a non-empty string or null, got {path!r}"
        elif timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                      or not 0 < timeout < float("inf")):
            bad = f"timeout must be seconds > 0 or null, got {timeout!r}"
        if bad is not None:
            return {"ok": False, "error": "ProtocolError", "message": f"a malformed control request: {bad}"}
        job = self.job
        try:
            if op == "savepoint":
                done = job.savepoint(path, timeout=timeout)
                cid = _savepoint_id(job, done)
            else:
                done = job.stop(savepoint=path, drain=drain, timeout=timeout)
                cid = job.stopped_with_savepoint
                self.close()        # the job has ended: its file goes before the client hears so
        except Exception as exc:  # noqa: BLE001 - every failure is the client's answer; the job runs on
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)}
        done = local_path(done)         # absolute: the client's working directory is not the job's
        return {"ok": True, "op": op, "path": done, "checkpoint_id": cid, "job": job.spec.name}


def _endpoint_tls(setting, name):
    """(the endpoint's TLSConfig, the client's for the control file) for the
    job's ``tls=`` setting: (None, None) without TLS; the user's config and
    None for a TLSConfig; for True, two certificates of a CA of the
    endpoint's own, each side pinning the other's."""
    setting = T.resolve(setting)
    if setting is None:
        return None, None
    if setting is not True:
        T.check_dates(setting)      # an expired file is refused before the job runs, as an unreadable one
        return setting, None
    T.require_ssl()
    certs = T.JobCertificates(f"{name} control")
    server, client = certs.issue("control endpoint"), certs.issue("control client")
    return (T.TLSConfig(server.cert, server.key, server.ca, fingerprint=sorted(client.fingerprints)),
            T.TLSConfig(client.cert, client.key, client.ca, fingerprint=sorted(server.fingerprints)))


def _savepoint_id(job, path):
    want = local_path(path)
    for entry in reversed(job.checkpoints()):
        if entry.get("savepoint") and local_path(entry.get("path") or "") == want:
            return entry.get("id")
    return None


def local_path(path: str) -> str:
    """A path as the history and the caller may spell it: a file:// URL, relative, absolute."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    return (path if "://" in path else os.path.abspath(path)).rstrip("/")


@contextlib.contextmanager
def endpoint_for(spec, job):
    """Around ``job.start()``: the endpoint ``spec.control_port`` asks for
    (nothing without one) is bound and its file written before the job
    starts, served once it runs (``job.control``), and closed if it does not
    start. The job closes it when it ends (``Execution.join``/``stop``)."""
    endpoint = ControlEndpoint.open(spec)
    if endpoint is None:
        yield
        return
    try:
        yield
    except BaseException:
        endpoint.close()
        raise
    job.control = endpoint
    endpoint.serve(job)


@atexit.register
def _close_all() -> None:
    """A job still running when its process exits leaves no control file."""
    for endpoint in _open_endpoints():
        endpoint.close()


def _forget_in_child() -> None:
    # A forked worker inherits the listening socket; it must not hold the port
    # (nor answer on it, nor remove the driver's file at its exit).
    # (the lock may be held by a thread that does not exist here: a new one)
    global _OPEN_LOCK
    _OPEN_LOCK = threading.Lock()
    for endpoint in list(_OPEN):
        endpoint.pid = -1
        try:
            endpoint._sock.close()
        except OSError:
            pass
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)


# ---------------------------------------------------------------- the client's end

def request(address, secret: bytes, message: dict, *, timeout: float | None = None,
            connect_timeout: float = CONNECT_TIMEOUT, tls=None) -> dict:
    """Send one request to the endpoint at ``address`` and return the job's
    answer (a dict with ``ok``). ``timeout``: seconds to wait for the answer
    after the request went out (None: as long as the job takes; it bounds a
    savepoint by its checkpoint_timeout, and a vanished host is seen within
    about 30 s). ``tls``: the TLSConfig to present to a TLS endpoint
    (``client_tls(info)`` for a control file), None for a plaintext one.
    Raises ControlError when nobody listens there, the TLS or HMAC handshake
    fails (a wrong certificate or secret, TLS on one side only) or the
    connection breaks."""
    host, port = address
    where = f"{host}:{port}"
    hint = "" if tls is not None else f"; {TLS_HINT}"
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except ConnectionRefusedError:
        raise ControlError(f"no job is listening at {where}: the job has ended (or its control file is stale)") \
            from None
    except socket.timeout:
        raise ControlError(f"no answer from {where} within {connect_timeout} s") from None
    except OSError as e:
        raise ControlError(f"cannot connect to {where}: {e.strerror or e}") from None
    raw = sock
    try:
        P.configure_socket(sock)
        deadline = time.monotonic() + connect_timeout
        if tls is not None:
            try:
                sock = T.handshake_socket(raw, tls, server_side=False, peer=(host, port), deadline=deadline)
            except errors.TLSError as e:
                raise ControlError(f"TLS with the control endpoint at {where} failed: {e.reason}", "TLSError") \
                    from None
        reader = P.FrameReader(sock, _NO_BUFFERS)
        try:
            P.client_handshake(sock, reader, secret, 0, deadline=deadline)
        except errors.AuthenticationError:
            raise ControlError(f"the job at {where} refused the secret (a secret of another job, or of an earlier "
                               "run of it?)", "AuthenticationError") from None
        except socket.timeout:
            raise ControlError(f"{where} did not complete the control handshake within {connect_timeout} s "
                               f"(is it a pyflowbuf control endpoint?){hint}") from None
        except errors.ConnectionLostError as e:
            if tls is not None and T.ssl is not None and isinstance(e.__cause__, T.ssl.SSLError):
                # TLS 1.3: the server checks the client's certificate after the client's handshake ended
                raise ControlError(
                    f"TLS with the control endpoint at {where} failed: it refused this client's certificate "
                    f"({getattr(e.__cause__, 'reason', None) or e.__cause__}): present one signed by the CA the "
                    "job trusts (and matching its fingerprint= pin, if it has one)", "TLSError") from None
            if tls is not None:
                raise ControlError(
                    f"the job at {where} closed the TLS connection before the control handshake ended: it has "
                    "ended, or it refused this client's certificate (not the one it pins)", "TLSError") from None
            raise ControlError(f"the job at {where} closed the connection before the handshake ended (it has "
                               f"ended, or is ending){hint}") from None
        except errors.ProtocolError as e:
            raise ControlError(f"{where} is not a pyflowbuf control endpoint: {e}") from None
        _check_nothing_staged(reader)
        send_message(sock, message)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            answer = recv_message(sock, deadline)
        except socket.timeout:
            raise ControlError(f"no answer from the job at {where} within {timeout} s") from None
        except errors.ProtocolError as e:
            raise ControlError(f"the connection to the job at {where} broke before it answered: {e}") from None
        except OSError as e:
            raise ControlError(f"the connection to the job at {where} broke before it answered: "
                               f"{e.strerror or e}") from None
        if "ok" not in answer:
            raise ControlError(f"{where} answered without a status: {answer!r}")
        return answer
    finally:
        sock.close()
        raw.close()
