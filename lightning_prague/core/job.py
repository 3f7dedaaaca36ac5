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

If the default process group exists already (initialised by the user), steps 1 and 3-4 still run,
with the supervisor as a client of that group's store.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

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
from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout
from lightning_prague.core.plane.launch import Supervisor, launch, wait_until_listening
from lightning_prague.core.protocol import ADDRESS_RECORD, SessionConfig, address_key
from lightning_prague.core.records import BadRecord

log = logging.getLogger(__name__)


@dataclass
class Job:
    """What `init_job` set up for this process."""

    rank: int
    world_size: int
    backend: str
    control: ControlClient
    #: the library's process group over every rank (see the module docstring)
    group: dist.ProcessGroup
    #: the supervisor process (on global rank 0 only)
    supervisor: Optional[Supervisor] = None
    sessions: int = field(default=0)
    #: the ranks in `group`, sorted (every rank until some left the job)
    members: tuple[int, ...] = ()
    pg_timeout: Optional[timedelta] = None

    def __post_init__(self) -> None:
        if not self.members:
            self.members = tuple(range(self.world_size))

    @property
    def leader(self) -> int:
        """The lowest live rank: it takes over global rank 0's duties (checkpoints, logging)."""
        return self.members[0]

    def regroup(self, members: list[int]) -> dist.ProcessGroup:
        """The library's process group among `members` (survivors), built by them alone; every
        member must call this at the same point (see the module docstring)."""
        members_ = tuple(sorted(members))
        if members_ == self.members:
            return self.group
        old = self.group
        self.group = dist.new_group(
            list(members_), backend=self.backend, timeout=self.pg_timeout, use_local_synchronization=True
        )
        self.members = members_
        if "nccl" in self.backend:
            _abort(old)
        log.debug("rank %d: rebuilt the job's process group among ranks %s", self.rank, list(members_))
        return self.group

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
) -> Job:
    """Join the job (see the module docstring); returns this process's `Job` (the same one when called again).

    `control_port`: where global rank 0's supervisor serves the control plane (unset:
    `LIGHTNING_PRAGUE_CONTROL_PORT`, else a free port; see `supervisor.resolve_control_port`).
    """
    global _JOB
    job = current_job()
    if job is not None:
        return job
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except KeyError as err:
        raise CoordinationTimeout(
            f"rank {rank}: environment variable {err.args[0]} is not set; launch with torchrun or Lightning, or set "
            "MASTER_ADDR and MASTER_PORT"
        ) from None
    proc: Optional[Supervisor] = None
    pg_timeout = pg_timeout or timedelta(seconds=timeout)
    secret, launch_id = user_secret(), known_launch_id()
    start = dict(
        secret=secret or generated_secret().encode(),
        launch_id=launch_id or new_launch_id(),
        publish_secret=secret is None,
        # ranks connect only once the process group exists: wait for them as long as its rendezvous may take
        wait=pg_timeout.total_seconds() + timeout,
    )
    if not dist.is_initialized():
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
        if rank == 0:
            proc = launch(host, port, world_size, timeout, not agent_store, control_port, **start)
            log.info("rank 0: the supervisor (pid %d) logs to %s", proc.pid, proc.log_file)
            if not agent_store:
                wait_until_listening(proc, host, port, timeout)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=pg_timeout, wait_for_workers=False)
        rendezvous: dist.Store = store
        if agent_store:  # as torch's env:// rendezvous does: each restart attempt has keys of its own
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            rendezvous = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
        kwargs = {"device_id": device_id} if device_id is not None else {}
        dist.init_process_group(
            backend, store=rendezvous, rank=rank, world_size=world_size, timeout=pg_timeout, **kwargs
        )
        if "nccl" in backend:  # as Lightning does: torch warns about an NCCL process group left at exit
            atexit.register(_destroy_process_group)
    else:
        store = raw_store()
        if rank == 0:
            proc = launch(store.host, store.port, world_size, timeout, False, control_port, **start)
    control = _connect(raw_store(), rank, timeout, proc, secret, launch_id if proc is None else start["launch_id"])
    group = dist.new_group(list(range(world_size)), backend=backend, timeout=pg_timeout)
    _JOB = Job(rank, world_size, backend, control, group, proc, pg_timeout=pg_timeout)
    atexit.register(control.close)
    log.debug("rank %d: joined the job (%d ranks, supervisor pid %d)", rank, world_size, control.supervisor_pid)
    return _JOB


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
