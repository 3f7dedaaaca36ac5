"""Topologies: every round is a partition with a doubly stochastic mixing matrix; errors name the problem."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.policies import StaticPolicy
from lightning_prague.core.grouping.topology import (
    alternating_exp_ring,
    complete,
    is_doubly_stochastic,
    make_topology,
    one_peer_exp,
    prague_static,
    ring,
    schedule_from_spec,
    static_schedule,
)


def assert_valid(schedule):
    for r in range(schedule.period):
        seen = sorted(rank for group in schedule.groups(r) for rank in group.members)
        assert seen == list(range(schedule.world_size)), f"round {r} is not a partition: {seen}"
        w = schedule.mixing_matrix(r)
        assert is_doubly_stochastic(w) and torch.equal(w, w.T)
        for rank in range(schedule.world_size):
            assert rank in schedule.group_of(rank, r).members


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 40))
def test_complete_and_ring_are_valid_for_every_world_size(n):
    assert_valid(complete(n))
    schedule = ring(n)
    assert_valid(schedule)
    assert schedule.period == 2
    for r in range(2):  # one peer per round, on alternating sides of the ring
        for group in schedule.groups(r):
            assert len(group.members) <= 2
            if len(group.members) == 2:
                a, b = group.members
                assert (b - a) % n in (1, n - 1)
    alone = [g.members[0] for r in range(2) for g in schedule.groups(r) if len(g.members) == 1]
    assert len(alone) == (0 if n % 2 == 0 else 2)
    if n % 2 and n > 1:
        assert alone[0] != alone[1], "with odd n a different worker sits out in each round"


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32])
def test_one_peer_exp_pairs_at_powers_of_two_and_averages_exactly_after_a_period(n):
    schedule = one_peer_exp(n)
    assert_valid(schedule)
    assert schedule.period == n.bit_length() - 1
    for r in range(schedule.period):
        assert all(g.members[1] - g.members[0] == 2**r for g in schedule.groups(r))
    product = torch.eye(n, dtype=torch.float64)
    for r in range(schedule.period):
        product = schedule.mixing_matrix(r) @ product
    torch.testing.assert_close(product, torch.full((n, n), 1.0 / n, dtype=torch.float64))


@pytest.mark.parametrize("n", [3, 6, 12])
def test_one_peer_exp_rejects_other_world_sizes_and_says_why(n):
    with pytest.raises(ConfigurationError, match="power of two.*got " + str(n)):
        one_peer_exp(n)


@pytest.mark.parametrize(("n", "per_node"), [(8, 2), (8, 4), (12, 2), (12, 3), (16, 4), (4, 4), (6, 1), (32, 8)])
def test_alternating_exp_ring_staggers_the_inter_node_link(n, per_node):
    schedule = alternating_exp_ring(n, per_node)
    assert_valid(schedule)  # and the constructor checked that the rounds connect every worker
    nodes = n // per_node
    for r in range(schedule.period):
        crossing = dict.fromkeys(range(nodes), 0)
        for group in schedule.groups(r):
            node_ids = {m // per_node for m in group.members}
            if len(node_ids) == 1:
                continue  # inside one node
            # one worker of each node of a pair, the same local rank
            assert len(node_ids) == 2 and len({m % per_node for m in group.members}) == 1
            for node in node_ids:
                crossing[node] += 1
        if per_node > 2:  # staggered: one worker of a node uses the inter-node link at a time
            assert all(count <= 1 for count in crossing.values())
            assert nodes == 1 or any(crossing.values())


def test_alternating_exp_ring_needs_whole_nodes():
    with pytest.raises(ConfigurationError, match="10 workers cannot be split into nodes of workers_per_node=4"):
        alternating_exp_ring(10, 4)


def test_prague_static_schedule_reproduces_the_reference_cycle_for_4_workers_per_node():
    # 2 nodes of 4: inter-node group of local rank 0 + pairs (2, 3); node averages; inter-node group
    # of local rank 1 + pairs (0, 3); node averages (the local rank left out sits the round out)
    cycle = [sorted(static_schedule(8, 4, r)) for r in range(4)]
    assert cycle == [
        sorted([(0, 4), (2, 3), (6, 7), (1,), (5,)]),
        [(0, 1, 2, 3), (4, 5, 6, 7)],
        sorted([(1, 5), (0, 3), (4, 7), (2,), (6,)]),
        [(0, 1, 2, 3), (4, 5, 6, 7)],
    ]
    assert prague_static(8, 4).period == 4
    assert static_schedule(8, 4, 4) == static_schedule(8, 4, 0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 24), per_node=st.integers(1, 6))
def test_prague_static_schedule_is_a_valid_topology_and_drives_the_static_policy(n, per_node):
    schedule = prague_static(n, per_node)
    assert_valid(schedule)
    policy = StaticPolicy(n, 2, workers_per_node=per_node)
    for r in range(schedule.period):
        for rank in range(n):
            members = policy.select(rank, r, list(range(n)))
            group = policy.schedule.group_of(rank, r).members
            assert members == (group if len(group) >= 2 else None)


def test_user_schedule_with_weights_gives_the_edge_group_matrix():
    schedule = schedule_from_spec(4, [[{"members": [2, 0, 1], "self_weight": 0.5}, [3]], [[0, 3], [1, 2]]])
    assert_valid(schedule)
    w = schedule.mixing_matrix(0)
    assert w[0, 0] == 0.5 and w[0, 1] == 0.25 and w[2, 0] == 0.25 and w[3, 3] == 1.0
    assert schedule.mixing_matrix(3).equal(schedule.mixing_matrix(1)), "the schedule repeats"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ([[[0, 1], [1, 2, 3]]], "round 0: rank 1 is in two groups"),
        ([[[0, 1], [2, 3]], [[0, 1], [2]]], r"round 1: ranks \[3\] are in no group"),
        ([[[0, 1, 2, 4]]], "rank 4 does not exist in a world of 4 workers"),
        ([[{"members": [0, 1], "self_weight": 1.5}, [2, 3]]], r"self_weight 1.5 of \[0, 1\] is not in \[0, 1\]"),
        ([[{"members": [0], "self_weight": 0.5}, [1, 2, 3]]], "rank 0 is alone, so its self_weight must be 1"),
        ([[{"ranks": [0, 1, 2, 3]}]], "a mapping with 'members'"),
        ([], "has no rounds"),
    ],
)
def test_invalid_user_schedules_are_rejected_with_the_round_and_rank(spec, message):
    with pytest.raises(ConfigurationError, match=message):
        schedule_from_spec(4, spec)


def test_doubly_stochastic_check_catches_rows_columns_and_negative_entries():
    assert is_doubly_stochastic(torch.full((3, 3), 1 / 3, dtype=torch.float64))
    assert not is_doubly_stochastic(torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64))  # columns
    assert not is_doubly_stochastic(torch.tensor([[1.5, -0.5], [-0.5, 1.5]], dtype=torch.float64))  # negative


def test_unknown_topology_lists_the_choices():
    with pytest.raises(ConfigurationError, match="complete, ring, one_peer_exp, alternating_exp_ring, static"):
        make_topology("torus", 4)
