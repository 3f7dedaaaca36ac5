"""The synchronous part of a replica: its ranks average their gradients at every step, as DDP does.

A replica's `K` ranks train one model: each takes its own batch, and `DistributedDataParallel` on
the replica's own process group averages their gradients during the backward pass (bucket by
bucket, overlapped with it; on NCCL over NVLink inside a node), so they take the same optimizer
step and hold the same model. Across replicas the strategy's decentralized algorithm runs, each
replica one unit (`lightning_prague.core.replicas.columns`).

The replica's process group is made once per fit by its own ranks only (`use_local_synchronization`:
no other rank takes part or waits), under a name the ranks agree on (the replica and how many
replica groups this process made before: every rank of a replica makes them in the same fits), on
the default group's store. It is the one communicator a replica adds, and nothing is made per step.

**A rank lost** (killed, fenced, failed) loses its replica: the others' next gradient average fails
(gloo: at once, the peer's connection closes; NCCL: at the group's timeout, or when the watchdog
aborts it) and they fail with it, leaving the job; the other replicas train on without the whole
replica (`Schedule.whole`). The replica comes back whole: the control plane admits its new processes
together, and they make its group anew on the job's store (`replica_group`'s `came_back`: a rejoined
process's default group is a stand-in of its own).
"""

from __future__ import annotations

import itertools
import logging
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lightning_prague.core.membership import new_named_group
from lightning_prague.core.replicas.layout import ReplicaLayout

log = logging.getLogger(__name__)

#: how many replica groups this process made: part of each one's name, the same on every rank of a replica
_made = itertools.count()


def replica_group(
    layout: ReplicaLayout,
    rank: int,
    backend: str,
    timeout: timedelta,
    device_id: Optional[torch.device] = None,
    came_back: Optional[tuple[dist.Store, int]] = None,
) -> dist.ProcessGroup:
    """The process group of `rank`'s replica, made by the replica's ranks only (each must call it).

    `came_back`: the replica's ranks are new processes, admitted together in a membership epoch
    (`(the job's store, the epoch)`): the group is made on the job's store, under a name of that
    admission (the lost replica's group met under the replica's own name on the old default store)."""
    replica = layout.replica_of(rank)
    ranks = layout.ranks_of(replica)
    epoch = f".epoch{came_back[1]}" if came_back is not None else ""
    name = f"lightning_prague.replica.{replica}{epoch}.{next(_made)}"
    log.debug("rank %d: making the process group of replica %d (ranks %s) as %s", rank, replica, list(ranks), name)
    what = f"the process group of replica {replica} (ranks {list(ranks)})"
    store = came_back[0] if came_back is not None else None
    return new_named_group(ranks, backend, name, timeout, what, device_id, store=store)


def synchronous(
    module: torch.nn.Module, group: dist.ProcessGroup, device_ids: Optional[list[int]] = None, **ddp: Any
) -> DistributedDataParallel:
    """`module` wrapped so that its replica's ranks average their gradients during the backward pass
    (`DistributedDataParallel` on the replica's `group`; `ddp`: its options)."""
    return DistributedDataParallel(module, device_ids=device_ids, process_group=group, **ddp)
