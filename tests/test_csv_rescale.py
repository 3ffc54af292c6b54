"""read_csv resumes at another parallelism (issue 21, point 3): a restore
hands the byte ranges the old subtasks had left to the new ones, balanced.

Differential: CSV files of random lines (long ones across blocks, blank
lines, CRLF, empty and header-only files) read by the source's subtasks up to
a random point, their positions rescaled (once or twice, or restored as they
are), and read to the end: every row of a whole-file read with Python's csv
module comes out once, each subtask's rows in file order. Then the job API
(stop with a savepoint at 2, resume at 3 and at 1) and the errors.
"""
from __future__ import annotations

import collections
import csv
import io
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf.checkpoint import IncompatibleCheckpointError
from pyflowbuf.connectors import csv_split
from pyflowbuf.connectors.csv import csv_source
from pyflowbuf.errors import ConfigurationError

from pipeline_helpers import wait_for

pytest.importorskip("pyarrow")

TYPES = {"id": "int64", "t": "string"}

# a row: (length of its text, a blank line after it); long texts span blocks of 1024
_ROW = st.tuples(st.one_of(st.integers(0, 30), st.integers(900, 2600)), st.booleans())
_FILE = st.fixed_dictionaries({"rows": st.lists(_ROW, max_size=40), "crlf": st.booleans(),
                               "final_newline": st.booleans(), "empty": st.booleans()})
_FILES = st.lists(_FILE, min_size=1, max_size=4)


def write_files(d, files, header) -> list:
    """The files (f0.csv, f1.csv, ..) of ``files``; ids count up over them."""
    paths, next_id = [], 0
    for k, spec in enumerate(files):
        lines = ["id,t"] if header else []
        for length, blank in spec["rows"]:
            lines.append(f"{next_id},{chr(97 + next_id % 26) * length}")
            next_id += 1
            if blank:
                lines.append("")
        nl = "\r\n" if spec["crlf"] else "\n"
        text = nl.join(lines) + (nl if spec["final_newline"] and lines else "")
        if spec["empty"]:
            text = ""
        path = os.path.join(d, f"f{k}.csv")
        with open(path, "w", newline="") as fh:
            fh.write(text)
        paths.append(path)
    if not any(os.path.getsize(p) for p in paths):
        with open(paths[0], "w") as fh:       # read_csv refuses a source whose every file is empty
            fh.write("id,t\n-1,a\n" if header else "-1,a\n")
    return paths


def reference(paths, header) -> list:
    """Every row of the files in order, read whole by the csv module."""
    out = []
    for p in paths:
        with open(p, newline="") as fh:
            rows = [r for r in csv.reader(io.StringIO(fh.read())) if r]
        if header and rows:
            rows = rows[1:]
        out.extend((int(i), t if t != "" else None) for i, t in rows)
    return out


def factory_of(paths, header, block_size=1024):
    factory, _ = csv_source(paths, header=header, column_names=None if header else ["id", "t"],
                            column_types=TYPES, block_size=block_size, as_="tuples")
    return factory


def stored(position):
    """A position as it comes back from checkpoint storage (plain data)."""
    return json.loads(json.dumps(position))


def pull(src, sizes, pulls) -> list:
    out = []
    for k in range(pulls):
        batch = src.next_batch(sizes[k % len(sizes)])
        if batch is None:
            break
        out.extend(batch)
    return out


def run_stage(factory, p, positions, sizes, pulls):
    """Open ``p`` subtasks (seeking ``positions[i]`` when given), read
    ``pulls[i]`` batches from each: (rows per subtask, their positions)."""
    rows, after = [], []
    for i in range(p):
        src = factory()
        src.open(i, p)
        if positions is not None:
            src.seek(positions[i])
        rows.append(pull(src, sizes, pulls[i]))
        after.append(stored(src.position()))
        src.close()
    return rows, after


def rescaled(factory, positions, p):
    """The plan every new subtask computes from the same positions: one
    (worked out again, not taken from what the first computation kept)."""
    plan = factory().rescale_positions(positions, p)
    assert plan == factory().rescale_positions(positions, p)
    assert plan == csv_split.rescale_positions(factory().plan, positions, p)
    assert len(plan) == p and stored(plan) == plan
    check_balance(plan)
    return plan


def check_balance(plan):
    """Each run holds its share of the bytes left, give or take the partly
    read blocks (which are not cut)."""
    units = [u for run in plan for u in run["units"]]
    total = sum(e - s for _, s, e, _ in units)
    whole = max([e - s for _, s, e, row in units if row] or [0])
    p = len(plan)
    for i, run in enumerate(plan):
        share = total * (i + 1) // p - total * i // p
        assert abs(sum(e - s for _, s, e, _ in run["units"]) - share) <= whole, (plan, i)


def check(before, after, want):
    got = [r for part in before + after for r in part]
    assert len(got) == len(set(got)), "a row read twice"
    assert sorted(got) == sorted(want)
    for part in before + after:        # a subtask reads in file order
        ids = [r[0] for r in part]
        assert ids == sorted(ids)


# small files and cheap examples: more of them than the profile's, to meet
# the rare layouts (a block begun across a share's end, next to a share not begun)
EXAMPLES = max(200, settings.default.max_examples)
PULLS = st.lists(st.integers(0, 12), min_size=4, max_size=4)
SIZES = st.lists(st.integers(1, 40), min_size=1, max_size=4)


@settings(max_examples=EXAMPLES)
@given(files=_FILES, header=st.booleans(), p1=st.integers(1, 4), p2=st.integers(1, 4),
       pulls=PULLS, sizes=SIZES, block_size=st.sampled_from([1024, 1500, 4096]))
def test_a_rescaled_restore_reads_every_remaining_line_once(tmp_path_factory, files, header, p1, p2, pulls,
                                                             sizes, block_size):
    paths = write_files(tmp_path_factory.mktemp("csv"), files, header)
    factory = factory_of(paths, header, block_size)
    before, positions = run_stage(factory, p1, None, sizes, pulls)
    plan = rescaled(factory, positions, p2)
    after, ends = run_stage(factory, p2, plan, sizes, [10 ** 9] * p2)
    check(before, after, reference(paths, header))
    assert ends == [{"units": []}] * p2


@settings(max_examples=EXAMPLES)
@given(files=_FILES, header=st.booleans(), p1=st.integers(1, 4), p2=st.integers(1, 4), p3=st.integers(1, 4),
       pulls1=PULLS, pulls2=PULLS, sizes=SIZES, again_as_is=st.booleans())
def test_an_explicit_position_checkpoints_and_restores_again(tmp_path_factory, files, header, p1, p2, p3,
                                                             pulls1, pulls2, sizes, again_as_is):
    """p1 -> p2 -> p3, or p1 -> p2 and a restore of the explicit positions at
    p2 as they are (what a restore at the same parallelism does)."""
    paths = write_files(tmp_path_factory.mktemp("csv"), files, header)
    factory = factory_of(paths, header)
    first, positions = run_stage(factory, p1, None, sizes, pulls1)
    second, positions = run_stage(factory, p2, rescaled(factory, positions, p2), sizes, pulls2)
    assert all(isinstance(pos, dict) for pos in positions)
    if again_as_is:
        p3, plan = p2, positions
    else:
        plan = rescaled(factory, positions, p3)
    third, _ = run_stage(factory, p3, plan, sizes, [10 ** 9] * p3)
    check(first + second, third, reference(paths, header))


def test_one_subtask_half_way_through_one_file_gives_four_subtasks_a_share(tmp_path):
    path = tmp_path / "one.csv"
    n = 4000
    path.write_text("id,t\n" + "".join(f"{i:06d},{'x' * 12}\n" for i in range(n)))     # 20 bytes a line
    factory = factory_of([str(path)], True)
    src = factory()
    src.open(0, 1)
    head = pull(src, [100], 20)
    assert len(head) == 2000
    position = stored(src.position())
    src.close()
    plan = rescaled(factory, [position], 4)
    assert plan == factory_of([str(path)], True)().rescale_positions([position], 4)      # same on any process
    rows, _ = run_stage(factory, 4, plan, [64], [10 ** 9] * 4)
    check([head], rows, [(i, "x" * 12) for i in range(n)])
    per_block = 1024 // 20 + 1
    for part in rows:      # about a quarter of the 2000 left each
        assert abs(len(part) - 500) <= per_block, [len(p) for p in rows]
    # the partly read block stays whole, at the front of the first run
    first = plan[0]["units"][0]
    assert first[3] > 0 and first[1] == position[1]


def test_the_subtasks_of_one_process_share_a_plan_but_not_its_lists(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("id,t\n" + "".join(f"{i},v{i}\n" for i in range(300)))
    factory = factory_of([str(path)], True)
    positions = [[0, 5, 0]]
    mine = factory().rescale_positions(positions, 3)
    mine[0]["units"][0][1] = 999
    mine[1]["units"].clear()
    assert factory().rescale_positions(positions, 3) == csv_split.rescale_positions(factory().plan, positions, 3)
    assert factory().rescale_positions(positions, 2) == csv_split.rescale_positions(factory().plan, positions, 2)


def test_a_subtask_that_had_finished_and_one_that_had_not_begun(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("id,t\n" + "".join(f"{i},v{i}\n" for i in range(300)))
    factory = factory_of([str(path)], True)
    done = factory()
    done.open(0, 2)
    head = pull(done, [1000], 10)
    assert done.next_batch(10) is None
    finished = stored(done.position())
    assert finished == [1, 0, 0]
    fresh = factory()
    fresh.open(1, 2)
    plan = rescaled(factory, [finished, stored(fresh.position())], 3)
    rows, _ = run_stage(factory, 3, plan, [7], [10 ** 9] * 3)
    check([head], rows, [(i, f"v{i}") for i in range(300)])
    assert all(rows)


@pytest.mark.parametrize("p1,p2", [(2, 1), (2, 3), (3, 2), (4, 1)])
def test_a_partly_read_last_block_of_a_share_keeps_the_end_its_subtask_gave_it(tmp_path, p1, p2):
    """A share smaller than a block is one block ending after the line across
    the share's end, not after block_size bytes: the plan finds that end
    again, so the rows after it are not read twice."""
    path = tmp_path / "a.csv"
    path.write_text("id,t\n" + "".join(f"{i},v{i}\n" for i in range(100)))
    factory = factory_of([str(path)], True)
    before, positions = run_stage(factory, p1, None, [3], [1] * (p1 - 1) + [0])
    assert all(pos[2] == 3 for pos in positions[:-1])
    plan = rescaled(factory, positions, p2)
    after, _ = run_stage(factory, p2, plan, [10], [10 ** 9] * p2)
    check(before, after, reference([str(path)], True))


@pytest.mark.parametrize("p2", [1, 2, 3])
def test_a_block_begun_across_a_share_end_and_the_next_share_not_begun(tmp_path, p2):
    """Subtask 0 is in its last block of file 1, which ends after the line
    across its share's end; subtask 1 is still in file 0, so what it has left
    of file 1 is its whole share, from the raw byte where it begins: the two
    overlap in bytes, not in lines."""
    paths = []
    for k, n in enumerate((10, 100)):
        path = tmp_path / f"f{k}.csv"
        path.write_text("id,t\n" + "".join(f"{k * 1000 + i},v{i}\n" for i in range(n)))
        paths.append(str(path))
    factory = factory_of(paths, True)
    size = os.path.getsize(paths[1])
    raw_end = 5 + (size - 5) // 2
    assert open(paths[1], "rb").read()[raw_end - 1:raw_end] != b"\n"     # the share ends inside a line
    before, positions = run_stage(factory, 2, None, [1], [8, 0])
    assert positions[0][0] == 1 and positions[0][2] > 0 and positions[1][0] == 0
    plan = rescaled(factory, positions, p2)
    after, _ = run_stage(factory, p2, plan, [10], [10 ** 9] * p2)
    check(before, after, reference(paths, True))


# ---------------------------------------------------------------- through the job API

def csv_job(env, d, out, p, rate):
    (env.read_csv(d, parallelism=p, rate_limit=rate, block_size=1024, column_types={"id": "int64", "key": "int64"})
        .uid("rows")
        .key_by(lambda r: r["key"])
        .reduce(lambda a, b: {"key": a["key"], "id": b["id"], "n": a.get("n", 1) + 1}).uid("counts")
        .map(lambda r: {"key": r["key"], "id": r["id"], "n": r.get("n", 1)})
        .write_parquet(out))


def write_job_input(d, n):
    os.makedirs(d)
    per = n // 3
    for k in range(3):
        with open(os.path.join(d, f"part{k}.csv"), "w") as fh:
            fh.write("id,key,pad\n")
            for i in range(k * per, n if k == 2 else (k + 1) * per):
                fh.write(f"{i},{i % 11},{'p' * (i % 37)}\n")


def wait_for_output(out, job):
    """Until the running job has committed some rows (a checkpoint completed
    after records reached the sink): a stop then lands inside the files."""
    wait_for(lambda: os.path.isdir(out) and read_parquet_dir(out), "the job's first committed rows", job=job)


def read_parquet_dir(path):
    import pyarrow.parquet as pq

    return [r for name in sorted(os.listdir(path)) if name.startswith("part-") and name.endswith(".parquet")
            for r in pq.read_table(os.path.join(path, name)).to_pylist()]


def summary(rows):
    """What an uninterrupted run commits, whatever order a key's rows came in:
    each id once, and per key the counts 1..c."""
    per_key = collections.defaultdict(list)
    for r in rows:
        per_key[r["key"]].append(r["n"])
    return sorted(r["id"] for r in rows), {k: sorted(v) for k, v in per_key.items()}


@pytest.mark.parametrize("p2", [3, 1])
def test_a_csv_job_stopped_at_two_resumes_at_another_parallelism_exactly_once(tmp_path, p2):
    n = 6000
    d, out, ck, sp = (str(tmp_path / x) for x in ("in", "out", "ck", "sp"))
    write_job_input(d, n)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    csv_job(env, d, out, 2, rate=1000)
    job = env.execute_async()
    wait_for_output(out, job)
    assert job.stop(savepoint=sp) == sp
    first = read_parquet_dir(out)
    assert 0 < len(first) < n            # stopped half way: the savepoint holds positions inside the files
    env2 = fb.Environment(parallelism=p2, checkpoint_interval=0.1, checkpoint_dir=ck)
    csv_job(env2, d, out, p2, rate=None)
    env2.execute(60, restore_from=sp)
    rows = read_parquet_dir(out)
    want = [{"key": i % 11, "id": i, "n": 0} for i in range(n)]
    counts = collections.Counter(i % 11 for i in range(n))
    assert summary(rows) == (sorted(r["id"] for r in want), {k: list(range(1, c + 1)) for k, c in counts.items()})


def test_a_csv_job_rescaled_twice_through_savepoints(tmp_path):
    """2 -> 3 (explicit positions) -> 1: the second restore rescales them again."""
    n = 6000
    d, out, ck = (str(tmp_path / x) for x in ("in", "out", "ck"))
    write_job_input(d, n)
    sp = None
    for k, p in enumerate((2, 3)):
        env = fb.Environment(parallelism=p, checkpoint_interval=0.1, checkpoint_dir=ck)
        csv_job(env, d, out, p, rate=800)
        job = env.execute_async(restore_from=sp) if sp else env.execute_async()
        wait_for_output(out, job)
        if k:      # rows beyond what the first run committed
            wait_for(lambda: len(read_parquet_dir(out)) > committed, "rows of the second run", job=job)
        sp = job.stop(savepoint=str(tmp_path / f"sp{k}"))
        committed = len(read_parquet_dir(out))
        assert committed < n
    env = fb.Environment(parallelism=1, checkpoint_interval=0.1, checkpoint_dir=ck)
    csv_job(env, d, out, 1, rate=None)
    env.execute(60, restore_from=sp)
    counts = collections.Counter(i % 11 for i in range(n))
    assert summary(read_parquet_dir(out)) == (list(range(n)), {k: list(range(1, c + 1)) for k, c in counts.items()})


def test_workers_resume_a_csv_job_at_another_parallelism(tmp_path):
    """With workers=2 each process computes the plan for its own subtasks:
    the same plan, so the runs fit together."""
    n = 6000
    d, out, ck, sp = (str(tmp_path / x) for x in ("in", "out", "ck", "sp"))
    write_job_input(d, n)
    env = fb.Environment(parallelism=2, workers=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    csv_job(env, d, out, 2, rate=1000)
    job = env.execute_async()
    wait_for_output(out, job)
    job.stop(savepoint=sp)
    assert 0 < len(read_parquet_dir(out)) < n
    env2 = fb.Environment(parallelism=3, workers=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    csv_job(env2, d, out, 3, rate=None)
    env2.execute(120, restore_from=sp)
    counts = collections.Counter(i % 11 for i in range(n))
    assert summary(read_parquet_dir(out)) == (list(range(n)), {k: list(range(1, c + 1)) for k, c in counts.items()})


def test_a_changed_file_refuses_a_rescaled_restore(tmp_path):
    n = 3000
    d, out, ck, sp = (str(tmp_path / x) for x in ("in", "out", "ck", "sp"))
    write_job_input(d, n)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=ck)
    csv_job(env, d, out, 2, rate=1000)
    job = env.execute_async()
    wait_for_output(out, job)
    job.stop(savepoint=sp)
    with open(os.path.join(d, "part1.csv"), "a") as fh:
        fh.write("99999,1,x\n")
    env2 = fb.Environment(parallelism=3, checkpoint_interval=0.1, checkpoint_dir=ck)
    csv_job(env2, d, out, 3, rate=None)
    with pytest.raises(IncompatibleCheckpointError, match="part1.csv"):
        env2.execute(60, restore_from=sp)


# ---------------------------------------------------------------- positions that do not fit

@pytest.fixture
def one_file(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("id,t\n" + "".join(f"{i},v{i}\n" for i in range(200)))
    return str(path), os.path.getsize(path)


def test_a_byte_offset_beyond_the_file_is_refused(one_file):
    path, size = one_file
    src = factory_of([path], True)()
    with pytest.raises(ConfigurationError, match=r"does not fit the files read now.*not a line start"):
        src.rescale_positions([[0, size + 100, 0], [1, 0, 0]], 3)
    with pytest.raises(IncompatibleCheckpointError, match=r"bytes 5\.\.\d+ of .*whose rows are bytes 5\.\."):
        src.rescale_positions([{"units": [[0, 5, size + 1, 0]]}], 2)
    src.open(0, 2)
    with pytest.raises(ConfigurationError, match="does not fit"):
        src.seek({"units": [[0, 5, size + 1, 0]]})


def test_a_position_inside_a_line_or_the_header_or_another_file_is_refused(one_file):
    path, size = one_file
    src = factory_of([path], True)()
    with pytest.raises(ConfigurationError, match="not a line start"):
        src.rescale_positions([[0, 7, 0]], 2)            # inside line "0,v0"
    with pytest.raises(ConfigurationError, match="whose rows are bytes 5"):
        src.rescale_positions([{"units": [[0, 0, 20, 0]]}], 2)      # the header is no row
    with pytest.raises(ConfigurationError, match="file 3 of 1"):
        src.rescale_positions([[3, 0, 0]], 2)
    with pytest.raises(ConfigurationError, match="line start to a line end"):
        src.rescale_positions([{"units": [[0, 5, 9, 1]]}], 2)       # a begun block cut inside a line
    with pytest.raises(ConfigurationError, match="is in both"):
        src.rescale_positions([{"units": [[0, 5, 50, 0]]}, {"units": [[0, 40, 60, 0]]}], 2)
    with pytest.raises(ConfigurationError, match="is in both"):       # past a unit that holds no line
        src.rescale_positions([{"units": [[0, 5, 100, 0]]}, {"units": [[0, 6, 7, 0], [0, 60, 70, 0]]}], 2)


@pytest.mark.parametrize("bad", ["x", None, [0, 5], [0, -1, 0], {"units": [[0, "5", 9, 0]]}, {"unit": []},
                                 {"units": [[0, 5, 9]]}])
def test_a_position_that_is_not_one_is_refused(one_file, bad):
    path, _ = one_file
    src = factory_of([path], True)()
    with pytest.raises(ConfigurationError, match="is not a position of this source"):
        src.rescale_positions([bad, [1, 0, 0]], 1)
    if isinstance(bad, dict):
        src.open(0, 1)
        with pytest.raises(ConfigurationError, match="is not a position of this source"):
            src.seek(bad)


def test_the_plan_deals_bytes_not_blocks():
    """``deal`` on its own: pieces not begun are cut at the runs' bounds,
    partly read blocks go whole to the run that holds their middle."""
    units = [(0, 10, 110, 0), (0, 110, 130, 3), (1, 0, 80, 0)]
    runs = csv_split.deal(units, 4)           # 200 bytes: 50 each
    assert runs == [[(0, 10, 60, 0)], [(0, 60, 110, 0)], [(0, 110, 130, 3), (1, 0, 30, 0)], [(1, 30, 80, 0)]]
    assert csv_split.deal([], 3) == [[], [], []]
    assert csv_split.deal([(0, 0, 1, 0)], 3) == [[], [], [(0, 0, 1, 0)]]
