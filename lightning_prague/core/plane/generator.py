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
  reported them with `arrive` (`positions`: a sharded stream's shards, with the positions they were
  trained to); `requeued`: what lost ranks gave back that nobody claimed again yet (for checkpoints,
  with `pending`); `final`
  (gossip on a fixed schedule only): the round every rank runs its gossip to before the meeting
  ends (see `Gossip phases` below); `members`: the workers still in the job (see `Membership`);
  `complete`: no live worker arrived reporting `incomplete` (the global average's commit meeting,
  `<sync>/commit`: see `Membership`); at a synchronization point (`is_synchronization_point`),
  `changed`: a member departed or was admitted since the last one (every member shards Lightning's
  data anew); once there were admissions, `epoch`: the membership epoch; an epoch's end that admitted
  joiners names them in `joined` (see `Rejoining`).
- `{"t": "members", "epoch", "members", "joined", "donor", "donors", "leader"[, "at"]}` and, to the
  joiner, `{"t": "admit", ..., "base"[, "round"]}`: an admission (see `Rejoining`); `donors`: each
  joiner's donor, `[joiner, donor]` pairs.
- `{"t": "round", "key", "members", "epoch"}` (or `"round"`, to a joiner that starts): who takes part
  in a gossip round (`round_members`).
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

Rejoining: a new process for a rank that left (`request_join`) is admitted at once, with no meeting:
the generator opens a new *membership epoch* (`epoch`), makes it a live worker, and puts a
`{"t": "members", "epoch", "members", "joined", "donor", "leader"}` item into every other live
worker's inbox, behind every group already issued to it and before any group issued later; the joiner
gets `{"t": "admit", ...}` with the same fields and the meeting's members (`base`). Executing inbox
items in order, every member switches to the epoch's process group between the same two groups of
its sequence, so every group sum runs on one process group on all its members
(`lightning_prague.core.membership`). The joiner is drawn into nobody's group until it trains (its
first request or claim: `starting`); the donor, the lowest member that trains, sends it the fit's
state in the background. With replicas sharded over their ranks (`shard`) each joiner has a donor of
its own: rank `j` gets its shard from the rank of the lowest replica whose ranks all train that holds
the same shard (`donors`), so a replica comes back shard by shard and no rank gathers the model.
Only while the members meet (some are parked) is an admission held back, to the meeting's release.
A joiner with nothing of the members' epoch to train (`after_epoch`: a lock-step shard,
`CoordinatorSession.nothing_left_in_epoch`) is admitted at the members' next epoch's end
(`epoch_end@<n>`, `ADMITTING_AT`) instead, inside that release: its `members` then name it, so
the next epoch's shards include it. Every release while such joiners wait names them in `joining`:
the members then meet at their next epoch's end even where they would skip that meeting. A joiner
that departs, or closes its session, before its admission is withdrawn (`withdraw`); after it, it is
a member that departs like any other. A fit that ends (`fit_end`, a stop) before admitting it sends
it an `error` item that says so. Every release names the membership epoch it closes (`epoch`).

Gossip rounds on a fixed schedule (`lightning_prague.core.exchange.gossip`) are not issued here, so
no inbox order can place a joiner in them: the members of each round's group are decided here
instead (`round_members`), as a pure function of the round, so that every member of a group, asking
when it likes, gets the same answer. Each rank has intervals of rounds it takes part in: the
launched ones from round 0; one that departs up to the largest round decided so far (a round
decided with it stays so; it fails at once on its members, and its verdict drops it); a joiner from
the round after the largest decided so far, which it asks for when it starts training (`start`).
A decision names the newest membership epoch among the ranks it includes, whose process group
holds them all.

The cost of a message does not grow with the number of workers: the set of workers that may be
drawn into a group is kept up to date when it changes (parking, leaving, lagging) rather than
rebuilt per request, and who is lagging is re-evaluated every `ceil(N / 8)` reports.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from lightning_prague.core.grouping.policies import Candidates, Group, GroupingPolicy
from lightning_prague.core.protocol import ADMITTING_AT, COMMIT, REQUEUE, SIGTERM, STOP_SYNC, is_synchronization_point

Item = dict[str, Any]

log = logging.getLogger(__name__)


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
        replica_size: int = 1,
        shard: bool = False,
    ) -> None:
        self.world_size = world_size
        #: ranks `rK .. rK+K-1` train one model (a replica group): a replica's joiners are admitted together
        self.replica_size = replica_size
        #: each rank of a replica holds its own shard: joiner `j` gets its state from rank `j % K` of one
        #: live replica (`donors`), not all of them from one donor
        self.shard = shard and replica_size > 1
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
        #: the work lost ranks gave back that no rank claimed again yet, as `[item, value]` pairs (the
        #: session's queues: `CoordinatorSession.requeued_work`); a release names it for checkpoints
        self.requeued_work: Callable[[], list[list[Any]]] = list
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
        #: per rank, the shards of a stream it holds and the positions they were trained to
        self._positions: dict[int, list[list[int]]] = {}
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
        #: joiners admitted at an epoch's end only, never inside the epoch (`request_join`)
        self.after_epoch: set[int] = set()
        #: ranks admitted since the control plane last took them (`take_joined`)
        self._joined: list[int] = []
        #: the fit's end (`fit_end`) or a stop was released: nobody is admitted from here
        self.ended = False
        #: ranks admitted that have not asked for a group yet (still restoring the fit's state): nobody
        #: draws them into a group until they do, so that no member waits on one that is not training
        self.starting: set[int] = set()
        #: the membership epoch: admissions so far (each one's process group: `lightning_prague.core.membership`)
        self.epoch = 0
        #: rank -> the intervals of gossip rounds it takes part in, `[first, last or None, its epoch]`
        #: (see `round_members`)
        self._rounds_of: dict[int, list[list[Any]]] = {r: [[0, None, 0]] for r in self.live}
        #: rank -> the largest gossip round decided with it in its group; the largest of all
        self._decided: dict[int, int] = {}
        self._frontier = -1
        #: the members at the last meeting's release that have not trained since (`resume`): until they
        #: all have, sub-meetings may follow it (a global average's commit), and nobody is admitted
        self._unresumed: set[int] = set()
        #: ranks admitted in the last meeting's release (an epoch's end): its sub-meetings go on without them
        self._in_release: set[int] = set()
        #: a member departed since the last meeting's release (the members rebuild their group at the next)
        self._departed_since_release = False
        #: departures and admissions so far, and as of the last synchronization point's release (`changed`)
        self._changes = 0
        self._changes_released = 0

    def request_join(self, rank: int, out: dict[int, list[Item]] | None = None, after_epoch: bool = False) -> None:
        """`rank`, which left the job, has a new process that asks to rejoin (see the module docstring):
        it is admitted at once (`out`), or at the release of the meeting the members are at.
        `after_epoch`: it is admitted at the members' next epoch's end instead, with nothing of the
        current epoch left to it (a lock-step shard: inside this epoch it would have no batch to train,
        and could only wait for the others)."""
        if rank not in self.left:
            raise ValueError(f"rank {rank} cannot rejoin: it is a live member of the fit")
        if rank not in self.joining:
            self.joining.append(rank)
            if after_epoch:
                self.after_epoch.add(rank)
        if out is not None:
            self._admit_waiting(out)

    def _admit_waiting(self, out: dict[int, list[Item]]) -> None:
        """Admit the joiners that may be admitted inside an epoch, unless the members meet now (their
        release admits them), the fit is stopping or ended, or no member trains to send them its state."""
        if self.parked or self._unresumed or self.stopping or self.stop_requested or self.ended:
            return
        admit = self._whole([r for r in self.joining if r not in self.after_epoch])
        if admit:
            self._admit(admit, out)

    def _whole(self, joiners: list[int]) -> list[int]:
        """The `joiners` whose replica's ranks are all joining (a replica trains whole: its ranks come
        back together, in one admission, or not at all); every joiner without replica groups."""
        size = self.replica_size
        if size == 1:
            return joiners
        waiting = set(joiners)
        whole = [r for r in joiners if all(m in waiting for m in range(r - r % size, r - r % size + size))]
        if len(whole) < len(joiners):
            log.debug("joiners %s wait for the rest of their replicas", sorted(waiting - set(whole)))
        return whole

    def _donor(self) -> int | None:
        """The member that sends joiners the fit's state: the lowest one that trains; with sharded
        replicas the first rank of the lowest replica whose ranks all train (each sends its own shard)."""
        if not self.shard:
            return next((r for r in self.live if r not in self.starting), None)
        size, live = self.replica_size, set(self.live)
        for first in sorted({r - r % size for r in self.live}):
            if all(r in live and r not in self.starting for r in range(first, first + size)):
                return first
        return None

    def _donors(self, donor: int, joiners: list[int]) -> list[list[int]]:
        """`[joiner, its donor]` for each joiner: `donor` for every one of them, or with sharded
        replicas the rank of `donor`'s replica that holds the joiner's shard (the same index)."""
        if not self.shard:
            return [[j, donor] for j in sorted(joiners)]
        return [[j, donor + j % self.replica_size] for j in sorted(joiners)]

    def _admit(self, joiners: list[int], out: dict[int, list[Item]], release: Item | None = None) -> bool:
        """A new membership epoch with `joiners` in it (see `Rejoining` in the module docstring);
        `release`: inside that release (an epoch's end), which then names them. False if no member
        trains (nobody could send them the fit's state): they go on waiting."""
        donor = self._donor()
        if donor is None:
            return False
        base = list(self.live)
        self.epoch += 1
        for r in joiners:
            self.joining.remove(r)
            self.after_epoch.discard(r)
        self.left.difference_update(joiners)
        self._changes += 1
        self.live = sorted(set(self.live) | set(joiners))
        self.starting.update(joiners)
        self._joined.extend(joiners)
        self._changed()
        news = {
            "epoch": self.epoch,
            "members": list(self.live),
            "joined": sorted(joiners),
            "donor": donor,
            "donors": self._donors(donor, joiners),
            "leader": self.leader,
        }
        if release is not None:  # (the members follow it after that release, at the epoch's end)
            news["at"] = release["sync"]
        for r in base:
            self._push(out, r, {"t": "members", **news})
        admit: Item = {"t": "admit", **news, "base": base}
        if release is not None:
            if "final" in release:  # it takes up gossip where the members' next phase starts
                admit["round"] = release["final"]
                for r in joiners:
                    self._rounds_of.setdefault(r, []).append([release["final"], None, self.epoch])
            release["joined"] = sorted(joiners)
            release["members"] = list(self.live)
            release["epoch"] = self.epoch
        for r in joiners:
            self._push(out, r, dict(admit))
        return True

    def renew_epoch(self, out: dict[int, list[Item]]) -> bool:
        """A control plane that took the job back from its journal (`lightning_prague.core.plane.journal`):
        the store that the current membership epoch's group meets in died with the old plane, and pairs
        of it that had not connected yet (gloo connects them at their first exchange) never could. So a
        new epoch opens with the same members and no joiner: every member switches to its group, made
        in the new store, at the same point of its sequence (a `members` item), and gossip rounds after
        every round decided so far take it. False (nothing to renew) while no admission opened an epoch."""
        if self.epoch == 0 or not self.live:
            return False
        self.epoch += 1
        first = self._frontier + 1
        for rank in self.live:  # rounds already decided keep their epoch: every member gets the same answers
            intervals = self._rounds_of.get(rank)
            if not intervals or intervals[-1][1] is not None:
                continue
            if intervals[-1][0] >= first:
                intervals.pop()
            else:
                intervals[-1][1] = self._frontier
            intervals.append([first, None, self.epoch])
        news = {"epoch": self.epoch, "members": list(self.live), "joined": [], "donor": -1, "leader": self.leader}
        for rank in self.live:
            self._push(out, rank, {"t": "members", **news})
        return True

    def started(self, rank: int) -> None:
        """`rank`, admitted, trains now (its first group request, or its first claim on the work queue):
        others may draw it into their groups from here (see `starting`)."""
        if rank in self.starting:
            self.starting.discard(rank)
            self._changed()

    def is_joiner(self, rank: int) -> bool:
        """`rank` asked to rejoin and is not admitted yet."""
        return rank in self.joining

    def withdraw(self, rank: int, out: dict[int, list[Item]]) -> None:
        """A joiner not admitted yet is gone (its process ended, or it gave up): forgotten."""
        if rank in self.joining:
            self.joining.remove(rank)
        self.after_epoch.discard(rank)

    def take_joined(self) -> list[int]:
        """The ranks admitted since the last call (the control plane counts them as members again)."""
        joined, self._joined = self._joined, []
        return joined

    def round_members(
        self, rank: int, key: str, round_index: int, slots: Sequence[int], start: bool, out: dict[int, list[Item]]
    ) -> None:
        """Which of `slots` (a schedule's group) take part in gossip round `round_index`, and the
        membership epoch whose process group holds them, as a `{"t": "round", "key", "members",
        "epoch"}` item to `rank`; `start`: `rank` was admitted inside a phase and starts training: it
        takes part from the round after every round decided so far (`{"t": "round", "key", "round"}`).
        See the module docstring."""
        if start:
            first = self._frontier + 1
            intervals = self._rounds_of.setdefault(rank, [])
            if not intervals or intervals[-1][1] is not None:
                intervals.append([first, None, self.epoch])
            else:  # (asked again: the same answer)
                first = intervals[-1][0]
            self.started(rank)
            self._push(out, rank, {"t": "round", "key": key, "round": first})
            return
        self._frontier = max(self._frontier, round_index)
        included: list[int] = []
        epoch = 0
        for slot in sorted(set(slots)):
            if not 0 <= slot < self.world_size:
                raise ValueError(f"rank {rank} asked about round {round_index} with rank {slot}, outside the fit")
            self._decided[slot] = max(self._decided.get(slot, -1), round_index)
            for first, last, admitted in self._rounds_of.get(slot, ()):
                if first <= round_index and (last is None or round_index <= last):
                    included.append(slot)
                    epoch = max(epoch, admitted)
                    break
        self._push(out, rank, {"t": "round", "key": key, "members": included, "epoch": epoch})

    def _close_rounds(self, rank: int) -> None:
        """`rank` departed: it takes part in no gossip round after those decided with it (see `round_members`)."""
        intervals = self._rounds_of.get(rank)
        if not intervals or intervals[-1][1] is not None:
            return
        last = self._decided.get(rank, self._frontier)
        if last < intervals[-1][0]:
            intervals.pop()
        else:
            intervals[-1][1] = last
        del intervals[:-8]  # (the older ones lie far behind every live rank's round)

    # -- messages ---------------------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> dict[int, list[Item]]:
        """Process one message; returns the items to append, per rank, in order."""
        out: dict[int, list[Item]] = {}
        op = message["op"]
        rank = int(message["rank"])
        if not 0 <= rank < self.world_size:
            raise ValueError(f"message from rank {rank} outside world of size {self.world_size}: {message}")
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
            if "positions" in message:
                self._positions[rank] = [[int(shard), int(at)] for shard, at in message["positions"]]
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
        elif op == "resume":  # it trains again after a meeting and everything that followed it
            self._unresumed.discard(rank)
            self._admit_waiting(out)
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
        # `e`: the membership epoch it is issued in; a member readmitted since is another process than
        # the one drawn (`GroupVerdicts.readmitted`)
        item: Item = {"t": "group", "gid": gid, "members": list(members), "e": self.epoch}
        if versions is not None:
            item["version"] = max(versions)
            weights = self.policy.weights(versions)
            if weights is not None:
                item["weights"] = weights
        for r in members:
            self._push(out, r, item)
        log.debug("groups: #%d over ranks %s (membership epoch %d)", gid, list(members), self.epoch)
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
        self.policy.on_ready(rank)
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
        self.parked[rank] = sync
        self._changed()
        self._form_ready_groups(out)  # the pool without it may form groups now
        self._maybe_release(sync, out)

    def _maybe_release(self, sync: str, out: dict[int, list[Item]]) -> None:
        """Release the meeting if every live worker is parked (a sub-meeting, `<sync>/...`: every one
        but those admitted in its meeting's release)."""
        top = is_synchronization_point(sync)
        required = set(self.live) if top else set(self.live) - self._in_release
        if not self.parked or not required <= set(self.parked):
            return
        names = set(self.parked.values())
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
            positions = sorted(pair for pairs in self._positions.values() for pair in pairs)
            if positions:  # a sharded stream's shards in progress, with their positions (for checkpoints)
                release["positions"] = positions
            requeued = self.requeued_work()
            if requeued:  # given back by lost ranks, not claimed again yet: a checkpoint here holds them too
                release["requeued"] = requeued
            if self.epoch:  # the membership epoch it closes (admissions so far), once there was one
                release["epoch"] = self.epoch
            present = sorted(self.parked)  # (joiners admitted in this release are not at the meeting)
            if self._rounds:
                rounds = set(self._rounds.values())
                if self._settling or (len(rounds) == 1 and not self._idle):
                    release["final"] = max(rounds)
                else:  # some rank may still be issuing rounds: every rank reports where it stopped
                    release["settle"] = True
            stopping = release["stop"] or sync == STOP_SYNC or sync.startswith(f"{STOP_SYNC}/")
            if top:
                self._in_release = set()
            if sync == "fit_end" or stopping:
                self._turn_away(out)
            elif sync.startswith(ADMITTING_AT) and top and self.joining and not self._departed_since_release:
                # an epoch's end: every joiner, in the release (unless the members rebuild their group here)
                joiners = self._whole(list(self.joining))
                if joiners and self._admit(joiners, out, release):
                    self._in_release = set(joiners)
            if top:
                self._unresumed = set(present)
                self._departed_since_release = False
                # the members changed since the last synchronization point: every one of them, a joiner
                # at its first meeting too, shards Lightning's data among them anew from here
                release["changed"] = self._changes != self._changes_released
                self._changes_released = self._changes
            if self.joining:  # they wait: the members meet at their next epoch's end even if they met just before
                release["joining"] = sorted(self.joining)
            for r in present:
                self._push(out, r, release)
            if sync == "fit_end" or release["stop"]:
                self.ended = True
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
        self._positions = {}
        self._rounds = {}
        self._incomplete = set()
        self._settling = False
        self._idle = False
        self.rounds = [0] * self.world_size
        self._per_round.clear()
        self.policy.restart(mixed=released and self.sync_averages)  # a global average follows a release
        self._lagging = set()
        self.busy.clear()  # every worker ran everything issued to it before the release
        self._waiting.clear()
        self._changed()
        if released:
            self._admit_waiting(out)  # joiners held back while the members met

    def _turn_away(self, out: dict[int, list[Item]]) -> None:
        """The fit ends (or stops) before the joiners could be admitted: each is told so."""
        for r in self.joining:
            message = f"rank {r} cannot rejoin: the fit ended (or is stopping) before it was admitted"
            self._push(out, r, {"t": "error", "message": message, "ended": True})  # its fit ends quietly
        self.joining = []
        self.after_epoch.clear()

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
        self._close_rounds(rank)
        self._changes += 1
        self._unresumed.discard(rank)
        self._in_release.discard(rank)
        self._departed_since_release = True
        if rank == self.leader:
            self.leader = self.live[0] if self.live else None
        self.busy.discard(rank)
        self._waiting.pop(rank, None)
        self._ready = deque(entry for entry in self._ready if entry[0] != rank)
        self.parked.pop(rank, None)
        self._untrained.pop(rank, None)
        self._positions.pop(rank, None)
        self._rounds.pop(rank, None)
        self._incomplete.discard(rank)  # the survivors' completeness decides
        self._lagging.discard(rank)
        self._changed()
        if len(self.live) < self.min_workers:
            self._request_stop(out)
        self._form_ready_groups(out)  # a worker held for it is grouped with the others now
        if self.parked:
            self._maybe_release(next(iter(self.parked.values())), out)
        self._admit_waiting(out)

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
