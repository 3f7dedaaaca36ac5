"""A schedule drawn over replicas, as the ranks run it: each group of replicas becomes its columns.

A topology or a static schedule is built over the `R` replicas of a job (`make_topology(..., R, ...)`),
each replica one worker. Its ranks run it column by column: where replicas `a` and `b` average in a
round, rank `i` of `a` averages with rank `i` of `b`, for every index `i`, with the group's weights.
So the ranks' mixing matrix is the replicas' one for each index, `W kron I_K` in rank order: doubly
stochastic where the replicas' is, and a replica whose ranks hold one model (a replica trains
synchronously) holds, column by column, the replicas' mix of it.

The columns of a group of replicas are decided together (`WeightedGroup.joint`): a round takes
effect on all of them or on none, and a replica with a rank gone takes part in none of them
(`Schedule.whole`), so a replica's ranks never hold different mixes. The columns never meet in the
schedule: a replica's ranks depend on each other at every step through their gradient average,
which the schedule's connectivity counts (`coupled`). See `docs/design/replicas.md`.
"""

from __future__ import annotations

from lightning_prague.core.grouping.topology import Schedule, WeightedGroup
from lightning_prague.core.replicas.layout import ReplicaLayout


def column_schedule(schedule: Schedule, layout: ReplicaLayout) -> Schedule:
    """`schedule`, over `layout.replicas` workers, as a schedule over the job's ranks: each of its
    groups of replicas split into one group per index of a replica (its column), same weights."""
    if schedule.world_size != layout.replicas:
        raise ValueError(
            f"the schedule is over {schedule.world_size} workers, the job has {layout.replicas} replicas "
            f"(of {layout.replica_size} ranks)"
        )
    rounds = [[column for group in groups for column in _columns(group, layout)] for groups in schedule.rounds]
    replicas = [layout.ranks_of(replica) for replica in range(layout.replicas)]  # coupled at every step
    return Schedule(layout.world_size, rounds, f"{schedule.name} over replicas of {layout.replica_size}", replicas)


def _columns(group: WeightedGroup, layout: ReplicaLayout) -> list[WeightedGroup]:
    """Group `group` of replicas as one group per index of a replica, decided jointly (`joint`)."""
    ranks = tuple(rank for replica in group.members for rank in layout.ranks_of(replica))
    joint = tuple(sorted(ranks)) if layout.replica_size > 1 else ()
    first = layout.leader_of(group.members[0])
    return [
        WeightedGroup(layout.column(first + index, group.members), group.self_weight, joint)
        for index in range(layout.replica_size)
    ]
