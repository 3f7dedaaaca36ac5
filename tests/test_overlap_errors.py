"""An error in a communication thread surfaces at the next safe point with its own message, not as a timeout."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_prague.core.comm.averaging import BucketedTensors, FlatBuffers
from lightning_prague.core.exchange.overlap import BackgroundAverager

pytestmark = pytest.mark.timeout(60)


class FailingWorker:
    """Stands in for a GroupWorker whose group exchange fails (as a dead peer's would)."""

    rank = 2
    part = None  # (the whole model: no replica)
    version = 0

    def __init__(self, live: BucketedTensors) -> None:
        self._spare = FlatBuffers(live)

    def spare(self) -> FlatBuffers:
        return self._spare

    def partial_sync(self, target, version):
        raise RuntimeError("rank 2: group [1, 2, 3] failed: peer 3 closed the connection")

    def post_pause(self) -> None:
        pass


def averager(timeout: float = 300.0) -> BackgroundAverager:
    live = BucketedTensors([torch.ones(4)])
    return BackgroundAverager(FailingWorker(live), live, timeout)  # type: ignore[arg-type]


def test_an_exchange_error_is_raised_at_the_next_step_with_its_message():
    exchanger = averager()
    exchanger.step()  # starts the thread and hands it the first exchange, which fails
    deadline = time.monotonic() + 10
    while exchanger.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="peer 3 closed the connection"):
        exchanger.step()
    exchanger.close()


def test_drain_raises_the_error_at_once_rather_than_waiting_for_the_timeout():
    exchanger = averager(timeout=300.0)
    exchanger.step()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="peer 3 closed the connection"):
        exchanger.drain()
    assert time.monotonic() - start < 10


def test_a_thread_that_dies_before_taking_its_exchange_does_not_stall_drain(monkeypatch):
    exchanger = averager(timeout=300.0)

    def broken_bind() -> None:
        raise RuntimeError("cannot bind the communication stream to cuda:1")

    monkeypatch.setattr(exchanger.streams, "bind", broken_bind)
    exchanger.step()  # the thread dies at start-up; the exchange it was given stays queued
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="cannot bind the communication stream"):
        exchanger.drain()
    assert time.monotonic() - start < 10
    exchanger.close()


class WaitingWorker(FailingWorker):
    """A GroupWorker whose group request waits for a group the others never join: they wait for this rank
    at the queue's end while it holds work. The control plane answers the request once this rank says it
    leaves (`send_leave`), then sends `left`."""

    doing = "group request #1"

    def __init__(self, live: BucketedTensors) -> None:
        super().__init__(live)
        import threading

        self.left = threading.Event()
        self.leaves_sent: list[str] = []

    def partial_sync(self, target, version):
        assert self.left.wait(30), "the request was never answered: nobody said this rank leaves"
        return None

    def send_leave(self) -> None:
        import threading

        if not self.left.is_set():
            self.leaves_sent.append(threading.current_thread().name)
            self.left.set()

    def leave(self) -> None:  # (from the communication thread, after its exchange)
        self.send_leave()


def test_a_rank_that_leaves_while_its_exchange_waits_for_a_group_says_so_itself_after_a_grace():
    """Found under load: a `partial_reduce` rank that failed in a step joined its communication thread
    before leaving, for up to its timeout; that thread waited for a first-ready group the others, parked
    at the queue's end waiting for this rank, never joined: every rank waited until the test's timeout.
    The training thread now sends the `leave` itself after a short grace."""
    from lightning_prague.core.exchange.overlap import LEAVE_GRACE_SECONDS

    live = BucketedTensors([torch.ones(4)])
    worker = WaitingWorker(live)
    exchanger = BackgroundAverager(worker, live, 300.0)  # type: ignore[arg-type]
    exchanger.step()  # the exchange blocks in its group request
    start = time.monotonic()
    exchanger.leave()
    assert time.monotonic() - start < LEAVE_GRACE_SECONDS + 5
    assert worker.leaves_sent == ["MainThread"]  # said by the training thread, once
    exchanger.close()
