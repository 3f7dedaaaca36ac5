"""One rank of a model sharded over its replica with FSDP2, replicas averaged shard by shard, on gloo.

Usage: sharded_replica_worker.py RANK WORLD PORT OUT_JSON REPLICA_SIZE

The ranks form replicas of REPLICA_SIZE consecutive ranks (a 2-D device mesh, `replicate` x `shard`);
each replica's model is `fully_shard`ed over its own ranks only (no averaging across replicas), and
trains 3 AdamW steps on data of its own, so the replicas differ. Then every rank averages its local
shards with the same shards of the other replicas (`average_sharded_replicas`). Each rank writes its
replica's whole model (`full_tensor`) before and after, and the bytes of its local shards.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_prague.core import GroupComm
from lightning_prague.core.replicas import ReplicaLayout, average_sharded_replicas


def whole(model: torch.nn.Module) -> list[list[float]]:
    return [p.full_tensor().reshape(-1).tolist() for p in model.parameters()]


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    size = int(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = ReplicaLayout(world, size)
    mesh = init_device_mesh("cpu", (layout.replicas, size), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)  # one initial model everywhere
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches: replicas drift apart
    for _ in range(3):
        loss = model(torch.randn(4, 8, generator=data)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    before = whole(model)
    comm = GroupComm(rank, world, timeout=60)
    comm.warm_up()
    shards = [p.to_local() for p in model.parameters()]
    applied = average_sharded_replicas(comm, shards, layout, range(layout.replicas))
    after = whole(model)
    local = sum(s.numel() * s.element_size() for s in shards)
    with open(out, "w") as f:
        json.dump({"before": before, "after": after, "applied": applied, "local_bytes": local}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
