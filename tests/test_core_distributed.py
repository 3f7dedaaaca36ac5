"""The core on real processes (gloo on 127.0.0.1): averaging, coordinator, no communicator per group."""

from __future__ import annotations

import pytest
from helpers import run_core_ranks

pytestmark = pytest.mark.timeout(150)


def _groups_by_id(results):
    return {gid: members for gid, members in results[0]["issued"]}


@pytest.mark.parametrize("policy", ["random", "static", "first_ready"])
def test_partial_syncs_conserve_the_sum_and_end_in_consensus(tmp_path, policy):
    world = 5
    results = run_core_ranks(tmp_path, world, policy, "3", "12")
    expected = sum(range(world)) / world  # each rank starts at its own rank number
    # partial averages are doubly stochastic: the mean over ranks never changes, so no exchange was
    # lost or applied twice; after the final global average every rank holds exactly that mean
    before = [r["before_global"][0] for r in results]
    assert sum(before) / world == pytest.approx(expected, abs=1e-5)
    for r in results:
        assert r["final"] == pytest.approx([expected] * 5, abs=1e-5)
        assert r["buffer"] == pytest.approx([expected * 10] * 3, abs=1e-4)
    assert sum(r["stats"]["groups"] for r in results) > 0
    # a checkpoint's optimizer state: the mean of the workers' (a copy: each optimizer keeps its own)
    squares = sum(r * r for r in range(world)) / world
    for r in results:
        assert r["optimizer_complete"] and r["optimizer_unchanged"]
        assert r["optimizer_mean"]["0"] == {
            "step": pytest.approx(expected + 1),
            "exp_avg": pytest.approx([expected] * 4),
            "exp_avg_sq": pytest.approx([squares] * 4),
        }
        assert r["optimizer_mean"]["1"] == {"momentum_buffer": pytest.approx([2 * expected] * 2)}
        # states of different layouts are not averaged: each keeps its own
        assert r["uneven"] == [False, [float(r["rank"])] * 4]


def test_a_group_average_sets_members_to_the_mean_and_leaves_others_untouched(tmp_path):
    # static schedule, 4 workers in virtual nodes of 2, round 0: ranks 0 and 2 form the only group
    logs = tmp_path / "logs"  # the job's supervisor keeps its log in the folder the user names
    results = run_core_ranks(tmp_path, 4, "static", "2", "1", LIGHTNING_PRAGUE_LOG_DIR=str(logs))
    kept = list(logs.glob("supervisor-*.log"))
    assert len(kept) == 1 and oct(kept[0].stat().st_mode & 0o777) == "0o600", kept
    assert [members for _, members in results[0]["issued"]] == [[0, 2]]
    for rank in (0, 2):
        assert results[rank]["history"][0]["after"] == pytest.approx([1.0] * 5)  # mean of 0 and 2
    for rank in (1, 3):
        entry = results[rank]["history"][0]
        assert entry["gid"] is None and entry["after"] == entry["before"] == [float(rank)] * 5


def test_a_long_run_creates_no_communicator_and_the_store_does_not_grow(tmp_path):
    world = 6
    results = run_core_ranks(tmp_path, world, "random", "3", "160")
    expected = sum(range(world)) / world
    for r in results:
        assert r["final"] == pytest.approx([expected] * 5, abs=1e-5)
        assert r["new_communicators"] == 0, "a group created a communicator"
    distinct = {tuple(m) for _, m in results[0]["issued"]}
    assert len(distinct) >= 15, "the run must have used many different member sets"
    # keys at a quarter, half, three quarters of the steps and at the last one, in the job's store and in
    # the session's counters: group requests write nothing there, whatever the number of steps
    keys = results[0]["store_keys"]
    assert len({tuple(k) for k in keys}) == 1, f"the store or the counters grew over 160 steps: {keys} keys"


def test_a_slow_rank_neither_hangs_nor_breaks_consensus(tmp_path):
    world = 4
    # rank 0 sleeps 0.3 s per step, the others up to 0.01 s; all do 8 steps
    results = run_core_ranks(tmp_path, world, "buffer", "2", "8", "0", "0.3")
    assert any(0 in m for m in _groups_by_id(results).values()), "the slow rank never mixed"
    expected = sum(range(world)) / world
    for r in results:
        assert r["final"] == pytest.approx([expected] * 5, abs=1e-5)
