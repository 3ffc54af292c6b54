"""A real Apache Kafka broker on this machine, for tests, demos and trying a job.

``LocalKafkaBroker`` runs one KRaft node (broker and controller in one JVM) on
127.0.0.1, on free ports, with its log in a directory of its own: the same
broker that production runs, not an imitation. Mock brokers hand aborted
transactional records to ``read_committed`` consumers, so only a real one can
prove an exactly-once sink.

The broker's jars come from Maven Central (``org.apache.kafka:kafka_2.13``
and its dependencies), fetched once into a cache by
``python -m pyflowbuf.connectors.kafka_broker install`` (``ci/setup.sh`` runs
it), or from an unpacked Kafka release named by ``KAFKA_HOME``. It needs Java
17 or newer.

Example::

    from pyflowbuf.connectors.kafka_broker import LocalKafkaBroker

    with LocalKafkaBroker() as broker:           # a few seconds to start
        broker.create_topic("clicks", partitions=4)
        print(broker.bootstrap_servers)          # '127.0.0.1:<port>'

The JVM is tied to the Python process that started it (it gets SIGKILL when
that process dies), so a killed test run leaves no broker behind.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

from pyflowbuf.connectors import maven
from pyflowbuf.errors import KafkaBrokerError

KAFKA_VERSION = "4.1.1"
SCALA_VERSION = "2.13"
LOG4J_VERSION = "2.24.3"       # Kafka 4.1's own log4j2; its slf4j 1.x binding so the broker logs to a file

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>pyflowbuf</groupId><artifactId>local-kafka-broker</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_{scala}</artifactId><version>{kafka}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>{log4j}</version></dependency>
  </dependencies>
</project>
"""

_LOG4J = """status = warn
appender.file.type = File
appender.file.name = file
appender.file.fileName = ${sys:kafka.logs.dir}/broker.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = warn
rootLogger.appenderRef.file.ref = file
logger.broker.name = kafka.server.BrokerServer
logger.broker.level = info
"""


def cache_dir() -> str:
    """Where ``install`` puts the broker's jars: ``$PYFLOWBUF_KAFKA_LIBS``, or
    ``~/.cache/pyflowbuf/kafka-<version>`` (``$XDG_CACHE_HOME`` honoured)."""
    return maven.cache_folder("PYFLOWBUF_KAFKA_LIBS", f"kafka-{KAFKA_VERSION}")


def find_libs() -> str | None:
    """The folder of the broker's jars: the cache when ``install`` filled it,
    else ``$KAFKA_HOME/libs`` of an unpacked Kafka release; None when neither."""
    for folder in (cache_dir(), os.path.join(os.environ.get("KAFKA_HOME", ""), "libs")):
        if folder and glob.glob(os.path.join(folder, "kafka_*.jar")):
            return folder
    return None


def install(quiet: bool = False) -> str:
    """Fetch the broker's jars from Maven Central into ``cache_dir()`` (once:
    a complete cache is kept) and return that folder. Needs ``mvn``."""
    target = cache_dir()
    fetched = maven.fetch_jars(
        target, _POM.format(scala=SCALA_VERSION, kafka=KAFKA_VERSION, log4j=LOG4J_VERSION),
        expect="kafka_*.jar", label=f"kafka_{SCALA_VERSION}:{KAFKA_VERSION}", error=KafkaBrokerError,
        missing_mvn="fetching the Kafka broker needs Maven (mvn) to resolve org.apache.kafka:kafka_"
                    f"{SCALA_VERSION}:{KAFKA_VERSION} from Maven Central; install Maven, or unpack a Kafka "
                    f"{KAFKA_VERSION} release and set KAFKA_HOME to it")
    if not fetched:
        return target
    if not quiet:
        print(f"Kafka {KAFKA_VERSION} broker jars in {target}")
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    if not java or not os.path.exists(java):
        raise KafkaBrokerError("the Kafka broker needs Java 17 or newer: none found (JAVA_HOME, PATH)")
    return java


def _die_with_parent():     # runs in the child between fork and exec
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except OSError:
        pass                # not Linux: stop() and atexit still end it


class LocalKafkaBroker:
    """One KRaft Kafka node on 127.0.0.1 (see the module docstring).

    Parameters
    ----------
    data_dir : folder for its log and config; default a new temporary folder,
        removed by ``close()``. A given folder is kept, so a broker started
        again on it (``restart()``, or a new ``LocalKafkaBroker(data_dir=...)``)
        has every topic and record it had.
    port : the client port; 0 (default) takes a free one.
    start_timeout : seconds to wait for the broker to serve metadata.
    heap : the JVM's heap (``-Xmx``), default ``"512m"``.
    properties : more broker settings (``server.properties`` keys), e.g.
        ``{"log.retention.ms": "-1"}``.

    ``bootstrap_servers`` is the address clients use. ``stop()`` ends the
    JVM and keeps the data; ``start()`` starts it again on the same ports;
    ``close()`` (or leaving the ``with`` block) stops it and removes a
    temporary data folder.
    """

    def __init__(self, data_dir: str | os.PathLike | None = None, *, port: int = 0,
                 start_timeout: float = 60.0, heap: str = "512m", properties: dict | None = None):
        if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
            raise ValueError(f"port must be 0 (a free one) or a port number, got {port!r}")
        if start_timeout <= 0:
            raise ValueError(f"start_timeout is in seconds and must be positive, got {start_timeout!r}")
        self._owns_dir = data_dir is None
        self.data_dir = tempfile.mkdtemp(prefix="pyflowbuf-kafka-") if data_dir is None else os.fspath(data_dir)
        os.makedirs(self.data_dir, exist_ok=True)
        self.port = port or _free_port()
        self.controller_port = _free_port()
        self.start_timeout = start_timeout
        self.heap = heap
        self.properties = dict(properties or {})
        self._proc: subprocess.Popen | None = None
        self._libs = find_libs()
        if self._libs is None:
            raise KafkaBrokerError(
                f"no Kafka broker jars found (looked in {cache_dir()} and $KAFKA_HOME/libs): run "
                "`python -m pyflowbuf.connectors.kafka_broker install` (ci/setup.sh does), or set "
                "KAFKA_HOME to an unpacked Kafka release")
        self.start()

    @property
    def bootstrap_servers(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        """The broker's own log (warnings and errors, and its start)."""
        return os.path.join(self.data_dir, "broker.log")

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _write_config(self) -> str:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": os.path.join(self.data_dir, "log"),
            # one node: internal topics cannot have more replicas than that
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
        }
        props.update({str(k): str(v) for k, v in self.properties.items()})
        path = os.path.join(self.data_dir, "server.properties")
        with open(path, "w") as f:
            f.writelines(f"{k}={v}\n" for k, v in props.items())
        with open(os.path.join(self.data_dir, "log4j2.properties"), "w") as f:
            f.write(_LOG4J)
        return path

    def _java_cmd(self, *args) -> list:
        return [_java(), f"-Xmx{self.heap}", "-Xss1m", "-XX:+UseSerialGC", "-Djava.awt.headless=true",
                f"-Dlog4j2.configurationFile={os.path.join(self.data_dir, 'log4j2.properties')}",
                f"-Dkafka.logs.dir={self.data_dir}",
                "-cp", os.path.join(self._libs, "*"), *args]

    def start(self) -> None:
        """Start the broker (formatting its log folder the first time) and
        wait until it serves metadata; ``KafkaBrokerError`` if it does not
        within ``start_timeout`` seconds."""
        if self.running:
            return
        config = self._write_config()
        if not os.path.exists(os.path.join(self.data_dir, "log", "meta.properties")):
            cluster_id = uuid.uuid4().hex[:22]   # any 22 characters of base64's alphabet
            run = subprocess.run(self._java_cmd("kafka.tools.StorageTool", "format", "-t", cluster_id,
                                                "-c", config, "--ignore-formatted"),
                                 capture_output=True, text=True, timeout=self.start_timeout)
            if run.returncode != 0:
                raise KafkaBrokerError(f"formatting the Kafka log folder failed:\n{(run.stdout + run.stderr)[-3000:]}")
        out = open(os.path.join(self.data_dir, "stdout.log"), "ab")
        try:
            self._proc = subprocess.Popen(self._java_cmd("kafka.Kafka", config), stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        finally:
            out.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + self.start_timeout
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0,
                             "logger": _SILENT})
        while True:
            if self._proc.poll() is not None:
                raise KafkaBrokerError(f"the Kafka broker exited with {self._proc.returncode} while starting; "
                                       f"its log: {self.log_path}\n{self._tail()}")
            try:
                md = admin.list_topics(timeout=1.0)
                if md.brokers:
                    return
            except Exception:       # not serving yet  # noqa: BLE001
                pass
            if time.monotonic() > deadline:
                raise KafkaBrokerError(f"the Kafka broker did not serve metadata on {self.bootstrap_servers} "
                                       f"within {self.start_timeout} s; its log: {self.log_path}\n{self._tail()}")
            time.sleep(0.2)

    def _tail(self) -> str:
        lines = []
        for name in ("stdout.log", "broker.log"):
            try:
                with open(os.path.join(self.data_dir, name), errors="replace") as f:
                    lines += f.readlines()[-20:]
            except OSError:
                pass
        return "".join(lines)

    def stop(self, timeout: float = 30.0) -> None:
        """End the JVM (SIGTERM, a controlled shutdown; SIGKILL after
        ``timeout`` seconds). Its data stays."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """End the JVM at once (SIGKILL), as a crash would: what the broker
        had not flushed may be recovered from its log on the next start."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        """``stop()`` then ``start()``: same ports, same data."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<LocalKafkaBroker {self.bootstrap_servers} {'running' if self.running else 'stopped'}>"

    # ---- conveniences for tests and demos ----
    def create_topic(self, name: str, partitions: int = 1, *, config: dict | None = None,
                     timeout: float = 30.0) -> None:
        """Create topic ``name`` and wait until every partition has a leader."""
        from confluent_kafka.admin import AdminClient, NewTopic

        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "logger": _SILENT})
        futures = admin.create_topics([NewTopic(name, partitions, 1, config=dict(config or {}))],
                                      operation_timeout=timeout, request_timeout=timeout)
        futures[name].result(timeout)
        deadline = time.monotonic() + timeout
        while True:
            topic = admin.list_topics(name, timeout=timeout).topics.get(name)
            if topic is not None and topic.error is None and len(topic.partitions) == partitions \
                    and all(p.leader >= 0 for p in topic.partitions.values()):
                return
            if time.monotonic() > deadline:
                raise KafkaBrokerError(f"topic {name!r} has no leader for every partition after {timeout} s")
            time.sleep(0.05)


class _Silent:
    """A logger for librdkafka's own lines while the broker starts (it reports
    every refused connection, which is the expected state then)."""

    def log(self, *args, **kwargs):
        pass

    def __getattr__(self, name):      # debug/info/warning/error/... as logging.Logger has
        return self.log


_SILENT = _Silent()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyflowbuf.connectors.kafka_broker",
                                     description="Fetch or run a local Apache Kafka broker (KRaft, 127.0.0.1).")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help=f"fetch Kafka {KAFKA_VERSION}'s jars from Maven Central into {cache_dir()}")
    run = sub.add_parser("run", help="start a broker and keep it running until Ctrl-C")
    run.add_argument("--port", type=int, default=9092)
    run.add_argument("--data-dir", default=None, help="keep its log here (default: a temporary folder)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "install":
            install()
            return 0
        with LocalKafkaBroker(args.data_dir, port=args.port) as broker:
            print(f"Kafka {KAFKA_VERSION} serving on {broker.bootstrap_servers} (data in {broker.data_dir}); "
                  "Ctrl-C stops it", flush=True)
            try:
                while broker.running:
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass
        return 0
    except KafkaBrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
