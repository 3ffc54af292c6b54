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

from pyflowbuf import errors
from pyflowbuf._core.serde import key_groups, stable_hash

DEFAULT_MAX_PARALLELISM = 128      # Flink's default for small parallelisms
UPPER_BOUND = 32768                # Flink's upper bound (1 << 15)


def check_max_parallelism(value, parallelisms=()) -> int:
    """``value`` once it is an int in 1..32768 and at least every operator's
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


def key_group(key, max_parallelism: int) -> int:
    """The key group of ``key``."""
    return stable_hash(key) % max_parallelism


def key_group_range(max_parallelism: int, parallelism: int, index: int) -> tuple[int, int]:
    """The groups subtask ``index`` of ``parallelism`` owns: ``[start, end)``."""
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end = ((index + 1) * max_parallelism + parallelism - 1) // parallelism
    return start, end


def operator_index(max_parallelism: int, parallelism: int, group: int) -> int:
    """The subtask of ``parallelism`` that owns key group ``group``."""
    return group * parallelism // max_parallelism


def group_keys(keys, max_parallelism: int) -> dict:
    """{group: [keys]} for ``keys`` (any iterable), in one C call for the hashes."""
    keys = list(keys)
    out: dict = {}
    for k, g in zip(keys, key_groups(keys, max_parallelism)):
        bucket = out.get(g)
        if bucket is None:
            out[g] = [k]
        else:
            bucket.append(k)
    return out


def split_dict(d: dict, max_parallelism: int, key_of=None) -> dict:
    """{group: {k: v}} of a dict whose keys are the records' keys (or hold
    them: ``key_of(k)`` gives the record key, e.g. a window's (key, start, end))."""
    if not d:
        return {}
    ks = list(d)
    hashed = ks if key_of is None else [key_of(k) for k in ks]
    out: dict = {}
    for k, g in zip(ks, key_groups(hashed, max_parallelism)):
        part = out.get(g)
        if part is None:
            out[g] = part = {}
        part[k] = d[k]
    return out


def split_timers(snap, max_parallelism: int, key_of=None) -> dict:
    """{group: [(t, [keys])]} of a TimerQueue snapshot ``[(t, [keys])]``."""
    out: dict = {}
    for t, keys in snap or ():
        hashed = keys if key_of is None else [key_of(k) for k in keys]
        for k, g in zip(keys, key_groups(hashed, max_parallelism)):
            part = out.setdefault(g, [])
            if part and part[-1][0] == t:
                part[-1][1].append(k)
            else:
                part.append((t, [k]))
    return out


def merge_timers(parts) -> list:
    """The TimerQueue snapshot of several groups' timers, in time order."""
    at: dict = {}
    for part in parts:
        for t, keys in part or ():
            at.setdefault(t, []).extend(keys)
    return [(t, at[t]) for t in sorted(at)]
