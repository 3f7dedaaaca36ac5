"""Lightning strategies; importing this module registers their names with Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_prague.strategies.adpsgd import ADPSGDStrategy
from lightning_prague.strategies.base import DecentralizedStrategy
from lightning_prague.strategies.decent_adam import DecentAdamStrategy
from lightning_prague.strategies.partial_all_reduce import PartialAllReduceStrategy
from lightning_prague.strategies.partial_reduce import PartialReduceStrategy

#: registered name -> (class, description)
STRATEGIES: dict[str, tuple[type[DecentralizedStrategy], str]] = {
    "prague": (PartialAllReduceStrategy, "Asynchronous decentralized training with Partial All-Reduce (Prague)"),
    "partial_all_reduce": (PartialAllReduceStrategy, "Alias of 'prague'"),
    "partial_reduce": (PartialReduceStrategy, "Partial Reduce: the first ready workers average together"),
    "adpsgd": (ADPSGDStrategy, "AD-PSGD: asynchronous gossip between active and passive workers"),
    "decent_adam": (DecentAdamStrategy, "Decentralized Adam: gossip on a topology, overlapped with the next step"),
}


def register_strategies() -> None:
    """Make `Trainer(strategy="prague")` (and the other names in `STRATEGIES`) resolve to our classes."""
    for name, (cls, description) in STRATEGIES.items():
        StrategyRegistry.register(name, cls, description=description, override=True)


register_strategies()

__all__ = [
    "STRATEGIES",
    "ADPSGDStrategy",
    "DecentAdamStrategy",
    "DecentralizedStrategy",
    "PartialAllReduceStrategy",
    "PartialReduceStrategy",
    "register_strategies",
]
