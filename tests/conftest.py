"""Shared test configuration: Hypothesis profiles and generic fixtures.

Profiles (pick with ``HYPOTHESIS_PROFILE``, default ``dev``):

* ``ci``    200 examples per property, for the CI run;
* ``dev``    50 examples, the default for a local run;
* ``debug``  10 examples, verbose, for chasing one failure.

No profile has a deadline: the test machines are shared and noisy, so a slow
example is not a failure. Keep this file generic; fixtures that only one area
needs belong in that area's test module.
"""
import gc
import os
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, Verbosity, settings

sys.path.insert(0, os.path.dirname(__file__))  # tests/strategies.py, tests/reference_model.py

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", max_examples=200, **_COMMON)
settings.register_profile("dev", max_examples=50, **_COMMON)
settings.register_profile("debug", max_examples=10, verbosity=Verbosity.verbose, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def assert_no_leaks(network_pool):
    """Every segment is back in the free list and no guarantee is outstanding."""
    total = network_pool.total_segments
    if network_pool.available_segments != total:
        gc.collect()  # a cycle may still hold a Buffer; collecting is slow, so only then
    assert network_pool.available_segments == total, (
        f"{total - network_pool.available_segments} segment(s) leaked: {network_pool!r}")
    assert network_pool.in_use_segments == 0


@pytest.fixture
def make_network_pool():
    """Factory for NetworkBufferPools, e.g. ``make_network_pool(16, 4096)``.

    The test keeps the pools it makes; the fixture holds no reference after the
    test, so an arena is freed as soon as the test's own objects are."""
    from pyflowbuf._core.memory import NetworkBufferPool

    made = []

    def make(num_segments=16, segment_size=4096):
        nbp = NetworkBufferPool(num_segments, segment_size)
        made.append(nbp)
        return nbp

    yield make
    made.clear()


@pytest.fixture
def no_leaks():
    """``no_leaks(nbp)`` asserts that every segment of ``nbp`` is free again."""
    return assert_no_leaks


class _Runner:
    """Threads started by a test, joined (with a limit) when the test ends."""

    def __init__(self):
        self.threads = []
        self.errors = []

    def start(self, fn, *args, name=None, **kwargs):
        result = {}

        def body():
            try:
                result["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - reported by join()
                result["error"] = exc
                self.errors.append(exc)

        t = threading.Thread(target=body, name=name or getattr(fn, "__name__", "worker"), daemon=True)
        t.result = result
        self.threads.append(t)
        t.start()
        return t

    def join(self, timeout=30.0):
        """Join every thread; raise the first error a thread raised."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self.threads if t.is_alive()]
        assert not alive, f"threads still running after {timeout} s: {alive}"
        if self.errors:
            raise self.errors[0]


@pytest.fixture
def threads():
    """``threads.start(fn, *args)`` runs fn in a daemon thread and returns the
    Thread (its ``result`` dict gets ``value`` or ``error``);
    ``threads.join()`` waits and re-raises the first error."""
    runner = _Runner()
    yield runner
    for t in runner.threads:
        t.join(5.0)


@pytest.fixture
def fast_switching():
    """Make the interpreter switch threads often, to shake out interleavings."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(old)


class _LoopbackNetwork:
    """A secret, a NetworkBufferPool (``segments`` of the default size) and
    the servers and connection managers a test makes with them."""

    def __init__(self, segments):
        from pyflowbuf._core.memory import NetworkBufferPool
        from pyflowbuf.net import new_secret

        self.secret = new_secret()
        self.nbp = NetworkBufferPool(segments)
        self.stops = []         # callables the test adds: run first at the end, then managers, then servers
        self._servers, self._managers = [], []

    def server(self, **kw):
        """A started NetworkServer on 127.0.0.1 with the secret."""
        from pyflowbuf.net import NetworkServer

        s = NetworkServer(self.secret, **kw)
        s.start()
        self._servers.append(s)
        return s

    def manager(self, **kw):
        """A ConnectionManager with the secret, or with ``secret=`` another."""
        from pyflowbuf.net import ConnectionManager

        m = ConnectionManager(kw.pop("secret", self.secret), **kw)
        self._managers.append(m)
        return m

    def close(self):
        for stop in self.stops:
            stop()
        for m in self._managers:
            m.close()
        for s in self._servers:
            s.close()


@pytest.fixture
def loopback_network():
    """``net = loopback_network(512)``: ``net.secret``, ``net.nbp`` (512
    segments), ``net.server(**kw)`` and ``net.manager(**kw)``; at the end of
    the test the callables in ``net.stops`` run, then every manager and
    server made is closed."""
    made = []

    def make(segments=256):
        net = _LoopbackNetwork(segments)
        made.append(net)
        return net

    yield make
    for net in made:
        net.close()


@pytest.fixture
def memory_root():
    """A fresh directory of fsspec's memory:// file system (this process's
    memory: a job in one process), emptied at the end of the test."""
    import uuid

    from fsspec.implementations.memory import MemoryFileSystem

    root = f"/pyflowbuf-test-{uuid.uuid4().hex[:8]}"
    yield root
    for key in [k for k in MemoryFileSystem.store if k.startswith(root)]:
        del MemoryFileSystem.store[key]
    MemoryFileSystem.pseudo_dirs[:] = [d for d in MemoryFileSystem.pseudo_dirs if not d.startswith(root)]


@pytest.fixture
def clean_imports():
    """The job modules that ``pyflowbuf run`` loads in this process (job*,
    pyflowbuf_job*, other_job*) are forgotten afterwards, and sys.path is
    restored."""
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if name.startswith(("job", "pyflowbuf_job", "other_job")):
            del sys.modules[name]


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory):
    """One real Kafka broker (KRaft, 127.0.0.1, a free port) for the whole
    session, its log on disk under the session's temporary folder; stopped at
    the end. Tests create topics of their own names on it. Its jars come from
    ``ci/setup.sh``: without them this fixture fails, naming the command."""
    from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker

    broker = LocalKafkaBroker(tmp_path_factory.mktemp("kafka"))
    yield broker
    broker.close()
