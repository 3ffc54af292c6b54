"""Spark's Kafka connector (``spark.read.format("kafka")``, ``readStream``,
``writeStream.format("kafka")``) for the installed PySpark, from Maven Central.

PySpark's wheel does not ship the connector. ``install()`` fetches
``org.apache.spark:spark-sql-kafka-0-10_2.13`` and the jars it needs that
PySpark lacks (``spark-token-provider-kafka-0-10``, ``kafka-clients``,
``commons-pool2``) once into a cache, with the local Maven (``mvn``), as
``pyflowbuf.connectors.kafka_broker`` fetches the broker; ``ci/setup.sh``
runs ``python -m pyflowbuf.spark.kafka_jars install``. ``spark_conf()``
gives the ``spark.jars`` setting that puts them on the driver's and the
executors' class path (what ``--packages`` would do, without Ivy at run time).

Example::

    from pyflowbuf.spark import local_session
    from pyflowbuf.spark.kafka_jars import spark_conf

    spark = local_session(conf=spark_conf())      # KafkaJarsError if not installed
    df = (spark.read.format("kafka")
               .option("kafka.bootstrap.servers", "127.0.0.1:9092")
               .option("subscribe", "clicks").load())

The connector's version is PySpark's own when Maven Central serves it. When
it does not (a PySpark release newer than the connector releases Maven
Central has), the newest earlier release of the same major version that it
serves is taken, and ``installed_version()`` says which: Spark's Kafka
connector talks to Spark through its DataSource V2 interfaces, which a minor
release keeps. ``$PYFLOWBUF_SPARK_KAFKA_VERSION`` names a version to take
instead.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

from pyflowbuf.connectors import maven
from pyflowbuf.errors import KafkaJarsError

GROUP = "org.apache.spark"
ARTIFACT = "spark-sql-kafka-0-10_2.13"
# The jars the connector needs that PySpark's own jars/ lacks; install()
# checks that each came, since a partial class path fails only at run time
# (a NoClassDefFoundError in the middle of a query).
REQUIRED = ("spark-sql-kafka-0-10_2.13", "spark-token-provider-kafka-0-10_2.13", "kafka-clients",
            "commons-pool2")

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>pyflowbuf</groupId><artifactId>spark-kafka-connector</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId><version>{version}</version></dependency>
  </dependencies>
</project>
"""


def spark_version() -> str:
    """The installed PySpark's version (without importing it)."""
    try:
        return importlib.metadata.version("pyspark")
    except importlib.metadata.PackageNotFoundError:
        raise KafkaJarsError("Spark's Kafka connector is fetched for the installed PySpark, and "
                             "PySpark is not installed: pip install 'pyflowbuf[spark]'") from None


def cache_dir() -> str:
    """Where ``install`` puts the jars: ``$PYFLOWBUF_SPARK_KAFKA_JARS``, or
    ``~/.cache/pyflowbuf/spark-kafka-<pyspark version>`` (``$XDG_CACHE_HOME``
    honoured)."""
    return maven.cache_folder("PYFLOWBUF_SPARK_KAFKA_JARS", f"spark-kafka-{spark_version()}")


def _artifact_id(jar_name: str) -> str:
    """``kafka-clients-3.9.2.jar`` -> ``kafka-clients``."""
    return re.sub(r"-\d[^-]*\.jar$", "", jar_name)


def _pyspark_jars() -> set:
    """The artifact ids in PySpark's own jars/ folder: the connector's
    dependencies that Spark already has (Scala, Hadoop, snappy, slf4j...)
    stay out of spark.jars, so one version of each is on the class path."""
    spec = importlib.util.find_spec("pyspark")
    if spec is None or not spec.submodule_search_locations:
        return set()
    folder = os.path.join(list(spec.submodule_search_locations)[0], "jars")
    return {_artifact_id(n) for n in os.listdir(folder) if n.endswith(".jar")} if os.path.isdir(folder) else set()


def candidate_versions(version: str | None = None) -> list:
    """The connector versions ``install`` tries, in order: PySpark's own,
    then x.y-1.0, x.y-2.0 ... x.0.0 of the same major version (a PySpark
    newer than what Maven Central serves). ``$PYFLOWBUF_SPARK_KAFKA_VERSION``
    is the only one tried when set."""
    forced = os.environ.get("PYFLOWBUF_SPARK_KAFKA_VERSION")
    if forced:
        return [forced]
    version = version or spark_version()
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        return [version]
    major, minor = int(m.group(1)), int(m.group(2))
    same_minor = [f"{major}.{minor}.{m.group(3)}"] + ([f"{major}.{minor}.0"] if m.group(3) != "0" else [])
    return same_minor + [f"{major}.{k}.0" for k in range(minor - 1, -1, -1)]


def _complete_marker(folder: str) -> str:
    return os.path.join(folder, ".complete")


def installed_version() -> str | None:
    """The connector version in the cache, or None when nothing is installed."""
    try:
        with open(_complete_marker(cache_dir())) as f:
            return f.read().split(":")[-1].strip() or None
    except OSError:
        return None


def jars() -> list:
    """The cached jars (sorted paths); ``KafkaJarsError`` naming the install
    command when there are none."""
    folder = cache_dir()
    found = sorted(glob.glob(os.path.join(folder, "*.jar")))
    if not os.path.exists(_complete_marker(folder)) or not found:
        raise KafkaJarsError(
            f"Spark's Kafka connector is not installed (looked in {folder}): run "
            "`python -m pyflowbuf.spark.kafka_jars install` (ci/setup.sh does); it needs Maven (mvn) "
            "and Maven Central")
    return found


def spark_conf() -> dict:
    """``{"spark.jars": ...}``: give it to the SparkSession builder (static
    setting, read when the session's JVM starts)."""
    return {"spark.jars": ",".join(jars())}


def _fetch(mvn: str, version: str, staging: str) -> tuple:
    pom = os.path.join(staging, f"pom-{version}.xml")
    with open(pom, "w") as f:
        f.write(_POM.format(group=GROUP, artifact=ARTIFACT, version=version))
    libs = os.path.join(staging, f"libs-{version}")
    cmd = [mvn, "-B", "-q", "-f", pom, "dependency:copy-dependencies", f"-DoutputDirectory={libs}",
           "-DincludeScope=runtime"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    ok = run.returncode == 0 and glob.glob(os.path.join(libs, f"{ARTIFACT}-*.jar"))
    return (libs if ok else None), cmd, (run.stdout + run.stderr)[-2000:]


def install(quiet: bool = False) -> str:
    """Fetch the connector for the installed PySpark into ``cache_dir()``
    (once: a complete cache is kept) and return that folder. Needs ``mvn``;
    ``KafkaJarsError`` saying what Maven answered when no candidate version
    (``candidate_versions()``) could be fetched."""
    target = cache_dir()
    if os.path.exists(_complete_marker(target)):
        return target
    mvn = shutil.which("mvn")
    if mvn is None:
        raise KafkaJarsError(
            f"fetching Spark's Kafka connector ({GROUP}:{ARTIFACT}) needs Maven (mvn) to resolve it from "
            "Maven Central; install Maven and run `python -m pyflowbuf.spark.kafka_jars install` again")
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".spark-kafka-jars-", dir=os.path.dirname(target) or ".")
    tried = []
    try:
        for version in candidate_versions():
            libs, cmd, output = _fetch(mvn, version, staging)
            if libs is None:
                tried.append(f"{version}: {' '.join(cmd)}\n{output}")
                continue
            spark_has = _pyspark_jars()
            for name in os.listdir(libs):
                if _artifact_id(name) in spark_has:
                    os.remove(os.path.join(libs, name))
            present = {_artifact_id(n) for n in os.listdir(libs)}
            missing = [a for a in REQUIRED if a not in present]
            if missing:
                raise KafkaJarsError(f"Maven fetched {ARTIFACT}:{version} without {missing} "
                                     f"(got {sorted(present)})")
            with open(_complete_marker(libs), "w") as f:
                f.write(f"{GROUP}:{ARTIFACT}:{version}\n")
            if os.path.exists(target):      # an incomplete earlier try
                shutil.rmtree(target)
            os.replace(libs, target)
            if not quiet:
                note = "" if version == spark_version() else \
                    f" (PySpark is {spark_version()}; Maven Central does not serve that connector release)"
                print(f"Spark Kafka connector {version} in {target}{note}")
            return target
        raise KafkaJarsError(f"mvn could not fetch {GROUP}:{ARTIFACT} for PySpark {spark_version()} in any of "
                             f"the versions {candidate_versions()}:\n" + "\n".join(tried)[-4000:])
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pyflowbuf.spark.kafka_jars",
                                     description="Fetch Spark's Kafka connector for the installed PySpark.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("install", help="fetch the connector's jars from Maven Central into the cache")
    sub.add_parser("path", help="print the spark.jars value (the cached jars, comma-separated)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "install":
            install()
        else:
            print(spark_conf()["spark.jars"])
        return 0
    except KafkaJarsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
