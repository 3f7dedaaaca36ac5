"""Collectives among the live members that a lost member cannot hang: barrier, sum, gather, broadcast.

Lightning runs collectives at synchronization points (a `sync_dist` reduce, `ModelCheckpoint`'s
broadcast, `EarlyStopping`'s decision, torchmetrics' state sync, a barrier). On the backends' own
collectives a member that dies in the middle can leave the others waiting: gloo's ring algorithms
wait on a live neighbour that gave up, until the process group's timeout, which then closes every
connection of the process. These collectives are built on `GroupComm.sum_` instead, whose sums
survive a member that disappears (`lightning_prague.core.comm.groups`) and say so with an explicit
flag (a NaN or an infinity in a value is data: a diverged loss is reduced as one). Each returns
`None` on every member when a member was lost, and the caller falls back to its own value. A
member that dies part-way through its sends can leave one member's sum complete and another's
not; after each sum every member takes the same branch, decided by `agree` (the control plane's
decision, `GroupWorker.agree`) or, where no control plane runs (after a fit), by the members'
direct agreement (`GroupComm.agree_among`), so the results are alike and the members' next
messages stay in step.
A gather costs one sum when no member's tensor has more than `GATHER_INLINE` elements (a
metric's state, a logged value: the shapes and the values in one slot per member), else two (the
shapes, then the padded tensors); a broadcast of an object one sum when `torch.save` writes it in
at most `BROADCAST_INLINE` bytes (a path, a flag, a small dict: its size and its bytes together),
else two (its size, then its bytes). Each sum is followed by its agreement, a meeting at the
control plane, which costs more than a sum of a few values on a loaded machine: at an epoch's end
of the demo on 4 ranks a rank ran 12 sums before gathers took one, 8 after.

An object travels as `torch.save` writes it and is read with `torch.load(weights_only=True)`,
never unpickled: what another process sent builds tensors, numbers, strings and containers, never
runs code. An object that cannot be read that way (an instance of a class of the user's) fails on
every member with a `TypeError`. They run where no exchange is in flight (the strategies call them
where the ranks are aligned).
"""

from __future__ import annotations

import io
import pathlib
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_prague.core.comm.groups import GroupComm

#: elements of each member's tensor a gather's first sum carries beside the shapes: a gather of
#: tensors no larger takes one sum (and one agreement) instead of two
GATHER_INLINE = 64
#: bytes of an object a broadcast's first sum carries beside its size (`torch.save` writes a short
#: string or a flag in about 1.3 KB): a broadcast of an object no larger takes one sum instead of two
BROADCAST_INLINE = 2048


class MemberCollectives:
    """Collectives over `comm.everyone` (the live members) on `comm`'s process group.

    `timeout`: seconds each may wait for the others (default: `comm`'s, one operation's). At a
    synchronization point that is its bound (`sync_timeout`): a barrier after rank 0 wrote a
    checkpoint waits as long as the write takes, as DDP's does. `agree`: given this member's
    completeness of a sum, whether every member's was complete (the same answer on every member).
    """

    def __init__(
        self,
        comm: GroupComm,
        timeout: Optional[float] = None,
        agree: Optional[Callable[[bool], bool]] = None,
        members: Optional[tuple[int, ...]] = None,
    ) -> None:
        self.comm = comm
        self.timeout = timeout
        self.agree = agree
        self._members = members

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks they run among: `members` if given, else every member of `comm`."""
        return self._members if self._members is not None else self.comm.everyone

    def _sum(self, tensor: torch.Tensor, what: str) -> Optional[torch.Tensor]:
        """`tensor` summed over the members (on the comm's device), or `None` if a member was lost."""
        total = tensor.to(self.comm.device, copy=True)
        complete = self.comm.sum_(total, self.members, what, timeout=self.timeout)
        if self.agree is not None:
            complete = self.agree(complete)
        else:
            complete = self.comm.agree_among(self.members, complete, what)
        return total if complete else None

    def barrier(self) -> bool:
        """Every member reached it (True), or one was lost on the way (False)."""
        return self._sum(torch.ones(1), "a barrier") is not None

    def sum(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """The members' `tensor`s summed (dtype and device of `tensor`), or `None`."""
        total = self._sum(tensor.double(), "a reduce")
        return None if total is None else total.to(tensor.device, tensor.dtype)

    def gather(self, tensor: torch.Tensor) -> Optional[list[torch.Tensor]]:
        """Every member's `tensor` (shapes may differ, not the number of dimensions), in member
        order, or `None`. One sum if no member's tensor holds more than `GATHER_INLINE` elements
        (every member learns so from the first sum's shapes), else two."""
        count, index = len(self.members), self.members.index(self.comm.rank)
        width = 1 + tensor.dim()
        values = tensor.detach().reshape(-1).double()
        first = torch.zeros(count, width + GATHER_INLINE, dtype=torch.float64)
        first[index, 0] = tensor.dim()
        first[index, 1:width] = torch.tensor(tensor.shape, dtype=torch.float64)
        if values.numel() <= GATHER_INLINE:
            first[index, width : width + values.numel()] = values
        summed = self._sum(first, "a gather")
        if summed is None:
            return None
        shapes = summed[:, :width]
        sizes = [int(torch.Size(int(d) for d in row[1:]).numel()) for row in shapes]
        if max(sizes) <= GATHER_INLINE:
            gathered = summed[:, width:]
        else:  # (the same branch on every member: the shapes are the sum's)
            slots = torch.zeros(count, max(sizes), dtype=torch.float64)
            slots[index, : values.numel()] = values
            gathered = self._sum(slots, "a gather's values")
            if gathered is None:
                return None
        out = []
        for row, size, data in zip(shapes, sizes, gathered):
            shape = [int(d) for d in row[1:]]
            out.append(data[:size].reshape(shape).to(tensor.device, tensor.dtype))
        return out

    def broadcast_object(self, obj: Any, src: int) -> tuple[bool, Any]:
        """`(True, src's obj)` on every member, or `(False, None)` if a member was lost.

        Raises `TypeError` on every member if `obj` is not something `torch.load(weights_only=True)`
        reads back (see the module docstring).
        """
        mine = self.comm.rank == src
        payload = encode_object(obj) if mine else b""
        first = torch.zeros(1 + BROADCAST_INLINE, dtype=torch.float64)
        if mine:
            first[0] = float(len(payload)) if payload is not None else -1.0
            if payload is not None and len(payload) <= BROADCAST_INLINE:
                first[1 : 1 + len(payload)] = _as_values(payload)
        summed = self._sum(first, "a broadcast")
        if summed is None:
            return False, None
        size = int(summed[0].item())
        if size < 0:
            kind = type(obj).__name__ if mine else "an object"
            raise TypeError(
                f"rank {src} broadcast {kind}, which torch.load(weights_only=True) cannot read: broadcasts among the "
                "members carry tensors, numbers, strings and lists, tuples and dicts of them"
            )
        if size <= BROADCAST_INLINE:  # (the same branch on every member: the size is the sum's)
            data = summed[1 : 1 + size]
        else:
            buffer = torch.zeros(size, dtype=torch.float64)
            if mine:
                buffer.copy_(_as_values(payload))
            data = self._sum(buffer, "a broadcast's bytes")
            if data is None:
                return False, None
        return True, decode_object(bytes(data.to(torch.uint8).tolist()))


def _as_values(payload: bytes) -> torch.Tensor:
    """An object's bytes as the values a sum carries (one per byte)."""
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).double()


def encode_object(obj: Any) -> bytes | None:
    """`obj` as `torch.save` writes it, or `None` if `decode_object` could not read it back."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        payload = buffer.getvalue()
        decode_object(payload)
    except Exception:  # torch.load refused it (an UnpicklingError naming the class), or torch.save could not
        return None
    return payload


def decode_object(payload: bytes) -> Any:
    """An object that `encode_object` wrote: tensors, numbers, strings and containers only (no code runs)."""
    with torch.serialization.safe_globals(_PATHS):  # file paths, as Lightning broadcasts checkpoint paths
        return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")


_PATHS = [pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath, pathlib.WindowsPath]
