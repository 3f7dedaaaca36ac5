"""Callbacks that work with every strategy of this package (and with plain DDP)."""

from lightning_prague.callbacks.slowdown import SlowdownInjector
from lightning_prague.callbacks.summary import WorkerSummary

__all__ = ["SlowdownInjector", "WorkerSummary"]
