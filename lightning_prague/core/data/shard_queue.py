"""A sharded stream shared out by speed: its shards are items of the work queue, read from positions.

The map-style work queue (`lightning_prague.core.data.sharding`) hands out chunks of one batch. A
stream (`lightning_prague.core.data.shard_sources`) has shards of unknown length instead, so here an
item of the same queue, and of the same ledger at the control plane, is **a shard**:

* each rank starts an epoch with the shard numbered by its place among the members, then claims
  further shards; fast ranks claim more, and an epoch ends when every shard has been read and
  trained, not when the first rank's stream ends;
* the ledger's value for a held shard (the ticket of a map-style chunk) is **the position up to which
  it was trained**: after each optimizer step a rank reports it (`work` message, `hold` with the
  position; no reply, no round trip), and `done` once the shard's end was trained. A lost rank's
  shards go back to the queue with their positions, and whoever claims one reads it on from there.
  A batch the lost rank trained but had not reported died with its model: it is read again, once;
* a slow rank leaves the epoch's tail to the others as with chunks (`WorkQueueSampler._leave_tail`),
  and once the queue ran out (a rank that found it empty marked it before waiting at its end) a slow
  rank gives the shards it reads back from where its reads stand, after training what it read, to
  the ranks waiting there (`queue_ran_out`): they do not wait for its whole shard. A give-back is a
  request: the control plane takes the shard only where a claim is parked or another member still
  claims. Where nobody would read it (a meeting at a checkpoint boundary released the parked claims:
  the others ended their epoch), the rank keeps it, and once its reads ended it reads the shards it
  kept itself, in a further pass of its loader (`continue_kept`), so nothing is left unread.

**Reading, in the rank's process or in `DataLoader` worker processes.** The sampler runs in the rank's
own process and yields `ShardRead`s (which shard, from which position, how many samples); the
`ShardReader`, a map-style dataset over those keys, reads them, wherever the `DataLoader` runs it.
A `DataLoader` with `num_workers=W` sends the `i`-th key to worker `i % W`, so the sampler keeps `W`
*slots*, one shard each, and cycles over them: worker `w` reads slot `w`'s shard straight on, and
keeps its iterator open between reads. Only the rank's process claims, through its own connection;
a worker process never talks to the control plane. A read past a shard's end returns no batch
(`StreamBatch.rows` is 0); the loader drops it, and the slot claims its next shard.

Every batch (`StreamBatch`) carries its read, so the rank knows which shard and position each batch
it trains ends at (`take`, `trained`), whatever the loader prefetched.

What a rank re-reads or skips at most, through a fault: a rank killed after its optimizer step and
before its report re-reads one batch (in the others' models it never was); a rank lost after its
last claim returned (every rank had emptied the queue) while it trains its last batches loses them,
as with map-style chunks (`docs/fault_tolerance.md`, "Exactly once").
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Optional

from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from lightning_prague.core.data.shard_sources import ShardSource, read_rows
from lightning_prague.core.data.sharding import WorkQueueSampler
from lightning_prague.core.errors import ConfigurationError

log = logging.getLogger(__name__)


class ShardRead(NamedTuple):
    """A read of `count` samples of `shard` from position `start`, by the loader's slot `slot`."""

    slot: int
    shard: int
    start: int
    count: int


class StreamBatch(NamedTuple):
    """What the loader returns for a `ShardRead`: the samples it read (`rows`; fewer than asked where
    the shard ended) collated into `batch` (`None` when there were none)."""

    read: ShardRead
    rows: int
    batch: Any


class TrainedTo(NamedTuple):
    """A batch handed to the trainer: the shard it came from and the position it ends at."""

    shard: int
    end: int


def keep_batch(item: StreamBatch) -> StreamBatch:
    """The `DataLoader`'s collate for `ShardReader`'s items: each is one batch, collated already."""
    return item


class ShardReader(Dataset):
    """A map-style dataset over `ShardRead` keys: each read, collated (see the module docstring)."""

    def __init__(self, source: ShardSource, collate_fn: Optional[Callable[[list[Any]], Any]] = None) -> None:
        self.source = source
        self.collate_fn = collate_fn or default_collate
        #: per slot, the shard it reads, the position its iterator stands at, and the iterator
        self._open: dict[int, tuple[int, int, Iterator[Any]]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_open"] = {}  # (open iterators stay in the process that opened them)
        return state

    def __getitem__(self, read: ShardRead) -> StreamBatch:
        slot, shard, start, count = (int(v) for v in read)
        opened = self._open.get(slot)
        if opened is not None and opened[0] == shard and opened[1] == start:
            rows_from = opened[2]
        else:
            rows_from = self.source.iter_shard(shard, start)
        rows = read_rows(rows_from, count)
        self._open[slot] = (shard, start + len(rows), rows_from)
        return StreamBatch(ShardRead(slot, shard, start, count), len(rows), self.collate_fn(rows) if rows else None)


class ShardQueueSampler(WorkQueueSampler):
    """Yields `ShardRead`s of the shards this rank claims from the work queue (see the module docstring).

    `num_shards` shards, `batch_size` samples per read, `slots`: the loader's worker processes (1
    where it reads in this process)."""

    def __init__(
        self,
        num_shards: int,
        batch_size: int,
        rank: int,
        world_size: int,
        store: Any,
        slots: int = 1,
        timeout: float = 300.0,
        slow_ratio: float = 2.0,
    ) -> None:
        if num_shards < world_size:
            raise ConfigurationError(
                f"the stream has {num_shards} shard(s), fewer than the {world_size} workers: each worker starts "
                "an epoch with a shard of its own; give the stream more shards (for a Hugging Face dataset, "
                "more data files, or `to_iterable_dataset(num_shards=...)`)"
            )
        if batch_size < 1:
            raise ConfigurationError(f"the batch size must be at least 1, got {batch_size}")
        super().__init__(
            num_shards, 1, rank, world_size, store, shuffle=False, timeout=timeout, slow_ratio=slow_ratio,
            claim_ahead=False,
        )  # fmt: skip
        self.batch_size = batch_size
        self.slots = max(1, int(slots))
        #: the batches handed to the trainer and not yet trained, in order (`ProgressLoader` pops them)
        self.untrained: deque[TrainedTo] = deque()  # type: ignore[assignment]
        #: shard -> the position where it ended, once a read found its end
        self._ends: dict[int, int] = {}
        #: per shard, the batches handed out and not yet trained
        self._in_training: dict[int, int] = {}
        #: per shard held and not trained to its end, the position it was trained to
        self._trained_to: dict[int, int] = {}
        #: the positions a resumed checkpoint's shards go on from (`resume_shards`)
        self._resume_positions: dict[int, int] = {}
        self.shards_taken = 0  # in the current epoch
        #: the queue ran out of shards (another rank's reads ended) and this rank is slow: it gives the
        #: shards it reads back from where its reads stand (`queue_ran_out`)
        self._giving_back = False
        #: per shard being given back: the position it goes back from, and its reads not yet taken
        self._back_at: dict[int, int] = {}
        self._unread: dict[int, int] = {}
        #: shards given back this epoch
        self.shards_given_back = 0
        #: shard -> the position a give-back nobody took left it at: this rank reads it on itself
        self._kept: dict[int, int] = {}
        #: shards given back while a batch of them was in training (`continue_kept`): its report is no hold
        self._given: set[int] = set()
        #: the shards a further pass of this epoch reads (`continue_kept`), and whether this pass is one
        self._continuing: Optional[dict[int, int]] = None
        self._no_give_back = False
        #: called once this rank's last reading slot finds the queue empty, before it waits at its end
        #: (`ProgressCounter.mark_shard_stream_end`: how the others learn that the queue ran out)
        self.on_queue_end: Optional[Callable[[], None]] = None

    # -- the reads -----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[ShardRead]:  # type: ignore[override]
        continuing, self._continuing = self._continuing, None
        if continuing is None:
            first = self._start_epoch()
            self._ends.clear()
            self._in_training.clear()
            self._trained_to.clear()
            self._back_at.clear()
            self._unread.clear()
            self._kept.clear()
            self._given.clear()
            self._no_give_back = False
            self.shards_taken = 0
            self.shards_given_back = 0
        else:  # a further pass of the epoch: the shards kept, held already, then claims as at the queue's end
            first = sorted(continuing)
            self._resume_positions.update(continuing)
            self._no_give_back = True
        self._giving_back = False
        #: per slot: [shard, the position of its next read], or None while it needs a shard
        reading: list[Optional[list[int]]] = [None] * self.slots
        retired: set[int] = set()
        previous: tuple[float, int] | None = None
        left = False
        slot = -1
        while len(retired) < self.slots:
            slot = (slot + 1) % self.slots
            if slot in retired:
                continue
            current = reading[slot]
            if current is not None and current[0] in self._ends:
                reading[slot] = current = None  # its shard ended: the slot takes another
            if self._giving_back and (current is None or current[0] not in self._ends):
                # the queue is empty and this rank slow: the rest of its shard goes to a faster rank, from
                # where its reads stand, once the reads issued so far are trained (`_give_back_when_trained`)
                if current is not None:
                    self._back_at[current[0]] = current[1]
                    self._give_back_when_trained(current[0])
                retired.add(slot)
                continue
            if current is None:
                if first:  # this rank's place among the members (no claim), or a resumed checkpoint's shards
                    shard = first.pop(0)
                    if self.shards_taken and continuing is None:  # (all but the first are claimed by number)
                        self._claim_shard(park=False, shard=shard)
                    start = self._resume_positions.pop(shard, 0)
                    if start and continuing is None:  # the control plane holds it from there, whatever happens
                        self._report_position(shard, start)
                else:
                    others = any(r is not None for s, r in enumerate(reading) if s != slot and s not in retired)
                    if left or (self.slow_ratio > 0 and not others and self._leave_tail(previous)):
                        left = True
                        retired.add(slot)
                        continue
                    claimed_at = self.clock()
                    # at the queue's end only the last slot that reads waits there (it parks while a
                    # member may give shards back); a slot beside others that read just retires
                    shard, position = self._claim_shard(park=not others and self.on_queue_end is None)
                    if shard >= self.num_chunks and not others and self.on_queue_end is not None:
                        self.on_queue_end()  # before it waits: the others learn that the queue ran out
                        shard, position = self._claim_shard(park=True)
                    self._observe(previous, claimed_at, shard)
                    previous = (self.clock(), shard)
                    if shard >= self.num_chunks:
                        retired.add(slot)
                        continue
                    start = max(0, position or 0)  # (a shard set aside for a lost rank comes with no position)
                self._trained_to.setdefault(shard, start)
                self.shards_taken += 1
                self.chunks_taken += 1
                self.total_chunks_taken += 1
                log.debug("rank %d: slot %d reads shard %d from %d", self.rank, slot, shard, start)
                reading[slot] = current = [shard, start]
            self._unread[current[0]] = self._unread.get(current[0], 0) + 1
            yield ShardRead(slot, current[0], current[1], self.batch_size)
            current[1] += self.batch_size

    def _slower_in_epoch(self, position: int) -> bool:
        """Shards differ in length, so counts of them say nothing of speed: the estimates decide alone."""
        return True

    def _claim_shard(self, park: bool, shard: Optional[int] = None) -> tuple[int, Optional[int]]:
        """The next shard of the queue with the position a lost rank left it at (`None`: its start),
        or `shard`, one a resumed checkpoint hands this rank."""
        return self._begin_claim(shard, park=park)()

    def _report_position(self, shard: int, position: int) -> None:
        self._trained_to[shard] = position
        report = getattr(self._store, "report", None)
        if report is not None:
            report(self._cursor_key, hold=[shard], tickets=[position])

    # -- the tail: a slow rank gives its shards in progress back -----------------------------------
    def queue_ran_out(self, slow: bool) -> None:
        """Another rank's reads ended: the queue holds no more shards, and the ranks that read on read
        the shards they hold. If this rank is `slow`, the rest of each shard it reads goes back to the
        queue from where its reads stand, for the faster ranks that wait there, instead of making them
        wait for it: exactly once, since it gives a shard back only once it trained every read of it
        it issued (until then it holds it, and a loss requeues it from its trained position)."""
        if slow and not self._giving_back and self.slow_ratio > 0 and not self._no_give_back:
            log.debug(
                "rank %d: the queue ran out and this rank is slow: it gives its shards in progress back", self.rank
            )
            self._giving_back = True

    def _give_back_when_trained(self, shard: int) -> None:
        """Give `shard` back (see `queue_ran_out`) once every read of it issued was taken and trained."""
        at = self._back_at.get(shard)
        if at is None or self._unread.get(shard, 0) or self._in_training.get(shard, 0):
            return
        del self._back_at[shard]
        if shard in self._ends:  # its reads found its end: nothing left to give
            self._report_done(shard)
            return
        self._give_back(shard, at)

    def _give_back(self, shard: int, at: int) -> bool:
        """Offer the rest of `shard` from `at` to the control plane: taken (this rank holds it no more)
        or kept, to be read on by this rank once its reads ended (`continue_kept`)."""
        give_back = getattr(self._store, "give_back", None)
        if give_back is None or not give_back(self._cursor_key, shard, at):
            self._kept[shard] = at
            log.debug("rank %d: nobody would read shard %d from %d: it keeps it", self.rank, shard, at)
            return False
        self._trained_to.pop(shard, None)
        self.shards_given_back += 1
        log.debug("rank %d: gave shard %d back from position %d", self.rank, shard, at)
        return True

    def continue_kept(self) -> bool:
        """This rank's reads of the epoch ended (its loader ran dry; the batch Lightning fetched ahead may
        still be in training): decide the give-backs still waiting for that batch now, from where its
        reads stand (a shard given back so is no longer held here: that batch's rows are the ones a loss
        of this rank before its step would skip), and whether a further pass of the loader must read
        the shards kept (no one took them). True if so: iterate the loader again."""
        for shard, at in sorted(self._back_at.items()):
            del self._back_at[shard]
            if shard in self._ends:  # (its end is trained with that batch: reported done then)
                continue
            if self._give_back(shard, at):
                self._given.add(shard)
        if not self._kept:
            return False
        self._continuing, self._kept = dict(self._kept), {}
        log.debug("rank %d: reads on the shards it kept: %s", self.rank, self._continuing)
        return True

    # -- what the loader returned, and what was trained ------------------------------------------
    def take(self, item: StreamBatch) -> Any:
        """A batch the loader returned: the user's batch to hand to the trainer, or `None` for a read
        past its shard's end (nothing to train)."""
        read = item.read
        self._unread[read.shard] = max(0, self._unread.get(read.shard, 0) - 1)
        if item.rows < read.count:
            self._ends.setdefault(read.shard, read.start + item.rows)
        if item.rows == 0:
            if not self._in_training.get(read.shard):
                self._report_done(read.shard)
            self._give_back_when_trained(read.shard)
            return None
        self._in_training[read.shard] = self._in_training.get(read.shard, 0) + 1
        self.untrained.append(TrainedTo(read.shard, read.start + item.rows))
        return item.batch

    def trained(self, chunk: TrainedTo) -> None:  # type: ignore[override]
        """The batch `chunk` took its optimizer step: its shard is trained up to its end (reported at
        once, without a reply), or done if that is where the shard ended."""
        shard, end = chunk
        left = self._in_training.get(shard, 1) - 1
        self._in_training[shard] = left
        if shard in self._given:  # given back from where its reads stood: another rank holds it from there
            return
        if self._ends.get(shard) == end or (left == 0 and shard in self._ends):
            self._report_done(shard)
            return
        self._report_position(shard, end)
        self._give_back_when_trained(shard)

    def _report_done(self, shard: int) -> None:
        if self._ends.get(shard, -1) < 0:
            return
        self._ends[shard] = -1  # (reported)
        self._trained_to.pop(shard, None)
        report = getattr(self._store, "report", None)
        if report is not None:
            report(self._cursor_key, done=[shard])
        log.debug("rank %d: shard %d is trained to its end", self.rank, shard)

    def holds(self, chunk: Any, ticket: int) -> None:
        """(A ticket claimed apart from a batch: a shard's ledger value is its position, not a ticket.)"""

    def held(self) -> list[int]:
        """The shards this rank holds with batches handed out and not trained."""
        return sorted({record.shard for record in self.untrained})

    def positions(self) -> list[list[int]]:
        """`[shard, position]` for every shard this rank holds and has not trained to its end: the
        position it was trained to (where a resumed fit reads it on from). Reported at a meeting."""
        return [[shard, position] for shard, position in sorted(self._trained_to.items())]

    def resume_shards(self, epoch: int, cursor: int, positions: list[list[int]]) -> None:
        """Continue `epoch` where a checkpoint stopped it: the shards in progress then (`positions`)
        first, each from its position, shared round-robin among the members, then the queue from
        `cursor` (the shards before it and not in progress were trained to their ends)."""
        self._resume_positions = {int(shard): int(position) for shard, position in positions}
        self.resume(epoch, cursor, sorted(self._resume_positions))
