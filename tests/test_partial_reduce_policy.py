"""Partial Reduce's controller: first-ready groups, staleness weights, and no update isolation."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sim import assert_consistent_order, propagation_delays, simulate, simulate_first_ready

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.policies import FirstReadyPolicy, make_policy
from lightning_prague.core.grouping.staleness import staleness_weights
from lightning_prague.core.grouping.syncgraph import SyncGraph
from lightning_prague.core.plane.generator import GroupGenerator


def test_staleness_weights_reproduce_the_reference_example():
    # staleness [1, 3, 1] (versions 5, 3, 5): the empty level 2 goes to the freshest level
    assert staleness_weights([5, 3, 5], alpha=0.9) == pytest.approx([0.351, 0.299, 0.351], abs=5e-4)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=12), st.floats(0.05, 0.95))
def test_staleness_weights_sum_to_one_and_favour_fresh_levels(versions, alpha):
    weights = staleness_weights(versions, alpha)
    assert sum(weights) == pytest.approx(1.0)
    assert all(w > 0 for w in weights)
    # fresher staleness levels carry at least as much total weight as staler ones
    by_version: dict[int, float] = {}
    for v, w in zip(versions, weights):
        by_version[v] = by_version.get(v, 0.0) + w
    ordered = [by_version[v] for v in sorted(by_version, reverse=True)]
    assert all(a >= b - 1e-12 for a, b in zip(ordered, ordered[1:]))
    if len(set(versions)) == 1:
        assert weights == pytest.approx([1 / len(versions)] * len(versions))


def test_invalid_weighting_options_are_rejected():
    with pytest.raises(ConfigurationError, match="alpha=1.5 is invalid"):
        staleness_weights([1, 2], alpha=1.5)
    with pytest.raises(ConfigurationError, match="weighting='newest' is invalid"):
        FirstReadyPolicy(4, 2, weighting="newest")
    with pytest.raises(ConfigurationError, match="mixing_window=0 is invalid"):
        FirstReadyPolicy(4, 2, mixing_window=0)


def test_the_first_ready_workers_form_groups_and_carry_weights_and_the_newest_version():
    generator = GroupGenerator(5, make_policy("first_ready", 5, 3, weighting="staleness"))
    assert not generator.handle({"op": "ready", "rank": 4, "req": 1, "version": 5})
    assert not generator.handle({"op": "ready", "rank": 1, "req": 1, "version": 3})
    out = generator.handle({"op": "ready", "rank": 2, "req": 1, "version": 5})
    group = out[1][0]
    assert group["members"] == [1, 2, 4] and group["version"] == 5
    assert group["weights"] == pytest.approx([0.299, 0.351, 0.351], abs=5e-4)  # in member order
    assert {r for r in out} == {1, 2, 4}, "busy workers 0 and 3 must not be grouped"
    assert all(items[-1] == {"t": "answer", "req": 1, "gid": group["gid"]} for items in out.values())


def test_uniform_weighting_sends_no_weights():
    generator = GroupGenerator(3, make_policy("first_ready", 3, 2))
    generator.handle({"op": "ready", "rank": 0, "req": 1, "version": 9})
    out = generator.handle({"op": "ready", "rank": 2, "req": 1, "version": 1})
    assert "weights" not in out[0][0] and out[0][0]["version"] == 9


def _connected_within(groups, world, start, end):
    graph = SyncGraph(world)
    for t, _, members in groups:
        if start <= t <= end:
            graph.join(members)
    return graph.connected()


def _window_ends(groups, world, window, slowest_step):
    """For each report time t0: the time by which two windows of reports plus two slowest steps have passed."""
    times = [t for t, _, _ in groups]
    reports = [n for _, n, _ in groups]
    for i, t0 in enumerate(times):
        later = [t for t, n in zip(times, reports) if n >= reports[i] + 2 * window]
        if not later or later[0] + 2 * slowest_step > times[-1]:
            return  # the simulation ended before this interval did
        yield t0, later[0] + 2 * slowest_step


def test_equal_speeds_isolate_pairs_without_the_window_and_mix_with_it():
    world, window = 8, 16
    steps = [1.0 + 1e-3 * r for r in range(world)]  # the same order every round: (0,1), (2,3), ... forever
    isolated = simulate_first_ready(GroupGenerator(world, FirstReadyPolicy(world, 2, mixing_window=10**9)), steps, 60)
    assert {m for _, _, m in isolated} == {(0, 1), (2, 3), (4, 5), (6, 7)}, "the demonstration needs isolation"

    policy = FirstReadyPolicy(world, 2, mixing_window=window)
    groups = simulate_first_ready(GroupGenerator(world, policy), steps, 60)
    assert policy.bridging_groups > 0 and policy.windows_closed >= 3
    for t0, t1 in _window_ends(groups, world, window, max(steps)):
        assert _connected_within(groups, world, t0, t1), f"no mixing between t={t0} and t={t1}"


@pytest.mark.parametrize("group_size", [2, 3])
def test_a_10x_slower_worker_mixes_with_everyone_within_the_window(group_size):
    world, window = 8, 20
    steps = [10.0] + [1.0 + 0.01 * r for r in range(1, world)]
    policy = FirstReadyPolicy(world, group_size, mixing_window=window)
    groups = simulate_first_ready(GroupGenerator(world, policy), steps, 200)
    slow_groups = [t for t, _, m in groups if 0 in m]
    assert len(slow_groups) >= 19, "every report of the slow worker must find a group"
    for t0, t1 in _window_ends(groups, world, window, max(steps)):
        assert _connected_within(groups, world, t0, t1), f"no mixing between t={t0} and t={t1}"
    # fast workers are not held back to the slow worker's pace
    fast_groups = sum(1 for _, _, m in groups if 0 not in m)
    assert fast_groups > 5 * len(slow_groups)


@pytest.mark.parametrize(
    ("world", "group_size", "window", "slow"), [(16, 2, 10, 1.0), (16, 2, 10, 10.0), (16, 4, 16, 10.0)]
)
def test_every_contribution_reaches_every_worker_in_time_order_within_the_stated_bound(world, group_size, window, slow):
    steps = [1.0 + 1e-3 * r for r in range(world - 1)] + [slow]
    groups = simulate_first_ready(
        GroupGenerator(world, FirstReadyPolicy(world, group_size, mixing_window=window)), steps, 300
    )
    delays = propagation_delays(groups, world)
    assert len(delays) > 10 * world
    # docs/partial_reduce.md: within N - 1 windows, each at most the window's reports plus N - 1
    # bridging groups that wait at most one step of the slowest worker (reports made meanwhile)
    reports_per_slowest_step = math.ceil(max(steps) * sum(1 / s for s in steps))
    bound = (world - 1) * (window + (world - 1) * reports_per_slowest_step)
    assert max(delays) <= bound


@settings(max_examples=80, deadline=None)
@given(
    st.integers(2, 12).flatmap(lambda w: st.tuples(st.just(w), st.integers(2, w))),
    st.integers(1, 6),
    st.sampled_from(["uniform", "staleness"]),
    st.integers(0, 2**16),
)
def test_bridging_never_deadlocks_even_with_tiny_windows(sizes, window, weighting, seed):
    world, group_size = sizes
    rng = random.Random(seed)
    steps = {r: rng.randint(0, 10) for r in range(world)}
    policy = FirstReadyPolicy(world, group_size, seed, weighting=weighting, mixing_window=window)
    result = simulate(GroupGenerator(world, policy), steps, rng)
    assert result.released
    assert_consistent_order(result)
    assert result.steps == steps
