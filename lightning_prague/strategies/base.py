"""Shared Lightning machinery of the asynchronous strategies.

`DecentralizedStrategy` takes Lightning's DDP launcher, rank bookkeeping and process-group
setup, but never wraps the model in `DistributedDataParallel`. It is abstract: a subclass decides
who averages with whom (`make_policy`) and how an exchange runs relative to the local steps
(`make_exchanger`). This class owns what every asynchronous strategy needs from Lightning:

* **phases** - between the first training batch of an epoch and the next synchronization point
  the ranks are *unaligned* (at different steps). Then `barrier`/`broadcast`/`reduce`/
  `all_gather` act locally (a local value and one warning per operation) instead of hanging.
  At synchronization points they are real collectives again.
* **synchronization points** - validation during fit, epoch end, end of fit: every rank drains
  its group operations, meets the others, and (`average_at_sync`) the replicas are averaged so
  validation, checkpoints and `trainer.test` see one consensus model.
* **work-queue sharding** of the training loader, a **coordinated SIGTERM** that drains
  in-flight groups on every rank before all of them stop, and **stops decided by the job**:
  `trainer.should_stop` set on any rank (Timer, EarlyStopping, the module) stops every rank at
  the same synchronization point.
* **lost workers** - a rank whose process ends (exit, exception, kill -9) or that hangs (declared
  from its own step times and fenced, `lightning_prague.core.plane.liveness`) leaves the job and the
  survivors finish the fit: from the next synchronization point on they exchange among
  themselves, Lightning's collectives run on their group, the lowest live rank takes over global
  rank 0's duties (checkpoints, logging), and at the end a warning names who was lost, when and
  why. `min_workers` stops the job (cleanly, at its next synchronization point) when fewer remain.
  Lightning's kill-all launcher is replaced (`lightning_prague.strategies.launcher`).

The class is an adapter: it keeps Lightning's hooks and hands each to the part that does the work,
one module each under `lightning_prague.strategies`: the validated options (`options`), the
collectives (`collectives`), the loaders and shards (`loaders`), signals and stops (`stops`), the
synchronization points (`sync_points`) and the survivors of a lost worker (`survivors`). Underneath
are three objects of the core: the process's `Job` (the supervisor, the store, our process group;
`setup_distributed`), this fit's `TrainingSession` (control session, worker, exchanger; built from
`session_plan`) and the `SyncController` (the phase state machine).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from abc import abstractmethod
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torchmetrics import Metric
from typing_extensions import override

from lightning_prague.core.auth import secret_advice
from lightning_prague.core.client.control import Session
from lightning_prague.core.comm.averaging import BucketedTensors, averaged_state
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.exchange.overlap import Exchanger
from lightning_prague.core.exchange.phases import SyncController
from lightning_prague.core.exchange.training import SessionPlan, TrainingSession
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.grouping.policies import GroupingPolicy, SchedulePolicy
from lightning_prague.core.job import Job, init_job
from lightning_prague.core.plane.launch import LOG_DIR_VARIABLE
from lightning_prague.core.plane.service import plane_address
from lightning_prague.core.protocol import HangRule
from lightning_prague.core.replicas.agreement import DonationAgreement, ReplicaAgreement
from lightning_prague.core.replicas.layout import ReplicaLayout
from lightning_prague.core.replicas.reassembly import SliceReassembly
from lightning_prague.core.replicas.sharding import (
    full_model_state,
    full_optimizer_state,
    is_sharded,
    load_full_model_state,
    load_full_optimizer_state,
    load_model_shards,
    load_optimizer_shards,
    model_shards,
    optimizer_shards,
    replica_mesh,
    shard_model,
)
from lightning_prague.core.replicas.sync import replica_group, synchronous
from lightning_prague.strategies import _patches
from lightning_prague.strategies._checks import check_layer_sync, check_lightning_internals, check_trainer
from lightning_prague.strategies.collectives import RoutedCollectives
from lightning_prague.strategies.ddp_options import check_ddp_options, strategy_options
from lightning_prague.strategies.global_progress import GlobalProgress
from lightning_prague.strategies.in_place import ComebackMultiProcessingLauncher, EpochMovedOn
from lightning_prague.strategies.launcher import SurvivingForkLauncher, SurvivingScriptLauncher
from lightning_prague.strategies.loaders import StrategyLoaders
from lightning_prague.strategies.options import DDP_TIMEOUT, Option, StrategyOptions, watchdog_margin
from lightning_prague.strategies.rejoin import (
    MEMBERS_METRICS,
    PEER_CHECKPOINT,
    SENT_SHARD_BY_SHARD,
    TAKEN_AT_EPOCH_END,
    PeerState,
    epoch_under_way,
    held_inside_epoch,
    members_metrics,
    resume_epoch_progress,
)
from lightning_prague.strategies.sharded_checkpoints import (
    LOADED_SHARD_BY_SHARD,
    agreed_path,
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
)
from lightning_prague.strategies.stops import Stops
from lightning_prague.strategies.survivors import Survivors
from lightning_prague.strategies.sync_points import Synchronizer, SyncPoints

log = logging.getLogger(__name__)

#: seconds a rank whose replica's gradient average failed waits to hear which rank of it was lost
REPLICA_LOSS_NOTICE_SECONDS = 5.0

#: `DDP_TIMEOUT`, `watchdog_margin` (`options`) and `SyncPoints` (`sync_points`) are importable from here as before
__all__ = ["DDP_TIMEOUT", "DecentralizedStrategy", "SyncPoints", "watchdog_margin"]


class DecentralizedStrategy(DDPStrategy):
    """Abstract base class of the asynchronous strategies; not usable by itself.

    Select one of its subclasses (`PartialAllReduceStrategy`, `PartialReduceStrategy`,
    `ADPSGDStrategy`, `DecentAdamStrategy`); a subclass implements `make_policy` and
    `make_exchanger`. See the module docstring for what this class does.
    """

    #: the name users select it by, used in messages
    strategy_name = "decentralized"
    #: training batches come from one global work queue (fast workers take more); `False` keeps
    #: Lightning's distributed sampler (equal shards, equal step counts on every worker)
    shards_by_work_queue = True
    #: leave workers that lag far behind out of other workers' groups (`GroupGenerator.lagging`)
    avoid_stragglers = False
    #: draw into a group only workers not busy in an unfinished one (`GroupGenerator.avoid_busy`)
    avoid_busy = False
    #: it trains in replica groups (`replica_size`): its schedule is drawn over replicas (lock-step shards)
    takes_replicas = False

    def __init__(
        self,
        sync_every: int = 1,
        seed: int = 0,
        timeout: float = 300.0,
        average_at_sync: bool = True,
        bucket_mb: float = 25.0,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        min_workers: int = 1,
        hang_timeout: float = 60.0,
        hang_factor: float = 20.0,
        leave_out_after: float = 10.0,
        sync_timeout: Optional[float] = None,
        coordinator_port: Optional[int] = None,
        max_restarts: int = 0,
        max_workers: Optional[int] = None,
        plane: Optional[str] = None,
        plane_wait: Optional[float] = None,
        replica_size: Union[int, str] = 1,
        shard: bool = False,
        state_dict_type: str = "full",
        auto_wrap_policy: Optional[Any] = None,
        **ddp_kwargs: Any,
    ) -> None:
        """Options every asynchronous strategy shares.

        Args:
            sync_every: local optimizer steps between two exchanges.
            seed: seeds the grouping decisions and the per-epoch data shuffle.
            timeout: seconds one operation (a group exchange, a request to the coordinator, a
                claim on the work queue) may take before failing with an error that names the
                ranks and the operation (a `datetime.timedelta`, as `DDPStrategy` takes, is
                accepted too). The timeouts form a hierarchy, each bound above the one before:
                `hang_timeout` (a worker without progress or any sign of life is declared hung and
                fenced, 60 s; one that computes is never declared for a long step),
                `timeout` (one operation, 300 s), `sync_timeout` (every rank reaching one
                synchronization point, and a worker busy outside its steps, such as rank 0
                writing a checkpoint; 1800 s as DDP's collectives), then the backend's own
                timeout (the process group's, beyond `sync_timeout`).
            average_at_sync: average all replicas at synchronization points (validation, epoch
                end, end of fit) so that they see one consensus model.
            bucket_mb: size of the flat buffers averaged in one collective.
            accelerator: Lightning's; the Trainer sets it from its `accelerator`, leave it unset.
            parallel_devices: Lightning's; the Trainer sets it from its `devices`, leave it unset.
            cluster_environment: Lightning's; the Trainer detects it (torchrun, SLURM, ...).
            checkpoint_io: Lightning's checkpoint plugin; unset: the default one.
            precision_plugin: Lightning's; the Trainer sets it from its `precision`, leave it unset.
            process_group_backend: `"gloo"`, `"nccl"`, ...; unset: the device's default (`nccl` on CUDA, `gloo` on CPU).
            start_method: how Lightning starts the ranks of one node: `"popen"` (a new interpreter
                per rank), `"spawn"`, `"fork"` (forked from this process, the fastest start; CPU only,
                Linux and macOS) or `"forkserver"`. `"popen"` and `"fork"` let the other ranks go on
                when one fails, and restart a lost rank with `max_restarts` (`"spawn"` and
                `"forkserver"` run on `torch.multiprocessing`, which ends every process).
            min_workers: stop the job (every rank at its next synchronization point, as when
                `trainer.should_stop` is set) when fewer workers than this remain.
            hang_timeout: the shortest time without training progress and without any sign of life
                (its training thread used no CPU, its stack did not move, its device was idle) after
                which a worker is declared hung and fenced (`lightning_prague.core.plane.liveness`):
                60 s, as torchft's collectives. A worker that computes is slow, not hung: only
                `sync_timeout` bounds it. A silent worker (a frozen process, a lost node) is declared
                after `max(min(10 s, hang_timeout), hang_factor x` its step`)`.
            hang_factor: a worker is declared hung after `max(hang_timeout, hang_factor x` its
                longest recent step`)` without progress or sign of life (steps timed on that worker).
            leave_out_after: the short bound of a blocked worker: after `max(min(leave_out_after,
                hang_timeout), hang_factor x` its step`)` without progress or sign of life (10 s for
                short steps) it is left out of groups, rounds and meetings, and the others go on
                without it; it is fenced only at `hang_timeout`'s bound. If it wakes before that, it
                comes back in place, with a live worker's state (`lightning_prague.strategies.in_place`).
                `hang_timeout` or more: a blocked worker is fenced without being left out first.
            sync_timeout: seconds the ranks may take to all reach a synchronization point (its
                meeting and Lightning's collectives there: a barrier after rank 0 wrote a
                checkpoint), and a worker may stay busy outside its steps (an epoch's end, a
                checkpoint) before it is declared hung. Unset: 1800 s, Lightning's DDP timeout, or
                `timeout` if that is longer; it must not be shorter than `timeout`.
            coordinator_port: the port (1-65535) on which the supervisor started by global rank 0
                serves the control plane, for a firewall that only opens known ports; unset: the
                `LIGHTNING_PRAGUE_CONTROL_PORT` environment variable, else a free port. Setting both
                to different ports is an error. It listens on rank 0's node at `MASTER_ADDR`'s
                address, or at the one `LIGHTNING_PRAGUE_CONTROL_HOST` names; on every interface only
                if that variable says so (`0.0.0.0`), or if `MASTER_ADDR` is a host name that resolves
                to a loopback address there or is not an address of that node at all.
            max_restarts: how many times a lost rank's process is started again, for each rank,
                rank 0 included. Under Lightning's launcher (`start_method="popen"` or `"fork"`) the
                process you start becomes the node's agent: it trains nothing itself, starts every
                rank (a new interpreter, or a fork) and restarts the lost ones. Under srun, torchrun
                or a container per rank, each rank's process becomes its rank's keeper, which forks
                the training process and restarts it in place (`lightning_prague.strategies.keeper`).
                The new process rejoins the running fit at once, with no meeting, with the
                state of a live worker (`lightning_prague.strategies.rejoin`). 0: a lost rank stays
                lost (restart it yourself with `LIGHTNING_PRAGUE_REJOIN=1`), and the others finish
                the fit.
            max_workers: the most workers the job may grow to while it runs: a process started
                with a rank from the launched number on (and `LIGHTNING_PRAGUE_REJOIN=1`) joins the
                running fit as a lost rank's new process does (see `docs/fault_tolerance.md`, "Scale
                up"). Unset: the workers the job was launched with.
            plane: `HOST:PORT` of a plane service (`lightning-prague plane`) that hosts the job's store
                and control plane on a host of your choice; unset: `LIGHTNING_PRAGUE_PLANE`, else
                global rank 0 starts them on its node, and the job ends with that node. With a
                service, rank 0's node can be lost like any other (`docs/fault_tolerance.md`, "The
                control plane as a service"); every rank needs the job's secret.
            plane_wait: seconds a rank waits for the control plane to come back after its connection
                closed (the supervisor or plane service died and is started again: it takes the job
                back from its journal, `docs/fault_tolerance.md`, "The control plane dies too"); 0:
                the control plane is lost at once and every fit fails with `ControlPlaneLost`. Unset:
                `LIGHTNING_PRAGUE_PLANE_WAIT`, else 60.
            replica_size: consecutive ranks that train one model synchronously (their gradients
                averaged at every step by `DistributedDataParallel` on the replica's own process
                group) and decentralize as one unit: `"node"` for the ranks of a node; 1 (the
                default): every rank on its own. Schedules and groups are drawn over the replicas,
                rank `i` of each averaging its slice of the model with rank `i` of the others; the
                work queue hands a replica one chunk of `replica_size` batches per step (map-style
                data only). A lost rank loses its replica; with `max_restarts` the replica comes
                back whole where its data comes from the work queue (with `shard=True` shard by
                shard; not with a schedule in rounds); `max_workers` must stay unset. See
                `docs/replica_groups.md`.
            shard: shard the model over each replica's ranks with FSDP2 (`fully_shard` on the
                replica's ranks: parameters, gradients and optimizer state split `replica_size`
                ways) instead of keeping it whole on each; needs `replica_size`. The strategy shards
                every submodule that holds parameters of its own, then the module, unless
                `configure_model` sharded it already (on `strategy.device_mesh`, the replica's
                ranks); the exchanges then average each rank's own shards with the same shards of
                the other replicas. Checkpoints hold the consensus model and optimizer state as
                `state_dict_type` says.
            state_dict_type: how checkpoints hold a model sharded with `shard=True`, as Lightning's
                `FSDPStrategy` names it: `"full"` (the default: one file with the whole model and
                optimizer state, gathered inside one replica, which any Lightning job loads) or
                `"sharded"` (a directory written shard by shard with `torch.distributed.checkpoint`,
                in the layout of Lightning's `ModelParallelStrategy`: no rank gathers the whole
                model; `lightning-prague consolidate` makes one file of it). See
                `docs/checkpoints.md`.
            auto_wrap_policy: the units a model is sharded in with `shard=True`, as Lightning's
                `FSDPStrategy` takes them: a set of module classes (`{Block}`, or their import paths
                in a config file), each submodule of which FSDP2 gathers whole for its forward and
                backward. Unset: every submodule that holds parameters of its own. A model that
                `configure_model` sharded itself keeps its units.
            **ddp_kwargs: options of Lightning's `DDPStrategy` / `DistributedDataParallel`, for code
                moved from DDP. The model is not wrapped in `DistributedDataParallel` (replicas
                average parameters in groups, not gradients), so `find_unused_parameters`,
                `static_graph`, `gradient_as_bucket_view` (and the other options whose purpose
                already holds, `lightning_prague.strategies.ddp_options.DDP_OPTIONS`) are accepted
                and ignored; the others (`broadcast_buffers=True`, `bucket_cap_mb` - use `bucket_mb`,
                `ddp_comm_hook`, `model_averaging_period` - use `sync_every`, ...) raise a
                `ConfigurationError` that says what to use instead. Any other keyword is a `TypeError`.
        """
        check_ddp_options(self.strategy_name, ddp_kwargs, strategy_options(type(self), DecentralizedStrategy))
        #: the shared options, validated (`ConfigurationError` for a value no fit could use)
        self.options = StrategyOptions(
            sync_every=sync_every, seed=seed, timeout=timeout, average_at_sync=average_at_sync, bucket_mb=bucket_mb,
            min_workers=min_workers, hang_timeout=hang_timeout, hang_factor=hang_factor,
            leave_out_after=leave_out_after, sync_timeout=sync_timeout, coordinator_port=coordinator_port,
            max_restarts=max_restarts, max_workers=max_workers, plane=plane, plane_wait=plane_wait,
            replica_size=replica_size, shard=shard, state_dict_type=state_dict_type, auto_wrap_policy=auto_wrap_policy,
        )  # fmt: skip
        if replica_size != 1 and not self.takes_replicas:
            raise ConfigurationError(
                f"replica_size={replica_size!r}: strategy={self.strategy_name!r} does not train in replica groups "
                "yet; 'prague', 'partial_reduce' and 'decent_adam' do (docs/replica_groups.md)"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=self.options.backend_timeout,  # fires after every one of ours
            start_method=start_method,
        )
        #: rank -> (wall-clock time this rank heard of it, why): workers lost during the last fit
        self.lost_workers: dict[int, tuple[float, str]] = {}
        #: batches this process trained in a fit attempt it was left out of (`leave_in_place`)
        self._carried_batches = 0
        #: times this process came back in place after it was left out (`leave_in_place`)
        self.comebacks = 0
        #: the last synchronization point changed the membership (see `Survivors.follow_membership`)
        self.regrouped = False
        #: this process's membership of the job (store, control plane, our process group)
        self.job: Job | None = None
        #: this fit's session: control session, worker, exchanger (`None` outside an asynchronous fit)
        self.training: TrainingSession | None = None
        #: this rank's replica's process group during a fit in replica groups (`replica_size`)
        self._replica_group: dist.ProcessGroup | None = None
        #: a gloo group of the same ranks where the replica's own group is on another backend (NCCL)
        self._replica_host_group: dist.ProcessGroup | None = None
        #: this fit's agreement of a sharded replica's ranks on the admissions they send their shards for
        self._donation_agreement: DonationAgreement | None = None
        self._device_mesh: Any = None
        #: this rank's phase between synchronization points
        self.controller = SyncController()
        #: Lightning reported an exception (`on_exception`) during this fit
        self.failed = False
        #: per-step schedules on global progress (work-queue strategies during fit)
        self.progress: GlobalProgress | None = None
        self.local_steps = 0
        self.batches_done, self._carried_batches = self._carried_batches, 0  # 0 but after a comeback in place
        #: the epoch this process joined the fit inside (its state from a live member, taken inside that epoch)
        self.joined_epoch: Optional[int] = None
        #: the global step of the state a live member sent this rejoining process (`None`: it did not rejoin)
        self.joined_at_step: Optional[int] = None
        #: what was warned about once (a local collective, a checkpoint between synchronization points)
        self.warned: set[str] = set()
        self._trainer: Trainer | None = None
        #: measure the replicas' exact consensus error at every synchronization point (ConsensusMonitor)
        self.measure_consensus = False
        #: the last measurement: mean_i ||x_i - x_bar||^2 / ||x_bar||^2 before the global average
        self.consensus_error: float | None = None
        # the parts that do the work (one module each; see the module docstring)
        self.collectives = RoutedCollectives(self)
        self.loaders = StrategyLoaders(self)
        self.stops = Stops(self)
        self.synchronizer = Synchronizer(self)
        self.survivors = Survivors(self)
        self.peer_state = PeerState(self)

    # -- the options, read-only (`StrategyOptions`) ------------------------------------------------
    sync_every = Option[int]()
    seed = Option[int]()
    #: seconds one operation may take (`timeout`)
    operation_timeout = Option[float]()
    #: seconds for every rank to reach one synchronization point (`sync_timeout`, resolved)
    sync_timeout = Option[float]("sync_bound")
    average_at_sync = Option[bool]()
    bucket_mb = Option[float]()
    min_workers = Option[int]()
    max_workers = Option[Optional[int]]()
    #: the control plane's port; `None`: `LIGHTNING_PRAGUE_CONTROL_PORT` or a free one
    coordinator_port = Option[Optional[int]]()
    max_restarts = Option[int]()
    #: a plane service's `HOST:PORT`; `None`: `LIGHTNING_PRAGUE_PLANE`, else rank 0 starts the supervisor
    plane = Option[Optional[str]]()
    #: seconds a rank waits for its control plane to come back; `None`: `LIGHTNING_PRAGUE_PLANE_WAIT`, else 60
    plane_wait = Option[Optional[float]]()
    hang_rule = Option[HangRule]()
    #: consecutive ranks that train one model synchronously (`"node"`: a node's); see `replicas`
    replica_size = Option[Union[int, str]]()
    #: the model is sharded over each replica's ranks (FSDP2)
    shard = Option[bool]()
    #: how checkpoints hold a sharded model: `"full"` or `"sharded"` (DCP, shard by shard)
    state_dict_type = Option[str]()
    #: the module classes a sharded model is sharded in (`()`: every submodule with parameters of its own)
    auto_wrap_policy = Option[Any]()

    # -- this fit's session (None outside an asynchronous fit) ------------------------------------
    @property
    def session(self) -> Session | None:
        return self.training.session if self.training is not None else None

    @property
    def worker(self) -> GroupWorker | None:
        return self.training.worker if self.training is not None else None

    @property
    def exchanger(self) -> Exchanger | None:
        return self.training.exchanger if self.training is not None else None

    # -- hooks for subclasses ----------------------------------------------------------------
    @abstractmethod
    def make_policy(self) -> GroupingPolicy:
        """Who averages with whom: the coordinator's grouping policy for this fit.

        Called at setup with `world_size` known; raise `ConfigurationError` for options the
        world cannot satisfy (before any process group or thread starts). It changes nothing on
        the strategy: what the exchanges need of the policy, `make_exchanger` is given.
        """

    @abstractmethod
    def make_exchanger(self, worker: GroupWorker, tensors: BucketedTensors, policy: GroupingPolicy) -> Exchanger:
        """How this rank's exchanges run relative to its steps (see `lightning_prague.core.exchange.overlap`);
        `policy`: this fit's, as `make_policy` returned it."""

    # -- setup / teardown ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The ranks of the library's world: the launched workers (`world_size`), or `max_workers`
        if more (places new workers may join). Policies, topologies and the control plane count these."""
        return self.options.capacity(self.world_size)

    @property
    def data_workers(self) -> int:
        """The workers the work queue and global progress count: the ranks (`capacity`), or in replica
        groups the replicas, each training one batch per rank at a step."""
        return self.capacity // self.replicas.replica_size

    @property
    def workers_per_node(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

    def _replica_process_group(self) -> dist.ProcessGroup:
        """This rank's replica's process group, made by its ranks when first asked for in a fit."""
        if self._replica_group is None:
            self._replica_group = replica_group(
                self.replicas,
                self.global_rank,
                self._get_process_group_backend(),
                timedelta(seconds=self.operation_timeout),
                self.root_device if self.root_device.type != "cpu" else None,
                self._came_back(),
            )
        return self._replica_group

    def _came_back(self) -> Optional[tuple[dist.Store, int]]:
        """For a replica come back (this process rejoined): the job's store its ranks meet on and the
        membership epoch of their admission (`replica_group`'s `came_back`); else `None`."""
        admission = self.training.admission if self.training is not None else None
        if admission is None:
            return None
        store = self._require_job().store
        assert store is not None
        return store, int(admission.release.get("epoch", 0))

    @property
    def replicas_come_back(self) -> bool:
        """Whether a lost replica's new processes can rejoin the fit: replica groups whose data comes from
        the work queue (the fit's state from one live rank, or shard by shard from one live replica's
        ranks with `shard=True`)."""
        return self.shards_by_work_queue

    def refuse_replica_restarts(self) -> None:
        """`ConfigurationError` for `max_restarts` in replica groups that cannot come back (called once the
        strategy knows where its data comes from: `replicas_come_back`)."""
        if self.options.replica_size != 1 and self.max_restarts and not self.replicas_come_back:
            raise ConfigurationError(
                f"strategy={self.strategy_name!r} with replica_size={self.options.replica_size!r} and "
                f"max_restarts={self.max_restarts}: a lost replica comes back only where its data comes from the "
                "work queue, and a schedule in rounds trains equal shards; use pace='own', or set max_restarts=0"
            )

    def check_replicas_come_back(self) -> None:
        """`ConfigurationError` on a new process that rejoins a job in replica groups that cannot come back
        (`replicas_come_back`: a new `srun` step, a restarted container), before it asks to."""
        self.refuse_replica_restarts()
        if self.replicas.replica_size > 1 and self._require_job().joining and not self.replicas_come_back:
            raise ConfigurationError(
                f"rank {self.global_rank}'s new process cannot rejoin: a lost replica comes back only under the work "
                "queue, not in replicas whose data is in equal shards (a schedule in rounds; docs/replica_groups.md)"
            )

    def replica_host_group(self) -> dist.ProcessGroup:
        """A gloo group of this rank's replica, for the replica's agreements on numbers in host memory (a
        stop, whether a round is done), so they never wait for the device: the replica's own group on
        gloo, else a second group made once per fit."""
        group = self._replica_process_group()
        if dist.get_backend(group) == "gloo":
            return group
        if self._replica_host_group is None:
            self._replica_host_group = replica_group(
                self.replicas, self.global_rank, "gloo", timedelta(seconds=self.operation_timeout),
                came_back=self._came_back(),
            )  # fmt: skip
        return self._replica_host_group

    def replica_agreement(self) -> Optional[ReplicaAgreement]:
        """How this rank's replica agrees on what its ranks must do alike (`ReplicaAgreement`): mix a gossip
        round in at its own pace (`pace="own"`), and, come back, the round it takes gossip up at; `None`
        without replicas."""
        if self.replicas.replica_size == 1:
            return None
        layout = self.replicas
        what = f"rank {self.global_rank}'s replica (ranks {list(layout.ranks_of(layout.replica_of(self.global_rank)))})"
        return ReplicaAgreement(self.replica_host_group(), timedelta(seconds=self.operation_timeout), what)

    def donation_agreement(self) -> Optional[DonationAgreement]:
        """How the ranks of a replica sharded over them (`shard=True`) agree on the admissions they send
        their shards for, so that a replica coming back gets shards of one moment
        (`DonationAgreement`); `None` otherwise (one donor sends the whole model)."""
        if not self.shard or self._replica_group is None or self.training is None:
            return None
        if self._donation_agreement is None:
            layout = self.replicas
            ranks = list(layout.ranks_of(layout.replica_of(self.global_rank)))
            what = f"rank {self.global_rank}'s replica (ranks {ranks})"
            timeout = timedelta(seconds=self.operation_timeout)
            self._donation_agreement = DonationAgreement(self.replica_host_group(), timeout, what)
        return self._donation_agreement

    @property
    def device_mesh(self) -> Any:
        """The ranks of this rank's replica as a 1-D `DeviceMesh` (dimension `"shard"`), for
        `configure_model` to `fully_shard` the model on with `shard=True`; `None` without replicas."""
        if self.replicas.replica_size == 1:
            return None
        if self._device_mesh is None:
            self._device_mesh = replica_mesh(self._replica_process_group(), self.root_device.type)
        return self._device_mesh

    def _column(self, everyone: tuple[int, ...]) -> tuple[int, ...]:
        """This rank's column among the live ranks `everyone`: rank `i` of each replica all of whose ranks
        are live (a replica with a rank gone takes part in nothing; this rank alone if its own is one)."""
        layout = self.replicas
        live = set(everyone)
        whole = [r for r in range(layout.replicas) if set(layout.ranks_of(r)) <= live]
        if layout.replica_of(self.global_rank) not in whole:
            return (self.global_rank,)
        return layout.column(self.global_rank, whole)

    @property
    def replicas(self) -> ReplicaLayout:
        """This job's replica groups (`replica_size`): every rank its own replica by default."""
        layout = ReplicaLayout.resolve(self.replica_size, self.world_size, self.workers_per_node)
        if layout.replica_size > 1 and layout.replicas < 2:
            raise ConfigurationError(
                f"replica_size={self.replica_size!r} makes the job's {self.world_size} ranks one replica: that is "
                "DDP (strategy='ddp'), with nothing to decentralize"
            )
        return layout

    @override
    def setup(self, trainer: Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_lightning_internals(trainer, self.strategy_name)  # before anything reads or patches them
            if self.shards_by_work_queue:
                check_trainer(trainer, self.strategy_name)
            policy = self.make_policy()  # validates group_size against the world before anything starts
        self._trainer = trainer
        self.controller.reset()
        asynchronous = fitting and self.world_size >= 2
        if asynchronous:
            check_layer_sync(self, self.strategy_name)
            # before Lightning's setup: configure_optimizers may read trainer.estimated_stepping_batches,
            # which loads the training data (through the work queue) there
            self.check_replicas_come_back()
            self.training = TrainingSession(self._require_job(), self.session_plan(policy))
            self.training.open()
            if self.training.admission is not None:  # rejoined: the others train on, unaligned with it
                self.controller.batch_starts()
                trainer.num_sanity_val_steps = 0  # the fit is under way: no sanity check (and no collectives)
                self.survivors.assign_rank_zero()  # the leader stays whoever leads now
            replacements = {**self.stops.replacements(trainer), **self.loaders.replacements(trainer)}
            if self.shards_by_work_queue:
                self.progress = GlobalProgress(trainer, self.data_workers, self.controller, self.synchronize)
                replacements.update(self.progress.replacements())
            _patches.install(trainer, replacements, self.strategy_name)
        super().setup(trainer)
        if not asynchronous:
            return
        assert self.training is not None
        self.training.start(averaged_state(self.lightning_module))  # the parameters on their final device
        assert self.training.worker is not None  # a joiner this rank's meeting waits for: its state goes out there
        self.training.worker.on_admission = lambda: self.synchronizer.follow_admissions(inside_only=True)
        if self.shard:  # a synchronization point averages each shard with the same shards of the other replicas
            self.training.worker.averaged_with = self._column
        self.loaders.sharded_members = self._require_job().members
        for module in self.lightning_module.modules():  # torchmetrics' syncs survive a lost rank too
            if isinstance(module, Metric) and module.dist_sync_fn is None:
                module.dist_sync_fn = self.collectives.gather_metric_state
        self.local_steps = 0
        self.batches_done = 0
        if not any(isinstance(cb, SyncPoints) and cb.strategy is self for cb in trainer.callbacks):
            trainer.callbacks.insert(0, SyncPoints(self))

    def session_plan(self, policy: GroupingPolicy) -> SessionPlan:
        """The factory of this fit's session: what it needs, from this strategy's options (starts nothing)."""
        options = self.options
        config = options.session_config(
            self.world_size, policy, self.avoid_stragglers, self.avoid_busy, self.replicas.replica_size
        )
        exchanger = partial(self._exchanger, policy=policy)
        return SessionPlan(config, exchanger, options.operation_timeout, options.bucket_bytes, options.sync_bound)

    def _exchanger(self, worker: GroupWorker, tensors: BucketedTensors, policy: GroupingPolicy) -> Exchanger:
        """`make_exchanger`'s, with a replica's slices put together where its ranks average them apart: a
        whole model on each rank of a replica, exchanged by the groups of a work-queue strategy (each rank
        averages its own slice with its column, `lightning_prague.core.replicas.reassembly`)."""
        layout = self.replicas
        gossip = isinstance(policy, SchedulePolicy)  # (its rounds put a replica's slices together themselves)
        if not self.shards_by_work_queue or layout.replica_size == 1 or self.shard or gossip:
            return self.make_exchanger(worker, tensors, policy)
        part = worker.part = (layout.index_of(self.global_rank), layout.replica_size)
        exchanger = self.make_exchanger(worker, tensors, policy)
        exchanger.reassemble = SliceReassembly(lambda: worker.tensors, self._replica_process_group(), part)
        return exchanger

    def _require_job(self) -> Job:
        if self.job is None:
            raise ConfigurationError(
                f"strategy={self.strategy_name!r} found no job: its setup_distributed did not run (was "
                "torch.distributed initialised by a subclass that overrides it?)"
            )
        return self.job

    @override
    def setup_distributed(self) -> None:
        """Lightning's rank bookkeeping, then `init_job`: the supervisor (started by global rank 0)
        hosts the store and the control plane, and our exchanges get a process group of their own."""
        backend = self._get_process_group_backend()
        if "nccl" in backend:
            # a communicator error (a lost peer) aborts that communicator without ending the process
            # (2: CleanUpOnly; torch's default 3 would end it): the survivors rebuild their group
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if self.world_size < 2 and not dist.is_initialized():
            super().setup_distributed()
            return
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self.cluster_environment.main_port)
        advice = secret_advice(self.num_nodes)
        if advice is not None:
            rank_zero_warn(advice)
        self.job = init_job(
            self.global_rank,
            self.capacity,
            backend,
            self.operation_timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
            pg_timeout=self._timeout,
            control_port=self.coordinator_port,
            launched=self.world_size,
            log_dir=self._supervisor_log_dir(),
            plane=plane_address(self.plane),
            plane_wait=self.plane_wait,
        )
        supervisor = self.job.supervisor
        if supervisor is not None and not supervisor.adopted:
            rank_zero_info(f"lightning-prague: the supervisor (pid {supervisor.pid}) logs to {supervisor.log_file}")

    def _supervisor_log_dir(self) -> Optional[str]:
        """Where the supervisor's log stays: `LIGHTNING_PRAGUE_LOG_DIR`, else `lightning_prague_logs/` in the
        trainer's `default_root_dir`, next to Lightning's own logs (it outlives a job whose `$TMPDIR`
        the cluster wipes)."""
        if os.environ.get(LOG_DIR_VARIABLE):
            return os.environ[LOG_DIR_VARIABLE]
        try:
            trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        except RuntimeError:  # not attached to a trainer (`LightningModule.trainer` says so)
            trainer = None
        root = getattr(trainer, "default_root_dir", None)
        return os.path.join(root, "lightning_prague_logs") if root else None

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":  # Lightning's would SIGKILL every rank when one fails
            assert self.cluster_environment is not None
            self._launcher = SurvivingScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes, max_restarts=self.max_restarts
            )
        elif self._start_method == "fork":  # forked ranks: the survivors go on, a lost one is forked again
            self._launcher = SurvivingForkLauncher(self, start_method="fork")
        else:  # its ranks come back in place when left out, as the script launcher's do
            if self.max_restarts > 0:  # torch.multiprocessing ends every rank when one dies: nothing to restart
                warnings.warn(
                    f"max_restarts={self.max_restarts} is ignored with start_method={self._start_method!r}: "
                    "torch.multiprocessing ends every rank when one dies. Use start_method='popen' (the default) "
                    "or 'fork'",
                    stacklevel=2,
                )
            self._launcher = ComebackMultiProcessingLauncher(self, start_method=self._start_method)

    def leave_in_place(self) -> None:
        """The control plane left this rank out of the running fit, and its attempt ended: the job
        becomes a joiner of that fit (`lightning_prague.strategies.in_place`)."""
        self._require_job().leave_in_place()
        self._carried_batches = self.batches_done  # this process's count goes on
        self.comebacks += 1

    @property
    @override
    def is_global_zero(self) -> bool:
        """The lowest live rank: global rank 0, or its successor once rank 0 was lost."""
        if self.job is not None:
            return self.global_rank == self.job.leader
        return super().is_global_zero

    @override
    def configure_ddp(self) -> None:
        # no DistributedDataParallel: replicas only have to start equal
        assert self.model is not None
        rejoined = self.job is not None and self.job.rejoined
        # a rejoined rank's state comes from a live member (the default group may hold ranks that moved on)
        if not rejoined and not is_sharded(self.model):  # (sharded in configure_model: its shards come from one seed)
            _sync_module_states(self.model)
        if self.replicas.replica_size == 1:
            return
        # a replica's ranks average their gradients each step (core.replicas.sync), or hold shards of its model
        if self.shard:
            assert isinstance(self.model, LightningModule)
            shard_model(self.model, self.device_mesh, self.auto_wrap_policy or ())
        else:
            self.model = synchronous(self.model, self._replica_process_group(), self.determine_ddp_device_ids())

    @override
    def teardown(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self._trainer is not None:
            _patches.remove(self._trainer)
            self._trainer.callbacks[:] = [cb for cb in self._trainer.callbacks if not isinstance(cb, SyncPoints)]
        if self.training is not None:
            if not self.failed:
                self.survivors.report_losses()
            # an error (Lightning called on_exception), or torn down mid-phase: leave, so nobody waits for us
            interrupted = self.failed or not self.controller.aligned
            self.training.close(interrupted=interrupted)
            self.training = None
        self.controller.reset()
        self.failed = False
        self.stops.close()
        self._donation_agreement = None
        if self._replica_host_group is not None:
            dist.destroy_process_group(self._replica_host_group)
            self._replica_host_group = None
        super().teardown()
        if self._replica_group is not None and not is_sharded(self.lightning_module):
            # (a sharded model keeps its replica's group: its parameters are shards over it, after the fit too)
            dist.destroy_process_group(self._replica_group)
            self._replica_group = self._device_mesh = None

    def progressed(self) -> None:
        """A training or validation batch starts: progress for the hang detector (and, in a long
        validation, where a rank cut off from the control plane raises)."""
        if self.session is not None:
            self.session.raise_if_cut_off("a validation batch")
            self.session.beacon.bump()

    def outside_steps(self) -> None:
        """Work outside the steps follows (an epoch's end, a checkpoint): the long hang bound applies."""
        if self.session is not None:
            self.session.beacon.set_busy()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """The fit failed on this rank: its teardown leaves the session, so the others are told at once
        (a coordinated SIGTERM stop is no failure: every rank met at the stop point). Under torchrun
        an error that follows the agent's SIGTERM is that SIGTERM's doing (the agent signals the
        node's processes together, so a DataLoader worker may die of it before the next batch's
        check): this rank leaves the job, as on the SIGTERM itself."""
        self.failed = not isinstance(exception, SIGTERMException)
        if self.failed and self.stops.leaving_on_agents_sigterm():
            self.stops.say_leaving()
            self.failed = False
        if self.session is not None:  # its exception path (a checkpoint) may outlast a lost control plane
            self.session.fit_failed()
            if self.failed:
                self._say_replica_lost()
        super().on_exception(exception)

    def _say_replica_lost(self) -> None:
        """Where this rank fails because a rank of its replica was lost, say so: the error it fails with is
        the backend's (a gloo pair's read error, an NCCL timeout)."""
        if self._replica_group is None or self.session is None:
            return
        layout = self.replicas
        ranks = layout.ranks_of(layout.replica_of(self.global_rank))
        deadline = time.monotonic() + REPLICA_LOSS_NOTICE_SECONDS  # (the backend's error comes first)
        while not (lost := {r: self.session.departed[r] for r in ranks if r in self.session.departed}):
            if time.monotonic() > deadline:
                log.error("rank %d failed: its replica (ranks %s) leaves with it", self.global_rank, list(ranks))
                return
            time.sleep(0.05)
        log.error(
            "rank %d leaves the job with its replica (ranks %s): rank(s) %s of it were lost (%s)",
            self.global_rank,
            list(ranks),
            sorted(lost),
            "; ".join(lost.values()),
        )

    # -- training step ------------------------------------------------------------------------
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.progress is not None and self.progress.loader is not None:
            self.progress.loader.report_trained()  # trained: before its update reaches any other model
            # the next batch now (`strategies.fetching`): a wait at the work queue's end, which serves the
            # groups peers draw this rank into, comes before the step's exchange work, which puts a
            # replica's model together after it
            self.progress.look_ahead()
        if self.worker is not None and self.exchanger is not None:
            self.local_steps += 1
            self.worker.version += 1
            if self.local_steps % self.sync_every == 0:
                self.exchanger.step()
        return output

    def enter_async_phase(self) -> None:
        if self.session is not None:  # a rank cut off from the control plane raises here, in the training thread
            self.session.raise_if_cut_off("a training batch")
        if self.exchanger is not None:
            self.controller.batch_starts()
            self.batches_done += 1
            if self.worker is not None:
                self.worker.resumed()  # after a meeting: joiners may be admitted again
            self.exchanger.start()

    def drain(self) -> None:
        """Finish the exchanges in flight and stop the communication thread (a synchronization point)."""
        if self.exchanger is not None:
            self.exchanger.drain()

    # -- synchronization points (`sync_points`) ---------------------------------------------------
    def synchronize(
        self, name: str, progress: Optional[int] = None, inside_epoch: bool = False, validate: bool = False
    ) -> None:
        """Drain, meet every rank, then average (if `average_at_sync`). No-op when already aligned.

        `progress`: the global batch count this synchronization point stands at (a boundary), or
        `None` where it is read after the ranks met (the end of an epoch); `inside_epoch` and
        `validate`: see `SyncController.met`.
        """
        self.synchronizer.synchronize(name, progress, inside_epoch, validate)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's shards (validation; training without the work queue): among the live ranks."""
        return self.loaders.sampler_kwargs() or super().distributed_sampler_kwargs

    @property
    def wait_seconds(self) -> float:
        """Seconds this rank's training thread has spent waiting on other ranks during this fit:
        exchanges not hidden behind computation, and synchronization points."""
        if self.worker is None or self.exchanger is None:
            return 0.0
        return self.exchanger.wait_seconds + self.worker.stats.sync_seconds

    @property
    def aligned(self) -> bool:
        """True when every rank is at the same point of the training loop (collectives are safe)."""
        return self.controller.aligned

    # -- Lightning's collectives (`collectives`): local while unaligned, else over the live members
    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.collectives.barrier(super().barrier, *args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.collectives.broadcast(super().broadcast, obj, src)

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        return self.collectives.reduce(super().reduce, tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        return self.collectives.all_gather(super().all_gather, tensor, group, sync_grads)

    # -- checkpoints --------------------------------------------------------------------------
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state as a checkpoint holds it: at a synchronization point (every rank
        saves there together) the mean over the live workers of its floating-point state (Adam's
        moments and step count, momentum buffers), as the parameters are the mean, so a resumed
        run starts every worker from the same state, and from all workers' rather than rank 0's.
        Between synchronization points (a checkpoint of one rank's replica), or if the workers'
        states differ in layout (one never stepped), this rank's own state."""
        if self.shard and self._replica_group is not None:  # this replica's, whole or shard by shard
            if self.state_dict_type == "sharded" or self.peer_state.dumping:  # (a rejoining rank gets its shard)
                return optimizer_shards(self.lightning_module, optimizer)
            return full_optimizer_state(self.lightning_module, optimizer)
        state = super().optimizer_state(optimizer)
        if self.peer_state.dumping:  # the state sent to a rejoining rank: this replica's own
            return state
        return self.synchronizer.optimizer_state(state)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state; with `shard=True` the whole model, gathered inside the replica (a
        collective of the replica's ranks: every rank saves a checkpoint together), or this rank's
        shards of it with `state_dict_type="sharded"`."""
        if is_sharded(self.lightning_module):
            if self.state_dict_type == "sharded" or self.peer_state.dumping:  # (a rejoining rank gets its shard)
                return model_shards(self.lightning_module)
            return full_model_state(self.lightning_module)
        return super().lightning_module_state_dict()

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Lightning's, but a whole model is split into this rank's shards where `configure_model`
        sharded the module already (the strategy shards it after loading otherwise)."""
        if checkpoint.get(LOADED_SHARD_BY_SHARD):  # (`load_checkpoint` loaded the shards already)
            return
        if is_sharded(self.lightning_module):
            load_full_model_state(self.lightning_module, checkpoint["state_dict"], strict)
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Lightning's, but a whole optimizer state is split into this rank's shards with `shard=True`."""
        if checkpoint.get(LOADED_SHARD_BY_SHARD):  # (`load_checkpoint` loaded the shards already)
            return
        if not is_sharded(self.lightning_module):
            super().load_optimizer_state_dict(checkpoint)
            return
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_full_optimizer_state(self.lightning_module, optimizer, state)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """A rejoining rank gets its checkpoint when it is admitted, in its setup (`rejoin`); a model
        sharded over its replica (`shard=True`) loads into its shards, which setup makes."""
        return self.shard or (self.job is not None and (self.job.joining or self.job.rejoined))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """`PEER_CHECKPOINT`: the state a live member sent this rejoining rank; else Lightning's."""
        if str(checkpoint_path) == PEER_CHECKPOINT:
            admission = self.training.admission if self.training is not None else None
            if admission is None:
                raise ConfigurationError(
                    f"ckpt_path={PEER_CHECKPOINT!r} is the state of a rank that rejoins a running fit; this "
                    "process did not rejoin one"
                )
            checkpoint = self.peer_state.checkpoint(admission.payload)
            step = checkpoint.get("global_step")
            self.joined_at_step = step if type(step) is int else None
            if checkpoint.pop(SENT_SHARD_BY_SHARD, False) is True:  # its shards, from the same rank of a live replica
                self._load_peer_shards(checkpoint)
                checkpoint[LOADED_SHARD_BY_SHARD] = True
            if self._trainer is not None:  # the members' latest metrics, where this process logged none yet
                for name, value in members_metrics(checkpoint.pop(MEMBERS_METRICS, None)).items():
                    self._trainer.callback_metrics.setdefault(name, value)
            if checkpoint.pop(TAKEN_AT_EPOCH_END, False) is True:
                return checkpoint  # at an epoch's end: this rank starts the next epoch with the members
            # taken at a batch boundary inside the epoch, perhaps the donor's last batch: this rank goes on
            # in that epoch (it ends when its data does), as the members do
            epoch_under_way(checkpoint)
            self.joined_epoch = int(checkpoint.get("epoch", 0))
            if not self.shards_by_work_queue:  # lock-step shards: go on where the lost rank stood in its own
                resumed = self.loaders.resume_shard(admission.position, int(checkpoint.get("epoch", 0)))
                if resumed is None:
                    # its rank stood in an earlier epoch, which the control plane admits at an epoch's end
                    # only (`CoordinatorSession.nothing_left_in_epoch`): a lock-step rank with nothing of
                    # this epoch to train would wait for the others in idle gossip rounds (not supported)
                    raise EpochMovedOn(
                        f"rank {self.global_rank} stood in epoch {(admission.position or {}).get('epoch')} and "
                        f"the others are in epoch {checkpoint.get('epoch')}: it has nothing of this epoch to train"
                    )
                accumulate = self._trainer.accumulate_grad_batches if self._trainer is not None else 1
                resume_epoch_progress(checkpoint, resumed, accumulate)
            return checkpoint
        if is_sharded_checkpoint(checkpoint_path):
            checkpoint = self._load_shard_by_shard(Path(checkpoint_path))
        else:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if held_inside_epoch(checkpoint):  # (a checkpoint at the step budget, written before `save_checkpoint`
            epoch_under_way(checkpoint)  # said so: Lightning would resume at the next epoch, skipping this one's rest)
        return checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.outside_steps()
        if not self.controller.aligned and self.is_global_zero and "save_checkpoint" not in self.warned:
            self.warned.add("save_checkpoint")
            warnings.warn(
                "a checkpoint was saved between synchronization points: it holds rank 0's replica, not the "
                "consensus model. Save at epoch ends (ModelCheckpoint(every_n_epochs=...)) for the consensus model.",
                stacklevel=2,
            )
        loader = self.progress.loader if self.progress is not None else None
        if loader is not None and loader.held_back_at_budget:
            # stopped by `max_steps` inside an epoch: Lightning took the batch held back for the last of
            # its epoch and would resume at the next epoch, skipping the rest of this one
            epoch_under_way(checkpoint)
        if self.state_dict_type == "sharded" and self._replica_group is not None:
            self._save_shard_by_shard(checkpoint, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _writing_replica(self) -> int:
        """The replica that writes a checkpoint shard by shard: the leader's (the lowest live rank)."""
        leader = self.job.leader if self.job is not None else 0
        return self.replicas.replica_of(leader)

    def _save_shard_by_shard(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        """`state_dict_type="sharded"`: the writing replica's ranks save their shards together, in the
        directory its first rank named (`lightning_prague.strategies.sharded_checkpoints`); the other
        replicas, which hold the same consensus at a synchronization point, write nothing."""
        replica = self._writing_replica()
        if self.replicas.replica_of(self.global_rank) != replica:
            return
        group = self._replica_process_group()
        first = self.replicas.leader_of(replica)
        path = agreed_path(filepath, group, first, self.root_device)
        save_sharded(checkpoint, path, group, writes_metadata=self.global_rank == first)

    def _load_peer_shards(self, checkpoint: dict[str, Any]) -> None:
        """A rejoining rank of a replica sharded over its ranks: load the shards its donor sent (the
        same shards of a live replica, `PeerState`) into the model and the optimizers, sharded at setup."""
        load_model_shards(self.lightning_module, checkpoint["state_dict"])
        states = checkpoint.get("optimizer_states")
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ConfigurationError(
                f"rank {self.global_rank}: the state a live member sent holds "
                f"{len(states) if isinstance(states, list) else 'no'} optimizer states, this fit has "
                f"{len(self.optimizers)} optimizers"
            )
        for optimizer, state in zip(self.optimizers, states):
            load_optimizer_shards(self.lightning_module, optimizer, state)
        log.debug("rank %d: loaded its shards of the model and the optimizers from a live replica", self.global_rank)

    def _load_shard_by_shard(self, path: Path) -> dict[str, Any]:
        """A checkpoint directory written shard by shard: each rank loads its own shards into the model
        and the optimizers (sharded at setup, before this), and Lightning gets the rest."""
        if not is_sharded(self.lightning_module):
            raise ConfigurationError(
                f"{str(path)!r} is a checkpoint saved shard by shard (state_dict_type='sharded'): it loads into a "
                "model sharded with shard=True; for any other job, make one file of it first with `lightning-prague "
                "consolidate`"
            )
        optimizers = self.optimizers if self.lightning_module.trainer.state.fn == TrainerFn.FITTING else []
        checkpoint = load_sharded(path, self.lightning_module, list(optimizers))
        checkpoint[LOADED_SHARD_BY_SHARD] = True
        checkpoint.setdefault("optimizer_states", [])  # (loaded: Lightning only checks that the key is there)
        return checkpoint
