"""A replica's ranks agree on a stop one step after any of them saw it, and on mixing a gossip round in.

Under the lock-step strategies (`decent_adam`, `prague` with `grouping="static"`) a replica's ranks
average their gradients at every step, so they must stop at the same step. A stop, though, reaches
each rank at its own batch: the control plane's announcement of a SIGTERM arrives over each rank's
own connection, and the rank the signal hit sees it at once. A rank that stopped while its replica's
other rank went into the next step's gradient average left that rank waiting for a peer that never
came (the test that found it: SIGTERM on a replica's rank under `decent_adam`; its mate failed at the
gradient average's broken connection and was left out of the job).

`StopAgreement` makes the decision the replica's: before every training batch each rank puts in what
it saw (a signal's stop, a requested stop) and gets back what the replica's ranks put in one batch
before, summed. Each call starts one all-reduce of two numbers on the replica's ranks and waits for
the previous call's, which finished a step ago: the ranks get the same answer at the same batch, so
they stop together, one batch after the first of them saw the stop. The numbers live in host memory
on a gloo group of the replica's ranks (on an NCCL job a second group, made once per fit), so this
never waits for the device; nothing else is exchanged, and nothing goes beyond the replica.

`ReplicaAgreement` makes the replica's ranks mix a gossip round in at the same update when the
schedule runs at each replica's own pace (`pace="own"`): each rank's round (its slice or shard with its
column) finishes at its own moment, and the replica mixes it in only once it is done on all of them.

`DonationAgreement` makes the ranks of a replica sharded over them (`shard=True`) send a replica that
comes back their shards of one moment: each rank sends the joiner of its own index its shard
(`GroupGenerator`'s `donors`), and the admission reaches each rank at its own batch. At every batch's
end each rank puts in the newest membership epoch it heard of and gets the newest one the replica's
ranks put in one batch before (a lagged all-reduce, as `StopAgreement`'s); every rank then sends the
state of every admission up to that epoch, at the same batch. Before a meeting (drained: nothing of
the replica moves until the release) they agree at once (`settle`).

A rank of the replica lost makes the wait fail (gloo: at once; otherwise at the group's timeout), as
the next gradient average would: the replica is lost with it (`lightning_prague.core.replicas.sync`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from lightning_prague.core.errors import CoordinationTimeout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Agreed:
    """What the replica's ranks saw, as agreed one batch after they saw it."""

    #: a signal's stop (SIGTERM, the requeue signal): stop at this batch
    signal: bool = False
    #: a requested stop (`trainer.should_stop`): end the epoch after this batch
    request: bool = False


class _LaggedAllReduce:
    """An all-reduce of a few numbers among a replica's ranks, started at one call and read at the next:
    two host buffers used in turn, one in flight while the next batch fills the other."""

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta, what: str, width: int, op: dist.ReduceOp) -> None:
        self.group = group
        self.timeout = timeout
        self.what = what
        self.op = op
        self._buffers = (torch.zeros(width, dtype=torch.int64), torch.zeros(width, dtype=torch.int64))
        self._pending: Optional[dist.Work] = None
        self.calls = 0

    def _start(self, values: list[int]) -> dist.Work:
        """Start the all-reduce of this call's `values`."""
        sent = self._buffers[self.calls % 2]
        sent.copy_(torch.tensor(values, dtype=torch.int64))
        self.calls += 1
        return dist.all_reduce(sent, op=self.op, group=self.group, async_op=True)

    def _wait(self, work: dist.Work, operation: str) -> list[int]:
        """The result of the last call started (`work`), once done; `CoordinationTimeout` past the timeout."""
        if not work.wait(self.timeout):
            raise CoordinationTimeout(
                f"{self.what}: the replica's ranks did not agree on {operation} within {self.timeout}"
            )
        return [int(v) for v in self._buffers[(self.calls - 1) % 2].tolist()]

    def _collect(self, operation: str) -> Optional[list[int]]:
        """The result of the call in flight (`None` if none)."""
        if self._pending is None:
            return None
        work, self._pending = self._pending, None
        return self._wait(work, operation)


class StopAgreement(_LaggedAllReduce):
    """One replica's agreement on stops; every rank of the replica calls `exchange` once per training batch."""

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta, what: str) -> None:
        super().__init__(group, timeout, what, 2, dist.ReduceOp.SUM)

    def exchange(self, signal: bool, request: bool) -> Agreed:
        """Put in what this rank saw; get what the replica's ranks put in at the previous call (nothing
        at the first)."""
        agreed = Agreed()
        previous = self._collect("a stop")
        if previous is not None:
            agreed = Agreed(signal=previous[0] > 0, request=previous[1] > 0)
        self._pending = self._start([int(signal), int(request)])
        if agreed.signal or agreed.request:
            log.debug("%s: agreed at call %d: %s", self.what, self.calls, agreed)
        return agreed


class DonationAgreement(_LaggedAllReduce):
    """One sharded replica's agreement on the admissions its ranks send their shards for; every rank of
    the replica calls `lagged` once per training batch and `settle` at each meeting it drains for."""

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta, what: str) -> None:
        super().__init__(group, timeout, what, 1, dist.ReduceOp.MAX)

    def lagged(self, newest: int) -> int:
        """Put in `newest` (the newest membership epoch this rank heard of); get the newest the replica's
        ranks put in at the previous call (0 at the first)."""
        previous = self._collect("the admissions it sends its shards for")
        self._pending = self._start([newest])
        return previous[0] if previous is not None else 0

    def settle(self, newest: int) -> int:
        """The newest membership epoch any rank of the replica heard of, `newest` included, now."""
        previous = self._collect("the admissions it sends its shards for")
        agreed = self._wait(self._start([newest]), "the admissions it sends its shards for before a meeting")[0]
        agreed = max(agreed, previous[0] if previous is not None else 0)
        log.debug("%s: agreed on membership epoch %d before a meeting", self.what, agreed)
        return agreed


class ReplicaAgreement:
    """A replica's ranks agree on what their gossip rounds need alike: whether each of them can mix its
    round in without waiting (a schedule's rounds at each replica's own pace, `LaggedGossip`'s
    `own_pace`), and, for a replica come back, the round they take gossip up at.

    Each rank of a replica averages its own slice (or shard) of the model with its column, so its round
    finishes at its own moment; the replica's ranks hold one model (or its shards, updated in step) and
    must mix a round in at the same update. Before each update every rank puts in whether its round is
    done and gets whether it is done on all of them: one blocking all-reduce of one number, in host
    memory on a gloo group of the replica's ranks, bounded by `timeout`. The replica's ranks step
    together anyway (their gradient average), so the wait is the group's latency inside the node.
    """

    def __init__(self, group: dist.ProcessGroup, timeout: timedelta, what: str) -> None:
        self.group = group
        self.timeout = timeout
        self.what = what
        self._value = torch.zeros(1, dtype=torch.int64)

    def _reduce(self, value: int, op: dist.ReduceOp, operation: str) -> int:
        self._value[0] = value
        work = dist.all_reduce(self._value, op=op, group=self.group, async_op=True)
        if not work.wait(self.timeout):
            raise CoordinationTimeout(
                f"{self.what}: the replica's ranks did not agree on {operation} within {self.timeout}"
            )
        return int(self._value[0])

    def all_done(self, done: bool) -> bool:
        """Whether the round in flight is done on every rank of the replica (`done`: on this one)."""
        return self._reduce(int(done), dist.ReduceOp.MIN, "mixing a round in") > 0

    def largest(self, value: int, operation: str) -> int:
        """The largest of the replica's ranks' `value`s (`operation`: what it is, for an error)."""
        return self._reduce(value, dist.ReduceOp.MAX, operation)
