"""How ``tests/data/savepoint-a288b41/`` and ``tests/data/unaligned-a288b41/``
were made, by the code of a288b41 (kept for the record: they are committed,
not regenerated; ``tests/test_restore_a288b41.py`` restores them). Run from
the repository root:

    python tests/data/make_checkpoints_a288b41.py

Each directory holds the checkpoint and ``expected.json``: per parallelism
restored at (2 and 3), what each subtask started from and the restored run's
output (its digest), as a288b41 restored them."""
import collections
import json
import os
import shutil
import sys
import tempfile

import pytest

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(here))

from test_restore_a288b41 import N, all_output, digest, keyed_job, restore_and_run, stop_with_savepoint  # noqa: E402
from test_unaligned_rescale import run_cancel  # noqa: E402

import pyflowbuf as fb  # noqa: E402
from pyflowbuf.checkpoint import CheckpointStorage  # noqa: E402


def keyed_edge_inflight(meta):
    layout = meta.properties["layout"]
    return [k for k, s in layout.items() if s.get("inflight") and any(
        s["edges"]["in"][int(n.split("/")[1])]["keyed"] for n in s["inflight_items"] if n.startswith("in/"))]


def savepoint(tmp, dest):
    return stop_with_savepoint(tmp, dest)


def unaligned(tmp, dest):
    ck = os.path.join(tmp, "ck-u")
    env = fb.Environment(parallelism=2, checkpoint_interval=0.25, checkpoint_dir=ck, checkpoint_alignment="unaligned",
                         segment_size=4096, incremental_checkpoints=False)
    keyed_job(env, 2, delay=0.003, rate=3000)
    run_cancel(env, ck, keyed_edge_inflight)
    meta = CheckpointStorage(ck).latest()
    shutil.copytree(os.path.join(ck, f"chk-{meta.checkpoint_id}"), dest)


def main():
    for name, make in (("savepoint-a288b41", savepoint), ("unaligned-a288b41", unaligned)):
        dest = os.path.join(here, name)
        if os.path.exists(dest):
            sys.exit(f"{dest} exists: it is committed; do not regenerate it")
        with tempfile.TemporaryDirectory() as tmp:
            before = make(tmp, dest)
        restored = {}
        for p in (2, 3):
            mp = pytest.MonkeyPatch()
            with tempfile.TemporaryDirectory() as tmp:
                starts, output = restore_and_run(mp, tmp, dest, p)
            mp.undo()
            if before is not None:      # exactly once, checked once here
                assert (collections.Counter(map(tuple, before)) + collections.Counter(map(tuple, output))
                        == all_output())
            restored[str(p)] = {"starts": starts, "output": digest(output)}
        expected = {"n": N, "restored": restored}
        with open(os.path.join(dest, "expected.json"), "w") as f:
            json.dump(expected, f, separators=(",", ":"))
        print("wrote", dest, sorted(os.listdir(dest)))


if __name__ == "__main__":
    main()
