"""The places where Lightning would put asynchronous ranks back in lock-step, redirected.

1. `_TrainingEpochLoop._broadcast_sigterm_tensor` broadcasts a flag on the world group before
   every batch; it becomes a local check of the coordinator's stop announcement.
2. `_SignalConnector._sigterm_notifier_fn` broadcasts from inside the SIGTERM handler; it
   becomes a local flag that the next batch turns into a coordinated stop.
3. `_DataConnector._prepare_dataloader` injects a static `DistributedSampler` into the training
   loader; it gets the work-queue sampler instead.
4. The training epoch loop's validation decision, per-step LR updates and end-of-epoch test, and the
   fit loop's data setup, count this worker's batches; they follow global progress instead
   (`lightning_prague.strategies.global_progress`).

The patches are instance attributes on this trainer's objects, installed in `Strategy.setup` and
removed in `teardown`; nothing global is changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

_TARGETS = (
    ("fit_loop.epoch_loop", "_broadcast_sigterm_tensor"),
    ("_signal_connector", "_sigterm_notifier_fn"),
    ("_data_connector", "_prepare_dataloader"),
    # per-step schedules on global progress (lightning_prague.strategies.global_progress)
    ("fit_loop.epoch_loop", "_should_check_val_fx"),
    ("fit_loop.epoch_loop", "_update_learning_rates"),
    ("fit_loop.epoch_loop", "_num_ready_batches_reached"),
    ("fit_loop", "setup_data"),
)


def _owner(trainer: pl.Trainer, path: str) -> Any:
    obj: Any = trainer
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def install(trainer: pl.Trainer, replacements: dict[str, Callable[..., Any]]) -> None:
    """Shadow the named methods on this trainer's loop/connector instances."""
    for path, name in _TARGETS:
        if name in replacements:
            setattr(_owner(trainer, path), name, replacements[name])


def remove(trainer: pl.Trainer) -> None:
    for path, name in _TARGETS:
        owner = _owner(trainer, path)
        if name in vars(owner):
            delattr(owner, name)
