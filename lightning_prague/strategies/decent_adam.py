"""Decentralized Adam with overlapped gossip as a Lightning strategy (`strategy="decent_adam"`)."""

from __future__ import annotations

from typing import Any, Literal, Optional, get_args

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from lightning_prague.core.comm.averaging import BucketedTensors
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.exchange.gossip import LaggedGossip
from lightning_prague.core.exchange.overlap import Exchanger
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.grouping.policies import GroupingPolicy, SchedulePolicy
from lightning_prague.core.grouping.topology import make_topology
from lightning_prague.core.replicas.columns import column_schedule
from lightning_prague.strategies.base import DecentralizedStrategy
from lightning_prague.strategies.options import check_pace, resolve_pace

Pace = Literal["auto", "round", "own"]
"""How a fixed schedule's rounds pace the workers: `pace` of `decent_adam` and of `prague`'s static schedule."""

Topology = Literal["complete", "ring", "one_peer_exp", "alternating_exp_ring", "static"]
"""The named topologies of `DecentAdamStrategy` (its `topology` option): `lightning_prague.core.grouping.topology`."""


class MixPoint(Callback):
    """Mixes the gossip round in flight into the parameters just before the optimizer update.

    It runs after every other callback's `on_before_optimizer_step` (it is appended last at
    setup), so the exchange overlaps the whole forward and backward pass and anything callbacks do
    after the backward pass.
    """

    def __init__(self, strategy: DecentAdamStrategy) -> None:
        self.strategy = strategy

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        exchanger = self.strategy.exchanger
        if isinstance(exchanger, LaggedGossip) and not exchanger.own_pace:  # (own pace: mixed after the update)
            exchanger.mix()


class DecentAdamStrategy(DecentralizedStrategy):
    """Decentralized training with communicate-while-adapt ("From promise to practice", ICLR 2025).

    Every worker runs the optimizer its LightningModule configures (Adam, AdamW, SGD,
    `lightning_prague.optim.AccumAdam`, with any LR scheduler) on its own replica, and
    mixes replicas by gossip on a fixed, time-varying topology:
    `x_i^{t+1} = sum_j w_ij x_j^t - lr * d_i^t`. The exchange of `x^t` is issued right after
    update `t` (one group sum per bucket, point-to-point within the worker's group of that round), runs while
    the next forward and backward pass compute the gradient at the un-averaged `x^t`, and is
    waited for just before the next update (one-step lag). A worker waits only for the members
    of its group, never for the slowest of all.

    Workers advance round by round together (none can get more than the topology's
    `coverage` rounds ahead of another), so a work queue would not let fast workers take more
    batches; this strategy keeps Lightning's distributed sampler (equal shards, as with DDP), and
    step-based settings (`max_steps`, `val_check_interval`) are allowed. With `pace="own"` the rounds
    still go together, but a worker trains local steps while its round is in flight, and the data
    comes from the work queue, as with `prague`'s random groups. The meeting that
    ends a phase tolerates unequal step counts anyway: a worker out of batches runs idle rounds
    (mixing only) until every worker has reached the same final round, which the meeting settles
    (see `lightning_prague.core.exchange.gossip`). Synchronization points (validation, epoch end, end of
    fit) then average all replicas (`average_at_sync`). A SIGTERM (or SLURM's requeue signal)
    stops every worker before its next batch once the stop reaches it: the workers settle their
    final gossip round, a step or two apart, and meet at the stop point, where they average.

    Args:
        topology: `"ring"` (one peer, alternating sides), `"one_peer_exp"` (one peer at
            distance 2^r; needs a power-of-two number of workers), `"complete"` (exact
            averaging), `"alternating_exp_ring"` (node-aware: in each round one worker of each
            node averages with its counterpart on a partner node, the node pairs cycling through
            exponential hops, while the others average inside the node) or
            `"static"` (Prague's schedule on the node layout); see
            `lightning_prague.core.grouping.topology`.
        schedule: a user schedule instead of a named topology: a list of rounds, each a list of
            groups, each a list of ranks or `{"members": [...], "self_weight": w}`. Validated:
            every round must put every rank in exactly one group. Given, it replaces `topology`.
            With `replica_size`, a topology or schedule is over the replicas (replica `r`: ranks
            `rK .. rK+K-1`), and rank `i` of each replica averages with rank `i` of the others.
        workers_per_node: the node size the node-aware topologies assume; default: the devices
            per node Lightning runs.
        overlap: issue each exchange in the background and wait just before the next update;
            `False` waits at once (the same parameters, no overlap).
        pace: `"round"` (the paper's algorithm): every update waits for its round, so all workers
            advance round by round at the slowest one's pace, on equal shards of the data. `"own"`:
            every worker (or replica) trains at its own pace: an update whose round is still in
            flight is a local step, the round is mixed in at the first update after it is done, and
            the training data comes from the work queue, so a fast worker takes more batches and never
            waits for a slow neighbour (every batch still trained once). For clusters whose workers or
            nodes differ in speed; needs `overlap`. `"auto"` (the default): `"own"` in replica groups
            (`replica_size`: nodes that differ, the slow one must not stall the others) with `overlap`,
            else `"round"`.
        **kwargs: the options every asynchronous strategy shares (`sync_every`, `seed`, `timeout`,
            `average_at_sync`, `bucket_mb`, `min_workers`, `hang_timeout`, `hang_factor`, `leave_out_after`,
            `sync_timeout`, `coordinator_port`, `max_restarts`, `max_workers`, `plane`,
            `plane_wait`, `replica_size`, `shard`, `state_dict_type`, `auto_wrap_policy`) and Lightning's
            plugins; see `DecentralizedStrategy`.
    """

    strategy_name = "decent_adam"
    shards_by_work_queue = False
    takes_replicas = True

    def __init__(
        self,
        topology: Topology = "ring",
        schedule: Optional[list[list[Any]]] = None,
        workers_per_node: Optional[int] = None,
        overlap: bool = True,
        pace: Pace = "auto",
        **kwargs: Any,
    ) -> None:
        check_pace(pace, overlap, "decent_adam")
        if schedule is None and topology not in get_args(Topology):
            raise ConfigurationError(
                f"topology={topology!r} is not a topology of strategy='decent_adam'; choose one of "
                f"{', '.join(get_args(Topology))} or pass a schedule"
            )
        if workers_per_node is not None and workers_per_node < 1:
            raise ConfigurationError(f"workers_per_node={workers_per_node} is invalid: it must be at least 1")
        super().__init__(**kwargs)
        self.topology = topology
        self.schedule_spec = schedule
        self.node_size = workers_per_node
        self.overlap = overlap
        self.pace = resolve_pace(pace, overlap, self.options.replica_size)
        # at its own pace a fast worker trains more batches than a slow one: from the work queue
        self.shards_by_work_queue = self.pace == "own"
        self.refuse_replica_restarts()

    def make_policy(self) -> GroupingPolicy:
        per_node = self.node_size or self.workers_per_node
        layout = self.replicas
        if layout.replica_size == 1:
            return SchedulePolicy(make_topology(self.topology, self.capacity, per_node, self.schedule_spec), self.seed)
        # drawn over the replicas (a node holding `per_node / K` of them), run by the ranks column by column
        over_replicas = make_topology(
            self.topology, layout.replicas, max(1, per_node // layout.replica_size), self.schedule_spec
        )
        return SchedulePolicy(column_schedule(over_replicas, layout), self.seed)

    def make_exchanger(self, worker: GroupWorker, tensors: BucketedTensors, policy: GroupingPolicy) -> Exchanger:
        assert isinstance(policy, SchedulePolicy)
        return LaggedGossip(
            worker, tensors, policy.schedule, self.operation_timeout, overlap=self.overlap, slices=not self.shard,
            own_pace=self.pace == "own", replica=self.replica_agreement() if self.pace == "own" else None,
        )  # fmt: skip

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self.exchanger is not None and not any(isinstance(cb, MixPoint) for cb in trainer.callbacks):
            trainer.callbacks.append(MixPoint(self))

    def teardown(self) -> None:
        if self._trainer is not None:
            self._trainer.callbacks[:] = [cb for cb in self._trainer.callbacks if not isinstance(cb, MixPoint)]
        super().teardown()
