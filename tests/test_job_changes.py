"""Job changes between a savepoint and its restore (issue 27): whatever
changes, the restored job counts exactly once, or the restore is refused
with a typed error. Never a silently wrong count.

The job: numbers -> [a filter] -> [rebalance] -> pairs (key, 1) -> [a keyed
reduce keeping the last record: stateful, passes records on unchanged] ->
a keyed running count -> [the same after it] -> collect. The reduces are
named "reduce" (the count now and then "tally"): operators of one name and
type, as in issue 27's case 4. A savepoint is
taken mid-way (the first run is stopped once records flow, long before its
rate-limited source ends); the second run, changed, restores it and reads
the rest. The reference model: each key's running counts over both runs
are 1..n, n its number of records in the whole input.

The changes drawn: a stateless or stateful operator inserted or removed
before or after the count, chaining on or off, a ``rebalance()`` added or
removed, the count renamed, another parallelism (1..3) before and after,
with or without uids in each run. A change of the key kind is its own test
below."""
from __future__ import annotations

import collections
import time

import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import pyflowbuf as fb
from pyflowbuf.checkpoint import CheckpointError
from pyflowbuf.errors import ConfigurationError, JobFailedError

N = 600
KEYS = 5
RATE = 40                   # records per second (and subtask) in the first run: it would last 5 s or more
TYPED_REFUSALS = (ConfigurationError, CheckpointError)

# each example runs two short jobs: a modest share of the profile's examples
EXAMPLES = max(3, settings().max_examples // 5)


def declare(env, shape, seen=None, rate=None):
    """The job of ``shape`` on ``env``; returns its collect() handle."""
    uids = shape["uids"]

    def uid(stream, name):
        return stream.uid(name) if uids else stream

    s = uid(env.from_sequence(0, N, parallelism=shape["p"], rate_limit=rate), "numbers")
    if shape["filter"]:
        s = s.filter(lambda x: True, name="keep-all")
    if shape["rebalance"]:
        s = s.rebalance()

    def pair(x):
        if seen is not None:
            seen.append(x)
        k = x % KEYS
        return (str(k) if shape["str_keys"] else k, 1)

    pairs = s.map(pair, name="pairs")
    if shape["last_before"]:
        pairs = uid(pairs.key_by(lambda kv: kv[0]).reduce(lambda a, b: b), "last-before")
    counts = uid(pairs.key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1]), name=shape["name"]),
                 "counts")
    if shape["last_after"]:
        counts = uid(counts.key_by(lambda kv: kv[0]).reduce(lambda a, b: b), "last-after")
    out = counts.collect()
    return out.uid("out") if uids else out


def environment(tmp, shape, sub):
    return fb.Environment(parallelism=shape["p"], chaining=shape["chaining"], checkpoint_interval=0.2,
                          checkpoint_dir=str(tmp / sub))


def exactly_once(records) -> bool:
    """Each key's running counts over both runs are 1..n, once each (keys
    compared by value: "3" and 3 are one key of the input)."""
    per_key = collections.defaultdict(list)
    for k, c in records:
        per_key[int(k)].append(c)
    want = collections.Counter(x % KEYS for x in range(N))
    return {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in want.items()}


def first_run(tmp, shape):
    """Run ``shape`` until records flow, then stop it with a savepoint."""
    env = environment(tmp, shape, "ck1")
    seen: list = []
    out = declare(env, shape, seen, rate=RATE)
    job = env.execute_async()
    deadline = time.monotonic() + 60
    while len(seen) < 10:
        assert time.monotonic() < deadline and not job.done, "the first run did not start"
        time.sleep(0.01)
    path = job.stop(savepoint=str(tmp / "sp"))
    assert len(out.result) < N, "the first run should stop before its end"
    return path, out.result


def restore(tmp, shape, path):
    """The changed job restored from ``path``: its records, or the typed refusal."""
    env = environment(tmp, shape, "ck2")
    out = declare(env, shape)
    try:
        env.execute(60, restore_from=path)
    except TYPED_REFUSALS as exc:
        return None, exc
    except JobFailedError as exc:
        # a changed key kind shows at the first key a restored operator computes: the job fails
        # with the typed refusal as its cause, before anything is committed
        if isinstance(exc.__cause__, TYPED_REFUSALS):
            return None, exc.__cause__
        raise
    return out.result, None


shapes = st.fixed_dictionaries({
    "p": st.integers(1, 3), "chaining": st.booleans(), "rebalance": st.booleans(), "filter": st.booleans(),
    "last_before": st.booleans(), "last_after": st.booleans(), "name": st.sampled_from(["reduce", "tally"]),
    "uids": st.booleans(), "str_keys": st.just(False)})

CHANGES = ["filter", "rebalance", "chaining", "last_before", "last_after", "name", "p", "str_keys"]


@st.composite
def changed(draw, shape):
    """``shape`` with one or more changes, and whether its uids changed."""
    new = dict(shape)
    for what in draw(st.lists(st.sampled_from(CHANGES), min_size=1, max_size=3, unique=True)):
        if what == "name":
            new["name"] = "tally" if shape["name"] == "reduce" else "reduce"
        elif what == "p":
            new["p"] = draw(st.integers(1, 3))
        else:
            new[what] = not shape[what]
    # mostly the same uids as before; now and then given or taken away
    new["uids"] = draw(st.sampled_from([shape["uids"]] * 3 + [not shape["uids"]]))
    return new


@settings(max_examples=EXAMPLES, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
@pytest.mark.filterwarnings("ignore::pyflowbuf.errors.OperatorIdWarning")
def test_a_changed_job_counts_exactly_once_or_is_refused(tmp_path_factory, data):
    before = data.draw(shapes, label="before")
    after = data.draw(changed(before), label="after")
    tmp = tmp_path_factory.mktemp("change")
    path, first = first_run(tmp, before)
    second, refused = restore(tmp, after, path)
    event("refused" if refused is not None else "restored")
    if refused is None:
        assert exactly_once(first + second), (before, after)
    # and what must restore does: the same operators (uids, or derived ids of an unchanged graph)
    removed_state = (before["last_before"] and not after["last_before"]) or \
        (before["last_after"] and not after["last_after"])
    same_graph = all(before[k] == after[k] for k in ("filter", "last_before", "last_after"))
    same_keys = before["str_keys"] == after["str_keys"]       # else refused, unless migrated
    if same_keys and ((before["uids"] and after["uids"] and not removed_state)
                      or (not before["uids"] and same_graph)):
        assert refused is None, (before, after, refused)


@pytest.mark.parametrize("uids", [True, False])
@pytest.mark.filterwarnings("ignore::pyflowbuf.errors.OperatorIdWarning")
def test_a_changed_key_kind_counts_exactly_once_or_is_refused(tmp_path, uids):
    """``x % 5`` before, ``str(x % 5)`` after: the int keys' state would be
    orphaned and the str keys start from zero."""
    before = {"p": 2, "chaining": True, "rebalance": False, "filter": False, "last_before": False,
              "last_after": False, "name": "reduce", "uids": uids, "str_keys": False}
    after = dict(before, str_keys=True)
    path, first = first_run(tmp_path, before)
    second, refused = restore(tmp_path, after, path)
    assert refused is not None or exactly_once(first + second)


def test_the_reference_model_catches_a_restarted_count():
    """(The check itself: counts started over, or one count twice, are wrong.)"""
    whole = [(x % KEYS, n) for x in range(KEYS) for n in range(1, N // KEYS + 1)]
    assert exactly_once(whole)
    assert not exactly_once(whole + [(0, 1)])
    assert not exactly_once([(str(k), n) for k, n in whole[:10]] + whole)
