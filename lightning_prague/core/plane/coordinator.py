"""The control plane: every training session's coordinator, its counters, and who is in the job.

It runs in the supervisor process (`lightning_prague.core.plane.supervisor`), never in a training
process, behind one `MessageServer`. Each training process keeps one connection to it
(`lightning_prague.core.client.control.ControlClient`); everything that coordinates ranks goes over that
connection, in one global order (the server handles one message at a time):

* **sessions** - one per fit (`join` with the session's configuration, `close` at its end). A
  session holds a `GroupGenerator` (groups, synchronization points, stops) and a small key-value
  table of counters (the work queue's claims and global-progress tickets), deleted
  with the session, so nothing outlives a fit.
* **membership** - the ranks that joined a session and have neither closed it nor gone. When a
  rank's connection closes while it is in a session (its process ended: exit, exception, kill -9),
  or it leaves after an error, every other member gets a `departed` item naming it at once.
  The generator then leaves it out of everything (see `Membership` in
  `lightning_prague.core.plane.generator`): the survivors go on.
* **failures** - a rank whose fit fails sends `leave` from its teardown (right after Lightning's
  `on_exception`): it departs for the others at once, then runs what was already assigned to it
  and gets its `left` item.
* **hangs** - every member's beacon beats once a second (`lightning_prague.core.plane.liveness`), and each
  beat is answered (`ALIVE`); a
  member the `HangDetector` finds hung departs like a crashed one and is **fenced**: SIGKILLed
  when its process runs on the supervisor's host, otherwise sent a `fenced` item on which it ends
  itself (a frozen process on another host cannot be ended from here: its peers' exchanges with it
  end at the process group's timeout). Fencing turns a hang into a crash, which the exchanges of
  the survivors already survive (a dead peer fails only its own pairs, see
  `lightning_prague.core.comm.groups`).
* **partitions** - a member cut off from the control plane (its node's link is down) is silent:
  it is declared hung by the same rule, and the survivors go on. The `fenced` item cannot reach
  it, so it fences itself: its beats go unanswered, and once nothing has come from the control
  plane for its own hang bound plus a margin it ends its process with an error that says so
  (`lightning_prague.core.client.control.Session.check_reachable`). Whichever side of a partition holds
  the control plane goes on; the other stops: no split brain.

* **replicas' followers** - in a replica group only the leader (its first rank) claims from the work
  queue; each other rank of the replica sends claims that `follow` `[leader, n]`: the leader's `n`-th
  answer on that queue, given to it as well (at once, or when the leader gets it), so every rank of
  the replica trains the same chunks in the same order. A follow takes nothing from the queue, and
  a follower is not waited for at the queue's end; one whose leader leaves the job gets an error at
  once (`FollowedClaims` in `lightning_prague.core.plane.queue_end`). Follows are journaled and
  replayed as claims are: a plane started again from its journal keeps the answers and the waiting
  follows, and answers a follow as the dead one would have.

Messages of a session carry `"s"` (its number) and `"rank"`; items sent back carry `"s"` too, and
replies to requests (`"req"`) are `{"t": "reply", "req", "value"}`.
"""

from __future__ import annotations

import logging
import socket
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from lightning_prague.core.errors import CONTROL_PLANE, ConfigurationError
from lightning_prague.core.grouping.policies import policy_from_spec
from lightning_prague.core.plane.fencing import fence, running_cpu_seconds
from lightning_prague.core.plane.generator import GroupGenerator, Item
from lightning_prague.core.plane.liveness import HangDetector
from lightning_prague.core.plane.queue_end import FollowedClaims, FollowReply, QueueEnds
from lightning_prague.core.plane.verdicts import GroupVerdicts
from lightning_prague.core.plane.work import WorkLedger
from lightning_prague.core.protocol import ALIVE, REQUEUED, SessionConfig

log = logging.getLogger(__name__)

Out = dict[int, list[Item]]


#: the messages served to current members of a session only: a departed rank's late claim, report or
#: verdict takes no work and changes nothing (a joiner sends none of them before its admission)
MEMBERS_ONLY = frozenset({"kv", "work", "summed", "trained", "round"})

#: why a rank from a session's `launched` on is not a member: no worker has joined in its place yet
FREE_PLACE = "a free place: no worker has joined the fit as this rank yet"


class CoordinatorSession:
    """One fit's coordinator: its generator, members and counters."""

    def __init__(self, number: int, config: SessionConfig) -> None:
        self.number = number
        self.world_size = config.world_size
        #: the configuration as its first member sent it: every later `join` must send the same
        self.config = config
        policy = policy_from_spec(config.policy)
        if policy.world_size != config.world_size:
            raise ConfigurationError(
                f"the grouping policy is for {policy.world_size} workers, the session for {config.world_size}"
            )
        self.generator = GroupGenerator(
            config.world_size,
            policy,
            config.avoid_stragglers,
            sync_averages=config.sync_averages,
            min_workers=config.min_workers,
            avoid_busy=config.avoid_busy,
            launched=config.launched,
            replica_size=config.replica_size,
            shard=config.shard,
        )
        self.hangs = HangDetector(config.hang, max(config.timeout, config.sync_timeout or 0.0))
        #: rank -> (pid, host name) of its process, as it said when it joined (the pid is only a claim:
        #: fencing checks that this pid holds the rank's connection, `lightning_prague.core.plane.fencing`)
        self.processes: dict[int, tuple[int, str]] = {}
        #: rank -> the addresses other nodes reach it at, as it said when it joined
        self.addresses: dict[int, list[str]] = {}
        self.generator.record_history = config.record_history
        self.generator.requeued_work = self.requeued_work
        self.members: set[int] = set()
        self.closed: set[int] = set()
        #: rank -> why it is not a member: it left, or it is a free place that a worker may join (`launched`)
        self.departed: dict[int, str] = dict.fromkeys(range(config.starting, config.world_size), FREE_PLACE)
        self.values: dict[str, Any] = {}
        #: per rank, the work queue's chunks it holds untrained (they go back to the queue if it is lost)
        self.work = WorkLedger()
        #: the claims that found their queue empty and wait while a member may still give chunks back
        self.ends = QueueEnds()
        #: every claim's answers, numbered per queue and claimer, for the followers of replicas' leaders
        self.followed = FollowedClaims()
        #: the all-or-nothing verdicts of the group collectives in flight
        self.verdicts = GroupVerdicts()
        self._waits: dict[str, list[tuple[int, int]]] = defaultdict(list)
        #: rank -> where it stands in its own shard of the epoch (lock-step shards: the `trained` message),
        #: kept after it departs: a new process for it goes on from there (its admission names it)
        self.positions: dict[int, dict[str, int]] = {}
        #: rank -> why: departed ranks whose processes live, left out at their short hang bound and
        #: fenced at their long one unless they come back first (`depart(left_out=True)`)
        self.left_out: dict[int, str] = {}
        #: every other rank is done with the fit while some were left out (they were told: `fit_ended`)
        self.ended = False

    def came_back(self, rank: int) -> None:
        """A left-out rank spoke up for itself (it closed its fit, or asks to rejoin): it is no longer
        watched for its fence."""
        if self.left_out.pop(rank, None) is not None:
            self.hangs.forget(rank)
            log.warning("session %d: rank %d, which was left out, woke: it comes back in place", self.number, rank)

    def nothing_left_in_epoch(self, rank: int) -> bool:
        """Under lock-step shards (the members report where they stand: `positions`), `rank` stood in
        an earlier epoch than a live member does, had trained its whole shard of the epoch, or never
        reported where: inside the members' epoch its shard holds nothing for a new process of it,
        which is then admitted at their epoch's end. Work-queue shards report no positions: never."""
        current = [position["epoch"] for member, position in self.positions.items() if member in self.members]
        if not current:
            return False
        own = self.positions.get(rank)
        if own is None or own["epoch"] < max(current):
            return True
        return "total" in own and own["batches"] >= own["total"]

    @property
    def over(self) -> bool:
        """Every rank closed the session or departed: it can be deleted."""
        return len(self.closed | set(self.departed)) >= self.world_size

    def depart(self, rank: int, reason: str, out: Out, leaving: bool = False, left_out: bool = False) -> None:
        """`rank` is gone: tell every other member, and assign it nothing more.

        `leaving`: it said so itself (`leave`) and the generator's `leave` follows, which still
        sends it what was assigned to it; otherwise its process is gone and nothing is sent to it.
        `left_out`: its process lives but blocked past its short hang bound: the others go on without
        it as without a lost rank, while the hang detector still watches it (it is fenced at its long
        bound), and it is told (`left_out`): if it wakes, it comes back in place as a joiner does.
        """
        if rank in self.departed or rank in self.closed:
            return
        self.members.discard(rank)
        if left_out:
            self.left_out[rank] = reason
            out.setdefault(rank, []).append({"t": "left_out", "reason": reason})
        else:
            self.hangs.forget(rank)
        self._requeue(rank)
        self.ends.depart(rank)
        self.follows_depart(rank, reason, out)
        self.departed[rank] = reason
        log.warning("session %d: rank %d departed (%s)", self.number, rank, reason)
        notice: Item = {"t": "departed", "rank": rank, "reason": reason, "members": sorted(self.members)}
        node, unreachable = self._lost_node(rank) if not left_out else ("", [])
        if unreachable:  # the survivors drop their connections there (`lightning_prague.core.client.partition`)
            notice.update(node=node, unreachable=unreachable)
            log.warning("session %d: every rank of %s is gone (addresses %s)", self.number, node, unreachable)
        for member in sorted(self.members):  # first: a meeting's error that the departure causes comes after
            out.setdefault(member, []).append(notice)
        if not leaving:
            self.generator.depart(rank, out)
        for member, item in self.verdicts.depart(rank, self.departed):
            out.setdefault(member, []).append(item)
        self.settle_queues(out)

    def _lost_node(self, rank: int) -> tuple[str, list[str]]:
        """`rank`'s node and its addresses if every rank of it has now departed and it is not the control
        plane's node (a partition or a node that went down: its connections never close by themselves)."""
        host = self.processes.get(rank, (0, ""))[1]
        if not host or host == socket.gethostname():
            return host, []
        ranks = [r for r, (_, h) in self.processes.items() if h == host]
        if any(r not in self.departed and r not in self.closed for r in ranks):
            return host, []
        return host, sorted({a for r in ranks for a in self.addresses.get(r, [])})

    # -- the key-value table --------------------------------------------------------------------
    def kv(self, rank: int, req: int, message: dict[str, Any], out: Out) -> None:
        do, key = message["do"], message.get("key", "")
        values = self.values
        if do == "add":
            values[key] = int(values.get(key, 0)) + int(message["amount"])
            self._reply(rank, req, values[key], out)
            self._wake(key, out)
        elif do == "set":
            values[key] = message["value"]
            self._reply(rank, req, None, out)
            self._wake(key, out)
        elif do == "cas":  # as TCPStore.compare_set: set if absent (expected "") or equal; return the value
            current = values.get(key)
            if (current is None and message["expected"] == "") or current == message["expected"]:
                values[key] = current = message["desired"]
                self._wake(key, out)
            self._reply(rank, req, current if current is not None else message["expected"], out)
        elif do == "claim":  # the work queue: the next chunk, and with it the batch's ticket (one message)
            self.generator.started(rank)  # a rank that was admitted trains now: it may be drawn into groups
            if "follow" in message:  # a replica's follower: its leader's answer, taking nothing
                self._follow(rank, req, key, message["follow"], out)
                return
            if self.followed.claims_again(key, rank):  # it followed a leader here before: a claimer now
                self.ends.claims_again(key, rank)
            if "members" in message:  # this rank's first claim of the epoch: the chunks set aside
                self._set_aside(key, message["members"], message["preset"])
            if self.ends.claims_on(key, rank):  # it went on to another epoch: no claim waits for it there
                self.settle_queues(out)
            reports = bool(message.get("reports"))  # it trains what it holds while the claim waits
            if message.get("standby"):  # it left the epoch's tail: a chunk only once nobody else will take one
                self.ends.park(key, rank, req, int(message.get("num", 0)), standby=message, reports=reports)
                self._settle(key, out)
                return
            chunk, ticket = self._next_chunk(key, message)
            if chunk < int(message.get("num", chunk + 1)):
                self.work.claimed(rank, key, chunk, ticket)
            elif message.get("park"):  # the queue is empty: wait while a member may still give chunks back
                self.ends.park(key, rank, req, chunk, reports=reports)
                self._settle(key, out)
                return
            self._answer_claim(rank, req, key, [chunk, ticket], out)
            if self.ends.standing_by(key) is not None:  # it may have taken the last chunk: they need not wait
                self._settle(key, out)
        elif do == "give_back":  # a slow rank's shard at a stream's tail, taken only where a claimer will read it
            self._reply(rank, req, self._give_back(rank, key, int(message["shard"]), int(message["position"])), out)
            self._settle(key, out)
        elif do == "get":  # waits for the key, as TCPStore.get does
            if key in values:
                self._reply(rank, req, values[key], out)
            else:
                self._waits[key].append((rank, req))
        elif do == "check":
            self._reply(rank, req, all(k in values for k in message["keys"]), out)
        elif do == "delete":
            self.work.forget(key)
            for answer in self.ends.forget(key):
                self._answer_claim(answer.rank, answer.req, key, [answer.chunk, None], out)
            self._send_follows(self.followed.forget(key), out)
            self._reply(rank, req, values.pop(key, None) is not None, out)
        elif do == "keys":
            self._reply(rank, req, len(values), out)
        else:
            raise ValueError(f"unknown key-value operation {do!r}")

    def _answer_claim(self, rank: int, req: int, key: str, value: list[int | None], out: Out) -> None:
        """Reply `value` (`[chunk, ticket]`) to `rank`'s claim `req` on `key`: every answer a claim gets goes
        through here, numbered for the followers of `rank`'s replica (`FollowedClaims.given`), and the
        follows that waited for it get it too."""
        self._reply(rank, req, value, out)
        self._send_follows(self.followed.given(key, rank, value), out)

    def _follow(self, rank: int, req: int, key: str, follow: list[int], out: Out) -> None:
        """`rank`, a follower in a replica, asks for answer `n` of its leader's claims on `key` (`follow`
        is `[leader, n]`): replied now if given, else when it is; it takes nothing from the queue (its
        claim's other fields are not used), and the queue's parked claims do not wait for it. A leader
        that left the job gets it an error reply at once; `ValueError` (an error reply too) for a leader
        that is itself or no member, or an answer that cannot be given (`FollowedClaims.follow`)."""
        leader, n = int(follow[0]), int(follow[1])
        if leader == rank:
            raise ValueError(f"rank {rank} cannot follow its own claims on {key!r}: a leader claims itself")
        gone = None
        if leader not in self.members:
            gone = "it closed the fit" if leader in self.closed else self.departed.get(leader)
            if gone is None or gone == FREE_PLACE:
                raise ValueError(
                    f"rank {rank} cannot follow rank {leader} on {key!r}: it is not a live member of the fit"
                )
        value = self.followed.follow(key, rank, req, leader, n) if gone is None else None
        try:
            self.ends.finish(key, rank)  # not a claimer: parked claims never wait for it
        except ValueError:
            self.followed.cancel(key, rank)
            raise
        if gone is not None:  # (an expected end, not a bad request: its fit fails at once, quietly here)
            error = (
                f"rank {rank}'s follow of answer {n} on {key!r} cannot be answered: rank {leader}, the leader of "
                f"its replica, left the job ({gone})"
            )
            log.debug("session %d: %s", self.number, error)
            self._send_follows([FollowReply(rank, req, error=error)], out)
        elif value is not None:
            self._reply(rank, req, value, out)
        self._settle(key, out)  # (claims parked there may have waited for it)

    def follows_depart(self, rank: int, why: str, out: Out) -> None:
        """`rank` left the fit (`why`): its waiting follows go, and the follows waiting on its answers get
        an error, so that its replica's followers fail at once."""
        self._send_follows(self.followed.depart(rank, why), out)

    @staticmethod
    def _send_follows(replies: list[FollowReply], out: Out) -> None:
        for reply in replies:
            if reply.error is None:
                CoordinatorSession._reply(reply.rank, reply.req, reply.value, out)
            else:
                item: Item = {"t": "reply", "req": reply.req, "error": reply.error, "source": CONTROL_PLANE}
                out.setdefault(reply.rank, []).append(item)

    def _next_chunk(self, key: str, message: dict[str, Any]) -> tuple[int, int | None]:
        """The chunk a claim gets: a lost rank's first (with the ticket it had for it), else the
        queue's next, with the next ticket if asked for."""
        values, tickets = self.values, message.get("tickets")
        requeued = values.get(key + REQUEUED)
        if "chunk" in message:  # a chunk handed to this rank by a resumed checkpoint (no queue position)
            chunk = int(message["chunk"])
        elif requeued:
            chunk, ticket = requeued.pop(0)
            return int(chunk), ticket
        else:
            chunk = int(message["first"]) + int(values.get(key, 0))
            values[key] = int(values.get(key, 0)) + 1
        ticket = None
        if tickets is not None and chunk < int(message["ticketed"]):
            values[tickets] = ticket = int(values.get(tickets, 0)) + 1
        return chunk, ticket

    def _set_aside(self, key: str, members: list[int], preset: list[int]) -> None:
        """Hold each member's set-aside chunk of `key`'s epoch (once); a lost member's goes back to the queue."""
        if len(members) != len(preset):
            raise ValueError(f"a claim on {key!r} names {len(members)} members but {len(preset)} set-aside chunks")
        orphans = self.work.set_aside(key, members, preset, self.departed)
        if orphans:
            self.values.setdefault(key + REQUEUED, []).extend([c, t] for c, t in orphans)

    def report_work(self, rank: int, message: dict[str, Any]) -> None:
        """A `work` message: chunks `rank` now holds (with their tickets), has trained, or gives back."""
        key = message["key"]
        hold = message.get("hold", [])
        self.work.hold(rank, key, hold, message.get("tickets", [None] * len(hold)))
        self.work.done(rank, key, message.get("done", []))
        for chunk, position in message.get("back", []):  # only what it holds: it is requeued from there
            if self.work.give_back(rank, key, int(chunk)):
                self.values.setdefault(key + REQUEUED, []).append([int(chunk), int(position)])
        if message.get("end"):
            self.ends.finish(key, rank)

    def _give_back(self, rank: int, key: str, shard: int, position: int) -> bool:
        """`rank` offers the rest of `shard`, which it holds, from `position`: it goes back to the queue
        if a claim is parked there or another live member still claims from it, and `rank` claims no
        more (it left the tail); otherwise nobody would read it (the others ended their epoch: a meeting
        released their parked claims), so `rank` keeps it and reads it on itself. False too where it
        did not hold it."""
        if not self.ends.still_claiming(key, self.members, rank) or not self.work.give_back(rank, key, shard):
            log.debug("session %d: rank %d keeps shard %d of %s: nobody would read it", self.number, rank, shard, key)
            return False
        self.values.setdefault(key + REQUEUED, []).append([shard, position])
        self.ends.finish(key, rank)
        return True

    def settle_queues(self, out: Out) -> None:
        """Answer the parked claims that may return now (`lightning_prague.core.plane.queue_end`):
        after anything that changes whom they wait for (a departure, a rank done claiming, one that
        arrived at a meeting or closed the session)."""
        for key in self.ends.keys():
            self._settle(key, out)

    def _drained(self, key: str) -> bool:
        """Whether `key`'s queue handed out every chunk (as the claims standing by on it count them)."""
        claim = self.ends.standing_by(key)
        if claim is None or "num" not in claim:
            return False
        return int(claim["first"]) + int(self.values.get(key, 0)) >= int(claim["num"])

    def _settle(self, key: str, out: Out) -> None:
        members = self.work.members(key) or sorted(self.members)
        requeued = self.values.get(key + REQUEUED, [])
        holding = self.work.holders(key)
        stood_by = False
        drained = self._drained(key)
        for answer in self.ends.settle(key, self.members, members, self.generator.parked, holding, requeued, drained):
            chunk, ticket = answer.chunk, answer.ticket
            if answer.standby is not None:  # nobody else takes the queue's rest: this rank does, or it ends
                stood_by = True
                chunk, ticket = self._next_chunk(key, answer.standby)
                if chunk < int(answer.standby.get("num", chunk + 1)):
                    self.work.claimed(answer.rank, key, chunk, ticket)
                    log.info("session %d: rank %d takes chunk %d of %s: nobody else would", self.number, answer.rank,
                             chunk, key)  # fmt: skip
                else:
                    self.ends.finish(key, answer.rank)
            elif answer.given_back:
                self.work.claimed(answer.rank, key, chunk, ticket)
            self._answer_claim(answer.rank, answer.req, key, [chunk, ticket], out)
        if stood_by:  # the other parked claims wait for one that took a chunk, or end with the others
            self._settle(key, out)

    def requeued_work(self) -> list[list[Any]]:
        """What lost ranks gave back and no rank claimed again yet, on every queue: `[chunk, ticket value]`
        (map-style), `[shard, position]` (a sharded stream)."""
        pairs = [[item, value] for key, held in self.values.items() if key.endswith(REQUEUED) for item, value in held]
        return sorted(pairs, key=lambda pair: pair[0])

    def _requeue(self, rank: int) -> None:
        """A lost rank's untrained chunks go back to their epoch's queue, with their tickets."""
        for key, held in self.work.lose(rank).items():
            self.values.setdefault(key + REQUEUED, []).extend([c, t] for c, t in held)
            log.warning(
                "session %d: rank %d's untrained chunks %s of %s go back to the work queue",
                self.number,
                rank,
                [c for c, _ in held],
                key,
            )

    def _wake(self, key: str, out: Out) -> None:
        for rank, req in self._waits.pop(key, ()):
            self._reply(rank, req, self.values[key], out)

    @staticmethod
    def _reply(rank: int, req: int, value: Any, out: Out) -> None:
        out.setdefault(rank, []).append({"t": "reply", "req": req, "value": value})


class FitGone(ValueError):
    """A new process asks to rejoin a fit that ended (or that every rank left): its error item says
    `ended`, and it ends its fit without one (`lightning_prague.core.errors.FitEnded`)."""


class ControlPlane:
    """The message handler of the supervisor's `MessageServer` (see the module docstring)."""

    def __init__(self) -> None:
        self.sessions: dict[int, CoordinatorSession] = {}
        self.handled = 0
        #: `ends(rank)`: the (client, server) addresses of `rank`'s authenticated connection, or `None`
        #: (the server's `MessageServer.ends`): fencing kills only the process that holds it
        self.ends: Callable[[int], tuple[tuple[str, int], tuple[str, int]] | None] = lambda rank: None

    # -- MessageServer hooks ----------------------------------------------------------------------
    def handle(self, message: dict[str, Any]) -> Out:
        """The items one message produces; an error in it is answered to its sender only.

        `message` is a record of `lightning_prague.core.protocol` (the server checked it), from the
        rank it names (the server binds a rank to its authenticated connection).
        """
        out: Out = {}
        rank = message["rank"]
        try:
            self._handle(message, rank, out)
        except Exception as err:  # a malformed message must not kill the control plane
            log.exception("control plane rejected a message of rank %d: %.300s", rank, message)
            error = f"the control plane rejected {message.get('op')!r}: {type(err).__name__}: {err}"
            item: Item = {"t": "error", "source": CONTROL_PLANE, "message": error}
            if isinstance(err, FitGone):  # the joiner's fit ends quietly (`FitEnded`)
                item["ended"] = True
            if "req" in message:
                item = {"t": "reply", "req": message["req"], "error": error, "source": CONTROL_PLANE}
            elif "s" in message:
                item["s"] = message["s"]
            out = {rank: [item]}
        self.handled += 1
        return out

    def on_connect(self, rank: int, hello: dict[str, Any] | None = None) -> Out:
        log.debug("control plane: rank %d connected", rank)
        return {}

    def tick(self) -> Out:
        """Called by the server a few times a second: members found hung depart and are fenced."""
        out: Out = {}
        for number, rank, kind, reason in self.hang_events():
            self.apply_hang(number, rank, kind, reason, out)
        self.sweep(out)
        return out

    def hang_events(self) -> list[tuple[int, int, str, str]]:
        """What the hang detectors find now (it depends on the clock): `(session, rank, kind, reason)`,
        `kind` `"left_out"` (blocked past its short bound) or `"hung"` (to be fenced), for `apply_hang`."""
        events = []
        for session in list(self.sessions.values()):
            left_out = [(r, why) for r, why in session.hangs.left_out() if r in session.members]
            events += [(session.number, r, "left_out", why) for r, why in left_out]
            events += [(session.number, r, "hung", why) for r, why in session.hangs.hung()]
        return events

    def apply_hang(
        self, number: int, rank: int, kind: str, reason: str, out: Out, fenced_item: bool | None = None
    ) -> bool:
        """A hang detector's finding (`hang_events`): the rank departs, left out or fenced. Returns
        whether it was sent a `fenced` item (it was not SIGKILLed here); `fenced_item` replays that
        decision instead of fencing (`lightning_prague.core.plane.journal`)."""
        session = self.sessions.get(number)
        if session is None:
            return False
        asked = False
        if kind == "left_out":
            if rank not in session.members:
                return False
            log.error("session %d: rank %d is %s", session.number, rank, reason)
            session.depart(rank, reason, out, left_out=True)
        else:
            log.error("session %d: rank %d is %s; fencing it", session.number, rank, reason)
            session.left_out.pop(rank, None)
            session.depart(rank, reason, out)
            if fenced_item is None:
                asked = self._fence(session, rank, reason, out)
            elif fenced_item:
                asked = True
                out.setdefault(rank, []).append({"t": "fenced", "reason": reason})
        self._tag(session, out)
        return asked

    def renew_epochs(self, out: Out) -> bool:
        """After a restart from the journal: every fit whose members are in a membership epoch of an
        admission opens a new one, with the same members, in the new store (`GroupGenerator.renew_epoch`).
        Returns whether any did."""
        renewed = False
        for session in list(self.sessions.values()):
            if session.generator.renew_epoch(out):
                renewed = True
                log.warning("session %d: membership epoch %d for the store started again", session.number,
                            session.generator.epoch)  # fmt: skip
                self._tag(session, out)
        return renewed

    def sweep(self, out: Out) -> bool:
        """Sessions that are over are deleted (and left-out ranks told that their fit ended); returns
        whether anything changed."""
        before = (len(self.sessions), sum(len(items) for items in out.values()))
        for session in list(self.sessions.values()):
            self._maybe_delete(session, out)
        return before != (len(self.sessions), sum(len(items) for items in out.values()))

    def _cpu_seconds(self, session: CoordinatorSession, rank: int) -> float | None:
        """The CPU seconds `rank`'s process used, if it runs verifiably on this host and is not stopped."""
        pid, host = session.processes.get(rank, (0, ""))
        ends = self.ends(rank)
        if ends is None or host != socket.gethostname():
            return None
        return running_cpu_seconds(pid, *ends)

    def _fence(self, session: CoordinatorSession, rank: int, reason: str, out: Out) -> bool:
        """SIGKILL a hung rank's process if it is verifiably the rank's (the pid it claimed holds its
        authenticated connection, on this host); else ask it to end itself (a `fenced` item: True)."""
        pid, host = session.processes.get(rank, (0, ""))
        ends = self.ends(rank)
        if ends is not None and host == socket.gethostname() and fence(pid, *ends):
            log.warning("session %d: sent SIGKILL to rank %d (pid %d)", session.number, rank, pid)
            return False
        log.warning(
            "session %d: rank %d (pid %d) is not a process this host can verify: asking it to end",
            session.number,
            rank,
            pid,
        )
        out.setdefault(rank, []).append({"t": "fenced", "reason": reason})
        return True

    def on_disconnect(self, rank: int) -> Out:
        """A rank's process closed its connection: it departs from every session it is in, and a
        joiner not admitted yet is withdrawn (nobody waits for it at an admission)."""
        out: Out = {}
        for session in list(self.sessions.values()):
            if rank in session.members:
                session.depart(rank, "its process ended: its connection to the control plane closed", out)
                self._tag(session, out)
            elif session.generator.is_joiner(rank):
                log.warning("session %d: rank %d's new process ended before its admission", session.number, rank)
                session.generator.withdraw(rank, out)
                self._tag(session, out)
            self._maybe_delete(session, out)
        return out

    # -- messages -------------------------------------------------------------------------------
    def _handle(self, message: dict[str, Any], rank: int, out: Out) -> None:
        op = message["op"]
        number = message["s"]
        session = self.sessions.get(number)
        if op == "join" and message.get("rejoin"):
            self._rejoin(session, number, rank, message, out)
            if session is not None:
                self._tag(session, out)
            return
        if op == "join":
            config = SessionConfig.from_wire(message["config"])
            if session is None:
                if not 0 <= rank < config.world_size:
                    raise ValueError(f"rank {rank} cannot open a session of {config.world_size} workers")
                session = self.sessions[number] = CoordinatorSession(number, config)
                session.hangs.probe = lambda r, s=session: self._cpu_seconds(s, r)
                log.debug("control plane: session %d opened by rank %d", number, rank)
            if config != session.config:
                raise ValueError(
                    f"rank {rank} joined session {number} with another configuration than its first member's"
                )
            if (
                not 0 <= rank < session.world_size
                or rank in session.members
                or rank in session.closed
                or rank in session.departed
            ):
                raise ValueError(f"rank {rank} cannot join session {number}: it is outside it, or joined it before")
            session.members.add(rank)
            session.hangs.joined(rank)
            session.processes[rank] = (message["pid"], message["host"])
            session.addresses[rank] = list(message.get("addresses", ()))
            return
        if session is None:
            # every rank failed or left, so the session is over: a failed rank's teardown still leaves
            if op == "leave":
                out[rank] = [{"t": "left", "s": number}]
                return
            if op in ("close", "beat"):
                return
            raise ValueError(f"rank {rank} sent {op!r} for session {number}, which is not open")
        if op in MEMBERS_ONLY and rank not in session.members:
            # a departed rank's late message (a claim in flight when it was declared lost, a report of a
            # rank that left on SIGTERM) takes no work and changes nothing: a claim finds the queue at its
            # end, a report is dropped, anything else is refused
            if op == "kv" and message.get("do") == "claim":
                CoordinatorSession._reply(rank, int(message["req"]), [int(message.get("num", 0)), None], out)
                return
            if op != "kv":
                log.debug("session %d: dropped %r of rank %d, which is not a member", number, op, rank)
                return
            why = session.departed.get(rank, "it closed the session" if rank in session.closed else "it never joined")
            raise ValueError(f"rank {rank} is not a member of fit {number} ({why}): {op!r} refused")
        session.hangs.heard(rank)
        if op == "beat":
            session.hangs.beat(
                rank,
                int(message["progress"]),
                bool(message["waiting"]),
                bool(message["busy"]),
                message.get("step"),
                bool(message.get("active", False)),
            )
            out[rank] = [{"t": ALIVE}]  # the worker hears the control plane too (it fences itself without it)
            return
        if op == "kv":
            session.kv(rank, int(message["req"]), message, out)
        elif op == "work":
            session.report_work(rank, message)
            session.settle_queues(out)
        elif op == "trained":
            session.positions[rank] = {
                k: int(message[k]) for k in ("epoch", "batches", "shard", "of", "total") if k in message
            }
        elif op == "round":  # the members of a gossip round (`GroupGenerator.round_members`)
            session.generator.round_members(
                rank, message["key"], message["round"], message.get("slots", ()), bool(message.get("start")), out
            )
        elif op == "summed":
            members = message["members"]
            if any(m >= session.world_size for m in members):
                raise ValueError(f"rank {rank} reported a collective of ranks {members} outside the session")
            verdicts = session.verdicts.report(
                rank, message["key"], members, message["ok"], session.departed, message.get("epoch")
            )
            for member, item in verdicts:
                out.setdefault(member, []).append(item)
        elif op == "close":
            session.came_back(rank)
            if session.generator.is_joiner(rank):  # it gave up waiting for its admission
                session.generator.withdraw(rank, out)
            elif message.get("failed") and rank in session.members:
                # it gives up on the fit (a joiner whose state transfer failed, a fit that failed before
                # it could leave): a departure, so that nobody waits for it
                session.depart(rank, "it gave up on the fit after an error", out)
            session.members.discard(rank)
            session.hangs.forget(rank)  # its process may run on after its fit: nothing to fence
            if rank not in session.departed:
                session.closed.add(rank)
            session.ends.depart(rank)
            session.follows_depart(rank, "it closed the fit", out)
            session.settle_queues(out)
            self._maybe_delete(session, out)
        elif op == "parked":
            CoordinatorSession._reply(rank, int(message["req"]), sorted(session.generator.parked), out)
        elif op == "history":  # for tests and benchmarks (SessionConfig.record_history)
            generator = session.generator
            history = {
                "issued": [[gid, list(members)] for gid, members in generator.issued],
                "windows_closed": getattr(generator.policy, "windows_closed", None),
            }
            CoordinatorSession._reply(rank, int(message["req"]), history, out)
        elif op == "leave":  # the others hear of it first, then it gets what is still assigned to it
            session.came_back(rank)
            session.depart(rank, "it stopped after an error", out, leaving=True)
            for r, items in session.generator.handle(message).items():
                out.setdefault(r, []).extend(items)
        else:
            for r, items in session.generator.handle(message).items():
                out.setdefault(r, []).extend(items)
            if op == "arrive":  # a rank at a meeting claims nothing until its release
                session.settle_queues(out)
        self._tag(session, out)

    @staticmethod
    def _rejoin(session: CoordinatorSession | None, number: int, rank: int, message: dict[str, Any], out: Out) -> None:
        """A new process for `rank`, which left the fit, asks to be admitted: it is, at once or at the
        members' meeting's release (`GroupGenerator.request_join`, the items in `out`); refused, to it
        alone, where that cannot be."""
        if session is None:
            raise FitGone(f"rank {rank} cannot rejoin fit {number}: no such fit runs (it ended, or every rank left it)")
        if rank not in session.departed:
            raise ValueError(f"rank {rank} cannot rejoin fit {number}: that rank is a live member of it")
        config = SessionConfig.from_wire(message["config"])
        if config != session.config:
            raise ValueError(
                f"rank {rank} cannot rejoin fit {number}: it runs with another configuration than the fit's "
                "(another strategy, options or number of workers: another job's script?)"
            )
        generator = session.generator
        if generator.stopping or generator.stop_requested:
            raise ValueError(f"rank {rank} cannot rejoin fit {number}: the fit is stopping")
        session.came_back(rank)
        session.processes[rank] = (message["pid"], message["host"])
        session.addresses[rank] = list(message.get("addresses", ()))
        after_epoch = session.nothing_left_in_epoch(rank)
        generator.request_join(rank, out, after_epoch=after_epoch)
        later = "; its shard holds nothing of the members' epoch: it is admitted at their epoch's end"
        log.warning(
            "session %d: a new process for rank %d asks to rejoin (pid %d)%s",
            number, rank, message["pid"], later if after_epoch else "",
        )  # fmt: skip

    @staticmethod
    def _take_joined(session: CoordinatorSession) -> None:
        """Ranks the generator admitted are members again (see `GroupGenerator`'s `Rejoining`)."""
        for rank in session.generator.take_joined():
            session.departed.pop(rank, None)
            session.closed.discard(rank)  # an earlier process of it may have closed: this one departs when lost
            session.members.add(rank)
            session.hangs.joined(rank)
            session.verdicts.readmitted(rank, session.generator.epoch)
            log.warning("session %d: rank %d rejoined the fit", session.number, rank)

    @staticmethod
    def _tag(session: CoordinatorSession, out: Out) -> None:
        """After each message: ranks admitted meanwhile are members again; items carry the session; an
        admission names where the joiner's rank stood in its shard of the epoch, if it reported it."""
        ControlPlane._take_joined(session)
        for rank, items in out.items():
            for item in items:
                if item["t"] != "reply":
                    item["s"] = session.number
                if item["t"] == "admit" and rank in session.positions:
                    item["position"] = dict(session.positions[rank])

    def _maybe_delete(self, session: CoordinatorSession, out: Out) -> None:
        if session.over and session.left_out and not session.ended:
            # the fit ended while ranks were left out: nothing to come back to, so each one's fit ends when
            # it wakes (it is told now); the session stays, to fence those that never wake at their bound
            session.ended = True
            for rank in session.left_out:
                log.warning("session %d: the fit ended while rank %d was left out", session.number, rank)
                out.setdefault(rank, []).append({"t": "fit_ended", "s": session.number})
        if session.left_out:
            return
        if session.over and session.generator.joining:  # nobody is left to admit them
            for rank in session.generator.joining:
                message = f"rank {rank} cannot rejoin fit {session.number}: the fit ended"
                out.setdefault(rank, []).append({"t": "error", "message": message, "s": session.number, "ended": True})
            session.generator.joining = []
        if session.over and self.sessions.get(session.number) is session:
            del self.sessions[session.number]
            log.debug("control plane: session %d is over", session.number)
