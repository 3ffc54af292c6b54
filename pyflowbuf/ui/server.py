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
import threading
import time
import urllib.parse
import weakref
from importlib import resources

from pyflowbuf import errors
from pyflowbuf.ui import model

log = logging.getLogger("pyflowbuf.ui")

LOOPBACK = "127.0.0.1"
# the page's files: name -> content type
STATIC = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
          "app.css": "text/css; charset=utf-8"}
# How long one built answer is reused: a page polls once a second, and several
# pages (or a page and a script) polling together cost the job one build.
CACHE_S = 0.25
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
    """

    def __init__(self, job, port: int = 0, host: str = LOOPBACK, *, plan=None):
        if port is None or isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise errors.ConfigurationError(f"ui_port must be an int in 0..65535 (0: a free port), got {port!r}")
        if not isinstance(host, str) or not host:
            raise errors.ConfigurationError(f"ui_host must be a host name or address, got {host!r}")
        self.view = model.JobView(job, plan)
        self.host = host
        self.token = None if is_loopback(host) else secrets.token_urlsafe(24)
        self._cache: dict = {}
        self._cache_lock = threading.Lock()
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

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            host = self.view.host        # a name the reader can reach it by
        if ":" in host:
            host = f"[{host}]"
        q = "" if self.token is None else "?token=" + self.token
        return f"http://{host}:{self.port}/{q}"

    def start(self) -> "UiServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="pyflowbuf: ui", daemon=True)
        self._thread.start()
        job = self._job_ref()
        if job is not None:
            # the view lives as long as the job handle: when that goes, so does the port
            self._finalizer = weakref.finalize(job, _close_httpd, self._httpd)
        log.info("web view of job %r: %s", self.view.name, self.url)
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
        key = path + "?" + "&".join(f"{k}={v}" for k, v in sorted(query.items()) if k != "token")
        now = time.monotonic()
        with self._cache_lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return 200, "application/json", hit[1]
        body = json.dumps(self._api(path[5:], query), separators=(",", ":"), allow_nan=False,
                          default=str).encode()
        with self._cache_lock:
            if len(self._cache) > 256:
                self._cache.clear()
            self._cache[key] = (now, body)
        return 200, "application/json", body

    def _api(self, what: str, query: dict):
        view = self.view
        if what == "job":
            return model.job_info(view)
        if what == "graph":
            return model.graph(view)
        if what == "subtasks":
            vertex = query.get("vertex", [None])[0]
            if vertex is not None:
                if not vertex.isdigit() or int(vertex) not in {v.id for v in view.vertices}:
                    raise _BadRequest(400, f"vertex={vertex!r}: not a vertex id of this job "
                                           f"(ids: {[v.id for v in view.vertices]})")
                vertex = int(vertex)
            return model.subtasks(view, vertex_id=vertex)
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


def _close_httpd(httpd) -> None:
    # Called when the job handle is collected, maybe on the serving thread
    # itself (whose shutdown() would wait for itself): from a thread of its own.
    def close():
        httpd.shutdown()
        httpd.server_close()
    threading.Thread(target=close, name="pyflowbuf: ui close", daemon=True).start()


def _make_server(ui: UiServer, host: str, port: int):
    # http.server is imported here, not with pyflowbuf: most jobs never serve a page
    import http.server
    import socket

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "pyflowbuf-ui"
        sys_version = ""

        def log_message(self, fmt, *args):  # noqa: D401 - the job's log, not stderr
            log.debug("%s %s", self.address_string(), fmt % args)

        def _send(self, status, ctype, body, head=False):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for k, v in _HEADERS:
                self.send_header(k, v)
            self.end_headers()
            if not head:
                self.wfile.write(body)

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
            body = b"read-only: GET only\n"
            self.send_response(405)
            self.send_header("Allow", "GET, HEAD")
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 64

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


def serve(job, port: int = 0, host: str = LOOPBACK, *, plan=None) -> UiServer:
    """Serve the web view of ``job`` (a job handle: ``Environment.execute_async()``)
    and return the server; its ``url`` is logged (``pyflowbuf.ui``, INFO).

    Example::

        job = environment.execute_async()
        server = pyflowbuf.ui.serve(job)      # or job.serve_ui()
        print(server.url)                     # http://127.0.0.1:<port>/
    """
    return UiServer(job, port, host, plan=plan).start()


def _forget_in_child() -> None:
    # A forked worker inherits the listening socket: it must not hold the port.
    for server in list(_OPEN):
        if server._pid != os.getpid():
            try:
                server._httpd.socket.close()
            except OSError:
                pass
            server._closed = True
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_in_child)
