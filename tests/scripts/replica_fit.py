"""One fit in replica groups (`replica_size`), run as a cluster launcher runs each rank: `decent_adam`,
`prague` with `grouping="static"` (lock-step), or the work-queue strategies `prague` (random groups),
`partial_reduce` and `adpsgd`.

Usage: replica_fit.py --out DIR --replica-size K [--strategy decent_adam|prague-static|prague|partial_reduce|adpsgd]
       [--epochs E] [--kill RANK:BATCH] [--slow RANK:SECONDS]...

Every rank writes `DIR/replica.rankR.json`: the SHA-256 of its parameters after each of its first
`RECORDED` training batches (after the optimizer step and the gossip mix), at fit's end, how many
batches it trained, the validation accuracy at the end, and the sizes of its sums over its column
(what it sent across replicas) against its model's. `--kill RANK:BATCH`: rank RANK SIGKILLs
itself at the start of its BATCH-th batch (it writes nothing). `--slow RANK:SECONDS`: rank RANK sleeps
that long at every batch (a slow node). `--indexed`: the training samples carry their index, and every
rank records the indices it trained, by epoch (`samples`). `--sigterm RANK:BATCH`: rank RANK gets SIGTERM
at the start of its BATCH-th batch; every rank that stops with an exception writes `stopped.rankR.json`.
`--stop-request RANK:BATCH`: rank RANK alone sets `trainer.should_stop` at the end of its BATCH-th batch
(as a `Timer` on that rank would). `--max-steps`, `--val-every`: the Trainer's `max_steps` and
`val_check_interval` (in steps); each rank records the global steps it validated at (`validations`).
"""

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor

import lightning_prague
from lightning_prague.core.comm.averaging import averaged_state
from lightning_prague.demo import DigitsClassifier, DigitsDataModule

#: training batches whose parameters every rank records
RECORDED = 24


#: the size of every group sum whose members are one rank of each of several replicas (a column)
COLUMN_SUMS: list[int] = []


def record_column_sums(replica_size: int) -> None:
    """Wrap `GroupComm.sum_` to note the elements of each sum over a column (every member with the same
    index in its replica, more than one member): what a rank sends across replicas."""
    from lightning_prague.core.comm.groups import GroupComm

    summed = GroupComm.sum_

    def sum_(self, tensor, members, *args, **kwargs):
        members = tuple(members)
        if len(members) > 1 and len({m % replica_size for m in members}) == 1:
            COLUMN_SUMS.append(tensor.numel())
        return summed(self, tensor, members, *args, **kwargs)

    GroupComm.sum_ = sum_


def whole(parameter: torch.Tensor) -> torch.Tensor:
    """The whole parameter (gathered inside the replica where it is sharded: every rank calls this)."""
    return parameter.full_tensor() if isinstance(parameter, DTensor) else parameter


def digest(module: torch.nn.Module) -> str:
    data = b"".join(
        whole(p).detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for p in module.parameters()
    )
    return hashlib.sha256(data).hexdigest()


class Record(L.Callback):
    def __init__(
        self, out: Path, kill: tuple[int, int] | None, slow: dict[int, float], sigterm: tuple[int, int] | None = None
    ) -> None:
        self.out, self.kill, self.slow, self.sigterm = out, kill, slow, sigterm
        self.stop_request: tuple[int, int] | None = None
        self.record: dict = {"digests": [], "batches": 0, "samples": {}}

    def on_train_start(self, trainer, pl_module):
        self.record["start"] = digest(pl_module)  # (the checkpoint's model, where the fit resumed from one)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.kill is not None and trainer.global_rank == self.kill[0] and self.record["batches"] + 1 == self.kill[1]:
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_rank in self.slow:
            time.sleep(self.slow[trainer.global_rank])
        at = self.record["batches"] + 1
        if self.sigterm is not None and trainer.global_rank == self.sigterm[0] and at == self.sigterm[1]:
            os.kill(os.getpid(), signal.SIGTERM)
        if len(batch) > 2:  # the samples' indices: which the rank trained, by epoch
            self.record["samples"].setdefault(str(trainer.current_epoch), []).extend(batch[2].tolist())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["batches"] += 1
        # `pace="own"`: the updates made while a gossip round was still in flight, so far in the fit
        self.record["local_steps"] = getattr(trainer.strategy.exchanger, "local_steps", 0)
        if self.stop_request is not None and (trainer.global_rank, self.record["batches"]) == self.stop_request:
            trainer.should_stop = True  # (as a Timer on this rank alone would)
        if len(self.record["digests"]) < RECORDED:
            self.record["digests"].append(digest(pl_module))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.record.setdefault("validations", []).append(trainer.global_step)

    def on_exception(self, trainer, pl_module, exception):
        stopped = {"rank": trainer.global_rank, "error": type(exception).__name__, "final": digest(pl_module)}
        stopped.update(epoch=trainer.current_epoch, batches=self.record["batches"], digests=self.record["digests"])
        (self.out / f"stopped.rank{trainer.global_rank}.json").write_text(json.dumps(stopped))

    def on_fit_end(self, trainer, pl_module):
        self.record.update(
            rank=trainer.global_rank,
            final=digest(pl_module),
            val_acc=float(trainer.callback_metrics["val_acc"]),
            lost=sorted(int(r) for r in trainer.strategy.lost_workers),
            column_sums=sorted(set(COLUMN_SUMS)),
            state_elements=sum(t.numel() for t in averaged_state(pl_module)),
            model_elements=sum(whole(p).numel() for p in pl_module.parameters())
            + sum(b.numel() for b in pl_module.buffers() if b.is_floating_point()),
            sharded=any(isinstance(p, DTensor) for p in pl_module.parameters()),
            global_step=trainer.global_step,
            epoch=trainer.current_epoch,
        )
        (self.out / f"replica.rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


class IndexedDigits(DigitsDataModule):
    """The digits, each training sample with its index (a third tensor)."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        x, y = self.train_set.tensors
        self.train_set = torch.utils.data.TensorDataset(x, y, torch.arange(len(x)))


class IndexedClassifier(DigitsClassifier):
    def training_step(self, batch, batch_idx):
        return super().training_step(batch[:2], batch_idx)


class ShardedInConfigureModel(DigitsClassifier):
    """The digits model that shards its own layers on the strategy's mesh (the replica's ranks)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not isinstance(self.net, FSDPModule):
            fully_shard(self.net, mesh=self.trainer.strategy.device_mesh)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--replica-size", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--kill", help="RANK:BATCH")
    parser.add_argument(
        "--strategy",
        default="decent_adam",
        choices=["decent_adam", "prague-static", "prague", "partial_reduce", "adpsgd"],
    )
    parser.add_argument("--sigterm", help="RANK:BATCH: that rank gets SIGTERM at the start of that batch")
    parser.add_argument("--indexed", action="store_true", help="record the training samples' indices")
    parser.add_argument("--max-steps", type=int, default=-1, help="the Trainer's step budget")
    parser.add_argument("--val-every", type=int, help="validate every this many steps (val_check_interval)")
    parser.add_argument("--stop-request", help="RANK:BATCH: that rank alone sets trainer.should_stop after that batch")
    parser.add_argument("--slow", action="append", default=[], help="RANK:SECONDS slept at every batch")
    parser.add_argument("--shard", action="store_true", help="shard the model over each replica (FSDP2)")
    parser.add_argument("--resume", type=Path, help="resume the fit from this checkpoint")
    parser.add_argument("--configure-model", action="store_true", help="the module shards its layers itself")
    parser.add_argument("--state-dict-type", default="full", help="how checkpoints hold the sharded model")
    parser.add_argument("--pace", default="round", help="decent_adam's and prague-static's pace")
    args = parser.parse_args()
    kill = tuple(int(x) for x in args.kill.split(":")) if args.kill else None
    sigterm = tuple(int(x) for x in args.sigterm.split(":")) if args.sigterm else None
    slow = {int(rank): float(seconds) for rank, seconds in (item.split(":") for item in args.slow)}
    L.seed_everything(0, verbose=False)
    size = int(args.replica_size) if args.replica_size.isdigit() else args.replica_size
    record_column_sums(size if isinstance(size, int) else 1)
    if args.strategy == "decent_adam":
        strategy = lightning_prague.DecentAdamStrategy(
            topology="ring", replica_size=size, shard=args.shard, seed=0, timeout=60.0,
            state_dict_type=args.state_dict_type, pace=args.pace,
        )  # fmt: skip
    elif args.strategy == "prague-static":
        strategy = lightning_prague.PartialAllReduceStrategy(
            grouping="static", group_size=2, replica_size=size, shard=args.shard, seed=0, timeout=60.0,
            pace=args.pace,
        )  # fmt: skip
    elif args.strategy == "prague":
        strategy = lightning_prague.PartialAllReduceStrategy(
            group_size=2, replica_size=size, shard=args.shard, seed=0, timeout=60.0
        )
    elif args.strategy == "partial_reduce":
        strategy = lightning_prague.PartialReduceStrategy(
            group_size=2, replica_size=size, shard=args.shard, seed=0, timeout=60.0
        )
    else:
        strategy = lightning_prague.ADPSGDStrategy(replica_size=size, shard=args.shard, seed=0, timeout=60.0)
    record = Record(args.out, kill, slow, sigterm)
    if args.stop_request:
        record.stop_request = tuple(int(x) for x in args.stop_request.split(":"))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        val_check_interval=args.val_every if args.val_every else 1.0,
        callbacks=[record, ModelCheckpoint(dirpath=args.out / "ckpt", save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=args.out,
    )
    kind = ShardedInConfigureModel if args.configure_model else IndexedClassifier if args.indexed else DigitsClassifier
    data = (IndexedDigits if args.indexed else DigitsDataModule)(batch_size=32)
    trainer.fit(kind(lr=0.05), data, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
