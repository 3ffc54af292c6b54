"""Where the files of file sources and part-file sinks are: a local path
(the fast path: ``os`` and the builtin ``open``) or an fsspec URL
(``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ``file://``, ``memory://``,
...), reached through the URL's fsspec file system.

A URL's files are named by canonical URLs (``file:///abs/dir/part-...``),
so a name means the same file in every process that reads it (a forked
worker, a Spark executor). ``memory://`` is one process's memory: fine in a
job in one process, refused where tasks run in other processes.

Example::

    from pyflowbuf.connectors import filesystems as fsx

    fsx.is_url("s3://bucket/events/")            # True
    with fsx.open_input("memory://in/a.csv") as fh:
        head = fh.read(100)
"""
from __future__ import annotations

import errno
import glob
import os
import re
import shutil

import fsspec

_URL = re.compile(r"[a-zA-Z][a-zA-Z0-9+.\-]*://")


def is_url(path) -> bool:
    """Whether ``path`` names its file system (``proto://...``); anything
    else is a local path."""
    return isinstance(path, str) and _URL.match(path) is not None


def url_fs(url: str):
    """``(fsspec file system, path inside it)`` of a URL."""
    return fsspec.core.url_to_fs(url)


def is_process_local(path) -> bool:
    """Whether a URL's files live in one process's memory (``memory://``)."""
    if not is_url(path):
        return False
    fs, _ = url_fs(path)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "memory" in protocols


def as_local(path):
    """The local path a path or a ``file://`` URL names; None for other URLs."""
    path = os.fspath(path)
    if not is_url(path):
        return os.path.abspath(path)
    fs, p = url_fs(path)
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return p if "file" in protocols or "local" in protocols else None


def canonical(path) -> str:
    """The absolute local path, or the URL with its file system's own spelling
    of the path (``memory://a`` -> ``memory:///a``)."""
    path = os.fspath(path)
    if not is_url(path):
        return os.path.abspath(path)
    fs, p = url_fs(path)
    return fs.unstrip_protocol(p)


def join(directory: str, name: str) -> str:
    return f"{directory.rstrip('/')}/{name}" if is_url(directory) else os.path.join(directory, name)


def split(path: str):
    """``(directory, name)``."""
    if is_url(path):
        d, _, name = path.rpartition("/")
        return d, name
    return os.path.split(path)


def basename(path: str) -> str:
    return split(path)[1]


# ---------------------------------------------------------------- reading

def open_input(path):
    """A binary file object for reading (seekable)."""
    if not is_url(path):
        return open(path, "rb")
    fs, p = url_fs(path)
    return fs.open(p, "rb")


def size(path) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = url_fs(path)
    return int(fs.size(p))


def read_at(path, offset: int, n: int, fh=None) -> bytes:
    """``n`` bytes at ``offset`` (of the open file ``fh`` when given)."""
    if fh is not None and not is_url(path):
        return os.pread(fh.fileno(), n, offset)
    if fh is not None:
        fh.seek(offset)
        return fh.read(n)
    if not is_url(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.pread(fd, n, offset)
        finally:
            os.close(fd)
    fs, p = url_fs(path)
    with fs.open(p, "rb") as f:
        f.seek(offset)
        return f.read(n)


def exists(path) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = url_fs(path)
    return fs.exists(p)


def isfile(path) -> bool:
    if not is_url(path):
        return os.path.isfile(path)
    fs, p = url_fs(path)
    return fs.isfile(p)


def isdir(path) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = url_fs(path)
    return fs.isdir(p)


def _hidden(name: str) -> bool:
    return name.startswith((".", "_"))


def list_tree(path) -> dict:
    """{file: (size, modification stamp)} of every file below the directory
    ``path``, a name starting with ``.`` or ``_`` skipped at any level
    (uncommitted parts, ``_SUCCESS``). Files named as ``path`` names them:
    joined local paths, or canonical URLs."""
    out = {}
    if not is_url(path):
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not _hidden(d))
            for f in files:
                if _hidden(f):
                    continue
                p = os.path.join(root, f)
                try:
                    st = os.stat(p)
                except OSError:
                    continue        # gone while listed
                out[p] = (st.st_size, st.st_mtime_ns)
        return out
    fs, root = url_fs(path)
    fs.invalidate_cache(root)
    root = root.rstrip("/")
    for name, info in fs.find(root, detail=True, withdirs=False).items():
        rel = name[len(root):].lstrip("/") if name.startswith(root) else name
        if any(_hidden(part) for part in rel.split("/")):
            continue
        out[fs.unstrip_protocol(name)] = (int(info.get("size") or 0), _stamp(info))
    return out


def glob_files(pattern) -> dict:
    """As ``list_tree``, for the files a glob pattern matches (hidden base names skipped)."""
    out = {}
    if not is_url(pattern):
        for p in glob.glob(pattern, recursive=True):
            if _hidden(os.path.basename(p)) or not os.path.isfile(p):
                continue
            try:
                st = os.stat(p)
            except OSError:
                continue
            out[p] = (st.st_size, st.st_mtime_ns)
        return out
    fs, p = url_fs(pattern)
    fs.invalidate_cache()
    for name, info in fs.glob(p, detail=True).items():
        if info.get("type") != "file" or _hidden(name.rsplit("/", 1)[-1]):
            continue
        out[fs.unstrip_protocol(name)] = (int(info.get("size") or 0), _stamp(info))
    return out


def _stamp(info):
    """A file's modification time as the file system reports it (keys differ
    between implementations); compared only for equality between scans."""
    for key in ("mtime", "LastModified", "last_modified", "updated", "modified", "created"):
        v = info.get(key)
        if v is not None:
            return str(v)
    return None


def not_found(what, why, path):
    return FileNotFoundError(errno.ENOENT, f"{what}: {why}", path)


# ---------------------------------------------------------------- a sink's directory

class Directory:
    """One output directory, a local path or a URL: what a part-file sink
    does there (list, remove, open for writing, rename), each through ``os``
    for a local path and through the URL's fsspec file system otherwise.
    Picklable (the file system travels by its arguments)."""

    def __init__(self, path):
        path = os.fspath(path)
        self.local = not is_url(path)
        if self.local:
            self.fs, self.root = None, os.path.abspath(path)
            self.url = self.root
        else:
            self.fs, root = url_fs(path)
            self.root = root.rstrip("/") or "/"
            self.url = self.fs.unstrip_protocol(self.root)

    def path(self, name: str) -> str:
        """What a commit action names: a local path or a canonical URL."""
        return join(self.url, name)

    def _p(self, name):
        return f"{self.root.rstrip('/')}/{name}"

    def makedirs(self):
        if self.local:
            os.makedirs(self.root, exist_ok=True)
        else:
            self.fs.makedirs(self.root, exist_ok=True)

    def exists_as_file(self) -> bool:
        if self.local:
            return os.path.lexists(self.root) and not os.path.isdir(self.root)
        return self.fs.isfile(self.root)

    def remove_self(self):
        if self.local:
            os.remove(self.root)
        else:
            self.fs.rm_file(self.root)

    def names(self) -> list:
        if self.local:
            return os.listdir(self.root)
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != self.root]

    def remove(self, name: str):
        if self.local:
            p = os.path.join(self.root, name)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            else:
                os.remove(p)
        else:
            self._rm(self._p(name))

    def _rm(self, p):
        # file by file: the generic rm expands glob characters in the names
        if self.fs.isdir(p):
            for f in self.fs.find(p, withdirs=False):
                self.fs.rm_file(f)
            try:
                self.fs.rmdir(p)
            except (OSError, NotImplementedError):
                pass        # object stores have no directories to remove
        else:
            self.fs.rm_file(p)

    def open_write(self, name: str, text: bool, encoding: str = "utf-8"):
        if self.local:
            p = os.path.join(self.root, name)
            return open(p, "w", encoding=encoding) if text else open(p, "wb")
        return self.fs.open(self._p(name), "w" if text else "wb", **({"encoding": encoding} if text else {}))

    def rename(self, src_name: str, dst_name: str):
        if self.local:
            os.replace(os.path.join(self.root, src_name), os.path.join(self.root, dst_name))
        elif type(self.fs).mv is not fsspec.AbstractFileSystem.mv:
            self.fs.mv(self._p(src_name), self._p(dst_name))     # the file system's own rename
        else:
            # the generic mv expands glob characters in the directory's name;
            # object stores copy and delete anyway (a repeat after a crash
            # between the two copies again: the commit stays idempotent)
            self.fs.cp_file(self._p(src_name), self._p(dst_name))
            self.fs.rm_file(self._p(src_name))

    def has(self, name: str) -> bool:
        if self.local:
            return os.path.exists(os.path.join(self.root, name))
        return self.fs.exists(self._p(name))

    def is_link(self, name: str) -> bool:
        if self.local:
            return os.path.islink(os.path.join(self.root, name))
        islink = getattr(self.fs, "islink", None)
        return bool(islink(self._p(name))) if islink is not None else False
