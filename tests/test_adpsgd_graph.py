"""AD-PSGD's neighbour graphs and pairing: bipartite, connected, always active with passive."""

from __future__ import annotations

import random

import pytest
from sim import assert_consistent_order, simulate

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.core.grouping.policies import GossipPolicy
from lightning_prague.core.grouping.syncgraph import SyncGraph
from lightning_prague.core.plane.generator import GroupGenerator


@pytest.mark.parametrize("world", range(2, 65))
def test_default_graph_is_bipartite_and_connected_for_every_world_size(world):
    graph = BipartiteGraph.ring(world)
    assert graph.active == frozenset(range(0, world, 2))
    connectivity = SyncGraph(world)
    for a, b in graph.edges():
        assert a % 2 != b % 2, f"edge ({a}, {b}) joins two ranks of the same side"
        assert b in graph.neighbors[a] and a in graph.neighbors[b]
        connectivity.join((a, b))
    assert connectivity.connected()
    assert all(graph.neighbors[r] for r in range(world))
    if world % 2:  # odd: the wrap-around edge N-1 -> 0 would join two active ranks and is left out
        assert 0 not in graph.neighbors[world - 1]
    else:
        assert 0 in graph.neighbors[world - 1]
    # hops 1 and 1 + 2^i: each rank has a logarithmic number of neighbours
    assert max(len(n) for n in graph.neighbors.values()) <= 2 * (world.bit_length() + 1)


@pytest.mark.parametrize("world", [2, 3, 7, 8, 16])
def test_gossip_policy_pairs_an_active_worker_with_a_passive_neighbour(world):
    graph = BipartiteGraph.ring(world)
    policy = GossipPolicy(graph, seed=3)
    everyone = list(range(world))
    for _ in range(200):
        requester = random.Random(_).randrange(world)
        group = policy.select(requester, 0, everyone)
        if not graph.is_active(requester):
            assert group is None, "passive workers never start an exchange"
            continue
        assert group is not None and requester in group and len(group) == 2
        (peer,) = set(group) - {requester}
        assert not graph.is_active(peer) and peer in graph.neighbors[requester]
    # a parked (unavailable) neighbour is never chosen
    assert policy.select(0, 0, [0]) is None


@pytest.mark.parametrize("world", [2, 5, 8])
def test_gossip_through_the_generator_is_deadlock_free(world):
    graph = BipartiteGraph.ring(world)
    generator = GroupGenerator(world, GossipPolicy(graph, seed=1), avoid_stragglers=False)
    # in the model a worker only executes its inbox while it waits; passive workers' requests are
    # answered with no group, so they stand for a responder that serves between its steps
    steps = dict.fromkeys(range(world), 6)
    result = simulate(generator, steps, random.Random(world))
    assert result.released
    assert_consistent_order(result)
    assert result.groups, "no exchange was issued"
    assert all(graph.is_active(min(m)) != graph.is_active(max(m)) for m in result.groups.values())


def test_user_graphs_are_validated():
    square = BipartiteGraph.from_spec(4, [[0, 1], [1, 2], [2, 3], [3, 0]])
    assert square.active == {0, 2}
    star = BipartiteGraph.from_spec(4, {1: [0, 2, 3]})
    assert star.active == {0, 2, 3} and star.neighbors[1] == [0, 2, 3]
    with pytest.raises(ConfigurationError, match="not bipartite: ranks .* are neighbours"):
        BipartiteGraph.from_spec(3, [[0, 1], [1, 2], [2, 0]])
    with pytest.raises(ConfigurationError, match=r"not connected: ranks \[3\] cannot be reached"):
        BipartiteGraph.from_spec(4, [[0, 1], [1, 2]])
    with pytest.raises(ConfigurationError, match="outside 0..3"):
        BipartiteGraph.from_spec(4, [[0, 4]])
    with pytest.raises(ConfigurationError, match="pair of ranks"):
        BipartiteGraph.from_spec(4, [[0, 1, 2]])
    with pytest.raises(ConfigurationError, match="at least 2 workers"):
        BipartiteGraph.ring(1)
