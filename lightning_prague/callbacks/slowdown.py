"""Simulated heterogeneity: stretch every training step to a simulated compute time per worker.

The papers measure stragglers this way: a worker's step is padded with sleep to
`step_time * factor`, where `factor` comes from a per-worker profile. Sleeping (not spinning)
keeps a small machine's cores out of the measurement.

The sleep ends the forward pass (`on_before_backward`), so the gradient exists only once the
simulated compute time is over, as on a real accelerator. Padding later (after the backward pass)
would let DDP all-reduce a gradient its slow worker had not finished computing yet, and hide the
wait for the slowest worker inside the fast workers' padding.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.nn.parallel import DistributedDataParallel

from lightning_prague.core.comm.groups import set_link_delay
from lightning_prague.core.errors import ConfigurationError

Profile = Literal["homogeneous", "straggler", "jitter", "periodic"]
PROFILES = ("homogeneous", "straggler", "jitter", "periodic")


@dataclass(frozen=True)
class SlowLinks:
    """Workers behind a slow link, and the extra seconds each byte of a group sum costs there.

    While it is active (`simulate_slow_links`), every group sum of this process that involves one of
    those workers completes no sooner than `seconds_per_byte * bytes` after it was issued (through
    `lightning_prague.core.comm.groups.set_link_delay`): every member of such a group sees the same
    delay, as with a real bottleneck link.
    """

    ranks: frozenset[int]
    seconds_per_byte: float

    def delay(self, members: Iterable[int], nbytes: int) -> float:
        """Extra seconds a collective of `nbytes` among `members` takes."""
        return nbytes * self.seconds_per_byte if self.ranks.intersection(members) else 0.0


def simulate_slow_links(links: SlowLinks | None) -> None:
    """Make `links` apply to this process's group collectives (`None` turns it off)."""
    set_link_delay(links.delay if links is not None else None)


class SlowdownInjector(Callback):
    """Pads each training batch (its start to its backward pass) to `step_time * factor` seconds.

    The padding ends before `backward`, so gradients (and DDP's gradient all-reduce) come only
    after the simulated compute time. A `training_step` that returns `None` (no backward) is
    not padded.

    Args:
        step_time: simulated compute time of one step on a normal worker, in seconds.
        profile: `homogeneous` (factor 1), `straggler` (`slow_ranks` run `slow_factor` times
            slower), `jitter` (each step's factor is lognormal with `sigma`, median 1) or
            `periodic` (`slow_ranks` run `slow_factor` times slower for `duty` of every
            `period` steps, each rank at its own seeded phase of the cycle).
        slow_ranks: global ranks slowed down by the `straggler` and `periodic` profiles.
        slow_factor: their slowdown.
        sigma: lognormal sigma of the `jitter` profile.
        period: length in steps of a `periodic` cycle.
        duty: fraction of each cycle that is slow, in [0, 1].
        seed: makes `jitter` and the `periodic` phases reproducible (per rank).
        slow_link_ranks: workers behind a slow network link (default: none).
        link_seconds_per_byte: extra seconds per byte of every synchronization that involves one
            of them: the group collectives of this package's strategies
            (`SlowLinks`; overlapped exchanges can hide it) and, with
            Lightning's DDP, its gradient all-reduce (through a DDP communication hook).
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
        slow_link_ranks: Optional[list[int]] = None,
        link_seconds_per_byte: float = 0.0,
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
        if link_seconds_per_byte < 0:
            raise ConfigurationError(f"link_seconds_per_byte={link_seconds_per_byte} must not be negative")
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
        self.links = (
            SlowLinks(frozenset(slow_link_ranks or []), link_seconds_per_byte)
            if slow_link_ranks and link_seconds_per_byte > 0
            else None
        )
        self._rng: random.Random | None = None
        self._start = 0.0
        self.steps = 0
        self.slept = 0.0

    def factor(self, rank: int) -> float:
        """The slowdown of `rank`'s next step under this profile."""
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

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.links is not None:
            simulate_slow_links(self.links)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.links is not None:
            simulate_slow_links(None)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = trainer.strategy.model
        if self.links is not None and isinstance(model, DistributedDataParallel):
            model.register_comm_hook((self.links, dist.get_world_size()), _slow_link_allreduce)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start = time.perf_counter()

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        target = self.step_time * self.factor(trainer.global_rank)
        remaining = target - (time.perf_counter() - self._start)
        if remaining > 0:
            time.sleep(remaining)
            self.slept += remaining
        self.steps += 1


def _slow_link_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the real annotations
    """DDP's gradient all-reduce (the mean over all workers), completing no sooner than the slow link allows.

    Untyped on purpose: DDP compares the hook's annotations with `dist.GradBucket` and
    `torch.futures.Future`, which this module's postponed (string) annotations would fail.
    """
    links, world = state
    tensor = bucket.buffer()
    issued = time.perf_counter()
    delay = links.delay(range(world), tensor.numel() * tensor.element_size())
    future = dist.all_reduce(tensor.div_(world), async_op=True).get_future()

    def finish(done: torch.futures.Future) -> torch.Tensor:
        remaining = issued + delay - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return done.value()[0]

    return future.then(finish)
