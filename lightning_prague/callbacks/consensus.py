"""How far the replicas have drifted apart: `consensus/error` and `consensus/group_error`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_prague.callbacks.straggler import log_metrics
from lightning_prague.core.comm.averaging import averaged_state
from lightning_prague.core.comm.groups import backend_device
from lightning_prague.core.comm.norms import Drift
from lightning_prague.strategies.base import DecentralizedStrategy


class ConsensusMonitor(Callback):
    """Logs the consensus error of the replicas.

    - `consensus/error`: exactly `mean_i ||x_i - x_bar||^2 / ||x_bar||^2` over every worker's
      parameters and floating-point buffers, measured at each synchronization point before the
      replicas are averaged (one extra collective there, none during training); the measurement
      of the epoch-end synchronization point is logged at every epoch end. With a lock-step
      strategy (DDP) it is measured at the epoch end and is 0 up to rounding.
    - `consensus/group_error`: an estimate during asynchronous training, from the group averages
      that happen anyway: the mean over this worker's recent group averages of
      `||x_i - avg||^2 / ||avg||^2`. It costs no communication. Every rank computes its own, but
      only rank 0 logs it (the loggers write on global rank 0), every `log_every_n_steps` training
      steps in which rank 0 averaged with a group. Reading it is a host synchronisation (the sum
      stays on the device until then), so by default it follows the trainer's own
      `log_every_n_steps` (50 by default), as Lightning's logging does, never every step.

    Values go straight to the trainer's loggers (any Lightning logger), at `trainer.global_step`.

    `history` keeps `(epoch, error)` for the exact measurements on every rank.
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be at least 1 (or None: the trainer's)")
        #: training steps between two readings of `consensus/group_error` (`None`: the trainer's setting)
        self.log_every_n_steps = log_every_n_steps
        self.history: list[tuple[int, float]] = []
        self._steps = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy, DecentralizedStrategy):
            trainer.strategy.measure_consensus = True

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        strategy = trainer.strategy
        self._steps += 1
        if not isinstance(strategy, DecentralizedStrategy) or strategy.worker is None:
            return
        every = self.log_every_n_steps or max(1, int(trainer.log_every_n_steps))
        if self._steps % every:
            return
        estimate = strategy.worker.stats.take_group_error()
        if estimate is not None:
            log_metrics(trainer, {"consensus/group_error": estimate})

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        if isinstance(strategy, DecentralizedStrategy):
            error = strategy.consensus_error  # measured at the synchronization point just passed
            strategy.consensus_error = None
        else:
            error = self._measure(pl_module)
        if error is None:
            return
        self.history.append((trainer.current_epoch, error))
        log_metrics(trainer, {"consensus/error": error})

    @staticmethod
    def _measure(pl_module: LightningModule) -> float:
        """The exact error with plain collectives on the default group (ranks are aligned at epoch end).

        The tensors go to the backend's device (CUDA for NCCL, the CPU for gloo) whatever the
        model's device is.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return 0.0
        world = dist.get_world_size()
        device = backend_device(str(dist.get_backend()))
        mine = torch.cat([t.detach().reshape(-1).double().to(device) for t in averaged_state(pl_module)])
        mean = mine.clone()
        dist.all_reduce(mean)
        mean.div_(world)
        drift = Drift(device)
        drift.add_average(mean)
        drift.add_distance(mine, mean)
        dist.all_reduce(drift.distance.view(1))  # summed over every replica
        return float(drift.error(replicas=world))
