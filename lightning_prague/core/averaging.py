"""Averaging model state over a group, a few flat buckets at a time.

One collective per tensor would cost a round trip per parameter; flattening into buckets of at
most `bucket_bytes` (grouped by dtype and device) keeps it to a handful per average.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_prague.core.groups import GroupComm, sum_is_complete


def averaged_state(module: nn.Module) -> list[torch.Tensor]:
    """The tensors that replicas must agree on: parameters and floating-point buffers.

    Integer buffers (e.g. BatchNorm's `num_batches_tracked`) are counters, not estimates, and are
    left alone.
    """
    tensors = [p.data for p in module.parameters()]
    tensors += [b.data for b in module.buffers() if torch.is_floating_point(b)]
    return tensors


class BucketedTensors:
    """A fixed list of tensors split into flat buckets for collectives."""

    def __init__(self, tensors: Sequence[torch.Tensor], bucket_bytes: int = 25 * 2**20) -> None:
        self.tensors = list(tensors)
        self.buckets: list[list[torch.Tensor]] = []
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in self.tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            current: list[torch.Tensor] = []
            size = 0
            for t in group:
                nbytes = t.numel() * t.element_size()
                if current and size + nbytes > bucket_bytes:
                    self.buckets.append(current)
                    current, size = [], 0
                current.append(t)
                size += nbytes
            if current:
                self.buckets.append(current)

    @property
    def device(self) -> torch.device:
        """Where the tensors live (the CPU for none)."""
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def flat(self, bucket: Iterable[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in bucket])

    @staticmethod
    def unflatten_(bucket: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        offset = 0
        for t in bucket:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


def average_(
    tensors: BucketedTensors,
    comm: GroupComm,
    members: Sequence[int],
    weight: float | None = None,
    operation: str = "average",
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: every member's tensors become the (weighted) average over `members`, or, if a
    member disappeared during it, stay as they were (all-or-nothing: no member keeps a partial sum).

    With `weight=None` this is the plain mean. Otherwise each member contributes `weight * x`
    and the weights of the members must sum to 1 (staleness-aware Partial Reduce).

    Returns `(error, applied)`, scalar tensors on the tensors' device (reading them is left to
    whoever needs the numbers, so the average costs no host synchronisation): `error` is
    `||x - avg||^2 / ||avg||^2` for this member's tensors before the average, a free estimate of how
    far this replica had drifted from its group (`consensus/group_error`); `applied` whether the
    average was complete and taken. Every bucket is summed before any is written back, so the
    decision covers the whole model (one extra copy of the tensors while it runs).
    """
    scale = 1.0 / len(members) if weight is None else weight
    distance = torch.zeros((), dtype=torch.float64, device=tensors.device)
    norm = torch.zeros((), dtype=torch.float64, device=tensors.device)
    applied = torch.ones((), dtype=torch.bool, device=tensors.device)
    sums = []
    for bucket in tensors.buckets:
        flat = tensors.flat(bucket)
        flat.mul_(scale)
        comm.sum_(flat, members, operation)
        applied &= sum_is_complete(flat)
        sums.append(flat)
    for bucket, flat in zip(tensors.buckets, sums):
        before = tensors.flat(bucket)
        flat = torch.where(applied, flat, before)
        distance += (before - flat).double().pow(2).sum()
        norm += flat.double().pow(2).sum()
        tensors.unflatten_(bucket, flat)
    return relative_error(distance, norm), applied


def averaged_optimizer_state(
    state: dict[str, Any], comm: GroupComm, members: Sequence[int], operation: str = "optimizer state average"
) -> tuple[dict[str, Any], bool]:
    """A copy of an optimizer's `state_dict()` whose floating-point state tensors (Adam's moments and
    step count, SGD's momentum buffers) are the mean over `members`; the optimizer is not changed.

    Replicas that are averaged at synchronization points have moments of the same model, so a
    checkpoint holds their mean as it holds the mean of the parameters, and a resumed run starts
    every worker from it rather than from one worker's. A collective of `members`, where they are
    aligned. Returns `(state, averaged)`: this rank's own state, unchanged, if a member was lost
    meanwhile (all-or-nothing, as every average) or if the members' states do not have the same
    structure (a worker that never stepped holds no moments yet): the mean of those would be wrong.
    """
    per_param = {key: dict(entry) for key, entry in state.get("state", {}).items()}
    names = sorted(
        ((key, name) for key, entry in per_param.items() for name, value in entry.items() if _averageable(value)),
        key=str,
    )
    copy = {**state, "state": per_param}
    if len(members) < 2:
        return copy, True
    layout = repr(
        [(key, name, tuple(per_param[key][name].shape), str(per_param[key][name].dtype)) for key, name in names]
    )
    # every member runs this check, even one with no state yet, so the sums below match on every member
    if not _same_everywhere(zlib.crc32(layout.encode()) % (1 << 20), comm, members, operation):
        return copy, False
    if not names:  # no floating-point state (plain SGD) on any member: nothing to average
        return copy, True
    averaged = [per_param[key][name].detach().clone() for key, name in names]  # the optimizer keeps its own
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in averaged:
        by_device.setdefault(tensor.device, []).append(tensor)
    complete = True
    for group in by_device.values():
        _, applied = average_(BucketedTensors(group), comm, members, operation=operation)
        complete = complete and bool(applied)
    if complete:  # all-or-nothing over the whole state, not per device
        for (key, name), tensor in zip(names, averaged):
            per_param[key][name] = tensor
    return copy, complete


def _averageable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _same_everywhere(signature: int, comm: GroupComm, members: Sequence[int], operation: str) -> bool:
    """Whether every member has the same `signature` (below 2**20: its sum and its sum of squares
    are exact in float64, and they equal `count` times its value and square only if all are equal)."""
    mine = torch.tensor([float(signature), float(signature) ** 2, 1.0], dtype=torch.float64, device=comm.device)
    comm.sum_(mine, members, f"{operation}: the layouts")
    if not bool(torch.isfinite(mine).all()):
        return False
    count = float(len(members))
    return bool(mine[0] == count * signature and mine[1] == count * float(signature) ** 2 and mine[2] == count)


def relative_error(distance: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """`distance / norm` (both squared norms, scalar tensors), 0 when both are 0, inf when only norm is."""
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    zero_norm = torch.where(distance == 0, torch.zeros_like(distance), torch.full_like(distance, float("inf")))
    return torch.where(norm > 0, distance / safe, zero_norm)
