"""A model sharded over its replica's ranks (`shard=True`): FSDP2 on the replica's process group.

Each replica's `K` ranks hold `1/K` of every parameter, of its gradient and of the optimizer's state
(`torch.distributed.fsdp.fully_shard` on a 1-D device mesh of the replica's ranks only, so that FSDP2
itself never averages across replicas: its reduce-scatter averages the replica's gradients). Rank
`i` of every replica holds the same shard `i` of each parameter, so the decentralized exchanges
average each rank's local shards (`DTensor.to_local()`, in place) with the same shards of the other
replicas (`lightning_prague.core.comm.averaging.averaged_state` takes them), and nothing is put
together inside the replica. The whole model exists only where it is computed (FSDP2 gathers a
module's parameters for its forward and backward) and in checkpoints, gathered inside the replica.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)

#: methods of a LightningModule that Lightning calls instead of `forward`: FSDP2 gathers the root's
#: parameters around them too
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
#: a whole state gathered on the replica's first rank only, in host memory (the others get none)
_WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: each rank's own shards, as DTensors (a checkpoint written shard by shard)
_SHARDS = StateDictOptions(full_state_dict=False)


def replica_mesh(group: torch.distributed.ProcessGroup, device_type: str) -> DeviceMesh:
    """The replica's ranks (its process `group`) as a 1-D device mesh, dimension `"shard"`."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=("shard",))


def is_sharded(module: nn.Module) -> bool:
    """Whether `module`, or a module in it, is sharded with FSDP2."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def shard_model(module: nn.Module, mesh: DeviceMesh, units: tuple[type[nn.Module], ...] = ()) -> None:
    """Shard `module` over `mesh` in place, in units FSDP2 gathers one at a time for their forward
    and backward (so the whole model is never gathered at once): every submodule of one of the
    classes `units` (a transformer's block, as Lightning's `FSDPStrategy(auto_wrap_policy={Block})`
    chooses them), or without `units` every submodule that holds parameters of its own (a `Linear`, a
    norm, an embedding); innermost first, as FSDP2 wants them; then the module itself (its own
    parameters, and the root). A module sharded already (`configure_model` did it, in units of its
    choice) only gets the root where it is missing."""
    if not is_sharded(module):
        for child in reversed(list(module.modules())[1:]):
            chosen = isinstance(child, units) if units else any(True for _ in child.parameters(recurse=False))
            if chosen:
                fully_shard(child, mesh=mesh)
    if not isinstance(module, FSDPModule):
        fully_shard(module, mesh=mesh)
    for name in STEP_METHODS:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    log.debug("sharded %s over %s", type(module).__name__, mesh)


def full_model_state(module: nn.Module) -> dict[str, Any]:
    """The whole model's state dict, gathered inside the replica (a collective of its ranks): on its
    first rank in host memory, empty on the others."""
    return get_model_state_dict(module, options=_WHOLE)


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The whole optimizer state (keyed by parameter names), gathered as `full_model_state`."""
    return get_optimizer_state_dict(module, optimizer, options=_WHOLE)


def model_shards(module: nn.Module) -> dict[str, Any]:
    """This rank's shards of the model's state (DTensors), by the parameters' plain names: nothing is gathered."""
    return get_model_state_dict(module, options=_SHARDS)


def optimizer_shards(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the optimizer's state, keyed by parameter names: nothing is gathered."""
    return get_optimizer_state_dict(module, optimizer, options=_SHARDS)


def load_model_shards(module: nn.Module, state: dict[str, Any]) -> None:
    """Load `model_shards`' kind of state (this rank's shards) into `module`."""
    set_model_state_dict(module, state, options=_SHARDS)


def load_optimizer_shards(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load `optimizer_shards`' kind of state (this rank's shards) into `optimizer`."""
    set_optimizer_state_dict(module, optimizer, state, options=_SHARDS)


def load_full_model_state(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Split a whole model's state dict (`full_model_state`'s, or any plain one) into this rank's shards."""
    set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=strict))


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Split a whole optimizer state (`full_optimizer_state`'s) into this rank's shards."""
    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))


#: a shard sent to a rank that rejoins (`as_local_shards`): the key of the whole tensor's shape, next
#: to `"local"`, this rank's shard of it
SHARD_OF = "lightning_prague_shard_of"


def as_local_shards(value: Any) -> Any:
    """`value` with each DTensor in it (a sharded model's or optimizer's state) replaced by
    `{SHARD_OF: the whole tensor's shape, "local": this rank's shard}`: plain tensors, which a
    weights-only load reads, and which `from_local_shards` makes DTensors of again on a rank that
    holds the same shard of the same model."""
    if isinstance(value, DTensor):
        return {SHARD_OF: list(value.shape), "local": value.to_local()}
    if isinstance(value, dict):
        return {key: as_local_shards(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [as_local_shards(item) for item in value]
        return items if isinstance(value, list) else tuple(items)
    return value


def from_local_shards(state: dict[str, Any], like: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A model's (or one optimizer's, keyed by parameter name: `{"state": {name: {...}}, ...}`) state
    of `as_local_shards`' kind, untrusted, with each shard at name `n` made a DTensor again like
    `like[n]` (this rank's own DTensor of that parameter: its mesh, placements, whole shape and
    stride); returns it and what did not fit (a shard of another shape, or of no parameter here),
    which stays as it came."""
    wrong: list[str] = []

    def rebuild(value: Any, name: str) -> Any:
        if not (isinstance(value, dict) and SHARD_OF in value):
            return value
        template, local, shape = like.get(name), value.get("local"), value.get(SHARD_OF)
        if (
            not isinstance(template, DTensor)
            or not isinstance(local, torch.Tensor)
            or shape != list(template.shape)
            or local.shape != template.to_local().shape
            or local.dtype != template.dtype
        ):
            wrong.append(f"{name}: a shard of {shape} {tuple(local.shape) if isinstance(local, torch.Tensor) else ''}")
            return value
        local = local.to(template.to_local().device)
        mesh, placements, shape = template.device_mesh, template.placements, template.shape
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=template.stride())

    rebuilt: dict[str, Any] = {}
    for key, value in state.items():
        if key == "state" and isinstance(value, dict):  # an optimizer's: parameter name -> its state
            rebuilt[key] = {
                name: {k: rebuild(v, str(name)) for k, v in entry.items()} if isinstance(entry, dict) else entry
                for name, entry in value.items()
            }
        else:
            rebuilt[key] = rebuild(value, str(key))
    return rebuilt, wrong
