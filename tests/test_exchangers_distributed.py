"""The threaded exchangers on real processes (gloo): AD-PSGD gossip and Partial Reduce, no Lightning."""

from __future__ import annotations

import pytest
from helpers import run_core_ranks

from lightning_prague.core.grouping.bipartite import BipartiteGraph

pytestmark = pytest.mark.timeout(150)


def _run(tmp_path, world, mode, steps=15, *slow):
    return run_core_ranks(tmp_path, world, mode, str(steps), *map(str, slow), script="exchange_worker.py")


def _assert_nothing_lost_or_doubled(results):
    # plain means are doubly stochastic: the sum over ranks changes only by the local increments
    expected = sum(r["start_sum"] + r["added"] for r in results)
    assert sum(r["before_global_sum"] for r in results) == pytest.approx(expected, rel=0, abs=1e-9)
    mean = expected / (len(results) * 6)
    for r in results:
        assert r["final"] == pytest.approx([mean] * 6, abs=1e-9)


def _assert_threads_follow_the_phases(results):
    for r in results:
        assert all(len(names) <= 1 for names in r["threads_during"]), r["threads_during"]
        assert r["threads_after_drain"] == [] and r["threads_at_end"] == [], r


@pytest.mark.parametrize("world", [5])  # odd: the ring without wrap-around edges (every N: test_adpsgd_graph)
def test_gossip_pairs_are_active_passive_and_every_exchange_counts_once(tmp_path, world):
    results = _run(tmp_path, world, "gossip")
    graph = BipartiteGraph.ring(world)
    issued = results[0]["issued"]
    assert issued, "no exchange happened"
    for a, b in issued:
        assert graph.is_active(a) != graph.is_active(b) and b in graph.neighbors[a], (a, b)
    passive = [r for r in results if r["passive"]]
    active = [r for r in results if not r["passive"]]
    assert {r["rank"] for r in passive} == set(range(1, world, 2))
    assert all(r["requests"] == 0 for r in passive), "passive workers must never start an exchange"
    # every issued pair was executed once on each side (passive ranks execute the pairs assigned
    # after their pause marker in the synchronization point's drain)
    assert sum(r["groups_executed"] for r in active) == len(issued)
    assert sum(r["groups_executed"] for r in passive) == len(issued)
    assert sum(r["exchanges"] for r in active) == len(issued), "an active exchange was not folded in"
    _assert_nothing_lost_or_doubled(results)
    _assert_threads_follow_the_phases(results)


def test_partial_reduce_overlapped_conserves_the_sum_and_a_10x_slower_worker_keeps_mixing(tmp_path):
    world = 4
    results = _run(tmp_path, world, "first_ready", 5, 0, 10)  # rank 0 does 5 steps per phase, 10x slower
    issued = results[0]["issued"]
    _assert_nothing_lost_or_doubled(results)
    _assert_threads_follow_the_phases(results)
    assert sum(r["groups_executed"] for r in results) == sum(len(m) for m in issued)
    slow, *fast = results
    # nobody waits for the slow worker, and it is never left out: every report it makes finds a group
    assert min(r["requests"] for r in fast) >= 3 * slow["requests"], [r["requests"] for r in results]
    assert slow["exchanges"] >= slow["requests"] - 1, slow
    # the sync graph became connected again and again, the slow worker included each time
    assert slow["windows_closed"] >= slow["requests"] - 2


def test_partial_reduce_staleness_weighting_runs_and_ends_in_consensus(tmp_path):
    results = _run(tmp_path, 4, "first_ready_staleness", 10)
    finals = {tuple(round(x, 9) for x in r["final"]) for r in results}
    assert len(finals) == 1
    assert sum(r["exchanges"] for r in results) > 0
    _assert_threads_follow_the_phases(results)
