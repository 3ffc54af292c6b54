"""How ``tests/data/filesinks-4628c8a/`` was made, by the code of 4628c8a
(the last commit whose part-file sinks had their own commit path: renames
listed in ``_metadata`` that the driver carried out). Kept for the record:
the data is committed, not regenerated; ``tests/test_restore_filesinks_4628c8a.py``
restores it. Run from the repository root of a 4628c8a checkout:

    python tests/data/make_filesinks_4628c8a.py

The job: ``from_sequence(0, N)`` at parallelism 2 into ``write_text`` and
``write_parquet`` under ``memory://`` (so the renames in ``_metadata`` name
the same directories wherever the test runs). After a few checkpoints have
committed their parts, the driver's commits stop (a crash between a
checkpoint's completion and its renames) and the job is cancelled once a
checkpoint has completed that way (and before another one is triggered). The directory holds that checkpoint
(``checkpoint/``, a ``chk-<id>`` copy), both output directories as they were
(``output/text``, ``output/parquet``: committed parts, the pending parts the
checkpoint's renames name, and parts written after it) and ``expected.json``.
"""
import json
import os
import shutil
import sys
import tempfile
import threading
import time

import fsspec

import pyflowbuf as fb
from pyflowbuf.checkpoint import CheckpointStorage
from pyflowbuf.checkpointing import coordinator as coordinator_mod

here = os.path.dirname(os.path.abspath(__file__))
N = 4000
TEXT, PARQUET = "memory://pyflowbuf-4628c8a/text", "memory://pyflowbuf-4628c8a/parquet"


def main():
    dest = os.path.join(here, "filesinks-4628c8a")
    if os.path.exists(dest):
        sys.exit(f"{dest} exists: it is committed; do not regenerate it")
    fs = fsspec.filesystem("memory")
    real = coordinator_mod.run_commits
    done = {"real": 0, "skipped": 0}
    crashed = threading.Event()

    def run_commits(commits, outputs):
        renames = [c for c in commits if c and c[0] == "rename"]
        if done["real"] < 3 or not renames:
            if renames:
                done["real"] += 1
            return real(commits, outputs)
        done["skipped"] += 1        # completed, its renames never carried out
        crashed.set()

    trigger = coordinator_mod.CheckpointCoordinator.trigger

    def no_trigger_after_the_crash(self, *args, **kwargs):
        return None if crashed.is_set() else trigger(self, *args, **kwargs)

    coordinator_mod.run_commits = run_commits
    coordinator_mod.CheckpointCoordinator.trigger = no_trigger_after_the_crash
    with tempfile.TemporaryDirectory() as tmp:
        ck = os.path.join(tmp, "ck")
        env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck,
                             incremental_checkpoints=False)
        nums = env.from_sequence(0, N, rate_limit=1000).uid("numbers")
        nums.map(str, kind="str").write_text(TEXT).uid("text-out")
        nums.map(lambda x: {"value": x}).write_parquet(PARQUET).uid("parquet-out")
        job = env.execute_async()
        assert crashed.wait(60), "no checkpoint completed after the commits stopped"
        time.sleep(0.15)        # parts written after it, pending too
        job.cancel()
        try:
            job.result(60)
        except Exception:       # noqa: BLE001 - cancelled
            pass
        coordinator_mod.run_commits = real
        coordinator_mod.CheckpointCoordinator.trigger = trigger
        assert done["skipped"] == 1, done
        meta = CheckpointStorage(ck).latest()
        renames = [c for c in meta.properties["commits"] if c[0] == "rename"]
        assert renames, meta.properties["commits"]
        shutil.copytree(os.path.join(ck, f"chk-{meta.checkpoint_id}"), os.path.join(dest, "checkpoint"))
    listing = {}
    for url, sub in ((TEXT, "text"), (PARQUET, "parquet")):
        d = os.path.join(dest, "output", sub)
        os.makedirs(d)
        path = url.split("://", 1)[1]
        for full in sorted(fs.ls(path, detail=False)):
            name = full.rsplit("/", 1)[-1]
            with fs.open(full, "rb") as src, open(os.path.join(d, name), "wb") as out:
                out.write(src.read())
        listing[sub] = sorted(os.listdir(d))
    with open(os.path.join(dest, "expected.json"), "w") as f:
        json.dump({"n": N, "checkpoint_id": meta.checkpoint_id, "renames": renames, "listing": listing,
                   "skipped_completions": done["skipped"]}, f, indent=1)
    named = {r[1].rsplit("/", 1)[-1] for r in renames}
    assert any(n.startswith(".") and n not in named for names in listing.values() for n in names), listing
    print("wrote", dest, listing, len(renames), "pending renames")


if __name__ == "__main__":
    main()
