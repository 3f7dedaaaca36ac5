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
control plane's (`lightning_prague.core.plane.coordinator`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from lightning_prague.core.protocol import SILENT_SECONDS, HangRule

log = logging.getLogger(__name__)


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
