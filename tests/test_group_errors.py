"""Which errors of a group sum mean a lost peer: only the backend's communication errors. This
rank's own errors (CUDA out of memory, a dtype error) propagate as they are."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_prague.core.comm.groups import GroupComm, PeerFailure
from lightning_prague.core.errors import CoordinationTimeout


@pytest.fixture
def comm():
    # a world of one process is enough: the sums' algorithms are replaced by the failures under test
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield GroupComm(0, 2, timeout=5.0)
    finally:
        dist.destroy_process_group()


def fail_with(error: BaseException):
    def algorithm(*args, **kwargs):
        raise error

    return algorithm


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), RuntimeError("expected Float, got Half")],
    ids=["out-of-memory", "dtype"],
)
def test_this_ranks_own_errors_are_not_taken_for_a_lost_peer(comm, monkeypatch, error):
    monkeypatch.setattr(comm, "_all_to_all", fail_with(error))
    comm.abandon = lambda members: True  # even where a member's departure was announced
    with pytest.raises(type(error)) as raised:
        comm.sum_(torch.ones(4), (0, 1), "group average #7")
    assert raised.value is error


def test_a_failed_communication_names_the_operation_and_ranks(comm, monkeypatch):
    monkeypatch.setattr(comm, "_all_to_all", fail_with(PeerFailure("Connection closed by peer [127.0.0.1]:4242")))
    with pytest.raises(CoordinationTimeout) as raised:
        comm.sum_(torch.ones(4), (0, 1), "group average #7")
    message = str(raised.value)
    assert "rank 0: group average #7 over ranks [0, 1] failed" in message and "Connection closed by peer" in message


def test_a_failed_communication_with_a_departed_member_leaves_an_incomplete_sum(comm, monkeypatch):
    monkeypatch.setattr(comm, "_all_to_all", fail_with(PeerFailure("Connection closed by peer")))
    comm.abandon = lambda members: True  # the control plane announced that a member left
    assert comm.sum_(torch.ones(4), (0, 1), "group average #8") is False  # the flag, whatever the values


def test_a_workers_error_item_is_the_control_planes_failure_or_the_ranks_disagreement():
    from types import SimpleNamespace

    from lightning_prague.core.errors import CONTROL_PLANE, ControlPlaneError, SyncMismatchError
    from lightning_prague.core.exchange.worker import GroupWorker

    worker = SimpleNamespace(rank=3)
    failed = {"t": "error", "source": CONTROL_PLANE, "message": "the control plane rejected 'arrive': KeyError"}
    with pytest.raises(ControlPlaneError, match="rank 3: the control plane rejected 'arrive'"):
        GroupWorker.execute(worker, failed)
    mismatch = {"t": "error", "message": "ranks reached different synchronization points"}
    with pytest.raises(SyncMismatchError, match="rank 3: ranks reached different"):
        GroupWorker.execute(worker, mismatch)
