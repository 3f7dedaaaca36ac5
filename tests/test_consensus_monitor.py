"""ConsensusMonitor reads the group error (a host synchronisation on a GPU) only every
`log_every_n_steps` training steps: the trainer's setting unless it is given one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lightning_prague import PartialAllReduceStrategy
from lightning_prague.callbacks import ConsensusMonitor


class CountingStats:
    def __init__(self) -> None:
        self.reads = 0

    def take_group_error(self) -> None:
        self.reads += 1  # each read is one host synchronisation where the sum lives on a GPU
        return None


class BareStrategy(PartialAllReduceStrategy):
    worker = None  # a plain attribute: the monitor looks only at the strategy's type and its worker


def reads_over(monitor: ConsensusMonitor, steps: int, trainer_every: int) -> int:
    strategy = object.__new__(BareStrategy)
    stats = CountingStats()
    strategy.worker = SimpleNamespace(stats=stats)
    trainer = SimpleNamespace(strategy=strategy, log_every_n_steps=trainer_every)
    for step in range(steps):
        monitor.on_train_batch_end(trainer, None, None, None, step)
    return stats.reads


def test_the_group_error_is_read_at_the_trainers_logging_interval_not_every_step():
    assert reads_over(ConsensusMonitor(), 120, trainer_every=50) == 2
    assert reads_over(ConsensusMonitor(log_every_n_steps=10), 120, trainer_every=50) == 12


def test_an_interval_below_one_is_rejected():
    with pytest.raises(ValueError, match="log_every_n_steps=0 must be at least 1"):
        ConsensusMonitor(log_every_n_steps=0)
