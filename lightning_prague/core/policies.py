"""Grouping policies: which peers a worker averages with when it asks the coordinator for a group.

A policy is pure, deterministic logic (seeded ``random.Random``); it never talks to the network.
The :class:`~lightning_prague.core.generator.GroupGenerator` calls it in one global order, which is
what makes any policy deadlock-free.

``random``
    Prague's Group Generator: the requester plus ``group_size - 1`` peers drawn uniformly from the
    workers that are still training.
``buffer``
    Group Buffer: a random partition of all workers into groups of ``group_size`` (one group takes
    ``group_size + 1`` rather than leave a worker alone) is kept; a
    requester gets the buffered group that contains it. When that group has already been handed
    out, a fresh partition is drawn. Groups handed out from one partition are disjoint, so they
    do not conflict.
``division``
    Group Division: workers are split into fixed divisions of consecutive ranks (``division_size``,
    by default the workers per node on several nodes, otherwise half the world); groups are drawn
    inside the requester's division, except every ``cross_period``-th request, which draws from
    the whole world so that divisions keep mixing.
``static``
    A conflict-free schedule for homogeneous clusters (:func:`static_schedule`): round ``r``
    partitions the workers; a worker's ``r``-th request gets its group of round ``r``.
``first_ready``
    Partial Reduce: the first ``group_size`` workers that report ready form a group; nobody is
    grouped while busy (see :class:`FirstReadyPolicy`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from lightning_prague.core.errors import ConfigurationError

Group = tuple[int, ...]

POLICY_NAMES = ("random", "buffer", "division", "static", "first_ready")


class GroupingPolicy:
    """Chooses the members of a group for a worker that asks for one."""

    #: a policy whose groups are shared by a round: the generator issues each (round, group) once
    issues_per_round = False
    #: a policy that waits for other workers to be ready instead of answering at once
    waits_for_ready = False

    def __init__(self, world_size: int, group_size: int, seed: int = 0) -> None:
        self.world_size = world_size
        self.group_size = group_size
        self.rng = random.Random(seed)

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        """Members (sorted, containing ``requester``) or ``None`` when no group can be formed.

        ``available`` lists the workers still training (not parked at a synchronization point),
        in rank order, and always contains ``requester``.
        """
        raise NotImplementedError

    def _draw(self, requester: int, candidates: Sequence[int]) -> Group | None:
        others = [r for r in candidates if r != requester]
        if not others:
            return None
        peers = self.rng.sample(others, min(self.group_size - 1, len(others)))
        return tuple(sorted([requester, *peers]))


class RandomPolicy(GroupingPolicy):
    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        return self._draw(requester, available)


class BufferPolicy(GroupingPolicy):
    def __init__(self, world_size: int, group_size: int, seed: int = 0) -> None:
        super().__init__(world_size, group_size, seed)
        self._buffer: dict[int, Group] = {}

    def _refill(self) -> None:
        ranks = list(range(self.world_size))
        self.rng.shuffle(ranks)
        groups = [tuple(sorted(ranks[i : i + self.group_size])) for i in range(0, len(ranks), self.group_size)]
        if len(groups) > 1 and len(groups[-1]) == 1:  # never leave a worker alone: it joins the previous group
            last = groups.pop()
            groups[-1] = tuple(sorted(groups[-1] + last))
        self._buffer = {rank: group for group in groups for rank in group}

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        if requester not in self._buffer:
            self._refill()
        group = self._buffer[requester]
        for rank in group:
            self._buffer.pop(rank, None)
        alive = set(available)
        members = tuple(r for r in group if r in alive)
        return members if len(members) >= 2 else None


class DivisionPolicy(GroupingPolicy):
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
        return self._draw(requester, [r for r in available if self.division_of(r) == home])


def static_schedule(world_size: int, workers_per_node: int, round_index: int) -> list[Group]:
    """The groups of one round of the static schedule; they partition ``range(world_size)``.

    Workers are laid out node by node (``workers_per_node`` consecutive ranks per node, the last
    node may be smaller). The cycle has ``2 * workers_per_node`` rounds and generalizes the
    reference schedule for 4 workers per node:

    * odd rounds: each node averages all its workers (cheap intra-node links);
    * even round ``2c``: the workers of local rank ``c`` on every node form one inter-node group,
      and on each node the other local ranks pair up, the pairing rotated by ``c`` so that every
      pair of local ranks meets over the cycle; a worker left over stays alone this round.
    """
    if workers_per_node < 1:
        raise ConfigurationError(f"workers_per_node must be at least 1, got {workers_per_node}")
    nodes = [
        list(range(start, min(start + workers_per_node, world_size)))
        for start in range(0, world_size, workers_per_node)
    ]
    phase = round_index % (2 * workers_per_node)
    if phase % 2 == 1:
        return [tuple(node) for node in nodes]
    column = phase // 2
    groups: list[Group] = []
    inter = [node[column] for node in nodes if column < len(node)]
    if inter:
        groups.append(tuple(inter))
    for node in nodes:
        rest = [r for i, r in enumerate(node) if i != column]
        shift = column % len(rest) if rest else 0
        rest = rest[shift:] + rest[:shift]
        groups.extend(tuple(sorted(rest[i : i + 2])) for i in range(0, len(rest), 2))
    return groups


class StaticPolicy(GroupingPolicy):
    issues_per_round = True

    def __init__(self, world_size: int, group_size: int, seed: int = 0, workers_per_node: int | None = None) -> None:
        super().__init__(world_size, group_size, seed)
        # on one node there are no slow links to avoid: use virtual nodes of group_size workers
        self.workers_per_node = (
            workers_per_node if workers_per_node and 2 <= workers_per_node < world_size else group_size
        )

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        alive = set(available)
        for group in static_schedule(self.world_size, self.workers_per_node, round_index):
            if requester in group:
                members = tuple(r for r in group if r in alive)
                return members if len(members) >= 2 else None
        raise AssertionError("static schedule is not a partition")  # pragma: no cover


class FirstReadyPolicy(GroupingPolicy):
    """Partial Reduce's controller: group the first ``group_size`` ready workers, in arrival order.

    ``select`` is given the ready workers (the generator keeps the FIFO); it returns a group once
    ``group_size`` of them are waiting, or all remaining workers when fewer are still training.
    """

    waits_for_ready = True

    def select(self, requester: int, round_index: int, available: Sequence[int]) -> Group | None:
        raise NotImplementedError("first_ready groups are formed by GroupGenerator from its ready FIFO")


def make_policy(
    name: str,
    world_size: int,
    group_size: int,
    seed: int = 0,
    workers_per_node: int | None = None,
) -> GroupingPolicy:
    """Build a policy by name; unknown names and impossible sizes raise :class:`ConfigurationError`."""
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
        return FirstReadyPolicy(world_size, group_size, seed)
    raise ConfigurationError(
        f"grouping={name!r} is not a known grouping policy; choose one of {', '.join(POLICY_NAMES)}"
    )
