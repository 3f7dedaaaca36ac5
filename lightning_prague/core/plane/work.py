"""Who holds which batch of an epoch: so that a lost rank's untrained batches are trained exactly once.

The work queue (`lightning_prague.core.data.sharding`) hands an epoch's chunks (one batch each)
out one claim at a time; each rank also starts every epoch with one chunk set aside for it (its
place among the members), without a claim. The control plane keeps, per rank, every chunk it holds
and has not trained yet (`WorkLedger`):

* a **claim** holds the chunk it hands out, with the global-progress ticket claimed with it;
* the **set-aside chunks** of an epoch are held from the first claim on its queue (every rank's
  first claim of an epoch names the members and the chunk each starts with): a rank lost before
  anyone claimed still has its chunk found, and its set-aside ticket goes with it (no hole);
* a rank says `done` for a chunk right after the optimizer step that trained it, before its model
  takes part in any exchange (`work` messages; a batch is trained once its rank said so), and
  `hold` for a chunk whose ticket it claimed apart from the chunk (at the start of training);
* when a rank is lost, what it holds goes back to the queue (`lose`), with the tickets, and the
  next claims hand it out before the queue goes on.

A batch that a rank trained but had not yet reported when it died was trained into a model that
died with it and took part in no average: handing it out again trains it once in the job's model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Optional

log = logging.getLogger(__name__)

#: chunks one rank may hold at once (its batch in flight and the prefetched ones): a rank that
#: claims to hold more is refused, so the ledger stays small whatever a connection sends
MAX_HELD = 4096

_ABSENT = object()

Held = list[tuple[int, Optional[int]]]  # (chunk, ticket value as the queue's claims count it)


class WorkLedger:
    """Per rank and epoch queue, the chunks it holds untrained (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[int, dict[str, dict[int, Optional[int]]]] = {}
        #: the queues whose set-aside chunks are registered
        self._registered: set[str] = set()
        #: chunks reported done on a queue before its set-aside chunks were registered, or given back
        #: then by a lost rank that held them (a set-aside one among them is not given back twice)
        self._early: dict[str, set[int]] = {}
        #: the members of each registered queue's epoch, as its first claim named them
        self._members: dict[str, list[int]] = {}

    def claimed(self, rank: int, key: str, chunk: int, ticket: Optional[int]) -> None:
        """`rank` holds `chunk` of `key`'s queue, claimed with `ticket`."""
        held = self._held.setdefault(rank, {}).setdefault(key, {})
        if chunk not in held and self.holding(rank) >= MAX_HELD:
            raise ValueError(f"rank {rank} would hold more than {MAX_HELD} untrained chunks")
        held[chunk] = ticket
        log.debug("work: rank %d holds chunk %d of %s (ticket %s)", rank, chunk, key, ticket)

    def holding(self, rank: int) -> int:
        return sum(len(chunks) for chunks in self._held.get(rank, {}).values())

    def set_aside(self, key: str, members: Sequence[int], chunks: Sequence[int], lost: Iterable[int]) -> Held:
        """Register `key`'s set-aside chunks (`chunks[i]` is `members[i]`'s, with the `i`-th set-aside
        ticket), once; return those of members already lost, to go back to the queue."""
        if key in self._registered:
            return []
        self._registered.add(key)
        self._members[key] = list(members)
        early = self._early.pop(key, set())
        gone = set(lost)
        orphans: Held = []
        count = len(members)
        for index, (rank, chunk) in enumerate(zip(members, chunks)):
            if chunk < 0 or chunk in early:
                continue
            ticket = 1 + index - count  # the claim value whose ticket is the set-aside `start + 1 + index`
            if rank in gone:
                orphans.append((chunk, ticket))
            else:
                self._held.setdefault(rank, {}).setdefault(key, {}).setdefault(chunk, ticket)
        if orphans:
            log.warning("work: the set-aside chunks %s of %s belong to lost ranks", [c for c, _ in orphans], key)
        return orphans

    def holders(self, key: str) -> set[int]:
        """The ranks that hold chunks of `key`'s queue untrained."""
        return {rank for rank, held in self._held.items() if held.get(key)}

    def members(self, key: str) -> list[int] | None:
        """The members of `key`'s epoch (`None` until its set-aside chunks are registered)."""
        return self._members.get(key)

    def hold(self, rank: int, key: str, chunks: Sequence[int], tickets: Sequence[Optional[int]]) -> None:
        """`rank` holds `chunks` with these `tickets` (claimed apart from the chunks)."""
        for chunk, ticket in zip(chunks, tickets):
            self.claimed(rank, key, chunk, ticket)

    def done(self, rank: int, key: str, chunks: Sequence[int]) -> None:
        """`rank` trained `chunks` of `key`'s queue."""
        held = self._held.get(rank, {}).get(key, {})
        for chunk in chunks:
            held.pop(chunk, None)
            # (before the registration even where it was held: a rank that holds its set-aside chunk with a
            # ticket claimed apart from it may train it before any claim on the queue registers it)
            if key not in self._registered:
                early = self._early.setdefault(key, set())
                if len(early) < MAX_HELD:
                    early.add(chunk)
        log.debug("work: rank %d trained chunks %s of %s", rank, list(chunks), key)

    def give_back(self, rank: int, key: str, chunk: int) -> bool:
        """`rank` gives `chunk` of `key`'s queue back untrained from where it stands (a slow rank's shard
        in progress at the epoch's tail, `lightning_prague.core.data.shard_queue`): it holds it no more.
        False where it did not hold it (nothing to give back)."""
        held = self._held.get(rank, {}).get(key, {})
        if held.pop(chunk, _ABSENT) is _ABSENT:
            return False
        log.debug("work: rank %d gives chunk %d of %s back", rank, chunk, key)
        return True

    def lose(self, rank: int) -> dict[str, Held]:
        """What the lost `rank` held untrained, by queue (it holds nothing after this)."""
        held = self._held.pop(rank, {})
        for key, chunks in held.items():
            if key not in self._registered:  # (its set-aside chunk among them: it goes back once, from here)
                early = self._early.setdefault(key, set())
                early.update(list(chunks)[: max(0, MAX_HELD - len(early))])
        return {key: sorted(chunks.items()) for key, chunks in held.items() if chunks}

    def forget(self, key: str) -> None:
        """`key`'s epoch is over on every rank (its keys are deleted)."""
        for chunks in self._held.values():
            chunks.pop(key, None)
        self._registered.discard(key)
        self._early.pop(key, None)
        self._members.pop(key, None)
