"""The worker side of decentralized training: ask for groups, run them in order, meet at sync points.

A `GroupWorker` belongs to one rank. After a local step it sends `ready` and executes its
inbox in order until the coordinator's answer; at a synchronization point it sends `arrive` and
keeps executing its inbox (other workers may still average with it) until everyone has arrived.
Then nothing is in flight anywhere, and a world-wide average is safe.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from lightning_prague.core.client.control import Session
from lightning_prague.core.comm.averaging import BucketedTensors, FlatBuffers, Part, average_, follow_live
from lightning_prague.core.comm.exact import ExactMaxima, layout_signature
from lightning_prague.core.comm.groups import Decide, GroupComm
from lightning_prague.core.comm.norms import Drift
from lightning_prague.core.comm.streams import CommStream, mark_on
from lightning_prague.core.comm.transfer import BackgroundTransfer
from lightning_prague.core.errors import (
    CONTROL_PLANE,
    ControlPlaneError,
    CoordinationTimeout,
    ExchangeInterrupted,
    SyncMismatchError,
)
from lightning_prague.core.job import Job
from lightning_prague.core.protocol import (
    COMMIT,
    REQUEUE,
    SIGTERM,
    STOP_SYNC,
    donor_of,
    is_synchronization_point,
    rebuild_meeting,
)

log = logging.getLogger(__name__)


class PhaseEnd(Protocol):
    """What a meeting asks of the exchanger whose phase it ends (`lightning_prague.core.exchange.overlap.Exchanger`)."""

    idle_after: float | None

    def meeting_report(self) -> dict[str, Any]: ...

    def serve(self) -> None: ...

    def finish(self, release: dict[str, Any]) -> None: ...


#: runs one group average on some copy of the model: `(comm, members, weight, operation, decide) -> (error,
#: applied)` as `lightning_prague.core.comm.averaging.average_` takes and returns them (`decide`: the
#: control plane's verdict, `GroupWorker.verdicts`); the default averages the live tensors
AverageTarget = Callable[[GroupComm, tuple[int, ...], Optional[float], str, Decide], tuple[torch.Tensor, bool]]

PAUSE = {"t": "pause"}  # a worker posts this to its own inbox to stop a thread that serves it


@dataclass(frozen=True)
class GroupAnswer:
    """The outcome of one group request: the group id (`None`: no group) and the adopted model version."""

    gid: int | None
    version: int | None = None


@dataclass
class WorkerStats:
    """What one worker did; read by monitors and benchmarks."""

    requests: int = 0
    groups_executed: int = 0
    skipped: int = 0
    syncs: int = 0
    sync_seconds: float = 0.0
    group_sizes: deque[int] = field(default_factory=lambda: deque(maxlen=4096))  # of the latest groups
    #: messages this worker sent to and received from the coordinator
    messages: int = 0
    #: seconds from each of the latest group requests to the coordinator's first reply (its group or answer)
    reply_seconds: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    #: sum and count of `||x_i - avg||^2 / ||avg||^2` over the group averages this worker took part in;
    #: the sum stays a tensor on the model's device until it is read (no host synchronisation per step)
    group_error_sum: torch.Tensor | None = None
    group_error_count: int = 0
    # the communication thread records while the training thread takes: both under this lock
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # on CUDA: when the latest sum is computed (it was computed on the recording thread's stream)
    _sum_ready: Any = field(default=None, repr=False, compare=False)

    def record_group_error(self, error: torch.Tensor) -> None:
        """Add one group average's error (a 0-d tensor, from any thread and its current stream)."""
        error = error.detach()
        with self._lock:
            previous = self.group_error_sum
            if previous is None:
                total = error.clone()
            else:  # the previous sum may come from another thread's stream
                CommStream.wait(self._sum_ready)
                CommStream.keep_for([previous])
                total = previous + error
            self.group_error_sum = total
            self._sum_ready = mark_on(total.device)
            self.group_error_count += 1

    def take_group_error(self) -> float | None:
        """Mean group error since the last call (`None` if there was no group average)."""
        with self._lock:
            total, count, ready = self.group_error_sum, self.group_error_count, self._sum_ready
            self.group_error_sum, self.group_error_count, self._sum_ready = None, 0, None
        if total is None or not count:
            return None
        if ready is not None:
            ready.synchronize()
        return float(total) / count


class GroupWorker:
    """One rank's client of its session's coordinator, executing the groups it is assigned.

    Args:
        session: this rank's session of the control plane (`ControlClient.open_session`).
        tensors: the live tensors that group averages change.
        timeout: seconds any one wait may take.
        sync_timeout: seconds every rank may take to reach one synchronization point, the whole
            meeting (default and at least: `timeout`).
        comm: the group sums; default: over the library's process group of `job`, or the world
            group where there is no job.
        job: this process's job (`lightning_prague.core.job.init_job`), whose process group the
            sums run on: when ranks leave it, the worker rebuilds that group among the survivors
            (`Job.regroup`). `None`: no job; the worker goes on among the survivors on the group
            it has.
    """

    def __init__(
        self,
        session: Session,
        tensors: BucketedTensors,
        timeout: float,
        comm: GroupComm | None = None,
        sync_timeout: float | None = None,
        job: Job | None = None,
    ) -> None:
        self.session = session
        self.job = job
        self.rank = session.rank
        self.world_size = session.world_size
        self.tensors = tensors
        self.timeout = timeout
        self.sync_timeout = max(timeout, sync_timeout or 0.0)
        #: the session's counters in the coordinator (the end-of-phase agreement of gossip)
        self.counters = session.counters
        if comm is None:
            comm = GroupComm(self.rank, self.world_size, timeout, job.group if job is not None else None)
            if job is not None and job.group is not None and job.members != comm.everyone:
                comm.rebind(job.group, job.members)  # ranks were lost before this fit, or this one rejoined
        #: sums over any group on one process group that spans every rank; no communicator per group
        self.comm = comm
        # a member departed, or this rank was left out (the others gave its operations up)
        self.comm.abandon = lambda members: session.left_out is not None or any(m in session.departed for m in members)
        self.comm.waiting = session.beacon.waiting
        if job is None or not job.rejoined:  # a joiner's group was built with it, amid the others' training
            self.comm.warm_up()
        self.stats = WorkerStats()
        self.stop_seen = False
        self._stopped = False
        self._req = 0
        #: local updates of this replica (Partial Reduce's model version); group members adopt the newest
        self.version = 0
        #: the newest version any worker had reported when the last synchronization point was released
        self.released_version = 0
        #: the last synchronization point's release (`GroupGenerator`'s item), `None` before the first
        self.release: dict[str, Any] | None = None
        self._doing = "training"  # what this rank waits on, for error messages
        self._spare: FlatBuffers | None = None
        self._stop_requests: set[str] = set()  # stops this rank asked for (once each)
        #: where a global average finds the model's state now: `() -> (averaged tensors, exact buffers)`,
        #: e.g. `averaged_state(module)` and `exact_state(module)`; `None`: the tensors of construction
        self.live_state: Callable[[], tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]] | None = None
        #: which of the live ranks a synchronization point's average runs over, from this rank's view (a
        #: model sharded over replicas: rank `i` of each replica, its column); `None`: every live rank
        self.averaged_with: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None
        #: the part of each bucket this rank's group averages cover (`(index, parts)`: rank `index` of a
        #: replica of `parts` ranks that each hold the whole model averages its own slice with its column,
        #: `lightning_prague.core.replicas.reassembly`); `None`: all of it
        self.part: Part | None = None
        #: ranks admitted in the last synchronization point's release (an epoch's end): not aligned with
        #: the others until the next one, so the collectives of this aligned stretch run without them
        self.fresh: set[int] = set()
        #: the fit's state on its way to ranks that rejoined, sent by this rank (the donor) in the background
        self.transfer: BackgroundTransfer | None = None
        #: exchanges switch to a new membership epoch's group where its `members` item stands in the
        #: inbox (groups the control plane issues); False: at the next synchronization point, the
        #: rounds in between taking the group the control plane names with their members (gossip)
        self.switch_in_order = True
        #: the membership epoch of the last synchronization point's release (`comm`'s group holds its members)
        self.base_epoch = 0
        #: called on the training thread when an admission comes while it waits at a meeting (the donor
        #: sends its state from there: the joiner is a member the meeting waits for)
        self.on_admission: Callable[[], None] | None = None
        #: admissions whose joiners this rank sends the fit's state to, not sent yet (`donate`'s `upto`):
        #: (membership epoch, its members, the receivers, when it was taken)
        self._held: list[tuple[int, list[int], list[int], float]] = []
        self._owes_resume = False  # a meeting was released: `resumed` tells the control plane once
        self._warned_layout = False
        self._leave_sent = False  # `leave` went to the control plane (`send_leave`)

    # -- messaging -------------------------------------------------------------------------
    def _send(self, op: str, **fields: Any) -> None:
        self.session.send(op, **fields)
        self.stats.messages += 1

    def poll_item(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next item of this rank's inbox, or `None` if none came within the timeout."""
        item = self.session.receive(timeout)
        if item is not None:
            self.stats.messages += 1
        return item

    @property
    def doing(self) -> str:
        """What this rank's exchange is at now (a group request, a group average, a meeting), for errors."""
        return self._doing

    def _next_item(self, waiting_for: str, deadline: float | None = None) -> dict[str, Any]:
        """The next inbox item within `timeout`, or by `deadline` (a meeting's overall bound)."""
        limit = self.timeout if deadline is None else max(0.0, deadline - time.monotonic())
        with self.session.beacon.waiting():
            item = self.poll_item(limit)
        if item is None:
            raise self._timed_out(waiting_for, self.timeout if deadline is None else self.sync_timeout)
        return item

    def _timed_out(self, waiting_for: str, seconds: float) -> CoordinationTimeout:
        return CoordinationTimeout(
            f"rank {self.rank}: waited {seconds:.0f}s for {waiting_for}{self._parked_hint()}; a rank may have stalled"
        )

    def _parked_hint(self) -> str:
        try:
            parked = self.session.request("parked", "the ranks at the synchronization point", timeout=5.0)
        except Exception:  # the hint is best effort; the timeout is the error
            return ""
        missing = sorted(set(self.comm.everyone) - set(parked))
        return f" (ranks not at the synchronization point: {missing})" if parked else ""

    def check_members(self, during: str) -> None:
        """Raise `MemberLost` naming the ranks that left the job, if any did."""
        self.session.check_members(during)

    def spare(self) -> FlatBuffers:
        """One flat copy of the live tensors, allocated at first use and kept: the sums of every
        average of the live tensors (the global average, blocking exchanges, the consensus
        measurement), so that they allocate nothing the size of the model.

        An exchanger may use it for its own snapshot while its phase runs (`BackgroundAverager`,
        `PassiveResponder` and `LaggedGossip` do): the live tensors are averaged only where the
        phase has ended (synchronization points, which drain it first) or in a phase whose
        exchanges average the live tensors themselves (`BlockingExchanger`), never both at once.
        """
        if self._spare is None:
            self._spare = FlatBuffers(self.tensors)
        return self._spare

    def average_live(
        self, comm: GroupComm, members: tuple[int, ...], weight: float | None, operation: str, decide: Decide
    ) -> tuple[torch.Tensor, bool]:
        """The default `AverageTarget`: average the live tensors in place (all-or-nothing)."""
        return average_(
            self.tensors, comm, members, weight=weight, operation=operation, sums=self.spare(), decide=decide,
            part=self.part,
        )  # fmt: skip

    def verdicts(self, key: str, members: Sequence[int], operation: str, epoch: int | None = None) -> Decide:
        """The `Decide` of a group collective `key` (the same on every member) among `members`: the
        control plane's verdict (`Session.verdict`: all-or-nothing on every member). A collective
        that decides more than once (bucket by bucket) asks under `key`, then `key.1`, `key.2`, ...
        `epoch`: the membership epoch the control plane drew the members in, where it said."""
        calls = itertools.count()

        def decide(complete: bool) -> bool:
            index = next(calls)
            part = f"{key}.{index}" if index else key
            try:
                return self.session.verdict(part, members, complete, operation, timeout=self.timeout, epoch=epoch)
            except CoordinationTimeout as err:
                raise self.session.explain(err, f"the verdict on {operation} over ranks {list(members)}") from err

        return decide

    def serve_inbox(self) -> None:
        """Carry out what is in this rank's inbox now, without waiting: while the training thread waits
        elsewhere (a claim at the work queue's end), the groups its peers drew it into still run."""
        while (item := self.poll_item(0.0)) is not None:
            if item["t"] != "pause":  # (one left over from a communication thread that ended)
                self.execute(item)  # a group of others: its version is not adopted (as in `partial_sync`)

    def execute(self, item: dict[str, Any], target: AverageTarget | None = None) -> int | None:
        """Carry out one inbox item, a group average on `target` (default: the live tensors); returns an
        adopted version."""
        kind = item["t"]
        if kind == "group":
            members = tuple(item["members"])
            weights = item.get("weights")
            weight = None if weights is None else float(weights[members.index(self.rank)])
            operation = f"group average #{item['gid']}"
            decide = self.verdicts(f"g{item['gid']}", members, operation, item.get("e"))
            doing, self._doing = self._doing, f"{operation} over ranks {list(members)}"
            log.debug(
                "rank %d: %s over ranks %s (membership epoch %s) begins",
                self.rank,
                operation,
                list(members),
                item.get("e"),
            )
            try:
                error, applied = (target or self.average_live)(self.comm, members, weight, operation, decide)
            except CoordinationTimeout as err:
                raise self.session.explain(err, f"{operation} over ranks {list(members)}") from err
            finally:
                self._doing = doing
            if not applied:
                gone = sorted(self.comm.failed_peers) or "(elsewhere in the group)"
                log.info("rank %d: %s was cancelled on every member: lost ranks %s", self.rank, operation, gone)
            self.stats.record_group_error(error)
            self.stats.groups_executed += 1
            self.stats.group_sizes.append(len(members))
            return item.get("version")
        if kind in ("pause", "left"):
            raise ExchangeInterrupted(f"rank {self.rank}: exchange interrupted at shutdown")
        if kind == "departed":  # the session noted it; the next release changes the membership
            return None
        if kind == "members":  # a membership epoch: an admission (see `follow_epoch`)
            self.follow_epoch(item)
            return None
        if kind == "stop":
            if item.get("reason", SIGTERM) in (SIGTERM, REQUEUE):
                self.stop_seen = True
        elif kind == "error":
            if item.get("source") == CONTROL_PLANE:  # its handler failed on one of this rank's messages
                raise ControlPlaneError(f"rank {self.rank}: {item['message']}")
            raise SyncMismatchError(f"rank {self.rank}: {item['message']}")
        return None

    # -- public API ------------------------------------------------------------------------
    def partial_sync(self, target: AverageTarget | None = None, version: int | None = None) -> GroupAnswer:
        """Report ready after a local step and average with the group the coordinator forms.

        Groups are averaged by `target` (default: the live tensors given at construction, in
        place), which lets `BackgroundAverager` work on a snapshot.
        `version` (default `version`) is the model version reported with the request; the
        answer carries the newest version among the members of this request's group, if any. The
        caller decides how to adopt it (a snapshot's version is not the live one).
        """
        self._req += 1
        req = self._req
        self._doing = f"group request #{req}"
        self.stats.requests += 1
        reported = self.version if version is None else version
        sent = time.monotonic()
        self._send("ready", req=req, version=reported)
        versions: dict[int, int | None] = {}
        first = True
        while True:
            item = self._next_item(f"the coordinator's answer to group request #{req}")
            if first:
                self.stats.reply_seconds.append(time.monotonic() - sent)
                first = False
            if item["t"] == "answer" and item["req"] == req:
                gid = item["gid"]
                if gid is None:
                    self.stats.skipped += 1
                return GroupAnswer(gid, versions.get(gid))
            newest = self.execute(item, target)
            if item["t"] == "group":
                versions[item["gid"]] = newest

    def synchronize(self, name: str, exchanger: PhaseEnd | None = None, **report: Any) -> bool:
        """Wait until every rank reached `name` with nothing in flight; True if training is stopping (SIGTERM).

        `report`: what this rank tells the others at the meeting (`stop`: it wants the job to stop;
        `speed`: its seconds per batch; `untrained`: the work-queue chunks it holds untrained); the
        release (`release`) carries everyone's. `exchanger`: the exchanger whose phase ends here
        (gossip on a fixed schedule reports its round, serves neighbours while waiting once the
        phase goes idle, and runs to the release's final round; see `GroupGenerator`).
        """
        start = time.monotonic()
        self.end_transfer()  # the membership may change here: the state a joiner waits for goes out first
        target = STOP_SYNC if self.stop_seen else name
        if exchanger is not None:
            report = {**report, **exchanger.meeting_report()}
        with self.session.beacon.waiting():
            target = self._meet(target, start, exchanger, report)
        if exchanger is not None:
            exchanger.finish(self.release)  # the phase's last rounds, among the phase's members
        if is_synchronization_point(target):  # (its sub-meetings keep it)
            # every member is at this meeting, aligned, but ranks admitted in its release (an epoch's end)
            self.fresh = {int(r) for r in (self.release or {}).get("joined", ())}
        self.change_members((self.release or {}).get("members"))
        if self.job is not None:
            self.job.follow_leader(self.release or {})
        self.stats.syncs += 1
        self.stats.sync_seconds += time.monotonic() - start
        if target == STOP_SYNC:
            self._stopped = True
        elif is_synchronization_point(target):
            self._owes_resume = True  # (sub-meetings may follow this one: `resumed` at the next exchange)
        return target == STOP_SYNC

    def resumed(self) -> None:
        """This rank trains again after a meeting and whatever followed it (its global average's
        commit, a rebuild): tell the control plane, once per meeting, from the training thread at its
        next batch (it admits nobody in between: `GroupGenerator`'s `Rejoining`)."""
        if self._owes_resume:
            self._owes_resume = False
            self._send("resume")

    def _meet(
        self, target: str, start: float, exchanger: PhaseEnd | None, report: dict[str, Any], follow_stop: bool = True
    ) -> str:
        """Arrive at `target` and execute the inbox until its release; returns the point met (the
        stop point if a SIGTERM stop came meanwhile and `follow_stop`: a commit meeting does not
        move, the control plane releases it while stopping too)."""
        self._doing = f"synchronization point {target!r}"
        idle_after = exchanger.idle_after if exchanger is not None else None
        idle = asked_idle = False
        deadline = start + self.sync_timeout  # the whole meeting; each group executed in it has its own bound
        self._send("arrive", sync=target, **report)
        while True:
            waiting = f"the other ranks at synchronization point {target!r}"
            if idle_after is None:
                item = self._next_item(waiting, deadline)
            else:  # poll: a rank out of steps may have to serve its neighbours (idle rounds)
                if idle:
                    assert exchanger is not None
                    exchanger.serve()
                item = self.poll_item(0.001 if idle else 0.01)
                if item is None:
                    waited = time.monotonic() - start
                    if not asked_idle and waited > idle_after:
                        asked_idle = True
                        self._send("idle")
                    if time.monotonic() > deadline:
                        raise self._timed_out(waiting, self.sync_timeout)
                    continue
            if item["t"] == "release" and item["sync"] == target:
                self.released_version = int(item.get("version", 0))
                self.release = item
                return target
            if item["t"] == "idle":
                idle = True
                continue
            if item["t"] != "pause":  # a pause left over from a communication thread that ended on its own
                self.execute(item)
            if item["t"] == "members" and "at" not in item and self.on_admission is not None:
                self.on_admission()  # a joiner this meeting waits for: its state goes out from here
            if follow_stop and self.stop_seen and target != STOP_SYNC:
                target = STOP_SYNC
                self._doing = f"synchronization point {target!r}"
                if exchanger is not None:  # its round moved on if it served idle rounds meanwhile
                    report = {**report, **exchanger.meeting_report()}
                self._send("arrive", sync=target, **report)

    def agree(self, complete: bool) -> bool:
        """Whether every live member completed the collective it just ran, as the control plane
        decides from their reports at one more meeting (`<sync>/commit`). Call only where the ranks
        are aligned, every one after the same collective. A member that dies part-way through its
        sends can leave one member's sum complete and another's not; deciding here keeps the
        members' results, and their next operations, in step. The first release stays this
        worker's `release`, with the members named by the second."""
        first, version = self.release or {}, self.released_version
        name = f"{first['sync']}{COMMIT}" if "sync" in first else COMMIT.lstrip("/")
        with self.session.beacon.waiting():
            self._meet(name, time.monotonic(), None, {} if complete else {"incomplete": True}, follow_stop=False)
        decided = self.release or {}
        agreed = bool(decided.get("complete", complete))
        self.release = {**first, "members": decided.get("members", first.get("members"))}
        self.released_version = version
        log.debug("rank %d: %r: complete here %s, on every member %s", self.rank, name, complete, agreed)
        return agreed

    def settle_rounds(self, issued: int) -> int:
        """The final round of a gossip phase whose release said `settle`: every rank meets once more,
        reporting the rounds it has `issued`, and gets the largest (see `GroupGenerator`). The
        first release stays this worker's `release`, with the members named by the second."""
        first, version = self.release or {}, self.released_version
        name = f"{first.get('sync', STOP_SYNC)}/rounds"
        log.debug("rank %d: settling the final gossip round at %r (issued %d)", self.rank, name, issued)
        with self.session.beacon.waiting():
            self._meet(name, time.monotonic(), None, {"round": issued, "settle": True})
        settled = self.release or {}
        final = int(settled.get("final", issued))
        self.release = {**first, "members": settled.get("members", first.get("members"))}
        self.released_version = version
        log.debug("rank %d: the final gossip round is %d", self.rank, final)
        return final

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks this worker exchanges with (every rank until some left the job)."""
        return self.comm.everyone

    def change_members(self, members: list[int] | None) -> None:
        """From now on exchange among `members` (a release's live ranks), if they changed: every
        survivor calls this right after the same release, so all switch at the same point. Ranks
        admitted meanwhile are in the job's group already (`follow_epoch`); after a loss the job's
        process group is rebuilt among the survivors (no communicator that held a lost rank is used
        again). A member that departs while they rebuild it is no hang: they start again without it
        (`Job.regroup`, deciding at meetings of their own, `_agree_on_group`), and this worker's
        `release` then names the members the group was built among. Groups of older membership
        epochs are dropped (nothing is in flight here)."""
        if members is None:
            return
        job = self.job
        group = self.comm.pg
        if job is not None:
            if tuple(sorted(members)) != job.members or job.group is None:
                self._rebuild = 0
                tag = f"s{self.session.number}/{(self.release or {}).get('sync', STOP_SYNC)}"
                job.regroup(members, self._departed_now, self._agree_on_group, timeout=self.timeout, tag=tag)
            group, members = job.group, list(job.members)
        self.base_epoch = int((self.release or {}).get("epoch", self.base_epoch))
        # ranks admitted in the release (`fresh`) are in the group, not in this stretch's collectives
        members = [m for m in members if m not in self.fresh]
        if tuple(members) == self.comm.everyone and group is self.comm.pg:
            return
        gone = sorted(set(self.comm.everyone) - set(members))
        came = sorted(set(members) - set(self.comm.everyone))
        self.comm.rebind(group, members)  # type: ignore[arg-type]
        if job is not None:
            job.retire_epochs()
        if gone:
            log.warning("rank %d: going on without ranks %s; members now %s", self.rank, gone, list(members))
        if came:
            log.info("rank %d: ranks %s joined; members now %s", self.rank, came, list(members))

    def follow_epoch(self, item: dict[str, Any]) -> None:
        """A `members` item (an admission: `GroupGenerator`'s `Rejoining`), in this rank's inbox order:
        the job's group is the new membership epoch's from here, and, where exchanges switch in inbox
        order, every group after this item runs on it."""
        job = self.job
        if job is None:
            return
        epoch, members = int(item["epoch"]), [int(m) for m in item["members"]]
        if epoch in job.epoch_groups and job.group is job.epoch_groups[epoch][0]:
            return  # (followed already)
        group = job.adopt_epoch(epoch, members, lambda: self.session.departed_for(epoch))
        if self.switch_in_order:
            self.comm.rebind(group, job.members)
        log.debug("rank %d: membership epoch %d: members %s", self.rank, epoch, list(job.members))

    def epoch_comm(self, epoch: int) -> GroupComm:
        """Sums on membership epoch `epoch`'s group (a gossip round's members, as the control plane
        named them): this worker's own comm if its group holds them, else a view on that epoch's."""
        job = self.job
        if job is None or epoch <= self.base_epoch:
            return self.comm
        known = job.epoch_groups.get(epoch)
        members = known[1] if known is not None else self.session.epochs.get(epoch)
        if members is None:
            raise CoordinationTimeout(
                f"rank {self.rank}: the control plane named membership epoch {epoch}, which it never announced here"
            )
        return self.comm.view(job.epoch_group(epoch, members, lambda: self.session.departed_for(epoch)), members)

    def donate(
        self, snapshot: Callable[[], Callable[[], bytes]], inside_only: bool = False, upto: int | None = None
    ) -> list[int]:
        """At a batch boundary or a synchronization point, on the training thread: follow the
        admissions announced since the last call (`Session.take_admissions`). Every member creates each
        one's group here (on NCCL collectively, so every member must come here); a donor (the
        admission's `donors` name it for each joiner) takes `snapshot()` of the fit's state and sends
        its joiners what it encodes in the background
        (`lightning_prague.core.comm.transfer.BackgroundTransfer`: the donor trains on; its exchanges
        with a joiner wait for the transfer; the next synchronization point ends it). A joiner lost on
        the way costs the donor a warning, not the fit. `inside_only`: not the admissions of a
        meeting's release (an epoch's end: they follow once it is over). `upto`: send only for the
        admissions of membership epochs up to it, holding the others for a later call (the ranks of a
        sharded replica send their shards of one moment: `DonationAgreement`); `None`: all of them.
        Returns the ranks admitted."""
        admitted: list[int] = []
        for item in self.session.take_admissions(inside_only):
            epoch, members = int(item["epoch"]), [int(m) for m in item["members"]]
            joined = [int(j) for j in item.get("joined", ())]
            admitted += joined
            if self.job is None:
                continue
            self.job.epoch_group(epoch, members, lambda e=epoch: self.session.departed_for(e))
            receivers = [j for j in joined if j not in self.session.departed and donor_of(item, j) == self.rank]
            if receivers:
                self._held.append((epoch, members, receivers, time.time()))
        for epoch, members, receivers, since in [held for held in self._held if upto is None or held[0] <= upto]:
            self._held.remove((epoch, members, receivers, since))
            self._send_state(snapshot, epoch, members, receivers, since)
        if self._held:
            log.debug("rank %d: holds the fit's state for %s until its replica agrees", self.rank, self._held)
        return admitted

    def _send_state(
        self,
        snapshot: Callable[[], Callable[[], bytes]],
        epoch: int,
        members: list[int],
        receivers: list[int],
        since: float,
    ) -> None:
        """Send `receivers`, admitted in membership epoch `epoch` (at `since`), the fit's state (`donate`)."""
        assert self.job is not None
        left = self._left_since(since)
        receivers = [j for j in receivers if not left(j)]
        if not receivers:
            return
        group = self.job.epoch_group(epoch, members, lambda: self.session.departed_for(epoch))
        self.end_transfer()
        try:
            encode = snapshot()
        except Exception as err:  # the joiners' receives fail and they leave; the donor's fit goes on
            log.warning("rank %d: could not take the fit's state for ranks %s: %s", self.rank, receivers, err)
            return
        comm = self.comm.view(group, members)
        transfer = BackgroundTransfer(comm, receivers, encode, "the fit's state", self.timeout, left)
        self.comm.before_exchange = transfer.guard
        self.transfer = transfer.start()
        log.debug("rank %d: sending the fit's state to ranks %s (epoch %d)", self.rank, receivers, epoch)

    def newest_epoch(self) -> int:
        """The newest membership epoch the control plane announced to this rank (0: none yet)."""
        return self.session.announced_epoch

    def await_epoch(self, epoch: int, why: str) -> None:
        """Wait (at most the operation timeout) until the control plane announced membership epoch
        `epoch` here: another rank heard of it, and its announcement is on its way to every member."""
        deadline = time.monotonic() + self.timeout
        while self.newest_epoch() < epoch:
            self.session.raise_if_cut_off(f"waiting for membership epoch {epoch} ({why})")
            if time.monotonic() > deadline:
                raise CoordinationTimeout(
                    f"rank {self.rank}: membership epoch {epoch}, which {why} heard of, was not announced here "
                    f"within {self.timeout:.0f}s"
                )
            time.sleep(0.001)

    def _left_since(self, since: float) -> Callable[[int], bool]:
        """Whether a rank left the job after `since` (wall-clock seconds): it is gone, or it left
        and was admitted again (a joiner that gave up on a transfer and asked again)."""
        session = self.session
        return lambda rank: rank in session.departed or session.rejoined.get(rank, (0.0, ""))[0] >= since

    def _departed_now(self) -> dict[int, str]:
        """The ranks that left the job, for a rebuild of the process group to poll (it ends at once,
        with `ControlPlaneLost`, if the control plane is lost)."""
        self.session.raise_if_cut_off("rebuilding the job's process group")
        return self.session.departed

    def _agree_on_group(self, built: bool) -> tuple[list[int], bool]:
        """`Job.regroup`'s agreement: one more meeting (`<sync>/rebuild<N>/commit`), where each member
        says whether it built the group; returns the live members and whether every one of them did.
        The first release stays this worker's `release`, with the members named by this one."""
        first, version = self.release or {}, self.released_version
        self._rebuild += 1
        name = rebuild_meeting(first.get("sync", STOP_SYNC), self._rebuild)
        self._doing = f"the rebuild of the job's process group ({name!r})"
        with self.session.beacon.waiting():
            self._meet(name, time.monotonic(), None, {} if built else {"incomplete": True}, follow_stop=False)
        decided = self.release or {}
        members = [int(r) for r in decided.get("members", first.get("members", self.comm.everyone))]
        self.release = {**first, "members": members}
        self.released_version = version
        everyone = bool(decided.get("complete", built))
        log.debug("rank %d: %r: built here %s, everywhere %s; members %s", self.rank, name, built, everyone, members)
        return members, everyone

    def request_stop(self, reason: str = "sigterm") -> None:
        """Ask every rank to stop. `"sigterm"`: they drain their groups at the next step and leave
        together (`"requeue"`: the same, and every rank then writes the requeue checkpoint);
        `"request"`: they end their epochs early and the next release says stop.

        Safe to call from the training thread while a communication thread uses the worker.
        """
        if reason in self._stop_requests or (self.stop_seen and reason != REQUEUE):
            return
        if reason == "request" and self.session.stop_reason is not None:
            return  # the job is stopping already
        self._stop_requests.add(reason)
        self._send("stop", reason=reason)

    def leave(self, served: Callable[[], bool] | None = None) -> None:
        """Leave the session after an error: tell the coordinator (`leave`), then execute what was
        already assigned to this rank until its `left` item. Every exchanger leaves through this.

        Every group already issued to this rank is executed (its peers are waiting in it); the
        coordinator assigns nothing more, and the other ranks get an error naming this one at their
        next synchronization point instead of waiting for it. Call it from the thread that sent this
        rank's group requests: sent after them, the `leave` reaches the coordinator after them, so
        every request gets its answer before `left`.

        `served`: where another thread reads the inbox, called right after the `leave` is sent; it
        returns True once that thread has executed everything up to `left` and ended, False if no
        such thread runs (this thread then reads the inbox itself, as without `served`).
        """
        self.send_leave()
        if served is None or not served():
            self._serve_until_left()

    def send_leave(self) -> None:
        """Send `leave` once (see `leave`). A training thread that gives up on the fit sends it itself
        where the communication thread is blocked on an answer that may need this rank's departure (a
        first-ready group that the others, waiting for this rank at the queue's end, never join); that
        thread's requests went out before it blocked, so the `leave` still follows them."""
        if not self._leave_sent:
            self._leave_sent = True
            self._send("leave")

    def _serve_until_left(self) -> None:
        """Execute what was already assigned to this rank until the coordinator's `left` item
        (`leave`; this thread is the only one that reads the inbox)."""
        self._doing = "leaving after an error"
        while True:
            item = self._next_item("the coordinator's acknowledgement of this rank leaving")
            if item["t"] == "left":
                return
            if item["t"] == "group":
                try:
                    self.execute(item)
                except CoordinationTimeout:  # a member of it is gone too: it failed on every member
                    log.debug("rank %d: group %s failed while leaving", self.rank, item.get("gid"), exc_info=True)

    def post_pause(self) -> None:
        """Put `PAUSE` at the end of this rank's own inbox (see `PassiveResponder`).

        The coordinator echoes it behind everything it already assigned to this rank.
        """
        self.session.post(PAUSE)

    def end_transfer(self) -> None:
        """Wait until the state this rank sends in the background (`admit`) is out."""
        transfer, self.transfer = self.transfer, None
        if transfer is not None:
            transfer.wait()
            self.comm.before_exchange = None

    def close(self) -> None:
        """This rank is done with its session (teardown; the worker is not used afterwards)."""
        self.end_transfer()
        self.session.close()

    def drain_for_stop(self, exchanger: PhaseEnd | None = None) -> None:
        """Meet every other rank at the stop point (idempotent)."""
        if not self._stopped:
            self.synchronize(STOP_SYNC, exchanger)

    def consensus_error(self) -> float:
        """Exactly `mean_i ||x_i - x_bar||^2 / ||x_bar||^2` over all replicas; a collective of every rank.

        Call only where ranks are aligned (right after `synchronize`); it changes no tensor.
        The sums run on the backend's device; the one number is read once, at the end.
        """
        everyone = self._averaged_over()
        count = len(everyone)
        drift = Drift(self.tensors.device)
        sums = self.spare()
        complete = True
        for flat, views, bucket in zip(sums.flats, sums.views, self.tensors.buckets):
            torch._foreach_copy_(views, bucket)
            complete &= self.comm.sum_(flat, everyone, "consensus measurement")
            drift.add_average(flat, 1.0 / count)
            for mine, total in zip(bucket, views):
                drift.add_distance(mine, total, 1.0 / count)
        complete &= self.comm.sum_(drift.distance.view(1), everyone, "consensus measurement")  # over every replica
        if not complete:  # a measurement: a member lost during it leaves no number (nothing is changed)
            return float("nan")
        return float(drift.error(replicas=count))

    def global_average(self) -> bool:
        """Average over all live ranks; call only right after `synchronize` returned.

        The floating-point state is averaged (the live tensors: `live_state`, if set, tells where they
        are now, `follow_live`); the exact buffers of `live_state` (integer and boolean ones) become
        their element-wise maximum over the members (`ExactMaxima`). Both are decided together and
        written together: the members end with bitwise the same parameters and buffers.

        Returns False, on every member alike, if a member was lost during it (every member kept its
        tensors): meet again (the release leaves the lost member out) and average again. The
        members' completeness is decided at the control plane before anything is written back (a
        member that dies part-way through its sends can leave one survivor's sum complete and
        another's not). Replicas of different layouts raise `SyncMismatchError`.
        """
        tensors, exact = self._state_now()
        sums = self.spare() if tensors is self.tensors else None
        over = self._averaged_over()
        maxima = ExactMaxima(exact, self.comm, over, "global average")
        applied = False
        try:
            complete = maxima.gather(layout_signature(tensors.tensors, exact), self.agree)
            if complete is not None:  # else every member knows a member was lost: nothing to decide

                def decide(mine: bool) -> bool:
                    return self.agree(mine and complete)

                _, applied = average_(tensors, self.comm, over, operation="global average", sums=sums, decide=decide)
        except CoordinationTimeout as err:
            raise self.session.explain(err, "the global average") from err
        if applied:
            maxima.apply()
            return True
        if set((self.release or {}).get("members", self.comm.everyone)) >= set(self.comm.everyone):
            raise SyncMismatchError(
                f"rank {self.rank}: the global average over ranks {list(self.comm.everyone)} did not complete on "
                "every member although no rank left the job: a connection between live ranks failed (the log of "
                "the rank that reported it names the peer)"
            )
        log.warning("rank %d: a rank was lost during the global average; meeting again without it", self.rank)
        return False

    def _averaged_over(self) -> tuple[int, ...]:
        """The ranks this rank's synchronization-point average runs over (`averaged_with`); whether it takes
        effect is still decided over every live rank, all or nothing."""
        everyone = tuple(self.comm.everyone)
        return everyone if self.averaged_with is None else self.averaged_with(everyone)

    def _state_now(self) -> tuple[BucketedTensors, list[torch.Tensor]]:
        """What a global average changes: the floating-point tensors (those of construction, pointed
        at the live ones where the module replaced some) and the exact buffers (see `live_state`)."""
        if self.live_state is None:
            return self.tensors, []
        live, exact = self.live_state()
        if follow_live(self.tensors, live):
            return self.tensors, list(exact)
        if not self._warned_layout:
            self._warned_layout = True
            log.warning(
                "rank %d: the model's parameters or floating-point buffers changed in number, shape or dtype "
                "since setup: synchronization points average them, group exchanges still average those of setup",
                self.rank,
            )
        return BucketedTensors(live), list(exact)
