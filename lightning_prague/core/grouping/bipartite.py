"""Neighbour graphs for AD-PSGD: bipartite, so that gossip cannot deadlock.

Active workers start every exchange, always with a passive neighbour; passive workers only answer.
An exchange therefore never waits on a worker that is itself waiting on an exchange it started.

The default graph puts even ranks on the active side and odd ranks on the passive side, and links
each rank to the ranks at ring distance 1 and `1 + 2^i` (3, 5, 9, ...), which are odd, so every
edge joins an even rank to an odd one. With an odd number of workers, going around the ring past
the last rank lands on a rank of the *same* parity; those wrap-around edges are left out, so for
odd world sizes the ring is cut open between rank `N-1` and rank 0 (a path, still connected
through the distance-1 edges).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from lightning_prague.core.errors import ConfigurationError


class BipartiteGraph:
    """A connected, undirected, bipartite neighbour graph with a chosen active side."""

    def __init__(self, world_size: int, edges: Iterable[tuple[int, int]]) -> None:
        if world_size < 2:
            raise ConfigurationError(f"a gossip graph needs at least 2 workers, got world_size={world_size}")
        self.world_size = world_size
        neighbors: dict[int, set[int]] = {r: set() for r in range(world_size)}
        for a, b in edges:
            a, b = int(a), int(b)
            if not (0 <= a < world_size and 0 <= b < world_size):
                raise ConfigurationError(f"edge ({a}, {b}) names a rank outside 0..{world_size - 1}")
            if a == b:
                raise ConfigurationError(f"edge ({a}, {b}) joins a rank to itself")
            neighbors[a].add(b)
            neighbors[b].add(a)
        self.neighbors: dict[int, list[int]] = {r: sorted(n) for r, n in neighbors.items()}
        self.active = self._two_colour()

    def _two_colour(self) -> frozenset[int]:
        """The side containing rank 0 is active; fails if the graph is not connected or not bipartite."""
        side = {0: 0}
        todo = deque([0])
        while todo:
            r = todo.popleft()
            for n in self.neighbors[r]:
                if n not in side:
                    side[n] = 1 - side[r]
                    todo.append(n)
                elif side[n] == side[r]:
                    raise ConfigurationError(
                        f"the gossip graph is not bipartite: ranks {r} and {n} are neighbours but must be on the same "
                        "side (active or passive); AD-PSGD needs every edge to join an active and a passive worker"
                    )
        missing = sorted(set(range(self.world_size)) - side.keys())
        if missing:
            raise ConfigurationError(
                f"the gossip graph is not connected: ranks {missing} cannot be reached from rank 0, so their models "
                "would never mix with the others"
            )
        return frozenset(r for r, s in side.items() if s == 0)

    def is_active(self, rank: int) -> bool:
        return rank in self.active

    def edges(self) -> list[tuple[int, int]]:
        return [(a, b) for a, ns in self.neighbors.items() for b in ns if a < b]

    @classmethod
    def ring(cls, world_size: int) -> BipartiteGraph:
        """The default graph of the module docstring."""
        if world_size < 2:
            raise ConfigurationError(f"a gossip graph needs at least 2 workers, got world_size={world_size}")
        hops = [1]
        i = 1
        while 1 + 2**i < world_size:
            hops.append(1 + 2**i)
            i += 1
        edges = []
        for r in range(world_size):
            for h in hops:
                n = (r + h) % world_size
                if r % 2 != n % 2:  # only wrap-around edges of odd world sizes fail this
                    edges.append((r, n))
        return cls(world_size, edges)

    @classmethod
    def from_spec(cls, world_size: int, spec: Mapping[int, Sequence[int]] | Sequence[Sequence[int]]) -> BipartiteGraph:
        """A user's graph: a mapping `rank -> neighbours` or a list of `[a, b]` edges."""
        if isinstance(spec, Mapping):
            edges = [(int(a), int(b)) for a, ns in spec.items() for b in ns]
        else:
            edges = []
            for edge in spec:
                if len(edge) != 2:
                    raise ConfigurationError(f"a gossip graph edge must be a pair of ranks, got {list(edge)}")
                edges.append((int(edge[0]), int(edge[1])))
        return cls(world_size, edges)
