"""The checkpoint benchmark's Flink peer (benchmarks/flink_peer): what it reads
back from Flink's output is each completed checkpoint's duration and the sink's
count, and a run that did not finish is an error, not a run without
checkpoints. The peer itself (a JVM, Flink's jars) is left to the benchmark."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import flink_peer  # noqa: E402

# captured from `CheckpointPeer 200000.0 6.0 aligned unchained <dir> 1000` on Flink 2.3.0
# (the stack trace's "at ..." lines cut)
SAMPLE = """\
WARN DefaultDelegationTokenManager No tokens obtained so skipping notifications
WARN WebMonitorUtils Log file environment variable 'log.file' is not set.
INFO CheckpointCoordinator No checkpoint found during restore.
INFO CheckpointCoordinator Triggering checkpoint 1 (type=CheckpointType{name='Checkpoint', \
sharingFilesStrategy=FORWARD_BACKWARD}) @ 1795862489910 for job da71bb85d1a9f9bbae1c225ed0610a3c.
INFO CheckpointCoordinator Completed checkpoint 1 for job da71bb85d1a9f9bbae1c225ed0610a3c \
(4951 bytes, checkpointDuration=353 ms, finalizationTime=36 ms).
INFO CheckpointCoordinator Triggering checkpoint 2 (type=CheckpointType{name='Checkpoint', \
sharingFilesStrategy=FORWARD_BACKWARD}) @ 1795862490907 for job da71bb85d1a9f9bbae1c225ed0610a3c.
INFO CheckpointCoordinator Completed checkpoint 2 for job da71bb85d1a9f9bbae1c225ed0610a3c \
(27151 bytes, checkpointDuration=1440 ms, finalizationTime=23 ms).
INFO CheckpointCoordinator Triggering checkpoint 3 (type=CheckpointType{name='Checkpoint', \
sharingFilesStrategy=FORWARD_BACKWARD}) @ 1795862492375 for job da71bb85d1a9f9bbae1c225ed0610a3c.
WARN CheckpointFailureManager Failed to trigger or complete checkpoint 3 for job \
da71bb85d1a9f9bbae1c225ed0610a3c. (0 consecutive failed attempts so far)
org.apache.flink.runtime.checkpoint.CheckpointException: Checkpoint Coordinator is suspending.
PEER sink_records=56954 sink_seconds=6.000
"""


def test_reads_each_completed_checkpoint_and_the_sinks_rate():
    got = flink_peer.parse_output(SAMPLE)
    assert got["durations"] == [0.353, 1.44]            # checkpoint 3 failed at the cancel: not counted
    assert [c["id"] for c in got["checkpoints"]] == [1, 2]
    assert got["checkpoints"][1] == {"id": 2, "bytes": 27151, "duration_s": 1.44, "finalization_s": 0.023}
    assert (got["sink_records"], got["sink_seconds"]) == (56954, 6.0)
    assert got["sink_records_per_s"] == pytest.approx(9492.33, abs=0.01)


def test_output_without_the_summary_is_a_failed_run_not_an_empty_one():
    cut = SAMPLE[:SAMPLE.index("PEER")]
    with pytest.raises(flink_peer.FlinkPeerFailed, match="no 'PEER sink_records=...' line"):
        flink_peer.parse_output(cut)


def test_without_the_jars_and_no_fetch_the_peer_says_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PYFLOWBUF_FLINK_LIBS", str(tmp_path / "none"))
    if flink_peer.shutil.which("java") is None or flink_peer.shutil.which("javac") is None:
        with pytest.raises(flink_peer.FlinkPeerUnavailable, match="JDK"):
            flink_peer.prepare(fetch=False)
        return
    with pytest.raises(flink_peer.FlinkPeerUnavailable, match="flink_peer install"):
        flink_peer.prepare(fetch=False)


def test_a_wrong_mode_or_topology_is_refused_before_a_jvm_starts():
    with pytest.raises(ValueError, match="topology"):
        flink_peer.run(1000, 1, "aligned", "chain", prepared={})
    with pytest.raises(ValueError, match="mode"):
        flink_peer.run(1000, 1, "exactly", "chained", prepared={})
