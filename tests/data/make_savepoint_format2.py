"""How ``tests/data/savepoint-format-2/`` was made (kept for the record: the
point of that directory is that it was written by an older release, so it
is committed, not regenerated). Run from the repository root:

    python tests/data/make_savepoint_format2.py

A keyed running count over ``from_sequence(0, 2000, parallelism=2)``, keys
``x % 7``, stopped with a savepoint; ``expected.json`` holds each key's count
in the savepoint (what the first run had collected when it stopped)."""
import json
import os
import shutil
import sys
import tempfile
import time

import pyflowbuf as fb

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "savepoint-format-2")
if os.path.exists(here):
    sys.exit(f"{here} exists: it is the committed savepoint of an earlier release; do not regenerate it")
tmp = tempfile.mkdtemp()
env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=os.path.join(tmp, "ck"))
out = (env.from_sequence(0, 2000, parallelism=2, rate_limit=2000).uid("numbers")
          .map(lambda x: (x % 7, 1)).key_by(lambda kv: kv[0])
          .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts").collect())
job = env.execute_async()
time.sleep(0.5)
path = job.stop(savepoint=os.path.join(tmp, "sp"))
counts = {}
for k, c in out.result:
    counts[k] = max(counts.get(k, 0), c)
shutil.copytree(path, here)
with open(os.path.join(here, "expected.json"), "w") as f:
    json.dump({"counts_at_savepoint": {str(k): v for k, v in sorted(counts.items())}, "n": 2000, "keys": 7}, f)
print("wrote", here, counts)
