"""Which ranks form each replica, and which of them average with which (pure: no torch, no I/O).

A job of `W` ranks with replica size `K` has `R = W / K` replicas; replica `r` holds the consecutive
ranks `r K .. r K + K - 1`, so with `K` ranks per node (`replica_size="node"`) a replica is one node.
Rank `i` of a replica is its *index*. When replicas average, rank `i` of each averages only with
rank `i` of the others (its *column*), on its own slice of the model (`slice_bounds`): no rank sends
more than its share of the model across nodes, and the columns run side by side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_prague.core.errors import ConfigurationError

#: `replica_size` for the ranks of a node: as many as the launcher starts per node
NODE = "node"


@dataclass(frozen=True)
class ReplicaLayout:
    """`world_size` ranks in replicas of `replica_size` consecutive ranks."""

    world_size: int
    replica_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            raise ConfigurationError(f"a job has at least one rank, not world_size={self.world_size!r}")
        size = self.replica_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigurationError(f"replica_size must be a positive number of ranks or {NODE!r}, not {size!r}")
        if self.world_size % size:
            raise ConfigurationError(
                f"replica_size={size} does not divide the job's {self.world_size} ranks into whole replicas"
            )

    @classmethod
    def resolve(cls, replica_size: int | str, world_size: int, ranks_per_node: int) -> ReplicaLayout:
        """The layout for a strategy's `replica_size`: a number of ranks, or `"node"` (`ranks_per_node`)."""
        if replica_size == NODE:
            return cls(world_size, ranks_per_node)
        if isinstance(replica_size, str):
            raise ConfigurationError(
                f"replica_size must be a positive number of ranks or {NODE!r}, not {replica_size!r}"
            )
        return cls(world_size, replica_size)

    @property
    def replicas(self) -> int:
        """How many replicas the job has."""
        return self.world_size // self.replica_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a job of {self.world_size} ranks")

    def _check_replica(self, replica: int) -> None:
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica} is outside a job of {self.replicas} replicas")

    def replica_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.replica_size

    def index_of(self, rank: int) -> int:
        """The rank's place in its replica (its column)."""
        self._check_rank(rank)
        return rank % self.replica_size

    def ranks_of(self, replica: int) -> tuple[int, ...]:
        self._check_replica(replica)
        first = replica * self.replica_size
        return tuple(range(first, first + self.replica_size))

    def leader_of(self, replica: int) -> int:
        """The replica's first rank: the one that speaks for it where one must."""
        return self.ranks_of(replica)[0]

    def column(self, rank: int, replicas: Sequence[int]) -> tuple[int, ...]:
        """The ranks with `rank`'s index in each of `replicas` (which must hold its own), sorted."""
        own = self.replica_of(rank)
        chosen = sorted(set(replicas))
        if own not in chosen:
            raise ValueError(f"rank {rank}'s replica {own} is not among replicas {chosen}")
        for replica in chosen:
            self._check_replica(replica)
        index = self.index_of(rank)
        return tuple(replica * self.replica_size + index for replica in chosen)

    def slice_bounds(self, index: int, numel: int) -> tuple[int, int]:
        """[start, stop) of the slice of a flat model of `numel` elements that index `index` of a
        replica averages: as equal as can be, the first `numel % replica_size` one element longer."""
        if not 0 <= index < self.replica_size:
            raise ValueError(f"index {index} is outside a replica of {self.replica_size} ranks")
        return share_of(numel, index, self.replica_size)


def share_of(numel: int, index: int, parts: int) -> tuple[int, int]:
    """[start, stop) of part `index` of `parts` near-equal parts of `numel` elements, the first
    `numel % parts` one element longer: the slice of a flat model (or of a bucket of it) that rank
    `index` of a replica of `parts` ranks averages across replicas."""
    base, extra = divmod(numel, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)
