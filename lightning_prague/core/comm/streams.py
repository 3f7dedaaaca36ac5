"""Ordering a communication thread's work against the training thread's, without blocking either.

On CUDA a communication thread runs on a stream of its own, bound to the rank's device (a new
thread would otherwise default to `cuda:0` and the default stream). Hand-offs are CUDA events:
the training thread marks the point after which a snapshot is ready and the communication
stream waits for it; the communication thread marks the point after which its result is ready
and the compute stream waits for that before folding it in, so the optimizer never reads a
half-written buffer. No side waits on the host. On the CPU every call is a no-op.

Memory is safe by construction too: every tensor handed from one thread to the other is kept
(`keep_for`) on the stream of the thread that uses it, so the caching allocator does not hand
its block to new work before the receiving stream has run what it queued on it, even when the
thread that allocated it has dropped it (`Tensor.record_stream`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

Marker = Optional["torch.cuda.Event"]


class CommStream:
    """The stream communication for tensors on `device` runs on (none on the CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def bind(self) -> None:
        """Make the calling thread use this device and stream (call first in a communication thread)."""
        if self.stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)

    def mark(self) -> Marker:
        """An event recorded on the calling thread's current stream (`None` on the CPU)."""
        return mark_on(self.device)

    @staticmethod
    def keep_for(tensors: Iterable[torch.Tensor]) -> None:
        """The calling thread's current stream uses `tensors`, which another thread's stream made
        (a snapshot, a difference, a sum): their memory is not reused before this stream's work
        queued so far on them has run, whoever frees them (no-op for tensors off CUDA)."""
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(torch.cuda.current_stream(tensor.device))

    @staticmethod
    def wait(marker: Marker) -> None:
        """Make the calling thread's current stream wait for `marker` (host does not block)."""
        if marker is not None:
            torch.cuda.current_stream().wait_event(marker)


def mark_on(device: torch.device) -> Marker:
    """An event recorded on the calling thread's current stream of `device` (`None` off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def device_of(tensors: list[torch.Tensor]) -> torch.device:
    """The device of a rank's model state (the CPU if it holds no tensor)."""
    return tensors[0].device if tensors else torch.device("cpu")
