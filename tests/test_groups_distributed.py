"""The group primitive on real processes (gloo): any group, any weights, no communicator per group."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from helpers import SCRIPTS, run_core_ranks

sys.path.insert(0, str(SCRIPTS))
from group_worker import BUCKET, PIECE, SNAPSHOT_MEMBERS, snapshot_model, start  # noqa: E402

pytestmark = pytest.mark.timeout(150)
WORLD = 16


def cases(world: int) -> list[dict]:
    """Groups of 2 to 8 members and of 12 and 13, plain and weighted, then the whole world; those
    beyond 4 members once by recursive doubling (powers of two and not) and once in a ring (the
    whole world: once by recursive doubling, once by gloo's all-reduce)."""
    rng = random.Random(3)
    out = [{"members": list(range(world)), "weights": None, "ring": True}]  # first: later ones change it
    for size in [*range(2, 9), 12, 13]:
        for weighted in (False, True):
            for ring in (False, True) if size > 4 else (False,):
                members = sorted(rng.sample(range(world), size))
                weights = None
                if weighted:
                    raw = [rng.uniform(0.1, 1.0) for _ in members]
                    weights = [w / sum(raw) for w in raw]
                out.append({"members": members, "weights": weights, "ring": ring})
    out.append({"members": list(range(world)), "weights": None, "ring": False})
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("groups")
    return run_core_ranks(tmp, WORLD, json.dumps(cases(WORLD)), script="group_worker.py", timeout=120)


def test_members_reach_the_weighted_group_mean_and_others_are_untouched(runs):
    state = [torch.stack([start(r)[i] for r in range(WORLD)]) for i in range(2)]
    for index, case in enumerate(cases(WORLD)):
        members = case["members"]
        weights = case["weights"] or [1.0 / len(members)] * len(members)
        w = torch.tensor(weights, dtype=torch.float64).unsqueeze(1)
        for x in state:
            x[members] = (w * x[members]).sum(0)
        for rank in range(WORLD):
            got = runs[rank]["after"].get(str(index))
            if rank in members:
                for i, x in enumerate(state):
                    torch.testing.assert_close(torch.tensor(got[i], dtype=torch.float64), x[rank], rtol=0, atol=1e-12)
            else:
                assert got is None, f"rank {rank} ran case {index} it is not a member of"
        # every member holds bitwise the same result
        results = {json.dumps(runs[m]["after"][str(index)]) for m in members}
        assert len(results) == 1, f"members of case {index} ({members}) disagree"
    for rank in range(WORLD):
        for i, x in enumerate(state):
            torch.testing.assert_close(
                torch.tensor(runs[rank]["final"][i], dtype=torch.float64), x[rank], atol=1e-12, rtol=0
            )


def test_no_communicator_is_created_for_any_group(runs):
    assert [r["new_communicators"] for r in runs] == [0] * WORLD
    assert sum(r["messages"] for r in runs) > 0, "the groups ran point-to-point"


def test_snapshot_averages_are_exact_and_allocate_pieces_not_buckets(runs):
    """Three members average snapshots of a 2 x 400 KB model all-to-all: the change is the mean minus
    each one's own, and a step of an average and a chained one allocates nothing near a bucket
    (two pieces of 16 KB per peer, norms in small chunks)."""
    models = [snapshot_model(r) for r in SNAPSHOT_MEMBERS]
    mean = [sum(m[i] for m in models) / len(models) for i in range(2)]
    for rank in SNAPSHOT_MEMBERS:
        got = runs[rank]["snapshot"]
        for i in range(2):
            change = torch.tensor(got["change"][i])
            torch.testing.assert_close(change, mean[i] - models[rank][i], rtol=0, atol=1e-5)
        peers = len(SNAPSHOT_MEMBERS) - 1
        assert got["largest_allocation"] <= 2 * peers * PIECE, (rank, got["largest_allocation"], got["allocated_by"])
        assert got["largest_allocation"] < BUCKET * 4 // 4
    for rank in SNAPSHOT_MEMBERS:  # snapshot + change: the mean, to float32's rounding of the difference
        for i in range(2):
            torch.testing.assert_close(torch.tensor(runs[rank]["snapshot"]["averaged"][i]), mean[i], rtol=0, atol=1e-6)
