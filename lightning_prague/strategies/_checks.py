"""Checks at setup, each failing with a way out instead of misbehaving later.

* Trainer settings that asynchronous training cannot honour (`check_trainer`, `check_layer_sync`).
* The private Lightning internals this package reads, writes, calls or replaces
  (`LIGHTNING_INTERNALS`, checked by `check_lightning_internals`): a Lightning release that renames
  one would otherwise turn a replacement into a dead attribute that nothing calls, or fail in the
  middle of a fit (when a rank is lost, at a resume) instead of at its start.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import lightning
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_prague.core.errors import ConfigurationError


def check_trainer(trainer: pl.Trainer, strategy_name: str) -> None:
    """Raise `ConfigurationError` for options that need ranks to run equal numbers of steps.

    Step-based options (`max_steps`, `val_check_interval` in steps or as a fraction,
    `check_val_every_n_epoch=None`, `ModelCheckpoint(every_n_train_steps=...)`) run on global
    progress (`lightning_prague.strategies.global_progress`); time-based ones cannot, because
    workers reach a moment in time at different points of the data.
    """
    why = (
        f"with strategy={strategy_name!r} workers run different numbers of steps (fast workers take more "
        "batches) and meet only at synchronization points, which are placed by global progress, not by time"
    )
    if trainer._val_check_time_interval is not None:  # val_check_interval given as a duration
        raise ConfigurationError(
            f"a time-based val_check_interval cannot be honoured: {why}. Use an int (validate every N steps)"
        )
    for callback in trainer.callbacks:
        if isinstance(callback, ModelCheckpoint) and callback._train_time_interval is not None:
            raise ConfigurationError(
                f"ModelCheckpoint(train_time_interval=...) cannot be honoured: {why}. "
                "Use ModelCheckpoint(every_n_train_steps=...)"
            )
    limit = trainer.limit_train_batches
    if isinstance(limit, float) and limit != 1.0:
        raise ConfigurationError(
            f"limit_train_batches={limit} (a fraction) cannot be honoured: batches are handed out from one global "
            "work queue whose length is not known per worker. Pass an int (batches per worker and epoch) or "
            "train on a subset of the dataset"
        )
    step_based = (
        isinstance(trainer.val_check_interval, int)
        or trainer.val_check_interval != 1.0
        or any(isinstance(cb, ModelCheckpoint) and cb._every_n_train_steps for cb in trainer.callbacks)
    )
    if isinstance(limit, int) and step_based:
        raise ConfigurationError(
            f"limit_train_batches={limit} cannot be combined with step-based validation or checkpoints: each "
            "worker would stop its epoch on its own count, so nobody knows where the epoch's global progress "
            "ends. Train on a subset of the dataset instead"
        )


def check_layer_sync(strategy: Any, strategy_name: str) -> None:
    """Raise `ConfigurationError` for `Trainer(sync_batchnorm=True)` (the strategy's `_layer_sync` is set)."""
    if getattr(strategy, "_layer_sync", None) is not None:
        raise ConfigurationError(
            f"sync_batchnorm=True cannot be honoured with strategy={strategy_name!r}: SyncBatchNorm runs a "
            "collective of every rank in every forward pass, but workers run different numbers of steps and would "
            "wait for each other forever. Use plain BatchNorm (each replica keeps its own statistics, averaged "
            "with the parameters at synchronization points) or GroupNorm/LayerNorm"
        )


# -- the private Lightning internals this package depends on ---------------------------------------

#: the Lightning releases this one is tested with; the `lightning` dependency in pyproject.toml says
#: the same (tests/test_lightning_internals.py holds them together)
SUPPORTED_LIGHTNING = ">=2.6,<2.7"

#: how the package depends on an internal: "replaced" methods are shadowed on this trainer's
#: instances (`_patches`), "overridden" ones by a subclass of ours, so both must exist on Lightning's
#: class; the others are read, written, called or subclassed where `purpose` says
Use = Literal["read", "written", "read and written", "called", "replaced", "overridden", "subclassed"]


@dataclass(frozen=True)
class LightningInternal:
    """One private part of Lightning that this package depends on, and what for.

    `owner` says where it lives, in one of four forms:

    * a path from the trainer: `"trainer.fit_loop.epoch_loop"`;
    * a Lightning class, `"module:Class"`: `"lightning.pytorch.strategies:DDPStrategy"`;
    * an instance of one, for attributes its `__init__` sets: `"lightning.pytorch.callbacks:ModelCheckpoint()"`;
    * a module: `"lightning.pytorch.trainer.call"`.
    """

    owner: str
    name: str
    use: Use
    purpose: str

    @property
    def where(self) -> str:
        """Its full name, as messages show it: `trainer.fit_loop._combined_loader`."""
        return f"{self.owner.replace(':', '.')}.{self.name}"

    @property
    def on_trainer(self) -> bool:
        """It lives on this trainer's objects (`owner` is a path from the trainer)."""
        return self.owner == "trainer" or self.owner.startswith("trainer.")

    @property
    def on_instance(self) -> bool:
        """`__init__` of the owner class sets it (it is looked for on a fresh instance)."""
        return self.owner.endswith("()")


_EPOCH_LOOP = "trainer.fit_loop.epoch_loop"
_VAL_LOOP = "trainer.fit_loop.epoch_loop.val_loop"
_AUTOMATIC_STEPS = "trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total"
_MANUAL_STEPS = "trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress.total"
_DDP = "lightning.pytorch.strategies:DDPStrategy"
_CHECKPOINT = "lightning.pytorch.callbacks:ModelCheckpoint()"
_GLOBAL_STEP = "trainer.global_step reads the global step (global_progress.set_global_step)"
_LOST_VALIDATION = (
    "validation is sharded among the survivors of a lost rank (StrategyLoaders.reshard_validation and "
    "reshard, lightning_prague.strategies.loaders)"
)
_STEP_FIRST = "StepFirstFetcher takes over Lightning's training fetcher and the batch it fetched ahead at set-up"
_RESUMED_LOADER = "a resumed fit whose data was loaded before its checkpoint restores the loader's position"

#: every private Lightning internal that `lightning_prague` reads, writes, calls or replaces;
#: `check_lightning_internals` finds each on the installed Lightning before anything is patched
LIGHTNING_INTERNALS: tuple[LightningInternal, ...] = (
    # -- the trainer and its connectors
    LightningInternal(
        "trainer",
        "_checkpoint_connector",
        "called",
        "dump_checkpoint: the fit's state a live worker sends a rank that rejoins (strategies.rejoin.PeerState)",
    ),
    LightningInternal(
        "trainer",
        "_teardown",
        "called",
        "a rank left out of the fit ends its attempt as Lightning ends a failed fit, then rejoins in place "
        "(strategies.in_place.end_attempt)",
    ),
    LightningInternal(
        "lightning.fabric.strategies.launchers.subprocess_script",
        "_basic_subprocess_cmd",
        "called",
        "the command line of a rank's process that the launcher's agent starts again (launcher.RankAgent)",
    ),
    LightningInternal(
        "trainer",
        "_val_check_time_interval",
        "read",
        "a val_check_interval given as a duration is rejected (check_trainer) and kept out of step-based "
        "validation (global_progress)",
    ),
    LightningInternal(
        "trainer._data_connector",
        "_prepare_dataloader",
        "replaced",
        "the training loader gets the work-queue sampler instead of a DistributedSampler",
    ),
    LightningInternal(
        "trainer._signal_connector",
        "_sigterm_notifier_fn",
        "replaced",
        "SIGTERM sets a local flag instead of broadcasting from inside the signal handler",
    ),
    LightningInternal(
        "trainer._signal_connector",
        "_slurm_sigusr_handler_fn",
        "replaced",
        "SLURM's requeue signal stops every rank at its next batch like SIGTERM, and Lightning's own handler "
        "(a checkpoint, then `scontrol requeue`) runs at the stop point, where the replicas are one model",
    ),
    LightningInternal(
        "trainer._signal_connector",
        "received_sigterm",
        "written",
        "a coordinated SIGTERM stop tells Lightning that the process was signalled",
    ),
    # -- the training epoch loop
    LightningInternal(
        _EPOCH_LOOP,
        "_broadcast_sigterm_tensor",
        "replaced",
        "the world-wide SIGTERM broadcast before every batch becomes a local check of the job's stop",
    ),
    LightningInternal(
        _EPOCH_LOOP,
        "on_advance_end",
        "replaced",
        "in replica groups, a stop set on one rank during a batch waits until its replica's ranks agree on it",
    ),
    LightningInternal(
        _EPOCH_LOOP,
        "_should_check_val_fx",
        "replaced",
        "step-based validation runs at global-progress boundaries (Lightning's decides the rest)",
    ),
    LightningInternal(
        _EPOCH_LOOP,
        "_should_check_val_epoch",
        "called",
        "the replacement of _should_check_val_fx asks whether this epoch validates",
    ),
    LightningInternal(
        _EPOCH_LOOP,
        "_update_learning_rates",
        "replaced",
        "per-step learning-rate schedulers follow the global step",
    ),
    LightningInternal(
        _EPOCH_LOOP,
        "_num_ready_batches_reached",
        "replaced",
        "an epoch ends when the work queue is empty, not at this worker's batch count; asked first once a batch "
        "was processed, it sets is_last_batch from StepFirstFetcher's look ahead (made then if no optimizer "
        "step made it)",
    ),
    LightningInternal(_AUTOMATIC_STEPS, "ready", "written", _GLOBAL_STEP + " under automatic optimization"),
    LightningInternal(_AUTOMATIC_STEPS, "completed", "written", _GLOBAL_STEP + " under automatic optimization"),
    LightningInternal(_MANUAL_STEPS, "ready", "written", _GLOBAL_STEP + " under manual optimization"),
    LightningInternal(_MANUAL_STEPS, "completed", "written", _GLOBAL_STEP + " under manual optimization"),
    # -- the fit loop
    LightningInternal(
        "trainer.fit_loop",
        "setup_data",
        "replaced",
        "the training data is set up for global progress (fractional val_check_interval, restored loaders)",
    ),
    LightningInternal(
        "trainer.fit_loop",
        "_combined_loader",
        "read and written",
        "tells whether setup_data built a new training loader; reset so that training without the work "
        "queue is resharded among the survivors of a lost rank",
    ),
    LightningInternal("trainer.fit_loop", "_combined_loader_states_to_load", "read", _RESUMED_LOADER),
    LightningInternal("trainer.fit_loop", "_load_combined_loader_states", "called", _RESUMED_LOADER),
    LightningInternal(
        "trainer.fit_loop",
        "_data_fetcher",
        "read and written",
        _RESUMED_LOADER + " and starts its epoch again; under the work queue the training fetcher is a "
        "StepFirstFetcher (strategies.fetching), which fetches the next batch after a batch's step",
    ),
    # -- the training fetcher that StepFirstFetcher replaces (strategies.fetching)
    LightningInternal("lightning.pytorch.loops.fetchers", "_DataFetcher", "subclassed", _STEP_FIRST),
    LightningInternal("lightning.pytorch.loops.fetchers", "_PrefetchDataFetcher", "read", _STEP_FIRST),
    LightningInternal("lightning.pytorch.loops.fetchers:_PrefetchDataFetcher()", "batches", "read", _STEP_FIRST),
    LightningInternal("lightning.pytorch.loops.fetchers:_DataFetcher()", "_combined_loader", "read", _STEP_FIRST),
    LightningInternal("lightning.pytorch.loops.fetchers:_DataFetcher()", "_start_profiler", "read", _STEP_FIRST),
    LightningInternal("lightning.pytorch.loops.fetchers:_DataFetcher()", "_stop_profiler", "read", _STEP_FIRST),
    LightningInternal(
        "trainer.fit_loop",
        "max_batches",
        "read and written",
        "an epoch's batches as DDP would count them (progress bar, estimated_stepping_batches)",
    ),
    # -- the validation loop, rebuilt when a rank is lost
    LightningInternal(_VAL_LOOP, "_combined_loader", "written", _LOST_VALIDATION),
    LightningInternal(_VAL_LOOP, "setup_data", "called", _LOST_VALIDATION),
    LightningInternal(_VAL_LOOP, "reset", "called", _LOST_VALIDATION),
    LightningInternal(
        _VAL_LOOP, "run", "called", "a rank that joined an epoch with no batch left validates at its end, as the others"
    ),
    # -- the logged metrics a joiner takes from the members (`strategies.rejoin.members_metrics`)
    LightningInternal(
        "trainer._logger_connector",
        "_callback_metrics",
        "written",
        "a rank that rejoins takes the members' latest metrics into `trainer.callback_metrics` (that dict)",
    ),
    # -- ModelCheckpoint
    LightningInternal(
        _CHECKPOINT, "_train_time_interval", "read", "time-based checkpoints are rejected (check_trainer)"
    ),
    LightningInternal(
        _CHECKPOINT,
        "_every_n_train_steps",
        "read",
        "step-based checkpoints become global-progress boundaries (check_trainer, global_progress)",
    ),
    LightningInternal(
        _CHECKPOINT,
        "_last_global_step_saved",
        "read and written",
        "a resumed fit does not save the step it was restored at again",
    ),
    # -- DDPStrategy, the base class of DecentralizedStrategy
    LightningInternal(
        _DDP,
        "_configure_launcher",
        "overridden",
        "Lightning's kill-all script launcher is replaced by SurvivingScriptLauncher",
    ),
    LightningInternal(
        _DDP, "_get_process_group_backend", "called", "setup_distributed picks the backend Lightning would"
    ),
    LightningInternal(
        _DDP + "()",
        "_process_group_backend",
        "written",
        "setup_distributed records the backend it chose, as Lightning's does",
    ),
    LightningInternal(
        _DDP + "()", "_timeout", "read", "setup_distributed gives the process group its timeout (ours plus a margin)"
    ),
    LightningInternal(_DDP + "()", "_start_method", "read", "only start_method='popen' gets SurvivingScriptLauncher"),
    LightningInternal(
        _DDP + "()", "_launcher", "written", "holds SurvivingScriptLauncher (Lightning reads it as Strategy.launcher)"
    ),
    LightningInternal(
        _DDP + "()",
        "_layer_sync",
        "read",
        "Trainer(sync_batchnorm=True) is rejected (check_layer_sync reads it with a default, so without this "
        "check a rename would let it through)",
    ),
    # -- the script launcher that SurvivingScriptLauncher extends
    LightningInternal(
        "lightning.pytorch.strategies.launchers",
        "_SubprocessScriptLauncher",
        "subclassed",
        "SurvivingScriptLauncher starts a node's ranks as Lightning does, without killing them all when one fails",
    ),
    LightningInternal(
        "lightning.pytorch.strategies.launchers",
        "_MultiProcessingLauncher",
        "subclassed",
        "ComebackMultiProcessingLauncher runs each rank's fit so that a rank left out comes back in place",
    ),
    LightningInternal(
        "lightning.pytorch.strategies.launchers:_MultiProcessingLauncher",
        "_wrapping_function",
        "called",
        "SurvivingForkLauncher runs each forked rank's fit as Lightning's launcher does (rank 0's results come back)",
    ),
    LightningInternal(
        "lightning.pytorch.strategies.launchers:_MultiProcessingLauncher",
        "_collect_rank_zero_results",
        "overridden",
        "ComebackMultiProcessingLauncher sends a model sharded over its replica to the process that called fit whole",
    ),
    LightningInternal(
        "lightning.pytorch.strategies.launchers:_MultiProcessingLauncher",
        "_recover_results_in_main_process",
        "called",
        "SurvivingForkLauncher takes rank 0's results into the process that called fit, as Lightning's launcher does",
    ),
    LightningInternal(
        "lightning.pytorch.strategies.launchers:_SubprocessScriptLauncher",
        "_call_children_scripts",
        "called",
        "SurvivingScriptLauncher.launch starts the node's other ranks",
    ),
    # -- private functions
    LightningInternal(
        "lightning.fabric.utilities.distributed",
        "_set_num_threads_if_needed",
        "called",
        "SurvivingScriptLauncher.launch sets the threads per process as Lightning's launcher does",
    ),
    LightningInternal(
        "lightning.pytorch.overrides.distributed",
        "_sync_module_states",
        "called",
        "configure_ddp starts every replica equal without DistributedDataParallel",
    ),
    LightningInternal(
        "lightning.pytorch.utilities.data",
        "_update_dataloader",
        "called",
        "the training DataLoader is rebuilt with the work-queue sampler",
    ),
    LightningInternal(
        "lightning.pytorch.trainer.call",
        "_call_lightning_module_hook",
        "called",
        "per-step learning-rate schedulers are stepped through the module's lr_scheduler_step hook",
    ),
)

#: the methods `_patches.install` shadows on this trainer's instances
REPLACED_INTERNALS: tuple[LightningInternal, ...] = tuple(i for i in LIGHTNING_INTERNALS if i.use == "replaced")

_ABSENT = object()


def lightning_object(owner: str) -> Any:
    """The module or class that a `"module"` or `"module:Class"` owner names (a trailing `()` is ignored).

    Raises `LookupError` with the dotted name of the module or class that does not exist.
    """
    module_name, _, class_name = owner.removesuffix("()").partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise LookupError(module_name) from err
    if not class_name:
        return module
    cls = getattr(module, class_name, _ABSENT)
    if cls is _ABSENT:
        raise LookupError(f"{module_name}.{class_name}")
    return cls


def locate_owner(internal: LightningInternal, trainer: pl.Trainer) -> Any:
    """The object `internal` is looked for on: one of this trainer's, a Lightning class or module, or a
    fresh instance of the class. Raises `LookupError` naming the first object on the way that is missing."""
    if not internal.on_trainer:
        owner = lightning_object(internal.owner)
        return owner() if internal.on_instance else owner
    obj: Any = trainer
    walked = "trainer"
    for part in internal.owner.split(".")[1:]:
        walked = f"{walked}.{part}"
        obj = getattr(obj, part, _ABSENT)
        if obj is _ABSENT:
            raise LookupError(walked)
    return obj


def missing_part(internal: LightningInternal, trainer: pl.Trainer) -> Optional[str]:
    """What this Lightning lacks of `internal`: its own `where`, or an object on the way to it;
    `None` when it is there. A replaced method is looked for on the owner's class, where Lightning
    defines it: on the instance it may be our own replacement, installed by an earlier setup."""
    try:
        owner = locate_owner(internal, trainer)
    except LookupError as missing:
        return str(missing.args[0])
    holder = type(owner) if internal.use == "replaced" else owner
    return None if hasattr(holder, internal.name) else internal.where


def unsupported_lightning(
    missing: Sequence[tuple[LightningInternal, str]], strategy_name: Optional[str]
) -> ConfigurationError:
    """The error for internals the installed Lightning lacks: each one and what it is for, the
    installed version, the supported range, and the way out (install or pin a supported version)."""
    who = f"strategy={strategy_name!r}" if strategy_name else "lightning-prague"
    described = "; ".join(_describe(internal, part) for internal, part in missing)
    return ConfigurationError(
        f"{who} relies on private parts of Lightning that the installed lightning=={lightning.__version__} does "
        f"not have: {described}. This release of lightning-prague supports lightning{SUPPORTED_LIGHTNING}: "
        f"install one (pip install 'lightning{SUPPORTED_LIGHTNING}') and pin it in your requirements, or use "
        "a lightning-prague release that supports your Lightning"
    )


def _describe(internal: LightningInternal, part: str) -> str:
    where = f"{internal.where} ({internal.use}: {internal.purpose})"
    return where if part == internal.where else f"{where}, reached through {part}, which is missing"


def check_lightning_internals(trainer: pl.Trainer, strategy_name: str) -> None:
    """Raise `ConfigurationError` naming every entry of `LIGHTNING_INTERNALS` that the installed
    Lightning lacks. Runs at setup, before anything is patched, so that a Lightning release that
    renamed one fails at the start of the fit, not with a replacement nobody calls or mid-fit."""
    missing = [(internal, part) for internal in LIGHTNING_INTERNALS if (part := missing_part(internal, trainer))]
    if missing:
        raise unsupported_lightning(missing, strategy_name)
