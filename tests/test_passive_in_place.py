"""An AD-PSGD passive worker averages each snapshot once, in place: one copy of the model for its exchanges.

A group that comes before the training thread's next safe point waits for the new snapshot that point
publishes (the change folded into the live model, a fresh copy taken); a training thread that waits
(parked at the work queue's end, draining at a synchronization point) publishes meanwhile, so nothing
waits for a step that does not come. Each exchange is applied to the live model exactly once.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
from helpers import wait_until

from lightning_prague.core.comm.averaging import BucketedTensors, FlatBuffers
from lightning_prague.core.exchange.overlap import PassiveResponder

pytestmark = pytest.mark.timeout(60)


class PeerOfZeros:
    """A group comm whose only peer holds zeros: a mean of two halves this rank's values."""

    def sum_(self, total, members, operation, timeout=None) -> bool:
        return True  # (the peer adds zeros)

    def agree_among(self, members, complete, operation) -> bool:
        return complete


class InboxWorker:
    """Stands in for a GroupWorker: its inbox is a queue the test fills; `executed` counts the groups run."""

    rank = 1
    part = None
    version = 0

    def __init__(self, live: BucketedTensors) -> None:
        self._spare = FlatBuffers(live)
        self.inbox: queue.Queue = queue.Queue()
        self.executed = 0
        self.comm = PeerOfZeros()

    def spare(self) -> FlatBuffers:
        return self._spare

    def poll_item(self, timeout=None):
        try:
            return self.inbox.get(timeout=0.05)
        except queue.Empty:
            return None

    def execute(self, item, target=None):
        if item["t"] == "group":
            target(self.comm, (0, self.rank), None, f"group average #{item['gid']}", None)
            self.executed += 1

    def post_pause(self) -> None:
        self.inbox.put({"t": "pause"})

    def serve_inbox(self) -> None:
        raise AssertionError("the responder's thread serves the inbox")


def test_a_second_group_waits_for_the_next_safe_point_and_every_exchange_is_applied_once():
    live = BucketedTensors([torch.full((8,), 8.0)])
    worker = InboxWorker(live)
    responder = PassiveResponder(worker, live, 30.0)  # type: ignore[arg-type]
    assert responder.in_place
    responder.start()
    averages = responder._snapshots()
    assert averages.change is averages.snapshot, "one copy: the snapshot becomes its change"
    worker.inbox.put({"t": "group", "gid": 1})
    worker.inbox.put({"t": "group", "gid": 2})
    wait_until(lambda: worker.executed == 1)
    time.sleep(0.3)
    assert worker.executed == 1, "the second group waits for a new snapshot"
    assert torch.equal(live.tensors[0], torch.full((8,), 8.0)), "nothing folded in before a safe point"
    live.tensors[0].add_(1.0)  # a local step meanwhile: kept
    responder.step()  # the safe point: the first change (-4) folded in, a new snapshot (5) taken
    wait_until(lambda: worker.executed == 2)
    responder.drain()  # the second change (-2.5) folded in, the thread ended
    assert not responder.running
    assert torch.equal(live.tensors[0], torch.full((8,), 2.5))
    assert responder.exchanges == 2
    responder.close()


def test_a_draining_or_parked_training_thread_publishes_for_the_groups_that_wait():
    live = BucketedTensors([torch.full((4,), 16.0)])
    worker = InboxWorker(live)
    responder = PassiveResponder(worker, live, 30.0)  # type: ignore[arg-type]
    responder.start()
    for gid in (1, 2):
        worker.inbox.put({"t": "group", "gid": gid})
    wait_until(lambda: worker.executed == 1)
    responder.serve_while_parked()  # parked in a claim at the queue's end: a new snapshot for the second
    wait_until(lambda: worker.executed == 2)
    worker.inbox.put({"t": "group", "gid": 3})  # comes before the synchronization point's pause
    drained = threading.Thread(target=responder.drain)
    drained.start()
    drained.join(10)
    assert not drained.is_alive() and worker.executed == 3, "the drain published for the group before it"
    assert torch.equal(live.tensors[0], torch.full((4,), 2.0))  # 16 halved three times, each once
    responder.close()


def test_closing_ends_a_thread_that_waits_for_a_snapshot():
    live = BucketedTensors([torch.ones(4)])
    worker = InboxWorker(live)
    responder = PassiveResponder(worker, live, 30.0)  # type: ignore[arg-type]
    responder.start()
    worker.inbox.put({"t": "group", "gid": 1})
    worker.inbox.put({"t": "group", "gid": 2})
    wait_until(lambda: worker.executed == 1)
    responder.close()
    assert not responder.running and worker.executed == 1
