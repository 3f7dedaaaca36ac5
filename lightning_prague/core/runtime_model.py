"""A runtime model: how fast All-Reduce and each strategy train on a given cluster, before you run them.

Inputs are per-worker compute-time distributions (`ComputeProfile`, as measured by
`StragglerMonitor` or assumed), the model size and the `Cluster`: workers per node and
two link kinds, intra-node and inter-node (bandwidth, latency); a group inside one node uses the
intra-node link, a group spanning nodes is a ring bounded by the inter-node link. Outputs are
per-strategy `Prediction`s of throughput in batches per second over all workers:

- `ddp` (All-Reduce): every iteration waits for the slowest worker; the gradients are
  all-reduced (ring) in buckets during its backward pass (`backward_fraction` of its compute
  time), so only what does not fit behind the backward pass is exposed, and at least the last
  bucket's all-reduce:
  `N / (E[max_i c_i] + max(allreduce(bucket), allreduce(model) - backward_fraction * E[max_i c_i]))`.
  `backward_fraction=0` is no overlap. Closed form when no worker varies.
- `prague`, `partial_reduce`, `adpsgd`: nobody waits for a busy worker and exchanges overlap
  computation (work queue: fast workers take more batches), so each worker runs at
  `1 / E[max(c_i, exchange)]` and the throughput is the sum (Monte Carlo when step times vary).
  What they pay instead is at synchronization points: the epoch ends when the work queue runs
  dry, mid-step for every worker, and the synchronization point waits until each has finished
  its step (`sync_wait`: the expected largest remaining step time, by Monte Carlo; a worker far
  slower than the others leaves the epoch's tail to them, as the work queue does, so it is not
  in flight then).
- `decent_adam`: gossip on its topology (`ring` by default; any name of `make_topology`) with a
  one-step lag and equal shards: the max-plus recursion
  `T_i(t) = max(T_i(t-1) + c_i(t), max_{j in G_i(t)} T_j(t-1) + exchange(G_i(t)))` simulated by
  Monte Carlo, each round's group costing its own link.

The physical limit is the sum of the workers' speeds, `sum_i 1 / E[c_i]`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.groups import ALL_TO_ALL_MAX
from lightning_prague.core.policies import StaticPolicy
from lightning_prague.core.topology import Schedule, make_topology

STRATEGY_MODELS = ("ddp", "prague", "partial_reduce", "adpsgd", "decent_adam")


@dataclass(frozen=True)
class ComputeProfile:
    """One worker's compute time per step: `step_time * slowdown`, times a lognormal factor with
    `sigma` (median 1), times `periodic_factor` during `duty` of every `period` steps, plus
    `overhead`: host time every step pays whatever the device does (the training loop, callbacks,
    the optimizer launch), which a slow device does not stretch."""

    step_time: float
    slowdown: float = 1.0
    sigma: float = 0.0
    period: int = 0
    duty: float = 0.0
    periodic_factor: float = 1.0
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if self.step_time <= 0 or self.slowdown <= 0 or self.sigma < 0 or not 0 <= self.duty <= 1 or self.overhead < 0:
            raise ConfigurationError(f"invalid compute profile {self}")

    @property
    def deterministic(self) -> bool:
        return self.sigma == 0 and (self.period == 0 or self.duty in (0.0, 1.0) or self.periodic_factor == 1.0)

    @property
    def mean(self) -> float:
        periodic = 1.0 + (self.duty * (self.periodic_factor - 1.0) if self.period else 0.0)
        return self.step_time * self.slowdown * math.exp(self.sigma**2 / 2) * periodic + self.overhead

    def sample(self, rng: random.Random, step: int, phase: int = 0) -> float:
        factor = math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else 1.0
        if self.period and ((step + phase) % self.period) < self.duty * self.period:
            factor *= self.periodic_factor
        return self.step_time * self.slowdown * factor + self.overhead


@dataclass(frozen=True)
class Link:
    """A network link: `latency` seconds per message and `bandwidth` bytes per second."""

    bandwidth: float = 1e9
    latency: float = 1e-4

    def allreduce_seconds(self, members: int, nbytes: int) -> float:
        """A ring all-reduce among `members`: `2 (n-1)/n * bytes / bandwidth + 2 (n-1) latency`."""
        if members < 2:
            return 0.0
        return 2 * (members - 1) / members * nbytes / self.bandwidth + 2 * (members - 1) * self.latency


@dataclass(frozen=True)
class Cluster:
    """Where the workers are: `workers_per_node` consecutive ranks share a node and its `intra`
    link; groups that span nodes use the `inter` link (a ring runs at its slowest link)."""

    workers_per_node: int = 1
    intra: Link = Link(bandwidth=100e9, latency=1e-5)
    inter: Link = Link()
    #: each node's own link (node order), when they differ: a transfer between two nodes runs at the
    #: slower of their links; `None`: every node on `inter`
    node_links: tuple[Link, ...] | None = None

    def __post_init__(self) -> None:
        if self.workers_per_node < 1:
            raise ConfigurationError(f"workers_per_node={self.workers_per_node} must be at least 1")

    @classmethod
    def uniform(cls, link: Link) -> Cluster:
        """Every pair of workers joined by the same `link`."""
        return cls(1, link, link)

    def node_of(self, rank: int) -> int:
        return rank // self.workers_per_node

    def link_of(self, node: int) -> Link:
        """Node `node`'s own link to the others."""
        return self.node_links[node] if self.node_links else self.inter

    def bottleneck(self, members: Sequence[int]) -> Link:
        """The link a ring among `members` runs at: the node's own inside one node, else the slowest
        link of the nodes it spans."""
        nodes = {self.node_of(m) for m in members}
        if len(nodes) == 1:
            return self.intra
        return min((self.link_of(n) for n in nodes), key=lambda link: link.bandwidth)

    def allreduce_seconds(self, members: Sequence[int], nbytes: int) -> float:
        """A ring all-reduce among `members` (global ranks), as DDP's gloo or NCCL runs it."""
        return self.bottleneck(members).allreduce_seconds(len(members), nbytes)

    def exchange_seconds(self, members: Sequence[int], nbytes: int, sharing: dict[int, int] | None = None) -> float:
        """The library's group sum among `members` (`core.groups`): all-to-all up to `ALL_TO_ALL_MAX`
        members (each sends its whole tensor to every other), a ring beyond. Inside one node it runs
        on `intra`; across nodes each node's link carries what its members send out of the node (its
        `m` members to the `k - m` others all-to-all; one ring edge each way for consecutive ranks),
        `sharing[node]` concurrent exchanges of the same size sharing that link."""
        k = len(members)
        if k < 2:
            return 0.0
        by_node: dict[int, int] = {}
        for m in members:
            by_node[self.node_of(m)] = by_node.get(self.node_of(m), 0) + 1
        if len(by_node) == 1:
            if k <= ALL_TO_ALL_MAX:
                return (k - 1) * nbytes / self.intra.bandwidth + self.intra.latency
            return self.intra.allreduce_seconds(k, nbytes)
        worst = 0.0
        for node, here in by_node.items():
            crossing = here * (k - here) * nbytes if k <= ALL_TO_ALL_MAX else 2 * (k - 1) / k * nbytes
            share = (sharing or {}).get(node, 1)
            worst = max(worst, crossing * share / self.link_of(node).bandwidth)
        rounds = 1 if k <= ALL_TO_ALL_MAX else 2 * (k - 1)
        return worst + rounds * max(self.link_of(n).latency for n in by_node)

    def round_seconds(self, groups: Sequence[Sequence[int]], nbytes: int) -> dict[tuple[int, ...], float]:
        """Each group's exchange when all of `groups` run at once: groups that leave a node share its
        link, groups inside a node share its `intra` link (a loopback is the node's memory and CPU)."""
        crossing: dict[int, int] = {}
        inside: dict[int, int] = {}
        for group in groups:
            nodes = {self.node_of(m) for m in group}
            if len(group) < 2:
                continue
            counts = inside if len(nodes) == 1 else crossing
            for node in nodes:
                counts[node] = counts.get(node, 0) + 1
        out = {}
        for g in groups:
            nodes = {self.node_of(m) for m in g}
            share = inside.get(next(iter(nodes)), 1) if len(nodes) == 1 else 1
            out[tuple(g)] = share * self.exchange_seconds(g, nbytes, crossing)
        return out

    def random_group_seconds(self, world: int, size: int, nbytes: int) -> float:
        """Expected all-reduce time of a group of `size` drawn uniformly from `world` workers."""
        if size < 2:
            return 0.0
        same_node = math.comb(min(self.workers_per_node, world) - 1, size - 1) / math.comb(world - 1, size - 1)
        intra = self.intra.allreduce_seconds(size, nbytes)
        inter = self.inter.allreduce_seconds(size, nbytes)
        return same_node * intra + (1 - same_node) * inter


@dataclass(frozen=True)
class Prediction:
    strategy: str
    throughput: float  # batches per second over all workers
    seconds_per_iteration: float  # N / throughput: the time for every worker to do one step, on average
    limit: float  # the physical limit, batches per second
    method: str  # "closed form" or "monte carlo"
    #: extra seconds each synchronization point costs beyond a lock-step strategy's: a work-queue
    #: epoch ends when the queue runs dry, and every worker first finishes the step it is in
    sync_wait: float = 0.0
    #: seconds each synchronization point spends averaging every replica (a world-wide all-reduce)
    sync_seconds: float = 0.0


def _ddp(
    workers: Sequence[ComputeProfile],
    allreduce: float,
    last_bucket: float,
    backward: float,
    steps: int,
    rng: random.Random,
) -> tuple[float, str]:
    """Seconds per iteration: the slowest worker's step, plus the all-reduce its backward pass cannot hide."""

    def exposed(slowest: float) -> float:
        return max(last_bucket, allreduce - backward * slowest)

    if all(w.deterministic for w in workers):
        slowest = max(w.mean for w in workers)
        return slowest + exposed(slowest), "closed form"
    total = 0.0
    for t in range(steps):
        slowest = max(w.sample(rng, t, r) for r, w in enumerate(workers))
        total += slowest + exposed(slowest)
    return total / steps, "monte carlo"


def _independent(workers: Sequence[ComputeProfile], comm: float, steps: int, rng: random.Random) -> tuple[float, str]:
    if all(w.deterministic for w in workers):
        return sum(1.0 / max(w.mean, comm) for w in workers), "closed form"
    rate = 0.0
    for r, w in enumerate(workers):
        rate += steps / sum(max(w.sample(rng, t, r), comm) for t in range(steps))
    return rate, "monte carlo"


def _residual_wait(
    workers: Sequence[ComputeProfile], rng: random.Random, trials: int = 200, slow_ratio: float = 2.0
) -> float:
    """Expected time from the moment the work queue runs dry until every worker has finished its step.

    A worker `slow_ratio` times slower than the others' mean leaves the epoch's tail to them
    (`WorkQueueSampler`): it claims no batch it would still be training when the queue runs dry,
    so only the other workers can be mid-step then.
    """
    means = [w.mean for w in workers]
    rates = sum(1.0 / m for m in means)

    def leaves_tail(mean: float) -> bool:
        others = rates - 1.0 / mean
        return len(means) > 1 and others > 0 and mean > slow_ratio * (len(means) - 1) / others

    in_flight = [(r, w) for r, w in enumerate(workers) if not leaves_tail(w.mean)] or list(enumerate(workers))
    horizon = 20 * max(w.mean for _, w in in_flight)
    total = 0.0
    for _ in range(trials):
        moment = rng.uniform(horizon / 2, horizon)
        worst = 0.0
        for r, w in in_flight:
            t, step = 0.0, 0
            while t <= moment:
                t += w.sample(rng, step, r)
                step += 1
            worst = max(worst, t - moment)
        total += worst
    return total / trials


def _lagged_gossip(
    workers: Sequence[ComputeProfile], schedule: Schedule, cluster: Cluster, nbytes: int, steps: int, rng: random.Random
) -> float:
    n = len(workers)
    finish = [0.0] * n
    costs: dict[tuple[int, ...], float] = {}
    rounds: dict[int, dict[tuple[int, ...], float]] = {}
    for t in range(steps):
        previous = list(finish)
        if cluster.node_links is not None and t % schedule.period not in rounds:  # groups share node links
            rounds[t % schedule.period] = cluster.round_seconds([g.members for g in schedule.groups(t)], nbytes)
        for i, w in enumerate(workers):
            peers = schedule.group_of(i, t).members
            if cluster.node_links is not None:
                cost = rounds[t % schedule.period][peers]
            else:
                if peers not in costs:
                    costs[peers] = cluster.allreduce_seconds(peers, nbytes)
                cost = costs[peers]
            ready = max(previous[j] for j in peers) + cost
            finish[i] = max(previous[i] + w.sample(rng, t, i), ready)
    return n * steps / max(finish)


def _background(
    workers: Sequence[ComputeProfile], cluster: Cluster, size: int, nbytes: int, steps: int, rng: random.Random
) -> tuple[float, str, float]:
    """Strategies whose exchanges run in a background thread, one at a time, skipped while one is in
    flight (`core.overlap.BackgroundAverager`): no step waits for an exchange, so each worker runs
    at its compute speed. What the links cost them is at a synchronization point, which first
    drains the exchanges in flight: the expected remaining time of the slowest one, where a worker's
    groups are `size` workers drawn at random (the remaining time of an exchange found in flight at a
    random moment is its length's second moment over twice its mean)."""
    throughput, method = _independent(workers, 0.0, steps, rng)
    n = len(workers)
    drain = 0.0
    for rank in range(n):
        lengths = []
        for _ in range(64):
            others = rng.sample([r for r in range(n) if r != rank], min(size, n) - 1)
            lengths.append(cluster.exchange_seconds(sorted([rank, *others]), nbytes))
        mean = sum(lengths) / len(lengths)
        if mean > 0:
            drain = max(drain, sum(x * x for x in lengths) / len(lengths) / (2 * mean))
    return throughput, method, drain


def predict(
    workers: Sequence[ComputeProfile],
    model_bytes: int,
    link: Link | None = None,
    strategies: Sequence[str] = STRATEGY_MODELS,
    group_size: int = 3,
    steps: int = 400,
    seed: int = 0,
    cluster: Cluster | None = None,
    topology: str = "ring",
    backward_fraction: float = 0.0,
    bucket_bytes: int = 25 * 2**20,
    grouping: str = "random",
) -> list[Prediction]:
    """Predicted throughput of each strategy on this cluster (see the module docstring).

    `link`: one link kind between every pair of workers (ignored when `cluster` is given).
    `topology`: decent_adam's. `backward_fraction`: the share of a step's compute that is the
    backward pass DDP overlaps its bucketed all-reduce with (about 2/3 on accelerators; 0 when the
    step time is padding, as with `SlowdownInjector`).
    """
    if not workers:
        raise ConfigurationError("the runtime model needs at least one worker")
    unknown = sorted(set(strategies) - set(STRATEGY_MODELS))
    if unknown:
        raise ConfigurationError(f"no runtime model for {unknown}; known: {', '.join(STRATEGY_MODELS)}")
    if not 0.0 <= backward_fraction <= 1.0:
        raise ConfigurationError(f"backward_fraction={backward_fraction} must be between 0 and 1")
    cluster = cluster or Cluster.uniform(link or Link())
    n = len(workers)
    everyone = range(n)
    limit = sum(1.0 / w.mean for w in workers)
    out = []
    residual: float | None = None  # shared by the work-queue strategies
    for name in strategies:
        rng = random.Random(seed)
        sync_wait = 0.0
        if name == "ddp":
            allreduce = cluster.allreduce_seconds(everyone, model_bytes)
            last_bucket = cluster.allreduce_seconds(everyone, min(bucket_bytes, model_bytes))
            seconds, method = _ddp(workers, allreduce, last_bucket, backward_fraction, steps, rng)
            throughput = n / seconds
        elif name == "decent_adam":
            schedule = make_topology(topology, n, cluster.workers_per_node)
            throughput = _lagged_gossip(workers, schedule, cluster, model_bytes, steps, rng)
            method = "monte carlo"
        elif name == "prague" and grouping == "static":
            schedule = StaticPolicy(n, min(group_size, n), seed, cluster.workers_per_node).schedule  # as the strategy
            throughput = _lagged_gossip(workers, schedule, cluster, model_bytes, steps, rng)
            method = "monte carlo"
        elif cluster.node_links is not None:
            size = 2 if name == "adpsgd" else min(group_size, n)
            throughput, method, drain = _background(workers, cluster, size, model_bytes, steps, rng)
            if residual is None:
                residual = _residual_wait(workers, random.Random(seed))
            sync_wait = max(residual, drain)
        else:
            size = 2 if name == "adpsgd" else min(group_size, n)
            exchange = cluster.random_group_seconds(n, size, model_bytes)
            throughput, method = _independent(workers, exchange, steps, rng)
            if residual is None:
                residual = _residual_wait(workers, random.Random(seed))
            sync_wait = residual
        # a synchronization point of a decentralized strategy averages every replica (`average_at_sync`)
        sync_seconds = (
            0.0 if name == "ddp" or cluster.node_links is None else cluster.exchange_seconds(everyone, model_bytes)
        )
        out.append(Prediction(name, throughput, n / throughput, limit, method, sync_wait, sync_seconds))
    return out


def recommend(predictions: Sequence[Prediction]) -> Prediction:
    """The strategy with the highest predicted throughput."""
    return max(predictions, key=lambda p: p.throughput)
