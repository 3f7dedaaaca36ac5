"""One rank of a core-only run in which members die while the survivors rebuild their process group.

Usage: regroup_worker.py RANK WORLD PORT OUT_JSON DEATHS_JSON

DEATHS_JSON maps a rank to when it SIGKILLs itself: ``"start"`` (before the first synchronization
point, so that its release leaves it out and the survivors rebuild their group), or ``[ATTEMPT,
"before-key" | "after-key"]`` (inside attempt ATTEMPT of that rebuild, before it publishes its
address in the store, or a moment after: while the others connect to it). Every survivor meets at
one synchronization point, then averages globally, and writes what it ended with.
"""

import json
import os
import signal
import sys
import time

import torch

from lightning_prague.core import BucketedTensors, GroupWorker, SessionConfig, init_job, make_policy
from lightning_prague.core import job as job_module


def die_in_rebuild(attempt: int, when: str) -> None:
    """SIGKILL this process in attempt `attempt` of the next rebuild of the job's process group."""
    publish = job_module.RendezvousStore.set

    def set_(store, key, value):
        if f"(attempt {attempt})" in store.what:
            if when == "after-key":
                publish(store, key, value)
                time.sleep(0.3)  # the others find its address and connect to it
            os.kill(os.getpid(), signal.SIGKILL)
        publish(store, key, value)

    job_module.RendezvousStore.set = set_


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    deaths = {int(r): when for r, when in json.loads(sys.argv[5]).items()}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    session = job.open_session(SessionConfig(world, make_policy("random", world, 2, seed=1).spec()))
    params = torch.full((5,), float(rank))
    worker = GroupWorker(session, BucketedTensors([params]), timeout=60, job=job)
    death = deaths.get(rank)
    if death == "start":
        os.kill(os.getpid(), signal.SIGKILL)
    if death is not None:
        die_in_rebuild(*death)
    start = time.monotonic()
    worker.synchronize("end")
    sync_seconds = time.monotonic() - start
    while not worker.global_average():  # a rank lost meanwhile: meet again without it
        worker.synchronize("end/again")
    result = {
        "rank": rank,
        "members": list(job.members),
        "worker_members": list(worker.members),
        "release_members": worker.release["members"],
        "rebuilds": job.rebuilds,
        "sync_seconds": sync_seconds,
        "params": params.tolist(),
        "departed": sorted(session.departed),
    }
    worker.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
