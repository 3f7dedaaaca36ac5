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

It adapts Lightning's hooks to three objects that do the work: the process's `Job` (the
supervisor, the store, our process group; `setup_distributed`), this fit's `TrainingSession`
(control session, worker, exchanger; built from `session_plan`) and the `SyncController` (the
phase state machine).
"""

from __future__ import annotations

import logging
import os
import signal
import time
import warnings
from abc import abstractmethod
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torchmetrics import Metric
from torchmetrics.utilities.distributed import gather_all_tensors
from typing_extensions import override

from lightning_prague.core.client.control import Session
from lightning_prague.core.comm.averaging import BucketedTensors, averaged_optimizer_state, averaged_state
from lightning_prague.core.comm.collectives import MemberCollectives
from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.data.progress import ProgressCounter
from lightning_prague.core.data.progress_loader import ProgressLoader
from lightning_prague.core.data.sharding import WorkQueueSampler
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.exchange.overlap import Exchanger
from lightning_prague.core.exchange.phases import SyncController
from lightning_prague.core.exchange.training import SessionPlan, TrainingSession
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.grouping.policies import GroupingPolicy
from lightning_prague.core.job import Job, init_job
from lightning_prague.core.protocol import REQUEUE, SIGTERM, STOP_SYNC, HangRule, SessionConfig, resolve_control_port
from lightning_prague.strategies import _patches
from lightning_prague.strategies._checks import check_layer_sync, check_lightning_internals, check_trainer
from lightning_prague.strategies.ddp_options import check_ddp_options, strategy_options
from lightning_prague.strategies.global_progress import GlobalProgress, batches_per_epoch
from lightning_prague.strategies.launcher import SurvivingScriptLauncher

log = logging.getLogger(__name__)


def _requeue_signal(environment: Optional[ClusterEnvironment]) -> int:
    """The cluster's requeue signal (SLURM's, as Lightning's SLURM environment names it; SIGUSR1)."""
    return int(getattr(environment, "requeue_signal", None) or signal.SIGUSR1)


#: Lightning's (and torch's) default timeout of DDP's collectives, seconds: the default `sync_timeout`
DDP_TIMEOUT = 1800.0


def watchdog_margin(timeout: float) -> float:
    """Seconds the backend's own timeout (NCCL's watchdog) waits beyond ours."""
    return max(30.0, 0.1 * timeout)


class SyncPoints(Callback):
    """Calls the strategy's synchronization points from the trainer's hooks; runs before other callbacks."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.strategy.progress is not None:
            self.strategy.progress.on_train_start()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.strategy.enter_async_phase()

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.strategy.progressed()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.outside_steps()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.strategy.progress is not None:
            self.strategy.progress.after_batch()  # a boundary: meet before step-based callbacks run

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.outside_steps()  # until its first batch: a meeting, loaders built
        if not self.strategy.controller.validation_starts():
            return  # the ranks met at the boundary just before
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.strategy.synchronize(f"validation@epoch{trainer.current_epoch}")
            if self.strategy.regrouped:  # ranks were lost at this very meeting
                self.strategy.reshard_validation()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.outside_steps()
        self.strategy.synchronize(f"epoch_end@epoch{trainer.current_epoch}")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.synchronize("fit_end")


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
        hang_timeout: float = 10.0,
        hang_factor: float = 20.0,
        sync_timeout: Optional[float] = None,
        coordinator_port: Optional[int] = None,
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
                `hang_timeout` (a worker without progress is declared hung and fenced, 10 s),
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
                per rank), `"spawn"`, `"fork"` (forked from this process, the fastest start) or
                `"forkserver"`. Only `"popen"` lets the other ranks go on when one fails (the
                others run on `torch.multiprocessing`, which ends every process).
            min_workers: stop the job (every rank at its next synchronization point, as when
                `trainer.should_stop` is set) when fewer workers than this remain.
            hang_timeout: the shortest time without training progress after which a worker is
                declared hung and fenced (`lightning_prague.core.plane.liveness`).
            hang_factor: a worker is declared hung after `max(hang_timeout, hang_factor x` its
                longest recent step`)` without progress (steps timed on that worker).
            sync_timeout: seconds the ranks may take to all reach a synchronization point (its
                meeting and Lightning's collectives there: a barrier after rank 0 wrote a
                checkpoint), and a worker may stay busy outside its steps (an epoch's end, a
                checkpoint) before it is declared hung. Unset: 1800 s, Lightning's DDP timeout, or
                `timeout` if that is longer; it must not be shorter than `timeout`.
            coordinator_port: the port (1-65535) on which the supervisor started by global rank 0
                serves the control plane (on every interface of the first node), for a firewall
                that only opens known ports; unset: the `LIGHTNING_PRAGUE_CONTROL_PORT`
                environment variable, else a free port. Setting both to different ports is an error.
            **ddp_kwargs: options of Lightning's `DDPStrategy` / `DistributedDataParallel`, for code
                moved from DDP. The model is not wrapped in `DistributedDataParallel` (replicas
                average parameters in groups, not gradients), so `find_unused_parameters`,
                `static_graph`, `gradient_as_bucket_view` (and the other options whose purpose
                already holds, `lightning_prague.strategies.ddp_options.DDP_OPTIONS`) are accepted
                and ignored; the others (`broadcast_buffers`, `bucket_cap_mb` - use `bucket_mb`,
                `ddp_comm_hook`, `model_averaging_period` - use `sync_every`, ...) raise a
                `ConfigurationError` that says what to use instead. Any other keyword is a `TypeError`.
        """
        check_ddp_options(self.strategy_name, ddp_kwargs, strategy_options(type(self), DecentralizedStrategy))
        if isinstance(timeout, timedelta):  # DDPStrategy's type
            timeout = timeout.total_seconds()
        resolve_control_port(coordinator_port)  # validated here; global rank 0's environment decides at launch
        if sync_every < 1:
            raise ConfigurationError(f"sync_every={sync_every} is invalid: it must be at least 1 local step")
        if timeout <= 0:
            raise ConfigurationError(f"timeout={timeout} is invalid: it must be a positive number of seconds")
        if bucket_mb <= 0:
            raise ConfigurationError(f"bucket_mb={bucket_mb} is invalid: it must be positive")
        if min_workers < 1:
            raise ConfigurationError(f"min_workers={min_workers} is invalid: it must be at least 1")
        if hang_timeout <= 0 or hang_factor <= 0:
            raise ConfigurationError(
                f"hang_timeout={hang_timeout} and hang_factor={hang_factor} are invalid: both must be positive"
            )
        sync_timeout = max(DDP_TIMEOUT, timeout) if sync_timeout is None else float(sync_timeout)
        if sync_timeout < timeout:
            raise ConfigurationError(
                f"sync_timeout={sync_timeout} is shorter than timeout={timeout}: a synchronization point contains "
                "operations, so its bound must be at least one operation's"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            # the backend's own timeout (NCCL's watchdog) fires after every one of ours, so our error,
            # which names the ranks and the operation, is the one the user sees
            timeout=timedelta(seconds=sync_timeout + watchdog_margin(sync_timeout)),
            start_method=start_method,
        )
        self.sync_every = sync_every
        self.seed = seed
        self.operation_timeout = float(timeout)
        #: seconds for every rank to reach one synchronization point (see `sync_timeout`)
        self.sync_timeout = sync_timeout
        self.average_at_sync = average_at_sync
        self.bucket_mb = bucket_mb
        self.min_workers = min_workers
        #: the control plane's port; `None`: `LIGHTNING_PRAGUE_CONTROL_PORT` or a free one
        self.coordinator_port = coordinator_port
        self.hang_rule = HangRule(floor=float(hang_timeout), factor=float(hang_factor))
        #: rank -> (wall-clock time this rank heard of it, why): workers lost during the last fit
        self.lost_workers: dict[int, tuple[float, str]] = {}
        self._sharded_members: tuple[int, ...] = ()  # the members Lightning's shards were last built for
        #: the last synchronization point changed the membership (see `_follow_membership`)
        self.regrouped = False
        #: leave workers that lag far behind out of other workers' groups (`GroupGenerator.lagging`)
        self.avoid_stragglers = False
        #: this process's membership of the job (store, control plane, our process group)
        self.job: Job | None = None
        #: this fit's session: control session, worker, exchanger (`None` outside an asynchronous fit)
        self.training: TrainingSession | None = None
        #: this rank's phase between synchronization points
        self.controller = SyncController()
        self._failed = False  # Lightning reported an exception (on_exception) during this fit
        self.sampler: WorkQueueSampler | None = None
        #: per-step schedules on global progress (work-queue strategies during fit)
        self.progress: GlobalProgress | None = None
        self.local_steps = 0
        self.batches_done = 0
        self._warned: set[str] = set()
        self._trainer: Trainer | None = None
        #: measure the replicas' exact consensus error at every synchronization point (ConsensusMonitor)
        self.measure_consensus = False
        #: the last measurement: mean_i ||x_i - x_bar||^2 / ||x_bar||^2 before the global average
        self.consensus_error: float | None = None

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
        world cannot satisfy (before any process group or thread starts).
        """

    @abstractmethod
    def make_exchanger(self, worker: GroupWorker, tensors: BucketedTensors) -> Exchanger:
        """How this rank's exchanges run relative to its steps (see `lightning_prague.core.exchange.overlap`)."""

    # -- setup / teardown ---------------------------------------------------------------------
    @property
    def workers_per_node(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices else 1

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
            self.training = TrainingSession(self._require_job(), self.session_plan(policy))
            self.training.open()
            replacements: dict[str, Callable[..., Any]] = {
                "_broadcast_sigterm_tensor": self._check_stop,
                "_sigterm_notifier_fn": self._on_sigterm,
                "_slurm_sigusr_handler_fn": self._on_requeue_signal,
                "_prepare_dataloader": self._wrap_prepare_dataloader(trainer._data_connector._prepare_dataloader),
            }
            if self.shards_by_work_queue:
                self.progress = GlobalProgress(trainer, self.world_size, self.controller, self.synchronize)
                replacements.update(self.progress.replacements())
            _patches.install(trainer, replacements, self.strategy_name)
        super().setup(trainer)
        if not asynchronous:
            return
        assert self.training is not None
        self.training.start(averaged_state(self.lightning_module))  # the parameters on their final device
        self._sharded_members = self._require_job().members
        for module in self.lightning_module.modules():  # torchmetrics' syncs survive a lost rank too
            if isinstance(module, Metric) and module.dist_sync_fn is None:
                module.dist_sync_fn = self._gather_metric_state
        self.local_steps = 0
        self.batches_done = 0
        if not any(isinstance(cb, SyncPoints) and cb.strategy is self for cb in trainer.callbacks):
            trainer.callbacks.insert(0, SyncPoints(self))

    def session_plan(self, policy: GroupingPolicy) -> SessionPlan:
        """The factory of this fit's session: what it needs, from this strategy's options (starts nothing)."""
        config = SessionConfig(
            self.world_size,
            policy,
            self.avoid_stragglers,
            sync_averages=self.average_at_sync,
            timeout=self.operation_timeout,
            hang=self.hang_rule,
            min_workers=self.min_workers,
            sync_timeout=self.sync_timeout,
            avoid_busy=getattr(self, "avoid_busy", False),
        )
        return SessionPlan(
            config, self.make_exchanger, self.operation_timeout, int(self.bucket_mb * 2**20), self.sync_timeout
        )

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
        self.job = init_job(
            self.global_rank,
            self.world_size,
            backend,
            self.operation_timeout,
            device_id=self.root_device if self.root_device.type != "cpu" else None,
            pg_timeout=self._timeout,
            control_port=self.coordinator_port,
        )

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if self._start_method == "popen":  # Lightning's would SIGKILL every rank when one fails
            assert self.cluster_environment is not None
            self._launcher = SurvivingScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

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
        _sync_module_states(self.model)

    @override
    def teardown(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self._trainer is not None:
            _patches.remove(self._trainer)
            self._trainer.callbacks[:] = [cb for cb in self._trainer.callbacks if not isinstance(cb, SyncPoints)]
        if self.training is not None:
            self._report_losses()
            # an error (Lightning called on_exception), or torn down mid-phase: leave, so nobody waits for us
            interrupted = self._failed or not self.controller.aligned
            self.training.close(interrupted=interrupted)
            self.training = None
        self.controller.reset()
        self._failed = False
        super().teardown()

    def _report_losses(self) -> None:
        session = self.session
        if session is None or not session.departed or self._failed:
            return
        self.lost_workers = {r: (session.departed_at.get(r, 0.0), why) for r, why in session.departed.items()}
        if self.is_global_zero:
            lines = "; ".join(
                f"rank {r} at {time.strftime('%H:%M:%S', time.localtime(at))}: {why}"
                for r, (at, why) in self.lost_workers.items()
            )
            stopped = ""
            if len(session.members) < self.min_workers:
                stopped = (
                    f"; fewer than min_workers={self.min_workers} remained, so the job stopped at its next "
                    "synchronization point"
                )
            warnings.warn(
                f"strategy={self.strategy_name!r} lost {len(self.lost_workers)} worker(s) during the fit and finished "
                f"it with ranks {list(session.members)}: {lines}{stopped}",
                stacklevel=2,
            )

    def progressed(self) -> None:
        """A training or validation batch starts: progress for the hang detector."""
        if self.session is not None:
            self.session.beacon.bump()

    def outside_steps(self) -> None:
        """Work outside the steps follows (an epoch's end, a checkpoint): the long hang bound applies."""
        if self.session is not None:
            self.session.beacon.set_busy()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """The fit failed on this rank: its teardown leaves the session, so the others are told at once
        (a coordinated SIGTERM stop is no failure: every rank met at the stop point)."""
        self._failed = not isinstance(exception, SIGTERMException)
        super().on_exception(exception)

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
        if self.worker is not None and self.exchanger is not None:
            self.local_steps += 1
            self.worker.version += 1
            if self.local_steps % self.sync_every == 0:
                self.exchanger.step()
        return output

    def enter_async_phase(self) -> None:
        if self.exchanger is not None:
            self.controller.batch_starts()
            self.batches_done += 1
            self.exchanger.start()

    def drain(self) -> None:
        """Finish the exchanges in flight and stop the communication thread (a synchronization point)."""
        if self.exchanger is not None:
            self.exchanger.drain()

    # -- synchronization points ---------------------------------------------------------------
    def synchronize(
        self, name: str, progress: Optional[int] = None, inside_epoch: bool = False, validate: bool = False
    ) -> None:
        """Drain, meet every rank, then average (if `average_at_sync`). No-op when already aligned.

        `progress`: the global batch count this synchronization point stands at (a boundary), or
        `None` where it is read after the ranks met (the end of an epoch); `inside_epoch` and
        `validate`: see `SyncController.met`.
        """
        if self.worker is None or not self.controller.must_meet:
            return
        self.drain()
        loader = self.progress.loader if self.progress is not None else None
        sampler = loader.sampler if loader is not None else None
        self._request_signal_stop()
        assert self._trainer is not None
        report: dict[str, Any] = {"stop": bool(self._trainer.should_stop)}
        if loader is not None:
            report["untrained"] = loader.untrained()
        if sampler is not None:
            report["speed"] = sampler.seconds_per_chunk
        if self.worker.synchronize(name, self.exchanger, **report):
            self._raise_stop()
        release = self.worker.release or {}
        if release.get("stop"):  # some rank decided to stop: every rank stops here, together
            self._trainer.should_stop = True
        if self.measure_consensus:
            self.consensus_error = self.worker.consensus_error()
        if self.average_at_sync:
            self._average_replicas(name)
        if loader is not None:
            loader.set_members(list(self.worker.members))
        self.regrouped = self._follow_membership()
        if loader is not None and self.is_global_zero:
            loader.forget_finished_epochs()
        if sampler is not None and "speeds" in release:
            # every rank's time per batch, for the work queue's tail decisions
            sampler.set_speeds(release["speeds"])
        self.controller.met(inside_epoch, validate)
        if loader is not None:
            loader.pending = list(release.get("pending", []))
            if self.progress is not None and self.progress.schedule is not None:
                reached = loader.synchronized(progress)
                if progress is None:
                    self.progress.at_synchronization(reached)

    def _average_replicas(self, name: str) -> None:
        """Right after the meeting `name`: one model on every live rank (a rank lost during the
        average: meet again without it and average again)."""
        assert self.worker is not None
        while not self.worker.global_average():
            self.worker.synchronize(f"{name}/again")
        self.worker.version = self.worker.released_version  # one model again: one version

    def _follow_membership(self) -> bool:
        """After a release: if it lost ranks, the data that Lightning shards by rank (validation, and
        training without the work queue) is sharded among the survivors from its next pass (their
        loaders are rebuilt: `distributed_sampler_kwargs`), and if rank 0 was lost its successor
        logs as rank zero. Returns whether the membership changed at this release."""
        job = self.job
        if job is None or job.members == self._sharded_members:
            return False
        self._sharded_members = job.members
        assert self._trainer is not None
        fit_loop = self._trainer.fit_loop
        fit_loop.epoch_loop.val_loop._combined_loader = None
        if not self.shards_by_work_queue:
            fit_loop._combined_loader = None  # from the next epoch on (this one's iterator goes on)
        if job.leader != 0 and self.is_global_zero and rank_zero_only.rank != 0:
            log.warning("rank %d: takes over global rank 0's duties (checkpoints, logging)", self.global_rank)
            rank_zero_only.rank = 0
        return True

    def reshard_validation(self) -> None:
        """The validation that starts now shards among the survivors (the membership changed at its
        own meeting, after Lightning built its loaders): rebuild them and the loop's fetcher."""
        assert self._trainer is not None
        loop = self._trainer.fit_loop.epoch_loop.val_loop
        loop._combined_loader = None
        loop.setup_data()
        loop.reset()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Lightning's shards (validation; training without the work queue): among the live ranks."""
        job = self.job
        if job is not None and len(job.members) < job.world_size and self.global_rank in job.members:
            return {"num_replicas": len(job.members), "rank": job.members.index(self.global_rank)}
        return super().distributed_sampler_kwargs

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

    # -- SIGTERM --------------------------------------------------------------------------------
    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if not self.controller.sigterm and self.launcher is not None:
            self.launcher.kill(signum)  # forward to this node's other processes, as Lightning does
        self.controller.sigterm = True

    def _on_requeue_signal(self, signum: int, frame: Any) -> None:
        """SLURM's requeue signal (`SLURMEnvironment(auto_requeue=True)`): Lightning's handler would
        write a checkpoint of this rank's replica from inside the handler, in the middle of a phase.
        It becomes a stop at the next batch instead, and the handler runs at the stop point."""
        self.controller.requeue_signal = signum
        self.controller.sigterm = True

    def _request_signal_stop(self) -> None:
        """A signal reached this process: ask every rank to stop (for the requeue signal, to write
        the requeue checkpoint as well)."""
        if self.worker is not None and self.controller.sigterm:
            self.worker.request_stop(REQUEUE if self.controller.requeue_signal is not None else SIGTERM)

    def _check_stop(self) -> None:
        """Before every training batch (where Lightning would broadcast its SIGTERM flag): local checks
        of what the control plane announced. A lost member ends the fit with an error naming it; a
        stop asked for by any rank (`trainer.should_stop`) ends this rank's epoch after this batch,
        so that every rank stops at the same synchronization point; SIGTERM drains and stops now."""
        if self.worker is None:
            return
        session = self.worker.session
        session.beacon.bump()
        session.check_members("training")
        trainer = self._trainer
        if trainer is not None:
            if trainer.should_stop and session.stop_reason is None:
                self.worker.request_stop("request")
            elif session.stop_reason == "request" and not trainer.should_stop:
                log.debug("rank %d: the job is stopping; ending this epoch", self.global_rank)
                trainer.should_stop = True
        self._request_signal_stop()
        if session.stop_reason in (SIGTERM, REQUEUE):  # announced: stop at this batch, whatever reads the inbox
            self.worker.stop_seen = True
        if self.worker.stop_seen:
            self.drain()
            self.worker.drain_for_stop(self.exchanger)
            self._raise_stop()

    def _raise_stop(self) -> None:
        """Every rank met at the stop point: make the replicas one model (so any checkpoint written
        now, Lightning's `OnExceptionCheckpoint`'s or the requeue's, holds the consensus), run the
        requeue if one was signalled, and stop as Lightning does on SIGTERM."""
        log.warning("rank %d: stopping on SIGTERM; every rank drained its group operations first", self.global_rank)
        trainer = self._trainer
        assert trainer is not None and self.worker is not None
        if self.average_at_sync:
            self._average_replicas(STOP_SYNC)
        trainer._signal_connector.received_sigterm = True
        self.controller.met()  # every rank drained and met at the stop point
        if (self.worker.release or {}).get("requeue"):  # decided at the stop point: every rank alike
            signum = self.controller.requeue_signal or _requeue_signal(self.cluster_environment)
            log.warning("rank %d: requeue signal: a checkpoint of the consensus model, then requeue", self.global_rank)
            connector = trainer._signal_connector
            type(connector)._slurm_sigusr_handler_fn(connector, signum, None)  # Lightning's own, now aligned
        raise SIGTERMException()

    # -- data ---------------------------------------------------------------------------------
    def _wrap_prepare_dataloader(self, original: Callable[..., object]) -> Callable[..., object]:
        def prepare(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
            sharded = self.shards_by_work_queue and self.session is not None and self.progress is not None
            if mode != RunningStage.TRAINING or not sharded:
                return original(dataloader, shuffle, mode)
            assert self.progress is not None
            if isinstance(dataloader, DataLoader) and not isinstance(dataloader.dataset, IterableDataset):
                loader = self._shard(dataloader)
                return self.progress.wrap(loader, self._progress_loader, batches_per_epoch(loader))
            # a stream: every rank reads its own, as the user wrote it; an epoch ends with the first that ends
            return self.progress.wrap(original(dataloader, shuffle, mode), self._progress_loader, None)

        return prepare

    def _progress_loader(self, loader: Any, batches_per_epoch: Optional[int], start: int) -> ProgressLoader:
        assert self.session is not None and self.progress is not None and self._trainer is not None
        counter = ProgressCounter(
            self.session.counters,
            self.operation_timeout,
            self.progress.budget,
            self.global_rank,
            self.world_size,
            self.progress.batches_per_step,
        )
        trainer = self._trainer
        return ProgressLoader(
            loader,
            counter,
            lambda: trainer.current_epoch,
            sampler=self.sampler if batches_per_epoch is not None else None,
            batches_per_epoch=batches_per_epoch,
            start=start,
        )

    def _shard(self, dataloader: DataLoader) -> DataLoader:
        name = self.strategy_name
        if dataloader.batch_size is None:
            raise ConfigurationError(
                f"strategy={name!r} needs the training DataLoader to use batch_size (a custom batch_sampler cannot "
                "be fed from the work queue)"
            )
        if isinstance(dataloader.sampler, RandomSampler):
            shuffle = True
        elif isinstance(dataloader.sampler, SequentialSampler):
            shuffle = False
        else:
            raise ConfigurationError(
                f"strategy={name!r} replaces the training sampler with a work-queue sampler but the DataLoader has a "
                f"custom sampler ({type(dataloader.sampler).__name__}); use shuffle=True or shuffle=False instead"
            )
        assert self.session is not None
        self.sampler = WorkQueueSampler(
            len(dataloader.dataset),  # type: ignore[arg-type]
            dataloader.batch_size,
            self.global_rank,
            self.world_size,
            self.session.counters,
            shuffle=shuffle,
            seed=self.seed,
            timeout=self.operation_timeout,
        )
        return _update_dataloader(dataloader, self.sampler, mode=RunningStage.TRAINING)

    # -- collectives that must not run while ranks are unaligned ------------------------------
    def _local_instead(self, operation: str) -> bool:
        if self.controller.aligned:
            return False
        if operation not in self._warned:
            self._warned.add(operation)
            warnings.warn(
                f"{operation} was called during asynchronous training with strategy={self.strategy_name!r}, while "
                "ranks are at different steps; a world-wide collective here would hang, so it uses this rank's "
                "local value instead (this warning is shown once). Values logged with sync_dist=True during "
                "training steps are per-rank; they are reduced across ranks at epoch end.",
                stacklevel=3,
            )
        return True

    @property
    def _survivors(self) -> Optional[dist.ProcessGroup]:
        """The survivors' group once a rank was lost (collectives of the world group would need it)."""
        job = self.job
        if job is None or len(job.members) == job.world_size or not dist.is_initialized():
            return None
        return job.group

    def _members(self) -> Optional[MemberCollectives]:
        """Collectives that survive a lost member: during a fit, and after one that lost a rank."""
        if self.worker is not None:
            return MemberCollectives(self.worker.comm, self.sync_timeout, agree=self.worker.agree)
        job = self.job
        if self._survivors is None or job is None:
            return None  # no fit, nobody lost: the world group's collectives
        comm = GroupComm(self.global_rank, self.world_size, self.operation_timeout, job.group)
        comm.rebind(job.group, job.members)
        return MemberCollectives(comm, self.sync_timeout)

    def _incomplete(self, operation: str) -> None:
        log.warning(
            "rank %d: %s was cut short by a lost rank; this rank uses its own value (the next synchronization "
            "point goes on without the lost rank)",
            self.global_rank,
            operation,
        )

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._local_instead("barrier"):
            return
        members = self._members()
        if members is None:
            self._world_collective("a barrier", super().barrier, *args, **kwargs)
        elif not members.barrier():
            self._incomplete("a barrier")

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._local_instead("broadcast"):
            return obj
        members = self._members()
        if members is None:
            return self._world_collective("a broadcast", super().broadcast, obj, src)
        source = src if src in members.members else members.members[0]  # rank 0's duties moved
        done, value = members.broadcast_object(obj, source)
        if not done:
            self._incomplete("a broadcast")
            return obj
        return value

    @override
    def reduce(self, tensor: Any, group: Optional[Any] = None, reduce_op: Optional[Any] = "mean") -> Any:
        if self._local_instead("reduce (e.g. self.log(..., sync_dist=True))"):
            return tensor
        members = self._members()
        if members is None or group is not None or not isinstance(tensor, Tensor):
            return self._world_collective("a reduce", super().reduce, tensor, group, reduce_op)
        op = str(reduce_op).lower().split(".")[-1] if reduce_op is not None else "sum"
        if op in ("max", "min"):
            gathered = members.gather(tensor)
            result = None
            if gathered is not None:
                stacked = torch.stack(gathered)
                result = stacked.amax(0) if op == "max" else stacked.amin(0)
        else:
            result = members.sum(tensor)
            if result is not None and op in ("mean", "avg"):
                result = result / len(members.members)
        if result is None:
            self._incomplete("a reduce")
            return tensor
        return result

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        if self._local_instead("all_gather"):
            return tensor.unsqueeze(0)
        members = self._members()
        if members is None or group is not None or sync_grads:
            return self._world_collective("an all_gather", super().all_gather, tensor, group, sync_grads)
        gathered = members.gather(tensor)
        if gathered is None:
            self._incomplete("an all_gather")
            return tensor.unsqueeze(0)
        return torch.stack(gathered)

    def _gather_metric_state(self, result: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        """torchmetrics' `dist_sync_fn`: the states of every member (of the survivors after a loss);
        between synchronization points (`dist_sync_on_step=True`) this rank's own, as for `reduce`."""
        if self._local_instead("a torchmetrics metric's state sync (dist_sync_on_step=True)"):
            return [result]
        members = self._members()
        if members is None:
            return gather_all_tensors(result, group)
        gathered = members.gather(result)
        if gathered is None:
            self._incomplete("a metric's state sync")
            return [result]
        return gathered

    def _world_collective(self, what: str, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A collective of Lightning's on the world group; if it fails because a rank left the job,
        the error says which rank (the backend's only says a connection closed)."""
        try:
            return collective(*args, **kwargs)
        except RuntimeError as err:
            session = self.session
            explained = session.explain(err, f"{what} of every rank (Lightning's)") if session is not None else err
            if explained is err:
                raise
            raise explained from err

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state as a checkpoint holds it: at a synchronization point (every rank
        saves there together) the mean over the live workers of its floating-point state (Adam's
        moments and step count, momentum buffers), as the parameters are the mean, so a resumed
        run starts every worker from the same state, and from all workers' rather than rank 0's.
        Between synchronization points (a checkpoint of one rank's replica), or if the workers'
        states differ in layout (one never stepped), this rank's own state."""
        state = super().optimizer_state(optimizer)
        worker = self.worker
        if worker is None or self._failed or not self.controller.aligned or not state:
            return state
        averaged, complete = averaged_optimizer_state(
            state, worker.comm, worker.members, operation="optimizer state average for a checkpoint"
        )
        if not complete:
            log.warning("rank %d: the checkpoint holds this rank's own optimizer state, not the mean", self.global_rank)
        return averaged

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        self.outside_steps()
        if not self.controller.aligned and self.is_global_zero and "save_checkpoint" not in self._warned:
            self._warned.add("save_checkpoint")
            warnings.warn(
                "a checkpoint was saved between synchronization points: it holds rank 0's replica, not the "
                "consensus model. Save at epoch ends (ModelCheckpoint(every_n_epochs=...)) for the consensus model.",
                stacklevel=2,
            )
        super().save_checkpoint(checkpoint, filepath, storage_options)
