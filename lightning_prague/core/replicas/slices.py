"""The models of several replicas averaged slice by slice: each rank sends only its share across them.

Every rank of every replica in `replicas` calls `average_replicas_by_slices` with the same replicas
and its replica's model as one flat tensor (the same on each rank of a replica: a replica trains
synchronously). Rank `i` of a replica sums its slice `i` with rank `i` of the other replicas (its
column, `ReplicaLayout.column`); the column decides, all-or-nothing on each of its members
(`decide`: the control plane's verdict), whether its average takes effect. Then each replica puts
its model back together: a sum over its own ranks, each contributing the slice it holds (averaged,
or as it was where its column's average did not take effect) and zeros elsewhere. Columns are
independent: each conserves the sum of its slice over the replicas, so the model's does too.

Across replicas (between nodes) a rank sends `1/K` of the model, where `K` is the replica size;
inside the replica the reassembly sends the whole model once per rank (an intra-node link). A
model sharded over the replica's ranks, each rank holding its own slice, needs no reassembly:
`average_sharded_replicas` averages each rank's local shards (FSDP2's `fully_shard` on the
replica's ranks: rank `i` of every replica holds shard `i` of each parameter) over its column.
Each call allocates one buffer the size of the model (the reassembly's) and one of its slice: no
strategy averages replicas yet; the one that does keeps them across steps, as the exchangers do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_prague.core.comm.groups import Decide, GroupComm
from lightning_prague.core.replicas.layout import ReplicaLayout


def average_replicas_by_slices(
    comm: GroupComm,
    flat: torch.Tensor,
    layout: ReplicaLayout,
    replicas: Sequence[int],
    decide: Decide | None = None,
    operation: str = "a replica average",
) -> tuple[bool, bool]:
    """In place: `flat` becomes the mean of `replicas`' models, slice by slice (see the module
    docstring). `decide`: the column's all-or-nothing decision from this member's completeness
    (default: this member's own completeness, for a caller without faults to fear). Returns whether
    this rank's column average took effect, and whether the replica's model was put back together
    (if not, a rank of the replica is gone, and `flat` is as it was)."""
    rank = comm.rank
    index = layout.index_of(rank)
    column = layout.column(rank, replicas)
    start, stop = layout.slice_bounds(index, flat.numel())
    part = flat[start:stop].clone()
    complete = comm.sum_(part, column, f"{operation}: slice {index} over ranks {list(column)}")
    applied = decide(complete) if decide is not None else complete
    own = torch.zeros_like(flat)
    own[start:stop] = part.div_(len(column)) if applied else flat[start:stop]
    replica = layout.ranks_of(layout.replica_of(rank))
    whole = comm.sum_(own, replica, f"{operation}: the slices of replica {layout.replica_of(rank)}")
    if whole:
        flat.copy_(own)
    return applied, whole


def average_sharded_replicas(
    comm: GroupComm,
    shards: Sequence[torch.Tensor],
    layout: ReplicaLayout,
    replicas: Sequence[int],
    decide: Decide | None = None,
    operation: str = "a sharded replica average",
) -> bool:
    """In place: this rank's `shards` (its local shard of each parameter of a model sharded over its
    replica's ranks, in the model's order: `DTensor.to_local()` under FSDP2) become their mean over
    its column of `replicas`: the same shards of the same parameters on rank `i` of each replica.
    One sum of `1/K` of the model per rank, and nothing inside the replica. `decide` as in
    `average_replicas_by_slices`; returns whether the average took effect (all-or-nothing over the
    column: the shards stay as they were otherwise)."""
    column = layout.column(comm.rank, replicas)
    flat = torch.cat([shard.detach().reshape(-1).to(comm.device, torch.float64) for shard in shards])
    what = f"{operation}: shard {layout.index_of(comm.rank)} over ranks {list(column)}"
    complete = comm.sum_(flat, column, what)
    applied = decide(complete) if decide is not None else complete
    if applied:
        flat.div_(len(column))
        offset = 0
        with torch.no_grad():
            for shard in shards:
                count = shard.numel()
                shard.copy_(flat[offset : offset + count].view(shard.shape))
                offset += count
    return applied
