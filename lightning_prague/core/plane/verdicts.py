"""All-or-nothing for group collectives: the control plane decides whether a group's sum takes effect.

A group sum whose member dies part-way through can reach some members complete and others not
(`lightning_prague.core.comm.groups`). Every member therefore reports its own completeness of the
sum (`summed`: a key naming the collective, the members, `ok`) before it writes anything back, and
waits for this table's verdict, the same for every member:

- every member reported and every one said `ok`: the sum takes effect on every member;
- a member said it is incomplete, or departed before it reported: it takes effect on none.

A member that reported and departed afterwards does not change the verdict (its share is in every
sum). A member readmitted (a new process for its rank, `readmitted`) after the membership epoch the
collective's members were drawn in is not the process that was drawn: that one departed, and the new
one never reports, so a collective first reported after the readmission is decided against too. A
verdict decided by a departure is kept until every live member has had it, so a member that reports
late learns the same. The table holds only undecided collectives and decided ones that live members
have yet to fetch; a rank may have at most `MAX_OPEN_PER_RANK` of them open (a rank runs one group at
a time; a report beyond that, or one a rank would never send, is refused with an error to its sender
only), so nothing in it grows with the number of steps.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: collectives a rank may have reported and not yet had a verdict for
MAX_OPEN_PER_RANK = 64

#: a verdict to send: (rank, item)
Verdict = tuple[int, dict[str, Any]]


@dataclass
class _Open:
    members: frozenset[int]
    reported: dict[int, bool] = field(default_factory=dict)
    #: members that were sent the verdict (or departed after they reported)
    sent: set[int] = field(default_factory=set)
    #: the verdict, once decided (a departure decides before every member reported)
    apply: bool | None = None


class GroupVerdicts:
    """The verdicts of one session's group collectives (see the module docstring)."""

    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}
        self._per_rank: dict[int, int] = {}
        #: rank -> the membership epoch its current process was admitted in (ranks that rejoined)
        self._admitted: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._open)

    def readmitted(self, rank: int, epoch: int) -> None:
        """A new process for `rank` was admitted in membership epoch `epoch` (its earlier one departed)."""
        self._admitted[rank] = epoch

    def report(
        self,
        rank: int,
        key: str,
        members: Sequence[int],
        ok: bool,
        departed: Container[int],
        epoch: int | None = None,
    ) -> list[Verdict]:
        """`rank`'s completeness of collective `key` among `members`, drawn in membership epoch `epoch`
        (if known); returns the verdicts now due.

        Raises `ValueError` (the sender broke the protocol) for a rank outside `members`, fewer than
        two members, other members than an earlier report of `key` named, a second report of the
        same rank, or too many open collectives of one rank.
        """
        group = frozenset(int(m) for m in members)
        if rank not in group or len(group) < 2 or len(group) != len(members):
            raise ValueError(f"rank {rank} reported collective {key!r} of members {list(members)}, not a group of it")
        if self._per_rank.get(rank, 0) >= MAX_OPEN_PER_RANK:
            raise ValueError(f"rank {rank} has {MAX_OPEN_PER_RANK} collectives open without a verdict")
        entry = self._open.get(key)
        if entry is None:
            entry = self._open[key] = _Open(group)
            if any(m in departed or self._drawn_before(m, epoch) for m in group):  # lost before it could report
                entry.apply = False
        elif entry.members != group:
            raise ValueError(
                f"rank {rank} reported collective {key!r} with members {sorted(group)}, "
                f"others with {sorted(entry.members)}"
            )
        if rank in entry.reported:
            raise ValueError(f"rank {rank} reported collective {key!r} twice")
        entry.reported[rank] = bool(ok)
        self._per_rank[rank] = self._per_rank.get(rank, 0) + 1
        if not ok:
            entry.apply = False
        if entry.apply is None and len(entry.reported) == len(entry.members):
            entry.apply = True
        log.debug("verdicts: rank %d reported %r (ok %s); verdict %s", rank, key, ok, entry.apply)
        due = self._due(key, entry, departed)
        if rank in departed:  # it left after an error and still runs what was issued to it: against, as for all
            due.append((rank, {"t": "verdict", "key": key, "apply": False}))
        return due

    def _drawn_before(self, rank: int, epoch: int | None) -> bool:
        """Whether `rank`'s process in a collective drawn in `epoch` was an earlier one than its current."""
        return epoch is not None and self._admitted.get(rank, -1) > epoch

    def depart(self, rank: int, departed: Container[int]) -> list[Verdict]:
        """`rank` is gone: every collective it had not reported is decided against; returns the
        verdicts now due to the members that reported."""
        self._per_rank.pop(rank, None)
        due: list[Verdict] = []
        for key, entry in list(self._open.items()):
            if rank not in entry.members:
                continue
            if rank not in entry.reported and entry.apply is None:
                entry.apply = False
            due += self._due(key, entry, departed)
        return due

    def _due(self, key: str, entry: _Open, departed: Container[int]) -> list[Verdict]:
        """The decided verdict for every member that reported and has not had it (live ones only);
        the entry is forgotten once no live member is left to report."""
        if entry.apply is None:
            return []
        due = []
        for member in entry.reported:
            if member in entry.sent:
                continue
            entry.sent.add(member)
            self._release(member)
            if member not in departed:
                due.append((member, {"t": "verdict", "key": key, "apply": entry.apply}))
        if all(m in entry.reported or m in departed for m in entry.members):
            del self._open[key]
        return due

    def _release(self, rank: int) -> None:
        count = self._per_rank.get(rank, 0) - 1
        if count > 0:
            self._per_rank[rank] = count
        else:
            self._per_rank.pop(rank, None)

    def ranks_open(self) -> Iterable[int]:
        """Ranks with reports still waiting for a verdict (for tests and monitoring)."""
        return [r for r, n in self._per_rank.items() if n > 0]
