"""One rank of a collective during which a member dies part-way through its sends (gloo).

Usage: global_average_fault.py RANK WORLD PORT OUT_JSON DIES average|gather

Every rank holds a tensor of its rank's value and meets at a synchronization point; rank DIES
then sends its first message of the collective's all-to-all (to the lowest other rank, whose sum
is then complete while the others' are not) and SIGKILLs itself.

`average`: the global average; the survivors average again until one average is taken, as a
strategy does at a synchronization point, and write their tensor, their members and how many
averages they tried. `gather`: a gather of `MemberCollectives` with the control plane's decision
(as Lightning's collectives run during a fit); the survivors write whether it returned, meet
again (without the lost rank) and gather again, then gather tensors of two dimensions, rank 0's
larger than a gather's first sum carries (`GATHER_INLINE`: a second sum), and broadcast a small
object, one larger than a broadcast's first sum carries (`BROADCAST_INLINE`) and one the others
could not read (refused on every member).
"""

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from lightning_prague.core import BucketedTensors, GroupComm, GroupWorker, SessionConfig, init_job, make_policy
from lightning_prague.core.comm.collectives import GATHER_INLINE, MemberCollectives


class Unreadable:
    """An object of a class of the user's: `torch.load(weights_only=True)` does not read it back."""


def die_after_the_first_send(comm: GroupComm) -> None:
    def post(ops):  # the all-to-all's first piece: a send to each peer, a receive from each
        first = next(op for op in ops if op.op is dist.isend)
        first.op(first.tensor, first.peer, first.group).wait()
        os.kill(os.getpid(), signal.SIGKILL)

    comm._post = post


def main() -> None:
    rank, world, port, out, dies = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    mode = sys.argv[6]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    session = job.open_session(SessionConfig(world, make_policy("random", world, 2, seed=1).spec()))
    params = torch.full((64,), float(rank), dtype=torch.float64)
    worker = GroupWorker(session, BucketedTensors([params]), timeout=30, job=job)
    worker.synchronize("end")
    if rank == dies:
        die_after_the_first_send(worker.comm)
    if mode == "average":
        attempts = 1
        while not worker.global_average():
            worker.synchronize("end/again")
            attempts += 1
        result = {"rank": rank, "params": params.tolist(), "members": list(worker.members), "attempts": attempts}
    else:
        mine = torch.full((rank + 1,), float(rank))  # shapes differ
        first = MemberCollectives(worker.comm, 30, agree=worker.agree).gather(mine)
        worker.synchronize("end/again")
        second = MemberCollectives(worker.comm, 30, agree=worker.agree).gather(mine)
        rows = GATHER_INLINE if rank == 0 else rank  # rank 0's 2 x GATHER_INLINE values take a second sum
        large = MemberCollectives(worker.comm, 30, agree=worker.agree).gather(
            torch.arange(2 * rows, dtype=torch.int64).reshape(rows, 2) + 1000 * rank
        )
        members = MemberCollectives(worker.comm, 30, agree=worker.agree)
        small = members.broadcast_object({"path": "/ckpt/epoch=1.ckpt", "stop": True}, src=1)  # one sum
        big = members.broadcast_object([float(i) for i in range(1000)], src=2)  # beyond BROADCAST_INLINE: two
        try:
            members.broadcast_object(Unreadable(), src=0)
            refused = ""
        except TypeError as err:
            refused = str(err)
        result = {
            "rank": rank,
            "first": None if first is None else [t.tolist() for t in first],
            "second": None if second is None else [t.tolist() for t in second],
            "large": None if large is None else [t.tolist() for t in large],
            "small": small,
            "big": big,
            "refused": refused,
            "members": list(worker.members),
        }
    worker.close()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
