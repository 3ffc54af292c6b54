#!/usr/bin/env python
"""Event time and windows: a keyed 10 s tumbling count over out-of-order events,
checked against a plain-Python count.

    python examples/windows.py

See docs/event-time.md."""
import random

import pyflowbuf as fb
from pyflowbuf.windows import Count


def main():
    rng = random.Random(7)
    # one event a second, each up to 3 s late: out of order, within out_of_orderness
    events = [(f"user{rng.randrange(5)}", t + rng.uniform(-3, 0)) for t in range(600)]
    env = fb.Environment(parallelism=2)
    counts = (env.from_collection(events)                  # (user, seconds)
                 .assign_timestamps(lambda e: e[1], out_of_orderness=5.0)
                 .key_by(lambda e: e[0])
                 .window(fb.Tumbling(10.0))
                 .aggregate(Count(), window_function=lambda user, w, n: (user, w.start, n))
                 .collect())
    env.execute()
    want = {}
    for user, t in events:
        start = (t // 10) * 10
        want[(user, start)] = want.get((user, start), 0) + 1
    got = {(user, start): n for user, start, n in counts.result}
    assert got == want, "windows differ from the plain-Python count"
    return len(got)


if __name__ == "__main__":
    print(main(), "windows, each equal to a plain-Python count")
