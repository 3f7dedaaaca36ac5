"""Lightning strategies; importing this module registers their names with Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_prague.strategies.base import DecentralizedStrategy
from lightning_prague.strategies.partial_all_reduce import PartialAllReduceStrategy


def register_strategies() -> None:
    """Make ``Trainer(strategy="prague")`` (and ``"partial_all_reduce"``) resolve to our classes."""
    for name in ("prague", "partial_all_reduce"):
        StrategyRegistry.register(
            name,
            PartialAllReduceStrategy,
            description="Asynchronous decentralized training with Partial All-Reduce (Prague)",
            override=True,
        )


register_strategies()

__all__ = ["DecentralizedStrategy", "PartialAllReduceStrategy", "register_strategies"]
