"""Which workers are slow: per-worker compute time, waiting time and batches, without per-step collectives."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


@dataclass
class WorkerTiming:
    """One worker's totals for the fit so far."""

    rank: int
    batches: int
    compute_seconds: float  # step time minus the time blocked on other workers
    wait_seconds: float  # blocked on other workers: unhidden exchanges and synchronization points

    @property
    def compute_per_step(self) -> float:
        return self.compute_seconds / self.batches if self.batches else 0.0


class StragglerMonitor(Callback):
    """Measures every worker's compute time per step, time spent waiting on others, and batches;
    flags workers slower than `slow_factor` times the median compute time per step.

    Each rank measures itself (a step is `on_train_batch_start` to `on_train_batch_end`; the
    strategy reports how much of it, and of the synchronization points, was spent waiting on
    other ranks: `strategy.wait_seconds`; strategies that do not report it, like Lightning's DDP,
    count waiting as compute). With a logger, the numbers are gathered once per epoch, at the
    epoch end where ranks are aligned, and logged by rank 0 as `straggler/rank{r}/compute_ms`,
    `straggler/rank{r}/wait_s`, `straggler/rank{r}/batches` and `straggler/flagged` (how
    many workers are flagged); without one they are gathered only at the end of fit. At the
    end of fit rank 0 prints a per-worker table and, with `path`, writes it as JSON
    (`{"workers": [{"rank", "batches", "compute_seconds", "wait_seconds", "compute_per_step",
    "flagged"}, ...]}`), which `lightning-prague plan --timings PATH` reads; `timings`
    and `flagged` keep the last gathered values on every rank.
    """

    def __init__(self, slow_factor: float = 2.0, verbose: bool = True, path: Optional[str] = None) -> None:
        if slow_factor <= 1.0:
            raise ValueError(f"slow_factor={slow_factor} must be above 1 (a multiple of the median step time)")
        self.slow_factor = slow_factor
        self.verbose = verbose
        self.path = path
        self.timings: list[WorkerTiming] = []
        self.flagged: list[int] = []
        self._batches = 0
        self._compute_seconds = 0.0
        self._batch_start = 0.0
        self._waited_at_start = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batches, self._compute_seconds = 0, 0.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, idx: int) -> None:
        self._batch_start = time.perf_counter()
        self._waited_at_start = _waited(trainer)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        waited = _waited(trainer) - self._waited_at_start  # blocked on other ranks inside this step
        self._compute_seconds += max(0.0, time.perf_counter() - self._batch_start - waited)
        self._batches += 1

    def _local(self, trainer: Trainer) -> list[float]:
        return [float(self._batches), self._compute_seconds, _waited(trainer)]

    def _gather(self, trainer: Trainer, pl_module: LightningModule) -> None:
        local = torch.tensor(self._local(trainer), dtype=torch.float64, device=pl_module.device)
        rows = trainer.strategy.all_gather(local).reshape(-1, 3).tolist()
        self.timings = [WorkerTiming(r, int(b), c, w) for r, (b, c, w) in enumerate(rows)]
        self.flagged = flag_slow([t.compute_per_step for t in self.timings], self.slow_factor)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.loggers:
            return  # nothing to log to: gather once, at the end of fit
        self._gather(trainer, pl_module)
        metrics = {"straggler/flagged": float(len(self.flagged))}
        for t in self.timings:
            metrics[f"straggler/rank{t.rank}/compute_ms"] = 1000 * t.compute_per_step
            metrics[f"straggler/rank{t.rank}/wait_s"] = t.wait_seconds
            metrics[f"straggler/rank{t.rank}/batches"] = float(t.batches)
        log_metrics(trainer, metrics)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._gather(trainer, pl_module)
        if self.verbose and trainer.is_global_zero:
            print(self.table(), flush=True)
        if self.path and trainer.is_global_zero:
            self.write(self.path)

    def write(self, path: str) -> None:
        """The per-worker timings as JSON, for `lightning-prague plan --timings`."""
        Path(path).write_text(json.dumps({"workers": self.as_dicts()}, indent=1))

    def table(self) -> str:
        """The per-worker summary as text."""
        lines = [f"{'rank':>4} {'batches':>8} {'compute ms/step':>16} {'waiting s':>10}  flag"]
        for t in self.timings:
            flag = f"slow (> {self.slow_factor:g}x median)" if t.rank in self.flagged else ""
            lines.append(
                f"{t.rank:>4} {t.batches:>8} {1000 * t.compute_per_step:>16.1f} {t.wait_seconds:>10.2f}  {flag}"
            )
        return "\n".join(lines)

    def as_dicts(self) -> list[dict[str, Any]]:
        return [
            {**asdict(t), "compute_per_step": t.compute_per_step, "flagged": t.rank in self.flagged}
            for t in self.timings
        ]


def log_metrics(trainer: Trainer, metrics: dict[str, float]) -> None:
    """Straight to the trainer's loggers (they write on global rank 0 only), skipping `LightningModule.log`,
    whose epoch-level bookkeeping costs far more than these few numbers."""
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)


def _waited(trainer: Trainer) -> float:
    """The strategy's running total of time blocked on other ranks (0 if it does not report one)."""
    return float(getattr(trainer.strategy, "wait_seconds", 0.0))


def flag_slow(per_step: list[float], slow_factor: float) -> list[int]:
    """Ranks whose time per step exceeds `slow_factor` times the median over all ranks."""
    if not per_step:
        return []
    threshold = slow_factor * median(per_step)
    return [rank for rank, seconds in enumerate(per_step) if seconds > threshold]
