"""Telling a hung worker from a slow one: each worker's beacon, and the control plane's verdict.

A crash needs no detector: the worker's connection to the control plane closes and the control
plane announces its departure at once. A hang does: the process is still there, but its training
has stopped (a deadlocked data loader, a stuck kernel, a frozen or SIGSTOPped process). Each
worker therefore runs a `Beacon` thread that tells the control plane, once a second, how far its
training has come (a counter bumped at every training and validation batch), whether it is waiting
on other ranks (an exchange, a meeting) or busy outside the steps (setup, an epoch's end,
checkpoints), the longest of its latest step times (computing only, waits excluded), and whether
its training thread showed a sign of life since the last beat (`active`: it used the CPU, its stack
moved or its device worked, `lightning_prague.core.client.activity`).

**The rule** (`HangRule`, decided by the control plane's `HangDetector`): a worker whose progress
has not moved while it was neither waiting nor busy is

* **slow**, not hung, while it is active: a step that computes for minutes is never fenced; only
  the session's long bound (`sync_timeout`) ends a worker that moves without progress (a livelock);
* **hung (blocked)** once it has shown no sign of life for `max(floor, factor x its longest recent
  step)`, 60 s and 20 by default (a deadlock, a wait that never returns);
* **hung (silent)** once nothing at all was heard from it (its beacon is silent too: the process is
  frozen or SIGSTOPped, or cut off) for `max(min(silent_floor, floor), factor x step)`, 10 s by
  default; on the control plane's own host, a silent process that is running and using the CPU (a
  C call that holds the interpreter lock) counts as active instead (`probe`).

The bounds follow each worker's own step history and never the others'. Until a worker has timed a
step (its first batch of a fit), and while it says it is busy, the bound is the session's
`sync_timeout` (a first step that compiles, a long checkpoint: 1800 s by default, as DDP survives);
a busy worker's beacon still beats, though, so one that goes silent while busy is declared after
`silent_busy_factor` (3) times its silent bound. A worker that waits on a hung peer is not hung: it
says it is waiting. When a worker's state changes (busy to stepping, its first timed step) its
training thread sends a beat itself, before the step, so that the control plane knows its bound
before it can hang.

What happens next (fencing the worker, so that a hang becomes a departure like a crash) is the
control plane's (`lightning_prague.core.plane.coordinator`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from lightning_prague.core.protocol import LEFT_OUT, SILENT_SECONDS, HangRule

log = logging.getLogger(__name__)


@dataclass
class _Heard:
    last_heard: float
    last_advance: float
    #: the last sign of life: progress, a wait, busy work, or activity of its training thread
    last_alive: float
    progress: int = 0
    busy: bool = True
    step: Optional[float] = None
    #: the CPU seconds its process had used when `probe` last found it silent
    probed: Optional[float] = None
    #: it was left out of the fit at its short bound (`left_out`); it is fenced at its long one
    left_out: bool = False


@dataclass
class HangDetector:
    """The control plane's side: per rank, when it was last heard from and last moved."""

    rule: HangRule
    timeout: float
    clock: Callable[[], float] = time.monotonic
    #: `probe(rank)`: the CPU seconds the rank's process has used if it runs on this host and is not
    #: stopped, else `None` (a silent rank whose CPU time grows holds the interpreter: it computes)
    probe: Callable[[int], Optional[float]] = lambda rank: None
    _ranks: dict[int, _Heard] = field(default_factory=dict)

    def joined(self, rank: int) -> None:
        now = self.clock()
        self._ranks[rank] = _Heard(now, now, now)

    def heard(self, rank: int) -> None:
        """Any message from `rank`: it is not frozen."""
        entry = self._ranks.get(rank)
        if entry is not None:
            entry.last_heard = self.clock()

    def beat(
        self, rank: int, progress: int, waiting: bool, busy: bool, step: Optional[float], active: bool = False
    ) -> None:
        entry = self._ranks.get(rank)
        if entry is None:
            return
        now = self.clock()
        entry.last_heard = now
        entry.probed = None
        if progress != entry.progress or waiting or busy:
            entry.last_advance = now
        if progress != entry.progress or waiting or busy or active:
            entry.last_alive = now
        entry.progress, entry.busy, entry.step = progress, busy, step

    def left_out(self) -> list[tuple[int, str]]:
        """Stepping ranks blocked past their short bound (`HangRule.leave_out_bound`), each with the
        reason, reported once: the others go on without them, and `hung` fences them at the long bound
        unless they show life before that."""
        now = self.clock()
        found = []
        for rank, entry in self._ranks.items():
            bound = self.rule.leave_out_bound(entry.step, entry.busy, self.timeout)
            if entry.left_out or bound is None or now - entry.last_heard > SILENT_SECONDS:
                continue  # a silent rank is judged by its silence bound (`hung`)
            lifeless = now - entry.last_alive
            if lifeless > bound:
                entry.left_out = True
                found.append((
                    rank,
                    f"{LEFT_OUT}: no training progress and no sign of life for {lifeless:.1f}s (short bound "
                    f"{bound:.1f}s from its step time {entry.step:.3f}s); fenced at "
                    f"{self.rule.bound(entry.step, entry.busy, self.timeout):.0f}s unless it wakes",
                ))  # fmt: skip
        return found

    def forget(self, rank: int) -> None:
        self._ranks.pop(rank, None)

    def hung(self) -> list[tuple[int, str]]:
        """Ranks that are hung now, each with the reason (removed: each is reported once)."""
        now = self.clock()
        found = []
        for rank, entry in list(self._ranks.items()):
            why = self._verdict(rank, entry, now)
            if why is not None:
                del self._ranks[rank]
                found.append((rank, f"hung: {why}"))
        return found

    def _verdict(self, rank: int, entry: _Heard, now: float) -> Optional[str]:
        """Why `rank` is hung now, or `None` (see the module docstring)."""
        rule = self.rule
        blocked = rule.bound(entry.step, entry.busy, self.timeout)
        quiet = rule.silence_bound(entry.step, entry.busy, self.timeout)
        silent, still, lifeless = now - entry.last_heard, now - entry.last_advance, now - entry.last_alive
        basis = "its sync_timeout" if entry.busy or entry.step is None else f"its step time {entry.step:.3f}s"
        if silent > quiet and self._computes_unheard(rank, entry):
            entry.last_heard = entry.last_alive = now  # it holds the interpreter: slow, not frozen
            log.debug("rank %d is silent but its process uses the CPU: computing", rank)
            return None
        if silent > quiet or (lifeless > blocked and silent > SILENT_SECONDS):
            if entry.busy and entry.step is not None and quiet < blocked:
                basis = f"{rule.silent_busy_factor:g} x its silent bound from its step time {entry.step:.3f}s, busy"
            return (
                f"nothing heard from it for {silent:.1f}s (bound {min(quiet, blocked):.1f}s from {basis}): "
                "it is frozen, or cut off from the control plane (a network partition, or its node is down)"
            )
        if lifeless > blocked:
            return (
                f"no training progress for {still:.1f}s and no sign of life for {lifeless:.1f}s (its training "
                f"thread used no CPU, its stack did not move, its device was idle; bound {blocked:.1f}s from {basis})"
            )
        if still > self.timeout:
            return (
                f"no training progress for {still:.1f}s although its training thread is active "
                f"(bound {self.timeout:.0f}s, the session's sync_timeout: a livelock?)"
            )
        return None

    def _computes_unheard(self, rank: int, entry: _Heard) -> bool:
        """Whether a silent `rank`'s process is running and used the CPU since it was last probed."""
        cpu = self.probe(rank)
        if cpu is None:
            return False
        computing = entry.probed is not None and cpu > entry.probed
        first = entry.probed is None
        entry.probed = cpu
        return computing or first
