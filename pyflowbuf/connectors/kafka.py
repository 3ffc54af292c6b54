"""Kafka in and out: ``Environment.read_kafka`` and ``stream.write_kafka``, the first
users of the connector API (``connectors/api.py``). Client: confluent-kafka
(librdkafka: batched consume, idempotent and transactional produce).

Reading (``KafkaSource``): a partition is a split. Partitions are *assigned*
to the reader subtasks by a formula (Flink's Kafka enumerator's: a topic's
partitions start at a subtask given by a hash of the topic name and go round
the subtasks), never subscribed, so the checkpoint owns the offsets; new
partitions are picked up every ``discovery_interval`` seconds. A
checkpoint records ``[next offset, end offset]`` per partition; a restore at
another parallelism deals the partitions out again. The group's offsets are
committed back when a checkpoint completes, for lag monitoring only.

Backpressure reaches the broker: the task pulls from the client only when
its output has room, and librdkafka stops fetching once its own prefetch
queue holds ``queued.max.messages.kbytes`` (default here 16 MiB per
subtask), so memory stays bounded and the lag grows in Kafka. A task that
has not pulled for ``pause_after`` seconds (held in a write by backpressure,
or busy in a slow chained operator) has its partitions paused by a watchdog
thread (``FetchPauser``): librdkafka drops what it had prefetched and
fetches nothing until the task pulls again, when they resume from the next
offset the task has not read.

Writing (``KafkaSink``): ``delivery="at_least_once"`` flushes (waits until
every record is delivered) before a checkpoint's barrier passes the sink.
Only failed deliveries are reported back (``delivery.report.only.error``).
``delivery="exactly_once"`` writes each checkpoint's records in a Kafka
transaction committed when the checkpoint completes, with the records kept in
the checkpoint and a commit marker written in the same transaction;
docs/kafka.md has the protocol and its failure cases.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import threading
import time
import weakref
import zlib
from array import array
from typing import Any, Callable

from pyflowbuf import errors
from pyflowbuf.connectors import api, kafka_arrow
from pyflowbuf.operators.contracts import Operator

log = logging.getLogger("pyflowbuf.kafka")

FORMATS = ("bytes", "str", "json")
READ_FORMATS = FORMATS + kafka_arrow.FORMATS        # read_kafka's: Arrow batches too
STARTS = ("earliest", "latest", "committed")
DELIVERIES = ("exactly_once", "at_least_once")
CONNECT_TIMEOUT_S = 10.0
POLL_S = 0.1
FETCH_WAIT_MS = 10
FETCH_MIN_BYTES = 64 * 1024
# seconds without a pull after which a reader's partitions are paused (a
# long block, not the short waits of steady backpressure: each pause drops
# the prefetched records, fetched again on resume)
PAUSE_AFTER_S = 1.0
# at most this long for the log start offsets of partitions read from the
# beginning (KafkaReader._resolve_beginnings); past it the logical offset is
# assigned, which costs librdkafka's 500 ms retry at worst
RESOLVE_BEGINNING_S = 1.0
# The marker's offset is the checkpoint id plus this (offsets are >= 0, and
# the id of the end of input is -1).
MARKER_BIAS = 2
# seconds a commit step may run past its own timeout before the task gives up
# on it: send_offsets_to_transaction can block past its timeout while the group
# coordinator is away (librdkafka issues 5456, 5511), so the task's wait has a
# bound of its own
COMMIT_GRACE_S = 5.0
# seconds a cancelled job's sink still waits for the commit running then (a
# commit of a completed checkpoint that ends in that time shows its records;
# one that does not is done again by a restore of that checkpoint)
CANCEL_WAIT_S = 2.0


def _ck():
    try:
        import confluent_kafka
    except ImportError as exc:      # optional dependency: the ``kafka`` extra
        raise ImportError("read_kafka/write_kafka need confluent-kafka: pip install 'pyflowbuf[kafka]'") from exc
    return confluent_kafka


class ClientLog:
    """librdkafka's log lines, into the logger ``pyflowbuf.kafka``. A broker
    that refuses a connection or closes one is retried by the client on its
    own (a restart, a moment's outage): librdkafka logs that at ERROR, which
    here becomes WARNING. A broker that stays away is the job's error, not a
    log line's: ``KafkaConnectionError`` after ``connect_timeout`` when the
    job starts, ``KafkaSinkError`` when a transaction cannot complete."""

    # (facilities FAIL and ERROR: a connection's state, not a request's answer)
    RECONNECTS = re.compile(
        r"Connection refused|Disconnected|connection closed|Connection reset|Connect to \S+ failed|"
        r"all brokers are down|brokers are down|Receive failed|Send failed|timed out|Broker transport failure",
        re.IGNORECASE)

    def __init__(self, logger=None):
        self.logger = logger or log

    def log(self, level, msg, *args, **kw):
        if level >= logging.ERROR and args and args[0] in ("FAIL", "ERROR"):
            text = str(args[-1])
            if self.RECONNECTS.search(text):
                level = logging.WARNING
        self.logger.log(level, msg, *args, **kw)


CLIENT_LOG = ClientLog()


def _client_conf(bootstrap_servers, properties) -> dict:
    conf = {"bootstrap.servers": bootstrap_servers, "logger": CLIENT_LOG}
    # authentication and TLS settings (security.protocol, sasl.*, ssl.*) pass through unchanged
    conf.update(properties or {})
    return conf


def _metadata(client, bootstrap_servers, timeout, topic=None):
    """The cluster's metadata, or KafkaConnectionError naming the servers."""
    ck = _ck()
    try:
        return client.list_topics(topic, timeout=timeout)
    except ck.KafkaException as exc:
        raise errors.KafkaConnectionError(
            f"no Kafka broker answered at bootstrap_servers={bootstrap_servers!r} within {timeout:g} s "
            f"({exc.args[0].str() if exc.args else exc}): is the broker running and the address right? "
            "(connect_timeout= sets how long to wait)") from None


def _consume(consumer, n):
    """Up to ``n`` records: those the client holds now, else the first to
    arrive within POLL_S. (``consume(n, timeout)`` alone waits until it has
    ``n`` or the timeout passed: up to POLL_S more latency per batch.)"""
    return consumer.consume(n, 0) or consumer.consume(1, POLL_S)


def flink_owner(topic: str, partition: int, parallelism: int) -> int:
    """The subtask reading ``partition`` of ``topic``: a topic's partitions
    start at a subtask given by a stable hash of its name and go round."""
    start = ((zlib.crc32(topic.encode("utf-8")) * 31) & 0x7FFFFFFF) % parallelism
    return (start + partition) % parallelism


# ---------------------------------------------------------------- reading

class KafkaSource(api.Source):
    """``Environment.read_kafka``'s source; see the module docstring."""

    def __init__(self, bootstrap_servers: str, topics=None, pattern=None, *, group_id=None,
                 value_format="bytes", include=(), starting_offsets="earliest", bounded=False,
                 timestamps=None, out_of_orderness=0.0, idle_timeout=None, properties=None,
                 wait_for_topics=False, connect_timeout=CONNECT_TIMEOUT_S, discovery_interval=10.0,
                 dead_letter=False, max_prefetch_kbytes=16384, pause_after=PAUSE_AFTER_S, name="read_kafka",
                 schema=None, batch_size=kafka_arrow.DEFAULT_BATCH_SIZE):
        self.bootstrap_servers = bootstrap_servers
        self.topics = list(topics) if topics is not None else None
        self.pattern = pattern
        self.group_id = group_id or f"pyflowbuf-{name}"
        self.value_format = value_format
        self.include = tuple(include)
        self.starting_offsets = starting_offsets
        self.bounded = bounded
        self.timestamps = timestamps
        self.out_of_orderness = out_of_orderness
        self.idle_timeout = idle_timeout
        self.properties = dict(properties or {})
        self.wait_for_topics = wait_for_topics
        self.connect_timeout = connect_timeout
        self.discovery_interval = None if bounded else discovery_interval
        self.dead_letter = dead_letter
        self.max_prefetch_kbytes = max_prefetch_kbytes
        self.pause_after = pause_after
        self.name = name
        self.schema = schema            # value_format="arrow-json": the values' columns
        self.batch_size = batch_size    # value_format="arrow"/"arrow-json": rows per RecordBatch at most
        # the metadata client, shared by this object's readers (with threads,
        # every subtask's): closed when the last reader closes, not the first,
        # whose subtask may end at once (no partition) while others still ask.
        # Not thread-local: a client left on a thread's locals is freed in a
        # forked child (a worker), where librdkafka's locks deadlock.
        self._admin = None
        self._admin_users = 0
        self._admin_lock = threading.Lock()

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_admin"], d["_admin_users"] = None, 0
        del d["_admin_lock"]
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._admin_lock = threading.Lock()

    def _client(self):
        with self._admin_lock:
            if self._admin is None:
                ck = _ck()
                conf = _client_conf(self.bootstrap_servers, self.properties)
                conf.update({"group.id": self.group_id, "enable.auto.commit": False})
                self._admin = ck.Consumer(conf)
            return self._admin

    def splits(self):
        deadline = time.monotonic() + self.connect_timeout
        while True:
            md = _metadata(self._client(), self.bootstrap_servers, self.connect_timeout)
            found, missing = [], []
            names = self.topics if self.topics is not None else sorted(
                t for t in md.topics if re.fullmatch(self.pattern, t) and not t.startswith("__"))
            for t in names:
                tm = md.topics.get(t)
                if tm is None or tm.error is not None or not tm.partitions:
                    missing.append(t)
                    continue
                found.extend((t, p) for p in sorted(tm.partitions))
            if not missing or self.wait_for_topics:
                self._check_explicit_offsets(md)
                return found
            if time.monotonic() > deadline:
                raise errors.KafkaTopicError(
                    f"read_kafka {self.name!r}: topic(s) {', '.join(map(repr, missing))} do not exist at "
                    f"{self.bootstrap_servers}: create them, or pass wait_for_topics=True to wait for them")
            time.sleep(0.2)     # just created: metadata may lag a moment

    def _check_explicit_offsets(self, md):
        """Explicit starting offsets name partitions that exist: one that does
        not is a typo, and would otherwise leave its topic's other partitions
        read from the earliest offset as if nothing had been asked."""
        so = self.starting_offsets
        if not isinstance(so, dict):
            return
        for key, val in so.items():
            topic, parts = (key[0], [key[1]]) if isinstance(key, tuple) else (key, list(val))
            tm = md.topics.get(topic)
            if tm is None or tm.error is not None or not tm.partitions:
                continue        # not there (yet): wait_for_topics
            absent = sorted(p for p in parts if p not in tm.partitions)
            if absent:
                raise errors.ConfigurationError(
                    f"read_kafka {self.name!r}: starting_offsets names partition(s) {absent} of topic {topic!r}, "
                    f"which has partitions 0..{max(tm.partitions)} at {self.bootstrap_servers}")

    def owner(self, split, parallelism):
        return flink_owner(split[0], split[1], parallelism)

    def create_reader(self, subtask, parallelism):
        with self._admin_lock:
            self._admin_users += 1
        return KafkaReader(self, subtask)

    def identity(self):
        return {"topics": self.topics, "pattern": self.pattern}

    def close_admin(self):
        """A reader is done with the metadata client; the last one closes it."""
        with self._admin_lock:
            self._admin_users = max(0, self._admin_users - 1)
            admin = self._admin if self._admin_users == 0 else None
            if admin is not None:
                self._admin = None
        if admin is not None:
            admin.close()


class FetchPauser:
    """One thread per process that pauses the partitions of every reader
    whose task has not pulled for its ``pause_after`` seconds (see the
    module docstring), and meanwhile asks the broker for their end offsets
    once a second, so ``records_lag`` keeps growing while nothing is
    fetched. It ends when no reader is left."""

    def __init__(self):
        self._reset()

    def _reset(self):
        # (also in a forked child: a worker does not inherit the parent's thread or lock)
        self.lock = threading.Lock()
        self.readers = weakref.WeakSet()
        self.thread = None

    def add(self, reader):
        with self.lock:
            self.readers.add(reader)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="pyflowbuf-kafka-pauser", daemon=True)
                self.thread.start()

    def remove(self, reader):
        with self.lock:
            self.readers.discard(reader)

    def _run(self):
        while True:
            with self.lock:
                readers = list(self.readers)
                if not readers:
                    self.thread = None
                    return
            step = min(r.s.pause_after for r in readers) / 4
            for r in readers:
                try:
                    r.pause_if_stalled(time.monotonic())
                except Exception as exc:    # noqa: BLE001 - a closed client: its task reports its own end
                    log.debug("read_kafka %r: pausing: %s", r.s.name, exc)
            time.sleep(max(0.02, min(step, 0.25)))


PAUSER = FetchPauser()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=PAUSER._reset)


class KafkaReader(api.SourceReader):
    """One subtask's consumer: its assigned partitions, their positions, the
    per-partition watermarks."""

    def __init__(self, source: KafkaSource, subtask: int):
        ck = _ck()
        self.ck = ck
        self.s = source
        self.subtask = subtask
        conf = _client_conf(source.bootstrap_servers, {})
        conf.update({
            "group.id": source.group_id, "enable.auto.commit": False, "enable.auto.offset.store": False,
            "enable.partition.eof": True, "isolation.level": "read_committed",
            "auto.offset.reset": "earliest",
            # the client's own prefetch queue is bounded: while the task does
            # not pull (backpressure) librdkafka stops fetching at this size
            "queued.max.messages.kbytes": source.max_prefetch_kbytes,
            # librdkafka waits this long before fetching again once the queue
            # was full (1 s by default): a task that drains the queue faster
            # would then wait for records, capped at a queue's worth a second
            "fetch.queue.backoff.ms": 20,
            # a fetch answers once 64 KiB are there or 10 ms passed, not at the
            # first record (the client's default): under a steady stream that is
            # a fetch request per produce request, and the broker's handling of
            # them took more of the machine than the job (a third less with
            # this, for at most 10 ms more latency; a backlog is read at once)
            "fetch.wait.max.ms": FETCH_WAIT_MS,
            "fetch.min.bytes": FETCH_MIN_BYTES,
        })
        conf.update(source.properties)
        self.consumer = ck.Consumer(conf)
        self.pos: dict = {}         # (topic, partition) -> [next offset or None, end offset or None]
        self.done: set = set()
        self.high: dict = {}        # last log end offset seen per partition (records_lag)
        self.max_ts: dict = {}      # per-partition highest timestamp
        self.last_seen: dict = {}   # per-partition monotonic time of the last record
        self.stamps = None          # the times of the last batch (timestamps=)
        self.dead = []              # undecodable records not yet handed to the dead-letter stream
        self._decode = _decoder(source.value_format)
        self._arrow = kafka_arrow.ArrowBatches(source) if source.value_format in kafka_arrow.FORMATS else None
        ts = source.timestamps
        self._ts_fn = ts if callable(ts) else None
        self._kafka_ts = ts == "kafka"
        # pausing (FetchPauser, in its own thread); the lock orders a pause
        # against the task's next pull, which resumes first
        self._fetch_lock = threading.Lock()
        self._pulling = False
        self._last_pull = time.monotonic()
        self.paused: list = []          # the TopicPartitions paused now
        self._stash: list = []          # messages served while pausing, for the next pull
        self.pauses = 0                 # how many times fetching was paused
        self._ends_asked = 0.0
        if source.pause_after is not None:
            PAUSER.add(self)

    # ---- splits ----
    def add_splits(self, splits):
        with self._fetch_lock:
            self._pulling = True        # (no pause meanwhile: the assignment changes)
        try:
            self._add_splits(splits)
        finally:
            self._last_pull = time.monotonic()
            self._pulling = False

    def _add_splits(self, splits):
        ck = self.ck
        assign = []
        for tp, pos in splits.items():
            topic, partition = tp
            if pos is not None:
                nxt, end = pos
                if end is None and self.s.bounded:
                    # restored from an unbounded read: bounded from here
                    end = self._end(topic, partition)
            else:
                nxt, end = self._start(topic, partition), None
                if self.s.bounded:
                    end = self._end(topic, partition)
            self.pos[tp] = [nxt, end]
            if end is not None and nxt is not None and nxt >= end:
                self.done.add(tp)
                continue
            self.last_seen[tp] = time.monotonic()
            assign.append(ck.TopicPartition(topic, partition, ck.OFFSET_BEGINNING if nxt is None else nxt))
        if assign:
            self._resolve_beginnings(assign)
            self.consumer.incremental_assign(assign)

    def _resolve_beginnings(self, assign):
        """Replace OFFSET_BEGINNING in ``assign`` by the log start offsets,
        asked in one request. A fresh consumer given a logical offset asks
        for it while it still talks to the bootstrap connection, and when
        the partition moves to its leader's connection librdkafka retries
        that query only after a fixed 500 ms: every job reading from the
        beginning started fetching half a second late. An explicit offset
        needs no query. If the broker does not answer (a leader not yet
        elected, say), the logical offset stays: correct, only slower."""
        ck = self.ck
        logical = [tp for tp in assign if tp.offset == ck.OFFSET_BEGINNING]
        if not logical:
            return
        try:
            # a ListOffsets timestamp of -2 (OFFSET_BEGINNING) asks for the earliest offset
            got = self.consumer.offsets_for_times(
                [ck.TopicPartition(tp.topic, tp.partition, ck.OFFSET_BEGINNING) for tp in logical],
                timeout=min(self.s.connect_timeout, RESOLVE_BEGINNING_S))
        except ck.KafkaException:
            return
        for tp, r in zip(logical, got):
            if r.error is None and r.offset >= 0:
                tp.offset = r.offset

    def _end(self, topic, partition):
        try:
            _, high = self.consumer.get_watermark_offsets(self.ck.TopicPartition(topic, partition),
                                                           timeout=self.s.connect_timeout)
        except self.ck.KafkaException as exc:
            raise errors.KafkaConnectionError(
                f"read_kafka {self.s.name!r}: the end offset of {topic}/{partition} at "
                f"{self.s.bootstrap_servers}: {exc}") from None
        return high

    def _start(self, topic, partition):
        """The first offset to read: None is the log's beginning."""
        ck, so = self.ck, self.s.starting_offsets
        tp = ck.TopicPartition(topic, partition)
        if so == "earliest":
            return None
        if so == "latest":
            return self._end(topic, partition)
        if so == "committed":
            got = self.consumer.committed([tp], timeout=self.s.connect_timeout)[0]
            return got.offset if got.offset >= 0 else None
        if isinstance(so, dict):
            given = so.get((topic, partition), so.get(topic))
            if isinstance(given, dict):
                given = given.get(partition)
            if given is None or given == "earliest":
                return None
            if given == "latest":
                return self._end(topic, partition)
            return int(given)
        # a timestamp in seconds: the first offset of a record at or after it
        tp = ck.TopicPartition(topic, partition, int(so * 1000))
        got = self.consumer.offsets_for_times([tp], timeout=self.s.connect_timeout)[0]
        return got.offset if got.offset >= 0 else self._end(topic, partition)

    # ---- pausing while the task does not pull ----
    def pause_if_stalled(self, now):
        """(FetchPauser's thread) Pause every partition being read when the
        task has not pulled for ``pause_after`` seconds; while paused, ask
        the broker for their end offsets once a second (``records_lag``)."""
        if self._pulling or now - self._last_pull < self.s.pause_after:
            return
        with self._fetch_lock:
            if self._pulling or self.consumer is None:
                return
            if not self.paused:
                tps = [self.ck.TopicPartition(t, p) for (t, p) in self.pos if (t, p) not in self.done]
                if not tps:
                    return
                self.consumer.pause(tps)
                # the records librdkafka had prefetched stay in its queue,
                # outdated, until the queue is served: serve it now, so they
                # are freed (a record of a partition not paused, none
                # expected, is kept for the task's next pull)
                self._stash.extend(self.consumer.consume(1000, 0))
                self.paused = tps
                self.pauses += 1
                log.debug("read_kafka %r subtask %d: no pull for %.1f s, fetching paused", self.s.name,
                          self.subtask, now - self._last_pull)
            if now - self._ends_asked < 1.0:
                return
            self._ends_asked = now
            for tp in self.paused:
                # (a short timeout: the task may pull again meanwhile)
                _, high = self.consumer.get_watermark_offsets(tp, timeout=1.0)
                if high >= 0:
                    self.high[(tp.topic, tp.partition)] = high

    def _resume(self):
        with self._fetch_lock:
            self._pulling = True
            if self.paused:
                tps, self.paused = self.paused, []
                # fetching starts again at the next offset the task has not read
                self.consumer.resume(tps)

    # ---- records ----
    def poll(self, max_records):
        if len(self.done) == len(self.pos) and self.s.bounded:
            return None
        self._resume()
        arrow = self._arrow
        try:
            if self._stash:
                msgs, self._stash = self._stash, []
            else:
                msgs = _consume(self.consumer, min(max_records, 10000 if arrow is None else arrow.batch_size))
        finally:
            self._last_pull = time.monotonic()
            self._pulling = False
        if not msgs:
            self.stamps = array("d") if self._ts_fn or self._kafka_ts else None
            return []
        if arrow is not None:
            return arrow.poll(self, msgs)
        timed = self._ts_fn is not None or self._kafka_ts
        if not timed and not self.s.include:
            fast = self._fast(msgs)
            if fast is not None:
                return fast
        out = []
        stamps = array("d") if timed else None
        pos, done, bounded = self.pos, self.done, self.s.bounded
        decode, include = self._decode, self.s.include
        now = time.monotonic()
        for m in msgs:
            err = m.error()
            tp = (m.topic(), m.partition())
            if err is not None:
                if err.code() == self.ck.KafkaError._PARTITION_EOF:
                    self.high[tp] = m.offset()
                    if bounded and tp in pos and pos[tp][1] is not None and m.offset() >= pos[tp][1]:
                        self._finish(tp)
                    continue
                if err.fatal() or not err.retriable():
                    if err.code() == self.ck.KafkaError.UNKNOWN_TOPIC_OR_PART:
                        raise errors.KafkaTopicError(f"read_kafka {self.s.name!r}: {tp[0]}/{tp[1]}: {err.str()}")
                    raise errors.KafkaConnectionError(
                        f"read_kafka {self.s.name!r} ({self.s.bootstrap_servers}): {err.str()}")
                continue
            if tp in done:
                continue
            p = pos[tp]
            off = m.offset()
            if bounded and p[1] is not None and off >= p[1]:
                self._finish(tp)
                continue
            p[0] = off + 1
            try:
                v = decode(m.value())
            except Exception as exc:  # noqa: BLE001 - any decoding failure is the record's
                if not self.s.dead_letter:
                    raise errors.KafkaDecodeError(
                        f"read_kafka {self.s.name!r}: the record at {tp[0]}/{tp[1]} offset {off} is not "
                        f"{self.s.value_format} ({type(exc).__name__}: {exc}); pass dead_letter=True to send "
                        "such records to read_kafka(...).dead_letters() instead") from None
                self.dead.append({"topic": tp[0], "partition": tp[1], "offset": off, "key": m.key(),
                                  "value": m.value(), "error": f"{type(exc).__name__}: {exc}"})
                continue
            if include:
                rec = {"value": v}
                for f in include:
                    if f == "key":
                        rec["key"] = m.key()
                    elif f == "headers":
                        rec["headers"] = m.headers()
                    elif f == "timestamp":
                        rec["timestamp"] = m.timestamp()[1] / 1000.0
                    elif f == "topic":
                        rec["topic"] = tp[0]
                    elif f == "partition":
                        rec["partition"] = tp[1]
                    elif f == "offset":
                        rec["offset"] = off
                v = rec
            out.append(v)
            if stamps is not None:
                t = m.timestamp()[1] / 1000.0 if self._kafka_ts else float(self._ts_fn(v))
                stamps.append(t)
                if t > self.max_ts.get(tp, -float("inf")):
                    self.max_ts[tp] = t
                self.last_seen[tp] = now
            if bounded and p[1] is not None and p[0] >= p[1]:
                self._finish(tp)
        self.stamps = stamps
        return out

    def _fast(self, msgs):
        """The records of a batch with no error, no partition reaching its end
        and nothing to add to the values (the common case), with a few C calls
        per record; None: the batch needs the full loop."""
        last = {}
        values = []
        add = values.append
        topics = self.s.topics
        if topics is not None and len(topics) == 1:
            # one topic: the partition alone says where a record is
            for m in msgs:
                if m.error() is not None:
                    return None
                last[m.partition()] = m.offset()
                add(m.value())
            t = topics[0]
            last = {(t, p): off for p, off in last.items()}
        else:
            for m in msgs:
                if m.error() is not None:
                    return None
                last[(m.topic(), m.partition())] = m.offset()
                add(m.value())
        pos, done = self.pos, self.done
        for tp, off in last.items():
            p = pos.get(tp)
            if p is None or tp in done or (p[1] is not None and off + 1 >= p[1]):
                return None
        fmt = self.s.value_format
        if fmt != "bytes" and fmt not in kafka_arrow.FORMATS:     # (ArrowBatches decodes the arrow ones)
            try:
                values = [v.decode("utf-8") for v in values] if fmt == "str" else list(map(json.loads, values))
            except Exception:  # noqa: BLE001 - the full loop names the record at fault
                return None
        for tp, off in last.items():
            pos[tp][0] = off + 1
        if self.s.idle_timeout is not None:
            now = time.monotonic()
            for tp in last:
                self.last_seen[tp] = now
        return values

    def _finish(self, tp):
        if tp in self.done:
            return
        self.done.add(tp)
        try:
            self.consumer.incremental_unassign([self.ck.TopicPartition(tp[0], tp[1])])
        except self.ck.KafkaException:
            pass

    def positions(self):
        return {tp: list(p) for tp, p in self.pos.items()}

    # ---- event time per partition ----
    def watermark(self):
        """The subtask's watermark: the lowest over its partitions that are not
        idle (highest timestamp - out_of_orderness); None while one that is
        not idle has no record yet; +inf once all are idle or ended."""
        idle_after = self.s.idle_timeout
        now = time.monotonic()
        low = None
        for tp in self.pos:
            if tp in self.done:
                continue
            if idle_after is not None and now - self.last_seen.get(tp, now) >= idle_after:
                continue            # idle: does not hold the others back
            ts = self.max_ts.get(tp)
            if ts is None:
                return None
            wm = ts - self.s.out_of_orderness
            low = wm if low is None else min(low, wm)
        return low

    def all_idle(self):
        idle_after = self.s.idle_timeout
        if idle_after is None:
            return False
        now = time.monotonic()
        live = [tp for tp in self.pos if tp not in self.done]
        return bool(live) and all(now - self.last_seen.get(tp, now) >= idle_after for tp in live)

    # ---- monitoring ----
    def records_lag(self) -> dict:
        """Per partition "topic/partition": log end offset - next offset (from
        the client's cached offsets, no request)."""
        out = {}
        if self.consumer is None:
            return out
        # (the metrics thread: the task's thread may add partitions meanwhile)
        for tp, (nxt, _) in list(self.pos.items()):
            try:
                _, high = self.consumer.get_watermark_offsets(self.ck.TopicPartition(*tp), cached=True)
            except (self.ck.KafkaException, RuntimeError, AttributeError):     # (closed meanwhile)
                continue
            high = max(high, self.high.get(tp, -1))      # (asked for while paused)
            if high >= 0:
                out[f"{tp[0]}/{tp[1]}"] = max(0, high - (nxt or 0))
        return out

    def commit_offsets(self, positions) -> None:
        """The group's offsets, for monitoring only (never read for correctness)."""
        ck = self.ck
        tps = [ck.TopicPartition(t, p, nxt) for (t, p), (nxt, _) in positions.items() if nxt is not None]
        if tps:
            try:
                self.consumer.commit(offsets=tps, asynchronous=True)
            except ck.KafkaException as exc:
                log.info("read_kafka %r: committing offsets for monitoring failed: %s", self.s.name, exc)

    def wakeup(self):
        pass        # consume() waits POLL_S at most

    def close(self):
        PAUSER.remove(self)
        with self._fetch_lock:
            consumer, self.consumer = self.consumer, None
        try:
            if consumer is not None:
                consumer.close()
        except Exception:
            pass
        if not self.__dict__.get("_admin_released"):       # (once per reader: it counts readers)
            self._admin_released = True
            self.s.close_admin()


def _decoder(fmt):
    if fmt == "bytes" or fmt in kafka_arrow.FORMATS:     # (arrow: kafka_arrow.ArrowBatches decodes)
        return lambda b: b
    if fmt == "str":
        return lambda b: b.decode("utf-8")
    if fmt == "json":
        return json.loads
    raise errors.ConfigurationError(f"value_format must be one of {READ_FORMATS}, got {fmt!r}")


class KafkaSourceOperator(Operator):
    """Chained right after the Kafka source, in its task: the per-partition
    watermarks of its reader (``timestamps=``), the group's offsets committed
    when a checkpoint completes, the dead-letter side stream. The records
    pass through."""

    passes_records = True
    event_time = False

    def __init__(self, name, link: dict, with_time: bool, dead_tag=None):
        super().__init__(name)
        self.link = link
        self.dead_tag = dead_tag
        self.with_time = with_time
        self.reader = None
        self.emitted = -float("inf")
        self.is_idle = False
        self.checkpointed: dict = {}

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        # its SourceTask, opened after it in the same task, finds it here
        self.link[subtask] = self
        if self.chain_output is not None:
            self._tick_later()

    def attach(self, source_task):
        self.source_task = source_task
        self.reader = source_task.reader

    def process_batch(self, batch):
        return self._dead(batch)

    def process_ts(self, batch, ts):
        r = self.reader
        if r is None:
            raise errors.FlowBufError(f"{self.name}: not in the task of its Kafka source")
        stamps = r.stamps
        if self.is_idle:
            self.is_idle = False
        return self._dead(batch), stamps

    def _dead(self, batch, ship=False):
        """Hand the reader's undecodable records to the dead-letter stream
        (in a batch the chain ships them after it; else ``ship``: now, so that
        a barrier or the end never overtakes them)."""
        r = self.reader
        if r is not None and r.dead:
            dead, r.dead = r.dead, []
            if self.side is not None:
                for d in dead:
                    self.side.output(self.dead_tag, d)
                if ship:
                    self.chain_output.emit([])
        return batch

    def finish(self):
        self._dead([])
        return []

    # ---- watermarks, every 200 ms in the task's thread ----
    def _tick_later(self):
        self.chain_output.schedule(time.time() + 0.2, self._tick)

    def _tick(self):
        r = self.reader
        self._dead([], ship=True)
        if r is not None and self.with_time:
            wm = r.watermark()
            if wm is not None and wm > self.emitted:
                self.emitted = wm
                self.is_idle = False
                self.chain_output.emit_watermark(wm)
            elif r.all_idle() and not self.is_idle:
                self.is_idle = True
                self.chain_output.emit_idle()
        self._tick_later()

    def on_watermark(self, watermark):
        return [], watermark if watermark == float("inf") else None

    # ---- offsets back to the group when a checkpoint completes ----
    def prepare_commit(self, checkpoint_id):
        # (called at every snapshot, before the source's position is taken and
        # its barrier sent)
        self._dead([], ship=True)
        if self.reader is not None:
            self.checkpointed = self.reader.positions()
        return []

    def notify_checkpoint_complete(self, checkpoint_id):
        if self.reader is not None and self.reader.consumer is not None and self.checkpointed:
            self.reader.commit_offsets(self.checkpointed)

    def metrics(self):
        if self.reader is None:
            return {}
        lag = self.reader.records_lag()
        out = {f"records_lag[{tp}]": n for tp, n in lag.items()}
        if lag:
            out["records_lag"] = sum(lag.values())
        # partitions not fetched now (the task has not pulled for pause_after
        # seconds), and how many times fetching was paused
        out["fetch_paused"] = len(self.reader.paused)
        out["fetch_pauses"] = self.reader.pauses
        return out


DEAD_LETTERS = "kafka-dead-letters"


class LinkedSourceTask(api.SourceTask):
    """The Kafka source's task side, handing its reader to the operator after it."""

    def __init__(self, source, name, link):
        super().__init__(source, name)
        self.link = link
        if source.value_format in kafka_arrow.FORMATS:
            # (the runtime's pull size counts rows then: KafkaReader.poll asks
            # the client for at most that many, as for the other formats)
            self.rows_of = kafka_arrow.rows_of

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        op = self.link.pop(subtask, None)
        if op is not None:
            op.attach(self)


# ---------------------------------------------------------------- writing

def _encoder(fmt):
    if fmt == "bytes":
        def enc(v):
            if isinstance(v, (bytes, bytearray, memoryview)):
                return bytes(v)
            raise errors.RecordTypeError(f"write_kafka: value_format='bytes' takes bytes, got {type(v).__name__} "
                                         "(pass value_format='str' or 'json')")
        return enc
    if fmt == "str":
        return lambda v: (v if isinstance(v, str) else str(v)).encode("utf-8")
    if fmt == "json":
        def enc_json(v):
            try:
                return json.dumps(v, separators=(",", ":")).encode("utf-8")
            except (TypeError, ValueError) as exc:
                raise errors.RecordTypeError(
                    f"write_kafka: value_format='json' cannot write the record {v!r:.200} ({exc}): map it to "
                    "JSON's types first (dict with str keys, list, str, int, float, bool, None)") from exc
        return enc_json
    raise errors.ConfigurationError(f"value_format must be one of {FORMATS}, got {fmt!r}")


def _key_bytes(k):
    if k is None or isinstance(k, bytes):
        return k
    if isinstance(k, str):
        return k.encode("utf-8")
    return str(k).encode("utf-8")


def sink_base(prefix: str, subtask: int) -> str:
    return f"{prefix}-{subtask}"


def default_prefix(job: str, uid: str, scope: str | None = None) -> str:
    """A sink's transactional id prefix when none is given: its job's name,
    the ``checkpoint_scope`` of its checkpoint directory, and the uid its
    state is stored under, unique in the job (and kept when the job is
    rescaled or operators are added before it with uids given)."""
    return f"pyflowbuf-{job}-{uid}" if scope is None else f"pyflowbuf-{job}-{scope}-{uid}"


def checkpoint_scope(directory) -> str | None:
    """Eight hex digits naming a checkpoint directory (its absolute path, or
    its URL): in the default transactional id prefix, so two jobs of the
    same name and sinks of the same uid (two copies of a script, or two
    scripts left with the default name "job") write under different ids
    when their checkpoints go to different places, and do not fence each
    other. Two runs in one directory at once are refused anyway
    (``CheckpointDirectoryInUseError``); a restart or restore from that
    directory keeps the ids."""
    if directory is None:
        return None
    d = os.fspath(directory)
    d = d.rstrip("/") if "://" in d else os.path.abspath(os.path.expanduser(d))
    return hashlib.sha1(d.encode("utf-8")).hexdigest()[:8]


class PrefixCheck:
    """``Node.job_check`` of a ``write_kafka`` node: once the job's ids are
    assigned, no two Kafka sinks of the job may share a transactional id
    prefix (their transactions would fence each other and each would read
    the other's commit marker)."""

    def __init__(self, prefix, job, name, scope=None, sink=None):
        self.prefix, self.job, self.name, self.scope, self.sink = prefix, job, name, scope, sink

    def bind(self, job_name, checkpoint_config) -> None:
        """When the job starts: the job's name and checkpoint directory as
        they are then (``execute("payments")`` renames the job and moves its
        default directory after ``write_kafka`` was called)."""
        cc = checkpoint_config
        self.job = job_name
        self.scope = checkpoint_scope(cc.directory) if cc is not None and cc.enabled else None
        if self.sink is not None:
            self.sink.job, self.sink.scope = self.job, self.scope

    def resolved(self, node) -> str:
        return self.prefix if self.prefix is not None else default_prefix(self.job, node.operator_uid,
                                                                          getattr(self, "scope", None))

    def __call__(self, node, nodes) -> None:
        mine = self.resolved(node)
        for other in nodes:
            check = other.job_check
            if other is not node and isinstance(check, PrefixCheck) and check.resolved(other) == mine:
                raise errors.ConfigurationError(
                    f"write_kafka {self.name!r} and write_kafka {check.name!r} both have the transactional id "
                    f"prefix {mine!r}: their transactions would fence each other; give each its own "
                    "transactional_id_prefix= (or leave both out: the default holds the sink's uid)")


def fence_list(base: str, restored) -> list:
    """The transactional ids to initialize when a sink subtask opens: those
    its restored writers recorded, and for each of their bases (and its own)
    the slots up to two past the highest recorded (a slot taken after the
    last snapshot)."""
    highest = {base: 1}
    for tid in restored:
        b, _, slot = tid.rpartition("-")
        if slot.isdigit():
            highest[b] = max(highest.get(b, 1), int(slot))
    return sorted({f"{b}-{i}" for b, top in highest.items() for i in range(top + 3)} | set(restored))


class Committer:
    """The exactly-once sink's committer: one daemon thread running handed-over
    commits in order. ``wait`` returns when all have run, or raises
    ``KafkaSinkError`` when the running one is past its ``deadline`` (set by
    the commit, step by step): a librdkafka call that never returns then holds
    neither the task nor, being a daemon thread, the process's exit. After
    ``cancel`` (the job is cancelled) ``wait`` waits at most CANCEL_WAIT_S more
    and then raises ``CancelledError``."""

    def __init__(self, name):
        self._items: list = []
        self._cv = threading.Condition()
        self._pending = 0
        self._stopped = False
        self.abandoned = False      # given up on: a step still running ends as soon as it can
        self.cancelled_at = None    # monotonic time of the job's cancel
        self.deadline = None        # monotonic time by which the running step must end
        self.bound = 0.0            # the running step's allowance in seconds (for the error)
        self.what = ""              # the running commit, and its step, for the error
        self.step = ""
        self.checkpoint_id = None
        self.tid = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args):
        with self._cv:
            self._pending += 1
            self._items.append((fn, args))
            self._cv.notify_all()

    def expect(self, step, seconds):
        if self.abandoned:
            # (the thread of a given-up commit: stop before the next call to the broker)
            raise errors.KafkaSinkError(f"{self.what}: given up before {step}", step=step)
        self.step, self.bound, self.deadline = step, seconds, time.monotonic() + seconds

    def on(self, what, checkpoint_id=None, tid=None):
        """The commit that runs now (named in a deadline's error)."""
        self.what, self.checkpoint_id, self.tid = what, checkpoint_id, tid

    def _run(self):
        while True:
            with self._cv:
                while not self._items and not self._stopped:
                    self._cv.wait()
                if not self._items:
                    return
                fn, args = self._items.pop(0)
            try:
                fn(*args)
            finally:
                with self._cv:
                    self._pending -= 1
                    self.deadline = None
                    self._cv.notify_all()

    def wait(self):
        """Until every handed-over commit has run; ``KafkaSinkError`` once the
        running one is past its deadline, ``CancelledError`` once the job was
        cancelled CANCEL_WAIT_S ago."""
        with self._cv:
            while self._pending:
                now = time.monotonic()
                d = self.deadline
                if d is not None and now > d:
                    raise errors.KafkaSinkError(
                        f"{self.what}: {self.step} did not end within {self.bound:g} s", step=self.step,
                        checkpoint_id=self.checkpoint_id, transactional_id=self.tid)
                c = self.cancelled_at
                if c is not None and now > c + CANCEL_WAIT_S:
                    raise errors.CancelledError(f"{self.what}: {self.step}: the job was cancelled")
                self._cv.wait(0.1)

    def cancel(self):
        """(Any thread) The job is cancelled: ``wait`` gives up soon."""
        with self._cv:
            if self.cancelled_at is None:
                self.cancelled_at = time.monotonic()
            self._cv.notify_all()

    def stop(self):
        """No more commits: the thread ends after those handed over."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def abandon(self):
        """Given up on (the running commit stalled): nothing more runs."""
        with self._cv:
            self._items.clear()
            self._stopped = True
            self.abandoned = True
            self._cv.notify_all()


def _error_name(exc):
    """librdkafka's error of a KafkaException (or None), and its name."""
    err = exc.args[0] if getattr(exc, "args", None) else None
    if err is None or not hasattr(err, "name"):
        return None, None
    return err, err.name()


# librdkafka's errors of a producer that a newer one with its transactional id fenced
FENCED_ERRORS = ("_FENCED", "PRODUCER_FENCED", "INVALID_PRODUCER_EPOCH")


def _from_client(exc) -> bool:
    """A SystemError of confluent-kafka's own making: it called a Python
    callback (a delivery report) while an exception of its own was pending,
    which CPython reports as "... returned a result with an exception set",
    chaining the pending one. Not a user function's error."""
    return isinstance(exc, SystemError) and "with an exception set" in str(exc)


def _client_exception(exc, kafka_exception):
    """``exc`` if it is librdkafka's error, else the one a SystemError of
    confluent-kafka's callbacks chained (None if it chained none)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, kafka_exception):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class KafkaSink(api.Sink):
    """``stream.write_kafka``'s sink; see the module docstring and docs/kafka.md.

    ``transactional_id_prefix`` names the transactions (and the marker
    group) of this sink: ``<prefix>-<subtask>-<slot>``; None: ``job`` and
    the uid of its operator (``default_prefix``), set by ``KafkaSinkOperator``.

    Exactly once, the task thread only writes: a checkpoint's transaction
    gets its marker and is committed by a thread of the subtask
    (``_committer``) while the task writes the next interval under another
    slot's transactional id; the next barrier waits for that commit. Every
    other call that waits for the broker (fencing on open, the re-send of a
    restored checkpoint, the driver's final commit, the at-least-once flush)
    has a deadline too, so a broker that is away fails the task (or the job)
    with ``KafkaSinkError`` instead of holding it."""

    def __init__(self, bootstrap_servers, topic, *, key=None, value_format="str", delivery="at_least_once",
                 transactional_id_prefix=None, properties=None, connect_timeout=CONNECT_TIMEOUT_S,
                 transaction_timeout=300.0, name="write_kafka", job="job", scope=None):
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.key = key
        self.value_format = value_format
        self.delivery = delivery
        self.prefix = transactional_id_prefix
        self.properties = dict(properties or {})
        self.connect_timeout = connect_timeout
        self.transaction_timeout = transaction_timeout
        self.name = name
        self.job = job
        self.scope = scope          # checkpoint_scope of the job's checkpoint directory (default prefix)
        self.producer = None        # at least once: the subtask's producer, from open()
        self._committer = None      # exactly once: the thread committing checkpoints' transactions
        self._commit_error = None   # its failure, raised in the task
        self._cancelled = False     # the job was cancelled (``_cancel``, from another thread)

    # ---- errors ----
    def _where(self, tid=None) -> str:
        return f"write_kafka {self.name!r} (topic {self.topic!r}" + (f", transactional id {tid!r})" if tid else ")")

    def _client_error(self, exc, step, tid=None, checkpoint_id=None, hint=""):
        """``KafkaSinkError`` (``KafkaFencedError`` for a fenced producer) for
        librdkafka's ``exc`` in ``step``; raise it ``from exc``. ``exc`` may
        be the SystemError that confluent-kafka raises from a callback (see
        ``_from_client``), and librdkafka's ``_FATAL`` ("Unable to produce
        message: Fatal error") says only that the producer failed before:
        both are named by the error that made the producer fail
        (``_fatal_error``: a fencing, typically)."""
        inner = _client_exception(exc, self.ck.KafkaException)
        err, name = _error_name(inner) if inner is not None else (None, None)
        self._note_fatal(exc, tid)
        if name in (None, "_FATAL"):
            cause = self._fatal_error(tid)
            if cause is not None:
                err, name = cause, cause.name()
        text = err.str() if err is not None else f"{type(exc).__name__}: {exc}"
        if name not in FENCED_ERRORS and not (err is not None and err.retriable()):
            cause = self._fenced_since(tid)
            if cause is not None:
                text = f"{cause.str()} (the step itself failed with {name}: {text})"
                err, name = cause, cause.name()
        fatal = err.fatal() if err is not None else None
        retriable = err.retriable() if err is not None else None
        cls = errors.KafkaSinkError
        if name in FENCED_ERRORS:
            cls = errors.KafkaFencedError
            hint = ("a newer producer initialized this transactional id: is another job (or a second run of this "
                    f"one) writing with the same transactional_id_prefix ({self.prefix!r}) now? Each job (and each "
                    "sink) needs its own: give it transactional_id_prefix=" + (f"; else {hint}" if hint else ""))
        elif not hint:
            hint = ("the job restores its latest checkpoint and writes it again" if not fatal else
                    "the producer cannot go on (fatal): the job restores its latest checkpoint with new producers")
        of = "" if checkpoint_id is None else f" of checkpoint {checkpoint_id}"
        return cls(f"{self._where(tid)}: {step}{of} failed: {name or type(exc).__name__}: {text} "
                   f"(retriable: {'yes' if retriable else 'no'}, fatal: {'yes' if fatal else 'no'}): {hint}",
                   topic=self.topic, transactional_id=tid, step=step, checkpoint_id=checkpoint_id,
                   error_name=name, retriable=retriable, fatal=fatal)

    def _in_context(self, exc, c, step):
        """A ``KafkaSinkError`` of a commit's step (a delivery refused, a
        flush without progress) with the commit it belongs to."""
        if exc.checkpoint_id is not None:
            return exc
        return type(exc)(f"{c.what}: {step}: {exc}", topic=self.topic, transactional_id=c.tid, step=step,
                         checkpoint_id=c.checkpoint_id, error_name=exc.error_name, retriable=exc.retriable,
                         fatal=exc.fatal)

    # ---- the subtask ----
    def open(self, subtask, parallelism):
        self.ck = _ck()
        self.subtask = subtask
        self._enc = _encoder(self.value_format)
        self._errors = []
        self._produced = 0
        if self.delivery == "at_least_once":
            conf = self._conf()
            conf.update({"enable.idempotence": True, "acks": "all"})
            self.producer = self.ck.Producer(conf)
            self._check_topic(self.producer)
            return
        if self.prefix is None:         # run by hand, not placed in a job (KafkaSinkOperator sets it)
            self.prefix = default_prefix(self.job, self.name, getattr(self, "scope", None))
        self.base = sink_base(self.prefix, subtask)
        # the commit markers of this writer go to a group of its own, named in its
        # committables (so in its checkpoints): a job (or a fresh run of this one)
        # sharing the prefix marks its commits elsewhere, and a restore never
        # takes another writer's marker for this one's (docs/kafka.md)
        self.group = f"{self.base}-marker-{os.urandom(6).hex()}"
        self.producers: dict = {}           # transactional id -> Producer (initialized)
        self._fatal: dict = {}              # transactional id -> the fatal error its producer raised
        self.prepared: dict = {}            # checkpoint id -> transactional id, awaiting commit
        self._lock = threading.Lock()       # ``prepared``: the committer thread removes what it committed
        # the open transaction's encoded values and keys (keys: None while every key is None)
        self.values: list = []
        self.keys = None
        self.current = None
        self.last_id = getattr(self, "last_id", 0)
        self._committer = Committer(f"kafka-commit-{self.base}")
        if self._cancelled:
            self._committer.cancel()
        # fence every transactional id that the restored writers, or an earlier
        # run of this subtask, may have left a transaction open under: the
        # broker completes one that was committing and aborts the others
        self._bounded(self._fence, fence_list(self.base, getattr(self, "_fence_ids", ())),
                      what=f"{self._where()}: opening subtask {subtask}")
        self._check_topic(self._producer(f"{self.base}-0"))

    def _cancel(self):
        """(Another thread) The job is cancelled: what the task waits for in
        this sink gives up within CANCEL_WAIT_S (a commit that ends sooner
        still ends)."""
        self._cancelled = True
        c = self._committer
        if c is not None:
            c.cancel()

    def _conf(self):
        conf = _client_conf(self.bootstrap_servers, self.properties)
        conf.setdefault("partitioner", "murmur2_random")     # the Java client's: the same key, the same partition
        conf.setdefault("linger.ms", 5)
        # only failed deliveries come back as reports: a report per record cost
        # the sink's thread a Python call and a message object each (a fifth of
        # its time at tens of thousands of records a second), and nothing here
        # needs the good ones (flush and commit_transaction wait for every record)
        conf.setdefault("delivery.report.only.error", True)
        conf["on_delivery"] = self._on_delivery
        return conf

    def _check_topic(self, producer):
        md = _metadata(producer, self.bootstrap_servers, self.connect_timeout)
        tm = md.topics.get(self.topic)
        if tm is None or tm.error is not None:
            raise errors.KafkaTopicError(
                f"write_kafka {self.name!r}: topic {self.topic!r} does not exist at {self.bootstrap_servers}: "
                "create it first (its partitions and replication are yours to choose)")
        self.partitions = len(tm.partitions)

    def _producer(self, tid, checkpoint_id=None):
        p = self.producers.get(tid)
        if p is None:
            conf = self._conf()
            conf.update({"transactional.id": tid, "transaction.timeout.ms": int(self.transaction_timeout * 1000),
                         "acks": "all", "enable.idempotence": True})
            p = self.ck.Producer(conf)
            try:
                # fences every earlier producer of this id and aborts its open transaction
                p.init_transactions(self.connect_timeout)
            except self.ck.KafkaException as exc:
                err, name = _error_name(exc)
                if name in ("_TIMED_OUT", "_TRANSPORT", "_ALL_BROKERS_DOWN", "COORDINATOR_NOT_AVAILABLE"):
                    raise errors.KafkaConnectionError(
                        f"write_kafka {self.name!r}: init_transactions of {tid!r} at "
                        f"bootstrap_servers={self.bootstrap_servers!r} failed within {self.connect_timeout:g} s: "
                        f"{err.str()}") from exc
                raise self._client_error(exc, "init_transactions", tid, checkpoint_id) from exc
            self.producers[tid] = p
        return p

    def _note_fatal(self, exc, tid):
        """Keep the fatal error (a fencing) that ``exc`` carries for ``tid``."""
        inner = _client_exception(exc, self.ck.KafkaException)
        err, name = _error_name(inner) if inner is not None else (None, None)
        if err is not None and err.fatal() and name != "_FATAL":
            self.__dict__.setdefault("_fatal", {}).setdefault(tid, err)

    def _fatal_error(self, tid):
        """The error that made ``tid``'s producer fail (of any of this sink's,
        without ``tid``), or None. confluent-kafka raises it once, from the
        poll that serves it; every call after that reports only ``_FATAL``,
        so it is kept when seen, and served here when it was not yet."""
        fatal = self.__dict__.setdefault("_fatal", {})
        p = getattr(self, "producers", {}).get(tid)
        if p is not None and tid not in fatal:
            try:
                p.poll(0)
            except Exception as exc:    # noqa: BLE001 - the producer failed already: this is its error
                self._note_fatal(exc, tid)
        if tid is not None:
            return fatal.get(tid)
        return next(iter(fatal.values()), None)

    def _fenced_since(self, tid):
        """The fencing of ``tid``'s producer, for a failure that does not say
        (None if it was not fenced): a commit cut short by another producer's
        init_transactions can fail with "Unknown broker error". Aborting the
        failed transaction (as is due after it anyway) then fails with the
        fencing. Only on a failure's path; the restore fences and aborts it in
        any case."""
        p = getattr(self, "producers", {}).get(tid)
        if p is None:
            return None
        try:
            p.abort_transaction(min(self.connect_timeout, 2.0))
        except Exception as exc:    # noqa: BLE001 - what it says is the answer
            self._note_fatal(exc, tid)
            inner = _client_exception(exc, self.ck.KafkaException)
            if inner is not None and _error_name(inner)[1] in FENCED_ERRORS:
                return _error_name(inner)[0]
        cause = self.__dict__.get("_fatal", {}).get(tid)
        return cause if cause is not None and cause.name() in FENCED_ERRORS else None

    def _fence(self, tids, c=None, checkpoints=None):
        """``_producer`` of each, at once (daemon threads: a call that never
        returns holds no exit): an init_transactions waits for the broker (a
        round trip or more each), and they are independent. ``checkpoints``:
        the checkpoint of a transactional id, for an error."""
        tids = [t for t in tids if t not in self.producers]
        of = (checkpoints or {}).get
        if c is not None:
            c.expect(f"fencing {len(tids)} transactional id(s) (init_transactions)",
                     self.connect_timeout + COMMIT_GRACE_S)
        if len(tids) < 2:
            for t in tids:
                self._producer(t, of(t))
            return
        failed = []

        def init(t):
            try:
                self._producer(t, of(t))
            except BaseException as exc:    # noqa: BLE001 - raised below, in the caller's thread
                failed.append(exc)

        threads = [threading.Thread(target=init, args=(t,), name=f"kafka-init-{t}", daemon=True) for t in tids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if failed:
            raise failed[0]

    def _bounded(self, fn, *args, what):
        """Run ``fn(*args, committer)`` on the committer thread and wait for it:
        each of its steps (``committer.expect``) within its deadline, else
        ``KafkaSinkError`` (the thread is left behind, a daemon). The driver,
        which has no committer, gets one for the call."""
        c = self._committer
        if c is None:
            c = self._committer = Committer(f"kafka-commit-{self.prefix}-driver")
            if self._cancelled:
                c.cancel()
        box = []

        def run():
            c.on(what)
            try:
                fn(*args, c)
            except BaseException as exc:    # noqa: BLE001 - raised in the waiting thread
                box.append(exc)

        c.submit(run)
        self._wait_committer()
        if box:
            raise box[0]

    def _free_slot(self):
        with self._lock:
            busy = set(self.prepared.values())
        i = 0
        while f"{self.base}-{i}" in busy:
            i += 1
        return f"{self.base}-{i}"

    def _on_delivery(self, err, msg):
        if err is not None:
            self._errors.append(err)

    def _raise_delivery_errors(self, tid=None):
        if self._errors:
            err = self._errors[0]
            self._errors = []
            if self.delivery == "exactly_once" and (err.fatal() or err.name() in FENCED_ERRORS + ("_FATAL",)):
                raise self._client_error(self.ck.KafkaException(err), "produce", tid)
            raise errors.KafkaSinkError(f"write_kafka {self.name!r}: a record was not delivered to "
                                        f"{self.topic!r}: {err.str()}", topic=self.topic, step="produce",
                                        error_name=err.name(), retriable=err.retriable(), fatal=err.fatal())

    def write(self, batch):
        enc, key = self._enc, self.key
        if self.delivery == "at_least_once":
            p, topic = self.producer, self.topic
            for r in batch:
                self._produce(p, topic, enc(r), None if key is None else _key_bytes(key(r)))
            p.poll(0)
            self._raise_delivery_errors()
            return
        if self._commit_error is not None:
            self._raise_commit_error()
        try:
            if self.current is None:
                self.current = self._free_slot()
                self._producer(self.current).begin_transaction()
            p, topic = self.producers[self.current], self.topic
            values = self.values
            if key is None:
                for r in batch:
                    v = enc(r)
                    values.append(v)
                    self._produce(p, topic, v, None)
            else:
                keys = self.keys
                if keys is None:
                    keys = self.keys = [None] * len(values)
                for r in batch:
                    v = enc(r)
                    k = _key_bytes(key(r))
                    values.append(v)
                    keys.append(k)
                    self._produce(p, topic, v, k)
            p.poll(0)
        except (self.ck.KafkaException, SystemError) as exc:
            # (begin_transaction, or produce refused by the producer's state: fenced, fatal)
            if isinstance(exc, SystemError) and not _from_client(exc):
                raise
            raise self._client_error(exc, "writing a transaction", self.current,
                                     checkpoint_id=self.last_id + 1) from exc
        self._raise_delivery_errors(self.current)

    def _produce(self, p, topic, v, k, c=None):
        try:
            p.produce(topic, v, k)
        except BufferError:
            self._produce_when_room(p, topic, v, k, c)

    def _produce_when_room(self, p, topic, v, k, c):
        """The client's queue is full: wait for deliveries to make room, for at
        most ``connect_timeout`` without any (a broker that is away)."""
        since = time.monotonic()
        while True:
            p.poll(0.05)
            try:
                p.produce(topic, v, k)
            except BufferError:
                pass
            else:
                if c is not None:
                    c.expect(c.step, self.connect_timeout + COMMIT_GRACE_S)     # progress: a new allowance
                return
            if self._cancelled:
                raise errors.CancelledError(f"{self._where()}: cancelled while its queue was full")
            if c is not None and c.abandoned:
                raise errors.KafkaSinkError(f"{self._where()}: given up while its queue was full")
            if time.monotonic() - since > self.connect_timeout:
                raise errors.KafkaSinkError(
                    f"{self._where()}: the client's queue stayed full for {self.connect_timeout:g} s "
                    f"(connect_timeout) with no delivery: is the broker at {self.bootstrap_servers!r} reachable?",
                    topic=self.topic, step="produce")

    def prepare_commit(self, checkpoint_id):
        if self.delivery == "at_least_once":
            self._flush_at_least_once(checkpoint_id)
            return []
        # an earlier checkpoint's commit is resolved before this barrier passes: a
        # failed one then fails the task before a later checkpoint (whose snapshot no
        # longer holds the earlier committable) can complete
        self._drain()
        if checkpoint_id == api.END_OF_INPUT:
            # the marker grows with every commit: the end comes after the last checkpoint
            checkpoint_id = self.last_id + 1
        else:
            self.last_id = max(self.last_id, checkpoint_id)
        if self.current is None:
            return []           # nothing written in this epoch
        tid = self.current
        with self._lock:
            self.prepared[checkpoint_id] = tid
        self.current = None
        values, keys = self.values, self.keys
        self.values, self.keys = [], None
        # no round trip here: the flush, the marker and the commit come when the
        # checkpoint completes; until then the records are in the checkpoint
        return [{"tid": tid, "group": self.group, "topic": self.topic, "id": checkpoint_id,
                 "values": values, "keys": keys}]

    def _flush_at_least_once(self, checkpoint_id):
        """At least once, at a barrier: every delivery confirmed. It may take as
        long as deliveries go on, but fails after ``connect_timeout`` with none
        (a broker that is away; its own flush would wait for the records'
        delivery timeout, 300 s), and ends at once on a cancel."""
        stall = self.connect_timeout
        which = "the end of input" if checkpoint_id == api.END_OF_INPUT else f"checkpoint {checkpoint_id}"

        def stopped():
            if self._cancelled:
                raise errors.CancelledError(f"{self._where()}: cancelled while flushing for {which}")

        left = self._flush_while_delivering(self.producer, 0.2, stopped)
        if left:
            raise errors.KafkaSinkError(
                f"{self._where()}: its flush at the barrier of {which} (at least once) did not end: "
                f"{left} records not delivered, none for {stall:g} s (connect_timeout): is the broker at "
                f"{self.bootstrap_servers!r} reachable? The job restores its latest checkpoint and writes "
                "them again", topic=self.topic, step="flush",
                checkpoint_id=None if checkpoint_id == api.END_OF_INPUT else checkpoint_id)

    def _flush_while_delivering(self, p, poll_s, stopped, progressed=None):
        """Flush ``p`` for as long as deliveries go on: 0 once every record is
        delivered, or the count left when none was for ``connect_timeout`` (a
        broker that is away). ``stopped()`` may raise (a cancel, a commit given
        up); ``progressed()`` runs whenever a delivery happened."""
        stall = self.connect_timeout
        last = since = None
        while True:
            left = p.flush(min(poll_s, stall))
            self._raise_delivery_errors()
            if not left:
                return 0
            stopped()
            if last is None or left < last:
                last, since = left, time.monotonic()
                if progressed is not None:
                    progressed()
            elif time.monotonic() - since > stall:
                return left

    def _mark(self, p, checkpoint_id, group=None, topic=None):
        """The commit marker, in the same transaction: the marker group's offset
        of the topic's partition 0 becomes the checkpoint id (+ MARKER_BIAS)."""
        topic = topic or self.topic
        p.send_offsets_to_transaction([self.ck.TopicPartition(topic, 0, checkpoint_id + MARKER_BIAS)],
                                      self._group_metadata(group or self.group), self.connect_timeout)

    def _group_metadata(self, group):
        metas = self.__dict__.setdefault("_metas", {})
        if group not in metas:
            cons = self.ck.Consumer(_client_conf(self.bootstrap_servers, {**self.properties, "group.id": group}))
            metas[group] = cons.consumer_group_metadata()
            cons.close()
        return metas[group]

    def _flush_bounded(self, p, c):
        """The committer's flush: it may take as long as deliveries go on, but
        fails after ``connect_timeout`` with none (a broker that is away)."""
        stall = self.connect_timeout

        def stopped():
            if c.abandoned:
                raise errors.KafkaSinkError(f"{self._where()}: given up during its flush")

        c.expect("its flush", stall + COMMIT_GRACE_S)
        left = self._flush_while_delivering(p, 1.0, stopped,
                                            lambda: c.expect("its flush", stall + COMMIT_GRACE_S))
        if left:
            raise errors.KafkaSinkError(f"write_kafka {self.name!r}: {left} records not delivered to "
                                        f"{self.topic!r}, none for {stall:g} s (connect_timeout)",
                                        topic=self.topic, step="flush")

    def commit(self, committables):
        if self.delivery == "at_least_once":
            return
        if not hasattr(self, "producers"):
            # the driver, committing a finished subtask's last transaction
            self.ck, self.producers, self.prepared, self._errors = _ck(), {}, {}, []
            self._lock = threading.Lock()
            self._committer = None
        live, restored = [], []
        for c in sorted(committables, key=lambda c: c["id"]):
            tid = self.prepared.get(c["id"])
            (live if tid == c["tid"] and tid in self.producers else restored).append(c)
        if restored:
            ids = ", ".join(str(c["id"]) for c in restored)
            self._bounded(self._recommit_all, restored,
                          what=f"{self._where()}: committing checkpoint(s) {ids} again (restored)")
        for c in live:
            if self._committer is None:
                self._committer = Committer(f"kafka-commit-{self.base}")
            self._committer.submit(self._commit_in_thread, c, self._committer)     # off the task thread, in order

    def _commit_live(self, c, committer):
        """Flush, mark and commit the open transaction of committable ``c``
        (the committer thread)."""
        if self._commit_error is not None:
            return          # an earlier commit failed: the task fails, the restore re-sends
        p = self.producers[c["tid"]]
        step = "flush"
        try:
            self._flush_bounded(p, committer)
            step = "send_offsets_to_transaction"
            committer.expect("its commit marker (send_offsets_to_transaction)", self.connect_timeout + COMMIT_GRACE_S)
            self._mark(p, c["id"])
            # the records are delivered: what is left is one round trip to the
            # coordinator; a restore re-does the commit if it does not answer
            step = "commit_transaction"
            committer.expect("its commit_transaction", self.connect_timeout + COMMIT_GRACE_S)
            p.commit_transaction(self.connect_timeout)
        except (self.ck.KafkaException, SystemError) as exc:
            if isinstance(exc, SystemError) and not _from_client(exc):
                raise
            raise self._client_error(exc, step, c["tid"], c["id"],
                                     hint="the job restores this checkpoint and commits it again") from exc
        except errors.KafkaSinkError as exc:
            raise self._in_context(exc, committer, step) from exc
        with self._lock:
            del self.prepared[c["id"]]

    def _commit_in_thread(self, c, committer):
        committer.on(f"{self._where(c['tid'])}: committing the transaction of checkpoint {c['id']}", c["id"], c["tid"])
        try:
            self._commit_live(c, committer)
        except BaseException as exc:        # noqa: BLE001 - whatever it is, the task must fail with it
            self._commit_error = exc        # raised by the task at its next write or barrier

    def _raise_commit_error(self):
        err, self._commit_error = self._commit_error, None
        raise err

    def _drain(self):
        """Wait for the commits handed to the committer thread; raise the
        first that failed."""
        if self._committer is not None:
            self._wait_committer()
        if self._commit_error is not None:
            self._raise_commit_error()

    def _wait_committer(self):
        try:
            self._committer.wait()
            return
        except errors.KafkaSinkError as exc:
            stalled = exc
        except errors.CancelledError:
            # the stuck thread is left behind (a daemon); a restore of the
            # checkpoint re-does its commit
            self._committer.abandon()
            self._committer = None
            raise
        self._committer.abandon()
        self._committer = None
        driver = not hasattr(self, "base")
        raise errors.KafkaSinkError(
            f"{stalled.args[0]} (connect_timeout={self.connect_timeout:g} s + {COMMIT_GRACE_S:g} s): is the broker "
            f"at {self.bootstrap_servers!r} reachable? "
            + ("The job fails; its final commit is done again by a restore of its latest checkpoint" if driver else
               "The job restores its latest checkpoint, whose commit is then done again"),
            topic=self.topic, step=stalled.step, checkpoint_id=stalled.checkpoint_id,
            transactional_id=stalled.transactional_id) from None

    def _committed_marker(self, group, topic) -> int:
        ck = self.ck
        cons = ck.Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": group,
                            "enable.auto.commit": False, "isolation.level": "read_committed",
                            "logger": CLIENT_LOG, **self.properties})
        try:
            got = cons.committed([ck.TopicPartition(topic, 0)], timeout=self.connect_timeout)[0]
        finally:
            cons.close()
        return got.offset

    def _recommit_all(self, committables, c):
        """(The committer thread) The committables of a restored checkpoint, or
        the driver's final ones: every transaction they name that this
        process does not hold is fenced before any marker is read (a prepared
        transaction's marker leaves its group's offset unstable until it is
        resolved), then each is committed again if its marker says it was
        not."""
        self._fence({x["tid"] for x in committables}, c, {x["tid"]: x["id"] for x in committables})
        for x in committables:
            c.on(f"{self._where(x['tid'])}: committing the transaction of checkpoint {x['id']} again (restored)",
                 x["id"], x["tid"])
            self._recommit(x, c)

    def _recommit(self, x, c):
        """A committable whose transaction this process did not keep open
        (a restore): if its marker is not committed, send its records again
        under a new transaction with the marker. Each step within its
        deadline (``c.expect``)."""
        tid, grace = x["tid"], self.connect_timeout + COMMIT_GRACE_S
        step = "init_transactions"
        try:
            # fences (and completes or aborts) what an earlier producer of tid left
            # open, so that the marker read next is final
            c.expect("fencing it (init_transactions)", grace)
            p = self._producer(tid)
            step = "reading its commit marker"
            c.expect("reading its commit marker (committed offsets)", grace)
            if self._committed_marker(x["group"], x["topic"]) >= x["id"] + MARKER_BIAS:
                return      # the transaction committed before the failure
            step = "begin_transaction"
            p.begin_transaction()
            if "records" in x:      # a checkpoint of a release that kept [key, value] pairs
                pairs = x["records"]
            else:
                pairs = zip(x["keys"] or [None] * len(x["values"]), x["values"])
            step = "sending its records again"
            c.expect("sending its records again (produce)", grace)
            for k, v in pairs:
                self._produce(p, x["topic"], v, k, c)
            step = "send_offsets_to_transaction"
            c.expect("its commit marker (send_offsets_to_transaction)", grace)
            self._mark(p, x["id"], x["group"], x["topic"])
            step = "flush"
            self._flush_bounded(p, c)
            step = "commit_transaction"
            c.expect("its commit_transaction", grace)
            p.commit_transaction(self.connect_timeout)
        except (self.ck.KafkaException, SystemError) as exc:
            if isinstance(exc, SystemError) and not _from_client(exc):
                raise
            raise self._client_error(exc, step, tid, x["id"],
                                     hint="the job fails or restores its latest checkpoint, whose commit "
                                          "is then done again") from exc
        except errors.KafkaSinkError as exc:
            raise self._in_context(exc, c, step) from exc

    def abort(self):
        if self.delivery == "at_least_once":
            return
        self._aborted = True
        self._stop_committer()
        if self.current is not None:
            try:
                self.producers[self.current].abort_transaction(self.connect_timeout)
            except Exception:
                pass        # a successor's init_transactions aborts it in any case

    def snapshot_state(self):
        if self.delivery == "at_least_once":
            return None
        # every transactional id this writer may have left open, for a
        # restore (maybe at another parallelism) to fence
        return {"tids": sorted(self.producers), "last_id": self.last_id}

    def restore_state(self, states):
        self._fence_ids = [t for s in states for t in s.get("tids", ())]
        self.last_id = max([s.get("last_id", 0) for s in states] + [0])

    def close(self):
        if not hasattr(self, "ck"):
            return
        if self.delivery == "at_least_once":
            if self.producer is not None:
                self.producer.flush(0)
            return
        self._stop_committer()
        # transactions left open are aborted by the successor's init_transactions
        self.producers = {}
        if self._commit_error is not None and not getattr(self, "_aborted", False):
            # a commit handed over at the very end (the subtask's own final commit)
            self._raise_commit_error()

    def _stop_committer(self):
        if self._committer is not None:
            # the commits handed over are of completed checkpoints: they run, so a
            # job cancelled right after a checkpoint completed still shows that
            # checkpoint's records; one that stalls (the broker away) is given up
            # within connect_timeout + COMMIT_GRACE_S (CANCEL_WAIT_S after a
            # cancel) and re-done by a restore
            committer = self._committer
            committer.stop()
            try:
                self._wait_committer()
            except (errors.KafkaSinkError, errors.CancelledError) as exc:
                if self._commit_error is None:
                    self._commit_error = exc
            self._committer = None


class KafkaSinkOperator(api.ConnectorSinkOperator):
    """``write_kafka``'s operator: a connector sink whose default
    transactional id prefix takes the uid the job gave its state."""

    def place(self, node_id, uid, out_kind, timestamped) -> None:
        super().place(node_id, uid, out_kind, timestamped)
        if self.sink.prefix is None and uid is not None:
            self.sink.prefix = default_prefix(self.sink.job, uid, getattr(self.sink, "scope", None))
