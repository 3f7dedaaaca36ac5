"""A process's membership of the running fit: who the members are, the process group among them, and admission.

The library's process group spans the members of the job (`Membership.members`). Two things change it:

**An admission opens a membership epoch** (`epoch_group`), with no meeting: the control plane admits
a joiner at once and announces the epoch to every member, in its inbox order
(`lightning_prague.core.plane.generator`'s `Rejoining`). Each member and the joiner then create the
epoch's group under a name they derive alike (the fit, the epoch, its members), on their own, when
they come to it. On gloo it connects lazily: creating it waits for nobody, and each pair of members
connects at its first exchange, so only the joiner, its donor and the joiner's first groups or rounds
ever meet; a peer's address is waited for in the store as in a rebuild (below), giving up when it
departs. On NCCL a communicator is created collectively: every member creates the epoch's at its
next batch boundary (`lightning_prague.strategies.sync_points`), the one wait of an admission,
NCCL's. Work-queue groups switch to the epoch's group between the same two groups on every member
(the inbox order); gossip rounds take the group the control plane names with each round's members.
Groups of older epochs are dropped at the next synchronization point, where nothing is in flight
(`retire_epochs`).

**A loss is followed at a synchronization point's release** (`regroup`): the survivors rebuild the
group among themselves, and no communicator that held a lost rank is used again. The old one is
aborted on NCCL (its operations with the lost rank would never complete) and dropped on gloo. The
world group is left alone: collectives on it need every rank, so after a change the strategies run
Lightning's collectives on this group instead.

**A rebuild is bounded and abandonable.** Building a group is a rendezvous in the store (every
member publishes its address and waits for the others') and then connections between every pair.
Each attempt has a store prefix of its own (`rebuilds`, counted alike on every member, or named by
the meeting all of them call it at, so a half-finished rendezvous never mixes with the next); its
waits for the others' addresses poll (`RendezvousStore`), and give up as soon as a member departs
(`departed`) or the rebuild's bound passes; the connections are built by a thread of its own,
which the member abandons as well (gloo's connection attempts to a dead peer end later by
themselves). Whether every member built the group, and who is still in the job, is then decided at
one more meeting of the control plane (`agree`): a member can finish its connections with one that
dies a moment later while another cannot. Every member adopts the group only if every live member
built it; otherwise they all start again among the live ones, so a second and a third loss during
a rebuild cost an attempt each, not the process group's timeout. A rebuild that fails although
nobody left ends with a `CoordinationTimeout` naming the ranks and the operation, on every member
alike.

**A joiner's side** (`rejoin`): it opens the fit's session asking to rejoin, waits for its
admission item (the epoch, its members, the donor, where its rank stood in its shard), creates the
epoch's group and receives the fit's state from the donor over it
(`lightning_prague.core.comm.transfer`). Any failure on the way closes its session as failed (a
departure, or a withdrawal before its admission): nobody waits for it. Once it connected to a
member it first shuts down its own connections (gloo's operations cannot be aborted, and its
process may live on: a member's exchange with it would otherwise wait for the operation's
timeout). A donor that leaves before its state arrived (its receive watches for the departure)
costs only that admission: the joiner asks again, in a new session of the same fit, and the next
lowest member sends the state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_prague.core.client.control import Session
from lightning_prague.core.client.partition import established_connections, shut_down_connections
from lightning_prague.core.comm.groups import GroupComm, watch_lazy_connects
from lightning_prague.core.comm.transfer import receive_payload
from lightning_prague.core.errors import ControlPlaneError, CoordinationTimeout, MemberLost
from lightning_prague.core.protocol import SessionConfig, donor_of

if TYPE_CHECKING:
    from lightning_prague.core.client.control import ControlClient

log = logging.getLogger(__name__)

#: the store prefix under which rebuilt groups meet (each under a name of its own)
GROUPS_PREFIX = "lightning_prague/groups"
#: seconds a rebuilt group's members may take to connect to each other once every address is in the
#: store (gloo tries a refused connection a few times: a member that died there costs a few times this)
CONNECT_SECONDS = 10.0
#: the longest pause between two looks at the store while waiting for a member's address
POLL_SECONDS = 0.05
#: attempts a rejoining rank makes when its donor leaves the job before the fit's state arrived (`Membership.rejoin`)
REJOIN_ATTEMPTS = 3
#: seconds a rejoining rank whose transfer failed waits for the control plane's word that the donor left
DEPARTURE_NOTICE_SECONDS = 5.0
#: `agree(built)` -> `(the live members, whether every one of them built the group)`; see `Membership.regroup`
Agreement = Callable[[bool], tuple[Sequence[int], bool]]


class Membership:
    """The membership half of a `Job` (`lightning_prague.core.job`): its fields live there."""

    rank: int
    world_size: int
    backend: str
    control: ControlClient
    group: Optional[dist.ProcessGroup]
    sessions: int
    members: tuple[int, ...]
    named_leader: Optional[int]
    pg_timeout: Optional[timedelta]
    rebuilds: int
    store: Optional[dist.Store]
    device_id: Optional[torch.device]
    joining: bool
    rejoined: bool
    #: the established TCP connections (socket inodes) of `group` on this process (gloo's pairs)
    connections: set[int]
    _connected_before: set[int]
    #: this process's connections that belong to no group of the library (the control plane, the
    #: store, the world group): `drop_group_connections` keeps them
    outside_groups: Optional[set[int]]
    #: membership epoch -> (its process group, its members) (`epoch_group`)
    epoch_groups: dict[int, tuple[dist.ProcessGroup, tuple[int, ...]]]
    _epoch_stores: dict[int, dist.Store]
    _epoch_lock: threading.Lock

    @property
    def leader(self) -> int:
        """The rank that does global rank 0's duties (checkpoints, logging): the one the control plane
        names (`follow_leader`), while it is a member; else the lowest live rank (-1, nobody, for a
        joiner before its admission: it is no member yet)."""
        named = self.named_leader
        if named is not None and named in self.members:
            return named
        return self.members[0] if self.members else -1

    def follow_leader(self, release: dict[str, Any]) -> None:
        """Take the leader a release names (the control plane keeps it until it is lost, so a rank
        that rejoins below it does not take the duties back)."""
        named = release.get("leader")
        if isinstance(named, int) and not isinstance(named, bool) and 0 <= named < self.world_size:
            self.named_leader = named

    def regroup(
        self,
        members: Sequence[int],
        departed: Callable[[], Collection[int]] = frozenset,
        agree: Optional[Agreement] = None,
        timeout: Optional[float] = None,
        tag: Optional[str] = None,
    ) -> dist.ProcessGroup:
        """The library's process group among `members` (survivors, and ranks that rejoin), built by
        them alone; every member must call this at the same point (see the module docstring).

        `departed()`: the ranks known to have left the job (polled while waiting on the others; it
        may raise to end the rebuild, e.g. when the control plane is lost). `agree(built)`: called
        by every member after each attempt with whether it built the group here; returns the live
        members and whether every one of them built it (a meeting of the control plane). Without
        it, one attempt, which fails with `MemberLost` if a member departs. `timeout`: the bound of
        the whole rebuild (default: the process group's timeout). `members` (then `self.members`)
        ends up as the members of the group returned. `tag`: names the point where the members
        call it, alike on every one of them (the session and its meeting), so that a rank that
        rejoins, which has rebuilt nothing before, finds the others' rendezvous; default: the
        number of rebuilds so far."""
        self._connected_before = set(established_connections())  # `_adopt` names the group's connections
        proposal = tuple(sorted(members))
        if proposal == self.members and self.group is not None:
            return self.group
        bound = timeout if timeout is not None else self._pg_seconds()
        deadline = time.monotonic() + bound
        attempt = 0
        while True:
            attempt += 1
            self.rebuilds += 1
            what = f"rebuilding the job's process group among ranks {list(proposal)} (attempt {attempt})"
            log.debug("rank %d: %s", self.rank, what)
            group: Optional[dist.ProcessGroup] = None
            failure: Optional[BaseException] = None
            try:
                group = self._build(proposal, what, departed, deadline, bound, f"{tag or 'rebuild'}-{attempt}")
            except ControlPlaneError:
                raise
            except (RuntimeError, TimeoutError) as err:  # a member left, the bound passed, a connection failed
                failure = err
                log.debug("rank %d: %s failed here: %s", self.rank, what, err)
            if agree is None:
                if group is None:
                    assert failure is not None
                    raise failure
                return self._adopt(group, proposal)
            live, everyone_built = agree(group is not None)
            live_ = tuple(sorted(live))
            if group is not None and everyone_built and live_ == proposal:
                return self._adopt(group, proposal)
            if group is not None:
                _drop(group, self.backend)
            if self.rank not in live_:
                raise MemberLost(f"rank {self.rank}: the control plane counted this rank out while {what}")
            if live_ == proposal and time.monotonic() > deadline:
                error = failure or "it failed on another member"
                raise CoordinationTimeout(
                    f"rank {self.rank}: {what} did not succeed within {bound:.0f}s although no rank left: {error}"
                ) from failure
            gone = sorted(set(proposal) - set(live_))
            log.warning(
                "rank %d: %s %s; starting again among ranks %s",
                self.rank,
                what,
                f"was abandoned: ranks {gone} left the job meanwhile" if gone else "failed on some member",
                list(live_),
            )
            proposal = live_

    def _pg_seconds(self) -> float:
        return self.pg_timeout.total_seconds() if self.pg_timeout is not None else 1800.0

    def _build(
        self,
        members: tuple[int, ...],
        what: str,
        departed: Callable[[], Collection[int]],
        deadline: float,
        bound: float,
        tag: str,
    ) -> dist.ProcessGroup:
        """One attempt: a group among `members` under a store prefix of its own, built by a thread
        of its own while this one watches for departures and the deadline (see the module docstring)."""
        others = [m for m in members if m != self.rank]
        name = f"lightning_prague-{tag}-" + "-".join(map(str, members))
        base = dist.PrefixStore(GROUPS_PREFIX, self.store) if self.store is not None else _default_store()
        store = RendezvousStore(base, self.rank, members, what, departed, deadline, bound)
        connect = timedelta(seconds=max(1.0, min(CONNECT_SECONDS, deadline - time.monotonic())))
        outcome: dict[str, object] = {}

        def build() -> None:
            try:
                outcome["group"] = _new_group(members, self.backend, store, name, connect, what, self.device_id)
            except BaseException as err:  # the waiting thread raises it, or has moved on
                outcome["error"] = err
                if store.abandoned:
                    log.debug("rank %d: an abandoned attempt ended: %s", self.rank, err)

        builder = threading.Thread(target=build, name=f"prague-rebuild-{self.rank}", daemon=True)
        builder.start()
        pause = 0.001
        while builder.is_alive():
            builder.join(pause)
            pause = min(POLL_SECONDS, pause * 2)
            if not builder.is_alive():
                break
            try:
                gone = sorted(r for r in others if r in departed())
            except BaseException:
                store.abandoned = True
                raise
            if gone:
                store.abandoned = True
                raise MemberLost(f"rank {self.rank}: ranks {gone} left the job while {what}")
            if time.monotonic() > deadline + connect.total_seconds():
                store.abandoned = True
                raise CoordinationTimeout(
                    f"rank {self.rank}: {what} did not finish within {bound:.0f}s: the connections among the "
                    f"members did not complete"
                )
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        group = outcome["group"]
        assert isinstance(group, dist.ProcessGroup)
        store.settle()  # later waits (NCCL connects lazily) are bounded by the group's own timeout
        if self.pg_timeout is not None:
            dist.distributed_c10d._set_pg_timeout(self.pg_timeout, group)
        return group

    def _adopt(self, group: dist.ProcessGroup, members: tuple[int, ...]) -> dist.ProcessGroup:
        """Switch to `group`, built among `members` on every one of them."""
        old, self.group, self.members = self.group, group, members
        self.connections = set(established_connections()) - self._connected_before
        if "nccl" in self.backend and old is not None:
            _abort(old)
        log.debug("rank %d: rebuilt the job's process group among ranks %s", self.rank, list(members))
        return group

    def epoch_group(
        self, epoch: int, members: Sequence[int], departed: Callable[[], Collection[int]] = frozenset
    ) -> dist.ProcessGroup:
        """The process group of membership epoch `epoch` among `members` (see the module docstring),
        created on the first call: lazily connected on gloo (it waits for nobody), collectively on
        NCCL. `departed()`: the ranks known to have left (a wait for a peer's address gives up on it)."""
        with self._epoch_lock:
            known = self.epoch_groups.get(epoch)
            if known is not None:
                return known[0]
            ranks = tuple(sorted(int(m) for m in members))
            what = f"the process group of membership epoch {epoch} among ranks {list(ranks)}"
            base = dist.PrefixStore(GROUPS_PREFIX, self.store) if self.store is not None else _default_store()
            bound = self._pg_seconds()
            pairwise = "nccl" not in self.backend  # (lazily connected: see `_new_group`)
            store = RendezvousStore(base, self.rank, ranks, what, departed, time.monotonic() + bound, bound, pairwise)
            store.settle()  # every wait is bounded by its own timeout (and a departure)
            name = f"lightning_prague-s{self.sessions}-e{epoch}-" + "-".join(map(str, ranks))
            log.debug("rank %d: creating %s", self.rank, what)
            group = _new_group(
                ranks, self.backend, store, name, timedelta(seconds=bound), what, self.device_id, lazy=True
            )
            if self.pg_timeout is not None:
                dist.distributed_c10d._set_pg_timeout(self.pg_timeout, group)
            if pairwise:  # a peer that dies before its pair connects must not hold this rank in gloo
                watch_lazy_connects(group, departed)
            self.epoch_groups[epoch] = (group, ranks)
            self._epoch_stores[epoch] = store  # gloo waits on it at each pair's first operation: kept alive
            return group

    def adopt_epoch(
        self, epoch: int, members: Sequence[int], departed: Callable[[], Collection[int]] = frozenset
    ) -> dist.ProcessGroup:
        """From now on the job's group is membership epoch `epoch`'s (an admission); the one before
        stays usable until `retire_epochs`."""
        group = self.epoch_group(epoch, members, departed)
        self.group, self.members = group, tuple(sorted(int(m) for m in members))
        return group

    def retire_epochs(self) -> None:
        """At a synchronization point, nothing in flight: drop the groups of membership epochs that are
        not the job's group any more."""
        with self._epoch_lock:
            retired = [e for e, (group, _) in self.epoch_groups.items() if group is not self.group]
            for epoch in retired:
                group, _ = self.epoch_groups.pop(epoch)
                _retire(group, self.backend)
                self._epoch_stores.pop(epoch, None)
        if retired:
            log.debug("rank %d: dropped the process groups of membership epochs %s", self.rank, retired)

    def drop_group_connections(self) -> None:
        """Shut down this process's side of its process group's connections (the control plane left it
        out of the fit): every peer's exchange with it fails at once, as if it had ended, instead of
        waiting for it (gloo; on NCCL the peers' waits give up on its departure). Called by the
        control client's reader thread: the training thread may be the one that blocks."""
        grouped = self.connections | (set(established_connections()) - (self.outside_groups or set()))
        shut_down_connections(grouped, self.rank, "it was left out of the fit")

    def leave_in_place(self) -> None:
        """This process was left out of its running fit (it blocked past its short hang bound, and the
        others went on without it): it becomes a joiner of that fit, as a new process for its rank
        would be, so that `rejoin` (with the session's number again) takes it back with a live
        member's state. Its process group, which the others no longer use, is dropped."""
        old, self.group, self.members = self.group, None, ()
        epochs = [group for group, _ in self.epoch_groups.values()]
        self.retire_epochs()
        if old is not None and all(old is not group for group in epochs):
            _drop(old, self.backend)
        self.sessions = max(0, self.sessions - 1)  # `rejoin` opens the same fit's session again
        self.joining, self.rejoined, self.named_leader = True, False, None
        log.warning("rank %d: left out of the running fit; it rejoins it in place", self.rank)

    def rejoin(self, config: SessionConfig, wait: float, timeout: float) -> Admission:
        """A new process for a rank that left the job: join the running fit's session, wait (at most
        `wait` s) for its admission (at once, or after the members' meeting, or at their epoch's end
        for a lock-step rank with nothing left in their epoch), create the admission's membership
        epoch's group (`epoch_group`) and receive the fit's state from the donor over it
        (`lightning_prague.core.comm.transfer`); `timeout` bounds each operation. A transfer that
        fails costs an attempt: a donor that left the job before its state arrived (it died
        mid-transfer), or one that lives but whose state did not arrive within the timeout (its send
        never reached this process). This rank gives up on that admission (a departure, so nobody
        waits for it, and the donor leaves its transfer behind) and asks again, up to
        `REJOIN_ATTEMPTS` times, in a new membership epoch whose group connects afresh. Raises `ControlPlaneError` with
        the reason if the fit cannot take it back."""
        self.sessions += 1
        start = time.monotonic()
        for attempt in range(1, REJOIN_ATTEMPTS + 1):
            try:
                return self._rejoin_once(config, wait, timeout, start)
            except _TransferFailed as err:
                if attempt == REJOIN_ATTEMPTS:
                    raise MemberLost(f"{err}; gave up after {attempt} attempts to rejoin") from err
                log.warning("%s; it asks to rejoin again (attempt %d of %d)", err, attempt + 1, REJOIN_ATTEMPTS)
                self.group, self.members = None, ()  # a new epoch at the next admission
        raise AssertionError("unreachable")  # (the loop returns or raises)

    def _rejoin_once(self, config: SessionConfig, wait: float, timeout: float, start: float) -> Admission:
        """One attempt of `rejoin`, in a session of its own (the fit's number, `self.sessions`);
        `_TransferFailed` if the fit's state did not arrive (the donor left, or the receive timed
        out). Any failure closes the session as failed: a withdrawal before the admission, a
        departure after it."""
        session = self.control.open_session(self.sessions, config, rejoin=True)
        donor: Optional[int] = None
        receiving = False  # whether the failure is the transfer's (which another attempt may get through)
        connected: Optional[dict[int, int]] = None  # this process's connections before it connected to a member
        try:
            admit = session.await_admission(wait)
            epoch, members = int(admit["epoch"]), tuple(sorted(int(m) for m in admit["members"]))
            donor = donor_of(admit, self.rank)
            if self.rank not in members or donor not in members or donor == self.rank:
                raise MemberLost(f"rank {self.rank}: the fit's admission named members {list(members)}, donor {donor}")
            departed = lambda: session.departed_for(epoch)  # noqa: E731
            connected = established_connections()
            self.adopt_epoch(epoch, members, departed)
            comm = GroupComm(self.rank, self.world_size, timeout, self.group)
            comm.rebind(self.group, self.members)  # type: ignore[arg-type]
            admitted = time.monotonic()
            sender = donor
            receiving = True
            payload = receive_payload(comm, donor, "the fit's state", sender_gone=lambda: sender in session.departed)
        except BaseException as err:
            # (before the close: a closed session hears of no departure)
            failed = isinstance(err, (MemberLost, CoordinationTimeout))
            lost = donor is not None and failed and _heard_left(session, donor)
            if connected is not None:  # a member's exchange with this process (a gossip round) fails at once
                built = set(established_connections()) - set(connected)
                shut_down_connections(built, self.rank, "those of the group it made at an admission it gives up")
            session.close(failed=True)
            if lost:
                raise _TransferFailed(
                    f"rank {self.rank}: rank {donor} left the job before the fit's state arrived"
                ) from err
            if receiving and isinstance(err, CoordinationTimeout):
                why = f"rank {self.rank}: the fit's state from rank {donor} did not arrive: {err}"
                raise _TransferFailed(why) from err
            raise
        self.joining, self.rejoined = False, True
        self.follow_leader(admit)
        done = time.monotonic()
        where = f"at {admit['at']!r}" if admit.get("at") else "inside the epoch"
        log.warning(
            "rank %d: rejoined the job %s (membership epoch %d) after %.1fs; received the fit's state from rank %d "
            "(%.1f MB in %.2fs)", self.rank, where, epoch, admitted - start, donor, len(payload) / 1e6, done - admitted,
        )  # fmt: skip
        position = admit.get("position") if isinstance(admit.get("position"), dict) else None
        return Admission(session, donor, payload, admitted - start, done - admitted, admit, position)


class _TransferFailed(MemberLost):
    """The fit's state did not reach a rejoining rank (its donor left the job first, or the receive
    timed out): the rank asks again."""


def _heard_left(session: Session, rank: int, within: float = DEPARTURE_NOTICE_SECONDS) -> bool:
    """Whether `rank`'s departure was announced to `session`, waiting up to `within` s for the notice
    (a broken connection to a process that died comes before the control plane's word of it)."""
    deadline = time.monotonic() + within
    while rank not in session.departed:
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


@dataclass(frozen=True)
class Admission:
    """What a rank that rejoined got: its session, the donor and the fit's state (bytes) it sent,
    the seconds it waited for its admission and those the state took to arrive, the admission item
    (`release`: the membership epoch, the meeting it was admitted in if any, the members' counters it
    takes up: `Exchanger.take_up`) and where its rank stood in its shard."""

    session: Session
    donor: int
    payload: bytes
    waited: float
    received: float
    release: dict[str, Any]
    #: where this rank stood in its own shard of the epoch when it was lost (lock-step shards:
    #: `epoch`, `batches`, `shard`, `of`), as the control plane last heard it; `None` if never reported
    position: Optional[dict[str, int]] = None


def _default_store() -> dist.Store:
    """The store `new_group` would build a group's rendezvous on (the default group's, with its prefix)."""
    c10d = dist.distributed_c10d
    return c10d._world.pg_map[c10d._get_default_group()][1]


#: the variable that makes torch create a gloo process group that connects each pair at its first use
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
_lazy_lock = threading.Lock()


def _new_group(
    members: tuple[int, ...],
    backend: str,
    store: dist.Store,
    name: str,
    timeout: timedelta,
    what: str,
    device_id: Optional[torch.device] = None,
    lazy: bool = False,
) -> dist.ProcessGroup:
    """`dist.new_group(members, use_local_synchronization=True)` under the group name (its store prefix)
    `name` and on `store`: torch names a group by its ranks and the number of groups this process
    made, which two members need not agree on, and a failed attempt would reuse it. `lazy`: on gloo,
    each pair connects at its first operation (creating the group waits for nobody)."""
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
    lazily = lazy and "nccl" not in backend

    def create() -> dist.ProcessGroup:
        group, _ = c10d._new_process_group_helper(
            len(members),
            members.index(default.rank()),
            list(members),
            backend,
            store,
            c10d.GroupName(name),
            timeout=timeout,
            device_id=device_id if device_id is not None else default.bound_device_id,
            group_desc=what[:200],
        )
        return group

    if lazily:  # (torch reads the variable when it creates the group; an eager build, which may block
        # for long in a thread it abandoned, never holds the lock)
        with _lazy_lock:
            before = os.environ.get(GLOO_LAZY_INIT)
            os.environ[GLOO_LAZY_INIT] = "1"
            try:
                group = create()
            finally:
                if before is None:
                    os.environ.pop(GLOO_LAZY_INIT, None)
                else:
                    os.environ[GLOO_LAZY_INIT] = before
    else:
        group = create()
    c10d._world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(members)}
    return group


def new_named_group(
    members: tuple[int, ...],
    backend: str,
    name: str,
    timeout: timedelta,
    what: str,
    device_id: Optional[torch.device] = None,
    store: Optional[dist.Store] = None,
) -> dist.ProcessGroup:
    """A process group of `members` made by them only, named `name` (unique in the job, the same on
    every member) on the default group's store, or under `GROUPS_PREFIX` on the job's `store` (ranks
    that rejoined: their default group is their own stand-in); its waits are bounded by `timeout`."""
    base = dist.PrefixStore(GROUPS_PREFIX, store) if store is not None else _default_store()
    return _new_group(members, backend, base, name, timeout, what, device_id)


class RendezvousStore(dist.Store):
    """The store a rebuilt group's rendezvous runs on: the default store, with waits that poll, so
    that they give up when a member departs (`departed`), when the rebuild is abandoned or when its
    `deadline` passes, each time with an error that names the operation and the ranks missing.

    `pairwise`: the group's pairs connect one by one, each at its first operation (a membership
    epoch's group on gloo): a wait then gives up only when a member it waits for departs (a store
    key of gloo's names the peer's index), not when a third member does. A donor's first send to a
    joiner went on failing at once when another member departed between the joiner's admission and
    that send, and the joiner waited out its timeout for the state (`tests/test_membership.py`)."""

    def __init__(
        self,
        base: dist.Store,
        rank: int,
        members: tuple[int, ...],
        what: str,
        departed: Callable[[], Collection[int]],
        deadline: float,
        bound: float,
        pairwise: bool = False,
    ) -> None:
        super().__init__()
        self.base = base
        self.pairwise = pairwise
        self.rank = rank
        self.members = members
        self.what = what
        self.departed = departed
        self.deadline: Optional[float] = deadline
        self.bound = bound
        #: set by the member that gave up on this attempt: every wait of it ends
        self.abandoned = False

    def settle(self) -> None:
        """The group is built: later waits are bounded by their own timeouts only."""
        self.deadline = None

    def _poll(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        limit = self.deadline
        if limit is None:
            seconds = timeout.total_seconds() if timeout is not None else self.bound
            limit = time.monotonic() + seconds
        pause = 0.002
        watched = self._watched(keys)
        while not self.base.check(keys):
            gone = sorted(r for r in watched if r in self.departed())
            if gone:
                raise MemberLost(f"rank {self.rank}: ranks {gone} left the job while {self.what}")
            if self.abandoned:
                raise MemberLost(f"rank {self.rank}: {self.what} was abandoned")
            if time.monotonic() > limit:
                missing = [k for k in keys if not self.base.check([k])]
                raise CoordinationTimeout(
                    f"rank {self.rank}: {self.what} timed out after {self.bound:.0f}s waiting for ranks "
                    f"{self._ranks(missing)} (store keys {missing})"
                )
            time.sleep(pause)
            pause = min(POLL_SECONDS, pause * 2)

    def _watched(self, keys: list[str]) -> list[int]:
        """The members whose departure ends a wait on `keys`: those the keys name on a `pairwise`
        group, else (or for a key that names none) every other member."""
        others = [m for m in self.members if m != self.rank]
        if not self.pairwise:
            return others
        named = self._ranks(keys)
        if not all(isinstance(r, int) for r in named):
            return others
        return [r for r in named if isinstance(r, int) and r != self.rank]

    def _ranks(self, keys: list[str]) -> list[object]:
        """The members whose keys these are (a rendezvous key ends with the member's index)."""
        found: list[object] = []
        for key in keys:
            tail = key.rsplit("/", 1)[-1]
            index = int(tail) if tail.isdigit() else -1
            found.append(self.members[index] if 0 <= index < len(self.members) else key)
        return found

    def set(self, key: str, value: object) -> None:
        self.base.set(key, value)

    def get(self, key: str) -> bytes:
        self._poll([key])
        return self.base.get(key)

    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        self._poll(list(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return self.base.check(keys)

    def add(self, key: str, amount: int) -> int:
        return self.base.add(key, amount)

    def compare_set(self, key: str, expected: object, desired: object) -> bytes:
        return self.base.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.base.delete_key(key)

    def num_keys(self) -> int:
        return self.base.num_keys()


def _drop(group: dist.ProcessGroup, backend: str) -> None:
    """A group built by an attempt the members did not all complete: never used (aborted on NCCL)."""
    if "nccl" in backend:
        _abort(group)


def _retire(group: dist.ProcessGroup, backend: str) -> None:
    """A group nobody uses any more (an older membership epoch's): its connections close."""
    if "nccl" in backend:
        _abort(group)
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # it is dropped either way
        log.debug("dropping an older membership epoch's process group failed", exc_info=True)


def _abort(group: dist.ProcessGroup) -> None:
    """Abort an NCCL communicator that held a lost rank, so nothing waits on it again."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    try:
        if abort is not None:
            abort(group)
        else:
            group._get_backend(torch.device("cuda")).abort()  # type: ignore[attr-defined]
    except Exception:  # the communicator is dropped either way
        log.warning("aborting the process group that held a lost rank failed", exc_info=True)
