"""The package's layout: import circles (tools/import_cycles.py) and the
function-local imports that used to hide them."""
import ast
import importlib.util
import os
import textwrap

import pytest

_TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "import_cycles.py")
_spec = importlib.util.spec_from_file_location("import_cycles", _TOOL)
import_cycles = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_cycles)
_MOVES_TOOL = os.path.join(os.path.dirname(_TOOL), "layout_moves.py")
_spec = importlib.util.spec_from_file_location("layout_moves", _MOVES_TOOL)
layout_moves = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layout_moves)

# The circles still there. This list may only shrink: remove an entry when its
# circle is gone (the test says so), never add one.
KNOWN_CIRCLES: set = set()

# Circles removed in issue 19, by moving the shared piece down a layer: each
# pair must not import each other, directly or through others, lazily or not.
REMOVED = [
    ("pyflowbuf.monitoring", "pyflowbuf.runtime.metrics"),
    ("pyflowbuf.time.timers", "pyflowbuf.time.watermarks"),
    ("pyflowbuf.serializers", "pyflowbuf.serializers_arrow"),
    ("pyflowbuf.connectors", "pyflowbuf.connectors.sources"),
    ("pyflowbuf.api.stream", "pyflowbuf.windows.operator"),
    ("pyflowbuf.api.windowed", "pyflowbuf.windows.aggregates"),
    # the stream classes and what window(), join() and interval_join() return:
    # those make their streams through the stream they came from (Stream._derive)
    ("pyflowbuf.api.stream", "pyflowbuf.api.windowed"),
    ("pyflowbuf.api.stream", "pyflowbuf.api.joined"),
]

# Function-local imports of pyflowbuf modules that are still there, as
# (importer, imported). Each should go (a top-level import) unless it stands for
# an optional dependency: serializers_arrow imports pyarrow and pandas; the
# demos and pyflowbuf.spark run only on request. May only shrink.
KNOWN_LAZY = {
    ("pyflowbuf.demo", "pyflowbuf"),
    ("pyflowbuf.demo", "pyflowbuf.experiments.backpressure"),
    ("pyflowbuf.demo", "pyflowbuf.spark.demo"),
    ("pyflowbuf.demo", "pyflowbuf.spark.cluster_demo"),     # pyspark is optional, as above
    ("pyflowbuf.demo", "pyflowbuf.windows"),
    ("pyflowbuf.serializers", "pyflowbuf.serializers_arrow"),
    ("pyflowbuf.spark.adapters", "pyflowbuf"),
    ("pyflowbuf.spark.demo", "pyflowbuf.spark"),
    ("pyflowbuf.spark.demo", "pyflowbuf.spark.metrics"),
    ("pyflowbuf.spark.session", "pyflowbuf"),
}


@pytest.fixture(scope="module")
def graph():
    return import_cycles.import_graph()


def test_no_import_circles_but_the_known_ones(graph):
    edges, _ = graph
    found = set(import_cycles.cycles(edges))
    new = {g: " -> ".join(import_cycles.cycle_path(edges, g)) for g in found - KNOWN_CIRCLES}
    assert not new, f"new import circles: {new}"
    gone = KNOWN_CIRCLES - found
    assert not gone, f"circles gone (well done): remove {sorted(gone)} from KNOWN_CIRCLES"


@pytest.mark.parametrize("a, b", REMOVED)
def test_removed_circles_stay_gone(graph, a, b):
    edges, _ = graph
    assert a in edges and b in edges, "a module was renamed: update REMOVED"
    for group in import_cycles.cycles(edges):
        assert not (a in group and b in group), import_cycles.cycle_path(edges, group)


def test_no_new_function_local_imports_of_pyflowbuf_modules(graph):
    _, lazy = graph
    found = {(module, target) for module, _, target in lazy}
    new = sorted(f"{m}:{line} -> {t}" for m, line, t in lazy if (m, t) not in KNOWN_LAZY)
    assert not new, ("import these at top level; a lazy import stays only for an optional dependency "
                     f"(then add it to KNOWN_LAZY, saying so): {new}")
    gone = KNOWN_LAZY - found
    assert not gone, f"lazy imports gone: remove {sorted(gone)} from KNOWN_LAZY"


# The layers, bottom-up (README "How it works"; each package's README.md). A
# module belongs to the layer of the longest entry that names it or a package
# above it; "pyflowbuf" names the top-level package module only. Each
# module-level import goes down to a lower layer or sideways within its own.
LAYERS = [
    ("foundation", ["pyflowbuf._core", "pyflowbuf.includes", "pyflowbuf.errors", "pyflowbuf._version",
                    "pyflowbuf.kinds", "pyflowbuf.config", "pyflowbuf.monitoring", "pyflowbuf.serializers",
                    "pyflowbuf.serializers_arrow", "pyflowbuf._validation"]),
    ("exchange", ["pyflowbuf.exchange", "pyflowbuf.net"]),
    ("checkpoint", ["pyflowbuf.checkpoint"]),
    ("operators", ["pyflowbuf.operators"]),
    ("time", ["pyflowbuf.time"]),
    ("windows", ["pyflowbuf.windows"]),
    ("connectors", ["pyflowbuf.connectors"]),
    ("jobgraph", ["pyflowbuf.jobgraph"]),         # the job description the runtime receives
    ("checkpointing", ["pyflowbuf.checkpointing"]),  # coordinator, a subtask's side, restore, rescaling
    ("ui", ["pyflowbuf.ui"]),                     # the web view: reads a job handle's public snapshots
    ("runtime", ["pyflowbuf.runtime"]),           # the job graph, the task, the coordinator, one job here
    ("cluster", ["pyflowbuf.cluster"]),
    ("api", ["pyflowbuf.api"]),
    ("spark", ["pyflowbuf.spark"]),
    ("applications", ["pyflowbuf", "pyflowbuf.__main__", "pyflowbuf.testing", "pyflowbuf.cli", "pyflowbuf.demo",
                      "pyflowbuf.experiments", "pyflowbuf.spark.demo", "pyflowbuf.spark.cluster_demo"]),
]


def layer_of(module: str) -> int:
    best, rank = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            hit = module == e if e == "pyflowbuf" else module == e or module.startswith(e + ".")
            if hit and len(e) > best:
                best, rank = len(e), i
    return rank


def module_level_imports():
    """(module, line, target) of every import outside a function."""
    files = import_cycles.module_files()
    out = []
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node, in_function in import_cycles._imports(tree):
            if in_function:
                continue
            for target in import_cycles._targets(node, module, path.endswith("__init__.py"), files):
                if target and target != module:
                    out.append((module, node.lineno, target))
    return out


def test_every_module_has_a_layer():
    modules = import_cycles.module_files()
    assert not [m for m in modules if layer_of(m) is None]
    named = {e for _, entries in LAYERS for e in entries}
    assert not named - set(modules), "a layer names a module that is gone: update LAYERS"


def test_imports_go_down_the_layers():
    up = sorted(f"{m}:{line} ({LAYERS[layer_of(m)][0]}) imports {t} ({LAYERS[layer_of(t)][0]})"
                for m, line, t in module_level_imports() if layer_of(t) > layer_of(m))
    assert not up, "imports up the layers:\n" + "\n".join(up)


def test_layer_check_sees_an_import_up(tmp_path):
    # the moved exchange sides importing the runtime would be caught
    assert layer_of("pyflowbuf.exchange.sides") < layer_of("pyflowbuf.runtime.job")
    assert layer_of("pyflowbuf.spark.demo") > layer_of("pyflowbuf.spark.cluster")
    assert layer_of("pyflowbuf") == len(LAYERS) - 1 and layer_of("pyflowbuf.errors") == 0


def test_the_stored_savepoint_names_no_module_path():
    # a stored format that named a module (a pickled class) would tie restores to
    # the layout; format 2 holds plain data only, so the moves of issue 19 need no
    # alias modules (tests/test_savepoints.py restores this savepoint)
    data = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "savepoint-format-2")
    for name in os.listdir(data):
        with open(os.path.join(data, name), "rb") as f:
            assert b"pyflowbuf." not in f.read(), name


def test_no_module_is_named_by_its_path_before_the_moves():
    # after merging a branch cut before the moves: python tools/layout_moves.py rewrite
    stale = [f"{path}:{line}: {what}" for path in layout_moves.files()
             for line, what in layout_moves.old_mentions(open(path, encoding="utf-8").read(), path)]
    assert not stale, "\n".join(stale)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for old, new in layout_moves.MOVES.items():
        assert not os.path.exists(os.path.join(root, "pyflowbuf", layout_moves._path(old))), old
        if old not in layout_moves.ARRIVING:
            assert importlib.util.find_spec(new) is not None, new


def test_the_rewrite_moves_imports_mentions_and_paths_once():
    text = ("from pyflowbuf.runtime import checkpointing as ckpt, outputs as sink_outputs, debloat  # why\n"  # layout_moves: keep
            "    from pyflowbuf.runtime.watermarks import NO_WATERMARK\n"  # layout_moves: keep
            "from pyflowbuf.runtime import exchange\n"  # layout_moves: keep
            "import pyflowbuf.net.control as cc\n"  # layout_moves: keep
            'monkeypatch.setattr("pyflowbuf.runtime.timers.schedule", f)\n'  # layout_moves: keep
            "see pyflowbuf/runtime/sinks.py and runtime/task/input.py, pyflowbuf.runtime.jobs\n")  # layout_moves: keep
    out = layout_moves.rewrite_text(text)
    assert out == ("from pyflowbuf.checkpointing import coordinator as ckpt  # why\n"
                   "from pyflowbuf.connectors import outputs as sink_outputs\n"
                   "from pyflowbuf.exchange import debloat\n"
                   "    from pyflowbuf.time.watermarks import NO_WATERMARK\n"
                   "from pyflowbuf.exchange import sides as exchange\n"
                   "import pyflowbuf.cluster.control_channel as cc\n"
                   'monkeypatch.setattr("pyflowbuf.time.timers.schedule", f)\n'
                   "see pyflowbuf/connectors/sinks.py and runtime/task/input.py, pyflowbuf.runtime.jobs\n")
    assert layout_moves.rewrite_text(out) == out
    assert layout_moves.old_mentions(out, "x.py") == []
    assert [w for _, w in layout_moves.old_mentions(text, "x.py")].count("pyflowbuf.runtime.timers") == 1  # layout_moves: keep
    assert layout_moves.rewrite_text("x = 'pyflowbuf.runtime.sinks'  # layout_moves: keep\n").count("runtime") == 1


def test_names_moved_between_modules_are_carried_and_not_left_behind():
    # issue 28 item 5: classes left a module that stays (operators/basic.py,
    # time/timers.py); the new module defines each, the old one no longer does
    # (it may import one it uses)
    for old, new in layout_moves.NAMES.items():
        (old_mod, name), (new_mod, new_name) = old.rsplit(".", 1), new.rsplit(".", 1)
        assert getattr(importlib.import_module(new_mod), new_name).__module__ == new_mod, new
        left = vars(importlib.import_module(old_mod)).get(name)
        assert left is None or left.__module__ == new_mod, f"{old} is still defined there"
    text = ("from pyflowbuf.operators.basic import Map, KeyedReduce, Operator as Op  # why\n"  # layout_moves: keep
            "from pyflowbuf.runtime.operators import Output\n"  # layout_moves: keep
            "x = pyflowbuf.time.timers.KeyedProcessOperator\n")  # layout_moves: keep
    out = layout_moves.rewrite_text(text)
    assert out == ("from pyflowbuf.operators.basic import Map  # why\n"
                   "from pyflowbuf.operators.keyed import KeyedReduce\n"
                   "from pyflowbuf.operators.contracts import Operator as Op\n"
                   "from pyflowbuf.operators.contracts import Output\n"
                   "x = pyflowbuf.time.process.KeyedProcessOperator\n")
    assert layout_moves.rewrite_text(out) == out and layout_moves.old_mentions(out, "x.py") == []
    left = layout_moves.old_mentions("from pyflowbuf.time.timers import (TimerQueue,\n"  # layout_moves: keep
                                     "    KeyedProcessFunction)\n", "x.py")
    assert left == [(1, "from pyflowbuf.time.timers import KeyedProcessFunction")]  # layout_moves: keep


# ---------------------------------------------------------------- the tool itself


def _package(tmp_path, files: dict):
    root = tmp_path / "pyflowbuf"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(root)


def test_tool_finds_a_circle_hidden_in_a_function(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pyflowbuf.b import thing\n",
        "b.py": "def thing():\n    from pyflowbuf import a\n    return a\n",
        "c.py": "import numpy\nfrom pyflowbuf import a\n",
    })
    edges, lazy = import_cycles.import_graph(root)
    assert import_cycles.cycles(edges) == [("pyflowbuf.a", "pyflowbuf.b")]
    assert import_cycles.cycle_path(edges, ("pyflowbuf.a", "pyflowbuf.b")) == ["pyflowbuf.a", "pyflowbuf.b",
                                                                               "pyflowbuf.a"]
    assert lazy == [("pyflowbuf.b", 2, "pyflowbuf.a")]
    assert edges["pyflowbuf.c"] == {"pyflowbuf.a"}          # numpy is not an edge


def test_tool_resolves_relative_imports_names_and_longer_circles(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from pyflowbuf.api import Env\n",
        "api.py": "from .sub import x\nclass Env: pass\n",
        "sub/__init__.py": "",
        "sub/x.py": "from ..sub import y\n",
        "sub/y.py": "import pyflowbuf.sub.z\n",
        "sub/z.py": "class Z:\n    def m(self):\n        from pyflowbuf import Env\n",
        "free.py": "from pyflowbuf import api\n",
    })
    edges, _ = import_cycles.import_graph(root)
    assert edges["pyflowbuf.api"] == {"pyflowbuf.sub.x"}
    assert edges["pyflowbuf.sub.x"] == {"pyflowbuf.sub.y"}
    assert edges["pyflowbuf.sub.z"] == {"pyflowbuf"}        # a name of the package, not a module
    assert edges["pyflowbuf.free"] == {"pyflowbuf.api"}
    assert import_cycles.cycles(edges) == [
        ("pyflowbuf", "pyflowbuf.api", "pyflowbuf.sub.x", "pyflowbuf.sub.y", "pyflowbuf.sub.z")]
