"""A running job's control endpoint (pyflowbuf/cluster/control.py) and the
commands that use it, ``pyflowbuf savepoint`` and ``pyflowbuf stop``
(pyflowbuf/cli/control.py): real jobs, in this process and as ``python -m
pyflowbuf run`` processes; the output they commit is compared with one run
without a stop."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import time

import pytest

import pyflowbuf as fb
from cli_helpers import ENV, KEYS, cli, committed_lines, expected_lines
from pipeline_helpers import cancel_and_join, wait_for
from pyflowbuf.errors import ConfigurationError, PortUnavailableError
from pyflowbuf.net import protocol as P
from pyflowbuf.cluster.control_channel import _NO_BUFFERS
from pyflowbuf.cluster import control






def count(key, n, state):
    state["n"] = state.get("n", 0) + 1
    return [f"{key},{state['n']}"]


def keyed_count(env, n, out, rate):
    (env.from_sequence(0, n, rate_limit=rate).uid("numbers")
        .key_by(lambda x: x % KEYS)
        .process(count).uid("counts")
        .write_text(out))


JOB = textwrap.dedent("""\
    import os
    import pyflowbuf as fb

    def count(key, n, state):
        state["n"] = state.get("n", 0) + 1
        return [f"{{key}},{{state['n']}}"]

    env = fb.Environment(parallelism=2, checkpoint_interval={interval}, checkpoint_dir="ck")
    rate = float(os.environ["JOB_RATE"]) if "JOB_RATE" in os.environ else None     # records/s
    (env.from_sequence(0, {n}, rate_limit=rate).uid("numbers")
        .key_by(lambda x: x % {keys})
        .process(count).uid("counts")
        .write_text("out"))
    """)


def start_job_process(tmp_path, *, n, rate, interval):
    (tmp_path / "job.py").write_text(JOB.format(n=n, interval=interval, keys=KEYS))
    proc = subprocess.Popen([sys.executable, "-m", "pyflowbuf", "run", "job.py", "--control-port", "0"],
                            cwd=tmp_path, env=dict(ENV, JOB_RATE=str(rate)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: os.path.exists(tmp_path / "ck" / control.CONTROL_FILE), "control file", proc=proc)
    return proc


@contextlib.contextmanager
def running(proc):
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


# ---------------------------------------------------------------- real jobs, own processes

def test_savepoint_of_a_running_job_then_restore_from_it_is_exactly_once(tmp_path, monkeypatch, clean_imports):
    """`pyflowbuf savepoint` while the job runs; the job runs on and then dies
    (SIGKILL, nothing else committed: its periodic checkpoints are an hour
    apart); restoring from the savepoint completes the output exactly once."""
    monkeypatch.chdir(tmp_path)
    n = 30_000
    with running(start_job_process(tmp_path, n=n, rate=3000, interval=3600)) as proc:
        time.sleep(0.3)             # some records through (the test holds whenever it lands)
        code, out, err = cli("savepoint", "ck", "sp", "--json")
        assert code == 0, err
        answer = json.loads(out)
        assert answer["command"] == "savepoint" and not answer["stopped"] and answer["job"] == "job"
        assert answer["path"] == str(tmp_path / "sp") and isinstance(answer["checkpoint_id"], int)
        assert os.path.exists(tmp_path / "sp" / "_metadata")
        assert proc.poll() is None                  # a savepoint leaves the job running
        before = committed_lines("out")
        assert len(before) < n
        proc.kill()
        proc.communicate()
    assert committed_lines("out") == before         # what the savepoint covers, no more
    # the dead job's file is left behind; the command says it is stale
    code, _, err = cli("stop", "ck")
    assert code == 1 and "is stale" in err and err.count("\n") == 1
    # a job started on that checkpoint_dir replaces the stale file, and removes its own at the end
    code, out, err = cli("run", "job.py", "--restore", "sp", "--control-port", "0", "--json")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["restored_from"] == answer["checkpoint_id"]
    assert committed_lines("out") == expected_lines(n)
    assert not os.path.exists(tmp_path / "ck" / control.CONTROL_FILE)


def test_stop_with_a_savepoint_then_resume_loses_and_repeats_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    n = 30_000
    with running(start_job_process(tmp_path, n=n, rate=2000, interval=0.1)) as proc:
        wait_for(lambda: glob.glob("ck/chk-*/_metadata"), "checkpoint", proc=proc)
        code, out, err = cli("stop", "ck", "--savepoint", "sp")
        assert code == 0, err
        assert "stopped job 'job'" in out and str(tmp_path / "sp") in out and "--restore" in out
        _, job_err = proc.communicate(timeout=60)
        assert proc.returncode == 0, job_err
    assert "stopped with a savepoint in" in job_err and str(tmp_path / "sp") in job_err
    assert not os.path.exists(tmp_path / "ck" / control.CONTROL_FILE)      # gone with the job
    first = committed_lines("out")
    assert len(first) < n
    code, _, err = cli("stop", "ck")
    assert code == 1 and "no running job controls" in err
    res = subprocess.run([sys.executable, "-m", "pyflowbuf", "run", "job.py", "--restore", "sp",
                          "--parallelism", "3"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert committed_lines("out") == expected_lines(n)


# ---------------------------------------------------------------- in this process

def control_env(tmp_path, **kw):
    kw.setdefault("checkpoint_interval", 0.1)
    return fb.Environment(parallelism=2, checkpoint_dir=str(tmp_path / "ck"), control_port=0, **kw)


@pytest.fixture
def slow_job(tmp_path):
    """A job that runs for minutes unless stopped; cancelled afterwards."""
    env = control_env(tmp_path)
    keyed_count(env, 10_000_000, str(tmp_path / "out"), rate=2000)
    job = env.execute_async()
    yield env, job
    if not job.done:
        with contextlib.suppress(Exception):
            cancel_and_join(job)


def test_the_control_file_is_private_names_the_endpoint_and_goes_with_the_job(tmp_path):
    env = control_env(tmp_path)
    # ~3 s at this rate: the file is still there when read (it goes when the job ends, joined or not)
    keyed_count(env, 6000, str(tmp_path / "out"), rate=2000)
    job = env.execute_async()
    path = tmp_path / "ck" / control.CONTROL_FILE
    info = json.loads(path.read_text())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert (info["address"], info["port"]) == tuple(job.control.address) and info["pid"] == os.getpid()
    assert info["job"] == "job" and len(bytes.fromhex(info["secret"])) == 32
    job.join(60)
    assert not path.exists() and job.control.closed
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(tuple(job.control.address), timeout=5).close()


def test_a_job_nobody_joins_removes_its_file_when_it_ends(tmp_path):
    env = control_env(tmp_path)
    keyed_count(env, 600, str(tmp_path / "out"), rate=None)
    job = env.execute_async()
    wait_for(lambda: job.done, "end of the job")
    wait_for(lambda: not os.path.exists(tmp_path / "ck" / control.CONTROL_FILE), "removal of the control file")
    job.join(10)


def test_a_wrong_secret_is_refused_and_the_job_runs_on(tmp_path, slow_job):
    env, job = slow_job
    host, port = job.control.address
    wrong = tmp_path / "wrong-secret"
    wrong.write_text(os.urandom(32).hex())
    code, _, err = cli("savepoint", "--address", f"{host}:{port}", "--secret-file", wrong, tmp_path / "sp")
    assert code == 1 and "refused the secret" in err
    # the endpoint counts the refusal after the client has read it: wait, don't race it
    wait_for(lambda: job.control.refused >= 1, "the endpoint to count the refusal", job=job)
    assert job.control.refused == 1 and not job.done and not os.path.exists(tmp_path / "sp")
    # a copy of the control file is a secret file too; then PATH is the one positional
    code, out, err = cli("savepoint", "--address", f"{host}:{port}", "--secret-file",
                         tmp_path / "ck" / control.CONTROL_FILE, tmp_path / "sp", "--json")
    assert code == 0, err
    assert json.loads(out)["path"] == str(tmp_path / "sp") and os.path.exists(tmp_path / "sp" / "_metadata")
    assert [c["path"] for c in env.checkpoints() if c["savepoint"]] == [f"file://{tmp_path / 'sp'}"]


def test_the_endpoint_reads_nothing_before_the_handshake_and_only_json_after(tmp_path, slow_job):
    env, job = slow_job
    address = tuple(job.control.address)
    secret = bytes.fromhex(json.loads((tmp_path / "ck" / control.CONTROL_FILE).read_text())["secret"])
    # a stranger that connects and says nothing does not hold up a real request
    stranger = socket.create_connection(address, timeout=5)
    try:
        answer = control.request(address, secret, {"op": "savepoint", "path": str(tmp_path / "sp1")})
        assert answer["ok"] and answer["path"] == str(tmp_path / "sp1")
    finally:
        stranger.close()
    # bytes that are not the handshake: refused, the endpoint goes on
    junk = socket.create_connection(address, timeout=5)
    junk.sendall(b"\x80\x04\x95" + b"\x00" * 64)         # e.g. a pickle
    junk.settimeout(10)
    with contextlib.suppress(OSError):
        while junk.recv(4096):
            pass
    junk.close()
    # authenticated, then a request that is no JSON object, or an unknown op
    for body in (b"[1, 2]", b"\xff\xfe", b'{"op": "cancel"}', b'{"op": "savepoint", "timeout": -1}',
                 b'{"op": "savepoint", "path": 7}'):
        sock = socket.create_connection(address, timeout=5)
        try:
            P.client_handshake(sock, P.FrameReader(sock, _NO_BUFFERS), secret, 0, deadline=time.monotonic() + 10)
            sock.sendall(len(body).to_bytes(4, "big") + body)
            sock.settimeout(10)
            try:
                answer = control.recv_message(sock)
            except (fb.errors.ProtocolError, OSError):
                answer = None           # not JSON: closed without an answer
        finally:
            sock.close()
        if body.startswith(b"{"):
            assert answer["ok"] is False and answer["error"] == "ProtocolError", body
        else:
            assert answer is None, body
    # a frame over the limit is refused without being read
    sock = socket.create_connection(address, timeout=5)
    P.client_handshake(sock, P.FrameReader(sock, _NO_BUFFERS), secret, 0, deadline=time.monotonic() + 10)
    sock.sendall((control.MAX_MESSAGE + 1).to_bytes(4, "big"))
    sock.settimeout(10)
    assert sock.recv(16) == b""
    sock.close()
    assert not job.done
    answer = control.request(address, secret, {"op": "savepoint", "path": str(tmp_path / "sp2")})
    assert answer["ok"] and answer["checkpoint_id"] > 0


def test_a_savepoint_the_job_cannot_take_is_an_error_and_the_job_runs_on(tmp_path, slow_job):
    env, job = slow_job
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "something").write_text("x")
    code, _, err = cli("savepoint", tmp_path / "ck", taken)
    assert code == 1 and "the job did not take the savepoint" in err and str(taken) in err
    assert not job.done
    code, _, err = cli("stop", tmp_path / "ck" / control.CONTROL_FILE, "--savepoint", taken)
    assert code == 1 and not job.done


def test_no_job_and_stale_files_are_clear_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(("savepoint", tmp_path / "nowhere"), "no such checkpoint directory"),
             (("savepoint", empty), "no running job controls"),
             (("stop", empty), "no running job controls")]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / control.CONTROL_FILE).write_text("{not json")
    cases.append((("stop", bad), "is not a pyflowbuf control file"))
    # a file of a process that is alive (this one) but listens on nothing there
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    left = tmp_path / "left"
    left.mkdir()
    (left / control.CONTROL_FILE).write_text(json.dumps({
        "format": 1, "job": "old", "pid": os.getpid(), "host": socket.gethostname(), "address": "127.0.0.1",
        "port": port, "secret": os.urandom(32).hex(), "token": "x", "started": time.time()}))
    cases.append((("savepoint", left), f"no job is listening at 127.0.0.1:{port}"))
    # a file of a process that is gone
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = tmp_path / "dead"
    dead.mkdir()
    info = json.loads((left / control.CONTROL_FILE).read_text())
    (dead / control.CONTROL_FILE).write_text(json.dumps(dict(info, pid=int(gone.stdout))))
    cases.append((("stop", dead), "is stale"))
    for argv, message in cases:
        code, out, err = cli(*argv)
        assert code == 1 and message in err and err.count("\n") == 1 and out == "", (argv, err)


@pytest.mark.parametrize("argv, message", [
    (["savepoint"], "name the job"),
    (["savepoint", "--address", "127.0.0.1:1"], "--address needs --secret-file"),
    (["savepoint", "ck", "--secret-file", "f"], "--secret-file goes with --address"),
    (["stop", "ck", "--address", "127.0.0.1:1", "--secret-file", "f"], "give no CHECKPOINT_DIR"),
    (["savepoint", "--address", "localhost", "--secret-file", "f"], "HOST:PORT"),
])
def test_usage_errors_exit_with_2(argv, message):
    code, _, err = cli(*argv)
    assert code == 2 and message in err


def test_settings_are_checked_before_anything_runs(tmp_path):
    with pytest.raises(ConfigurationError, match="savepoints need checkpointing"):
        fb.Environment(control_port=0)
    for port in (True, -1, 65536, "80", 1.5):
        with pytest.raises(ConfigurationError, match="control_port must be"):
            fb.Environment(checkpoint_interval=1.0, control_port=port)
    with pytest.raises(ConfigurationError, match="local checkpoint_dir"):
        fb.Environment(checkpoint_interval=1.0, checkpoint_dir="memory://ck", control_port=0)
    env = control_env(tmp_path)
    it = env.from_sequence(0, 10).to_iterator()
    with pytest.raises(ConfigurationError, match="execute_iter runs without a control endpoint"):
        next(env.execute_iter(it))
    # a busy port: refused before the job starts; the Environment is still unused
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        env = control_env(tmp_path)
        env.control_port = taken.getsockname()[1]
        out = env.from_sequence(0, 100).collect()
        with pytest.raises(PortUnavailableError, match="control_port="):
            env.execute(60)
        assert env.last_execution is None and not os.path.exists(tmp_path / "ck" / control.CONTROL_FILE)
    finally:
        taken.close()
    env.control_port = 0
    env.execute(60)
    assert sorted(out.result) == list(range(100))


def test_a_second_job_on_the_same_checkpoint_dir_is_refused(tmp_path, slow_job):
    env, job = slow_job
    other = control_env(tmp_path)
    other.from_sequence(0, 10).collect()
    with pytest.raises(ConfigurationError, match="two jobs must not share a checkpoint_dir"):
        other.execute(60)
    assert not job.done and os.path.exists(tmp_path / "ck" / control.CONTROL_FILE)


def test_stop_of_a_job_in_worker_processes_then_resume(tmp_path):
    """With workers=2 the driver serves the endpoint; the forked workers do
    not keep its port."""
    n = 3000

    def counting(rate=None, **kw):
        env = fb.Environment(parallelism=2, checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / "ck"), **kw)
        out = (env.from_sequence(0, n, rate_limit=rate).uid("numbers")
                  .map(lambda x: (x % 7, 1)).key_by(lambda kv: kv[0])
                  .reduce(lambda a, b: (a[0], a[1] + b[1])).uid("counts").collect())
        return env, out

    env, first = counting(workers=2, control_port=0, rate=1500)
    job = env.execute_async()
    address = tuple(job.control.address)
    wait_for(lambda: any(c["status"] == "completed" for c in env.checkpoints()), "checkpoint")
    code, out, err = cli("stop", tmp_path / "ck", "--savepoint", tmp_path / "sp", "--json")
    assert code == 0, err
    assert json.loads(out)["stopped"] and job.done
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(address, timeout=5).close()
    env2, second = counting()
    env2.execute(120, restore_from=str(tmp_path / "sp"))
    final = {}
    for k, c in first.result + second.result:
        final[k] = max(final.get(k, 0), c)
    assert final == {k: len(range(k, n, 7)) for k in range(7)}
    assert len(first.result) + len(second.result) == n          # nothing lost, nothing twice
