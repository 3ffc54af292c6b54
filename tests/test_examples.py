"""Every program in examples/ runs as written and checks its own result.

Each runs alone in a fresh interpreter with a timeout, as a user would start
it (``python examples/NAME.py``); the programs write only into temporary
directories. ``streaming_rate.py`` is tested through its ``main`` in
tests/test_spark.py. Programs that need Spark are marked ``spark`` and skipped
without a JDK, as tests/test_spark.py is; those that need pyarrow are skipped
without it."""
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TIMEOUT_S = 240
TESTED_ELSEWHERE = {"streaming_rate.py"}
NEEDS = {"files.py": ["pyarrow"], "pyspark_udf.py": ["pyspark", "pyarrow"], "kafka_exactly_once.py": ["confluent_kafka"]}


def _params():
    params = []
    for name in sorted(os.listdir(EXAMPLES)):
        if not name.endswith(".py") or name in TESTED_ELSEWHERE:
            continue
        marks = [pytest.mark.skipif(importlib.util.find_spec(mod) is None, reason=f"needs {mod}")
                 for mod in NEEDS.get(name, [])]
        if "confluent_kafka" in NEEDS.get(name, []):
            from pyflowbuf.connectors.kafka_broker import find_libs
            marks += [pytest.mark.kafka, pytest.mark.skipif(
                find_libs() is None or shutil.which("java") is None,
                reason="needs the local Kafka broker (ci/setup.sh) and Java")]
        if "pyspark" in NEEDS.get(name, []):
            marks += [pytest.mark.spark, pytest.mark.skipif(
                shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                reason="PySpark needs a JDK (17+)")]
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def test_there_is_an_example_per_concept():
    names = set(os.listdir(EXAMPLES))
    for name in ["wordcount.py", "checkpoints.py", "windows.py", "files.py", "workers.py",
                 "monitoring.py", "pyspark_udf.py", "streaming_rate.py", "early_firings.py",
                 "socket_wordcount.py", "monitored_directory.py",
                 "side_outputs.py"]:
        assert name in names


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("name", _params())
def test_example_runs_as_written(name, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))
    res = subprocess.run([sys.executable, os.path.join(EXAMPLES, name)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=TIMEOUT_S, env=env)
    assert res.returncode == 0, f"examples/{name} failed:\n--- stdout ---\n{res.stdout[-2000:]}\n--- stderr ---\n{res.stderr[-4000:]}"
    assert sorted(os.listdir(tmp_path)) == [], f"examples/{name} wrote into its working directory"
    # our examples give every stateful operator a uid (docs/checkpoints.md, "Ids without a uid")
    assert "OperatorIdWarning" not in res.stderr, res.stderr[-4000:]
