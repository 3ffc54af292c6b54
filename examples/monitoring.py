#!/usr/bin/env python
"""Monitoring: a job whose sink is slower than its source, seen through
env.metrics() (busy / idle / backpressured ms per second and a level per
task) and a JSON metrics log.

    python examples/monitoring.py

Add prometheus_port=0 or live_view=True to the Environment for the other
front ends. See docs/monitoring.md."""
import json
import os
import tempfile
import time

import pyflowbuf as fb


def main(d):
    log = os.path.join(d, "metrics.jsonl")
    env = fb.Environment(chaining=False, metrics_interval=0.2, metrics_log=log,
                         segment_size=4096, output_buffers=(2, 2))   # small pools: backpressure soon
    (env.from_sequence(0, 20_000, name="source")
        .map(lambda x: x + 1, name="plus-one")
        .sink(lambda x: time.sleep(0.0001), name="slow-sink"))     # the slow stage
    env.execute(120)
    with open(log) as f:
        samples = [json.loads(line) for line in f]
    for task, m in env.metrics().items():                          # the final sample
        print(f"{task:>24}: {m['state']}, records in {m['records_in']}, out {m['records_out']}")
    busiest = max(samples, key=lambda s: s["backpressured_ms_per_s"])
    print(f"{len(samples)} samples; most backpressured: {busiest['task']} at "
          f"{busiest['backpressured_ms_per_s']:.0f} ms/s")
    return samples


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        main(d)
