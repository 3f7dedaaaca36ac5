"""A runtime model: how fast All-Reduce and each strategy train on a given cluster, before you run them.

Inputs are per-worker compute-time distributions (`ComputeProfile`, as measured by
`StragglerMonitor` or assumed), the model size and the `Cluster`: workers per node and
two link kinds, intra-node and inter-node (bandwidth, latency), or one link per node; a group inside
one node uses the intra-node link, a group spanning nodes is bounded by the links it crosses.
Outputs are per-strategy `Prediction`s of throughput in batches per second over all workers, plus
what each synchronization point costs (`sync_wait`, `sync_seconds`):

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
  in flight then). With per-node links it also drains the exchanges in flight (`_background`:
  the residual of the slowest one, every worker in a group at once, so groups crossing a node's
  link share it), and two strategies drain more than that:

  * `adpsgd` (`_passive_drain`): a passive worker answers the exchanges of every active that
    picked it one at a time, in order (`PassiveResponder`), so actives that share a passive queue
    behind each other, and the drain waits for the longest queue. Measured on the emulated
    cluster with a slow node (both actives' neighbour): its drain took 3.4 s, more than a whole
    exchange over that node's link (3.1 s then), where one exchange's residual is half of one.
  * `partial_reduce` (`_leftover_exchange`): after its last step every worker asks for a group
    once more; groups form in the order the requests come (`FirstReadyPolicy`), and the
    `n mod group_size` workers left over wait until nobody else can come, i.e. until the others
    have drained, and only then average: one more exchange after the drain. Measured on 2 nodes x 4
    workers, groups of 3: a leftover pair started when the last other worker arrived, each epoch.

- `decent_adam` and `prague` with its `static` schedule: gossip on a fixed schedule with a
  one-step lag: the max-plus recursion
  `T_i(t) = max(T_i(t-1) + c_i(t), max_{j in G_i(t)} T_j(t-1) + exchange(G_i(t)))` simulated by
  Monte Carlo, each round's groups sharing the links they cross. The meeting that ends a phase is
  simulated too (`_phase_end`, `sync_wait`): nothing overlaps the round issued after the last step,
  so the meeting waits for it; and where the first worker waits `IDLE_AFTER` seconds for the last
  (`core.exchange.gossip`), the waiting workers run idle rounds, which every worker then runs to the end.
  Measured with node4 behind a 10 Mbit/s link: two rounds over node4's link (5.7 s) after the
  last worker's last step, where the model had none.

Links. `Link.bandwidth` is what a link carries when something keeps it busy (DDP's pipelined ring,
or several transfers at once); `Link.single_flow` what one point-to-point transfer gets by itself.
Through a shaped link's queue a lone TCP flow each way stalls now and then (losses at the full
queue, recovery), and the link idles meanwhile: on the emulated links one model each way took 2.0
to 4.1 s, 2.9 s on average (71% of 10 Mbit/s; 0.23 to 0.42 s, 63-73% of 100 Mbit/s), while DDP's
all-reduce got 92-95%, and two exchanges crossing 100 Mbit/s at once took 0.44 s together, 95%. So a
link carrying `k` transfers of `b` bytes at once takes `max(k b / bandwidth, b / single_flow)`,
and the library's ring (groups above `ALL_TO_ALL_MAX`) runs at `bandwidth`.

Replica groups (`replica_size=K`, issue 50's design: `docs/design/replicas.md`). `K` consecutive
ranks train one model synchronously, as DDP does, and the strategy runs with the replica as its unit.
A replica is modelled as one worker (`ReplicaProfile`): each of its steps trains `K` batches and
takes its slowest rank's compute plus the part of its gradient all-reduce (among its ranks, inside
a node on the `intra` link) that its backward pass cannot hide, the same formula as `ddp`'s. The
replicas then see a cluster of their own (`Cluster.of_replicas`): `workers_per_node / K` of them on
a node, or one replica spanning several nodes that leaves through all of their links. When
replicas average, rank `i` of each averages only slice `i` of the model with rank `i` of the others
(its column), the `K` slices side by side: together one model leaves each replica, where without
replicas each of its `K` ranks sends a whole one. Under the work-queue strategies the columns average
apart, each when its own exchange is done, so a replica puts its slices together after every step:
one more all-reduce of the model among its ranks, which nothing hides. So replicas pay where the
nodes' links are the bottleneck, and cost where one rank is slow inside a fast node (its replica
waits for it each step).

The physical limit is the sum of the workers' speeds, `sum_i 1 / E[c_i]`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_prague.core.comm.groups import ALL_TO_ALL_MAX
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.exchange.gossip import IDLE_AFTER
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.core.grouping.policies import StaticPolicy
from lightning_prague.core.grouping.topology import Schedule, make_topology
from lightning_prague.core.replicas.layout import ReplicaLayout

STRATEGY_MODELS = ("ddp", "prague", "partial_reduce", "adpsgd", "decent_adam")
#: the most idle rounds `_phase_end` simulates at one meeting
MAX_IDLE_ROUNDS = 1000


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


class ReplicaProfile:
    """`K` ranks training one model synchronously, modelled as one worker whose step trains `K`
    batches: its slowest member's compute, plus what of the replica's gradient all-reduce
    (`allreduce` seconds, `last_bucket` at least) the backward pass (`backward` of the slowest step)
    cannot hide. `first`: the first member's rank (each member's periodic phase is its rank).
    `reassembly`: seconds after each step in which the replica puts its slices together (a work-queue
    strategy's replica averages them apart: `lightning_prague.core.replicas.reassembly`)."""

    #: Monte Carlo draws of a replica's mean step when its members' steps vary (fixed seed: repeatable)
    MEAN_DRAWS = 4000

    def __init__(
        self,
        members: Sequence[ComputeProfile],
        allreduce: float,
        last_bucket: float = 0.0,
        backward: float = 0.0,
        first: int = 0,
        reassembly: float = 0.0,
    ) -> None:
        if not members:
            raise ConfigurationError("a replica has at least one rank")
        self.members = tuple(members)
        self.allreduce, self.last_bucket, self.backward, self.first = allreduce, last_bucket, backward, first
        self.reassembly = reassembly
        self.deterministic = all(m.deterministic for m in self.members)
        if self.deterministic:
            self.mean = self._step(max(m.mean for m in self.members))
        else:
            rng = random.Random(first)
            self.mean = sum(self.sample(rng, t) for t in range(self.MEAN_DRAWS)) / self.MEAN_DRAWS

    def _step(self, slowest: float) -> float:
        if len(self.members) < 2:
            return slowest
        return slowest + max(self.last_bucket, self.allreduce - self.backward * slowest) + self.reassembly

    def sample(self, rng: random.Random, step: int, phase: int = 0) -> float:
        """One step of the replica (`phase` is ignored: each member's phase is its own rank)."""
        return self._step(max(m.sample(rng, step, self.first + j) for j, m in enumerate(self.members)))


#: a worker the model simulates: one rank, or a replica of several
Worker = ComputeProfile | ReplicaProfile


@dataclass(frozen=True)
class Link:
    """A network link: `latency` seconds per message and `bandwidth` bytes per second.

    `single_flow`: bytes per second one point-to-point transfer gets over it by itself (`None`: the
    bandwidth). A lone transfer (one TCP flow each way) can leave a link idle while it stalls
    (losses at a full queue, recovery), which a pipelined ring or several flows at once do not: a
    link carrying `k` transfers of `b` bytes at once takes `max(k b / bandwidth, b / single_flow)`.
    """

    bandwidth: float = 1e9
    latency: float = 1e-4
    single_flow: float | None = None

    @property
    def flow_bandwidth(self) -> float:
        return min(self.bandwidth, self.single_flow) if self.single_flow else self.bandwidth

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

    def of_replicas(self, size: int, nodes: int) -> Cluster:
        """The cluster that replicas of `size` consecutive ranks see as their workers, on `nodes` nodes:
        `workers_per_node / size` replicas on a node, or, where a replica spans `size / workers_per_node`
        whole nodes, one per node whose link is the sum of theirs (its `size` slices leave through
        all of them at once)."""
        per_node = self.workers_per_node
        if size == 1:
            return self
        if per_node % size == 0:
            return Cluster(per_node // size, self.intra, self.inter, self.node_links)
        if size % per_node:
            raise ConfigurationError(
                f"replica_size={size} neither divides nor is a multiple of the {per_node} workers of a node"
            )
        span = size // per_node

        def joined(links: Sequence[Link]) -> Link:
            return Link(sum(link.bandwidth for link in links), max(link.latency for link in links),
                        sum(link.flow_bandwidth for link in links))  # fmt: skip

        links = None
        if self.node_links is not None:
            own = [self.link_of(node) for node in range(nodes)]
            links = tuple(joined(own[r * span : (r + 1) * span]) for r in range(nodes // span))
        return Cluster(1, self.intra, joined([self.inter] * span), links)

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
        """The library's group sum among `members` (`core.comm.groups`): all-to-all up to `ALL_TO_ALL_MAX`
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
            link = self.link_of(node)
            share = (sharing or {}).get(node, 1)
            if k <= ALL_TO_ALL_MAX:  # one flow per pair and direction: each at most one flow's rate
                crossing = here * (k - here) * nbytes
                seconds = max(crossing * share / link.bandwidth, nbytes / link.flow_bandwidth)
            else:  # a pipelined ring keeps the link busy
                seconds = 2 * (k - 1) / k * nbytes * share / link.bandwidth
            worst = max(worst, seconds)
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
    #: consecutive ranks that train one model synchronously and decentralize as one (1: every rank alone)
    replica_size: int = 1

    @property
    def name(self) -> str:
        """The strategy, with its replica groups where it has them."""
        return self.strategy if self.replica_size == 1 else f"{self.strategy} (replicas of {self.replica_size})"


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


def _independent(workers: Sequence[Worker], comm: float, steps: int, rng: random.Random) -> tuple[float, str]:
    if all(w.deterministic for w in workers):
        return sum(1.0 / max(w.mean, comm) for w in workers), "closed form"
    rate = 0.0
    for r, w in enumerate(workers):
        rate += steps / sum(max(w.sample(rng, t, r), comm) for t in range(steps))
    return rate, "monte carlo"


def _residual_wait(workers: Sequence[Worker], rng: random.Random, trials: int = 200, slow_ratio: float = 2.0) -> float:
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
    workers: Sequence[Worker],
    schedule: Schedule,
    cluster: Cluster,
    nbytes: int,
    steps: int,
    rng: random.Random,
    idle_after: float = IDLE_AFTER,
) -> tuple[float, float]:
    """Throughput of gossip on `schedule` with a one-step lag, and the end of its phase.

    Round `t` is issued at `I_i(t)`, the end of step `t - 1` (round 0 as the phase starts); its group
    is done at `D_G(t) = max_{j in G} I_j(t) + exchange(G)`; step `t` ends, issuing round `t + 1`, at
    `max(I_i(t) + c_i, D_G(t))`. Returns the batches per second and the phase end: seconds from the
    last worker's last step until every worker has mixed its last round (`_phase_end`), the mean
    over the schedule's period (a phase may end at any of its rounds).
    """
    n = len(workers)
    costs: dict[tuple[int, ...], float] = {}
    rounds: dict[int, dict[tuple[int, ...], float]] = {}

    def cost(peers: tuple[int, ...], t: int) -> float:
        if cluster.node_links is not None:  # the round's groups share node links
            if t % schedule.period not in rounds:
                rounds[t % schedule.period] = cluster.round_seconds([g.members for g in schedule.groups(t)], nbytes)
            return rounds[t % schedule.period][peers]
        if peers not in costs:
            costs[peers] = cluster.allreduce_seconds(peers, nbytes)
        return costs[peers]

    def done(issued: Sequence[float], i: int, t: int) -> float:
        peers = schedule.group_of(i, t).members
        return max(issued[j] for j in peers) + cost(peers, t)

    finish = [0.0] * n
    ends = []  # a phase ends anywhere in the schedule's period: the mean over its rounds
    for t in range(steps + schedule.period - 1):
        previous = list(finish)
        for i, w in enumerate(workers):
            finish[i] = max(previous[i] + w.sample(rng, t, i), done(previous, i, t))
        if t == steps - 1:
            throughput = n * steps / max(finish)
        if t >= steps - 1:
            ends.append(_phase_end(list(finish), t + 1, done, idle_after))
    return throughput, sum(ends) / len(ends)


def _phase_end(
    issued: list[float], last_round: int, done: Callable[[Sequence[float], int, int], float], idle_after: float
) -> float:
    """Seconds from the last worker's arrival at the meeting that ends a gossip phase until the phase
    is over (`core.exchange.gossip.LaggedGossip`, `GroupWorker.synchronize`).

    Each worker arrives after its last step with round `last_round` in flight (issued at
    `issued[i]`); nothing overlaps that round any more, so the meeting waits for it. If the first
    worker waits `idle_after` seconds before the last one arrives, every waiting worker runs idle
    rounds (mixing only, each as soon as its previous round is done) until the last arrives; then
    the ranks settle on the largest round any of them issued and all run their rounds to it.
    `done(issued, i, t)`: when worker `i`'s group of round `t` is done, given every worker's issue
    time of round `t`.
    """
    n = len(issued)
    last = max(issued)
    trigger = min(issued) + idle_after
    by_round = {last_round: list(issued)}
    final = last_round
    if trigger < last:  # idle rounds until the release (a round not issued by then: math.inf)
        while final < last_round + MAX_IDLE_ROUNDS:  # (rounds that cost nothing would never end)
            previous = by_round[final]
            following = []
            for i in range(n):
                ready = max(done(previous, i, final), trigger)
                following.append(ready if ready < last else math.inf)
            if all(math.isinf(x) for x in following):
                break
            final += 1
            by_round[final] = following
    for t in range(last_round + 1, final + 1):  # after the settling meeting every worker runs to `final`
        previous = by_round[t - 1]
        by_round[t] = [max(done(previous, i, t - 1), last) if math.isinf(x) else x for i, x in enumerate(by_round[t])]
    end = max(done(by_round[final], i, final) for i in range(n))
    return end - last


def _background(
    workers: Sequence[Worker], cluster: Cluster, size: int, nbytes: int, steps: int, rng: random.Random
) -> tuple[float, str, float]:
    """Strategies whose exchanges run in a background thread, one at a time, skipped while one is in
    flight (`core.exchange.overlap.BackgroundAverager`): no step waits for an exchange, so each worker runs
    at its compute speed. What the links cost them is at a synchronization point, which first
    drains the exchanges in flight: the expected remaining time of the slowest one, where a worker's
    groups are `size` workers drawn at random (the remaining time of an exchange found in flight at a
    random moment is its length's second moment over twice its mean)."""
    throughput, method = _independent(workers, 0.0, steps, rng)
    n = len(workers)
    size = min(size, n)
    lengths: dict[int, list[float]] = {rank: [] for rank in range(n)}
    for _ in range(64):  # every worker in a group at once: groups crossing a node's link share it
        order = rng.sample(range(n), n)
        groups = [sorted(order[i : i + size]) for i in range(0, n - size + 1, size)]
        for group, seconds in cluster.round_seconds(groups, nbytes).items():
            for rank in group:
                lengths[rank].append(seconds)
    drain = 0.0
    for rank in range(n):
        if not lengths[rank]:
            continue
        mean = sum(lengths[rank]) / len(lengths[rank])
        if mean > 0:
            drain = max(drain, sum(x * x for x in lengths[rank]) / len(lengths[rank]) / (2 * mean))
    return throughput, method, drain


def _leftover_exchange(cluster: Cluster, n: int, size: int, nbytes: int, rng: random.Random, draws: int = 64) -> float:
    """Partial Reduce's last exchange of a phase (`FirstReadyPolicy`): after its last step every worker
    asks for a group once more; groups of `size` form in the order the requests come, and the
    `n mod size` workers left over wait until nobody else can come, i.e. until every other worker
    has drained and arrived, and only then average among themselves. That exchange (of random
    members) follows the drain of the others."""
    left = n % size
    if left < 2:
        return 0.0
    return sum(cluster.exchange_seconds(sorted(rng.sample(range(n), left)), nbytes) for _ in range(draws)) / draws


def _passive_drain(
    workers: Sequence[Worker],
    cluster: Cluster,
    graph: BipartiteGraph,
    nbytes: int,
    steps: int,
    rng: random.Random,
    runs: int = 16,
    moments: int = 32,
) -> float:
    """AD-PSGD's drain at a synchronization point: the expected time until every exchange issued
    before it is done (`core.exchange.overlap.PassiveResponder`, `BackgroundAverager`).

    After each step an active worker whose exchange is done starts one with a random passive
    neighbour (`GossipPolicy`); a passive worker serves the exchanges issued to it one at a time,
    in order, so actives that pick the same passive queue behind each other, and a passive behind
    a slow link holds every active that picked it. Simulated `runs` times over `steps` steps of the
    actives; at `moments` random moments of each (the work queue running dry) every active finishes
    its step, may start one more exchange, and drains: the synchronization point waits for the last
    queue to empty.
    """
    active = sorted(r for r in range(len(workers)) if graph.is_active(r))
    service: dict[tuple[int, int], float] = {}
    total, count = 0.0, 0
    for _ in range(runs):
        jobs: list[tuple[float, float]] = []  # (issued, done) of every exchange
        step_ends: dict[int, list[float]] = {}
        for a in active:
            t, ends = 0.0, []
            for step in range(steps):
                t += workers[a].sample(rng, step, a)
                ends.append(t)
            step_ends[a] = ends
        free: dict[int, float] = {}  # when each passive has served its queue
        busy_until = dict.fromkeys(active, 0.0)
        for t, a in sorted((end, rank) for rank in active for end in step_ends[rank]):
            if busy_until[a] > t:
                continue  # one exchange in flight at a time
            p = rng.choice(graph.neighbors[a])
            pair = (min(a, p), max(a, p))
            if pair not in service:
                service[pair] = cluster.exchange_seconds(pair, nbytes)
            free[p] = busy_until[a] = max(t, free.get(p, 0.0)) + service[pair]
            jobs.append((t, busy_until[a]))
        horizon = min(ends[-1] for ends in step_ends.values())
        for _ in range(moments if jobs else 0):
            moment = rng.uniform(horizon / 4, horizon * 3 / 4)
            # the end of the step each active is in: its last chance to start an exchange before draining
            cutoff = max(next((end for end in step_ends[a] if end >= moment), moment) for a in active)
            total += max(0.0, max(done for issued, done in jobs if issued <= cutoff) - cutoff)
            count += 1
    return total / count if count else 0.0


def _replicas(
    workers: Sequence[ComputeProfile],
    cluster: Cluster,
    size: int,
    model_bytes: int,
    bucket_bytes: int,
    backward_fraction: float,
    apart: bool = False,
) -> tuple[list[Worker], Cluster]:
    """The units a decentralized strategy runs over, and the cluster they see: the ranks themselves,
    or replicas of `size` consecutive ranks (`ReplicaProfile`, `Cluster.of_replicas`). `apart`: the
    replica's ranks average their slices apart (a work-queue strategy) and put them together after
    every step, one more all-reduce of the model among them."""
    if size == 1:
        return list(workers), cluster
    layout = ReplicaLayout(len(workers), size)
    if layout.replicas < 2:
        raise ConfigurationError(
            f"replica_size={size} makes the {len(workers)} workers one replica, which is DDP ('ddp' predicts it)"
        )
    units: list[Worker] = []
    for replica in range(layout.replicas):
        ranks = layout.ranks_of(replica)
        allreduce = cluster.allreduce_seconds(ranks, model_bytes)
        last_bucket = cluster.allreduce_seconds(ranks, min(bucket_bytes, model_bytes))
        units.append(
            ReplicaProfile(
                [workers[r] for r in ranks],
                allreduce,
                last_bucket,
                backward_fraction,
                ranks[0],
                allreduce if apart else 0.0,
            )
        )
    nodes = -(-len(workers) // cluster.workers_per_node)
    return units, cluster.of_replicas(size, nodes)


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
    replica_size: int = 1,
    pace: str = "round",
) -> list[Prediction]:
    """Predicted throughput of each strategy on this cluster (see the module docstring).

    `link`: one link kind between every pair of workers (ignored when `cluster` is given).
    `topology`: decent_adam's. `backward_fraction`: the share of a step's compute that is the
    backward pass DDP overlaps its bucketed all-reduce with (about 2/3 on accelerators; 0 when the
    step time is padding, as with `SlowdownInjector`); a replica overlaps its own all-reduce the same
    way. `replica_size`: the decentralized strategies run over replicas of that many consecutive
    ranks (`ddp` is always every rank in lock-step). `pace`: that of `decent_adam`'s and the static
    schedule's rounds (`"own"`: each unit trains on while its round is in flight, from the work queue).
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
    limit = sum(1.0 / w.mean for w in workers)
    lockstep, on = _replicas(workers, cluster, replica_size, model_bytes, bucket_bytes, backward_fraction)
    apart, _ = _replicas(workers, cluster, replica_size, model_bytes, bucket_bytes, backward_fraction, apart=True)
    count = len(lockstep)
    out = []
    residual: float | None = None  # shared by the work-queue strategies
    for name in strategies:
        rng = random.Random(seed)
        if name == "ddp":
            everyone = range(n)
            allreduce = cluster.allreduce_seconds(everyone, model_bytes)
            last_bucket = cluster.allreduce_seconds(everyone, min(bucket_bytes, model_bytes))
            seconds, method = _ddp(workers, allreduce, last_bucket, backward_fraction, steps, rng)
            out.append(Prediction(name, n / seconds, seconds, limit, method))
            continue
        sync_wait = 0.0
        scheduled = name == "decent_adam" or (name == "prague" and grouping == "static")
        units = lockstep if scheduled else apart
        if scheduled and pace == "own":  # every unit at its own pace, a round of two in flight at a time
            exchange = on.random_group_seconds(count, 2, model_bytes)
            throughput, method = _independent(units, exchange, steps, rng)
            if residual is None:
                residual = _residual_wait(units, random.Random(seed))
            sync_wait = residual
        elif name == "decent_adam":
            schedule = make_topology(topology, count, on.workers_per_node)
            throughput, sync_wait = _lagged_gossip(units, schedule, on, model_bytes, steps, rng)
            method = "monte carlo"
        elif name == "prague" and grouping == "static":
            schedule = StaticPolicy(count, min(group_size, count), seed, on.workers_per_node).schedule  # as prague
            throughput, sync_wait = _lagged_gossip(units, schedule, on, model_bytes, steps, rng)
            method = "monte carlo"
        elif on.node_links is not None:
            size = 2 if name == "adpsgd" else min(group_size, count)
            throughput, method, drain = _background(units, on, size, model_bytes, steps, rng)
            if name == "adpsgd" and count > 1:  # passive workers queue the actives' exchanges
                drain = _passive_drain(units, on, BipartiteGraph.ring(count), model_bytes, steps, rng)
            elif name == "partial_reduce":  # and the workers left over from full groups average last
                drain += _leftover_exchange(on, count, size, model_bytes, rng)
            if residual is None:
                residual = _residual_wait(units, random.Random(seed))
            sync_wait = max(residual, drain)
        else:
            size = 2 if name == "adpsgd" else min(group_size, count)
            exchange = on.random_group_seconds(count, size, model_bytes)
            throughput, method = _independent(units, exchange, steps, rng)
            if residual is None:
                residual = _residual_wait(units, random.Random(seed))
            sync_wait = residual
        throughput *= replica_size  # a unit's step trains a batch on each of its ranks
        # a synchronization point of a decentralized strategy averages every replica (`average_at_sync`)
        # (every rank takes part in it, as without replicas: one model on each rank's link)
        sync_seconds = 0.0 if cluster.node_links is None else cluster.exchange_seconds(range(n), model_bytes)
        out.append(Prediction(name, throughput, n / throughput, limit, method, sync_wait, sync_seconds, replica_size))
    return out


def recommend(predictions: Sequence[Prediction]) -> Prediction:
    """The strategy with the highest predicted throughput."""
    return max(predictions, key=lambda p: p.throughput)
