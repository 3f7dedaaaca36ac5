"""A payload of bytes from one member to another over the library's process group.

A rank that rejoins a fit gets its state (model, optimizer, progress) from a live member this way,
right after the process group was rebuilt with it (`lightning_prague.core.job.Job.rejoin`): a size
first, then the bytes in pieces of `PIECE_BYTES`, as point-to-point operations on the group, on
the backend's device (staged through it on NCCL), each wait bounded. Only the sender and the
receiver take part; the other members go on at once.

`BackgroundTransfer` sends one payload to one or more receivers from a thread of its own, so that
the sender trains on meanwhile: it encodes the payload there (from a snapshot the caller took),
and sends it on a `GroupComm` of its own over the same process group. An exchange of the
sender's with a receiver waits for the transfer first (`GroupComm.before_exchange`), so the
receiver's operations with the sender come in one order, on gloo and NCCL alike; exchanges with
anyone else run while it sends.

What arrives is bytes: the receiver checks the size against its bound before it allocates
anything, and decodes the bytes itself (never by unpickling: `lightning_prague.core.comm.collectives.decode_object`).

**On CUDA (NCCL).** The transfer thread first binds the rank's device and a CUDA stream of its own
(`CommStream.bind`, as the exchange threads do): a new thread would otherwise work on `cuda:0`
(a CUDA context there for every donor of another local rank) and on the default stream, which
the training thread computes on. Its waits are the host's: `GroupComm.point_to_point` polls each
piece's end on NCCL, bounded by the timeout and by departures, and makes no stream wait for it
before it has completed, so the compute stream never waits for the transfer, and neither does the
transfer's own stream wait for a piece that will never arrive.

The transfer and the exchanges share the job's process group, and so one NCCL communicator. Two
threads must not issue batches on it at once (NCCL's coalescing state is per process group, not
per thread): every NCCL operation of a `GroupComm`, whichever thread and whichever `GroupComm`,
is issued under the process group's issue lock (`lightning_prague.core.comm.groups.issue_lock`),
held only while a batch is issued, never while it runs, so the exchanges go on beside the
transfer. A communicator of the transfer's own was not chosen: the donor and the joiner would have
to create it together at every admission (the setup of an NCCL communicator, and its buffers on
the device), and the job would no longer hold a fixed set of communicators (`GroupComm` never
adds one); the lock needs nothing from the joiner and nothing on gloo, whose operations run as
before.

**A joiner that dies mid-transfer.** On gloo the next piece fails at once and the transfer thread
ends. On NCCL the piece in flight never completes, and the communicator's operations behind it
(the donor's exchanges, and its peers' exchanges with the donor) would wait for it: once the
control plane announces the joiner's departure, the transfer thread gives up (its poll sees the
departure) and so does every wait on the communicator (`GroupComm` gives up any NCCL wait once a
member of the group departed), its sums ending incomplete, until the next synchronization point
rebuilds the group without the joiner. A joiner that hangs without departing holds a piece until
the timeout (one operation's bound), as it holds any exchange, until the hang detector fences it
(a departure). The donor's next synchronization point waits for the transfer (`wait`) no longer
than the transfer's own bound (the timeout, per receiver), and at most `DEPARTED_GRACE` seconds
after a departure even if the thread is held inside the backend's call that issues a piece
(which no deadline reaches); such a thread is left behind, with the communicator it holds, which
the rebuild replaces.

**A donor that dies mid-transfer.** The joiner's receive watches for the donor's departure
(`receive_payload`'s `sender_gone`: the control plane announces every departure to the members,
the joiner among them since its admission): on NCCL its polls give up at it; on gloo, whose waits
block in the backend (a connection that closes fails them at once, a donor across a partition or
a fenced one does not), the receive runs on a thread of its own while the calling thread watches,
and is left behind when the donor leaves. Either way the joiner learns of it within
`_WAIT_POLL` seconds of the notice (a `MemberLost` naming the donor), not at the timeout, and asks
to rejoin again (`lightning_prague.core.membership.Membership.rejoin`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.comm.streams import CommStream
from lightning_prague.core.errors import CoordinationTimeout, MemberLost

log = logging.getLogger(__name__)

#: the largest piece of a payload in flight at once (a bound on the staging buffers)
PIECE_BYTES = 64 << 20
#: the largest payload a receiver accepts unless told otherwise
MAX_PAYLOAD_BYTES = 256 << 30
#: seconds `BackgroundTransfer.wait` gives a transfer thread on NCCL after a member's departure
#: before it leaves the thread behind (it ends on its own within milliseconds unless it is held in a call)
DEPARTED_GRACE = 5.0
#: seconds between two looks at the thread and at departures in `BackgroundTransfer.wait`
_WAIT_POLL = 0.05


def send_payload(comm: GroupComm, peer: int, payload: bytes, what: str) -> float:
    """Send `payload` to `peer` (which runs `receive_payload`); returns the seconds it took."""
    start = time.monotonic()
    comm.point_to_point(torch.tensor([len(payload)], dtype=torch.int64), peer, True, f"the size of {what}")
    view = memoryview(payload)
    for offset in range(0, len(payload), PIECE_BYTES):
        piece = torch.frombuffer(bytearray(view[offset : offset + PIECE_BYTES]), dtype=torch.uint8)
        comm.point_to_point(piece, peer, True, what)
    seconds = time.monotonic() - start
    log.debug("rank %d: sent %s to rank %d: %d bytes in %.2fs", comm.rank, what, peer, len(payload), seconds)
    return seconds


def receive_payload(
    comm: GroupComm,
    peer: int,
    what: str,
    limit: int = MAX_PAYLOAD_BYTES,
    sender_gone: Callable[[], bool] | None = None,
) -> bytes:
    """The bytes `peer` sends with `send_payload`; a size above `limit` is refused before anything is allocated.

    `sender_gone()`: whether `peer` left the job (the control plane announced its departure), asked
    while waiting: once it says so the receive ends with `MemberLost`, at once rather than at the
    timeout (see the module docstring). On NCCL it becomes `comm`'s `abandon` (only the sender's
    departure ends the receive)."""
    if sender_gone is None:
        return _receive(comm, peer, what, limit)
    start = time.monotonic()

    def left(err: BaseException | None = None) -> MemberLost:
        return MemberLost(
            f"rank {comm.rank}: rank {peer}, which was sending it {what}, left the job after "
            f"{time.monotonic() - start:.1f}s of the transfer" + (f" ({err})" if err is not None else "")
        )

    if comm.batched:  # NCCL: its waits poll from the host, and give up at the sender's departure
        comm.abandon = lambda members: sender_gone()
        try:
            return _receive(comm, peer, what, limit)
        except CoordinationTimeout as err:
            if sender_gone():
                raise left(err) from err
            raise
    # gloo: a wait blocks in the backend until the timeout; receive on a thread, watch from here
    outcome: dict[str, object] = {}

    def receive() -> None:
        try:
            outcome["payload"] = _receive(comm, peer, what, limit)
        except BaseException as err:  # raised below, or left behind with the thread
            outcome["error"] = err

    thread = threading.Thread(target=receive, name=f"prague-receive-{comm.rank}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(_WAIT_POLL)
        if thread.is_alive() and sender_gone():
            raise left()  # the thread ends with the backend's wait; nothing reads what it got
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    payload = outcome["payload"]
    assert isinstance(payload, bytes)
    return payload


def _receive(comm: GroupComm, peer: int, what: str, limit: int) -> bytes:
    """`receive_payload`'s transfer itself: the size, then the pieces."""
    size = torch.zeros(1, dtype=torch.int64)
    comm.point_to_point(size, peer, False, f"the size of {what}")
    total = int(size.item())
    if not 0 <= total <= limit:
        raise CoordinationTimeout(
            f"rank {comm.rank}: rank {peer} announced {what} of {total} bytes, outside 0..{limit}: refused"
        )
    out = bytearray(total)
    for offset in range(0, total, PIECE_BYTES):
        piece = torch.empty(min(PIECE_BYTES, total - offset), dtype=torch.uint8)
        comm.point_to_point(piece, peer, False, what)
        out[offset : offset + piece.numel()] = piece.numpy().tobytes()
    return bytes(out)


class BackgroundTransfer:
    """`encode()`'s bytes to each of `receivers`, sent from a thread (see the module docstring).

    A receiver lost on the way costs a warning, not the sender's fit: its own side fails, and it
    leaves the job. `wait` ends the transfer (bounded by `timeout` per receiver, and on NCCL by a
    member's departure). The thread binds `stream` (the device and stream of `comm`'s backend)
    before anything else.
    """

    def __init__(
        self,
        comm: GroupComm,
        receivers: Sequence[int],
        encode: Callable[[], bytes],
        what: str,
        timeout: float,
        receiver_left: Callable[[int], bool] = lambda rank: False,
    ) -> None:
        self.receivers = set(receivers)
        #: whether a receiver left the job since this transfer began (it gave up on it; it may have
        #: asked to rejoin again): `wait` leaves a send to receivers that all left behind
        self.receiver_left = receiver_left
        self.what = what
        self.timeout = timeout
        # a communicator of its own over the same process group: the training thread's keeps its state
        self._comm = GroupComm(comm.rank, comm.world_size, timeout, comm.pg)
        self._comm.rebind(comm.pg, comm.everyone)
        self._comm.abandon = comm.abandon
        self._comm.batched = comm.batched  # (the same process group: its operations are issued the same way)
        #: the device and stream the thread binds first: on CUDA the rank's device and a stream of its own
        self.stream = CommStream(comm.device)
        self._encode = encode
        #: (receiver, MB, seconds) of each completed send
        self.sent: list[tuple[int, float, float]] = []
        self._thread = threading.Thread(target=self._run, name=f"prague-transfer-{comm.rank}", daemon=True)
        self._left_behind = False

    def start(self) -> BackgroundTransfer:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            self.stream.bind()  # before anything touches CUDA: no context on cuda:0, no use of the default stream
            payload = self._encode()
        except Exception as err:  # the receivers' own waits fail; they leave the job
            log.warning("rank %d: could not encode %s: %s", self._comm.rank, self.what, err)
            return
        for receiver in sorted(self.receivers):
            try:
                seconds = send_payload(self._comm, receiver, payload, self.what)
                self.sent.append((receiver, len(payload) / 1e6, seconds))
                log.warning(
                    "rank %d: sent %s to rank %d in the background (%.1f MB in %.2fs)",
                    self._comm.rank, self.what, receiver, len(payload) / 1e6, seconds,
                )  # fmt: skip
            except (CoordinationTimeout, RuntimeError) as err:
                log.warning("rank %d: could not send rank %d %s: %s", self._comm.rank, receiver, self.what, err)

    @property
    def done(self) -> bool:
        """Whether the thread has ended."""
        return not self._thread.is_alive()

    def guard(self, peers: set[int]) -> None:
        """Before an exchange with `peers`: if one of them is a receiver, the transfer ends first."""
        if self.receivers & peers and not self.done and not self._left_behind:
            log.debug("rank %d: an exchange with ranks %s waits for %s", self._comm.rank, sorted(peers), self.what)
            self.wait()

    def wait(self) -> None:
        """Until the transfer ended (each send is bounded by the timeout, so this is too). At most
        `DEPARTED_GRACE` seconds once every receiver it has not reached left the job (on gloo a send
        held in the backend's connect, which its receiver gave up on, ends at no deadline of ours),
        and on NCCL once any member departed: the thread is then left behind (see the module
        docstring), and later calls return at once."""
        if self._left_behind:
            return
        start = time.monotonic()
        bound = start + self.timeout * (len(self.receivers) + 1) + 5.0
        departed_at: float | None = None
        while self._thread.is_alive():
            self._thread.join(min(_WAIT_POLL, max(0.0, bound - time.monotonic())))
            now = time.monotonic()
            if not self._thread.is_alive():
                return
            if now >= bound:
                log.warning("rank %d: %s is still being sent after its timeout", self._comm.rank, self.what)
                return
            pending = self.receivers - {receiver for receiver, _, _ in list(self.sent)}
            nccl_gone = self._comm.batched and self._comm.abandon(self._comm.everyone)
            if nccl_gone or (pending and all(self.receiver_left(r) for r in pending)):
                departed_at = now if departed_at is None else departed_at
                if now - departed_at >= DEPARTED_GRACE:
                    self._left_behind = True
                    log.warning(
                        "rank %d: %s is still being sent %.1fs after a member left the job; left behind",
                        self._comm.rank, self.what, now - departed_at,
                    )  # fmt: skip
                    return
