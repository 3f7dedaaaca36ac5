"""One rank of a run of the group primitive alone: a fixed sequence of groups of every size, on gloo.

Usage: group_worker.py RANK WORLD PORT OUT_JSON CASES_JSON

CASES_JSON is a list of ``{"members": [...], "weights": [...] | null, "ring": bool}``, the same on
every rank. Each rank holds two tensors (37 and 3 elements: a ring with uneven chunks, and a tensor
smaller than a large group) starting at known values, and runs, in order, the cases it is a member
of with ``average_``: by default groups beyond four members sum by recursive doubling (and the
whole world too, on gloo), with ``"ring": true`` in a ring (the whole world: gloo's all-reduce).
It writes its tensors after every case it took part in, its final tensors, and how many
communicators exist after the warm-up compared with the end.

Then ranks 0-2 average snapshots of a larger model (`SnapshotAverages`, all-to-all in pieces of
`PIECE` bytes) three times and write the third's result and the largest allocation it made.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from lightning_prague.core import BucketedTensors, GroupComm, average_, communicator_count
from lightning_prague.core.comm import groups, norms
from lightning_prague.core.comm.averaging import SnapshotAverages

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peak_memory import largest_allocation  # noqa: E402

#: the snapshot test: a model of two buckets of 100,000 floats (400 KB each), sent in 16 KB pieces
PIECE, BUCKET, SNAPSHOT_MEMBERS = 16 << 10, 100_000, (0, 1, 2)


def snapshot_model(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(BUCKET, generator=g), torch.randn(BUCKET, generator=g)]


def snapshot_steps(rank: int, comm: GroupComm) -> dict:
    """Three steps of a background exchange's buffers (an average and a chained one each); the largest
    storage the third allocates."""
    groups.ALL_TO_ALL_CHUNK_BYTES, norms.NORM_CHUNK = PIECE, 2048
    model = snapshot_model(rank)
    averages = SnapshotAverages(BucketedTensors(model, bucket_bytes=BUCKET * 4))

    def step(chained: bool = True) -> None:
        averages.apply()
        averages.take()
        averages.average(comm, SNAPSHOT_MEMBERS, None, "snapshot average")
        if chained:
            averages.average(comm, SNAPSHOT_MEMBERS, None, "a chained snapshot average")

    step()
    step()
    largest, where = largest_allocation(step)
    for t, fresh in zip(model, snapshot_model(rank)):  # known values for a last step
        t.copy_(fresh)
    averages.apply()
    step(chained=False)
    averaged = [(s + c).tolist() for s, c in zip(averages.snapshot.flats, averages.change.flats)]
    return {
        "largest_allocation": largest,
        "allocated_by": where,
        "averaged": averaged,
        "change": [c.tolist() for c in averages.change.flats],
    }


def start(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7 + rank)
    return [torch.randn(37, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)]


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cases = json.loads(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = GroupComm(rank, world, timeout=60)
    ring_comm = GroupComm(rank, world, timeout=60, doubling_max_bytes=0)
    comm.warm_up()
    communicators = communicator_count()
    tensors = start(rank)
    bucketed = BucketedTensors(tensors, bucket_bytes=8)  # one bucket per tensor
    after = {}
    for index, case in enumerate(cases):
        members = case["members"]
        if rank not in members:
            continue
        weights = case["weights"]
        weight = None if weights is None else weights[members.index(rank)]
        chosen = ring_comm if case.get("ring") else comm
        average_(bucketed, chosen, members, weight=weight, operation=f"case {index}")
        after[index] = [t.tolist() for t in tensors]
    result = {
        "rank": rank,
        "after": after,
        "final": [t.tolist() for t in tensors],
        "new_communicators": communicator_count() - communicators,
        "messages": comm.stats.messages + ring_comm.stats.messages,
    }
    if rank in SNAPSHOT_MEMBERS:
        result["snapshot"] = snapshot_steps(rank, comm)
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
