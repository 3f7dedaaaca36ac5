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
removed in `teardown`; nothing global is changed. Where they go is registered with every other
Lightning internal the package depends on (`_checks.LIGHTNING_INTERNALS`, the entries whose use is
"replaced"), and `install` refuses to shadow a method that Lightning's class does not have: the
replacement would be a dead attribute that nothing calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import lightning.pytorch as pl

from lightning_prague.strategies._checks import (
    REPLACED_INTERNALS,
    LightningInternal,
    locate_owner,
    missing_part,
    unsupported_lightning,
)


def _targets(names: list[str]) -> list[LightningInternal]:
    """The registered replaced methods called `names`; `ValueError` for a name nobody registered."""
    registered = {internal.name: internal for internal in REPLACED_INTERNALS}
    unknown = sorted(set(names) - set(registered))
    if unknown:
        raise ValueError(
            f"no replaceable Lightning method is registered as {unknown}: add it to LIGHTNING_INTERNALS "
            "(lightning_prague/strategies/_checks.py) with use='replaced'"
        )
    return [registered[name] for name in names]


def install(
    trainer: pl.Trainer, replacements: dict[str, Callable[..., Any]], strategy_name: Optional[str] = None
) -> None:
    """Shadow the named methods on this trainer's loop/connector instances.

    Every target is checked first and nothing is installed unless Lightning has all of them:
    `ConfigurationError` (see `_checks.unsupported_lightning`) names those it lacks.
    """
    targets = _targets(list(replacements))
    missing = [(internal, part) for internal in targets if (part := missing_part(internal, trainer))]
    if missing:
        raise unsupported_lightning(missing, strategy_name)
    for internal in targets:
        setattr(locate_owner(internal, trainer), internal.name, replacements[internal.name])


def remove(trainer: pl.Trainer) -> None:
    """Take the replacements off this trainer's objects again (those that are there)."""
    for internal in REPLACED_INTERNALS:
        try:
            owner = locate_owner(internal, trainer)
        except LookupError:
            continue  # nothing could have been installed there
        if internal.name in vars(owner):
            delattr(owner, internal.name)
