"""A claim that waits at the work queue's end runs the groups peers drew its rank into, whoever else would.

A rank is drawn into groups from its first claim on. With a background exchanger (`prague`'s) its
communication thread runs those groups, but no such thread runs between phases: a joiner's first
claim comes before its first batch started one, and a member's first claim after a meeting does
too. If that claim waits at the queue's end, for a peer whose training waits on a group with this
rank, both wait out the group's timeout (found on the emulated cluster: two joiners admitted near
an epoch's end, and their peers' groups with them failed after 60 s). So the waiting claim runs
them itself whenever no communication thread does.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from lightning_prague.core.comm.averaging import BucketedTensors, FlatBuffers
from lightning_prague.core.exchange.overlap import BackgroundAverager, BlockingExchanger
from lightning_prague.core.exchange.training import TrainingSession

pytestmark = pytest.mark.timeout(60)


class SlowWorker:
    """Stands in for a GroupWorker: a group exchange takes until `release` is set; counts serves."""

    rank = 4
    version = 0

    def __init__(self, live: BucketedTensors) -> None:
        self._spare = FlatBuffers(live)
        self.release = threading.Event()
        self.served = 0

    def spare(self) -> FlatBuffers:
        return self._spare

    def partial_sync(self, target, version):
        self.release.wait(10)
        raise RuntimeError("the exchange ended")

    def post_pause(self) -> None:
        self.release.set()

    def serve_inbox(self) -> None:
        self.served += 1


def parked_claim_server(exchanger, worker) -> TrainingSession:
    training = TrainingSession.__new__(TrainingSession)
    training.worker, training.exchanger = worker, exchanger
    return training


def test_a_waiting_claim_runs_the_groups_itself_only_while_no_communication_thread_runs():
    live = BucketedTensors([torch.ones(4)])
    worker = SlowWorker(live)
    exchanger = BackgroundAverager(worker, live, 30.0)  # type: ignore[arg-type]
    training = parked_claim_server(exchanger, worker)
    training._serve_while_parked()  # a joiner's first claim: no thread has run yet
    assert worker.served == 1
    exchanger.step()  # a phase: its thread runs the groups (here, one that is in flight)
    assert exchanger.running
    training._serve_while_parked()
    assert worker.served == 1  # the thread owns the inbox: the claim leaves it alone
    worker.release.set()
    deadline = time.monotonic() + 10
    while exchanger.running and time.monotonic() < deadline:
        time.sleep(0.01)
    training._serve_while_parked()  # between phases again
    assert worker.served == 2
    exchanger.close()


def test_a_blocking_exchangers_claim_always_runs_them():
    live = BucketedTensors([torch.ones(4)])
    worker = SlowWorker(live)
    training = parked_claim_server(BlockingExchanger(worker, live, 30.0), worker)  # type: ignore[arg-type]
    training._serve_while_parked()
    training._serve_while_parked()
    assert worker.served == 2
