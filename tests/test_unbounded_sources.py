"""Unbounded sources (issue 22, item 4): ``socket_text`` against loopback
servers the tests start and stop, and ``monitor=`` on the file sources (a
watched directory, files added while the job runs, a file still growing, a
restore in the middle). Every test stops by itself: servers and writers are
bounded, monitored sources end with ``monitor_timeout`` or a cancel, and
waits are bounded loops."""
from __future__ import annotations

import collections
import json
import os
import socket
import threading
import time
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.connectors import monitor as mon
from pyflowbuf.windows import Count

from pipeline_helpers import assert_clean, read_parts

BOUND_S = 30        # no test waits longer than this for anything


# ---------------------------------------------------------------- loopback servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_once(port, chunks, pause=0.0, hold=None, ready=None):
    """Accept one connection on ``port``, send ``chunks`` (bytes) with
    ``pause`` seconds between them, then wait for ``hold`` (an Event) if
    given, and close. Returns the thread."""
    srv = socket.create_server(("127.0.0.1", port))

    def run():
        try:
            srv.settimeout(BOUND_S)
            conn, _ = srv.accept()
            with conn:
                for c in chunks:
                    conn.sendall(c)
                    if pause:
                        time.sleep(pause)
                if hold is not None:
                    hold.wait(BOUND_S)
        finally:
            srv.close()
            if ready is not None:
                ready.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def split_reference(data: bytes, delimiter: str) -> list:
    """What socket_text gives for ``data`` sent on one connection that then closes."""
    text = data.decode("utf-8")
    parts = text.split(delimiter)
    last = parts.pop()
    if delimiter == "\n":
        parts = [p[:-1] if p.endswith("\r") else p for p in parts]
        last = last[:-1] if last.endswith("\r") else last
    return parts + ([last] if last else [])


# ---------------------------------------------------------------- socket_text

@settings(max_examples=15)
@given(lines=st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\n;"),
                              max_size=12), min_size=1, max_size=12),
       delimiter=st.sampled_from(["\n", ";", "<>"]), crlf=st.booleans(), trailing=st.booleans(),
       cuts=st.lists(st.integers(min_value=1, max_value=200), max_size=8))
def test_lines_split_across_sends_arrive_whole(lines, delimiter, crlf, trailing, cuts):
    sep = "\r\n" if crlf and delimiter == "\n" else delimiter
    data = (sep.join(lines) + (sep if trailing else "")).encode("utf-8")
    # cut the bytes anywhere, inside a delimiter or a UTF-8 character too
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    chunks = [data[a:b] for a, b in zip(points, points[1:]) if b > a]
    port = free_port()
    serve_once(port, chunks, pause=0.005)
    env = fb.Environment()
    out = env.socket_text("127.0.0.1", port, delimiter, max_retries=0, retry_delay=0.05).collect()
    env.execute(timeout=BOUND_S)
    assert out.result == split_reference(data, delimiter)


def test_the_source_reconnects_after_the_server_restarts_and_ends_when_retries_run_out():
    port = free_port()
    first_done = threading.Event()
    serve_once(port, [b"a1\na2\n", b"a3"], ready=first_done)     # "a3": the last line of a connection

    def second_server():
        first_done.wait(BOUND_S)
        time.sleep(0.3)       # down for a while: the source retries with its back-off meanwhile
        serve_once(port, [b"b1\n", b"b2\n"]).join(BOUND_S)
    threading.Thread(target=second_server, daemon=True).start()
    env = fb.Environment()
    out = env.socket_text("localhost", port, max_retries=4, retry_delay=0.05, max_retry_delay=0.2).collect()
    env.execute(timeout=BOUND_S)
    assert out.result == ["a1", "a2", "a3", "b1", "b2"]
    assert_clean(env)


def test_the_back_off_doubles_up_to_its_cap_and_resets_on_a_connection():
    from pyflowbuf.connectors.socket_text import SocketTextSource

    src = SocketTextSource("127.0.0.1", free_port(), max_retries=None, retry_delay=0.1, max_retry_delay=0.5)
    waits = []
    for _ in range(5):
        before = time.monotonic()
        src._connect()                                  # refused: nothing listens there
        waits.append(round(src._next_try - before, 1))
    assert waits == [0.1, 0.2, 0.4, 0.5, 0.5]
    port = free_port()
    src.port = port
    t = serve_once(port, [b"x\n"])
    src._connect()
    assert src._sock is not None and src._delay == 0.1 and src._failures == 0
    src.close()
    t.join(BOUND_S)


def test_a_source_that_never_connects_fails_the_job_naming_the_address():
    port = free_port()
    env = fb.Environment()
    env.socket_text("127.0.0.1", port, max_retries=2, retry_delay=0.02).collect()
    with pytest.raises(errors.JobFailedError, match=rf"ConnectionRefusedError.*127\.0\.0\.1:{port}.*3 attempts"):
        env.execute(timeout=BOUND_S)


@pytest.mark.parametrize("host", ["192.0.2.7", "8.8.8.8", "0.0.0.0"])
def test_a_host_that_is_not_loopback_is_refused_unless_allowed(host):
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match="allow_remote=True"):
        env.socket_text(host, 9999)
    env.socket_text(host, 9999, allow_remote=True)       # declared; nothing connects before execute()


def test_loopback_names_and_addresses_are_accepted():
    env = fb.Environment()
    for host in ["localhost", "127.0.0.1", "127.1.2.3"]:
        env.socket_text(host, 9999)


def test_arguments_are_checked_where_the_stream_is_declared():
    env = fb.Environment()
    for kw, match in [({"port": 0}, "port"), ({"port": "80"}, "port"), ({"delimiter": ""}, "delimiter"),
                      ({"encoding": "no-such-codec"}, "encoding"), ({"max_retries": -1}, "max_retries"),
                      ({"retry_delay": 0}, "retry_delay"), ({"max_retry_delay": float("inf")}, "max_retry_delay"),
                      ({"retry_delay": 2.0, "max_retry_delay": 1.0}, "max_retry_delay")]:
        args = {"host": "127.0.0.1", "port": 9999, **kw}
        with pytest.raises(errors.ConfigurationError, match=match):
            env.socket_text(**args)


def test_exactly_once_checkpoints_refuse_the_socket_source_saying_why(tmp_path):
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=tmp_path / "chk")
    with pytest.raises(errors.ConfigurationError, match="cannot rewind.*at_least_once"):
        env.socket_text("127.0.0.1", 9999)
    # checkpoints turned on after the declaration: refused when the job starts
    env = fb.Environment()
    env.socket_text("127.0.0.1", 9999).collect()
    env.checkpoint_interval, env.checkpoint_dir = 0.1, tmp_path / "chk2"
    with pytest.raises(errors.ConfigurationError, match="socket_text.*cannot rewind.*at_least_once"):
        env.execute(timeout=BOUND_S)


def test_at_least_once_checkpoints_complete_while_the_server_is_silent(tmp_path):
    port = free_port()
    hold = threading.Event()
    serve_once(port, [b"x\ny\n"], hold=hold)
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         checkpointing_mode="at_least_once")
    out = env.socket_text("127.0.0.1", port, max_retries=0).collect()
    job = env.execute_async()
    deadline = time.monotonic() + BOUND_S
    while len([c for c in env.checkpoints() if c["status"] == "completed"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    hold.set()              # the server closes: the stream ends
    job.join(BOUND_S)
    assert out.result == ["x", "y"]
    assert len([c for c in env.checkpoints() if c["status"] == "completed"]) >= 3


@pytest.mark.parametrize("phase", ["reading", "waiting to retry"])
def test_cancel_ends_the_source_while_it_waits(phase):
    port = free_port()
    hold = threading.Event()
    if phase == "reading":
        serve_once(port, [b"one\n"], hold=hold)       # connected, the server sends nothing more
    env = fb.Environment()
    got = []
    # a retry delay longer than the bound: only a wake-up ends the wait in time
    env.socket_text("127.0.0.1", port, max_retries=None, retry_delay=2 * BOUND_S,
                    max_retry_delay=2 * BOUND_S).sink(got.append)
    job = env.execute_async()
    deadline = time.monotonic() + BOUND_S
    while phase == "reading" and not got and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)
    assert not job.done
    job.cancel()
    job.join(BOUND_S)                 # a TimeoutError here: the source did not see the cancel
    hold.set()
    assert job.done and all(t.state == "CANCELED" for t in job.tasks)
    assert_clean(env)


def test_a_silent_socket_source_spins_no_core():
    port = free_port()
    hold = threading.Event()
    serve_once(port, [b"a\n"], hold=hold)
    env = fb.Environment()
    env.socket_text("127.0.0.1", port, max_retries=0).collect()
    job = env.execute_async()
    deadline = time.monotonic() + BOUND_S
    while not job.tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    src = job.tasks[0].source
    calls = []
    pull = src.next_batch

    def counted(n):
        calls.append(n)
        return pull(n)
    src.next_batch = counted
    time.sleep(1.0)
    hold.set()
    job.join(BOUND_S)
    # waiting in select: a pull per poll (0.2 s) or wake-up; a spinning
    # source would pull thousands of times in that second
    assert len(calls) < 50, len(calls)


# ---------------------------------------------------------------- the monitored directory

def put(directory, name, lines):
    """Write a file whole under a hidden name, then rename it into place."""
    tmp = os.path.join(directory, "." + name + ".tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in lines))
    os.rename(tmp, os.path.join(directory, name))


def lines_of(name, n):
    return [f"{name}-{i}" for i in range(n)]


def run_until(env, got, n, settle=0.5):
    """Run the job until the sink list ``got`` holds ``n`` records (a
    bounded wait), a little longer (a record read twice would show), then
    cancel it: a monitored source does not end by itself."""
    job = env.execute_async()
    deadline = time.monotonic() + BOUND_S
    while len(got) < n and time.monotonic() < deadline and not job.done:
        time.sleep(0.05)
    time.sleep(settle)
    running = not job.done
    job.cancel()
    job.join(BOUND_S)
    assert running, "the monitored source ended by itself"
    return job


def test_files_added_during_the_job_are_read_once(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    expected = []
    for i in range(3):
        put(d, f"early{i}.txt", lines_of(f"early{i}", 50))
        expected += lines_of(f"early{i}", 50)
    (d / "sub").mkdir()
    late = [(d, f"late{i}.txt") for i in range(4)] + [(d / "sub", "nested.txt")]
    for where, name in late:
        expected += lines_of(name, 30)

    def add_files():
        for where, name in late:
            time.sleep(0.15)
            put(where, name, lines_of(name, 30))
    env = fb.Environment(parallelism=2)
    got = []
    env.read_text(d, monitor=0.05).sink(got.append, parallelism=1)
    threading.Thread(target=add_files, daemon=True).start()
    run_until(env, got, len(expected))
    assert collections.Counter(got) == collections.Counter(expected)
    assert_clean(env)


def test_monitor_timeout_ends_the_source_once_nothing_new_comes(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    put(d, "a.txt", lines_of("a", 10))
    env = fb.Environment(parallelism=2)
    out = env.read_text(d, monitor=0.05, monitor_timeout=0.3).collect()
    env.execute(timeout=BOUND_S)           # ends by itself
    assert sorted(out.result) == sorted(lines_of("a", 10))


def test_a_file_still_growing_is_read_once_it_is_complete(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    expected = lines_of("grow", 100)

    def write_slowly():
        # appended in pieces that cut lines in two, with pauses shorter than
        # the scan interval: read early, the file would give a partial line
        # and lose the rest (a file is read once)
        with open(d / "grow.txt", "w") as f:
            text = "".join(line + "\n" for line in expected)
            for i in range(0, len(text), 7):
                f.write(text[i:i + 7])
                f.flush()
                time.sleep(0.01)
    env = fb.Environment()
    got = []
    # (a scan interval well above the writer's pauses, which a loaded machine
    # may stretch: two scans apart unchanged is the rule for "complete")
    env.read_text(d, monitor=0.5).sink(got.append)
    writer = threading.Thread(target=write_slowly, daemon=True)
    # the job runs (and scans) while the file grows, for several scans
    threading.Timer(0.5, writer.start).start()
    run_until(env, got, len(expected), settle=1.0)
    writer.join(BOUND_S)
    assert got == expected


def test_the_stability_rule_directly(tmp_path):
    """Drive the source by hand: a file is taken at the second scan that
    sees it unchanged, an empty one not at all, one growing not yet."""
    d = tmp_path / "in"
    d.mkdir()
    factory, kind = mon.text_source(str(d), encoding="utf-8", monitor=0.01, monitor_timeout=None, what="t")
    src = factory()
    src.open(0, 1)
    (d / "empty.txt").write_text("")
    (d / "a.txt").write_text("a\n")
    assert src.next_batch(10) == []           # first scan: seen once
    time.sleep(0.02)
    with open(d / "b.txt", "w") as f:
        f.write("b")
    assert src.next_batch(10) == ["a"]        # second scan: a is stable; b is new
    for _ in range(3):
        with open(d / "b.txt", "a") as f:
            f.write("b")
        time.sleep(0.02)
        assert src.next_batch(10) == []       # b grows between scans
    got = []
    for _ in range(20):                       # unchanged now: read at the next scans, whole
        time.sleep(0.02)
        got += src.next_batch(10)
    assert got == ["bbbb"]
    for _ in range(3):
        time.sleep(0.02)
        assert src.next_batch(10) == []       # read once; empty.txt never
    assert sorted(os.path.basename(p) for p in src.done) == ["a.txt", "b.txt"]
    src.close()


def test_a_file_changed_after_it_was_read_warns_and_is_not_read_again(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    put(d, "a.txt", ["1", "2"])
    factory, _ = mon.text_source(str(d), encoding="utf-8", monitor=0.01, monitor_timeout=0.3, what="t")
    src = factory()
    src.open(0, 1)
    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(200):
            batch = src.next_batch(10)
            if batch is None:
                break
            got += batch
            if got == ["1", "2"] and not caught and not os.path.exists(d / "appended"):
                # appended while the file is being read or after: read as it was found complete
                with open(d / "a.txt", "a") as f:
                    f.write("3\n")
                (d / ".appended").write_text("")
                os.rename(d / ".appended", d / "appended")
    assert got == ["1", "2"]
    assert len([w for w in caught if "changed after it was read" in str(w.message)]) == 1


def run_source_to_end(src, cap=2000):
    got = []
    for _ in range(cap):
        batch = src.next_batch(7)
        if batch is None:
            return got
        got += batch
    raise AssertionError("the monitored source did not end")


@settings(max_examples=25)
@given(sizes=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=5),
       parallelism=st.integers(min_value=1, max_value=3), stop_after=st.integers(min_value=0, max_value=40),
       fmt=st.sampled_from(["text", "csv"]))
def test_a_restore_from_any_position_reads_each_file_exactly_once(tmp_path_factory, sizes, parallelism,
                                                                 stop_after, fmt):
    """Differential: subtasks read some batches, take their positions (plain
    JSON data), and new subtasks sought to them read the rest; together
    they give every line of every file once, in file order per file."""
    d = tmp_path_factory.mktemp("in")
    reference = []
    for i, n in enumerate(sizes):
        rows = [f"f{i}-{j}" for j in range(n)]
        if fmt == "csv":
            put(d, f"f{i}.csv", ["name"] + rows)
        else:
            put(d, f"f{i}.txt", rows)
        reference += rows
    if fmt == "csv":
        import pyarrow as pa
        factory, _ = mon.csv_source(str(d), columns=None, column_types=pa.schema([("name", pa.string())]),
                                    column_names=None, header=True, delimiter=",", quote_char='"',
                                    batch_size=4, block_size=1024, as_="tuples", monitor=0.01,
                                    monitor_timeout=0.05, what="c")
    else:
        factory, _ = mon.text_source(str(d), encoding="utf-8", monitor=0.01, monitor_timeout=0.05, what="t")
    got = []
    for sub in range(parallelism):
        first = factory()
        first.open(sub, parallelism)
        for _ in range(stop_after):
            batch = first.next_batch(3)
            if batch is None:
                break
            got += batch
        pos = json.loads(json.dumps(first.position()))       # plain data, as checkpoints store it
        first.close()
        second = factory()
        second.check_identity(first.identity(), pos)
        second.open(sub, parallelism)
        second.seek(pos)
        got += run_source_to_end(second)
        second.close()
    if fmt == "csv":
        got = [r[0] for r in got]
    assert collections.Counter(got) == collections.Counter(reference)
    for i in range(len(sizes)):
        mine = [x for x in got if x.startswith(f"f{i}-")]
        assert mine == [f"f{i}-{j}" for j in range(sizes[i])]


@settings(max_examples=25)
@given(sizes=st.lists(st.integers(min_value=0, max_value=30), min_size=1, max_size=6),
       old_p=st.integers(min_value=1, max_value=3), new_p=st.integers(min_value=1, max_value=3),
       stop_after=st.integers(min_value=0, max_value=20))
def test_positions_dealt_out_to_another_parallelism_read_each_line_once(tmp_path_factory, sizes, old_p, new_p,
                                                                      stop_after):
    """For state rescaling: the positions of every old subtask, dealt out by
    rescale_positions to new_p subtasks, give every line once."""
    d = tmp_path_factory.mktemp("in")
    reference = []
    for i, n in enumerate(sizes):
        put(d, f"f{i}.txt", [f"f{i}-{j}" for j in range(n)])
        reference += [f"f{i}-{j}" for j in range(n)]
    factory, _ = mon.text_source(str(d), encoding="utf-8", monitor=0.01, monitor_timeout=0.05, what="t")
    got, positions = [], []
    for sub in range(old_p):
        src = factory()
        src.open(sub, old_p)
        for _ in range(stop_after):
            batch = src.next_batch(2)
            if batch is None:
                break
            got += batch
        positions.append(json.loads(json.dumps(src.position())))
        src.close()
    for sub, pos in enumerate(mon.MonitoredFileSource.rescale_positions(positions, new_p)):
        src = factory()
        src.open(sub, new_p)
        src.seek(pos)
        got += run_source_to_end(src)
        src.close()
    assert collections.Counter(got) == collections.Counter(reference)


def test_a_restore_refuses_a_file_being_read_that_changed_since(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    put(d, "a.txt", lines_of("a", 20))
    factory, _ = mon.text_source(str(d), encoding="utf-8", monitor=0.01, monitor_timeout=0.05, what="t")
    src = factory()
    src.open(0, 1)
    got = []
    while len(got) < 5:
        got += src.next_batch(5)
    pos = src.position()
    src.close()
    assert pos["reading"]
    with open(d / "a.txt", "w") as f:
        f.write("rewritten\n")
    from pyflowbuf.checkpoint.errors import IncompatibleCheckpointError
    with pytest.raises(IncompatibleCheckpointError, match="a.txt.*changed"):
        factory().check_identity(src.identity(), pos)


def checkpointed_job(env, d, out, **kw):
    (env.read_text(d, monitor=0.05, rate_limit=200, **kw)
        .map(lambda line: line.upper())
        .write_text(out))


@pytest.mark.parametrize("workers", [None, 2])
def test_a_restore_in_the_middle_reads_each_file_exactly_once(tmp_path, workers):
    d, out, chk = tmp_path / "in", tmp_path / "out", tmp_path / "chk"
    d.mkdir()
    expected = []
    for i in range(8):
        put(d, f"f{i}.txt", lines_of(f"f{i}", 40))
        expected += lines_of(f"f{i}", 40)
    env = fb.Environment(parallelism=2, workers=workers, checkpoint_interval=0.1, checkpoint_dir=chk)
    checkpointed_job(env, d, out)
    job = env.execute_async()
    deadline = time.monotonic() + BOUND_S
    # cancelled once checkpoints committed some files whole (320 lines at 200/s)
    while len(read_parts(out)) < 100 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not job.done
    job.cancel()
    job.join(BOUND_S)
    done_before = len(read_parts(out))
    assert 100 <= done_before < len(expected)
    # a file that appears while the job is down is read after the restore
    put(d, "while_down.txt", lines_of("down", 40))
    expected += lines_of("down", 40)
    env = fb.Environment(parallelism=2, workers=workers, checkpoint_interval=0.1, checkpoint_dir=chk)
    checkpointed_job(env, d, out, monitor_timeout=1.0)
    env.execute(timeout=BOUND_S * 2, restore_from="latest")
    assert env.last_execution.restored_from is not None
    assert collections.Counter(read_parts(out)) == collections.Counter(x.upper() for x in expected)


def owned_names(prefix, n, parallelism, owner_index, d):
    names = []
    i = 0
    while len(names) < n:
        name = f"{prefix}{i}.txt"
        if mon.owner(os.path.abspath(os.path.join(d, name)), parallelism) == owner_index:
            names.append(name)
        i += 1
    return names


def test_an_idle_monitored_subtask_lets_the_watermark_advance_with_idle_timeout(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    # every file goes to subtask 0: subtask 1 of the source never has a record
    name, = owned_names("t", 1, 2, 0, d)
    put(d, name, [str(t) for t in range(15)])        # timestamps 0..14: window [0, 10) complete
    env = fb.Environment(parallelism=2)
    fired = []
    (env.read_text(d, monitor=0.05)
        .map(float)
        .assign_timestamps(lambda t: t, idle_timeout=0.2)
        .key_by(lambda t: 0)
        .window(fb.Tumbling(10.0))
        .aggregate(Count(), window_function=lambda key, w, n: (w.start, n))
        .sink(fired.append, parallelism=1))
    job = env.execute_async()
    deadline = time.monotonic() + BOUND_S
    while not fired and time.monotonic() < deadline:
        time.sleep(0.05)
    running = not job.done          # the monitored source never ends: the window fired while it ran
    job.cancel()
    job.join(BOUND_S)
    assert running and fired == [(0.0, 10)]


def test_csv_and_parquet_directories_are_watched_too(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    csv_dir, pq_dir = tmp_path / "csv", tmp_path / "pq"
    csv_dir.mkdir()
    pq_dir.mkdir()
    schema = pa.schema([("id", pa.int64()), ("name", pa.string())])

    def add():
        for i in range(3):
            time.sleep(0.1)
            put(csv_dir, f"{i}.csv", ["id,name"] + [f"{i * 10 + j},n{j}" for j in range(10)])
            tmp = pq_dir / f".{i}.parquet"
            pq.write_table(pa.table({"id": list(range(i * 10, i * 10 + 10)),
                                     "name": [f"n{j}" for j in range(10)]}, schema=schema), tmp)
            os.rename(tmp, pq_dir / f"{i}.parquet")
    env = fb.Environment(parallelism=2)
    got = []
    # empty directories: the columns come from column_types / schema
    a = env.read_csv(csv_dir, column_types=schema, monitor=0.05)
    b = env.read_parquet(pq_dir, schema=schema, columns=["id"], as_="tuples", monitor=0.05)
    a.map(lambda r: ("csv", r["id"], r["name"])).union(b.map(lambda r: ("pq", r[0], None))).sink(got.append)
    threading.Thread(target=add, daemon=True).start()
    run_until(env, got, 60)
    assert sorted(r[1] for r in got if r[0] == "csv") == list(range(30))
    assert all(r[2].startswith("n") for r in got if r[0] == "csv")
    assert sorted(r[1] for r in got if r[0] == "pq") == list(range(30))


def test_a_file_of_another_schema_fails_the_job_naming_it(tmp_path):
    pa = pytest.importorskip("pyarrow")
    d = tmp_path / "in"
    d.mkdir()
    put(d, "a.csv", ["id,name", "1,x"])
    env = fb.Environment()
    env.read_csv(d, monitor=0.05).collect()        # the columns of a.csv, the oldest file
    put(d, "b.csv", ["id,other", "2,y"])
    job = env.execute_async()
    with pytest.raises(errors.JobFailedError, match=r"FileFormatError.*b\.csv.*\['id', 'other'\]"):
        job.join(BOUND_S)
    del pa


def test_monitor_arguments_are_checked_where_the_stream_is_declared(tmp_path):
    pa = pytest.importorskip("pyarrow")
    d = tmp_path / "in"
    d.mkdir()
    (tmp_path / "one.txt").write_text("x\n")
    env = fb.Environment()
    with pytest.raises(errors.ConfigurationError, match="is a file"):
        env.read_text(tmp_path / "one.txt", monitor=1.0)
    with pytest.raises(FileNotFoundError):
        env.read_text(tmp_path / "nowhere", monitor=1.0)
    for bad in (0, -1, float("nan"), "1", True):
        with pytest.raises(errors.ConfigurationError, match="monitor"):
            env.read_text(d, monitor=bad)
    with pytest.raises(errors.ConfigurationError, match="monitor_timeout"):
        env.read_text(d, monitor=1.0, monitor_timeout=0)
    with pytest.raises(errors.ConfigurationError, match="needs monitor="):
        env.read_text(tmp_path / "one.txt", monitor_timeout=1.0)
    with pytest.raises(errors.ConfigurationError, match="column_types=pyarrow.schema"):
        env.read_csv(d, monitor=1.0)
    with pytest.raises(errors.ConfigurationError, match="schema=pyarrow.schema"):
        env.read_parquet(d, monitor=1.0)
    with pytest.raises(errors.ConfigurationError, match="schema= is for monitor="):
        env.read_parquet(d, schema=pa.schema([("a", pa.int64())]))
    env.read_text(str(tmp_path / "in" / "*.log"), monitor=1.0)       # a glob may match nothing yet


def test_a_cancel_ends_a_monitored_source_that_waits(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    env = fb.Environment(parallelism=2)
    env.read_text(d, monitor=2 * BOUND_S).collect()          # the next scan would be far away
    job = env.execute_async()
    time.sleep(0.3)
    assert not job.done
    job.cancel()
    job.join(BOUND_S)
    assert all(t.state == "CANCELED" for t in job.tasks)
    assert_clean(env)


def test_a_restart_with_at_least_once_checkpoints_reconnects_and_reads_on(tmp_path):
    port = free_port()
    srv = socket.create_server(("127.0.0.1", port))
    srv.settimeout(BOUND_S)
    second = threading.Event()

    def serve():
        with srv:
            first, _ = srv.accept()
            with first:
                first.sendall(b"a1\na2\nboom\n")
                conn, _ = srv.accept()        # the restarted source connects again
                second.set()
                with conn:
                    conn.sendall(b"b1\nb2\n")
    threading.Thread(target=serve, daemon=True).start()
    failed = []

    def fail_once(line):
        if line == "boom" and not failed:
            failed.append(line)
            raise RuntimeError("boom")
        return line
    env = fb.Environment(checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         checkpointing_mode="at_least_once", restart_attempts=1)
    out = env.socket_text("127.0.0.1", port, max_retries=0).map(fail_once).collect()
    env.execute(timeout=BOUND_S)
    assert failed and second.is_set() and env.last_execution.restarts == 1
    assert out.result[-2:] == ["b1", "b2"] and "boom" not in out.result


def test_the_socket_source_runs_in_a_worker_process():
    port = free_port()
    serve_once(port, [b"one two\nthree\n"])
    env = fb.Environment(parallelism=2, workers=2)
    out = env.socket_text("127.0.0.1", port, max_retries=0).flat_map(str.split).collect()
    env.execute(timeout=BOUND_S * 2)
    assert sorted(out.result) == ["one", "three", "two"]


@pytest.mark.parametrize("data", [b"ok\n\xff\xfe\n", "ok\nend\u00e9".encode()[:-1]])
def test_bytes_that_are_not_text_fail_the_job_naming_the_source(data):
    port = free_port()
    serve_once(port, [data])
    env = fb.Environment()
    env.socket_text("127.0.0.1", port, max_retries=0).collect()
    with pytest.raises(errors.JobFailedError, match="RecordTypeError.*not utf-8 text.*encoding="):
        env.execute(timeout=BOUND_S)


def test_a_failure_and_restart_of_a_monitored_job_gives_each_line_once(tmp_path):
    d, out = tmp_path / "in", tmp_path / "out"
    d.mkdir()
    expected = []
    for i in range(6):
        put(d, f"f{i}.txt", lines_of(f"f{i}", 40))
        expected += lines_of(f"f{i}", 40)
    seen = []

    def fail_once(line):
        seen.append(line)
        if len(seen) == 150:
            raise RuntimeError("fails once, in the middle")
        return line
    env = fb.Environment(parallelism=2, checkpoint_interval=0.05, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=1, chaining=False)
    (env.read_text(d, monitor=0.05, monitor_timeout=1.0, rate_limit=300)
        .map(fail_once, parallelism=1)
        .write_text(out))
    env.execute(timeout=BOUND_S * 2)
    assert env.last_execution.restarts == 1
    assert collections.Counter(read_parts(out)) == collections.Counter(expected)


def test_monitored_csv_and_parquet_arguments_are_checked_on_an_empty_directory_too(tmp_path):
    pa = pytest.importorskip("pyarrow")
    d = tmp_path / "in"
    d.mkdir()
    schema = pa.schema([("a", pa.int64())])
    env = fb.Environment()
    for kw, match in [({"as_": "rows"}, "as_"), ({"block_size": 10}, "block_size"), ({"header": 1}, "header"),
                      ({"columns": ["b"]}, "no column 'b'"), ({"batch_size": 0}, "batch_size")]:
        with pytest.raises(errors.ConfigurationError, match=match):
            env.read_csv(d, column_types=schema, monitor=1.0, **kw)
    with pytest.raises(errors.ConfigurationError, match="schema must be a pyarrow.Schema"):
        env.read_parquet(d, schema={"a": "int64"}, monitor=1.0)
    with pytest.raises(errors.ConfigurationError, match="no column 'b'"):
        env.read_parquet(d, schema=schema, columns=["b"], monitor=1.0)
