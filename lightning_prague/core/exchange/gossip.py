"""Gossip on a fixed topology with a one-step lag (decentralized Adam's communicate-while-adapt).

Each exchange is one round of a `Schedule`: the worker's
group sums the members' models (one group sum per bucket, with the same point-to-point primitive
as every other strategy, `GroupComm`: a schedule's groups
cost no setup, so none are pre-built) and every member takes `x_i <- a x_i + b sum_j x_j`,
which is row `i` of `W x` for the round's mixing matrix. The sums run in a communication
thread of the worker (on CUDA, on its own stream, ordered against compute with events).

`LaggedGossip` issues the exchange of the parameters `x^t` right after update `t` (and
at the start of each asynchronous phase), lets it run in the backend while the next forward and
backward pass compute the gradient at the un-averaged `x^t`, and waits for it just before
update `t + 1`, so that `x^{t+1} = sum_j w_ij x_j^t - lr d_i^t`. `overlap=False` waits for the
exchange as soon as it is issued: the same parameters, without the overlap. `lagged=False` also
mixes it in at once, so the next gradient is taken at the averaged parameters (Prague's blocking
Partial All-Reduce with its `static` schedule uses that).

**At each worker's own pace** (`own_pace`, the strategies' `pace="own"`) the update does not wait for
the round in flight: if its sums are not done yet, the update is a local step, and the round is mixed
in at the first update after they are done, the next round issued then. The change a round brings is
`W x - x` of the snapshot it was issued with, so it is added to the parameters as they stand, local
steps included. A worker three times faster than its slow neighbour so takes about three steps per
round where the neighbour takes one, and never waits for it; the rounds still go round by round
together. Where ranks are coupled (a replica's), they must mix a round in at the same update, so they
agree on whether it is done on all of them first (`replica`: `lightning_prague.core.replicas.agreement`).

Rounds are counted per worker, and each round is a collective of its group, so every worker must
end a phase at the same round. The phase ends in the meeting of every rank that ends any
strategy's phase (`GroupWorker.synchronize`, decided by `GroupGenerator`): each rank arrives with
its round. Normally (equal data shards) all workers stop at the same round and end there. If a
worker finds itself waiting `idle_after` seconds for the others, it asks the coordinator for
*idle* rounds, and every waiting worker runs them (mixing only, no gradient) so that neighbours
with more steps are never stuck. A waiting worker starts an idle round only once its previous
round is done, so it keeps reading its inbox. The ranks then settle the final round: each stops,
reports the rounds it issued, and all run to the largest (`GroupWorker.settle_rounds`).

Every round is all-or-nothing: after its sums each member reports its own completeness to the
control plane and mixes the round in only if the verdict says every member completed it
(`lightning_prague.core.plane.verdicts`), decided in the communication thread, so the overlap
keeps it hidden. A worker that leaves the job: a round it was in changes nobody's model, on every
member alike.

**Who takes part in a round** is the control plane's word, asked by the communication thread before
the round's sums (`GroupGenerator.round_members`): the same answer to every member of the
schedule's group, whenever each asks, so a rank that departs drops out of every round after those
already decided with it (`surviving`), and one admitted inside the phase (a lost rank's new process)
comes in at a round every member of its groups agrees on, with no meeting: it asks for that round
when it starts training (`take_up`), and the answer names the membership epoch whose process group
holds the round's members (`GroupWorker.epoch_comm`).

**Replicas.** A schedule drawn over replicas runs column by column
(`lightning_prague.core.replicas.columns`): a group's `joint` ranks (its replicas' other columns)
ask who takes part together, a replica with a rank gone takes part in none of its columns
(`Schedule.whole`), and the round's verdict is one for all of them, so every column of a replica
mixes, or none does. Rank `i` of a replica averages only slice `i` of each bucket with its column
(`share_of`), so a replica sends one model out of its node per round, not one per rank; once the
verdict says the round takes effect, the replica's ranks sum their slices' changes among
themselves (a sum of the whole bucket inside the node, each rank contributing its slice and zeros),
and every rank of it adds the same change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch

from lightning_prague.core.comm.averaging import SUM_PIECE_BYTES, BucketedTensors, FlatBuffers, PieceScratch, pieces
from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.comm.norms import Drift
from lightning_prague.core.comm.streams import Marker
from lightning_prague.core.errors import CoordinationTimeout
from lightning_prague.core.exchange.overlap import Exchanger
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.grouping.topology import Schedule, WeightedGroup
from lightning_prague.core.replicas.agreement import ReplicaAgreement
from lightning_prague.core.replicas.layout import share_of

log = logging.getLogger(__name__)

#: seconds a worker leaving after an error waits for its last exchange (a peer that left too ends it sooner)
LEAVE_WAIT = 10.0
#: seconds a worker waits at the meeting that ends a phase before it asks for idle rounds (`LaggedGossip`)
IDLE_AFTER = 1.0
#: seconds between a waiting worker's idle rounds while they take no effect (a member of its group is
#: gone, or no partner is left in it): such a round ends at once, and without a pause a waiting worker
#: would run one, and send the control plane its verdict, at every poll of the meeting (1 kHz)
IDLE_PAUSE_SECONDS = 0.05


@dataclass
class _InFlight:
    round_index: int
    weighted: WeightedGroup
    #: the round's name at the control plane (its verdict): the same on every member of it
    key: str = ""
    #: the membership epoch the control plane named the round's members in
    epoch: int | None = None
    #: the round's group in the schedule, before the control plane named who takes part in it
    planned: WeightedGroup | None = None
    #: the ranks the round is decided with, all-or-nothing (this group's and, for a replica's column,
    #: its other columns': `WeightedGroup.joint`), once decided; `()`: its own members
    joint: tuple[int, ...] = ()
    #: whether the round took effect on every member (the control plane's verdict)
    applied: bool = True
    #: `||x_i - mean||^2 / ||mean||^2` of the round's group (a tensor, set by the communication thread)
    error: torch.Tensor | None = None
    future: Future[Marker] | None = None  # None: the worker sits this round out, or it was waited for

    @property
    def exchanges(self) -> bool:
        return len(self.weighted.members) > 1

    def operation(self, rank: int) -> str:
        return f"gossip round {self.round_index} of rank {rank} with ranks {list(self.weighted.members)}"


def surviving(group: WeightedGroup, members: Sequence[int]) -> WeightedGroup:
    """`group` without the ranks that left the job: the others keep their weight for each other and
    each takes the lost members' weight onto itself, so every round's mixing matrix stays
    symmetric with rows summing to one (doubly stochastic)."""
    live = set(members)
    kept = tuple(m for m in group.members if m in live)
    if len(kept) == len(group.members):
        return group
    return WeightedGroup(kept, 1.0 - (len(kept) - 1) * group.peer_weight)


class LaggedGossip(Exchanger):
    """Issues one gossip round after every update and mixes it in just before the next one."""

    def __init__(
        self,
        worker: GroupWorker,
        live: BucketedTensors,
        schedule: Schedule,
        timeout: float,
        overlap: bool = True,
        name: str = "gossip",
        idle_after: float = IDLE_AFTER,
        lagged: bool = True,
        slices: bool = True,
        own_pace: bool = False,
        replica: ReplicaAgreement | None = None,
    ) -> None:
        if schedule.world_size != worker.world_size:
            raise ValueError(f"topology for {schedule.world_size} workers used by a world of {worker.world_size}")
        if own_pace and not (overlap and lagged):
            raise ValueError("own_pace mixes a round in once it is done: it needs overlap and lagged rounds")
        super().__init__(worker, live, timeout)
        worker.switch_in_order = False  # rounds take the group the control plane names with their members
        self.schedule = schedule
        self.overlap = overlap
        #: `False`: mix each round in as soon as it is issued, so the next gradient is taken at the
        #: averaged parameters (Prague's blocking Partial All-Reduce); implies waiting at once
        self.lagged = lagged
        #: the ranks coupled with this one (a replica's) hold one model, each averaging its slice of it;
        #: `False`: each holds its own part already (a model sharded over the replica)
        self.slices = slices
        #: each worker trains at its own pace: a round is mixed in at the first update where it is done
        #: (local steps meanwhile), and the next is issued then; `False`: every update waits for its round
        self.own_pace = own_pace
        #: the agreements of the ranks coupled with this one (a replica's), which must mix at the same
        #: update and take gossip up at the same round; `None`: none coupled (or lock-step anyway)
        self.replica = replica
        self.local_steps = 0  #: updates made while a round was still in flight (`own_pace`)
        self.round = 0  #: exchanges issued so far; equal on every worker at synchronization points
        self._flight: _InFlight | None = None
        self._phase_open = False
        self._executor: ThreadPoolExecutor | None = None
        self._name = name  # names this instance's threads
        self.idle_after = idle_after  # seconds a finished worker waits before it asks for idle rounds
        self._meeting_started: float | None = None
        self._waited_before = 0.0
        self.phases = 0  #: phases ended by `drain`
        self.idle_rounds = 0  #: rounds run without a gradient step while waiting for slower workers
        self._idle_issued = 0.0  # when the last idle round was issued (`serve`)
        self._scratch = PieceScratch()  # the communication thread's: a piece's sum (`SUM_PIECE_BYTES`)

    def _thread(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix=f"prague-gossip-{self.worker.rank}", initializer=self.streams.bind
            )
        return self._executor

    @property
    def in_flight(self) -> bool:
        return self._flight is not None

    def _round_buffers(self) -> FlatBuffers:
        """The round's snapshot, which becomes its change: the worker's spare copy of the model (free
        while a phase runs; synchronization points use it once the phase has ended)."""
        return self.worker.spare()

    def issue(self) -> None:
        """Send this worker's current tensors into its group of the next round."""
        planned = self.schedule.group_of(self.worker.rank, self.round)
        # rounds are counted from the fit's start alike on every member (a rank that rejoined takes up
        # the members' count, `take_up`) and never repeat; a round's groups are disjoint
        flight = _InFlight(self.round, surviving(planned, (self.worker.rank,)), planned=planned)
        self.round += 1
        if len(planned.members) > 1:  # who takes part is decided in the communication thread
            self._round_buffers().copy_from_live()
            flight.future = self._thread().submit(self._sum, flight, self.streams.mark())
        self._flight = flight
        if not self.lagged:
            self.mix()
        elif not self.overlap:
            self._wait(flight)

    def _decide_members(self, flight: _InFlight) -> GroupComm:
        """In the communication thread: who takes part in the round (the control plane's word, see the
        module docstring), set on `flight`; returns the comm whose process group holds them."""
        planned = flight.planned
        assert planned is not None
        joint = planned.joint or planned.members  # a replica's columns ask, and are decided, together
        key = f"m{flight.round_index}.{min(joint)}"
        answer = self.worker.session.round_members(key, flight.round_index, joint, f"gossip round {flight.round_index}")
        # a replica with a rank gone takes part in none of its columns (`Schedule.whole`)
        taking_part = list(self.schedule.whole([int(m) for m in answer.get("members", ())]))
        if self.worker.rank not in taking_part:  # (it asked to start later: it sits this round out)
            taking_part = [self.worker.rank]
        flight.weighted = surviving(planned, taking_part)
        flight.joint = tuple(m for m in planned.joint if m in taking_part) if len(taking_part) > 1 else ()
        flight.key = f"r{flight.round_index}.{min(flight.joint or flight.weighted.members)}"
        flight.epoch = int(answer.get("epoch", 0))
        return self.worker.epoch_comm(flight.epoch)

    def _sum(self, flight: _InFlight, ready: Marker) -> Marker:
        """In the communication thread: the round's members, its group sums, and from them the round's
        change `(a - 1) x_i + b sum_j x_j` over the snapshot; zero everywhere if the round does not take
        effect (nobody else takes part, or a member was lost: the control plane's verdict, the same on
        every member)."""
        self.streams.wait(ready)
        buffers = self._round_buffers()
        self.streams.keep_for(buffers.flats)
        comm = self._decide_members(flight)
        if not flight.exchanges:
            for flat in buffers.flats:
                flat.zero_()
            flight.applied = False
            flight.error = Drift(self.live.device).error(applied=False)
            return self.streams.mark()
        operation = flight.operation(self.worker.rank)
        a, b = flight.weighted.coefficients()
        size = len(flight.weighted.members)
        drift = Drift(self.live.device)
        complete = True
        members = flight.weighted.members
        # a replica's ranks hold one model: each averages only its own slice of every bucket across the
        # replicas (its column), so no rank sends more than its share of the model out of its node
        coupled = self.schedule.coupled_with(self.worker.rank) if self.slices else (self.worker.rank,)
        index, parts = coupled.index(self.worker.rank), len(coupled)
        for flat in buffers.flats:
            start, stop = share_of(flat.numel(), index, parts)
            # piece by piece: each piece becomes its change as soon as its sum is in (the round is all or
            # nothing as a whole, below), so the sums need one piece of scratch, not a bucket
            for piece in pieces(flat[start:stop], SUM_PIECE_BYTES):  # (this module's: a test makes them small)
                total = self._scratch.for_piece(piece)
                total.copy_(piece)
                complete &= comm.sum_(total, members, operation)
                drift.add_average(total, 1.0 / size)
                drift.add_distance(piece, total, 1.0 / size)
                piece.mul_(a - 1.0).add_(total, alpha=b)
            if parts > 1:  # the other slices' changes come from the replica's other ranks
                flat[:start].zero_()
                flat[stop:].zero_()
        decided_with = flight.joint or members
        flight.applied = self.worker.verdicts(flight.key, decided_with, operation, flight.epoch)(complete)
        if flight.applied and parts > 1:  # the replica puts its slices' changes together (inside its node)
            whole = True
            for flat in buffers.flats:
                whole &= comm.sum_(flat, coupled, f"{operation}: the slices of its replica (ranks {list(coupled)})")
            flight.applied = whole  # (not whole: a rank of the replica is gone, and the replica with it)
        if not flight.applied:  # a round a member left mid-way is skipped by every member of it
            for flat in buffers.flats:
                flat.zero_()
        flight.error = drift.error(applied=flight.applied)
        return self.streams.mark()

    def _wait(self, flight: _InFlight, timeout: float | None = None) -> None:
        """Until the round's sums are done; an error of the communication thread is raised here, as it was."""
        future, flight.future = flight.future, None
        if future is None:
            return
        start = time.monotonic()
        limit = self.timeout if timeout is None else timeout
        try:
            done = future.result(limit + 5.0)  # the sums time out on their own after self.timeout
        except CoordinationTimeout as err:
            raise self.worker.session.explain(err, flight.operation(self.worker.rank)) from err
        except FutureTimeout:
            raise CoordinationTimeout(
                f"rank {self.worker.rank}: {flight.operation(self.worker.rank)} did not finish within {limit:.0f}s"
            ) from None
        finally:
            self.wait_seconds += time.monotonic() - start
        self.streams.wait(done)

    def mix(self) -> None:
        """Wait for the exchange in flight and fold its change, `W x - x` of the snapshot, into the live tensors."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        self._wait(flight)
        if flight.exchanges:
            self._round_buffers().add_to_live()
            assert flight.error is not None
            self.streams.keep_for([flight.error])
            self.worker.stats.record_group_error(flight.error)
        self.exchanges += 1

    def ready(self) -> bool:
        """Whether the round in flight can be mixed in without waiting: done here (and, with `agree`, on
        every rank coupled with this one), or none in flight."""
        flight = self._flight
        if flight is None:  # (the same on every rank of a replica: they mix and issue together)
            return True
        done = flight.future is None or flight.future.done()
        return self.replica.all_done(done) if self.replica is not None else done

    # -- the Exchanger interface ------------------------------------------------------------
    def start(self) -> None:
        """The first exchange of a phase overlaps the phase's first forward and backward pass."""
        if not self._phase_open:
            self._phase_open = True
            if self._flight is None:
                self.issue()

    def step(self) -> None:
        if self.own_pace and not self.ready():  # a local step: the round is mixed in at the first update it is done
            self.local_steps += 1
            log.debug("rank %d: round %d still in flight: a local step", self.worker.rank, self.round - 1)
            return
        self.mix()  # normally already mixed just before the update (`lagged`, not `own_pace`); a no-op then
        self.issue()

    def drain(self) -> None:
        """Nothing to finish alone: a gossip phase ends in the meeting of every rank (the hooks below)."""

    # -- the meeting that ends the phase (GroupWorker.synchronize) ------------------------------
    def meeting_report(self) -> dict[str, Any]:
        if self._meeting_started is None:  # (asked again when a meeting turns into the stop point)
            self._meeting_started = time.monotonic()
            self._waited_before = self.wait_seconds
        return {"round": self.round}

    def take_up(self, admission: dict[str, Any]) -> None:
        """A rank that rejoined goes on from the members' round: the one its admission names (at an
        epoch's end: where the members' next phase starts), or else the one the control plane gives it
        now that it starts training (see the module docstring)."""
        first = admission.get("round")
        if first is None:
            answer = self.worker.session.round_members("start", 0, (), "the round it takes up gossip at", start=True)
            first = answer.get("round")
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ValueError(f"rank {self.worker.rank}: the control plane named no gossip round to take up ({first!r})")
        if self.replica is not None:
            # a replica come back: its ranks go on from one round, the latest any was given (before it, the
            # replica was not whole: in no round)
            first = self.replica.largest(first, "the gossip round it takes up")
        self.round = first
        log.debug("rank %d: rejoined gossip at round %d", self.worker.rank, first)

    def serve(self) -> None:
        """An idle round, if the round in flight is done (else nothing: the meeting goes on reading
        its inbox, so a release is never missed while a partner is elsewhere), and, where the last
        one took no effect, once `IDLE_PAUSE_SECONDS` have passed since it was issued."""
        flight = self._flight
        if flight is not None and flight.future is not None and not flight.future.done():
            return
        took_no_effect = flight is not None and (not flight.exchanges or not flight.applied)
        if took_no_effect and time.monotonic() - self._idle_issued < IDLE_PAUSE_SECONDS:
            return  # nobody waits for such rounds: pace them
        self._idle_round()
        self._idle_issued = time.monotonic()

    def _idle_round(self) -> None:
        """Mix the round in flight and issue the next, without a gradient step."""
        self.mix()
        self.issue()
        self.idle_rounds += 1

    def finish(self, release: dict[str, Any]) -> None:
        """Run to the phase's final round (every rank does), mix the last one in: the phase is over.

        The release names it, or says `settle`: ranks may have stopped at different rounds (idle
        rounds, or rounds that ended at once because a member was lost), so they agree on the
        largest round any of them issued first.
        """
        if release.get("settle"):
            final = self.worker.settle_rounds(self.round)
        else:
            final = int(release.get("final", self.round))
        if final < self.round:  # cannot happen: the settled round is the largest issued
            raise RuntimeError(f"rank {self.worker.rank}: gossip at round {self.round} is past the final round {final}")
        while self.round < final:
            self._idle_round()
        self.mix()
        # the whole end of the phase is waiting
        started = self._meeting_started if self._meeting_started is not None else time.monotonic()
        self.wait_seconds = self._waited_before + time.monotonic() - started
        self._meeting_started = None
        self.phases += 1
        self._phase_open = False

    def end_phase(self, name: str) -> None:
        """For programs without Lightning: end the phase with a meeting of every rank named `name`."""
        self.drain()
        self.worker.synchronize(name, self)

    def close(self) -> None:
        self._flight = None  # an unfinished sum ends at its peers' exit or its timeout
        self._phase_open = False
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
            for thread in list(getattr(executor, "_threads", ())):
                thread.join(min(self.timeout, 10.0))
                if thread.is_alive():
                    log.warning(
                        "rank %d: %s is still blocked in an exchange at teardown", self.worker.rank, thread.name
                    )

    def leave(self) -> None:
        flight, self._flight = self._flight, None
        if flight is not None:  # finish our part of the round in flight if the peers get there soon
            self._wait(flight, min(self.timeout, LEAVE_WAIT))
        super().leave()
