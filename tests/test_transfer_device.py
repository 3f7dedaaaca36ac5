"""A background transfer beside the exchanges on NCCL's path, tested on the CPU
(`lightning_prague.core.comm.transfer`, `GroupComm`'s issue lock and polled waits).

NCCL needs GPUs, so its path runs here with a stand-in: a `GroupComm` whose `batched` is set (NCCL's
way of issuing: one batch under the process group's issue lock, waits polled from the host) over
torch's `fake` process group, with `dist.batch_isend_irecv` replaced by a recorder whose works
complete, or never do (a peer that died). Each case runs in a forked process of its own (a world of
three ranks, this process being rank 0), so that no process group outlives it. The last case is
the real thing on gloo: three processes, a receiver that dies in the middle of the transfer.
The CUDA side (the transfer thread's device and stream, the compute stream never held) is in
`test_cuda.py`.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_prague.core.comm import groups, transfer
from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.comm.streams import CommStream
from lightning_prague.core.comm.transfer import BackgroundTransfer

pytestmark = pytest.mark.timeout(120)

RECEIVER = 2


# -- the harness ------------------------------------------------------------------------------------
def _child(conn: Any, body: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        conn.send(("ok", body(*args)))
    except BaseException:  # the test's failure, with the child's traceback
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def in_processes(bodies: list[Callable[..., Any]], *args: Any, timeout: float = 60.0) -> list[Any]:
    """Run each of `bodies(rank, *args)` in a forked process (rank = its index); their return values.
    A body that raises fails the test with its traceback; one that exits without a result gives `None`."""
    ctx = multiprocessing.get_context("fork")
    pipes = [ctx.Pipe(duplex=False) for _ in bodies]
    procs = [
        ctx.Process(target=_child, args=(sender, body, (rank, *args)), daemon=True)
        for rank, (body, (_, sender)) in enumerate(zip(bodies, pipes))
    ]
    gc.collect()
    gc.freeze()  # a child's garbage collector finalises nothing that earlier tests left behind
    try:
        for proc in procs:
            proc.start()
    finally:
        gc.unfreeze()
    for _, sender in pipes:
        sender.close()
    results: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        for (receiver, _), proc in zip(pipes, procs):
            if not receiver.poll(max(0.0, deadline - time.monotonic())):
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.is_alive():
                    pytest.fail(f"a process of the test did not end within {timeout}s")
                results.append(None)  # it exited without a result (a rank that dies on purpose)
                continue
            try:
                status, value = receiver.recv()
            except EOFError:
                results.append(None)
                continue
            if status == "error":
                pytest.fail(value)
            results.append(value)
    finally:
        for proc in procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    return results


def fake_world(rank: int = 0, world: int = 3) -> None:
    """This process alone as `rank` of a world of `world` (torch's `fake` backend: no communication)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the `fake` backend)

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world)


def nccl_like(comm: GroupComm, departed: set[int] | None = None) -> GroupComm:
    """`comm` issuing and waiting as it does on NCCL (batches under the issue lock, host-polled
    waits that give up at any member's departure); `departed`: the control plane's departures."""
    comm.batched = True
    if departed is not None:
        comm.abandon = lambda members: any(m in departed for m in members)
    return comm


class Done:
    """A work that has completed."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: Any = None) -> bool:
        return True


class Never:
    """A work with a peer that died: it never completes (as an NCCL kernel that waits for a dead peer)."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: Any = None) -> bool:
        raise AssertionError("a wait that orders a stream after an operation that never ends")


class Batches:
    """`dist.batch_isend_irecv`'s stand-in: records which thread issues what, and every time two
    threads are inside an issue at once (NCCL's coalescing window is the process group's)."""

    def __init__(self, hold: float = 0.003) -> None:
        self.hold = hold
        self.active = 0
        self.overlaps = 0
        #: (thread name, peers) of each issue, in order
        self.issued: list[tuple[str, tuple[int, ...]]] = []
        #: the work each issue returns: `(thread name, peers) -> work` (default: one that completed)
        self.work: Callable[[str, tuple[int, ...]], Any] = lambda thread, peers: Done()
        #: called inside each issue (to hold it there, as a group end waiting for a peer would)
        self.inside: Callable[[str, tuple[int, ...]], None] = lambda thread, peers: None
        self._lock = threading.Lock()

    def __call__(self, ops: list[dist.P2POp]) -> list[Any]:
        thread, peers = threading.current_thread().name, tuple(op.peer for op in ops)
        with self._lock:
            self.active += 1
            self.overlaps += self.active > 1
            self.issued.append((thread, peers))
        try:
            self.inside(thread, peers)
            time.sleep(self.hold)  # the issue takes a while: room for another thread's batch to join it
        finally:
            with self._lock:
                self.active -= 1
        return [self.work(thread, peers)]

    def install(self) -> Batches:
        dist.batch_isend_irecv = self  # type: ignore[assignment]  (in a forked process of its own)
        return self


def switches(issued: list[tuple[str, tuple[int, ...]]]) -> int:
    """How often the issuing thread changed: > 1 means the threads really ran side by side."""
    names = [thread for thread, _ in issued]
    return sum(a != b for a, b in zip(names, names[1:]))


class NoLock:
    """An issue lock that locks nothing: what the process group had before."""

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        pass


# -- two threads, one process group ---------------------------------------------------------------
def _side_by_side(rank: int, locked: bool) -> dict[str, Any]:
    fake_world()
    if not locked:
        groups.issue_lock = lambda group: NoLock()  # type: ignore[assignment,return-value]
    transfer.PIECE_BYTES = 1000
    batches = Batches().install()
    comm = nccl_like(GroupComm(0, 3, 30.0))
    payload = bytes(range(250)) * 160  # 40 pieces
    sending = BackgroundTransfer(comm, [RECEIVER], lambda: payload, "the payload", 30.0)
    comm.before_exchange = sending.guard
    sending.start()
    beside = 0
    while not sending.done or beside < 5:  # exchanges with a rank that receives nothing, as the exchange thread's
        assert comm.sum_(torch.ones(16), (0, 1), "an exchange beside the transfer")
        beside += 1
    comm.sum_(torch.ones(16), (0, RECEIVER), "an exchange with the receiver")
    return {"overlaps": batches.overlaps, "issued": batches.issued, "sent": sending.sent, "beside": beside}


def test_the_transfer_and_the_exchanges_never_issue_batches_on_the_group_at_once():
    (result,) = in_processes([_side_by_side], True)
    issued = result["issued"]
    by_transfer = [peers for thread, peers in issued if thread == "prague-transfer-0"]
    by_exchanges = [peers for thread, peers in issued if thread != "prague-transfer-0"]
    assert len(by_transfer) == 41 and set(by_transfer) == {(RECEIVER,)}  # the size, then 40 pieces
    assert by_exchanges and all(RECEIVER not in peers for peers in by_exchanges[:-1])
    assert issued[-1][1] == (RECEIVER, RECEIVER)  # the exchange with the receiver came after the whole transfer
    assert switches(issued) >= 4, "the two threads issued side by side, turn by turn"
    assert result["overlaps"] == 0, "two threads were inside batch_isend_irecv on one process group at once"
    assert [(receiver, round(mb, 3)) for receiver, mb, _ in result["sent"]] == [(RECEIVER, 0.04)]


def test_without_the_issue_lock_the_recorder_sees_the_batches_overlap():
    """The instrument of the test above works: the same run without the lock overlaps its issues."""
    (result,) = in_processes([_side_by_side], False)
    assert switches(result["issued"]) >= 4 and result["overlaps"] > 0


def _binds_first(rank: int) -> dict[str, Any]:
    fake_world()
    events: list[tuple[str, str]] = []

    def bind(self: CommStream) -> None:
        events.append(("bind", threading.current_thread().name))

    CommStream.bind = bind  # type: ignore[method-assign]
    batches = Batches(hold=0.0).install()
    batches.inside = lambda thread, peers: events.append(("issue", thread))
    comm = nccl_like(GroupComm(0, 3, 30.0))
    sending = BackgroundTransfer(comm, [RECEIVER], lambda: b"state", "the state", 30.0).start()
    sending.wait()
    return {"events": events, "device": str(sending.stream.device), "comm_device": str(comm.device)}


def test_the_transfer_thread_binds_its_device_and_stream_before_anything_else():
    (result,) = in_processes([_binds_first])
    assert result["events"] == [("bind", "prague-transfer-0")] + [("issue", "prague-transfer-0")] * 2
    assert result["device"] == result["comm_device"]  # the backend's device: the rank's GPU on NCCL


# -- a receiver that departs mid-transfer -------------------------------------------------------------
def _send_held_for_receivers_that_left(rank: int) -> dict[str, Any]:
    fake_world()
    transfer.DEPARTED_GRACE = 0.2
    held = threading.Event()  # never set: the send is held where no deadline of ours reaches it
    comm = GroupComm(0, 3, 60.0)  # gloo's way of issuing: no host-polled waits that see departures
    left = {"at": float("inf")}
    sending = BackgroundTransfer(
        comm, [RECEIVER], lambda: held.wait() and b"", "the state", 60.0, lambda r: time.monotonic() >= left["at"]
    ).start()
    start = time.monotonic()
    threading.Timer(0.3, lambda: left.update(at=time.monotonic())).start()  # the receiver gives up on it
    sending.wait()
    waited = time.monotonic() - start
    start = time.monotonic()
    sending.guard({RECEIVER})  # an exchange with the rank that asked again does not wait for it
    return {"waited": waited, "guard": time.monotonic() - start, "alive": not sending.done}


def test_a_send_held_for_receivers_that_all_left_is_left_behind_on_any_backend():
    """A donor's send held in the backend (gloo's connect of a new group's pair, which no timeout of
    ours reaches) for a joiner that gave up and asked again: the donor's wait ends a grace after the
    receiver left, not at the transfer's bound, and no exchange with that rank waits for it again."""
    (result,) = in_processes([_send_held_for_receivers_that_left])
    assert result["alive"]  # (the thread is still held: left behind, not ended)
    assert 0.4 <= result["waited"] < 5.0, result
    assert result["guard"] < 0.1, result


def _receiver_departs(rank: int) -> dict[str, Any]:
    fake_world()
    transfer.PIECE_BYTES = 1000
    departed: set[int] = set()
    comm = nccl_like(GroupComm(0, 3, 60.0), departed)
    batches = Batches(hold=0.0).install()
    to_receiver = [0]
    announced: list[float] = []

    def work(thread: str, peers: tuple[int, ...]) -> Any:
        if RECEIVER not in peers:
            return Done()
        to_receiver[0] += 1
        if to_receiver[0] <= 3:  # the size and two pieces arrive; then the receiver dies
            return Done()
        if not announced:  # the control plane announces its departure a moment later
            announced.append(time.monotonic() + 0.3)
            threading.Timer(0.3, departed.add, (RECEIVER,)).start()
        return Never()

    batches.work = work
    sending = BackgroundTransfer(comm, [RECEIVER], lambda: bytes(10_000), "the state", 60.0)
    comm.before_exchange = sending.guard
    sending.start()
    sums = 0
    while not announced or time.monotonic() < announced[0]:  # the exchange thread goes on meanwhile
        assert comm.sum_(torch.ones(4), (0, 1), "an exchange beside the transfer")
        sums += 1
        time.sleep(0.01)
    start = time.monotonic()
    sending.wait()  # the next synchronization point
    return {
        "waited": time.monotonic() - start,
        "done": sending.done,
        "sent": sending.sent,
        "issued_to_receiver": to_receiver[0],
        "sums_beside": sums,
    }


def test_a_receiver_that_departs_mid_transfer_ends_the_senders_thread_at_once():
    (result,) = in_processes([_receiver_departs])
    assert result["issued_to_receiver"] == 4  # the size, two pieces, and the one that never completed
    assert result["done"] and result["sent"] == []  # the thread gave up: no send completed, none is left
    assert result["waited"] < 3.0, "the sender's thread gave up at the departure, not at its 60 s timeout"
    assert result["sums_beside"] > 0


def _held_in_an_issue(rank: int) -> dict[str, Any]:
    fake_world()
    transfer.PIECE_BYTES = 1000
    transfer.DEPARTED_GRACE = 0.5
    departed: set[int] = set()
    comm = nccl_like(GroupComm(0, 3, 60.0), departed)
    batches = Batches(hold=0.0).install()
    holding, release = threading.Event(), threading.Event()

    def inside(thread: str, peers: tuple[int, ...]) -> None:
        if thread == "prague-transfer-0" and not holding.is_set():  # a group end that waits for a dead peer
            holding.set()
            threading.Timer(0.3, departed.add, (RECEIVER,)).start()
            release.wait(60)

    batches.inside = inside
    sending = BackgroundTransfer(comm, [RECEIVER], lambda: bytes(5_000), "the state", 60.0)
    comm.before_exchange = sending.guard
    sending.start()
    assert holding.wait(10)
    start = time.monotonic()
    complete = comm.sum_(torch.ones(4), (0, 1), "an exchange while the transfer holds the group")
    summed = time.monotonic() - start
    broken = comm.broken
    start = time.monotonic()
    sending.wait()  # the next synchronization point
    waited, alive = time.monotonic() - start, not sending.done
    start = time.monotonic()
    sending.guard({RECEIVER})  # an exchange with the receiver waits for a thread left behind no more,
    sending.wait()  # nor does the next synchronization point
    guarded = time.monotonic() - start
    release.set()
    sending._thread.join(10)
    return {
        "complete": complete,
        "summed": summed,
        "broken": broken,
        "waited": waited,
        "alive": alive,
        "guarded": guarded,
        "ended": sending.done,
        "issued": batches.issued,
    }


def test_an_exchange_waiting_for_the_issue_lock_gives_up_at_a_departure():
    """The transfer thread is held inside the call that issues a piece (an NCCL group end waiting for
    a peer that died): the exchange that waits for the issue lock ends incomplete at the departure,
    not at its timeout, and the next synchronization point leaves the thread behind."""
    (result,) = in_processes([_held_in_an_issue])
    assert result["complete"] is False and result["broken"] is True  # incomplete, as with any lost member
    assert result["summed"] < 3.0, "the exchange gave up at the departure, not at its 60 s timeout"
    assert {thread for thread, _ in result["issued"]} == {"prague-transfer-0"}  # the exchange issued nothing
    assert result["alive"] and 0.3 <= result["waited"] < 3.0  # DEPARTED_GRACE (0.5 s) after the departure
    assert result["guarded"] < 0.5 and result["ended"]


# -- on gloo: a receiver process that dies in the middle -------------------------------------------
def _gloo_world(rank: int, port: int) -> GroupComm:
    transfer.PIECE_BYTES = 1 << 16
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    return GroupComm(rank, 3, 30.0)


def _gloo_donor(rank: int, port: int) -> dict[str, Any]:
    comm = _gloo_world(rank, port)
    sending = BackgroundTransfer(comm, [RECEIVER], lambda: bytes(range(256)) * 32768, "the state", 30.0)  # 8 MB
    comm.before_exchange = sending.guard
    sending.start()
    total = torch.tensor([1.0])
    beside = comm.sum_(total, (0, 1), "an exchange beside the transfer")
    start = time.monotonic()
    sending.wait()
    return {"beside": beside, "sum": total.item(), "waited": time.monotonic() - start, "sent": sending.sent}


def _gloo_other(rank: int, port: int) -> dict[str, Any]:
    comm = _gloo_world(rank, port)
    total = torch.tensor([10.0])
    return {"beside": comm.sum_(total, (0, 1), "an exchange with the sender"), "sum": total.item()}


def _gloo_receiver_dies(rank: int, port: int) -> None:
    comm = _gloo_world(rank, port)
    size = torch.zeros(1, dtype=torch.int64)
    comm.point_to_point(size, 0, False, "the size of the state")
    comm.point_to_point(torch.empty(1 << 16, dtype=torch.uint8), 0, False, "the state")
    os._exit(0)  # dies with the rest of the state on its way


def test_on_gloo_a_receiver_that_dies_mid_transfer_ends_the_senders_thread_promptly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    donor, other, receiver = in_processes([_gloo_donor, _gloo_other, _gloo_receiver_dies], port)
    assert receiver is None
    assert donor["beside"] and other["beside"] and donor["sum"] == other["sum"] == 11.0
    assert donor["sent"] == [] and donor["waited"] < 15.0, "not the transfer's bound of 2 x 30 s"
