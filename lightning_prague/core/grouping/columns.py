"""Grouping by columns: a policy drawn over replicas, run by each index of a replica on its own.

A job of `W = R K` ranks in replica groups has `R` replicas of `K` consecutive ranks (replica `r`
holds ranks `r K .. r K + K - 1`); rank `i` of a replica (its *index*, `rank % K`) holds slice or
shard `i` of the replica's model. It averages that part only with rank `i` of the other replicas
(its *column*): averaging it with any other index would mix different parts of the model. So every
group is within one column, and each column is an independent decentralized average of its part
of the model, run by its own copy of an ordinary policy (`random`, `buffer`, `division`,
`first_ready`) whose workers are the replica numbers `0 .. R - 1`, seeded `seed + index` so that
the columns draw different groups and no column waits on another.

`ColumnPolicy` does the bookkeeping only: it maps a rank to (replica, index) and back, and routes
each request, ready report and pool to its column's policy. It is defined in `policies`, beside
`policy_from_spec` that rebuilds it from a spec (the grouping modules import each other in one
direction only); this module is its home for readers and builds one by name (`column_policy`).
Fixed schedules and gossip pairs are not run by columns here: a schedule over replicas becomes the
ranks' schedule with `lightning_prague.core.replicas.column_schedule`.
"""

from __future__ import annotations

from typing import Any

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.policies import (
    COLUMN_KINDS,
    MAX_REPLICA_SIZE,
    MAX_WORKERS,
    ColumnPolicy,
    make_policy,
)
from lightning_prague.core.records import integer

__all__ = ["COLUMN_KINDS", "ColumnPolicy", "column_policy"]


def column_policy(
    name: str, replicas: int, replica_size: int, group_size: int, seed: int = 0, **first_ready: Any
) -> ColumnPolicy:
    """Policy `name` by columns: `make_policy(name, replicas, group_size, seed + index, **first_ready)`
    for each index of a replica of `replica_size` ranks. Unknown names, impossible sizes and kinds a
    column cannot run raise `ConfigurationError`."""
    if name not in COLUMN_KINDS:
        raise ConfigurationError(f"grouping={name!r} cannot run by columns; choose one of {', '.join(COLUMN_KINDS)}")
    if not integer(1, MAX_REPLICA_SIZE)(replica_size):
        raise ConfigurationError(
            f"replica_size must be a number of ranks from 1 to {MAX_REPLICA_SIZE}, not {replica_size!r}"
        )
    if replicas * replica_size > MAX_WORKERS:
        raise ConfigurationError(
            f"{replicas} replicas of {replica_size} ranks exceed the {MAX_WORKERS} workers a policy may name"
        )
    inner = [make_policy(name, replicas, group_size, seed + index, **first_ready) for index in range(replica_size)]
    return ColumnPolicy(inner, replica_size, seed)
