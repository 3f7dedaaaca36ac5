"""A payload of bytes from one member to another over the library's process group.

A rank that rejoins a fit gets its state (model, optimizer, progress) from a live member this way,
right after the process group was rebuilt with it (`lightning_prague.core.job.Job.rejoin`): a size
first, then the bytes in pieces of `PIECE_BYTES`, as point-to-point operations on the group, on
the backend's device (staged through it on NCCL), each wait bounded. Only the sender and the
receiver take part; the other members go on at once.

What arrives is bytes: the receiver checks the size against its bound before it allocates
anything, and decodes the bytes itself (never by unpickling: `lightning_prague.core.comm.collectives.decode_object`).
"""

from __future__ import annotations

import logging
import time

import torch

from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.errors import CoordinationTimeout

log = logging.getLogger(__name__)

#: the largest piece of a payload in flight at once (a bound on the staging buffers)
PIECE_BYTES = 64 << 20
#: the largest payload a receiver accepts unless told otherwise
MAX_PAYLOAD_BYTES = 256 << 30


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


def receive_payload(comm: GroupComm, peer: int, what: str, limit: int = MAX_PAYLOAD_BYTES) -> bytes:
    """The bytes `peer` sends with `send_payload`; a size above `limit` is refused before anything is allocated."""
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
