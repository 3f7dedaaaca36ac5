"""Simulated slow network links, for studying heterogeneity the way the papers do.

A `SlowLinks` says which workers sit behind a slow link and how many extra seconds each
byte costs there. While it is active (`simulate_slow_links`), every group sum of
`lightning_prague.core.groups.GroupComm` that involves one of those workers completes no sooner
than `seconds_per_byte * bytes` after it was issued: blocking ones take that much longer,
overlapped ones hide it behind computation if they can. Every member of such a group sees
the same delay, as with a real bottleneck link.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SlowLinks:
    ranks: frozenset[int]
    seconds_per_byte: float

    def delay(self, members: Iterable[int], nbytes: int) -> float:
        """Extra seconds a collective of `nbytes` among `members` takes."""
        return nbytes * self.seconds_per_byte if self.ranks.intersection(members) else 0.0


_active: SlowLinks | None = None


def simulate_slow_links(links: SlowLinks | None) -> None:
    """Make `links` apply to this process's group collectives (`None` turns it off)."""
    global _active
    _active = links


def active_slow_links() -> SlowLinks | None:
    return _active
