"""The checkpoint benchmark's restore timing reaches into the runtime (it
times the restore alone, without the subtasks): a redesign that renames what
it uses must break this test, not a 7-minute benchmark run at its end."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import bench_checkpoint  # noqa: E402


def test_rescale_restore_times_a_restore_at_both_parallelisms(tmp_path):
    r = bench_checkpoint.rescale_restore(2000, 16, 1, str(tmp_path))
    assert r["plain_s"] > 0 and r["rescale_s"] > 0
    assert r["state_bytes"] > 2000 * 16
