"""``read_kafka(value_format="arrow" | "arrow-json")``: Kafka records as Arrow
RecordBatches for the vectorized operators (the stream's kind is ``arrow``).

One consumed batch (up to ``batch_size`` records, one ``consume`` call) becomes
one RecordBatch, built after the reader has moved its per-partition positions
past every record in it. The source task emits it as a single record, and a
checkpoint's barrier only comes between two pulls, so a batch is always
wholly before or wholly after a barrier: a restore neither repeats nor loses a
row.

Columns:

* ``"arrow"``: ``value`` (binary, null for a tombstone);
* ``"arrow-json"``: each value is one JSON object parsed by pyarrow into the
  columns of ``schema=`` (fields not in it are ignored, absent ones null);
* then the ``include=`` fields in the order asked: ``key`` (binary),
  ``headers`` (list of struct<key: string, value: binary>), ``timestamp``
  (timestamp[ms, UTC]), ``topic`` (string), ``partition`` (int32), ``offset``
  (int64).

With ``timestamps="kafka"`` every partition's watermark follows its rows'
times as for the other formats; the batch, a single record downstream, has
the time of its earliest row, so it is late only if that row is.

A value that ``arrow-json`` cannot parse into the schema (not JSON, not one
object, a field of another type, a required field absent) is
``KafkaDecodeError`` naming topic, partition and offset, or with
``dead_letter=True`` a dead letter with its raw bytes while the other rows of
its batch go on.
"""
from __future__ import annotations

import io
import time
from array import array

from pyflowbuf import errors

FORMATS = ("arrow", "arrow-json")
FIELDS = ("key", "headers", "timestamp", "topic", "partition", "offset")
DEFAULT_BATCH_SIZE = 10000


def _pa():
    try:
        import pyarrow as pa
        import pyarrow.json  # noqa: F401
    except ImportError as exc:      # optional dependency: the ``arrow`` extra
        raise ImportError("read_kafka(value_format='arrow') needs pyarrow: pip install 'pyflowbuf[arrow]'") from exc
    return pa


def value_schema(what: str, value_format: str, schema, include):
    """The value columns' ``pyarrow.Schema`` (None for ``"arrow"``), checked
    where ``read_kafka`` is declared."""
    pa = _pa()
    if value_format == "arrow":
        if schema is not None:
            raise errors.ConfigurationError(
                f"{what}: schema= parses JSON values into columns: pass value_format='arrow-json' with it "
                "(value_format='arrow' gives the raw values in a binary column 'value')")
        names = ["value"]
    else:
        if isinstance(schema, dict):
            try:
                schema = pa.schema([(n, pa.type_for_alias(t) if isinstance(t, str) else t)
                                    for n, t in schema.items()])
            except (ValueError, TypeError) as exc:
                raise errors.ConfigurationError(f"{what}: schema= {schema!r}: {exc}") from None
        if not isinstance(schema, pa.Schema) or not len(schema):
            raise errors.ConfigurationError(
                f"{what}: value_format='arrow-json' needs schema=, a pyarrow.Schema (or a dict of column name "
                f"to type) of the JSON values' fields, got {schema!r}")
        names = list(schema.names)
    clash = sorted(set(names) & set(include))
    if clash:
        raise errors.ConfigurationError(
            f"{what}: the value column(s) {clash} and include= both name a column: rename the schema's field(s)")
    return schema


class ArrowBatches:
    """Builds a reader's RecordBatch from one ``consume`` call's messages."""

    def __init__(self, source):
        self.pa = pa = _pa()
        self.s = source
        self.batch_size = source.batch_size
        self.json = source.value_format == "arrow-json"
        self.schema = source.schema
        extra = {"key": pa.binary(), "headers": pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])),
                 "timestamp": pa.timestamp("ms", tz="UTC"), "topic": pa.string(), "partition": pa.int32(),
                 "offset": pa.int64()}
        fields = list(self.schema) if self.json else [pa.field("value", pa.binary())]
        self.out_schema = pa.schema(fields + [pa.field(f, extra[f]) for f in source.include])
        if self.json:
            import pyarrow.json as pj
            self.pj = pj
            self.parse_one = pj.ParseOptions(explicit_schema=self.schema, unexpected_field_behavior="ignore",
                                             newlines_in_values=True)
            self.parse_lines = pj.ParseOptions(explicit_schema=self.schema, unexpected_field_behavior="ignore")

    def poll(self, r, msgs) -> list:
        """The records of one pull: [] or [RecordBatch]. Moves ``r``'s
        positions, watermarks' highest times and dead letters, as
        ``KafkaReader.poll`` does for the other formats."""
        timed = r._kafka_ts
        values = None if timed else r._fast(msgs)
        if values is not None:
            # the common case: no error, no partition at its end, no times
            r.stamps = None
            return self._batch(r, msgs, values)
        ck = r.ck
        eof = ck.KafkaError._PARTITION_EOF
        pos, done, bounded = r.pos, r.done, r.s.bounded
        kept = []
        seen = set()
        max_ts = r.max_ts
        for m in msgs:
            err = m.error()
            tp = (m.topic(), m.partition())
            if err is not None:
                # (the same handling as KafkaReader.poll's)
                if err.code() == eof:
                    r.high[tp] = m.offset()
                    if bounded and tp in pos and pos[tp][1] is not None and m.offset() >= pos[tp][1]:
                        r._finish(tp)
                    continue
                if err.fatal() or not err.retriable():
                    if err.code() == ck.KafkaError.UNKNOWN_TOPIC_OR_PART:
                        raise errors.KafkaTopicError(f"read_kafka {r.s.name!r}: {tp[0]}/{tp[1]}: {err.str()}")
                    raise errors.KafkaConnectionError(
                        f"read_kafka {r.s.name!r} ({r.s.bootstrap_servers}): {err.str()}")
                continue
            if tp in done:
                continue
            p = pos[tp]
            off = m.offset()
            if bounded and p[1] is not None and off >= p[1]:
                r._finish(tp)
                continue
            p[0] = off + 1
            kept.append(m)
            seen.add(tp)
            if timed:
                t = m.timestamp()[1] / 1000.0
                if t > max_ts.get(tp, -float("inf")):
                    max_ts[tp] = t
            if bounded and p[1] is not None and p[0] >= p[1]:
                r._finish(tp)
        if seen:
            now = time.monotonic()
            for tp in seen:
                r.last_seen[tp] = now
        r.stamps = array("d") if timed else None
        if not kept:
            return []
        return self._batch(r, kept, [m.value() for m in kept], timed)

    def _batch(self, r, kept, values, timed=False) -> list:
        """[the RecordBatch of the messages ``kept``] (whose ``values`` these
        are), or [] when none is left (all dead letters); ``timed``: its time,
        its earliest row's, into ``r.stamps``."""
        if self.json:
            columns, good = self._parse(r, kept, values)
            if good is not None:
                kept = [kept[i] for i in good]
            if not kept:
                return []
        else:
            columns = [self.pa.array(values, self.pa.binary())]
        if timed:
            r.stamps.append(min(m.timestamp()[1] for m in kept) / 1000.0)
        return [self.pa.RecordBatch.from_arrays(columns + self._included(kept), schema=self.out_schema)]

    def _included(self, kept) -> list:
        pa = self.pa
        cols = []
        for f in self.s.include:
            if f == "key":
                cols.append(pa.array([m.key() for m in kept], pa.binary()))
            elif f == "headers":
                cols.append(pa.array([None if h is None else [{"key": k, "value": v} for k, v in h]
                                      for h in (m.headers() for m in kept)], self.out_schema.field(f).type))
            elif f == "timestamp":
                # (TIMESTAMP_NOT_AVAILABLE, i.e. type 0: null)
                cols.append(pa.array([t[1] if t[0] else None for t in (m.timestamp() for m in kept)],
                                     pa.timestamp("ms", tz="UTC")))
            elif f == "topic":
                cols.append(pa.array([m.topic() for m in kept], pa.string()))
            elif f == "partition":
                cols.append(pa.array([m.partition() for m in kept], pa.int32()))
            elif f == "offset":
                cols.append(pa.array([m.offset() for m in kept], pa.int64()))
        return cols

    # ---- arrow-json ----
    def _parse(self, r, kept, values):
        """The schema's columns of the values, and the indices of the rows
        kept (None: all). All values are parsed in one call when that call
        cannot misalign rows and values: no value is missing, blank or holds a
        line break, so every line gives at least one row, and then as many
        rows as values means one each. Otherwise, or when that call fails,
        value by value: the undecodable ones fail the job or are dead
        letters."""
        pj = self.pj
        n = len(values)
        if None not in values:
            joined = b"\n".join(values)
            if joined.count(b"\n") == n - 1 and b"\r" not in joined and all(map(bytes.strip, values)):
                try:
                    t = pj.read_json(io.BytesIO(joined), read_options=self._read_options(len(joined)),
                                     parse_options=self.parse_lines)
                except (ValueError, TypeError):   # pyarrow's ArrowInvalid is a ValueError
                    t = None
                if t is not None and t.num_rows == n:
                    return self._columns(t), None
        tables, good = [], []
        for i, v in enumerate(values):
            why = None
            if v is None:
                why = "a null value (tombstone)"
            else:
                try:
                    t = pj.read_json(io.BytesIO(v), read_options=self._read_options(len(v)),
                                     parse_options=self.parse_one)
                except (ValueError, TypeError) as exc:
                    why = f"{type(exc).__name__}: {exc}"
                else:
                    if t.num_rows != 1:
                        why = f"it holds {t.num_rows} JSON objects, not one"
            if why is None:
                tables.append(t)
                good.append(i)
                continue
            m = kept[i]
            if not r.s.dead_letter:
                raise errors.KafkaDecodeError(
                    f"read_kafka {r.s.name!r}: the record at {m.topic()}/{m.partition()} offset {m.offset()} is not "
                    f"a JSON object of schema {_schema_text(self.schema)} ({why}); fix the schema= of "
                    "value_format='arrow-json', or pass dead_letter=True to send such records to "
                    "read_kafka(...).dead_letters() instead")
            r.dead.append({"topic": m.topic(), "partition": m.partition(), "offset": m.offset(), "key": m.key(),
                           "value": v, "error": why})
        if not tables:
            return [], good
        return self._columns(self.pa.concat_tables(tables)), good

    def _read_options(self, nbytes):
        # one block: no object cut at a block's end, no thread pool per batch
        return self.pj.ReadOptions(use_threads=False, block_size=max(nbytes + 1, 1 << 16))

    def _columns(self, table) -> list:
        table = table.select(self.schema.names)
        return [c.combine_chunks() for c in table.columns]


def rows_of(batch) -> int:
    """The rows of a pull (its RecordBatches): what the source task's pull
    size counts for this source, so a pull holds no more rows than the
    bytes path would hold records."""
    return sum(b.num_rows for b in batch)


def _schema_text(schema) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"
