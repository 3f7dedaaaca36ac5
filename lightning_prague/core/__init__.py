"""The core of lightning-prague: decentralized averaging with no Lightning imports.

Usable from any torch.distributed program initialised with the env:// method: create a
`CoordinatorService` on rank 0, a `GroupWorker` on every rank, call
`partial_sync()` after each local step and `synchronize(name)` + `global_average()` where
all ranks must agree.
"""

from lightning_prague.core.averaging import BucketedTensors, average_, averaged_state
from lightning_prague.core.coordinator import CoordinatorService
from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout, PragueError, SyncMismatchError
from lightning_prague.core.generator import GroupGenerator
from lightning_prague.core.groups import GroupComm, communicator_count
from lightning_prague.core.policies import POLICY_NAMES, GroupingPolicy, SchedulePolicy, make_policy
from lightning_prague.core.sharding import WorkQueueSampler
from lightning_prague.core.store import StoreAddress
from lightning_prague.core.streams import CommStream
from lightning_prague.core.topology import TOPOLOGIES, Schedule, WeightedGroup, make_topology, static_schedule
from lightning_prague.core.worker import GroupWorker, WorkerStats

__all__ = [
    "POLICY_NAMES",
    "TOPOLOGIES",
    "Schedule",
    "SchedulePolicy",
    "WeightedGroup",
    "make_topology",
    "BucketedTensors",
    "CommStream",
    "ConfigurationError",
    "CoordinationTimeout",
    "CoordinatorService",
    "GroupComm",
    "GroupGenerator",
    "GroupWorker",
    "GroupingPolicy",
    "PragueError",
    "StoreAddress",
    "SyncMismatchError",
    "WorkQueueSampler",
    "WorkerStats",
    "average_",
    "communicator_count",
    "averaged_state",
    "make_policy",
    "static_schedule",
]
