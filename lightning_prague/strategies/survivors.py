"""The survivors' side of a lost worker: following the membership, and the report at the end of the fit.

A rank whose process ends or that hangs leaves the job (`lightning_prague.core.plane.liveness`), and
the survivors finish the fit without it. The control plane tells every rank who is left in the
release of a synchronization point; from there (`Survivors.follow_membership`) the data that
Lightning shards by rank goes to the survivors (`StrategyLoaders.reshard`), and if global rank 0
was lost, the lowest live rank takes over its duties (checkpoints, logging: Lightning's
`rank_zero_only`) and keeps them until it is lost itself (`Job.leader`, named by the control plane:
a rank 0 that rejoins does not take them back, so one process logs at a time). At every
synchronization point the leader logs the live and lost workers as metrics (`log_membership`).
When the fit ends, the leader warns once, naming every rank that was lost, when and why, and
whether `min_workers` stopped the job (`report_losses`); the strategy's `lost_workers` keeps the
same on every rank.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import TYPE_CHECKING

from lightning.fabric.utilities.rank_zero import rank_zero_only

from lightning_prague.core.protocol import LEFT_OUT

if TYPE_CHECKING:
    from lightning_prague.strategies.base import DecentralizedStrategy

log = logging.getLogger(__name__)


class Survivors:
    """What the strategy does when the membership changes (see the module docstring)."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy

    def follow_membership(self, rebuild: bool = False) -> bool:
        """After a release: if it lost ranks, Lightning's shards go to the survivors from their next
        pass (`StrategyLoaders.reshard`; `rebuild`: the control plane says the membership changed, so
        they are rebuilt even where this rank's shards already were the members'), and if rank 0 was
        lost its successor logs as rank zero. Returns whether the membership changed at this release."""
        strategy = self.strategy
        job = strategy.job
        self.assign_rank_zero()
        return job is not None and strategy.loaders.reshard(job.members, rebuild)

    def assign_rank_zero(self) -> None:
        """Lightning's `rank_zero_only` follows the leader (`Job.leader`): it alone logs and writes
        checkpoints, and a new process for global rank 0 that rejoined does not while another leads."""
        strategy = self.strategy
        job = strategy.job
        if job is None:
            return
        duty = 0 if strategy.is_global_zero else (strategy.global_rank or -1)  # -1: rank 0, not leading
        if duty != rank_zero_only.rank:
            if duty == 0:
                log.warning("rank %d: takes over global rank 0's duties (checkpoints, logging)", strategy.global_rank)
            else:
                log.warning("rank %d: rank %d does global rank 0's duties", strategy.global_rank, job.leader)
            rank_zero_only.rank = duty

    def log_membership(self) -> None:
        """At a synchronization point, on the leader: the number of live workers (`workers/live`) and
        of the losses so far (`workers/lost`, a rank that came back included) to the trainer's
        loggers, at the global step, so that a dashboard plots them over the fit."""
        strategy = self.strategy
        trainer, job, session = strategy._trainer, strategy.job, strategy.session
        if trainer is None or job is None or session is None or not strategy.is_global_zero:
            return
        if trainer.sanity_checking or not trainer.loggers:
            return
        lost = len(set(session.departed) | set(session.rejoined))
        metrics = {"workers/live": float(len(job.members)), "workers/lost": float(lost)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        log.debug("rank %d: logged %s at step %d", strategy.global_rank, metrics, trainer.global_step)

    def report_losses(self) -> None:
        """At the teardown of a fit that did not fail: record who was lost (`lost_workers`) and, on
        the lowest live rank, warn naming them."""
        strategy = self.strategy
        session = strategy.session
        if session is None or not (session.departed or session.rejoined):
            return
        departed, at = dict(session.departed), dict(session.departed_at)  # the reader thread adds to them
        lost = {r: (at.get(r, 0.0), why) for r, why in departed.items()}
        for r, (when, why) in dict(session.rejoined).items():  # lost, and back: named too
            if not why.startswith(LEFT_OUT):  # a rank left out for a while that came back was never lost
                lost.setdefault(r, (when, f"{why}; a new process for it rejoined the fit"))
        if not lost:
            return
        strategy.lost_workers = lost
        if strategy.is_global_zero:
            lines = "; ".join(
                f"rank {r} at {time.strftime('%H:%M:%S', time.localtime(at))}: {why}" for r, (at, why) in lost.items()
            )
            stopped = ""
            if len(session.members) < strategy.min_workers:
                stopped = (
                    f"; fewer than min_workers={strategy.min_workers} remained, so the job stopped at its next "
                    "synchronization point"
                )
            warnings.warn(
                f"strategy={strategy.strategy_name!r} lost {len(lost)} worker(s) during the fit and finished "
                f"it with ranks {list(session.members)}: {lines}{stopped}",
                stacklevel=2,
            )
