"""Key groups: the unit in which keyed state is stored and moved.

A key's group is ``stable_hash(key) % max_parallelism``; subtask ``i`` of an
operator with parallelism ``p`` owns the contiguous groups
``key_group_range(max_parallelism, p, i)``, as Flink's
KeyGroupRangeAssignment does. ``key_by`` routes a record to the subtask that
owns its key's group, and checkpoints store keyed state per group, so a
restore at another parallelism (up to ``max_parallelism``) hands every new
subtask exactly the groups of its range. ``max_parallelism`` itself is fixed
for the life of the job's state: changing it would move keys between groups.
"""
from __future__ import annotations

import numpy as np

from pyflowbuf import errors
# The formulas are defined once, in C (csrc/fb_serde.h), and this module
# uses the same functions as the RecordWriter's key_by routing: key_group (a
# key's group), key_group_range (the groups of a subtask) and key_group_owner
# (the subtask of a group), so routing and state assignment cannot disagree.
from pyflowbuf._core.serde import key_group, key_group_owner, key_group_range, key_groups, stable_hash  # noqa: F401

DEFAULT_MAX_PARALLELISM = 128      # Flink's default for small parallelisms
UPPER_BOUND = 1 << 15              # Flink's upper bound


def check_max_parallelism(value, parallelisms=()) -> int:
    """``value`` once it is an int in 1..UPPER_BOUND and at least every operator's
    parallelism in ``parallelisms`` ((name, parallelism) pairs)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= UPPER_BOUND:
        raise errors.ConfigurationError(
            f"max_parallelism must be an int in 1..{UPPER_BOUND} (the number of key groups), got {value!r}")
    for name, p in parallelisms:
        if p > value:
            raise errors.ConfigurationError(
                f"operator {name!r} has parallelism {p}, above max_parallelism={value}: each subtask owns at "
                "least one key group; raise max_parallelism (it cannot change later without losing the "
                "keyed state's placement) or lower the parallelism")
    return value


def operator_index(max_parallelism: int, parallelism: int, group: int) -> int:
    """The subtask of ``parallelism`` that owns key group ``group``: the
    subtask ``key_by`` routes the group's keys to."""
    return key_group_owner(max_parallelism, parallelism, group)


def group_index(keys, max_parallelism: int) -> np.ndarray:
    """The key group of each of ``keys`` (a list), as a uint16 array: one C
    call for the hashes. Checkpoints store it beside a keyed map, in the
    map's order, so a restore picks a range's entries without hashing."""
    return np.asarray(key_groups(keys, max_parallelism), dtype=np.uint16)


def flatten_timers(snap) -> tuple[list, list]:
    """A TimerQueue snapshot ``[(t, [keys])]`` as parallel lists (times, keys)."""
    times, keys = [], []
    for t, ks in snap or ():
        times.extend([t] * len(ks))
        keys.extend(ks)
    return times, keys


def timers_from(pairs) -> list:
    """``[(t, key)]`` in time order (ties in the order given) as a TimerQueue snapshot."""
    out: list = []
    for t, k in pairs:
        if out and out[-1][0] == t:
            out[-1][1].append(k)
        else:
            out.append((t, [k]))
    return out


# Incremental checkpoints re-write a group whose newest copy is older than
# this many checkpoints, so a checkpoint refers to at most this many earlier
# ones and retention never has to keep more than that many directories.
INCREMENTAL_MAX_AGE = 10
# Recording changed keys costs a set insert per record. When most groups
# change between two checkpoints anyway, a subtask stops recording and
# writes whole checkpoints, and records again over one interval in this
# many to see whether that still holds.
TRACK_PROBE_EVERY = 8
TRACK_DIRTY_FRACTION = 0.5


class GroupChain:
    """Which key groups of one keyed operator of one subtask an incremental
    checkpoint must write, and where the others already are.

    The task thread calls ``plan`` at each snapshot and ``confirm`` when a
    checkpoint completed (both in that thread, so no lock). A group is
    written when a key of it changed since the last snapshot, when a
    checkpoint not yet known complete wrote it (that copy may never count),
    when no complete checkpoint holds it, or when the copy it would refer to
    is ``INCREMENTAL_MAX_AGE`` checkpoints old; every other group refers to
    the complete checkpoint that holds it. Whatever goes wrong (a checkpoint
    aborted, a notification lost) makes later checkpoints write more, never
    less: a completion only ever confirms what that very checkpoint wrote.

    ``plan`` also says whether to record changed keys over the next
    interval: not while most groups change anyway (``TRACK_DIRTY_FRACTION``),
    probing again every ``TRACK_PROBE_EVERY`` checkpoints. An interval not
    recorded (``touched`` None) counts as every group changed.
    """

    def __init__(self, max_parallelism: int, start: int, end: int):
        self.max_parallelism = max_parallelism
        self.start, self.end = start, end
        self.held = np.full(end - start, -1, dtype=np.int64)   # complete checkpoint holding each group
        self.pending: dict[int, np.ndarray] = {}                 # checkpoint id -> groups it wrote (mask)
        self.untracked = 0                    # intervals in a row not recorded

    def plan(self, checkpoint_id: int, touched) -> tuple[list, dict, bool]:
        """The groups checkpoint ``checkpoint_id`` writes (absolute numbers),
        the others by the checkpoint that holds them (``{id: [groups]}``), and
        whether to record the next interval's changes. ``touched``: the keys
        changed since the last snapshot; None when they were not recorded."""
        if touched is None:
            written, refs = self._plan(checkpoint_id, None)
            self.untracked += 1
            return written, refs, self.untracked >= TRACK_PROBE_EVERY
        self.untracked = 0
        written, refs = self._plan(checkpoint_id, touched)
        return written, refs, self._dirty_fraction <= TRACK_DIRTY_FRACTION

    def _plan(self, checkpoint_id: int, touched) -> tuple[list, dict]:
        write = self.held < 0
        write |= self.held < checkpoint_id - INCREMENTAL_MAX_AGE
        self._dirty_fraction = 1.0
        if touched is None:
            write[:] = True
        elif touched:
            g = group_index(list(touched), self.max_parallelism).astype(np.int64) - self.start
            # a key outside the range is the operator's input not partitioned by this
            # job's key groups: the whole state is written and the write refuses it
            dirty = np.zeros(write.size, dtype=bool)
            dirty[g[(g >= 0) & (g < write.size)]] = True
            if g.size and (g.min() < 0 or g.max() >= write.size):
                dirty[:] = True
            self._dirty_fraction = float(dirty.mean())
            write |= dirty
        else:
            self._dirty_fraction = 0.0
        for mask in self.pending.values():
            write |= mask
        self.pending[checkpoint_id] = write
        if len(self.pending) > 64:           # never confirmed: the newest one covers the older ones
            del self.pending[min(self.pending)]
        refs: dict = {}
        for j in np.flatnonzero(~write).tolist():
            refs.setdefault(int(self.held[j]), []).append(j + self.start)
        return (np.flatnonzero(write) + self.start).tolist(), refs

    def confirm(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` completed: what it wrote is held there."""
        mask = self.pending.get(checkpoint_id)
        if mask is None:
            return
        self.held[mask] = checkpoint_id
        for n in [n for n in self.pending if n <= checkpoint_id]:
            del self.pending[n]
