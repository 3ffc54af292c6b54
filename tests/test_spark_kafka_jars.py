"""Which Spark Kafka connector pyflowbuf.spark.kafka_jars fetches, which of
its jars it keeps, and its errors (no Maven, not installed). No Spark, no
Maven run: tests/test_spark_kafka.py uses the real jars."""
import pytest

from pyflowbuf.errors import KafkaJarsError
from pyflowbuf.spark import kafka_jars


@pytest.mark.parametrize("version, expected", [
    ("4.3.0", ["4.3.0", "4.2.0", "4.1.0", "4.0.0"]),
    ("4.1.2", ["4.1.2", "4.1.0", "4.0.0"]),
    ("3.5.1", ["3.5.1", "3.5.0", "3.4.0", "3.3.0", "3.2.0", "3.1.0", "3.0.0"]),
    ("4.0.0", ["4.0.0"]),
])
def test_candidates_are_pyspark_s_own_version_then_earlier_releases_of_its_major(version, expected, monkeypatch):
    monkeypatch.delenv("PYFLOWBUF_SPARK_KAFKA_VERSION", raising=False)
    assert kafka_jars.candidate_versions(version) == expected


def test_a_named_version_is_the_only_candidate(monkeypatch):
    monkeypatch.setenv("PYFLOWBUF_SPARK_KAFKA_VERSION", "4.1.1")
    assert kafka_jars.candidate_versions("4.3.0") == ["4.1.1"]


@pytest.mark.parametrize("jar, artifact", [
    ("spark-sql-kafka-0-10_2.13-4.2.0.jar", "spark-sql-kafka-0-10_2.13"),
    ("spark-token-provider-kafka-0-10_2.13-4.2.0.jar", "spark-token-provider-kafka-0-10_2.13"),
    ("kafka-clients-3.9.2.jar", "kafka-clients"),
    ("commons-pool2-2.13.1.jar", "commons-pool2"),
    ("snappy-java-1.1.10.5.jar", "snappy-java"),
    ("scala-library-2.13.15.jar", "scala-library"),
])
def test_artifact_ids_of_jar_names(jar, artifact):
    assert kafka_jars._artifact_id(jar) == artifact


def test_the_connector_s_own_jars_are_not_in_pyspark():
    """install() keeps a fetched jar only when PySpark's jars/ has no jar of
    that artifact (one version of each on the class path): the four the
    connector needs must therefore be absent there."""
    spark_has = kafka_jars._pyspark_jars()
    if not spark_has:
        pytest.skip("PySpark is not installed")
    assert "spark-core_2.13" in spark_has
    assert not spark_has & set(kafka_jars.REQUIRED)


def test_not_installed_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PYFLOWBUF_SPARK_KAFKA_JARS", str(tmp_path / "none"))
    with pytest.raises(KafkaJarsError, match="python -m pyflowbuf.spark.kafka_jars install"):
        kafka_jars.spark_conf()
    assert kafka_jars.installed_version() is None


def test_install_without_maven_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("PYFLOWBUF_SPARK_KAFKA_JARS", str(tmp_path / "jars"))
    monkeypatch.setattr(kafka_jars.shutil, "which", lambda name: None)
    with pytest.raises(KafkaJarsError, match=r"needs Maven \(mvn\)"):
        kafka_jars.install(quiet=True)


def test_a_complete_cache_is_used_as_it_is(tmp_path, monkeypatch):
    folder = tmp_path / "jars"
    folder.mkdir()
    for name in ("spark-sql-kafka-0-10_2.13-4.2.0.jar", "kafka-clients-3.9.2.jar"):
        (folder / name).write_bytes(b"")
    (folder / ".complete").write_text("org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0\n")
    monkeypatch.setenv("PYFLOWBUF_SPARK_KAFKA_JARS", str(folder))
    monkeypatch.setattr(kafka_jars.shutil, "which", lambda name: pytest.fail("Maven run for a complete cache"))
    assert kafka_jars.install(quiet=True) == str(folder)
    assert kafka_jars.installed_version() == "4.2.0"
    assert kafka_jars.spark_conf() == {"spark.jars": f"{folder}/kafka-clients-3.9.2.jar,"
                                                     f"{folder}/spark-sql-kafka-0-10_2.13-4.2.0.jar"}
