"""Which checkpoint a job starts from, and which one a restart goes back
to: ``restore_from`` resolved (``"latest"``, an id, a ``chk-<id>``
directory, a savepoint or a checkpoint copied elsewhere), the newest intact
checkpoint, the storage that holds a checkpoint's files, and what tells a
worker process where to find it."""
from __future__ import annotations

import os

from fsspec.implementations.local import LocalFileSystem

from pyflowbuf import errors
from pyflowbuf.checkpoint.storage import CorruptCheckpointError, SavepointStorage


def restore_id(restore_from) -> int | None:
    """The checkpoint id ``restore_from`` names: an int, or a str of digits
    (``restore_from="15"``, as ``pyflowbuf run --restore 15`` means it); None
    when it names something else. A directory named by digits is ``"./15"``."""
    if isinstance(restore_from, int) and not isinstance(restore_from, bool):
        return restore_from
    if isinstance(restore_from, str) and restore_from.isascii() and restore_from.isdigit():
        return int(restore_from)
    return None


def restore_plan(storage, restore_from, *, verify: bool = True):
    """The CheckpointMetadata to restore from: ``"latest"`` (None when there is
    none yet), a checkpoint id (an int or a str of digits), or a path: a
    ``chk-<id>`` directory, a savepoint, a checkpoint copied elsewhere."""
    if restore_from is None:
        return None
    if restore_from == "latest":
        return latest_checkpoint(storage, verify=verify)
    cid = restore_id(restore_from)
    if cid is not None:
        return storage.load_metadata(cid, verify=verify)
    if not isinstance(restore_from, (str, os.PathLike)) or isinstance(restore_from, bool):
        raise errors.ConfigurationError(
            f"restore_from must be 'latest', a checkpoint id, a chk-<id> directory or a savepoint directory, "
            f"got {restore_from!r}")
    path = os.fspath(restore_from).rstrip("/")
    name = os.path.basename(path)
    if name.startswith("chk-") and name[4:].isdigit():
        cid = int(name[4:])
        if not os.path.dirname(path) or _same_path(storage, path, storage.checkpoint_path(cid)):
            return storage.load_metadata(cid, verify=verify)
    # a savepoint, or a checkpoint directory copied elsewhere: self-contained
    sp = SavepointStorage(path, allow_pickle=storage.allow_pickle)
    return sp.load_metadata(sp.checkpoint_id, verify=verify)


def storage_of(storage, meta):
    """The storage that holds ``meta``'s files: the checkpoint_dir's, or the
    directory of a savepoint (or a copied checkpoint) on its own."""
    if not meta.path or meta.path == storage.fs.unstrip_protocol(storage.checkpoint_path(meta.checkpoint_id)):
        return storage
    return SavepointStorage(meta.path, allow_pickle=storage.allow_pickle, checkpoint_id=meta.checkpoint_id)


def restore_location(storage, meta):
    """What tells a worker process which checkpoint to restore: its id when it
    lies in the checkpoint_dir, else its directory."""
    return meta.checkpoint_id if storage_of(storage, meta) is storage else meta.path


def _same_path(storage, given: str, own: str) -> bool:
    strip = storage.fs._strip_protocol
    a, b = strip(given).rstrip("/"), strip(own).rstrip("/")
    if isinstance(storage.fs, LocalFileSystem):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b


def latest_checkpoint(storage, *, verify: bool = True, min_id: int = 0):
    """The newest intact complete checkpoint; None when there is none at all
    (a first run, or one that never completed a checkpoint). When complete
    checkpoints exist and every one is damaged: CorruptCheckpointError.
    Starting from scratch then would write again what they committed, so
    it must be asked for (``restore_from=None`` and the sinks' ``mode``).
    ``min_id``: only the checkpoints from that id on."""
    meta = storage.latest(verify=verify, min_id=min_id)
    if meta is not None:
        return meta
    broken = [info for info in storage.scan(verify=verify)
              if info.status == "CORRUPT" and info.checkpoint_id >= min_id]
    if not broken:
        return None
    what = "; ".join(f"chk-{info.checkpoint_id}: {info.error.reason}" for info in broken)
    raise CorruptCheckpointError(
        f"no intact checkpoint in {storage.url}, {len(broken)} damaged ({what}). Restoring none of them and "
        "starting from scratch would write again the output they committed: repair or restore them, or "
        "start from scratch on purpose with execute(restore_from=None) and mode='overwrite' on the file "
        "sinks (or another checkpoint_dir and output path)",
        checkpoint_id=broken[-1].checkpoint_id, path=broken[-1].path)


def restart_point(coordinator, started_from):
    """What a restart after a failure restores: the newest intact checkpoint
    of this run (numbered from ``coordinator.first_id`` on), else what the
    run started from (``started_from``: the restored checkpoint or savepoint,
    None for a fresh start). Never a checkpoint an earlier run of the job
    left in the directory: a run that started fresh (or from a savepoint)
    and failed before its first checkpoint would go on from that run's state."""
    meta = latest_checkpoint(coordinator.storage, verify=False, min_id=coordinator.first_id)
    return meta if meta is not None else started_from
