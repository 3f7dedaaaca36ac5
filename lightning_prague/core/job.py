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

When the membership changes (ranks leave, a lost rank's new process is admitted), the members
rebuild that group among themselves: `lightning_prague.core.membership`, where the rebuild, the
membership epochs and a joiner's admission live.

If the default process group exists already (initialised by the user), steps 1 and 3-4 still run,
with the supervisor as a client of that group's store.

**Private parts of torch.distributed** are checked first (`lightning_prague.core.torch_internals`).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from lightning_prague.core.auth import (
    LAUNCH_VARIABLE,
    SECRET_FILE_VARIABLE,
    SECRET_VARIABLE,
    Credentials,
    generated_secret,
    known_launch_id,
    new_launch_id,
    user_secret,
)
from lightning_prague.core.client.control import ControlClient, Session
from lightning_prague.core.client.partition import established_connections
from lightning_prague.core.discovery import find_running_fit, publish_running
from lightning_prague.core.errors import ConfigurationError, ControlPlaneError, CoordinationTimeout, FitEnded
from lightning_prague.core.membership import (  # noqa: F401  (re-exported: where they used to live)
    GROUPS_PREFIX,
    Admission,
    Agreement,
    Membership,
    RendezvousStore,
    _abort,
    _default_store,
    _drop,
    _new_group,
)
from lightning_prague.core.plane.launch import Supervisor, adopt, launch, wait_until_listening
from lightning_prague.core.protocol import ADDRESS_RECORD, SERVICE_ADDRESS_KEY, SessionConfig, address_key
from lightning_prague.core.records import BadRecord, environment_number
from lightning_prague.core.torch_internals import (  # noqa: F401  (re-exported)
    SUPPORTED_TORCH,
    TORCH_INTERNALS,
    TorchInternal,
    check_torch_internals,
    missing_torch_internal,
)

log = logging.getLogger(__name__)

#: environment variable: seconds a rank waits for its control plane to come back after its connection
#: closed (a supervisor or plane service started again); 0: the plane is lost at once (`ControlPlaneLost`)
PLANE_WAIT_VARIABLE = "LIGHTNING_PRAGUE_PLANE_WAIT"
#: its default
PLANE_WAIT_SECONDS = 60.0
#: times global rank 0 starts a supervisor that died again, per job
MAX_SUPERVISOR_RESTARTS = 5
#: seconds a rank whose control link resumed waits for the plane's record in its new store
RECORD_SECONDS = 5.0


def plane_wait() -> float:
    """`PLANE_WAIT_VARIABLE`'s seconds, else `PLANE_WAIT_SECONDS`; `ConfigurationError` if not a number >= 0."""
    must_be = "the seconds (0 to 86400) a rank waits for its control plane to come back"
    seconds = environment_number(PLANE_WAIT_VARIABLE, float, 0, 86400, must_be)
    return PLANE_WAIT_SECONDS if seconds is None else seconds


@dataclass
class Job(Membership):
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
    #: the established TCP connections (socket inodes) of `group` on this process (`drop_group_connections`)
    connections: set[int] = field(default_factory=set)
    _connected_before: set[int] = field(default_factory=set, repr=False)
    #: this process's connections outside the library's groups (`drop_group_connections` keeps them);
    #: default: those it has when the job is made
    outside_groups: Optional[set[int]] = None
    #: membership epoch -> (its process group, its members) (`Membership.epoch_group`)
    epoch_groups: dict[int, tuple[dist.ProcessGroup, tuple[int, ...]]] = field(default_factory=dict, repr=False)
    _epoch_stores: dict[int, dist.Store] = field(default_factory=dict, repr=False)
    _epoch_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not self.members and not self.joining:
            self.members = tuple(range(self.world_size))
        if self.outside_groups is None:
            self.outside_groups = set(established_connections())
        self.control.on_left_out = self.drop_group_connections
        link = self.control.link
        link.on_reconnect_attempt = self._restart_supervisor
        link.on_resumed = self._after_plane_restart

    def _restart_supervisor(self) -> None:
        """Before each attempt of the control link to reconnect: global rank 0 starts its supervisor again
        if it died (it takes the job back from its journal: `lightning_prague.core.plane.journal`)."""
        supervisor = self.supervisor
        if supervisor is None or supervisor.restarts >= MAX_SUPERVISOR_RESTARTS or not supervisor.dead():
            return
        log.warning(
            "rank %d: the supervisor (pid %d) exited with status %s mid-fit: starting it again",
            self.rank, supervisor.pid, "unknown" if supervisor.returncode is None else supervisor.returncode,
        )  # fmt: skip
        supervisor.restart(self.control.port)
        self.control.supervisor_pid = supervisor.pid

    def _after_plane_restart(self) -> None:
        """The control link resumed with a control plane started again: if the job's store died with it
        (the supervisor or the plane service hosts it), this rank's client of it is replaced by one of
        the new store at the same address, and the job's running mark is set there again."""
        store = self.store
        if not isinstance(store, dist.TCPStore) or not self.control.store_in_plane:
            return  # (the launcher's store lives on)
        timeout = self.pg_timeout or timedelta(seconds=self.control.timeout)
        self.store = dist.TCPStore(store.host, store.port, is_master=False, timeout=timeout, wait_for_workers=False)
        log.warning(
            "rank %d: the job's store at %s:%d started again with the control plane", self.rank, store.host, store.port
        )
        if not self.joining:
            publish_running(self.store, self.control.launch, self.rank)
        try:  # the process that serves the plane now (a plane service's new pid)
            self.store.wait([self.control.record_key], timedelta(seconds=RECORD_SECONDS))
            record = ADDRESS_RECORD.check(json.loads(self.store.get(self.control.record_key)))
            if record["launch"] == self.control.launch:
                self.control.supervisor_pid = record["pid"]
        except (RuntimeError, ValueError, BadRecord, dist.DistError) as err:
            log.debug("rank %d: no control plane's record in the new store: %s", self.rank, err)

    @property
    def supervisor_pid(self) -> int:
        return self.control.supervisor_pid

    def open_session(self, config: SessionConfig) -> Session:
        """A new session (one fit). Every rank opens its sessions in the same order, so they agree on
        the number without communicating."""
        self.sessions += 1
        return self.control.open_session(self.sessions, config)


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
    plane: Optional[tuple[str, int]] = None,
    plane_wait: Optional[float] = None,
) -> Job:
    """Join the job (see the module docstring); returns this process's `Job` (the same one when called again).

    `rejoin` (default: `rejoining()` after `look_for_running_fit`: told so by the environment, or a
    running fit of this process's own job found in the store): this process replaces a rank that left
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

    `plane`: `(host, port)` of a plane service (`lightning_prague.core.plane.service`) that hosts the
    job's store and control plane: no rank starts a supervisor, every rank is their client (the
    process group meets in that store, not at MASTER_ADDR:MASTER_PORT), and the job's secret must be
    set on every rank (the service never hands one out).

    `plane_wait`: seconds this rank waits for its control plane to come back after its connection
    closed (one started again takes the job back; 0: lost at once). Unset: `plane_wait()`.
    """
    global _JOB
    job = current_job()
    if job is not None:
        return job
    check_torch_internals()  # before anything uses them
    try:
        host, port = plane if plane is not None else (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
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
    if rejoin is None and not dist.is_initialized():
        look_for_running_fit(rank, host, port)
    joins = rejoin if rejoin is not None else rejoining()
    if rank >= starting and not joins:
        raise ConfigurationError(
            f"rank {rank} is past the {starting} ranks that start the job and found no running fit of its job at "
            f"{host}:{port} to join: a worker that joins a running job needs its job's id (SLURM's, torchrun's or "
            f"{LAUNCH_VARIABLE}) or {REJOIN_VARIABLE}=1"
        )
    secret, launch_id = user_secret(), known_launch_id()
    if plane is not None and secret is None:
        raise ConfigurationError(
            f"rank {rank}: the plane service at {host}:{port} needs the job's secret on every rank: set "
            f"{SECRET_VARIABLE} or {SECRET_FILE_VARIABLE} to the secret it was started with"
        )
    # a plane service publishes its own launch's record under a key of its own: the user named it
    key, checked_launch = (SERVICE_ADDRESS_KEY, None) if plane is not None else (address_key(), launch_id)
    if joins:
        _init_local_world(rank, world_size)  # first: a torch without the stand-in fails before anything connects
        store = _joiner_store(rank, host, port, world_size, min(pg_timeout, timedelta(seconds=timeout)))
        control, job_secret = _connect(
            store, rank, timeout, None, secret, checked_launch, joining=True, key=key, wait=plane_wait
        )
        if rank == 0 and plane is None:  # it starts the supervisor again, as the first process of rank 0 did
            proc = adopt(
                control.supervisor_pid, host, port, starting, timeout, control.store_in_plane, secret=job_secret,
                launch_id=control.launch, wait=pg_timeout.total_seconds() + timeout, publish_secret=secret is None,
                log_dir=log_dir,
            )  # fmt: skip
        _JOB = Job(
            rank, world_size, backend, control, None, proc, pg_timeout=pg_timeout, store=store, device_id=device_id,
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
    if plane is not None:  # the service's store: the process group meets there, whatever the launcher's
        try:  # (the client retries until the service listens, within the rendezvous' bound)
            store = dist.TCPStore(host, port, starting, is_master=False, timeout=pg_timeout, wait_for_workers=False)
        except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
            raise ControlPlaneError(
                f"rank {rank}: no plane service answered at {host}:{port} within {pg_timeout.total_seconds():.0f}s "
                f"(start it first: lightning-prague plane): {err}"
            ) from None
        if not dist.is_initialized():
            kwargs = {"device_id": device_id} if device_id is not None else {}
            dist.init_process_group(backend, store=store, rank=rank, world_size=starting, timeout=pg_timeout, **kwargs)
            if "nccl" in backend:
                atexit.register(_destroy_process_group)
    elif not dist.is_initialized():
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
    launch_id = launch_id if proc is None else str(start["launch_id"])
    if plane is None:
        store, checked_launch = raw_store(), launch_id
    control, _ = _connect(store, rank, timeout, proc, secret, checked_launch, key=key, wait=plane_wait)
    connected = set(established_connections())
    group = dist.new_group(list(range(starting)), backend=backend, timeout=pg_timeout)
    if launch_id is not None:  # every rank that starts the job has met: a later process of it rejoins the fit
        publish_running(store, launch_id, rank)
    _JOB = Job(
        rank, world_size, backend, control, group, proc, pg_timeout=pg_timeout, store=store, device_id=device_id,
        members=tuple(range(starting)), connections=set(established_connections()) - connected,
        outside_groups=set(connected),
    )  # fmt: skip
    atexit.register(control.close)
    log.debug("rank %d: joined the job (%d ranks, supervisor pid %d)", rank, world_size, control.supervisor_pid)
    return _JOB


#: environment variable: how many times this rank's process was started again (set by the strategies'
#: launcher with `max_restarts`; 0 or unset: the first start)
RESTARTS_VARIABLE = "LIGHTNING_PRAGUE_RESTART_COUNT"
#: environment variable: the exit status of a restarted rank's previous process (set by its keeper or
#: agent; `-N`: killed by signal N): a restart whose predecessor's fit failed, and which then finds
#: nothing of the job, was not left behind by a fit that ended but by one that failed
PREVIOUS_EXIT_VARIABLE = "LIGHTNING_PRAGUE_PREVIOUS_EXIT_STATUS"
#: environment variable: `1` makes a process rejoin the running job as the rank its environment names,
#: `0` makes it start with the job's ranks without looking for a running fit; unset: it looks
#: (`look_for_running_fit`)
REJOIN_VARIABLE = "LIGHTNING_PRAGUE_REJOIN"

#: the pid of the process that found its job's running fit (`look_for_running_fit`); 0: none. A pid,
#: not a flag: a process forked from it (a test's ranks, a keeper's training process) found nothing
_found_running_fit = 0


def _rejoin_flag() -> str:
    """`REJOIN_VARIABLE`'s value: "" (unset), "0" or "1"; a `ConfigurationError` for anything else."""
    flag = os.environ.get(REJOIN_VARIABLE, "").strip()
    if flag not in ("", "0", "1"):
        raise ConfigurationError(f"{REJOIN_VARIABLE}={flag!r}: set it to 1 (rejoin the running job) or 0")
    return flag


def previous_exit() -> Optional[int]:
    """The exit status of this rank's previous process, as its keeper or agent passed it to this
    restarted one (`PREVIOUS_EXIT_VARIABLE`), or `None` (a first start, or unknown)."""
    value = os.environ.get(PREVIOUS_EXIT_VARIABLE, "").strip()
    try:
        return int(value) if value else None
    except ValueError:
        return None


def restarts() -> int:
    """How many times this rank's process was started again before this one (`RESTARTS_VARIABLE`)."""
    try:
        return int(os.environ.get(RESTARTS_VARIABLE, "0") or 0)
    except ValueError:
        raise ConfigurationError(f"{RESTARTS_VARIABLE}={os.environ[RESTARTS_VARIABLE]!r} is not a number") from None


def rejoining() -> bool:
    """Whether this process replaces a rank of a running job: `RESTARTS_VARIABLE` above 0,
    `REJOIN_VARIABLE` set to 1, or a running fit of its own job found (`look_for_running_fit`)."""
    flag = _rejoin_flag()
    return _found_running_fit == os.getpid() or restarts() > 0 or flag == "1"


def look_for_running_fit(rank: int, host: str, port: int) -> bool:
    """Whether this process rejoins a running fit: `rejoining()`, or, unless `REJOIN_VARIABLE` is 0, a
    running fit of this process's own job found in the store at `host:port`
    (`lightning_prague.core.discovery`); found once, `rejoining()` says so from then on.

    Only a process that knows its job's id (`known_launch_id`: SLURM's, torchrun's, or
    `LAUNCH_VARIABLE`) looks: a process of a new job never attaches to an old one, and one started by
    hand with no id rejoins only when told to (`REJOIN_VARIABLE=1`).
    """
    global _found_running_fit
    if rejoining():
        return True
    launch = known_launch_id()
    if _rejoin_flag() == "0" or launch is None:
        return False
    if find_running_fit(rank, host, port, launch):
        _found_running_fit = os.getpid()
        log.warning(
            "rank %d: a fit of this process's job (%r) runs at %s:%d: this process rejoins it", rank, launch, host, port
        )
    return _found_running_fit == os.getpid()


#: seconds a joining process lets the job's store refuse its connections before it concludes that
#: nothing serves the job any more: a live store accepts at once, even when its process is busy
STORE_GONE_SECONDS = 5.0


def _joiner_store(rank: int, host: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The running job's store, for a process that joins it. `FitEnded` if `host:port` refuses
    connections for `STORE_GONE_SECONDS` (its supervisor exited: the others finished the fit, or the
    address is not the job's); a `ControlPlaneError` that says so if it does not answer within `timeout`."""
    _wait_for_listener(rank, host, port, timeout.total_seconds())
    try:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, TimeoutError) as err:  # torch's DistStoreError / DistNetworkError are RuntimeErrors
        raise ControlPlaneError(
            f"rank {rank} cannot join the running job: no job's store answered at {host}:{port} within "
            f"{timeout.total_seconds():.0f}s (the job ended, or MASTER_ADDR / MASTER_PORT are not the job's): {err}"
        ) from None


def _wait_for_listener(rank: int, host: str, port: int, timeout: float, what: str = "the job's store") -> None:
    """Return once something accepts a connection at `host:port` (`what`); `FitEnded` once it refused
    every attempt for `STORE_GONE_SECONDS`. Other failures (a timeout, an unreachable network: a
    partition, not proof that the job is gone) are left to the connection itself, which waits `timeout`."""
    start = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, timeout)):
                return
        except ConnectionRefusedError:
            waited = time.monotonic() - start
            if waited >= min(STORE_GONE_SECONDS, timeout):
                log.debug("rank %d: %s:%d refused connections for %.1fs", rank, host, port, waited)
                raise FitEnded(
                    f"rank {rank} found no running fit to rejoin: nothing listens at {what} at {host}:{port} "
                    f"(refused for {waited:.0f}s): the job's supervisor exited, because the others finished the fit "
                    "or its node is gone, or MASTER_ADDR / MASTER_PORT are not the job's",
                    nothing_listens=True,
                ) from None
            time.sleep(0.2)
        except OSError:
            return  # not a refusal: the store's connection waits, and fails by its own timeout


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
    joining: bool = False,
    key: Optional[str] = None,
    wait: Optional[float] = None,
) -> tuple[ControlClient, bytes]:
    """Connect to the control plane whose address the supervisor published in the store; returns the
    client and the job's secret (`secret`, else the one the supervisor published).

    What the store holds is checked as untrusted input (`ADDRESS_RECORD`). Rank 0 checks that the
    address is its own supervisor's, every rank that the launch is its own (when it knows its own):
    a job never attaches to an earlier launch's supervisor that still holds a fixed port. A process
    `joining` a running fit whose control plane refuses it for `STORE_GONE_SECONDS` finds the fit
    ended (`FitEnded`): under torchrun the job's store is the agent's, which outlives the fit and its
    running mark, while the control plane ends with the fit.
    """
    key = key or address_key()
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
    if joining:
        _wait_for_listener(rank, record["host"], record["port"], timeout, "the job's control plane")
    client = ControlClient(
        record["host"],
        record["port"],
        rank,
        timeout,
        credentials,
        reconnect_within=plane_wait() if wait is None else wait,
    )
    client.supervisor_pid = record["pid"]
    client.store_in_plane = bool(record.get("store"))
    client.record_key = key
    return client, secret
