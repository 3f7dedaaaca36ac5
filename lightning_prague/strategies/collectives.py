"""Lightning's collectives routed to where they can run: locally, over the live members, or on the world group.

Lightning calls the strategy's `barrier`, `broadcast`, `reduce` and `all_gather` (and torchmetrics
a metric's `dist_sync_fn`) assuming that every rank is at the same point of the loop. Under the
asynchronous strategies that holds only at synchronization points, so each call goes one of three
ways (`RoutedCollectives`):

* **locally**, while the ranks are unaligned (between synchronization points): a world-wide
  collective would hang there, so it returns this rank's own value, with one warning per operation;
* **over the live members** (`lightning_prague.core.comm.collectives.MemberCollectives`) during a
  fit and after a fit that lost a rank: built on the library's group primitive, which a lost member
  cannot hang; a collective cut short by a lost member leaves this rank its own value;
* **on the world group**, Lightning's own, outside a fit where nobody was lost; if it fails because
  a rank left the job, the error names that rank (the backend's only says a connection closed).

The strategy keeps Lightning's hooks and hands each call here with Lightning's own collective as
the world-group fallback.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_prague.core.comm.collectives import MemberCollectives
from lightning_prague.core.comm.groups import GroupComm

if TYPE_CHECKING:
    from lightning_prague.strategies.base import DecentralizedStrategy

log = logging.getLogger(__name__)

#: `warnings.warn`'s stacklevel from `RoutedCollectives.local_instead` to the code that called the
#: strategy's collective (local_instead, the routed collective, the strategy's hook, its caller)
_CALLER = 4


class RoutedCollectives:
    """Runs the strategy's collectives where they can run (see the module docstring)."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy

    def local_instead(self, operation: str, stacklevel: int = _CALLER) -> bool:
        """Whether `operation` must act locally (the ranks are unaligned); warns once per operation."""
        strategy = self.strategy
        job = strategy.job
        if job is not None and job.joining:  # a rejoining rank before its admission: nobody to meet
            return True
        if strategy.controller.aligned:
            return False
        worker = strategy.worker
        if job is not None and job.rejoined and worker is not None and worker.stats.syncs == 0:
            # a rank that rejoined, before its first meeting (Lightning restores its checkpoint and sets
            # up its validation data there): local, as the others train on; nothing to warn about
            log.debug("rank %d: %s before its first meeting since it rejoined: local", strategy.global_rank, operation)
            return True
        if operation not in strategy.warned:
            strategy.warned.add(operation)
            warnings.warn(
                f"{operation} was called during asynchronous training with strategy={strategy.strategy_name!r}, "
                "while ranks are at different steps; a world-wide collective here would hang, so it uses this "
                "rank's local value instead (this warning is shown once). Values logged with sync_dist=True "
                "during training steps are per-rank; they are reduced across ranks at epoch end.",
                stacklevel=stacklevel,
            )
        return True

    @property
    def survivors(self) -> Optional[dist.ProcessGroup]:
        """The members' group once the membership changed (a rank was lost, or rejoined as a new
        process): the world group then holds a process that is gone, or lacks one that came."""
        job = self.strategy.job
        if job is None or not dist.is_initialized():
            return None
        if len(job.members) == job.world_size and not job.rebuilds and not job.rejoined:
            return None  # the world group holds every rank of this job's first processes
        return job.group

    def members(self) -> Optional[MemberCollectives]:
        """Collectives that survive a lost member: during a fit, and after one that lost a rank."""
        strategy = self.strategy
        worker = strategy.worker
        if worker is not None and worker.fresh:  # ranks just rejoined, not aligned yet: among the others,
            # deciding among themselves (a meeting of the control plane would wait for the joiners)
            others = tuple(m for m in worker.members if m not in worker.fresh)
            return MemberCollectives(worker.comm, strategy.sync_timeout, members=others)
        if worker is not None:
            return MemberCollectives(worker.comm, strategy.sync_timeout, agree=worker.agree)
        job = strategy.job
        if self.survivors is None or job is None:
            return None  # no fit, nobody lost: the world group's collectives
        comm = GroupComm(strategy.global_rank, job.world_size, strategy.operation_timeout, job.group)
        comm.rebind(job.group, job.members)
        return MemberCollectives(comm, strategy.sync_timeout)

    def incomplete(self, operation: str) -> None:
        log.warning(
            "rank %d: %s was cut short by a lost rank; this rank uses its own value (the next synchronization "
            "point goes on without the lost rank)",
            self.strategy.global_rank,
            operation,
        )

    def world(self, what: str, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A collective of Lightning's on the world group; if it fails because a rank left the job,
        the error says which rank (the backend's only says a connection closed)."""
        try:
            return collective(*args, **kwargs)
        except RuntimeError as err:
            session = self.strategy.session
            explained = session.explain(err, f"{what} of every rank (Lightning's)") if session is not None else err
            if explained is err:
                raise
            raise explained from err

    # -- the collectives; `lightning`: Lightning's own, for the world group ----------------------
    def barrier(self, lightning: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        if self.local_instead("barrier"):
            return
        members = self.members()
        if members is None:
            self.world("a barrier", lightning, *args, **kwargs)
        elif not members.barrier():
            self.incomplete("a barrier")

    def broadcast(self, lightning: Callable[[Any, int], Any], obj: Any, src: int) -> Any:
        if self.local_instead("broadcast"):
            return obj
        members = self.members()
        if members is None:
            return self.world("a broadcast", lightning, obj, src)
        source = src if src in members.members else members.members[0]  # rank 0's duties moved
        done, value = members.broadcast_object(obj, source)
        if not done:
            self.incomplete("a broadcast")
            return obj
        return value

    def reduce(self, lightning: Callable[..., Any], tensor: Any, group: Optional[Any], reduce_op: Optional[Any]) -> Any:
        if self.local_instead("reduce (e.g. self.log(..., sync_dist=True))"):
            return tensor
        members = self.members()
        if members is None or group is not None or not isinstance(tensor, Tensor):
            return self.world("a reduce", lightning, tensor, group, reduce_op)
        op = str(reduce_op).lower().split(".")[-1] if reduce_op is not None else "sum"
        if op in ("max", "min"):
            gathered = members.gather(tensor)
            result = None
            if gathered is not None:
                stacked = torch.stack(gathered)
                result = stacked.amax(0) if op == "max" else stacked.amin(0)
        else:
            result = members.sum(tensor)
            if result is not None and op in ("mean", "avg"):
                result = result / len(members.members)
        if result is None:
            self.incomplete("a reduce")
            return tensor
        return result

    def all_gather(
        self, lightning: Callable[..., Tensor], tensor: Tensor, group: Optional[Any], sync_grads: bool
    ) -> Tensor:
        if self.local_instead("all_gather"):
            return tensor.unsqueeze(0)
        members = self.members()
        if members is None or group is not None or sync_grads:
            return self.world("an all_gather", lightning, tensor, group, sync_grads)
        gathered = members.gather(tensor)
        if gathered is None:
            self.incomplete("an all_gather")
            return tensor.unsqueeze(0)
        return torch.stack(gathered)

    def gather_metric_state(self, result: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        """torchmetrics' `dist_sync_fn`: the states of every member (of the survivors after a loss);
        between synchronization points (`dist_sync_on_step=True`) this rank's own, as for `reduce`."""
        # torchmetrics calls this directly: one frame less than the strategy's hooks
        if self.local_instead("a torchmetrics metric's state sync (dist_sync_on_step=True)", _CALLER - 1):
            return [result]
        members = self.members()
        if members is None:
            return gather_all_tensors(result, group)
        gathered = members.gather(result)
        if gathered is None:
            self.incomplete("a metric's state sync")
            return [result]
        return gathered
