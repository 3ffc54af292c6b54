"""Jars fetched from Maven Central once into a cache folder, with ``mvn``
(``dependency:copy-dependencies`` of a small POM): the local Kafka broker's
(``kafka_broker.install``) and, for benchmarks, Flink's
(``benchmarks/flink_peer``). A folder holds a ``.complete`` file only once
every jar is in it, so an interrupted fetch is never taken for a cache."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile

COMPLETE = ".complete"


def cache_folder(env_var: str, name: str) -> str:
    """A jar cache folder: ``$<env_var>`` when set, else
    ``~/.cache/pyflowbuf/<name>`` (``$XDG_CACHE_HOME`` honoured)."""
    given = os.environ.get(env_var)
    if given:
        return given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pyflowbuf", name)


def complete(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, COMPLETE))


def fetch_jars(target: str, pom: str, *, expect: str, label: str, error, missing_mvn: str) -> bool:
    """Fill ``target`` with the runtime dependencies of ``pom`` (POM text);
    False when it was complete already. ``expect``: a glob one fetched jar
    must match; ``label``: written into the marker; ``error``: the exception
    class raised, with ``missing_mvn`` as its message when there is no mvn."""
    if complete(target):
        return False
    mvn = shutil.which("mvn")
    if mvn is None:
        raise error(missing_mvn)
    parent = os.path.dirname(target) or "."
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".jars-", dir=parent)
    try:
        pom_path = os.path.join(staging, "pom.xml")
        with open(pom_path, "w") as f:
            f.write(pom)
        libs = os.path.join(staging, "libs")
        cmd = [mvn, "-B", "-q", "-f", pom_path, "dependency:copy-dependencies",
               f"-DoutputDirectory={libs}", "-DincludeScope=runtime"]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0 or not glob.glob(os.path.join(libs, expect)):
            raise error(f"mvn could not fetch {label} ({' '.join(cmd)}):\n{(run.stdout + run.stderr)[-3000:]}")
        with open(os.path.join(libs, COMPLETE), "w") as f:
            f.write(f"{label}\n")
        if os.path.exists(target):          # an incomplete earlier try
            shutil.rmtree(target)
        os.replace(libs, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True
