"""Declared output schemas: Spark <-> Arrow, and checking pipeline output.

The declared schema is resolved once on the driver (``resolve_schema``); the
worker gets the Arrow schema in the UDF's closure and fits every output
record to it (``conform_batch``): columns are matched by name, reordered, and
cast when Arrow can do so without losing values (int32 -> int64, string ->
large_string, a timestamp's time zone...). Anything else raises
``SchemaMismatchError`` naming the missing, unexpected and mistyped columns.
"""
from __future__ import annotations

from typing import Any

import pyarrow as pa

from pyflowbuf.errors import FlowBufError


class SchemaMismatchError(FlowBufError, ValueError):
    """The pipeline's output does not match the declared schema."""

    def __init__(self, message, missing=(), extra=(), wrong_types=()):
        super().__init__(message)
        self.missing = list(missing)
        self.extra = list(extra)
        self.wrong_types = list(wrong_types)   # (name, expected type, got type)


def resolve_schema(schema: Any, *, timezone: str | None = None):
    """``(spark StructType, pyarrow.Schema)`` for a declared schema: a Spark
    ``StructType``, a DDL string (``"id long, name string"``) or a
    ``pyarrow.Schema``. DDL strings are parsed by Spark, so they need a
    running SparkSession (they are resolved on the driver)."""
    from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
    from pyspark.sql.types import StructType

    if isinstance(schema, pa.Schema):
        struct = from_arrow_schema(schema)
        return struct, _to_arrow(struct, timezone, to_arrow_schema)
    if isinstance(schema, str):
        struct = StructType.fromDDL(schema)
    elif isinstance(schema, StructType):
        struct = schema
    else:
        raise TypeError(f"schema must be a pyspark StructType, a DDL string or a pyarrow.Schema, "
                        f"got {type(schema).__name__}")
    return struct, _to_arrow(struct, timezone, to_arrow_schema)


def _to_arrow(struct, timezone, to_arrow_schema):
    return to_arrow_schema(struct, timezone=timezone or "UTC")


def session_timezone() -> str:
    try:
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
        if spark is not None:
            return spark.conf.get("spark.sql.session.timeZone") or "UTC"
    except Exception:  # pragma: no cover - no JVM
        pass
    return "UTC"


def _describe(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def to_record_batch(obj, index: int = 0) -> pa.RecordBatch:
    """A RecordBatch from what a pipeline may emit: a RecordBatch, a Table or
    a pandas DataFrame."""
    if isinstance(obj, pa.RecordBatch):
        return obj
    if isinstance(obj, pa.Table):
        batches = obj.combine_chunks().to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([], schema=obj.schema)
    mod = type(obj).__module__
    if mod.startswith("pandas"):
        import pandas as pd

        if isinstance(obj, pd.DataFrame):
            return pa.RecordBatch.from_pandas(obj, preserve_index=False)
    raise TypeError(f"pipeline output record {index} is a {mod}.{type(obj).__qualname__}; "
                    "the pipeline must end in pyarrow.RecordBatch (or Table / pandas.DataFrame) records")


def conform_batch(obj, schema: pa.Schema, *, cast: bool = True) -> pa.RecordBatch:
    """Fit one output record to ``schema`` or raise SchemaMismatchError."""
    batch = to_record_batch(obj)
    if batch.schema.equals(schema):
        return batch
    names = batch.schema.names
    expected = schema.names
    present = set(names)
    missing = [n for n in expected if n not in present]
    extra = [n for n in names if n not in set(expected)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    wrong = []
    cols = []
    if not dupes:
        for field in schema:
            if field.name not in present:
                continue
            col = batch.column(field.name)
            if col.type != field.type:
                if not cast:
                    wrong.append((field.name, field.type, col.type, "casts disabled"))
                    continue
                try:
                    col = col.cast(field.type, safe=True)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                    wrong.append((field.name, field.type, col.type, str(exc).splitlines()[0]))
                    continue
            cols.append(col)
    if missing or extra or wrong or dupes:
        parts = []
        if missing:
            parts.append(f"missing columns {missing}")
        if extra:
            parts.append(f"unexpected columns {extra}")
        if dupes:
            parts.append(f"duplicate columns {dupes}")
        if wrong:
            parts.append("wrong types: " + "; ".join(
                f"{n!r} expected {e}, got {g} ({why})" for n, e, g, why in wrong))
        raise SchemaMismatchError(
            "pipeline output does not match the declared schema: " + ", ".join(parts)
            + f". Declared: [{_describe(schema)}]; got: [{_describe(batch.schema)}]",
            missing, extra, [(n, e, g) for n, e, g, _ in wrong])
    return pa.RecordBatch.from_arrays(cols, schema=schema)


# --- pandas output (mapInPandas): names and coarse type families ---

def _family(t: pa.DataType) -> str:
    if pa.types.is_null(t):
        return "null"
    if pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_temporal(t):
        return "temporal"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list"
    if pa.types.is_map(t):
        return "map"
    if pa.types.is_struct(t):
        return "struct"
    return str(t)


def check_pandas_frame(df, schema: pa.Schema) -> None:
    """Raise SchemaMismatchError when a DataFrame cannot become ``schema``:
    missing or unexpected columns, or a column whose values are of another
    family (text where numbers are declared, ...). Finer checks (overflow,
    precision) are left to Spark's own conversion."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"pipeline output record is a {type(df).__module__}.{type(df).__qualname__}; "
                        "mapInPandas needs pandas.DataFrame records")
    names = [str(c) for c in df.columns]
    expected = schema.names
    missing = [n for n in expected if n not in set(names)]
    extra = [n for n in names if n not in set(expected)]
    wrong = []
    if len(df):
        for field in schema:
            if field.name not in df.columns:
                continue
            col = df[field.name]
            if isinstance(col, pd.DataFrame):
                continue  # duplicate names: reported as extra by Spark itself
            try:
                got = pa.Array.from_pandas(col.head(64)).type
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                wrong.append((field.name, field.type, f"{col.dtype} ({str(exc).splitlines()[0]})"))
                continue
            fe, fg = _family(field.type), _family(got)
            if fg != "null" and fe != fg:
                wrong.append((field.name, field.type, got))
    if missing or extra or wrong:
        parts = []
        if missing:
            parts.append(f"missing columns {missing}")
        if extra:
            parts.append(f"unexpected columns {extra}")
        if wrong:
            parts.append("wrong types: " + "; ".join(f"{n!r} expected {e}, got {g}" for n, e, g in wrong))
        raise SchemaMismatchError(
            "pipeline output does not match the declared schema: " + ", ".join(parts)
            + f". Declared: [{_describe(schema)}]; got columns {names}", missing, extra, wrong)
