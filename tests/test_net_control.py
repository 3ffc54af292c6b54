"""The driver <-> worker control channel for workers on other hosts
(pyflowbuf.cluster.control_channel): authenticated, bounded, never unpickling."""
import socket
import struct
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyflowbuf import errors
from pyflowbuf.cluster.control_channel import MAX_MESSAGE, ControlListener, connect_control

SECRET = b"s" * 32


@pytest.fixture
def listener():
    lis = ControlListener(SECRET, host="127.0.0.1")
    lis.start()
    yield lis
    lis.close()


def _pair(listener, secret=SECRET, **kw):
    worker = connect_control(listener.address, secret, **kw)
    driver = listener.accept(time.monotonic() + 10)
    assert driver is not None
    return worker, driver


plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63 - 1) | st.floats(allow_nan=False) | st.text()
    | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.integers(0, 100) | st.text(max_size=5), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=30, deadline=None)
@given(msg=plain)
def test_messages_come_back_as_sent(msg):
    lis = ControlListener(SECRET)
    lis.start()
    try:
        worker, driver = _pair(lis)
        worker.send((3, ("metrics", msg)))
        assert driver.recv() == (3, ("metrics", msg))
        driver.send(msg)
        assert worker.recv() == msg
        worker.close()
        driver.close()
    finally:
        lis.close()


def test_arrays_and_the_end_of_the_channel(listener):
    worker, driver = _pair(listener)
    worker.send(("collected", {0: {1: (0, [np.arange(3), b"x" * 100_000])}}))
    got = driver.recv()
    assert got[0] == "collected" and got[1][0][1][1][1] == b"x" * 100_000
    np.testing.assert_array_equal(got[1][0][1][1][0], np.arange(3))
    assert not driver.poll(0.05)
    worker.close()
    assert driver.poll(5)
    with pytest.raises(EOFError):
        driver.recv()


def test_a_wrong_secret_is_refused_and_the_listener_goes_on(listener):
    with pytest.raises(errors.AuthenticationError):
        connect_control(listener.address, b"t" * 32)
    deadline = time.monotonic() + 5
    while listener.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.refused == 1
    assert listener.accept(time.monotonic() + 0.2) is None      # nothing was let in
    worker, driver = _pair(listener)
    worker.send("after")
    assert driver.recv() == "after"


def test_a_new_secret_refuses_the_old_attempt(listener):
    listener.set_secret(b"n" * 32)
    with pytest.raises(errors.AuthenticationError):
        connect_control(listener.address, SECRET)
    _pair(listener, b"n" * 32)


def test_a_stranger_without_the_handshake_is_dropped(listener):
    # a peer that connects and sends bytes instead of answering the challenge
    with socket.create_connection(listener.address, timeout=5) as s:
        s.sendall(b"\x00" * 64)
        s.settimeout(5)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass
    deadline = time.monotonic() + 5
    while listener.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert listener.refused == 1


def test_pickled_values_are_refused_without_the_opt_in(listener):
    from fractions import Fraction as Custom

    worker, driver = _pair(listener)
    with pytest.raises(errors.ProtocolError, match="Fraction.*allow_pickle"):
        worker.send(("collected", Custom(1, 3)))          # not plain data: not sent at all
    # a peer that sends a frame holding a pickle: refused before anything is unpickled
    from pyflowbuf.checkpoint import container

    data = container.dumps(Custom(1, 3), allow_pickle=True)
    worker._sock.sendall(struct.pack(">I", len(data)) + data)
    with pytest.raises(errors.ProtocolError, match="malformed|pickle"):
        driver.recv()


def test_an_oversized_frame_is_refused_before_it_is_read(listener):
    worker, driver = _pair(listener)
    worker._sock.sendall(struct.pack(">I", MAX_MESSAGE + 1))
    with pytest.raises(errors.ProtocolError, match="over the limit"):
        driver.recv()


def test_close_wakes_a_thread_blocked_in_recv(listener):
    worker, driver = _pair(listener)
    ended = threading.Event()

    def reader():
        try:
            worker.recv()
        except EOFError:
            ended.set()

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.1)
    worker.close()
    t.join(5)
    assert ended.is_set()


def test_a_wildcard_address_is_refused():
    with pytest.raises(ValueError, match="0.0.0.0"):
        ControlListener(SECRET, host="0.0.0.0")


def test_the_job_description_travels_and_rebuilds_the_job():
    from pyspark import cloudpickle

    import pyflowbuf as fb
    from pyflowbuf.spark.cluster import JobDescription

    env = fb.Environment(parallelism=2, buffer_timeout=0.01, checkpoint_interval=1.0, checkpoint_dir="/tmp/x",
                         prometheus_port=0)
    out = env.from_collection(["a b", "b"]).flat_map(str.split).key_by(lambda w: w).map(str.upper).collect()
    desc = cloudpickle.loads(cloudpickle.dumps(JobDescription(env, workers=2)))
    copy = desc.environment(bind_host="10.1.2.3")
    assert copy.bind_host == "10.1.2.3" and copy.buffer_timeout == 0.01 and copy.checkpoint_interval == 1.0
    assert copy.prometheus_port is None and copy.workers is None     # the driver serves the metrics
    assert [n.name for n in copy.nodes] == [n.name for n in env.nodes]
    copy.execute(timeout=60)            # the rebuilt graph runs (here, in one process)
    assert sorted(r for part in copy.nodes[-1].collect_parts.values() for r in part) == ["A", "B", "B"]
    assert out.result == []             # the original's results are not touched
