"""The main job's Kafka step (pyflowbuf/experiments/kafka_demo.py), quick:
a local broker, the lag growing in Kafka while the sink side is slow, one
failure, the output read back read_committed exactly once."""
from __future__ import annotations

import pytest

pytest.importorskip("confluent_kafka")

from pyflowbuf.connectors.kafka_broker import find_libs  # noqa: E402
from pyflowbuf.experiments.kafka_demo import kafka_demo  # noqa: E402

pytestmark = pytest.mark.skipif(find_libs() is None, reason="the local Kafka broker is not installed "
                                "(python -m pyflowbuf.connectors.kafka_broker install; ci/setup.sh does)")


def test_the_kafka_step_shows_lag_in_kafka_and_ends_exactly_once(tmp_path):
    lines = []
    res = kafka_demo(tmp_path, quick=True, say=lines.append)
    assert res["exactly_once"], (res["missing"], res["duplicated"])
    assert res["restarted"]                       # the failure happened and the job recovered from it
    assert res["lag_grew_while_slow"] and res["max_records_lag"] > 0, [r for r in res["samples"]]
    assert any("exactly once" in line for line in lines)
