"""The control endpoint of a job run with ``tls=`` (pyflowbuf/cluster/control.py)
and ``pyflowbuf savepoint`` / ``pyflowbuf stop`` against it
(pyflowbuf/cli/control.py): mutual TLS 1.3 first, the HMAC challenge inside
it. ``tls=True`` hands the command a client certificate in the private
control file; a job with its own ``TLSConfig`` takes the ``--tls-*`` options.
Hostile or mistaken clients are refused with a TLSError naming the peer and
the reason, and the job runs on. Every wait is for a condition."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap

import pytest

import pyflowbuf as fb
from cli_helpers import ENV, cli
from pipeline_helpers import cancel_and_join, open_sockets, wait_for
from pyflowbuf.cluster import control
from pyflowbuf.errors import TLSError
from pyflowbuf.net import TLSConfig
from pyflowbuf.net import tls as T

pytestmark = pytest.mark.timeout(180)

KEYS = 10


def count(key, n, state):
    state["n"] = state.get("n", 0) + 1
    return [f"{key},{state['n']}"]


def start(tmp_path, tls, **kw):
    """A job in this process that runs until stopped, with a control endpoint."""
    env = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "ck"),
                         control_port=0, tls=tls, **kw)
    (env.from_sequence(0, 10_000_000, rate_limit=2000).uid("numbers")
        .key_by(lambda x: x % KEYS).process(count).uid("counts").write_text(str(tmp_path / "out")))
    return env, env.execute_async()


@contextlib.contextmanager
def running(tmp_path, tls, **kw):
    env, job = start(tmp_path, tls, **kw)
    try:
        yield env, job
    finally:
        if not job.done:
            cancel_and_join(job, failure_ok=True)


def the_file(tmp_path) -> dict:
    return control.read_control_file(tmp_path / "ck")


def refusal(job, match):
    """The endpoint's recorded refusal (peer, TLSError) whose reason matches."""
    def found():
        return [(p, e) for p, e in list(job.control.errors) if isinstance(e, TLSError) and match in e.reason]
    return wait_for(found, lambda: f"a TLSError with {match!r} in {job.control.errors}", job=job)[0]


def committed_prefixes(out_dir) -> dict:
    """key -> how many counts it committed; each key's counts must be 1..m,
    each once (exactly once up to the stop)."""
    per_key: dict = {}
    for path in glob.glob(os.path.join(out_dir, "part-*")):
        with open(path) as f:
            for line in f.read().splitlines():
                k, c = line.split(",")
                per_key.setdefault(k, []).append(int(c))
    for k, counts in per_key.items():
        assert sorted(counts) == list(range(1, len(counts) + 1)), (k, sorted(counts)[:20])
    return {k: len(c) for k, c in per_key.items()}


@pytest.fixture(scope="module")
def user_pki(tmp_path_factory):
    """The user's own files: a CA, the job's certificate, a CLI's certificate
    of the same CA, and one of another CA."""
    d = tmp_path_factory.mktemp("pki")
    ca = T.JobCertificates("user")
    other = T.JobCertificates("stranger")
    files = {}
    for name, cfg in (("node", ca.for_attempt(0)), ("cli", ca.for_attempt(1)), ("stranger", other.for_attempt(0))):
        for part in ("cert", "key", "ca"):
            path = d / f"{name}.{part}.pem"
            path.write_bytes(getattr(cfg, part))
            files[f"{name}.{part}"] = str(path)
        files[f"{name}.fingerprint"] = sorted(cfg.fingerprints)[0]
    return files


# ---------------------------------------------------------------- tls=True

def test_a_tls_true_job_hands_a_client_certificate_in_its_private_file_and_nowhere_else(tmp_path, caplog):
    caplog.set_level("DEBUG")
    with running(tmp_path, True) as (env, job):
        path = tmp_path / "ck" / control.CONTROL_FILE
        info = the_file(tmp_path)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        entry = info["tls"]
        assert entry["mode"] == "generated" and "PRIVATE KEY" in entry["key"] and len(entry["fingerprint"]) == 1
        assert job.control.tls is not None
        client = control.client_tls(info)
        answer = control.request(control.control_address(info), control.control_secret(info),
                                 {"op": "savepoint", "path": str(tmp_path / "sp")}, tls=client)
        assert answer["ok"] and os.path.exists(tmp_path / "sp" / "_metadata")
        key = entry["key"].strip().splitlines()[1]        # a line of the key's base64
        wait_for(lambda: any(c["status"] == "completed" and not c["savepoint"] for c in env.checkpoints()),
                 "a periodic checkpoint", job=job)
        cancel_and_join(job)
    assert not path.exists()            # the certificate and key go with the job
    for f in glob.glob(str(tmp_path / "**" / "*"), recursive=True):
        if os.path.isfile(f):
            with open(f, "rb") as fh:
                data = fh.read()
            assert b"PRIVATE KEY" not in data and key.encode() not in data, f
    assert key not in caplog.text and "PRIVATE KEY" not in caplog.text


def test_savepoint_and_stop_of_a_tls_job_run_by_the_cli(tmp_path, monkeypatch):
    """`pyflowbuf run --workers 2` of a job with tls=True (TLS on its data,
    control channel and control endpoint), then `pyflowbuf savepoint` and
    `pyflowbuf stop` from another process, with nothing but CHECKPOINT_DIR."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "job.py").write_text(textwrap.dedent(f"""\
        import pyflowbuf as fb

        def count(key, n, state):
            state["n"] = state.get("n", 0) + 1
            return [f"{{key}},{{state['n']}}"]

        env = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir="ck", tls=True)
        (env.from_sequence(0, 10_000_000, rate_limit=2000).uid("numbers")     # runs until stopped
            .key_by(lambda x: x % {KEYS})
            .process(count).uid("counts")
            .write_text("out"))
        """))
    proc = subprocess.Popen([sys.executable, "-m", "pyflowbuf", "run", "job.py", "--control-port", "0",
                             "--workers", "2"], cwd=tmp_path, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.exists(tmp_path / "ck" / control.CONTROL_FILE), "control file", proc=proc)
        wait_for(lambda: glob.glob("ck/chk-*/_metadata"), "a checkpoint", proc=proc)
        code, out, err = cli("savepoint", "ck", "sp", "--json")
        assert code == 0, err
        answer = json.loads(out)
        assert answer["tls"] is True and answer["path"] == str(tmp_path / "sp") and not answer["stopped"]
        assert os.path.exists(tmp_path / "sp" / "_metadata") and proc.poll() is None
        res = subprocess.run([sys.executable, "-m", "pyflowbuf", "stop", "ck", "--savepoint", "sp2"], cwd=tmp_path,
                             env=ENV, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "stopped job 'job'" in res.stdout and str(tmp_path / "sp2") in res.stdout
        _, job_err = proc.communicate(timeout=120)
        assert proc.returncode == 0, job_err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "(mutual TLS)" in job_err and "stopped with a savepoint in" in job_err
    assert "PRIVATE KEY" not in job_err
    assert not os.path.exists(tmp_path / "ck" / control.CONTROL_FILE)
    assert os.path.exists(tmp_path / "sp2" / "_metadata")
    assert sum(committed_prefixes("out").values()) > 0


def test_a_plaintext_client_is_refused_naming_the_peer_and_the_job_runs_on(tmp_path, monkeypatch):
    monkeypatch.setattr(control, "HANDSHAKE_TIMEOUT", 1.0)
    with running(tmp_path, True) as (env, job):
        info = the_file(tmp_path)
        address, secret = control.control_address(info), control.control_secret(info)
        # a client without TLS waits for the challenge; the endpoint waits for a
        # ClientHello, gives up at its handshake timeout and says why
        with pytest.raises(control.ControlError, match="--tls-cert FILE") as exc:
            control.request(address, secret, {"op": "savepoint"})
        assert "closed the connection" in str(exc.value)
        peer, err = refusal(job, "handshake timeout")
        assert peer[0] == "127.0.0.1" and "client without tls=" in err.reason and f"{peer[1]}" in str(err)
        # one that speaks first, in the clear: refused at once
        junk = socket.create_connection(address, timeout=10)
        mine = junk.getsockname()
        junk.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(OSError):
            while junk.recv(4096):
                pass
        junk.close()
        peer, err = refusal(job, "does not speak TLS")
        assert tuple(peer) == tuple(mine)
        # the CLI with only --address and a bare secret: told what to pass
        (tmp_path / "secret").write_text(secret.hex())
        code, _, err = cli("savepoint", "--address", f"{address[0]}:{address[1]}", "--secret-file",
                           tmp_path / "secret")
        assert code == 1 and "--tls-cert" in err and "control file" in err and err.count("\n") == 1
        assert not job.done and not glob.glob(str(tmp_path / "ck" / "savepoints" / "*"))
        # a copy of the control file carries the client certificate: that works
        code, out, err = cli("savepoint", "--address", f"{address[0]}:{address[1]}", "--secret-file",
                             tmp_path / "ck" / control.CONTROL_FILE, tmp_path / "sp", "--json")
        assert code == 0, err
        assert json.loads(out)["tls"] is True and not job.done


def test_a_client_certificate_of_another_ca_is_refused_naming_the_peer_and_the_job_runs_on(tmp_path):
    with running(tmp_path, True) as (env, job):
        info = the_file(tmp_path)
        address, secret = control.control_address(info), control.control_secret(info)
        good = control.client_tls(info)
        stranger = T.JobCertificates("another job").for_attempt(0)
        sockets = open_sockets()
        # trusts the job's endpoint, presents a certificate of another CA: the endpoint refuses it
        wrong_cert = TLSConfig(stranger.cert, stranger.key, good.ca, fingerprint=sorted(good.fingerprints))
        with pytest.raises(control.ControlError, match="refused this client's certificate") as exc:
            control.request(address, secret, {"op": "savepoint"}, tls=wrong_cert)
        assert exc.value.error == "TLSError"
        peer, err = refusal(job, "unable to get local issuer certificate")
        assert peer[0] == "127.0.0.1" and "this side refused the peer's certificate" in err.reason
        # all of another job's TLS: the client refuses the endpoint, the endpoint hears why
        with pytest.raises(control.ControlError, match="TLS with the control endpoint at .* failed") as exc:
            control.request(address, secret, {"op": "savepoint"}, tls=stranger)
        assert exc.value.error == "TLSError"
        peer, err = refusal(job, "the peer refused our certificate")
        assert "ALERT" in err.reason
        # the right certificate and a wrong secret: the HMAC challenge still runs inside TLS
        with pytest.raises(control.ControlError, match="refused the secret"):
            control.request(address, os.urandom(32), {"op": "savepoint"}, tls=good)
        wait_for(lambda: job.control.refused == 3, "the endpoint to count the refusal", job=job)
        assert isinstance(job.control.errors[-1][1], fb.errors.AuthenticationError)
        assert not job.done
        wait_for(lambda: open_sockets() <= sockets, lambda: f"sockets: {open_sockets()} now, {sockets} before", job=job)
        answer = control.request(address, secret, {"op": "savepoint", "path": str(tmp_path / "sp")}, tls=good)
        assert answer["ok"]



def test_tls_options_on_a_tls_true_or_plaintext_job_are_usage_errors(tmp_path, user_pki):
    flags = ["--tls-cert", user_pki["cli.cert"], "--tls-key", user_pki["cli.key"], "--tls-ca", user_pki["cli.ca"]]
    with running(tmp_path / "a", True):
        code, _, err = cli("savepoint", tmp_path / "a" / "ck", *flags)
        assert code == 2 and "tls=True" in err and "drop the --tls-* options" in err
    with running(tmp_path / "b", None) as (env, job):
        assert the_file(tmp_path / "b")["tls"] is None and job.control.tls is None
        code, _, err = cli("savepoint", tmp_path / "b" / "ck", *flags)
        assert code == 2 and "without tls=" in err


@pytest.mark.parametrize("argv, message", [
    (["--tls-key", "k.pem"], "--tls-cert FILE and --tls-ca FILE go together"),
    (["--tls-cert", "c.pem"], "--tls-cert FILE and --tls-ca FILE go together"),
    (["--tls-cert", "c.pem", "--tls-ca", "a.pem", "--tls-fingerprint", "12"], "64 hex digits"),
])
def test_incomplete_tls_options_exit_with_2(tmp_path, argv, message):
    (tmp_path / "s").write_text("ab" * 32)
    code, _, err = cli("stop", "--address", "127.0.0.1:1", "--secret-file", tmp_path / "s", *argv)
    assert code == 2 and message in err, err


# ---------------------------------------------------------------- tls=TLSConfig(...): the user's files

def test_a_job_with_its_own_certificates_takes_the_clis_tls_options(tmp_path, user_pki):
    tls = TLSConfig(user_pki["node.cert"], user_pki["node.key"], user_pki["node.ca"])
    with running(tmp_path, tls) as (env, job):
        info = the_file(tmp_path)
        assert info["tls"] == {"mode": "own"}           # no certificate or key of the user's in the file
        ck = tmp_path / "ck"
        # without the options: exit 2, saying what to pass
        code, _, err = cli("savepoint", ck)
        assert code == 2 and "--tls-cert FILE --tls-ca FILE" in err and "--tls-key FILE" in err
        # a certificate of another CA: refused, the job runs on
        code, _, err = cli("savepoint", ck, "--tls-cert", user_pki["stranger.cert"], "--tls-key",
                           user_pki["stranger.key"], "--tls-ca", user_pki["node.ca"])
        assert code == 1 and "refused this client's certificate" in err
        peer, e = refusal(job, "unable to get local issuer certificate")
        assert peer[0] == "127.0.0.1"
        # the right CA, the job's certificate pinned wrongly: the CLI refuses the endpoint
        flags = ["--tls-cert", user_pki["cli.cert"], "--tls-key", user_pki["cli.key"], "--tls-ca", user_pki["cli.ca"]]
        code, _, err = cli("savepoint", ck, *flags, "--tls-fingerprint", "00" * 32)
        assert code == 1 and "not the pinned one" in err
        # a key file that is not there is said before connecting
        code, _, err = cli("savepoint", ck, "--tls-cert", user_pki["cli.cert"], "--tls-key", tmp_path / "nope",
                           "--tls-ca", user_pki["cli.ca"])
        assert code == 1 and "--tls-cert/--tls-key/--tls-ca" in err
        assert not job.done
        code, out, err = cli("savepoint", ck, tmp_path / "sp", *flags, "--tls-fingerprint",
                             user_pki["node.fingerprint"], "--json")
        assert code == 0, err
        assert json.loads(out)["tls"] is True and os.path.exists(tmp_path / "sp" / "_metadata")
        code, out, err = cli("stop", ck, "--savepoint", tmp_path / "sp2", *flags, "--json")
        assert code == 0, err
        assert json.loads(out)["stopped"] and job.done
    assert not (tmp_path / "ck" / control.CONTROL_FILE).exists()


def test_a_bad_certificate_file_of_the_job_is_refused_before_it_runs(tmp_path):
    (tmp_path / "bad.pem").write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    env = fb.Environment(parallelism=1, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "ck"),
                         control_port=0, tls=TLSConfig(tmp_path / "bad.pem", tmp_path / "bad.pem",
                                                       tmp_path / "bad.pem"))
    env.from_sequence(0, 10).collect()
    with pytest.raises(fb.errors.TLSUnavailableError, match="cannot load the certificate"):
        env.execute(60)
    assert not (tmp_path / "ck" / control.CONTROL_FILE).exists()
