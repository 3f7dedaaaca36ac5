"""Averages over persistent flat buffers: what they compute, all-or-nothing, and that a step allocates
nothing the size of the model. In one process: the group is a stand-in whose sums add the other
members' known shares, and whose chosen call fails as a lost member's would (its flag says so)."""

from __future__ import annotations

import sys

import pytest
import torch
from helpers import SCRIPTS

from lightning_prague.core.comm import averaging, norms
from lightning_prague.core.comm.averaging import (
    BucketedTensors,
    FlatBuffers,
    SnapshotAverages,
    average_,
    average_difference_,
)
from lightning_prague.core.comm.norms import squared_distance, squared_norm

sys.path.insert(0, str(SCRIPTS))
import peak_memory  # noqa: E402

pytestmark = pytest.mark.timeout(60)


class PeerSums:
    """`sum_` of a group of this rank and one peer whose tensors are `peer` (flat, per bucket in
    order); the call numbered `fail_at` ends incomplete, as a lost member's would: its sum holds
    garbage and its flag says so. The members' agreement is this member's own flag (the peer is
    taken to agree)."""

    def __init__(self, peer: list[torch.Tensor], fail_at: int | None = None) -> None:
        self.peer, self.fail_at, self.calls = peer, fail_at, 0
        self.weight = 0.5  # the peer's share is scaled as ours (the plain mean of two)

    def sum_(self, tensor: torch.Tensor, members, operation: str = "", timeout=None) -> bool:
        index = self.calls % len(self.peer)
        complete = self.calls != self.fail_at
        if complete:
            tensor.add_(self.peer[index], alpha=self.weight)
        else:
            tensor.fill_(12345.0)  # what a lost share leaves: anything
        self.calls += 1
        return complete

    def agree_among(self, members, complete: bool, operation: str = "") -> bool:
        return complete


def model(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, generator=g)]


def live_of(tensors: list[torch.Tensor]) -> BucketedTensors:
    return BucketedTensors(tensors, bucket_bytes=64)  # buckets: [4x3], [5, 2x2]


def flat_buckets(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    live = live_of([t.clone() for t in tensors])
    return [torch.cat([t.reshape(-1) for t in bucket]) for bucket in live.buckets]


def test_flat_buffers_copy_and_add_through_views_of_one_flat_tensor_per_bucket():
    tensors = model(0)
    live = live_of(tensors)
    buffers = FlatBuffers(live)
    assert len(buffers.flats) == len(live.buckets) == 2
    buffers.copy_from_live()
    assert [f.tolist() for f in buffers.flats] == [f.tolist() for f in flat_buckets(tensors)]
    before = [t.clone() for t in tensors]
    buffers.add_to_live()
    for t, b in zip(tensors, before):
        torch.testing.assert_close(t, 2 * b)
    assert buffers.nbytes == live.nbytes


def test_average_makes_the_live_tensors_the_mean_or_leaves_them_whole():
    mine, theirs = model(0), model(1)
    live = live_of(mine)
    expected = [(a + b) / 2 for a, b in zip(mine, theirs)]
    error, applied = average_(live, PeerSums(flat_buckets(theirs)), (0, 1))
    assert bool(applied)
    for t, e in zip(mine, expected):
        torch.testing.assert_close(t, e)
    distance = sum(float((a - e).double().pow(2).sum()) for a, e in zip(model(0), expected))
    norm = sum(float(e.double().pow(2).sum()) for e in expected)
    assert float(error) == pytest.approx(distance / norm, rel=1e-6)

    mine = model(0)
    live = live_of(mine)
    error, applied = average_(live, PeerSums(flat_buckets(theirs), fail_at=1), (0, 1))  # the second bucket
    assert not bool(applied) and float(error) == 0.0
    for t, original in zip(mine, model(0)):
        assert torch.equal(t, original), "a failed average changed a bucket"


def test_average_difference_writes_avg_minus_snapshot_or_zero_and_keeps_the_snapshot():
    mine, theirs = model(0), model(1)
    live = live_of(mine)
    snapshot, out = FlatBuffers(live), FlatBuffers(live)
    snapshot.copy_from_live()
    _, applied = average_difference_(snapshot, PeerSums(flat_buckets(theirs)), (0, 1), out)
    assert bool(applied)
    for o, s, b in zip(out.flats, flat_buckets(mine), flat_buckets(theirs)):
        torch.testing.assert_close(o, (s + b) / 2 - s)
    assert [f.tolist() for f in snapshot.flats] == [f.tolist() for f in flat_buckets(mine)]

    _, applied = average_difference_(snapshot, PeerSums(flat_buckets(theirs), fail_at=1), (0, 1), out)
    assert not bool(applied)  # decided bucket by bucket: the first bucket's sum took effect, the second's not
    mine_flat, theirs_flat = flat_buckets(mine), flat_buckets(theirs)
    torch.testing.assert_close(out.flats[0], (mine_flat[0] + theirs_flat[0]) / 2 - mine_flat[0])
    assert bool((out.flats[1] == 0).all()), "a failed bucket left a partial difference"


def test_snapshot_averages_chain_keep_local_progress_and_apply_once():
    mine, theirs, third = model(0), model(1), model(2)
    live = live_of(mine)
    averages = SnapshotAverages(live)
    averages.take()
    snap = flat_buckets(mine)
    # two averages on one snapshot: the second starts from the first's result
    averages.average(PeerSums(flat_buckets(theirs)), (0, 1), None, "first")
    averages.average(PeerSums(flat_buckets(third)), (0, 2), None, "second")
    assert averages.buffers() and len(averages._scratch) == 1, "a chained average needs one bucket, no copy"
    first = [(s + b) / 2 for s, b in zip(snap, flat_buckets(theirs))]
    second = [(f + c) / 2 for f, c in zip(first, flat_buckets(third))]
    for t in mine:  # local progress made while the averages ran
        t.add_(1.0)
    assert averages.apply()
    for got, s, want in zip(flat_buckets(mine), snap, second):
        torch.testing.assert_close(got, s + 1.0 + (want - s))
    assert not averages.apply(), "a change is applied once"
    with pytest.raises(RuntimeError, match="not taken"):
        averages.average(PeerSums(flat_buckets(theirs)), (0, 1), None, "stale")
    averages.take()
    averages.average(PeerSums(flat_buckets(theirs)), (0, 1), None, "after a new snapshot")
    with pytest.raises(RuntimeError, match="before the change"):
        averages.take()


class PeerPieces(PeerSums):
    """`PeerSums` whose sums come piece by piece, in order: each call takes the peer's next elements."""

    def __init__(self, peer: list[torch.Tensor], fail_at: int | None = None) -> None:
        super().__init__([torch.cat(peer)], fail_at)
        self.offset = 0

    def sum_(self, tensor: torch.Tensor, members, operation: str = "", timeout=None) -> bool:
        complete = self.calls != self.fail_at
        theirs = self.peer[0][self.offset : self.offset + tensor.numel()]
        self.offset += tensor.numel()
        tensor.add_(theirs, alpha=self.weight) if complete else tensor.fill_(12345.0)
        self.calls += 1
        return complete


@pytest.mark.parametrize("piece_bytes", [8, 2**20])
def test_a_snapshot_averaged_in_place_becomes_its_change_piece_by_piece_and_keeps_local_progress(piece_bytes):
    """`in_place`: one copy of the tensors, not two; the snapshot becomes avg - snapshot, in pieces of
    `piece_bytes` (two elements, or a whole bucket), each bucket all or nothing (a piece's sum that fails
    zeroes its whole bucket, the pieces before it too); local progress made meanwhile is kept, the change
    applied once; and a second average of the same snapshot is refused by name."""
    mine, theirs = model(0), model(1)
    live = live_of(mine)
    snap, peer = flat_buckets(mine), flat_buckets(theirs)
    for fail_at, whole_buckets in ((None, {0, 1}), (7, {0})):  # (7: the second piece of the second bucket)
        for t, v in zip(mine, model(0)):
            t.copy_(v)
        averages = SnapshotAverages(live, in_place=True)
        assert averages.change is averages.snapshot, "one copy"
        averages.take()
        fails = fail_at if piece_bytes == 8 else (1 if fail_at is not None else None)
        peers = PeerPieces(peer, fail_at=fails)
        with pytest.MonkeyPatch.context() as patch:  # pieces of `piece_bytes`
            patch.setattr(averaging, "SUM_PIECE_BYTES", piece_bytes)
            _, applied = averages.average(peers, (0, 1), None, "in place")
        assert bool(applied) == (fail_at is None)
        assert peers.calls == (sum(-(-f.numel() // 2) for f in snap) if piece_bytes == 8 else 2)
        with pytest.raises(RuntimeError, match="a second average of a snapshot that became its first"):
            averages.average(PeerPieces(peer), (0, 1), None, "again")
        for t in mine:  # local progress made while the average ran
            t.add_(1.0)
        assert averages.apply() and not averages.apply()
        for index, (got, s, b) in enumerate(zip(flat_buckets(mine), snap, peer)):
            want = s + 1.0 + ((s + b) / 2 - s if index in whole_buckets else 0.0)
            torch.testing.assert_close(got, want)


def test_a_first_and_a_chained_average_decide_bucket_by_bucket_asking_the_same_verdicts():
    """Both ask one verdict per bucket, in bucket order, so the members of a group agree whichever of the
    two each runs (one verdict for the whole model against one per bucket deadlocked a model of several
    buckets: the first summed its second bucket while the chained one waited for its first verdict)."""
    mine, theirs, third = model(0), model(1), model(2)
    snap = flat_buckets(mine)
    live = live_of(mine)
    averages = SnapshotAverages(live)
    averages.take()
    asked: list[bool] = []

    def decide(complete: bool) -> bool:
        asked.append(complete)
        return complete

    _, applied = averages.average(PeerSums(flat_buckets(theirs), fail_at=1), (0, 1), None, "first", decide)
    assert not bool(applied) and asked == [True, False], "a verdict per bucket, in order"
    first = [(s + b) / 2 for s, b in zip(snap, flat_buckets(theirs))]
    torch.testing.assert_close(averages.change.flats[0], first[0] - snap[0])
    assert bool((averages.change.flats[1] == 0).all()), "the second bucket's average is dropped"
    asked.clear()
    # chained, with its second bucket's sum incomplete: the first bucket is averaged, the second kept
    _, applied = averages.average(PeerSums(flat_buckets(third), fail_at=1), (0, 2), None, "chained", decide)
    assert not bool(applied) and asked == [True, False], "the same verdicts as a first average asks"
    value = [s + c for s, c in zip(snap, averages.change.flats)]
    torch.testing.assert_close(value[0], (first[0] + flat_buckets(third)[0]) / 2)
    torch.testing.assert_close(value[1], snap[1])
    assert all(bool(torch.isfinite(c).all()) for c in averages.change.flats)


def test_chunked_norms_match_a_float64_computation(monkeypatch):
    monkeypatch.setattr(norms, "NORM_CHUNK", 7)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(50, generator=g), torch.randn(50, generator=g)
    assert float(squared_norm(a, 0.5)) == pytest.approx(float((0.5 * a.double()).pow(2).sum()), rel=1e-12)
    # the difference is taken in the tensors' dtype: exact in float64, to float32's rounding otherwise
    assert float(squared_distance(a.double(), b.double(), alpha=0.25)) == pytest.approx(
        float((a.double() - 0.25 * b.double()).pow(2).sum()), rel=1e-12
    )
    assert float(squared_distance(a, b)) == pytest.approx(float((a.double() - b.double()).pow(2).sum()), rel=1e-6)
    wide = torch.randn(6, 5, generator=g, dtype=torch.float64).t()  # not contiguous
    other = torch.randn(5, 6, generator=g, dtype=torch.float64)
    assert float(squared_distance(wide, other)) == pytest.approx(float((wide - other).pow(2).sum()), rel=1e-12)


def test_nan_and_infinities_are_data_not_an_incomplete_sum():
    mine = [torch.tensor([float("nan"), 1.0, 2.0]), torch.tensor([float("inf"), 4.0])]
    theirs = [torch.tensor([1.0, 3.0, 4.0]), torch.tensor([1.0, -float("inf")])]
    live = BucketedTensors(mine, bucket_bytes=12)  # a bucket each
    assert len(live.buckets) == 2
    _, applied = average_(live, PeerSums(theirs), (0, 1))
    assert applied, "a NaN or an infinity in a replica is averaged as DDP would, not taken for a lost member"
    assert torch.isnan(mine[0][0]) and mine[0][1:].tolist() == [2.0, 3.0]
    assert mine[1].tolist() == [float("inf"), -float("inf")]


def largest_allocation(work) -> int:
    """The largest storage `work()` allocates in this thread (scripts/peak_memory.py)."""
    return peak_memory.largest_allocation(work)[0]


def test_a_step_of_snapshot_averages_allocates_nothing_the_size_of_a_bucket(monkeypatch):
    monkeypatch.setattr(norms, "NORM_CHUNK", 256)
    mine = [torch.randn(64, 64), torch.randn(64, 64)]  # 16 KiB each: a bucket each
    live = BucketedTensors(mine, bucket_bytes=16 << 10)
    peer = [torch.randn(64 * 64), torch.randn(64 * 64)]
    averages = SnapshotAverages(live)

    def step() -> None:
        averages.apply()
        averages.take()
        averages.average(PeerSums(peer), (0, 1), None, "a step")
        averages.average(PeerSums(peer), (0, 1), None, "a chained average")

    step()  # the chained average's bucket exists from here on
    assert largest_allocation(step) < 4 << 10  # chunks of the norms and scalars only: not a quarter bucket

    sums = FlatBuffers(live)
    assert largest_allocation(lambda: average_(live, PeerSums(peer), (0, 1), sums=sums)) < 4 << 10
