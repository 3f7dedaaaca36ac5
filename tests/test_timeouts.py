"""The timeout hierarchy: `hang_timeout` < `timeout` (one operation) <= `sync_timeout` (a whole
synchronization point) < the backend's timeout. Each bound is checked where it applies."""

from __future__ import annotations

import time
from contextlib import nullcontext
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from lightning_prague import DecentAdamStrategy, PartialAllReduceStrategy
from lightning_prague.core.comm.averaging import BucketedTensors
from lightning_prague.core.errors import ConfigurationError, CoordinationTimeout
from lightning_prague.core.exchange.worker import GroupWorker


def test_the_defaults_form_a_hierarchy_that_survives_what_ddp_survives():
    strategy = PartialAllReduceStrategy()
    assert strategy.hang_rule.floor == 60.0 < strategy.operation_timeout == 300.0 < strategy.sync_timeout == 1800.0
    assert strategy._timeout > timedelta(seconds=strategy.sync_timeout)  # the backend's own fires last
    # a longer timeout raises the synchronization bound with it
    assert DecentAdamStrategy(timeout=2400.0).sync_timeout == 2400.0


def test_a_synchronization_bound_shorter_than_one_operation_is_rejected():
    with pytest.raises(ConfigurationError, match="sync_timeout=60.0 is shorter than timeout=300.0"):
        PartialAllReduceStrategy(sync_timeout=60.0)
    assert PartialAllReduceStrategy(timeout=30.0, sync_timeout=60.0).sync_timeout == 60.0


class ChattySession:
    """A session whose inbox gets an item every `every` seconds, never the meeting's release."""

    def __init__(self, every: float) -> None:
        self.rank, self.world_size, self.every = 0, 2, every
        self.counters = None
        self.departed: dict[int, str] = {}
        self.beacon = SimpleNamespace(waiting=nullcontext)
        self.sent: list[str] = []

    def send(self, op: str, **fields) -> None:
        self.sent.append(op)

    def receive(self, timeout: float | None = None):
        time.sleep(min(self.every, timeout if timeout is not None else self.every))
        return {"t": "departed", "rank": 1} if timeout is None or timeout >= self.every else None

    def request(self, *args, **kwargs):
        raise CoordinationTimeout("no control plane here")


def test_a_synchronization_point_is_bounded_as_a_whole_not_per_item():
    # every item comes within one operation's timeout, but the release never comes
    comm = SimpleNamespace(warm_up=lambda: None, everyone=(0, 1))
    session = ChattySession(every=0.05)
    worker = GroupWorker(session, BucketedTensors([torch.zeros(2)]), timeout=0.2, comm=comm, sync_timeout=0.6)
    start = time.monotonic()
    expected = r"rank 0: waited \d+s for the other ranks at synchronization point 'e'"
    with pytest.raises(CoordinationTimeout, match=expected):
        worker.synchronize("e")
    assert 0.6 <= time.monotonic() - start < 2.0
    assert session.sent == ["arrive"]


def test_a_worker_busy_outside_its_steps_gets_the_synchronization_bound_before_it_is_declared_hung():
    from lightning_prague.core import SessionConfig, make_policy
    from lightning_prague.core.plane.coordinator import CoordinatorSession

    config = SessionConfig(2, make_policy("random", 2, 2).spec(), timeout=300.0, sync_timeout=1800.0)
    assert CoordinatorSession(1, config).hangs.timeout == 1800.0
    # no synchronization bound given: one operation's
    assert (
        CoordinatorSession(2, SessionConfig(2, make_policy("random", 2, 2).spec(), timeout=300.0)).hangs.timeout
        == 300.0
    )
