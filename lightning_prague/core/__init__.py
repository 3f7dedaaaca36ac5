"""The core of lightning-prague: decentralized averaging with no Lightning imports.

Usable from any program started like a torch.distributed one (`MASTER_ADDR`/`MASTER_PORT` set):
every rank calls `init_job` (rank 0's call starts the supervisor process that hosts the store and
the control plane), opens a session with `job.open_session(SessionConfig(...))`, builds a
`GroupWorker` on it, calls `partial_sync()` after each local step and `synchronize(name)` +
`global_average()` where all ranks must agree, and `close()` at the end.
"""

from lightning_prague.core.client.control import ControlClient, Session
from lightning_prague.core.comm.averaging import (
    BucketedTensors,
    FlatBuffers,
    SnapshotAverages,
    average_,
    average_difference_,
    averaged_state,
)
from lightning_prague.core.comm.groups import GroupComm, communicator_count
from lightning_prague.core.comm.streams import CommStream
from lightning_prague.core.data.sharding import WorkQueueSampler
from lightning_prague.core.errors import (
    ConfigurationError,
    ControlPlaneError,
    ControlPlaneLost,
    CoordinationTimeout,
    FitEnded,
    MemberLost,
    PragueError,
    SyncMismatchError,
)
from lightning_prague.core.exchange.worker import GroupWorker, WorkerStats
from lightning_prague.core.grouping.policies import POLICY_NAMES, GroupingPolicy, SchedulePolicy, make_policy
from lightning_prague.core.grouping.topology import TOPOLOGIES, Schedule, WeightedGroup, make_topology, static_schedule
from lightning_prague.core.job import Job, current_job, init_job
from lightning_prague.core.plane.coordinator import ControlPlane
from lightning_prague.core.plane.generator import GroupGenerator
from lightning_prague.core.protocol import SessionConfig

__all__ = [
    "POLICY_NAMES",
    "TOPOLOGIES",
    "Schedule",
    "SchedulePolicy",
    "WeightedGroup",
    "make_topology",
    "BucketedTensors",
    "FlatBuffers",
    "SnapshotAverages",
    "CommStream",
    "ConfigurationError",
    "ControlPlaneError",
    "ControlPlaneLost",
    "CoordinationTimeout",
    "FitEnded",
    "ControlClient",
    "ControlPlane",
    "Job",
    "MemberLost",
    "Session",
    "SessionConfig",
    "current_job",
    "init_job",
    "GroupComm",
    "GroupGenerator",
    "GroupWorker",
    "GroupingPolicy",
    "PragueError",
    "SyncMismatchError",
    "WorkQueueSampler",
    "WorkerStats",
    "average_",
    "average_difference_",
    "communicator_count",
    "averaged_state",
    "make_policy",
    "static_schedule",
]
