"""A runtime model: how fast All-Reduce and each strategy train on a given cluster, before you run them.

Inputs are per-worker compute-time distributions (:class:`ComputeProfile`, as measured by
``StragglerMonitor`` or assumed), the model size and the link (bandwidth, latency). Outputs are
per-strategy :class:`Prediction` s of throughput in batches per second over all workers:

``ddp`` (All-Reduce)
    every iteration waits for the slowest worker, then all-reduces the gradients (ring):
    ``N / (E[max_i c_i] + allreduce(N))``. Closed form when no worker varies.
``prague``, ``partial_reduce``, ``adpsgd``
    nobody waits for a busy worker and exchanges overlap computation (work queue: fast workers
    take more batches), so each worker runs at ``1 / E[max(c_i, exchange)]`` and the throughput is
    the sum (Monte Carlo when step times vary).
``decent_adam``
    gossip on a ring with a one-step lag and equal shards: the max-plus recursion
    ``T_i(t) = max(T_i(t-1) + c_i(t), T_peer(t-1) + exchange)`` simulated by Monte Carlo.

The physical limit is the sum of the workers' speeds, ``sum_i 1 / E[c_i]``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.topology import ring

STRATEGY_MODELS = ("ddp", "prague", "partial_reduce", "adpsgd", "decent_adam")


@dataclass(frozen=True)
class ComputeProfile:
    """One worker's compute time per step: ``step_time * slowdown``, times a lognormal factor with
    ``sigma`` (median 1), times ``periodic_factor`` during ``duty`` of every ``period`` steps."""

    step_time: float
    slowdown: float = 1.0
    sigma: float = 0.0
    period: int = 0
    duty: float = 0.0
    periodic_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.step_time <= 0 or self.slowdown <= 0 or self.sigma < 0 or not 0 <= self.duty <= 1:
            raise ConfigurationError(f"invalid compute profile {self}")

    @property
    def deterministic(self) -> bool:
        return self.sigma == 0 and (self.period == 0 or self.duty in (0.0, 1.0) or self.periodic_factor == 1.0)

    @property
    def mean(self) -> float:
        periodic = 1.0 + (self.duty * (self.periodic_factor - 1.0) if self.period else 0.0)
        return self.step_time * self.slowdown * math.exp(self.sigma**2 / 2) * periodic

    def sample(self, rng: random.Random, step: int, phase: int = 0) -> float:
        factor = math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else 1.0
        if self.period and ((step + phase) % self.period) < self.duty * self.period:
            factor *= self.periodic_factor
        return self.step_time * self.slowdown * factor


@dataclass(frozen=True)
class Link:
    """A network link: ``latency`` seconds per message and ``bandwidth`` bytes per second."""

    bandwidth: float = 1e9
    latency: float = 1e-4

    def allreduce_seconds(self, members: int, nbytes: int) -> float:
        """A ring all-reduce among ``members``: ``2 (n-1)/n * bytes / bandwidth + 2 (n-1) latency``."""
        if members < 2:
            return 0.0
        return 2 * (members - 1) / members * nbytes / self.bandwidth + 2 * (members - 1) * self.latency


@dataclass(frozen=True)
class Prediction:
    strategy: str
    throughput: float  # batches per second over all workers
    seconds_per_iteration: float  # N / throughput: the time for every worker to do one step, on average
    limit: float  # the physical limit, batches per second
    method: str  # "closed form" or "monte carlo"


def _ddp(workers: Sequence[ComputeProfile], comm: float, steps: int, rng: random.Random) -> tuple[float, str]:
    if all(w.deterministic for w in workers):
        return max(w.mean for w in workers) + comm, "closed form"
    total = sum(max(w.sample(rng, t, r) for r, w in enumerate(workers)) for t in range(steps))
    return total / steps + comm, "monte carlo"


def _independent(workers: Sequence[ComputeProfile], comm: float, steps: int, rng: random.Random) -> tuple[float, str]:
    if all(w.deterministic for w in workers):
        return sum(1.0 / max(w.mean, comm) for w in workers), "closed form"
    rate = 0.0
    for r, w in enumerate(workers):
        rate += steps / sum(max(w.sample(rng, t, r), comm) for t in range(steps))
    return rate, "monte carlo"


def _lagged_ring(workers: Sequence[ComputeProfile], comm: float, steps: int, rng: random.Random) -> float:
    n = len(workers)
    schedule = ring(n)
    finish = [0.0] * n
    for t in range(steps):
        previous = list(finish)
        for i, w in enumerate(workers):
            peers = schedule.group_of(i, t).members
            ready = max(previous[j] for j in peers) + (comm if len(peers) > 1 else 0.0)
            finish[i] = max(previous[i] + w.sample(rng, t, i), ready)
    return n * steps / max(finish)


def predict(
    workers: Sequence[ComputeProfile],
    model_bytes: int,
    link: Link | None = None,
    strategies: Sequence[str] = STRATEGY_MODELS,
    group_size: int = 3,
    steps: int = 400,
    seed: int = 0,
) -> list[Prediction]:
    """Predicted throughput of each strategy on this cluster (see the module docstring)."""
    if not workers:
        raise ConfigurationError("the runtime model needs at least one worker")
    unknown = sorted(set(strategies) - set(STRATEGY_MODELS))
    if unknown:
        raise ConfigurationError(f"no runtime model for {unknown}; known: {', '.join(STRATEGY_MODELS)}")
    link = link or Link()
    n = len(workers)
    limit = sum(1.0 / w.mean for w in workers)
    out = []
    for name in strategies:
        rng = random.Random(seed)
        if name == "ddp":
            seconds, method = _ddp(workers, link.allreduce_seconds(n, model_bytes), steps, rng)
            throughput = n / seconds
        elif name == "decent_adam":
            throughput = _lagged_ring(workers, link.allreduce_seconds(2, model_bytes), steps, rng)
            method = "monte carlo"
        else:
            size = 2 if name == "adpsgd" else min(group_size, n)
            throughput, method = _independent(workers, link.allreduce_seconds(size, model_bytes), steps, rng)
        out.append(Prediction(name, throughput, n / throughput, limit, method))
    return out


def recommend(predictions: Sequence[Prediction]) -> Prediction:
    """The strategy with the highest predicted throughput."""
    return max(predictions, key=lambda p: p.throughput)
