"""The connector declarations: ``Environment.from_source`` and
``read_kafka``, ``Stream.sink_to`` and ``write_kafka`` (the connector API of
``pyflowbuf/connectors/api.py`` and its Kafka connector)."""
from __future__ import annotations

import datetime
import math
import numbers
import re
from typing import Any, Callable

from pyflowbuf._validation import _check_kind, _parallelism
from pyflowbuf.api.side_outputs import OutputTag
from pyflowbuf.api.sinks import DataSink
from pyflowbuf.connectors import api as capi
from pyflowbuf.connectors import kafka as kc
from pyflowbuf.errors import ConfigurationError

# the side output of read_kafka(dead_letter=True): a dict per undecodable record
KAFKA_DEAD_LETTERS = OutputTag(kc.DEAD_LETTERS)


def _seconds(what, name, v, optional=False):
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
        raise ConfigurationError(f"{what}: {name} must be a number of seconds >= 0, got {v!r}")
    return float(v)


def _servers(what, bootstrap_servers):
    if not isinstance(bootstrap_servers, str) or not bootstrap_servers.strip():
        raise ConfigurationError(f"{what}: bootstrap_servers must be 'host:port[,host:port...]', "
                                 f"got {bootstrap_servers!r}")


def _properties(what, properties):
    if properties is not None and (not isinstance(properties, dict)
                                   or not all(isinstance(k, str) for k in properties)):
        raise ConfigurationError(f"{what}: properties must be a dict of librdkafka settings (str keys), "
                                 f"got {properties!r}")


class ConnectorSourceDeclarations:
    """The ``Environment``'s methods that declare connector sources."""

    def from_source(self, source: "capi.Source", *, name: str = "source", parallelism: int | None = None,
                    kind: Any = None, timestamps: Callable | None = None, watermarks: float | None = None,
                    idle_timeout: float | None = None, rate_limit=None):
        """Records of a connector source (a ``fb.Source`` subclass: see
        docs/connectors.md, "Writing a connector").

        Its splits are dealt out over ``parallelism`` subtasks by
        ``source.owner``; every checkpoint records each split's position,
        and a restore, at this parallelism or another, reads on from there.
        ``timestamps=fn`` gives the records event time, with watermarks
        ``watermarks`` seconds (the out-of-orderness, default 0) behind the
        highest timestamp, and ``idle_timeout`` as for ``assign_timestamps``.
        Returns a ``Stream``. A ``source`` that is not a ``fb.Source`` is a
        ``TypeError``.

        Example::

            class Letters(fb.Source):
                def splits(self):
                    return ["abc", "de"]

                def read(self, split, position, max_records):
                    return list(split), len(split), True       # records, position, finished

            letters = env.from_source(Letters(), name="letters", parallelism=2)
        """
        if not isinstance(source, capi.Source):
            raise TypeError(f"from_source takes a pyflowbuf.Source (a subclass of fb.Source), got {source!r}")
        kind = _check_kind(kind if kind is not None else source.kind, f"from_source {name!r}")
        stream = self._source(name, lambda: capi.SourceTask(source, name), kind, rate_limit,
                              _parallelism(self.parallelism, parallelism))
        if timestamps is not None:
            stream = stream.assign_timestamps(timestamps, watermarks or 0.0, idle_timeout,
                                              name=f"{name}.timestamps")
        elif watermarks is not None or idle_timeout is not None:
            raise ConfigurationError(f"from_source {name!r}: watermarks= and idle_timeout= need timestamps=")
        return stream

    def read_kafka(self, topics=None, *, bootstrap_servers: str, pattern: str | None = None,
                   value_format: str = "bytes", include=(), group_id: str | None = None,
                   starting_offsets="earliest", bounded: bool = False, timestamps=None,
                   out_of_orderness: float = 0.0, idle_timeout: float | None = None,
                   parallelism: int | None = None, properties: dict | None = None,
                   wait_for_topics: bool = False, connect_timeout: float = kc.CONNECT_TIMEOUT_S,
                   discovery_interval: float = 10.0, dead_letter: bool = False,
                   max_prefetch_kbytes: int = 16384, pause_after: float | None = kc.PAUSE_AFTER_S,
                   name: str = "read_kafka", kind: Any = None, rate_limit=None, schema=None,
                   batch_size: int = kc.kafka_arrow.DEFAULT_BATCH_SIZE):
        """Records of Kafka topics (confluent-kafka): ``topics`` (a name or a
        list) or ``pattern`` (a regular expression over topic names).

        * ``value_format``: ``"bytes"``, ``"str"`` (UTF-8) or ``"json"``;
          ``include``: any of ``"key"``, ``"headers"``, ``"timestamp"``
          (seconds), ``"topic"``, ``"partition"``, ``"offset"``: each record
          is then a dict with ``"value"`` and those.
        * ``value_format="arrow"``: for the vectorized operators, a
          ``pyarrow.RecordBatch`` per pull of up to ``batch_size`` records,
          with a binary column ``value`` and a column per ``include`` field;
          ``"arrow-json"``: the JSON values parsed into the columns of
          ``schema=`` (a ``pyarrow.Schema`` or a dict of name to type).
          ``timestamps`` is then ``"kafka"`` (docs/kafka.md, "Arrow batches").
        * ``starting_offsets``: ``"earliest"``, ``"latest"``, ``"committed"``
          (the group's), a timestamp in seconds (or an aware ``datetime``),
          or a dict ``{(topic, partition): offset}`` / ``{topic: {partition:
          offset}}``; a timestamp in milliseconds is refused.
        * ``bounded=True``: read up to the end offsets seen at the start, then
          end (the end-of-partition signal decides, not the reported offset).
        * ``timestamps``: ``"kafka"`` (the records' own) or a function of the
          record; watermarks per partition (highest timestamp -
          ``out_of_orderness``), the lowest over the subtask's partitions,
          a partition without records for ``idle_timeout`` seconds left out.
        * ``properties``: more librdkafka settings (security.protocol, sasl.*,
          ssl.* pass through unchanged); reading uses read_committed.
        * ``dead_letter=True``: an undecodable record goes to
          ``stream.dead_letters()`` (a dict with topic, partition, offset,
          key, value bytes, error) instead of failing the job with
          ``KafkaDecodeError``.
        * ``rate_limit``: records per second (or a ``RateLimiter``), as for
          the other sources.
        * Backpressure: the client prefetches at most ``max_prefetch_kbytes``
          (plus one fetch response); a subtask that has not pulled for
          ``pause_after`` seconds (None: never) has its partitions paused,
          its prefetched records dropped, until it pulls again.

        Partitions are assigned to the subtasks (never subscribed); their
        offsets are in every checkpoint, and committed to ``group_id`` when a
        checkpoint completes, for monitoring only. New partitions are found
        every ``discovery_interval`` seconds. An unreachable broker is
        ``KafkaConnectionError`` after ``connect_timeout`` seconds, a missing
        topic ``KafkaTopicError`` unless ``wait_for_topics=True``. See
        docs/kafka.md.

        Example::

            clicks = env.read_kafka("clicks", bootstrap_servers="127.0.0.1:9092", value_format="json",
                                    timestamps="kafka", out_of_orderness=5.0, idle_timeout=30)
        """
        what = f"read_kafka {name!r}"
        _servers(what, bootstrap_servers)
        if (topics is None) == (pattern is None):
            raise ConfigurationError(f"{what}: give topics (a name or a list) or pattern=, one of them")
        if topics is not None:
            topics = [topics] if isinstance(topics, str) else list(topics)
            if not topics or not all(isinstance(t, str) and t for t in topics):
                raise ConfigurationError(f"{what}: topics must be a topic name or a list of them, got {topics!r}")
        else:
            try:
                re.compile(pattern)
            except (re.error, TypeError) as exc:
                raise ConfigurationError(f"{what}: pattern={pattern!r} is not a regular expression: {exc}") from None
        if value_format not in kc.READ_FORMATS:
            raise ConfigurationError(f"{what}: value_format must be one of {kc.READ_FORMATS}, got {value_format!r}")
        include = (include,) if isinstance(include, str) else tuple(include)
        fields = ("key", "headers", "timestamp", "topic", "partition", "offset")
        for f in include:
            if f not in fields:
                raise ConfigurationError(f"{what}: include takes {fields}, got {f!r}")
        arrow = value_format in kc.kafka_arrow.FORMATS
        if arrow:
            schema = kc.kafka_arrow.value_schema(what, value_format, schema, include)
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or not 1 <= batch_size <= 1_000_000:
                raise ConfigurationError(f"{what}: batch_size must be an int in 1..1000000 (records per "
                                         f"RecordBatch), got {batch_size!r}")
            if callable(timestamps):
                raise ConfigurationError(
                    f"{what}: with value_format={value_format!r} a record is a RecordBatch: timestamps= takes "
                    "'kafka' (each partition's watermark follows its rows' times); include='timestamp' gives "
                    "the rows' times as a column")
        elif schema is not None:
            raise ConfigurationError(f"{what}: schema= is for value_format='arrow-json', not {value_format!r}")
        so = _starting_offsets(what, starting_offsets, topics)
        if timestamps is not None and timestamps != "kafka" and not callable(timestamps):
            raise ConfigurationError(f"{what}: timestamps must be 'kafka' or a function of the record, "
                                     f"got {timestamps!r}")
        ooo = _seconds(what, "out_of_orderness", out_of_orderness)
        idle = _seconds(what, "idle_timeout", idle_timeout, optional=True)
        timeout = _seconds(what, "connect_timeout", connect_timeout)
        pause_after = _seconds(what, "pause_after", pause_after, optional=True)
        _properties(what, properties)
        kc._ck()            # the client is installed (the kafka extra)
        source = kc.KafkaSource(
            bootstrap_servers, topics, pattern, group_id=group_id, value_format=value_format, include=include,
            starting_offsets=so, bounded=bool(bounded), timestamps=timestamps, out_of_orderness=ooo,
            idle_timeout=idle, properties=properties, wait_for_topics=wait_for_topics, connect_timeout=timeout,
            discovery_interval=discovery_interval, dead_letter=dead_letter,
            max_prefetch_kbytes=max_prefetch_kbytes, pause_after=pause_after, name=name, schema=schema,
            batch_size=batch_size)
        if kind is None:
            kind = "arrow" if arrow else {"bytes": "bytes", "str": "str"}.get(value_format) if not include else None
        link: dict = {}         # the source task hands its reader to the operator after it
        p = _parallelism(self.parallelism, parallelism)
        stream = self._source(name, lambda: kc.LinkedSourceTask(source, name, link), kind, rate_limit, p)
        with_time = timestamps is not None
        op_name = f"{name}.partitions"
        node = stream._then(op_name, lambda: kc.KafkaSourceOperator(op_name, link, with_time, KAFKA_DEAD_LETTERS), p,
                            kind)
        node.assigns_timestamps = True      # runs in the source's task (jobgraph.graph.plan)
        if with_time:
            node.timestamps = timestamps if callable(timestamps) else _kafka_time
            node.event_time = True
        node.side_tags = {KAFKA_DEAD_LETTERS.name: KAFKA_DEAD_LETTERS}
        out = type(stream)(self, node)
        out.dead_letters = lambda: out.side_output(KAFKA_DEAD_LETTERS, name=f"{name}.dead_letters")
        return out


def _kafka_time(record):     # the times travel with the records from the reader; never called in a job
    raise ConfigurationError("read_kafka(timestamps='kafka'): the times come from the Kafka records")


class ConnectorSinkDeclarations:
    """The ``Stream``'s methods that end it in a connector sink."""

    def sink_to(self, sink: "capi.Sink", *, name: str = "sink", parallelism: int | None = None):
        """End the stream in a connector sink (a ``fb.Sink`` subclass: see
        docs/connectors.md, "Writing a connector"): each subtask writes with
        a two-phase commit, committed when a checkpoint completes (and again
        after a restore), or at the end of input. Returns a ``DataSink``.

        Example::

            class Printed(fb.Sink):
                def open(self, subtask, parallelism):
                    self.lines = []

                def write(self, batch):
                    self.lines.extend(map(str, batch))

                def prepare_commit(self, checkpoint_id):
                    lines, self.lines = self.lines, []
                    return lines

                def commit(self, committables):
                    for line in committables:
                        print(line)

            env.from_collection(["a", "b"]).sink_to(Printed(), name="printed")
        """
        if not isinstance(sink, capi.Sink):
            raise TypeError(f"sink_to takes a pyflowbuf.Sink (a subclass of fb.Sink), got {sink!r}")
        key = f"sink:{self.env.name}/{name}"
        capi.declare(key, sink)
        checkpointed = self.env.checkpoint_config.enabled
        node = self._then(name, lambda: capi.ConnectorSinkOperator(name, sink, key, checkpointed), parallelism,
                          None, sink=True)
        return DataSink(self.env, node)

    def write_kafka(self, topic: str, *, bootstrap_servers: str, key: Callable | None = None,
                    value_format: str = "str", delivery: str = "at_least_once",
                    transactional_id_prefix: str | None = None, properties: dict | None = None,
                    connect_timeout: float = kc.CONNECT_TIMEOUT_S, transaction_timeout: float = 300.0,
                    parallelism: int | None = None, name: str = "write_kafka"):
        """Write each record to Kafka ``topic``: its value ``value_format``
        (``"str"``: ``str(record)`` as UTF-8, ``"bytes"``, ``"json"``), its
        key ``key(record)`` (str or bytes; None: no key), partitioned as the
        Java client does (murmur2 of the key).

        ``delivery="at_least_once"``: every outstanding delivery is confirmed
        before a checkpoint's barrier passes the sink. ``"exactly_once"``:
        each checkpoint's records go in a Kafka transaction, committed when
        the checkpoint completes, with the records kept in the checkpoint
        and a commit marker written in the same transaction so a failure
        between the checkpoint's completion and the commit neither loses
        nor duplicates them (docs/kafka.md). Readers must use
        ``isolation.level=read_committed``. It needs checkpoints; the
        transactional ids are ``<transactional_id_prefix>-<subtask>-<slot>``,
        by default ``pyflowbuf-<job name>-<directory>-<the sink's uid>``
        (eight hex digits naming the checkpoint directory; ``.uid()``, or the
        id derived from its place in the graph); two sinks of a job with the
        same prefix are refused (``ConfigurationError``), and two jobs
        writing at once with prefixes given need different ones.

        Returns a ``DataSink``. A missing topic is ``KafkaTopicError``, an
        unreachable broker ``KafkaConnectionError``, both when the job starts.

        Example::

            counts = env.from_collection([("a", 1), ("b", 2)])
            counts.write_kafka("counts", bootstrap_servers="127.0.0.1:9092", key=lambda kv: kv[0],
                               value_format="json")     # delivery="exactly_once" with checkpoints
        """
        what = f"write_kafka {name!r}"
        _servers(what, bootstrap_servers)
        if not isinstance(topic, str) or not topic:
            raise ConfigurationError(f"{what}: topic must be a topic name, got {topic!r}")
        if value_format not in kc.FORMATS:
            raise ConfigurationError(f"{what}: value_format must be one of {kc.FORMATS}, got {value_format!r}")
        if delivery not in kc.DELIVERIES:
            raise ConfigurationError(f"{what}: delivery must be one of {kc.DELIVERIES}, got {delivery!r}")
        if key is not None and not callable(key):
            raise ConfigurationError(f"{what}: key must be a function of the record, got {key!r}")
        _properties(what, properties)
        taken = sorted({"on_delivery", "dr_cb", "dr_msg_cb"} & set(properties or ()))
        if taken:
            raise ConfigurationError(f"{what}: {taken[0]!r} is the sink's own (it turns a failed delivery into "
                                     "the job's KafkaSinkError), not a property")
        if delivery == "exactly_once" and properties and "transactional.id" in properties:
            raise ConfigurationError(f"{what}: the transactional ids are the sink's own "
                                     "(transactional_id_prefix= names them), not a property")
        kc._ck()
        env = self.env
        if delivery == "exactly_once" and not env.checkpoint_config.enabled:
            raise ConfigurationError(
                f"{what}: delivery='exactly_once' commits a transaction when a checkpoint completes, and this "
                "job takes no checkpoints: pass Environment(checkpoint_interval=...), or delivery='at_least_once'")
        prefix = transactional_id_prefix or None     # None: from the job, its directory and the sink's uid
        cc = env.checkpoint_config
        scope = kc.checkpoint_scope(cc.directory) if cc is not None and cc.enabled else None
        sink = kc.KafkaSink(bootstrap_servers, topic, key=key, value_format=value_format, delivery=delivery,
                            transactional_id_prefix=prefix, properties=properties,
                            connect_timeout=connect_timeout, transaction_timeout=transaction_timeout, name=name,
                            job=env.name, scope=scope)
        # the driver's final commits find the sink by this key: stable from run to
        # run of the same job, one per write_kafka (its rank among the job's sinks)
        rank = sum(isinstance(n.job_check, kc.PrefixCheck) for n in env.nodes)
        commit_key = f"kafka:{prefix}" if prefix else f"kafka:{env.name}:{rank}"
        capi.declare(commit_key, sink)
        checkpointed = env.checkpoint_config.enabled
        if not prefix:      # the key of checkpoints written before the prefix held the uid
            capi.declare(f"kafka:pyflowbuf-{env.name}-{name}", sink)

        def make():
            return kc.KafkaSinkOperator(name, sink, commit_key, checkpointed)

        node = self._then(name, make, parallelism, None, sink=True)
        node.job_check = kc.PrefixCheck(prefix, env.name, name, scope, sink)
        return DataSink(env, node)


# a timestamp past this many seconds (the year 5138) is one in milliseconds
_SECONDS_AT_MOST = 1e11


def _starting_offsets(what, so, topics):
    """read_kafka's ``starting_offsets``, checked; a datetime becomes its
    timestamp in seconds."""
    if isinstance(so, str) and so in kc.STARTS:
        return so
    if isinstance(so, datetime.datetime):
        if so.tzinfo is None:
            raise ConfigurationError(
                f"{what}: starting_offsets={so!r} has no time zone, so the instant it means is unclear: "
                "give an aware datetime (e.g. datetime(..., tzinfo=timezone.utc)) or seconds since the epoch")
        return so.timestamp()
    if isinstance(so, numbers.Real) and not isinstance(so, bool):
        if not (so >= 0 and math.isfinite(so)):
            raise ConfigurationError(f"{what}: starting_offsets as a timestamp is seconds since the epoch, "
                                     f">= 0, got {so!r}")
        if so > _SECONDS_AT_MOST:
            raise ConfigurationError(
                f"{what}: starting_offsets={so!r} is a timestamp in seconds far in the future (the year "
                f"{1970 + int(so // 31_556_952)}); it looks like milliseconds: pass seconds ({so / 1000!r}), "
                "as time.time() gives")
        return so
    if isinstance(so, dict):
        for key, val in so.items():
            if isinstance(key, tuple):
                ok = (len(key) == 2 and isinstance(key[0], str) and isinstance(key[1], int)
                      and not isinstance(key[1], bool) and key[1] >= 0)
                offsets, topic = {key[1] if ok else None: val}, key[0] if ok else None
            else:
                ok, topic = isinstance(key, str) and isinstance(val, dict), key
                offsets = val if ok else {}
                ok = ok and all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in offsets)
            if not ok:
                raise ConfigurationError(
                    f"{what}: starting_offsets as a dict maps (topic, partition) to an offset, or a topic to "
                    f"{{partition: offset}}; got the entry {key!r}: {val!r}")
            if topics is not None and topic not in topics:
                raise ConfigurationError(f"{what}: starting_offsets names topic {topic!r}, which this source does "
                                         f"not read (topics {topics!r})")
            for part, off in offsets.items():
                if not (off in ("earliest", "latest") or
                        (isinstance(off, int) and not isinstance(off, bool) and off >= 0)):
                    raise ConfigurationError(
                        f"{what}: starting_offsets for {topic}/{part} must be an offset >= 0, 'earliest' or "
                        f"'latest', got {off!r}")
        return so
    raise ConfigurationError(
        f"{what}: starting_offsets must be 'earliest', 'latest', 'committed', a timestamp in seconds (or an "
        f"aware datetime) or a dict of offsets per (topic, partition), got {so!r}")
