"""Digits classification: 1797 8x8 images that ship inside scikit-learn, so nothing is downloaded."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_prague.optim import AccumAdam, AccumAdamW

#: the optimizers the demo model can configure, by name
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "accum_adam": AccumAdam,
    "accum_adamw": AccumAdamW,
}


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits as (images scaled to [0, 1], labels).

    Read straight from the CSV file scikit-learn ships, without importing scikit-learn (about 2 s
    of CPU in every rank of every run); `sklearn.datasets.load_digits` if the file is not where
    it is expected.
    """
    spec = importlib.util.find_spec("sklearn")  # locates the package without running its __init__
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(p) / "datasets" / "data" / "digits.csv.gz" for p in locations), None)
    if path is not None and path.exists():
        with gzip.open(path, "rt") as f:
            rows = torch.tensor([[float(v) for v in line.split(",")] for line in f if line.strip()])
        x, y = rows[:, :-1], rows[:, -1].long()
    else:
        from sklearn.datasets import load_digits as sklearn_load_digits

        data, target = sklearn_load_digits(return_X_y=True)
        x, y = torch.tensor(data, dtype=torch.float32), torch.tensor(target, dtype=torch.long)
    return x.float() / 16.0, y


class DigitsDataModule(L.LightningDataModule):
    """Train/validation split of scikit-learn's digits, standardized, split reproducibly from `split_seed`."""

    def __init__(self, batch_size: int = 32, val_fraction: float = 0.2, split_seed: int = 0, num_workers: int = 0):
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed
        self.num_workers = num_workers

    def setup(self, stage: str) -> None:
        x, y = load_digits()
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(self.split_seed))
        n_val = int(len(x) * self.val_fraction)
        val_idx, train_idx = order[:n_val], order[n_val:]
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256, num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()


class DigitsClassifier(L.LightningModule):
    """A small MLP with BatchNorm (so floating-point buffers are averaged too).

    Args:
        hidden: width of the two hidden layers.
        lr: learning rate.
        momentum: SGD momentum.
        sync_dist_train_loss: log each step's training loss reduced across ranks, and a training
            accuracy metric that syncs its state every step (`dist_sync_on_step`), as under DDP.
            Asynchronous strategies cannot reduce between synchronization points (ranks are at
            different steps): they use the local values instead and warn once for each.
        optimizer: one of `OPTIMIZERS` (`sgd`, `adam`, `accum_adam`, `accum_adamw`, ...).
        accum_steps: tau of `accum_adam` / `accum_adamw`.
        lr_decay: multiply the LR by this after every epoch.
    """

    def __init__(
        self,
        hidden: int = 64,
        lr: float = 0.05,
        momentum: float = 0.9,
        sync_dist_train_loss: bool = False,
        optimizer: str = "sgd",
        accum_steps: int = 4,
        lr_decay: float = 1.0,
    ):
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is unknown; choose one of {', '.join(sorted(OPTIMIZERS))}")
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(64, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, 10),
        )
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")
        # with `sync_dist_train_loss`, a training metric that syncs its state every step as well
        self.train_acc = (
            torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro", dist_sync_on_step=True)
            if sync_dist_train_loss
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss, on_step=True, sync_dist=self.hparams.sync_dist_train_loss)
        if self.train_acc is not None:
            self.log("train_acc", self.train_acc(logits, y), on_step=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc(logits, y)
        self.log("val_acc", self.val_acc)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("test_acc", (self(x).argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> Any:
        """`optimizer` picks SGD with momentum or an Adam variant; `lr_decay` < 1 multiplies the LR by it
        after every epoch (`StepLR`)."""
        kind, hp = self.hparams.optimizer, self.hparams
        if kind == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=hp.lr, momentum=hp.momentum)
        elif kind.startswith("accum"):
            optimizer = OPTIMIZERS[kind](self.parameters(), lr=hp.lr, accum_steps=hp.accum_steps)
        else:
            optimizer = OPTIMIZERS[kind](self.parameters(), lr=hp.lr)
        if hp.lr_decay == 1.0:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, hp.lr_decay)}
