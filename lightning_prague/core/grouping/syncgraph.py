"""Which workers' models have mixed, directly or through others, since a window started.

Partial Reduce groups whoever is ready first, so workers of equal speed can keep meeting each
other and never the rest ("update isolation"). `SyncGraph` is a union-find over the groups
issued in the current window; the first-ready policy uses it to force groups that bridge
components once a window has run long enough (see `FirstReadyPolicy`).
"""

from __future__ import annotations

from collections.abc import Iterable


class SyncGraph:
    """Union-find over ranks; two ranks are joined when some chain of groups connects them."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._parent = list(range(world_size))

    def find(self, rank: int) -> int:
        root = rank
        while self._parent[root] != root:
            root = self._parent[root]
        while self._parent[rank] != root:  # path compression
            self._parent[rank], rank = root, self._parent[rank]
        return root

    def join(self, members: Iterable[int]) -> None:
        members = list(members)
        for other in members[1:]:
            a, b = self.find(members[0]), self.find(other)
            if a != b:
                self._parent[max(a, b)] = min(a, b)

    def components(self, among: Iterable[int] | None = None) -> int:
        """Number of components among `among` (default: every rank)."""
        ranks = range(self.world_size) if among is None else among
        return len({self.find(r) for r in ranks})

    def connected(self, among: Iterable[int] | None = None) -> bool:
        return self.components(among) <= 1

    def reset(self) -> None:
        self._parent = list(range(self.world_size))
