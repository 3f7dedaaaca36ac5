"""One rank of a model sharded over 2 ranks by `shard_model`, in the units its `units` choose.

Usage: shard_units_worker.py RANK WORLD PORT OUT_JSON

Builds a model of two blocks (each a Linear, a LayerNorm and a Linear, in a `Block`) and a head, and
shards one copy with `units=(Block,)` (as `auto_wrap_policy={Block}` does) and another with the
default (every submodule with parameters of its own); writes the names of the modules FSDP2 made
units of, in each, and whether one training step of each runs and leaves the ranks with one model.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_prague.core.replicas.sharding import shard_model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(6, 12), nn.LayerNorm(12), nn.Linear(12, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.norm(self.up(x)).relu())


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(6, 2))


def units_and_step(units: tuple[type, ...], mesh: DeviceMesh) -> dict:
    net = model()
    shard_model(net, mesh, units)
    names = sorted(name or "<root>" for name, m in net.named_modules() if isinstance(m, FSDPModule))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    net(torch.randn(3, 6, generator=torch.Generator().manual_seed(dist.get_rank()))).pow(2).mean().backward()
    optimizer.step()
    whole = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
    return {"units": names, "checksum": float(whole.double().sum())}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("shard",))
    result = {"blocks": units_and_step((Block,), mesh), "default": units_and_step((), mesh)}
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
