"""Lightning's step-based features driven by global progress (see `lightning_prague.core.data.progress`).

Under an asynchronous strategy with the work queue, every per-step schedule of the trainer follows
the global number of batches trained instead of this worker's own step count:

* `trainer.global_step` is the global step: exact at every synchronization point (the same on
  every worker) and, between them, this worker's estimate from its tickets, never reaching the
  next synchronization point's step early (so step-based callbacks fire only there);
* `max_steps`, `val_check_interval` in steps or as a fraction of an epoch (with
  `check_val_every_n_epoch` or `None`) and `ModelCheckpoint(every_n_train_steps=...)` are
  boundaries: every worker drains, meets and averages there, then validation and checkpoints see
  one model;
* learning-rate schedulers with `interval="step"` are stepped to the global step: a fast worker
  does not anneal faster than a slow one, and all agree at every synchronization point. Under
  manual optimization the module steps them itself (`self.lr_schedulers().step()`, once per
  batch): each such call advances the scheduler to the global step instead of by one;
* `trainer.estimated_stepping_batches` counts the steps one worker would take under DDP.

The methods below replace Lightning's on this trainer's loop instances only (see `_patches`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer import call
from torch.utils.data import DataLoader

from lightning_prague.core.data.progress import Boundary, ProgressSchedule
from lightning_prague.core.data.progress_loader import ProgressLoader
from lightning_prague.core.data.sharding import ChunkBatches
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.exchange.phases import SyncController
from lightning_prague.strategies.fetching import StepFirstFetcher, step_first

log = logging.getLogger(__name__)

#: `meet(name, progress, inside_epoch, validate)`: every rank meets at a boundary (the strategy's
#: synchronization point, which tells the `SyncController` it met)
Meet = Callable[[str, int, bool, bool], None]


def set_global_step(trainer: Trainer, step: int) -> None:
    """Make `trainer.global_step` read `step` (Lightning counts it in its optimizer-step progress)."""
    loop = trainer.fit_loop.epoch_loop
    module = trainer.lightning_module
    if module is None or module.automatic_optimization:
        tracker = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        tracker = loop.manual_optimization.optim_step_progress.total
    tracker.ready = tracker.completed = step


def prefetch_depth(loader: Any) -> int:
    """Batches a DataLoader's worker processes fetch ahead of the training loop."""
    workers = getattr(loader, "num_workers", 0) or 0
    return workers * (getattr(loader, "prefetch_factor", None) or 2) if workers > 0 else 0


class GlobalStepScheduler:
    """Stands in for a per-step LR scheduler that a manually optimizing module steps itself.

    `step()` without arguments advances the scheduler to the global step of the batch being
    trained (what one call per batch reaches under DDP), so a fast worker calling it more often
    does not anneal faster. Everything else (`state_dict`, `get_last_lr`, ...) is the
    scheduler's own.
    """

    def __init__(self, scheduler: Any, index: int, progress: GlobalProgress) -> None:
        self.scheduler = scheduler
        self._index = index
        self._progress = progress

    def step(self, *args: Any, **kwargs: Any) -> None:
        progress = self._progress
        ticket = progress.loader.current_ticket if progress.loader is not None else None
        if args or kwargs or ticket is None:
            self.scheduler.step(*args, **kwargs)
            progress._scheduler_steps[self._index] = progress._scheduler_steps.get(self._index, 0) + 1
            return
        schedule = progress.schedule
        progress.step_schedulers_to(schedule.step_of(ticket) if schedule else ticket // progress.batches_per_step)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("scheduler", "_index", "_progress"):  # copy/pickle probe a bare object
            raise AttributeError(name)
        return getattr(self.scheduler, name)


class GlobalProgress:
    """Runs one fit's per-step schedules on global progress; owned by the strategy.

    Args:
        trainer: the trainer whose loops it drives.
        world_size: the number of workers.
        controller: this rank's phases (it reads which validation a boundary asked for).
        meet: how every rank meets at a boundary (see `Meet`).
    """

    def __init__(self, trainer: Trainer, world_size: int, controller: SyncController, meet: Meet) -> None:
        self.trainer = trainer
        self.world_size = world = world_size
        self.controller = controller
        self.meet = meet
        self.batches_per_step = world * trainer.accumulate_grad_batches
        max_steps = trainer.max_steps
        #: global batches in all (`max_steps` under DDP), `None` without a step budget
        self.budget = max_steps * self.batches_per_step if max_steps not in (-1, None) else None
        self.loader: Optional[ProgressLoader] = None
        self.schedule: Optional[ProgressSchedule] = None
        self._boundaries: Optional[Iterator[Boundary]] = None
        self._next: Optional[Boundary] = None
        self._boundaries_epoch: Optional[int] = None
        self._tail = 2 * world
        self._loader_batches: float = float("inf")  # Lightning's own per-worker batch limit
        self._epoch_batches: Optional[float] = None  # a DDP-equivalent epoch length held back while restarting
        self._scheduler_steps: dict[int, int] = {}
        self._step_floor = 0  # the global step at the last synchronization point
        #: (global batches, global step, validated) of every boundary this worker met, in order
        self.met: list[tuple[int, int, bool]] = []

    # -- configuration --------------------------------------------------------------------------
    def wrap(
        self, loader: Any, build: Callable[..., ProgressLoader], batches_per_epoch: Optional[int]
    ) -> ProgressLoader:
        """Wrap the training loader (the strategy builds the ProgressLoader with its store and sampler)."""
        self.loader = build(
            loader, batches_per_epoch=batches_per_epoch, start=self.trainer.global_step * self.batches_per_step
        )
        self.loader.next_boundary = self._next_boundary_batches
        # (a batch fetched ahead of the trainer's own prefetch where tickets are claimed ahead)
        self._tail = self.world_size * (prefetch_depth(loader) + 2 + self.loader.claims_ahead)
        return self.loader

    def _next_boundary_batches(self) -> Optional[int]:
        """The global batch count of the next boundary this worker has not met (`None`: none ahead)."""
        if self.schedule is None:
            return None
        boundary = self._next_boundary()
        return None if boundary is None else boundary.batches

    def make_schedule(self) -> ProgressSchedule:
        trainer = self.trainer
        world = self.world_size
        validate_every: Optional[int] = None
        interval = trainer.val_check_interval
        per_epoch = trainer.check_val_every_n_epoch is not None
        if trainer._val_check_time_interval is None and trainer.enable_validation:
            if isinstance(interval, int):
                validate_every = interval * world
            elif interval != 1.0:
                assert self.loader is not None
                if self.loader.batches_per_epoch is None:
                    raise ConfigurationError(
                        f"val_check_interval={interval} (a fraction of an epoch) needs a map-style training set: a "
                        "streaming epoch has no known length. Pass an int (validate every N steps)"
                    )
                # whole batches per worker, as DDP counts them
                validate_every = max(1, int(self.loader.batches_per_epoch * interval / world)) * world
        checkpoint_every = tuple(
            cb._every_n_train_steps * self.batches_per_step
            for cb in trainer.callbacks
            if isinstance(cb, ModelCheckpoint) and cb._every_n_train_steps
        )
        origin = (0, 0)
        restored = self.loader.restored_progress if self.loader is not None else None
        step = trainer.global_step
        if restored is not None and restored != step * self.batches_per_step:
            # resumed on another number of workers: the checkpoint's batches stand at its global step,
            # and the steps that follow are steps of this world (as DDP resumed on it would count them)
            origin = (restored, step)
            if self.budget is not None:
                self.budget = restored + (trainer.max_steps - step) * self.batches_per_step
                self.loader.counter.budget = self.budget
        return ProgressSchedule(
            world,
            self.batches_per_step,
            origin=origin,
            budget=self.budget,
            validate_every=validate_every,
            validate_in_epoch=per_epoch,
            checkpoint_every=checkpoint_every,
        )

    # -- Lightning hooks --------------------------------------------------------------------------
    def replacements(self) -> dict[str, Callable[..., Any]]:
        """The loop methods this fit runs instead of Lightning's."""
        loop = self.trainer.fit_loop.epoch_loop
        original_should_check_val = loop._should_check_val_fx
        original_update_lr = loop._update_learning_rates
        original_setup_data = self.trainer.fit_loop.setup_data

        def should_check_val(data_fetcher: Any) -> bool:
            decided = self.controller.take_validation(loop._should_check_val_epoch())
            budget_ended = self.loader is not None and self.loader.stopped_inside_epoch
            last = loop.batch_progress.is_last_batch
            log.debug("validation check: a boundary decided %s; the budget ended the epoch %s; last batch %s",
                      decided, budget_ended, last)  # fmt: skip
            if decided is not None:
                return decided
            if self.schedule is not None and self.schedule.validate_every is not None:
                return False  # step-based validation happens at boundaries only
            if budget_ended:
                return False  # the step budget, not the data, ended the epoch (`stopped_inside_epoch`)
            return original_should_check_val(data_fetcher)

        def update_learning_rates(interval: str, update_plateau_schedulers: bool) -> None:
            if interval != "step" or update_plateau_schedulers or self.loader is None:
                original_update_lr(interval, update_plateau_schedulers)
                return
            ticket = self.loader.current_ticket
            if ticket is not None and self.trainer.lightning_module.automatic_optimization and self.schedule:
                self.step_schedulers_to(self.schedule.step_of(ticket))

        def num_ready_batches_reached() -> bool:
            progress = loop.batch_progress
            if progress.current.processed == progress.current.ready and not progress.is_last_batch:
                # (asked first once the batch was processed: the next batch was fetched at its optimizer step,
                # or is fetched now where none came, see `fetching`)
                progress.is_last_batch = self.look_ahead()
            return progress.is_last_batch or progress.current.ready == self._loader_batches

        def setup_data() -> None:
            trainer = self.trainer
            interval = trainer.val_check_interval
            fractional = isinstance(interval, float) and interval != 1.0 and trainer._val_check_time_interval is None
            if fractional:  # a fraction of an epoch: our boundaries, not Lightning's per-worker batch count
                trainer.val_check_interval = 1.0
            fit_loop = trainer.fit_loop
            before = fit_loop._combined_loader
            try:
                original_setup_data()
            finally:
                trainer.val_check_interval = interval
            if fit_loop._combined_loader is before:
                if fit_loop.restarting and fit_loop._combined_loader_states_to_load and before is not None:
                    # the data was loaded before the checkpoint was restored (estimated_stepping_batches
                    # in configure_optimizers): restore the loader's position now, start its epoch again
                    fit_loop._load_combined_loader_states()
                    iter(fit_loop._data_fetcher)
                if fit_loop.restarting and fit_loop.max_batches != float("inf"):
                    # Lightning would take this worker's batch count for the end of the restored epoch
                    self._epoch_batches, fit_loop.max_batches = fit_loop.max_batches, float("inf")
                return
            if self.loader is not None and fit_loop._combined_loader is not None:
                fit_loop._data_fetcher = step_first(fit_loop._data_fetcher, trainer.accumulate_grad_batches)
                if self.loader.sampler is not None:
                    # it takes a claim's answer only after its step (one batch per chunk, no DataLoader worker
                    # fetching ahead): at the queue's end the others' claims may wait for the chunk it holds
                    batches = getattr(self.loader, "batch_sampler", None)
                    self.loader.sampler.reports_while_parked = (
                        isinstance(fit_loop._data_fetcher, StepFirstFetcher)
                        and self.loader.tickets_with_chunks
                        and isinstance(batches, ChunkBatches)
                        and not batches.drop_last
                    )
                self._loader_batches = fit_loop.max_batches
                if self.loader.batches_per_epoch is not None and fit_loop.max_batches == float("inf"):
                    # what one worker trains per epoch under DDP: trainer.estimated_stepping_batches and
                    # the progress bar count it; the epoch still ends when the work queue is empty
                    fit_loop.max_batches = math.ceil(self.loader.batches_per_epoch / self.world_size)

        return {
            "_should_check_val_fx": should_check_val,
            "_update_learning_rates": update_learning_rates,
            "_num_ready_batches_reached": num_ready_batches_reached,
            "setup_data": setup_data,
        }

    def look_ahead(self) -> bool:
        """After a batch's step: fetch the next batch where the fit loop's fetcher is a `StepFirstFetcher`
        (once per batch); whether the batch was the epoch's last (`False` where Lightning's fetcher,
        which fetched ahead, says it itself)."""
        fetcher = self.trainer.fit_loop._data_fetcher
        return fetcher.look_ahead() if isinstance(fetcher, StepFirstFetcher) else False

    def on_train_start(self) -> None:
        if self._epoch_batches is not None:  # the restart is over (see setup_data)
            self.trainer.fit_loop.max_batches, self._epoch_batches = self._epoch_batches, None
        self.schedule = self.make_schedule()
        self._step_floor = self.trainer.global_step
        for callback in self.trainer.callbacks:
            if isinstance(callback, ModelCheckpoint) and self._step_floor > 0:
                # a resumed fit starts at a synchronization point whose checkpoint exists: between
                # synchronization points the global step may read that step again, which must not save
                callback._last_global_step_saved = max(callback._last_global_step_saved, self._step_floor)
        self._scheduler_steps = {
            i: self.trainer.global_step // config.frequency
            for i, config in enumerate(self.trainer.lr_scheduler_configs)
        }
        if not self.trainer.lightning_module.automatic_optimization:
            for i, config in enumerate(self.trainer.lr_scheduler_configs):
                if config.interval == "step" and not config.reduce_on_plateau:
                    config.scheduler = GlobalStepScheduler(config.scheduler, i, self)
        if self.loader is not None:
            self.loader.arm()
            if self.loader.sampler is not None:
                self.loader.sampler.may_leave_tail = self._may_leave_tail

    def close(self) -> None:
        """At the end of the fit: the module's schedulers are its own again."""
        for config in self.trainer.lr_scheduler_configs:
            if isinstance(config.scheduler, GlobalStepScheduler):
                config.scheduler = config.scheduler.scheduler

    def step_schedulers_to(self, step: int) -> None:
        """Step every per-step LR scheduler until it has taken `step // frequency` steps."""
        for i, config in enumerate(self.trainer.lr_scheduler_configs):
            if config.interval != "step" or config.reduce_on_plateau:
                continue
            target = step // config.frequency
            scheduler = config.scheduler
            if isinstance(scheduler, GlobalStepScheduler):
                scheduler = scheduler.scheduler
            while self._scheduler_steps.get(i, 0) < target:
                call._call_lightning_module_hook(self.trainer, "lr_scheduler_step", scheduler, None)
                self._scheduler_steps[i] = self._scheduler_steps.get(i, 0) + 1

    def _next_boundary(self) -> Optional[Boundary]:
        loader = self.loader
        assert loader is not None and self.schedule is not None
        if self._boundaries_epoch != loader.epoch:
            self._boundaries_epoch = loader.epoch
            start = max(loader.progress, loader.epoch_base)
            self._boundaries = self.schedule.boundaries(loader.epoch_base, loader.epoch_end, self._tail, start)
            self._next = next(self._boundaries, None)
        return self._next

    def _may_leave_tail(self) -> bool:
        """A slow worker may leave the rest of an epoch to others only when no boundary is ahead of it
        before the epoch's end (it would have no batch left to meet it with)."""
        if self.loader is None or self.schedule is None or self.loader.epoch_end is None:
            return True
        boundary = self._next_boundary()
        return boundary is None or boundary.batches >= self.loader.epoch_end

    def after_batch(self) -> None:
        """At the end of every training batch: meet the others if this worker is at a boundary."""
        loader = self.loader
        if loader is None or self.schedule is None or not loader.tickets:
            return
        ticket = loader.batch_trained()
        boundary = self._next_boundary()
        following = loader.current_ticket
        end = loader.counter.epoch_end if following is None else None
        # a sharded stream: the boundaries after the first rank's reads ended wait for the epoch's end
        stream_end = loader.counter.stream_end
        after_stream_end = stream_end is not None and boundary is not None and boundary.batches > stream_end
        log.debug("trained ticket %d; next %s, epoch end %s, next boundary %s", ticket, following, end, boundary)
        if boundary is not None and boundary.due(following, end) and not after_stream_end:
            # unless every batch of the epoch is trained, the others go on: meet them at the epoch's end (a
            # sharded stream's ranks still train the shards they hold, whatever this rank's end says)
            inside_epoch = end is None or boundary.batches < end or loader.counter.keep_claiming
            self.meet(f"progress@{boundary.batches}", boundary.batches, inside_epoch, boundary.validate)
            self.at_synchronization(boundary.batches, boundary.step)
            self.met.append((boundary.batches, boundary.step, boundary.validate))
            assert self._boundaries is not None
            self._next = next(self._boundaries, None)
            return
        step = self.schedule.step_of(ticket)
        if boundary is not None:
            step = min(step, boundary.step - 1)
        set_global_step(self.trainer, max(self._step_floor, step))

    def at_synchronization(self, progress: int, step: Optional[int] = None) -> None:
        """Every worker stands at `progress` global batches: one global step and one LR everywhere."""
        assert self.schedule is not None
        exact = self.schedule.step_of(progress)
        self._step_floor = max(self._step_floor, exact if step is None else step)
        set_global_step(self.trainer, self._step_floor)
        self.step_schedulers_to(exact)


def batches_per_epoch(loader: DataLoader) -> int:
    """Batches of one pass over a map-style loader's dataset (`drop_last` honoured)."""
    size = len(loader.dataset)  # type: ignore[arg-type]
    assert loader.batch_size is not None
    return size // loader.batch_size if loader.drop_last else math.ceil(size / loader.batch_size)
