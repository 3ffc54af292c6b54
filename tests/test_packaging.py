"""What a source distribution and an installed package carry: the sources
the compiled core is built from (.pyx, .pxi, .pxd, csrc headers) and the type
information (.pyi stubs, py.typed), not the generated C."""
import pathlib
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CORE = ROOT / "pyflowbuf" / "_core"


def _setup(tmp_path, *args):
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), *args],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)


def _wanted():
    files = [p for ext in ("pyx", "pxi", "pxd", "pyi") for p in CORE.glob(f"*.{ext}")]
    files += list((ROOT / "pyflowbuf" / "includes").glob("*.pxd")) + list((ROOT / "csrc").glob("*.h"))
    files.append(ROOT / "pyflowbuf" / "py.typed")
    # every module of every package (the layers of issue 19 are packages: a new
    # folder without its __init__.py would be left out of the wheel)
    files += [p for p in (ROOT / "pyflowbuf").rglob("*.py") if "__pycache__" not in p.parts]
    return {str(p.relative_to(ROOT)) for p in files}


def test_sdist_carries_the_sources_of_the_core_and_no_generated_c(tmp_path):
    _setup(tmp_path, "sdist", "-d", str(tmp_path))
    (archive,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert _wanted() - names == set()
    assert [n for n in names if n.endswith(".c")] == []


def test_installed_package_carries_stubs_pxd_and_py_typed(tmp_path):
    out = tmp_path / "lib"
    _setup(tmp_path, "build_py", "-d", str(out))
    names = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    wanted = {n for n in _wanted() if n.startswith("pyflowbuf/") and not n.endswith(".pyx")}
    assert wanted - names == set()
