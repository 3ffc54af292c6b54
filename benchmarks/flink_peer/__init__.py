"""Apache Flink 2.3 as the peer of the checkpoint benchmark's backpressured job
(issue 32): the same keyed count under the same backpressure, run by Flink on
this machine in the same minutes as ours, so the aligned checkpoint's duration
is a ratio measured side by side, not a figure quoted from elsewhere.

The job (``CheckpointPeer.java`` beside this file; DataStream API, Flink's
MiniCluster in the same JVM through ``StreamExecutionEnvironment``):

* a rate-limited source of longs (``DataGeneratorSource``, ``rate`` records/s),
  ``map`` (x + 1), ``pair`` (x % keys, 1), ``keyBy`` + ``reduce`` (a keyed
  count), a sink slow per record draining ``rate / 20`` records/s, paced by
  deadline as ours is (``bench_checkpoint.paced_sink``);
* parallelism 1, Flink's default network buffers (2 exclusive buffers a
  channel, 8 floating a gate, at most 10 a channel), 32 KiB segments, a
  checkpoint every second to a local ``file://`` folder (the hashmap state
  backend, filesystem checkpoint storage);
* ``topology``: ``"chained"`` is Flink's default (source -> map -> pair in one
  task, count -> sink in another: 2 tasks, 1 exchange); ``"unchained"``
  disables chaining: 5 tasks and 4 exchanges, as ``bench_checkpoint.py`` runs
  ours (``chaining=False``); ``"rebalance"`` is ``"unchained"`` with each
  forward exchange made a rebalance, because Flink (2.3) keeps a barrier
  aligned on a pointwise (forward) exchange even with unaligned checkpoints
  on: only a rebalance or hash exchange lets it overtake, which the unaligned
  comparison needs (at parallelism 1 a rebalance carries the same data).

What is read back: Flink's own log line for each completed checkpoint
(``CheckpointCoordinator`` at INFO: "Completed checkpoint N for job J (B bytes,
checkpointDuration=D ms, finalizationTime=F ms)."; ``checkpointDuration`` is
trigger to completion, what ``env.checkpoints()`` calls ``duration_s``) and the
program's last line, ``PEER sink_records=N sink_seconds=S``: the records the
sink took from its first one to the cancel (the sink's measured rate).

The jars come from Maven Central (``org.apache.flink:flink-streaming-java``,
``flink-clients``, ``flink-runtime`` and a log4j binding), fetched once into a
cache by ``python benchmarks/flink_peer install`` (or on the first
``prepare(fetch=True)``; needs ``mvn``); the program is compiled with ``javac``
into the cache, again whenever its source changes. Java 17 or newer. Nothing
in the test suite or ``ci/setup.sh`` needs it: the benchmark skips the peer,
with the reason in its note, where any of it is missing.

Example (prints the peer's figures as JSON)::

    python benchmarks/flink_peer run --seconds 20 --topology unchained
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from pyflowbuf.connectors import maven

FLINK_VERSION = "2.3.0"
LOG4J_VERSION = "2.24.3"       # binds Flink's slf4j 1.7 API, so the coordinator's lines reach stdout
TOPOLOGIES = ("chained", "unchained", "rebalance")
MODES = ("aligned", "unaligned")
_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCE = os.path.join(_HERE, "CheckpointPeer.java")

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>pyflowbuf</groupId><artifactId>flink-checkpoint-peer</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.flink</groupId><artifactId>flink-streaming-java</artifactId><version>{flink}</version></dependency>
    <dependency><groupId>org.apache.flink</groupId><artifactId>flink-clients</artifactId><version>{flink}</version></dependency>
    <dependency><groupId>org.apache.flink</groupId><artifactId>flink-runtime</artifactId><version>{flink}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>{log4j}</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-core</artifactId><version>{log4j}</version></dependency>
  </dependencies>
</project>
"""

# only the coordinator's lines at INFO: the parser reads them, the rest is noise
_LOG4J = """rootLogger.level = WARN
rootLogger.appenderRef.out.ref = out
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = %p %c{1} %m%n
logger.coordinator.name = org.apache.flink.runtime.checkpoint.CheckpointCoordinator
logger.coordinator.level = INFO
"""

_COMPLETED = re.compile(r"Completed checkpoint (\d+) for job ([0-9a-f]+) \((\d+) bytes, "
                        r"checkpointDuration=(\d+) ms, finalizationTime=(\d+) ms\)")
_PEER = re.compile(r"^PEER sink_records=(\d+) sink_seconds=([0-9.]+)\s*$", re.M)


class FlinkPeerUnavailable(RuntimeError):
    """The peer cannot run here (no Java, no Maven to fetch the jars, a fetch
    or compile that failed); the message says what is missing and the fix."""


class FlinkPeerFailed(RuntimeError):
    """The peer ran but did not report: it exited badly, ran past its time
    limit, or printed no summary line (the message holds its output's tail)."""


def cache_dir() -> str:
    """Where the jars go: ``$PYFLOWBUF_FLINK_LIBS``, or
    ``~/.cache/pyflowbuf/flink-<version>`` (``$XDG_CACHE_HOME`` honoured)."""
    return maven.cache_folder("PYFLOWBUF_FLINK_LIBS", f"flink-{FLINK_VERSION}")


def install(quiet: bool = False) -> str:
    """Fetch Flink's jars from Maven Central into ``cache_dir()`` (once: a
    complete cache is kept) and return that folder. Needs ``mvn``."""
    target = cache_dir()
    fetched = maven.fetch_jars(
        target, _POM.format(flink=FLINK_VERSION, log4j=LOG4J_VERSION), expect="flink-runtime-*.jar",
        label=f"flink:{FLINK_VERSION}", error=FlinkPeerUnavailable,
        missing_mvn=f"fetching Flink {FLINK_VERSION} needs Maven (mvn) to resolve org.apache.flink:flink-streaming-java "
                    f"from Maven Central; install Maven, or put the jars of flink-streaming-java, flink-clients and "
                    f"flink-runtime {FLINK_VERSION} with their dependencies in {target} (and an empty .complete file)")
    if not fetched:
        return target
    if not quiet:
        print(f"Flink {FLINK_VERSION} jars in {target}")
    return target


def _tool(name: str) -> str:
    home = os.environ.get("JAVA_HOME")
    path = os.path.join(home, "bin", name) if home else shutil.which(name)
    if not path or not os.path.exists(path):
        raise FlinkPeerUnavailable(f"the Flink peer needs a JDK 17 or newer: no {name} found (JAVA_HOME, PATH)")
    return path


def prepare(fetch: bool = True) -> dict:
    """Make the peer runnable: the jars (fetched with ``install`` when
    ``fetch`` and missing) and the program compiled into the cache (once per
    version of its source). Returns what ``run`` needs; raises
    ``FlinkPeerUnavailable`` with the reason when it cannot."""
    java, javac = _tool("java"), _tool("javac")
    libs = cache_dir()
    if not maven.complete(libs):
        if not fetch:
            raise FlinkPeerUnavailable(f"Flink {FLINK_VERSION}'s jars are not in {libs}: run "
                                       "`python benchmarks/flink_peer install` (needs mvn)")
        libs = install(quiet=True)
    with open(_SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    classes = os.path.join(libs, f"peer-classes-{digest}")
    if not os.path.exists(os.path.join(classes, "CheckpointPeer.class")):
        staging = tempfile.mkdtemp(prefix=".peer-classes-", dir=libs)
        try:
            run = subprocess.run([javac, "-nowarn", "-d", staging, "-cp", os.path.join(libs, "*"), _SOURCE],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                raise FlinkPeerUnavailable(f"javac could not compile {_SOURCE} against Flink {FLINK_VERSION}:\n"
                                           f"{(run.stdout + run.stderr)[-3000:]}")
            with open(os.path.join(staging, "log4j2.properties"), "w") as f:
                f.write(_LOG4J)
            os.replace(staging, classes)
        except OSError:
            if not os.path.exists(os.path.join(classes, "CheckpointPeer.class")):   # not a concurrent compile
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return {"java": java, "classpath": classes + os.pathsep + os.path.join(libs, "*"),
            "log4j": os.path.join(classes, "log4j2.properties")}


def parse_output(text: str) -> dict:
    """The completed checkpoints and the sink's count in the peer's output:
    ``{"checkpoints": [{"id", "bytes", "duration_s", "finalization_s"}, ...],
    "durations": [s, ...], "sink_records", "sink_seconds",
    "sink_records_per_s"}``. Raises ``FlinkPeerFailed`` without the summary
    line (a run that did not finish is never read as one with no checkpoints)."""
    cps = [{"id": int(m[1]), "bytes": int(m[3]), "duration_s": int(m[4]) / 1000.0,
            "finalization_s": int(m[5]) / 1000.0} for m in _COMPLETED.finditer(text)]
    summary = _PEER.search(text)
    if summary is None:
        raise FlinkPeerFailed("the Flink peer printed no 'PEER sink_records=...' line; its output ended with:\n"
                              + text[-3000:])
    n, secs = int(summary[1]), float(summary[2])
    return {"checkpoints": cps, "durations": [c["duration_s"] for c in cps], "sink_records": n,
            "sink_seconds": secs, "sink_records_per_s": n / secs if secs > 0 else float("nan")}


def _die_with_parent():     # runs in the child between fork and exec
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)     # PR_SET_PDEATHSIG
    except OSError:
        pass                # not Linux: the time limit still ends it


def run(rate: float, seconds: float, mode: str = "aligned", topology: str = "unchained", keys: int = 1000,
        *, tmp: str | None = None, prepared: dict | None = None, startup_s: float = 120.0) -> dict:
    """Run the peer's job for ``seconds`` after its first record reaches the
    sink, and return ``parse_output`` of what it printed plus ``mode`` and
    ``topology``. The JVM gets ``seconds + startup_s`` in all, then SIGKILL
    (and it dies with this process)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
    p = prepared or prepare()
    ck = tempfile.mkdtemp(prefix="flink-peer-", dir=tmp)
    cmd = [p["java"], "-Xmx1g", f"-Dlog4j.configurationFile={p['log4j']}", "-cp", p["classpath"],
           "CheckpointPeer", repr(float(rate)), repr(float(seconds)), mode, topology, ck, str(int(keys))]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                text=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        try:
            out, _ = proc.communicate(timeout=seconds + startup_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            raise FlinkPeerFailed(f"the Flink peer ran past {seconds + startup_s:g} s and was killed; its output "
                                  f"ended with:\n{(out or '')[-3000:]}") from None
        if proc.returncode != 0:
            raise FlinkPeerFailed(f"the Flink peer exited with {proc.returncode}; its output ended with:\n"
                                  f"{out[-3000:]}")
    finally:
        shutil.rmtree(ck, ignore_errors=True)
    return dict(parse_output(out), mode=mode, topology=topology)


def main(argv=None) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python benchmarks/flink_peer", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help=f"fetch Flink {FLINK_VERSION}'s jars into {cache_dir()} (needs mvn)")
    r = sub.add_parser("run", help="run the peer's job once and print its figures as JSON")
    r.add_argument("--rate", type=float, default=200_000)
    r.add_argument("--seconds", type=float, default=30.0)
    r.add_argument("--mode", choices=MODES, default="aligned")
    r.add_argument("--topology", choices=TOPOLOGIES, default="unchained")
    r.add_argument("--keys", type=int, default=1000)
    a = ap.parse_args(argv)
    if a.cmd == "install":
        install()
        return 0
    got = run(a.rate, a.seconds, a.mode, a.topology, a.keys)
    print(json.dumps({k: v for k, v in got.items() if k != "checkpoints"}))
    return 0
