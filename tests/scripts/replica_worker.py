"""One rank of replica averages by slices, on gloo (`lightning_prague.core.replicas`).

Usage: replica_worker.py RANK WORLD PORT OUT_JSON CASES_JSON

CASES_JSON is a list of ``{"replica_size": K, "replicas": [...], "numel": N}``. For each case every
rank holds its replica's model, ``N`` values that differ by replica (`model`), and the ranks of the
replicas named average them by slices; every other rank leaves its model alone. Each rank writes its
model after each case, and what the average returned.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from lightning_prague.core import GroupComm
from lightning_prague.core.replicas import ReplicaLayout, average_replicas_by_slices


def model(replica: int, numel: int) -> torch.Tensor:
    return torch.arange(numel, dtype=torch.float64) * (replica + 1) + 100.0 * replica


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cases = json.loads(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    comm = GroupComm(rank, world, timeout=60)
    comm.warm_up()
    results = []
    for case in cases:
        layout = ReplicaLayout(world, case["replica_size"])
        flat = model(layout.replica_of(rank), case["numel"])
        applied = whole = None
        if layout.replica_of(rank) in case["replicas"]:
            applied, whole = average_replicas_by_slices(comm, flat, layout, case["replicas"])
        results.append({"flat": flat.tolist(), "applied": applied, "whole": whole})
        dist.barrier()
    with open(out, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
