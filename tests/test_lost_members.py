"""Group sums with a member that dies in the middle: all-or-nothing on every survivor, in real processes."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from helpers import SCRIPTS, run_core_ranks

sys.path.insert(0, str(SCRIPTS))
from lost_member import start  # noqa: E402

from lightning_prague.core.comm.collectives import GATHER_INLINE  # noqa: E402

pytestmark = pytest.mark.timeout(120)
WORLD = 8

CASES = [
    # all-to-all (3 members): the dying rank posts nothing
    {"members": [0, 1, 2], "dies": 2, "when": "before"},
    # recursive doubling (7 members, its last one beyond the power of two) once its first message is out
    {"members": [0, 1, 3, 4, 5, 6, 7], "dies": 7, "when": "after-first"},
    # recursive doubling, a member inside the power of two, before anything
    {"members": [0, 1, 3, 4, 5, 6], "dies": 4, "when": "before"},
    # a ring (large tensors), once its first message is out
    {"members": [0, 1, 3, 5, 6], "dies": 6, "when": "after-first", "ring": True},
    # the survivors go on exchanging on the same process group
    {"members": [0, 1, 3, 5]},
    {"members": [0, 1, 3, 5], "ring": True},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lost")
    dead = tuple(case["dies"] for case in CASES if "dies" in case)
    return run_core_ranks(tmp, WORLD, json.dumps(CASES), script="lost_member.py", timeout=90, may_die=dead)


def test_a_member_that_dies_mid_sum_leaves_every_survivor_all_or_nothing(runs):
    for index, case in enumerate(CASES):
        survivors = [r for r in case["members"] if r != case.get("dies") and runs[r]]
        outcomes = {runs[r]["cases"][index]["applied"] for r in survivors}
        assert len(outcomes) == 1, f"case {index}: survivors disagree on applying the average"
        for r in survivors:
            got = runs[r]["cases"][index]
            after, before = torch.tensor(got["after"]), torch.tensor(got["before"])
            if got["applied"]:  # the complete average, identical on every survivor
                assert torch.equal(after, torch.tensor(runs[survivors[0]]["cases"][index]["after"]))
                assert torch.isfinite(after).all()
            else:  # its own tensors, untouched: no partial sum
                assert torch.equal(after, before), f"case {index}: rank {r} kept a partial sum"
        if case.get("when") == "before":
            assert outcomes == {False}, f"case {index}: a sum without a member's share cannot be complete"


def test_the_survivors_sums_afterwards_are_exact(runs):
    state = {r: start(r) for r in range(WORLD)}
    for index, case in enumerate(CASES):
        members = [r for r in case["members"] if r != case.get("dies")]
        survivors = [r for r in members if runs[r]]
        if "dies" not in case:
            mean = torch.stack([state[r] for r in members]).mean(0)
            for r in members:
                torch.testing.assert_close(torch.tensor(runs[r]["cases"][index]["after"], dtype=torch.float64), mean)
        for r in survivors:
            state[r] = torch.tensor(runs[r]["cases"][index]["after"], dtype=torch.float64)


@pytest.fixture(scope="module")
def global_average_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lost_global")
    return run_core_ranks(tmp, 4, "3", "average", script="global_average_fault.py", timeout=90, may_die=(3,))


def test_a_member_dying_mid_send_of_the_global_average_leaves_the_survivors_agreeing(global_average_runs):
    """Rank 3 reaches rank 0 with its share and dies before the others get theirs: rank 0's sum is
    complete, 1's and 2's are not. The control plane's decision makes every survivor drop the first
    average alike, meet again without rank 3 and take the second: the mean of ranks 0-2."""
    survivors = [r for r in global_average_runs if r]
    assert [r["rank"] for r in survivors] == [0, 1, 2]
    for result in survivors:
        assert result["members"] == [0, 1, 2]
        assert result["attempts"] == 2, f"rank {result['rank']} took an average the others dropped"
        assert result["params"] == [1.0] * 64


@pytest.fixture(scope="module")
def gather_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lost_gather")
    return run_core_ranks(tmp, 4, "3", "gather", script="global_average_fault.py", timeout=90, may_die=(3,))


def test_a_member_dying_mid_send_of_a_gather_leaves_the_survivors_in_step(gather_runs):
    """Lightning's collectives over the members (`MemberCollectives`) run one or two sums each; with
    the control plane's decision after each, no survivor takes a gather the others gave up (nor goes
    on to a second sum of it), so the next gather, without the lost rank, is exact on every survivor."""
    survivors = [r for r in gather_runs if r]
    assert [r["rank"] for r in survivors] == [0, 1, 2]
    for result in survivors:
        assert result["first"] is None, f"rank {result['rank']} took a gather the others dropped"
        assert result["members"] == [0, 1, 2]
        assert result["second"] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
        # a tensor larger than the first sum carries: its values come in a second sum, on every member
        expected = [
            torch.arange(2 * rows).reshape(rows, 2) + 1000 * r for r, rows in ((0, GATHER_INLINE), (1, 1), (2, 2))
        ]
        assert len(result["large"]) == len(expected), result["large"]
        for got, want in zip(result["large"], expected):
            assert torch.equal(torch.tensor(got), want), (got, want)
        # broadcasts: a small object in one sum, a larger one in two, one nobody could read refused by all
        assert result["small"] == [True, {"path": "/ckpt/epoch=1.ckpt", "stop": True}]
        assert result["big"] == [True, [float(i) for i in range(1000)]]
        assert "rank 0 broadcast Unreadable, which torch.load(weights_only=True) cannot read" in result["refused"] or (
            result["rank"] != 0 and "rank 0 broadcast an object" in result["refused"]
        ), result["refused"]
