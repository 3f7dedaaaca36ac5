"""Trainer settings that asynchronous training cannot honour, rejected at setup with a way out."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_prague.core.errors import ConfigurationError


def check_trainer(trainer: pl.Trainer, strategy_name: str) -> None:
    """Raise :class:`ConfigurationError` for options that need ranks to run equal numbers of steps."""
    why = (
        f"with strategy={strategy_name!r} workers run different numbers of steps (fast workers take more "
        "batches), so every per-step schedule differs between workers"
    )
    if trainer._val_check_time_interval is not None:  # val_check_interval given as a duration
        raise ConfigurationError(
            f"a time-based val_check_interval cannot be honoured: {why}. Use val_check_interval=1.0"
        )
    interval = trainer.val_check_interval
    if isinstance(interval, int) or (isinstance(interval, float) and interval != 1.0):
        raise ConfigurationError(
            f"val_check_interval={interval!r} cannot be honoured: {why}. Validate at epoch ends instead: "
            "val_check_interval=1.0, with check_val_every_n_epoch to validate less often"
        )
    if trainer.check_val_every_n_epoch is None:
        raise ConfigurationError(
            f"check_val_every_n_epoch=None (validation by step count) cannot be honoured: {why}. "
            "Set check_val_every_n_epoch to a number of epochs"
        )
    if trainer.fit_loop.max_steps not in (-1, None):
        raise ConfigurationError(
            f"max_steps={trainer.fit_loop.max_steps} cannot be honoured: {why}, so workers would stop in different "
            "epochs. Use max_epochs (an epoch is one pass over the data by all workers together)"
        )
    limit = trainer.limit_train_batches
    if isinstance(limit, float) and limit != 1.0:
        raise ConfigurationError(
            f"limit_train_batches={limit} (a fraction) cannot be honoured: batches are handed out from one global "
            "work queue whose length is not known per worker. Pass an int (batches per worker and epoch) or "
            "train on a subset of the dataset"
        )
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and (
            callback._every_n_train_steps or callback._train_time_interval is not None
        ):
            raise ConfigurationError(
                f"ModelCheckpoint(every_n_train_steps / train_time_interval) cannot be honoured: {why}. "
                "Use ModelCheckpoint(every_n_epochs=...) to save the consensus model at epoch ends"
            )
