"""One rank of a model sharded over its replica with FSDP2, replicas averaged shard by shard, on gloo.

Usage: sharded_replica_worker.py RANK WORLD PORT OUT_JSON REPLICA_SIZE

The ranks form replicas of REPLICA_SIZE consecutive ranks (a 2-D device mesh, `replicate` x `shard`);
each replica's model is `fully_shard`ed over its own ranks only (no averaging across replicas), and
trains 3 AdamW steps on data of its own, so the replicas differ. Then every rank averages its local
shards with the same shards of the other replicas (`average_sharded_replicas`). Each rank writes its
replica's whole model (`full_tensor`) before and after, and the bytes of its local shards.

Then the shards as a rank that rejoins gets them (`as_local_shards`, through `torch.save` and a
weights-only load, `from_local_shards`) are loaded into a new model and optimizer, sharded alike but
initialised apart: it writes whether they then hold this rank's shards exactly, and what
`from_local_shards` names as not fitting in a shard of another shape. Last, the replica's ranks run
a `DonationAgreement` with inputs that differ by index, and it writes what each call returned.
"""

import io
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from lightning_prague.core import GroupComm
from lightning_prague.core.replicas import ReplicaLayout, average_sharded_replicas
from lightning_prague.core.replicas.agreement import DonationAgreement
from lightning_prague.core.replicas.sharding import (
    SHARD_OF,
    as_local_shards,
    from_local_shards,
    load_model_shards,
    load_optimizer_shards,
    model_shards,
    optimizer_shards,
)


def whole(model: torch.nn.Module) -> list[list[float]]:
    return [p.full_tensor().reshape(-1).tolist() for p in model.parameters()]


def sharded_model(mesh, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 17), torch.nn.ReLU(), torch.nn.Linear(17, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def sent_and_loaded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, mesh) -> dict:
    """This rank's shards sent as to a rejoining rank, and loaded into a new model sharded alike."""
    buffer = io.BytesIO()
    torch.save(as_local_shards({"model": model_shards(model), "optim": optimizer_shards(model, optimizer)}), buffer)
    received = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    new = sharded_model(mesh, seed=7)
    new_optimizer = torch.optim.AdamW(new.parameters(), lr=0.05)
    like = model_shards(new)
    model_state, wrong_model = from_local_shards(received["model"], like)
    optim_state, wrong_optim = from_local_shards(received["optim"], like)
    load_model_shards(new, model_state)
    load_optimizer_shards(new, new_optimizer, optim_state)
    same = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), new.parameters()))
    for a, b in zip(model.parameters(), new.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            same = same and torch.equal(optimizer.state[a][key].to_local(), new_optimizer.state[b][key].to_local())
    bad = {"0.weight": {SHARD_OF: [99, 8], "local": torch.zeros(1)}, "nowhere": {SHARD_OF: [1], "local": 0}}
    _, wrong = from_local_shards(bad, like)
    return {"loaded_exactly": same, "fitting": wrong_model + wrong_optim, "wrong": wrong}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    size = int(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = ReplicaLayout(world, size)
    mesh = init_device_mesh("cpu", (layout.replicas, size), mesh_dim_names=("replicate", "shard"))
    model = sharded_model(mesh["shard"], seed=0)  # one initial model everywhere
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
    sent = sent_and_loaded(model, optimizer, mesh["shard"])
    agreement = DonationAgreement(mesh["shard"].get_group(), timedelta(seconds=60), f"rank {rank}'s replica")
    index = rank % size
    agreed = [agreement.lagged(3 if index == 0 else 1), agreement.lagged(0)]
    agreed += [agreement.settle(5 if index == 1 else 0), agreement.lagged(0), agreement.lagged(0)]
    sent["agreed"] = agreed
    with open(out, "w") as f:
        json.dump({"before": before, "after": after, "applied": applied, "local_bytes": local, **sent}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
