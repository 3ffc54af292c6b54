"""Dropped state drops its commits (issue 27): a savepoint of a job with a
file sink, restored with allow_non_restored_state=True into the job whose
sink is now collect(): the dropped sink's pending commits are dropped too,
with a warning naming the sink and its directory, and its directory is left
as it was."""
from __future__ import annotations

import ast
import collections
import os
import time

import pytest

import pyflowbuf as fb
from pyflowbuf.checkpoint import IncompatibleCheckpointError
from pyflowbuf.errors import NonRestoredStateWarning

N = 3000
KEYS = 7


def job(env, sink, out_dir=None, rate=None):
    counts = (env.from_sequence(0, N, parallelism=2, rate_limit=rate).uid("numbers")
              .map(lambda x: (x % KEYS, 1), name="pair")
              .key_by(lambda kv: kv[0]).reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts"))
    if sink == "text":
        return counts.write_text(out_dir).uid("text-out")
    return counts.collect()


def listing(d):
    return {n: os.path.getsize(os.path.join(d, n)) for n in sorted(os.listdir(d))}


def committed(d):
    got = []
    for n in os.listdir(d):
        if n.startswith("part-"):
            with open(os.path.join(d, n)) as fh:
                got.extend(ast.literal_eval(line) for line in fh if line.strip())
    return got


def savepoint_of_text_job(tmp_path):
    out = str(tmp_path / "out")
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    job(env, "text", out, rate=2000)
    running = env.execute_async()
    end = time.monotonic() + 60
    while not any(n.startswith("part-") for n in os.listdir(out)):
        assert time.monotonic() < end
        time.sleep(0.01)
    path = running.stop(savepoint=str(tmp_path / "sp"))
    return out, path


def test_dropped_sink_state_drops_its_pending_commits(tmp_path):
    out, path = savepoint_of_text_job(tmp_path)
    before = listing(out)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    collected = job(env, "collect")
    with pytest.warns(NonRestoredStateWarning) as record:
        env.execute(60, restore_from=path, allow_non_restored_state=True)
    text = " ".join(str(w.message) for w in record)
    assert "'text-out'" in text and out in text
    assert listing(out) == before               # left as it was at the savepoint
    per_key = collections.defaultdict(list)
    for k, c in committed(out) + collected.result:
        per_key[k].append(c)
    want = collections.Counter(x % KEYS for x in range(N))
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in want.items()}


def test_without_allow_non_restored_state_the_restore_is_still_refused(tmp_path):
    out, path = savepoint_of_text_job(tmp_path)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    job(env, "collect")
    with pytest.raises(IncompatibleCheckpointError, match="text-out"):
        env.execute(60, restore_from=path)
