"""Every ```python block of README.md, pyflowbuf/spark/README.md and
docs/*.md runs as written.

Each block runs alone in a fresh interpreter, in a temporary directory that
holds the files the README's examples read (words.txt, lines.parquet,
events/, users.csv, events.csv), made here. The README is read when the
tests are collected, so a block added or changed later is tested as it
stands. A block that is deliberately a fragment carries an HTML comment
``<!-- not-run -->`` on the line before its opening fence (use it sparingly:
a runnable example is better). Blocks that use Spark are marked ``spark``
and skipped without a JDK, as tests/test_spark.py is."""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_RUN = "<!-- not-run -->"
TIMEOUT_S = 240


def _blocks():
    files = ([os.path.join(ROOT, "README.md"), os.path.join(ROOT, "pyflowbuf", "spark", "README.md")]
             + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))
    out = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                start = i
                j = i + 1
                while j < len(lines) and lines[j].strip() != "```":
                    j += 1
                skipped = start > 0 and lines[start - 1].strip() == NOT_RUN
                out.append((os.path.relpath(path, ROOT), start + 1, "\n".join(lines[start + 1:j]) + "\n", skipped))
                i = j + 1
            else:
                i += 1
    return out


def _needs_spark(code):
    return re.search(r"\bpyflowbuf\.spark\b|\bpyspark\b", code) is not None


def _params():
    params = []
    for path, line, code, skipped in _blocks():
        marks = []
        if skipped:
            marks.append(pytest.mark.skip(reason=f"{path}:{line} is marked {NOT_RUN}"))
        if _needs_spark(code):
            marks += [pytest.mark.spark, pytest.mark.skipif(
                shutil.which("java") is None and not os.environ.get("JAVA_HOME"),
                reason="PySpark needs a JDK (17+)")]
        params.append(pytest.param(code, id=f"{path}:{line}", marks=marks))
    return params


def _make_input_files(d):
    """The files the README's examples read, small."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    words = ["to be or not to be", "that is the question", "whether tis nobler in the mind"]
    with open(os.path.join(d, "words.txt"), "w") as f:
        f.write("\n".join(words * 50) + "\n")
    pq.write_table(pa.table({"ts": [float(i) for i in range(200)],
                             "text": [words[i % 3] for i in range(200)]}), os.path.join(d, "lines.parquet"))
    os.mkdir(os.path.join(d, "events"))
    for part in range(2):
        pq.write_table(pa.table({"user": [f"u{i % 7}" for i in range(100)],
                                 "page": ["home" if i % 3 == 0 else "cart" for i in range(100)],
                                 "ms": list(range(100))}),
                       os.path.join(d, "events", f"part-{part}.parquet"))
    with open(os.path.join(d, "users.csv"), "w") as f:
        f.write("user,age\n" + "".join(f"u{i},{20 + i}\n" for i in range(7)))
    with open(os.path.join(d, "events.csv"), "w") as f:
        f.write("".join(f"u{i % 5},{'home' if i % 2 else 'cart'},{i}\n" for i in range(300)))


def test_the_readme_has_python_examples():
    blocks = _blocks()
    assert len(blocks) >= 5
    assert sum(skipped for *_, skipped in blocks) <= 2, "only true fragments may be marked not-run"


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("code", _params())
def test_readme_python_block_runs_as_written(code, tmp_path):
    _make_input_files(str(tmp_path))
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=env)
    assert res.returncode == 0, f"the block failed:\n{code}\n--- stderr ---\n{res.stderr[-4000:]}"
    # our examples give every stateful operator a uid (docs/checkpoints.md, "Ids without a uid")
    assert "OperatorIdWarning" not in res.stderr, res.stderr[-4000:]
