"""Partial Reduce as a Lightning strategy (`strategy="partial_reduce"`)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from lightning_prague.core.comm.averaging import BucketedTensors
from lightning_prague.core.exchange.overlap import BackgroundAverager, BlockingExchanger, Exchanger
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.grouping.columns import column_policy
from lightning_prague.core.grouping.policies import FirstReadyPolicy, GroupingPolicy, make_policy
from lightning_prague.strategies.base import DecentralizedStrategy
from lightning_prague.strategies.partial_all_reduce import check_group_size

Weighting = Literal["uniform", "staleness"]
"""How `PartialReduceStrategy` weighs a group's models (its `weighting` option)."""


class PartialReduceStrategy(DecentralizedStrategy):
    """Asynchronous decentralized training with Partial Reduce (P-Reduce, SIGMOD 2021).

    After every local step a worker reports ready to the coordinator with its model version (its
    number of local updates). The coordinator groups the first `group_size` ready workers;
    disjoint groups run concurrently and nobody waits for a busy worker. Members average their
    models and adopt the newest version. The coordinator also guarantees that no set of workers
    stays isolated (see `mixing_window`).

    Args:
        group_size: P, the workers per group (2 to the number of workers).
        weighting: `"uniform"` (`x_i <- mean of the group`) or `"staleness"` (fresher
            models weigh more; `lightning_prague.core.grouping.staleness.staleness_weights`).
        alpha: the staleness decay of `weighting="staleness"` (0 < alpha < 1).
        mixing_window: ready reports after which, if some workers' models have not mixed with
            the others' (directly or through others) since the window began, the coordinator
            only forms groups that bridge them. Default `10 * number of workers`.
        overlap: report ready and average on a snapshot in a background thread, folding the
            result in at the next step, so the training thread never waits for its group;
            `False` waits in the training thread, as in the paper.
        **kwargs: the options every asynchronous strategy shares (`sync_every`, `seed`, `timeout`,
            `average_at_sync`, `bucket_mb`, `min_workers`, `hang_timeout`, `hang_factor`, `leave_out_after`,
            `sync_timeout`, `coordinator_port`, `max_restarts`, `max_workers`, `plane`,
            `plane_wait`, `replica_size`, `shard`, `state_dict_type`, `auto_wrap_policy`) and Lightning's
            plugins; see `DecentralizedStrategy`.
    """

    strategy_name = "partial_reduce"
    takes_replicas = True

    def __init__(
        self,
        group_size: int = 3,
        weighting: Weighting = "uniform",
        alpha: float = 0.9,
        mixing_window: Optional[int] = None,
        overlap: bool = True,
        **kwargs: Any,
    ) -> None:
        check_group_size(group_size)
        FirstReadyPolicy(max(group_size, 2), group_size, weighting=weighting, alpha=alpha, mixing_window=mixing_window)
        super().__init__(**kwargs)
        self.group_size = group_size
        self.weighting = weighting
        self.alpha = alpha
        self.mixing_window = mixing_window
        self.overlap = overlap

    def make_policy(self) -> GroupingPolicy:
        layout = self.replicas
        if layout.replica_size > 1:  # the first ready replicas, column by column
            return column_policy(
                "first_ready", layout.replicas, layout.replica_size, min(self.group_size, layout.replicas),
                self.seed, weighting=self.weighting, alpha=self.alpha, mixing_window=self.mixing_window,
            )  # fmt: skip
        return make_policy(
            "first_ready",
            self.capacity,
            self.group_size,
            self.seed,
            weighting=self.weighting,
            alpha=self.alpha,
            mixing_window=self.mixing_window,
        )

    def make_exchanger(self, worker: GroupWorker, tensors: BucketedTensors, policy: GroupingPolicy) -> Exchanger:
        if self.overlap:  # first-ready groups: only its own requests average its snapshot, once each
            return BackgroundAverager(worker, tensors, self.operation_timeout, in_place=True)
        return BlockingExchanger(worker, tensors, self.operation_timeout)
