"""Global progress: the number of batches trained by all workers together, and where it stops.

Asynchronous workers run different numbers of steps, so no per-worker step count can schedule
anything that every worker must do together (validation every N steps, a checkpoint every N steps,
`max_steps`, a learning-rate schedule). One count is the same on every worker: the global number
of batches trained. Each batch gets a *ticket* (its 1-based global number) from an atomic counter
of the session's coordinator (`Session.counters`) when the worker fetches it; tickets increase on
every worker in the order its batches are trained.

A *boundary* is a global batch count at which every worker must meet (a synchronization point):
every batch with a ticket up to the boundary is trained before it, none after it. A worker is at a
boundary when the batch it just trained is its last one with a ticket up to it: its next batch has
a larger ticket, or it has none left in the epoch (`Boundary.due`). Because a worker holds at
most one ticket beyond the boundary it has not passed yet (its prefetched batch; a ticket claimed a
batch ahead only while its last one is well before the boundary, `ProgressLoader._may_claim_ahead`),
boundaries at least `world_size` batches apart are met one at a time, on every worker exactly once.

`max_steps=S` is the budget `S x world_size x accumulate_grad_batches` batches, the same work as
under DDP. Claims beyond the budget fail, so the budget is honoured exactly whoever trains faster.

Data: a map-style epoch has a known number of batches. A streaming epoch (every worker reads its
own stream) ends when the first worker's stream ends: the others' next claims fail, so nobody waits
for a slow worker's stream and nothing is read twice. The count at that moment is published so that
every worker knows where the epoch ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_prague.core.data.counters import EpochKeys, begin_increment, increment, read, wait_for
from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout

#: added to an epoch's claim counter when its first stream ends: later claims see a value above it
ENDED = 1 << 40
#: the names of the store keys of one epoch's progress
EPOCH_KEYS = ("claims", "enders", "end")
#: the store keys of one epoch's progress: `progress/<epoch>/<name>`
_KEYS = EpochKeys("progress", EPOCH_KEYS)


@dataclass(frozen=True)
class Boundary:
    """A synchronization point at `batches` global batches; `step` is the global step it stands for."""

    batches: int
    step: int
    validate: bool = False
    checkpoint: bool = False

    def due(self, next_ticket: Optional[int], epoch_end: Optional[int]) -> bool:
        """Whether a worker that just trained a batch is at this boundary.

        `next_ticket`: the ticket of its next batch (`None`: it has none left this epoch);
        `epoch_end`: the epoch's last ticket once the worker knows it (it has none left).
        """
        if next_ticket is not None:
            return next_ticket > self.batches
        return epoch_end is not None and self.batches <= epoch_end


@dataclass(frozen=True)
class ProgressSchedule:
    """Which global batch counts are boundaries; the same on every worker, computed without communication.

    Args:
        world_size: workers.
        batches_per_step: global batches per global optimizer step (`world_size x accumulate`).
        budget: batches in all (`max_steps x batches_per_step`); `None`: no step budget.
        validate_every: validation every this many global batches, counted from the start of
            training (`check_val_every_n_epoch=None`) or of each epoch (`validate_in_epoch`).
        checkpoint_every: global batch intervals of step-based checkpoints (counted from the start).
    """

    world_size: int
    batches_per_step: int
    budget: Optional[int] = None
    validate_every: Optional[int] = None
    validate_in_epoch: bool = False
    checkpoint_every: tuple[int, ...] = ()
    #: `(global batches, global step)` where this fit's steps start counting: `(0, 0)`, or where a fit
    #: resumed on another number of workers (its steps of `batches_per_step` count from there)
    origin: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        for every in (self.validate_every, *self.checkpoint_every):
            if every is not None and every < self.world_size:
                raise ConfigurationError(
                    f"a synchronization point every {every} global batches is closer than one batch per worker "
                    f"({self.world_size} workers); use an interval of at least one step"
                )

    def step_of(self, batches: int) -> int:
        """The global step (optimizer steps of one worker under DDP) after `batches` global batches."""
        origin_batches, origin_step = self.origin
        return origin_step + (batches - origin_batches) // self.batches_per_step

    @property
    def _step_zero(self) -> int:
        """The global batch count at which step 0 lies in this fit's unit (0 unless resumed on another world)."""
        origin_batches, origin_step = self.origin
        return origin_batches - origin_step * self.batches_per_step

    def boundaries(
        self, epoch_base: int, epoch_end: Optional[int], tail: int = 0, start: Optional[int] = None
    ) -> Iterator[Boundary]:
        """The boundaries after `start` (default: `epoch_base`, where the epoch began) in one epoch, in order.

        `epoch_end`: the epoch's last ticket when known in advance (map-style data), else `None`.
        Boundaries in the epoch's last `tail` batches (where a worker may already have run out of
        data while others still hold several batches) are merged into one at the epoch's end.
        """
        end = epoch_end
        if self.budget is not None:
            end = self.budget if end is None else min(end, self.budget)
        # only where the data's end binds: a budget or a stream's end is met by failing claims, and
        # then no worker holds more than one batch beyond the boundary it has not passed
        data_end_binds = epoch_end is not None and (self.budget is None or epoch_end <= self.budget)
        merge_from = end - tail if data_end_binds and end is not None else None
        merged: Optional[Boundary] = None
        position = epoch_base if start is None else start
        while True:
            nxt = self._next_after(position, epoch_base)
            if nxt is None or (end is not None and nxt.batches > end):
                break
            position = nxt.batches
            if merge_from is not None and nxt.batches > merge_from and nxt.batches < end:
                merged = _merge(merged, nxt)
                continue
            if merged is not None and nxt.batches == end:
                nxt = _merge(merged, nxt)
                merged = None
            yield Boundary(nxt.batches, nxt.step, nxt.validate, nxt.checkpoint)
        if merged is not None and end is not None:
            yield Boundary(end, merged.step, merged.validate, merged.checkpoint)

    def _next_after(self, position: int, epoch_base: int) -> Optional[Boundary]:
        candidates: list[tuple[int, bool, bool]] = []
        if self.validate_every is not None:
            origin = epoch_base if self.validate_in_epoch else self._step_zero
            candidates.append((_next_multiple(position, origin, self.validate_every), True, False))
        for every in self.checkpoint_every:
            candidates.append((_next_multiple(position, self._step_zero, every), False, True))
        if self.budget is not None and self.budget > position:
            candidates.append((self.budget, False, False))
        if not candidates:
            return None
        batches = min(c[0] for c in candidates)
        hits = [c for c in candidates if c[0] == batches]
        return Boundary(
            batches,
            self.step_of(batches),
            validate=any(c[1] for c in hits),
            checkpoint=any(c[2] for c in hits),
        )


def _next_multiple(position: int, origin: int, every: int) -> int:
    return origin + (math.floor((position - origin) / every) + 1) * every


def _merge(a: Optional[Boundary], b: Boundary) -> Boundary:
    if a is None:
        return b
    return Boundary(
        max(a.batches, b.batches), max(a.step, b.step), a.validate or b.validate, a.checkpoint or b.checkpoint
    )


@dataclass(eq=False)
class ProgressCounter:
    """One worker's view of the global ticket counter (one store operation per batch).

    `store` is a client of the job's store under this session's prefix. Keys: one claim counter
    and one end marker per epoch (nothing grows per step). Each worker's first batch of an epoch
    has a ticket set aside for it (`epoch start + 1 + rank`), so every worker trains in every
    epoch. An epoch's count is rounded up to whole global steps (`batches_per_step`), as DDP pads
    an epoch to equal shards: epochs start at step boundaries and a step budget never leaves an
    epoch with fewer batches than workers.
    """

    store: Any
    timeout: float
    budget: Optional[int] = None
    rank: int = 0
    world_size: int = 1
    batches_per_step: int = 1
    _first_taken: bool = field(default=False, init=False)
    epoch: int = field(default=0, init=False)
    #: global batches trained before this epoch
    epoch_base: int = field(default=0, init=False)
    #: tickets of this epoch handed out before this session (a resumed epoch)
    offset: int = field(default=0, init=False)
    #: the epoch's last ticket, once known here
    epoch_end: Optional[int] = field(default=None, init=False)
    #: a claim failed because the step budget is spent (not because the epoch's data ended)
    budget_spent: bool = field(default=False, init=False)
    #: a sharded stream: the first rank that found the queue empty does not end the others' reads (they
    #: train the shards they hold to their ends); it marks where progress boundaries stop (`stream_end`)
    keep_claiming: bool = field(default=False, init=False)
    #: in a sharded stream's epoch, the ticket count when the first rank found the queue empty: boundaries
    #: after it are left to the epoch's end on every rank (some rank would have no batch to meet them with)
    stream_end: Optional[int] = field(default=None, init=False)
    #: this worker's place among the members (its first ticket's offset): its rank until some are lost
    _index: int = field(default=0, init=False)
    #: the members from the next epoch on
    _members: Optional[list[int]] = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._index = self.rank

    def set_members(self, members: list[int]) -> None:
        """The ranks still in the job, from the next epoch on (this epoch's tickets are numbered)."""
        self._members = sorted(members)

    def begin_epoch(self, epoch: int, epoch_base: int, offset: int = 0) -> None:
        self.epoch, self.epoch_base, self.offset, self.epoch_end = epoch, epoch_base, offset, None
        self.stream_end = None
        self._first_taken = False
        if self._members is not None:
            self.world_size, self._index = len(self._members), self._members.index(self.rank)

    def join_epoch(self, epoch: int, epoch_base: int, offset: int, world_size: int) -> None:
        """Join `epoch` under way (a rank that rejoined): the members' origin and number of tickets set
        aside (`world_size`, the members at the epoch's start); no ticket is set aside for this rank,
        it claims every one."""
        self.begin_epoch(epoch, epoch_base, offset)
        self.world_size = world_size
        self._first_taken = True

    def padded(self, end: int) -> int:
        """`end` rounded up to whole global steps from the epoch's start (then capped by the budget)."""
        steps = -(-(end - self.epoch_base) // self.batches_per_step)
        padded = self.epoch_base + steps * self.batches_per_step
        return padded if self.budget is None else min(padded, self.budget)

    @property
    def _origin(self) -> int:
        return self.epoch_base + self.offset

    def _key(self, name: str) -> str:
        return _KEYS.key(self.epoch, name)

    @property
    def first_taken(self) -> bool:
        """This worker took its first ticket of the epoch (set aside for it; claims come after it)."""
        return self._first_taken

    @property
    def tickets_key(self) -> str:
        """The counter this epoch's tickets are claimed from (the work queue claims one with each chunk)."""
        return self._key("claims")

    def claim(self) -> Optional[int]:
        """The next global ticket, or `None` when the epoch's data or the budget is used up."""
        return self.begin_claim()()

    def begin_claim(self) -> Callable[[], Optional[int]]:
        """`claim`, sent now; call what it returns for the ticket (the control plane's round trip
        overlaps the caller's training). Claims are answered in the order they were sent."""
        if not self._first_taken:
            self._first_taken = True
            ticket = self._origin + 1 + self._index
            return lambda: self._within_budget(ticket)
        answer = begin_increment(self.store, self.tickets_key)
        epoch = self.epoch
        return lambda: self._claimed(answer(), epoch)

    def _claimed(self, value: int, epoch: int) -> Optional[int]:
        """The ticket of the `value`-th claim of `epoch`'s counter (see `claim`)."""
        if epoch != self.epoch:  # answered after the epoch moved on: nothing of it is trained
            return None
        if value > ENDED:
            if self.keep_claiming:  # (claimed after the first rank found the queue empty: boundaries stop)
                self.stream_end = self._published_end()
                return self.accept(value - ENDED)
            self.epoch_end = self._published_end()
            return None
        return self.accept(value)

    def accept(self, value: int) -> Optional[int]:
        """The ticket of the `value`-th claim on `tickets_key` (made here or along with a chunk), or
        `None` beyond the budget."""
        return self._within_budget(self._origin + self.world_size + value)

    def claim_value(self, ticket: int) -> int:
        """The value of `tickets_key` whose claim gives `ticket` (`accept`'s inverse; a set-aside
        ticket's is at most 0)."""
        return ticket - self._origin - self.world_size

    def _within_budget(self, ticket: int) -> Optional[int]:
        if self.budget is not None and ticket > self.budget:
            self.epoch_end = self.budget
            self.budget_spent = True
            return None
        return ticket

    def end_stream(self) -> int:
        """This worker's data ran out: end the epoch for everyone; return the epoch's last ticket."""
        if increment(self.store, self._key("enders")) == 1:
            claimed = increment(self.store, self._key("claims"), ENDED) - ENDED
            self.store.set(self._key("end"), str(self._origin + self.world_size + claimed))
        self.epoch_end = self._published_end()
        return self.epoch_end

    def mark_shard_stream_end(self) -> None:
        """A sharded stream's queue ran out here (this worker is about to wait at its end): the first to
        get here marks the ticket count, without ending anyone's claims. The others learn of it with
        their next ticket (`stream_end`): progress boundaries stop there, and a slow worker gives its
        shards in progress back (`lightning_prague.core.data.shard_queue`)."""
        if increment(self.store, self._key("enders")) == 1:
            claimed = increment(self.store, self._key("claims"), ENDED) - ENDED
            self.store.set(self._key("end"), str(self._origin + self.world_size + claimed))

    def end_shard_stream(self) -> int:
        """This worker's reads of a sharded stream ended (the queue's last claims returned together): the
        mark (`mark_shard_stream_end`), if nobody made it yet; returns it (`stream_end`)."""
        self.mark_shard_stream_end()
        self.stream_end = self.epoch_end = self._published_end()
        return self.stream_end

    def exhausted(self, epoch_end: int) -> None:
        """This worker's data ran out at a known last ticket (map-style data): nothing to tell the others."""
        self.epoch_end = self.padded(epoch_end)

    def has_keys(self, epoch: int) -> bool:
        """Whether `epoch` still has keys in the store."""
        return _KEYS.present(self.store, epoch)

    def forget_epoch(self, epoch: int) -> None:
        """Delete `epoch`'s keys from the store; call once every rank is done with that epoch."""
        _KEYS.forget(self.store, epoch)

    def final_count(self) -> int:
        """Global batches trained when this epoch is over (call when every worker has stopped claiming)."""
        value = read(self.store, self._key("claims"))
        if value > ENDED and self.keep_claiming:  # (claims went on after the mark)
            return self.padded(self._origin + self.world_size + value - ENDED)
        if value > ENDED:
            return self._published_end()
        return self.padded(self._origin + self.world_size + value)

    def _published_end(self) -> int:
        key = self._key("end")
        try:
            wait_for(self.store, [key], self.timeout)
        except RuntimeError as err:
            raise CoordinationTimeout(
                f"rank {self.rank}: epoch {self.epoch} ended (another rank's stream ran out) but the rank that "
                f"ended it did not publish the epoch's last batch within {self.timeout:.0f}s "
                f"(operation: read the epoch's end from the store; ranks 0-{self.world_size - 1} share it)"
            ) from err
        return self.padded(int(self.store.get(key)))
