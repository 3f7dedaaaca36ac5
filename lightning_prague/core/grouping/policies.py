"""Grouping policies: which peers a worker averages with when it asks the coordinator for a group.

A policy is pure, deterministic logic (seeded `random.Random`); it never talks to the network.
The `GroupGenerator` calls it in one global order, which is
what makes any policy deadlock-free.

- `random`: Prague's Group Generator: the requester plus `group_size - 1` peers drawn uniformly from
  the workers that are still training.
- `buffer`: Group Buffer: each round (a worker's `r`-th request since the last synchronization
  point) has a random partition of all workers into groups of `group_size` (one group takes
  `group_size + 1` rather than leave a worker alone); a requester gets the group of its round's
  partition that contains it, which may already have been handed out to another member (then nothing
  new is issued). Groups of one partition are disjoint, so workers that keep pace never conflict
  (see `BufferPolicy`).
- `division`: Group Division: workers are split into fixed divisions of consecutive ranks
  (`division_size`, by default the workers per node on several nodes, otherwise half the world);
  groups are drawn inside the requester's division, except every `cross_period`-th request, which
  draws from the whole world so that divisions keep mixing.
- `static`: A conflict-free schedule for homogeneous clusters (`static_schedule`): round `r`
  partitions the workers; a worker's `r`-th request gets its group of round `r`.
- `first_ready`: Partial Reduce: the first `group_size` workers that report ready form a group;
  nobody is grouped while busy, and no set of workers stays isolated (see `FirstReadyPolicy`).
- `columns`: for replica groups, one of `random`, `buffer`, `division` or `first_ready` per index of
  a replica, over the replicas: every group is within a column (`ColumnPolicy`; see
  `lightning_prague.core.grouping.columns`).

`GossipPolicy` (AD-PSGD's active/passive pairs) is built from a graph rather than by name.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.core.grouping.staleness import staleness_weights
from lightning_prague.core.grouping.syncgraph import SyncGraph
from lightning_prague.core.grouping.topology import Schedule, WeightedGroup, prague_static
from lightning_prague.core.records import (
    MAX_INT,
    BadRecord,
    Check,
    Record,
    integer,
    json_object,
    list_of,
    number,
    one_of,
    text,
)

#: the most workers a policy may name
MAX_WORKERS = 1 << 20

Group = tuple[int, ...]

POLICY_NAMES = ("random", "buffer", "division", "static", "first_ready")
WEIGHTINGS = ("uniform", "staleness")


class GroupingPolicy:
    """Chooses the members of a group for a worker that asks for one.

    The `GroupGenerator` asks every policy the same things, whatever its kind:

    - `pools_ready`: whether a request is answered at once (`select`: this request's group, or none)
      or joins a pool of ready workers from which groups form (`form`, asked whenever the pool or
      the workers around it change: a report, a worker parking at a synchronization point or
      leaving). A policy implements the one of the two its kind uses; the other forms no group;
    - `on_ready`: a worker reported ready (its request counts, whatever comes of it);
    - `weights`: how the members of a group average;
    - `restart`: every worker met at a synchronization point.
    """

    #: groups form from the pool of ready workers (`form`) rather than one per request (`select`)
    pools_ready = False
    #: a policy whose groups are shared by a round: the generator issues each (round, group) once
    issues_per_round = False
    #: every member the policy names takes part, lagging or not (a fixed schedule)
    keeps_stragglers = False

    #: the policy's name in its spec (`spec`, `policy_from_spec`); a policy without one cannot be sent
    kind = ""

    def __init__(self, world_size: int, group_size: int, seed: int = 0) -> None:
        self.world_size = world_size
        self.group_size = group_size
        self.seed = seed
        self.rng = random.Random(seed)

    def spec(self) -> dict[str, Any]:
        """This policy as a JSON object, from which `policy_from_spec` rebuilds it (in the control plane).

        Raises `ConfigurationError` for a policy that is not one of this package's kinds: the
        control plane never runs code that a training process sends, only the policies it knows.
        """
        if "kind" not in type(self).__dict__ or SPEC_RECORDS.get(self.kind) is None:  # a subclass: code of its own
            raise ConfigurationError(
                f"{type(self).__name__} cannot be sent to the control plane: it rebuilds only the policies "
                f"{', '.join(SPEC_RECORDS)} from their specs"
            )
        return {"kind": self.kind, "world_size": self.world_size, "group_size": self.group_size, "seed": self.seed}

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        """Members (sorted, containing `requester`) or `None` when no group can be formed.

        `available` lists the workers that may be drawn (still training, not parked at a
        synchronization point) and always contains `requester`; the generator passes a sequence
        with constant-time membership, so a policy's cost per request need not grow with N.
        A policy that pools ready workers (`pools_ready`) forms no group for one request: `None`.
        """
        return None

    def form(self, ready: Sequence[int], busy: Sequence[int]) -> list[list[int]]:
        """Groups to form now from the pool of `ready` workers (in the order they reported); `busy`
        (training, not in the pool) will report later. A returned group of one worker means that
        worker gets no group (nobody else can come); the others stay in the pool.

        A policy that answers each request (`pools_ready` false) has no pool: no group.
        """
        return []

    def on_ready(self, rank: int | None = None) -> None:
        """Worker `rank` reported ready (before it joins the pool, for a policy that pools); `None`: a
        worker not named (a policy that runs by columns counts it in each)."""

    def weights(self, versions: Sequence[int]) -> list[float] | None:
        """Per-member averaging weights for members at these model versions; `None` is the plain mean."""
        return None

    def restart(self, mixed: bool = False) -> None:
        """Every worker met at a synchronization point: rounds count from 0 again.

        `mixed`: the meeting was released and averaged every worker's model (globally).
        """

    def _draw(self, requester: int, candidates: Sequence[int]) -> Group | None:
        """The requester and up to `group_size - 1` distinct others, uniformly at random."""
        others_count = len(candidates) - (1 if requester in candidates else 0)
        k = min(self.group_size - 1, others_count)
        if k <= 0:
            return None
        if 4 * k >= others_count:  # few candidates: sample from the list of them
            peers: set[int] | list[int] = self.rng.sample([r for r in candidates if r != requester], k)
        else:  # many: draw until k distinct others, expected O(k) whatever the number of candidates
            peers = set()
            while len(peers) < k:
                rank = candidates[self.rng.randrange(len(candidates))]
                if rank != requester:
                    peers.add(rank)
        return tuple(sorted([requester, *peers]))


class RandomPolicy(GroupingPolicy):
    kind = "random"

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        return self._draw(requester, available)


class BufferPolicy(GroupingPolicy):
    """Group Buffer: round `r` of every worker is one random partition of all workers.

    A worker's `r`-th request (since the last synchronization point) is answered with the group
    of partition `r` that contains it; the first member to ask issues it, the others' requests of
    that round are answered with the same group (already in their inboxes), so a round costs one
    group per member, not one per request. Groups of one partition are disjoint: workers that keep
    pace never conflict. Partitions are drawn when first needed and only the newest
    `depth` are kept; a worker far behind (a straggler) gets a freshly drawn one.
    """

    issues_per_round = True
    kind = "buffer"

    def __init__(self, world_size: int, group_size: int, seed: int = 0, depth: int = 64) -> None:
        super().__init__(world_size, group_size, seed)
        self.depth = depth
        self._partitions: dict[int, dict[int, Group]] = {}

    def _partition(self) -> dict[int, Group]:
        ranks = list(range(self.world_size))
        self.rng.shuffle(ranks)
        groups = [tuple(sorted(ranks[i : i + self.group_size])) for i in range(0, len(ranks), self.group_size)]
        if len(groups) > 1 and len(groups[-1]) == 1:  # never leave a worker alone: it joins the previous group
            last = groups.pop()
            groups[-1] = tuple(sorted(groups[-1] + last))
        return {rank: group for group in groups for rank in group}

    def partition(self, round_index: int) -> dict[int, Group]:
        """Rank -> its group in round `round_index`'s partition."""
        partition = self._partitions.get(round_index)
        if partition is None:
            partition = self._partitions[round_index] = self._partition()
            if len(self._partitions) > self.depth:
                del self._partitions[min(self._partitions)]
        return partition

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        members = tuple(r for r in self.partition(round_index)[requester] if r in available)
        return members if len(members) >= 2 else None

    def restart(self, mixed: bool = False) -> None:
        self._partitions.clear()

    def spec(self) -> dict[str, Any]:
        return {**super().spec(), "depth": self.depth}


class DivisionPolicy(GroupingPolicy):
    kind = "division"

    def __init__(
        self, world_size: int, group_size: int, seed: int = 0, division_size: int | None = None, cross_period: int = 4
    ) -> None:
        super().__init__(world_size, group_size, seed)
        self.division_size = division_size or max(group_size, (world_size + 1) // 2)
        if self.division_size < 2:
            raise ConfigurationError(f"division_size must be at least 2, got {self.division_size}")
        if cross_period < 1:
            raise ConfigurationError(f"cross_period must be at least 1, got {cross_period}")
        self.cross_period = cross_period
        self._requests = 0

    def division_of(self, rank: int) -> int:
        return rank // self.division_size

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        self._requests += 1
        if self._requests % self.cross_period == 0:
            return self._draw(requester, available)
        home = self.division_of(requester)
        start = home * self.division_size
        division = range(start, min(start + self.division_size, self.world_size))
        return self._draw(requester, [r for r in division if r in available])

    def spec(self) -> dict[str, Any]:
        return {**super().spec(), "division_size": self.division_size, "cross_period": self.cross_period}


class SchedulePolicy(GroupingPolicy):
    """Groups from a fixed `Schedule`: a worker's `r`-th request
    gets its group of round `r`. The coordinator averages these groups with plain means."""

    issues_per_round = True
    keeps_stragglers = True
    kind = "schedule"

    def __init__(self, schedule: Schedule, seed: int = 0) -> None:
        super().__init__(schedule.world_size, max(len(g.members) for r in schedule.rounds for g in r), seed)
        self.schedule = schedule

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        members = tuple(r for r in self.schedule.group_of(requester, round_index).members if r in available)
        return members if len(members) >= 2 else None

    def spec(self) -> dict[str, Any]:
        rounds = [[[list(g.members), g.self_weight] for g in groups] for groups in self.schedule.rounds]
        spec = {**super().spec(), "name": self.schedule.name, "rounds": rounds}
        if self.schedule.coupled:
            spec["coupled"] = [list(ranks) for ranks in self.schedule.coupled]
        return spec


class StaticPolicy(SchedulePolicy):
    """Prague's static schedule (`static_schedule`)."""

    def __init__(self, world_size: int, group_size: int, seed: int = 0, workers_per_node: int | None = None) -> None:
        # on one node there are no slow links to avoid: use virtual nodes of group_size workers
        per_node = workers_per_node if workers_per_node and 2 <= workers_per_node < world_size else group_size
        super().__init__(prague_static(world_size, per_node), seed)
        self.group_size = group_size
        self.workers_per_node = per_node

    kind = "static"

    def spec(self) -> dict[str, Any]:
        return {**GroupingPolicy.spec(self), "workers_per_node": self.workers_per_node}


class FirstReadyPolicy(GroupingPolicy):
    """Partial Reduce's controller: group the first `group_size` ready workers, in arrival order.

    The generator keeps the FIFO of ready workers (`pools_ready`) and calls `form`. A worker left
    waiting is grouped as soon as `group_size` workers wait, or with whoever waits when nobody else
    can come.

    **No update isolation.** A `SyncGraph` records which
    workers have mixed since the current window began. Once `mixing_window` ready reports have
    arrived in a window and the graph is still not connected, groups must *bridge* components:
    the oldest ready worker is grouped with ready workers of other components first; if every
    ready worker is in one component while a worker of another is busy, the oldest
    `group_size - 1` are held for it (later arrivals still group among themselves). Each bridging
    group joins at least two components, so at most `N - 1` of them connect the graph, and a
    held worker waits for at most one step of a worker of another component. The window restarts
    whenever the graph becomes connected (and at synchronization points that average globally).
    The graph ignores time order; what holds in time order: a worker's model as of any moment
    reaches every other training worker through time-ordered groups within `N - 1` windows,
    since each window's connected graph joins the set of workers already reached to one more
    (docs/partial_reduce.md states the bound in reports and what was measured). Parked workers
    are outside the windows; synchronization points mix them.

    `weighting`: `"uniform"` (plain mean) or `"staleness"` (see
    `staleness_weights`, decay `alpha`).
    """

    pools_ready = True
    kind = "first_ready"

    def __init__(
        self,
        world_size: int,
        group_size: int,
        seed: int = 0,
        weighting: str = "uniform",
        alpha: float = 0.9,
        mixing_window: int | None = None,
    ) -> None:
        super().__init__(world_size, group_size, seed)
        if weighting not in WEIGHTINGS:
            raise ConfigurationError(f"weighting={weighting!r} is invalid; choose one of {', '.join(WEIGHTINGS)}")
        if not 0.0 < alpha < 1.0:
            raise ConfigurationError(f"alpha={alpha} is invalid: the staleness decay must be strictly between 0 and 1")
        window = 10 * world_size if mixing_window is None else mixing_window
        if window < 1:
            raise ConfigurationError(f"mixing_window={mixing_window} is invalid: it must be at least 1 ready report")
        self.weighting = weighting
        self.alpha = alpha
        self.mixing_window = window
        self.graph = SyncGraph(world_size)
        self.reports = 0  # ready reports in the current window
        self.windows_closed = 0
        self.bridging_groups = 0

    def weights(self, versions: Sequence[int]) -> list[float] | None:
        """Per-member weights for members with these versions; `None` means the plain mean."""
        return staleness_weights(versions, self.alpha) if self.weighting == "staleness" else None

    def on_ready(self, rank: int | None = None) -> None:
        """One more ready report in the current window."""
        self.reports += 1

    def restart(self, mixed: bool = False) -> None:
        """Every worker met; if a global average `mixed` them, a new window begins (the window counts
        only the mixing of workers that train: parked workers are outside it)."""
        if mixed:
            self.restart_window()

    def spec(self) -> dict[str, Any]:
        return {
            **super().spec(),
            "weighting": self.weighting,
            "alpha": self.alpha,
            "mixing_window": self.mixing_window,
        }

    def restart_window(self) -> None:
        self.graph.reset()
        self.reports = 0

    def form(self, ready: Sequence[int], busy: Sequence[int]) -> list[list[int]]:
        """Groups to form now from `ready` (FIFO order); `busy` will report later.

        A returned group of one worker means that worker gets no group (nobody else can come).
        """
        queue = list(ready)
        groups: list[list[int]] = []
        while queue:
            group = self._next_group(queue, busy)
            if group is None:
                break
            groups.append(group)
            queue = [r for r in queue if r not in group]
            self._record(group, [*queue, *busy])
        return groups

    def _record(self, group: list[int], others: Sequence[int]) -> None:
        if len(group) < 2:
            return
        self.graph.join(group)
        if self.graph.connected([*group, *others]):
            self.windows_closed += 1
            self.restart_window()

    def _next_group(self, queue: list[int], busy: Sequence[int]) -> list[int] | None:
        size = self.group_size
        if self.reports >= self.mixing_window and not self.graph.connected([*queue, *busy]):
            bridge = self._bridge(queue, busy)
            if bridge != "normal":
                return bridge
        if len(queue) >= size:
            return queue[:size]
        return list(queue) if not busy else None

    def _bridge(self, queue: list[int], busy: Sequence[int]) -> list[int] | None | str:
        """A group spanning components, `None` to hold the queue, or `"normal"` if bridging is impossible."""
        size = self.group_size
        find = self.graph.find
        group = [queue[0]]
        seen = {find(queue[0])}
        for r in queue[1:]:
            if len(group) < size and find(r) not in seen:
                group.append(r)
                seen.add(find(r))
        for r in queue[1:]:
            if len(group) < size and r not in group:
                group.append(r)
        if len(seen) > 1 and (len(group) == size or not busy):
            self.bridging_groups += 1
            return group
        if any(find(b) not in seen for b in busy):  # someone of another component will report: hold for it
            rest = queue[size - 1 :]
            return rest[:size] if len(rest) >= size else None
        return "normal"


class GossipPolicy(GroupingPolicy):
    """AD-PSGD's pairing: an active worker averages with a random passive neighbour.

    Passive workers never ask (they only answer, from a background thread), so every group is an
    (active, passive) pair of the `BipartiteGraph`.
    """

    kind = "gossip"

    def __init__(self, graph: BipartiteGraph, seed: int = 0) -> None:
        super().__init__(graph.world_size, 2, seed)
        self.graph = graph

    def spec(self) -> dict[str, Any]:
        edges = [[a, b] for a, peers in self.graph.neighbors.items() for b in peers if a < b]
        return {**super().spec(), "edges": edges}

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        if not self.graph.is_active(requester):
            return None
        peers = [n for n in self.graph.neighbors[requester] if n in available]
        if not peers:
            return None
        return tuple(sorted((requester, self.rng.choice(peers))))


#: the policies `column_policy` builds by name for a column of `ColumnPolicy`: those that draw groups over
#: any set of workers
COLUMN_KINDS = ("random", "buffer", "division", "first_ready")
#: the kinds a column may run: those, and AD-PSGD's pairs on a bipartite graph over the replicas
COLUMN_POLICY_KINDS = (*COLUMN_KINDS, "gossip")
#: the most ranks a replica may have in `ColumnPolicy`: each is a column with a policy (and a `random.Random`,
#: about 3 KB) of its own, so a spec from a socket builds at most this many
MAX_REPLICA_SIZE = 1 << 12
_REPLICA_SIZE = integer(1, MAX_REPLICA_SIZE)


class Candidates(Sequence[int]):
    """Ranks (or replicas) that may be drawn into a group: a sequence (for sampling) with O(1) membership,
    what `GroupingPolicy.select` expects."""

    __slots__ = ("ranks", "_members")

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self._members = frozenset(ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._members

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self.ranks[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks)


class ColumnPolicy(GroupingPolicy):
    """For `R` replicas of `replica_size = K` consecutive ranks: column `i` (rank `i` of every
    replica) runs its own policy `inner[i]` over the replica numbers `0 .. R - 1`, so every group
    is within one column (why: `lightning_prague.core.grouping.columns`, which also builds one,
    `column_policy`). It lives here, beside `policy_from_spec`, which rebuilds it from its spec.

    Rank `r K + i` is replica `r`'s index `i` (`ReplicaLayout`'s mapping, which the grouping logic
    does not import). All columns run the same kind of policy over the same number of replicas
    with the same group size, so the generator sees one policy: the columns' `pools_ready`,
    `issues_per_round`, `keeps_stragglers`, `group_size` and `weights`. `seed` seeds only this
    policy's own `rng` (the generator draws from it), by default column 0's seed.
    """

    kind = "columns"

    def __init__(self, inner: Sequence[GroupingPolicy], replica_size: int, seed: int | None = None) -> None:
        columns = list(inner)
        if not _REPLICA_SIZE(replica_size):
            raise ConfigurationError(
                f"replica_size must be a number of ranks from 1 to {MAX_REPLICA_SIZE}, not {replica_size!r}"
            )
        if len(columns) != replica_size:
            raise ConfigurationError(
                f"a replica of {replica_size} ranks has {replica_size} columns, but {len(columns)} policies were given"
            )
        first = columns[0]
        if first.kind not in COLUMN_POLICY_KINDS:
            raise ConfigurationError(
                f"a column cannot run a {type(first).__name__} (kind {first.kind!r}); "
                f"it runs one of {', '.join(COLUMN_POLICY_KINDS)}"
            )

        def shape(policy: GroupingPolicy) -> str:
            return f"{type(policy).__name__} over {policy.world_size} replicas, groups of {policy.group_size}"

        for index, column in enumerate(columns):
            if shape(column) != shape(first):
                raise ConfigurationError(
                    f"column {index}'s policy ({shape(column)}) differs from column 0's ({shape(first)}): "
                    f"every column runs the same policy"
                )
        super().__init__(first.world_size * replica_size, first.group_size, first.seed if seed is None else seed)
        self.columns = columns
        self.replica_size = replica_size
        self.replicas = first.world_size
        self.pools_ready = first.pools_ready
        self.issues_per_round = first.issues_per_round
        self.keeps_stragglers = first.keeps_stragglers

    def _ranks(self, replicas: Sequence[int], index: int) -> list[int]:
        """The ranks of column `index` in these replicas (in their order)."""
        return [replica * self.replica_size + index for replica in replicas]

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        """The requester's column's policy draws among the replicas whose rank of its index is available."""
        replica, index = divmod(requester, self.replica_size)
        candidates = Candidates([r for r in range(self.replicas) if r * self.replica_size + index in available])
        members = self.columns[index].select(replica, round_index, candidates)
        return None if members is None else tuple(sorted(self._ranks(members, index)))

    def form(self, ready: Sequence[int], busy: Sequence[int]) -> list[list[int]]:
        """Each column forms its groups from its own ready ranks (in the order they reported)."""
        size = self.replica_size
        ready_by: list[list[int]] = [[] for _ in range(size)]
        busy_by: list[list[int]] = [[] for _ in range(size)]
        for rank in ready:
            ready_by[rank % size].append(rank // size)
        for rank in busy:
            busy_by[rank % size].append(rank // size)
        groups: list[list[int]] = []
        for index, column in enumerate(self.columns):
            if ready_by[index]:  # a column with nobody waiting forms nothing
                groups.extend(self._ranks(group, index) for group in column.form(ready_by[index], busy_by[index]))
        return groups

    def on_ready(self, rank: int | None = None) -> None:
        """The rank's column counts its report (every column, when the rank is not named)."""
        if rank is None:
            for column in self.columns:
                column.on_ready()
        else:
            self.columns[rank % self.replica_size].on_ready(rank // self.replica_size)

    def weights(self, versions: Sequence[int]) -> list[float] | None:
        """Column 0's weights: they depend only on the versions, the same in every column."""
        return self.columns[0].weights(versions)

    def restart(self, mixed: bool = False) -> None:
        """Every rank met: every column restarts."""
        for column in self.columns:
            column.restart(mixed)

    def spec(self) -> dict[str, Any]:
        """Column 0's spec stands for all: column `i` is the same policy seeded `seed + i`.

        Raises `ConfigurationError` for columns that are not (they could not be rebuilt from it).
        """
        inner = self.columns[0].spec()
        for index, column in enumerate(self.columns):
            if column.spec() != {**inner, "seed": inner["seed"] + index}:
                raise ConfigurationError(
                    f"column {index}'s policy is not column 0's seeded {inner['seed'] + index}: the columns "
                    f"cannot be sent to the control plane as one spec"
                )
        return {**super().spec(), "replica_size": self.replica_size, "inner": inner}


_WORLD = integer(1, MAX_WORKERS)
_BASE = {"kind": text(32), "world_size": _WORLD, "group_size": _WORLD, "seed": integer(-MAX_INT, MAX_INT)}
_GROUP = Check(
    lambda g: (
        isinstance(g, list)
        and len(g) == 2
        and list_of(integer(0, MAX_WORKERS - 1), MAX_WORKERS)(g[0])
        and number(0.0, 1.0)(g[1])
    ),
    "[members, self_weight]",
)
#: what each kind's spec holds (`GroupingPolicy.spec`), checked before any policy is built from it
SPEC_RECORDS: dict[str, Record] = {
    "random": Record("the 'random' policy", _BASE),
    "buffer": Record("the 'buffer' policy", {**_BASE, "depth": integer(1, 1 << 16)}),
    "division": Record(
        "the 'division' policy", {**_BASE, "division_size": _WORLD, "cross_period": integer(1, 1 << 20)}
    ),
    "schedule": Record(
        "the 'schedule' policy",
        {**_BASE, "name": text(64), "rounds": list_of(list_of(_GROUP, MAX_WORKERS), 1 << 12)},
        {"coupled": list_of(list_of(integer(0, MAX_WORKERS - 1), MAX_WORKERS), MAX_WORKERS)},
    ),
    "static": Record("the 'static' policy", {**_BASE, "workers_per_node": _WORLD}),
    "first_ready": Record(
        "the 'first_ready' policy",
        {**_BASE, "weighting": one_of(*WEIGHTINGS), "alpha": number(0.0, 1.0), "mixing_window": integer(1, MAX_INT)},
    ),
    "gossip": Record(
        "the 'gossip' policy", {**_BASE, "edges": list_of(list_of(integer(0, MAX_WORKERS - 1), 2), 1 << 20)}
    ),
    # `inner`: column 0's spec, checked as a spec of its own (`_columns_from_spec`)
    "columns": Record("the 'columns' policy", {**_BASE, "replica_size": _REPLICA_SIZE, "inner": json_object()}),
}


def policy_from_spec(spec: Any) -> GroupingPolicy:
    """The policy a spec (`GroupingPolicy.spec()`, sent by a training process) describes.

    The spec is untrusted input: it is checked against its kind's record first (`SPEC_RECORDS`),
    then the policy's own constructor validates it as it validates a user's options. Raises
    `BadRecord` or `ConfigurationError` naming what is wrong.
    """
    kind = spec.get("kind") if isinstance(spec, dict) else None
    record = SPEC_RECORDS.get(kind) if isinstance(kind, str) else None
    if record is None:
        raise BadRecord(f"a grouping policy of unknown kind {str(kind)[:40]!r}; known: {', '.join(SPEC_RECORDS)}")
    args = dict(record.check(spec))
    del args["kind"]
    world, size, seed = args.pop("world_size"), args.pop("group_size"), args.pop("seed")
    if not 2 <= size <= world:
        raise ConfigurationError(f"a grouping policy's group_size={size} is invalid for {world} workers")
    if kind == "schedule":
        rounds = [
            [WeightedGroup(tuple(members), float(weight)) for members, weight in groups] for groups in args["rounds"]
        ]
        return SchedulePolicy(Schedule(world, rounds, args["name"], args.get("coupled", ())), seed)
    if kind == "gossip":
        return GossipPolicy(BipartiteGraph(world, [tuple(edge) for edge in args["edges"]]), seed)
    if kind == "static":
        return StaticPolicy(world, size, seed, args["workers_per_node"])
    if kind == "columns":
        return _columns_from_spec(world, size, seed, args["replica_size"], args["inner"])
    classes: dict[str, Any] = {
        "random": RandomPolicy,
        "buffer": BufferPolicy,
        "division": DivisionPolicy,
        "first_ready": FirstReadyPolicy,
    }
    return classes[kind](world, size, seed, **args)


def _columns_from_spec(world: int, size: int, seed: int, replica_size: int, inner: dict[str, Any]) -> GroupingPolicy:
    """A `ColumnPolicy` from its checked fields: `inner` (column 0's spec) is checked as a spec of one of
    the kinds a column runs (never `columns` again), and the sizes must agree before the other
    `replica_size - 1` columns (column `i`: `inner` with its seed plus `i`) are built."""
    inner_kind = inner.get("kind")
    if not isinstance(inner_kind, str) or inner_kind not in COLUMN_POLICY_KINDS:
        raise BadRecord(
            f"the 'columns' policy: its inner policy is of kind {str(inner_kind)[:40]!r}, "
            f"but a column runs one of {', '.join(COLUMN_POLICY_KINDS)}"
        )
    first = policy_from_spec(inner)
    if first.world_size * replica_size != world or first.group_size != size:
        raise ConfigurationError(
            f"the 'columns' policy is for {world} workers in groups of {size}, but its inner policy over "
            f"{first.world_size} replicas of replica_size={replica_size} ranks makes {first.world_size * replica_size} "
            f"workers in groups of {first.group_size}"
        )
    columns = [first, *(policy_from_spec({**inner, "seed": first.seed + i}) for i in range(1, replica_size))]
    return ColumnPolicy(columns, replica_size, seed)


def make_policy(
    name: str,
    world_size: int,
    group_size: int,
    seed: int = 0,
    workers_per_node: int | None = None,
    **first_ready: Any,
) -> GroupingPolicy:
    """Build a policy by name; unknown names and impossible sizes raise `ConfigurationError`."""
    if world_size < 2:
        raise ConfigurationError(f"decentralized training needs at least 2 workers, got world_size={world_size}")
    if not 2 <= group_size <= world_size:
        raise ConfigurationError(
            f"group_size={group_size} is invalid for {world_size} workers: it must be between 2 and the number of "
            f"workers ({world_size}); use group_size={min(3, world_size)} or add workers"
        )
    if name == "random":
        return RandomPolicy(world_size, group_size, seed)
    if name == "buffer":
        return BufferPolicy(world_size, group_size, seed)
    if name == "division":
        division = workers_per_node if workers_per_node and 2 <= workers_per_node < world_size else None
        return DivisionPolicy(world_size, group_size, seed, division_size=division)
    if name == "static":
        return StaticPolicy(world_size, group_size, seed, workers_per_node)
    if name == "first_ready":
        return FirstReadyPolicy(world_size, group_size, seed, **first_ready)
    raise ConfigurationError(
        f"grouping={name!r} is not a known grouping policy; choose one of {', '.join(POLICY_NAMES)}"
    )
