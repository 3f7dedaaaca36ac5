"""A worker's beacon: what its training thread reports to the control plane, and the thread that sends it.

The verdict on what it reports (hung or slow) is the control plane's
(`lightning_prague.core.plane.liveness`); the rule both sides share is `protocol.HangRule`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Optional

from lightning_prague.core.client.activity import ThreadActivity
from lightning_prague.core.protocol import BEAT_SECONDS, HangRule

log = logging.getLogger(__name__)


class Beacon:
    """A worker's side: what its training thread reports, and the thread that sends it.

    `send(fields)` delivers one beat (the session's `send("beat", **fields)`); it is called from
    the beacon's own thread, which keeps beating while the training thread is blocked. Each beat
    says whether the training thread showed a sign of life besides progress (`activity`: it uses
    the CPU, its stack moves, its device works): a long step that computes is slow, not hung.
    """

    def __init__(
        self,
        rule: HangRule,
        interval: float = BEAT_SECONDS,
        history: int = 32,
        activity: Optional[ThreadActivity] = None,
    ) -> None:
        self.rule = rule
        self.interval = interval
        self.activity = activity if activity is not None else ThreadActivity()
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
        self.activity.watch()  # the thread that trains
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
        self.activity.watch()
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
        active = self.activity.sample()
        with self._lock:
            waiting = self._waiting > 0 or self._waited
            self._waited = False
            self._sent = (self.busy, step is not None)
            self._reported.append((time.monotonic(), step, self.busy))
            return {"progress": self.progress, "waiting": waiting, "busy": self.busy, "step": step, "active": active}

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

    def stop(self, timeout: float = 5.0) -> None:
        """Stop beating and wait (up to `timeout` seconds) for the thread to end."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the beacon thread did not end within %.0fs", timeout)
