"""lightning-prague: asynchronous decentralized data-parallel training for PyTorch Lightning.

``import lightning_prague`` registers the strategies, so ``Trainer(strategy="prague")`` works.
"""

from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout, PragueError, SyncMismatchError
from lightning_prague.strategies import DecentralizedStrategy, PartialAllReduceStrategy

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "CoordinationTimeout",
    "DecentralizedStrategy",
    "PartialAllReduceStrategy",
    "PragueError",
    "SyncMismatchError",
    "__version__",
]
