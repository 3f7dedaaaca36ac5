"""A replica's model put back together after its ranks averaged their slices apart, at every step.

Under a work-queue strategy (`prague`, `partial_reduce`) in replica groups with the model whole on
each rank (`shard=False`), rank `i` of a replica averages only slice `i` of each bucket of the model
(`GroupWorker.part`) with rank `i` of other replicas, in groups the control plane draws column by
column (`lightning_prague.core.grouping.columns`), whenever its own exchange is done: the ranks of one
replica take part in different groups at different times. So each rank is the owner of its slice:
nobody else changes it but the replica's synchronous steps, which change every rank's copy alike.

`SliceReassembly` runs on every rank of the replica after every exchanger step and after every
meeting's release (the same number of times on each: a replica's ranks take the same steps and meet
together; never while a rank drains before a meeting, where it must still serve the groups others
drew it into): each contributes the slice it owns and zeros
elsewhere to one sum over the replica's process group, bucket by bucket, and takes the result. Every
rank then holds the same model again, bitwise, with each slice as its owner has it. That is one
all-reduce of the model inside the replica per step (a node's NVLink under `replica_size="node"`),
besides DDP's gradient average; it runs on the backend's device without a host synchronisation, in
one bucket of scratch memory.

**Faults.** A rank of the replica lost makes the others' sum fail (gloo: at once; NCCL: at the
replica group's timeout), as their next gradient average would: the replica is lost, as it is with
the lock-step strategies (`lightning_prague.core.replicas.sync`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_prague.core.comm.averaging import BucketedTensors, Part, part_bounds, shaped_views

log = logging.getLogger(__name__)


class SliceReassembly:
    """Each rank of a replica takes slice `j` of every bucket from rank `j` of it (see the module docstring).

    `tensors`: the live tensors as the exchanges bucket them now (a callable: a worker may rebuild
    them, `GroupWorker.tensors`); `group`: the replica's process group, in which this rank is `index`
    of `parts` (the replica's ranks in order).
    """

    def __init__(self, tensors: Callable[[], BucketedTensors], group: dist.ProcessGroup, part: Part) -> None:
        index, parts = part
        if not 0 <= index < parts:
            raise ValueError(f"index {index} is outside a replica of {parts} ranks")
        self.tensors = tensors
        self.group = group
        self.part = part
        self.rounds = 0  # reassemblies run (the same on every rank of the replica)
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def _bucket_scratch(self, bucket: list[torch.Tensor]) -> torch.Tensor:
        numel = sum(t.numel() for t in bucket)
        key = (bucket[0].dtype, bucket[0].device)
        scratch = self._scratch.get(key)
        if scratch is None or scratch.numel() < numel:
            scratch = self._scratch[key] = torch.empty(numel, dtype=bucket[0].dtype, device=bucket[0].device)
        return scratch[:numel]

    def __call__(self) -> None:
        """Put the replica's model together: a collective of the replica's ranks, each calling it once
        at the same point of its steps."""
        for bucket in self.tensors().buckets:
            flat = self._bucket_scratch(bucket)
            views = shaped_views(flat, bucket)
            torch._foreach_copy_(views, bucket)
            start, stop = part_bounds(flat.numel(), self.part)
            flat[:start].zero_()
            flat[stop:].zero_()
            dist.all_reduce(flat, group=self.group)
            torch._foreach_copy_(bucket, views)
        self.rounds += 1
        log.debug("replica slices put together (%d)", self.rounds)
