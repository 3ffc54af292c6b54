"""The output directory of a part-file sink (``write_text``, ``write_parquet``):
its one layout, what a run may find in it (``mode``), and which sink commits
a checkpoint may carry out.

Layout, whatever the settings: ``path`` is a directory of
``part-<subtask:05d>-<seq:06d><suffix>`` files. A part is written under the
hidden name ``.part-<subtask>-<seq><suffix>.inprogress`` and renamed to its
final name when it is committed: at the end of the job, or with checkpoints
when a checkpoint covering it completes. Readers (``read_parquet``,
``read_csv``, Spark, pyarrow) skip names starting with ``.`` or ``_``.

Modes, checked by the driver once before anything runs (Spark's save modes):

* ``"error"`` (default): the directory must hold no output (no name that does
  not start with ``.`` or ``_``), except, when the job restores a checkpoint,
  the part files of this sink's own subtasks;
* ``"overwrite"``: what the directory holds is removed first (on a restore:
  all but this sink's own part files);
* ``"append"``: what is there stays; this run's parts are numbered after the
  highest sequence number found, so no name can collide.

``path`` is a local path or any fsspec URL (``s3://bucket/out``,
``file:///shared/out``, ``memory://out`` in a job in one process): the
directory's files are listed, written, removed and renamed through ``os``
for a local path (the fast path) and through the URL's fsspec file system
otherwise (``connectors/filesystems.py``).

The sinks (``connectors/sinks.py``) are connector sinks (``fb.Sink``, run
by ``ConnectorSinkOperator``): a committable is the rename of one pending
part into its final name, ``["rename", pending path, final path]``,
committed where the connector sinks commit (in the subtask when a checkpoint
completes and on restore; by the driver for a subtask's last ones at the end
of input). Committables come back from checkpoints, so before any file moves
each is checked against the sink's own FileOutput (``check_renames``): a file
that is not a pending part of its directory is never moved.
"""
from __future__ import annotations

import logging
import os
import re

from pyflowbuf import errors
from pyflowbuf.connectors import api as connector_api
from pyflowbuf.checkpoint.errors import UnsafeCommitError
from pyflowbuf.connectors.filesystems import Directory, as_local, canonical, is_process_local, is_url, split

log = logging.getLogger("pyflowbuf")

MODES = ("error", "overwrite", "append")

_PART = r"part-(\d{5})-(\d{6})"


def check_mode(mode, what: str) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise errors.ConfigurationError(f"{what}: mode must be one of {MODES}, got {mode!r}")
    return mode


def _visible(name: str) -> bool:
    return not name.startswith((".", "_"))


class FileOutput:
    """The directory of one part-file sink, shared by its subtasks (and, forked,
    by worker processes): the driver's ``prepare`` sets ``seq_start``."""

    def __init__(self, path, suffix: str, mode: str = "error", what: str = "sink", legacy_suffixes=()):
        self.dir = Directory(path)
        self.path = self.dir.url        # an absolute local path, or a canonical URL
        self.suffix = suffix
        self.mode = mode
        self.what = what
        self.parallelism = None       # the sink's, set when it is declared
        self.seq_start = 0            # the first part number of a fresh run (append: after what is there)
        # set by a restore (runtime.restore.commit_outputs): whether the
        # checkpoint holds this sink's state under its operator id (None: an
        # older checkpoint that does not say)
        self.restored_state = None
        self.uid = None
        self.commit_key = None        # its sink's (connectors/api.py ``declare``), set by write_text/write_parquet
        self.declared_in = os.getpid()
        suffixes = "|".join(re.escape(s) for s in (suffix, *legacy_suffixes))
        self._final = re.compile(rf"{_PART}(?:{suffixes})\Z")
        self._pending = re.compile(rf"\.{_PART}(?:{suffixes})\.inprogress\Z")

    def __deepcopy__(self, memo):
        # one per sink: every copy of the sink (one per subtask, the driver's
        # for a final commit) sees what the driver decided (seq_start, the
        # restored parallelism) whenever the copy was made
        return self

    def check_process(self) -> None:
        """Refuse a ``memory://`` directory in a process other than the one
        that declared the sink (a forked worker, a Spark executor): what it
        wrote there would never reach the driver, which commits it."""
        if self.declared_in != os.getpid() and is_process_local(self.path):
            raise errors.ConfigurationError(
                f"{self.what}: {self.path} is in one process's memory, and this subtask runs in another "
                f"process (workers=N or a SparkCluster): its parts would be lost. Write to a file system "
                "every process reaches (a local path, file://, s3://, ...)")

    def part_path(self, subtask: int, seq: int, pending: bool) -> str:
        return self.dir.path(self.part_name(subtask, seq, pending))

    def part_name(self, subtask: int, seq: int, pending: bool) -> str:
        name = f"part-{subtask:05d}-{seq:06d}{self.suffix}"
        return f".{name}.inprogress" if pending else name

    def parse(self, name: str):
        """(subtask, seq, pending) of a part file name of this sink, else None."""
        for pattern, pending in ((self._final, False), (self._pending, True)):
            m = pattern.match(name)
            if m:
                return int(m.group(1)), int(m.group(2)), pending
        return None

    def _own(self, name: str) -> bool:
        p = self.parse(name)
        return p is not None and (self.parallelism is None or p[0] < self.parallelism)

    # ---- before the job runs (the driver, once) ----
    def prepare(self, *, restoring: bool, checkpoint_dir=None) -> None:
        """Apply ``mode`` to the directory; ``restoring``: the job starts from a
        checkpoint, so this sink's own part files are expected there."""
        path, d = self.path, self.dir
        if d.exists_as_file():
            if self.mode != "overwrite":
                raise errors.OutputExistsError(
                    f"{self.what}: {path} exists and is not a directory; the sink writes a directory of part "
                    "files: remove it, choose another path, or pass mode='overwrite'")
            d.remove_self()
        d.makedirs()
        names = sorted(d.names())
        # A sink restored without state (a new sink, or one whose derived id
        # moved) would number its parts from 0 again, over the ones there
        own = restoring and self.restored_state is not False
        foreign = [n for n in names if not (own and self._own(n))]
        if self.mode == "error":
            shown = [n for n in foreign if _visible(n)]
            if shown:
                more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
                why = ("that this job's checkpoint did not write" if own else
                       f"and the checkpoint being restored holds no state of this sink (operator id {self.uid!r}: "
                       "a new sink, or one whose derived id changed with the job; give each sink a stable id "
                       "with .uid(...))" if restoring else
                       "and the job does not restore a checkpoint that wrote it")
                raise errors.OutputExistsError(
                    f"{self.what}: the output directory {path} is not empty ({', '.join(shown[:3])}{more}) "
                    f"{why}: pass mode='overwrite' to replace its contents, mode='append' to add to them, "
                    "or choose another path")
        elif self.mode == "overwrite":
            if checkpoint_dir is not None and _inside(os.fspath(checkpoint_dir), path):
                raise errors.ConfigurationError(
                    f"{self.what}: mode='overwrite' would remove the checkpoint_dir {checkpoint_dir}, which is "
                    f"inside the output directory {path}: put them apart")
            for n in foreign:
                d.remove(n)
        else:   # append: after every part number already there
            seqs = [p[1] for p in map(self.parse, names) if p is not None]
            self.seq_start = max(seqs) + 1 if seqs else 0


def _inside(inner: str, outer: str) -> bool:
    a, b = as_local(inner), as_local(outer)
    if a is None or b is None:          # an object store's URL: the same only if spelt the same
        if (a is None) != (b is None):
            return False
        inner, outer = canonical(inner).rstrip("/"), canonical(outer).rstrip("/")
        return inner == outer or inner.startswith(outer + "/")
    inner, outer = os.path.realpath(a), os.path.realpath(b)
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def graph_outputs(nodes) -> list:
    return [n.file_output for n in nodes if n.file_output is not None]


def prepare_outputs(nodes, *, restoring: bool, checkpoint_dir=None) -> None:
    """The driver's step before a job runs: every part-file sink's ``mode``."""
    for out in graph_outputs(nodes):
        out.prepare(restoring=restoring, checkpoint_dir=checkpoint_dir)


# ---------------------------------------------------------------- commits

def commit_directory(action):
    """The directory (``directory_key``) a rename committable renames a
    file in; None for what is not a rename."""
    if (isinstance(action, (list, tuple)) and len(action) == 3 and action[0] == "rename"
            and isinstance(action[1], str) and action[1]):
        return _dir_key(split(action[1])[0])
    return None


def directory_key(directory: str) -> str:
    """What names one directory however it is spelt (see ``_dir_key``)."""
    return _dir_key(directory)


def _dir_key(directory: str) -> str:
    """What names one directory however it is spelt: the real local path, or
    the canonical URL."""
    return canonical(directory) if is_url(directory) else os.path.realpath(directory)


def check_renames(renames, output: FileOutput) -> list:
    """``(source name, target name)`` of each rename committable of the sink
    writing ``output``, once every one is checked: a committable read back
    from a checkpoint may have been planted there, so one this sink cannot
    have produced (``UnsafeCommitError``) refuses them all before any file
    moves: a source that is not a pending part file of a subtask of its
    directory, a target that is not that part's final name in the same
    directory, a ``..`` in either, a source or target that is a link."""
    dirs = {_dir_key(output.path): [output]}
    checked = []
    for action in renames:
        why = _refusal(action, dirs)
        if isinstance(why, str):
            raise UnsafeCommitError(
                f"refusing sink commit {action!r}: {why}; only the renames of the part files of {output.what} "
                f"run (directory {output.path})", action=action)
        checked.append(why[1:])
    return checked


def commit_renames(renames, output: FileOutput) -> None:
    """Rename each pending part into its final name, once all are checked
    (``check_renames``). Idempotent: a rename repeated after a failure (a
    checkpoint's completion may have been told and not carried out, or
    carried out and not told) changes nothing."""
    d = output.dir
    for src, dst in check_renames(renames, output):
        try:
            if d.has(src):
                d.rename(src, dst)
                continue
        except FileNotFoundError:       # renamed meanwhile by another commit of the same part
            pass
        if not d.has(dst):
            log.warning("pyflowbuf: committed file %s is missing (and %s too)", d.path(dst), d.path(src))


def run_commits(commits, outputs) -> None:
    """The sink commits the driver carries out: a finished sink subtask's last
    committables (``["connector", commit key, committables]``, see
    ``connectors/api.py``), when the job has ended or a checkpoint holding
    them completes or is restored. A checkpoint written before the part-file
    sinks were connector sinks (4628c8a and earlier) lists its renames
    (``["rename", pending part, final name]``) instead: each is handed, as a
    committable, to the sink of ``outputs`` (the job's FileOutputs) whose
    directory it renames in. Every action is checked before any runs: one
    that no sink of this job can have produced (read back from a crafted
    ``_metadata``) refuses them all (``UnsafeCommitError``)."""
    actions = _as_connector_commits(commits, outputs)
    sinks = [connector_api.checked_final_commit(a) for a in actions]
    for sink, action in zip(sinks, actions):
        connector_api.run_final_commit(action, sink)


def _as_connector_commits(commits, outputs) -> list:
    dirs = {}
    for out in outputs:
        dirs.setdefault(_dir_key(out.path), []).append(out)
    actions, legacy = [], {}
    for action in commits:
        if isinstance(action, (list, tuple)) and action and action[0] == "connector":
            actions.append(action)
            continue
        why = _refusal(action, dirs)
        if isinstance(why, str) or why[0].commit_key is None:
            why = why if isinstance(why, str) else f"{why[0].what} takes no commits"
            raise UnsafeCommitError(
                f"refusing sink commit {action!r}: {why}; only the renames of this job's part-file sinks "
                f"run (directories: {sorted(dirs) or 'none'})", action=action)
        legacy.setdefault(why[0].commit_key, []).append(list(action))
    return actions + [["connector", key, renames] for key, renames in legacy.items()]


def _refusal(action, dirs):
    if not isinstance(action, (list, tuple)) or not action:
        return "not a commit action"
    if action[0] != "rename":
        return f"unknown action {action[0]!r}"
    if len(action) != 3 or not all(isinstance(p, str) and p for p in action[1:]):
        return "a rename takes two paths"
    _, src, dst = action
    for p in (src, dst):
        if ".." in re.split(r"[/\\]", p.split("://", 1)[-1]):
            return f"{p!r} holds '..'"
    if is_url(src) != is_url(dst):
        return "the target is not in the source's directory"
    src_dir, src_name = split(src)
    dst_dir, dst_name = split(dst)
    here = _dir_key(src_dir)
    outs = dirs.get(here)
    if outs is None:
        return f"{src_dir!r} is not the directory of a sink of this job"
    if _dir_key(dst_dir) != here:
        return "the target is not in the source's directory"
    for out in outs:
        p = out.parse(src_name)
        if p is None or not p[2]:
            continue
        sub, seq, _ = p
        if out.parallelism is not None and sub >= out.parallelism:
            continue
        if out.parse(dst_name) != (sub, seq, False) or dst_name != src_name[1:-len(".inprogress")]:
            return f"{dst_name!r} is not the final name of {src_name!r}"
        if out.dir.is_link(src_name) or out.dir.is_link(dst_name):
            return "a part file is a link"
        return out, src_name, dst_name
    return f"{src_name!r} is not a pending part file of a sink subtask"
