"""Salted hashes (issue 27, case 6): ``key_by(lambda u: hash(u))`` over
strings gives a key that depends on the process's hash salt (PYTHONHASHSEED),
so after a stop and resume in a new process every key is new. Key functions
that call the builtin ``hash`` are found at declaration and refused where
keys must agree across processes or runs (checkpoints on, a SparkCluster),
unless PYTHONHASHSEED is fixed; ``stable_key`` is the escape hatch."""
from __future__ import annotations

import builtins
import collections
import functools
import json
import os
import subprocess
import sys
import textwrap
import types

import pytest
from hypothesis import given, settings, strategies as st

import pyflowbuf as fb
from pyflowbuf._validation import check_key_hashes, salted_hash_use
from pyflowbuf.errors import ConfigurationError, SaltedHashError


# ---- detection ----

def _helper_hash(u):
    return hash(u) % 97


def _helper_plain(u):
    return len(u) % 97


class _CallHash:
    def __call__(self, u):
        return hash(u)


class _CallPlain:
    def __call__(self, u):
        return u


class _Methods:
    def hashed(self, u):
        return u.__hash__()

    def plain(self, u):
        return u


_BASES = {
    True: [lambda u: hash(u), lambda u: hash((u, 1)) % 8, lambda u: builtins.hash(u), _helper_hash, _CallHash(),
           _Methods().hashed, lambda u: [hash(c) for c in u][0], lambda u: _helper_hash(u), hash],
    False: [lambda u: u, lambda u: u.hash, lambda u: len(u), _helper_plain, _CallPlain(), _Methods().plain,
            lambda u: [c for c in u][0], lambda u: _helper_plain(u), str, lambda u: fb.stable_hash(u)],
}


def _wrap(fn, how):
    if how == "partial":
        return functools.partial(lambda f, u: f(u), fn)
    if how == "lambda":
        return lambda u: fn(u)
    if how == "nested":
        def outer(u):
            def inner(v):
                return fn(v)
            return inner(u)
        return outer
    if how == "method":
        class Holder:
            def key(self, u, _f=fn):
                return _f(u)
        return Holder().key
    return fn


@settings(max_examples=200, deadline=None)
@given(uses=st.booleans(), data=st.data(), layers=st.lists(st.sampled_from(["partial", "lambda", "nested", "method"]),
                                                             max_size=3))
def test_a_hash_call_is_found_through_any_wrapping(uses, data, layers):
    fn = data.draw(st.sampled_from(_BASES[uses]))
    for how in layers:
        fn = _wrap(fn, how)
    assert (salted_hash_use(fn) is not None) == uses


def test_a_local_named_hash_is_not_the_builtin():
    def key(u, hash=len):
        return hash(u)
    assert salted_hash_use(key) is None


def test_stable_key_is_the_escape_hatch():
    assert salted_hash_use(fb.stable_key(lambda u: hash(u))) is None
    assert salted_hash_use(fb.stable_key(hash)) is None


# ---- per mode, at execute ----

def _job(env, key_fn):
    (env.from_collection([f"user{i % 5}" for i in range(50)])
        .map(lambda u: (u, 1)).key_by(lambda kv: key_fn(kv[0])).reduce(lambda a, b: (a[0], a[1] + b[1]))
        .uid("counts").collect())


def test_checkpoints_refuse_a_salted_key_without_a_fixed_seed(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    _job(env, lambda u: hash(u))
    with pytest.raises(SaltedHashError) as info:
        env.execute(60)
    assert isinstance(info.value, ConfigurationError)
    text = str(info.value)
    assert "key_by" in text and "PYTHONHASHSEED" in text and "stable_key" in text and "lambda" in text


def test_a_fixed_seed_or_stable_key_lets_it_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    _job(env, lambda u: hash(u))
    env.execute(60)
    monkeypatch.delenv("PYTHONHASHSEED")
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck2"))
    _job(env, fb.stable_key(lambda u: hash(u)))
    env.execute(60)


@pytest.mark.parametrize("kw", [{"parallelism": 2}, {"parallelism": 2, "workers": 2}])
def test_without_checkpoints_one_process_and_forked_workers_are_right(monkeypatch, kw):
    """Forked workers share the driver's hash salt: a str's hash is the same in all of them."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    env = fb.Environment(**kw)
    out = (env.from_collection([f"user{i % 5}" for i in range(50)])
              .map(lambda u: (u, 1)).key_by(lambda kv: hash(kv[0])).reduce(lambda a, b: (a[0], a[1] + b[1]))
              .collect())
    env.execute(60)
    final = collections.defaultdict(int)
    for u, c in out.result:
        final[u] = max(final[u], c)
    assert dict(final) == {f"user{i}": 10 for i in range(5)}


@pytest.mark.filterwarnings("ignore::pyflowbuf.errors.OperatorIdWarning")
def test_joins_are_checked_too(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    a = env.from_collection([("a", 1)]).assign_timestamps(lambda r: 0.0)
    b = env.from_collection([("a", 2)]).assign_timestamps(lambda r: 0.0)
    (a.join(b).where(lambda r: hash(r[0])).equal_to(lambda r: r[0])
      .window(fb.Tumbling(1.0)).apply(lambda x, y: (x, y)).collect())
    with pytest.raises(SaltedHashError, match="where"):
        env.execute(60)


class _FakeCluster:
    def __init__(self, executor_seed):
        self.executor_seed = executor_seed

    def _conf(self, key, default=None):
        return self.executor_seed if key == "spark.executorEnv.PYTHONHASHSEED" else default


@pytest.mark.parametrize("driver,executors,refused", [
    (None, None, True), ("1", None, True), (None, "1", True), ("1", "2", True), ("1", "1", False)])
def test_a_spark_cluster_needs_one_fixed_seed_everywhere(monkeypatch, driver, executors, refused):
    if driver is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", driver)
    found = [("key_by after 'pair'", "hash() in <lambda>")]
    if refused:
        with pytest.raises(SaltedHashError, match="spark.executorEnv.PYTHONHASHSEED"):
            check_key_hashes(found, checkpoints=False, cluster=_FakeCluster(executors))
    else:
        check_key_hashes(found, checkpoints=False, cluster=_FakeCluster(executors))


# ---- the wrong result the check prevents: a resume in a new process ----

SCRIPT = textwrap.dedent("""
    import json, sys, time
    import pyflowbuf as fb
    mode, ck, sp, stable = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    key = (lambda u: hash(u))
    if stable:
        key = fb.stable_key(key)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    out = (env.from_sequence(0, 2000, parallelism=1, rate_limit=2000 if mode == "first" else None).uid("n")
              .map(lambda x: ("user%d" % (x % 50), 1)).key_by(lambda kv: key(kv[0]))
              .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts").collect())
    try:
        if mode == "first":
            job = env.execute_async()
            end = time.monotonic() + 60
            while len(out.result) < 300 and time.monotonic() < end:
                time.sleep(0.01)
            job.stop(savepoint=sp)
        else:
            env.execute(60, restore_from=sp)
    except fb.errors.SaltedHashError as exc:
        print(json.dumps({"error": str(exc)}))
        sys.exit(0)
    print(json.dumps({"records": out.result}))
""")


def _run(tmp_path, mode, seed, stable, tag):
    env = dict(os.environ)
    env.pop("PYTHONHASHSEED", None)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), mode, str(tmp_path / f"ck-{tag}"), str(tmp_path / f"sp-{tag}"),
                          "1" if stable else "0"], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _exactly_once(records):
    per_user = collections.defaultdict(list)
    for u, c in records:
        per_user[u].append(c)
    return sum(sorted(cs) == list(range(1, 41)) for cs in per_user.values())


def test_a_resume_in_a_new_process_with_another_salt_is_wrong_and_refused(tmp_path):
    # what the check prevents: hash() of a str differs in the resumed process; every user's count is wrong
    a = _run(tmp_path, "first", "1", True, "x")
    b = _run(tmp_path, "second", "2", True, "x")
    assert _exactly_once(a["records"] + b["records"]) == 0
    # the same fixed seed in both processes: right
    a = _run(tmp_path, "first", "7", False, "y")
    b = _run(tmp_path, "second", "7", False, "y")
    assert _exactly_once(a["records"] + b["records"]) == 50
    # no seed: refused before anything runs
    got = _run(tmp_path, "first", None, False, "z")
    assert "PYTHONHASHSEED" in got["error"]
