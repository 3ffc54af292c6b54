#!/usr/bin/env python
"""Unbounded sources: a watched directory. Files that appear while the job
runs are read once each, when complete; the job counts the orders per
product in 10-second event-time windows.

    python examples/monitored_directory.py

A monitored source never ends by itself; here ``monitor_timeout`` ends it
once nothing new has come for three seconds (a service would leave it out and
cancel the job). Files are written under a hidden name and renamed into
place, so a reader never sees half a file; see docs/connectors.md,
"Watching a directory"."""
import os
import tempfile
import threading
import time

import pyflowbuf as fb
from pyflowbuf.windows import Count


def drop_files(inbox, batches):
    """Another program delivering files: one every 0.2 s, each renamed into place."""
    for i, lines in enumerate(batches):
        time.sleep(0.2)
        tmp = os.path.join(inbox, f".orders-{i}.tmp")              # hidden: not read
        with open(tmp, "w") as f:
            f.write("".join(line + "\n" for line in lines))
        os.rename(tmp, os.path.join(inbox, f"orders-{i}.csv"))


def main(d):
    inbox = os.path.join(d, "inbox")
    os.mkdir(inbox)
    # "seconds,product" lines, 5 files of 20 orders over 50 seconds of event time
    batches = [[f"{t},{'tea' if t % 3 else 'cake'}" for t in range(i * 10, i * 10 + 10) for _ in range(2)]
               for i in range(5)]
    env = fb.Environment(parallelism=2, checkpoint_interval=0.5, checkpoint_dir=os.path.join(d, "chk"))
    # (uids: the ids checkpoints store the state of the source, the watermarks and the windows under)
    counts = (env.read_text(inbox, monitor=0.2, monitor_timeout=3.0).uid("orders")   # scan every 0.2 s
                 .map(lambda line: line.split(","))
                 .assign_timestamps(lambda r: float(r[0]), idle_timeout=1.0).uid("event-time")
                 .key_by(lambda r: r[1])
                 .window(fb.Tumbling(10.0))
                 .aggregate(Count(), window_function=lambda product, w, n: (w.start, product, n)).uid("counts")
                 .collect().uid("results"))
    threading.Thread(target=drop_files, args=(inbox, batches), daemon=True).start()
    env.execute(timeout=120)
    result = sorted(counts.result)
    expected = sorted((float(i * 10), p, sum(2 for t in range(i * 10, i * 10 + 10) if (p == "tea") == bool(t % 3)))
                      for i in range(5) for p in ("tea", "cake"))
    assert result == expected, result
    return result


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        for row in main(d):
            print(row)
