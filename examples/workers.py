#!/usr/bin/env python
"""Running on many processes: a CPU-bound Python map in two forked worker
processes, exchanging records over TCP with credit-based flow control.

    python examples/workers.py

Operators run on the workers' copies of your objects: bring results back with
collect() or execute_iter, not a list a sink appends to. See docs/workers.md."""
import pyflowbuf as fb


def expensive(x):
    return sum(i * i for i in range(x % 100))


def main(records=100_000):
    env = fb.Environment(workers=2, parallelism=2)
    out = (env.from_sequence(0, records, parallelism=1)
              .map(expensive, kind="int64")                # subtask i runs in worker i % 2
              .collect(parallelism=1))
    env.execute(120)
    assert sorted(out.result) == sorted(expensive(x) for x in range(records))
    return len(out.result)


if __name__ == "__main__":
    print(main(), "records through two worker processes")
