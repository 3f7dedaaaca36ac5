"""Communication topologies: fixed, time-varying schedules of weighted groups.

A `Schedule` is a cycle of *rounds*. Each round partitions the workers into groups, and
a group `R` mixes its members' models with the weights of an edge group: `W_ii = w` and
`W_ij = (1 - w) / (|R| - 1)` for the other members `j` (a group of one keeps its model,
`w = 1`). One round of gossip is then `x <- W x` with a symmetric, doubly stochastic `W`,
which is what the convergence theory of decentralized SGD and Adam needs. Every schedule is
validated when it is built.

Built-in topologies (`make_topology(name, ...)`):

- `complete`: one round, one group of everybody, `w = 1/N` (exact averaging, like All-Reduce).
- `ring`: one peer per round, alternating sides: even rounds pair `(0,1), (2,3), ...`, odd rounds
  pair `(1,2), (3,4), ..., (N-1,0)`. With an odd `N` one worker sits out each round (a different
  one in the two rounds), `w = 1/2`.
- `one_peer_exp`: one peer per round at exponentially growing distance: round `r` (of `log2 N`)
  pairs `j` with `j + 2^r` for the `j` whose bit `r` is 0 (`j XOR 2^r`); after `log2 N` rounds
  every model is the exact average. Needs a power of two.
- `alternating_exp_ring`: node-aware: workers sit on `M` nodes of `L = workers_per_node`
  consecutive ranks, and node pairs `(n, n + 2^i)` cycle through the `H = ceil(log2 M)` hops
  `1, 2, 4, ...` below `M` (a node whose partner would fall past the last node sits the crossing
  out). With `L > 2` rounds are staggered: in each round one worker of each node (local rank
  `t mod L`) averages with the worker of the same local rank on the partner node while the others
  average inside the node; the period is `lcm(H, L)`. With `L <= 2` rounds alternate an exact
  node average with every worker crossing (period `2 H`). On one node: the node average. See
  `alternating_exp_ring`.
- `static`: Prague's conflict-free static schedule for homogeneous clusters (`prague_static`).

A user schedule (`schedule_from_spec`) is a list of rounds; a round is a list of groups; a
group is a list of ranks (plain mean) or `{"members": [...], "self_weight": w}`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lightning_prague.core.errors import ConfigurationError

TOPOLOGIES = ("complete", "ring", "one_peer_exp", "alternating_exp_ring", "static")


@dataclass(frozen=True)
class WeightedGroup:
    """An edge group: `members` (sorted global ranks) and the weight each keeps of its own model.

    `joint`: the ranks (these members among them) whose round is decided together with this group's,
    all-or-nothing, and who take part in it only all together (a replica's columns, each averaging
    its own slice of one model: `lightning_prague.core.replicas.columns`); `()`: its own members."""

    members: tuple[int, ...]
    self_weight: float
    joint: tuple[int, ...] = ()

    @classmethod
    def uniform(cls, members: Sequence[int]) -> WeightedGroup:
        return cls(tuple(sorted(members)), 1.0 / len(members))

    @property
    def peer_weight(self) -> float:
        """`W_ij` for two different members."""
        return 0.0 if len(self.members) == 1 else (1.0 - self.self_weight) / (len(self.members) - 1)

    def coefficients(self) -> tuple[float, float]:
        """`(a, b)` with `x_i <- a x_i + b sum_{j in R} x_j`: one sum over the group computes the mix."""
        return self.self_weight - self.peer_weight, self.peer_weight


class Schedule:
    """A validated cycle of rounds of weighted groups over `world_size` workers."""

    def __init__(
        self,
        world_size: int,
        rounds: Sequence[Sequence[WeightedGroup]],
        name: str = "custom",
        coupled: Sequence[Sequence[int]] = (),
    ) -> None:
        """`coupled`: sets of ranks that depend on each other at every step outside the schedule (a
        replica's ranks average their gradients each step): they count as connected in every round."""
        if world_size < 1:
            raise ConfigurationError(f"a topology needs at least one worker, got world_size={world_size}")
        if not rounds:
            raise ConfigurationError(f"topology {name!r} has no rounds")
        self.world_size = world_size
        self.name = name
        self.rounds = [list(r) for r in rounds]
        self.coupled = tuple(tuple(sorted(set(ranks))) for ranks in coupled)
        self._coupled: dict[int, frozenset[int]] = {}
        for ranks in self.coupled:
            for rank in ranks:
                if not 0 <= rank < world_size or rank in self._coupled:
                    raise ConfigurationError(
                        f"topology {name!r}: coupled rank {rank} is outside a world of {world_size} or in two sets"
                    )
                self._coupled[rank] = frozenset(ranks)
        self._member_of = [self._validate_round(i, r) for i, r in enumerate(self.rounds)]
        self._coverage: int | None = None
        self.coverage  # noqa: B018  (validates that the rounds connect every worker)

    def _validate_round(self, index: int, groups: list[WeightedGroup]) -> dict[int, WeightedGroup]:
        where = f"topology {self.name!r}, round {index}"
        owner: dict[int, WeightedGroup] = {}
        for group in groups:
            if not group.members:
                raise ConfigurationError(f"{where}: an empty group")
            if len(set(group.members)) != len(group.members):
                raise ConfigurationError(f"{where}: group {list(group.members)} lists a rank twice")
            for rank in group.members:
                if not 0 <= rank < self.world_size:
                    raise ConfigurationError(
                        f"{where}: rank {rank} does not exist in a world of {self.world_size} workers"
                    )
                if rank in owner:
                    raise ConfigurationError(
                        f"{where}: rank {rank} is in two groups ({list(owner[rank].members)} and "
                        f"{list(group.members)}); each round must put every rank in exactly one group"
                    )
                owner[rank] = group
            if not 0.0 <= group.self_weight <= 1.0:
                raise ConfigurationError(
                    f"{where}: self_weight {group.self_weight} of {list(group.members)} is not in [0, 1]"
                )
            if len(group.members) == 1 and group.self_weight != 1.0:
                raise ConfigurationError(f"{where}: rank {group.members[0]} is alone, so its self_weight must be 1")
        missing = sorted(set(range(self.world_size)) - set(owner))
        if missing:
            raise ConfigurationError(
                f"{where}: ranks {missing} are in no group; each round must put every rank in exactly one group "
                "(a rank that sits a round out is a group of one)"
            )
        if not is_doubly_stochastic(self._matrix(groups)):
            raise ConfigurationError(f"{where}: the mixing matrix is not doubly stochastic")
        return owner

    def coupled_with(self, rank: int) -> tuple[int, ...]:
        """The ranks coupled with `rank` (`coupled`), itself among them, sorted; `(rank,)` if none."""
        return tuple(sorted(self._coupled.get(rank, (rank,))))

    def whole(self, members: Sequence[int]) -> tuple[int, ...]:
        """`members` without those whose coupled ranks (`coupled`) are not all among them: a replica
        with a rank gone takes part in nothing, its other ranks neither."""
        present = set(members)
        return tuple(m for m in members if self._coupled.get(m, frozenset()) <= present)

    @property
    def period(self) -> int:
        """Rounds before the schedule repeats."""
        return len(self.rounds)

    def groups(self, round_index: int) -> list[WeightedGroup]:
        return self.rounds[round_index % self.period]

    def group_of(self, rank: int, round_index: int) -> WeightedGroup:
        return self._member_of[round_index % self.period][rank]

    def _matrix(self, groups: Sequence[WeightedGroup]) -> torch.Tensor:
        w = torch.zeros(self.world_size, self.world_size, dtype=torch.float64)
        for group in groups:
            for i in group.members:
                for j in group.members:
                    w[i, j] = group.self_weight if i == j else group.peer_weight
        return w

    @property
    def coverage(self) -> int:
        """Rounds within which every worker depends on every other one; validates connectivity.

        A worker can issue round `t` only after mixing round `t - 1`, which needs every member
        of its group of round `t - 1` to have issued it. Going back `coverage` rounds from any
        worker and any round reaches every worker, so no worker can be more than `coverage`
        rounds ahead of any other (this bounds the rounds the end-of-phase protocol of
        `LaggedGossip` adds).
        """
        if self._coverage is None:
            self._coverage = max(
                self._rounds_to_reach_all(rank, start)
                for start in range(self.period)
                for rank in range(self.world_size)
            )
        return self._coverage

    def _rounds_to_reach_all(self, rank: int, start: int) -> int:
        reached = {rank}
        for depth in range(1, self.world_size * self.period + 1):
            round_index = start - depth
            reached = {m for r in reached for m in self.group_of(r, round_index).members}
            reached |= {m for r in reached for m in self._coupled.get(r, ())}
            if len(reached) == self.world_size:
                return depth
        if self.world_size == 1:
            return 0
        raise ConfigurationError(
            f"topology {self.name!r} never mixes ranks {sorted(set(range(self.world_size)) - reached)} with rank "
            f"{rank}: the groups of all its rounds together must connect every worker"
        )

    def mixing_matrix(self, round_index: int) -> torch.Tensor:
        """`W` of one round (float64, `N x N`): one gossip round maps the stacked models `x` to `W x`."""
        return self._matrix(self.groups(round_index))

    def __repr__(self) -> str:
        return f"Schedule({self.name!r}, world_size={self.world_size}, period={self.period})"


def is_doubly_stochastic(w: torch.Tensor, tol: float = 1e-9) -> bool:
    """Non-negative, and every row and every column sums to 1."""
    ones = torch.ones(w.shape[0], dtype=w.dtype)
    return bool(
        (w >= -tol).all() and torch.allclose(w.sum(0), ones, atol=tol) and torch.allclose(w.sum(1), ones, atol=tol)
    )


def _pairs_at_hop(units: int, hop: int) -> list[tuple[int, ...]]:
    """Units `j` and `j + hop` for the `j` with `(j // hop)` even; units without a partner stay alone."""
    groups: list[tuple[int, ...]] = []
    for j in range(units):
        if (j // hop) % 2 == 0:
            groups.append((j, j + hop) if j + hop < units else (j,))
    return groups


def complete(world_size: int) -> Schedule:
    return Schedule(world_size, [[WeightedGroup.uniform(range(world_size))]], "complete")


def ring(world_size: int) -> Schedule:
    n = world_size
    rounds = []
    for side in (0, 1):  # pairs (j, j+1) for even j, then for odd j (wrapping only when n is even)
        pairs = sorted({tuple(sorted((j, (j + 1) % n))) for j in range(side, n, 2) if j + 1 < n or n % 2 == 0})
        paired = {r for pair in pairs for r in pair}
        rounds.append(
            [WeightedGroup.uniform(p) for p in pairs] + [WeightedGroup((r,), 1.0) for r in range(n) if r not in paired]
        )
    return Schedule(n, rounds, "ring")


def one_peer_exp(world_size: int) -> Schedule:
    if world_size < 2 or world_size & (world_size - 1):
        raise ConfigurationError(
            f"topology='one_peer_exp' needs a power of two workers (2, 4, 8, ...), got {world_size}; "
            "use topology='ring' or 'alternating_exp_ring' for other world sizes"
        )
    rounds = []
    hop = 1
    while hop < world_size:
        rounds.append([WeightedGroup.uniform(pair) for pair in _pairs_at_hop(world_size, hop)])
        hop *= 2
    return Schedule(world_size, rounds, "one_peer_exp")


def _nodes(world_size: int, workers_per_node: int, name: str) -> int:
    if workers_per_node < 1 or world_size % workers_per_node:
        raise ConfigurationError(
            f"topology={name!r} needs whole nodes: {world_size} workers cannot be split into nodes of "
            f"workers_per_node={workers_per_node}"
        )
    return world_size // workers_per_node


def alternating_exp_ring(world_size: int, workers_per_node: int) -> Schedule:
    """Node-aware exponential ring, staggered: one worker of each node uses the inter-node link at
    a time while the others average inside the node.

    With `L` workers per node and `M` nodes, round `t` uses the hop `h = 2^(t mod H)`
    (`H` hops `1, 2, 4, ...` below `M`) and the local rank `t mod L`: that worker averages with
    the worker of the same local rank on the partner node (node pairs `(n, n + h)` as in
    `_pairs_at_hop`), and the node's other workers average together inside it. The crossing local
    rank moves by one per round, so every worker crosses once every `L` rounds and mixes with its
    whole node in the others; the period is `lcm(H, L)`.

    Why one at a time: the workers of a node share its link, so `k` of them crossing in one round
    make that round cost `k` models over the link. With one, every round sends exactly one model
    each way over each node's link, which overlaps a step's compute where the ring's crossing
    rounds send two at once (its pairs `(L - 1, L)` and `(N - 1, 0)` on two nodes; on more, one
    per neighbouring node) and its other rounds none: measured on an emulated cluster of 2 nodes x
    4 workers, half of the workers crossing at a time was slower than the ring, one at a time
    faster (docs/multi_node.md). With `L <= 2` the crossing worker would leave no node average
    to mix it with, so rounds alternate an exact node average with every worker crossing
    (unstaggered); on one node, the node average alone.
    """
    nodes = _nodes(world_size, workers_per_node, "alternating_exp_ring")
    per = workers_per_node
    hops = []
    while 2 ** len(hops) < nodes:
        hops.append(2 ** len(hops))
    whole_nodes = [WeightedGroup.uniform(range(n * per, (n + 1) * per)) for n in range(nodes)]
    if not hops:
        return Schedule(world_size, [whole_nodes], "alternating_exp_ring")

    def crossing(locals_: list[int], hop: int) -> list[WeightedGroup]:
        return [
            WeightedGroup.uniform([n * per + local for n in pair])
            for pair in _pairs_at_hop(nodes, hop)
            for local in locals_
        ]

    rounds: list[list[WeightedGroup]] = []
    if per <= 2:
        for hop in hops:
            rounds += [whole_nodes, crossing(list(range(per)), hop)]
        return Schedule(world_size, rounds, "alternating_exp_ring")
    for t in range(math.lcm(len(hops), per)):
        window = [t % per]
        staying = [local for local in range(per) if local not in window]
        groups = [WeightedGroup.uniform([n * per + local for local in staying]) for n in range(nodes)]
        rounds.append(groups + crossing(window, hops[t % len(hops)]))
    return Schedule(world_size, rounds, "alternating_exp_ring")


PRAGUE_STATIC_PERIOD = 4


def static_schedule(world_size: int, workers_per_node: int, round_index: int) -> list[tuple[int, ...]]:
    """The groups of one round of Prague's static schedule; they partition `range(world_size)`.

    Workers are laid out node by node (`workers_per_node` = `L` consecutive ranks per node, the
    last node may be smaller). The cycle has 4 rounds and is the reference schedule for 4 workers
    per node, generalized to any `L`:

    * rounds 1 and 3: each node averages all its workers (cheap intra-node links);
    * round `2c` (`c` = 0, 1): the workers of local rank `c` on every node form one
      inter-node group; meanwhile, on each node, local rank `c + 1` sits out and the others pair
      up in local-rank order starting after it (for `L = 4`: `(2, 3)` in round 0, `(3, 0)`
      in round 2, as the reference); a worker left over stays alone.

    Local ranks 0 and 1 carry all inter-node traffic; the others mix with them through the node
    averages.
    """
    if workers_per_node < 1:
        raise ConfigurationError(f"workers_per_node must be at least 1, got {workers_per_node}")
    nodes = [
        list(range(start, min(start + workers_per_node, world_size)))
        for start in range(0, world_size, workers_per_node)
    ]
    phase = round_index % PRAGUE_STATIC_PERIOD
    if phase % 2 == 1:
        return [tuple(node) for node in nodes]
    column = phase // 2
    groups: list[tuple[int, ...]] = []
    inter = [node[column] for node in nodes if column < len(node)]
    if inter:
        groups.append(tuple(inter))
    for node in nodes:
        size = len(node)
        crossing = column if column < size else None
        idle = (column + 1) % size if size > 1 and (column + 1) % size != crossing else None
        order = [(column + 2 + i) % size for i in range(size)]  # starts after the one sitting out
        rest = [node[i] for i in order if i not in (crossing, idle)]
        groups.extend(tuple(sorted(rest[i : i + 2])) for i in range(0, len(rest), 2))
        if idle is not None:
            groups.append((node[idle],))
    return groups


def prague_static(world_size: int, workers_per_node: int) -> Schedule:
    """`static_schedule` as a `Schedule` (plain means)."""
    rounds = [
        [WeightedGroup.uniform(g) for g in static_schedule(world_size, workers_per_node, r)]
        for r in range(PRAGUE_STATIC_PERIOD)
    ]
    return Schedule(world_size, rounds, "static")


def schedule_from_spec(world_size: int, spec: Sequence[Sequence[Any]]) -> Schedule:
    """A user schedule: rounds of groups, each a list of ranks or `{"members": [...], "self_weight": w}`."""
    rounds = []
    for index, round_spec in enumerate(spec):
        groups = []
        for group in round_spec:
            if isinstance(group, dict):
                unknown = set(group) - {"members", "self_weight"}
                if unknown or "members" not in group:
                    raise ConfigurationError(
                        f"schedule round {index}: a group is a list of ranks or a mapping with 'members' and "
                        f"optionally 'self_weight'; got {group!r}"
                    )
                members = [int(r) for r in group["members"]]
                weight = group.get("self_weight")
                groups.append(
                    WeightedGroup.uniform(members)
                    if weight is None
                    else WeightedGroup(tuple(sorted(members)), float(weight))
                )
            elif isinstance(group, (list, tuple)):
                groups.append(WeightedGroup.uniform([int(r) for r in group]) if group else WeightedGroup((), 1.0))
            else:
                raise ConfigurationError(f"schedule round {index}: a group must be a list of ranks, got {group!r}")
        rounds.append(groups)
    return Schedule(world_size, rounds, "schedule")


def make_topology(
    name: str, world_size: int, workers_per_node: int = 1, schedule: Sequence[Sequence[Any]] | None = None
) -> Schedule:
    """A topology by name, or the user's `schedule` when one is given (then `name` is ignored)."""
    if schedule is not None:
        return schedule_from_spec(world_size, schedule)
    if name == "complete":
        return complete(world_size)
    if name == "ring":
        return ring(world_size)
    if name == "one_peer_exp":
        return one_peer_exp(world_size)
    if name == "alternating_exp_ring":
        return alternating_exp_ring(world_size, workers_per_node)
    if name == "static":
        return prague_static(world_size, workers_per_node)
    raise ConfigurationError(f"topology={name!r} is unknown; choose one of {', '.join(TOPOLOGIES)} or pass a schedule")
