"""Heterogeneity-aware data sharding: one global work queue per epoch.

An epoch is one pass over a shuffled permutation of the dataset, cut into chunks of one batch.
Every rank first takes the chunk numbered by its rank (so nobody ends an epoch empty-handed), then
claims further chunks from an atomic counter of the session's coordinator (`Session.counters`).
Fast ranks claim more chunks; nobody idles at the end of the epoch waiting for a slow rank's fixed
shard. The permutation depends only on `seed` and the epoch, so all ranks agree on it without
communicating.

Tail awareness: near the end of an epoch a slow rank would hold the last chunk while everyone else
waits for it at the epoch's synchronization point. A rank therefore stops claiming when it is much
slower than the others (`slow_ratio` times their mean time per chunk) *and* the others will
consume all remaining chunks within one of its steps. Both figures come from the counter values the
rank already sees (plus one read of the counter per rank, in the first epoch, before any estimate
exists), so this costs no extra communication per chunk; ranks that are not slow never stop early,
so every chunk is still trained on. The estimates come from the intervals between a rank's own
claims, and one interval can hold a burst of the others' claims (each sends its first claim ahead
at about the same moment); so a rank also checks the epoch's counts (`_slower_in_epoch`: the others
took `slow_ratio` times as many chunks each as it did) before it leaves.

Claims ahead: a claim is a round trip to the control plane, and a rank that claimed only when it
needed the next chunk would wait that long at every batch. Once it has timed its chunks, a rank
sends its next claim when it starts handing out a chunk and takes the answer when that chunk is
done, so the round trip overlaps a step of its training (the tail decision is then taken one chunk
earlier, with a horizon one chunk longer). In its first epoch a rank claims after each chunk until
it has an estimate: a slow rank must not take a chunk before it can tell that the others would
finish sooner. A claim in flight holds its chunk for this rank like any other (`lightning_prague.
core.plane.work`): a rank lost with it gives it back to the queue.

Replicas (`replica_size=K`): `K` consecutive ranks train one model synchronously, so they must take the
same steps. The queue's workers are then the replicas, each known by its first rank: a chunk is one
step of the replica (`K` batches), which its first rank claims, decides about (the tail) and reports
as above, and every rank of the replica trains its own part of each chunk (`_share`). The replica's
other ranks take their first rank's answers, in order, from the control plane (a claim that
`follow`s it: it takes nothing from the queue), so they hand out the same chunks with the same
tickets and end each epoch at the same step, with no message between the ranks themselves.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

import torch
from torch.utils.data import BatchSampler, Sampler

from lightning_prague.core.data.counters import EpochKeys, increment, read
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.protocol import REQUEUED

#: every store key the queue may write in an epoch: its cursor, the ranks that left its tail, and
#: the chunks of ranks lost in it (which the control plane keeps next to the cursor)
_KEYS = EpochKeys("epoch", ("cursor", "left", "cursor" + REQUEUED))


class WorkQueueSampler(Sampler[int]):
    """Yields dataset indices, a chunk at a time, claimed from a counter every rank shares.

    `store`: where the counters live, with TCPStore's `add`/`check`/`delete_key` (the session's
    `Counters` in training; a TCPStore works too).

    It deliberately has no `__len__`: how many batches a rank gets depends on its speed, and a
    length would make trainers schedule per-rank events (mid-epoch validation) at batch counts that
    differ between ranks.
    """

    def __init__(
        self,
        dataset_size: int,
        chunk_size: int,
        rank: int,
        world_size: int,
        store: Any,
        shuffle: bool = True,
        seed: int = 0,
        timeout: float = 300.0,
        slow_ratio: float = 2.0,
        lookahead: int = 1,
        clock: Callable[[], float] = time.monotonic,
        claim_ahead: bool = True,
        replica_size: int = 1,
    ) -> None:
        if chunk_size < 1:
            raise ConfigurationError(f"chunk_size (the batch size) must be at least 1, got {chunk_size}")
        if replica_size < 1 or chunk_size % replica_size:
            raise ConfigurationError(
                f"a chunk of {chunk_size} samples cannot be shared by replicas of {replica_size} ranks"
            )
        self.dataset_size = dataset_size
        self.chunk_size = chunk_size
        self.rank = rank
        #: ranks per replica (see "Replicas" in the module docstring): the queue's workers are replicas,
        #: `world_size` of them, each known by its first rank (`unit`), and this rank is `index` in its own
        self.replica_size = replica_size
        self.unit = rank - rank % replica_size
        self.index = rank % replica_size
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.timeout = timeout
        # a replica's other ranks take its first rank's chunks, in order: they decide nothing themselves
        self.slow_ratio = slow_ratio if self.index == 0 else 0.0
        self.lookahead = lookahead
        #: keep the next claim in flight while this rank trains the chunk before it (see the module docstring)
        self.claim_ahead = claim_ahead
        self.clock = clock  # seconds, for the speed estimates; injectable so tests can run a schedule
        self._my_seconds: float | None = None
        self._others_rate: float | None = None
        self._my_claims = 0  # chunks this rank claimed from the queue in the current epoch
        self._epoch_started = 0.0  # when this rank began the current epoch (monotonic)
        self.chunks_left_to_others = 0  # chunks this rank declined at the end of the last epoch
        self.epoch = 0
        self.chunks_taken = 0  # in the current epoch
        self.total_chunks_taken = 0
        #: chunks handed to the data loader and not yet trained (the trainer pops one per trained batch)
        self.untrained: deque[int] = deque()
        #: this rank trains, and reports, the chunks it holds while a claim of its own waits at the queue's
        #: end: it takes a claim's answer only after its step (the strategy's `StepFirstFetcher`, one batch
        #: per chunk, no DataLoader workers fetching ahead); so the others' parked claims wait for them too
        self.reports_while_parked = False
        #: asked before leaving an epoch's tail; the strategy says no while a synchronization point is ahead
        self.may_leave_tail: Callable[[], bool] = lambda: True
        #: asked before each claim: `(tickets counter, chunks below which a chunk gets a ticket)` to claim
        #: the batch's global-progress ticket in the same message as its chunk, or `None` (see ProgressLoader)
        self.ticketing: Callable[[], Optional[tuple[str, int]]] = lambda: None
        #: the ticket counter values claimed with the chunks handed out this epoch, in order (`None`: none)
        self.ticket_values: deque[Optional[int]] = deque()
        self._resume: Optional[tuple[int, int, list[int]]] = None  # (epoch, cursor, chunks to hand out first)
        self._join: Optional[tuple[int, int]] = None  # (epoch, its first claimed chunk): joined under way
        #: (members, the chunk each starts the epoch with): sent with this rank's first claim of an epoch
        self._set_aside: Optional[tuple[list[int], list[int]]] = None
        self._first_claimed = world_size  # chunk number of this epoch's first claim
        self._follow_next = 0  # a replica's other rank: the number of its first rank's next answer to take
        self._ending = False  # `end_claims`: the epoch's next claim gets the queue's end
        #: the claim sent ahead and not yet answered, and an answer taken before the iterator needed it
        self._in_flight: Optional[Callable[[], tuple[int, Optional[int]]]] = None
        self._taken: Optional[tuple[int, Optional[int]]] = None
        self._store = store
        #: the workers in the job (every rank, or every replica's first rank, until some are lost); set
        #: between epochs (`set_members`)
        self.members: list[int] = [unit * replica_size for unit in range(world_size)]
        if self.num_chunks < world_size:
            raise ConfigurationError(
                f"the training set has {dataset_size} samples, {self.num_chunks} batches of {chunk_size}, fewer than "
                f"the {world_size} workers; use a smaller batch size or fewer devices"
            )

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.dataset_size / self.chunk_size)

    @property
    def follows(self) -> bool:
        """This rank takes its replica's first rank's chunks rather than claiming (see "Replicas")."""
        return self.index > 0

    def units_of(self, ranks: Sequence[int]) -> list[int]:
        """The workers among `ranks` (the ranks in the job): each replica all of whose ranks are in it, by
        its first rank (every rank, without replicas). A replica with a rank lost trains no more."""
        live, size = set(ranks), self.replica_size
        return sorted(r for r in live if r % size == 0 and all(r + i in live for i in range(1, size)))

    def set_members(self, members: Sequence[int]) -> None:
        """The ranks still in the job, from the next epoch on (this one's chunks are handed out)."""
        self.members = self.units_of(members)
        self.world_size = len(self.members)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # a connection does not pickle; a copy (in another process) cannot claim
        state["_in_flight"] = None  # (nor does a reply awaited here)
        return state

    def _connect(self) -> Any:
        if self._store is None:
            raise RuntimeError("a copy of a WorkQueueSampler in another process cannot claim chunks")
        return self._store

    def _claim(self, chunk: Optional[int] = None) -> tuple[int, Optional[int]]:
        """The next chunk of the queue (or `chunk`, handed to this rank by a resumed checkpoint) and, if
        `ticketing` asks for it, the ticket claimed with it (`_begin_claim`, waited for)."""
        return self._begin_claim(chunk)()

    def _begin_claim(
        self, chunk: Optional[int] = None, park: Optional[bool] = None, standby: bool = False
    ) -> Callable[[], tuple[int, Optional[int]]]:
        """Send a claim now; what it returns gives the claimed chunk and ticket once answered. `park`
        (default: a claim on the queue, not of `chunk`) lets it wait at an emptied queue; `standby`: this
        rank left the epoch's tail, and gets a chunk only where nobody else would take the queue's rest
        (a plain store: the queue's end at once).

        The control plane holds the chunk for this rank until it is reported trained (`trained`), so
        that it goes back to the queue if this rank is lost first (`lightning_prague.core.plane.work`);
        this rank's first claim of an epoch tells it which chunk every member started the epoch with.
        A claim that finds the queue empty waits there while another member may still be lost with
        chunks in hand, and may get one of them (`lightning_prague.core.plane.queue_end`). A plain
        store, in tests, just counts (at once)."""
        store = self._connect()
        if self.follows:  # its first rank's next answer, whatever kind of claim got it
            if not hasattr(store, "begin_claim"):
                raise ConfigurationError("a replica's ranks take their chunks through the control plane's counters")
            sequence, self._follow_next = self._follow_next, self._follow_next + 1
            return store.begin_claim(
                self._cursor_key, self._first_claimed, num=self.num_chunks, follow=(self.unit, sequence)
            ).result
        request = self.ticketing()
        if hasattr(store, "begin_claim"):
            tickets, ticketed = request if request is not None else (None, 0)
            set_aside, self._set_aside = self._set_aside, None
            reports = {"reports": True} if self.reports_while_parked else {}
            return store.begin_claim(
                self._cursor_key,
                self._first_claimed,
                tickets,
                ticketed,
                num=self.num_chunks,
                chunk=chunk,
                set_aside=set_aside,
                park=chunk is None if park is None else park and chunk is None,
                standby=standby,
                **reports,
            ).result
        assert request is None, "tickets are claimed with chunks only from the control plane's counters"
        if standby:
            return lambda: (self.num_chunks, None)
        claimed = chunk if chunk is not None else self._first_claimed + increment(store, self._cursor_key) - 1
        return lambda: (claimed, None)

    def trained(self, chunk: int) -> None:
        """`chunk` is trained: the control plane no longer requeues it if this rank is lost."""
        report = getattr(self._store, "report", None) if not self.follows else None
        if report is not None:
            report(self._cursor_key, done=[chunk])

    def holds(self, chunk: int, ticket: int) -> None:
        """This rank holds `chunk` with the ticket claimed apart from it (its claim value `ticket`)."""
        report = getattr(self._store, "report", None) if not self.follows else None
        if report is not None:
            report(self._cursor_key, hold=[chunk], tickets=[ticket])

    def cursor(self) -> int:
        """The next chunk the queue will hand out in the current epoch."""
        return self._first_claimed + read(self._connect(), self._cursor_key)

    @property
    def first_claimed(self) -> int:
        """The first chunk of the current epoch that the queue hands out by claim (the ones before it
        were set aside, one per member at the epoch's start, or handed out by a resumed checkpoint)."""
        return self._first_claimed

    def join_epoch(self, epoch: int, first_claimed: int) -> None:
        """Join `epoch` under way (a rank that rejoined): claim from the members' queue, numbered as
        theirs (`first_claimed`), with no chunk set aside for this rank."""
        self._join = (epoch, first_claimed)

    def resume(self, epoch: int, cursor: int, pending: list[int]) -> None:
        """Continue `epoch` where a checkpoint stopped it: the `pending` chunks (handed out, not
        trained) first, shared round-robin by rank, then the queue from `cursor`."""
        self._resume = (epoch, cursor, sorted(pending))

    def should_leave_tail(self, remaining: int, horizon: float, my_chunk_seconds: float, others_rate: float) -> bool:
        """True when this rank is `slow_ratio` times slower than the others' mean and they will
        consume the `remaining` chunks within `horizon` seconds (before a chunk claimed now
        would be done here)."""
        if others_rate <= 0 or self.world_size < 2:
            return False
        others_chunk_seconds = (self.world_size - 1) / others_rate
        return my_chunk_seconds > self.slow_ratio * others_chunk_seconds and remaining <= others_rate * horizon

    def permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def _start_epoch(self) -> list[int]:
        """An epoch's iteration begins: the chunks this rank starts it with, before any claim (its
        place among the members, or those a resumed checkpoint hands it; none for a rank that joins
        the epoch under way). Its first claim names every member's (`_set_aside`)."""
        self.chunks_taken = 0
        self._my_claims = 0
        self.chunks_left_to_others = 0
        self.untrained.clear()
        self.ticket_values.clear()
        # the first world_size chunks are pre-assigned: no store traffic at an epoch's start
        # (among the members: a lost rank's first chunk is another's; they change between epochs only)
        self._follow_next = 0
        self._ending = False
        first: list[int] = [self.members.index(self.unit)]
        self._first_claimed = len(self.members)
        preset = list(range(len(self.members)))
        if self._resume is not None and self._resume[0] == self.epoch:
            _, self._first_claimed, pending = self._resume
            first = pending[self.members.index(self.unit) :: len(self.members)]
            preset = [pending[i] if i < len(pending) else -1 for i in range(len(self.members))]
        self._resume = None
        self._set_aside = (list(self.members), preset)
        if self._join is not None and self._join[0] == self.epoch:  # the epoch is under way: claims only
            first, self._first_claimed, self._set_aside = [], self._join[1], None
        self._join = None
        self._epoch_started = self.clock()
        return first

    def __iter__(self) -> Iterator[int]:
        for part in self.chunks():
            yield from part

    def chunks(self) -> Iterator[list[int]]:
        """The epoch's chunks this rank trains, each as its samples (its share of it in a replica), in
        the order it takes them: one batch each (`ChunkBatches`)."""
        order = self.permutation()
        first = self._start_epoch()
        previous: tuple[float, int] | None = None  # (time, chunk) of this rank's previous claim
        chunk, ticket = (first.pop(0), None) if first else self._claim()
        self._in_flight, self._taken = None, None
        left = False  # this rank left the rest of the epoch to the others
        while chunk < self.num_chunks:
            self.chunks_taken += 1
            self.total_chunks_taken += 1
            self._my_claims += chunk >= self._first_claimed  # (not a chunk it started the epoch with)
            self.untrained.append(chunk)
            self.ticket_values.append(ticket)
            # ahead once this rank timed its chunks (its first epoch's first claims wait for that: a slow
            # rank must not take a chunk before it can tell that the others would finish sooner)
            if self.claim_ahead and not first and self._my_seconds is not None:
                left = self.slow_ratio > 0 and self._leave_tail(previous)
                if not left:
                    self._in_flight = self._claim_next()  # answered while this chunk trains
            yield self._share(order, chunk)
            if first:  # more chunks a resumed checkpoint handed to this rank: held from their claim
                chunk, ticket = self._claim(first.pop(0))
                continue
            if self._in_flight is None and self._taken is None:
                if left or (self.slow_ratio > 0 and self._leave_tail(previous)):
                    # it left the rest to the others, but stands by: if they are lost with the queue's rest
                    # untaken, nobody else would train it (`lightning_prague.core.plane.queue_end`)
                    self._in_flight = self._claim_next(standby=True)
                    left = False  # (what it gets, it trains, and claims on)
                else:
                    self._in_flight = self._claim_next()
            claimed_at = self.clock()
            chunk, ticket = self._take()
            self._observe(previous, claimed_at, chunk)
            # from when the claim returned: a claim that waited at the queue's end (for a hung
            # member, say) must not make this rank look slow in the next epoch's tail decisions
            previous = (self.clock(), chunk)

    def end_claims(self) -> None:
        """Claim nothing more in this epoch: the next claim gets the queue's end at once (on a replica's
        first rank; its other ranks, which follow its answers, end their epoch at the same chunk). A
        replica stops this way: its ranks cannot each stop at the batch where a stop reaches them,
        which may differ by one, since they take every step together."""
        self._ending = True

    def _claim_next(self, standby: bool = False) -> Callable[[], tuple[int, Optional[int]]]:
        """The epoch's next claim, sent now (`_begin_claim`); the queue's end at once once `end_claims`
        was called (the chunks this rank holds are still its own to train and report)."""
        if self._ending and not self.follows:
            report = getattr(self._store, "report", None)
            if report is not None:  # the queue's parked claims need not wait for this rank
                report(self._cursor_key, end=True)
            return self._begin_claim(self.num_chunks)
        return self._begin_claim(standby=standby)

    def _share(self, order: list[int], chunk: int) -> list[int]:
        """This rank's samples of `chunk`: all of it, or in a replica its `index`-th part. Every rank of a
        replica takes as many samples of every chunk (a short last chunk lends its first samples again
        to the parts it is too short for), so that they form the same batches and take the same steps."""
        samples = order[chunk * self.chunk_size : (chunk + 1) * self.chunk_size]
        if self.replica_size == 1:
            return samples
        size = -(-len(samples) // self.replica_size)
        return [samples[i % len(samples)] for i in range(self.index * size, (self.index + 1) * size)]

    def _take(self) -> tuple[int, Optional[int]]:
        """The answer of the claim sent ahead (waited for here unless `held` took it already)."""
        if self._taken is None:
            assert self._in_flight is not None
            self._taken = self._in_flight()
            self._in_flight = None
        taken, self._taken = self._taken, None
        return taken

    def held(self) -> list[int]:
        """The chunks this rank holds untrained: those handed out and not trained, and the one its claim
        in flight got (its answer is taken here), which the control plane holds for it too. A
        checkpoint taken now resumes with all of them (`resume`'s `pending`), so none is skipped."""
        if self._in_flight is not None:
            self._taken = self._in_flight()
            self._in_flight = None
        ahead = [self._taken[0]] if self._taken is not None and self._taken[0] < self.num_chunks else []
        if self.follows:  # its replica's first rank holds them, and reports them once for the replica
            return []
        return [*self.untrained, *ahead]

    @property
    def _cursor_key(self) -> str:
        return _KEYS.key(self.epoch, "cursor")

    def has_keys(self, epoch: int) -> bool:
        """Whether `epoch` still has keys in the store."""
        return _KEYS.present(self._connect(), epoch)

    def forget_epoch(self, epoch: int) -> None:
        """Delete `epoch`'s keys from the store; call once every rank is done with that epoch."""
        _KEYS.forget(self._connect(), epoch)

    def _observe(self, previous: tuple[float, int] | None, claimed_at: float, chunk: int) -> None:
        """Update the speed estimates from two consecutive claims of this rank.

        Between them this rank trained one chunk and the others claimed the ones in between; the
        estimates carry over epochs, so the first decision of an epoch (after the pre-assigned
        chunk, which a slow rank may be the only one it should take) is informed too. An interval
        in which the queue ran dry still times this rank's step but says nothing about the others'
        speed (`share_speeds` supplies it where this rank never sees the queue running).
        """
        if previous is None:
            return
        elapsed = max(claimed_at - previous[0], 1e-6)
        self._my_seconds = self._ema(self._my_seconds, elapsed)
        if chunk < self.num_chunks:
            self._others_rate = self._ema(self._others_rate, max(chunk - previous[1] - 1, 0) / elapsed)

    @property
    def seconds_per_chunk(self) -> float:
        """This rank's estimated seconds per chunk (0.0 before it has timed one)."""
        return self._my_seconds or 0.0

    def set_speeds(self, seconds_per_chunk: Sequence[float]) -> None:
        """Every rank's `seconds_per_chunk`, as exchanged at a synchronization point.

        A slow rank in an epoch of few chunks per rank may never see the queue running (it is
        dry whenever this rank comes back for more), so it could not tell how fast the others
        are; with everyone's times it can. Nothing changes while any rank has no time yet (0).
        """
        if len(seconds_per_chunk) <= max(self.members):
            return
        others = [seconds_per_chunk[rank] for rank in self.members if rank != self.unit]
        if min(seconds_per_chunk[rank] for rank in self.members) <= 0:
            return
        self._my_seconds = float(seconds_per_chunk[self.unit])
        self._others_rate = sum(1.0 / s for s in others)

    def _leave_tail(self, previous: tuple[float, int] | None) -> bool:
        """Whether to leave the rest of the epoch to the others, judged from this rank's own claims.

        The queue's position now is extrapolated from this rank's last claim at the others' rate,
        so once the estimates exist the decision costs no store operation (the claim that follows
        is the only one per chunk); before, it reads the queue's position once.
        """
        now = self.clock()
        if self._my_seconds is None or self._others_rate is None:
            if previous is None:
                return False
            # no estimates yet (this job's first epoch): one read of the queue's position, once,
            # rather than a second claim, so a slow rank does not take a chunk it cannot finish
            cursor = self.cursor()
            if cursor >= self.num_chunks:
                return False  # the queue ran dry: the claim that follows ends the epoch
            self._observe(previous, now, cursor)
            previous = (now, cursor - 1)
        if not self._others_rate:
            return False
        if previous is None:  # the pre-assigned chunk: the others took theirs, then claimed at their rate
            since, position = self._epoch_started, self._first_claimed
        else:
            since, position = previous[0], previous[1] + 1
            if not self._slower_in_epoch(position):
                return False
        cursor = position + self._others_rate * (now - since)
        # a chunk claimed now is trained after the prefetched ones (and, claimed ahead, after this one)
        horizon = self._my_seconds * (1 + self.lookahead + int(self.claim_ahead))
        remaining = max(0, math.ceil(self.num_chunks - cursor))
        if not self.should_leave_tail(remaining, horizon, self._my_seconds, self._others_rate):
            return False
        if not self.may_leave_tail():
            return False
        # the last rank still taking chunks must not leave, whatever its estimates say: the rest
        # of the epoch would be trained by nobody (one store operation per leaving rank and epoch).
        # Counted among the live members: with ranks lost in this epoch, the epoch's members (its
        # world size) counted them, and every survivor once left (found under load: 3 of 5 ranks
        # killed, the 2 survivors both left, and 28 of the epoch's 45 batches were never trained)
        if increment(self._connect(), _KEYS.key(self.epoch, "left")) >= self._live_members():
            return False
        self.chunks_left_to_others = remaining
        report = getattr(self._store, "report", None)
        if report is not None:  # the others' claims at the queue's end need not wait for this rank
            report(self._cursor_key, end=True)
        return True

    def _slower_in_epoch(self, position: int) -> bool:
        """Whether this epoch's chunks say so too: the others took `slow_ratio` times as many each as
        this rank did, the queue standing at `position` (every other member is counted with the chunk
        it started the epoch with). The speed estimates come from intervals between this rank's
        claims, and one interval can catch a burst of the others' claims whole (as each starts to
        claim ahead); a rank as fast as the others then took them for faster by half and left the tail
        of the job's first epoch with a third of it untaken (seen on the emulated cluster: a fast
        replica idle for 0.85 s of a 2 s epoch). A common burst lifts every member's count alike."""
        others = len(self.members) - 1
        if others < 1:
            return False
        ahead = self.lookahead + int(self.claim_ahead)  # what each holds beyond the chunk it trains
        theirs = max(1.0, (position - self._first_claimed - self._my_claims + others) / others - ahead)
        mine = self.chunks_taken - max(0, len(self.untrained) - 1)
        return theirs > self.slow_ratio * mine

    def _live_members(self) -> int:
        """The epoch's members still in the job, as this rank's session last heard (its members, once
        others were lost), else the epoch's members."""
        members = getattr(getattr(self._connect(), "session", None), "members", None)
        if isinstance(members, (list, tuple, set)) and members:
            return min(self.world_size, len(self.units_of(list(members))))
        return self.world_size

    @staticmethod
    def _ema(old: float | None, new: float, weight: float = 0.5) -> float:
        return new if old is None else weight * new + (1 - weight) * old


class ChunkBatches(BatchSampler):
    """The training DataLoader's batches from a work queue: each chunk one batch, whole, the epoch's
    short last chunk too (`WorkQueueSampler.chunks`). PyTorch's `BatchSampler` would fill that chunk's
    batch with the samples of the chunk after it (one a lost rank gave back), and every batch from
    there would span two chunks: one reported trained while half of the next was in it, and a fetch
    that takes the next claim's answer before the batch it holds is trained. A sampler without chunks
    (a lock-step shard resumed in place), and `drop_last`, batch as PyTorch's does."""

    def __iter__(self) -> Iterator[list[int]]:
        chunks = getattr(self.sampler, "chunks", None)
        if chunks is None or self.drop_last:
            yield from super().__iter__()
            return
        yield from chunks()
