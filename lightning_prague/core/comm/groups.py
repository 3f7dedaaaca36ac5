"""Sums over any subset of ranks, with no communicator per subset.

A group's sum runs as batched point-to-point operations (`isend`/`irecv`) between its members
over one process group that spans every rank (the world group). Nothing is created per member
set: on gloo, point-to-point messages use the world group's pairs; on NCCL, batched
point-to-point operations run on the world communicator. Any group of any size therefore costs
no setup, and a job of N workers holds exactly the communicators it had after initialisation.

Members must run the groups they share in the same order (the coordinator's order, or a
schedule's): that, and messages between two ranks being matched in the order they were sent, is
what makes it deadlock-free.

Small groups exchange all-to-all (`|G| - 1` copies of the tensor sent by each member, in pieces
of `ALL_TO_ALL_CHUNK_BYTES` with two in flight, so that the receive buffers stay two pieces per
peer whatever the size of the model). Larger groups with a small tensor (latency-bound: the whole model of a small
network, or any model at a synchronization point of many ranks) use recursive doubling
(`ceil(log2 |G|)` rounds, plus one before and one after for the members beyond a power of two);
larger tensors a ring reduce-scatter and all-gather (`2 (|G| - 1)` rounds, about twice the tensor
sent by each member). A group of every member on a device with its own collectives (NCCL) is
one all-reduce of the process group; on the CPU it takes the paths above, never gloo's
all-reduce, whose ring cannot survive a member that disappears (see below). In every case each
member ends with bitwise the same sum: in recursive doubling both partners of a round add the
same two values, and addition is commutative.

Measured on 2 CPU cores (gloo, 12,000 floats): a world all-reduce took 25.6 ms at 8 processes and
71 ms at 16; recursive doubling 4.5 ms and 10.8 ms (gloo's all-reduce runs its ring of
`2 (N - 1)` steps, each waiting for a process to be scheduled). With 16 processes, recursive
doubling stays ahead up to 128 KB (32,000 floats: 18 ms against 78 ms for all 16) and falls far
behind from 160 KB (274 ms against 102 ms), where whole-tensor messages between oversubscribed
processes stall; hence the 64 KB bound (`DOUBLING_MAX_BYTES`).

Tensors travel on the backend's device (CUDA for NCCL, the CPU for gloo); a tensor elsewhere is
staged through a copy. Operations run on the calling thread's current CUDA stream; every wait is
bounded by the timeout and fails with a `CoordinationTimeout`
naming the ranks and the operation, on NCCL too (its wait only orders streams, so the end of each
operation is polled with a CUDA event from the thread that issued it, never the training thread
unless it chose to block).

**A member that disappears mid-operation** (its process died, or it was fenced after a hang) makes
the operations on its pairs fail; on gloo only those pairs fail. Every member still posts and
waits for all of its remaining operations (so no live member waits for one that gave up), and
`sum_` returns whether this member saw every one of its operations succeed: an explicit flag,
never a value of the tensor (NaN and infinities are data and travel as such). The flag is local:
a member whose partner in recursive doubling or a ring lost a message may get a sum that lacks a
share although its own operations all succeeded, and in all-to-all a peer that dies part-way
through its sends reaches some members and not others. So no caller applies a sum on its own
flag: the members decide together, all-or-nothing, before anything is written back. During a
fit the control plane decides (every member reports its flag; the sum takes effect iff every
member reported success, and on none if a member departed before it reported:
`lightning_prague.core.client.control.Session.verdict`); without a control plane the members
exchange their flags directly (`GroupComm.agree_among`). On NCCL a dead peer's operations never
complete: the host wait polls `abandon` (the control plane announced a member's departure) and
gives up, and the communicator is not used again (the job rebuilds its group among the
survivors, `lightning_prague.core.job`). There a wait gives up once *any* member of the
communicator departed, not only a member of its own operation: an operation that never ends
holds the communicator's one NCCL stream, and every later operation of the communicator, on this
rank or on a peer waiting for this rank's part, waits behind it (on gloo only the operations with
the departed member fail, and nothing changes for the others).

**Several threads, one process group.** The exchange threads, the training thread and a
background transfer (`lightning_prague.core.comm.transfer`) may use one process group at once. On
NCCL, `batch_isend_irecv` opens a coalescing window whose state belongs to the process group, not
to the thread, so two threads must never issue on one group at the same time: every NCCL
operation of a `GroupComm` is issued under the process group's issue lock (`issue_lock`), held
only while issuing, never while waiting, so both threads go on. A thread that waits for the lock
is bounded like any wait (the deadline, a member's departure). Gloo's operations are posted one
by one, each thread on its own, with no lock (`GroupComm.batched`).
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lightning_prague.core.errors import CoordinationTimeout

log = logging.getLogger(__name__)

#: `delay(members, nbytes) -> seconds`: extra time a group sum takes, for emulated slow links
LinkDelay = Callable[[Sequence[int], int], float]
_link_delay: LinkDelay | None = None


def set_link_delay(delay: LinkDelay | None) -> None:
    """Make every group sum of this process complete no sooner than `delay(members, nbytes)` seconds
    after it was issued (`None`: no delay). The hook through which benchmarks emulate slow links
    (`lightning_prague.callbacks.slowdown.SlowLinks`); the runtime never sets it."""
    global _link_delay
    _link_delay = delay


#: groups of at most this many members exchange all-to-all; larger ones use recursive doubling or a ring
ALL_TO_ALL_MAX = 4
#: tensors of at most this many bytes are summed by recursive doubling in groups beyond ALL_TO_ALL_MAX
DOUBLING_MAX_BYTES = 64 << 10
#: all-to-all exchanges send a tensor in pieces of at most this many bytes (two per peer in flight)
ALL_TO_ALL_CHUNK_BYTES = 1 << 20
#: seconds between two looks at the device (an operation's end) while the host waits for it
POLL_SECONDS = 1e-4
#: seconds between two looks at the deadline and at departures while a thread waits for the issue lock
ISSUE_POLL_SECONDS = 0.01

_issue_locks: weakref.WeakKeyDictionary[Any, threading.Lock] = weakref.WeakKeyDictionary()
_issue_locks_guard = threading.Lock()


def issue_lock(group: Any) -> threading.Lock:
    """The lock under which this process issues NCCL operations on `group` (one per process group,
    whatever `GroupComm` issues them): a batch of point-to-point operations is one coalescing
    window of the group, and a second thread's operation issued inside it would join that batch
    (see the module docstring). Dropped with the group (a rebuilt group gets a new one)."""
    with _issue_locks_guard:
        lock = _issue_locks.get(group)
        if lock is None:
            lock = _issue_locks[group] = threading.Lock()
        return lock


class LazyPairs:
    """The pairs of a lazily connected gloo process group (a membership epoch's: each pair connects at
    its first operation) that have connected on this process, and who departed from the group.

    Gloo connects a pair inside the first operation's *posting*, in native code that no departure
    reaches: a rank whose peer published its address at the group's creation and died before
    connecting waits for it there for five times the group's timeout (measured on torch 2.13: 150
    minutes under the default 30 minutes). So the first operation on each pair is posted by a thread
    of its own while the caller watches `departed` and its deadline; a peer that departs meanwhile
    fails the operation as a lost peer (the thread stays behind, held by gloo, on a pair nobody uses
    again: its peer is gone from this group)."""

    def __init__(self, departed: Callable[[], Collection[int]]) -> None:
        self.departed = departed
        self.connected: set[int] = set()


_lazy_pairs: weakref.WeakKeyDictionary[Any, LazyPairs] = weakref.WeakKeyDictionary()


def watch_lazy_connects(group: Any, departed: Callable[[], Collection[int]]) -> None:
    """`group` connects its pairs lazily (gloo): post each pair's first operation watching
    `departed()`, the ranks gone from the group (see `LazyPairs`)."""
    _lazy_pairs[group] = LazyPairs(departed)


def backend_device(backend: str) -> torch.device:
    """The device a backend's collectives take their tensors on: CUDA for NCCL, else the CPU."""
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class PeerFailure(RuntimeError):
    """The backend failed an operation with another rank (a peer gone, a broken communicator).

    Only errors of the backend's communication calls become this; an error of this rank's own
    work (CUDA out of memory, a wrong dtype) propagates as it is, never as a lost peer or a timeout.
    """


def _communicate(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`call` (a backend communication call); its `RuntimeError` becomes `PeerFailure`."""
    try:
        return call(*args, **kwargs)
    except PeerFailure:
        raise
    except RuntimeError as err:
        raise PeerFailure(str(err)) from err


#: decides, from this member's own completeness of a collective, whether every member completed it:
#: the same answer on every member (the control plane's verdict, or `GroupComm.agree_among`)
Decide = Callable[[bool], bool]


def communicator_count() -> int:
    """Process groups this process holds (the world group included): what `GroupComm` never adds to."""
    if not dist.is_initialized():
        return 0
    return len(dist.distributed_c10d._world.pg_map)


@dataclass
class CommStats:
    """What one rank's group communication did; read by benchmarks and tests."""

    operations: int = 0
    messages: int = 0
    bytes_sent: int = 0


class GroupComm:
    """One rank's sums over arbitrary groups of ranks on a process group spanning the world.

    Args:
        rank: this process's global rank.
        world_size: the number of ranks; `process_group` must hold them all, in global order.
        timeout: seconds any one group operation may take.
        process_group: default: the world group.
        all_to_all_max: the largest group that exchanges all-to-all.
        doubling_max_bytes: the largest tensor a larger group sums by recursive doubling rather
            than in a ring; 0 never uses it.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        timeout: float,
        process_group: dist.ProcessGroup | None = None,
        all_to_all_max: int = ALL_TO_ALL_MAX,
        doubling_max_bytes: int = DOUBLING_MAX_BYTES,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.pg = process_group if process_group is not None else dist.group.WORLD
        self.backend = str(dist.get_backend(self.pg))
        self.device = backend_device(self.backend)
        self.all_to_all_max = max(2, all_to_all_max)
        self.doubling_max_bytes = doubling_max_bytes
        #: the ranks every exchange is among: every rank, or the survivors after a membership change
        self.everyone = tuple(range(world_size))
        self.stats = CommStats()
        #: peers whose operations failed in the latest `sum_` (their process is gone)
        self.failed_peers: set[int] = set()
        #: asked while waiting on NCCL: True once a member's departure was announced (give up waiting)
        self.abandon: Callable[[Sequence[int]], bool] = lambda members: False
        #: the process group failed with a member gone (NCCL): every sum is incomplete until `rebind`
        self.broken = False
        #: `waiting()` is entered around every wait on peers (the hang detector's beacon)
        self.waiting: Callable[[], AbstractContextManager[None]] = nullcontext
        #: called with the peers of every exchange before it starts (a background transfer to one of
        #: them ends first: `lightning_prague.core.comm.transfer.BackgroundTransfer`)
        self.before_exchange: Callable[[set[int]], None] | None = None
        # NCCL's wait only orders the stream; the host learns of the end (and of a hang) by polling
        self._host_waits = self.device.type == "cpu"
        #: NCCL: point-to-point operations run as one batch, issued under the group's `issue_lock`, and
        #: every wait gives up once any member departed; gloo (False): posted one by one, no lock
        self.batched = self.device.type != "cpu"

    def rebind(self, process_group: dist.ProcessGroup, members: Sequence[int]) -> None:
        """Exchange among `members` (sorted global ranks) on `process_group` from now on: the
        survivors' new group after a membership change. Called by every survivor at the same point
        of its sequence of exchanges (right after a synchronization point's release)."""
        self.pg = process_group
        self.everyone = tuple(members)
        self.broken = False

    def view(self, process_group: dist.ProcessGroup, members: Sequence[int]) -> GroupComm:
        """This comm's sums on `process_group` among `members` (another membership epoch's group: a
        gossip round's, a transfer's), leaving this one as it is; the rest is shared."""
        other = copy.copy(self)
        other.pg, other.everyone, other.broken = process_group, tuple(members), False
        other.failed_peers = set()
        return other

    def warm_up(self) -> None:
        """One world-wide all-reduce; every rank must call it, before any group operation.

        NCCL allows batched point-to-point operations among a subset of ranks only after a first
        operation that involves every rank; it also creates the world communicator now, at setup.
        """
        self.sum_(torch.zeros(1, device=self.device), self.everyone, "warm-up of the world group")

    def sum_(
        self, tensor: torch.Tensor, members: Sequence[int], operation: str = "group sum", timeout: float | None = None
    ) -> bool:
        """In place: `tensor` becomes the sum of the members' tensors (`members` sorted, holding this rank).

        Blocks the calling thread until the sum is in `tensor` or the timeout (default: this comm's,
        one operation's) has passed. Returns whether every operation of this member succeeded; if
        not (a member disappeared), `tensor` holds no meaningful value. A True is this member's
        view only: the members decide together whether to use the sum (see the module docstring).
        """
        members = tuple(members)
        if self.rank not in members:
            raise ValueError(
                f"rank {self.rank} asked to run {operation} of group {list(members)} it is not a member of"
            )
        if len(members) < 2:
            return True
        start = time.monotonic()
        limit = self.timeout if timeout is None else timeout
        deadline = start + limit
        self.failed_peers = set()
        nbytes = tensor.numel() * tensor.element_size()
        ready_at = start + (_link_delay(members, nbytes) if _link_delay is not None else 0.0)
        staged = tensor if tensor.device == self.device else tensor.to(self.device)
        staged = staged if staged.is_contiguous() else staged.contiguous()
        if self.broken:
            return False
        complete = True
        with self.waiting():
            try:
                small = nbytes <= self.doubling_max_bytes
                if members == self.everyone and self.device.type != "cpu":
                    with self._issuing(deadline, members):
                        work = _communicate(dist.all_reduce, staged, group=self.pg, async_op=True)  # NCCL's own
                    self._wait(work, deadline)
                elif len(members) <= self.all_to_all_max:
                    self._all_to_all(staged, members, deadline)
                elif small:
                    self._doubling(staged, members, deadline)
                elif staged.numel() < len(members):  # too few elements for a ring's chunks
                    self._all_to_all(staged, members, deadline)
                else:
                    self._ring(staged, members, deadline)
                self._finish(staged, deadline, members)
                complete = not self.failed_peers
            except (PeerFailure, TimeoutError) as err:  # not this rank's own errors (out of memory, dtype)
                complete = self._member_gone(err, operation, members, start, limit)
        if staged is not tensor:
            tensor.copy_(staged)
        self.stats.operations += 1
        remaining = ready_at - time.monotonic()
        if remaining > 0:  # an emulated slow link (set_link_delay)
            time.sleep(remaining)
        if not complete:
            log.debug("rank %d: %s over ranks %s is incomplete here", self.rank, operation, list(members))
        return complete

    def agree_among(self, members: Sequence[int], complete: bool, operation: str = "a collective") -> bool:
        """Whether every member of `members` completed the collective they just ran, where no control
        plane decides (a `Decide`): each member sends its flag to every other and takes the
        collective only if every flag arrived and says complete.

        A member lost before it sent its flags fails the exchange on every other member alike, so
        they all drop the collective; one lost part-way through sending its flags can still leave
        some members taking it and others not (no rule without a decider can prevent that), which
        is why a fit decides at the control plane instead.
        """
        members = tuple(members)
        peers = [m for m in members if m != self.rank]
        if not peers:
            return complete
        if self.broken:
            return False
        mine = torch.full((1,), 1.0 if complete else 0.0, device=self.device)
        theirs = torch.zeros(len(peers), device=self.device)
        ops = []
        for index, peer in enumerate(peers):
            ops.append(dist.P2POp(dist.isend, mine, peer, self.pg))
            ops.append(dist.P2POp(dist.irecv, theirs[index : index + 1], peer, self.pg))
        self.failed_peers = set()
        start = time.monotonic()
        deadline = start + self.timeout
        with self.waiting():
            try:
                self._exchange(ops, deadline, 4 * len(peers), pairs=len(peers))
                self._finish(theirs, deadline, members)
            except (PeerFailure, TimeoutError) as err:
                return self._member_gone(err, f"{operation}: the members' agreement", members, start, self.timeout)
        return complete and not self.failed_peers and bool((theirs == 1.0).all())

    # -- algorithms ------------------------------------------------------------------------------
    def _all_to_all(self, tensor: torch.Tensor, members: tuple[int, ...], deadline: float) -> None:
        """Every member sends its tensor to every other and adds them up in member order.

        In pieces of at most `ALL_TO_ALL_CHUNK_BYTES`, two in flight (the next piece travels while
        this one is added up), so the receive buffers are two pieces per peer whatever the model.
        """
        peers = [m for m in members if m != self.rank]
        flat = tensor.view(-1)
        piece = max(1, ALL_TO_ALL_CHUNK_BYTES // flat.element_size())
        starts = list(range(0, flat.numel(), piece))
        buffers = torch.empty(2, len(peers), min(piece, flat.numel()), dtype=flat.dtype, device=flat.device)

        def post(index: int) -> tuple[torch.Tensor, dict[int, torch.Tensor], list]:
            mine = flat[starts[index] : starts[index] + piece]
            parts = {peer: buffers[index % 2, i, : mine.numel()] for i, peer in enumerate(peers)}
            ops = []
            for peer in peers:
                ops.append(dist.P2POp(dist.isend, mine, peer, self.pg))
                ops.append(dist.P2POp(dist.irecv, parts[peer], peer, self.pg))
            return mine, parts, self._post(ops)

        pending = post(0)
        for index in range(len(starts)):
            mine, parts, posted = pending
            if index + 1 < len(starts):
                pending = post(index + 1)
            self._complete(posted, deadline, len(peers) * mine.numel() * mine.element_size(), len(peers))
            # the same order on every member, ((x_0 + x_1) + x_2) + ...: bitwise the same sum
            parts[self.rank] = mine
            total = parts[members[0]]
            for member in members[1:]:
                total.add_(parts[member])
            if total is not mine:
                mine.copy_(total)

    def _doubling(self, tensor: torch.Tensor, members: tuple[int, ...], deadline: float) -> None:
        """Recursive doubling over the largest power of two of members; the others fold in first.

        Member `p + i` (beyond the power of two `p`) hands its tensor to member `i` and gets the
        sum back at the end; in round `k` member `i < p` exchanges the whole tensor with member
        `i ^ 2^k` and both add the pair, so all end with the same bits.
        """
        k = len(members)
        position = members.index(self.rank)
        power = 1 << (k.bit_length() - 1)
        size = tensor.numel() * tensor.element_size()
        if position >= power:  # an extra member: contribute, then receive the sum
            partner = members[position - power]
            self._exchange([dist.P2POp(dist.isend, tensor, partner, self.pg)], deadline, size, pairs=1)
            self._exchange([dist.P2POp(dist.irecv, tensor, partner, self.pg)], deadline, 0, pairs=0)
            return
        scratch = torch.empty_like(tensor)
        extra = position + power
        if extra < k:
            self._exchange([dist.P2POp(dist.irecv, scratch, members[extra], self.pg)], deadline, 0, pairs=0)
            tensor.add_(scratch)
        step = 1
        while step < power:
            peer = members[position ^ step]
            ops = [dist.P2POp(dist.isend, tensor, peer, self.pg), dist.P2POp(dist.irecv, scratch, peer, self.pg)]
            self._exchange(ops, deadline, size)
            tensor.add_(scratch)
            step <<= 1
        if extra < k:
            self._exchange([dist.P2POp(dist.isend, tensor, members[extra], self.pg)], deadline, size, pairs=1)

    def _ring(self, tensor: torch.Tensor, members: tuple[int, ...], deadline: float) -> None:
        k = len(members)
        position = members.index(self.rank)
        successor, predecessor = members[(position + 1) % k], members[(position - 1) % k]
        chunks = list(tensor.tensor_split(k))
        scratch = torch.empty_like(chunks[0])  # the first chunk is the largest
        size = tensor.element_size()
        for step in range(k - 1):  # reduce-scatter: afterwards chunk position+1 holds the full sum here
            send, recv = chunks[(position - step) % k], chunks[(position - step - 1) % k]
            buffer = scratch[: recv.numel()]
            ops = [
                dist.P2POp(dist.isend, send, successor, self.pg),
                dist.P2POp(dist.irecv, buffer, predecessor, self.pg),
            ]
            self._exchange(ops, deadline, send.numel() * size)
            recv.add_(buffer)
        for step in range(k - 1):  # all-gather of the summed chunks
            send, recv = chunks[(position + 1 - step) % k], chunks[(position - step) % k]
            ops = [dist.P2POp(dist.isend, send, successor, self.pg), dist.P2POp(dist.irecv, recv, predecessor, self.pg)]
            self._exchange(ops, deadline, send.numel() * size)

    # -- waiting ---------------------------------------------------------------------------------
    def point_to_point(self, tensor: torch.Tensor, peer: int, send: bool, operation: str) -> None:
        """Send `tensor` to `peer` (`send`), or receive it into `tensor`, on the backend's device;
        bounded by the timeout, and a `CoordinationTimeout` naming both ranks if it fails.

        On NCCL the host polls the operation's end (`_poll_batch`): no stream is made to wait for
        it, so an operation with a peer that never takes part (a joiner that died) holds no stream
        of this process, and the wait ends at the deadline or at a member's departure.
        """
        start = time.monotonic()
        deadline = start + self.timeout
        members = (self.rank, peer)
        staged = tensor.to(self.device)
        op = dist.P2POp(dist.isend if send else dist.irecv, staged, peer, self.pg)
        nbytes = tensor.numel() * tensor.element_size() if send else 0
        try:
            if self.batched:
                self._poll_batch(self._post([op]), deadline, members, nbytes, int(send))
            else:
                self._exchange([op], deadline, nbytes, int(send))
            self._finish(staged, deadline, members)
        except (RuntimeError, TimeoutError) as err:
            raise self._failure(operation, (self.rank, peer), start, self.timeout, err) from err
        if self.failed_peers:
            failed, self.failed_peers = sorted(self.failed_peers), set()
            raise self._failure(operation, (self.rank, peer), start, self.timeout, RuntimeError(f"ranks {failed}"))
        if not send and staged is not tensor:
            tensor.copy_(staged)

    def _exchange(self, ops: list[dist.P2POp], deadline: float, nbytes: int, pairs: int | None = None) -> None:
        """Run `ops`; `pairs`: the messages this rank sent (default: half the ops).

        On NCCL they run as one batch (its point-to-point operations must be grouped). On gloo each
        is posted and waited for on its own: an operation with a peer that is gone fails at once,
        and the others still run (a receive that failed leaves its buffer as it was; `sum_` reports it).
        """
        self._complete(self._post(ops), deadline, nbytes, len(ops) // 2 if pairs is None else pairs)

    def _post(self, ops: list[dist.P2POp]) -> list[tuple[dist.P2POp | None, dist.Work | None]]:
        """Start `ops` (see `_exchange`); an operation that fails to start has failed its peer.

        (Fault injection replaces this method with one of `ops` alone: `lightning_prague.demo.faults`.)
        """
        peers = {op.peer for op in ops}
        if self.before_exchange is not None:  # (only while a transfer is out: nothing on the common path)
            self.before_exchange(peers)  # before the issue lock: the transfer it may wait for needs it
        if self.batched:  # waiting for the lock is one more wait on peers, bounded as one operation
            with self._issuing(time.monotonic() + self.timeout, (self.rank, *sorted(peers))):
                works = _communicate(dist.batch_isend_irecv, ops)
            return [(None, work) for work in works]
        posted: list[tuple[dist.P2POp | None, dist.Work | None]] = []
        lazy = _lazy_pairs.get(self.pg)
        for op in ops:
            try:
                if lazy is not None and op.peer not in lazy.connected:
                    posted.append((op, self._post_connecting(op, lazy)))
                else:
                    posted.append((op, _communicate(op.op, op.tensor, op.peer, op.group)))
            except PeerFailure as err:
                self._peer_failed(op, err)
                posted.append((op, None))
        return posted

    def _post_connecting(self, op: dist.P2POp, lazy: LazyPairs) -> dist.Work:
        """Post `op`, the first on its pair of a lazily connected group, by a thread of its own, and
        wait for it (its connect) within this comm's timeout and until its peer departs (`LazyPairs`)."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def post() -> None:
            try:
                outcome["work"] = op.op(op.tensor, op.peer, op.group)
            except BaseException as err:  # handed to the caller
                outcome["error"] = err
            finally:
                done.set()

        threading.Thread(target=post, name=f"prague-connect-{self.rank}-{op.peer}", daemon=True).start()
        deadline = time.monotonic() + self.timeout
        pause = 0.001
        while not done.wait(pause):
            if op.peer in lazy.departed():
                raise PeerFailure(f"rank {op.peer} left the job while rank {self.rank} connected to it")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the connection to rank {op.peer} did not open")
            pause = min(ISSUE_POLL_SECONDS, pause * 2)
        if "error" in outcome:
            error = outcome["error"]
            if isinstance(error, RuntimeError):  # (as `_communicate` takes the backend's errors)
                raise PeerFailure(str(error)) from error
            raise error
        lazy.connected.add(op.peer)
        return outcome["work"]

    def _complete(
        self, posted: list[tuple[dist.P2POp | None, dist.Work | None]], deadline: float, nbytes: int, pairs: int
    ) -> None:
        """Wait for operations `_post` started, by the deadline."""
        for op, work in posted:
            if work is None:
                continue
            if op is None:  # NCCL: one batch, waited for as a whole
                self._wait(work, deadline)
                continue
            try:
                self._wait(work, deadline)
            except PeerFailure as err:
                if time.monotonic() >= deadline:
                    raise
                self._peer_failed(op, err)
        self.stats.messages += pairs
        self.stats.bytes_sent += nbytes

    def _poll_batch(
        self,
        posted: list[tuple[dist.P2POp | None, dist.Work | None]],
        deadline: float,
        members: tuple[int, ...],
        nbytes: int,
        pairs: int,
    ) -> None:
        """Wait for a batch `_post` started on NCCL by polling its end from the host, by the deadline
        and until a member departs; no stream waits for it (`Work.wait` only once it has completed,
        which orders nothing and raises the backend's error if it failed)."""
        for _, work in posted:
            if work is None:
                continue
            while not _communicate(work.is_completed):
                if time.monotonic() > deadline:
                    raise TimeoutError("the operation did not complete on the device")
                if self._gone(members):
                    raise TimeoutError("a member left the job; the operation will not complete")
                time.sleep(POLL_SECONDS)
            _communicate(work.wait)
        self.stats.messages += pairs
        self.stats.bytes_sent += nbytes

    def _gone(self, members: Sequence[int]) -> bool:
        """Whether a wait on `members`' operation should give up: one of them departed (gloo), or any
        member of the communicator did (NCCL: see the module docstring). On a membership epoch's group
        a member also departed from it if a new process took its rank since (`LazyPairs.departed`)."""
        if self.abandon(self.everyone if self.batched else members):
            return True
        lazy = _lazy_pairs.get(self.pg)
        return lazy is not None and any(m in lazy.departed() for m in members if m != self.rank)

    @contextmanager
    def _issuing(self, deadline: float, members: Sequence[int]) -> Iterator[None]:
        """Hold the process group's `issue_lock` while NCCL operations are issued; waiting for it is
        bounded by the deadline and by a member's departure (another thread may be held in an issue
        with a peer that is gone), like any wait on peers."""
        lock = issue_lock(self.pg)
        if not lock.acquire(blocking=False):
            while not lock.acquire(timeout=ISSUE_POLL_SECONDS):
                if time.monotonic() > deadline:
                    raise TimeoutError("another thread's operations on the process group did not start in time")
                if self._gone(members):
                    raise TimeoutError("a member left the job while another thread issued its operations")
        try:
            yield
        finally:
            lock.release()

    def _peer_failed(self, op: dist.P2POp, err: BaseException) -> None:
        if op.peer not in self.failed_peers:
            log.debug("rank %d: an operation with rank %d failed (its process is gone?): %s", self.rank, op.peer, err)
        self.failed_peers.add(op.peer)

    def _wait(self, work: dist.Work, deadline: float) -> None:
        if self._host_waits:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not _communicate(work.wait, timedelta(seconds=remaining)):
                raise TimeoutError("timed out")
        else:
            _communicate(work.wait)  # orders the current stream after the operation; _finish bounds it in time

    def _finish(self, tensor: torch.Tensor, deadline: float, members: tuple[int, ...]) -> None:
        """On a device with streams, wait (polling, bounded) until the operation has run: an event on
        the calling thread's current stream of `tensor`'s device (the stream the operation's `wait`
        ordered), never on whatever device happens to be current."""
        if not tensor.is_cuda:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tensor.device))
        while not done.query():
            if time.monotonic() > deadline:
                raise TimeoutError("the operation did not complete on the device")
            if self._gone(members):
                raise TimeoutError("a member left the job; the operation will not complete")
            time.sleep(POLL_SECONDS)

    def _member_gone(
        self, err: BaseException, operation: str, members: tuple[int, ...], start: float, limit: float
    ) -> bool:
        """An operation failed or timed out: if a member's departure was announced, note it and return
        False (incomplete); otherwise raise the `CoordinationTimeout` naming the ranks."""
        if isinstance(err, CoordinationTimeout):
            raise err
        if not self._gone(members):
            raise self._failure(operation, members, start, limit, err) from err
        # a member is gone: on NCCL the communicator is unusable until the survivors rebuild it
        log.warning("rank %d: %s over ranks %s ended incomplete: %s", self.rank, operation, list(members), err)
        self.broken = self.batched
        return False

    def _failure(
        self, operation: str, members: tuple[int, ...], start: float, limit: float, err: BaseException
    ) -> CoordinationTimeout:
        return CoordinationTimeout(
            f"rank {self.rank}: {operation} over ranks {list(members)} failed or timed out after "
            f"{time.monotonic() - start:.1f}s (timeout {limit:.0f}s): {err}"
        )
