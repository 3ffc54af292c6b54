"""Windows over Arrow/pandas batch streams, a batch at a time with pyarrow
compute."""
from __future__ import annotations


from pyflowbuf import errors
from pyflowbuf.time.timers import TimerOperator
from pyflowbuf.time.watermarks import seconds_column
from pyflowbuf.windows.assigners import Sliding


_ARROW_FUNCS = ("count", "sum", "min", "max", "mean")
# how a function's partial results combine: count and sum add up, min/max stay
_COMBINE = {"count": "sum", "sum": "sum", "min": "min", "max": "max"}


def check_arrow_spec(spec: dict) -> list:
    """``{out: (column, function)}`` as [(out, column, function)], checked."""
    out = []
    for name, what in spec.items():
        if not isinstance(name, str) or not isinstance(what, tuple) or len(what) != 2 \
                or not isinstance(what[0], str) or what[1] not in _ARROW_FUNCS:
            raise errors.ConfigurationError(
                f"aggregate({{...}}) takes {{output column: (input column, function)}} with a function among "
                f"{', '.join(_ARROW_FUNCS)}; got {name!r}: {what!r}")
        if name in ("window_start", "window_end"):
            raise errors.ConfigurationError(f"aggregate: {name!r} is the name of a column the windows add")
        out.append((name, what[0], what[1]))
    if not out:
        raise errors.ConfigurationError("aggregate({...}) needs at least one output column")
    return out


class ArrowWindowOperator(TimerOperator):
    """Keyed event-time windows over Arrow RecordBatches (or pandas
    DataFrames), a batch at a time: the window start of every row and a
    group-by (key, window) with pyarrow compute, keeping per window only
    partial aggregates (counts, sums, minima, maxima), which are combined
    when the watermark fires the window. The output is one RecordBatch per
    firing: the key column, ``window_start``, ``window_end`` and the
    aggregates, sorted by window and key.

    Records arriving within the allowed lateness update their window, which
    is emitted again at the next watermark.

    ``mode``: "full" (the above), "partial" (emits the partial aggregates of
    its own rows per window, for a "final" one to combine) or "final" (its
    input is those partial aggregates)."""

    def __init__(self, name, key_column, ts_column, assigner, aggs, lateness, mode="full"):
        super().__init__(name)
        self.mode = mode
        self.key = key_column
        self.ts = ts_column
        self.assigner = assigner
        self.aggs = aggs
        self.lateness = lateness
        self.parts: list = []           # partial tables not combined yet
        self.state = None               # one combined table of the open windows
        self.fired_end = -float("inf")  # windows ending at or before this have fired
        self.late_dropped = 0
        # partial columns: (partial name, source column, pyarrow function)
        partial = {}
        for out, col, fn in aggs:
            for f in (("sum", "count") if fn == "mean" else (fn,)):
                partial[f"{col}_{f}"] = (col, f)
        self.partial = [(n, c, f) for n, (c, f) in partial.items()]

    def open(self, subtask, parallelism):
        super().open(subtask, parallelism)
        import pyarrow as pa
        import pyarrow.compute as pc
        self.pa, self.pc = pa, pc

    def _table(self, b):
        pa = self.pa
        if isinstance(b, pa.RecordBatch):
            return pa.Table.from_batches([b])
        if isinstance(b, pa.Table):
            return b
        return pa.Table.from_pandas(b, preserve_index=False)

    def process_batch(self, batch):
        pa, pc = self.pa, self.pc
        if self.mode == "final":
            # partial results, grouped already; they come before the watermark
            # that passes their window, so none is late
            self.parts.extend(self._table(b) for b in batch)
            if len(self.parts) >= 64:
                self._combine()
            return []
        wm, lateness = self.timers.watermark, self.lateness
        a = self.assigner
        for b in batch:
            t = self._table(b)
            if t.num_rows == 0:
                continue
            ts = seconds_column(t.column(self.ts))
            step = a.slide if isinstance(a, Sliding) else a.size
            last = pc.add(pc.multiply(pc.floor(pc.divide(pc.subtract(ts, a.offset), step)), step), a.offset)
            n_windows = 1 if not isinstance(a, Sliding) else max(1, -int(-a.size // a.slide))
            cols = {self.key: t.column(self.key)}
            for _, col, _f in self.partial:
                if col != self.key:
                    cols[col] = t.column(col)
            pieces = []
            for j in range(n_windows):
                start = pc.subtract(last, j * step) if j else last
                end = pc.add(start, a.size)
                keep = pc.and_(pc.greater(end, ts), pc.greater(pc.add(end, lateness), wm))
                piece = pa.table(dict(cols, window_start=start, window_end=end)).filter(keep)
                pieces.append(piece)
                if j == 0:
                    on_time = keep
            # a row is late when none of its windows takes it
            if n_windows == 1:
                placed = on_time
            else:
                placed = None
                for j in range(n_windows):
                    start = pc.subtract(last, j * step) if j else last
                    end = pc.add(start, a.size)
                    k = pc.and_(pc.greater(end, ts), pc.greater(pc.add(end, lateness), wm))
                    placed = k if placed is None else pc.or_(placed, k)
            self.late_dropped += t.num_rows - pc.sum(pc.cast(placed, pa.int64())).as_py()
            rows = pa.concat_tables(pieces) if len(pieces) > 1 else pieces[0]
            if rows.num_rows:
                self.parts.append(rows.group_by([self.key, "window_start", "window_end"], use_threads=False)
                                  .aggregate([(c, f) for _, c, f in self.partial]))
                if len(self.parts) >= 64:
                    self._combine()
        return []

    def _combine(self):
        """Fold the pending partial tables into the state table."""
        pa = self.pa
        tables = ([self.state] if self.state is not None else []) + self.parts
        self.parts = []
        if not tables:
            return
        t = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        names = [n for n, _, _ in self.partial]
        t = t.group_by([self.key, "window_start", "window_end"], use_threads=False).aggregate(
            [(n, _COMBINE[f]) for n, _, f in self.partial])
        # group_by names a combined column "<partial>_<function>": back to the partial's name
        rename = {f"{n}_{_COMBINE[f]}": n for n, _, f in self.partial}
        self.state = t.rename_columns([rename.get(c, c) for c in t.column_names]).select(
            [self.key, "window_start", "window_end"] + names)

    def on_watermark(self, watermark):
        if not self.timers.advance(watermark):
            return [], None
        return self._fire(watermark), watermark

    def _fire(self, wm):
        pa, pc = self.pa, self.pc
        keys = [self.key, "window_start", "window_end"]
        # windows that fired before and got rows since (within the allowed lateness)
        dirty = None
        if self.parts and self.lateness:
            fired = [p.filter(pc.less_equal(p.column("window_end"), self.fired_end)).select(keys)
                     for p in self.parts]
            fired = pa.concat_tables(fired)
            if fired.num_rows:
                dirty = fired.group_by(keys, use_threads=False).aggregate([])
        self._combine()
        st = self.state
        if st is None or st.num_rows == 0:
            return []
        end = st.column("window_end")
        due = st.filter(pc.and_(pc.less_equal(end, wm), pc.greater(end, self.fired_end)))
        if dirty is not None:
            due = pa.concat_tables([due, st.join(dirty, keys, join_type="left semi")])
        self.fired_end = max(self.fired_end, wm)
        self.state = st.filter(pc.greater(pc.add(end, self.lateness), wm))
        if due.num_rows == 0:
            return []
        if self.mode == "partial":
            return due.combine_chunks().to_batches()
        due = due.sort_by([("window_start", "ascending"), (self.key, "ascending")])
        cols = {self.key: due.column(self.key), "window_start": due.column("window_start"),
                "window_end": due.column("window_end")}
        for out, col, fn in self.aggs:
            if fn == "mean":
                cols[out] = pc.divide(pc.cast(due.column(f"{col}_sum"), pa.float64()),
                                      pc.cast(due.column(f"{col}_count"), pa.float64()))
            else:
                cols[out] = due.column(f"{col}_{fn}")
        table = pa.table(cols).combine_chunks()
        return table.to_batches()

    def fire_event(self, watermark):
        return self._fire(watermark)

    def fire_processing(self, now):
        return []

    def snapshot_state(self):
        self._combine()
        st = self.state
        data = None
        if st is not None:
            sink = self.pa.BufferOutputStream()
            with self.pa.ipc.new_stream(sink, st.schema) as w:
                w.write_table(st)
            data = sink.getvalue().to_pybytes()
        return {"state": data, "fired_end": self.fired_end, "timers": self.timers.snapshot(),
                "late_dropped": self.late_dropped}

    def restore_state(self, state):
        if not state:
            return
        import pyarrow as pa
        if state["state"] is not None:
            self.state = pa.ipc.open_stream(pa.py_buffer(state["state"])).read_all()
        self.fired_end = state["fired_end"]
        self.timers.restore(state["timers"])
        self.late_dropped = state["late_dropped"]

    def metrics(self) -> dict:
        return {"late_records_dropped": self.late_dropped}

