"""Who refused whose certificate: a TLSError says "this side refused the
peer's certificate" when our verification failed, and "the peer refused our
certificate" when the peer's alert says it refused ours, on both ends of a
connection, in the core (libssl in netio) and in the relay fallback
(Python's ssl). Loopback only; every wait is for a condition."""
import datetime

import pytest

from pyflowbuf._core import netio
from pyflowbuf._core.channel import BufferQueue
from pyflowbuf.errors import TLSError
from pyflowbuf.net import TLSConfig
from pyflowbuf.net import tls as T
from pipeline_helpers import wait_for

pytestmark = pytest.mark.timeout(90)

OURS = "this side refused the peer's certificate"
THEIRS = "the peer refused our certificate"


@pytest.fixture(scope="module")
def job():
    return T.JobCertificates("reasons job")


@pytest.fixture(scope="module")
def stranger():
    return T.JobCertificates("another job").for_attempt(0)


@pytest.fixture(params=["core", "relay"])
def mode(request, monkeypatch):
    if request.param == "relay":
        monkeypatch.setenv("PYFLOWBUF_TLS_RELAY", "1")
    elif not netio.HAVE_TLS:
        pytest.skip("the core was built without libssl")
    return request.param


def _attempt(mgr, net, srv):
    excl, fl = mgr.create_input_pools(net.nbp, 1, 2, 4)
    with pytest.raises(TLSError) as info:
        mgr.create_channel(srv.address, "x", 0, BufferQueue(net.nbp), excl[0], fl, kind="int64")
    assert info.value.peer == tuple(srv.address)
    return info.value


def _server_error(srv):
    hit = wait_for(lambda: [e for _, e in list(srv.errors) if isinstance(e, TLSError)],
                   lambda: f"no TLSError in {list(srv.errors)}")
    assert hit[0].peer[0] == "127.0.0.1"
    return hit[0]


def test_the_client_refuses_the_servers_certificate(loopback_network, job, stranger, mode):
    """The client trusts another CA: its own check fails; the server hears the client's alert."""
    net = loopback_network(64)
    srv = net.server(tls=job.for_attempt(0), handshake_timeout=5)
    client = _attempt(net.manager(tls=stranger, connect_timeout=5), net, srv)
    assert OURS in client.reason and "certificate" in client.reason
    server = _server_error(srv)
    assert THEIRS in server.reason and "unknown ca" in server.reason.lower().replace("_", " ")
    assert OURS not in server.reason and "peer's certificate" not in server.reason


def test_the_server_refuses_the_clients_certificate(loopback_network, job, stranger, mode):
    """The client trusts the job's CA but presents another CA's certificate:
    the server's check fails; the client hears the server's alert."""
    net = loopback_network(64)
    srv = net.server(tls=job.for_attempt(0), handshake_timeout=5)
    wrong = TLSConfig(stranger.cert, stranger.key, job.for_attempt(0).ca)
    client = _attempt(net.manager(tls=wrong, connect_timeout=5), net, srv)
    assert THEIRS in client.reason and OURS not in client.reason
    server = _server_error(srv)
    assert OURS in server.reason and "unable to get local issuer certificate" in server.reason


def test_an_expired_certificate_is_said_as_such_on_both_ends(loopback_network, job, mode):
    net = loopback_network(64)
    srv = net.server(tls=job.for_attempt(0), handshake_timeout=5)
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=10)
    old = job.for_attempt(0, not_before=past, not_after=past + datetime.timedelta(days=1))
    client = _attempt(net.manager(tls=TLSConfig(old.cert, old.key, old.ca), connect_timeout=5), net, srv)
    assert THEIRS in client.reason and "expired" in client.reason
    server = _server_error(srv)
    assert OURS in server.reason and "has expired" in server.reason


@pytest.mark.parametrize("text, code, want", [
    # our own verification (Python's ssl gives verify_code and verify_message; the core the text)
    ("unable to get local issuer certificate", 20, OURS),
    ("certificate has expired", 10, OURS),
    ("certificate verify failed: certificate has expired", None, OURS),
    # the peer's alert about our certificate (Python's ssl and the core spell it differently)
    ("TLSV1_ALERT_UNKNOWN_CA", None, THEIRS),
    ("tlsv1 alert unknown ca", None, THEIRS),
    ("SSLV3_ALERT_BAD_CERTIFICATE", None, THEIRS),
    ("sslv3 alert certificate expired", None, THEIRS),
    ("TLSV13_ALERT_CERTIFICATE_REQUIRED", None, THEIRS),
])
@pytest.mark.parametrize("server_side", [True, False])
def test_each_reason_names_the_side_that_refused(text, code, want, server_side):
    reason = T._reason_text(text, code, server_side)
    assert want in reason and text in reason
    assert (OURS if want == THEIRS else THEIRS) not in reason


def test_an_unknown_handshake_failure_keeps_its_text():
    assert "decode error" in T._reason_text("decode error", None, True)
