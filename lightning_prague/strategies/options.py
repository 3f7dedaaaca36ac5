"""The options every asynchronous strategy shares, validated in one place.

`DecentralizedStrategy.__init__` keeps its keyword signature, because LightningCLI and
jsonargparse read it (and its docstring documents each option), and hands the values to
`StrategyOptions`. The dataclass checks them when the strategy is built, before any process group
or thread exists, raising a `ConfigurationError` that names the option, and derives what the rest
of the strategy needs from them: the timeout of one synchronization point, the hang rule, the
backend's own timeout and the control session's configuration. It is frozen: the options given at
construction hold for every fit the strategy runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, Optional, TypeVar, Union

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.policies import GroupingPolicy
from lightning_prague.core.plane.service import plane_address
from lightning_prague.core.protocol import HangRule, SessionConfig, resolve_control_port
from lightning_prague.core.replicas.layout import NODE

T = TypeVar("T")

#: how checkpoints hold a model sharded over its replica (`state_dict_type`), as Lightning's `FSDPStrategy` names them
STATE_DICT_TYPES = ("full", "sharded")

#: how a fixed schedule's rounds pace the workers (`pace` of `decent_adam` and of `prague`'s static schedule)
PACES = ("auto", "round", "own")


def resolve_pace(pace: str, overlap: bool, replica_size: Any) -> str:
    """The pace `"auto"` stands for: `"own"` in replica groups (`replica_size` not 1: a job on nodes that
    differ, whose slow node must not stall the others) where the exchanges overlap the updates, else
    `"round"`, the paper's algorithm. A pace given is kept."""
    if pace != "auto":
        return pace
    return "own" if overlap and replica_size != 1 else "round"


def check_pace(pace: str, overlap: bool, strategy: str) -> None:
    """`ConfigurationError` for a `pace` that is not one, or `"own"` without the overlap it runs on."""
    if pace not in PACES:
        raise ConfigurationError(
            f"pace={pace!r} is not a pace of strategy={strategy!r}; choose one of {', '.join(PACES)}"
        )
    if pace == "own" and not overlap:
        raise ConfigurationError(
            f"pace='own' with overlap=False: a worker at its own pace trains on while its round is in flight, "
            f"so strategy={strategy!r} needs overlap=True for it"
        )


#: Lightning's (and torch's) default timeout of DDP's collectives, seconds: the default `sync_timeout`
DDP_TIMEOUT = 1800.0


def module_classes(policy: Any) -> tuple[type, ...]:
    """`auto_wrap_policy` as a tuple of module classes: a set, list or tuple of `torch.nn.Module`
    subclasses, or of their import paths (`"torch.nn.TransformerEncoderLayer"`, as a config file
    gives them); `ConfigurationError` for anything else."""
    import importlib

    from torch import nn

    if isinstance(policy, (str, type)):
        policy = [policy]
    if not isinstance(policy, (set, frozenset, list, tuple)) or not policy:
        raise ConfigurationError(
            f"auto_wrap_policy={policy!r} is invalid: it must be a non-empty set of module classes (or their import "
            "paths), as Lightning's FSDPStrategy(auto_wrap_policy={Block}) takes them"
        )
    classes = []
    for entry in policy:
        found: Any = entry
        if isinstance(entry, str):
            where, _, name = entry.rpartition(".")
            try:
                found = getattr(importlib.import_module(where), name) if where else None
            except (ImportError, AttributeError, ValueError):
                found = None
        if not (isinstance(found, type) and issubclass(found, nn.Module)):
            raise ConfigurationError(
                f"auto_wrap_policy names {entry!r}, which is not a torch.nn.Module class (nor the import path of one)"
            )
        classes.append(found)
    return tuple(classes)


def watchdog_margin(timeout: float) -> float:
    """Seconds the backend's own timeout (NCCL's watchdog) waits beyond ours."""
    return max(30.0, 0.1 * timeout)


@dataclass(frozen=True)
class StrategyOptions:
    """The shared options as the user gave them (see `DecentralizedStrategy.__init__` for each).

    Raises `ConfigurationError` for a value no fit could use. Only `timeout` is normalised: a
    `datetime.timedelta` (what `DDPStrategy` takes) becomes seconds. `sync_timeout` stays as given;
    `sync_bound` resolves it.
    """

    sync_every: int = 1
    seed: int = 0
    #: seconds one operation may take
    timeout: float = 300.0
    average_at_sync: bool = True
    bucket_mb: float = 25.0
    min_workers: int = 1
    hang_timeout: float = 60.0
    hang_factor: float = 20.0
    #: seconds without progress or sign of life after which a stepping worker is left out (not fenced)
    leave_out_after: float = 10.0
    #: seconds every rank may take to reach one synchronization point; `None`: see `sync_bound`
    sync_timeout: Optional[float] = None
    #: the control plane's port; `None`: `LIGHTNING_PRAGUE_CONTROL_PORT` or a free one
    coordinator_port: Optional[int] = None
    #: times the strategy's launcher starts a lost rank's process again (0: never)
    max_restarts: int = 0
    #: the most workers the job may grow to while it runs (new workers join it); `None`: the launched ones
    max_workers: Optional[int] = None
    #: a plane service's `HOST:PORT` (`lightning_prague.core.plane.service`); `None`: `LIGHTNING_PRAGUE_PLANE`,
    #: else global rank 0 starts the job's supervisor
    plane: Optional[str] = None
    #: seconds a rank waits for its control plane to come back; `None`: `LIGHTNING_PRAGUE_PLANE_WAIT`, else 60
    plane_wait: Optional[float] = None
    #: consecutive ranks that train one model synchronously and decentralize as one; `"node"`: a node's
    replica_size: Union[int, str] = 1
    #: shard the model over each replica's ranks (FSDP2's `fully_shard`) instead of keeping it whole on each
    shard: bool = False
    #: how checkpoints hold a sharded model: `"full"` (one file, gathered) or `"sharded"` (DCP, shard by shard)
    state_dict_type: str = "full"
    #: the module classes sharded as units with `shard=True` (normalised to a tuple of classes); `None`: the default
    auto_wrap_policy: Any = None

    def __post_init__(self) -> None:
        timeout = self.timeout
        if isinstance(timeout, timedelta):  # DDPStrategy's type
            timeout = timeout.total_seconds()
            object.__setattr__(self, "timeout", timeout)
        resolve_control_port(self.coordinator_port)  # validated here; global rank 0's environment decides at launch
        if self.plane is not None and not isinstance(self.plane, str):
            raise ConfigurationError(f"plane={self.plane!r} is invalid: it must be the plane service's 'HOST:PORT'")
        plane_address(self.plane)  # validated here; each rank's environment decides at set-up
        if self.plane_wait is not None and (
            isinstance(self.plane_wait, bool)
            or not isinstance(self.plane_wait, (int, float))
            or not 0 <= self.plane_wait <= 86400
        ):
            raise ConfigurationError(
                f"plane_wait={self.plane_wait!r} is invalid: it must be the seconds (0 to 86400) a rank waits for its "
                "control plane to come back"
            )
        size = self.replica_size
        if size != NODE and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ConfigurationError(
                f"replica_size={size!r} is invalid: it must be a positive number of ranks or {NODE!r}"
            )
        if not isinstance(self.shard, bool):
            raise ConfigurationError(f"shard={self.shard!r} is invalid: it must be True or False")
        if self.shard and size == 1:
            raise ConfigurationError(
                "shard=True shards the model over the ranks of a replica: set replica_size (a number of ranks, or "
                f"{NODE!r})"
            )
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ConfigurationError(
                f"state_dict_type={self.state_dict_type!r} is invalid: it must be one of "
                f"{', '.join(map(repr, STATE_DICT_TYPES))}"
            )
        if self.state_dict_type == "sharded" and not self.shard:
            raise ConfigurationError(
                "state_dict_type='sharded' saves a model sharded over each replica shard by shard: set shard=True "
                "(and replica_size); a whole model is saved whole"
            )
        if self.auto_wrap_policy is not None:
            if not self.shard:
                raise ConfigurationError(
                    "auto_wrap_policy chooses the units a model sharded over its replica is sharded in: set shard=True "
                    "(and replica_size)"
                )
            object.__setattr__(self, "auto_wrap_policy", module_classes(self.auto_wrap_policy))
        if size != 1 and self.max_workers is not None:
            raise ConfigurationError(
                f"replica_size={size!r} with max_workers={self.max_workers}: new workers cannot join a job of "
                "replicas yet (docs/design/replicas.md); leave max_workers unset"
            )
        if self.sync_every < 1:
            raise ConfigurationError(f"sync_every={self.sync_every} is invalid: it must be at least 1 local step")
        if timeout <= 0:
            raise ConfigurationError(f"timeout={timeout} is invalid: it must be a positive number of seconds")
        if self.bucket_mb <= 0:
            raise ConfigurationError(f"bucket_mb={self.bucket_mb} is invalid: it must be positive")
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool) or self.max_restarts < 0:
            raise ConfigurationError(
                f"max_restarts={self.max_restarts!r} is invalid: it must be a whole number of restarts, 0 or more"
            )
        if self.max_workers is not None and (
            not isinstance(self.max_workers, int) or isinstance(self.max_workers, bool) or self.max_workers < 1
        ):
            raise ConfigurationError(f"max_workers={self.max_workers!r} is invalid: it must be a number of workers")
        if self.min_workers < 1:
            raise ConfigurationError(f"min_workers={self.min_workers} is invalid: it must be at least 1")
        if self.hang_timeout <= 0 or self.hang_factor <= 0:
            raise ConfigurationError(
                f"hang_timeout={self.hang_timeout} and hang_factor={self.hang_factor} are invalid: both must be "
                "positive"
            )
        if self.leave_out_after <= 0:
            raise ConfigurationError(
                f"leave_out_after={self.leave_out_after} is invalid: it must be a positive number of seconds (set it "
                "to hang_timeout or more to fence a blocked worker without leaving it out first)"
            )
        sync_timeout = self.sync_bound
        if sync_timeout < timeout:
            raise ConfigurationError(
                f"sync_timeout={sync_timeout} is shorter than timeout={timeout}: a synchronization point contains "
                "operations, so its bound must be at least one operation's"
            )

    @property
    def operation_timeout(self) -> float:
        """Seconds one operation (a group exchange, a request to the coordinator, a claim) may take."""
        return float(self.timeout)

    @property
    def sync_bound(self) -> float:
        """Seconds every rank may take to reach one synchronization point: `sync_timeout`, or unset
        Lightning's DDP timeout (`DDP_TIMEOUT`), or `timeout` if that is longer."""
        return max(DDP_TIMEOUT, self.timeout) if self.sync_timeout is None else float(self.sync_timeout)

    @property
    def backend_timeout(self) -> timedelta:
        """The process group's own timeout (NCCL's watchdog): it fires after every one of ours, so our
        error, which names the ranks and the operation, is the one the user sees."""
        bound = self.sync_bound
        return timedelta(seconds=bound + watchdog_margin(bound))

    @property
    def hang_rule(self) -> HangRule:
        """When a worker counts as hung (`lightning_prague.core.plane.liveness`)."""
        return HangRule(
            floor=float(self.hang_timeout), factor=float(self.hang_factor), leave_out_floor=float(self.leave_out_after)
        )

    @property
    def bucket_bytes(self) -> int:
        """The size of the flat buffers averaged in one collective, in bytes."""
        return int(self.bucket_mb * 2**20)

    def capacity(self, launched: int) -> int:
        """The most workers a job started with `launched` may grow to (`max_workers`)."""
        if self.max_workers is not None and self.max_workers < launched:
            raise ConfigurationError(
                f"max_workers={self.max_workers} is fewer than the {launched} workers the job starts with"
            )
        return max(launched, self.max_workers or 0)

    def session_config(
        self, launched: int, policy: GroupingPolicy, avoid_stragglers: bool, avoid_busy: bool, replica_size: int = 1
    ) -> SessionConfig:
        """The configuration of one fit's control session (the grouping options are the strategy's own)
        for a job started with `launched` workers, in replicas of `replica_size` ranks (resolved)."""
        world_size = self.capacity(launched)
        return SessionConfig(
            world_size,
            policy.spec(),  # the control plane rebuilds it: it runs no code a training process sends
            avoid_stragglers,
            sync_averages=self.average_at_sync,
            timeout=self.operation_timeout,
            hang=self.hang_rule,
            min_workers=self.min_workers,
            sync_timeout=self.sync_bound,
            avoid_busy=avoid_busy,
            launched=launched if world_size > launched else None,
            replica_size=replica_size,
            shard=bool(self.shard) and replica_size > 1,
        )


class Option(Generic[T]):
    """A read-only attribute of the strategy that reads `strategy.options.<name>` (default: the
    attribute's own name): `strategy.sync_every` and the like, as code written for the strategy
    reads them. Setting one is an `AttributeError`: the options are fixed when the strategy is built."""

    def __init__(self, name: Optional[str] = None) -> None:
        self.name = name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = self.name or name

    def __get__(self, strategy: Any, owner: Optional[type] = None) -> T:
        if strategy is None:
            return self  # type: ignore[return-value]  # looked up on the class (documentation, help())
        assert self.name is not None
        return getattr(strategy.options, self.name)

    def __set__(self, strategy: Any, value: T) -> None:
        raise AttributeError(f"{self.name} is an option of the strategy: pass it when the strategy is built")
