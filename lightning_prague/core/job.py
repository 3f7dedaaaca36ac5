"""A training process's membership of a job: the store, the control plane, and our process group.

`init_job` is called once per process, by every rank, where `torch.distributed.init_process_group`
would be (the strategies call it from `setup_distributed`; a script without Lightning calls it
itself). It

1. has global rank 0 start the supervisor (`lightning_prague.core.plane.supervisor`), which hosts the
   store and the control plane in a process of its own; under torchrun the agent's store is used
   (`TORCHELASTIC_USE_AGENT_STORE`) and the supervisor hosts the control plane only;
2. initialises the default process group with every rank a client of that store;
3. connects this process to the control plane (`ControlClient`);
4. builds the library's own process group over every rank, once: every exchange of ours runs on
   it, so collectives that users or Lightning run on the world group never interleave with ours
   (one communicator more on NCCL, whatever the number of groups).

When ranks leave the job, the survivors rebuild that group among themselves (`Job.regroup`, at a
synchronization point's release, where every survivor is): a new group under its own store prefix,
created by the survivors alone, so no communicator that held a lost rank is used again. The old
one is aborted on NCCL (its operations with the lost rank would never complete) and dropped on
gloo. The world group is left alone: collectives on it need every rank, so after a loss the
strategies run Lightning's collectives on this group instead.

**A rebuild is bounded and abandonable.** Building a group is a rendezvous in the store (every
member publishes its address and waits for the others') and then connections between every pair.
Each attempt has a store prefix of its own (`Job.rebuilds`, counted alike on every member, so a
half-finished rendezvous never mixes with the next); its waits for the others' addresses poll, and
give up as soon as a member departs (`departed`) or the rebuild's bound passes; the connections
are built by a thread of its own, which the member abandons as well (gloo's connection attempts to
a dead peer end later by themselves). Whether every member built the group, and who is still in
the job, is then decided at one more meeting of the control plane (`agree`): a member can finish
its connections with one that dies a moment later while another cannot. Every member adopts the
group only if every live member built it; otherwise they all start again among the live ones, so
a second and a third loss during a rebuild cost an attempt each, not the process group's timeout.
A rebuild that fails although nobody left ends with a `CoordinationTimeout` naming the ranks and
the operation, on every member alike.

If the default process group exists already (initialised by the user), steps 1 and 3-4 still run,
with the supervisor as a client of that group's store.

**Private parts of torch.distributed.** Rebuilding the group under a name and store of ours, and
finding the default group's store, use private parts of `torch.distributed.distributed_c10d`.
`TORCH_INTERNALS` lists every one the package uses (tests/test_torch_internals.py holds it to the
code), and `init_job` checks first that the installed torch has each (`check_torch_internals`): a
torch release that renamed one fails when the job starts, with a `ConfigurationError` naming it,
not when a rank is lost.
"""

from __future__ import annotations

import atexit
import inspect
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_prague.core.auth import (
    SECRET_FILE_VARIABLE,
    SECRET_VARIABLE,
    Credentials,
    generated_secret,
    known_launch_id,
    new_launch_id,
    user_secret,
)
from lightning_prague.core.client.control import ControlClient, Session
from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.comm.transfer import receive_payload
from lightning_prague.core.errors import ConfigurationError, ControlPlaneError, CoordinationTimeout, MemberLost
from lightning_prague.core.plane.launch import Supervisor, launch, wait_until_listening
from lightning_prague.core.protocol import ADDRESS_RECORD, SessionConfig, address_key, rebuild_meeting
from lightning_prague.core.records import BadRecord

log = logging.getLogger(__name__)

#: the store prefix under which rebuilt groups meet (each under a name of its own)
GROUPS_PREFIX = "lightning_prague/groups"
#: seconds a rebuilt group's members may take to connect to each other once every address is in the
#: store (gloo tries a refused connection a few times: a member that died there costs a few times this)
CONNECT_SECONDS = 10.0
#: the longest pause between two looks at the store while waiting for a member's address
POLL_SECONDS = 0.05
#: `agree(built)` -> `(the live members, whether every one of them built the group)`; see `Job.regroup`
Agreement = Callable[[bool], tuple[Sequence[int], bool]]


#: the torch releases this one is meant for; the `torch` dependency in pyproject.toml says the same
#: (tests/test_torch_internals.py holds them together)
SUPPORTED_TORCH = ">=2.13"


@dataclass(frozen=True)
class TorchInternal:
    """One private part of `torch.distributed.distributed_c10d` that this package uses, and what for.

    `name` is its path in that module (`"_world.pg_map"`). A `called` one must be callable, with the
    arguments the package passes: `arguments` positional ones and the keyword ones `keywords`.
    """

    name: str
    purpose: str
    called: bool = False
    arguments: int = 0
    keywords: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        """Its full name, as messages show it."""
        return f"torch.distributed.distributed_c10d.{self.name}"


#: every private part of torch.distributed the package uses; `init_job` checks each before any use
TORCH_INTERNALS: tuple[TorchInternal, ...] = (
    TorchInternal(
        "_get_default_store",
        "the default group's store, where the control plane's address is, in raw_store",
        called=True,
    ),
    TorchInternal(
        "_get_default_group", "the default group: this rank and device in a rebuilt group, in _new_group", called=True
    ),
    TorchInternal(
        "_world.pg_map",
        "the default group's store with its prefix, on which a rebuilt group meets, in _default_store; the "
        "number of process groups, in lightning_prague.core.comm.groups.communicator_count",
    ),
    TorchInternal("_world.pg_group_ranks", "a rebuilt group's ranks, registered as new_group does, in _new_group"),
    TorchInternal(
        "ProcessGroup.bound_device_id", "the device a rebuilt group is bound to, the default group's, in _new_group"
    ),
    TorchInternal("GroupName", "a rebuilt group's name, its store prefix, in _new_group", called=True, arguments=1),
    TorchInternal(
        "_new_process_group_helper",
        "rebuilding the job's group among the survivors under a name and on a store of ours, in _new_group",
        called=True,
        arguments=6,
        keywords=("timeout", "device_id", "group_desc"),
    ),
    TorchInternal("_set_pg_timeout", "a rebuilt group's operation timeout, in Job.regroup", called=True, arguments=2),
)


def missing_torch_internal(internal: TorchInternal) -> Optional[str]:
    """What the installed torch lacks of `internal`, as a message names it; `None` when it is there."""
    found: object = dist.distributed_c10d
    path = "torch.distributed.distributed_c10d"
    for part in internal.name.split("."):
        path = f"{path}.{part}"
        try:
            found = getattr(found, part)
        except AttributeError:
            return f"{path} ({internal.purpose}) is missing"
    if not internal.called:
        return None
    if not callable(found):
        return f"{path} ({internal.purpose}) is not callable (a {type(found).__name__})"
    try:
        signature = inspect.signature(found)
    except (TypeError, ValueError):  # a builtin or a typing construct: being callable is all we can check
        return None
    try:
        signature.bind(*[None] * internal.arguments, **dict.fromkeys(internal.keywords))
    except TypeError as err:
        takes = f"{internal.arguments} positional arguments" + "".join(f", {k}=" for k in internal.keywords)
        return f"{path} ({internal.purpose}) does not take {takes} ({err}; it is {path.rsplit('.', 1)[1]}{signature})"
    return None


def check_torch_internals() -> None:
    """Raise `ConfigurationError` naming every entry of `TORCH_INTERNALS` that the installed torch
    lacks (or that does not take the arguments the package passes), and the installed version."""
    missing = [found for internal in TORCH_INTERNALS if (found := missing_torch_internal(internal))]
    if missing:
        raise ConfigurationError(
            f"lightning-prague relies on private parts of torch.distributed that the installed torch=="
            f"{torch.__version__} does not provide: {'; '.join(missing)}. This release of lightning-prague "
            f"requires torch{SUPPORTED_TORCH} and uses them as torch 2.13 has them: install a torch release "
            f"that has them and pin it in your requirements, or use a lightning-prague release that supports "
            f"torch=={torch.__version__}"
        )


@dataclass
class Job:
    """What `init_job` set up for this process."""

    rank: int
    world_size: int
    backend: str
    control: ControlClient
    #: the library's process group over every rank (see the module docstring); `None` for a joiner
    #: until its admission
    group: Optional[dist.ProcessGroup]
    #: the supervisor process (on global rank 0 only)
    supervisor: Optional[Supervisor] = None
    sessions: int = field(default=0)
    #: the ranks in `group`, sorted (every rank until some left the job)
    members: tuple[int, ...] = ()
    #: the leader the control plane last named (`follow_leader`); `None`: the lowest member
    named_leader: Optional[int] = None
    pg_timeout: Optional[timedelta] = None
    #: attempts to rebuild `group` so far, the same number on every member (each one's store prefix)
    rebuilds: int = 0
    #: the job's store (no prefix): rebuilt groups meet on it, under `GROUPS_PREFIX`
    store: Optional[dist.Store] = None
    #: the device a rebuilt group is bound to (NCCL), else the default group's
    device_id: Optional[torch.device] = None
    #: a new process for a rank that left the job: outside it until `rejoin` admits it
    joining: bool = False
    #: this process rejoined a running fit (`rejoin`)
    rejoined: bool = False

    def __post_init__(self) -> None:
        if not self.members and not self.joining:
            self.members = tuple(range(self.world_size))

    @property
    def leader(self) -> int:
        """The rank that does global rank 0's duties (checkpoints, logging): the one the control plane
        names (`follow_leader`), while it is a member; else the lowest live rank."""
        named = self.named_leader
        return named if named is not None and named in self.members else self.members[0]

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
        if "nccl" in self.backend and old is not None:
            _abort(old)
        log.debug("rank %d: rebuilt the job's process group among ranks %s", self.rank, list(members))
        return group

    @property
    def supervisor_pid(self) -> int:
        return self.control.supervisor_pid

    def rejoin(self, config: SessionConfig, wait: float, timeout: float) -> Admission:
        """A new process for a rank that left the job: join the running fit's session, wait (at
        most `wait` s) for the members' next epoch's end, meet them at its admission, rebuild the
        process group with them (`regroup`, tagged with that meeting) and receive the fit's state
        from the donor (`lightning_prague.core.comm.transfer`); `timeout` bounds each operation.
        Raises `ControlPlaneError` with the reason if the fit cannot take it back."""
        self.sessions += 1
        session = self.control.open_session(self.sessions, config, rejoin=True)
        start = time.monotonic()
        try:
            admit = session.await_admission(wait)
            name = str(admit["sync"])
            release = session.meet(name, wait)
            joined = [int(r) for r in release.get("joined", [])]
            if self.rank not in joined:
                raise MemberLost(f"rank {self.rank}: the fit admitted ranks {joined} at {name!r}, not this one")
            donor = min(int(m) for m in release["members"] if int(m) not in joined)
            rebuilds = 0

            def agree(built: bool) -> tuple[Sequence[int], bool]:
                nonlocal rebuilds
                rebuilds += 1
                report = {} if built else {"incomplete": True}
                decided = session.meet(rebuild_meeting(name, rebuilds), wait, **report)
                return [int(r) for r in decided["members"]], bool(decided.get("complete", built))

            departed = lambda: session.departed  # noqa: E731
            self.regroup(release["members"], departed, agree, timeout=timeout, tag=f"s{session.number}/{name}")
            if donor not in self.members:
                raise MemberLost(f"rank {self.rank}: rank {donor}, which was to send the fit's state, left the job")
            comm = GroupComm(self.rank, self.world_size, timeout, self.group)
            comm.rebind(self.group, self.members)  # type: ignore[arg-type]
            admitted = time.monotonic()
            payload = receive_payload(comm, donor, "the fit's state")
        except BaseException:
            session.close(failed=True)
            raise
        self.joining, self.rejoined = False, True
        self.follow_leader(release)
        done = time.monotonic()
        log.warning(
            "rank %d: rejoined the job at %r after %.1fs; received the fit's state from rank %d (%.1f MB in %.2fs)",
            self.rank, name, admitted - start, donor, len(payload) / 1e6, done - admitted,
        )  # fmt: skip
        position = admit.get("position") if isinstance(admit.get("position"), dict) else None
        return Admission(session, donor, payload, admitted - start, done - admitted, release, position)

    def open_session(self, config: SessionConfig) -> Session:
        """A new session (one fit). Every rank opens its sessions in the same order, so they agree on
        the number without communicating."""
        self.sessions += 1
        return self.control.open_session(self.sessions, config)


@dataclass(frozen=True)
class Admission:
    """What a rank that rejoined got: its session, the donor and the fit's state (bytes) it sent,
    the seconds it waited for its admission and those the state took to arrive, the admission's
    release (the members' counters it takes up: `Exchanger.take_up`) and where its rank stood in its
    shard."""

    session: Session
    donor: int
    payload: bytes
    waited: float
    received: float
    release: dict[str, Any]
    #: where this rank stood in its own shard of the epoch when it was lost (lock-step shards:
    #: `epoch`, `batches`, `shard`, `of`), as the control plane last heard it; `None` if never reported
    position: Optional[dict[str, int]] = None


_JOB: Optional[Job] = None


def current_job() -> Optional[Job]:
    """This process's job, if `init_job` ran and its process group still exists."""
    if _JOB is not None and dist.is_initialized():
        return _JOB
    return None


def raw_store() -> dist.TCPStore:
    """The default process group's TCPStore client, without prefixes."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise CoordinationTimeout(f"the default process group's store is a {type(store).__name__}, not a TCPStore")
    return store


def init_job(
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    device_id: Optional[torch.device] = None,
    pg_timeout: Optional[timedelta] = None,
    control_port: Optional[int] = None,
    rejoin: Optional[bool] = None,
    launched: Optional[int] = None,
    log_dir: Optional[str] = None,
) -> Job:
    """Join the job (see the module docstring); returns this process's `Job` (the same one when called again).

    `rejoin` (default: `rejoining()`, from the environment): this process replaces a rank that left
    the running job. It starts no supervisor and meets nobody at a rendezvous: it reaches the store
    and the control plane the job already has, and its `Job` is outside the job (`joining`) until
    `Job.rejoin` admits it into the running fit. Its default process group is a local stand-in
    (torch's `fake` backend, one process) that nothing of the library or of Lightning runs on.

    `launched`: the ranks `0..launched-1` that start the job (torch's world; default: `world_size`).
    The job can grow to `world_size` workers: a process with a rank from `launched` on joins the
    running fit as a rejoining one does, in a free place (`max_workers`).

    `log_dir`: where global rank 0's supervisor writes its log, kept after the job (unset:
    `LIGHTNING_PRAGUE_LOG_DIR`, else a temporary file deleted at its clean exit).

    `control_port`: where global rank 0's supervisor serves the control plane (unset:
    `LIGHTNING_PRAGUE_CONTROL_PORT`, else a free port; see `supervisor.resolve_control_port`).
    """
    global _JOB
    job = current_job()
    if job is not None:
        return job
    check_torch_internals()  # before anything uses them
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as err:
        raise CoordinationTimeout(
            f"rank {rank}: environment variable {err.args[0]} is not set; launch with torchrun or Lightning, or set "
            "MASTER_ADDR and MASTER_PORT"
        ) from None
    proc: Optional[Supervisor] = None
    pg_timeout = pg_timeout or timedelta(seconds=timeout)
    starting = world_size if launched is None else launched
    if not 1 <= starting <= world_size:
        raise ConfigurationError(f"rank {rank}: {starting} ranks cannot start a job of at most {world_size}")
    if rank >= starting and not (rejoin if rejoin is not None else rejoining()):
        raise ConfigurationError(
            f"rank {rank} is past the {starting} ranks that start the job: a worker that joins a running job needs "
            f"{REJOIN_VARIABLE}=1"
        )
    secret, launch_id = user_secret(), known_launch_id()
    if rejoin if rejoin is not None else rejoining():
        _init_local_world(rank, world_size)  # first: a torch without the stand-in fails before anything connects
        store = _joiner_store(rank, host, port, world_size, min(pg_timeout, timedelta(seconds=timeout)))
        control = _connect(store, rank, timeout, None, secret, launch_id)
        _JOB = Job(
            rank, world_size, backend, control, None, pg_timeout=pg_timeout, store=store, device_id=device_id,
            joining=True,
        )  # fmt: skip
        atexit.register(control.close)
        log.warning("rank %d: a new process for this rank; it rejoins the running job", rank)
        return _JOB
    start = dict(
        log_dir=log_dir,
        secret=secret or generated_secret().encode(),
        launch_id=launch_id or new_launch_id(),
        publish_secret=secret is None,
        # ranks connect only once the process group exists: wait for them as long as its rendezvous may take
        wait=pg_timeout.total_seconds() + timeout,
    )
    if not dist.is_initialized():
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        if rank == 0:
            proc = launch(host, port, starting, timeout, not agent_store, control_port, **start)
            log.info("rank 0: the supervisor (pid %d) logs to %s", proc.pid, proc.log_file)
            if not agent_store:
                wait_until_listening(proc, host, port, timeout)
        store = dist.TCPStore(host, port, starting, is_master=False, timeout=pg_timeout, wait_for_workers=False)
        rendezvous: dist.Store = store
        if agent_store:  # as torch's env:// rendezvous does: each restart attempt has keys of its own
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            rendezvous = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
        kwargs = {"device_id": device_id} if device_id is not None else {}
        dist.init_process_group(backend, store=rendezvous, rank=rank, world_size=starting, timeout=pg_timeout, **kwargs)
        if "nccl" in backend:  # as Lightning does: torch warns about an NCCL process group left at exit
            atexit.register(_destroy_process_group)
    else:
        store = raw_store()
        if rank == 0:
            proc = launch(store.host, store.port, starting, timeout, False, control_port, **start)
    control = _connect(raw_store(), rank, timeout, proc, secret, launch_id if proc is None else start["launch_id"])
    group = dist.new_group(list(range(starting)), backend=backend, timeout=pg_timeout)
    _JOB = Job(
        rank, world_size, backend, control, group, proc, pg_timeout=pg_timeout, store=raw_store(), device_id=device_id,
        members=tuple(range(starting)),
    )  # fmt: skip
    atexit.register(control.close)
    log.debug("rank %d: joined the job (%d ranks, supervisor pid %d)", rank, world_size, control.supervisor_pid)
    return _JOB


#: environment variable: how many times this rank's process was started again (set by the strategies'
#: launcher with `max_restarts`; 0 or unset: the first start)
RESTARTS_VARIABLE = "LIGHTNING_PRAGUE_RESTART_COUNT"
#: environment variable: `1` makes a process rejoin the running job as the rank its environment names
#: (a restart by a launcher other than the strategies': a SLURM requeue of one task, a pod's restart)
REJOIN_VARIABLE = "LIGHTNING_PRAGUE_REJOIN"


def rejoining() -> bool:
    """Whether this process replaces a rank of a running job (`RESTARTS_VARIABLE` above 0, or
    `REJOIN_VARIABLE` set to 1)."""
    try:
        restarts = int(os.environ.get(RESTARTS_VARIABLE, "0") or 0)
    except ValueError:
        raise ConfigurationError(f"{RESTARTS_VARIABLE}={os.environ[RESTARTS_VARIABLE]!r} is not a number") from None
    flag = os.environ.get(REJOIN_VARIABLE, "").strip()
    if flag not in ("", "0", "1"):
        raise ConfigurationError(f"{REJOIN_VARIABLE}={flag!r}: set it to 1 (rejoin the running job) or 0")
    return restarts > 0 or flag == "1"


def _joiner_store(rank: int, host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The running job's store, for a process that joins it; a `ControlPlaneError` that says so if
    nothing answers at `host:port` within `timeout` (the job ended, or the address is not its)."""
    try:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        raise ControlPlaneError(
            f"rank {rank} cannot join the running job: no job's store answered at {host}:{port} within "
            f"{timeout.total_seconds():.0f}s (the job ended, or MASTER_ADDR / MASTER_PORT are not the job's): {err}"
        ) from None


def _init_local_world(rank: int, world_size: int) -> None:
    """A rejoining process's default process group: a local stand-in of the world (torch's `fake`
    backend: this process alone, with its rank), so that `torch.distributed` is initialised and
    knows this process's global rank; every exchange runs on the library's group (`Job.group`)."""
    try:
        import torch.testing._internal.distributed.fake_pg as _fake_pg  # noqa: F401  (registers the `fake` backend)
    except ImportError as err:
        raise ConfigurationError(
            f"rank {rank}: rejoining a running job needs torch's `fake` process group backend, which the installed "
            f"torch=={torch.__version__} lacks ({err}); this release needs torch{SUPPORTED_TORCH}"
        ) from None
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)


def _default_store() -> dist.Store:
    """The store `new_group` would build a group's rendezvous on (the default group's, with its prefix)."""
    c10d = dist.distributed_c10d
    return c10d._world.pg_map[c10d._get_default_group()][1]


def _new_group(
    members: tuple[int, ...],
    backend: str,
    store: dist.Store,
    name: str,
    timeout: timedelta,
    what: str,
    device_id: Optional[torch.device] = None,
) -> dist.ProcessGroup:
    """`dist.new_group(members, use_local_synchronization=True)` under the group name (its store prefix)
    `name` and on `store`: torch names a group by its ranks and the number of groups this process
    made, which two members need not agree on, and a failed attempt would reuse it."""
    c10d = dist.distributed_c10d
    default = c10d._get_default_group()
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
    c10d._world.pg_group_ranks[group] = {rank: index for index, rank in enumerate(members)}
    return group


class RendezvousStore(dist.Store):
    """The store a rebuilt group's rendezvous runs on: the default store, with waits that poll, so
    that they give up when a member departs (`departed`), when the rebuild is abandoned or when its
    `deadline` passes, each time with an error that names the operation and the ranks missing."""

    def __init__(
        self,
        base: dist.Store,
        rank: int,
        members: tuple[int, ...],
        what: str,
        departed: Callable[[], Collection[int]],
        deadline: float,
        bound: float,
    ) -> None:
        super().__init__()
        self.base = base
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
        while not self.base.check(keys):
            others = [m for m in self.members if m != self.rank]
            gone = sorted(r for r in others if r in self.departed())
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


def _destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _connect(
    store: dist.TCPStore,
    rank: int,
    timeout: float,
    proc: Optional[Supervisor],
    secret: Optional[bytes],
    launch_id: Optional[str],
) -> ControlClient:
    """Connect to the control plane whose address the supervisor published in the store.

    What the store holds is checked as untrusted input (`ADDRESS_RECORD`). Rank 0 checks that the
    address is its own supervisor's, every rank that the launch is its own (when it knows its own):
    a job never attaches to an earlier launch's supervisor that still holds a fixed port.
    """
    key = address_key()
    try:
        store.wait([key], timedelta(seconds=timeout))
    except (RuntimeError, dist.DistStoreError) as err:
        status = "" if proc is None or proc.poll() is None else f"; the supervisor exited with status {proc.returncode}"
        raise CoordinationTimeout(
            f"rank {rank}: the supervisor did not publish the control plane's address within {timeout:.0f}s "
            f"({err}{status})"
        ) from None
    try:
        record = ADDRESS_RECORD.check(json.loads(store.get(key)))
    except (ValueError, BadRecord) as err:
        raise CoordinationTimeout(
            f"rank {rank}: the store's {key!r} is not a control plane's address ({err})"
        ) from None
    where = f"the control plane at {record['host']}:{record['port']} (supervisor pid {record['pid']})"
    if proc is not None and record["pid"] != proc.pid:
        raise CoordinationTimeout(
            f"rank 0: the store names {where}, not the supervisor this rank started (pid {proc.pid}): another process "
            "(a supervisor of an earlier launch or another job) holds MASTER_PORT; choose another MASTER_PORT or end it"
        )
    if launch_id is not None and record["launch"] != launch_id:
        raise CoordinationTimeout(
            f"rank {rank}: the store names {where} of launch {record['launch']!r}, but this rank belongs to launch "
            f"{launch_id!r}: the store at MASTER_ADDR:MASTER_PORT is an earlier launch's or another job's"
        )
    if secret is None:
        if "secret" not in record:
            raise ConfigurationError(
                f"rank {rank}: the job's secret is set on rank 0 but not on this rank: set {SECRET_VARIABLE} (or "
                f"{SECRET_FILE_VARIABLE}) to the same secret on every rank"
            )
        secret = record["secret"].encode()
    credentials = Credentials.derive(secret, record["launch"])
    client = ControlClient(record["host"], record["port"], rank, timeout, credentials)
    client.supervisor_pid = record["pid"]
    return client
