#!/usr/bin/env python
"""Checkpoints and recovery: a keyed sum fails once halfway, restarts from its
last checkpoint, and its file sink still holds each running sum exactly once.

    python examples/checkpoints.py

See docs/checkpoints.md."""
import glob
import os
import tempfile

import pyflowbuf as fb

RECORDS = 50_000


def main(d):
    failed = []

    def fail_once(x):
        if x == RECORDS // 2 and not failed:
            failed.append(x)
            raise RuntimeError("injected failure")
        return x

    env = fb.Environment(parallelism=2, checkpoint_interval=0.2, restart_attempts=1,
                         checkpoint_dir=os.path.join(d, "checkpoints"))
    (env.from_sequence(0, RECORDS, parallelism=1, rate_limit=RECORDS / 2)   # about 2 s
        .map(fail_once, kind="int64")
        .key_by(lambda x: x % 10)
        .reduce(lambda a, b: a + b).uid("sums")             # keyed state, checkpointed under its uid
        .map(str)
        .write_text(os.path.join(d, "sums")))               # part files, committed per checkpoint
    env.execute(120)
    lines = []
    for part in sorted(glob.glob(os.path.join(d, "sums", "part-*"))):
        with open(part) as f:
            lines += f.read().splitlines()
    sums, want = {}, []
    for x in range(RECORDS):
        sums[x % 10] = sums.get(x % 10, 0) + x
        want.append(str(sums[x % 10]))
    assert sorted(lines) == sorted(want), "not exactly once"
    return env.last_execution.restarts, len(env.checkpoints())


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        restarts, checkpoints = main(d)
        print(f"{restarts} restart, {checkpoints} checkpoints, output exactly once")
