#!/usr/bin/env python
"""Connectors: CSV in, Parquet out (part files, committed at the end), read back.

    python examples/files.py

Needs pyarrow (the ``arrow`` extra). See docs/connectors.md."""
import os
import tempfile

import pyflowbuf as fb


def main(d):
    with open(os.path.join(d, "events.csv"), "w") as f:
        f.write("user,page,ms\n" + "".join(f"u{i % 5},{'home' if i % 2 else 'cart'},{i}\n" for i in range(1000)))
    env = fb.Environment(parallelism=2)
    (env.read_csv(os.path.join(d, "events.csv"), column_types={"ms": "int64"})   # a dict per row
        .filter(lambda e: e["page"] == "home")
        .map(lambda e: (e["user"], e["ms"]))                                      # tuples: a struct stream
        .write_parquet(os.path.join(d, "home"), mode="overwrite"))
    env.execute()
    env = fb.Environment()
    rows = env.read_parquet(os.path.join(d, "home"), as_="tuples").collect()      # skips hidden parts
    env.execute()
    assert len(rows.result) == 500
    return rows.result[:3]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        print(main(d))
