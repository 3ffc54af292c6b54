"""The .pyi stubs of the compiled _core modules declare what the modules
define: the same public names, the same public members per class, and the
same parameters (as the embedded signatures and the .pyx constructors say)."""
import ast
import importlib
import inspect
import pathlib
import re

import pytest

CORE = pathlib.Path(__file__).resolve().parents[1] / "pyflowbuf" / "_core"
MODULES = ("errors", "events", "memory", "channel", "serde", "netio")


def _public(names):
    return {n for n in names if not n.startswith("_")}


def _stub(name):
    return ast.parse((CORE / f"{name}.pyi").read_text(encoding="utf-8"))


def _stub_names(tree):
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                names[t.id] = node
        elif isinstance(node, ast.ImportFrom):
            # only `import X as X` re-exports a name from a stub
            names.update({a.asname: node for a in node.names if a.asname == a.name})
    return names


def _members(cls_node):
    out = {}
    for node in cls_node.body:
        if isinstance(node, ast.FunctionDef):
            out.setdefault(node.name, node)
        elif isinstance(node, ast.AnnAssign):
            out[node.target.id] = node
    return out


def _params(arglist):
    """Parameter names of a Cython argument list (types, `not None` and defaults dropped)."""
    parts, depth, cur = [], 0, ""
    for ch in arglist:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    names = []
    for p in parts:
        p = p.split("=")[0].replace("not None", "").strip()
        if p and p != "/":
            names.append(re.findall(r"[*]*\w+", p)[-1].lstrip("*"))
    return names


def _stub_params(fn):
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + ([a.vararg] if a.vararg else []) + a.kwonlyargs
            + ([a.kwarg] if a.kwarg else [])]


def _attrs(cls):
    """Everything a class defines, inherited members included (object's aside)."""
    out = {}
    for klass in reversed(cls.__mro__[:-1]):
        out.update(vars(klass))
    return out


def _constructor_params(mod_name, cls_name):
    src = (CORE / f"{mod_name}.pyx").read_text(encoding="utf-8")
    for pxi in CORE.glob("*.pxi"):
        src += "\n" + pxi.read_text(encoding="utf-8")
    body = re.search(rf"^cdef class {cls_name}\b.*?(?=^\S)", src + "\nEND", re.M | re.S).group(0)
    # __init__ when there is one: a __cinit__ beside it takes only self
    for kind in ("__init__", "__cinit__"):
        m = re.search(rf"^    def {kind}\((.*?)\):", body, re.M | re.S)
        if m:
            return kind, _params(m.group(1))
    return None, None


@pytest.mark.parametrize("name", MODULES)
def test_stub_declares_the_public_names_of_the_module(name):
    mod = importlib.import_module(f"pyflowbuf._core.{name}")
    defined = _public(n for n in dir(mod) if not inspect.ismodule(getattr(mod, n)))
    declared = _public(_stub_names(_stub(name)))
    assert declared == defined


@pytest.mark.parametrize("name", MODULES)
def test_stub_classes_declare_every_public_member_with_its_parameters(name):
    mod = importlib.import_module(f"pyflowbuf._core.{name}")
    for cls_name, node in _stub_names(_stub(name)).items():
        if not isinstance(node, ast.ClassDef):
            continue
        attrs = _attrs(getattr(mod, cls_name))
        members = _members(node)
        wanted = _public(attrs) | ({"__len__", "__iter__", "__next__"} & set(attrs))
        assert wanted - set(members) == set(), f"{cls_name}: not in the stub"
        assert _public(members) - _public(attrs) == set(), f"{cls_name}: stub declares what is not there"
        for meth, fn in members.items():
            doc = getattr(attrs.get(meth), "__doc__", None) or ""
            m = re.match(rf"{cls_name}\.{meth}\((.*?)\)", doc)
            if isinstance(fn, ast.FunctionDef) and m and not any(
                    isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
                assert _stub_params(fn) == _params(m.group(1)), f"{cls_name}.{meth}"
        ctor = members.get("__init__")
        kind, params = _constructor_params(name, cls_name)
        if ctor is not None:
            assert params is not None, f"{cls_name}: the stub has __init__, the .pyx has none"
            assert _stub_params(ctor) == params, f"{cls_name}.{kind}"
        else:
            # no constructor in the stub: the class is not made directly
            assert params is None or params == ["self", "args", "kwargs"], f"{cls_name}.{kind}"


@pytest.mark.parametrize("name", MODULES)
def test_stub_functions_have_the_embedded_parameters(name):
    mod = importlib.import_module(f"pyflowbuf._core.{name}")
    for fn_name, node in _stub_names(_stub(name)).items():
        if isinstance(node, ast.FunctionDef):
            m = re.match(rf"{fn_name}\((.*?)\)", getattr(mod, fn_name).__doc__ or "")
            assert m, fn_name
            assert _stub_params(node) == _params(m.group(1)), fn_name


def test_py_typed_marks_the_package():
    assert (CORE.parent / "py.typed").is_file()
