"""Build the Cython/C core.

PYFLOWBUF_DEBUG=1 builds with FB_DEBUG (C assertions, Cython bounds checks,
line tracing) and -O0 -g; PYFLOWBUF_SANITIZE=1 adds ASan/UBSan.
"""
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

CYTHON_DEPENDENCY = "Cython>=3.0.10,<3.4"
MODULES = ["errors", "events", "memory", "channel", "serde", "netio"]


def _flag(name):
    return os.environ.get(name, "") not in ("", "0", "false", "no")


DEBUG = _flag("PYFLOWBUF_DEBUG")
SANITIZE = _flag("PYFLOWBUF_SANITIZE")
# PYFLOWBUF_NO_LIBSSL=1 builds the core without libssl: TLS then runs in the
# Python relay (pyflowbuf.net.tls.TLSRelay), at a fraction of the throughput
NO_LIBSSL = _flag("PYFLOWBUF_NO_LIBSSL")


def _openssl_include():
    """The folder holding openssl/ssl.h (OpenSSL >= 1.1.1), or None."""
    roots = [os.environ.get("OPENSSL_DIR", ""), "/usr", "/usr/local", "/opt/homebrew/opt/openssl@3",
             "/usr/local/opt/openssl@3"]
    for root in roots:
        inc = os.path.join(root, "include") if root else ""
        if inc and os.path.exists(os.path.join(inc, "openssl", "ssl.h")):
            return inc
    return None


class build_ext(_build_ext):
    user_options = _build_ext.user_options + [
        ("cython-always", None, "run cythonize() even if .c files are present"),
        ("cython-annotate", None, "produce annotated HTML files"),
        ("cython-directives=", None, "Cython compiler directives"),
    ]
    boolean_options = _build_ext.boolean_options + ["cython-always", "cython-annotate"]

    def initialize_options(self):
        super().initialize_options()
        self.cython_always = False
        self.cython_annotate = False
        self.cython_directives = None

    def finalize_options(self):
        if getattr(self, "_cythonized", False):
            return super().finalize_options()
        import Cython
        from Cython.Build import cythonize
        from packaging.requirements import Requirement

        req = Requirement(CYTHON_DEPENDENCY)
        if Cython.__version__ not in req.specifier:
            raise RuntimeError(f"pyflowbuf needs {CYTHON_DEPENDENCY}, found {Cython.__version__}")
        directives = {
            "language_level": 3,
            "freethreading_compatible": True,
            "boundscheck": DEBUG,
            "wraparound": False,
            "initializedcheck": DEBUG,
            "cdivision": True,
            "embedsignature": True,
        }
        if DEBUG:
            directives["linetrace"] = True
        if self.cython_directives:
            for item in self.cython_directives.split(","):
                k, _, v = item.partition("=")
                directives[k.strip()] = v.strip()
        self.distribution.ext_modules[:] = cythonize(
            self.distribution.ext_modules,
            compiler_directives=directives,
            annotate=self.cython_annotate or DEBUG,
            force=self.cython_always,
            include_path=["."],
        )
        self._cythonized = True
        super().finalize_options()


def extensions():
    import numpy

    macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
    cflags = ["-std=gnu11", "-Wall", "-Wno-unused-function", "-Wno-unreachable-code"]
    ldflags = []
    if DEBUG:
        macros += [("FB_DEBUG", "1"), ("CYTHON_TRACE_NOGIL", "1")]
        cflags += ["-O0", "-g"]
    else:
        cflags += ["-O3"]
    if SANITIZE:
        cflags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
        ldflags += ["-fsanitize=address,undefined"]
    if sys.platform.startswith("linux"):
        ldflags += ["-pthread"]
    ssl_inc = None if NO_LIBSSL else _openssl_include()
    if ssl_inc is None:
        print("pyflowbuf: no OpenSSL headers (openssl/ssl.h) found: TLS will run in the slower Python relay "
              "(install libssl-dev, or set OPENSSL_DIR)", file=sys.stderr)

    def tls(name):
        # only netio calls libssl (csrc/fb_tls.h)
        if name != "netio" or ssl_inc is None:
            return {}
        lib = os.path.join(os.path.dirname(ssl_inc), "lib")
        return {"macros": [("FB_HAVE_TLS", "1")], "include_dirs": [ssl_inc], "libraries": ["ssl", "crypto"],
                "library_dirs": [lib] if os.path.isdir(lib) and ssl_inc != "/usr/include" else []}

    return [
        Extension(
            f"pyflowbuf._core.{name}",
            [f"pyflowbuf/_core/{name}.pyx"],
            include_dirs=["csrc", numpy.get_include()] + tls(name).get("include_dirs", []),
            define_macros=macros + tls(name).get("macros", []),
            libraries=tls(name).get("libraries", []),
            library_dirs=tls(name).get("library_dirs", []),
            extra_compile_args=cflags,
            extra_link_args=ldflags,
            depends=[os.path.join("csrc", f) for f in os.listdir("csrc")],
        )
        for name in MODULES
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": build_ext})
