"""Signs of life of a worker's training thread besides its progress: is a long step slow or dead?

A step that takes minutes is either computing (alive: it must never be fenced) or blocked (a
deadlock, a wait that never returns). The beacon thread samples, once per beat, what tells them
apart without touching the training thread (`ThreadActivity.sample`):

* the **training thread's CPU time** (Linux: `/proc/self/task/<tid>/stat`; elsewhere the process's):
  a thread that computes uses the CPU, one that waits on a lock or on I/O does not;
* the **training thread's stack** (`sys._current_frames`): the innermost frames and the instruction
  each stands at; a step that runs Python code moves, one that sits in one blocking call does not
  (a move counts only if the thread used some CPU meanwhile: one that sleeps in a polling loop is
  caught between two sleeps now and then, and is as blocked as one that waits);
* the **device's activity** (optional `device_busy`, e.g. a CUDA stream with work queued): a step
  that waits on its kernels is computing on the device.

Any of them counts as moving (`HangRule`: a moving worker is only bounded by the session's long
bound); none of them for the blocked bound means hung.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Optional

log = logging.getLogger(__name__)

#: share of the wall-clock time between two samples that the thread must have spent on the CPU to
#: count as computing (a thread that sleeps in a loop or polls uses far less)
CPU_SHARE = 0.1
#: innermost frames compared between two samples
STACK_DEPTH = 8

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def thread_cpu_seconds(native_id: Optional[int]) -> Optional[float]:
    """CPU seconds (user and system) the thread `native_id` of this process used; `None` if unknown."""
    if native_id is not None:
        try:
            with open(f"/proc/self/task/{native_id}/stat", "rb") as handle:
                fields = handle.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime (fields 14 and 15)
        except (OSError, IndexError, ValueError):
            pass
    try:
        return time.process_time()
    except OSError:  # pragma: no cover - every supported platform has it
        return None


def stack_signature(ident: Optional[int]) -> Optional[tuple[tuple[int, int], ...]]:
    """Where the thread `ident` stands: (code, instruction) of its innermost frames; `None` if gone."""
    if ident is None:
        return None
    frame = sys._current_frames().get(ident)
    signature = []
    while frame is not None and len(signature) < STACK_DEPTH:
        signature.append((id(frame.f_code), frame.f_lasti))
        frame = frame.f_back
    return tuple(signature) if signature else None


class ThreadActivity:
    """Samples one thread's signs of life (see the module docstring); thread-safe to `watch` and `sample`.

    `device_busy()`: whether the thread's device has work in flight (`None`: no device to watch).
    """

    def __init__(self, device_busy: Optional[Callable[[], bool]] = None, cpu_share: float = CPU_SHARE) -> None:
        self.device_busy = device_busy
        self.cpu_share = cpu_share
        self._ident: Optional[int] = None
        self._native_id: Optional[int] = None
        self._last: Optional[tuple[float, Optional[float], Optional[tuple[tuple[int, int], ...]]]] = None
        self._lock = threading.Lock()

    def watch(self, thread: Optional[threading.Thread] = None) -> None:
        """Watch `thread` (default: the calling thread, the training thread)."""
        thread = thread or threading.current_thread()
        with self._lock:
            if thread.ident != self._ident:
                self._ident, self._native_id, self._last = thread.ident, getattr(thread, "native_id", None), None

    def sample(self) -> bool:
        """Whether the watched thread showed a sign of life since the previous sample (the first: no)."""
        with self._lock:
            ident, native_id, last = self._ident, self._native_id, self._last
        if ident is None:
            return False
        now = time.monotonic()
        cpu = thread_cpu_seconds(native_id)
        stack = stack_signature(ident)
        with self._lock:
            if self._ident == ident:
                self._last = (now, cpu, stack)
        signs = []
        if last is not None:
            then, cpu_then, stack_then = last
            used = None if cpu is None or cpu_then is None else cpu - cpu_then
            if used is not None and used >= self.cpu_share * (now - then):
                signs.append("cpu")
            # a moved stack counts only with some CPU used meanwhile: a thread that sleeps in a loop
            # (polls) is caught between two sleeps now and then, and is as blocked as one that waits
            if stack is not None and stack_then is not None and stack != stack_then and (used is None or used > 0):
                signs.append("stack")
        if self.device_busy is not None:
            try:
                if self.device_busy():
                    signs.append("device")
            except Exception:  # a device that cannot be asked says nothing
                log.debug("the device's activity could not be read", exc_info=True)
        if signs:
            log.debug("training thread active: %s", ", ".join(signs))
        return bool(signs)
