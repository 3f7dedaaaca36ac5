"""The training loader of an asynchronous worker: the user's batches, each with a global ticket.

It wraps any iterable of batches: a `DataLoader` over a map-style dataset fed by the global work
queue (`WorkQueueSampler`), or over an `IterableDataset`
whose stream each worker reads on its own (DataLoader worker processes included). Every batch it
yields is given a ticket from `ProgressCounter`; when a claim
fails (budget spent, or another worker's stream ended the epoch) it stops, and the batch it fetched
is not trained (a streaming epoch reads every sample at most once).

Its `state_dict` is what makes a mid-epoch resume exact: the global progress at the last
synchronization point and, for map-style data, the queue's cursor and the chunks handed out but not
yet trained on every worker. Lightning saves and restores it with the checkpoint (the fit loop keeps
the state of stateful training loaders).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Optional

from lightning_prague.core.data.progress import ProgressCounter
from lightning_prague.core.data.shard_queue import ShardQueueSampler
from lightning_prague.core.data.sharding import WorkQueueSampler
from lightning_prague.core.errors import ControlPlaneError

#: what the loader's reads return past their end
_END = object()


class ProgressLoader:
    """Batches of `loader` with global tickets; attributes it does not have are the loader's."""

    def __init__(
        self,
        loader: Iterable[Any],
        counter: ProgressCounter,
        current_epoch: Callable[[], int],
        sampler: Optional[WorkQueueSampler] = None,
        batches_per_epoch: Optional[int] = None,
        start: int = 0,
    ) -> None:
        self.loader = loader
        self.counter = counter
        self.current_epoch = current_epoch
        self.sampler = sampler
        #: batches in one epoch of map-style data (`None`: a stream)
        self.batches_per_epoch = batches_per_epoch
        self.tickets: deque[Optional[int]] = deque()  # of the batches yielded and not yet trained, in order
        #: claims start when training does: batches a trainer fetches while it sets up get theirs then
        self.armed = False
        self.epoch: Optional[int] = None
        self.epoch_base = start
        #: global batches trained at the last synchronization point (`start`: before this fit)
        self.progress = start
        self._restored: Optional[dict[str, Any]] = None
        self._resumed_progress: Optional[int] = None
        #: chunks every rank held untrained at the last synchronization point (for checkpoints)
        self.pending: list[int] = []
        #: a sharded stream's shards every rank held then, each with the position it was trained to
        self.positions: list[list[int]] = []
        self._first_epoch: Optional[int] = None  # the oldest epoch whose store keys may still exist
        #: the rank that writes checkpoints: 0, or the lowest live rank once rank 0 was lost
        self.leader = 0
        #: the chunk of the batch in flight, once reported trained (`report_trained`)
        self._reported: Optional[int] = None
        #: `state_dict` is for a rank that joins the epoch under way (its state from a live member)
        self.for_joiner = False
        #: the next synchronization point's global batch count this rank has not met (`None`: none
        #: ahead); unset: tickets are not claimed ahead (`_claim_ahead`)
        self.next_boundary: Optional[Callable[[], Optional[int]]] = None
        #: this rank's last ticket, and how many tickets the job claimed between its last two (the
        #: job's claims during one of this rank's steps: large for a slow rank)
        self._last_ticket: Optional[int] = None
        self._ticket_gap: float = counter.world_size
        self._gaps = 0  # gaps measured (the first replaces the guess; the later ones are averaged)
        counter.keep_claiming = isinstance(sampler, ShardQueueSampler)
        if isinstance(sampler, ShardQueueSampler):
            sampler.on_queue_end = counter.mark_shard_stream_end
        if sampler is not None and batches_per_epoch is not None and not (getattr(loader, "num_workers", 0) or 0):
            # the loader runs in this process: the sampler is asked for a chunk exactly when the batch is
            # built, so the batch's ticket can come in the same message as its chunk (one per batch)
            sampler.ticketing = self._ticket_request
        #: each batch's ticket comes with its chunk's claim (`_ticket_request`)
        self.tickets_with_chunks = sampler is not None and sampler.ticketing == self._ticket_request

    def __getattr__(self, name: str) -> Any:
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __len__(self) -> int:  # no length: how many batches a worker trains depends on its speed
        raise TypeError("a ProgressLoader has no length")

    @property
    def store(self) -> Any:
        return self.counter.store

    @property
    def rank(self) -> int:
        return self.counter.rank

    @property
    def streaming(self) -> bool:
        return self.batches_per_epoch is None

    @property
    def epoch_end(self) -> Optional[int]:
        """Where the epoch's global progress ends when that is known in advance (map-style data):
        its last ticket rounded up to whole global steps."""
        if self.batches_per_epoch is None:
            return None
        return self.counter.padded(self.epoch_base + self.batches_per_epoch)

    @property
    def stopped_inside_epoch(self) -> bool:
        """The step budget (`max_steps`) was spent before the epoch's data ended. Lightning's fetcher,
        which looks a batch ahead, then finds the loader's end on some ranks (those that held a batch)
        and not on others (those whose claim failed at the budget): as under DDP, no epoch-end
        validation runs there, on any rank."""
        counter = self.counter
        if counter.budget is None or not (counter.budget_spent or self.progress >= counter.budget):
            return False  # (spent: a claim found it so; reached: the ranks met at the budget's boundary)
        return self.batches_per_epoch is None or counter.budget < self.epoch_base + self.batches_per_epoch

    # -- iteration --------------------------------------------------------------------------------
    @property
    def restored_progress(self) -> Optional[int]:
        """The global batch count of the checkpoint this fit resumed from (`None`: a fresh fit)."""
        return self._resumed_progress

    def begin_epoch(self) -> None:
        """Set this epoch's ticket origin (from a restored checkpoint, or where the last epoch ended)."""
        epoch = self.current_epoch()
        offset = 0
        restored, self._restored = self._restored, None
        join = restored.get("join") if restored is not None else None
        if restored is not None and isinstance(join, dict) and int(restored["epoch"]) == epoch:
            # a rank that joins the epoch under way: the members' numbering of it, no chunk or ticket set aside
            self.progress = int(restored["progress"])
            self.epoch_base = int(restored["epoch_base"])
            self.epoch = epoch
            if self._first_epoch is None:
                self._first_epoch = epoch
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
                self.sampler.join_epoch(epoch, int(join["first_claimed"]))
            self.counter.join_epoch(epoch, self.epoch_base, int(join["offset"]), int(join["world_size"]))
            self.tickets.clear()
            self._reported = None
            return
        if restored is not None:
            self.progress = int(restored["progress"])
            if int(restored["epoch"]) == epoch:  # resuming inside the epoch the checkpoint was taken in
                self.epoch_base = int(restored["epoch_base"])
                offset = self.progress - self.epoch_base
                if isinstance(self.sampler, ShardQueueSampler) and "positions" in restored:
                    positions = [list(pair) for pair in restored["positions"]]
                    self.sampler.resume_shards(epoch, int(restored["cursor"]), positions)
                elif self.sampler is not None and "cursor" in restored:
                    self.sampler.resume(epoch, int(restored["cursor"]), list(restored["pending"]))
            else:
                self.epoch_base = self.progress
        elif self.epoch is not None and epoch != self.epoch:
            self.epoch_base = self.counter.final_count()
        self.epoch = epoch
        if self._first_epoch is None:
            self._first_epoch = epoch
        if self.sampler is not None:  # the trainer sets it after its first fetch of a (resumed) fit
            self.sampler.set_epoch(epoch)
        self.counter.begin_epoch(epoch, self.epoch_base, offset)
        self.tickets.clear()
        self._reported = None

    def _ticket_request(self) -> Optional[tuple[str, int]]:
        if self.batches_per_epoch is None:
            return None
        replicas = self.sampler is not None and self.sampler.replica_size > 1
        # (a replica's chunks always come with their tickets, however early they are claimed, before
        # training starts too (a replica come back claims its first chunk then): its other ranks take the
        # first rank's answers, tickets included; a ticket each claimed on its own would count the
        # replica's step twice, and the step budget would end before its batches were trained)
        if replicas:
            return self.counter.tickets_key, self.batches_per_epoch
        if not self.armed or not self.counter.first_taken:
            return None  # the epoch's first ticket is set aside for this worker: claims come after it
        return self.counter.tickets_key, self.batches_per_epoch

    def __iter__(self) -> Iterator[Any]:
        self.begin_epoch()
        stashed = self.sampler.ticket_values if self.sampler is not None else None
        shards = self.sampler if isinstance(self.sampler, ShardQueueSampler) else None
        reads = iter(self.loader)

        def fetch() -> Any:
            """The next user batch of the loader (`_END`: none left). A sharded stream's reads go on in a
            further pass over the shards this rank kept where nobody took them (`continue_kept`)."""
            nonlocal reads
            while True:
                for batch in reads:
                    if shards is not None:  # a read of a sharded stream: the user's batch, or none past a shard's end
                        batch = shards.take(batch)
                        if batch is None:
                            continue
                    return batch
                if shards is None or not shards.continue_kept():
                    return _END
                reads = iter(self.loader)

        batch = fetch()
        value = stashed.popleft() if stashed else None
        claim = None
        while batch is not _END:
            if value is not None:  # claimed with the batch's chunk
                ticket = self.counter.accept(value)
            else:
                ticket = claim() if claim is not None else (self.counter.claim() if self.armed else None)
                if ticket is not None:
                    self._holds(len(self.tickets), ticket)
                    # (a sharded stream: while its queue runs, before anyone waits at its end: a wait there
                    # is no step, and once the others wait the job claims only this rank's tickets)
                    if self._last_ticket is not None and ticket > self._last_ticket and self.counter.stream_end is None:
                        gap = ticket - self._last_ticket
                        self._ticket_gap = gap if self._gaps == 0 else 0.7 * self._ticket_gap + 0.3 * gap
                        self._gaps += 1
                    self._last_ticket = ticket
                    if shards is not None and self.counter.stream_end is not None:
                        # another rank's reads ended: a rank during whose steps the job claims many more
                        # tickets than one per member is slow, and gives its shards in progress back
                        slow = self._gaps > 0 and self._ticket_gap > shards.slow_ratio * self.counter.world_size
                        shards.queue_ran_out(slow)
            if self.armed and ticket is None:
                stream_end = self.counter.stream_end
                if self.counter.budget_spent and not (stream_end is not None and self.counter.budget > stream_end):
                    # hand the batch over untrained: the trainer stops at the budget's synchronization point
                    # before it, in the middle of its epoch (a checkpoint there resumes the same epoch)
                    self.tickets.append(None)
                    yield batch
                # (a sharded stream whose budget falls after the first rank's reads ended: no boundary is met
                # there, so the epoch ends here, and the meeting at its end finds the budget spent)
                return
            self.tickets.append(ticket)
            if self._may_claim_ahead(ticket):
                # the next batch, and its ticket's claim, before this one is trained: the round trip overlaps it
                following = fetch()
                value = stashed.popleft() if stashed and following is not _END else None
                claim = self.counter.begin_claim() if following is not _END and value is None else None
                yield batch
            else:
                yield batch
                following, claim = fetch(), None
                value = stashed.popleft() if stashed and following is not _END else None
            batch = following
        if shards is not None:  # the others train the shards they hold to their ends: no claim fails
            self.counter.end_shard_stream()
            return
        if self.streaming:
            self.counter.end_stream()
        else:
            assert self.batches_per_epoch is not None
            self.counter.exhausted(self.epoch_base + self.batches_per_epoch)

    @property
    def claims_ahead(self) -> bool:
        """Whether batches' tickets are claimed a batch ahead (`_may_claim_ahead`): where they do not come
        with the batches' chunks (a map-style queue read in this process claims both in one message)."""
        return self.next_boundary is not None and not self.tickets_with_chunks

    def _may_claim_ahead(self, last: Optional[int]) -> bool:
        """Whether the next batch may be fetched, and its ticket claimed, before the batch with ticket
        `last` is trained.

        Only where that cannot carry this rank past a synchronization point it has not met: once
        `last` lies beyond the next boundary, a ticket claimed ahead could lie beyond the boundary
        after that too, and its batch would be trained before that boundary's meeting. So a rank holds
        at most one ticket beyond the next boundary, as without claims ahead
        (`lightning_prague.core.data.progress`), and claims when it hands a batch over once per boundary."""
        if not (self.armed and self.claims_ahead) or last is None:
            return False
        assert self.next_boundary is not None
        boundary = self.next_boundary()
        # near the boundary (within two of this rank's steps, in tickets the job claims meanwhile) a ticket
        # claimed ahead would be one more batch of this rank's before the meeting: a slow rank's, that the
        # others would wait for. There the ticket is claimed as the batch is handed over
        return boundary is None or boundary - last > 2 * self._ticket_gap

    def arm(self) -> None:
        """Training starts: claim tickets for the batches fetched before (a failed claim drops its batch)."""
        self.armed = True
        tickets: deque[Optional[int]] = deque()
        for index, ticket in enumerate(self.tickets):
            if ticket is None:
                ticket = self.counter.claim()
                if ticket is not None:
                    self._holds(index, ticket)
            if ticket is not None:
                tickets.append(ticket)
        self.tickets = tickets

    def _holds(self, index: int, ticket: int) -> None:
        """The batch `index` (among those yielded, not trained) got `ticket` apart from its chunk: the
        control plane learns which ticket goes with the chunk, to hand it on if this rank is lost."""
        sampler = self.sampler
        if sampler is not None and index < len(sampler.untrained):
            sampler.holds(sampler.untrained[index], self.counter.claim_value(ticket))

    def report_trained(self) -> None:
        """The batch being trained took its optimizer step: it counts as trained from now on, before
        this rank's model takes part in any exchange (so a loss after this does not requeue it)."""
        sampler = self.sampler
        if sampler is not None and sampler.untrained and self._reported is None:
            self._reported = sampler.untrained[0]
            sampler.trained(self._reported)

    def batch_trained(self) -> int:
        """The ticket of the batch just trained (the trainer calls this once per batch)."""
        if self.sampler is not None and self.sampler.untrained:
            self.report_trained()  # no optimizer step came (accumulation, manual optimization)
            self.sampler.untrained.popleft()
        self._reported = None
        ticket = self.tickets.popleft()
        assert ticket is not None, "a batch was trained before the loader was armed"
        return ticket

    @property
    def current_ticket(self) -> Optional[int]:
        """The ticket of the batch being trained (or of the next one, between batches)."""
        return self.tickets[0] if self.tickets else None

    @property
    def held_back_at_budget(self) -> bool:
        """A batch of this epoch was fetched and handed over untrained because the step budget was
        spent: the epoch's data goes on past the budget, so a checkpoint taken now resumes inside the
        epoch, although Lightning's fetcher, which looked one batch ahead, found the loader's end."""
        return self.counter.budget_spent and None in self.tickets

    # -- synchronization points and checkpoints ---------------------------------------------------
    def set_members(self, members: list[int]) -> None:
        """The ranks still in the job (a release's): the work queue and the tickets of the next epoch
        are shared among them."""
        # the workers that share them: ranks, or replicas by their first ranks (`WorkQueueSampler.units_of`)
        units = self.sampler.units_of(members) if self.sampler is not None else members
        self.counter.set_members(units)
        self.leader = min(units)
        if self.sampler is not None:
            self.sampler.set_members(members)

    def untrained_at_meeting(self, release: dict[str, Any]) -> None:
        """A meeting's release: the work not trained yet, for a checkpoint taken there (`state_dict`):
        what the ranks hold (`pending` chunks, a sharded stream's `positions`) and what lost ranks gave
        back that nobody claimed again yet (`requeued`: a shard goes on from its position), so that a
        fit resumed from it trains all of it."""
        requeued = [list(pair) for pair in release.get("requeued", [])]
        self.pending = sorted([*release.get("pending", []), *(int(item) for item, _ in requeued)])
        positions = [*release.get("positions", []), *([item, value or 0] for item, value in requeued)]
        self.positions = sorted([int(shard), int(at)] for shard, at in positions)

    def shard_positions(self) -> Optional[list[list[int]]]:
        """A sharded stream's shards this rank holds, with the positions they were trained to
        (reported when the ranks meet, for checkpoints); `None` for other data."""
        return self.sampler.positions() if isinstance(self.sampler, ShardQueueSampler) else None

    def untrained(self) -> list[int]:
        """The chunks this rank holds untrained (reported when the ranks meet, for checkpoints)."""
        return self.sampler.held() if self.sampler is not None else []

    def synchronized(self, progress: Optional[int]) -> int:
        """At a synchronization point, after the ranks met: record and return the global progress
        (`None`: the epoch is over on every rank, read its count)."""
        self.progress = self.counter.final_count() if progress is None else progress
        return self.progress

    def forget_finished_epochs(self) -> None:
        """Delete the store keys of the epochs before the current one (one rank calls it, right
        after the ranks met): so the store holds a bounded number of keys however long the run.

        Every rank reads an epoch's keys for the last time right after the meeting that ends it,
        before it trains the next epoch; a meeting in a later epoch comes after those reads on
        every rank.
        """
        if self.epoch is None or self._first_epoch is None:
            return
        for epoch in range(self._first_epoch, self.epoch):
            self.counter.forget_epoch(epoch)
            if self.sampler is not None:
                self.sampler.forget_epoch(epoch)
        self._first_epoch = self.epoch

    def epochs_in_store(self) -> list[int]:
        """The epochs up to the current one that still have keys in the store (a diagnostic: after
        a synchronization point of epoch `e`, only `e`'s)."""
        if self.epoch is None:
            return []
        sampler = self.sampler
        return [
            epoch
            for epoch in range(self.epoch + 1)
            if self.counter.has_keys(epoch) or (sampler is not None and sampler.has_keys(epoch))
        ]

    def state_dict(self) -> dict[str, Any]:
        """Where training stands; complete on rank 0 (which writes checkpoints) at a synchronization point.
        For a rank that joins the epoch under way (`for_joiner`): the epoch's numbering, which every
        member shares (`join`), and none of this rank's own chunks or tickets."""
        state: dict[str, Any] = {"epoch": self.epoch, "epoch_base": self.epoch_base, "progress": self.progress}
        if self.for_joiner:
            join = {"offset": self.counter.offset, "world_size": self.counter.world_size}
            if self.sampler is not None:
                join["first_claimed"] = self.sampler.first_claimed
            state["join"] = join
            return state
        if self.sampler is not None and self.rank == self.leader:
            try:
                cursor = self.sampler.cursor()
            except (
                ControlPlaneError
            ):  # the plane is gone (a checkpoint on the way out): the epoch resumes from its start
                return state
            if isinstance(self.sampler, ShardQueueSampler):
                # every shard: done (before the cursor), in progress at a position, or not started
                state["positions"] = sorted(self.positions)
            else:
                state["pending"] = sorted(self.pending)
            state["cursor"] = cursor
        elif self.sampler is None and callable(getattr(self.loader, "state_dict", None)):
            # a stream read as written keeps its loader's own position (a StatefulDataLoader's)
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's state at the start of the next epoch iteration."""
        self._restored = dict(state)
        if "loader" in state and callable(getattr(self.loader, "load_state_dict", None)):
            self.loader.load_state_dict(state["loader"])
        # (a rank that joins an epoch under way resumes no checkpoint: its steps are the members')
        self._resumed_progress = None if "join" in state else int(state["progress"])
