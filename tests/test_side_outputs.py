"""Side outputs: ``OutputTag``, ``ctx.output(tag, value)`` in every kind of
process function, ``stream.side_output(tag)``, and ``late()`` as the window
operator's side output. Each routing is checked against a plain-Python
reference; side outputs are checked across workers and across a failure with
checkpoints (exactly once), and every misuse is a typed error."""
from __future__ import annotations

import collections
import multiprocessing
import os
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyflowbuf as fb
from pipeline_helpers import FailOnceAfterCheckpoint, read_parts  # noqa: E402
from pyflowbuf import errors
from pyflowbuf.windows import Count, Tumbling

needs_fork = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers need fork")

ODD = fb.OutputTag("odd", kind="int64")
BIG = fb.OutputTag("big", kind="str")


def split_odd_big(x, ctx):
    """Main: the even numbers; ``odd``: the odd ones; ``big``: every number
    >= 50 as text (a record may go to main and a side output both)."""
    if x >= 50:
        ctx.output(BIG, f"big{x}")
    if x % 2:
        ctx.output(ODD, x)
    else:
        yield x


def run(env, timeout=120):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", errors.WorkerSideEffectWarning)
        env.execute(timeout=timeout)


# ---------------------------------------------------------------- each kind of process function

@pytest.mark.parametrize("chaining", [True, False])
def test_plain_process_routes_to_main_and_two_side_outputs(chaining):
    env = fb.Environment(parallelism=2, chaining=chaining)
    main = env.from_sequence(0, 100).process(split_odd_big, side_outputs=[ODD, BIG], name="split")
    m = main.map(lambda x: x * 10, kind="int64").collect()
    odd = main.side_output(ODD).collect()
    big = main.side_output(BIG).collect()
    run(env)
    assert sorted(m.result) == [x * 10 for x in range(0, 100, 2)]
    assert sorted(odd.result) == list(range(1, 100, 2))
    assert sorted(big.result) == sorted(f"big{x}" for x in range(50, 100))


def test_the_main_output_keeps_chaining_and_each_side_output_is_an_edge_of_its_own():
    env = fb.Environment(parallelism=2)
    main = env.from_sequence(0, 10).process(split_odd_big, side_outputs=[ODD, BIG], name="split")
    main.map(lambda x: x, name="after").collect()
    main.side_output(ODD).collect()
    vertices, edges = env.plan()
    assert [v.name for v in vertices][0] == "sequence -> split -> after -> collect"
    side = [e for e in edges if e.tag is not None]
    assert [(e.tag, e.source_node.name, e.partitioner, e.target.name) for e in side] == [
        ("odd", "split", "forward", "split.odd -> collect")]
    assert side[0].kind == "int64"


def test_a_job_without_side_outputs_plans_as_before():
    env = fb.Environment(parallelism=2)
    env.from_sequence(0, 10).map(lambda x: x).key_by(lambda x: x).process(lambda k, x, st: [x]).collect()
    vertices, edges = env.plan()
    assert [v.name for v in vertices] == ["sequence -> map", "process -> collect"]
    assert all(e.tag is None for e in edges)


def test_keyed_process_with_timers_emits_side_outputs_from_process_on_timer_and_on_end():
    seen = fb.OutputTag("seen", kind="struct")
    fired = fb.OutputTag("fired")
    ended = fb.OutputTag("ended")

    def fn(key, record, state, ctx):
        state["n"] = state.get("n", 0) + 1
        ctx.output(seen, (key, record[1]))
        ctx.register_event_time_timer(record[1] + 10)
        return [(key, state["n"])]

    def on_timer(key, t, state, ctx):
        ctx.output(fired, (key, t))

    def on_end(key, state, ctx):
        ctx.output(ended, (key, state["n"]))

    records = [(f"k{i % 3}", float(i)) for i in range(30)]
    env = fb.Environment(parallelism=2)
    out = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1])
              .key_by(lambda r: r[0])
              .process(fn, on_timer=on_timer, on_end=on_end, side_outputs=[seen, fired, ended]))
    main = out.collect()
    s = out.side_output(seen).collect()
    f = out.side_output(fired).collect()
    e = out.side_output(ended).collect()
    run(env)
    per_key = collections.Counter(k for k, _ in records)
    assert sorted(main.result) == sorted((k, n) for k, c in per_key.items() for n in range(1, c + 1))
    assert sorted(s.result) == sorted(records)
    assert sorted(f.result) == sorted((k, t + 10) for k, t in records)
    assert sorted(e.result) == sorted(per_key.items())


def test_a_keyed_process_function_class_emits_side_outputs():
    small = fb.OutputTag("small", kind="int64")

    class Split(fb.KeyedProcessFunction):
        def process_element(self, key, record, state, ctx):
            if record < 5:
                ctx.output(small, record)
            else:
                return [record]

    env = fb.Environment()
    out = env.from_sequence(0, 10).key_by(lambda x: x % 2).process(Split(), side_outputs=[small])
    big = out.collect()
    little = out.side_output(small).collect()
    run(env)
    assert sorted(big.result) == [5, 6, 7, 8, 9]
    assert sorted(little.result) == [0, 1, 2, 3, 4]


def test_keyed_connect_process_emits_side_outputs():
    unmatched = fb.OutputTag("unmatched")

    def on_order(key, order, state, ctx):
        state["order"] = order

    def on_payment(key, payment, state, ctx):
        order = state.pop("order", None)
        if order is None:
            ctx.output(unmatched, payment)
            return None
        return [(key, payment[1])]

    env = fb.Environment(parallelism=2)
    orders = env.from_collection([(i, "o") for i in range(5)])
    payments = env.from_collection([(i, 10 * i) for i in range(3, 8)])
    paid = (orders.key_by(lambda o: o[0]).connect(payments.key_by(lambda p: p[0]))
                  .process(on_order, on_payment, side_outputs=[unmatched]))
    ok = paid.collect()
    bad = paid.side_output(unmatched).collect()
    run(env)
    # orders and payments race: each payment is matched or unmatched, never both, never lost
    got = {k for k, _ in ok.result} | {k for k, _ in bad.result}
    assert got == {3, 4, 5, 6, 7}
    assert {k for k, _ in bad.result} >= {5, 6, 7}
    assert len(ok.result) + len(bad.result) == 5


def test_window_process_emits_side_outputs_beside_its_results_and_late_records():
    small = fb.OutputTag("small_window", kind="struct")

    def fn(key, window, records, ctx):
        assert ctx.key == key and ctx.window == window
        if len(records) < 3:
            ctx.output(small, (key, window.start, len(records)))
            return None
        return [(key, window.start, len(records))]

    # k0 gets 4 records in [0, 10), k1 2; then a late one for [0, 10)
    records = [("k0", 1.0), ("k0", 2.0), ("k1", 3.0), ("k0", 4.0), ("k1", 5.0), ("k0", 6.0), ("k0", 25.0),
               ("k1", 1.5)]
    env = fb.Environment(max_batch=1)
    res = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1], watermark_interval=0, parallelism=1)
              .key_by(lambda r: r[0])
              .window(Tumbling(10))
              .process(fn, side_outputs=[small]))
    main = res.collect()
    side = res.side_output(small).collect()
    late = res.late().collect()
    run(env)
    assert sorted(main.result) == [("k0", 0.0, 4)]
    assert sorted(side.result) == [("k0", 20.0, 1), ("k1", 0.0, 2)]
    assert late.result == [("k1", 1.5)]
    assert sum(m.get("late_records_out", 0) for m in env.metrics().values()) == 1


def test_a_side_output_of_a_side_outputs_consumer():
    third = fb.OutputTag("third", kind="int64")

    def by_three(x, ctx):
        if x % 3 == 0:
            ctx.output(third, x)
        else:
            return [x]

    env = fb.Environment(parallelism=2)
    main = env.from_sequence(0, 60).process(split_odd_big, side_outputs=[ODD, BIG])
    odd = main.side_output(ODD).process(by_three, side_outputs=[third], name="by_three")
    rest = odd.collect()
    thirds = odd.side_output(third).collect()
    run(env)
    assert sorted(rest.result) == [x for x in range(1, 60, 2) if x % 3]
    assert sorted(thirds.result) == [x for x in range(1, 60, 2) if x % 3 == 0]


def test_a_side_output_alone_when_nothing_reads_the_main_output():
    env = fb.Environment(parallelism=2)
    main = env.from_sequence(0, 30).process(split_odd_big, side_outputs=[ODD, BIG])
    odd = main.side_output(ODD).collect()
    run(env)
    assert sorted(odd.result) == list(range(1, 30, 2))


def test_taking_a_side_output_twice_gives_the_same_stream_and_a_declared_tag_nobody_reads_drops():
    env = fb.Environment()
    main = env.from_sequence(0, 20).process(split_odd_big, side_outputs=[ODD, BIG])
    assert main.side_output(ODD) is main.side_output(fb.OutputTag("odd", kind="int64"))
    evens = main.collect()
    odd = main.side_output(ODD).collect()
    run(env)            # nothing reads BIG: its records go nowhere, the rest is unchanged
    assert sorted(evens.result) == list(range(0, 20, 2))
    assert sorted(odd.result) == list(range(1, 20, 2))


def test_a_side_output_carries_watermarks_and_the_end_of_input_to_event_time_operators():
    """Side outputs get watermarks as main outputs do: a window after one fires."""
    rare = fb.OutputTag("rare", kind="struct")

    def fn(r, ctx):
        if r[0] == "rare":
            ctx.output(rare, r)
        else:
            return [r]

    records = [("rare" if i % 4 == 0 else "common", float(i)) for i in range(40)]
    env = fb.Environment(parallelism=2)
    main = env.from_iterable(records).assign_timestamps(lambda r: r[1]).process(fn, side_outputs=[rare])
    counts = (main.side_output(rare).assign_timestamps(lambda r: r[1])
                  .key_by(lambda r: r[0]).window(Tumbling(10))
                  .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, n)).collect())
    main.collect()
    run(env)
    assert sorted(counts.result) == [("rare", 0.0, 3), ("rare", 10.0, 2), ("rare", 20.0, 3), ("rare", 30.0, 2)]


def test_process_context_has_the_record_timestamp():
    stamps = fb.OutputTag("stamps", kind="float64")
    env = fb.Environment()
    main = (env.from_collection([("a", 1.5), ("b", 2.5)]).assign_timestamps(lambda r: r[1])
               .process(lambda r, ctx: ctx.output(stamps, ctx.timestamp), side_outputs=[stamps]))
    main.collect()
    got = main.side_output(stamps).collect()
    run(env)
    assert sorted(got.result) == [1.5, 2.5]


# ---------------------------------------------------------------- late() is a side output

def _late_job(order, *, workers=None):
    records = [("a", 1.0), ("a", 12.0), ("a", 3.0), ("b", 4.0), ("b", 25.0), ("a", 9.0), ("b", 14.0)]
    env = fb.Environment(parallelism=2 if workers else 1, workers=workers, max_batch=1)
    res = (env.from_iterable(records)
              .assign_timestamps(lambda r: r[1], watermark_interval=0, parallelism=1)
              .key_by(lambda r: r[0])
              .window(Tumbling(10))
              .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, n)))
    if order == "late first":
        late = res.late().collect()
        counts = res.map(lambda r: r, name="after").collect()
    elif order == "late after":
        counts = res.map(lambda r: r, name="after").collect()
        late = res.late().collect()
    else:   # after collect() on the result itself
        counts = res.collect()
        late = res.late().collect()
    run(env)
    return sorted(counts.result), sorted(late.result), env


@pytest.mark.parametrize("order", ["late first", "late after", "after collect"])
def test_late_may_be_taken_before_or_after_the_results_are_used(order):
    counts, late, env = _late_job(order)
    assert counts == [("a", 0.0, 1), ("a", 10.0, 1), ("b", 20.0, 1)]
    assert late == [("a", 3.0), ("a", 9.0), ("b", 4.0), ("b", 14.0)]
    # the results' reader chains to the window whichever came first
    names = [v.name for v in env.plan()[0]]
    assert any("window_aggregate -> " in n for n in names), names


@needs_fork
def test_late_and_side_outputs_with_workers():
    counts, late, _ = _late_job("late after", workers=2)
    assert counts == [("a", 0.0, 1), ("a", 10.0, 1), ("b", 20.0, 1)]
    assert late == [("a", 3.0), ("a", 9.0), ("b", 4.0), ("b", 14.0)]


@needs_fork
def test_side_outputs_across_workers_and_exchanges():
    env = fb.Environment(parallelism=2, workers=2)
    main = env.from_sequence(0, 2000).rebalance().process(split_odd_big, side_outputs=[ODD, BIG])
    m = main.collect()
    # a side output read through a hash exchange into a keyed operator
    odd_sums = (main.side_output(ODD).key_by(lambda x: x % 5)
                    .reduce(lambda a, b: a + b, name="odd_sum").collect())
    big = main.side_output(BIG).collect()
    run(env, 180)
    assert sorted(m.result) == list(range(0, 2000, 2))
    assert sorted(big.result) == sorted(f"big{x}" for x in range(50, 2000))
    last = collections.defaultdict(int)
    for v in odd_sums.result:
        last[v % 5] = max(last[v % 5], v)
    # the final rolling sum per key class: all odd numbers of that class
    want = collections.defaultdict(int)
    for x in range(1, 2000, 2):
        want[x % 5] += x
    assert len(odd_sums.result) == 1000
    assert max(odd_sums.result) == max(want.values())


# ---------------------------------------------------------------- exactly once across a failure



@pytest.mark.parametrize("chaining, where, at, mode", [
    (True, "after side", 700, "aligned"), (False, "after side", 800, "aligned"),
    (True, "before process", 1200, "aligned"), (False, "main", 300, "aligned"),
    (False, "after side", 600, "unaligned"), (True, "before process", 1500, "unaligned")])
def test_side_outputs_are_exactly_once_across_a_failure(tmp_path, chaining, where, at, mode):
    n = 3000
    fail = FailOnceAfterCheckpoint(at)
    env = fb.Environment(parallelism=2, checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk",
                         restart_attempts=2, chaining=chaining, checkpoint_alignment=mode)
    fail.env = env
    s = env.from_sequence(0, n, parallelism=1, rate_limit=6_000)
    if where == "before process":
        s = s.map(fail, kind="int64", name="fail", parallelism=1)     # keeps the order per key
    keyed = s.key_by(lambda x: x % 7)

    def fn(key, x, state, ctx):
        state["n"] = state.get("n", 0) + 1
        if x % 3 == 0:
            ctx.output(ODD, x)          # (any int64 tag will do)
            return None
        return [(key, state["n"])]

    main = keyed.process(fn, side_outputs=[ODD], name="split")
    side = main.side_output(ODD)
    if where == "after side":
        side = side.map(fail, kind="int64", name="fail")
    if where == "main":
        main = main.map(fail, name="fail")
    side_h = side.collect(parallelism=1)
    side.map(str, kind="str").write_text(str(tmp_path / "side"), parallelism=1)
    main_h = main.collect(parallelism=1)
    env.execute(timeout=180)
    assert fail.fired and env.last_execution.restarts == 1
    thirds = [x for x in range(n) if x % 3 == 0]
    assert sorted(side_h.result) == thirds                 # nothing lost, nothing twice
    assert sorted(int(x) for x in read_parts(tmp_path / "side")) == thirds
    assert not [f for f in os.listdir(tmp_path / "side") if f.startswith(".")]
    # the per-key counts in the main output went on from the restored state
    per_key = collections.Counter(x % 7 for x in range(n))
    assert sorted(main_h.result) == sorted((k, i) for k, c in per_key.items() for i in range(1, c + 1)
                                           if _nth_is_main(k, i, n))


def _nth_is_main(key, i, n):
    """Whether the i-th record (1-based) of key ``key`` went to the main output."""
    x = key + 7 * (i - 1)
    return x < n and x % 3 != 0


def test_window_late_records_are_exactly_once_across_a_failure(tmp_path):
    records = [(f"k{i % 3}", float(i) * 0.05 - (3.0 if i % 11 == 0 else 0.0)) for i in range(2000)]
    fail = FailOnceAfterCheckpoint(900)
    env = fb.Environment(checkpoint_interval=0.02, checkpoint_dir=tmp_path / "chk", restart_attempts=2, max_batch=1)
    fail.env = env
    res = (env.from_iterable(records, rate_limit=5_000).map(fail, name="fail")
              .assign_timestamps(lambda r: r[1], watermark_interval=0)
              .key_by(lambda r: r[0]).window(Tumbling(1))
              .aggregate(Count(), window_function=lambda k, w, n: (k, w.start, n)))
    late = res.late().collect()
    counts = res.collect()
    env.execute(timeout=180)
    assert fail.fired
    want_late, want_counts = _window_reference(records, 1.0)
    assert sorted(late.result) == sorted(want_late)
    assert sorted(counts.result) == sorted(want_counts)


def _window_reference(records, size):
    """Tumbling windows with watermark = max timestamp seen (after every
    record): (late records, (key, start, count) per window)."""
    wm = float("-inf")
    late, windows = [], collections.Counter()
    for k, t in records:
        start = t - t % size
        if start + size <= wm:
            late.append((k, t))
        else:
            windows[(k, start)] += 1
        wm = max(wm, t)
    return late, [(k, s, n) for (k, s), n in windows.items()]


# ---------------------------------------------------------------- differential

@settings(max_examples=int(os.environ.get("PYFLOWBUF_SIDE_EXAMPLES", "25")))
@given(values=st.lists(st.integers(-50, 50), max_size=200),
       routes=st.lists(st.lists(st.sampled_from(["main", "a", "b", "c"]), max_size=3), min_size=1, max_size=6),
       parallelism=st.integers(1, 3), chaining=st.booleans(), read=st.sets(st.sampled_from("abc")),
       keyed=st.booleans())
def test_routing_matches_a_plain_python_reference(values, routes, parallelism, chaining, read, keyed):
    """Each value goes to the outputs ``routes[value % len(routes)]`` lists
    (none, one, or several, repeats included): the records each output
    gets are those of the reference, as multisets."""
    tags = {name: fb.OutputTag(name, kind="int64") for name in "abc"}

    def route(x):
        return routes[x % len(routes)]

    def emit(x, ctx):
        out = []
        for where in route(x):
            if where == "main":
                out.append(x)
            else:
                ctx.output(tags[where], x)
        return out

    env = fb.Environment(parallelism=parallelism, chaining=chaining)
    src = env.from_collection(values)
    if keyed:
        main = src.key_by(lambda x: x % 4).process(lambda k, x, st, ctx: emit(x, ctx),
                                                   side_outputs=list(tags.values()), kind="int64")
    else:
        main = src.process(emit, side_outputs=list(tags.values()), kind="int64")
    got = {"main": main.collect()}
    for name in sorted(read):
        got[name] = main.side_output(tags[name]).collect()
    env.execute(timeout=120)
    want = collections.defaultdict(list)
    for x in values:
        for where in route(x):
            want[where].append(x)
    for name, handle in got.items():
        assert collections.Counter(handle.result) == collections.Counter(want[name]), name


# ---------------------------------------------------------------- errors

def test_output_tag_arguments_are_checked():
    with pytest.raises(errors.ConfigurationError, match="non-empty name"):
        fb.OutputTag("")
    with pytest.raises(errors.ConfigurationError, match="non-empty name"):
        fb.OutputTag(3)
    with pytest.raises(errors.ConfigurationError, match="not a record kind"):
        fb.OutputTag("x", kind="no-such-kind")
    assert fb.OutputTag("x", kind="int64") == fb.OutputTag("x", kind="int64")
    assert fb.OutputTag("x") != fb.OutputTag("x", kind="int64")
    assert repr(fb.OutputTag("x", kind="str")) == "OutputTag('x', kind='str')"
    import pickle
    assert pickle.loads(pickle.dumps(ODD)) == ODD


def test_declarations_are_checked_where_they_are_made():
    env = fb.Environment()
    src = env.from_sequence(0, 10)
    with pytest.raises(TypeError, match="side_outputs takes OutputTag"):
        src.process(lambda x, ctx: [x], side_outputs=["odd"])
    with pytest.raises(errors.ConfigurationError, match="two side outputs named 'x' with different kinds"):
        src.process(lambda x, ctx: [x], side_outputs=[fb.OutputTag("x", kind="int64"), fb.OutputTag("x", kind="str")])
    with pytest.raises(errors.ConfigurationError, match=r"fn\(record, ctx\)"):
        src.process(lambda x: [x])
    with pytest.raises(errors.ConfigurationError, match="takes no ctx"):
        src.key_by(lambda x: x).process(lambda k, x, st: [x], side_outputs=[ODD])
    with pytest.raises(errors.ConfigurationError, match="key_by both connected streams"):
        src.connect(src).process(lambda x, st: None, lambda x, st: None, side_outputs=[ODD])
    timed = src.assign_timestamps(lambda x: x).key_by(lambda x: x % 2).window(Tumbling(5))
    with pytest.raises(errors.ConfigurationError, match="reserved"):
        timed.process(lambda k, w, rs, ctx: None, side_outputs=[fb.OutputTag("late")])
    with pytest.raises(errors.ConfigurationError, match="cannot take"):
        timed.process(lambda k, w: None)


def test_side_output_of_a_stream_that_cannot_or_did_not_declare_it():
    env = fb.Environment()
    src = env.from_sequence(0, 10)
    with pytest.raises(errors.ConfigurationError, match="'map' cannot emit side outputs"):
        src.map(lambda x: x).side_output(ODD)
    with pytest.raises(errors.ConfigurationError, match="cannot emit side outputs"):
        src.side_output(ODD)
    main = src.process(lambda x, ctx: [x], side_outputs=[ODD])
    with pytest.raises(errors.ConfigurationError, match="did not declare the side output OutputTag\\('big'"):
        main.side_output(BIG)
    with pytest.raises(errors.ConfigurationError, match="declares the side output 'odd' with 'int64', not 'str'"):
        main.side_output(fb.OutputTag("odd", kind="str"))
    with pytest.raises(TypeError, match="takes an OutputTag"):
        main.side_output("odd")
    res = (src.assign_timestamps(lambda x: x).key_by(lambda x: x % 2).window(Tumbling(5))
              .aggregate(Count()))
    with pytest.raises(errors.ConfigurationError, match="result.late"):
        res.side_output(fb.OutputTag("late"))
    with pytest.raises(errors.ConfigurationError, match="did not declare"):
        res.side_output(ODD)


def _failing_job(fn, tags, kind=None):
    env = fb.Environment()
    main = env.from_sequence(0, 5).process(fn, side_outputs=tags, name="split")
    main.collect()
    for t in tags:
        main.side_output(t).collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=60)
    return info.value.__cause__


def test_emitting_to_an_undeclared_tag_fails_the_job_naming_the_operator_and_the_tags():
    cause = _failing_job(lambda x, ctx: ctx.output(BIG, str(x)), [ODD])
    assert isinstance(cause, errors.ConfigurationError)
    assert "'split'" in str(cause) and "did not declare" in str(cause) and "OutputTag('odd'" in str(cause)
    cause = _failing_job(lambda x, ctx: ctx.output(fb.OutputTag("odd", kind="str"), "1"), [ODD])
    assert isinstance(cause, errors.ConfigurationError) and "one kind" in str(cause)
    cause = _failing_job(lambda x, ctx: ctx.output("odd", x), [ODD])
    assert isinstance(cause, TypeError) and "ctx.output takes an OutputTag" in str(cause)
    cause = _failing_job(lambda x, ctx: ctx.output(ODD, x), [])
    assert isinstance(cause, errors.ConfigurationError) and "declared side outputs: none" in str(cause)


def test_a_side_record_that_does_not_fit_the_tags_kind_fails_naming_the_side_output():
    cause = _failing_job(lambda x, ctx: ctx.output(ODD, f"not a number {x}"), [ODD])
    assert isinstance(cause, errors.RecordTypeError)
    assert "split (side output 'odd')" in str(cause)


def test_a_window_function_cannot_emit_to_the_late_records():
    env = fb.Environment()
    res = (env.from_sequence(0, 10).assign_timestamps(lambda x: x).key_by(lambda x: x % 2).window(Tumbling(5))
              .process(lambda k, w, rs, ctx: ctx.output(fb.OutputTag("late"), 1)))
    res.collect()
    res.late().collect()
    with pytest.raises(errors.JobFailedError) as info:
        env.execute(timeout=60)
    assert isinstance(info.value.__cause__, errors.ConfigurationError)


def test_the_output_tag_docstring_example_runs():
    import inspect
    import textwrap
    doc = inspect.getdoc(fb.OutputTag)
    code = textwrap.dedent(doc.split("Example::", 1)[1])
    exec(compile(code, "<OutputTag example>", "exec"), {})


def test_the_operator_harness_shows_side_outputs():
    from pyflowbuf.testing import OperatorHarness

    env = fb.Environment()
    h = OperatorHarness(env.from_sequence(0, 10).process(split_odd_big, side_outputs=[ODD, BIG]))
    assert h.process([1, 2, 51, 52]) == [2, 52]
    assert h.side_output(ODD) == [1, 51]
    assert h.side_output(BIG) == ["big51", "big52"]
    with pytest.raises(errors.ConfigurationError, match="declares no side output"):
        h.side_output(fb.OutputTag("other"))
    res = (env.from_sequence(0, 10).assign_timestamps(lambda x: x).key_by(lambda x: x % 2)
              .window(Tumbling(5)).aggregate(Count()))
    res.late()
    w = OperatorHarness(res)
    w.process([1, 2])
    w.process_watermark(6.0)
    w.process([3])
    assert w.side_output(fb.OutputTag("late")) == [3]
    assert w.metrics["late_records_out"] == 1
