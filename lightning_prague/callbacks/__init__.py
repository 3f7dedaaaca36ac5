"""Callbacks that work with every strategy of this package (and with plain DDP)."""

from lightning_prague.callbacks.consensus import ConsensusMonitor
from lightning_prague.callbacks.slowdown import SlowdownInjector
from lightning_prague.callbacks.straggler import StragglerMonitor, WorkerTiming, flag_slow
from lightning_prague.callbacks.summary import WorkerSummary

__all__ = ["ConsensusMonitor", "SlowdownInjector", "StragglerMonitor", "WorkerSummary", "WorkerTiming", "flag_slow"]
