"""The ``Example::`` blocks of the job API's docstrings run, not only
compile: each in a fresh namespace that holds the names it assumes (an
``env``, streams such as ``lines``, ``orders`` or ``keyed``, small input
files in a temporary working directory), statement by statement. Where a
statement's comment states its value (``out.result  # [30, 10, 20]``, or a
comment line right after ``x = ...`` that is only a value), the value is
checked. An example that cannot run on its own would be listed in
``NOT_RUN`` with the reason (none is now); it still compiles
(test_public_api.py)."""
from __future__ import annotations

import ast
import inspect
import io
import tokenize

import pytest

import pyflowbuf as fb
from test_public_api import _DOCUMENTED, _examples, _public

# Examples that cannot run standalone, by the docstring (class.method) that
# holds them first: the reason says what they lack.
NOT_RUN: dict = {}

# Lines from inside a window function (key, window, records, ctx exist only
# there): they run as the body of one, fired by a harness.
IN_A_WINDOW_FUNCTION = {"WindowContext.current_processing_time", "WindowContext.output", "WindowContext.watermark"}
WINDOW_FUNCTION = """
from pyflowbuf.testing import OperatorHarness
big = fb.OutputTag("big")
ran = []

def fn(key, window, records, ctx):
{body}
    ran.append(window)
    return []

h = OperatorHarness(env.from_collection([("a", 1.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
                       .window(fb.Tumbling(10)).process(fn, side_outputs=[big]))
h.advance_processing_time(100.0)
h.process([("a", 1.0)], timestamps=[1.0])
h.process_watermark(10.0)
assert ran, "the window function did not run"
"""

# Examples that go on from a graph declared before them: the graph, put where
# the example has a line ``...`` (else before it).
GRAPH = "env.from_sequence(0, 100).map(lambda x: x + 1).collect()"
AFTER_A_GRAPH = {"Environment.checkpoints", "Environment.execute_async", "Environment.metrics", "Environment.plan"}

# Examples that go on from what a test did before: that code, run first.
# CLASS_EXAMPLE stands for the class's own example (its names: h, op, ...).
CLASS_EXAMPLE = "<the class's example>"
WINDOW_HARNESS = """
from pyflowbuf.testing import OperatorHarness
counts = (env.from_collection([("a", 1.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
             .window(fb.Tumbling(10)).aggregate(fb.Count(), window_function=lambda k, w, n: (k, w.start, n)))
h = OperatorHarness(counts)
h.process([("a", 1.0), ("a", 2.0)], timestamps=[1.0, 2.0])
"""
BEFORE = {
    "OperatorHarness.advance_processing_time": CLASS_EXAMPLE,
    "OperatorHarness.finish": CLASS_EXAMPLE,
    "OperatorHarness.process_watermark": CLASS_EXAMPLE,
    "OperatorHarness.process": CLASS_EXAMPLE + """
left = env.from_collection([("k", 0.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
right = env.from_collection([("k", 0.0)]).assign_timestamps(lambda r: r[1]).key_by(lambda r: r[0])
join = OperatorHarness(left.interval_join(right).between(-1.0, 1.0).process(lambda l, r: [(l, r)]))
""",
    "OperatorHarness.snapshot": CLASS_EXAMPLE + """
def make_operator():
    return KeyedProcessOperator("alarm", lambda r: r[0], lambda r: r[1], fn,
                                on_timer=lambda k, t, state, ctx: [(k, t)])
""",
    "OperatorHarness.side_output": "from pyflowbuf.testing import OperatorHarness",
    "OperatorHarness.state": WINDOW_HARNESS,
    "OperatorHarness.timers": WINDOW_HARNESS,
    "OperatorHarness.take": WINDOW_HARNESS,
    "OperatorHarness.metrics": WINDOW_HARNESS + """
h.process_watermark(10.0)
h.process([("a", 3.0)], timestamps=[3.0])       # its window has fired: late
""",
}


def _unique_examples():
    """(id, code, class example) for each distinct example, in the order of
    ``_DOCUMENTED``: an inherited method's example runs once."""
    seen = set()
    for cls in _DOCUMENTED:
        class_examples = _examples(inspect.getdoc(cls) or "")
        for name, doc in [("", inspect.getdoc(cls))] + list(_public(cls)):
            for i, code in enumerate(_examples(doc or "")):
                if code in seen:
                    continue
                seen.add(code)
                ident = f"{cls.__name__}.{name}" + (f"#{i + 1}" if i else "")
                yield ident, code, (class_examples[0] if class_examples else "")


EXAMPLES = list(_unique_examples())

# ---- the names the examples assume ----

EVENTS = [{"ts": float(i), "ts_ms": 1000 * i, "user": f"u{i % 3}", "page": f"/p{i % 2}", "score": i % 7,
           "amount": float(i), "latency": i % 5, "price": 1.0 + i} for i in range(20)]
ORDERS = [{"id": i, "customer": f"c{i % 3}", "amount": 10.0 * i, "item": f"i{i % 2}", "price": 1.0 + i % 4}
          for i in range(10)]
PAYMENTS = [{"order": i, "amount": 10.0 * i} for i in range(10)]
CLICKS = [{"ad": i % 3, "ts": float(i), "user": f"u{i % 2}"} for i in range(10)]


def _batches(env):
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"ts": [float(i) for i in range(8)], "word": ["a", "b"] * 4, "amount": [50.0, 150.0] * 4})
    return env.from_collection(table.to_batches(max_chunksize=4), kind="arrow")


def _rows(env):
    import numpy as np

    rows = np.zeros(8, dtype=[("key", "i8"), ("value", "f8")])
    return env.from_arrays([rows])


class _Db:
    """Stands for the user's database client."""

    def __init__(self):
        self.rows = []

    def insert(self, row):
        self.rows.append(row)

    def insert_many(self, rows):
        self.rows.extend(rows)


def _parse(line, ctx):
    """Stands for the user's parser: numbers on, anything else to the side
    output "bad"."""
    try:
        yield int(line)
    except ValueError:
        ctx.output(fb.OutputTag("bad"), line)


CONTEXT = {
    # streams
    "lines": lambda env: env.from_collection(["ERROR a b", "ok c"], kind="str"),
    "words": lambda env: env.from_collection(["a", "b", "a"], kind="str"),
    "events": lambda env: env.from_collection(EVENTS),
    "timed": lambda env: env.from_collection(EVENTS).assign_timestamps(lambda e: e["ts"]),
    "trades": lambda env: env.from_collection([{"sym": "X", "price": 1.0}]).assign_timestamps(lambda t: 0.0),
    "orders": lambda env: env.from_collection(ORDERS).assign_timestamps(lambda o: float(o["id"])),
    "payments": lambda env: env.from_collection(PAYMENTS).assign_timestamps(lambda p: float(p["order"])),
    "orders_by_user": lambda env: (env.from_collection(ORDERS).assign_timestamps(lambda o: float(o["id"]))
                                   .key_by(lambda o: o["customer"])),
    "clicks": lambda env: env.from_collection(CLICKS).assign_timestamps(lambda c: c["ts"]),
    "views": lambda env: env.from_collection(CLICKS).assign_timestamps(lambda c: c["ts"]),
    "purchases": lambda env: env.from_collection(CLICKS).assign_timestamps(lambda c: c["ts"]),
    "commands": lambda env: env.from_collection(["start", "stop"], kind="str"),
    "readings": lambda env: env.from_collection([1.5, 2.5]),
    "rules": lambda env: env.from_collection(["rule"], kind="str"),
    "s": lambda env: env.from_sequence(0, 10),
    "nums": lambda env: env.from_sequence(0, 10),
    "stream": lambda env: env.from_sequence(0, 10),
    "counts": lambda env: env.from_collection(["a,1"], kind="str"),
    "pairs": lambda env: env.from_collection([("a", 1), ("a", 2)]),
    "keyed": lambda env: env.from_collection(EVENTS).assign_timestamps(lambda e: e["ts"]).key_by(lambda e: e["user"]),
    "rows": _rows,
    "batches": _batches,
    "joined": lambda env: (env.from_collection(ORDERS).assign_timestamps(lambda o: float(o["id"]))
                           .join(env.from_collection(PAYMENTS).assign_timestamps(lambda p: float(p["order"])))
                           .where(lambda o: o["id"]).equal_to(lambda p: p["order"])),
    "a": lambda env: env.from_collection(ORDERS).assign_timestamps(lambda o: float(o["id"])).key_by(lambda o: o["id"]),
    "b": lambda env: (env.from_collection(PAYMENTS).assign_timestamps(lambda p: float(p["order"]))
                      .key_by(lambda p: p["order"])),
    # functions and objects
    "fn": lambda env: (lambda x: x),
    "expensive": lambda env: (lambda x: x),
    "add": lambda env: (lambda a, b: a + b),
    "parse": lambda env: _parse,
    "on_rule": lambda env: (lambda rule, state: None),
    "on_event": lambda env: (lambda event, state: [event]),
    "db": lambda env: _Db(),
    "k1": lambda env: (lambda o: o["id"]),
    "k2": lambda env: (lambda p: p["order"]),
    "tag": lambda env: fb.OutputTag("late"),
}

FILES = {
    "words.txt": "a b\nb\n",
    "users.csv": "name,age\nann,31\nbob,42\n",
    "events.csv": "ts,word,amount\n1.0,a,50.0\n2.0,b,150.0\n",
    "inbox/a.txt": "x\n",
}


def _parquet_files(tmp_path, code):
    """lines.parquet, and the folder events/: of Parquet files for an example
    that reads it with read_parquet, else of CSV files."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"ts": [1.0], "text": ["a"]}), tmp_path / "lines.parquet")
    (tmp_path / "events").mkdir()
    if "read_parquet" in code:
        pq.write_table(pa.table({"ts": [1.0], "word": ["a"], "amount": [1.0]}), tmp_path / "events" / "a.parquet")
    else:
        (tmp_path / "events" / "a.csv").write_text("ts,word,amount\n1.0,a,50.0\n")


def _namespace(code, tmp_path):
    used = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}
    env = fb.Environment()
    ns = {"fb": fb, "env": env, "__name__": "example"}
    ns.update({name: getattr(fb, name) for name in fb.__all__ if name in used})
    ns.update({name: make(env) for name, make in CONTEXT.items() if name in used})
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    _parquet_files(tmp_path, code)
    return ns


# ---- values stated in comments ----

def _comment(line):
    """The comment of one source line, or None."""
    try:
        for tok in tokenize.generate_tokens(io.StringIO(line + "\n").readline):
            if tok.type == tokenize.COMMENT:
                return tok.string[1:].strip()
    except (tokenize.TokenError, SyntaxError):
        pass
    return None


def _stated(comment, whole=False):
    """The value a comment states: its longest leading Python literal
    (``[(4.0, 7.0)], merged later`` states ``[(4.0, 7.0)]``), or, with
    ``whole``, the comment when it is a literal and nothing more."""
    if not comment:
        return None
    cuts = [len(comment)] if whole else [i for i, c in enumerate(comment) if c in ",:; "] + [len(comment)]
    for cut in sorted(cuts, reverse=True):
        text = comment[:cut].strip()
        if text.endswith(","):      # "[(4.0, 7.0)], merged later" is not a tuple
            continue
        try:
            return (ast.literal_eval(text),)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return None


def _run(code, ns, ident):
    """Runs ``code`` a statement at a time in ``ns``, checking the values its
    comments state."""
    lines = code.splitlines()
    for stmt in ast.parse(code).body:
        where = f"<{ident} example, line {stmt.lineno}>"
        claim = _stated(_comment(lines[stmt.end_lineno - 1]))
        if isinstance(stmt, ast.Expr) and claim is not None:
            expr = stmt.value
            if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "print":
                expr = expr.args[0]
            got = eval(compile(ast.Expression(expr), where, "eval"), ns)
            assert got == claim[0], f"{where}: {ast.unparse(stmt.value)} is {got!r}, its comment says {claim[0]!r}"
            continue
        exec(compile(ast.Module([stmt], type_ignores=[]), where, "exec"), ns)
        nxt = lines[stmt.end_lineno] if stmt.end_lineno < len(lines) else ""
        after = _stated(_comment(nxt), whole=True) if nxt.strip().startswith("#") else None
        if after is not None and isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Name):
            name = stmt.targets[0].id
            assert ns[name] == after[0], f"{where}: {name} is {ns[name]!r}, the comment after says {after[0]!r}"


def test_the_list_of_examples_not_run_is_current():
    """An entry of NOT_RUN names an example that exists (a renamed or fixed
    one leaves the list)."""
    ids = {ident for ident, _, _ in EXAMPLES}
    assert not set(NOT_RUN) - ids, set(NOT_RUN) - ids
    assert not set(BEFORE) - ids, set(BEFORE) - ids
    assert not IN_A_WINDOW_FUNCTION - ids, IN_A_WINDOW_FUNCTION - ids
    assert not AFTER_A_GRAPH - ids, AFTER_A_GRAPH - ids


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ident, code, class_example", EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_docstring_example_runs(ident, code, class_example, tmp_path, monkeypatch):
    if ident in NOT_RUN:
        pytest.skip(NOT_RUN[ident])
    monkeypatch.chdir(tmp_path)
    if ident in IN_A_WINDOW_FUNCTION:
        code = WINDOW_FUNCTION.format(body="\n".join("    " + line for line in code.splitlines()))
    if ident in BEFORE:
        code = BEFORE[ident].replace(CLASS_EXAMPLE, class_example) + "\n" + code
    if ident in AFTER_A_GRAPH:
        # an example that makes its own env has its graph at its "..." line
        lines = code.splitlines()
        at = next((i for i, line in enumerate(lines) if line.split("#")[0].strip() == "..."), None)
        if at is None or not any(isinstance(n, ast.Name) and n.id == "env" and isinstance(n.ctx, ast.Store)
                                 for n in ast.walk(ast.parse(code))):
            at = -1
        code = "\n".join([GRAPH] + lines if at < 0 else lines[:at] + [GRAPH] + lines[at + 1:])
    _run(code, _namespace(code, tmp_path), ident)


def test_a_value_that_a_comment_states_is_checked():
    with pytest.raises(AssertionError, match="its comment says 3"):
        _run("x = 1\nx + 1      # 3", {}, "wrong")
    with pytest.raises(AssertionError, match="the comment after says"):
        _run("x = [1]\n# [2]", {}, "wrong after")
    _run("x = 1\nx + 1      # 2, and more words\nprint(x)   # 1\ny = x\n# 1", {}, "right")


@pytest.mark.parametrize("comment, whole, value", [
    ("[(4.0, 7.0)], merged later with its neighbours", False, ([(4.0, 7.0)],)),
    ("(0.0, 10.0): holds 0 <= t < 10", False, ((0.0, 10.0),)),
    ("100 records", False, (100,)),
    ("'checkpoints/payments'", False, ("checkpoints/payments",)),
    ("one line per record", False, None),
    ('"a", "b", "a" -> ("a", 1)', True, None),
    ("[0, 1, 4]", True, ([0, 1, 4],)),
])
def test_what_a_comment_states(comment, whole, value):
    assert _stated(comment, whole) == value
