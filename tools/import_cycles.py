"""Import graph of the pyflowbuf package and its circles.

Reads every ``pyflowbuf/**/*.py`` with ``ast`` (nothing is imported) and takes an
edge A -> B for each import in A of a pyflowbuf module B, wherever it sits:
module level, or inside a function or method (a lazy import hides a circle, it
does not remove it). Imports of anything outside pyflowbuf (numpy, and the
optional pyarrow, pandas, rich, ... that stay lazy) are not edges. Importing a
module runs its package's ``__init__`` too; that implied edge is left out, so
``from pyflowbuf import errors`` is an edge to ``pyflowbuf.errors`` only, and
``from pyflowbuf import Environment`` one to ``pyflowbuf`` itself.

    python tools/import_cycles.py            # the circles (strongly connected groups)
    python tools/import_cycles.py --lazy     # and every function-local pyflowbuf import

Exit status 1 when there is a circle.
"""
from __future__ import annotations

import ast
import os
import sys
from collections import defaultdict

PACKAGE = "pyflowbuf"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)


def module_files(root: str = ROOT) -> dict:
    """``{module name: path}`` of every .py file under ``root``."""
    base = os.path.dirname(root)
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), base)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(d, f)
    return out


def _imports(tree: ast.AST):
    """(node, lazy) for each import statement; lazy when inside a function."""
    def walk(node, lazy):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, inner)
    yield from walk(tree, False)


def _targets(node, module: str, is_package: bool, modules) -> list:
    """The pyflowbuf modules one import statement imports."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
        return [_longest_module(n, modules) for n in names if n.split(".")[0] == PACKAGE]
    if node.level:
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != PACKAGE:
        return []
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        out.append(sub if sub in modules else _longest_module(base, modules))
    return out


def _longest_module(name: str, modules) -> str:
    parts = name.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or name


def import_graph(root: str = ROOT):
    """``(edges, lazy)``: ``edges[a]`` is the set of pyflowbuf modules ``a``
    imports; ``lazy`` lists ``(module, line, target)`` of the imports inside functions."""
    files = module_files(root)
    edges = defaultdict(set)
    lazy = []
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        edges[module]
        for node, in_function in _imports(tree):
            for target in _targets(node, module, is_package, files):
                if target and target != module:
                    edges[module].add(target)
                    if in_function:
                        lazy.append((module, node.lineno, target))
    return dict(edges), lazy


def cycles(edges: dict) -> list:
    """The strongly connected groups of more than one module (each a sorted
    tuple), sorted: every import circle lies inside one of them."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        # iterative Tarjan: the graph is small, but recursion limits are not ours to spend
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        while work:
            node, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges.get(w, ())))))
                    break
                if w in on_stack:
                    low[node] = min(low[node], index[w])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        group.append(w)
                        if w == node:
                            break
                    if len(group) > 1:
                        groups.append(tuple(sorted(group)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(groups)


def cycle_path(edges: dict, group) -> list:
    """One circle through the first module of ``group``, as a list of modules
    (first == last), for a readable report."""
    members = set(group)
    start = group[0]
    prev = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for w in sorted(edges.get(node, ())):
            if w == start:
                path = [node]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, node, start]
            if w in members and w not in prev:
                prev[w] = node
                queue.append(w)
    return list(group)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    edges, lazy = import_graph()
    groups = cycles(edges)
    for group in groups:
        print(f"circle among {len(group)} modules: {', '.join(group)}")
        print("  e.g. " + " -> ".join(cycle_path(edges, group)))
    if "--lazy" in argv:
        for module, line, target in sorted(lazy):
            print(f"lazy import: {module}:{line} -> {target}")
    if not groups:
        print("no import circles")
    return 1 if groups else 0


if __name__ == "__main__":
    sys.exit(main())
