"""One fit of a model whose state is more than its parameters; every rank records its whole state_dict.

Usage: one_model.py --strategy NAME --out DIR [--devices N] [--epochs E] [--slow-rank R]

The model (`StatefulModel`) holds what real models hold besides plain parameters: BatchNorm layers
(running statistics and `num_batches_tracked`; one with `momentum=None`, whose cumulative average
reads the counter), an embedding tied to the output layer (one parameter under two names), an
integer counter and an integer table that every training step changes (so they differ between ranks
that took different numbers of steps), a constant boolean mask, and a floating-point buffer that the
step *replaces* (`self.ema = ...`) rather than updating in place.

Every rank writes `DIR/state.rankR.json`: a digest of each state_dict entry at the end of each
validation during fit (`val<epoch>`), of the checkpoint's `state_dict` when ModelCheckpoint saves at an
epoch's end (`save<epoch>`; rank 0 writes it to `DIR/ckpt/e<epoch>.ckpt`) and after fit (`fit_end`),
whether the tied parameter is still one tensor, its counters and how many batches it trained itself.
"""

import argparse
import hashlib
import json
from pathlib import Path

import lightning as L
import torch
from torch import nn

import lightning_prague  # noqa: F401  (registers the strategies)
from lightning_prague.callbacks import SlowdownInjector
from lightning_prague.demo.digits import DigitsDataModule

VOCAB = 17  # digits' pixels take 17 values: they become tokens
TABLE = 32  # a table larger than what travels whole in the first sum (exact.SMALL)


class StatefulModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm2d = nn.BatchNorm2d(4)
        self.proj = nn.Linear(4 * 8 * 8, 8)
        self.norm1d = nn.BatchNorm1d(8, momentum=None)  # cumulative: reads num_batches_tracked
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied, as language models tie their embeddings
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("token_counts", torch.zeros(TABLE, dtype=torch.int64))
        self.register_buffer("mask", torch.arange(64) % 3 == 0)
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens = (x * 16).round().long()
        image = torch.relu(self.norm2d(self.conv(x.view(-1, 1, 8, 8))))
        features = torch.relu(self.norm1d(self.proj(image.flatten(1))))
        hidden = features + self.embed(tokens * self.mask).mean(1)
        return self.head(hidden)[:, :10], features, tokens

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits, features, tokens = self(x)
        self.steps += 1
        self.token_counts += torch.bincount(tokens.flatten(), minlength=TABLE)[:TABLE]
        self.ema = 0.9 * self.ema + 0.1 * features.detach().mean(0)  # a new tensor: the buffer is replaced
        return nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x)[0], y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each entry's dtype, shape and the SHA-256 of its bytes: equal exactly when the tensors are."""
    out = {}
    for name, tensor in state.items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = f"{tensor.dtype}{tuple(tensor.shape)}:{hashlib.sha256(data).hexdigest()}"
    return out


class RecordState(L.Callback):
    """Every rank's state_dict digests at validation's end, at each checkpoint and after fit."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.record: dict = {"states": {}, "batches": 0}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.record["batches"] += 1

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.record["states"][f"val{trainer.current_epoch}"] = digests(pl_module.state_dict())

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.record["states"][f"save{trainer.current_epoch}"] = digests(checkpoint["state_dict"])

    def on_fit_end(self, trainer, pl_module):
        self.record["states"]["fit_end"] = digests(pl_module.state_dict())
        self.record["tied"] = pl_module.head.weight is pl_module.embed.weight
        self.record["steps"] = int(pl_module.steps)
        self.record["num_batches_tracked"] = int(pl_module.norm1d.num_batches_tracked)
        self.record["rank"] = trainer.global_rank
        (self.out / f"state.rank{trainer.global_rank}.json").write_text(json.dumps(self.record))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--start-method", default="fork")
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    args.out.mkdir(parents=True, exist_ok=True)
    shared = {"seed": 0, "timeout": 60.0, "start_method": args.start_method}
    strategies = {
        "prague": lambda: lightning_prague.PartialAllReduceStrategy(group_size=2, **shared),
        "partial_reduce": lambda: lightning_prague.PartialReduceStrategy(group_size=2, **shared),
        "adpsgd": lambda: lightning_prague.ADPSGDStrategy(**shared),
        "decent_adam": lambda: lightning_prague.DecentAdamStrategy(topology="ring", **shared),
    }
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=args.out / "ckpt", filename="e{epoch}", auto_insert_metric_name=False, save_top_k=-1, monitor=None
    )
    slow = SlowdownInjector(step_time=0.004, profile="straggler", slow_ranks=[args.slow_rank], slow_factor=5.0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategies[args.strategy](),
        max_epochs=args.epochs,
        callbacks=[slow, checkpoint, RecordState(args.out)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=args.out,
    )
    trainer.fit(StatefulModel(), datamodule=DigitsDataModule(batch_size=32))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
