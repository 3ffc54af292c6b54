#!/usr/bin/env python
"""Early firings: hourly page views, with an updated count every 10 minutes of
event time before the hour closes (ContinuousEventTimeTrigger), and the
final count when it does; each firing says whether it is early or on time.
Checked against a plain-Python count.

    python examples/early_firings.py

See docs/event-time.md ("Triggers")."""
import random

import pyflowbuf as fb


def main():
    rng = random.Random(3)
    # a view every 5 s for two hours, each up to 20 s out of order
    views = [(rng.choice(["home", "docs", "blog"]), t * 5.0 + rng.uniform(-20, 0)) for t in range(1, 1440)]
    env = fb.Environment(parallelism=2)
    updates = (env.from_collection(views)                       # (page, seconds)
                  .assign_timestamps(lambda v: v[1], out_of_orderness=30.0)
                  .key_by(lambda v: v[0])
                  .window(fb.Tumbling(3600), trigger=fb.ContinuousEventTimeTrigger(600))
                  .aggregate(fb.Count(),
                             window_function=lambda page, w, n, ctx: (page, w.start, n, ctx.firing))
                  .collect())
    env.execute()

    final = {}
    for page, start, n, firing in updates.result:
        if firing == "on_time":
            assert (page, start) not in final, "one on-time firing per window"
            final[(page, start)] = n
    want = {}
    for page, t in views:
        start = (t // 3600) * 3600
        want[(page, start)] = want.get((page, start), 0) + 1
    assert final == want, "the on-time counts differ from the plain-Python count"
    early = [(page, start, n) for page, start, n, firing in updates.result if firing == "early"]
    assert early, "no early firing"
    for page, start, n in early:
        assert n <= final[(page, start)], "an early count above the final one"
    return len(early), len(final)


if __name__ == "__main__":
    n_early, n_final = main()
    print(f"{n_early} early updates, then {n_final} final hourly counts equal to a plain-Python count")
