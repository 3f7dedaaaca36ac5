"""Checkpoints of a model sharded over each replica (`shard=True, state_dict_type="sharded"`), shard by shard.

A checkpoint is a directory in the layout Lightning's own FSDP2 strategy (`ModelParallelStrategy`)
writes: `torch.distributed.checkpoint` (DCP) files holding `{"state_dict": the model's state,
"optimizer_0": the first optimizer's, ...}`, each tensor saved once by the rank that holds its shard,
and `meta.pt`, the rest of Lightning's checkpoint (epoch, step, loops, callbacks), written by one rank.
So no rank ever gathers the whole model: a model too large for one device is saved and restored
as it trains.

Which replica writes: the replicas hold one consensus model at a synchronization point, so one of
them suffices, the replica of the job's leader (`is_global_zero`'s rank: the lowest live rank).
Its ranks save together over the replica's process group; the other replicas write nothing.
Between synchronization points the checkpoint is that replica's model (the strategy warns once).

Where it is read: by this library (`ckpt_path=` the directory: each rank reads its own shards,
resharded if the replica size changed), by a plain Lightning job on `ModelParallelStrategy`, and
by any other once `consolidate` made one whole file of it (`lightning-prague consolidate`).
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.replicas.sharding import (
    load_model_shards,
    load_optimizer_shards,
    model_shards,
    optimizer_shards,
)

log = logging.getLogger(__name__)

#: the file with everything but the model's and the optimizers' tensors (Lightning's name for it)
METADATA_FILE = "meta.pt"
#: the file DCP writes last, which makes a directory a checkpoint
DCP_METADATA_FILE = ".metadata"
#: the model's key in the DCP files (`ModelParallelStrategy`'s)
MODEL_KEY = "state_dict"
#: the bytes a checkpoint's path may take when its writers agree on it
PATH_BYTES = 4096
#: a checkpoint's key, set by `load_checkpoint`: its shards are loaded already (Lightning's restore skips them)
LOADED_SHARD_BY_SHARD = "_lightning_prague_loaded_shard_by_shard"


def optimizer_key(index: int) -> str:
    """The key of optimizer `index`'s state in the DCP files (`ModelParallelStrategy`'s)."""
    return f"optimizer_{index}"


def is_sharded_checkpoint(path: Any) -> bool:
    """Whether `path` is a directory that DCP wrote a checkpoint into."""
    try:
        return Path(path).is_dir() and (Path(path) / DCP_METADATA_FILE).is_file()
    except (TypeError, OSError):
        return False


def require_checkpoint_directory(path: Path) -> None:
    """Raise `ConfigurationError` unless `path` holds a checkpoint written shard by shard."""
    if not is_sharded_checkpoint(path) or not (path / METADATA_FILE).is_file():
        raise ConfigurationError(
            f"{str(path)!r} is not a checkpoint saved shard by shard: a directory with DCP's "
            f"{DCP_METADATA_FILE!r} and {METADATA_FILE!r}"
        )


def agreed_path(path: Any, group: dist.ProcessGroup, source: int, device: torch.device) -> Path:
    """The checkpoint path of global rank `source`, on every rank of `group`: Lightning names a
    checkpoint on each rank (from its metrics, which differ between replicas and may between ranks),
    and the writers of one checkpoint must write one directory. One broadcast of `PATH_BYTES` bytes
    (a tensor on the backend's device: nothing is pickled)."""
    encoded = str(path).encode()
    if len(encoded) >= PATH_BYTES or b"\0" in encoded:
        raise ConfigurationError(f"the checkpoint path {str(path)[:200]!r} is too long (or holds a NUL byte)")
    buffer = torch.zeros(PATH_BYTES, dtype=torch.uint8, device=device)
    if dist.get_rank() == source:
        buffer[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    dist.broadcast(buffer, src=source, group=group)
    raw = bytes(buffer.cpu().tolist())
    return Path(raw.split(b"\0", 1)[0].decode())


def save_sharded(checkpoint: dict[str, Any], path: Path, group: dist.ProcessGroup, writes_metadata: bool) -> None:
    """Write `checkpoint` (Lightning's, with `model_shards` as its `state_dict` and `optimizer_shards` as its
    `optimizer_states`) into the directory `path`, together with the other ranks of `group` (a collective
    of theirs); `writes_metadata`: this rank also writes `meta.pt`, the rest of the checkpoint."""
    if writes_metadata:
        if path.is_file():
            path.unlink()  # (a whole checkpoint by that name from an earlier run)
        path.mkdir(parents=True, exist_ok=True)
    state = {MODEL_KEY: checkpoint.pop("state_dict")}
    state.update({optimizer_key(i): s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
    log.debug("saving shards of %d state dicts to %s", len(state), path)
    dcp.save(state, checkpoint_id=path, process_group=group)
    if writes_metadata:
        torch.save(checkpoint, path / METADATA_FILE)


def load_sharded(path: Path, module: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """Load this rank's shards of the model and of its optimizers' states from the checkpoint directory
    `path` into `module` and `optimizers` (resharded to this rank's shards, whatever the writers' were),
    and return the rest of the checkpoint (`meta.pt`). Each rank reads its own shards on its own.

    Raises `ConfigurationError` for a directory that is not such a checkpoint, or whose optimizers do
    not match these."""
    require_checkpoint_directory(path)
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    saved_optimizers = {key.split(".", 1)[0] for key in stored if key.startswith("optimizer_")}
    if optimizers and saved_optimizers != {optimizer_key(i) for i in range(len(optimizers))}:
        raise ConfigurationError(
            f"the checkpoint {str(path)!r} holds the state of {len(saved_optimizers)} optimizer(s) and this module "
            f"configures {len(optimizers)}"
        )
    state: dict[str, Any] = {MODEL_KEY: model_shards(module)}
    state.update({optimizer_key(i): optimizer_shards(module, o) for i, o in enumerate(optimizers)})
    log.debug("loading shards of %d state dicts from %s", len(state), path)
    dcp.load(state, checkpoint_id=path, no_dist=True)  # each rank its own shards: no collective
    load_model_shards(module, state[MODEL_KEY])
    for i, optimizer in enumerate(optimizers):
        load_optimizer_shards(module, optimizer, state[optimizer_key(i)])
    return read_metadata(path)


def read_metadata(path: Path) -> dict[str, Any]:
    """The checkpoint's `meta.pt`, read with torch's restricted unpickler whatever the caller's
    `weights_only` (a file another process wrote is never unpickled: a value of the user's classes in
    it fails the load, naming the class)."""
    metadata = torch.load(path / METADATA_FILE, map_location="cpu", weights_only=True)
    if not isinstance(metadata, dict):
        raise ConfigurationError(f"{str(path / METADATA_FILE)!r} does not hold a checkpoint's metadata")
    return metadata


def consolidate(path: Path) -> dict[str, Any]:
    """The whole checkpoint in the directory `path`, as Lightning saves one in a single file: the whole
    model as `state_dict`, the optimizers' states as `optimizer_states` (keyed by parameter names, in the
    optimizer's order: a plain `optimizer.load_state_dict` takes them) and the rest from `meta.pt`.
    Runs in one process and holds the whole model in host memory."""
    require_checkpoint_directory(path)
    with tempfile.TemporaryDirectory(prefix="lightning-prague-consolidate-") as scratch:
        whole_file = Path(scratch) / "whole.pt"
        dcp_to_torch_save(path, whole_file)
        whole = torch.load(whole_file, map_location="cpu", weights_only=True)
    checkpoint = read_metadata(path)
    checkpoint["state_dict"] = whole.pop(MODEL_KEY)
    count = sum(1 for key in whole if key.startswith("optimizer_"))
    checkpoint["optimizer_states"] = [whole.pop(optimizer_key(i)) for i in range(count)]
    return checkpoint
