#!/usr/bin/env python
"""Side outputs: one pass over payment lines gives the per-user totals per
10 s window, and beside them three more streams: the lines that do not parse,
the windows whose total looks suspicious, and the payments that came too late
for their window. Each is checked against plain Python.

    python examples/side_outputs.py

See docs/pipelines.md (Side outputs) and docs/event-time.md."""
import random

import pyflowbuf as fb

MALFORMED = fb.OutputTag("malformed", kind="str")
SUSPICIOUS = fb.OutputTag("suspicious", kind="struct")
LIMIT = 900


def parse(line, ctx):
    """'user,seconds,amount' -> (user, seconds, amount); anything else to MALFORMED."""
    parts = line.split(",")
    try:
        user, t, amount = parts[0], float(parts[1]), int(parts[2])
    except (IndexError, ValueError):
        ctx.output(MALFORMED, line)
        return None
    return [(user, t, amount)]


def total(user, window, payments, ctx):
    amount = sum(p[2] for p in payments)
    if amount > LIMIT:
        ctx.output(SUSPICIOUS, (user, window.start, amount))
    return [(user, window.start, amount)]


def make_lines(seed=3, n=400):
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        t = i * 0.25 - rng.uniform(0, 1)
        if i % 97 == 50:
            t -= 30                          # far behind the watermark: late
        lines.append(f"user{rng.randrange(4)},{t:.3f},{rng.randrange(1, 200)}")
        if i % 41 == 0:
            lines.append(f"garbage line {i}")
    return lines


def reference(lines, ooo):
    """Plain Python: the same parse, windows and watermark (highest time seen
    minus ``ooo``, after each record; a job with max_batch=1 and
    watermark_interval=0 sends it as often)."""
    malformed, totals, late = [], {}, []
    wm = float("-inf")
    for line in lines:
        parts = line.split(",")
        try:
            user, t, amount = parts[0], float(parts[1]), int(parts[2])
        except (IndexError, ValueError):
            malformed.append(line)
            continue
        start = t - t % 10
        if start + 10 <= wm:
            late.append((user, t, amount))
        else:
            totals[(user, start)] = totals.get((user, start), 0) + amount
        wm = max(wm, t - ooo)
    windows = sorted((u, s, a) for (u, s), a in totals.items())
    return sorted(malformed), windows, [w for w in windows if w[2] > LIMIT], sorted(late)


def main():
    lines = make_lines()
    env = fb.Environment(parallelism=2, max_batch=1)
    payments = env.from_collection(lines).process(parse, side_outputs=[MALFORMED], parallelism=1)
    windows = (payments.assign_timestamps(lambda p: p[1], out_of_orderness=2.0, watermark_interval=0,
                                          parallelism=1)
                       .key_by(lambda p: p[0])
                       .window(fb.Tumbling(10.0))
                       .process(total, side_outputs=[SUSPICIOUS]))
    totals = windows.collect()
    suspicious = windows.side_output(SUSPICIOUS).collect()
    late = windows.late().collect()
    malformed = payments.side_output(MALFORMED).collect()
    env.execute()

    want = reference(lines, 2.0)
    assert sorted(malformed.result) == want[0], "malformed lines differ"
    assert sorted(totals.result) == want[1], "window totals differ"
    assert sorted(suspicious.result) == want[2], "suspicious windows differ"
    assert sorted(late.result) == want[3], "late payments differ"
    return {"windows": len(want[1]), "suspicious": len(want[2]), "late": len(want[3]), "malformed": len(want[0])}


if __name__ == "__main__":
    print(main(), "each equal to plain Python")
