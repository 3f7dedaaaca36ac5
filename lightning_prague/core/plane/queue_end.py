"""When a claim on an emptied work queue may return: not while a live member may still give chunks back.

A rank whose claim finds its epoch's queue empty would end its epoch. If another member is lost
afterwards, the untrained chunks it held go back to the queue (`lightning_prague.core.plane.work`),
but nobody claims any more: they would never be trained. So such a claim **parks** at the control
plane while some live member of the epoch may still be lost with chunks in hand, i.e. while it is

* not itself parked in such a claim,
* not done claiming (a parked claim released empty, or a rank that left the epoch's tail) with
  every chunk it holds trained, and
* not waiting at a synchronization point (the meeting would wait for the parked claimer, which
  then must train its last batch and come: a parked claimer never waits for a rank at a meeting).

A chunk given back by a lost member goes to a parked claimer (the first parked), which trains it
and claims again. A rank that left the epoch's tail (a slow one, leaving the rest to faster ones)
**stands by** in a parked claim rather than ending its epoch: if every other live member is done or
parked while the queue still holds chunks (the ranks that took them were lost), it takes the
queue's next chunk and claims on, and the others' parked claims wait for it; otherwise it ends its
epoch with them, and at once where the others wait at a meeting inside the epoch (a validation at a
global step: they claim on after it, and the meeting waits for it). When no live member is left
to wait for, every parked claim of the queue returns empty together. A member lost or hung in its
epoch thus costs the others a wait until it is found (its hang bound), which they would spend at
the epoch's closing synchronization point anyway.

What this cannot cover: Lightning fetches one batch ahead, so every rank trains its last batch of an
epoch after its last claim returned. A rank lost while training that batch gives it back when no
claim is left to take it (`docs/fault_tolerance.md`, "Exactly once").

Everything here is bounded whatever a connection sends: one parked claim per rank and queue, at most
`MAX_PARKED_PER_RANK` queues per rank, and at most `MAX_QUEUES` queues (a rank that reports itself
done on many queues only pushes out the queues nobody waits on).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Container
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

#: queues (epochs) kept at once: one or two in a run (the epoch ending, perhaps the next one
#: starting); beyond it a queue without parked claims is dropped (it only knew who was done claiming,
#: which saves the others a short wait), and if every one has parked claims a new one is refused
MAX_QUEUES = 64
#: queues one rank may have parked claims on at once (a training process has one claim in flight)
MAX_PARKED_PER_RANK = 4


@dataclass
class _Queue:
    #: rank -> (request to answer, the end value to answer it with), in the order they parked
    parked: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: ranks that claim no more from this queue
    done: set[int] = field(default_factory=set)
    #: parked ranks standing by at the epoch's tail -> their claim (to take the queue's next chunk with)
    standby: dict[int, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """The reply a parked claim gets: `chunk` (the queue's end if there is none) and its `ticket`;
    `given_back`: the chunk is one a lost member gave back (the claimer holds it now)."""

    rank: int
    req: int
    chunk: int
    ticket: int | None
    given_back: bool = False
    #: a standby claim that nobody else will take the queue's rest for: the claim to take its next chunk
    #: with (the coordinator answers the queue's end if it has none)
    standby: dict[str, Any] | None = None


class QueueEnds:
    """The parked claims and the ranks done claiming, per work queue (see the module docstring)."""

    def __init__(self) -> None:
        self._queues: dict[str, _Queue] = {}

    def _queue(self, key: str) -> _Queue:
        queue = self._queues.get(key)
        if queue is None:
            if len(self._queues) >= MAX_QUEUES:
                idle = next((k for k, q in self._queues.items() if not q.parked), None)
                if idle is None:
                    raise ValueError(f"more than {MAX_QUEUES} work queues end at once")
                del self._queues[idle]
            queue = self._queues[key] = _Queue()
        return queue

    def park(self, key: str, rank: int, req: int, end: int, standby: dict[str, Any] | None = None) -> None:
        """`rank`'s claim `req` on `key` found the queue empty, or (`standby`: the claim, from a rank that
        left the epoch's tail) stands by for the queue's rest: it waits for `settle`."""
        queue = self._queue(key)
        if rank in queue.parked:
            raise ValueError(f"rank {rank} already waits on a claim of {key!r}")
        if sum(rank in q.parked for q in self._queues.values()) >= MAX_PARKED_PER_RANK:
            raise ValueError(f"rank {rank} already waits on claims of {MAX_PARKED_PER_RANK} work queues")
        queue.parked[rank] = (req, end)
        queue.done.discard(rank)
        if standby is not None:
            queue.standby[rank] = standby
        log.debug("queue end: rank %d's claim on %s parks", rank, key)

    def finish(self, key: str, rank: int) -> None:
        """`rank` claims nothing more from `key`'s queue (it left the epoch's tail)."""
        self._queue(key).done.add(rank)
        log.debug("queue end: rank %d claims no more from %s", rank, key)

    def claims_on(self, key: str, rank: int) -> bool:
        """`rank` claims on `key`: it is done with every other queue (an epoch it left); whether that
        changed whom a parked claim waits for."""
        changed = False
        for other, queue in self._queues.items():
            if other != key and rank not in queue.parked and rank not in queue.done:
                queue.done.add(rank)
                changed = changed or bool(queue.parked)
        return changed

    def still_claiming(self, key: str, live: Collection[int], rank: int) -> bool:
        """Whether a claim on `key` is parked, or a live member other than `rank` among those that
        claimed on it (`live` are the members) is not done claiming: someone will claim a chunk given
        back now. A queue nobody parked on or finished yet counts every other member."""
        queue = self._queues.get(key)
        if queue is None:
            return any(r != rank for r in live)
        return bool(queue.parked) or any(r != rank and r not in queue.done for r in live)

    def parked(self, key: str) -> list[int]:
        queue = self._queues.get(key)
        return list(queue.parked) if queue is not None else []

    def keys(self) -> list[str]:
        """The queues with parked claims."""
        return [key for key, queue in self._queues.items() if queue.parked]

    def settle(
        self,
        key: str,
        live: Container[int],
        members: list[int],
        at_meeting: Container[int],
        holding: Container[int],
        requeued: list[list[int | None]],
    ) -> list[Answer]:
        """The parked claims of `key` that return now: one per chunk in `requeued` (taken from it, in
        parking order), then, if no live member of `members` is left to wait for, all the others empty.
        `holding`: the ranks that hold chunks of `key` untrained (one done claiming is waited for until
        it has trained them)."""
        queue = self._queues.get(key)
        if queue is None or not queue.parked:
            return []
        answers: list[Answer] = []
        while requeued and queue.parked:
            rank = next(iter(queue.parked))
            req, _ = queue.parked.pop(rank)
            queue.standby.pop(rank, None)
            chunk, ticket = requeued.pop(0)
            assert chunk is not None
            answers.append(Answer(rank, req, int(chunk), ticket, given_back=True))
            log.debug("queue end: rank %d's parked claim on %s gets back chunk %d", rank, key, chunk)
        waited = [
            r
            for r in members
            if r in live and r not in queue.parked and r not in at_meeting and (r not in queue.done or r in holding)
        ]
        standing = [rank for rank in queue.parked if rank in queue.standby]
        if standing and not waited:
            # ranks at a meeting inside the epoch (a validation) will claim on after it, and the meeting
            # waits for the ranks standing by: those end their epoch, as a rank that leaves the tail did
            coming_back = [r for r in members if r in live and r in at_meeting and r not in queue.done]
            for rank in standing:
                req, end = queue.parked.pop(rank)
                claim = queue.standby.pop(rank)
                answers.append(Answer(rank, req, end, None, standby=None if coming_back else claim))
                if coming_back:
                    queue.done.add(rank)
            if not coming_back:  # nobody else takes the queue's rest: the ranks standing by do
                log.debug("queue end: nobody else claims on %s: ranks %s, standing by, take its rest", key, standing)
                return answers  # (settled again: one that takes a chunk claims again, and the others wait for it)
            log.debug("queue end: ranks %s at a meeting claim on %s after it: %s end", coming_back, key, standing)
        if queue.parked and not waited:
            for rank, (req, end) in queue.parked.items():
                answers.append(Answer(rank, req, end, None))
                queue.done.add(rank)
            log.debug("queue end: %s is done; ranks %s end their epoch", key, sorted(queue.parked))
            queue.parked.clear()
        elif queue.parked:
            log.debug("queue end: claims of %s on %s wait for ranks %s", sorted(queue.parked), key, waited)
        return answers

    def depart(self, rank: int) -> None:
        """`rank` is gone: its parked claims are answered by nobody."""
        for queue in self._queues.values():
            queue.parked.pop(rank, None)
            queue.standby.pop(rank, None)
            queue.done.discard(rank)

    def forget(self, key: str) -> list[Answer]:
        """`key`'s epoch is over (its keys are deleted): its parked claims, if any, return empty."""
        queue = self._queues.pop(key, None)
        if queue is None:
            return []
        return [Answer(rank, req, end, None) for rank, (req, end) in queue.parked.items()]
