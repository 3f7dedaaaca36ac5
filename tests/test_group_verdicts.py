"""All-or-nothing group averages, decided by the control plane: a member killed at each stage of each
sum algorithm, in real processes; and the plane's verdict table on its own."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import SCRIPTS, run_core_ranks

from lightning_prague.core.plane.verdicts import MAX_OPEN_PER_RANK, GroupVerdicts

sys.path.insert(0, str(SCRIPTS))
from group_verdict_fault import start  # noqa: E402

WORLD = 9
CASES = [
    # all-to-all in pieces: the victim dies after its third piece
    {"members": [0, 1, 2], "dies": 2, "stage": 3, "partial": True},
    # all-to-all in one piece: the victim's share reaches one peer and not the other
    {"members": [0, 1, 3], "dies": 3, "stage": 0, "partial": True, "whole": True},
    # recursive doubling: the member beyond the power of two handed in its share, dies before its result
    {"members": [0, 1, 4, 5, 6, 7, 8], "dies": 8, "stage": 1},
    # recursive doubling: a member dies in its second round, its partial sum reaching one partner
    {"members": [0, 1, 4, 5, 6, 7], "dies": 4, "stage": 1, "partial": True},
    # a ring: a member dies in the all-gather, after one more chunk went out
    {"members": [0, 1, 5, 6, 7], "dies": 7, "stage": 5, "partial": True, "ring": True},
    # every member completed, the victim reported so and died before the verdict: it takes effect
    {"members": [0, 1, 5], "dies": 5, "reports": True},
    # the survivors go on
    {"members": [0, 1, 6]},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("verdicts")
    dead = tuple(case["dies"] for case in CASES if "dies" in case)
    return run_core_ranks(tmp, WORLD, json.dumps(CASES), script="group_verdict_fault.py", timeout=120, may_die=dead)


@pytest.mark.timeout(150)
def test_a_member_killed_at_any_stage_leaves_every_survivor_agreeing_and_the_mass_conserved(runs):
    state = {r: start(r) for r in range(WORLD)}  # every rank's tensor, the lost ones' too
    for index, case in enumerate(CASES):
        members = case["members"]
        # ranks lost in a later case wrote no results: the ranks that finish speak for every case
        finished = [r for r in members if r != case.get("dies") and runs[r]]
        assert len(finished) >= 2, f"case {index}: survivors {finished}"
        results = {r: runs[r]["cases"][index] for r in finished}
        outcomes = {result["applied"] for result in results.values()}
        assert len(outcomes) == 1, f"case {index}: the survivors disagree on taking the average: {results}"
        for r, result in results.items():
            torch.testing.assert_close(torch.tensor(result["before"], dtype=torch.float64), state[r])
        total = sum(state[r] for r in members)  # the group's mass before, the victim's share included
        if outcomes == {True}:
            mean = total / len(members)
            for r in finished:
                torch.testing.assert_close(torch.tensor(results[r]["after"], dtype=torch.float64), mean)
            # every member, the lost one too, holds the mean: the sum over the group is unchanged
            torch.testing.assert_close(mean * len(members), total)
            for r in members:
                state[r] = mean
        else:
            for r in finished:
                assert results[r]["after"] == results[r]["before"], f"case {index}: rank {r} kept a partial sum"
        expected = case.get("reports", False) or "dies" not in case
        assert outcomes == {expected}, f"case {index}: verdict {outcomes}, expected {expected}"


def verdicts_of(due):
    return {rank: item["apply"] for rank, item in due}


def test_the_verdict_is_every_members_ok_and_reaches_each_reporter_once():
    table = GroupVerdicts()
    assert table.report(0, "g1", [0, 1, 2], True, departed=set()) == []
    assert table.report(2, "g1", [0, 1, 2], True, departed=set()) == []
    assert verdicts_of(table.report(1, "g1", [0, 1, 2], True, departed=set())) == {0: True, 1: True, 2: True}
    assert len(table) == 0, "a decided collective is forgotten"
    # an incomplete member decides at once; the others learn it as they report
    assert verdicts_of(table.report(0, "g2", [0, 1], False, departed=set())) == {0: False}
    assert verdicts_of(table.report(1, "g2", [0, 1], True, departed=set())) == {1: False}


def test_a_member_lost_before_it_reported_decides_against_on_every_member_even_late_ones():
    table = GroupVerdicts()
    table.report(0, "g1", [0, 1, 2], True, departed=set())
    assert verdicts_of(table.depart(2, departed={2})) == {0: False}
    assert len(table) == 1, "rank 1 has yet to report and learn the verdict"
    assert verdicts_of(table.report(1, "g1", [0, 1, 2], True, departed={2})) == {1: False}
    assert len(table) == 0
    # a collective first reported after a member was already lost
    assert verdicts_of(table.report(0, "g2", [0, 2], True, departed={2})) == {0: False}


def test_a_collective_of_a_readmitted_ranks_earlier_process_is_decided_against():
    """Rank 2 was drawn in membership epoch 3, lost before it reported, and readmitted (a new process)
    in epoch 4 before anyone reported: the new process never reports, and nobody waits for it."""
    table = GroupVerdicts()
    table.depart(2, departed={2})  # (nothing open yet)
    table.readmitted(2, 4)
    assert verdicts_of(table.report(0, "g7", [0, 2], True, departed=set(), epoch=3)) == {0: False}
    # a collective drawn in the epoch of its admission, or later, waits for the new process's report
    assert table.report(0, "g8", [0, 2], True, departed=set(), epoch=4) == []
    assert verdicts_of(table.report(2, "g8", [0, 2], True, departed=set(), epoch=4)) == {0: True, 2: True}


def test_a_member_lost_after_it_reported_does_not_change_the_verdict():
    table = GroupVerdicts()
    table.report(2, "g1", [0, 1, 2], True, departed=set())
    assert table.depart(2, departed={2}) == []
    table.report(0, "g1", [0, 1, 2], True, departed={2})
    assert verdicts_of(table.report(1, "g1", [0, 1, 2], True, departed={2})) == {0: True, 1: True}


def test_a_rank_that_left_after_an_error_still_gets_its_verdict():
    table = GroupVerdicts()
    assert verdicts_of(table.report(1, "g1", [0, 1], True, departed={1})) == {1: False}
    assert verdicts_of(table.report(0, "g1", [0, 1], True, departed={1})) == {0: False}


@pytest.mark.parametrize(
    "members, why",
    [([1, 2], "not a group of it"), ([0], "not a group of it"), ([0, 0, 1], "not a group of it")],
)
def test_reports_a_rank_would_never_send_are_refused(members, why):
    with pytest.raises(ValueError, match=why):
        GroupVerdicts().report(0, "g1", members, True, departed=set())


def test_other_members_or_a_second_report_are_refused_and_open_reports_are_bounded():
    table = GroupVerdicts()
    table.report(0, "g1", [0, 1], True, departed=set())
    with pytest.raises(ValueError, match="others with"):
        table.report(1, "g1", [1, 2], True, departed=set())
    with pytest.raises(ValueError, match="twice"):
        table.report(0, "g1", [0, 1], True, departed=set())
    for n in range(MAX_OPEN_PER_RANK - 1):
        table.report(0, f"k{n}", [0, 1], True, departed=set())
    with pytest.raises(ValueError, match="open without a verdict"):
        table.report(0, "one-too-many", [0, 1], True, departed=set())
    assert len(table) == MAX_OPEN_PER_RANK
