"""The buffers that have no mean: integer and boolean ones, agreed on exactly at synchronization points.

Averaging makes the replicas' floating-point state one model (`averaging.averaged_state`). An integer
or boolean buffer (BatchNorm's `num_batches_tracked`, a step counter, a mask, an index table) has no
mean, and under asynchronous training the ranks take different numbers of steps, so their counters
differ. At every global average (`GroupWorker.global_average`: every synchronization point that
averages the replicas, the end of fit included) each such buffer becomes, on every live member, its
**element-wise maximum over the members** (for a boolean buffer: any). A counter then never runs
backwards on any rank, and `num_batches_tracked` counts the batches of the replica that trained the
most; a constant (equal everywhere: `position_ids`, a causal mask) stays what it is. Between
synchronization points these buffers stay local, as the ranks' step counts do.

Exact by construction: values travel as float64 pieces (an integer as its high and low 32 bits),
each member's in a slot of its own that the others leave zero, so the sum over the members is a
gather (`x + 0` is exact); a lost member makes it incomplete, decided as every other sum. A
small buffer (at most `SMALL` elements: a counter) travels whole in the first sum; a larger one only
as two checksums there, and travels whole in a second sum only if the checksums differ among the
members (a constant table never does). The first sum also carries a signature of each member's
layout (the shapes and dtypes of the averaged tensors and of these buffers): replicas of different
models fail with an error naming the ranks instead of averaging garbage or hanging.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Optional

import torch
from torch import nn

from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.errors import SyncMismatchError

#: buffers of at most this many elements travel whole in the first sum (a counter is one element)
SMALL = 16

_LOW = 1 << 32


def exact_state(module: nn.Module) -> list[torch.Tensor]:
    """The module's buffers that are neither floating-point nor complex (the live tensors, each once
    even if several modules share it): what `ExactMaxima` agrees on at a synchronization point."""
    return list(unique_tensors(b for b in module.buffers() if not (b.is_floating_point() or b.is_complex())))


def storage_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensor objects the same memory: storage, offset, shape, strides, dtype, device."""
    try:
        pointer = tensor.untyped_storage().data_ptr()
    except (NotImplementedError, RuntimeError):  # no storage (an uninitialized parameter): itself only
        return (id(tensor),)
    return (pointer, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)


def unique_tensors(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """`tensors` without the repeats of a memory seen before (`storage_key`), in order."""
    seen: set[tuple] = set()
    for t in tensors:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            yield t


def layout_signature(*states: Sequence[torch.Tensor]) -> int:
    """A checksum (below 2**32) of the shapes and dtypes of `states`, in order: equal on replicas of one model."""
    text = repr([[(tuple(t.shape), str(t.dtype)) for t in state] for state in states])
    return zlib.crc32(text.encode())


def _pieces(tensor: torch.Tensor) -> torch.Tensor:
    """Integer (or boolean) values as float64, exactly: the high and low 32 bits of each, interleaved."""
    values = tensor.reshape(-1).to(torch.int64)
    high = torch.div(values, _LOW, rounding_mode="floor")
    return torch.stack((high, values - high * _LOW), dim=1).reshape(-1).to(torch.float64)


def _values(pieces: torch.Tensor) -> torch.Tensor:
    """`_pieces` back to int64 values, along the last dimension: `[..., 2n]` -> `[..., n]`."""
    pairs = pieces.reshape(*pieces.shape[:-1], -1, 2).to(torch.int64)
    return pairs[..., 0] * _LOW + pairs[..., 1]


def _checksums(tensor: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of a buffer's values (a sum and a position-weighted sum, wrapping): any one
    changed element changes the first, two changes that cancel in it change the second."""
    values = tensor.reshape(-1).to(torch.int64)
    weights = torch.arange(1, values.numel() + 1, dtype=torch.int64, device=values.device)
    return torch.stack((values.sum(), (values * weights).sum()))


class ExactMaxima:
    """One global average's agreement on the exact buffers `tensors` among `members` (see the module
    docstring): `gather` runs the sums and computes the maxima, `apply` writes them, once the caller
    decided (with the average of the floating-point state) that every member completed."""

    def __init__(
        self, tensors: Sequence[torch.Tensor], comm: GroupComm, members: Sequence[int], operation: str
    ) -> None:
        self.tensors = list(tensors)
        self.comm = comm
        self.members = tuple(members)
        self.operation = operation
        self._maxima: list[tuple[torch.Tensor, torch.Tensor]] = []

    def _gather(self, row: torch.Tensor, what: str) -> tuple[torch.Tensor, bool]:
        """Every member's `row` (`[members, len(row)]`, in member order) and whether this member's
        sum was complete (`GroupComm.sum_`'s flag)."""
        table = torch.zeros(len(self.members), row.numel(), dtype=torch.float64, device=self.comm.device)
        table[self.members.index(self.comm.rank)] = row.to(self.comm.device)
        complete = self.comm.sum_(table, self.members, f"{self.operation}: {what}")
        return table, complete

    def _keep_maxima(self, tensors: list[torch.Tensor], table: torch.Tensor, start: int) -> None:
        for t in tensors:
            width = 2 * t.numel()
            largest = _values(table[:, start : start + width]).amax(dim=0)
            self._maxima.append((t, largest.reshape(t.shape).to(device=t.device, dtype=t.dtype)))
            start += width

    def gather(self, signature: int, agree: Optional[Callable[[bool], bool]] = None) -> Optional[bool]:
        """Run the sums (every member alike) and compute the maxima; returns whether this member's
        later sum was complete (to be decided with the average it goes with) or `None` when every
        member knows already that the first sum was incomplete somewhere.

        Raises `SyncMismatchError` if the members' `signature`s (`layout_signature` of what they
        average and of these buffers) differ. `agree` (`GroupWorker.agree`): given this member's
        completeness of the first sum, whether every member's was complete, the same answer on
        every member (without it the members agree directly, `GroupComm.agree_among`). It is asked
        before the layouts are compared: a sum that lacks a member's share would look like another
        layout.
        """
        self._maxima = []
        small = [t for t in self.tensors if t.numel() <= SMALL]
        large = [t for t in self.tensors if t.numel() > SMALL]
        device = self.comm.device
        parts = [torch.tensor([float(signature)], dtype=torch.float64, device=device)]
        parts += [_pieces(t).to(device) for t in small]
        parts += [_pieces(_checksums(t)).to(device) for t in large]
        table, complete = self._gather(torch.cat(parts), "the layouts and the small buffers")
        agreed = agree(complete) if agree is not None else self.comm.agree_among(self.members, complete, self.operation)
        if not agreed:  # the first sum lacks a share somewhere: no second sum anywhere
            return None
        # a synchronization point may read the host: the layouts must agree before anything is averaged
        signatures = table[:, 0].tolist()
        if len(set(signatures)) > 1:
            by_signature: dict[float, list[int]] = {}
            for rank, value in zip(self.members, signatures):
                by_signature.setdefault(value, []).append(rank)
            groups = "; ".join(f"ranks {ranks}" for ranks in by_signature.values())
            raise SyncMismatchError(
                f"rank {self.comm.rank}: the replicas are not one model at {self.operation}: their parameters "
                f"or buffers differ in number, shape or dtype between {groups} (was a buffer or parameter "
                "added, removed or reshaped on some rank after setup?)"
            )
        self._keep_maxima(small, table, 1)
        if not large:
            return True
        start = 1 + sum(2 * t.numel() for t in small)
        checks = table[:, start:].reshape(len(self.members), len(large), 4)
        differing = [t for t, same in zip(large, (checks == checks[:1]).all(dim=2).all(dim=0).tolist()) if not same]
        if not differing:
            return True
        values, complete = self._gather(torch.cat([_pieces(t).to(device) for t in differing]), "the large buffers")
        self._keep_maxima(differing, values, 0)
        return complete

    def apply(self) -> None:
        """Every buffer becomes its maximum over the members (call after `gather`, once decided)."""
        for tensor, largest in self._maxima:
            tensor.copy_(largest)
        self._maxima = []
