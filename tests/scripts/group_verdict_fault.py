"""One rank of group averages during which a member dies at a chosen stage, decided by the control plane.

Usage: group_verdict_fault.py RANK WORLD PORT OUT_JSON CASES_JSON

Every rank joins one job and session (the control plane is real) and runs the cases in order;
CASES_JSON is a list of ``{"members": [...], "dies": R, "stage": K, "partial": bool, "ring": bool, "whole": bool}``
or ``{"members": [...], "dies": R, "reports": true}``. In each case the members execute the same
group item (`GroupWorker.execute`, as a strategy's inbox does), whose average is all-or-nothing by
the control plane's verdict. Rank ``dies`` SIGKILLs itself at its ``K``-th start of messages in the
case (``partial``: once the first of them is through, so some peers got its share and others did
not), or, with ``reports``, right after it reported its complete sum to the control plane. The
survivors write whether the average was applied, and their tensor before and after.
All-to-all is sent in pieces of 64 bytes here, so that a death can fall between pieces (``whole``:
in one piece).
"""

import json
import os
import signal
import sys
import time

import torch

from lightning_prague.core import BucketedTensors, GroupComm, GroupWorker, SessionConfig, init_job, make_policy
from lightning_prague.core.comm import groups


def start(rank: int) -> torch.Tensor:
    return torch.randn(48, generator=torch.Generator().manual_seed(5 + rank), dtype=torch.float64)


def die_at(comm: GroupComm, stage: int, partial: bool) -> None:
    post, count = comm._post, [0]

    def staged(ops):  # every algorithm of GroupComm starts its messages here
        if count[0] == stage:
            if partial:
                first = ops[0]
                first.op(first.tensor, first.peer, first.group).wait()
            os.kill(os.getpid(), signal.SIGKILL)
        count[0] += 1
        return post(ops)

    comm._post = staged


def die_after_reporting(worker: GroupWorker) -> None:
    session = worker.session

    def verdict(key, members, complete, operation, timeout=None, epoch=None):
        drawn = {} if epoch is None else {"epoch": epoch}
        session.send("summed", key=key, members=[int(m) for m in members], ok=bool(complete), **drawn)
        time.sleep(0.5)  # the report reaches the control plane before the connection closes
        os.kill(os.getpid(), signal.SIGKILL)

    session.verdict = verdict


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cases = json.loads(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    session = job.open_session(SessionConfig(world, make_policy("random", world, 2, seed=1).spec()))
    tensor = start(rank)
    worker = GroupWorker(session, BucketedTensors([tensor]), timeout=30, job=job)
    ring = GroupComm(rank, world, timeout=30, process_group=worker.comm.pg, doubling_max_bytes=0)
    ring.abandon, ring.waiting = worker.comm.abandon, worker.comm.waiting
    plain = worker.comm
    results = []
    for index, case in enumerate(cases):
        members = case["members"]
        if rank not in members:
            results.append(None)
            continue
        worker.comm = ring if case.get("ring") else plain
        groups.ALL_TO_ALL_CHUNK_BYTES = 1 << 20 if case.get("whole") else 64
        if rank == case.get("dies"):
            if case.get("reports"):
                die_after_reporting(worker)
            else:
                die_at(worker.comm, case["stage"], case.get("partial", False))
        before = tensor.clone()
        worker.execute({"t": "group", "gid": 1000 + index, "members": members})
        applied = not torch.equal(tensor, before)
        results.append({"applied": applied, "before": before.tolist(), "after": tensor.tolist()})
    worker.comm = plain
    worker.close()
    with open(out, "w") as f:
        json.dump({"rank": rank, "cases": results}, f)


if __name__ == "__main__":
    main()
