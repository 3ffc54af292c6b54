"""``pyflowbuf savepoint`` and ``pyflowbuf stop``: act on a running job
through its control endpoint (``pyflowbuf.cluster.control``).

The job is found by the control file it writes into its checkpoint_dir
(``CHECKPOINT_DIR`` names the directory or the file), or by ``--address
HOST:PORT --secret-file FILE`` (a file holding the secret in hexadecimal, or
a copy of the control file), e.g. for a job on another host.

A job run with ``tls=`` has a mutual TLS endpoint. ``tls=True``: its control
file carries a client certificate, used from there (or from a copy given as
``--secret-file``). ``tls=TLSConfig(...)``: the user's own files, given as
``--tls-cert FILE --tls-key FILE --tls-ca FILE`` (``--tls-fingerprint HEX``
pins the job's certificate)."""
from __future__ import annotations

import argparse
import json
import os

from pyflowbuf.cli import render
from pyflowbuf.cli.checkpoints import CliError
from pyflowbuf.cluster import control
from pyflowbuf.errors import TLSUnavailableError
from pyflowbuf.net.tls import TLSConfig

# what the client adds to --timeout before it gives up waiting for the answer:
# the job itself gives up after --timeout and answers with the reason
_ANSWER_MARGIN_S = 30.0


class UsageError(CliError):
    """A combination of arguments that cannot work (exit code 2)."""


def add_commands(sub, common, as_json) -> None:
    """The ``savepoint`` and ``stop`` subcommands of the parser."""
    where = ("the running job's checkpoint_dir (it holds the control file the job writes while it runs with "
             "control_port=), or that control file")
    sp = sub.add_parser(
        "savepoint", parents=[common, as_json], help="take a savepoint of a running job",
        usage="pyflowbuf savepoint (CHECKPOINT_DIR | --address HOST:PORT --secret-file FILE) [PATH] "
              "[--timeout S] [--tls-cert FILE [--tls-key FILE] --tls-ca FILE [--tls-fingerprint HEX]] [--json]",
        description="Take a savepoint of a running job (job.savepoint(PATH)); the job runs on. Resume from it "
                    "with `pyflowbuf run JOB --restore PATH` or execute(restore_from=PATH). The job must run "
                    "with control_port= (or `pyflowbuf run --control-port`).")
    sp.add_argument("target", nargs="?", metavar="CHECKPOINT_DIR", help=where)
    sp.add_argument("path", nargs="?", metavar="PATH",
                    help="where the savepoint goes (a new or empty directory, or an fsspec URL, on the job's "
                         "side); default <checkpoint_dir>/savepoints/savepoint-<time>")
    st = sub.add_parser(
        "stop", parents=[common, as_json], help="stop a running job with a final savepoint",
        usage="pyflowbuf stop (CHECKPOINT_DIR | --address HOST:PORT --secret-file FILE) [--savepoint PATH] "
              "[--drain] [--timeout S] [--tls-cert FILE [--tls-key FILE] --tls-ca FILE [--tls-fingerprint HEX]] "
              "[--json]",
        description="Stop a running job with a final savepoint (job.stop(savepoint=PATH)): its sources stop, "
                    "the savepoint is taken, the sinks commit what it covers, and the job ends; nothing runs "
                    "after the savepoint. Resuming from it loses and repeats nothing. If the savepoint fails "
                    "the job runs on (exit code 1).")
    st.add_argument("target", nargs="?", metavar="CHECKPOINT_DIR", help=where)
    st.add_argument("--savepoint", metavar="PATH", dest="path",
                    help="where the final savepoint goes; default <checkpoint_dir>/savepoints/savepoint-<time>")
    st.add_argument("--drain", action="store_true",
                    help="end event time before the savepoint (job.stop(drain=True)): every window fires once, "
                         "inside it; for a job ended for good (restored, it starts at the end of event time)")
    for p in (sp, st):
        p.add_argument("--address", metavar="HOST:PORT", help="the job's control endpoint, instead of a control file")
        p.add_argument("--secret-file", metavar="FILE",
                       help="with --address: a file holding the endpoint's secret (hexadecimal), or a copy of the "
                            "job's control file (for a job with tls=True, a copy also carries the client "
                            "certificate its TLS endpoint takes)")
        tls = p.add_argument_group(
            "mutual TLS", "A job run with tls= has a mutual TLS control endpoint (the secret's challenge runs "
                          "inside it). tls=True: nothing to pass, the control file carries a client certificate. "
                          "tls=TLSConfig(...) (the job's own files): pass a certificate of the CA the job trusts.")
        tls.add_argument("--tls-cert", metavar="FILE", help="this client's certificate (PEM; its chain may follow)")
        tls.add_argument("--tls-key", metavar="FILE", help="its private key (PEM), unless --tls-cert holds it")
        tls.add_argument("--tls-ca", metavar="FILE", help="the CA that signed the job's certificate (PEM)")
        tls.add_argument("--tls-fingerprint", metavar="HEX", action="append",
                         help="the SHA-256 fingerprint the job's certificate must have (hex, colons allowed; "
                              "repeat for several)")
        p.add_argument("--timeout", type=_seconds, metavar="S",
                       help="seconds the savepoint may take (default: the job's checkpoint_timeout)")


def _seconds(text: str) -> float:
    try:
        s = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < s < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return s


def parse_address(text: str) -> tuple:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6)."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--address takes HOST:PORT (e.g. 127.0.0.1:6123), got {text!r}")
    return host, int(port)


def read_secret_file(path: str) -> bytes:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CliError(f"--secret-file {path}: {e.strerror or e}") from None
    try:
        info = json.loads(text)
    except ValueError:
        info = None
    if isinstance(info, dict):
        if "secret" not in info:
            raise CliError(f"--secret-file {path}: a JSON file without a \"secret\" field")
        text = info["secret"]
    try:
        return control.parse_secret(text, f"--secret-file {path}")
    except control.ControlError as e:
        raise CliError(str(e)) from None


def _secret_source(path: str) -> dict:
    """--secret-file as a control file's fields: a copy of the control file
    as it is (its TLS entry too), a bare secret as {"secret": ...}."""
    secret = read_secret_file(path)
    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        info = None
    if not isinstance(info, dict):
        info = {}
    return {**info, "secret": secret.hex(), "file": path, "copy": True}


def tls_from_args(args):
    """The TLSConfig of --tls-cert/--tls-key/--tls-ca/--tls-fingerprint, loaded
    (a file that cannot be read is said now); None without them."""
    if not any((args.tls_cert, args.tls_key, args.tls_ca, args.tls_fingerprint)):
        return None
    if args.tls_cert is None or args.tls_ca is None:
        raise UsageError("--tls-cert FILE and --tls-ca FILE go together (with --tls-key FILE unless the cert file "
                         "holds the key, and --tls-fingerprint HEX to pin the job's certificate)")
    try:
        tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, fingerprint=args.tls_fingerprint)
    except (TypeError, ValueError) as e:
        raise UsageError(f"--tls-fingerprint: {e}") from None
    try:
        tls.context(False)
    except TLSUnavailableError as e:
        raise CliError(f"--tls-cert/--tls-key/--tls-ca: {e}") from None
    return tls


def choose_tls(args, info: dict):
    """What the client presents: the --tls-* files for a job with its own
    TLSConfig (or an endpoint known only by --address and a bare secret), the
    control file's certificate for tls=True, None for a plaintext endpoint."""
    given = tls_from_args(args)
    mode = (info.get("tls") or {}).get("mode") if isinstance(info.get("tls"), dict) else None
    where = info.get("file")
    if given is not None:
        if mode == "generated":
            raise UsageError(f"job {info.get('job')!r} runs with tls=True: {where} carries the client certificate "
                             "its endpoint takes (and pins); drop the --tls-* options")
        if mode is None and "tls" in info:
            raise UsageError(f"job {info.get('job')!r} runs without tls=: its control endpoint is not TLS; drop the "
                             "--tls-* options")
        return given
    try:
        return control.client_tls(info)
    except control.TLSCertificateNeeded as e:
        raise UsageError(str(e)) from None
    except control.ControlError as e:
        raise CliError(str(e)) from None


def find_job(args) -> tuple:
    """(address, secret, what the control file says (with --address: what
    --secret-file says), the TLSConfig to present or None)."""
    if args.address is not None:
        if args.secret_file is None:
            raise UsageError("--address needs --secret-file FILE: the endpoint takes only clients that know its secret")
        address = parse_address(args.address)
        info = _secret_source(args.secret_file)
        return address, bytes.fromhex(info["secret"]), info, choose_tls(args, info)
    if args.secret_file is not None:
        raise UsageError("--secret-file goes with --address; the control file in CHECKPOINT_DIR holds the secret")
    if args.target is None:
        raise UsageError("name the job: CHECKPOINT_DIR (its checkpoint_dir, which holds its control file), or "
                         "--address HOST:PORT --secret-file FILE")
    try:
        info = control.read_control_file(args.target)
        control.check_alive(info)
        address, secret = control.control_address(info), control.control_secret(info)
    except control.ControlError as e:
        raise CliError(str(e)) from None
    return address, secret, info, choose_tls(args, info)


def _job_path(path):
    """A local savepoint path as the caller means it: relative to where the
    command runs (the job's working directory may be another)."""
    if path is None or "://" in path or "::" in path:
        return path
    return os.path.abspath(path)


def run(args, op: str) -> int:
    if args.address is not None and args.target is not None:
        if op == "stop" or args.path is not None:
            raise UsageError("with --address, give no CHECKPOINT_DIR (the address says where the job is)")
        args.target, args.path = None, args.target       # with --address the one positional is PATH
    address, secret, info, tls = find_job(args)
    timeout = args.timeout
    message = {"op": op, "path": _job_path(args.path), "timeout": timeout}
    if getattr(args, "drain", False):
        message["drain"] = True
    try:
        answer = control.request(address, secret, message,
                                 timeout=None if timeout is None else timeout + _ANSWER_MARGIN_S, tls=tls)
    except control.ControlError as e:
        where = f" (control file {info['file']})" if info.get("file") and not info.get("copy") else ""
        raise CliError(f"{e}{where}") from None
    if not answer.get("ok"):
        raise CliError(f"the job did not take the savepoint: {answer.get('error')}: {answer.get('message')}")
    host, port = address
    result = {"command": op, "job": answer.get("job"), "address": f"{host}:{port}", "path": answer.get("path"),
              "checkpoint_id": answer.get("checkpoint_id"), "stopped": op == "stop", "tls": tls is not None}
    if args.json:
        render.emit_json(result)
        return 0
    render.table(f"{'stopped job' if op == 'stop' else 'savepoint of job'} {result['job']!r} at {result['address']}",
                 [("checkpoint", "right"), ("savepoint", "left")],
                 [["" if result["checkpoint_id"] is None else str(result["checkpoint_id"]), str(result["path"])]])
    print(f"resume with: pyflowbuf run JOB --restore {result['path']}  (or execute(restore_from=...))")
    return 0
