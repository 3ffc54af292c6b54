"""The web view's HTTP server: the page (package data in ``static/``) and its
JSON, read-only, on a thread of the process that coordinates the job.

Standard library only (``http.server``). It binds 127.0.0.1 unless a host is
named; then every request needs the access token the URL carries (compared in
constant time). Anything but a GET or HEAD of a known path is refused with a
4xx; nothing a request does reaches the job, which only its public snapshots
are read from.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
import urllib.parse
import weakref
from importlib import resources

from pyflowbuf import errors
from pyflowbuf.net import tls as _tls
from pyflowbuf.ui import model

log = logging.getLogger("pyflowbuf.ui")

LOOPBACK = "127.0.0.1"
# the page's files: name -> content type
STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "app.css": "text/css; charset=utf-8"}
# How long one built answer of what is not a metrics sample (checkpoints,
# watermark lags) is reused: several pages polling together cost one build.
# What is built from a metrics sample is reused until the runtime takes the next.
CACHE_S = 0.25
# A browser keeps its connection between polls (HTTP/1.1 keep-alive): one
# connection and one handler thread per page, not one per request. An idle
# one is closed after this; its thread waits in recv, off the GIL.
KEEPALIVE_S = 15.0
# how long a client has to finish the TLS handshake (HTTPS)
HANDSHAKE_S = 10.0
# what the page asks for each second, per view: the one request of a poll
LIVE_VIEWS = ("graph", "subtasks", "top", "checkpoints", "watermarks")
_HEADERS = (
    ("Cache-Control", "no-store"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),          # the token is in the URL
    ("X-Frame-Options", "DENY"),
    ("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"),
)
_OPEN: "weakref.WeakSet[UiServer]" = weakref.WeakSet()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Refused(Exception):
    """A connection ended before any request: the view closed, or not TLS on the HTTPS port."""


class _BadRequest(Exception):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status
        self.text = text


class UiServer:
    """Serves the web view of ``job`` until ``close()`` (or until the job
    handle is garbage: the view lives as long as the handle, showing the final
    state once the job ended).

    ``host``: 127.0.0.1 by default. Another address (``"0.0.0.0"``, a LAN
    address) exposes the page to the network, so it takes an access token:
    :attr:`url` carries it, and a request without it gets 403.

    ``https``: None (the default) serves HTTPS beyond loopback when the job
    has TLS on (``Environment(tls=...)``), with the certificate of its
    ``TLSConfig`` or, for ``tls=True``, one of the job's own CA
    (:attr:`ca_pem` is the CA a client verifies it with, :attr:`fingerprint`
    the certificate's SHA-256, also logged with the URL); HTTP on loopback.
    True asks for HTTPS on loopback too (the job must have TLS on); False
    serves HTTP.
    """

    def __init__(self, job, port: int = 0, host: str = LOOPBACK, *, plan=None, https=None):
        if port is None or isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise errors.ConfigurationError(f"ui_port must be an int in 0..65535 (0: a free port), got {port!r}")
        if not isinstance(host, str) or not host:
            raise errors.ConfigurationError(f"ui_host must be a host name or address, got {host!r}")
        self.view = model.JobView(job, plan)
        self.host = host
        self.token = None if is_loopback(host) else secrets.token_urlsafe(24)
        self._cache: dict = {}             # time-bound answers: key -> (monotonic, body)
        self._by_sample: dict = {}         # key -> (the metrics sample it was built from, body)
        self._cache_lock = threading.Lock()
        self._vertices = _dumps([{"id": v.id, "name": v.name, "parallelism": v.parallelism}
                                 for v in self.view.vertices])
        if https not in (None, True, False):
            raise errors.ConfigurationError(f"https must be None (HTTPS beyond loopback when the job has TLS on), "
                                            f"True or False, got {https!r}")
        self._https = https
        self.ssl_context = None            # the HTTPS server's context, when it serves HTTPS
        self.ca_pem = None                 # the CA a client verifies this view's certificate with
        self.fingerprint = None            # SHA-256 of this view's certificate
        self._conns: set = set()           # open connections, cut at close()
        self._conns_lock = threading.Lock()
        self._static = {name: resources.files("pyflowbuf.ui").joinpath("static", name).read_bytes()
                        for name in STATIC}
        self._httpd = _make_server(self, host, port)
        self.port = self._httpd.server_address[1]
        self._thread = None
        self._closed = False
        self._pid = os.getpid()
        self._finalizer = None
        _OPEN.add(self)
        self._job_ref = weakref.ref(job)
        self.view.job = weakref.proxy(job)
        try:
            self._choose_tls()             # a TLS setting that cannot load fails before the job runs
        except BaseException:
            self._httpd.server_close()
            raise

    def _choose_tls(self) -> None:
        """HTTPS when the view is reached beyond loopback (or asked for) and
        the job has TLS on. Called again at start(): a SparkCluster may turn
        TLS on for the job after the view was made (Spark's own encryption)."""
        if self.ssl_context is not None or self._https is False:
            return
        if self._https is None and self.token is None:
            return                       # loopback: HTTP unless asked
        config = self.view.tls_config()
        if config is None:
            if self._https:
                raise errors.ConfigurationError(
                    "https=True needs the job's TLS on: Environment(tls=True) or tls=TLSConfig(cert, key, ca)")
            return
        # Browsers have no certificate of the job's CA: the access token
        # authenticates the reader, the certificate this view to the reader.
        self.ssl_context = _tls.https_context(config, mutual=False)
        self.ca_pem, cert = (_read(x) for x in (config.ca, config.cert))
        der = _tls.require_ssl().PEM_cert_to_DER_cert(cert.decode("ascii").split("-----END CERTIFICATE-----")[0]
                                       + "-----END CERTIFICATE-----\n")
        self.fingerprint = _tls.fingerprint_of(der)

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = self.view.host        # a name the reader can reach it by
        if ":" in host:
            host = f"[{host}]"
        q = "" if self.token is None else "?token=" + self.token
        scheme = "http" if self.ssl_context is None else "https"
        return f"{scheme}://{host}:{self.port}/{q}"

    def start(self) -> "UiServer":
        self._choose_tls()
        # (the poll interval: how soon close() is seen; each wake-up takes the GIL once)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="pyflowbuf: ui", daemon=True)
        self._thread.start()
        job = self._job_ref()
        if job is not None:
            # the view lives as long as the job handle: when that goes, so does the port
            self._finalizer = weakref.finalize(job, _close_httpd, self._httpd)
        if self.fingerprint is None:
            log.info("web view of job %r: %s", self.view.name, self.url)
        else:
            log.info("web view of job %r: %s (certificate SHA-256 %s)", self.view.name, self.url, self.fingerprint)
        return self

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()
        _cut(self._conns, self._conns_lock)

    def _opened(self, sock) -> bool:
        with self._conns_lock:
            if self._closed:
                return False
            self._conns.add(sock)
            return True

    def _gone(self, sock) -> None:
        with self._conns_lock:
            self._conns.discard(sock)

    # ---- answering ----
    def check_token(self, query: dict) -> bool:
        if self.token is None:
            return True
        given = query.get("token", [""])[0]
        return hmac.compare_digest(given.encode("utf-8", "replace"), self.token.encode())

    def answer(self, path: str, query: dict):
        """(status, content type, body) for a GET of ``path``."""
        if path in ("/", "/index.html"):
            return 200, STATIC["index.html"], self._static["index.html"]
        if path.startswith("/static/") and path[8:] in STATIC:
            return 200, STATIC[path[8:]], self._static[path[8:]]
        if not path.startswith("/api/"):
            raise _BadRequest(404, f"no such page: {path}")
        what = path[5:]
        if what == "live":
            return 200, "application/json", self._live(query)
        if what == "job":
            return 200, "application/json", _dumps(model.job_info(self.view))
        if what in ("graph", "subtasks", "top"):
            return 200, "application/json", self._sampled(what, query, self.view.metrics())
        key = path + "?" + "&".join(f"{k}={v}" for k, v in sorted(query.items()) if k != "token")
        now = time.monotonic()
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return 200, "application/json", hit[1]
        body = _dumps(self._api(what, query))
        with self._cache_lock:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = (now, body)
        return 200, "application/json", body

    def _live(self, query: dict) -> bytes:
        """What an open page asks for each second, in one answer:
        ``{"job": /api/job, <part>: ...}`` with the part its ``view`` shows
        (graph; subtasks and the vertices, of ``vertex`` or all; top, of
        ``n`` a ranking; checkpoints, or one checkpoint with ``checkpoint=ID``;
        watermarks), each as its own endpoint answers it."""
        view = query.get("view", ["graph"])[0]
        if view not in LIVE_VIEWS:
            raise _BadRequest(400, f"view={view!r}: one of {', '.join(LIVE_VIEWS)}")
        parts = [(b"job", _dumps(model.job_info(self.view)))]
        if view == "graph":
            parts.append((b"graph", self._sampled("graph", {}, self.view.metrics())))
        elif view == "subtasks":
            q = {"vertex": query["vertex"]} if "vertex" in query else {}
            parts.append((b"subtasks", self._sampled("subtasks", q, self.view.metrics())))
            parts.append((b"vertices", self._vertices))
        elif view == "top":
            q = {"n": query["n"]} if "n" in query else {}
            parts.append((b"top", self._sampled("top", q, self.view.metrics())))
        elif view == "checkpoints" and "checkpoint" in query:
            parts.append((b"checkpoint", self.answer("/api/checkpoints/" + query["checkpoint"][0], {})[2]))
        else:
            parts.append((view.encode(), self.answer("/api/" + view, {})[2]))
        return b"{" + b",".join(b'"' + k + b'":' + v for k, v in parts) + b"}"

    def _sampled(self, what: str, query: dict, metrics: dict) -> bytes:
        """The answer of ``what`` built from the runtime's current metrics
        sample, shared by every request until the runtime takes the next one
        (the values of ``metrics`` are the sample's own per-subtask dicts,
        the same objects until then)."""
        key = what + "?" + "&".join(f"{k}={v[0]}" for k, v in sorted(query.items()) if k != "token")
        sample = list(metrics.values())
        with self._cache_lock:
            hit = self._by_sample.get(key)
        if hit is not None and len(hit[0]) == len(sample) and all(a is b for a, b in zip(hit[0], sample)):
            return hit[1]
        body = _dumps(self._api(what, query, metrics))
        with self._cache_lock:
            if len(self._by_sample) > 256:
                self._by_sample.clear()
            self._by_sample[key] = (sample, body)     # holding the sample: its ids stay unique
        return body

    def _api(self, what: str, query: dict, metrics: dict | None = None):
        view = self.view
        if what == "job":
            return model.job_info(view)
        if what == "graph":
            return model.graph(view, metrics)
        if what == "subtasks":
            vertex = query.get("vertex", [None])[0]
            if vertex is not None:
                if not vertex.isdigit() or int(vertex) not in {v.id for v in view.vertices}:
                    raise _BadRequest(400, f"vertex={vertex!r}: not a vertex id of this job "
                                           f"(ids: {[v.id for v in view.vertices]})")
                vertex = int(vertex)
            return model.subtasks(view, metrics, vertex_id=vertex)
        if what == "top":
            n = query.get("n", [str(model.TOP_N)])[0]
            if not (n.isascii() and n.isdigit() and len(n) <= 6) or not 1 <= int(n) <= model.TOP_N_MAX:
                raise _BadRequest(400, f"n={n!r}: how many subtasks each ranking shows, 1..{model.TOP_N_MAX}")
            return model.top(view, metrics, int(n))
        if what == "checkpoints":
            return model.checkpoint_history(view)
        if what.startswith("checkpoints/"):
            cid = what[len("checkpoints/"):]
            if not cid.isdigit() or len(cid) > 18:
                raise _BadRequest(400, f"checkpoint id {cid!r} is not a number")
            detail = model.checkpoint_detail(view, int(cid))
            if detail is None:
                raise _BadRequest(404, f"no checkpoint {cid} in this job's history")
            return detail
        if what == "watermarks":
            return model.watermarks(view)
        raise _BadRequest(404, f"no such endpoint: /api/{what}")


def _read(pem_or_path) -> bytes:
    if isinstance(pem_or_path, bytes):
        return pem_or_path
    with open(pem_or_path, "rb") as f:
        return f.read()


def _dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str).encode()


def _cut(conns, lock) -> None:
    # a page's kept-alive connection must not outlive the view
    with lock:
        open_ = list(conns)
        conns.clear()
    for sock in open_:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _close_httpd(httpd) -> None:
    # Called when the job handle is collected, maybe on the serving thread
    # itself (whose shutdown() would wait for itself): from a thread of its own.
    def close():
        httpd.shutdown()
        httpd.server_close()
        ui = httpd.ui_ref()
        if ui is not None:
            _cut(ui._conns, ui._conns_lock)
    threading.Thread(target=close, name="pyflowbuf: ui close", daemon=True).start()


def _make_server(ui: UiServer, host: str, port: int):
    # http.server is imported here, not with pyflowbuf: most jobs never serve a page
    import http.server

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "pyflowbuf-ui"
        sys_version = ""
        # keep-alive, as browsers speak it: a page's polls reuse one connection
        # and one thread, where HTTP/1.0 cost a connection and a thread each
        protocol_version = "HTTP/1.1"
        timeout = KEEPALIVE_S
        disable_nagle_algorithm = True

        def setup(self):
            if not ui._opened(self.request):
                raise _Refused("the view is closed")
            if ui.ssl_context is not None:
                plain = self.request
                try:
                    self.request = self._handshake(plain)
                finally:
                    ui._gone(plain)     # (refused: socketserver closes it)
                if not ui._opened(self.request):
                    self.request.close()
                    raise _Refused("the view is closed")
            super().setup()

        def _handshake(self, plain):
            plain.settimeout(HANDSHAKE_S)
            first = plain.recv(1, socket.MSG_PEEK)
            if first != b"\x16":       # not a TLS handshake record: plain HTTP (or nothing)
                if first:
                    text = f"this view is served over HTTPS only: open {ui.url.split('?')[0]}\n".encode()
                    plain.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\n"
                                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(text) + text)
                    # the request unread at close would send a reset, which may
                    # discard the answer before the client reads it: end our side,
                    # then take what it sent until it closes (bounded)
                    plain.shutdown(socket.SHUT_WR)
                    plain.settimeout(1.0)
                    taken = 0
                    while taken < 1 << 16 and (chunk := plain.recv(4096)):
                        taken += len(chunk)
                raise _Refused(f"{self.client_address}: not a TLS client on the HTTPS port")
            return ui.ssl_context.wrap_socket(plain, server_side=True)

        def finish(self):
            try:
                super().finish()
            finally:
                ui._gone(self.request)
                if ui.ssl_context is not None:
                    self.request.close()    # the TLS socket: the server closes only the plain one it gave

        def log_message(self, fmt, *args):  # noqa: D401 - the job's log, not stderr
            if log.isEnabledFor(logging.DEBUG):     # (every request: not formatted for nothing)
                log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, status, ctype, body, head=False, close=False, extra=()):
            if self.headers.get("Content-Length", "0") != "0" or self.headers.get("Transfer-Encoding"):
                close = True            # a body this server does not read must not be taken for a request
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in _HEADERS + tuple(extra):
                self.send_header(k, v)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            # headers and body in one write: one send, one GIL release, not two
            self._headers_buffer.append(b"\r\n")
            if not head:
                self._headers_buffer.append(body)
            self.flush_headers()

        def _get(self, head=False):
            try:
                parsed = urllib.parse.urlsplit(self.path)
                query = urllib.parse.parse_qs(parsed.query, keep_blank_values=True)
                if ui.token is None and not _host_ok(self.headers.get("Host"), ui.port):
                    # a loopback page is read by a browser on this host only:
                    # a page elsewhere that renamed itself to 127.0.0.1 (DNS
                    # rebinding) sends its own name as Host
                    raise _BadRequest(403, "this view answers to 127.0.0.1 or localhost only")
                # the page's code is public; the page and the job's figures take the token
                if not parsed.path.startswith("/static/") and not ui.check_token(query):
                    raise _BadRequest(403, "a missing or wrong access token: open the URL the job logged")
                status, ctype, body = ui.answer(parsed.path, query)
            except _BadRequest as e:
                status, ctype, body = e.status, "text/plain; charset=utf-8", (e.text + "\n").encode()
            except ReferenceError:      # the job handle is gone
                status, ctype, body = 410, "text/plain; charset=utf-8", b"the job handle is gone\n"
            except Exception as e:      # noqa: BLE001 - a page must never break the job
                log.warning("web view: %s failed: %r", self.path, e)
                status, ctype, body = 500, "text/plain; charset=utf-8", b"internal error (logged)\n"
            self._send(status, ctype, body, head)

        def do_GET(self):
            self._get()

        def do_HEAD(self):
            self._get(head=True)

        def _refuse(self):
            self._send(405, "text/plain; charset=utf-8", b"read-only: GET only\n", close=True,
                       extra=(("Allow", "GET, HEAD"),))

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 64
        ui_ref = staticmethod(weakref.ref(ui))

        def handle_error(self, request, client_address):
            # a client gone, a refused handshake, plain HTTP on the HTTPS port:
            # the job's log at debug, not a traceback on stderr
            log.debug("web view: connection from %s ended: %r", client_address, sys.exc_info()[1])

    if ":" in host and host != "localhost":
        Server.address_family = socket.AF_INET6
    try:
        return Server((host, port), Handler)
    except OSError as e:
        raise errors.PortUnavailableError(
            e.errno, f"ui_port {port} on {host}: {e.strerror or e}; pick another port or 0 for a free one") from e


def _host_ok(header, port) -> bool:
    if not header:
        return False
    host = header.rsplit(":", 1)[0] if not header.endswith("]") else header
    host = host.strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def serve(job, port: int = 0, host: str = LOOPBACK, *, plan=None, https=None) -> UiServer:
    """Serve the web view of ``job`` (a job handle: ``Environment.execute_async()``)
    and return the server; its ``url`` is logged (``pyflowbuf.ui``, INFO).

    Example::

        job = environment.execute_async()
        server = pyflowbuf.ui.serve(job)      # or job.serve_ui()
        print(server.url)                     # http://127.0.0.1:<port>/

    ``https``: see :class:`UiServer` (HTTPS beyond loopback when the job has TLS on).
    """
    return UiServer(job, port, host, plan=plan, https=https).start()


def _forget_in_child() -> None:
    # A forked worker inherits the listening socket: it must not hold the port.
    for server in list(_OPEN):
        if server._pid != os.getpid():
            try:
                server._httpd.socket.close()
            except OSError:
                pass
            # nor a page's kept-alive connection: its descriptor closed here (no
            # shutdown, which would cut it for the parent too; detached, as the
            # handler's file objects would keep a plain close() from closing it)
            for sock in list(server._conns):
                try:
                    os.close(sock.detach())
                except (OSError, ValueError):
                    pass
            server._conns.clear()
            server._closed = True
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)
