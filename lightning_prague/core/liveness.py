"""Telling a hung worker from a slow one: each worker's beacon, and the control plane's verdict.

A crash needs no detector: the worker's connection to the control plane closes and the control
plane announces its departure at once. A hang does: the process is still there, but its training
has stopped (a deadlocked data loader, a stuck kernel, a frozen or SIGSTOPped process). Each
worker therefore runs a `Beacon` thread that tells the control plane, once a second, how far its
training has come (a counter bumped at every training and validation batch), whether it is waiting
on other ranks (an exchange, a meeting) or busy outside the steps (setup, an epoch's end,
checkpoints), and the longest of its latest step times (computing only, waits excluded).

**The rule** (`HangRule`, decided by the control plane's `HangDetector`): a worker is hung when,
for longer than its bound, its progress has not moved while it was neither waiting nor busy, or
nothing at all was heard from it (the process is frozen: its beacon is silent too). Its bound is
`max(floor, factor * its longest recent step)`: by default `max(10 s, 20 x step)`, 10 s for 50 ms
steps and for a worker 5 times slower (250 ms) alike, since the bound follows each worker's own
history and never the others'. Until a worker has timed a step (its first batch of a fit), and
while it says it is busy, the bound is the session's `sync_timeout` (a first step that compiles, a
long checkpoint: 1800 s by default, as DDP survives); a busy worker's beacon still beats, though, so
one that goes silent while busy is declared after `silent_busy_factor` (3) times its stepping bound
(a frozen process, or one cut off by a network partition at an epoch's end). A worker that waits
on a hung peer is not hung: it says it is waiting. When a worker's state changes (busy to stepping, its first timed
step) its training thread sends a beat itself, before the step, so that the control plane knows
its bound before it can hang.

What happens next (fencing the worker, so that a hang becomes a departure like a crash) is the
control plane's (`lightning_prague.core.coordinator`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

log = logging.getLogger(__name__)

#: seconds between two beats of a worker's beacon
BEAT_SECONDS = 1.0
#: a worker not heard from for this long has gone silent (its beacon stopped), not merely slow
SILENT_SECONDS = 3 * BEAT_SECONDS


@dataclass(frozen=True)
class HangRule:
    """When a worker counts as hung (see the module docstring)."""

    floor: float = 10.0
    factor: float = 20.0
    #: steps a worker must have timed before its own history sets its bound
    min_steps: int = 1

    #: a busy worker (outside its steps) is declared hung after this many times its bound without a
    #: word: its beacon thread beats whatever its training thread does, so a long silence means the
    #: process is frozen or cut off (a network partition), even in a checkpoint that may take longer
    silent_busy_factor: float = 3.0

    def bound(self, step: Optional[float], busy: bool, timeout: float) -> float:
        """Seconds without progress after which a worker is declared hung."""
        if busy or step is None:
            return timeout
        return max(self.floor, self.factor * step)

    def silence_bound(self, step: Optional[float], busy: bool, timeout: float) -> float:
        """Seconds without a word (not even a beat) after which a worker is declared hung: its bound, or
        `silent_busy_factor` times its stepping bound while it is busy (before its first timed step:
        `timeout`, as for progress: a first step that compiles may hold the interpreter)."""
        if step is None:
            return timeout
        stepping = max(self.floor, self.factor * step)
        return min(timeout, self.silent_busy_factor * stepping) if busy else stepping


class Beacon:
    """A worker's side: what its training thread reports, and the thread that sends it.

    `send(fields)` delivers one beat (the session's `send("beat", **fields)`); it is called from
    the beacon's own thread, which keeps beating while the training thread is blocked.
    """

    def __init__(self, rule: HangRule, interval: float = BEAT_SECONDS, history: int = 32) -> None:
        self.rule = rule
        self.interval = interval
        self.progress = 0
        self.busy = True  # setup: until the first batch
        self._waiting = 0  # nested waits on other ranks in progress
        self._waited = False  # a wait happened since the last beat
        self._wait_started = 0.0
        self._waited_seconds = 0.0  # since the last bump
        self._last_bump: Optional[float] = None
        self._steps: deque[float] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sent: tuple[bool, bool] = (True, False)  # (busy, step known) of the last beat
        #: (when, step, busy) of the latest beats (about an hour's), for `bound(since=...)`
        self._reported: deque[tuple[float, Optional[float], bool]] = deque(maxlen=4096)
        self._send: Optional[Callable[[dict[str, Any]], None]] = None
        self._thread: Optional[threading.Thread] = None

    # -- the training thread ------------------------------------------------------------------
    def bump(self) -> None:
        """A batch starts: progress, and (unless a busy stretch came between) one more step time."""
        now = time.monotonic()
        with self._lock:
            if self._last_bump is not None and not self.busy:
                self._steps.append(max(0.0, now - self._last_bump - self._waited_seconds))
            self._last_bump = now
            self._waited_seconds = 0.0
            self.progress += 1
            self.busy = False
            changed = self._sent != (False, len(self._steps) >= self.rule.min_steps)
        if changed:  # from this thread, now: it may hang in the very step that follows
            self._beat()

    def set_busy(self) -> None:
        """Outside the steps until the next `bump` (an epoch's end, a checkpoint): the long bound applies."""
        with self._lock:
            self.busy = True

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Around a wait on other ranks: a worker that waits is not hung (its peers may be)."""
        with self._lock:
            if self._waiting == 0:
                self._wait_started = time.monotonic()
            self._waiting += 1
            self._waited = True
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1
                if self._waiting == 0:
                    self._waited_seconds += time.monotonic() - self._wait_started

    @property
    def step_seconds(self) -> Optional[float]:
        """The longest of the latest step times, once `rule.min_steps` were timed."""
        with self._lock:
            return max(self._steps) if len(self._steps) >= self.rule.min_steps else None

    def bound(self, timeout: float, since: Optional[float] = None) -> float:
        """This worker's bound of silence (`HangRule.silence_bound`, `timeout` being the session's long
        one): now, or
        with `since` the shortest of now and of every beat sent since then (the control plane judges
        the worker by whichever of them reached it last)."""
        step = self.step_seconds
        with self._lock:
            busy = self.busy
            sent = [(s, b) for when, s, b in self._reported if since is not None and when >= since]
        return min(self.rule.silence_bound(s, b, timeout) for s, b in [(step, busy), *sent])

    def report(self) -> dict[str, Any]:
        """One beat's fields (and the start of the next beat's window)."""
        step = self.step_seconds
        with self._lock:
            waiting = self._waiting > 0 or self._waited
            self._waited = False
            self._sent = (self.busy, step is not None)
            self._reported.append((time.monotonic(), step, self.busy))
            return {"progress": self.progress, "waiting": waiting, "busy": self.busy, "step": step}

    # -- the beacon thread ----------------------------------------------------------------------
    def _beat(self) -> bool:
        send = self._send
        if send is None or self._stop.is_set():
            return False
        try:
            send(self.report())
            return True
        except Exception:  # the connection is gone: the rank's own checks report that
            log.debug("a beat could not be sent", exc_info=True)
            return False

    def start(
        self, send: Callable[[dict[str, Any]], None], name: str, watch: Optional[Callable[[], None]] = None
    ) -> None:
        """Beat every `interval` seconds from a thread of its own; `watch()` runs before each beat (the
        session's check that the control plane still answers)."""
        self._send = send

        def beat() -> None:
            beating = True
            while not self._stop.wait(self.interval):
                if watch is not None:  # also once beats fail (the connection closed): it may end the process
                    watch()
                if beating:
                    beating = self._beat()
                elif watch is None:
                    return

        self._thread = threading.Thread(target=beat, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


@dataclass
class _Heard:
    last_heard: float
    last_advance: float
    progress: int = 0
    busy: bool = True
    step: Optional[float] = None


@dataclass
class HangDetector:
    """The control plane's side: per rank, when it was last heard from and last moved."""

    rule: HangRule
    timeout: float
    clock: Callable[[], float] = time.monotonic
    _ranks: dict[int, _Heard] = field(default_factory=dict)

    def joined(self, rank: int) -> None:
        now = self.clock()
        self._ranks[rank] = _Heard(now, now)

    def heard(self, rank: int) -> None:
        """Any message from `rank`: it is not frozen."""
        entry = self._ranks.get(rank)
        if entry is not None:
            entry.last_heard = self.clock()

    def beat(self, rank: int, progress: int, waiting: bool, busy: bool, step: Optional[float]) -> None:
        entry = self._ranks.get(rank)
        if entry is None:
            return
        now = self.clock()
        entry.last_heard = now
        if progress != entry.progress or waiting or busy:
            entry.last_advance = now
        entry.progress, entry.busy, entry.step = progress, busy, step

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def hung(self) -> list[tuple[int, str]]:
        """Ranks that are hung now, each with the reason (removed: each is reported once)."""
        now = self.clock()
        found = []
        for rank, entry in list(self._ranks.items()):
            bound = self.rule.bound(entry.step, entry.busy, self.timeout)
            quiet = self.rule.silence_bound(entry.step, entry.busy, self.timeout)
            silent, still = now - entry.last_heard, now - entry.last_advance
            basis = "its sync_timeout" if entry.busy or entry.step is None else f"its step time {entry.step:.3f}s"
            if silent > quiet or (still > bound and silent > SILENT_SECONDS):
                quiet_basis = basis
                if entry.busy and entry.step is not None and quiet < bound:
                    quiet_basis = f"{self.rule.silent_busy_factor:g} x its bound from its step time {entry.step:.3f}s"
                    quiet_basis += ", busy"
                why = (
                    f"nothing heard from it for {silent:.1f}s (bound {min(quiet, bound):.1f}s from {quiet_basis}): "
                    "it is frozen, or cut off from the control plane (a network partition, or its node is down)"
                )
            elif still > bound:
                why = f"no training progress for {still:.1f}s (bound {bound:.1f}s from {basis})"
            else:
                continue
            del self._ranks[rank]
            found.append((rank, f"hung: {why}"))
        return found
