"""One model on every rank: at every synchronization point and after fit, the whole state_dict.

Not only the parameters: BatchNorm's running statistics and `num_batches_tracked` (which differs
between ranks that took different numbers of steps), integer buffers that training changes, a buffer
the module replaces instead of updating in place, and a tied parameter, which must stay one tensor.
Every strategy runs `scripts/one_model.py` (3 workers, one 5x slower, 2 epochs); every rank records
digests of its state_dict at the end of each validation, at each epoch-end checkpoint and after fit.

Equality is exact (SHA-256 of the bytes), not a tolerance: the global average leaves every member with
bitwise the same sums and the integer buffers take one member's value, so anything short of equal
bits is a replica that missed the average (a tolerance would hide a buffer left out of it whenever
the replicas happened to stay close).

The in-process tests check the pieces: what is averaged (a tied parameter once), following a buffer
the module replaced, and the element-wise maximum of the integer buffers among two members.
"""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch
from helpers import run_many
from torch import nn

from lightning_prague.core.comm.averaging import BucketedTensors, FlatBuffers, averaged_state, follow_live
from lightning_prague.core.comm.exact import SMALL, ExactMaxima, exact_state, layout_signature
from lightning_prague.core.errors import SyncMismatchError

STRATEGIES = ("prague", "partial_reduce", "adpsgd", "decent_adam")
WORKERS = 3
EPOCHS = 2


@pytest.mark.timeout(240)
def test_every_rank_holds_the_same_state_dict_at_validation_checkpoints_and_after_fit(tmp_path):
    runs = {
        name: ("one_model.py", ["--strategy", name, "--out", str(tmp_path / name), "--devices", str(WORKERS)])
        for name in STRATEGIES
    }
    outcomes = run_many(tmp_path, runs, timeout=220)
    for name, run in outcomes.items():
        assert run.status == 0, f"{name}:\n{run.log[-3000:]}"
        records = [json.loads((run.dir / f"state.rank{r}.json").read_text()) for r in range(WORKERS)]
        expected = [f"{kind}{epoch}" for epoch in range(EPOCHS) for kind in ("val", "save")] + ["fit_end"]
        for record in records:
            assert sorted(record["states"]) == sorted(expected), (name, record["rank"])
        for point in expected:
            states = [record["states"][point] for record in records]
            differing = sorted(key for key in states[0] if len({state.get(key) for state in states}) > 1)
            assert not differing, f"{name}: the ranks differ at {point} in {differing}"
            assert states[0]["head.weight"] == states[0]["embed.weight"], (name, point)
        for epoch in range(EPOCHS):  # the file rank 0 wrote holds that same state
            saved = torch.load(run.dir / "ckpt" / f"e{epoch}.ckpt", weights_only=True, map_location="cpu")
            assert _digests(saved["state_dict"]) == records[0]["states"][f"save{epoch}"], (name, epoch)
        batches = [record["batches"] for record in records]
        if name != "decent_adam":  # the asynchronous ones: the slow rank trained fewer batches
            assert min(batches) < max(batches), (name, batches)
        for record in records:
            assert record["tied"], f"{name}: rank {record['rank']} untied the embedding from the output layer"
            # both counters count this rank's batches between meetings and take the largest at each
            assert record["steps"] == record["num_batches_tracked"] >= max(batches), (name, record)


def _digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """As `scripts/one_model.py` digests each entry."""
    out = {}
    for name, tensor in state.items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = f"{tensor.dtype}{tuple(tensor.shape)}:{hashlib.sha256(data).hexdigest()}"
    return out


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.alias = nn.Parameter(self.embed.weight.data)  # another parameter object over the same memory
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("table", torch.arange(SMALL + 4))
        self.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))


def test_averaged_state_holds_a_shared_tensor_once_and_exact_state_the_integer_buffers():
    model = Tied()
    state = averaged_state(model)
    assert sum(t.data_ptr() == model.embed.weight.data_ptr() for t in state) == 1
    assert [t.shape for t in state] == [
        (5, 3), (3,), (3,), (2, 2), (3,), (3,)  # embedding, BN weight and bias, phase, running mean and var
    ]  # fmt: skip
    assert [t.dtype for t in exact_state(model)] == [torch.int64, torch.int64]  # num_batches_tracked, table


def test_the_averaged_tensors_follow_a_buffer_the_module_replaced():
    model = Tied()
    live = BucketedTensors(averaged_state(model), bucket_bytes=64)
    flat = FlatBuffers(live)
    model.norm.running_mean = torch.full((3,), 7.0)  # replaced, not updated in place
    assert follow_live(live, averaged_state(model))
    flat.copy_from_live()
    assert any(torch.equal(view, model.norm.running_mean) for views in flat.views for view in views)
    assert any(t.data_ptr() == model.norm.running_mean.data_ptr() for t in live.tensors)
    model.norm.running_mean = torch.zeros(4)  # another shape: cannot follow
    assert not follow_live(live, averaged_state(model))


class PairComm:
    """Sums between two members, each in a thread of its own (`sum_` waits for the other's tensor)."""

    device = torch.device("cpu")

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.shared = rank, shared

    def sum_(self, tensor: torch.Tensor, members, operation: str = "", timeout=None) -> bool:
        self.shared[self.rank] = tensor.clone()
        self.shared["barrier"].wait()
        total = self.shared[0] + self.shared[1]
        self.shared["barrier"].wait()
        tensor.copy_(total)
        return True

    def agree_among(self, members, complete: bool, operation: str = "") -> bool:
        return complete


def _agree_between_two(states: list[list[torch.Tensor]], signatures: list[int]) -> list:
    shared = {"barrier": threading.Barrier(2, timeout=10)}
    outcome: list = [None, None]

    def member(rank: int) -> None:
        maxima = ExactMaxima(states[rank], PairComm(rank, shared), (0, 1), "test")
        try:
            complete = maxima.gather(signatures[rank])
            maxima.apply()
            outcome[rank] = bool(complete)
        except SyncMismatchError as err:
            outcome[rank] = err

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return outcome


def test_integer_and_boolean_buffers_become_their_element_wise_maximum_over_the_members():
    def state(counter: int, table: list[int], flag: bool) -> list[torch.Tensor]:
        big = torch.tensor(table + [5] * SMALL)
        return [torch.tensor(counter), big, torch.tensor([flag, False]), torch.arange(SMALL * 2) % 3 == 0]

    states = [state(7, [1, 9], False), state(12, [4, 2], True)]
    assert _agree_between_two(states, [1, 1]) == [True, True]
    for mine in states:
        assert int(mine[0]) == 12  # a counter never runs backwards
        assert mine[1][:2].tolist() == [4, 9] and mine[1][2:].tolist() == [5] * SMALL
        assert mine[2].tolist() == [True, False] and mine[2].dtype == torch.bool
        assert torch.equal(mine[3], torch.arange(SMALL * 2) % 3 == 0)
    # beyond 2**53, where float64 no longer tells neighbouring integers apart: exact through 32-bit halves
    big = [torch.tensor([2**60 + 3, -(2**60)]), torch.tensor([2**60 + 1, -(2**60) + 1])]
    assert _agree_between_two([[big[0]], [big[1]]], [1, 1]) == [True, True]
    assert big[0].tolist() == big[1].tolist() == [2**60 + 3, -(2**60) + 1]


def test_replicas_of_different_layouts_fail_with_an_error_naming_the_ranks():
    states = [[torch.tensor(1)], [torch.tensor(2)]]
    signatures = [layout_signature([torch.zeros(3)]), layout_signature([torch.zeros(4)])]
    outcome = _agree_between_two(states, signatures)
    assert all(isinstance(o, SyncMismatchError) and "ranks [0]; ranks [1]" in str(o) for o in outcome), outcome
    assert [int(s[0]) for s in states] == [1, 2]  # nothing written
