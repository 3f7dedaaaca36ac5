"""Prague's Partial All-Reduce as a Lightning strategy (``strategy="prague"``)."""

from __future__ import annotations

from typing import Any, Literal, Optional

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.plugins.precision import Precision

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.policies import GroupingPolicy, make_policy
from lightning_prague.strategies.base import DecentralizedStrategy

PRAGUE_POLICIES = ("random", "buffer", "division", "static")


class PartialAllReduceStrategy(DecentralizedStrategy):
    """Asynchronous decentralized training with Partial All-Reduce (Prague, ASPLOS 2020).

    After every ``sync_every`` local optimizer steps a worker asks the coordinator for a group and
    averages its parameters and floating-point buffers with the group's members. Nobody waits for
    workers outside its group, and with ``overlap`` (the default) nobody waits for its group
    either: the exchange runs on a snapshot while the next step computes.

    Args:
        group_size: workers per group (2 to the number of workers).
        grouping: ``"random"`` (Prague's Group Generator), ``"buffer"`` (Group Buffer),
            ``"division"`` (Group Division) or ``"static"`` (conflict-free schedule for
            homogeneous clusters); see :mod:`lightning_prague.core.policies`.
        sync_every: local optimizer steps between two partial all-reduces.
        seed: seeds the grouping policy and the per-epoch data shuffle.
        timeout: seconds any wait (coordinator, group, peer) may take before failing with an
            error that names the ranks and the operation.
        average_at_sync: average all replicas at synchronization points (validation, epoch end,
            end of fit) so that they see one consensus model.
        max_groups: communicators kept alive at once (least recently used ones are released).
        bucket_mb: size of the flat buffers averaged in one collective.
        avoid_stragglers: leave workers that lag far behind out of other workers' groups (they
            still average through the groups they ask for); see ``GroupGenerator.lagging``.
        overlap: run each group exchange on a snapshot in a background thread and fold the result
            in at the next step (no worker ever blocks on its group); ``False`` blocks the training
            thread until the group is averaged, as in the paper.
    """

    strategy_name = "prague"

    def __init__(
        self,
        group_size: int = 3,
        grouping: str = "random",
        sync_every: int = 1,
        seed: int = 0,
        timeout: float = 300.0,
        average_at_sync: bool = True,
        max_groups: int = 64,
        bucket_mb: float = 25.0,
        avoid_stragglers: bool = True,
        overlap: bool = True,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        if grouping not in PRAGUE_POLICIES:
            raise ConfigurationError(
                f"grouping={grouping!r} is not a grouping policy of strategy='prague'; choose one of "
                f"{', '.join(PRAGUE_POLICIES)}"
            )
        super().__init__(
            group_size=group_size,
            sync_every=sync_every,
            seed=seed,
            timeout=timeout,
            average_at_sync=average_at_sync,
            max_groups=max_groups,
            bucket_mb=bucket_mb,
            avoid_stragglers=avoid_stragglers,
            overlap=overlap,
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
        )
        self.grouping = grouping

    def make_policy(self) -> GroupingPolicy:
        return make_policy(self.grouping, self.world_size, self.group_size, self.seed, self.workers_per_node)
