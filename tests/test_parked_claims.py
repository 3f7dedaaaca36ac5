"""A claim that waits at the work queue's end runs the groups peers drew its rank into, whoever else would.

A rank is drawn into groups from its first claim on. With a background exchanger (`prague`'s) its
communication thread runs those groups only inside an exchange of its own: none runs between phases
(a joiner's first claim comes before its first batch started one, and a member's first claim after a
meeting does too), and an idle thread, waiting for the next step's exchange, reads no inbox. If that
claim waits at the queue's end, for a peer whose training waits on a group with this rank, both wait
out the group's timeout (found on the emulated cluster: two joiners admitted near an epoch's end,
and later, in CI, a member whose exchange had just finished, with the peer's admission meeting
waiting on its drain). So the waiting claim runs them itself whenever no exchange is in flight.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import wait_until

from lightning_prague.core.comm.averaging import BucketedTensors, FlatBuffers
from lightning_prague.core.exchange.overlap import BackgroundAverager, BlockingExchanger, PassiveResponder
from lightning_prague.core.exchange.training import TrainingSession
from lightning_prague.core.exchange.worker import GroupAnswer

pytestmark = pytest.mark.timeout(60)


class SlowWorker:
    """Stands in for a GroupWorker: a group exchange takes until `release` is set (then it fails if
    `fail`, else it completes); counts the times the training thread served the inbox."""

    rank = 4
    part = None  # (the whole model: no replica)
    version = 0

    def __init__(self, live: BucketedTensors, fail: bool = True) -> None:
        self._spare = FlatBuffers(live)
        self.release = threading.Event()
        self.fail = fail
        self.served = 0
        self.polled = threading.Event()

    def spare(self) -> FlatBuffers:
        return self._spare

    def partial_sync(self, target, version):
        self.release.wait(10)
        if self.fail:
            raise RuntimeError("the exchange ended")
        return GroupAnswer(gid=None)

    def post_pause(self) -> None:
        self.release.set()

    def serve_inbox(self) -> None:
        self.served += 1

    def poll_item(self, timeout=None):
        self.polled.set()
        self.release.wait(timeout or 0.05)
        return {"t": "pause"} if self.release.is_set() else None


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
    wait_until(lambda: not exchanger.running)
    training._serve_while_parked()  # between phases again
    assert worker.served == 2
    exchanger.close()


def test_a_waiting_claim_runs_the_groups_while_the_thread_waits_idle_for_its_next_exchange():
    """The CI hang: the thread's own exchange finished; it waits for the next step's, which the claim
    holds back. The claim serves, and the finished exchange is folded in at the next step as usual."""
    live = BucketedTensors([torch.ones(4)])
    worker = SlowWorker(live, fail=False)
    exchanger = BackgroundAverager(worker, live, 30.0)  # type: ignore[arg-type]
    training = parked_claim_server(exchanger, worker)
    exchanger.step()
    training._serve_while_parked()
    assert worker.served == 0  # in flight: the thread serves the inbox inside its request
    worker.release.set()
    wait_until(lambda: not exchanger.busy)
    assert exchanger.running  # alive and idle, its result not folded in yet
    training._serve_while_parked()
    training._serve_while_parked()
    assert worker.served == 2
    exchanger.step()  # the claim returned: the finished exchange is folded in, the next one starts
    wait_until(lambda: not exchanger.busy)
    exchanger.drain()
    assert not exchanger.running
    exchanger.close()


def test_a_passive_responders_thread_serves_the_inbox_while_it_runs():
    live = BucketedTensors([torch.ones(4)])
    worker = SlowWorker(live)
    exchanger = PassiveResponder(worker, live, 30.0)  # type: ignore[arg-type]
    training = parked_claim_server(exchanger, worker)
    exchanger.start()
    assert worker.polled.wait(10)  # its thread reads the inbox
    training._serve_while_parked()
    assert worker.served == 0
    worker.release.set()  # a pause: the thread ends
    wait_until(lambda: not exchanger.running)
    training._serve_while_parked()
    assert worker.served == 1
    exchanger.close()


def test_a_blocking_exchangers_claim_always_runs_them():
    live = BucketedTensors([torch.ones(4)])
    worker = SlowWorker(live)
    training = parked_claim_server(BlockingExchanger(worker, live, 30.0), worker)  # type: ignore[arg-type]
    training._serve_while_parked()
    training._serve_while_parked()
    assert worker.served == 2
