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

A rank sends its next claim while it trains the chunk before (a claim ahead), so its last claim of an
epoch parks while it still trains its last batch. A claim that says it `reports` (its rank takes the
answer only after its step, and reports the chunks it holds meanwhile) counts its rank as a member
that may still give chunks back until those are reported trained: a rank lost in its last step gives
its batch to a parked claim. Other claims (a rank whose loader fetches ahead: DataLoader workers, `drop_last`,
or Lightning's own fetcher under gradient accumulation) would make their own rank wait for itself, so
their rank is not waited for once parked, and a rank lost while training its last batch then gives it
back when no claim is left to take it (`docs/fault_tolerance.md`, "Exactly once").

Everything here is bounded whatever a connection sends: one parked claim per rank and queue, at most
`MAX_PARKED_PER_RANK` queues per rank, and at most `MAX_QUEUES` queues (a rank that reports itself
done on many queues only pushes out the queues nobody waits on).

**Replicas' followers** (`FollowedClaims`): the ranks of a replica group train one model in step, so
only its leader claims; each other rank (a follower) sends a claim that `follow`s the leader's `n`-th
answer on the queue (0, 1, ...: every answer the plane gives a claim, wherever it is given, is
numbered per queue and claimer) and gets the very same `[chunk, ticket]`, at once if it was given,
else when it is. A follow takes nothing (no chunk, no ticket, no ledger entry), and its rank counts
as done claiming that queue: parked claims never wait for it. The last `MAX_FOLLOWED` answers of each
claimer are kept (an older one is refused by name, as one `MAX_FOLLOWED` or more ahead), one follow
per rank and queue waits, on at most `MAX_PARKED_PER_RANK` queues, and answers are kept for at most
`MAX_QUEUES` queues (a queue pushed out or forgotten refuses follows from then on); a follow waiting on
a leader that leaves the job, or on a queue that is forgotten, gets an error at once.
"""

from __future__ import annotations

import logging
from collections import deque
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
#: answers of one claimer on one queue kept for its replica's followers (a follower trains in step with
#: its leader: it asks for one of the last few); an older one is refused
MAX_FOLLOWED = 64


@dataclass
class _Queue:
    #: rank -> (request to answer, the end value to answer it with), in the order they parked
    parked: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: ranks that claim no more from this queue
    done: set[int] = field(default_factory=set)
    #: parked ranks standing by at the epoch's tail -> their claim (to take the queue's next chunk with)
    standby: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: parked ranks that train, and report, the chunks they hold while their claim waits (`reports`)
    reporting: set[int] = field(default_factory=set)


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

    def park(
        self, key: str, rank: int, req: int, end: int, standby: dict[str, Any] | None = None, reports: bool = False
    ) -> None:
        """`rank`'s claim `req` on `key` found the queue empty, or (`standby`: the claim, from a rank that
        left the epoch's tail) stands by for the queue's rest: it waits for `settle`. `reports`: the rank
        trains and reports the chunks it holds meanwhile (the others' claims wait for those too)."""
        queue = self._queue(key)
        if rank in queue.parked:
            raise ValueError(f"rank {rank} already waits on a claim of {key!r}")
        if sum(rank in q.parked for q in self._queues.values()) >= MAX_PARKED_PER_RANK:
            raise ValueError(f"rank {rank} already waits on claims of {MAX_PARKED_PER_RANK} work queues")
        queue.parked[rank] = (req, end)
        queue.done.discard(rank)
        if reports:
            queue.reporting.add(rank)
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
        drained: bool = False,
    ) -> list[Answer]:
        """The parked claims of `key` that return now: one per chunk in `requeued` (taken from it, in
        parking order), then, if no live member of `members` is left to wait for, all the others empty.
        `holding`: the ranks that hold chunks of `key` untrained (one done claiming, or parked in a claim
        that `reports`, is waited for until it has trained them). `drained`: the queue has handed out
        every chunk (none given back waits), so the claims standing by end at once: there is no rest
        for them to take, and a chunk given back later goes to the claims parked at the queue's end or
        the ranks still claiming."""
        queue = self._queues.get(key)
        if queue is None or not queue.parked:
            return []
        answers: list[Answer] = []
        while requeued and queue.parked:
            rank = next(iter(queue.parked))
            req, _ = queue.parked.pop(rank)
            queue.standby.pop(rank, None)
            queue.reporting.discard(rank)
            chunk, ticket = requeued.pop(0)
            assert chunk is not None
            answers.append(Answer(rank, req, int(chunk), ticket, given_back=True))
            log.debug("queue end: rank %d's parked claim on %s gets back chunk %d", rank, key, chunk)
        waited = [
            r
            for r in members
            if r in live
            and r not in at_meeting
            and (
                (r not in queue.parked and (r not in queue.done or r in holding))
                or (r in queue.reporting and r in holding)  # parked, and still training what it holds
            )
        ]
        standing = [rank for rank in queue.parked if rank in queue.standby]
        if standing and waited and drained and not requeued:
            # (a rank standing by would otherwise wait for the last claimers to finish before it trains
            # its own last batch: Lightning fetched it, and waits for this claim, before training it)
            for rank in standing:
                req, end = queue.parked.pop(rank)
                queue.standby.pop(rank)
                queue.reporting.discard(rank)
                answers.append(Answer(rank, req, end, None))
                queue.done.add(rank)
            log.debug("queue end: %s handed out every chunk: ranks %s, standing by, end", key, standing)
            standing = []
        if standing and not waited:
            # ranks at a meeting inside the epoch (a validation) will claim on after it, and the meeting
            # waits for the ranks standing by: those end their epoch, as a rank that leaves the tail did
            coming_back = [r for r in members if r in live and r in at_meeting and r not in queue.done]
            for rank in standing:
                req, end = queue.parked.pop(rank)
                queue.reporting.discard(rank)
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
            queue.reporting.clear()
        elif queue.parked:
            log.debug("queue end: claims of %s on %s wait for ranks %s", sorted(queue.parked), key, waited)
        return answers

    def standing_by(self, key: str) -> dict[str, Any] | None:
        """A claim standing by on `key` (the first parked), or `None`."""
        queue = self._queues.get(key)
        return next(iter(queue.standby.values()), None) if queue is not None else None

    def claims_again(self, key: str, rank: int) -> None:
        """`rank`, which followed its replica's leader on `key` (done claiming there), claims itself now."""
        queue = self._queues.get(key)
        if queue is not None and rank in queue.done:
            queue.done.discard(rank)
            log.debug("queue end: rank %d claims on %s itself again", rank, key)

    def depart(self, rank: int) -> None:
        """`rank` is gone: its parked claims are answered by nobody."""
        for queue in self._queues.values():
            queue.parked.pop(rank, None)
            queue.standby.pop(rank, None)
            queue.reporting.discard(rank)
            queue.done.discard(rank)

    def forget(self, key: str) -> list[Answer]:
        """`key`'s epoch is over (its keys are deleted): its parked claims, if any, return empty."""
        queue = self._queues.pop(key, None)
        if queue is None:
            return []
        return [Answer(rank, req, end, None) for rank, (req, end) in queue.parked.items()]


@dataclass
class _Memo:
    """One claimer's answers on one queue: `answers[0]` is its answer number `first`."""

    first: int = 0
    answers: deque[tuple[int, int | None]] = field(default_factory=deque)

    @property
    def given(self) -> int:
        """How many answers its claims got on the queue."""
        return self.first + len(self.answers)


@dataclass
class _Followed:
    #: claimer (a replica's leader) -> its answers
    memos: dict[int, _Memo] = field(default_factory=dict)
    #: follower -> (the leader it follows, the number of the answer it waits for, its request)
    waiting: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    #: ranks that followed a leader on this queue (done claiming it)
    followers: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class FollowReply:
    """What a follow gets: the leader's answer `value` (`[chunk, ticket]`), or an `error` to reply."""

    rank: int
    req: int
    value: list[int | None] | None = None
    error: str | None = None


class FollowedClaims:
    """The answers claims got, per queue and claimer, for replicas' followers (see the module docstring).

    Deterministic in what it is given, as the rest of the plane: a plane rebuilt from its journal
    (`lightning_prague.core.plane.journal`) replays the claims and follows and stands where it stood.
    """

    def __init__(self) -> None:
        self._keys: dict[str, _Followed] = {}
        #: queues whose answers are no longer kept (forgotten, or pushed out), why: their follows are
        #: refused, and later answers on them are not kept (at most `MAX_QUEUES`, the oldest go first)
        self._dropped: dict[str, str] = {}

    def _drop(self, key: str, why: str) -> list[FollowReply]:
        followed = self._keys.pop(key, None)
        self._dropped.pop(key, None)
        self._dropped[key] = why
        while len(self._dropped) > MAX_QUEUES:
            del self._dropped[next(iter(self._dropped))]
        if followed is None:
            return []
        log.debug("followed claims: the answers on %s are dropped (%s)", key, why)
        return [
            FollowReply(rank, req, error=f"rank {rank} follows answer {n} of rank {leader} on {key!r}, but {why}")
            for rank, (leader, n, req) in followed.waiting.items()
        ]

    def _room(self, key: str, following: bool) -> tuple[_Followed, list[FollowReply]]:
        """`key`'s entry, made room for: a queue nobody waits on goes first; else, for an answer (which is
        given whatever), the oldest queue, its follows refused; a follow is refused."""
        followed = self._keys.get(key)
        if followed is not None:
            return followed, []
        refused: list[FollowReply] = []
        if len(self._keys) >= MAX_QUEUES:
            idle = next((k for k, f in self._keys.items() if not f.waiting), None)
            if idle is None and following:
                raise ValueError(f"follows wait on more than {MAX_QUEUES} work queues at once")
            victim = idle if idle is not None else next(iter(self._keys))
            refused = self._drop(victim, f"more than {MAX_QUEUES} work queues were followed at once")
        followed = self._keys[key] = _Followed()
        return followed, refused

    def given(self, key: str, leader: int, value: list[int | None]) -> list[FollowReply]:
        """`leader`'s claim on `key` got `value` (`[chunk, ticket]`): its next answer; the follows that
        waited for it get it too (and follows refused to make room, if any)."""
        if key in self._dropped:
            return []
        followed, replies = self._room(key, following=False)
        memo = followed.memos.setdefault(leader, _Memo())
        number = memo.given
        chunk, ticket = value
        memo.answers.append((chunk, ticket))
        if len(memo.answers) > MAX_FOLLOWED:
            memo.answers.popleft()
            memo.first += 1
        log.debug("followed claims: answer %d of rank %d on %s is %s", number, leader, key, value)
        for rank, (followed_leader, n, req) in list(followed.waiting.items()):
            if followed_leader == leader and n == number:
                del followed.waiting[rank]
                replies.append(FollowReply(rank, req, [chunk, ticket]))
                log.debug("followed claims: rank %d's waiting follow gets answer %d of rank %d on %s", rank, n,
                          leader, key)  # fmt: skip
        return replies

    def follow(self, key: str, rank: int, req: int, leader: int, n: int) -> list[int | None] | None:
        """`rank` (a follower of `leader`, a live member: the coordinator checked it) asks for `leader`'s
        answer `n` on `key`: the answer if it was given, else `None` (the follow waits for it, `given`).
        `ValueError` where it cannot be answered: an answer no longer kept, one too far ahead, a second
        follow of `rank` waiting on `key`, or too many queues waited on."""
        if rank == leader:
            raise ValueError(f"rank {rank} cannot follow its own claims on {key!r}")
        followed = self._keys.get(key)
        memo = followed.memos.get(leader) if followed is not None else None
        if memo is None and key in self._dropped:
            raise ValueError(f"rank {rank} cannot follow answer {n} of rank {leader} on {key!r}: {self._dropped[key]}")
        given = memo.given if memo is not None else 0
        if memo is not None and n < memo.first:
            raise ValueError(
                f"rank {rank} cannot follow answer {n} of rank {leader} on {key!r}: only its last {MAX_FOLLOWED} "
                f"answers are kept (from answer {memo.first})"
            )
        if n < given:
            assert memo is not None
            chunk, ticket = memo.answers[n - memo.first]
            if followed is not None:
                followed.followers.add(rank)
            log.debug("followed claims: rank %d gets answer %d of rank %d on %s", rank, n, leader, key)
            return [chunk, ticket]
        if n >= given + MAX_FOLLOWED:
            raise ValueError(
                f"rank {rank} cannot follow answer {n} of rank {leader} on {key!r}: its claims got {given} answers "
                f"so far (a follower is at most {MAX_FOLLOWED} ahead)"
            )
        if followed is not None and rank in followed.waiting:
            raise ValueError(f"rank {rank} already waits on a follow of {key!r}")
        if sum(rank in f.waiting for f in self._keys.values()) >= MAX_PARKED_PER_RANK:
            raise ValueError(f"rank {rank} already waits on follows of {MAX_PARKED_PER_RANK} work queues")
        followed, refused = self._room(key, following=True)
        assert not refused  # (a follow only pushes out a queue nobody waits on)
        followed.waiting[rank] = (leader, n, req)
        followed.followers.add(rank)
        log.debug("followed claims: rank %d waits for answer %d of rank %d on %s", rank, n, leader, key)
        return None

    def cancel(self, key: str, rank: int) -> None:
        """`rank`'s follow waiting on `key` is withdrawn (it was refused after all)."""
        followed = self._keys.get(key)
        if followed is not None:
            followed.waiting.pop(rank, None)

    def claims_again(self, key: str, rank: int) -> bool:
        """`rank` claims on `key` itself: whether it followed a leader there before (it was done claiming)."""
        followed = self._keys.get(key)
        if followed is None or rank not in followed.followers:
            return False
        followed.followers.discard(rank)
        return True

    def waiting(self, key: str) -> dict[int, tuple[int, int]]:
        """The follows waiting on `key`: follower -> (leader, answer number)."""
        followed = self._keys.get(key)
        return {} if followed is None else {rank: (leader, n) for rank, (leader, n, _) in followed.waiting.items()}

    def kept(self, key: str, leader: int) -> tuple[int, int]:
        """`(first, given)`: the numbers of `leader`'s answers on `key` that are kept, `range(first, given)`."""
        followed = self._keys.get(key)
        memo = followed.memos.get(leader) if followed is not None else None
        return (0, 0) if memo is None else (memo.first, memo.given)

    def keys(self) -> list[str]:
        """The queues with answers kept or follows waiting."""
        return list(self._keys)

    def depart(self, rank: int, why: str) -> list[FollowReply]:
        """`rank` left the job (`why`): its own waiting follows are answered by nobody, its answers are no
        longer kept, and the follows waiting on it get an error (they would never be answered)."""
        refused: list[FollowReply] = []
        for key, followed in self._keys.items():
            followed.waiting.pop(rank, None)
            followed.followers.discard(rank)
            if followed.memos.pop(rank, None) is not None:
                log.debug("followed claims: rank %d's answers on %s are dropped: it left", rank, key)
            for follower, (leader, n, req) in list(followed.waiting.items()):
                if leader == rank:
                    del followed.waiting[follower]
                    error = (
                        f"rank {follower}'s follow of answer {n} on {key!r} cannot be answered: rank {rank}, the "
                        f"leader of its replica, left the job ({why})"
                    )
                    refused.append(FollowReply(follower, req, error=error))
                    log.debug("followed claims: rank %d's follow on %s fails: its leader %d left", follower, key, rank)
        return refused

    def forget(self, key: str) -> list[FollowReply]:
        """`key`'s epoch is over (its keys are deleted): its answers go, and its waiting follows get an error."""
        return self._drop(key, "that work queue was forgotten (its epoch is over)")
