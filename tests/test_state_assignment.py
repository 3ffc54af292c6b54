"""State assignment (``pyflowbuf.checkpointing.assignment``): who restores
which key groups and positions, against routing and against a model."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyflowbuf import errors
from pyflowbuf.checkpoint import keygroups as kg
from pyflowbuf.checkpointing import assignment


@st.composite
def parallelisms(draw):
    maxp = draw(st.integers(1, 512))
    return maxp, draw(st.integers(1, maxp)), draw(st.integers(1, maxp))


@settings(max_examples=200, deadline=None)
@given(parallelisms(), st.data())
def test_a_subtask_restores_the_key_groups_routing_sends_it(ps, data):
    maxp, p, _ = ps
    ranges = [assignment.key_groups(maxp, p, i) for i in range(p)]
    # contiguous, disjoint, covering every group, in subtask order
    assert ranges[0][0] == 0 and ranges[-1][1] == maxp
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    group = data.draw(st.integers(0, maxp - 1))
    owner = kg.operator_index(maxp, p, group)          # where key_by routes the group's keys
    start, end = ranges[owner]
    assert start <= group < end


@settings(max_examples=200, deadline=None)
@given(parallelisms())
def test_keyed_state_of_any_old_parallelism_reaches_exactly_its_new_owners(ps):
    maxp, p1, p2 = ps
    old = [assignment.key_groups(maxp, p1, j) for j in range(p1)]
    keyless_owners = {j: 0 for j in range(p1)}
    for i in range(p2):
        start, end = assignment.key_groups(maxp, p2, i)
        got = assignment.keyed_sources(old, start, end)
        assert [j for j, _ in got] == [j for j, (s, e) in enumerate(old) if s < end and e > start]
        for j, owner in got:
            keyless_owners[j] += owner
            assert owner == (start <= old[j][0] < end)
        assert [j for j, _ in assignment.keyed_sources(old, start, end, migrated=True)] == list(range(p1))
    # an old subtask's keyless part (its counters) goes to exactly one new subtask
    assert set(keyless_owners.values()) == {1}


def test_per_subtask_state_and_source_positions():
    assert assignment.per_subtask_state(["a", "b"], 1, 2, None) == "b"
    assert assignment.per_subtask_state(["a", "b"], 0, 3, lambda s, i, p: (s, i, p)) == (["a", "b"], 0, 3)
    assert assignment.source_position([5, 7], 1, 2) == 7
    assert assignment.source_position([5, 7], 2, 3, lambda pos, p: [pos, p, "x"]) == "x"
    with pytest.raises(errors.ConfigurationError, match=r"source 'numbers' \(uid 'n'\) cannot hand its positions "
                                                        r"from parallelism 2 to 3"):
        assignment.source_position([5, 7], 0, 3, None, "numbers", "n")


def test_the_module_examples_run():
    import doctest

    assert doctest.testmod(assignment).failed == 0
