"""lightning-prague: asynchronous decentralized data-parallel training for PyTorch Lightning.

`import lightning_prague` registers the strategies, so `Trainer(strategy="prague")` (or
`"partial_reduce"`, `"adpsgd"`, `"decent_adam"`) works.
"""

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
from lightning_prague.strategies import (
    ADPSGDStrategy,
    DecentAdamStrategy,
    DecentralizedStrategy,
    PartialAllReduceStrategy,
    PartialReduceStrategy,
)

__version__ = "0.1.0"

__all__ = [
    "ADPSGDStrategy",
    "ConfigurationError",
    "ControlPlaneError",
    "ControlPlaneLost",
    "CoordinationTimeout",
    "FitEnded",
    "DecentAdamStrategy",
    "DecentralizedStrategy",
    "MemberLost",
    "PartialAllReduceStrategy",
    "PartialReduceStrategy",
    "PragueError",
    "SyncMismatchError",
    "__version__",
]
