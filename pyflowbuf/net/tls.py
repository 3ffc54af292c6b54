"""Mutual TLS 1.3 for every connection of a job: the data exchange
(``NetworkServer`` / ``ConnectionManager``), the driver's control channel
and the output relays of Spark tasks.

``TLSConfig(cert, key, ca, fingerprint=None)`` is what each side presents and
trusts: its certificate and key, the CA that signed the peers' certificates,
and optionally the SHA-256 fingerprint a peer's certificate must have (pinned).
Both sides present a certificate; host names are not checked (workers are
reached by address, and the CA is the job's own). ``Environment(tls=True)``
makes a private CA per job and one certificate per job attempt in memory
(``JobCertificates``), pinned, so a process of another job or of an earlier
attempt is refused at the handshake; the HMAC challenge under the attempt's
secret still runs inside the TLS connection.

How it runs: in the exchange's own loops. ``wrap`` gives a connection a
``CoreTLS``: libssl in the compiled core (``pyflowbuf._core.netio.TLSSocket``,
``csrc/fb_tls.h``), one ``SSL`` object per connection over the TCP socket.
The handshake runs without the GIL by a deadline; then ``Wire`` encrypts each
batch of frames (up to 16 buffers) with ``SSL_write`` on the sending thread,
and the receive loop decrypts with ``SSL_read`` straight into the segment its
channel reserved, both without the GIL; TLS_AES_128_GCM_SHA256 is preferred.
The pinned fingerprint is checked here, on the peer certificate's DER.

Where the core was built without libssl (no OpenSSL headers at build time,
or ``PYFLOWBUF_NO_LIBSSL=1``), or ``PYFLOWBUF_TLS_RELAY=1`` is set, TLS falls
back to ``TLSRelay``: Python's ``ssl.SSLObject`` over two ``ssl.MemoryBIO``
in one thread per connection, which moves bytes between the TCP socket and
one end of a local socket pair the loops use instead. It is correct but
several times slower (a socket-pair hop and a copy per side, AES-256-GCM);
a warning says so once per process.

The driver's control channel (``pyflowbuf.cluster.control_channel``) is not
one of the exchange's loops and carries few messages: it runs Python's ssl
on the TCP socket itself (``handshake_socket``, then ``SSLStream``), with
no thread of its own, whatever the core was built with.

Example (the user's own certificate files)::

    from pyflowbuf.net import NetworkServer, ConnectionManager, TLSConfig
    tls = TLSConfig("/etc/pyflowbuf/node.pem", "/etc/pyflowbuf/node.key", "/etc/pyflowbuf/ca.pem")
    server = NetworkServer(secret, host="0.0.0.0", tls=tls)
    mgr = ConnectionManager(secret, tls=tls)
"""
from __future__ import annotations

import datetime
import errno
import functools
import hashlib
import logging
import os
import select
import socket
import sys
import tempfile
import threading
import time
import warnings

try:
    import ssl
except ImportError:   # a Python built without OpenSSL: TLS asked for is refused in require_ssl()
    ssl = None

from pyflowbuf._core import netio
from pyflowbuf.errors import (CertificateExpiryWarning, CertificateValidityError, ConfigurationError, TLSError,
                              TLSUnavailableError)

log = logging.getLogger(__name__)

# plaintext taken from the pair per SSL_write, ciphertext per recv: many
# frames per call, so the per-call overhead (GIL, syscall) is paid per batch
CHUNK = 256 * 1024
_PAIR_BUFFER = 1 << 20
# the last bytes (and close_notify) after the local end closed: a peer that
# does not read them within this time is not waited for
_FLUSH_S = 5.0
# tls=True's CA and certificates: RFC 5280's "no well-defined expiration date"
# (4.1.2.5). Trust in them ends with the job, not at a date: the CA lives only
# in the driver's memory, and each attempt's certificate is pinned and replaced
# at the next attempt. A date would only refuse the handshakes of a job that
# runs longer (a restart's, a savepoint command's) and gain nothing.
GENERATED_NOT_AFTER = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)
# ... and valid from a day back: hosts' clocks differ, and a certificate that
# another host sees as not valid yet is refused there
GENERATED_BACKDATE = datetime.timedelta(days=1)
# a user's certificate that expires sooner than this after the job's start is
# warned about (CertificateExpiryWarning); one already expired is refused
EXPIRY_WARNING_DAYS = 30


def require_ssl():
    """The ``ssl`` module, or TLSUnavailableError naming this Python."""
    if ssl is None or not getattr(ssl, "HAS_TLSv1_3", False):
        raise TLSUnavailableError(
            f"TLS was asked for (tls=...), but this Python ({sys.executable}) has no ssl module with TLS 1.3 "
            "(it was built without OpenSSL >= 1.1.1): install a Python built with OpenSSL on every host, "
            "or run without tls=")
    return ssl


def fingerprint_of(der: bytes) -> str:
    """The SHA-256 fingerprint of a DER certificate, as ``TLSConfig(fingerprint=)`` takes it."""
    return hashlib.sha256(der).hexdigest()


def _norm_fingerprint(fp) -> str:
    if not isinstance(fp, str):
        raise TypeError(f"fingerprint must be a hex str (SHA-256 of the certificate), got {type(fp).__name__}")
    text = fp.replace(":", "").strip().lower()
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ConfigurationError(f"fingerprint must be the SHA-256 of a certificate: 64 hex digits (colons allowed), "
                         f"got {fp!r}")
    return text


def _pem_or_path(value, what):
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        if b"-----BEGIN" not in value:
            raise ConfigurationError(f"TLSConfig: {what} given as bytes must be PEM (-----BEGIN ...)")
        return bytes(value)
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    raise TypeError(f"TLSConfig: {what} must be a file path or PEM bytes, got {type(value).__name__}")


class TLSConfig:
    """What one process presents and trusts on a mutual TLS 1.3 connection.

    cert : its certificate (a PEM file path, or PEM bytes), optionally
        followed by the chain up to the CA.
    key : its private key (path or PEM bytes); None if ``cert`` holds it.
    ca : the CA certificate(s) the peers' certificates must chain to (path
        or PEM bytes). May be the same file as ``cert`` for a self-signed
        certificate shared by all processes.
    fingerprint : optionally, the SHA-256 fingerprint (hex, colons allowed)
        a peer's certificate must have; several in a list or tuple.

    The files are read where a connection is made (each host reads its own
    copy, at the same path); PEM bytes travel with the job. At the job's
    start their dates are checked (``check_dates``): an expired certificate is
    refused then, one that expires within 30 days is warned about. The key never
    appears in ``repr`` and is never written to checkpoints, logs or metrics.

    Example::

        tls = TLSConfig("node.pem", "node.key", "ca.pem",
                        fingerprint="3f:a1:...")        # optional pin
        env = fb.Environment(workers=2, tls=tls)
    """

    def __init__(self, cert, key=None, ca=None, *, fingerprint=None):
        self.cert = _pem_or_path(cert, "cert")
        if self.cert is None:
            raise ConfigurationError("TLSConfig: cert is required (both sides present a certificate)")
        self.key = _pem_or_path(key, "key")
        self.ca = _pem_or_path(ca, "ca")
        if self.ca is None:
            raise ConfigurationError("TLSConfig: ca is required (the CA that signed the peers' certificates)")
        if fingerprint is None:
            self.fingerprints = None
        elif isinstance(fingerprint, (list, tuple, set, frozenset)):
            self.fingerprints = frozenset(_norm_fingerprint(f) for f in fingerprint)
        else:
            self.fingerprints = frozenset([_norm_fingerprint(fingerprint)])
        self._contexts = {}
        self._lock = threading.Lock()

    def __repr__(self):
        def show(v):
            return "<PEM in memory>" if isinstance(v, bytes) else repr(v)
        pin = "" if self.fingerprints is None else f", fingerprint={sorted(self.fingerprints)!r}"
        return f"TLSConfig(cert={show(self.cert)}, key={'None' if self.key is None else show(self.key)}, " \
               f"ca={show(self.ca)}{pin})"

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_contexts")
        state.pop("_lock")
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._contexts = {}
        self._lock = threading.Lock()

    def context(self, server_side: bool):
        """The SSLContext of this side (made once per process and side)."""
        mod = require_ssl()
        with self._lock:
            ctx = self._contexts.get(server_side)
            if ctx is None:
                ctx = self._contexts[server_side] = self._make_context(mod, server_side)
            return ctx

    def core_context(self, server_side: bool):
        """libssl's context of this side in the compiled core (made once per
        process and side; the files are read here)."""
        require_ssl()
        with self._lock:
            ctx = self._contexts.get(("core", server_side))
            if ctx is None:
                try:
                    pems = [v if v is None or isinstance(v, bytes) else _read_file(v)
                            for v in (self.cert, self.key, self.ca)]
                    ctx = netio.TLSContext(pems[0], pems[1], pems[2], server_side)
                except (OSError, ValueError) as e:
                    raise TLSUnavailableError(f"{self!r}: cannot load the certificate, key or CA: {e}") from None
                self._contexts[("core", server_side)] = ctx
            return ctx

    def _make_context(self, mod, server_side):
        ctx = mod.SSLContext(mod.PROTOCOL_TLS_SERVER if server_side else mod.PROTOCOL_TLS_CLIENT)
        # 1.3 only: no renegotiation exists, and a 1.2 peer is refused at the hello
        ctx.minimum_version = mod.TLSVersion.TLSv1_3
        ctx.maximum_version = mod.TLSVersion.TLSv1_3
        ctx.check_hostname = False      # peers are reached by address; trust is the CA (and the pin)
        ctx.verify_mode = mod.CERT_REQUIRED
        if server_side:
            ctx.num_tickets = 0         # no session resumption: every connection authenticates in full
        try:
            if isinstance(self.ca, bytes):
                ctx.load_verify_locations(cadata=self.ca.decode("ascii"))
            else:
                ctx.load_verify_locations(cafile=self.ca)
            _load_cert_chain(ctx, self.cert, self.key)
        except (OSError, mod.SSLError, ValueError) as e:
            raise TLSUnavailableError(f"{self!r}: cannot load the certificate, key or CA: {e}") from None
        return ctx

    def check_peer(self, der, peer):
        """After the handshake: the pinned fingerprint, if any."""
        if self.fingerprints is None:
            return
        fp = fingerprint_of(der)
        if fp not in self.fingerprints:
            raise TLSError(peer, f"the peer's certificate has fingerprint {fp}, not the pinned one "
                                 "(a certificate of another job or attempt, or a wrong fingerprint=)")


def _read_file(path):
    with open(path, "rb") as f:
        return f.read()


def _load_cert_chain(ctx, cert, key):
    """load_cert_chain takes file names only: PEM held in memory goes through
    an anonymous memory file (Linux) so the key never touches a disk, else a
    private temporary file removed at once."""
    paths, cleanups = [], []
    try:
        for value in (cert, key):
            if value is None or not isinstance(value, bytes):
                paths.append(value)
                continue
            memfd = getattr(os, "memfd_create", None)
            if memfd is not None:
                fd = memfd("pyflowbuf-tls", 0)
                os.write(fd, value)
                paths.append(f"/proc/self/fd/{fd}")
                cleanups.append(lambda fd=fd: os.close(fd))
            else:
                fd, path = tempfile.mkstemp(prefix="pyflowbuf-tls-")
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                paths.append(path)
                cleanups.append(lambda path=path: os.unlink(path))
        ctx.load_cert_chain(paths[0], paths[1])
    finally:
        for c in cleanups:
            c()


def https_context(config: TLSConfig, *, mutual: bool = True):
    """An ``ssl.SSLContext`` for an HTTPS server (the job's web view when it is
    served beyond loopback) from the same TLSConfig: its certificate and key,
    TLS 1.3 only; with ``mutual`` a client must present a certificate of the
    config's CA (and the pin, checked by the caller with ``config.check_peer``
    on ``getpeercert(binary_form=True)``), else browsers connect without one.

    Example::

        httpd.socket = https_context(tls).wrap_socket(httpd.socket, server_side=True)
    """
    mod = require_ssl()
    ctx = config._make_context(mod, True)
    if not mutual:
        ctx.verify_mode = mod.CERT_NONE
    return ctx


# ------------------------------------------------------------ job certificates

class JobCertificates:
    """``Environment(tls=True)``: a private CA for one job (made in the driver,
    in memory, with the ``cryptography`` package) and one certificate per job
    attempt, each pinned, so a process of another job (another CA) or of an
    earlier attempt (another certificate) is refused at the handshake. The
    CA's key never leaves the driver; each attempt's ``TLSConfig`` travels to
    the workers with the job, as the attempt's secret does. None of them
    expires (``GENERATED_NOT_AFTER``): trust ends with the job and the pin,
    not at a date that a long-running job could outlive."""

    def __init__(self, name="pyflowbuf job"):
        x509, ec, hashes, NameOID = _crypto()
        self._name = name
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
        now = datetime.datetime.now(datetime.timezone.utc)
        ski = x509.SubjectKeyIdentifier.from_public_key(self._key.public_key())
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - GENERATED_BACKDATE)
                      .not_valid_after(GENERATED_NOT_AFTER)
                      .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                      .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False,
                                                   key_encipherment=False, data_encipherment=False,
                                                   key_agreement=False, key_cert_sign=True, crl_sign=True,
                                                   encipher_only=False, decipher_only=False), critical=True)
                      .add_extension(ski, critical=False)
                      .sign(self._key, hashes.SHA256()))
        self._attempts = {}

    def __reduce__(self):
        raise TypeError("JobCertificates holds the job CA's key and stays in the driver: "
                        "hand workers for_attempt(n) instead")

    def for_attempt(self, attempt: int, *, not_before=None, not_after=None) -> TLSConfig:
        """The TLSConfig of every process of ``attempt`` (made once)."""
        cfg = self._attempts.get(attempt) if not_before is None and not_after is None else None
        if cfg is None:
            cfg = self._issue(f"{self._name} attempt {attempt}", not_before, not_after)
            if not_before is None and not_after is None:
                self._attempts[attempt] = cfg
        return cfg

    def issue(self, role: str) -> TLSConfig:
        """One more certificate of this CA, for ``role`` (its common name
        follows the job's), made each call and pinned to itself as
        ``for_attempt``'s are: for connections apart from the attempts', such
        as the control endpoint and its client (``pyflowbuf.cluster.control``)."""
        return self._issue(f"{self._name} {role}")

    def _issue(self, cn, not_before=None, not_after=None):
        x509, ec, hashes, NameOID = _crypto()
        from cryptography.hazmat.primitives import serialization
        from cryptography.x509.oid import ExtendedKeyUsageOID
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(not_before or now - GENERATED_BACKDATE)
                .not_valid_after(not_after or GENERATED_NOT_AFTER)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                             key_encipherment=False, data_encipherment=False,
                                             key_agreement=False, key_cert_sign=False, crl_sign=False,
                                             encipher_only=False, decipher_only=False), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
                .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()),
                               critical=False)
                .sign(self._key, hashes.SHA256()))
        pem = serialization.Encoding.PEM
        return TLSConfig(cert.public_bytes(pem),
                         key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
                         self._cert.public_bytes(pem),
                         fingerprint=fingerprint_of(cert.public_bytes(serialization.Encoding.DER)))


def _crypto():
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        raise TLSUnavailableError(
            "tls=True makes the job's certificates with the 'cryptography' package, which this Python "
            f"({sys.executable}) lacks: pip install 'pyflowbuf[tls]' (or pass tls=TLSConfig(cert, key, ca) "
            "with your own files)") from None
    return x509, ec, hashes, NameOID


def resolve(value, what="tls"):
    """``Environment(tls=...)``: None/False (off), True (the job's own CA) or a TLSConfig."""
    if value is None or value is False:
        return None
    if value is True or isinstance(value, TLSConfig):
        return value
    raise ConfigurationError(f"{what} must be True, False, None or a pyflowbuf.net.TLSConfig, got {value!r}")


def check_dates(config: TLSConfig, *, now=None, warn_days=EXPIRY_WARNING_DAYS, stacklevel=2):
    """A user's certificates at the job's start: ``CertificateValidityError``
    when the certificate (or one of its chain) is expired or not valid yet,
    or no certificate of ``ca`` is valid now (every handshake would be
    refused); ``CertificateExpiryWarning`` when one of them, or every valid
    one of ``ca``, expires within ``warn_days`` (handshakes after that date
    will be refused: new connections, such as a restart's). Each message
    names the file (or "PEM bytes"), the certificate's subject and the date.
    Files that cannot be read or parsed here are left to the handshake, which
    reports them; without the ``cryptography`` package nothing is checked
    here (the handshake still checks the dates).

    Example::

        check_dates(TLSConfig("node.pem", "node.key", "ca.pem"))
    """
    try:
        from cryptography import x509
    except ImportError:
        log.debug("pyflowbuf.net.tls: no 'cryptography' package: certificate dates are checked at handshakes only")
        return
    now = now or datetime.datetime.now(datetime.timezone.utc)
    soon = now + datetime.timedelta(days=warn_days)

    def load(value):
        try:
            data = value if isinstance(value, bytes) else _read_file(value)
            return x509.load_pem_x509_certificates(data)
        except (OSError, ValueError):
            return []

    def where(value):
        return "given as PEM bytes" if isinstance(value, bytes) else f"in {value}"

    problems, warnings_ = [], []
    for i, c in enumerate(load(config.cert)):
        what = "the certificate" if i == 0 else "a certificate of the chain"
        text = f"{what} {where(config.cert)} ({_subject(c)})"
        if c.not_valid_after_utc < now:
            problems.append(f"{text} expired on {_date(c.not_valid_after_utc)}")
        elif c.not_valid_before_utc > now:
            problems.append(f"{text} is not valid before {_date(c.not_valid_before_utc)}")
        elif c.not_valid_after_utc < soon:
            warnings_.append(f"{text} expires on {_date(c.not_valid_after_utc)}")
    cas = load(config.ca)
    if cas:
        valid = [c for c in cas if c.not_valid_before_utc <= now <= c.not_valid_after_utc]
        if not valid:
            last = max(cas, key=lambda c: c.not_valid_after_utc)
            state = (f"expired on {_date(last.not_valid_after_utc)}" if last.not_valid_after_utc < now else
                     f"is not valid before {_date(last.not_valid_before_utc)}")
            problems.append(f"the CA {where(config.ca)} ({_subject(last)}{' and the others' if len(cas) > 1 else ''}) "
                            f"{state}")
        else:
            last = max(valid, key=lambda c: c.not_valid_after_utc)
            if last.not_valid_after_utc < soon:
                warnings_.append(f"the CA {where(config.ca)} ({_subject(last)}) expires on "
                                 f"{_date(last.not_valid_after_utc)}")
    if problems:
        raise CertificateValidityError(
            f"tls={config!r}: {'; '.join(problems)} (now {_date(now)}): every TLS handshake would refuse it; "
            "renew the files (every host reads its own copy)")
    for w in warnings_:
        warnings.warn(CertificateExpiryWarning(
            f"tls={config!r}: {w}, within {warn_days} days: TLS handshakes after that date are refused (a "
            "restart's, a savepoint command's); renew the files before then (every host reads its own copy)"),
            stacklevel=stacklevel)


def _subject(cert):
    return cert.subject.rfc4514_string() or "no subject"


def _date(d):
    return d.strftime("%Y-%m-%d %H:%M:%S UTC")


class AttemptTLS:
    """The driver's side of ``tls=``: the TLSConfig of each attempt (the
    user's own for every attempt, or one certificate per attempt of the job's
    CA for ``tls=True``); None when TLS is off."""

    def __init__(self, setting, name="pyflowbuf job"):
        self.setting = resolve(setting)
        self._certs = None
        if self.setting is True:
            require_ssl()
            self._certs = JobCertificates(name)
        elif self.setting is not None:
            check_dates(self.setting)     # at the job's start: not at a handshake a year on

    def for_attempt(self, attempt):
        if self.setting is None:
            return None
        if self._certs is not None:
            return self._certs.for_attempt(attempt)
        return self.setting

    def for_server(self, cn):
        """The TLSConfig of a server of the job that no attempt runs (the web
        view's HTTPS): the user's own, or a certificate ``cn`` of the job's CA."""
        if self.setting is None:
            return None
        if self._certs is not None:
            return self._certs._issue(cn)
        return self.setting


# ------------------------------------------------------------ the relay

def _reason(e, server_side):
    """An OpenSSL error, said as what it means here."""
    text = getattr(e, "verify_message", None) or getattr(e, "reason", None) or str(e)
    return _reason_text(text, getattr(e, "verify_code", None), server_side)


def _reason_text(text, code, server_side):
    """What failed in a handshake, and on which side. ``code`` is Python's
    ``verify_code`` (our own check of the peer's certificate failed); the
    core says so with "certificate verify failed: ..."; an alert is the
    peer's word about our certificate."""
    low = str(text).lower().replace("_", " ")
    if "wrong version number" in low or "http request" in low or "record layer" in low \
            or "packet length too long" in low or "unknown protocol" in low:
        return (f"the peer does not speak TLS ({text}): "
                + ("a client without tls= connected to this TLS server" if server_side else
                   "the server was started without tls=") + "; give every process the same tls= setting")
    if "unsupported protocol" in low or "no protocols available" in low or "tlsv1 alert protocol version" in low:
        return f"the peer offers no TLS 1.3 ({text}): pyflowbuf speaks TLS 1.3 only (no renegotiation)"
    if code is not None or "certificate verify failed" in low:
        return f"this side refused the peer's certificate ({text}): it must be valid now and signed by the CA " \
               "of this side's tls= setting (a certificate of another CA or another job is refused)"
    if "alert" in low:
        return _alert_text(text, low)
    if "certificate" in low:
        # "peer did not return a certificate" and the like: the peer's side is at fault
        return f"the peer's certificate was not acceptable ({text}): every process needs a certificate of the " \
               "CA of this job's tls= setting"
    return f"the TLS handshake failed ({text})"


def _alert_text(text, low):
    """The peer's alert: about OUR certificate when it names one."""
    if "expired" in low:
        return f"the peer refused our certificate as expired ({text}): renew this side's certificate " \
               "(the cert of its tls= setting); the peer checks its dates at every handshake"
    if "certificate" in low or "unknown ca" in low or "access denied" in low:
        return f"the peer refused our certificate ({text}): it does not trust it (another CA or job, or not " \
               "the one it pins): every process needs a certificate of the CA of this job's tls= setting"
    return f"the peer ended the TLS handshake with an alert ({text})"


class TLSRelay:
    """One TLS connection: the handshake on ``tcp`` (``handshake``), then a
    thread (``start``) that relays between ``tcp`` and ``local``, the end of
    a socket pair the caller uses as it would use ``tcp``. ``error`` is the
    TLSError that ended it, if one did. Closing ``local`` (or ``close()``)
    ends the thread and closes ``tcp``."""

    def __init__(self, tcp, config: TLSConfig, *, server_side: bool, peer):
        mod = require_ssl()
        self.tcp = tcp
        self.config = config
        self.server_side = server_side
        self.peer = peer
        self._in = mod.MemoryBIO()
        self._out = mod.MemoryBIO()
        self.obj = config.context(server_side).wrap_bio(self._in, self._out, server_side=server_side)
        self.local, self._inner = socket.socketpair()
        for s in (self.local, self._inner):
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                try:
                    s.setsockopt(socket.SOL_SOCKET, opt, _PAIR_BUFFER)
                except OSError:
                    pass
        self.error = None
        self.peer_closed = False      # the peer sent close_notify
        self.handshake_s = None
        self._thread = None
        self._closed = False
        # test-only tap: called with every chunk of bytes written to the TCP socket
        self.tap = None

    # ---------------------------------------------------------------- handshake
    def handshake(self, deadline=None):
        """Run the TLS handshake on ``tcp``, all of it by ``deadline``
        (time.monotonic(); None: the socket's own timeout), then check the
        pinned fingerprint. Raises TLSError naming the peer and the reason."""
        mod = ssl
        t0 = time.perf_counter()
        try:
            while True:
                try:
                    self.obj.do_handshake()
                    break
                except mod.SSLWantReadError:
                    self._flush_blocking(deadline)
                    data = self._recv_blocking(deadline)
                    if not data:
                        raise TLSError(self.peer, "the connection closed in the middle of the TLS handshake "
                                                  "(a truncated handshake, or the peer refused ours)")
                    self._in.write(data)
            self._flush_blocking(deadline)
        except socket.timeout:
            raise TLSError(self.peer, "the TLS handshake did not finish in time (the handshake timeout): "
                                      "a peer that sent no or only part of a handshake, or a client "
                                      "without tls= on a TLS port") from None
        except mod.SSLError as e:
            try:
                self._flush_blocking(deadline)     # our alert tells the peer why
            except (OSError, socket.timeout):
                pass
            raise TLSError(self.peer, _reason(e, self.server_side)) from None
        except OSError as e:
            if isinstance(e, TLSError):
                raise
            raise TLSError(self.peer, f"the connection failed during the TLS handshake: {e}") from None
        finally:
            try:
                self.tcp.settimeout(None)
            except OSError:
                pass
        der = self.obj.getpeercert(binary_form=True)
        if der is None:
            raise TLSError(self.peer, "the peer presented no certificate (mutual TLS needs one on both sides)")
        self.config.check_peer(der, self.peer)
        self.handshake_s = time.perf_counter() - t0

    def _settimeout(self, deadline):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            self.tcp.settimeout(left)

    def _recv_blocking(self, deadline):
        self._settimeout(deadline)
        return self.tcp.recv(CHUNK)

    def _flush_blocking(self, deadline):
        data = self._out.read()
        if data:
            self._settimeout(deadline)
            if self.tap is not None:
                self.tap(data)
            self.tcp.sendall(data)

    # ---------------------------------------------------------------- relaying
    def start(self):
        self._thread = threading.Thread(target=self._run, name=f"pyflowbuf-tls-{self.peer}", daemon=True)
        self._thread.start()

    def join(self, timeout=None):
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self):
        return self._thread is not None and self._thread.is_alive()

    def close(self):
        """Wake a handshake waiting on ``tcp``. (Once the thread runs, closing
        or shutting down ``local`` ends it: it sends close_notify first.)"""
        self._closed = True
        if self._thread is None:
            try:
                self.tcp.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release(self):
        """The owner is done with ``local`` (it closed it): if the thread never
        started, close the sockets it would have closed."""
        self._closed = True
        try:
            self.local.close()      # (the owner's close came first: closing twice is harmless)
        except OSError:
            pass
        if self._thread is None:
            self._close_all()

    def _close_all(self):
        for s in (self._inner, self.tcp):
            try:
                s.close()
            except OSError:
                pass

    def _fail(self, reason):
        if self.error is None:
            self.error = TLSError(self.peer, reason)

    def _run(self):
        mod = ssl
        tcp, inner, obj, bio_out = self.tcp, self._inner, self.obj, self._out
        tap = self.tap
        POLLIN, POLLOUT = select.POLLIN, select.POLLOUT
        GONE = select.POLLHUP | select.POLLERR
        RDHUP = getattr(select, "POLLRDHUP", select.POLLHUP)
        try:
            tcp.setblocking(False)
            inner.setblocking(False)
            out_mv = memoryview(bytearray(CHUNK))   # plaintext from the local end
            in_mv = memoryview(bytearray(CHUNK))    # plaintext for the local end
            raw_mv = memoryview(bytearray(CHUNK))   # ciphertext from tcp
            to_tcp = b""                # ciphertext not yet sent (a memoryview once partly sent)
            to_local = None             # a slice of in_mv not yet handed over
            local_eof = remote_eof = local_shut = False
            flush_by = None     # once the local end closed: how long the last bytes may take
            poller = select.poll()
            fi, ft = inner.fileno(), tcp.fileno()
            while not (local_eof and not to_tcp):
                ev_i = (0 if (to_tcp or local_eof) else POLLIN) | (POLLOUT if to_local else 0)
                if not ev_i and flush_by is None and not local_eof:
                    ev_i = RDHUP     # not reading it now, but its closing starts the flush deadline
                ev_t = (0 if (to_local or remote_eof) else POLLIN) | (POLLOUT if to_tcp else 0)
                if not ev_i and not ev_t:
                    break
                # only what we wait for: a hung-up end we do not wait on would wake poll() at once, forever
                for fd, ev in ((fi, ev_i), (ft, ev_t)):
                    if ev:
                        poller.register(fd, ev)
                    else:
                        try:
                            poller.unregister(fd)
                        except KeyError:
                            pass
                if local_eof and flush_by is None:
                    flush_by = time.monotonic() + _FLUSH_S
                if flush_by is None:
                    ready = dict(poller.poll())
                else:           # a peer that stopped reading must not hold this thread
                    left = flush_by - time.monotonic()
                    if left <= 0:
                        break
                    ready = dict(poller.poll(left * 1000))
                ri, rt = ready.get(fi, 0), ready.get(ft, 0)
                if (ri | rt) & select.POLLNVAL:
                    break
                if ri & (RDHUP | GONE) and flush_by is None and not ev_i & POLLIN:
                    flush_by = time.monotonic() + _FLUSH_S
                # local -> TLS -> tcp: all the frames waiting in one SSL_write (GIL released in it)
                if ev_i & POLLIN and ri & (POLLIN | GONE):
                    try:
                        n = inner.recv_into(out_mv)
                    except BlockingIOError:
                        n = -1
                    except OSError:
                        n = 0
                    if n == 0:
                        local_eof = True
                        try:
                            obj.unwrap()        # close_notify for the peer
                        except (mod.SSLError, ValueError):
                            pass
                    elif n > 0:
                        obj.write(out_mv[:n])
                    to_tcp = bio_out.read()
                if to_tcp and (rt & (POLLOUT | GONE) or not ev_t & POLLOUT):
                    try:
                        sent = tcp.send(to_tcp)
                    except BlockingIOError:
                        sent = 0
                    if tap is not None and sent:
                        tap(bytes(to_tcp[:sent]))
                    # a memoryview: what is left is not copied again
                    to_tcp = memoryview(to_tcp)[sent:] if sent < len(to_tcp) else b""
                # tcp -> TLS -> local: everything decryptable, up to CHUNK, per pass
                if ev_t & POLLIN and rt & (POLLIN | GONE):
                    try:
                        k = tcp.recv_into(raw_mv)
                    except BlockingIOError:
                        k = -1
                    if k == 0:
                        # a peer without close_notify (killed): the frame
                        # reader reports it as any lost connection
                        remote_eof = True
                    elif k > 0:
                        self._in.write(raw_mv[:k])
                    to_local = self._decrypt(in_mv)
                    if to_local is None and self.peer_closed:
                        remote_eof = True
                    extra = bio_out.read()      # post-handshake messages (KeyUpdate) answered
                    if extra:
                        to_tcp = bytes(to_tcp) + extra
                if to_local is not None and (ri & (POLLOUT | GONE) or not ev_i & POLLOUT):
                    try:
                        sent = inner.send(to_local)
                    except BlockingIOError:
                        sent = 0
                    except OSError:
                        local_eof, to_local, sent = True, None, 0   # nobody reads any more
                    if to_local is not None:
                        to_local = to_local[sent:] if sent < len(to_local) else None
                    if to_local is None and not remote_eof and (self._in.pending or obj.pending()):
                        to_local = self._decrypt(in_mv)     # what the BIO still holds
                    if to_local is None and self.peer_closed:
                        remote_eof = True
                if remote_eof and to_local is None and not local_shut:
                    local_shut = True
                    try:
                        inner.shutdown(socket.SHUT_WR)      # EOF for the reader after the last byte
                    except OSError:
                        pass
        except mod.SSLError as e:
            self._fail(_post_handshake_reason(e))
            try:                    # our alert, best effort: the peer learns why
                data = bio_out.read()
                if data:
                    tcp.send(data)
            except OSError:
                pass
        except OSError as e:
            if not self._closed:
                self._fail(f"the connection failed: {e}")
        finally:
            # the local end sees EOF: its reader stops, the error is in self.error
            try:
                inner.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._close_all()

    def _decrypt(self, mv):
        """Plaintext the TLS object holds, up to len(mv), as a slice of mv; None if none."""
        mod = ssl
        filled = 0
        size = len(mv)
        obj = self.obj
        while filled < size:
            try:
                k = obj.read(size - filled, mv[filled:])
            except mod.SSLWantReadError:
                break
            except mod.SSLZeroReturnError:
                self.peer_closed = True
                break
            if k == 0:      # _ssl says close_notify so (no data would be SSLWantReadError)
                self.peer_closed = True
                break
            filled += k
        return mv[:filled] if filled else None


def _post_handshake_reason(e):
    return _post_handshake_text(getattr(e, "reason", None) or str(e))


def _post_handshake_text(text):
    low = str(text).lower().replace("_", " ")
    if "alert" in low and ("certificate" in low or "unknown ca" in low or "access denied" in low):
        # a TLS 1.3 client hears the server refuse its certificate on its first read
        return _alert_text(text, low)
    if "unexpected message" in low or "renegotiat" in low or "no renegotiation" in low:
        return f"the peer sent a handshake message after the handshake ({text}): renegotiation is refused"
    return f"a TLS record after the handshake was not valid ({text}): garbage or tampering on the connection"


def explain(relay, exc):
    """The exception a connection over ``relay`` reports: the relay's
    TLSError beats what the frame reader saw (EOF) when the relay ended
    first; a clean TLS close in the middle of a frame is said as such."""
    if relay is None:
        return exc
    if relay.error is not None:
        return relay.error
    if relay.peer_closed and exc is not None and "truncated frame" in str(exc):
        return TLSError(relay.peer, f"the peer closed TLS (close_notify) in the middle of a frame: {exc}")
    return exc


# ------------------------------------------------------------ a plain TLS socket

def handshake_socket(sock, config: TLSConfig, *, server_side: bool, peer, deadline=None):
    """Mutual TLS 1.3 straight on the blocking socket ``sock``: returns the
    ``ssl.SSLSocket`` that replaces it (``sock`` is detached from its
    descriptor). For connections that carry a few small messages, such as the
    control endpoint of ``pyflowbuf savepoint`` / ``stop``, where a relay thread
    would cost more than it saves. The handshake finishes by ``deadline``
    (time.monotonic(); None: the socket's own timeout) and the pin is checked;
    else TLSError naming the peer and the reason, with the socket closed.

    Example::

        sock = handshake_socket(conn, tls, server_side=True, peer=peer,
                                deadline=time.monotonic() + 10)
    """
    mod = require_ssl()
    ctx = config.context(server_side)
    ssock = ctx.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False)
    try:
        try:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("deadline passed")
                ssock.settimeout(left)
            ssock.do_handshake()    # (_ssl bounds the whole handshake by one timeout: no trickling past it)
        except socket.timeout:
            raise TLSError(peer, "the TLS handshake did not finish in time (the handshake timeout): a peer "
                                 "that sent no or only part of a handshake, or a client without tls= on a "
                                 "TLS port") from None
        except (mod.SSLEOFError, ConnectionError):
            raise TLSError(peer, "the connection closed in the middle of the TLS handshake (a truncated "
                                 "handshake, or the peer refused ours)") from None
        except mod.SSLError as e:
            raise TLSError(peer, _reason(e, server_side)) from None
        except OSError as e:
            raise TLSError(peer, f"the connection failed during the TLS handshake: {e}") from None
        der = ssock.getpeercert(binary_form=True)
        if der is None:
            raise TLSError(peer, "the peer presented no certificate (mutual TLS needs one on both sides)")
        config.check_peer(der, peer)
        ssock.settimeout(None)
    except BaseException:
        ssock.close()
        raise
    return ssock


class SSLStream:
    """Python's ``ssl`` on the TCP socket itself, for a connection that
    carries few messages but is used from several threads at once: the
    control channel between a driver and its workers (one reader, several
    writers). No thread of its own, unlike ``TLSRelay``.

    ``ssock`` is the ``ssl.SSLSocket`` after its handshake
    (``handshake_socket``). OpenSSL's ``SSL`` object is not safe for two
    threads at once, so every call into it is made under a lock, on a
    non-blocking socket: a thread that must wait releases the lock and waits
    in ``poll()`` on the descriptor, so a writer waiting for a full socket
    never stops the reader. Python's ssl reads no more of the socket than the
    record it decrypts (no read-ahead), so when the descriptor is not
    readable no message waits inside TLS either: ``select``, ``poll`` and
    ``multiprocessing.connection.wait`` on ``fileno()`` work as on a plain
    socket (``pending()`` holds what is left of a record half read).

    A socket's face for the HMAC handshake and the channel: ``recv_into``,
    ``sendall``, ``settimeout``/``gettimeout`` (``socket.timeout`` at the
    end), ``shutdown`` (close_notify first, best effort), ``close``,
    ``fileno``. A TLS failure after the handshake is raised as ``TLSError``
    naming the peer and kept in ``error``.

    Example::

        stream = SSLStream(handshake_socket(sock, tls, server_side=False, peer=address,
                                            deadline=time.monotonic() + 10), address)
        stream.sendall(b"hello")
    """

    def __init__(self, ssock, peer):
        self._s = ssock
        self.peer = peer
        self.error = None
        self._lock = threading.Lock()           # the SSL object: one call at a time
        self._write_lock = threading.Lock()     # one sendall at a time: its records stay together
        self._timeout = ssock.gettimeout()
        self._shut = False
        self._closed = False
        ssock.setblocking(False)

    def fileno(self):
        return self._s.fileno()

    def settimeout(self, value):
        self._timeout = value

    def gettimeout(self):
        return self._timeout

    def pending(self) -> int:
        """Plaintext bytes decrypted and not read yet."""
        with self._lock:
            return 0 if self._closed else self._s.pending()

    def _failed(self, e):
        if self.error is None:
            self.error = TLSError(self.peer, _post_handshake_reason(e))
        return self.error

    def _wait(self, events, deadline):
        ms = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out")
            ms = left * 1000
        poller = select.poll()
        try:
            poller.register(self._s.fileno(), events)
        except (ValueError, OSError):
            pass        # closed meanwhile: the next call under the lock says so
        else:
            poller.poll(ms)

    def recv_into(self, buffer, nbytes=0):
        mod = ssl
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            with self._lock:
                if self._closed:
                    raise OSError(errno.EBADF, "the TLS connection is closed")
                if self._shut:
                    return 0
                try:
                    return self._s.recv_into(buffer, nbytes or None)   # (None: all of buffer)
                except mod.SSLWantReadError:
                    want = select.POLLIN
                except mod.SSLWantWriteError:
                    want = select.POLLOUT
                except mod.SSLEOFError:
                    return 0        # the peer went without close_notify: the caller sees the end
                except mod.SSLError as e:
                    raise self._failed(e) from None
            self._wait(want, deadline)

    def sendall(self, data):
        mod = ssl
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        with memoryview(data) as whole, self._write_lock:
            view = whole.cast("B")
            pos, total = 0, len(view)
            while pos < total:
                # after a "want", SSL_write must be called again with the same bytes
                chunk = view[pos:pos + CHUNK]
                sent, want = 0, 0
                with self._lock:
                    if self._closed or self._shut:
                        raise BrokenPipeError(errno.EPIPE, "the TLS connection is closed")
                    try:
                        sent = self._s.send(chunk)
                    except mod.SSLWantWriteError:
                        want = select.POLLOUT
                    except mod.SSLWantReadError:
                        want = select.POLLIN
                    except mod.SSLError as e:
                        raise self._failed(e) from None
                if sent:
                    pos += sent
                else:
                    self._wait(want, deadline)

    def shutdown(self, how):
        """close_notify (best effort, never waiting), then ``socket.shutdown``:
        a thread waiting on the connection wakes and sees its end."""
        mod = ssl
        with self._lock:
            if not self._closed and not self._shut:
                self._shut = True
                try:
                    self._s.unwrap()
                except (mod.SSLError, OSError, ValueError):
                    pass
        # the plain socket's shutdown: SSLSocket's would drop the SSL object under a reader
        socket.socket.shutdown(self._s, how)

    def close(self):
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._s.close()


# ------------------------------------------------------------ in the core

def _explain_core(text, in_handshake, server_side):
    """What an OpenSSL reason from the core (netio.TLSSocket) means here."""
    if text == "EOF":
        return "the connection closed in the middle of the TLS handshake (a truncated handshake, or the peer " \
               "refused ours)"
    if text == "TIMEOUT":
        return "the TLS handshake did not finish in time (the handshake timeout): a peer that sent no or only " \
               "part of a handshake, or a client without tls= on a TLS port"
    if text == "NOTLS":
        return "the compiled core has no libssl"
    if in_handshake:
        return _reason_text(text, None, server_side)
    return _post_handshake_text(text)


class CoreTLS:
    """One connection's TLS in the compiled core: ``sock`` (also ``local``)
    is the ``netio.TLSSocket`` the connection's Wire, pumps and FrameReader
    use in place of ``tcp``. The same face as TLSRelay, so a connection
    holds either: ``handshake``, ``start``, ``close``, ``release``,
    ``error``, ``peer_closed``."""

    alive = False       # no thread of its own

    def __init__(self, tcp, config: TLSConfig, *, server_side: bool, peer):
        self.tcp = tcp
        self.config = config
        self.server_side = server_side
        self.peer = peer
        self.sock = self.local = netio.TLSSocket(
            tcp, config.core_context(server_side), peer,
            functools.partial(_explain_core, server_side=server_side))
        self.handshake_s = None

    def handshake(self, deadline=None):
        """The TLS handshake by ``deadline`` (time.monotonic()), then the
        pinned fingerprint. Raises TLSError naming the peer and the reason."""
        t0 = time.perf_counter()
        self.sock.handshake(deadline)
        der = self.sock.peer_certificate()
        if der is None:
            raise TLSError(self.peer, "the peer presented no certificate (mutual TLS needs one on both sides)")
        self.config.check_peer(der, self.peer)
        self.handshake_s = time.perf_counter() - t0

    @property
    def cipher(self):
        return self.sock.cipher

    def start(self):
        pass

    def join(self, timeout=None):
        pass

    def close(self):
        """Wake every thread waiting on the connection."""
        try:
            self.tcp.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def release(self):
        try:
            self.sock.close()
        except OSError:
            pass

    @property
    def error(self):
        return self.sock.error

    @property
    def peer_closed(self):
        return self.sock.peer_closed


_warned_relay = False


def in_core() -> bool:
    """Whether TLS runs in the compiled core (else in the relay thread)."""
    return netio.HAVE_TLS and os.environ.get("PYFLOWBUF_TLS_RELAY", "") in ("", "0")


def wrap(tcp, config: TLSConfig, *, server_side: bool, peer):
    """The TLS of one connection over ``tcp`` (before its handshake): a
    CoreTLS, or a TLSRelay where the core has no libssl. The connection
    then uses ``.local`` as its socket."""
    global _warned_relay
    if in_core():
        return CoreTLS(tcp, config, server_side=server_side, peer=peer)
    if not _warned_relay:
        _warned_relay = True
        why = ("PYFLOWBUF_TLS_RELAY is set" if netio.HAVE_TLS else
               "the compiled core was built without libssl (no OpenSSL headers at build time)")
        log.warning("pyflowbuf.net: %s, so TLS runs in a relay thread per connection, several times slower: "
                    "install libssl-dev (or OpenSSL's headers) and rebuild pyflowbuf", why)
    return TLSRelay(tcp, config, server_side=server_side, peer=peer)
