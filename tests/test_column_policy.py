"""Grouping by columns: rank `i` of a replica is only ever grouped with rank `i` of other replicas."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import assert_consistent_order, simulate

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.columns import COLUMN_KINDS, ColumnPolicy, column_policy
from lightning_prague.core.grouping.policies import (
    MAX_REPLICA_SIZE,
    BufferPolicy,
    FirstReadyPolicy,
    RandomPolicy,
    make_policy,
    policy_from_spec,
)
from lightning_prague.core.plane.generator import GroupGenerator
from lightning_prague.core.records import MAX_INT, BadRecord

SELECTING = ("random", "buffer", "division")


def column_of(group, replica_size: int) -> int:
    """The one column every member of `group` is in (fails if they are in several)."""
    columns = {rank % replica_size for rank in group}
    assert len(columns) == 1, f"group {group} spans columns {sorted(columns)}"
    return columns.pop()


def assert_select_answer(group, requester: int, available, replica_size: int, group_size: int) -> None:
    if group is None:
        return
    assert requester in group and list(group) == sorted(set(group))
    assert set(group) <= set(available), f"{group} draws ranks that are not available"
    assert 2 <= len(group) <= group_size + 1  # buffer: a partition's last group may take one more
    assert column_of(group, replica_size) == requester % replica_size


def assert_form_answer(groups, ready, busy, replica_size: int, group_size: int) -> None:
    grouped = [rank for group in groups for rank in group]
    assert len(grouped) == len(set(grouped)), f"a rank is in two groups: {groups}"
    assert set(grouped) <= set(ready), f"{groups} groups ranks that are not ready"
    for group in groups:
        index = column_of(group, replica_size)
        assert 1 <= len(group) <= group_size
        if len(group) == 1:  # alone only when nobody of its column can come
            assert not [rank for rank in busy if rank % replica_size == index]


@pytest.mark.parametrize("name", SELECTING)
def test_select_draws_only_the_requesters_column(name):
    replicas, size, group = 5, 3, 3
    policy = column_policy(name, replicas, size, group, seed=4)
    assert (policy.kind, policy.world_size, policy.group_size) == ("columns", 15, 3)
    available = [r for r in range(15) if r not in (4, 9)]  # replica 1's and replica 3's index 1 and 0
    drawn = 0
    for round_index in range(6):
        for requester in available:
            members = policy.select(requester, round_index, available)
            assert_select_answer(members, requester, available, size, group)
            drawn += members is not None
    assert drawn > 0, "no request got a group"


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 6),
    st.integers(1, 4),
    st.sampled_from(COLUMN_KINDS),
    st.integers(0, 2**16),
    st.data(),
)
def test_every_group_is_within_one_column(replicas, size, name, seed, data):
    group = data.draw(st.integers(2, replicas))
    policy = column_policy(name, replicas, size, group, seed)
    world = replicas * size
    rng = random.Random(seed)
    for round_index in range(4):
        if policy.pools_ready:
            ranks = rng.sample(range(world), rng.randint(1, world))
            ready = ranks[: rng.randint(1, len(ranks))]
            busy = ranks[len(ready) :]
            for rank in ready:
                policy.on_ready(rank)
            assert_form_answer(policy.form(ready, busy), ready, busy, size, group)
        else:
            available = sorted(rng.sample(range(world), rng.randint(1, world)))
            for requester in available:
                members = policy.select(requester, round_index, available)
                assert_select_answer(members, requester, available, size, group)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 5), st.integers(1, 3), st.sampled_from(COLUMN_KINDS), st.integers(0, 2**16))
def test_the_generator_runs_columns_without_deadlock(replicas, size, name, seed):
    world = replicas * size
    generator = GroupGenerator(world, column_policy(name, replicas, size, 2, seed))
    steps = {rank: 1 + seed % 5 + rank % 3 for rank in range(world)}
    result = simulate(generator, steps, random.Random(seed))
    assert result.released and result.steps == steps
    assert_consistent_order(result)
    for members in result.groups.values():
        column_of(members, size)


def test_first_ready_never_groups_two_columns_and_columns_do_not_wait_on_each_other():
    policy = column_policy("first_ready", 3, 2, 2)  # ranks 0 2 4: column 0; ranks 1 3 5: column 1
    # one ready rank in each column: together they would make a group, but they are in different columns
    assert policy.form([0, 1], [2, 3, 4, 5]) == []
    # column 1 has two ready ranks: it forms its group while column 0's rank 0 keeps waiting
    assert policy.form([0, 1, 3], [2, 4, 5]) == [[1, 3]]
    # column 0's pool forms once a second rank of it reports, in arrival order
    assert policy.form([0, 4], [2, 1, 3, 5]) == [[0, 4]]


def test_first_ready_by_columns_through_the_generator():
    generator = GroupGenerator(6, column_policy("first_ready", 3, 2, 2))
    policy = generator.policy
    assert generator.handle({"op": "ready", "rank": 0, "req": 1}) == {}
    assert generator.handle({"op": "ready", "rank": 3, "req": 1}) == {}  # column 1: does not join rank 0
    out = generator.handle({"op": "ready", "rank": 5, "req": 1})
    assert set(out) == {3, 5} and out[3][0]["members"] == [3, 5]
    out = generator.handle({"op": "ready", "rank": 2, "req": 1})
    assert set(out) == {0, 2} and out[0][0]["members"] == [0, 2]
    # each report counted in its own column's mixing window only
    assert [column.reports for column in policy.columns] == [2, 2]
    policy.on_ready()  # a report of no rank named: every column
    assert [column.reports for column in policy.columns] == [3, 3]


@pytest.mark.parametrize("name", COLUMN_KINDS)
def test_one_rank_per_replica_behaves_like_the_inner_policy(name):
    replicas, group, seed = 6, 3, 11
    alone = make_policy(name, replicas, group, seed)
    columns = column_policy(name, replicas, 1, group, seed)
    rng = random.Random(seed)
    answers = 0
    for round_index in range(8):
        available = sorted(rng.sample(range(replicas), rng.randint(2, replicas)))
        if alone.pools_ready:
            busy = [r for r in range(replicas) if r not in available]
            alone.on_ready(available[0])
            columns.on_ready(available[0])
            expected = alone.form(available, busy)
            assert columns.form(available, busy) == expected
            answers += len(expected)
        else:
            for requester in available:
                expected = alone.select(requester, round_index, available)
                assert columns.select(requester, round_index, available) == expected
                answers += expected is not None
    assert answers > 0


def test_weights_and_restart_are_the_columns():
    policy = column_policy("first_ready", 4, 2, 2, weighting="staleness", alpha=0.5)
    assert policy.pools_ready and not policy.issues_per_round
    assert policy.weights([3, 1]) == FirstReadyPolicy(4, 2, weighting="staleness", alpha=0.5).weights([3, 1])
    buffered = column_policy("buffer", 4, 3, 2)
    assert buffered.issues_per_round and not buffered.pools_ready
    for requester in range(12):
        buffered.select(requester, 0, range(12))
    assert all(column._partitions for column in buffered.columns)
    buffered.restart()
    assert not any(column._partitions for column in buffered.columns)


@pytest.mark.parametrize("name", COLUMN_KINDS)
def test_spec_round_trip(name):
    policy = column_policy(name, 4, 3, 2, seed=7)
    spec = policy.spec()
    assert spec["kind"] == "columns" and spec["replica_size"] == 3 and spec["inner"]["seed"] == 7
    rebuilt = policy_from_spec(json.loads(json.dumps(spec)))
    assert isinstance(rebuilt, ColumnPolicy) and rebuilt.spec() == spec
    assert [column.seed for column in rebuilt.columns] == [7, 8, 9]
    if not policy.pools_ready:  # same seeds, same draws
        assert [rebuilt.select(r, 0, range(12)) for r in range(12)] == [
            policy.select(r, 0, range(12)) for r in range(12)
        ]


def test_columns_that_one_spec_cannot_describe_are_not_sent():
    policy = ColumnPolicy([RandomPolicy(4, 2, seed=1), RandomPolicy(4, 2, seed=1)], 2)
    with pytest.raises(ConfigurationError, match="column 1's policy is not column 0's seeded 2"):
        policy.spec()


@pytest.mark.parametrize(
    ("inner", "size", "match"),
    [
        ([RandomPolicy(4, 2), BufferPolicy(4, 2, 1)], 2, "column 1's policy .*BufferPolicy.* differs"),
        ([RandomPolicy(4, 2), RandomPolicy(5, 2, 1)], 2, "over 5 replicas.* differs"),
        ([RandomPolicy(4, 2)], 2, "has 2 columns, but 1 policies"),
        ([make_policy("static", 4, 2)], 1, "cannot run a StaticPolicy"),
        ([column_policy("random", 2, 1, 2)], 1, "cannot run a ColumnPolicy"),
        ([RandomPolicy(4, 2)] * 2, 0, "replica_size must be"),
    ],
)
def test_columns_that_are_not_one_policy_are_refused(inner, size, match):
    with pytest.raises(ConfigurationError, match=match):
        ColumnPolicy(inner, size)


def test_column_policy_refuses_kinds_and_sizes_it_cannot_run():
    with pytest.raises(ConfigurationError, match="grouping='static' cannot run by columns"):
        column_policy("static", 4, 2, 2)
    with pytest.raises(ConfigurationError, match="replica_size must be"):
        column_policy("random", 4, MAX_REPLICA_SIZE + 1, 2)
    with pytest.raises(ConfigurationError, match="group_size=5 is invalid for 4 workers"):
        column_policy("random", 4, 2, 5)


GOOD = column_policy("first_ready", 3, 2, 2, seed=5).spec()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"inner": GOOD}, BadRecord, "inner policy is of kind 'columns'"),
        ({"inner": make_policy("static", 3, 2).spec()}, BadRecord, "inner policy is of kind 'static'"),
        ({"inner": {**GOOD["inner"], "kind": "schedule"}}, BadRecord, "inner policy is of kind 'schedule'"),
        ({"inner": {**GOOD["inner"], "kind": "gossip"}}, BadRecord, "edges"),  # a gossip column without its graph
        ({"inner": {**GOOD["inner"], "kind": ["random"]}}, BadRecord, r"inner policy is of kind \"\['random'\]\""),
        ({"inner": "first_ready"}, BadRecord, "field 'inner' is 'first_ready', but it must be an object"),
        ({"inner": {"kind": "random"}}, BadRecord, "the 'random' policy: field 'world_size' is missing"),
        ({"inner": {**GOOD["inner"], "extra": 1}}, BadRecord, "the 'first_ready' policy: unknown field 'extra'"),
        ({"inner": {**GOOD["inner"], "seed": MAX_INT}}, BadRecord, "field 'seed' is"),
        ({"world_size": 7}, ConfigurationError, "for 7 workers .* makes 6 workers"),
        ({"group_size": 3}, ConfigurationError, "in groups of 3, but .* in groups of 2"),
        ({"replica_size": 1 << 20}, BadRecord, "field 'replica_size' is 1048576"),
        ({"replica_size": 1000}, ConfigurationError, "makes 3000 workers"),
        ({"replica_size": True}, BadRecord, "field 'replica_size' is True"),
        ({"replica_size": None}, BadRecord, "field 'replica_size' is None"),
        ({"depth": 4}, BadRecord, "unknown field 'depth'"),
    ],
)
def test_hostile_specs_are_refused(change, error, match):
    with pytest.raises(error, match=match):
        policy_from_spec({**GOOD, **change})


def test_a_spec_without_inner_is_refused():
    with pytest.raises(BadRecord, match="field 'inner' is missing"):
        policy_from_spec({k: v for k, v in GOOD.items() if k != "inner"})


def test_adpsgd_pairs_run_by_columns_and_travel_as_one_spec():
    """AD-PSGD's pairs over a bipartite graph of 4 replicas, in replicas of 2: an active rank's pair is
    the same index of a passive neighbour replica; a passive rank asks for none; the spec round trips."""
    from lightning_prague.core.grouping.bipartite import BipartiteGraph
    from lightning_prague.core.grouping.policies import GossipPolicy

    graph = BipartiteGraph.ring(4)
    policy = ColumnPolicy([GossipPolicy(graph, 7 + index) for index in range(2)], 2, 7)
    everyone = list(range(8))
    for rank in everyone:
        replica, index = divmod(rank, 2)
        pair = policy.select(rank, 0, everyone)
        if not graph.is_active(replica):
            assert pair is None
            continue
        assert pair is not None and rank in pair and len(pair) == 2
        other = next(r for r in pair if r != rank)
        assert other % 2 == index and other // 2 in graph.neighbors[replica]
    assert policy_from_spec(policy.spec()).spec() == policy.spec()
