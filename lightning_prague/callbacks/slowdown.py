"""Simulated heterogeneity: stretch every training step to a simulated compute time per worker.

The papers measure stragglers this way: a worker's step is padded with sleep to
``step_time * factor``, where ``factor`` comes from a per-worker profile. Sleeping (not spinning)
keeps a small machine's cores out of the measurement.
"""

from __future__ import annotations

import math
import random
import time
from typing import Any, Literal, Optional

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_prague.core.errors import ConfigurationError

Profile = Literal["homogeneous", "straggler", "jitter", "periodic"]
PROFILES = ("homogeneous", "straggler", "jitter", "periodic")


class SlowdownInjector(Callback):
    """Pads each training step (start of batch to optimizer step) to ``step_time * factor`` seconds.

    Args:
        step_time: simulated compute time of one step on a normal worker, in seconds.
        profile: ``homogeneous`` (factor 1), ``straggler`` (``slow_ranks`` run ``slow_factor`` times
            slower), ``jitter`` (each step's factor is lognormal with ``sigma``, median 1) or
            ``periodic`` (``slow_ranks`` run ``slow_factor`` times slower for ``duty`` of every
            ``period`` steps, each rank at its own seeded phase of the cycle).
        slow_ranks: global ranks slowed down by the ``straggler`` and ``periodic`` profiles.
        slow_factor: their slowdown.
        sigma: lognormal sigma of the ``jitter`` profile.
        period: length in steps of a ``periodic`` cycle.
        duty: fraction of each cycle that is slow, in [0, 1].
        seed: makes ``jitter`` and the ``periodic`` phases reproducible (per rank).
    """

    def __init__(
        self,
        step_time: float = 0.05,
        profile: Profile = "homogeneous",
        slow_ranks: Optional[list[int]] = None,
        slow_factor: float = 5.0,
        sigma: float = 0.5,
        period: int = 20,
        duty: float = 0.25,
        seed: int = 0,
    ) -> None:
        if step_time < 0:
            raise ConfigurationError(f"step_time={step_time} must not be negative")
        if profile not in PROFILES:
            raise ConfigurationError(f"profile={profile!r} is unknown; use one of {', '.join(PROFILES)}")
        if period < 1:
            raise ConfigurationError(f"period={period} must be at least 1 step")
        if not 0.0 <= duty <= 1.0:
            raise ConfigurationError(f"duty={duty} must be a fraction in [0, 1]")
        if sigma < 0:
            raise ConfigurationError(f"sigma={sigma} must not be negative")
        if slow_factor <= 0:
            raise ConfigurationError(f"slow_factor={slow_factor} must be positive")
        self.step_time = step_time
        self.profile = profile
        self.slow_ranks = [0] if slow_ranks is None else list(slow_ranks)
        self.slow_factor = slow_factor
        self.sigma = sigma
        self.period = period
        self.duty = duty
        self.seed = seed
        self._phase: int | None = None
        self._rng: random.Random | None = None
        self._start = 0.0
        self.steps = 0
        self.slept = 0.0

    def factor(self, rank: int) -> float:
        """The slowdown of ``rank``'s next step under this profile."""
        if self.profile == "straggler":
            return self.slow_factor if rank in self.slow_ranks else 1.0
        if self.profile == "jitter":
            if self._rng is None:
                self._rng = random.Random(self.seed * 100_003 + rank)
            return math.exp(self._rng.gauss(0.0, self.sigma))
        if self.profile == "periodic":
            if rank not in self.slow_ranks:
                return 1.0
            if self._phase is None:
                self._phase = random.Random(self.seed * 100_003 + rank).randrange(self.period)
            position = (self.steps + self._phase) % self.period
            return self.slow_factor if position < self.duty * self.period else 1.0
        return 1.0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        target = self.step_time * self.factor(trainer.global_rank)
        remaining = target - (time.perf_counter() - self._start)
        if remaining > 0:
            time.sleep(remaining)
            self.slept += remaining
        self.steps += 1
