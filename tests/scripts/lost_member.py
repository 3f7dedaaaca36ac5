"""One rank of a run in which group members die in the middle of group sums (gloo).

Usage: lost_member.py RANK WORLD PORT OUT_JSON CASES_JSON

CASES_JSON is a list of ``{"members": [...], "dies": R, "when": "before" | "after-first", "ring": bool}``,
the same on every rank. In each case the members average their tensors with ``average_``; rank
``dies`` SIGKILLs itself in its first exchange of the case, before posting anything or once its
first message is posted. Survivors record whether the average was applied and their tensors.
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from lightning_prague.core import BucketedTensors, GroupComm, average_


def start(rank: int) -> torch.Tensor:
    return torch.randn(40, generator=torch.Generator().manual_seed(11 + rank), dtype=torch.float64)


def die_in_next_exchange(comm: GroupComm, when: str) -> None:
    def post(ops):  # every algorithm of GroupComm starts its messages here
        if when == "after-first":
            first = ops[0]
            first.op(first.tensor, first.peer, first.group).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    comm._post = post


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cases = json.loads(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = GroupComm(rank, world, timeout=60)
    ring_comm = GroupComm(rank, world, timeout=60, doubling_max_bytes=0)
    comm.warm_up()
    tensor = start(rank)
    bucketed = BucketedTensors([tensor])
    results = []
    for case in cases:
        members = case["members"]
        if rank not in members:
            results.append(None)
            continue
        chosen = ring_comm if case.get("ring") else comm
        if rank == case.get("dies"):
            die_in_next_exchange(chosen, case["when"])
        before = tensor.clone()
        _, applied = average_(bucketed, chosen, members, operation="test average")
        results.append({"applied": bool(applied), "before": before.tolist(), "after": tensor.tolist()})
    with open(out, "w") as f:
        json.dump({"rank": rank, "cases": results}, f)


if __name__ == "__main__":
    main()
