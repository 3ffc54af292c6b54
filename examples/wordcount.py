#!/usr/bin/env python
"""Pipelines and backpressure: a word count over a text file, in threads.

    python examples/wordcount.py

A slow sink would slow every stage before it (bounded pools, nothing dropped);
see docs/pipelines.md."""
import os
import tempfile

import pyflowbuf as fb


def main(d):
    path = os.path.join(d, "words.txt")
    with open(path, "w") as f:
        f.write("to be or not to be\nthat is the question\n" * 1000)
    env = fb.Environment(parallelism=2)                  # tasks are threads
    counts = (env.read_text(path)
                 .flat_map(str.split)
                 .map(lambda w: (w, 1))
                 .key_by(lambda kv: kv[0])               # equal words meet in one subtask
                 .reduce(lambda a, b: (a[0], a[1] + b[1]))
                 .collect())
    env.execute()
    final = {}
    for word, n in counts.result:                        # running counts: keep the last per word
        final[word] = max(n, final.get(word, 0))
    assert final == {"to": 2000, "be": 2000, "or": 1000, "not": 1000,
                     "that": 1000, "is": 1000, "the": 1000, "question": 1000}, final
    return final


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(main(d))
