"""Errors that were unclear (issue 27): a key_by key that cannot be a key
is refused at the first batch at every parallelism and chaining, naming the
keyed operator, the key_by and the key's type (not a raw TypeError, not
each record its own key, not a failure of the first checkpoint blamed on
the sink); process functions' method signatures are checked where the
operator is declared."""
from __future__ import annotations

import dataclasses
import enum

import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf._validation import check_keys
from pyflowbuf.runtime.deployment import key_codec_error


@dataclasses.dataclass(frozen=True)
class UserKey:
    user: int


class Colour(enum.IntEnum):
    RED = 1
    BLUE = 2


def _keyed_job(key_fn, *, p, chaining=True, op="reduce", checkpoint_dir=None, n=200):
    kw = {} if checkpoint_dir is None else dict(checkpoint_interval=0.05, checkpoint_dir=str(checkpoint_dir))
    env = fb.Environment(parallelism=p, chaining=chaining, **kw)
    keyed = env.from_sequence(0, n).key_by(key_fn)
    if op == "reduce":
        out = keyed.reduce(lambda a, b: a + b, name="sums").uid("sums")
    elif op == "process":
        out = keyed.process(lambda k, x, st: [x], name="sums")
    else:
        out = keyed.window(fb.CountWindow(2)).reduce(lambda a, b: a + b, name="sums")
    return env, out.collect()


@pytest.mark.parametrize("p", [1, 2])
@pytest.mark.parametrize("chaining", [True, False])
@pytest.mark.parametrize("op", ["reduce", "process", "window"])
def test_an_unhashable_key_is_a_key_type_error_at_every_parallelism(p, chaining, op):
    env, _ = _keyed_job(lambda x: [x % 3], p=p, chaining=chaining, op=op)
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=60)
    msg = str(info.value)
    assert "KeyTypeError" in msg and "'sums'" in msg and "key_by(" in msg
    assert "type list" in msg and "not hashable" in msg


@pytest.mark.parametrize("p", [1, 2])
def test_an_identity_hashed_key_is_refused_not_a_key_per_record(p):
    env, out = _keyed_job(lambda x: object(), p=p)
    with pytest.raises(errors.JobFailedError, match="not the same in every process"):
        env.execute(timeout=60)


@pytest.mark.parametrize("p", [1, 2])
def test_a_dataclass_key_is_refused_naming_the_keyed_operator_not_the_sink(p, tmp_path):
    env, _ = _keyed_job(lambda x: UserKey(x % 3), p=p, checkpoint_dir=tmp_path / "ck")
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=60)
    msg = str(info.value)
    assert "key_by (into 'sums')" in msg and "UserKey" in msg
    assert "'collect'" not in msg
    assert not any((tmp_path / "ck").rglob("chk-*")), "refused before the first checkpoint"


def test_a_key_the_checkpoint_codec_cannot_write_is_refused_with_checkpoints_only(tmp_path):
    env, out = _keyed_job(lambda x: Colour(1 + x % 2), p=1)
    env.execute(timeout=60)
    assert len(out.result) == 200
    env, _ = _keyed_job(lambda x: Colour(1 + x % 2), p=1, checkpoint_dir=tmp_path / "ck")
    with pytest.raises(errors.JobFailedError, match="cannot be written into a checkpoint"):
        env.execute(timeout=60)


@pytest.mark.parametrize("key", ["a", 1, 1.5, True, None, b"x", ("a", 1), frozenset({1, 2})])
def test_plain_keys_pass_the_check(key):
    check_keys([key], "op", lambda r: r, key_codec_error)


def test_the_check_runs_once_per_output_not_per_batch():
    calls = []

    def key(x):
        calls.append(x)
        return x % 3

    env = fb.Environment(max_batch=10)
    out = env.from_sequence(0, 100).key_by(key).reduce(lambda a, b: a + b).collect()
    env.execute(timeout=60)
    assert len(out.result) == 100
    # the keyed operator's own 100 calls, and those of the first batch (at most 10) checked
    assert 100 < len(calls) <= 110


# ---------------------------------------------------------------- process functions' signatures

def test_pyflink_open_with_a_runtime_context_is_accepted():
    class F(fb.KeyedProcessFunction):
        def open(self, runtime_context):
            self.n = runtime_context.get_number_of_parallel_subtasks()

        def process_element(self, key, record, state, ctx):
            yield (record, self.n)

    env = fb.Environment(parallelism=2)
    out = env.from_sequence(0, 4).key_by(lambda x: x).process(F()).collect()
    env.execute(timeout=60)
    assert sorted(out.result) == [(x, 2) for x in range(4)]


@pytest.mark.parametrize("method, src", [
    ("open", "def open(self, a, b, c): pass"),
    ("process_element", "def process_element(self, key, record, state): pass"),
    ("on_timer", "def on_timer(self, t): pass"),
    ("on_end", "def on_end(self, key): pass"),
    ("close", "def close(self, how): pass"),
])
def test_a_process_function_method_with_a_bad_signature_is_refused_at_declaration(method, src):
    ns: dict = {}
    body = src if method == "process_element" else src + "\n    def process_element(self, value, ctx): pass"
    exec(f"class F(fb.KeyedProcessFunction):\n    {body}", {"fb": fb}, ns)
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match=rf"F\.{method}"):
        env.from_sequence(0, 3).key_by(lambda x: x).process(ns["F"](), name="p")


def test_a_process_function_class_instead_of_an_instance():
    class F(fb.KeyedProcessFunction):
        def process_element(self, key, record, state, ctx):
            return [record]

    with pytest.raises(TypeError, match=r"F\(\)"):
        fb.Environment().from_sequence(0, 3).key_by(lambda x: x).process(F)
