"""A checkpoint written by 4628c8a, the last commit whose part-file sinks
committed through renames listed in ``_metadata`` that the driver carried
out, restores and commits exactly once now that they are connector sinks
committing in their subtasks (``tests/data/make_filesinks_4628c8a.py`` made
it): the renames it lists (a crash came between its completion and them)
are carried out, the parts written after it go, and the restored run's
output holds every record once, at the parallelism it was taken at and at
others."""
from __future__ import annotations

import json
import os

import fsspec
import pytest

import pyflowbuf as fb

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "filesinks-4628c8a")
TEXT, PARQUET = "memory://pyflowbuf-4628c8a/text", "memory://pyflowbuf-4628c8a/parquet"

pytestmark = pytest.mark.timeout(300)


def put_output(fs):
    """The two output directories as the crashed run left them."""
    for url, sub in ((TEXT, "text"), (PARQUET, "parquet")):
        path = url.split("://", 1)[1]
        if fs.exists(path):
            fs.rm(path, recursive=True)
        fs.makedirs(path, exist_ok=True)
        src = os.path.join(DATA, "output", sub)
        for name in os.listdir(src):
            with open(os.path.join(src, name), "rb") as f, fs.open(f"{path}/{name}", "wb") as out:
                out.write(f.read())


def names(fs, url):
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(url.split("://", 1)[1], detail=False))


def text_records(fs):
    out = []
    for n in names(fs, TEXT):
        if n.startswith("part-"):
            with fs.open(f"{TEXT.split('://', 1)[1]}/{n}", "r") as f:
                out.extend(int(line) for line in f if line.strip())
    return out


def parquet_records(fs):
    import pyarrow.parquet as pq

    out = []
    for n in names(fs, PARQUET):
        if n.startswith("part-"):
            with fs.open(f"{PARQUET.split('://', 1)[1]}/{n}", "rb") as f:
                out.extend(pq.read_table(f).column("value").to_pylist())
    return out


@pytest.mark.parametrize("p", [2, 3, 1])
def test_a_checkpoint_of_4628c8a_with_pending_renames_restores_exactly_once(tmp_path, p):
    pytest.importorskip("pyarrow")
    with open(os.path.join(DATA, "expected.json")) as f:
        expected = json.load(f)
    n = expected["n"]
    fs = fsspec.filesystem("memory")
    put_output(fs)
    pending = {r[1].rsplit("/", 1)[-1] for r in expected["renames"]}
    assert pending and all(name in names(fs, TEXT) + names(fs, PARQUET) for name in pending)
    env = fb.Environment(parallelism=p, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"))
    nums = env.from_sequence(0, n).uid("numbers")
    nums.map(str, kind="str").write_text(TEXT).uid("text-out")
    nums.map(lambda x: {"value": x}).write_parquet(PARQUET).uid("parquet-out")
    env.execute(120, restore_from=os.path.join(DATA, "checkpoint"))
    for url in (TEXT, PARQUET):
        assert not [x for x in names(fs, url) if x.startswith(".")], names(fs, url)
    # the renames the checkpoint listed were carried out: those parts keep their names
    finals = set(names(fs, TEXT) + names(fs, PARQUET))
    assert {x[1:-len(".inprogress")] for x in pending} <= finals
    assert sorted(text_records(fs)) == list(range(n))
    assert sorted(parquet_records(fs)) == list(range(n))
