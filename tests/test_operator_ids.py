"""Operator ids (issue 21): state is stored per operator id and a restore
maps it back by id, so a job can change between runs.

Each test runs a keyed count, stops it with a savepoint, changes the job and
resumes it; the records collected over both runs must be exactly one run's
(each key's running counts 1..n once).
"""
from __future__ import annotations

import collections
import inspect
import json
import pathlib
import re
import time
import warnings

import pytest

import pyflowbuf as fb
from pyflowbuf.cli.checkpoints import open_target, show
from pyflowbuf.checkpoint import IncompatibleCheckpointError
from pyflowbuf.errors import ConfigurationError, OperatorIdWarning
from pipeline_helpers import held_sequence, wait_until_held

N = 3000
KEYS = 7
DATA = pathlib.Path(__file__).parent / "data"


def counting_job(env, *, extra_filter=False, map_name="pair", sums=False, uid_counts=True, sums_uid="sums",
                 p=2, rate=3000, collect_uid="out", hold=None):
    # hold: (value, release file): the first run's source holds there until stopped (held_sequence)
    s = (env.from_sequence(0, N, parallelism=p, rate_limit=rate) if hold is None else
         held_sequence(env, N, parallelism=p, rate_limit=rate, hold_at=hold[0], release=hold[1])).uid("numbers")
    if extra_filter:
        s = s.filter(lambda x: True, name="keep-all")
    pairs = s.map(lambda x: (x % KEYS, 1), name=map_name)
    counts = pairs.key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1]))
    if uid_counts:
        counts = counts.uid("counts")
    out = counts.collect()
    if collect_uid:
        out.uid(collect_uid)
    extra = None
    if sums:
        extra = (pairs.key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1]), name="sums")
                      .uid(sums_uid).collect())
    return out, extra


def check_exactly_once(records):
    per_key = collections.defaultdict(list)
    for k, c in records:
        per_key[k].append(c)
    want = collections.Counter(x % KEYS for x in range(N))
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in want.items()}


def first_run(tmp_path, chaining=True, **kw):
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"),
                         chaining=chaining)
    release = str(tmp_path / "release")
    out, extra = counting_job(env, hold=(N // 3, release), **kw)
    job = env.execute_async()
    wait_until_held(release, kw.get("p", 2), job)
    path = job.stop(savepoint=str(tmp_path / "sp"))
    assert len(out.result) < N, "the first run should stop before its end"
    return path, out, extra


def second_env(tmp_path, **kw):
    return fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"), **kw)


@pytest.mark.parametrize("change", [
    {"extra_filter": True},                       # a stateless operator added
    {"map_name": "to-pair"},                      # a stateless operator renamed
    {"chaining": False},                          # chained differently
    {"p": 3},                                     # another parallelism
])
def test_stateless_changes_restore_exactly_once(tmp_path, change):
    path, out1, _ = first_run(tmp_path)
    change = dict(change)
    env = second_env(tmp_path, chaining=change.pop("chaining", True))
    out2, _ = counting_job(env, rate=None, **change)
    env.execute(60, restore_from=path)
    check_exactly_once(out1.result + out2.result)


def test_a_stateless_operator_removed_restores(tmp_path):
    path, out1, _ = first_run(tmp_path, extra_filter=True)
    env = second_env(tmp_path)
    out2, _ = counting_job(env, rate=None)
    env.execute(60, restore_from=path)
    check_exactly_once(out1.result + out2.result)


def test_state_of_a_removed_operator_is_refused_unless_allowed(tmp_path):
    path, out1, _ = first_run(tmp_path, sums=True)
    env = second_env(tmp_path)
    counting_job(env, rate=None)
    with pytest.raises(IncompatibleCheckpointError, match="'sums'.*allow_non_restored_state=True"):
        env.execute(60, restore_from=path)
    env = second_env(tmp_path)
    out2, _ = counting_job(env, rate=None)
    env.execute(60, restore_from=path, allow_non_restored_state=True)
    check_exactly_once(out1.result + out2.result)


def test_a_new_stateful_operator_starts_empty(tmp_path):
    path, out1, _ = first_run(tmp_path)
    env = second_env(tmp_path)
    out2, sums = counting_job(env, rate=None, sums=True, sums_uid="new-sums")
    env.execute(60, restore_from=path)
    check_exactly_once(out1.result + out2.result)
    # the new operator saw only what came after the savepoint
    finals = {}
    for k, c in sums.result:
        finals[k] = max(finals.get(k, 0), c)
    assert sum(finals.values()) == N - len(out1.result)


def test_an_id_given_to_an_operator_of_another_kind_is_refused(tmp_path):
    path, _, _ = first_run(tmp_path)
    env = second_env(tmp_path)
    env.from_sequence(0, N, parallelism=2).uid("numbers").map(lambda x: (x, 1)).uid("counts").collect().uid("out")
    with pytest.raises(IncompatibleCheckpointError, match="'counts' was a KeyedReduce"):
        env.execute(60, restore_from=path)


def test_derived_ids_follow_the_graph(tmp_path):
    """Without uids the ids are derived from the graph: the same job,
    rescaled or chained differently, finds its state; with a stateless
    operator inserted before the count every id after it is another, and
    the restore is refused rather than starting the count over."""
    path, out1, _ = first_run(tmp_path, uid_counts=False, collect_uid=None)
    env = second_env(tmp_path, chaining=False)
    out2, _ = counting_job(env, rate=None, uid_counts=False, collect_uid=None, p=3)
    env.execute(60, restore_from=path)
    check_exactly_once(out1.result + out2.result)
    reduce_id = next(n.operator_uid for n in env.nodes if n.name == "reduce")
    assert reduce_id.startswith("KeyedReduce-")
    env = second_env(tmp_path)
    counting_job(env, rate=None, uid_counts=False, collect_uid=None, extra_filter=True)
    with pytest.raises(IncompatibleCheckpointError, match=re.escape(repr(reduce_id)) + ".*allow_non_restored_state"):
        env.execute(60, restore_from=path)


def test_a_reduce_inserted_before_a_reduce_without_uids_is_refused(tmp_path):
    """Issue 27, case 4: a new reduce inserted before the old one (no uids)
    took the old one's derived id ("reduce#0") and its sums: results 200
    times too large, with a warning only. Now the old state is refused."""
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    release = str(tmp_path / "release")
    pairs = held_sequence(env, N, parallelism=2, rate_limit=3000, hold_at=N // 3, release=release)
    pairs = pairs.map(lambda x: (x % KEYS, 1))
    pairs.key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).collect()
    job = env.execute_async()
    wait_until_held(release, 2, job)
    path = job.stop(savepoint=str(tmp_path / "sp"))
    env = second_env(tmp_path)
    pairs = env.from_sequence(0, N, parallelism=2).map(lambda x: (x % KEYS, 1))
    scaled = pairs.key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], max(a[1], b[1])), name="peak")
    out = scaled.key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).collect()
    with pytest.raises(IncompatibleCheckpointError, match=r"'peak' \(id 'KeyedReduce-.*fed CollectSink in the "
                                                          r"checkpoint and feeds KeyedReduce here.*\.uid\("):
        env.execute(60, restore_from=path)
    assert out.result == []
    # `pyflowbuf checkpoints show` says which ids were derived, and how
    shown = {o["name"]: o for o in show(open_target(path))["operators"]}
    assert shown["reduce"]["id_from"] == "graph" and shown["reduce"]["uid"].startswith("KeyedReduce-")
    assert shown["sequence"]["id_from"] == "graph" and shown["collect"]["id_from"] == "graph"


def test_checkpoints_show_tells_uids_from_ids_derived_by_name_and_rank():
    """A savepoint of an earlier release holds no id scheme: its name#rank
    ids are shown as such (test_savepoints restores it)."""
    shown = {o["uid"]: o["id_from"] for o in show(open_target(DATA / "savepoint-format-2"))["operators"]}
    assert shown == {"numbers": "uid", "map#0": "name#rank", "counts": "uid", "collect#0": "name#rank"}


def test_an_operator_given_a_uid_keeps_the_state_of_its_derived_id(tmp_path):
    """The way out of a refused change: restore into the job as it was, now
    with uids; each operator finds the state of the id derived for it."""
    path, out1, _ = first_run(tmp_path, uid_counts=False, collect_uid=None)
    env = second_env(tmp_path)
    out2, _ = counting_job(env, rate=None, uid_counts=True, collect_uid="out")
    env.execute(60, restore_from=path)
    check_exactly_once(out1.result + out2.result)


def test_uids_are_checked():
    env = fb.Environment()
    s = env.from_sequence(0, 10).map(lambda x: x).uid("a")
    with pytest.raises(ConfigurationError, match="already the id"):
        s.map(lambda x: x).uid("a")
    with pytest.raises(TypeError):
        s.uid("")
    with pytest.raises(TypeError):
        s.uid(3)


def test_a_stateful_operator_without_uid_warns_when_checkpointing(tmp_path):
    env = fb.Environment(checkpoint_interval=1.0, checkpoint_dir=str(tmp_path / "ck"))
    env.from_sequence(0, 10).key_by(lambda x: x % 2).reduce(lambda a, b: a + b).collect()
    declared = inspect.currentframe().f_lineno - 1
    with pytest.warns(OperatorIdWarning, match="'reduce' has no uid.*'KeyedReduce-") as got:
        env.execute(30)
    # it points at the line that declared the operator, not into pyflowbuf
    assert [(w.filename, w.lineno) for w in got] == [(__file__, declared)]
    env = fb.Environment(checkpoint_interval=1.0, checkpoint_dir=str(tmp_path / "ck2"))
    env.from_sequence(0, 10).key_by(lambda x: x % 2).reduce(lambda a, b: a + b).uid("sum").collect()
    env2 = fb.Environment()
    env2.from_sequence(0, 10).key_by(lambda x: x % 2).reduce(lambda a, b: a + b).collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error", OperatorIdWarning)
        env.execute(30)         # every stateful operator has a uid
        env2.execute(30)        # no checkpoints: nothing to warn about


# ---- sinks have ids too: a file sink's part numbers are stored under it ----

def _lines_job(env, out_dir, *, other_dir=None, sink_uid="lines", rate=None, hold=None):
    s = (env.from_sequence(0, N, parallelism=2, rate_limit=rate) if hold is None else
         held_sequence(env, N, parallelism=2, rate_limit=rate, hold_at=hold[0], release=hold[1]))
    s = s.uid("numbers").map(lambda x: x * 2)
    if other_dir is not None:
        s.write_text(other_dir)          # a new sink of the same name, declared first
    sink = s.write_text(out_dir)
    return sink.uid(sink_uid) if sink_uid else sink


def _lines(directory):
    return sorted(int(line) for f in directory.glob("part-*") for line in f.read_text().splitlines())


@pytest.mark.parametrize("workers", [None, 2])
def test_a_sink_found_by_its_uid_when_a_sink_is_added_writes_exactly_once(tmp_path, workers):
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    release = str(tmp_path / "release")
    handle = _lines_job(env, str(tmp_path / "out"), rate=3000, hold=(N // 3, release))
    assert isinstance(handle, fb.DataSink) and repr(handle) == "<DataSink 'write_text' uid='lines'>"
    job = env.execute_async()
    wait_until_held(release, 2, job)
    path = job.stop(savepoint=str(tmp_path / "sp"))
    assert 0 < len(_lines(tmp_path / "out")) < N, "the first run should stop before its end"
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck2"),
                         workers=workers)
    _lines_job(env, str(tmp_path / "out"), other_dir=str(tmp_path / "other"))
    env.execute(60, restore_from=path)
    assert _lines(tmp_path / "out") == [x * 2 for x in range(N)]


def test_a_sink_whose_derived_id_moved_is_refused_rather_than_writing_over_its_parts(tmp_path):
    """Without a uid, a sink of the same kind declared before it on the same
    stream makes the file sink's derived id ambiguous: restored with the
    other sink's state (or none) it would number its parts from 0 again,
    over the committed ones. Refused, naming uid."""
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    release = str(tmp_path / "release")
    _lines_job(env, str(tmp_path / "out"), sink_uid=None, rate=3000, hold=(N // 3, release))
    job = env.execute_async()
    wait_until_held(release, 2, job)
    path = job.stop(savepoint=str(tmp_path / "sp"))
    before = _lines(tmp_path / "out")
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck2"))
    _lines_job(env, str(tmp_path / "out"), other_dir=str(tmp_path / "other"), sink_uid=None)
    with pytest.raises(IncompatibleCheckpointError, match=r"'write_text' \(id 'TextFileSink-.*1 operator\(s\) of "
                                                          r"its type read the same input\(s\) in the checkpoint, 2 "
                                                          r"here.*\.uid\("):
        env.execute(60, restore_from=path)
    assert _lines(tmp_path / "out") == before          # nothing written over


def test_sink_handles_take_uids_checked_like_streams():
    env = fb.Environment()
    s = env.from_sequence(0, 10).map(lambda x: x).uid("a")
    with pytest.raises(ConfigurationError, match="already the id"):
        s.sink(lambda r: None).uid("a")
    with pytest.raises(TypeError):
        s.print().uid("")
    out = s.collect().uid("results")
    assert out.uid("results") is out          # (its own id again is fine)
    env.execute(30)
    assert out.result == list(range(10))
    assert {n.uid for n in env.nodes} >= {"a", "results"}


# ---- our own jobs give their stateful operators uids ----

def test_the_main_jobs_declare_a_uid_for_each_stateful_operator(tmp_path):
    """The demo's checkpointing jobs (pyflowbuf/demo.py), declared without
    running them: no OperatorIdWarning. (The examples and the docs' blocks
    are checked as they run: tests/test_examples.py, test_readme_snippets.py.)"""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from pyflowbuf import demo
    from pyflowbuf.checkpointing.restore import check_operator_ids
    from pyflowbuf.spark import cluster_demo       # (imports no pyspark until it runs)

    src = tmp_path / "lines.parquet"
    pq.write_table(pa.table({"ts": [0.0, 1.0], "text": ["a b", "c"]}), src)
    env1 = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "ck1"))
    demo.checkpoint_job(env1, 100, lambda x: x, tmp_path / "out")
    env2 = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "ck2"))
    demo.windows_job(env2, src, 2, lambda r: r)
    env3 = fb.Environment(parallelism=2, checkpoint_interval=0.2, checkpoint_dir=str(tmp_path / "ck3"))
    cluster_demo.cluster_job(env3, [("a", 0.0)], 1, str(tmp_path / "marker"), str(tmp_path / "ck3"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", OperatorIdWarning)
        for env in (env1, env2, env3):
            check_operator_ids(env)


def test_the_warning_points_at_the_job_module_under_pyflowbuf_run(tmp_path):
    """Under `pyflowbuf run job.py` the warning names job.py's line, not
    pyflowbuf's (issue 27)."""
    from cli_helpers import cli

    job = tmp_path / "job.py"
    job.write_text("import pyflowbuf as fb\n"
                   f"env = fb.Environment(checkpoint_interval=1.0, checkpoint_dir={str(tmp_path / 'ck')!r})\n"
                   "out = env.from_sequence(0, 10).uid('numbers').key_by(lambda x: x % 2)\n"
                   "out = out.reduce(lambda a, b: a + b).collect().uid('out')\n")
    with pytest.warns(OperatorIdWarning, match="'reduce' has no uid") as got:
        code, _, err = cli("run", str(job))
    assert code == 0, err
    assert [(w.filename, w.lineno) for w in got] == [(str(job), 4)]


# ---- checkpoints written before ids were derived from the graph ----

@pytest.fixture
def legacy_writer(monkeypatch):
    """Checkpoints written as releases before ids were derived from the graph
    wrote them: ids of name and rank ("map#0"), no ``id_scheme``. Returns the
    function that ends it (the restore then runs as this release does)."""
    from pyflowbuf.checkpointing import coordinator as checkpointing, restore
    from pyflowbuf.jobgraph import graph

    assign, properties = graph.assign_uids, restore.metadata_properties

    def legacy_assign(nodes):
        assign(nodes)
        for n in nodes:
            n.derived_uid, n.id_info = n.legacy_uid, None

    def legacy_properties(*args, **kw):
        out = properties(*args, **kw)
        del out["id_scheme"], out["derived_ids"]
        return out

    monkeypatch.setattr(graph, "assign_uids", legacy_assign)
    monkeypatch.setattr(restore, "assign_uids", legacy_assign)
    monkeypatch.setattr(checkpointing, "metadata_properties", legacy_properties)
    return monkeypatch.undo


@pytest.mark.parametrize("p2", [2, 3])
def test_an_unaligned_checkpoint_of_name_rank_ids_restores_its_inflight_data(tmp_path, legacy_writer, p2):
    """Its in-flight data names its edges by those ids: read as this job's
    ids, it goes back in place (the same parallelism) or moves by key group."""
    from pyflowbuf.checkpoint import CheckpointStorage
    from test_unaligned_rescale import committed, expected, run_cancel, slow_job

    out, ck, n = str(tmp_path / "out"), str(tmp_path / "ck"), 3000
    conf = dict(checkpoint_interval=0.25, checkpoint_dir=ck, checkpoint_alignment="unaligned", segment_size=4096)
    env = fb.Environment(parallelism=2, **conf)
    slow_job(env, 2, n, out, ("reduce",), delay=0.003, rate=3000)
    run_cancel(env, ck)
    legacy_writer()
    meta = CheckpointStorage(ck).latest()
    assert "id_scheme" not in meta.properties and "map#0" in meta.properties["operators"]
    env2 = fb.Environment(parallelism=p2, **conf)
    slow_job(env2, p2, n, out, ("reduce",))
    env2.execute(180, restore_from="latest")
    assert committed(out) == expected(n, ("reduce",))


# ---- derived ids, from the graph alone (nothing runs) ----

def _ids(p=2, chaining=True, rebalance=False, name="count", extra=False, upstream_uid=False, window="reduce"):
    from pyflowbuf.windows import Count

    env = fb.Environment(parallelism=p, chaining=chaining)
    s = env.from_sequence(0, 10)
    if extra:
        s = s.filter(lambda x: True)
    if rebalance:
        s = s.rebalance()
    s = s.map(lambda x: (x % 2, 1))
    if upstream_uid:
        s = s.uid("pairs")
    timed = s.assign_timestamps(lambda kv: kv[1]).key_by(lambda kv: kv[0])
    counts = timed.reduce(lambda a, b: (a[0], a[1] + b[1]), name=name)
    w = timed.window(fb.Tumbling(1.0))
    (w.reduce(lambda a, b: a) if window == "reduce" else w.aggregate(Count())).collect()
    counts.collect()
    env.plan()
    return {n.name if n.name != name else "count": n.derived_uid for n in env.nodes if n.name != "collect"}


@pytest.mark.parametrize("change", [{"p": 3}, {"chaining": False}, {"rebalance": True}, {"name": "tally"},
                                    {"upstream_uid": True}])
def test_a_rescale_rechaining_rename_or_a_uid_upstream_keeps_every_derived_id(change):
    assert _ids(**change) == _ids()


def test_an_operator_inserted_changes_the_derived_ids_after_it_and_windows_differ_by_kind():
    before, after = _ids(), _ids(extra=True)
    assert before["sequence"] == after["sequence"]
    assert all(before[k] != after[k] for k in ("map", "timestamps", "count", "window_reduce"))
    assert _ids(window="aggregate")["window_aggregate"] != before["window_reduce"]


def test_a_savepoint_of_name_rank_ids_restores_into_the_job_given_uids(tmp_path):
    """tests/data/savepoint-format-2 (an earlier release's): its collect()
    had no uid ("collect#0"); given one now, it still finds its state."""
    src = DATA / "savepoint-format-2"
    expected = json.loads((src / "expected.json").read_text())
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    out = (env.from_sequence(0, expected["n"], parallelism=2).uid("numbers")
              .map(lambda x: (x % 7, 1)).key_by(lambda kv: kv[0])
              .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts").collect().uid("out"))
    env.execute(60, restore_from=str(src))
    at = {int(k): v for k, v in expected["counts_at_savepoint"].items()}
    totals = collections.Counter(x % expected["keys"] for x in range(expected["n"]))
    per_key = collections.defaultdict(list)
    for k, c in out.result:
        per_key[k].append(c)
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(at[k] + 1, totals[k] + 1)) for k in totals}
