"""The job description the runtime receives (``pyflowbuf.jobgraph.spec.JobSpec``):
a job runs from its spec alone, a spec travels pickled, and nothing below
``api/`` reads an ``Environment`` (issue 28, item 1)."""
import ast
import gc
import importlib.util
import os
import re
import weakref

import pytest

import pyflowbuf as fb
from pyflowbuf.cluster.driver import ClusterExecution
from pyflowbuf.jobgraph.spec import JobSpec
from pyflowbuf.runtime.job import JobExecution

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
_spec = importlib.util.spec_from_file_location("layout_for_jobspec", os.path.join(_HERE, "test_layout.py"))
layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout)


def _word_count_spec(**settings):
    """A keyed job's spec, with no Environment left alive behind it (the
    weak reference says so): what the runtime gets is the spec alone."""
    env = fb.Environment(parallelism=2, buffer_timeout=0.01, **settings)
    (env.from_collection(["a b", "b c", "b"]).flat_map(str.split)
        .key_by(lambda w: w).map(lambda w: (w, 1)).collect())
    spec = env.job_spec()
    gone = weakref.ref(env)
    del env
    gc.collect()
    assert gone() is None, "the spec (or its nodes) holds the Environment"
    return spec


def _collected(spec):
    sink = spec.nodes[-1]
    return sorted(r for part in sink.collect_parts.values() for r in part)


WORDS = [("a", 1), ("b", 1), ("b", 1), ("b", 1), ("c", 1)]


def test_a_job_runs_from_its_spec_alone():
    spec = _word_count_spec()
    assert isinstance(spec, JobSpec) and spec.parallelism == 2 and spec.network_config.buffer_timeout == 0.01
    JobExecution(spec).run(timeout=60)
    assert _collected(spec) == WORDS


def test_a_job_runs_from_its_spec_alone_on_workers():
    # the driver's part (ClusterExecution) and the forked workers' too
    spec = _word_count_spec(workers=2)
    assert spec.workers == 2
    ClusterExecution(spec).run(timeout=60)
    assert _collected(spec) == WORDS


def test_a_spec_pickles_unpickles_and_runs():
    from pyspark import cloudpickle      # as a SparkCluster ships it: the nodes hold the user's functions

    spec = _word_count_spec(checkpoint_interval=5.0, checkpoint_dir="/tmp/pyflowbuf-jobspec-unused",
                            prometheus_port=0, control_port=0)
    copy = cloudpickle.loads(cloudpickle.dumps(spec))
    assert [n.name for n in copy.nodes] == [n.name for n in spec.nodes]
    assert copy.checkpoint_config == spec.checkpoint_config and copy.name == spec.name
    worker = copy.for_worker(bind_host="127.0.0.1").replace(checkpoint_config=fb.CheckpointConfig())
    # a worker's spec: its host, and neither the metrics nor the control endpoint (the driver serves them)
    assert worker.network_config.bind_host == "127.0.0.1" and worker.control_port is None
    assert worker.metrics_config.prometheus_port is None and worker.workers is None
    JobExecution(worker).run(timeout=60)
    assert _collected(worker) == WORDS
    assert _collected(spec) == []       # the original's results are not touched


def test_the_spec_resolves_the_settings():
    env = fb.Environment(parallelism=3, max_parallelism=64, name="payments", checkpoint_interval=1.0,
                         restart_attempts=2, debloat=True, allow_pickle=True, chaining=False)
    env.from_sequence(0, 3).collect()
    spec = env.job_spec()
    assert (spec.name, spec.parallelism, spec.max_parallelism, spec.chaining) == ("payments", 3, 64, False)
    assert spec.checkpoint_config.directory == env.checkpoint_dir and spec.default_checkpoint_dir
    assert spec.restart_config.attempts == 2 and spec.debloat_config.enabled and spec.allow_pickle
    assert spec.nodes is env.nodes
    assert not fb.Environment(checkpoint_interval=1.0, checkpoint_dir="ck").job_spec().default_checkpoint_dir


# ---- nothing below api/ reads an Environment ----

def _below_api():
    api = [name for name, _ in layout.LAYERS].index("api")
    pkg = os.path.join(_ROOT, "pyflowbuf")
    for dirpath, _, files in os.walk(pkg):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, _ROOT)[:-3].replace(os.sep, ".")
            module = rel[: -len(".__init__")] if rel.endswith(".__init__") else rel
            rank = layout.layer_of(module)
            if rank is not None and rank < api:
                yield module, path


def _environment_uses(path):
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    found = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
             for m in re.finditer(r"\benv\.\w*", text)]
    for node in ast.walk(ast.parse(text, path)):
        if isinstance(node, ast.Name) and node.id == "Environment" or \
                isinstance(node, ast.Attribute) and node.attr == "Environment":
            found.append(f"line {node.lineno}: names Environment")
        elif isinstance(node, ast.arg) and node.arg == "env":
            found.append(f"line {node.lineno}: a parameter named env")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(n == "pyflowbuf.api" or n.startswith("pyflowbuf.api.") for n in names):
                found.append(f"line {node.lineno}: imports pyflowbuf.api")
    return found


def test_no_module_below_api_reads_an_environment():
    modules = dict(_below_api())
    assert "pyflowbuf.runtime.job" in modules and "pyflowbuf.cluster.driver" in modules
    assert "pyflowbuf.api.environment" not in modules and "pyflowbuf.spark.cluster" not in modules
    bad = {m: hits for m, path in modules.items() if (hits := _environment_uses(path))}
    assert not bad, "below api/, the runtime receives a JobSpec, never the Environment:\n" + "\n".join(
        f"{m}: {h}" for m, hits in sorted(bad.items()) for h in hits)


def test_the_scan_sees_an_environment_read(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f(job):\n    return job.env.name\n")
    assert _environment_uses(p)
    p.write_text("from pyflowbuf.api import Environment\n")
    assert _environment_uses(p)
    p.write_text("def f(spec):\n    return spec.name\n")
    assert not _environment_uses(p)


@pytest.mark.parametrize("field", ["timestamps", "event_time", "single_subtask", "open_tags", "input_paths",
                                   "key_migration", "side_readers", "assigns_timestamps", "drops_timestamps",
                                   "window_late"])
def test_every_node_fact_is_a_declared_field(field):
    from dataclasses import fields

    from pyflowbuf.jobgraph.graph import Node

    assert field in {f.name for f in fields(Node)}
