"""State assignment: which part of a checkpoint each subtask of the job being
started restores, whatever the parallelism it was taken at (Flink's
``StateAssignmentOperation``). ``RestorePlan`` (``restore.py``) reads the
state; the rules of who gets what are here, and only here:

* **keyed state** goes by key group. New subtask ``i`` of ``p`` owns the
  contiguous key groups ``key_groups(max_parallelism, p, i)`` (the one
  formula routing uses too: ``pyflowbuf.checkpoint.keygroups``) and reads the
  entries of those groups from every old subtask whose range overlaps it
  (``keyed_sources``); the keyless part of an old subtask's state (its
  counters) goes to one new subtask only, the one owning its first group;
* **per-subtask state** (an operator's own, not keyed) goes to the subtask of
  the same index at the same parallelism, else through the operator's
  ``rescale_state`` (``per_subtask_state``);
* **a source's positions** likewise, through the source's
  ``rescale_positions`` (``source_position``);
* **in-flight data** on a changed keyed edge goes by key group like keyed
  state (``pyflowbuf.checkpointing.inflight``, with ``key_groups``).

    >>> key_groups(128, 3, 1)
    (43, 86)
    >>> keyed_sources([(0, 64), (64, 128)], 43, 86)
    [(0, False), (1, True)]
    >>> source_position([10, 20], 0, 2)
    10
"""
from __future__ import annotations

from pyflowbuf import errors
from pyflowbuf.checkpoint.keygroups import key_group_range


def key_groups(max_parallelism: int, parallelism: int, index: int) -> tuple[int, int]:
    """The key groups ``[start, end)`` subtask ``index`` of ``parallelism``
    owns: where routing sends their keys, and whose state it restores."""
    return key_group_range(max_parallelism, parallelism, index)


def keyed_sources(old_ranges, start: int, end: int, migrated: bool = False) -> list:
    """Which old subtasks' keyed state a new subtask owning key groups
    ``[start, end)`` reads: ``old_ranges`` is each old subtask's ``(start,
    end)`` in order; returns ``[(position in old_ranges, owner)]``, ``owner``
    whether the new subtask takes that old subtask's keyless part (it owns
    its first group). ``migrated``: the keys were migrated, so their groups
    moved and every old subtask may hold some of the new subtask's keys."""
    out = []
    for j, (s0, e0) in enumerate(old_ranges):
        if not migrated and (e0 <= start or s0 >= end):
            continue
        out.append((j, start <= s0 < end))
    return out


def per_subtask_state(states: list, index: int, parallelism: int, rescale):
    """A state that is not keyed, of new subtask ``index`` of ``parallelism``:
    the old subtask of that index at the same parallelism, else ``rescale(states,
    index, parallelism)`` (the operator's own rule)."""
    if len(states) == parallelism:
        return states[index]
    return rescale(states, index, parallelism)


def source_position(positions: list, index: int, parallelism: int, rescale=None, name: str = "source",
                    uid=None):
    """The position new source subtask ``index`` of ``parallelism`` starts
    from: the old one's at the same parallelism, else its share of
    ``rescale(positions, parallelism)`` (the source's ``rescale_positions``;
    every subtask computes them all from the same positions and takes its
    own). A source that cannot redistribute them is refused at another
    parallelism (``ConfigurationError``)."""
    if len(positions) == parallelism:
        return positions[index]
    if rescale is None:
        raise errors.ConfigurationError(
            f"source {name!r} (uid {uid!r}) cannot hand its positions from parallelism "
            f"{len(positions)} to {parallelism}: restore it at parallelism {len(positions)}")
    return rescale(positions, parallelism)[index]
