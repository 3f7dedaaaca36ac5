"""Prague's Partial All-Reduce as a Lightning strategy (`strategy="prague"`)."""

from __future__ import annotations

from typing import Any, Literal, get_args

from lightning.pytorch.utilities import rank_zero_warn

from lightning_prague.core.comm.averaging import BucketedTensors
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.exchange.gossip import LaggedGossip
from lightning_prague.core.exchange.overlap import BackgroundAverager, BlockingExchanger, Exchanger
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.grouping.columns import column_policy
from lightning_prague.core.grouping.policies import GroupingPolicy, SchedulePolicy, StaticPolicy, make_policy
from lightning_prague.core.replicas.columns import column_schedule
from lightning_prague.strategies.base import DecentralizedStrategy
from lightning_prague.strategies.decent_adam import Pace
from lightning_prague.strategies.options import check_pace, resolve_pace

Grouping = Literal["random", "buffer", "division", "static"]
"""The grouping policies of `PartialAllReduceStrategy` (its `grouping` option)."""

PRAGUE_POLICIES: tuple[str, ...] = get_args(Grouping)


def check_group_size(group_size: int) -> None:
    if group_size < 2:
        raise ConfigurationError(f"group_size={group_size} is invalid: a group needs at least 2 workers")


class PartialAllReduceStrategy(DecentralizedStrategy):
    """Asynchronous decentralized training with Partial All-Reduce (Prague, ASPLOS 2020).

    After every `sync_every` local optimizer steps a worker asks the coordinator for a group and
    averages its parameters and floating-point buffers with the group's members. Nobody waits for
    workers outside its group, and with `overlap` (the default) nobody waits for its group
    either: the exchange runs on a snapshot while the next step computes.

    Args:
        group_size: workers per group (2 to the number of workers).
        grouping: `"random"` (Prague's Group Generator), `"buffer"` (Group Buffer),
            `"division"` (Group Division) or `"static"` (conflict-free schedule for
            homogeneous clusters); see `lightning_prague.core.grouping.policies`. With `"static"`
            every worker knows its group of every round, so no exchange asks the coordinator: the
            rounds run as gossip (`lightning_prague.core.exchange.gossip.LaggedGossip`) and, since a
            worker's group waits for it every round, training keeps Lightning's distributed
            sampler (equal shards, step-based settings allowed), as `decent_adam` does. It is the
            grouping that takes `replica_size` (the schedule drawn over the replicas).
        avoid_stragglers: leave workers that lag far behind out of other workers' groups (they
            still average through the groups they ask for); see `GroupGenerator.lagging`.
        avoid_busy: draw into a worker's group only workers that are not in an unfinished group
            already (`random` and `division` grouping; see `GroupGenerator.is_busy`): a worker on a
            slow link then holds up only the group it is in, never a queue of groups behind it, and a
            synchronization point drains at most one exchange per worker. `False`: Prague's Group
            Generator as in the paper, which draws from every worker.
        overlap: run each group exchange on a snapshot in a background thread and fold the result
            in at the next step (no worker ever blocks on its group); `False` blocks the training
            thread until the group is averaged, as in the paper.
        pace: the static schedule's (the other groupings always go at each worker's own pace):
            `"round"` waits for each round at the next step, on equal shards; `"own"` trains local
            steps while a round is in flight and takes the data from the work queue, so fast workers
            never wait for a slow one (see `decent_adam`'s `pace`); needs `overlap`. `"auto"` (the
            default): `"own"` in replica groups (`replica_size`) with `overlap`, else `"round"`.
        **kwargs: the options every asynchronous strategy shares (`sync_every`, `seed`, `timeout`,
            `average_at_sync`, `bucket_mb`, `min_workers`, `hang_timeout`, `hang_factor`, `leave_out_after`,
            `sync_timeout`, `coordinator_port`, `max_restarts`, `max_workers`, `plane`,
            `plane_wait`, `replica_size`, `shard`, `state_dict_type`, `auto_wrap_policy`) and Lightning's
            plugins; see `DecentralizedStrategy`.
    """

    strategy_name = "prague"
    takes_replicas = True

    def __init__(
        self,
        group_size: int = 3,
        grouping: Grouping = "random",
        avoid_stragglers: bool = True,
        overlap: bool = True,
        avoid_busy: bool = True,
        pace: Pace = "auto",
        **kwargs: Any,
    ) -> None:
        check_group_size(group_size)
        check_pace(pace, overlap, "prague")
        if grouping not in PRAGUE_POLICIES:
            raise ConfigurationError(
                f"grouping={grouping!r} is not a grouping policy of strategy='prague'; choose one of "
                f"{', '.join(PRAGUE_POLICIES)}"
            )
        super().__init__(**kwargs)
        self.group_size = group_size
        self.grouping = grouping
        self.avoid_stragglers = avoid_stragglers
        self.overlap = overlap
        # only where the requester's group is drawn from everyone (random, division); a blocking
        # exchange finishes before the next request anyway, but a busy member still stalls the group
        self.avoid_busy = avoid_busy and grouping in ("random", "division")
        self.pace = resolve_pace(pace, overlap, self.options.replica_size)
        if grouping == "static" and self.pace == "round":
            # lock-step rounds: a work queue could not let fast workers take more batches
            self.shards_by_work_queue = False
        self.refuse_replica_restarts()

    def make_policy(self) -> GroupingPolicy:
        layout = self.replicas
        if layout.replica_size > 1 and self.grouping == "static":
            # the static schedule over the replicas, run by the ranks column by column
            per_node = max(1, self.workers_per_node // layout.replica_size)
            over_replicas = StaticPolicy(layout.replicas, self.group_size, self.seed, per_node).schedule
            return SchedulePolicy(column_schedule(over_replicas, layout), self.seed)
        if layout.replica_size > 1:  # groups of replicas, drawn column by column
            per_node = max(1, self.workers_per_node // layout.replica_size)
            return column_policy(
                self.grouping, layout.replicas, layout.replica_size, min(self.group_size, layout.replicas), self.seed,
                workers_per_node=per_node,
            )  # fmt: skip
        policy = make_policy(self.grouping, self.capacity, self.group_size, self.seed, self.workers_per_node)
        if isinstance(policy, StaticPolicy) and policy.workers_per_node != self.group_size:
            nodes, per_node = self.capacity // policy.workers_per_node, policy.workers_per_node
            rank_zero_warn(
                f"grouping='static' on {nodes} nodes of {per_node} workers groups by the node layout (node averages, "
                f"pairs inside a node and one group across the nodes); group_size={self.group_size} is not used"
            )
        return policy

    def make_exchanger(self, worker: GroupWorker, tensors: BucketedTensors, policy: GroupingPolicy) -> Exchanger:
        if isinstance(policy, SchedulePolicy):  # the static schedule: no coordinator round trip per exchange
            return LaggedGossip(
                worker, tensors, policy.schedule, self.operation_timeout, overlap=self.overlap, lagged=self.overlap,
                slices=not self.shard, own_pace=self.pace == "own",
                replica=self.replica_agreement() if self.pace == "own" else None,
            )  # fmt: skip
        if self.overlap:
            # avoid_busy: a worker is in one group between two of its requests (a group drawn for it is run
            # at its next request, which then gets none of its own), so each snapshot is averaged once
            return BackgroundAverager(worker, tensors, self.operation_timeout, in_place=self.avoid_busy)
        return BlockingExchanger(worker, tensors, self.operation_timeout)
