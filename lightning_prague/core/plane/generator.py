"""The Group Generator: one global order of group assignments, as pure logic.

Workers send messages (`ready` after a local step, `arrive` at a synchronization point,
`stop` to end training, `leave` when shutting down after an error); the control plane calls
`depart` for a rank whose process is gone. The generator answers by
appending items to per-worker inboxes. Every item for every worker is produced by this one object,
in one sequence, so two workers can never see two shared groups in opposite order, and executing
inbox items in order cannot deadlock.

Inbox items (plain dicts, JSON-serialisable):

- `{"t": "group", "gid", "members"[, "version", "weights"]}`: average with `members` (point-to-point
  on the world process group: no communicator is created for a group, see
  `lightning_prague.core.comm.groups`). Groups of workers that reported model versions (first_ready)
  carry the newest `version`, which members adopt, and, under staleness weighting, per-member
  `weights` (in `members` order) instead of the plain mean.
- `{"t": "answer", "req", "gid"}`: the reply to the worker's `ready` number `req`: the group it was
  given (already earlier in its inbox) or `None` when no group could be formed.
- `{"t": "release", "sync", "version", "stop", "requeue", "speeds", "pending", "members"}`: every
  live worker arrived at synchronization point `sync` and every group issued before it is earlier
  in every inbox; `version` is the newest model version reported so far; `stop`: some rank asked
  the job to stop (every rank stops here, together); `requeue`: the stop is for the cluster's
  requeue signal (every rank writes the requeue checkpoint, all alike); `speeds`: every rank's
  seconds per batch and `pending`: the work-queue chunks every rank holds untrained, as they
  reported them with `arrive`; `final`
  (gossip on a fixed schedule only): the round every rank runs its gossip to before the meeting
  ends (see `Gossip phases` below); `members`: the workers still in the job (see `Membership`);
  `complete`: no live worker arrived reporting `incomplete` (the global average's commit meeting,
  `<sync>/commit`: see `Membership`).
- `{"t": "idle"}`: the gossip phase switched to idle rounds (see below).
- `{"t": "left"}`: the answer to `leave` (a worker shutting down after an error): nothing more will
  name it.
- `{"t": "stop", "reason"}`: training is being stopped: `"sigterm"` (SIGTERM on some rank: every
  rank drains and meets at the stop point at once), `"requeue"` (the same, for the cluster's
  requeue signal, e.g. SLURM's SIGUSR1: every rank then writes the requeue checkpoint; it follows
  a `"sigterm"` stop if it comes later) or `"request"` (a rank decided to stop, e.g.
  `trainer.should_stop`: every rank ends its epoch early, and the next release says `stop`).
- `{"t": "error", "message"}`: ranks disagree about a synchronization point.

Gossip phases (fixed schedules, `lightning_prague.core.exchange.gossip`): every rank's gossip rounds are
collectives of its group, so a phase must end at the same round on every rank, and a rank out of
steps must keep serving neighbours that still step. Such ranks arrive with their `round`. A rank
that waits `idle_after` seconds sends `idle`: from then on every waiting rank runs idle rounds
(mixing only), and ranks that arrive later are told so at once. When the last rank arrives, the
release carries `final`, their round, if every rank stopped at the same round and nobody went
idle. Otherwise it carries `settle`: no rank starts another round, and every rank meets once more
(at `<sync>/rounds`, arriving with the rounds it has issued and `settle`); that release's `final`
is the largest of them, and every rank runs its gossip to it. Waiting for the largest round
issued needs no bound on how far ranks drift apart: a bound from the schedule (how many rounds
connect every rank) fails as soon as a member is lost, because rounds with a lost member end at
once. This is the same meeting that ends every strategy's phase.

Membership: a worker that departs (its process ended, it was fenced after a hang, or it left after
an error) is out of the job until a new process for its rank rejoins (below). Meanwhile it is never
drawn into a group: every policy picks from the live workers only, so a group of the policy's that
contained it becomes the group of its other members (skipped if one is left), each averaging with
the plain mean over the members present, which keeps every round's mixing doubly stochastic. Its
pending request is withdrawn, meetings wait for the live workers only, and the next release names
the live `members`, so every survivor changes its membership at the same point of its sequence of
exchanges. A group sum with a member that died fails on every other member alike if it had posted
nothing (see `lightning_prague.core.comm.groups`); one that died part-way through its sends may
have reached some members and not others, so their sums can differ in completeness. Each then keeps
its own tensors or takes the complete average, never a partial one; where the members must agree,
the global average of a synchronization point, they report their completeness at one more meeting
and all apply it only if the release says `complete`. `min_workers`: when fewer remain, the job is
asked to stop (the `"request"` stop: every rank ends its epoch, and the next release says stop).

Rejoining: a new process for a rank that left (`request_join`) waits, outside the job, for its
admission. Its request *calls* the members to an admission meeting, `admission@<n>`
(`ADMISSION_CALL`): every live member gets a `{"t": "join", "sync"}` item and meets there at its
next batch boundary, inside the epoch, wherever the others are (a mid-epoch meeting with no global
average and no alignment: each goes on training after it). The call's release, like the release of
an epoch's end (`epoch_end@<n>`, `ADMITTING_AT`) that does not stop the fit, names the joiners in
`admit`, and each gets an `{"t": "admit", "sync": "<meeting>/admit"}` item: the members meet the
joiners at `<meeting>/admit` (`lightning_prague.strategies.rejoin`). Only that meeting waits for
the joiners; its release names them in `joined` and the members, joiners included, in `members`,
and from then on they are live workers like any other (the next groups, rounds and work include
them). A call is out at most once at a time (`calling`). If a member meets the others elsewhere
first (it reached its epoch's end, validation, the fit's end, a stop), the call is off: the members
waiting at it get a release that says `cancel` (they train on), a member that comes to it later gets
one at once, and the joiners are admitted at that other meeting if it is an epoch's end, or called
again after its release. A joiner with nothing of the members' epoch to train (`after_epoch`: a
lock-step shard, `CoordinatorSession.nothing_left_in_epoch`) is never called in: an epoch's end admits it.
Every release while joiners wait names them in `joining`: the members then
meet at their next epoch's end even where they would skip that meeting. A joiner that departs, or
closes its session, before its admission is withdrawn (`withdraw`): nobody waits for it at
`<meeting>/admit`. A fit that ends (`fit_end`, a stop) before admitting it sends it an `error` item
that says so.

The cost of a message does not grow with the number of workers: the set of workers that may be
drawn into a group is kept up to date when it changes (parking, leaving, lagging) rather than
rebuilt per request, and who is lagging is re-evaluated every `ceil(N / 8)` reports.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from lightning_prague.core.grouping.policies import Group, GroupingPolicy
from lightning_prague.core.protocol import ADMISSION_CALL, ADMIT, ADMITTING_AT, COMMIT, REQUEUE, SIGTERM, STOP_SYNC

Item = dict[str, Any]


class Candidates(Sequence[int]):
    """Ranks that may be drawn into a group: a sequence (for sampling) with O(1) membership."""

    __slots__ = ("ranks", "_members")

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks
        self._members = frozenset(ranks)

    def __contains__(self, rank: object) -> bool:
        return rank in self._members

    def __len__(self) -> int:
        return len(self.ranks)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        return self.ranks[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ranks)


class GroupGenerator:
    """Turns worker messages into inbox items; see the module docstring for the protocol."""

    def __init__(
        self,
        world_size: int,
        policy: GroupingPolicy,
        avoid_stragglers: bool = True,
        sync_averages: bool = False,
        min_workers: int = 1,
        avoid_busy: bool = False,
        launched: int | None = None,
    ) -> None:
        self.world_size = world_size
        #: draw no worker into another's group while a group of its own is still unfinished (see `busy`)
        self.avoid_busy = avoid_busy
        #: workers in a group issued since their last request: busy until they ask again
        self.busy: set[int] = set()
        #: rank -> groups of others issued to it since its last request (it starts them at its next)
        self._waiting: dict[int, int] = {}
        self.min_workers = min_workers
        self.sync_averages = sync_averages  # synchronization points average globally (workers then agree)
        self.policy = policy
        self.avoid_stragglers = avoid_stragglers
        self.next_gid = 0
        self.rounds = [0] * world_size
        self.parked: dict[int, str] = {}  # rank -> name of the sync point it waits at
        self.stopping = False  # SIGTERM: every rank drains to the stop point
        self.stop_reason: str | None = None  # `SIGTERM` or `REQUEUE`, once stopping
        self.stop_requested = False  # a rank asked the job to stop at the next synchronization point
        starting = world_size if launched is None else launched
        #: ranks that shut down after an error or departed, and free places no worker took yet (`launched`)
        self.left: set[int] = set(range(starting, world_size))
        self.live: list[int] = list(range(starting))  # the others, sorted
        #: the rank that does global rank 0's duties (checkpoints, logging): the lowest live rank, and
        #: it stays the leader until it is lost (a rank that rejoins below it does not take them back,
        #: so that one process writes the logs at a time); every release names it
        self.leader: int | None = 0 if starting else None
        self._speeds: list[float] = [0.0] * world_size  # seconds per batch, as reported with `arrive`
        self._untrained: dict[int, list[int]] = {}
        self._rounds: dict[int, int] = {}  # gossip rounds reported with `arrive`, this meeting
        self._incomplete: set[int] = set()  # ranks whose last collective was incomplete, this meeting
        self._settling = False  # this meeting settles a gossip phase's final round (see above)
        self._idle = False  # this meeting's gossip phase switched to idle rounds
        #: groups shared by a round (static, buffer): (round, members) -> [gid, members yet to ask for it]
        self._per_round: dict[tuple[int, Group], list[int]] = {}
        #: the pool of a policy that pools ready workers (first_ready): FIFO of (rank, req, version)
        self._ready: deque[tuple[int, int, int]] = deque()
        self.newest_version = 0  # the highest model version any worker reported
        self.issued: list[tuple[int, Group]] = []  # (gid, members), for monitoring and tests
        self.record_history = False
        self._lagging: set[int] = set()
        self._reports_since_lagging = 0
        self._lagging_every = max(1, math.ceil(world_size / 8))
        self._pool: Candidates | None = None  # workers that may be drawn into groups, rebuilt on change
        self._available_cache: Candidates | None = None
        #: ranks that rejoin, waiting for their admission (see `Rejoining` in the module docstring)
        self.joining: list[int] = []
        #: ranks told to meet at `<meeting>/admit`, and those of them that arrived there
        self._admitting: set[int] = set()
        self._admit_parked: set[int] = set()
        #: joiners admitted at an epoch's end only, never at a call inside the epoch (`request_join`)
        self.after_epoch: set[int] = set()
        #: ranks admitted by the latest release, until the control plane takes them (`take_joined`)
        self._joined: list[int] = []
        #: the fit's end (`fit_end`) or a stop was released: no admission is called from here
        self.ended = False
        #: ranks admitted that have not asked for a group yet (still restoring the fit's state): nobody
        #: draws them into a group until they do, so that no member waits on one that is not training
        self.starting: set[int] = set()
        #: the admission meeting the members are called to now (`admission@<n>`), if any, and the calls so far
        self.calling: str | None = None
        self._calls = 0

    def request_join(self, rank: int, out: dict[int, list[Item]] | None = None, after_epoch: bool = False) -> None:
        """`rank`, which left the job, has a new process that asks to rejoin (see the module docstring):
        the members are called to an admission meeting at their next batch boundary (`out`).
        `after_epoch`: it is admitted at the members' next epoch's end instead, with nothing of the
        current epoch left to it (a lock-step shard: inside this epoch it would have no batch to train,
        and could only wait for the others)."""
        if rank not in self.left:
            raise ValueError(f"rank {rank} cannot rejoin: it is a live member of the fit")
        if rank not in self.joining and rank not in self._admitting:
            self.joining.append(rank)
            if after_epoch:
                self.after_epoch.add(rank)
        if out is not None:
            self._call_admission(out)

    def _call_admission(self, out: dict[int, list[Item]]) -> None:
        """Call every member to `admission@<n>` at its next batch boundary, unless a call is out, the
        members meet now (their release calls again), or the fit is stopping."""
        if not self._callable() or self.calling is not None or self.parked or self.stopping or self.stop_requested:
            return
        if self.ended or not self.live:
            return
        self._calls += 1
        self.calling = f"{ADMISSION_CALL}{self._calls}"
        for r in self.live:
            self._push(out, r, {"t": "join", "sync": self.calling, "joining": sorted(self.joining)})

    def _callable(self) -> list[int]:
        """The joiners an admission call inside the epoch may admit."""
        return [r for r in self.joining if r not in self.after_epoch]

    def _cancel_call(self, out: dict[int, list[Item]]) -> None:
        """The members meet elsewhere (an epoch's end, validation, the fit's end) before all answered
        the call: those waiting at it go on (a release that says `cancel`), and the others are told
        so when they come (`_arrive`). The joiners wait for the other meeting's release."""
        name, self.calling = self.calling, None
        waiting = sorted(r for r, sync in self.parked.items() if sync == name)
        for r in waiting:
            del self.parked[r]
            self._push(out, r, {"t": "release", "sync": name, "cancel": True, "members": list(self.live)})
        if waiting:
            self._changed()

    def started(self, rank: int) -> None:
        """`rank`, admitted, trains now (its first group request, or its first claim on the work queue):
        others may draw it into their groups from here (see `starting`)."""
        if rank in self.starting:
            self.starting.discard(rank)
            self._changed()

    def is_joiner(self, rank: int) -> bool:
        """`rank` asked to rejoin and is not admitted yet (it waits, or it is on its way to its admission)."""
        return rank in self.joining or rank in self._admitting

    def withdraw(self, rank: int, out: dict[int, list[Item]]) -> None:
        """A joiner not admitted yet is gone (its process ended, or it gave up): forgotten, and an
        admission meeting that waited for it goes on without it."""
        if rank in self.joining:
            self.joining.remove(rank)
        self.after_epoch.discard(rank)
        if rank in self._admitting:
            self._admitting.discard(rank)
            self._admit_parked.discard(rank)
            if self.parked:
                self._maybe_release(next(iter(self.parked.values())), out)

    def take_joined(self) -> list[int]:
        """The ranks admitted since the last call (the control plane counts them as members again)."""
        joined, self._joined = self._joined, []
        return joined

    # -- messages ---------------------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> dict[int, list[Item]]:
        """Process one message; returns the items to append, per rank, in order."""
        out: dict[int, list[Item]] = {}
        op = message["op"]
        rank = int(message["rank"])
        if not 0 <= rank < self.world_size:
            raise ValueError(f"message from rank {rank} outside world of size {self.world_size}: {message}")
        if rank in self._admitting and op == "arrive":  # a joiner at its admission
            self._admit_parked.add(rank)
            if self.parked:
                self._maybe_release(next(iter(self.parked.values())), out)
            return out
        if rank in self.left:  # out of the job (failed, or fenced while it still ran): assign it nothing
            if op == "ready":
                self._answer(rank, int(message["req"]), None, out)
            elif op == "leave":  # it announced its failure first: what was assigned to it is in its inbox
                self._push(out, rank, {"t": "left"})
            return out
        if op == "ready":
            self._ready_msg(rank, int(message["req"]), int(message.get("version", 0)), out)
        elif op == "arrive":
            if message.get("speed") is not None:
                self._speeds[rank] = float(message["speed"])
            if "untrained" in message:
                self._untrained[rank] = [int(c) for c in message["untrained"]]
            if message.get("incomplete"):
                self._incomplete.add(rank)
            if "round" in message:
                self._rounds[rank] = int(message["round"])
                self._settling = bool(message.get("settle"))
                if self._idle:
                    self._push(out, rank, {"t": "idle"})
            if message.get("stop"):
                self._request_stop(out)
            self._arrive(rank, str(message["sync"]), out)
        elif op == "stop":
            reason = str(message.get("reason", "sigterm"))
            if reason in (SIGTERM, REQUEUE):
                self._stop(out, reason)
            else:
                self._request_stop(out)
        elif op == "leave":
            self._leave(rank, out)
        elif op == "idle":
            self._go_idle(out)
        else:
            raise ValueError(f"unknown coordinator message {message}")
        return out

    # -- internals ---------------------------------------------------------------------------
    @staticmethod
    def _push(out: dict[int, list[Item]], rank: int, item: Item) -> None:
        out.setdefault(rank, []).append(item)

    def _available(self) -> list[int]:
        return [r for r in self.live if r not in self.parked and r not in self.starting]

    def lagging(self) -> set[int]:
        """Workers far behind the others since the last synchronization point.

        A worker is lagging when it has made fewer than half the median number of requests
        (less a slack of 2, so that the first steps of an epoch decide nothing). Putting a lagging
        worker into a fast worker's group would make the fast worker wait for the slow worker's
        whole step; lagging workers still mix through the groups they ask for themselves, whose
        fast members answer within one of their own short steps. The set is re-evaluated every
        `ceil(N / 8)` reports (an eighth of a step of every worker), which keeps its cost per
        report independent of N.
        """
        available = self._available()
        if not self.avoid_stragglers or len(available) < 3:
            return set()
        counts = sorted(self.rounds[r] for r in available)
        median = counts[len(counts) // 2]
        return {r for r in available if self.rounds[r] + 2 < median / 2}

    def is_busy(self, rank: int) -> bool:
        """Whether `rank` is in a group issued since its last request (`avoid_busy` only).

        A worker asks for a group only when its previous exchange is done (one in flight at a time,
        `core.exchange.overlap.BackgroundAverager`), and it runs every group issued to it in order. So a
        group drawing a busy worker waits, every member of it, until that worker has finished the
        exchange it is in, however slow its link. With `avoid_busy` groups draw only idle workers
        (a requester still gets a group if one other is idle, a smaller one if fewer than
        `group_size - 1` are), and a requester that was drawn into another's group meanwhile gets
        no new group of its own: it runs that one. So every worker is in at most one group at a
        time, nobody queues behind a slow link's exchange, and a synchronization point drains at
        most one exchange per worker. A lagging requester (`lagging`: it asks far less often than
        the others, because its steps or its exchanges are slow) gets a pair rather than a full
        group, holding up one other worker. Cost: one pass over the candidates per request while
        some are busy.
        """
        return rank in self.busy

    def _note_report(self) -> None:
        self._reports_since_lagging += 1
        if self._reports_since_lagging >= self._lagging_every:
            self._reports_since_lagging = 0
            lagging = self.lagging()
            if lagging != self._lagging:
                self._lagging = lagging
                self._pool = None

    def _changed(self) -> None:
        """The parked or left workers changed: the pools are rebuilt when next needed."""
        self._pool = None
        self._available_cache = None

    def _available_pool(self) -> Candidates:
        if self._available_cache is None:
            self._available_cache = Candidates(self._available())
        return self._available_cache

    def _candidates(self) -> Candidates:
        """Workers that may be drawn into another worker's group: available and not lagging."""
        if self._pool is None:
            available = self._available()
            chosen = [r for r in available if r not in self._lagging]
            self._pool = Candidates(chosen if len(chosen) >= 2 else available)
        return self._pool

    def _issue(self, members: Group, out: dict[int, list[Item]], versions: list[int] | None = None) -> int:
        gid = self.next_gid
        self.next_gid += 1
        item: Item = {"t": "group", "gid": gid, "members": list(members)}
        if versions is not None:
            item["version"] = max(versions)
            weights = self.policy.weights(versions)
            if weights is not None:
                item["weights"] = weights
        for r in members:
            self._push(out, r, item)
        if self.record_history:
            self.issued.append((gid, members))
        return gid

    def _answer(self, rank: int, req: int, gid: int | None, out: dict[int, list[Item]]) -> None:
        self._push(out, rank, {"t": "answer", "req": req, "gid": gid})

    def _ready_msg(self, rank: int, req: int, version: int, out: dict[int, list[Item]]) -> None:
        self.started(rank)
        round_index = self.rounds[rank]
        self.rounds[rank] += 1
        self._note_report()
        self.newest_version = max(self.newest_version, version)
        if self.stopping or rank in self.parked:
            self._answer(rank, req, None, out)
            return
        self.policy.on_ready()
        if self.policy.pools_ready:
            self._ready.append((rank, req, version))
            self._form_ready_groups(out)
            return
        if self.policy.keeps_stragglers:
            pool = self._available_pool()
        else:
            pool = self._candidates()
            if rank not in pool:  # a lagging requester still asks for groups of its own
                pool = Candidates([*pool.ranks, rank])
        if self.avoid_busy:
            if self._waiting.pop(rank, 0):  # groups wait for it: it runs them now, and no new one of its own
                self._answer(rank, req, None, out)
                return
            self.busy.discard(rank)  # everything issued to it is done
            if self.busy:
                pool = Candidates([r for r in pool.ranks if r not in self.busy])
        members = self.policy.select(rank, round_index, pool)
        if members is None or len(members) < 2:
            self._answer(rank, req, None, out)
            return
        if self.avoid_busy and rank in self._lagging and len(members) > 2:
            # a lagging worker (a slow step, or a slow link that keeps its exchanges long) averages in
            # pairs: each of its exchanges holds up one other worker, and moves half the bytes
            members = tuple(sorted((rank, self.policy.rng.choice([m for m in members if m != rank]))))
        if self.policy.issues_per_round:
            gid = self._round_group(round_index, members, out)
        else:
            gid = self._issue(members, out)
        if self.avoid_busy:
            self.busy.update(members)
            for member in members:
                if member != rank:  # it starts this group at its next request
                    self._waiting[member] = self._waiting.get(member, 0) + 1
        self._answer(rank, req, gid, out)

    def _round_group(self, round_index: int, members: Group, out: dict[int, list[Item]]) -> int:
        """The group `members` share in round `round_index`, issued by the first of them to ask.

        An entry is forgotten once every member asked for it (or at the next synchronization
        point, or when the table outgrows `4 N` entries: the oldest goes, and a member that still
        asks for it gets the group issued anew), so the table stays small between synchronization
        points however long they are apart.
        """
        key = (round_index, members)
        entry = self._per_round.get(key)
        if entry is None:
            gid = self._issue(members, out)
            self._per_round[key] = [gid, len(members) - 1]
            if len(self._per_round) > 4 * self.world_size:  # members that never asked (left, re-grouped)
                del self._per_round[next(iter(self._per_round))]
            return gid
        entry[1] -= 1
        if entry[1] <= 0:
            del self._per_round[key]
        return entry[0]

    def _form_ready_groups(self, out: dict[int, list[Item]]) -> None:
        """Let the policy pick groups from the FIFO of waiting workers (`GroupingPolicy.pools_ready`),
        whenever it or the workers around it change; nothing while nobody waits in it."""
        if not self._ready:
            return
        waiting = {r: (req, version) for r, req, version in self._ready}
        busy = [r for r in self._available() if r not in waiting]
        for group in self.policy.form([r for r, _, _ in self._ready], busy):
            members = tuple(sorted(group))
            versions = [waiting[r][1] for r in members]
            gid = self._issue(members, out, versions) if len(members) >= 2 else None
            for r in group:
                self._answer(r, waiting[r][0], gid, out)
            self._ready = deque(entry for entry in self._ready if entry[0] not in group)

    def _arrive(self, rank: int, sync: str, out: dict[int, list[Item]]) -> None:
        if sync.startswith(ADMISSION_CALL) and "/" not in sync:
            if sync != self.calling or any(name != sync for name in self.parked.values()):
                if sync == self.calling:  # the others meet elsewhere: the call is off
                    self._cancel_call(out)
                self._push(out, rank, {"t": "release", "sync": sync, "cancel": True, "members": list(self.live)})
                return
        elif self.calling is not None and self.calling in self.parked.values() and "/" not in sync:
            self._cancel_call(out)  # this rank meets elsewhere first: the call is off
        self.parked[rank] = sync
        self._changed()
        self._form_ready_groups(out)  # the pool without it may form groups now
        self._maybe_release(sync, out)

    def _maybe_release(self, sync: str, out: dict[int, list[Item]]) -> None:
        """Release the meeting if every live worker is parked (an admission: and every joiner)."""
        if not self.parked or len(self.parked) < len(self.live):
            return
        names = set(self.parked.values())
        admission = len(names) == 1 and sync.endswith(ADMIT)
        if admission and not self._admitting <= self._admit_parked:
            return  # the joiners are on their way
        settled = (n == STOP_SYNC or n.startswith(f"{STOP_SYNC}/") or n.endswith(COMMIT) for n in names)
        if self.stopping and not all(settled):
            return  # every rank sees the stop item and arrives at the stop point (or its settling); wait
        released = len(names) == 1
        if released:
            release: Item = {
                "t": "release",
                "sync": sync,
                "version": self.newest_version,
                "stop": self.stop_requested or self.stopping,
                "requeue": self.stop_reason == REQUEUE,
                "speeds": list(self._speeds),
                "pending": sorted(c for chunks in self._untrained.values() for c in chunks),
                "members": list(self.live),
                "leader": self.leader,
                # every live rank completed the collective this meeting decides on (`GroupWorker.global_average`)
                "complete": not self._incomplete,
            }
            if admission:
                self._admit(release)
            elif self.joining:
                self._offer_admission(sync, release, out)
            elif self._admitting and (sync == "fit_end" or release["stop"]):  # the members never reach the admission
                self._turn_away(out)
            if self.joining:  # they wait: the members meet at their next epoch's end even if they met just before
                release["joining"] = sorted(self.joining)
            if self._rounds:
                rounds = set(self._rounds.values())
                # (an admission: the members' round after their phase's end, which joiners take up)
                if admission or self._settling or (len(rounds) == 1 and not self._idle):
                    release["final"] = max(rounds)
                else:  # some rank may still be issuing rounds: every rank reports where it stopped
                    release["settle"] = True
            for r in self.live:
                self._push(out, r, release)
            if sync == "fit_end" or release["stop"]:
                self.ended = True
            if "/" not in sync:  # the members met (at the call or elsewhere): a call still out is off
                self.calling = None
        else:
            by_name: dict[str, list[int]] = {}
            for r, name in sorted(self.parked.items()):
                by_name.setdefault(name, []).append(r)
            detail = "; ".join(f"ranks {ranks} at {name!r}" for name, ranks in by_name.items())
            message = (
                f"ranks reached different synchronization points ({detail}); every rank must pass the same "
                "sequence of synchronization points (epoch ends, validation, end of fit)"
            )
            for r in self.live:
                self._push(out, r, {"t": "error", "message": message})
        self.parked.clear()
        self._untrained = {}
        self._rounds = {}
        self._incomplete = set()
        self._settling = False
        self._idle = False
        self.rounds = [0] * self.world_size
        self._per_round.clear()
        # a global average follows a release (not an admission call's: the members only admit there)
        self.policy.restart(mixed=released and self.sync_averages and not sync.startswith(ADMISSION_CALL))
        self._lagging = set()
        self.busy.clear()  # every worker ran everything issued to it before the release
        self._waiting.clear()
        self._changed()
        if released:
            self._call_admission(out)  # joiners that still wait: at the members' next batch boundary

    def _offer_admission(self, sync: str, release: Item, out: dict[int, list[Item]]) -> None:
        """At an admission call or an epoch's end that does not stop the fit the joiners are told to meet
        the members at `<sync>/admit`; at the end of the fit (or a stop) they are told that it ends
        without them."""
        stopping = release["stop"] or sync == STOP_SYNC or sync.startswith(f"{STOP_SYNC}/")
        admitting = sync.startswith(ADMITTING_AT) or sync.startswith(ADMISSION_CALL)
        if admitting and "/" not in sync and not stopping:
            admit = self.joining if sync.startswith(ADMITTING_AT) else self._callable()
            if not admit:
                return  # only joiners for an epoch's end wait: they go on waiting
            release["admit"] = sorted(admit)
            self._admitting = set(admit)
            for r in admit:
                self._push(out, r, {"t": "admit", "sync": f"{sync}{ADMIT}"})
            self.joining = [r for r in self.joining if r not in self._admitting]
            self.after_epoch -= self._admitting
        elif sync == "fit_end" or stopping:
            self._turn_away(out)

    def _turn_away(self, out: dict[int, list[Item]]) -> None:
        """The fit ends (or stops) before the joiners could be admitted: each is told so."""
        for r in [*self.joining, *sorted(self._admitting)]:
            message = f"rank {r} cannot rejoin: the fit ended (or is stopping) before it was admitted"
            self._push(out, r, {"t": "error", "message": message, "ended": True})  # its fit ends quietly
        self.joining, self._admitting, self._admit_parked = [], set(), set()
        self.after_epoch.clear()

    def _admit(self, release: Item) -> None:
        """The admission meeting's release: the joiners that arrived are live workers from here."""
        joined = sorted(self._admitting)
        self._admitting, self._admit_parked = set(), set()
        self.left.difference_update(joined)
        self.live = sorted(set(self.live) | set(joined))
        self.starting.update(joined)
        self._changed()
        release["joined"] = joined
        release["members"] = list(self.live)
        self._joined.extend(joined)

    def _leave(self, rank: int, out: dict[int, list[Item]]) -> None:
        """A worker shuts down after an error: it departs, and gets its `left` item after every group
        already issued to it, which it still executes (so no peer waits in one of those groups)."""
        for entry in list(self._ready):
            if entry[0] == rank:
                self._answer(rank, entry[1], None, out)
        self.depart(rank, out)
        self._push(out, rank, {"t": "left"})

    def depart(self, rank: int, out: dict[int, list[Item]]) -> None:
        """`rank` is out of the job (see `Membership` in the module docstring); nothing is sent to it."""
        self.withdraw(rank, out)  # a joiner gone before its admission: forgotten
        if rank in self.left:
            return
        self.left.add(rank)
        self.live.remove(rank)
        self.starting.discard(rank)
        if rank == self.leader:
            self.leader = self.live[0] if self.live else None
        self.busy.discard(rank)
        self._waiting.pop(rank, None)
        self._ready = deque(entry for entry in self._ready if entry[0] != rank)
        self.parked.pop(rank, None)
        self._untrained.pop(rank, None)
        self._rounds.pop(rank, None)
        self._incomplete.discard(rank)  # the survivors' completeness decides
        self._lagging.discard(rank)
        self._changed()
        if len(self.live) < self.min_workers:
            self._request_stop(out)
        self._form_ready_groups(out)  # a worker held for it is grouped with the others now
        if self.parked:
            self._maybe_release(next(iter(self.parked.values())), out)

    def _go_idle(self, out: dict[int, list[Item]]) -> None:
        """A waiting rank asked for idle rounds: every rank waiting at this meeting runs them (once)."""
        if self._idle or not self.parked:
            return
        self._idle = True
        for r in self.parked:
            if r not in self.left:
                self._push(out, r, {"t": "idle"})

    def _request_stop(self, out: dict[int, list[Item]]) -> None:
        """A rank decided to stop: every rank ends its epoch at its next batch; the release says stop."""
        if self.stop_requested:
            return
        self.stop_requested = True
        for r in self.live:
            self._push(out, r, {"t": "stop", "reason": "request"})

    def _stop(self, out: dict[int, list[Item]], reason: str = SIGTERM) -> None:
        if self.stopping and (self.stop_reason == REQUEUE or reason != REQUEUE):
            return  # stopping already (a requeue after a SIGTERM stop is announced too: it asks for more)
        first = not self.stopping
        self.stopping, self.stop_reason = True, reason
        for r in self.live:
            self._push(out, r, {"t": "stop", "reason": reason})
        if not first:
            return
        # waiting first_ready workers get their answer now, so they can reach the stop drain
        while self._ready:
            r, req, _ = self._ready.popleft()
            self._answer(r, req, None, out)
