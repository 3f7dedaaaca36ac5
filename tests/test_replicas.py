"""Replica groups' layout (which ranks form each replica, which average with which) and the average
of several replicas' models slice by slice, rank `i` of each with rank `i` of the others, on gloo in
real processes (`lightning_prague.core.replicas`)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_core_ranks
from hypothesis import given
from hypothesis import strategies as st

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.topology import make_topology
from lightning_prague.core.replicas import NODE, ReplicaLayout, column_schedule

pytestmark = pytest.mark.timeout(120)


def test_consecutive_ranks_form_each_replica_and_a_column_holds_one_rank_of_each():
    layout = ReplicaLayout(8, 2)
    assert layout.replicas == 4
    assert [layout.replica_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [layout.index_of(r) for r in range(8)] == [0, 1] * 4
    assert layout.ranks_of(2) == (4, 5) and layout.leader_of(3) == 6
    assert layout.column(5, [3, 0, 2]) == (1, 5, 7)  # index 1 of replicas 0, 2 and 3
    with pytest.raises(ValueError, match="not among replicas"):
        layout.column(5, [0, 1])
    with pytest.raises(ValueError, match="outside a job of 8 ranks"):
        layout.replica_of(8)
    with pytest.raises(ValueError, match="outside a job of 4 replicas"):
        layout.ranks_of(4)


@given(
    topology=st.sampled_from(["complete", "ring", "one_peer_exp", "static"]),
    replicas=st.sampled_from([2, 4, 8]),
    size=st.integers(1, 4),
)
def test_a_schedule_over_replicas_runs_column_by_column_and_mixes_each_replica_as_one(topology, replicas, size):
    """Rank `i` of each replica of a group averages with rank `i` of the others, with the group's
    weights: the ranks' mixing matrix is the replicas' one for each index (`W kron I_K`)."""
    layout = ReplicaLayout(replicas * size, size)
    over_replicas = make_topology(topology, replicas, 1)
    ranks = column_schedule(over_replicas, layout)
    assert ranks.world_size == layout.world_size and ranks.period == over_replicas.period
    # the columns never meet in the schedule; a replica's ranks meet at every step (their gradient average)
    assert ranks.coverage == over_replicas.coverage
    for t in range(over_replicas.period):
        expected = torch.kron(over_replicas.mixing_matrix(t), torch.eye(size, dtype=torch.float64))
        assert torch.equal(ranks.mixing_matrix(t), expected)
        for rank in range(layout.world_size):
            group = ranks.group_of(rank, t)
            assert {layout.index_of(m) for m in group.members} == {layout.index_of(rank)}  # its column only
            planned = over_replicas.group_of(layout.replica_of(rank), t)
            assert [layout.replica_of(m) for m in group.members] == list(planned.members)
            assert group.self_weight == planned.self_weight


def test_a_schedule_must_be_drawn_over_the_jobs_replicas():
    with pytest.raises(ValueError, match="over 8 workers, the job has 4 replicas"):
        column_schedule(make_topology("ring", 8, 1), ReplicaLayout(8, 2))


def test_node_means_the_ranks_of_a_node_and_bad_sizes_are_refused_by_name():
    assert ReplicaLayout.resolve(NODE, 8, ranks_per_node=4) == ReplicaLayout(8, 4)
    assert ReplicaLayout.resolve(2, 8, ranks_per_node=4) == ReplicaLayout(8, 2)
    assert ReplicaLayout(5).replicas == 5  # the default: every rank a replica of its own
    for bad, why in [(3, "does not divide the job's 8 ranks"), (0, "positive number"), (True, "positive number"),
                     ("nodes", "positive number"), (2.0, "positive number")]:  # fmt: skip
        with pytest.raises(ConfigurationError, match=why):
            ReplicaLayout.resolve(bad, 8, ranks_per_node=4)


@given(st.integers(1, 16), st.integers(0, 200))
def test_the_slices_of_a_replica_cover_the_model_once_in_near_equal_parts(size, numel):
    layout = ReplicaLayout(size, size)
    bounds = [layout.slice_bounds(i, numel) for i in range(size)]
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in order, no overlap
    lengths = [stop - start for start, stop in bounds]
    assert max(lengths) - min(lengths) <= 1


def model(replica: int, numel: int) -> torch.Tensor:
    """(as `scripts/replica_worker.py` builds each replica's model)"""
    return torch.arange(numel, dtype=torch.float64) * (replica + 1) + 100.0 * replica


#: 6 ranks: replicas of 2 (all three, then two of them), of 3, and of 1 (two ranks alone)
CASES = [
    {"replica_size": 2, "replicas": [0, 1, 2], "numel": 11},
    {"replica_size": 2, "replicas": [0, 2], "numel": 11},
    {"replica_size": 3, "replicas": [0, 1], "numel": 7},
    {"replica_size": 1, "replicas": [1, 4], "numel": 5},
]
WORLD = 6


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_core_ranks(tmp_path_factory.mktemp("replicas"), WORLD, json.dumps(CASES), script="replica_worker.py")


@pytest.mark.parametrize("index", range(len(CASES)))
def test_replicas_averaged_by_slices_hold_the_mean_of_their_models_and_the_others_are_untouched(runs, index):
    case = CASES[index]
    layout = ReplicaLayout(WORLD, case["replica_size"])
    mean = sum(model(r, case["numel"]) for r in case["replicas"]) / len(case["replicas"])
    for rank in range(WORLD):
        result = runs[rank][index]
        replica = layout.replica_of(rank)
        got = torch.tensor(result["flat"], dtype=torch.float64)
        if replica in case["replicas"]:
            assert result["applied"] is True and result["whole"] is True, (rank, result)
            torch.testing.assert_close(got, mean)
        else:
            assert result["applied"] is None
            torch.testing.assert_close(got, model(replica, case["numel"]))


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    return run_core_ranks(tmp_path_factory.mktemp("sharded"), 4, "2", script="sharded_replica_worker.py")


def test_replicas_sharded_with_fsdp2_averaged_shard_by_shard_hold_the_mean_of_their_models(sharded_runs):
    """4 ranks, replicas of 2, each replica's model sharded over its 2 ranks (FSDP2 on gloo), trained
    apart; then rank i of each replica averages its own shards with rank i of the other: each replica's
    whole model is the mean of both, and a rank held about half the model's bytes."""
    layout = ReplicaLayout(4, 2)
    before = {layout.replica_of(r): run["before"] for r, run in enumerate(sharded_runs)}
    for rank, run in enumerate(sharded_runs):  # a replica's ranks hold one model between them
        assert run["before"] == before[layout.replica_of(rank)]
    assert before[0] != before[1]  # the replicas trained apart
    for run in sharded_runs:
        assert run["applied"] is True
        for got, first, second in zip(run["after"], before[0], before[1]):
            mean = (torch.tensor(first, dtype=torch.float64) + torch.tensor(second, dtype=torch.float64)) / 2
            torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), mean, rtol=1e-6, atol=1e-6)
    params = sum(len(p) for p in before[0]) * 4  # float32 bytes of the whole model
    assert all(run["local_bytes"] <= params / 2 + 4 * 17 for run in sharded_runs)  # (a row of padding at most)


def test_a_ranks_shards_sent_to_a_rejoining_rank_load_exactly_and_shards_that_do_not_fit_are_named(sharded_runs):
    """What a rank of a sharded replica sends the joiner of its index (`as_local_shards`: plain tensors,
    read back by a weights-only load) is made DTensors of the joiner's own model again
    (`from_local_shards`): loaded into a new model and AdamW sharded alike, they hold the sender's
    shards and moments exactly. A shard of another shape, or of no parameter, is named, not loaded."""
    for run in sharded_runs:
        assert run["loaded_exactly"] is True
        assert run["fitting"] == []
        assert len(run["wrong"]) == 2 and run["wrong"][0].startswith("0.weight: a shard of [99, 8]"), run["wrong"]
        assert run["wrong"][1].startswith("nowhere"), run["wrong"]


def test_a_replicas_ranks_agree_one_batch_late_or_at_once_before_a_meeting_on_the_newest_admission(sharded_runs):
    """`DonationAgreement`: each call at a batch's end returns the newest membership epoch the replica's
    ranks put in at the call before (0 at the first); `settle`, before a meeting, the newest put in
    now or in the call in flight. Every rank of a replica gets the same answers, whatever it put in."""
    for run in sharded_runs:
        assert run["agreed"] == [0, 3, 5, 0, 0], run["agreed"]


def test_a_model_is_sharded_in_the_units_auto_wrap_policy_names_or_by_its_own_parameters(tmp_path):
    """`shard_model` (what `shard=True` runs at setup) on 2 ranks: with `auto_wrap_policy={Block}` the
    blocks and the root are FSDP2's units (the Linear head joins the root); by default every submodule
    with parameters of its own is one. Either way a training step runs and the ranks hold one model."""
    runs = run_core_ranks(tmp_path, 2, script="shard_units_worker.py")
    for run in runs:
        assert run["blocks"]["units"] == ["0", "1", "<root>"]
        assert run["default"]["units"] == ["0.down", "0.norm", "0.up", "1.down", "1.norm", "1.up", "2", "<root>"]
    assert runs[0]["blocks"]["checksum"] == runs[1]["blocks"]["checksum"]
    assert runs[0]["default"]["checksum"] == runs[1]["default"]["checksum"]
