"""Whether a running fit of this process's own job waits at `MASTER_ADDR:MASTER_PORT`.

A lost rank's new process (a new `srun` step of the same job, a container restarted in its pod, a
process the rank's keeper started again) cannot meet the others at the job's rendezvous: they met
there long ago and train. It must join the running fit instead (`lightning_prague.core.job`), and
it can tell that by itself, with no `LIGHTNING_PRAGUE_REJOIN=1`:

- once the ranks that start the job have met at its rendezvous, each of them writes the job's
  *running mark* into the job's store (`publish_running`): a JSON record of the job's id
  (`lightning_prague.core.auth.known_launch_id`) under a key derived from that id;
- a process that starts (`find_running_fit`) looks for the mark of its own job's id in the store at
  `MASTER_ADDR:MASTER_PORT`. Found: it rejoins. Not found (no store listens there yet, or the job's
  ranks have not all met): it is one of the ranks that start the job, and goes to the rendezvous.

A process of another job never finds the mark: a requeued SLURM job (a higher `SLURM_RESTART_COUNT`),
a torchrun restart, or a new allocation whose store happens to listen on the same port has another
id, so another key. Whatever the store holds is untrusted (anyone who reaches the port may write
into it): the mark is read with a bound on its size and checked as a record (`RUNNING_RECORD`)
whose id must be this process's own; anything else counts as no mark. A wrong mark can at worst make
a process ask to rejoin, and the control plane still admits only a rank with a free place in its
fit, after the handshake that proves the job's key (`lightning_prague.core.auth`).

Every step is bounded: the connection attempt (`CONNECT_SECONDS`) and the store's answer
(`timeout`), so a process never waits here on a store that does not answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_prague.core.auth import MAX_LAUNCH_CHARS
from lightning_prague.core.records import BadRecord, Record, number, text

log = logging.getLogger(__name__)

#: the store key under which a job's running mark lives (one per job id: `running_key`)
RUNNING_KEY = "lightning_prague/running"
#: the running mark: the job's id and when the rank that wrote it met the others (seconds since the epoch)
RUNNING_RECORD = Record("a job's running mark in the store", {"launch": text(MAX_LAUNCH_CHARS), "since": number()})
#: the largest running mark read from the store, bytes
MAX_MARK_BYTES = 1024
#: seconds to wait for a connection to `MASTER_ADDR:MASTER_PORT` (nothing listens: no fit runs there)
CONNECT_SECONDS = 2.0
#: seconds to wait for the store's answers
STORE_SECONDS = 10.0


def running_key(launch: str) -> str:
    """The store key of job `launch`'s running mark (a digest: any id gives a short, plain key)."""
    return f"{RUNNING_KEY}/{hashlib.sha256(launch.encode()).hexdigest()[:32]}"


def publish_running(store: dist.Store, launch: str, rank: int) -> None:
    """Mark job `launch` as running in `store`: called by each rank once the ranks that start the job
    have all met (a later process of the job can no longer meet them: `find_running_fit`). Best
    effort: a store that fails here fails the rank's next operation with its own error."""
    try:
        store.set(running_key(launch), json.dumps({"launch": launch, "since": time.time()}))
    except (RuntimeError, dist.DistError) as err:
        log.warning("rank %d: could not mark job %r as running in the store: %s", rank, launch, err)


def read_mark(raw: bytes, launch: str) -> bool:
    """Whether `raw` (a value read from the store) is job `launch`'s running mark; `False` for
    anything else (too long, not JSON, not the record, another job's id)."""
    if len(raw) > MAX_MARK_BYTES:
        return False
    try:
        mark = RUNNING_RECORD.check(json.loads(raw))
    except (ValueError, UnicodeDecodeError, BadRecord):
        return False
    return mark["launch"] == launch


def something_listens(host: str, port: int, timeout: float = CONNECT_SECONDS) -> bool:
    """Whether a TCP connection to `host:port` opens within `timeout` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def find_running_fit(rank: int, host: str, port: int, launch: str, timeout: float = STORE_SECONDS) -> bool:
    """Whether the store at `host:port` holds job `launch`'s running mark (see the module docstring).

    `False` when nothing listens there, when what listens is no store or does not answer within
    `timeout` seconds, or when the mark is absent or not this job's: this process then starts with
    the job's other ranks. Never raises for what it finds; each way it decided is logged.
    """
    if not something_listens(host, port):
        log.debug("rank %d: no store listens at %s:%d: no fit of job %r runs yet", rank, host, port, launch)
        return False
    try:
        store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )  # fmt: skip
        key = running_key(launch)
        if not store.check([key]):
            log.debug("rank %d: the store at %s:%d holds no running fit of job %r", rank, host, port, launch)
            return False
        raw = store.get(key)
    except (RuntimeError, dist.DistError) as err:  # not a store, or it did not answer in time
        log.warning(
            "rank %d: looking for a running fit of job %r at %s:%d failed (%s): starting with the job's ranks",
            rank, launch, host, port, err,
        )  # fmt: skip
        return False
    if not read_mark(raw, launch):
        log.warning(
            "rank %d: the store at %s:%d holds a malformed running mark for job %r; ignored", rank, host, port, launch
        )
        return False
    return True
