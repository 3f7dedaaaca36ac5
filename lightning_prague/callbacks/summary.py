"""Per-worker batch counts at the end of fit, gathered once (not per step)."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


class WorkerSummary(Callback):
    """Counts training batches per worker and gathers them at the end of fit.

    `train_seconds` is the time from the start to the end of training on this rank
    (process start-up and setup excluded); `step_seconds` is the part of it spent in
    training batches and between consecutive ones, so `train_seconds - step_seconds` is what
    validation, synchronization points and epoch boundaries cost. After `fit` every rank has
    `batches_per_worker` (a list indexed by global rank); rank 0 prints it. The gather runs
    in `on_train_end`, after the strategy's final synchronization point, so ranks are aligned
    and it cannot hang.
    """

    def __init__(self, verbose: bool = True) -> None:
        self.verbose = verbose
        self.batches = 0
        self.batches_per_worker: list[int] = []
        self.train_seconds = 0.0
        self.step_seconds = 0.0
        self._last_batch_end: float | None = None  # None after validation or an epoch boundary
        #: (seconds since the start of training, val_acc) after every validation, for time-to-accuracy
        self.timeline: list[tuple[float, float]] = []
        self._start = 0.0
        self._batch_start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = time.perf_counter()

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_batch_end = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_batch_end = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        if self._last_batch_end is not None:
            self.step_seconds += now - self._last_batch_end  # loading the next batch is part of a step
        self._batch_start = now

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        accuracy = trainer.callback_metrics.get("val_acc")
        if accuracy is not None and not trainer.sanity_checking and self._start:
            self.timeline.append((time.perf_counter() - self._start, float(accuracy)))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.batches += 1
        self._last_batch_end = time.perf_counter()
        self.step_seconds += self._last_batch_end - self._batch_start

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.train_seconds = time.perf_counter() - self._start
        counts = trainer.strategy.all_gather(torch.tensor(self.batches, device=pl_module.device))
        self.batches_per_worker = [int(c) for c in counts.reshape(-1).tolist()]
        if self.verbose and trainer.is_global_zero:
            cells = "  ".join(f"w{r}:{n}" for r, n in enumerate(self.batches_per_worker))
            print(f"batches per worker: {cells}  (total {sum(self.batches_per_worker)})", flush=True)
