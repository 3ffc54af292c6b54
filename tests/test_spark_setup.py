"""How pyflowbuf sets PySpark up: the pandas versions its spark extra allows
are those the installed PySpark supports, and local_session keeps a local
job's traffic on loopback."""
import os
import shutil
import subprocess
import sys
import tomllib
import warnings

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pandas")
from packaging.requirements import Requirement  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _extra_requirement(extra, name):
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    reqs = [Requirement(r) for r in extras[extra]]
    return next(r for r in reqs if r.name == name)


@pytest.mark.parametrize("version", ["2.0.3", "2.1.4", "2.2.0", "2.2.3", "2.3.3", "3.0.0", "3.0.2", "3.1.1",
                                     "4.0.0"])
def test_spark_extra_allows_only_pandas_versions_pyspark_supports(version, monkeypatch):
    """Differential: PySpark's own check of a pandas version (an ImportError
    below its minimum, a FutureWarning where its support is incomplete)
    against the spark extra's specifier, for versions on both sides: what
    the extra allows, the installed PySpark takes without a word."""
    import pandas
    from pyspark.sql.pandas.utils import require_minimum_pandas_version

    monkeypatch.setattr(pandas, "__version__", version)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        try:
            require_minimum_pandas_version()
            supported = True
        except (ImportError, FutureWarning):
            supported = False
        except Exception as exc:      # PySpark's own error class for a too-old pandas
            if "pandas" not in str(exc).lower():
                raise
            supported = False
    allowed = _extra_requirement("spark", "pandas").specifier.contains(version)
    assert supported or not allowed, (version, str(_extra_requirement("spark", "pandas")))


@pytest.mark.spark
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                    reason="PySpark needs a JDK (17+)")
def test_local_session_binds_spark_to_loopback():
    """In a fresh process (the JVM reads SPARK_LOCAL_IP when it starts): the
    driver is on 127.0.0.1 and Spark does not go looking for another
    interface (its 'resolves to a loopback address' warning)."""
    code = (
        "import os\n"
        "os.environ.pop('SPARK_LOCAL_IP', None)\n"
        "from pyflowbuf.spark import local_session\n"
        "s = local_session('loopback', cores=1)\n"
        "print('LOCAL_IP', os.environ['SPARK_LOCAL_IP'])\n"
        "print('HOST', s.conf.get('spark.driver.host'))\n"
        "print('COUNT', s.range(10).count())\n"
        "s.stop()\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "LOCAL_IP 127.0.0.1" in res.stdout and "HOST 127.0.0.1" in res.stdout and "COUNT 10" in res.stdout
    assert "resolves to a loopback address" not in res.stderr, res.stderr[-3000:]
    assert "SPARK_LOCAL_IP" not in res.stderr, res.stderr[-3000:]
