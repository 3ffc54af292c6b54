"""A job's checkpoint directory belongs to that job (docs/checkpoints.md,
"Whose checkpoints: the job's directory").

* ``open_directory``: the lock a job's driver holds on the directory while
  it runs (``pyflowbuf.checkpoint.lock``); ``check_no_other_job``: the
  refusal of a directory that holds another job's checkpoints (this job
  would number its own after them and its retention would remove them).
* ``job_fingerprint``: what a checkpoint records of the job's stateful
  operators (``_metadata``'s ``properties["fingerprint"]``), beside its name
  (``properties["job"]``).
* ``check_restore_point`` / ``check_identity``: a checkpoint found by the
  job's own lookup ("latest", an id, a ``chk-<id>`` of its directory) must
  be the same job's: the same name and, by the fingerprint, some stateful
  operator in common (for jobs that kept the default name "job", the same
  stateful operators). A checkpoint or savepoint given by its path is the
  user's choice, and restores into a changed version of the job as it
  always did (operator ids decide).
"""
from __future__ import annotations

import logging
import posixpath
import warnings
from hashlib import blake2b

from pyflowbuf import errors
from pyflowbuf.checkpoint.errors import CheckpointDirectoryInUseError, IncompatibleCheckpointError
from pyflowbuf.checkpoint.lock import DirectoryLock, wait_for_ending_holder
from pyflowbuf.checkpoint.storage import CheckpointStorage
from pyflowbuf.config import DEFAULT_CHECKPOINT_DIR, _caller_stacklevel
from pyflowbuf.operators.contracts import Operator, type_name

log = logging.getLogger("pyflowbuf.checkpoint")

DEFAULT_JOB_NAME = "job"
FINGERPRINT_FORMAT = 1


# ---------------------------------------------------------------- fingerprint

def _stateful(node) -> tuple | None:
    """(type, keyed) of a node whose operator or source holds state, else None."""
    if node.source is not None:
        return ("source", False)
    if node.make_operator is None:
        return None
    op = node.make_operator()
    cls = type(op)
    if cls.keyed_state:
        return (type_name(op), True)
    if cls.snapshot_state is not Operator.snapshot_state:
        return (type_name(op), False)
    return None


def job_fingerprint(nodes, max_parallelism: int) -> dict:
    """What identifies a job's state beside its name: per stateful operator
    its explicit uid (``Stream.uid``; derived ids are left out, they follow
    the graph's shape), its type and whether it is keyed, and the job's
    ``max_parallelism``. Plain data, as ``_metadata`` stores it."""
    ops = []
    for n in nodes:
        if n.is_iterator:
            continue
        what = _stateful(n)
        if what is None:
            continue
        ops.append(f"{n.uid or '*'}|{what[0]}|{'keyed' if what[1] else 'plain'}")
    ops.sort()
    digest = blake2b(repr((FINGERPRINT_FORMAT, max_parallelism, ops)).encode(), digest_size=8).hexdigest()
    return {"format": FINGERPRINT_FORMAT, "digest": digest, "max_parallelism": max_parallelism, "operators": ops}


def _describe(fp: dict) -> str:
    ops = fp.get("operators") or []
    return ", ".join(o.replace("|", " ") for o in ops[:6]) + (f" and {len(ops) - 6} more" if len(ops) > 6 else "")


def another_job_by_fingerprint(old: dict | None, new: dict, job_name: str) -> str | None:
    """Why a checkpoint with fingerprint ``old`` is another job's than one
    with ``new`` although both have the name ``job_name``, or None. Without
    a recorded fingerprint (older checkpoints) nothing can be told."""
    if not isinstance(old, dict) or old.get("format") != FINGERPRINT_FORMAT:
        return None
    if old.get("digest") == new["digest"]:
        return None
    a, b = set(old.get("operators") or ()), set(new["operators"])
    if a and b and not a & b:
        return (f"its stateful operators ({_describe(old)}) have nothing in common with this job's "
                f"({_describe(new)})")
    if job_name == DEFAULT_JOB_NAME:
        # the default name tells two jobs apart by nothing: the state must be the very same
        return (f"both jobs kept the default name {DEFAULT_JOB_NAME!r}, and its stateful operators "
                f"({_describe(old)}) differ from this job's ({_describe(new)})")
    return None


# ---------------------------------------------------------------- restore

def check_identity(meta, storage, implicit: bool, job_name: str, fingerprint: dict) -> None:
    """Refuse to restore another job's checkpoint ``meta`` where the job's own
    lookup found it (``implicit``: "latest", an id, a ``chk-<id>`` of its
    checkpoint_dir). One given by path is the user's choice: a name that
    differs is logged, and operator ids decide what restores, as always."""
    if meta is None:
        return
    props = meta.properties or {}
    old_name = props.get("job")
    where = f"checkpoint chk-{meta.checkpoint_id} in {storage.url}" if implicit else \
        f"checkpoint {meta.checkpoint_id} ({meta.path})"
    if not implicit:
        if isinstance(old_name, str) and old_name != job_name:
            log.info("pyflowbuf: %s was taken of job %r; job %r restores it, as asked by its path",
                     where, old_name, job_name)
        return
    if isinstance(old_name, str) and old_name != job_name:
        raise IncompatibleCheckpointError(
            f"{where} belongs to job {old_name!r}, this job is {job_name!r}: one job's state would go on in "
            "another. Give each job its own checkpoint_dir (or leave it unset: each job then gets "
            f"{DEFAULT_CHECKPOINT_DIR}/<name>); to start this job from that state on purpose, restore it by "
            f"its path (restore_from={meta.path!r})")
    why = another_job_by_fingerprint(props.get("fingerprint"), fingerprint, job_name)
    if why is not None:
        raise IncompatibleCheckpointError(
            f"{where} belongs to another job named {job_name!r}: {why}. Give each job its own name "
            f"(execute('name') or Environment(name=...)) or checkpoint_dir; to restore it into this job on "
            f"purpose (a new version of it), give its path: restore_from={meta.path!r}")


def legacy_checkpoints(directory: str, job_name: str) -> str | None:
    """Where a job with the default directory finds none of its own: the
    newest checkpoint of this job that an earlier release left in
    ``checkpoints/`` itself (before each job had a directory), or None."""
    parent = posixpath.dirname(directory.rstrip("/"))
    if parent != DEFAULT_CHECKPOINT_DIR:
        return None
    try:
        owners = CheckpointStorage(parent).owners()
    except Exception:   # noqa: BLE001 - an unreadable parent holds nothing to point at
        return None
    mine = [cid for cid, job in owners.items() if job in (None, job_name)]
    return None if not mine else f"{parent}/chk-{max(mine)}"


# ---------------------------------------------------------------- a run

def check_restore_point(storage, restore_from, meta, spec, fingerprint: dict) -> None:
    """Before a job starts: the checkpoint ``restore_plan`` chose is this
    job's (``check_identity``), and a ``"latest"`` that found none in the
    job's own default directory does not start from scratch over
    checkpoints an earlier release left in ``checkpoints/`` itself."""
    if meta is not None:
        implicit = meta.path == storage.fs.unstrip_protocol(storage.checkpoint_path(meta.checkpoint_id))
        check_identity(meta, storage, implicit, spec.name, fingerprint)
        return
    if restore_from != "latest" or not spec.default_checkpoint_dir:
        return
    old = legacy_checkpoints(spec.checkpoint_config.directory, spec.name)
    if old is not None:
        raise errors.ConfigurationError(
            f"restore_from='latest': job {spec.name!r} has no checkpoint in its directory "
            f"{spec.checkpoint_config.directory}, but {old} is one of its checkpoints from before each job had a "
            f"directory of its own. Go on with that directory: checkpoint_dir={DEFAULT_CHECKPOINT_DIR!r} (used as "
            "it is); or start from scratch on purpose with restore_from=None")


class JobDirectory:
    """What a job's driver holds of its checkpoint directory while it runs:
    the lock, and the job's name and fingerprint for the checks."""

    def __init__(self, lock: DirectoryLock | None, job_name: str, fingerprint: dict):
        self.lock = lock
        self.job_name = job_name
        self.fingerprint = fingerprint

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()

    def ending(self) -> None:
        """The job was cancelled or stopped by its user: a new job of this
        process may wait for this lock's release (``open_directory``)."""
        if self.lock is not None:
            self.lock.ending = True


def open_directory(storage, job_name: str, fingerprint: dict) -> JobDirectory:
    """Take the job's checkpoint directory (``storage``'s) with its lock:
    ``CheckpointDirectoryInUseError`` while another job runs there."""
    lock = DirectoryLock(storage.fs, storage.root, job_name)
    try:
        lock._acquire()
    except CheckpointDirectoryInUseError as exc:
        if not wait_for_ending_holder(exc.holder, ENDING_JOB_WAIT_S):
            raise
        lock._acquire()
    return JobDirectory(lock, job_name, fingerprint)


ENDING_JOB_WAIT_S = 60.0     # how long a new job waits for a cancelled job of this process to end


def warn_fresh_start(storage, job_name: str) -> None:
    """A fresh start over an earlier run's checkpoints of the same job is
    allowed (a rerun starts fresh, as in Flink), but said: a rerun that meant
    to resume would otherwise read its input again and, once its own
    checkpoints complete, remove the ones it could have resumed from."""
    earlier = sorted(cid for cid, job in storage.owners().items() if job == job_name)
    if earlier:
        warnings.warn(errors.FreshStartWarning(
            f"checkpoint_dir {storage.url} holds checkpoints of an earlier run of job {job_name!r} (newest "
            f"chk-{earlier[-1]}); this run starts fresh, as restore_from was not given, and its retention "
            f"removes them once {storage.retained} checkpoint(s) of its own have completed. To resume instead, "
            "run with restore_from='latest' (pyflowbuf run --restore latest)"), stacklevel=_caller_stacklevel())


def check_no_other_job(storage, job_name: str) -> None:
    """Refuse a directory that holds another job's checkpoints: this job would
    number its own after them, and its retention would remove them (whether
    it starts fresh or restores a savepoint)."""
    others = {cid: job for cid, job in storage.owners().items() if job is not None and job != job_name}
    if others:
        newest = max(others)
        raise CheckpointDirectoryInUseError(
            f"checkpoint_dir {storage.url} holds checkpoints of job {others[newest]!r} (chk-{newest}"
            + (f" and {len(others) - 1} more" if len(others) > 1 else "") + f"); this job is {job_name!r}. "
            "This job would number its checkpoints after them and its retention would remove them: give this "
            f"job its own checkpoint_dir (or leave it unset: each job then gets {DEFAULT_CHECKPOINT_DIR}/<name>), "
            "or remove those checkpoints if they are no longer needed",
            path=storage.url, holder={"job": others[newest], "checkpoint": newest})
