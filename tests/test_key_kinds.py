"""Key kinds (issue 27, case 5): a keyed operator's state is held under keys
of some kinds; a restore whose key function computes keys of another kind
would find none of it (every count starting from zero, without an error).
Checkpoints record the kinds, a restored operator checks its first keys
against them and fails with KeyKindError, unless the job declares a key
migration (Stream.migrate_keys)."""
from __future__ import annotations

import collections
import time
import types

import pytest
from hypothesis import given, settings, strategies as st

import numpy as np

import pyflowbuf as fb
from pyflowbuf.checkpoint import IncompatibleCheckpointError
from pyflowbuf.checkpoint.storage import SavepointStorage
from pyflowbuf.errors import ConfigurationError, JobFailedError
from pyflowbuf.checkpointing import key_kinds
from pyflowbuf.checkpoint import KeyKindError
from pyflowbuf.operators.contracts import Operator
from pipeline_helpers import wait_for

N = 3000
KEYS = 10


def counting(env, key_fn, *, rate=None, migrate=None, p=2, window=False):
    s = env.from_sequence(0, N, parallelism=p, rate_limit=rate).uid("numbers")
    pairs = s.map(lambda x: (x, 1), name="pair")
    counts = pairs.key_by(lambda kv: key_fn(kv[0])).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts")
    if migrate is not None:
        counts = counts.migrate_keys(migrate)
    return counts.map(lambda kv: (kv[0] % KEYS, kv[1]), name="by-key").collect()


def first_run(tmp_path, key_fn=lambda x: x % KEYS, p=2):
    env = fb.Environment(parallelism=p, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    out = counting(env, key_fn, rate=2000, p=p)
    job = env.execute_async()
    wait_for(lambda: len(out.result) >= 200)
    path = job.stop(savepoint=str(tmp_path / "sp"))
    assert len(out.result) < N
    return path, out


def check_exactly_once(records):
    per_key = collections.defaultdict(list)
    for k, c in records:
        per_key[k].append(c)
    want = collections.Counter(x % KEYS for x in range(N))
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in want.items()}


def second_env(tmp_path, **kw):
    return fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"), **kw)


def test_a_changed_key_kind_is_refused_at_the_first_key(tmp_path):
    path, out1 = first_run(tmp_path)
    env = second_env(tmp_path, restart_attempts=3)
    out2 = counting(env, lambda x: str(x % KEYS))
    with pytest.raises(JobFailedError) as info:
        env.execute(60, restore_from=path)
    cause = info.value.__cause__
    assert isinstance(cause, KeyKindError) and isinstance(cause, IncompatibleCheckpointError)
    text = str(cause)
    assert "'counts'" in text and "number" in text and "kind str" in text and "migrate_keys" in text
    assert out2.result == []            # nothing was emitted under a wrong key
    assert env.last_execution.restarts == 0     # a restart would meet the same keys: none


def test_the_same_key_kind_restores(tmp_path):
    path, out1 = first_run(tmp_path)
    env = second_env(tmp_path)
    # another function, same kind: numbers (a float key equals its int)
    out2 = counting(env, lambda x: float(x % KEYS))
    env.execute(60, restore_from=path)
    check_exactly_once(out1.result + [(int(k), c) for k, c in out2.result])


@pytest.mark.parametrize("p", [2, 3])
def test_a_declared_migration_restores_exactly_once(tmp_path, p):
    path, out1 = first_run(tmp_path)
    env = fb.Environment(parallelism=p, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    s = env.from_sequence(0, N, parallelism=2).uid("numbers").map(lambda x: (x, 1), name="pair")
    out2 = (s.key_by(lambda kv: str(kv[0] % KEYS)).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts")
             .migrate_keys(str).map(lambda kv: (kv[0] % KEYS, kv[1]), name="by-key").collect())
    env.execute(60, restore_from=path)
    check_exactly_once(out1.result + out2.result)


def test_a_migrated_checkpoint_is_not_migrated_again(tmp_path):
    path, out1 = first_run(tmp_path)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck2"))
    s = env.from_sequence(0, N, parallelism=2, rate_limit=2000).uid("numbers").map(lambda x: (x, 1), name="pair")
    out2 = (s.key_by(lambda kv: f"k{kv[0] % KEYS}").reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts")
             .migrate_keys(lambda k: f"k{k}").map(lambda kv: (kv[0] % KEYS, kv[1]), name="by-key").collect())
    job = env.execute_async(restore_from=path)
    wait_for(lambda: len(out1.result) + len(out2.result) >= 1000)
    path2 = job.stop(savepoint=str(tmp_path / "sp2"))
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck3"))
    s = env.from_sequence(0, N, parallelism=2).uid("numbers").map(lambda x: (x, 1), name="pair")
    # the same job again: its state holds "k3" already, "kk3" would be wrong
    out3 = (s.key_by(lambda kv: f"k{kv[0] % KEYS}").reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts")
             .migrate_keys(lambda k: f"k{k}").map(lambda kv: (kv[0] % KEYS, kv[1]), name="by-key").collect())
    env.execute(60, restore_from=path2)
    check_exactly_once(out1.result + out2.result + out3.result)


def test_a_migration_that_merges_keys_is_refused(tmp_path):
    path, _ = first_run(tmp_path)
    env = second_env(tmp_path)
    counting(env, lambda x: "one", migrate=lambda k: "one")
    with pytest.raises((IncompatibleCheckpointError, JobFailedError)) as info:
        env.execute(60, restore_from=path)
    assert "cannot be merged" in str(info.value) + str(info.value.__cause__)


def test_migrate_keys_needs_a_keyed_operator():
    env = fb.Environment()
    with pytest.raises(ConfigurationError, match="keeps no keyed state"):
        env.from_sequence(0, 10).map(lambda x: x).migrate_keys(str)


def test_checkpoint_metadata_records_the_key_kinds(tmp_path):
    path, _ = first_run(tmp_path)
    storage = SavepointStorage(path)
    meta = storage.load_metadata(storage.checkpoint_id)
    ops = meta.properties["operators"]
    assert ops["counts"]["key_kinds"] == ["number"]
    assert "key_kinds" not in ops["numbers"]


# ---- kinds: the rules, property-based ----

keys = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.binary(max_size=3),
                 st.none(), st.booleans())


@given(st.lists(keys, max_size=20), keys)
def test_a_key_is_compatible_with_the_kinds_of_keys_of_its_kind(ks, k):
    recorded = key_kinds.kinds_of(ks + [k])
    assert key_kinds.compatible(key_kinds.kind_of(k), recorded)
    assert key_kinds.kinds_of([k]) == {key_kinds.kind_of(k)}


@given(st.lists(st.tuples(keys, keys), min_size=1, max_size=20))
def test_tuple_kinds_are_by_items(ks):
    recorded = key_kinds.kinds_of(ks)
    for k in ks:
        assert key_kinds.compatible(key_kinds.kind_of(k), recorded)


def test_kinds_tell_equal_keys_apart_from_unequal_ones():
    k = key_kinds.kind_of
    assert k(3) == k(3.0) == k(np.int64(3)) == k(True) == "number"
    assert k("3") == k(np.str_("3")) == "str" != k(b"3")
    assert k((1, "a")) == "tuple(number, str)"
    assert not key_kinds.compatible(k("3"), {"number"})
    assert key_kinds.compatible(k((1, None)), {"tuple(number, str)"})
    assert not key_kinds.compatible(k(("1", "a")), {"tuple(number, str)"})


class _Op(Operator):
    """A keyed operator as key_kinds.arm sees one: the operator contract
    declares key_fn and key_fns."""

    def __init__(self):
        super().__init__("op")
        self.key_fn = lambda x: x

    def process_batch(self, batch):
        return batch


def test_the_check_lets_none_through_and_then_steps_aside():
    op = _Op()
    original = op.key_fn
    key_kinds.arm(op, ["number"], "checkpoint 1", "u")
    assert op.key_fn(None) is None        # tells nothing: still checking
    assert op.key_fn is not original
    assert op.key_fn(5) == 5
    assert op.key_fn is original          # nothing per record after the first telling key
    op = _Op()
    key_kinds.arm(op, ["number"], "checkpoint 1", "u")
    with pytest.raises(KeyKindError, match="kind str"):
        op.key_fn("5")


# ---- windows and timers: keys inside window keys and timer keys ----

def event_time_job(env, p, n, out, rate, key, migrate=None):
    """test_rescale's keyed job (timers, a count-triggered and a plain
    tumbling window), keyed by ``key(x % KEYS)``; output keys back to ints."""
    import os
    from test_rescale import COUNT, KEYS as RKEYS, WINDOW
    src = env.from_sequence(0, n, parallelism=p, rate_limit=rate).uid("numbers")
    keyed = (src.map(lambda x: (x % RKEYS, x / 100.0, 1))
             .assign_timestamps(lambda r: r[1]).uid("event-time")
             .key_by(lambda r: key(r[0])))

    def per_second(k, rec, state, ctx):
        b = int(rec[1])
        state[b] = state.get(b, 0) + 1
        ctx.register_event_time_timer(b + 1)

    def fire(k, t, state, ctx):
        b = int(t) - 1
        return [("t", int(k), b, state.pop(b, 0))]

    def mig(s):
        return s if migrate is None else s.migrate_keys(migrate)

    mig(keyed.process(per_second, on_timer=fire).uid("seconds")).write_text(os.path.join(out, "timers"))
    mig(keyed.window(fb.Tumbling(WINDOW), trigger=fb.CountTrigger(COUNT))
        .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]),
                window_function=lambda k, w, r: ("c", int(k), w.start, r[2])).uid("counted")
        ).write_text(os.path.join(out, "counted"))
    mig(keyed.window(fb.Tumbling(WINDOW))
        .reduce(lambda a, b: (a[0], a[1], a[2] + b[2]),
                window_function=lambda k, w, r: ("w", int(k), w.start, r[2])).uid("windows")
        ).write_text(os.path.join(out, "window"))


def _committed_some(out):
    import os
    d = os.path.join(out, "timers")
    return os.path.isdir(d) and any(n.startswith("part-") for n in os.listdir(d))


@pytest.mark.parametrize("p2", [1, 3])
def test_windows_and_timers_migrate_their_keys(tmp_path, p2):
    from test_rescale import committed, expected
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    n = 3000
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    event_time_job(env, 2, n, out, 2500, key=lambda k: k)
    job = env.execute_async()
    wait_for(lambda: _committed_some(out))
    path = job.stop(savepoint=str(tmp_path / "sp"))
    # without a migration: refused at the first key
    env2 = fb.Environment(parallelism=p2, checkpoint_interval=0.1, checkpoint_dir=ck)
    event_time_job(env2, p2, n, out, None, key=lambda k: f"{k}")
    with pytest.raises(JobFailedError) as info:
        env2.execute(120, restore_from=path)
    assert isinstance(info.value.__cause__, KeyKindError)
    env3 = fb.Environment(parallelism=p2, checkpoint_interval=0.1, checkpoint_dir=ck)
    event_time_job(env3, p2, n, out, None, key=lambda k: f"{k}", migrate=str)
    env3.execute(120, restore_from=path)
    kinds = ("timers", "count_trigger", "window")
    got, want = committed(out), expected(n, kinds)
    assert got == want, (sorted((want - got).items())[:5], sorted((got - want).items())[:5])


def test_a_changed_key_kind_is_refused_with_workers(tmp_path):
    path, _ = first_run(tmp_path)
    env = second_env(tmp_path, workers=2, restart_attempts=2)
    out2 = counting(env, lambda x: str(x % KEYS))
    with pytest.raises(JobFailedError, match="KeyKindError") as info:
        env.execute(60, restore_from=path)
    assert "migrate_keys" in str(info.value)
    assert out2.result == []
    assert env.last_execution.restarts == 0


def test_a_restart_from_the_executions_own_checkpoint_is_not_checked():
    """A checkpoint the execution wrote itself holds keys of the same key
    functions: a kind first met after its restore is a new key, not a
    changed function. The checkpoint it started from is checked, also when a
    restart restores it again (nothing newer was taken)."""
    from pyflowbuf.checkpointing.restore import checks_key_kinds
    execution = types.SimpleNamespace()
    start = types.SimpleNamespace(checkpoint_id=4, path="/sp")
    own = types.SimpleNamespace(checkpoint_id=9, path="/ck/chk-9")
    assert checks_key_kinds(execution, start)
    assert checks_key_kinds(execution, start)
    assert not checks_key_kinds(execution, own)
    worker = types.SimpleNamespace()
    assert not checks_key_kinds(worker, own, first=False)   # its driver said: a restart's own checkpoint
    fresh = types.SimpleNamespace()
    from pyflowbuf.checkpointing.restore import started_fresh
    started_fresh(fresh)
    assert not checks_key_kinds(fresh, own)


def test_two_input_keyed_operators_check_each_input():
    from pyflowbuf.time.process import KeyedCoProcess
    from pyflowbuf.time.process import KeyedCoProcessOperator
    op = KeyedCoProcess("co", lambda r: r[0], lambda r: r[1], lambda k, r, s: [], lambda k, r, s: [])
    originals = op.key_fns
    key_kinds.arm(op, ["number"], "checkpoint 1", "co")
    assert op.key_fns[0]((1, "a")) == 1 and op.key_fns[0] is originals[0]
    with pytest.raises(KeyKindError):
        op.key_fns[1]((1, "a"))
    op = KeyedCoProcessOperator("co2", (lambda r: r[0], lambda r: r[1]), (None, None),
                                (lambda k, r, s, c: [], lambda k, r, s, c: []))
    first = op.inputs[0][0]
    key_kinds.arm(op, ["str"], "checkpoint 1", "co2")
    assert op.inputs[0][0] is not first
    assert op.inputs[1][0](("x", "y")) == "y"
    assert op.inputs[1][0]((1, 2)) == 2            # checked once, then the function itself again
    with pytest.raises(KeyKindError):
        op.inputs[0][0]((7, 1))
    assert op.inputs[0][0] is not first
