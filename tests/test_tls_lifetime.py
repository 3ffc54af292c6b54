"""Certificate lifetime (pyflowbuf.net.tls): ``tls=True``'s CA and
certificates carry no expiry date that a long-running job could outlive,
and a user's own certificate that is expired, not valid yet or expiring soon
is named with its file and date at the job's start (an error, or a
warning), not at a handshake months later."""
import datetime
import multiprocessing
import warnings

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import pyflowbuf as fb
from pyflowbuf.cluster import control
from pyflowbuf.errors import CertificateExpiryWarning, CertificateValidityError
from pyflowbuf.net import TLSConfig
from pyflowbuf.net import tls as T

pytestmark = pytest.mark.timeout(120)

NOW = datetime.datetime.now(datetime.timezone.utc)
DAY = datetime.timedelta(days=1)


def _cert(days_before, days_after):
    """A self-signed CA certificate and key (PEM) valid from NOW - days_before to NOW + days_after."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"lifetime {days_before} {days_after}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(NOW - days_before * DAY).not_valid_after(NOW + days_after * DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def _files(tmp_path, cert, key, ca=None):
    (tmp_path / "node.pem").write_bytes(cert)
    (tmp_path / "node.key").write_bytes(key)
    (tmp_path / "ca.pem").write_bytes(ca if ca is not None else cert)
    return TLSConfig(str(tmp_path / "node.pem"), str(tmp_path / "node.key"), str(tmp_path / "ca.pem"))


def _dates(pem):
    return [(c.not_valid_before_utc, c.not_valid_after_utc) for c in x509.load_pem_x509_certificates(pem)]


# ---------------------------------------------------------------- tls=True

def test_generated_certificates_have_no_expiry_a_job_could_outlive():
    """RFC 5280's 99991231235959Z on the CA and on every certificate it issues:
    a job that runs (or restarts) years later still shakes hands."""
    t0 = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0)
    certs = T.JobCertificates("lifetime job")
    attempts = T.AttemptTLS(True, "lifetime job")
    made = [certs.for_attempt(0), certs.for_attempt(7), certs.issue("control endpoint"),
            attempts.for_attempt(0), attempts.for_server("web view")]
    t1 = datetime.datetime.now(datetime.timezone.utc)
    far = datetime.datetime(9999, 12, 31, 23, 59, 59, tzinfo=datetime.timezone.utc)
    for cfg in made:
        for pem in (cfg.cert, cfg.ca):
            (before, after), = _dates(pem)
            assert after == far
            assert t0 - DAY <= before <= t1 - DAY       # a day back: hosts' clocks differ
        T.check_dates(cfg)                                                   # and nothing to warn about
    ep, cli = control._endpoint_tls(True, "lifetime job")
    assert _dates(ep.cert)[0][1] == far and _dates(cli.cert)[0][1] == far


def test_generated_certificates_are_checked_by_the_handshake_as_before(tmp_path):
    """A certificate issued with explicit dates (as tests do) keeps them."""
    certs = T.JobCertificates("lifetime job")
    old = certs.for_attempt(0, not_before=NOW - 10 * DAY, not_after=NOW - 9 * DAY)
    assert _dates(old.cert)[0][1] < NOW


# ---------------------------------------------------------------- the user's files

def test_an_expired_certificate_is_refused_at_the_start_naming_the_file_and_date(tmp_path):
    cfg = _files(tmp_path, *_cert(400, -2))
    with pytest.raises(CertificateValidityError) as info:
        T.check_dates(cfg)
    msg = str(info.value)
    assert str(tmp_path / "node.pem") in msg and "expired on " + (NOW - 2 * DAY).strftime("%Y-%m-%d") in msg
    assert str(tmp_path / "ca.pem") in msg        # the self-signed file is its own CA: both named
    assert "renew" in msg and "BEGIN" not in msg


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")
def test_a_job_with_an_expired_certificate_fails_before_any_worker_starts(tmp_path):
    cfg = _files(tmp_path, *_cert(400, -2))
    env = fb.Environment(workers=2, parallelism=2, tls=cfg)
    env.from_sequence(0, 100).map(lambda x: x).collect()
    with pytest.raises(CertificateValidityError, match="node.pem.*expired on"):
        env.execute(timeout=60)


def test_a_local_job_with_a_control_endpoint_checks_too(tmp_path):
    cfg = _files(tmp_path, *_cert(400, -2))
    with pytest.raises(CertificateValidityError, match="expired on"):
        control._endpoint_tls(cfg, "job")


def test_a_certificate_not_valid_yet_is_refused(tmp_path):
    cfg = _files(tmp_path, *_cert(-3, 300))
    with pytest.raises(CertificateValidityError, match="node.pem.*not valid before " + (NOW + 3 * DAY).strftime("%Y-%m-%d")):
        T.check_dates(cfg)


def test_a_certificate_expiring_soon_is_warned_about_naming_the_file_and_date(tmp_path):
    cfg = _files(tmp_path, *_cert(300, 10))
    with pytest.warns(CertificateExpiryWarning) as caught:
        T.check_dates(cfg)
    msgs = [str(w.message) for w in caught]
    day = (NOW + 10 * DAY).strftime("%Y-%m-%d")
    assert any(str(tmp_path / "node.pem") in m and f"expires on {day}" in m for m in msgs)
    assert any(str(tmp_path / "ca.pem") in m and f"expires on {day}" in m for m in msgs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        T.check_dates(cfg, warn_days=5)               # outside a shorter window: quiet


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")
def test_a_job_with_a_certificate_expiring_soon_warns_and_runs(tmp_path):
    cfg = _files(tmp_path, *_cert(300, 10))
    env = fb.Environment(workers=2, parallelism=2, tls=cfg)
    out = env.from_sequence(0, 1000).rebalance().map(lambda x: x + 1).collect()
    with pytest.warns(CertificateExpiryWarning, match="node.pem.*expires on"):
        env.execute(timeout=120)
    assert sorted(out.result) == list(range(1, 1001))


def test_pem_bytes_are_named_as_such(tmp_path):
    cert, key = _cert(400, -2)
    with pytest.raises(CertificateValidityError, match="given as PEM bytes .*CN=lifetime 400 -2.*expired"):
        T.check_dates(TLSConfig(cert, key, cert))


def test_a_ca_bundle_with_one_expired_ca_beside_a_valid_one_is_accepted(tmp_path):
    """CA rotation: the old CA may stay in the bundle after it expired."""
    cert, key = _cert(300, 300)
    old, _ = _cert(800, -30)
    cfg = _files(tmp_path, cert, key, ca=old + cert)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        T.check_dates(cfg)


def test_a_ca_bundle_with_no_valid_ca_is_refused(tmp_path):
    cert, key = _cert(300, 300)
    old, _ = _cert(800, -30)
    older, _ = _cert(900, -60)
    cfg = _files(tmp_path, cert, key, ca=older + old)
    with pytest.raises(CertificateValidityError, match=r"the CA in .*ca\.pem .*and the others.*expired on"):
        T.check_dates(cfg)


def test_files_that_do_not_parse_are_left_to_the_handshake(tmp_path):
    cfg = TLSConfig(str(tmp_path / "missing.pem"), None, str(tmp_path / "missing-ca.pem"))
    T.check_dates(cfg)          # the loader names the missing file where a connection is made
