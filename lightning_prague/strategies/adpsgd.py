"""AD-PSGD as a Lightning strategy (`strategy="adpsgd"`)."""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning_prague.core.comm.averaging import BucketedTensors
from lightning_prague.core.exchange.overlap import BackgroundAverager, Exchanger, PassiveResponder
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.core.grouping.policies import ColumnPolicy, GossipPolicy, GroupingPolicy
from lightning_prague.strategies.base import DecentralizedStrategy

GraphSpec = Union[list[list[int]], dict[int, list[int]]]


class ADPSGDStrategy(DecentralizedStrategy):
    """Asynchronous decentralized parallel SGD (AD-PSGD, ICML 2018).

    Workers form a bipartite graph of *active* and *passive* workers. After each local step an
    active worker starts, from a communication thread, an exchange with a random passive
    neighbour: `x_i, x_j <- (x_i + x_j) / 2`. Passive workers only answer, from a thread of
    their own. Both sides average a snapshot while training goes on and fold the difference in at
    the next step, so the gradient computed meanwhile is applied to the averaged model and no
    local progress is lost. An exchange never waits on a worker that waits on an exchange itself,
    so gossip cannot deadlock.

    Args:
        graph: the neighbour graph, as a list of `[a, b]` edges or a mapping
            `rank -> neighbours`; it must be connected and bipartite, and the side containing
            rank 0 is active. Default: `BipartiteGraph.ring` (even ranks active, ring hops
            +-1 and +-(1 + 2^i); for odd world sizes the wrap-around edges, which would join two
            ranks of the same parity, are left out). With `replica_size`, the graph is over the
            replicas (replica numbers, not ranks), and rank `i` of an active replica averages
            with rank `i` of a passive neighbour replica.
        **kwargs: the options every asynchronous strategy shares (`sync_every`, `seed`, `timeout`,
            `average_at_sync`, `bucket_mb`, `min_workers`, `hang_timeout`, `hang_factor`, `leave_out_after`,
            `sync_timeout`, `coordinator_port`, `max_restarts`, `max_workers`, `plane`,
            `plane_wait`, `replica_size`, `shard`, `state_dict_type`, `auto_wrap_policy`) and Lightning's
            plugins; see `DecentralizedStrategy`.
    """

    strategy_name = "adpsgd"
    takes_replicas = True

    def __init__(self, graph: Optional[GraphSpec] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.graph_spec = graph
        self.group_size = 2

    def make_policy(self) -> GroupingPolicy:
        layout = self.replicas
        workers = layout.replicas if layout.replica_size > 1 else self.capacity  # (a graph of replicas)
        if self.graph_spec is None:
            graph = BipartiteGraph.ring(workers)
        else:
            graph = BipartiteGraph.from_spec(workers, self.graph_spec)
        if layout.replica_size > 1:  # the pairs of replicas, column by column
            columns = [GossipPolicy(graph, self.seed + index) for index in range(layout.replica_size)]
            return ColumnPolicy(columns, layout.replica_size, self.seed)
        return GossipPolicy(graph, self.seed)

    def make_exchanger(self, worker: GroupWorker, tensors: BucketedTensors, policy: GroupingPolicy) -> Exchanger:
        if isinstance(policy, ColumnPolicy):  # a replica is active or passive: each of its ranks alike
            replica, index = divmod(worker.rank, policy.replica_size)
            column = policy.columns[index]
            assert isinstance(column, GossipPolicy)
            active = column.graph.is_active(replica)
        else:
            assert isinstance(policy, GossipPolicy)
            active = policy.graph.is_active(worker.rank)
        if active:  # it starts every exchange it is in: each snapshot is averaged once
            return BackgroundAverager(worker, tensors, self.operation_timeout, in_place=True)
        return PassiveResponder(worker, tensors, self.operation_timeout)
