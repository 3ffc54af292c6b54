"""Two jobs (or runs) that share a transactional id prefix, against the real
broker (the session's ``kafka_broker``): the fenced job fails with
KafkaFencedError, and a restore or a final commit never takes another job's
commit marker for its own. Then each form in which confluent-kafka reports a
fencing, on a fake client (which form a real job meets varies from run to run)."""
from __future__ import annotations

import collections
import os
import re
import threading
import uuid

import pytest

import pyflowbuf as fb
from pyflowbuf import errors
from pyflowbuf.connectors import kafka as kc
from pipeline_helpers import cancel_and_join, wait_for
from test_kafka import FailOnce, read_committed
from test_kafka_committer import FakeClient, FakeProducer

ck = pytest.importorskip("confluent_kafka")
pytestmark = pytest.mark.kafka


def _name(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def endless_job(tmp_path, bs, out, prefix, name, *, rate=20000, workers=None):
    """An unbounded sequence (as str) into ``out``, exactly once with ``prefix``."""
    kw = {"workers": workers} if workers else {}
    env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / name), name=name, parallelism=2,
                         restart_attempts=0, **kw)
    (env.from_sequence(0, None, rate_limit=rate).uid("seq").map(str).uid("str")
        .write_kafka(out, bootstrap_servers=bs, delivery="exactly_once", transactional_id_prefix=prefix).uid("out"))
    return env


def committed_checkpoints(job):
    return sum(c.get("status") == "completed" for c in job.checkpoints())


@pytest.mark.parametrize("workers", [None, 2])
def test_a_job_fenced_by_another_with_its_prefix_fails_with_kafka_fenced_error(kafka_broker, tmp_path, workers):
    """Job b starts with job a's prefix: its producers fence a's. Where a
    meets that (a write, a delivery report, the commit's flush, marker or
    commit_transaction) varies from run to run, and so did the error before
    (a plain KafkaSinkError "_FATAL", or a SystemError from a delivery
    callback): it is always KafkaFencedError naming the id and the prefix."""
    bs = kafka_broker.bootstrap_servers
    out_a, out_b, prefix = _name("out-a"), _name("out-b"), _name("shared")
    kafka_broker.create_topic(out_a, partitions=1)
    kafka_broker.create_topic(out_b, partitions=1)
    a = endless_job(tmp_path, bs, out_a, prefix, "a", workers=workers).execute_async()
    b = None
    try:
        wait_for(lambda: committed_checkpoints(a) >= 3, "job a's first checkpoints", job=a)
        b = endless_job(tmp_path, bs, out_b, prefix, "b").execute_async()
        wait_for(lambda: a.done, "job a fenced by job b's producers")
        with pytest.raises(errors.JobFailedError) as info:
            a.join(60)
    finally:
        cancel_and_join(a, failure_ok=True)
        if b is not None:
            cancel_and_join(b, failure_ok=True)
    if workers:
        # (a worker's error reaches the driver as its type's name and message)
        text = str(info.value)
        assert "raised KafkaFencedError: " in text, text
    else:
        cause = info.value.__cause__
        assert isinstance(cause, errors.KafkaFencedError), f"job a failed with {cause!r}"
        assert cause.transactional_id.startswith(f"{prefix}-"), cause.transactional_id
        text = str(cause)
    assert re.search(rf"transactional id '{prefix}-\d-\d'.*same transactional_id_prefix \('{prefix}'\)", text), text


# ---- a restore and another job's commit marker (the same prefix, the same topic)

class FailsAroundACommit(kc.KafkaSink):
    """Fails once (``once``), in the commit of the first checkpoint with id
    ``at`` or more: ``before`` its transaction's commit (the checkpoint is
    complete, its records are not visible) or ``after`` it (visible, not yet
    forgotten). Without ``once`` it is a plain exactly-once sink."""

    def __init__(self, *a, once=None, when="before", at=1, **kw):
        super().__init__(*a, **kw)
        self.once, self.when, self.at = once, when, at

    def _commit_live(self, c, committer=None):
        due = self.once is not None and c["id"] >= self.at
        if due and self.when == "before" and self.once.now():
            raise RuntimeError(f"injected failure before the commit of checkpoint {c['id']}")
        super()._commit_live(c, committer)
        if due and self.when == "after" and self.once.now():
            raise RuntimeError(f"injected failure after the commit of checkpoint {c['id']}")


def tagged_job(chk, bs, out, prefix, tag, n, *, rate, sink_kw=None, interval=0.1):
    """``tag:i`` for i < n (None: unbounded) into ``out``, exactly once with ``prefix``."""
    env = fb.Environment(checkpoint_interval=interval, checkpoint_dir=str(chk), name=tag, restart_attempts=0)
    stream = env.from_sequence(0, n, rate_limit=rate).uid("seq").map(lambda i: f"{tag}:{i}").uid("tag")
    sink = FailsAroundACommit(bs, out, delivery="exactly_once", transactional_id_prefix=prefix, name="out",
                              **(sink_kw or {}))
    stream.sink_to(sink, name="out").uid("out")
    return env


def of_tag(values, tag):
    return collections.Counter(int(v.split(":")[1]) for v in values if v.startswith(tag + ":"))


def test_a_restore_re_sends_although_another_job_wrote_a_higher_marker(kafka_broker, tmp_path):
    """Job a fails after its checkpoint n completed, before n's transaction
    committed; job b, with the same prefix, writes to the same topic and
    commits checkpoints past n; a's restore of n must still send n's records
    (b's marker is not a's)."""
    bs = kafka_broker.bootstrap_servers
    out, prefix = _name("out"), _name("shared")
    kafka_broker.create_topic(out, partitions=1)
    once = FailOnce(tmp_path / "failed")
    a = tagged_job(tmp_path / "a", bs, out, prefix, "a", 3000, rate=1000,
                   sink_kw=dict(once=once, when="before")).execute_async()
    with pytest.raises(errors.JobFailedError):
        a.join(120)
    assert os.path.exists(once.marker)
    n = max(c["id"] for c in a.checkpoints() if c.get("status") == "completed")
    b = tagged_job(tmp_path / "b", bs, out, prefix, "b", None, rate=2000).execute_async()
    try:
        # b's marker passes a's checkpoint n
        wait_for(lambda: max([c["id"] for c in b.checkpoints() if c.get("status") == "completed"] + [0]) >= n + 3,
                 f"job b's checkpoint {n + 3}", job=b)
    finally:
        cancel_and_join(b, failure_ok=True)
    tagged_job(tmp_path / "a", bs, out, prefix, "a", 3000, rate=1000,
               sink_kw=dict(once=once, when="before")).execute(restore_from="latest")
    got = of_tag(read_committed(bs, out, 1), "a")
    assert got == collections.Counter(range(3000)), (
        f"missing {sorted(set(range(3000)) - set(got))[:10]}..., duplicated {[i for i, n in got.items() if n > 1][:10]}")


def test_a_restore_does_not_re_send_because_another_job_wrote_a_lower_marker(kafka_broker, tmp_path):
    """Job a fails right after its checkpoint n's transaction committed
    (n >= 20); job b, with the same prefix, writes to the same topic and
    commits checkpoints below n; a's restore of n must not send n's records
    again (b's marker is not a's)."""
    bs = kafka_broker.bootstrap_servers
    out, prefix = _name("out"), _name("shared")
    kafka_broker.create_topic(out, partitions=1)
    once = FailOnce(tmp_path / "failed")
    with pytest.raises(errors.JobFailedError):
        tagged_job(tmp_path / "a", bs, out, prefix, "a", None, rate=1000,
                   sink_kw=dict(once=once, when="after", at=20)).execute()
    assert os.path.exists(once.marker)
    # b: a checkpoint a second, stopped after its second (its ids stay below 20)
    b = tagged_job(tmp_path / "b", bs, out, prefix, "b", None, rate=100, interval=1.0).execute_async()
    try:
        wait_for(lambda: committed_checkpoints(b) >= 2, "job b's checkpoints", job=b)
    finally:
        b.stop(savepoint=str(tmp_path / "sp-b"), timeout=60)
    assert max(c["id"] for c in b.checkpoints()) < 20
    a = tagged_job(tmp_path / "a", bs, out, prefix, "a", None, rate=1000,
                   sink_kw=dict(once=once, when="after", at=20)).execute_async(restore_from="latest")
    try:
        wait_for(lambda: committed_checkpoints(a) >= 3, "the restored job a's checkpoints", job=a)
    finally:
        a.stop(savepoint=str(tmp_path / "sp-a"), timeout=60)
    got = read_committed(bs, out, 1)
    a_got = of_tag(got, "a")
    assert a_got and set(a_got) == set(range(max(a_got) + 1)), "a's output has a gap"
    assert [i for i, n in a_got.items() if n > 1] == [], "a's output has duplicates"
    b_got = of_tag(got, "b")
    assert b_got and set(b_got) == set(range(max(b_got) + 1)) and max(b_got.values()) == 1


def test_a_final_commit_is_not_skipped_for_another_jobs_higher_marker(kafka_broker, tmp_path):
    """Job a, with checkpoints, commits markers of ids past 2; then job b,
    with the same prefix and topic, ends before its first checkpoint: the
    driver's final commit of b (id 1) must not take a's marker for b's."""
    bs = kafka_broker.bootstrap_servers
    out, prefix = _name("out"), _name("shared")
    kafka_broker.create_topic(out, partitions=1)
    a = tagged_job(tmp_path / "a", bs, out, prefix, "a", None, rate=1000).execute_async()
    try:
        wait_for(lambda: committed_checkpoints(a) >= 5, "job a's checkpoints", job=a)
    finally:
        a.stop(savepoint=str(tmp_path / "sp-a"), timeout=60)
    tagged_job(tmp_path / "b", bs, out, prefix, "b", 10, rate=None, interval=30.0).execute()
    got = read_committed(bs, out, 1)
    assert of_tag(got, "b") == collections.Counter(range(10))
    a_got = of_tag(got, "a")
    assert set(a_got) == set(range(max(a_got) + 1)) and max(a_got.values()) == 1


# ---- how confluent-kafka reports a fencing (a fake client: each form, on demand)
#
# confluent-kafka 2.16 raises a producer's fatal error once, from the poll that
# serves it; when that poll then calls a delivery report, CPython raises
# SystemError("... returned a result with an exception set") chaining it; and
# every call after that reports only _FATAL ("Unable to produce message").


def kafka_exception(code, fatal=False):
    return ck.KafkaException(ck.KafkaError(code, "from the fake broker", fatal=fatal))


def callback_system_error(pending):
    """The SystemError CPython raises when confluent-kafka calls a Python
    callback while ``pending`` is set."""
    try:
        try:
            raise pending
        except ck.KafkaException as exc:
            raise SystemError("<function KafkaSink._on_delivery at 0x7f00> returned a result with an exception "
                              "set") from exc
    except SystemError as exc:
        return exc


class FencedLater(FakeProducer):
    """``poll`` raises ``client.poll_raises`` once (the fatal error it serves);
    ``abort_transaction`` does what ``calls["abort_transaction"]`` says."""

    def poll(self, timeout=0):
        exc, self.client.poll_raises = getattr(self.client, "poll_raises", None), None
        if exc is not None:
            raise exc
        return 0

    def abort_transaction(self, *a):
        self._call("abort_transaction")


class FencingClient(FakeClient):
    def Producer(self, conf):  # noqa: N802 - confluent_kafka's name
        return FencedLater(self, conf)


@pytest.fixture
def fencing(monkeypatch):
    release = threading.Event()
    client = FencingClient(release)
    monkeypatch.setattr(kc, "_ck", lambda: client)
    sink = kc.KafkaSink("127.0.0.1:9", "out", delivery="exactly_once", transactional_id_prefix="shared",
                        connect_timeout=5, name="sink")
    sink.open(0, 1)
    yield client, sink
    release.set()
    sink.abort()
    sink.close()


FENCED = dict(code=ck.KafkaError._FENCED, fatal=True)


def assert_fenced(err, tid="shared-0-0"):
    assert isinstance(err, errors.KafkaFencedError), repr(err)
    assert err.transactional_id == tid and err.error_name == "_FENCED", repr(err)
    assert re.search(rf"'{tid}'.*_FENCED.*same transactional_id_prefix \('shared'\).*transactional_id_prefix=",
                     str(err)), str(err)


def test_a_fencing_raised_through_a_delivery_callback_is_kafka_fenced_error(fencing):
    client, sink = fencing
    client.poll_raises = callback_system_error(kafka_exception(**FENCED))
    with pytest.raises(errors.KafkaFencedError) as info:
        sink.write(["x"])
    assert_fenced(info.value)
    assert isinstance(info.value.__cause__, SystemError)


def test_a_fatal_produce_is_named_by_the_fencing_not_yet_served(fencing):
    client, sink = fencing
    client.calls["produce"] = kafka_exception(ck.KafkaError._FATAL)
    client.poll_raises = kafka_exception(**FENCED)       # (served by the sink's own poll)
    with pytest.raises(errors.KafkaFencedError) as info:
        sink.write(["x"])
    assert_fenced(info.value)


def test_a_fatal_produce_after_the_fencing_was_served_is_kafka_fenced_error(fencing):
    client, sink = fencing
    client.poll_raises = kafka_exception(**FENCED)
    with pytest.raises(errors.KafkaFencedError):
        sink.write(["x"])
    client.calls["produce"] = kafka_exception(ck.KafkaError._FATAL)     # every later call
    with pytest.raises(errors.KafkaFencedError) as info:
        sink.write(["y"])
    assert_fenced(info.value)


def test_a_fencing_raised_through_a_callback_in_the_commit_is_kafka_fenced_error(fencing):
    client, sink = fencing
    sink.write(["x"])
    client.calls["flush"] = callback_system_error(kafka_exception(**FENCED))
    sink.commit(sink.prepare_commit(1))
    with pytest.raises(errors.KafkaFencedError) as info:
        sink.prepare_commit(2)
    assert_fenced(info.value)
    assert info.value.checkpoint_id == 1


@pytest.mark.parametrize("fenced", [True, False])
def test_a_commit_that_fails_without_saying_why_is_kafka_fenced_error_if_fenced(fencing, fenced):
    """Kafka 4.1 can answer a commit that another producer's
    init_transactions cut short with "Unknown broker error": aborting the
    transaction then tells whether the producer was fenced."""
    client, sink = fencing
    sink.write(["x"])
    client.calls["commit_transaction"] = kafka_exception(ck.KafkaError.UNKNOWN)
    if fenced:
        client.calls["abort_transaction"] = kafka_exception(**FENCED)
    sink.commit(sink.prepare_commit(1))
    with pytest.raises(errors.KafkaSinkError) as info:
        sink.prepare_commit(2)
    if fenced:
        assert_fenced(info.value)
        assert "UNKNOWN" in str(info.value)
    else:
        assert type(info.value) is errors.KafkaSinkError and info.value.error_name == "UNKNOWN", repr(info.value)


def test_a_system_error_of_a_user_function_is_not_taken_for_the_client(fencing):
    client, sink = fencing

    def key(r):
        raise SystemError("a C extension's own error")

    sink.key = key
    with pytest.raises(SystemError, match="C extension"):
        sink.write(["x"])


# ---- the default prefix: two copies of one job, in two checkpoint directories

def test_two_copies_of_a_job_with_the_default_prefix_in_two_directories_do_not_fence_each_other(kafka_broker,
                                                                                                tmp_path):
    """Two runs of one script (the same job name, the same sink uid, no
    prefix given), each with its own checkpoint directory, at once: the
    default prefix holds the directory, so neither fences the other; both
    keep committing and each output has every record once."""
    bs = kafka_broker.bootstrap_servers
    N = 20_000          # 4 s at the rate limit: the first copy still runs when the second opens
    outs = [_name("out-copy"), _name("out-copy")]
    for out in outs:
        kafka_broker.create_topic(out, partitions=1)

    def copy(i):
        env = fb.Environment(checkpoint_interval=0.1, checkpoint_dir=str(tmp_path / f"copy{i}"), parallelism=1,
                             restart_attempts=0)
        (env.from_sequence(0, N, rate_limit=5000).uid("seq").map(str).uid("str")
            .write_kafka(outs[i], bootstrap_servers=bs, delivery="exactly_once").uid("out"))
        return env
    envs = [copy(0), copy(1)]
    a = envs[0].execute_async("copy-job")
    b = None
    try:
        wait_for(lambda: committed_checkpoints(a) >= 2, "the first copy's first checkpoints", job=a)
        b = envs[1].execute_async("copy-job")
        wait_for(lambda: committed_checkpoints(b) >= 2, "the second copy's first checkpoints", job=b)
        overlapped = not a.done       # the second opened its producers beside the first's
        a.join(120)
        b.join(120)
    finally:
        cancel_and_join(a, failure_ok=True)
        if b is not None:
            cancel_and_join(b, failure_ok=True)
    prefixes = [kc.default_prefix("copy-job", "out", kc.checkpoint_scope(tmp_path / f"copy{i}")) for i in (0, 1)]
    assert prefixes[0] != prefixes[1] and all(p.startswith("pyflowbuf-copy-job-") for p in prefixes)
    assert overlapped, "the first copy ended before the second started: nothing was tried"
    for out in outs:
        assert sorted(map(int, read_committed(bs, out, 1))) == list(range(N))


def test_the_default_prefix_takes_the_name_and_directory_the_job_starts_with(tmp_path):
    """``execute("name")`` renames the job after ``write_kafka`` was
    called, and the default directory follows the name: the sink's default
    prefix is made of what the job starts with. A relative directory is
    named by its absolute path."""
    env = fb.Environment(checkpoint_interval=1.0, checkpoint_dir=str(tmp_path / "chk"))
    env.from_collection(["a"]).write_kafka("out", bootstrap_servers="127.0.0.1:9", delivery="exactly_once").uid("o")
    check = next(n.job_check for n in env.nodes if isinstance(n.job_check, kc.PrefixCheck))
    env.name = "payments"
    check.bind(env.name, env.checkpoint_config)
    assert (check.job, check.scope) == ("payments", kc.checkpoint_scope(tmp_path / "chk"))
    assert (check.sink.job, check.sink.scope) == ("payments", check.scope)
    assert kc.default_prefix(check.job, "o", check.scope) == f"pyflowbuf-payments-{check.scope}-o"
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert kc.checkpoint_scope("chk") == kc.checkpoint_scope(tmp_path / "chk")
    finally:
        os.chdir(cwd)
    assert kc.checkpoint_scope("s3://bucket/chk/") == kc.checkpoint_scope("s3://bucket/chk")
    assert kc.checkpoint_scope(None) is None
