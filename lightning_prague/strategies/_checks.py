"""Trainer settings that asynchronous training cannot honour, rejected at setup with a way out."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_prague.core.errors import ConfigurationError


def check_trainer(trainer: pl.Trainer, strategy_name: str) -> None:
    """Raise `ConfigurationError` for options that need ranks to run equal numbers of steps.

    Step-based options (`max_steps`, `val_check_interval` in steps or as a fraction,
    `check_val_every_n_epoch=None`, `ModelCheckpoint(every_n_train_steps=...)`) run on global
    progress (`lightning_prague.strategies.global_progress`); time-based ones cannot, because
    workers reach a moment in time at different points of the data.
    """
    why = (
        f"with strategy={strategy_name!r} workers run different numbers of steps (fast workers take more "
        "batches) and meet only at synchronization points, which are placed by global progress, not by time"
    )
    if trainer._val_check_time_interval is not None:  # val_check_interval given as a duration
        raise ConfigurationError(
            f"a time-based val_check_interval cannot be honoured: {why}. Use an int (validate every N steps)"
        )
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback._train_time_interval is not None:
            raise ConfigurationError(
                f"ModelCheckpoint(train_time_interval=...) cannot be honoured: {why}. "
                "Use ModelCheckpoint(every_n_train_steps=...)"
            )
    limit = trainer.limit_train_batches
    if isinstance(limit, float) and limit != 1.0:
        raise ConfigurationError(
            f"limit_train_batches={limit} (a fraction) cannot be honoured: batches are handed out from one global "
            "work queue whose length is not known per worker. Pass an int (batches per worker and epoch) or "
            "train on a subset of the dataset"
        )
    step_based = (
        isinstance(trainer.val_check_interval, int)
        or trainer.val_check_interval != 1.0
        or any(isinstance(cb, ModelCheckpoint) and cb._every_n_train_steps for cb in trainer.callbacks)
    )
    if isinstance(limit, int) and step_based:
        raise ConfigurationError(
            f"limit_train_batches={limit} cannot be combined with step-based validation or checkpoints: each "
            "worker would stop its epoch on its own count, so nobody knows where the epoch's global progress "
            "ends. Train on a subset of the dataset instead"
        )


def check_layer_sync(strategy: Any, strategy_name: str) -> None:
    """Raise `ConfigurationError` for `Trainer(sync_batchnorm=True)` (the strategy's `_layer_sync` is set)."""
    if getattr(strategy, "_layer_sync", None) is not None:
        raise ConfigurationError(
            f"sync_batchnorm=True cannot be honoured with strategy={strategy_name!r}: SyncBatchNorm runs a "
            "collective of every rank in every forward pass, but workers run different numbers of steps and would "
            "wait for each other forever. Use plain BatchNorm (each replica keeps its own statistics, averaged "
            "with the parameters at synchronization points) or GroupNorm/LayerNorm"
        )


#: Lightning internals the strategy touches when ranks are lost (`DecentralizedStrategy._follow_membership`,
#: `reshard_validation`): (path from the trainer, attribute)
LOOP_INTERNALS = (
    ("fit_loop", "_combined_loader"),
    ("fit_loop.epoch_loop.val_loop", "_combined_loader"),
    ("fit_loop.epoch_loop.val_loop", "setup_data"),
    ("fit_loop.epoch_loop.val_loop", "reset"),
)


def check_loop_internals(trainer: Any, strategy_name: str) -> None:
    """Raise `ConfigurationError` if this Lightning version lacks a loop internal that the survivors
    of a lost rank rebuild their data with (checked at setup, not when a rank is lost)."""
    for path, attribute in LOOP_INTERNALS:
        owner: Any = trainer
        for part in path.split("."):
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attribute):
            raise ConfigurationError(
                f"strategy={strategy_name!r} needs trainer.{path}.{attribute}, which this Lightning version does not "
                "have; use a Lightning version this release supports (see pyproject.toml)"
            )
