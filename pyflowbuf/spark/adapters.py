"""Run a pyflowbuf pipeline inside Spark's Python workers.

Spark hands a Python worker an iterator of Arrow batches per partition (see
``DataFrame.mapInArrow`` / ``mapInPandas``). The adapters here turn a
``build(stream) -> stream`` function into the function Spark calls:

1. the partition's iterator becomes the pipeline's source. It is pulled
   lazily in the source thread: a batch is taken from Spark only when it can
   be written into the bounded pool, so a slow stage (or a slow consumer on
   Spark's side) stops the reading from Spark - backpressure end to end, and
   the worker's memory stays within the pool plus the batches in hand;
2. every batch is serialized into pyflowbuf segments (Arrow IPC, decoded in
   place) and flows through the user's operators, which may run with
   parallelism > 1 in threads (I/O-bound enrichment, say);
3. the records reaching the end come back, in the worker's main thread, as
   the function's output, fitted to the declared schema.

Row order within a partition is kept unless ``preserve_order=False`` (see
``pyflowbuf.spark._ordered``). A pipeline failure is raised in the worker as
``pyflowbuf.errors.JobFailedError`` whose message names the operator and the
original error; Spark fails the task with that text. Output that does not fit
the declared schema raises ``SchemaMismatchError`` naming the columns.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

from pyflowbuf.serializers_arrow import DEFAULT_SEGMENT_SIZE
from pyflowbuf.spark._ordered import OrderedStream, PartitionArrowSerializer, SequencedSerializer, reorder
from pyflowbuf.spark._schema import (SchemaMismatchError, check_pandas_frame, conform_batch, resolve_schema,
                                     session_timezone)
from pyflowbuf.spark.metrics import MetricsCollector, PartitionStats

# Spark's batches are large records (10,000 rows by default: a few hundred
# KiB, many 32 KiB segments). Pull and move a few at a time, not the runtime's
# default of up to 1024 records per crossing, so read-ahead stays small; and
# let an output pool hold up to 32 segments (1 MiB), a couple of batches, so a
# writer is not stopped in the middle of every record (the runtime's default
# cap of 2 * subpartitions + 8 segments is less than one batch).
DEFAULT_ENV = {"max_batch": 4, "output_buffers": (4, 32), "name": "spark-partition"}

Build = Callable[[Any], Any]


def _env_kwargs(env_kwargs: dict) -> dict:
    kw = {**DEFAULT_ENV, **env_kwargs}
    from pyflowbuf import Environment

    Environment(**kw)  # validate on the driver: bad settings fail before any Spark job
    return kw


def _apply_build(build: Build, stream, expected_type, hint: str):
    out = build(stream)
    if out is None:
        raise TypeError("build(stream) returned None; it must return the stream it built "
                        "(e.g. `lambda s: s.map(f)`)")
    if not isinstance(out, expected_type):
        raise TypeError(f"build(stream) must return a stream, got {type(out).__name__}{hint}")
    return out


def run_partition(records: Iterable, build: Build, *, kind: Any = "arrow", preserve_order: bool = True,
                  env_kwargs: dict | None = None, convert: Callable[[Any, int], Any] | None = None,
                  stats: PartitionStats | None = None, on_done: Callable[[dict], None] | None = None,
                  output_kind: Any = None) -> Iterator:
    """Generator: ``records`` through the pipeline that ``build`` makes,
    yielded in this thread (``convert(record, index)`` applied). Closing it
    cancels the pipeline. The engine of every adapter; usable without Spark.

    ``kind`` is the input records' kind; ``output_kind``, when given, is the
    kind of the stream ``build`` returns if ``build`` declared none."""
    from pyflowbuf import Environment, Stream

    env = Environment(**(env_kwargs if env_kwargs is not None else DEFAULT_ENV))
    if stats is None and on_done is not None:
        stats = PartitionStats()
    if stats is not None:
        stats.env = env
        records = stats.count_in(records)
    sequenced = False
    if preserve_order:
        proxy = _apply_build(build, OrderedStream(), OrderedStream,
                             " (with preserve_order=True, build gets and must return an OrderedStream)")
        sequenced = proxy.needs_sequencing(env.parallelism)
        if sequenced:
            src = env.from_iterable(((i, [r]) for i, r in enumerate(records)),
                                    kind=SequencedSerializer(), name="spark-input")
        else:
            src = env.from_iterable(records, kind=kind, name="spark-input")
        out = proxy.replay(src, sequenced)
    else:
        src = env.from_iterable(records, kind=kind, name="spark-input")
        out = _apply_build(build, src, Stream, "")
    if output_kind is not None and not sequenced and out.node.kind is None:
        # declared, not inferred from the first record: the records reaching
        # this thread cross with the kind the adapter chose
        out.node.kind = output_kind
    inner = env.execute_iter(out.to_iterator(name="spark-output"))
    gen = reorder(inner) if sequenced else inner
    try:
        i = 0
        for rec in gen:
            if convert is not None:
                rec = convert(rec, i)
            if stats is not None:
                stats.count_out(rec)
            i += 1
            yield rec
    finally:
        if gen is not inner:
            gen.close()
        inner.close()   # cancels the job if it is still running
        if on_done is not None:
            try:
                on_done(stats.report(env))
            except Exception:  # metrics must never fail the task
                pass


# ---------------------------------------------------------------- mapInArrow

def arrow_udf(build: Build, schema: Any, *, preserve_order: bool = True, cast: bool = True,
              metrics: MetricsCollector | None = None, **env_kwargs
              ) -> Callable[[Iterator], Iterator]:
    """A function for ``DataFrame.mapInArrow(fn, schema)`` that runs each
    partition through the pipeline ``build(stream)`` makes.

    ``build`` gets a stream of ``pyarrow.RecordBatch`` records (Spark's Arrow
    batches, ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows each) and
    returns the stream whose records (RecordBatch, Table or pandas DataFrame)
    become the output. ``schema`` (StructType, DDL string or pyarrow.Schema)
    is the declared output schema: records are matched by column name and
    cast losslessly where needed (``cast=False``: types must be exact).
    ``env_kwargs`` go to ``pyflowbuf.Environment`` (``parallelism``,
    ``num_segments``, ``segment_size``, ``buffer_timeout``, ...).
    ``metrics``: a MetricsCollector receiving one report per partition.

    The returned function has ``spark_schema`` and ``arrow_schema`` attributes.
    """
    struct, arrow_schema = resolve_schema(schema, timezone=session_timezone())
    kw = _env_kwargs(env_kwargs)
    on_done = metrics.add if metrics is not None else None

    def convert(rec, i):
        return conform_batch(rec, arrow_schema, cast=cast)

    segment_size = kw.get("segment_size", DEFAULT_SEGMENT_SIZE)

    def pyflowbuf_map_in_arrow(batches: Iterator) -> Iterator:
        # made here, in the worker: the kinds keep per-partition schema caches
        return run_partition(batches, build, kind=PartitionArrowSerializer(segment_size),
                             preserve_order=preserve_order, env_kwargs=kw, convert=convert, on_done=on_done,
                             output_kind=PartitionArrowSerializer(segment_size, accept_pandas=True))

    pyflowbuf_map_in_arrow.spark_schema = struct
    pyflowbuf_map_in_arrow.arrow_schema = arrow_schema
    return pyflowbuf_map_in_arrow


def map_in_arrow(df, build: Build, schema: Any, *, preserve_order: bool = True, cast: bool = True,
                 metrics: MetricsCollector | None = None, barrier: bool = False, **env_kwargs):
    """``df.mapInArrow`` through a pyflowbuf pipeline; see ``arrow_udf``.

        out = map_in_arrow(df, lambda s: s.map(enrich, parallelism=4).map(score),
                           "id long, score double")
    """
    fn = arrow_udf(build, schema, preserve_order=preserve_order, cast=cast, metrics=metrics, **env_kwargs)
    if barrier:
        return df.mapInArrow(fn, fn.spark_schema, barrier=True)
    return df.mapInArrow(fn, fn.spark_schema)


# ---------------------------------------------------------------- mapInPandas

def pandas_udf_fn(build: Build, schema: Any, *, preserve_order: bool = True, check_schema: bool = True,
                  metrics: MetricsCollector | None = None, **env_kwargs) -> Callable[[Iterator], Iterator]:
    """A function for ``DataFrame.mapInPandas(fn, schema)``: like
    ``arrow_udf`` but the records are ``pandas.DataFrame``s (Spark converts
    each Arrow batch, with its own time-zone and type rules). Output frames
    are checked against the declared schema by column name and type family
    (``check_schema=False`` leaves all checking to Spark)."""
    struct, arrow_schema = resolve_schema(schema, timezone=session_timezone())
    kw = _env_kwargs(env_kwargs)
    on_done = metrics.add if metrics is not None else None

    def convert(rec, i):
        import pyarrow as pa

        if isinstance(rec, (pa.RecordBatch, pa.Table)):
            rec = rec.to_pandas()
        if check_schema:
            check_pandas_frame(rec, arrow_schema)
        return rec

    def pyflowbuf_map_in_pandas(frames: Iterator) -> Iterator:
        return run_partition(frames, build, kind="pandas", preserve_order=preserve_order, env_kwargs=kw,
                             convert=convert, on_done=on_done)

    pyflowbuf_map_in_pandas.spark_schema = struct
    pyflowbuf_map_in_pandas.arrow_schema = arrow_schema
    return pyflowbuf_map_in_pandas


def map_in_pandas(df, build: Build, schema: Any, *, preserve_order: bool = True, check_schema: bool = True,
                  metrics: MetricsCollector | None = None, barrier: bool = False, **env_kwargs):
    """``df.mapInPandas`` through a pyflowbuf pipeline; see ``pandas_udf_fn``."""
    fn = pandas_udf_fn(build, schema, preserve_order=preserve_order, check_schema=check_schema,
                       metrics=metrics, **env_kwargs)
    if barrier:
        return df.mapInPandas(fn, fn.spark_schema, barrier=True)
    return df.mapInPandas(fn, fn.spark_schema)


# ---------------------------------------------------------------- scalar pandas_udf

def pipeline_udf(build: Build, return_type: Any, *, num_args: int = 1, metrics: MetricsCollector | None = None,
                 **env_kwargs):
    """A scalar (iterator) ``pandas_udf`` whose values come from a pipeline:

        score = pipeline_udf(lambda s: s.map(lookup, parallelism=8), "double")
        df.select(score("id"))

    With one argument the pipeline's records are ``pandas.Series`` (one per
    Arrow batch); with ``num_args`` > 1 they are DataFrames with columns
    ``_0 .. _{n-1}``. Each record must map to exactly one output of the same
    length (a Series, array or list), so the operators are 1:1 maps: order is
    always kept, and a filter or flat_map that changes lengths is an error.
    """
    import typing

    import pandas as pd
    from pyspark.sql.functions import pandas_udf

    if not isinstance(num_args, int) or num_args < 1:
        raise ValueError(f"num_args must be a positive int, got {num_args!r}")
    kw = _env_kwargs(env_kwargs)
    on_done = metrics.add if metrics is not None else None

    def run(inputs):
        stats = PartitionStats()

        def convert(rec, i):
            expected = stats.input_rows.popleft() if stats.input_rows else None
            out = rec if isinstance(rec, pd.Series) else (
                rec.iloc[:, 0] if isinstance(rec, pd.DataFrame) and rec.shape[1] == 1 else pd.Series(rec))
            if expected is None or len(out) != expected:
                raise ValueError(f"pipeline_udf: output batch {i} has {len(out)} values but its input batch had "
                                 f"{expected} rows; a scalar UDF's pipeline must map each batch to one "
                                 "output of the same length (no filter / flat_map)")
            return out.reset_index(drop=True)

        return run_partition(inputs, build, kind="pandas", preserve_order=True, env_kwargs=kw,
                             convert=convert, stats=stats, on_done=on_done)

    if num_args == 1:
        def pyflowbuf_udf(it):
            return run(it)
        arg_type = typing.Iterator[pd.Series]
    else:
        def pyflowbuf_udf(it):
            frames = (pd.DataFrame({f"_{k}": s.reset_index(drop=True) for k, s in enumerate(cols)})
                      for cols in it)
            return run(frames)
        arg_type = typing.Iterator[typing.Tuple[pd.Series, ...]]
    # real types, not strings (this module uses postponed annotations): Spark
    # picks the UDF kind (scalar iterator) from them
    pyflowbuf_udf.__annotations__ = {"it": arg_type, "return": typing.Iterator[pd.Series]}
    return pandas_udf(pyflowbuf_udf, returnType=return_type)


__all__ = ["arrow_udf", "map_in_arrow", "pandas_udf_fn", "map_in_pandas", "pipeline_udf", "run_partition",
           "SchemaMismatchError", "DEFAULT_ENV"]
