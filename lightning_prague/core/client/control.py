"""A training process's side of the control plane: one connection, sessions over it, requests.

`ControlClient` is the process's one connection to the control plane (the supervisor process).
Its reader thread routes what arrives: replies to the request that asked (`request`), items of a
session to that session's inbox (`Session.receive`), and raises the session's flags at once:
`Session.departed` (ranks that left the job) and `Session.stop_reason` (the job is stopping). So
the training thread learns of a lost worker or a stop by reading a flag, even while no thread
waits on the connection (a worker that gossips on a fixed schedule never does).

`Session` is one fit's view: it sends the session's messages, reads its inbox, and offers
`Session.counters`, a key-value table in the coordinator with the subset of TCPStore's interface
the work queue, global progress and gossip use (`add`, `set`, `get`, `check`, `wait`,
`compare_set`, `delete_key`).

**Losing the control plane.** A control plane that dies and is started again within the link's wait
takes the job back (`MessageLink`'s reconnection, `lightning_prague.core.plane.journal`): meanwhile
nothing here fails, and the watch thread below leaves the silence to the link's own bound. The job
cannot go on without it beyond that, but the training thread must end through an exception, so that
Lightning's `on_exception` hooks run (an `OnExceptionCheckpoint` writes its checkpoint) before
the process ends. A background thread marks the session *cut off*, with the reason: the reader
thread when the connection closes (the supervisor or its node is gone), the session's watch
thread when nothing came from the control plane for this rank's hang bound plus
`MARGIN_SECONDS` (a network partition: the control plane has declared this rank lost by then;
the watch thread then closes the connection too). From then on every contact of the training
thread with the control plane raises `ControlPlaneLost` (a `ControlPlaneError`): any request or
wait on it (at once, also one already waiting), `Session.raise_if_cut_off` (the strategies call
it at each batch start) and `Session.check_members`. If the training thread gets to none of them
within a grace period (this rank's hang bound as of the cut; it may be stuck in an exchange with
a peer across the partition, which no abandon check can end), the watch thread ends the process
(`os._exit(FENCED_EXIT_STATUS)`, with the reason on its standard error), so that a rank cut off
from the others never trains on apart from them. Once the training thread has raised, its
exception path (checkpoint, teardown) gets up to the session's long bound before that last resort.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from lightning_prague.core.auth import Credentials
from lightning_prague.core.client.beacon import Beacon
from lightning_prague.core.client.link import MessageLink
from lightning_prague.core.client.partition import (
    EXCLUDED_EXIT_VARIABLE,
    FENCED_EXIT_STATUS,
    MARGIN_SECONDS,
    drop_connections,
    excluded_exit_status,
    own_addresses,
)
from lightning_prague.core.errors import (
    CONTROL_PLANE,
    ControlPlaneError,
    ControlPlaneLost,
    CoordinationTimeout,
    FitEnded,
    LeftOut,
    MemberLost,
    PragueError,
)
from lightning_prague.core.protocol import ALIVE, BEAT_SECONDS, ROUTED, HangRule, Message, SessionConfig

log = logging.getLogger(__name__)

_CLOSED: Message = {"t": "__closed__"}
#: seconds between two checks of the session's watch thread (`Session.check_reachable`)
WATCH_SECONDS = 0.5
#: verdicts kept that no thread has taken (one whose wait timed out arrives later and is dropped)
MAX_VERDICTS = 1024


class ControlClient:
    """This process's connection to the control plane (see the module docstring)."""

    def __init__(
        self, host: str, port: int, rank: int, timeout: float, credentials: Credentials, reconnect_within: float = 0.0
    ) -> None:
        self.rank = rank
        self.timeout = timeout
        self.address = f"{host}:{port}"
        self.port = port
        #: the launch this control plane serves (as the store's record named it)
        self.launch = credentials.launch
        #: the process that serves the control plane hosts the job's store too (it restarts with it)
        self.store_in_plane = False
        #: the store key of the control plane's record (`lightning_prague.core.protocol.ADDRESS_RECORD`)
        self.record_key = ""
        #: the supervisor's process id (as it published it with its address)
        self.supervisor_pid = 0
        #: called (by the reader thread) when the control plane leaves this rank out of its fit: the
        #: job shuts down its process group's connections (`Membership.drop_group_connections`)
        self.on_left_out: Callable[[], None] | None = None
        self._sessions: dict[int, Session] = {}
        self._replies: dict[int, queue.Queue[Message]] = {}
        self._lock = threading.Lock()
        self._req = itertools.count(1)
        self.link = MessageLink(
            host,
            port,
            rank,
            timeout,
            credentials,
            router=self._route,
            on_close=self._closed,
            peer=f"the control plane at {host}:{port}",
            reconnect_within=reconnect_within,
        )

    @property
    def closed(self) -> bool:
        return self.link.closed

    # -- the reader thread ------------------------------------------------------------------------
    def _route(self, message: Message) -> bool:
        if message.get("t") == ALIVE:  # the answer to a beat: its arrival is all it says
            return ROUTED
        if message.get("t") == "reply":
            with self._lock:
                waiter = self._replies.pop(int(message["req"]), None)
            if waiter is not None:
                waiter.put(message)
            return ROUTED
        number = message.get("s")
        session = self._sessions.get(int(number)) if number is not None else None
        if session is None:
            log.debug("rank %d: dropped an item of no open session: %s", self.rank, message)
            return ROUTED
        session.deliver(message)
        return ROUTED

    def _closed(self, error: str) -> None:
        for session in list(self._sessions.values()):  # first: a failed wait then finds the reason
            session.cut(error)
        with self._lock:
            waiters, self._replies = list(self._replies.values()), {}
        for waiter in waiters:
            waiter.put({"t": "reply", "error": error})
        for session in list(self._sessions.values()):
            session.deliver(_CLOSED)

    # -- requests ------------------------------------------------------------------------------
    def send(self, message: Message) -> None:
        self.link.send(message)

    def request(
        self, message: Message, what: str, timeout: float | None = None, serve: Callable[[], None] | None = None
    ) -> Any:
        """Send `message` with a fresh `req` number and return the reply's value; `serve` is called
        every few milliseconds while the reply is awaited (a rank that waits long still serves its peers)."""
        return self.begin(message, what).result(timeout, serve)

    def begin(self, message: Message, what: str) -> PendingReply:
        """Send `message` with a fresh `req` number now; its reply is taken later (`PendingReply.result`):
        a request in flight while the caller works on (a claim ahead of the batch that needs it)."""
        req = next(self._req)
        waiter: queue.Queue[Message] = queue.Queue(maxsize=1)
        with self._lock:
            if self.link.closed:
                raise self.link.closed_error(what)
            self._replies[req] = waiter
        self.link.send({**message, "req": req, "rank": self.rank})
        return PendingReply(self, req, waiter, what)

    def _forget_reply(self, req: int) -> None:
        with self._lock:
            self._replies.pop(req, None)

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, number: int, config: SessionConfig, rejoin: bool = False) -> Session:
        """Join session `number` (one fit); every rank of the session must join it with the same config.

        `rejoin`: this is a new process for a rank that left the fit; it asks to be admitted
        (`Session.await_admission`)."""
        # the control plane's hang detector uses the longer of the two as the bound of a busy worker
        long_bound = max(config.timeout, config.sync_timeout or 0.0)
        session = Session(self, number, config.world_size, Beacon(config.hang), long_bound, config.starting)
        self._sessions[number] = session
        local = self.link.local_address()
        self.send(
            {
                "op": "join",
                "s": number,
                "rank": self.rank,
                "config": config.to_wire(),
                "pid": os.getpid(),
                "host": socket.gethostname(),
                # where other nodes reach this process: a survivor drops its connections there once
                # every rank of this node is lost (`lightning_prague.core.client.partition`)
                "addresses": own_addresses(local),
                **({"rejoin": True} if rejoin else {}),
            }
        )
        session.beacon.start(lambda fields: session.send("beat", **fields), f"prague-control-beacon-{self.rank}")
        # a thread of its own, never behind a send that waits on the network (the beacon's may)
        session.start_watch(f"prague-control-watch-{self.rank}")
        log.debug("rank %d: joined session %d", self.rank, number)
        return session

    def forget(self, session: Session) -> None:
        self._sessions.pop(session.number, None)

    def close(self) -> None:
        self.link.close()


class Session:
    """One fit's messages, inbox, flags and counters (see the module docstring)."""

    def __init__(
        self,
        client: ControlClient,
        number: int,
        world_size: int,
        beacon: Beacon | None = None,
        long_bound: float | None = None,
        starting: int | None = None,
    ) -> None:
        self.client = client
        #: the hang bound of this rank while it is busy or has not timed a step (`HangRule.bound`)
        self.long_bound = client.timeout if long_bound is None else long_bound
        self._opened = time.monotonic()
        #: what this rank's training thread reports to the hang detector (`lightning_prague.core.plane.liveness`)
        self.beacon = beacon if beacon is not None else Beacon(HangRule())
        self.number = number
        self.rank = client.rank
        self.world_size = world_size
        self.timeout = client.timeout
        self._inbox: queue.Queue[Message] = queue.Queue()
        #: rank -> why it left the job, as the control plane announced it (in the order they left)
        self.departed: dict[int, str] = {}
        #: rank -> when (wall-clock seconds) this rank heard of its departure
        self.departed_at: dict[int, float] = {}
        #: the ranks still in the job, as of the latest departure notice or admission (at first the
        #: `starting` ranks that launched it; the rest of `world_size` are free places)
        self.members: list[int] = list(range(world_size if starting is None else starting))
        #: rank -> (when this rank heard of its departure, why) for ranks that left and came back
        self.rejoined: dict[int, tuple[float, str]] = {}
        #: rank -> the membership epoch its current process was admitted in (ranks that rejoined)
        self.admitted_in: dict[int, int] = {}
        #: `None`, or why the job is stopping (`"sigterm"`, `"request"`), as soon as it is announced
        self.stop_reason: str | None = None
        self.counters = Counters(self)
        self.open = True
        self._departure = threading.Event()
        #: requests this rank sent in the session (work-queue claims, tickets, ...), for tests and monitors
        self.requests = 0
        #: `None`, or why this rank lost the control plane (see the module docstring)
        self.cut_off: str | None = None
        self._cut_lock = threading.Lock()
        self._cut_since = 0.0  # `time.monotonic()` of the cut
        self._grace = 0.0  # seconds the training thread has, from the cut, to raise
        self._raised = False  # the training thread raised `ControlPlaneLost`
        #: the thread that opened the session: the one that trains (its raise is what the grace waits for)
        self._trainer = threading.get_ident()
        self._watching = threading.Event()
        #: key -> the control plane's verdict on a group collective this rank reported (`verdict`)
        self._verdicts: dict[str, bool] = {}
        self._verdict_ready = threading.Condition()
        self._rejected: str | None = None  # the control plane rejected one of this rank's messages
        #: membership epoch -> its members, as the control plane announced it (`members` and `admit`
        #: items: `lightning_prague.core.membership`); the newest few
        self.epochs: dict[int, tuple[int, ...]] = {}
        #: the newest membership epoch announced here (a `members` or `admit` item), once its item is
        #: followed in full (`take_admissions` finds it)
        self.announced_epoch = 0
        #: `members` items the training thread has not followed yet (`take_admissions`)
        self._admissions: list[Message] = []
        #: key -> the control plane's answer on a gossip round's members (`round_members`)
        self._round_answers: dict[str, Message] = {}
        #: `None`, or why the control plane left this rank out of the fit (it blocked past its short
        #: hang bound): its training thread raises `LeftOut` at its next contact with the plane
        self.left_out: str | None = None
        #: the others finished the fit while this rank was left out (its fit ends when it wakes)
        self.fit_ended = False

    def deliver(self, item: Message) -> None:
        """Called by the reader thread for every item of this session."""
        kind = item["t"]
        if kind == "verdict":  # not an inbox item: the thread waiting in `verdict` takes it
            with self._verdict_ready:
                self._verdicts[str(item["key"])] = item.get("apply") is True
                while len(self._verdicts) > MAX_VERDICTS:  # verdicts no one waits for any more (timed out)
                    del self._verdicts[next(iter(self._verdicts))]
                self._verdict_ready.notify_all()
            return
        if kind == "round":  # not an inbox item either: the thread waiting in `round_members` takes it
            with self._verdict_ready:
                self._round_answers[str(item.get("key"))] = item
                while len(self._round_answers) > MAX_VERDICTS:
                    del self._round_answers[next(iter(self._round_answers))]
                self._verdict_ready.notify_all()
            return
        if kind in ("members", "admit"):  # a new membership epoch (an admission): in the inbox too
            self._new_epoch(item)
        if kind == "error" and item.get("source") == CONTROL_PLANE and item.get("ended") is not True:
            # (a joiner's "the fit ended" is taken from the inbox where it waits: `FitEnded`, no failure)
            with self._verdict_ready:
                self._rejected = str(item.get("message", "a message was rejected"))
                self._verdict_ready.notify_all()
        if kind == "departed":
            self.departed[int(item["rank"])] = str(item["reason"])
            self.departed_at[int(item["rank"])] = time.time()
            self.members = [int(r) for r in item.get("members", self.members) if int(r) != int(item["rank"])]
            log.warning(
                "rank %d: rank %d left the job (%s); remaining members %s",
                self.rank,
                item["rank"],
                item["reason"],
                self.members,
            )
            if item.get("unreachable"):  # every rank of its node is lost: no exchange may wait on that node
                node = item.get("node", "its node")
                drop_connections(item["unreachable"], self.rank, f"every rank of {node} left the job")
            self._departure.set()
        if kind == "left_out":  # blocked past the short bound: the others went on without this rank
            with self._verdict_ready:  # a verdict this rank waits for will not come: the wait ends
                self.left_out = str(item.get("reason", "it blocked"))
                self._verdict_ready.notify_all()
            log.error("rank %d: the control plane left this rank out of the fit (%s)", self.rank, self.left_out)
            if self.client.on_left_out is not None:  # its peers' exchanges with it end now
                try:
                    self.client.on_left_out()
                except Exception:  # the reader thread must go on
                    log.exception("rank %d: could not drop the connections of its process group", self.rank)
        elif kind == "fit_ended":  # ... and they finished the fit meanwhile: nothing to come back to
            self.fit_ended = True
            log.warning("rank %d: the others finished the fit while this rank was left out", self.rank)
        elif kind == "fenced":  # declared hung: end this process, as a local one would be SIGKILLed
            status = excluded_exit_status()
            log.error(
                "rank %d: the control plane fenced this rank (%s); the job goes on without it: exiting with status %d "
                "(%s)", self.rank, item.get("reason"), status, EXCLUDED_EXIT_VARIABLE,
            )  # fmt: skip
            os._exit(status)
        elif kind == "stop" and (self.stop_reason is None or item.get("reason") == "requeue"):
            self.stop_reason = str(item.get("reason", "sigterm"))
            log.debug("rank %d: the job is stopping (%s)", self.rank, self.stop_reason)
        self._inbox.put(item)

    def send(self, op: str, **fields: Any) -> None:
        try:
            self.client.send({"op": op, "s": self.number, "rank": self.rank, **fields})
        except PragueError as err:
            lost = self._lost_plane(err, f"sending {op!r}")
            if lost is err:
                raise
            raise lost from err

    # -- losing the control plane (see the module docstring) ----------------------------------------
    def start_watch(self, name: str) -> None:
        """Run `check_reachable` every `WATCH_SECONDS` from a thread of its own until the session closes."""

        def watch() -> None:
            while not self._watching.wait(WATCH_SECONDS):
                if not self.open:
                    return
                try:
                    self.check_reachable()
                except Exception:  # never a silent end of the last resort
                    log.exception("rank %d: checking that the control plane is reachable failed", self.rank)

        threading.Thread(target=watch, name=name, daemon=True).start()

    def cut(self, reason: str, since: float | None = None, grace: float | None = None) -> None:
        """Mark the session cut off from the control plane (the first reason stays): from now on the
        training thread raises `ControlPlaneLost` at its next contact with the plane, and the watch
        thread ends the process if it does not within `grace` seconds of `since` (defaults: now, and
        this rank's hang bound now)."""
        if not self.open:
            return
        with self._cut_lock:
            if self.cut_off is not None:
                return
            self._grace = self.beacon.bound(self.long_bound) if grace is None else grace
            self._cut_since = time.monotonic() if since is None else since
            self.cut_off = reason
        log.error(
            "rank %d: lost the control plane: %s; the fit ends at this rank's next contact with it (the process "
            "ends in %.0fs if the training thread gets to none)",
            self.rank,
            reason,
            max(0.0, self._cut_since + self._grace - time.monotonic()),
        )

    def _lost_plane(self, err: PragueError, during: str) -> PragueError:
        """What a failed contact with the control plane raises: the plane-lost error once the plane is
        gone (a send that failed is a lost plane, whichever of the sender and the reader thread sees
        it first), else `err` itself."""
        if isinstance(err, ControlPlaneLost):
            self.cut(str(err))
        return self.plane_lost(during) if self._gone() else err

    def plane_lost(self, during: str) -> ControlPlaneLost:
        """The error for a contact with the control plane once it is lost (`cut_off`); raised by the
        training thread, it stands the process's last resort down (see the module docstring)."""
        reason = self.cut_off
        if reason is None:  # the connection closed a moment ago: the reader thread is about to say so
            link = self.client.link
            reason = link.close_error or f"rank {self.rank}: {link.peer} closed the connection; it stopped or failed"
            self.cut(reason)
        if threading.get_ident() == self._trainer:
            self._raised = True
        return ControlPlaneLost(
            f"{reason} (during {during}); the job cannot go on without its control plane (the supervisor "
            f"process, pid {self.client.supervisor_pid}): this rank's fit ends here"
        )

    def _gone(self) -> bool:
        """Whether the control plane is lost (cut off, or the connection closed)."""
        return self.cut_off is not None or self.client.closed

    def raise_if_cut_off(self, during: str = "training") -> None:
        """Raise `ControlPlaneLost` if this rank lost the control plane (the strategies call it at each
        batch start: a rank that trains without contact with the plane learns of it there)."""
        if self._gone():
            raise self.plane_lost(during)
        if self.left_out is not None:
            raise self.left_out_error(during)

    def left_out_error(self, during: str) -> LeftOut:
        """The error the training thread raises once the control plane has left this rank out."""
        return LeftOut(
            f"rank {self.rank}: the control plane left this rank out of the fit during {during} ({self.left_out}); "
            "the others went on without it"
        )

    def fit_failed(self) -> None:
        """The fit failed on this rank, whatever the error (the strategies call it from Lightning's
        `on_exception`): its training thread trains no more, so once the control plane is lost its
        exception path (an `OnExceptionCheckpoint`, the teardown) gets the session's long bound
        before the last resort, as when it raised `ControlPlaneLost` itself. (A `ControlPlaneLost`
        raised in a communication thread reaches the training thread as it is, without passing here.)"""
        self._raised = True

    def check_reachable(self) -> None:
        """The watch thread's check (every `WATCH_SECONDS`, see the module docstring): mark the session
        cut off if the control plane has not been heard from for this rank's hang bound plus
        `MARGIN_SECONDS` (every beat is answered: it has declared this rank lost by then, and the other
        ranks go on without it), and end this process if the training thread has not raised within the
        grace period since the cut (the session's long bound once it has).

        This is the cut side of a network partition (`lightning_prague.core.client.partition`): the control
        plane's `fenced` item cannot reach it, so it stops itself, with the same exit status as a last
        resort, rather than train on apart from the others or wait on them until an operation's timeout.
        """
        link = self.client.link
        if not self.open or getattr(link, "reconnecting", False):  # the link's own bound decides meanwhile
            return
        newly = self.cut_off is None
        if newly:
            heard = max(link.last_received, self._opened)
            silent = time.monotonic() - heard
            # the bound the control plane applies: from the state of the latest beat it got, which may be
            # any sent since the control plane was last heard from (a beat takes a moment to be answered)
            hang = self.beacon.bound(self.long_bound, since=heard - BEAT_SECONDS)
            if silent <= hang + MARGIN_SECONDS:
                return
            closed = f" ({link.close_error})" if link.closed and link.close_error else ""
            self.cut(
                f"rank {self.rank} on {socket.gethostname()}: cut off from the control plane at {self.client.address}"
                f"{closed}: nothing heard from it for {silent:.1f}s, longer than this rank's hang bound ({hang:.1f}s) "
                f"plus {MARGIN_SECONDS:.0f}s. The control plane has declared this rank lost (a network partition, or "
                "the control plane's node is down) and the ranks that reach it go on without it",
                since=heard + hang + MARGIN_SECONDS,
                grace=hang,
            )
        if self.cut_off is None:
            return
        waited = time.monotonic() - self._cut_since
        limit = max(self._grace, self.long_bound) if self._raised else self._grace
        if waited <= limit:
            if newly and not link.closed:  # every wait on the control plane fails now, not at its timeout
                link.close()
            return
        doing = (
            "its fit failed but did not end"
            if self._raised
            else "its training thread did not get to a contact with the control plane (it may wait on a peer across "
            "the partition)"
        )
        message = (
            f"{self.cut_off}; {doing} within {limit:.0f}s: ending this process (exit status {FENCED_EXIT_STATUS}) "
            "so that it never trains on apart from them"
        )
        try:
            sys.stderr.write(f"lightning_prague: {message}\n")
            sys.stderr.flush()
        finally:
            os._exit(FENCED_EXIT_STATUS)

    def request(
        self, op: str, what: str, timeout: float | None = None, serve: Callable[[], None] | None = None, **fields: Any
    ) -> Any:
        return self.begin(op, what, **fields).result(timeout, serve)

    def begin(self, op: str, what: str, **fields: Any) -> SessionReply:
        """Send request `op` of this session now and take its reply later (`SessionReply.result`)."""
        self.raise_if_cut_off(what)
        self.requests += 1
        try:
            return SessionReply(self, self.client.begin({"op": op, "s": self.number, **fields}, what))
        except PragueError as err:
            lost = self._lost_plane(err, what)
            if lost is err:
                raise
            raise lost from err

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next item of this session's inbox, or `None` if none came within `timeout`."""
        try:
            item = self._inbox.get(timeout=self.timeout if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return None
        if item is _CLOSED:
            self._inbox.put(_CLOSED)
            raise self.plane_lost("a wait for the control plane's next item")
        if item["t"] == "left_out":  # kept for every later wait: this rank is out of the fit
            self._inbox.put(item)
            raise self.left_out_error("a wait for the control plane's next item")
        return item

    def verdict(
        self,
        key: str,
        members: Sequence[int],
        complete: bool,
        operation: str,
        timeout: float | None = None,
        epoch: int | None = None,
    ) -> bool:
        """Whether group collective `key` among `members` takes effect on every member: this rank
        reports its own completeness (`complete`) and waits for the control plane's verdict, the
        same for every member (`lightning_prague.core.plane.verdicts`). A `Decide` of a group sum.

        `epoch`: the membership epoch the control plane drew the members in (a member readmitted since
        then is another process, which never takes part: its earlier one counts as lost).
        Raises `CoordinationTimeout` naming the members and `operation` if no verdict came within
        `timeout` (default: the session's), and `ControlPlaneLost` once the control plane is lost.
        """
        self._rejected = None
        drawn = {} if epoch is None else {"epoch": int(epoch)}
        self.send("summed", key=key, members=[int(m) for m in members], ok=bool(complete), **drawn)
        limit = self.timeout if timeout is None else timeout
        late = (
            f"the control plane gave no verdict on {operation} over ranks {list(members)} within {limit:.0f}s (a "
            "member neither reported its sum nor was declared lost)"
        )
        applied = self._answer(self._verdicts, key, f"the verdict on {operation}", limit, late)
        log.debug("rank %d: %s (%s): complete here %s, verdict %s", self.rank, operation, key, complete, applied)
        return applied

    def _new_epoch(self, item: Message) -> None:
        """The reader thread: a `members` or `admit` item opened membership epoch `epoch`: the ranks it
        admitted are members again, and the training thread follows it (`take_admissions`)."""
        epoch, members = int(item["epoch"]), tuple(int(r) for r in item["members"])
        self.epochs[epoch] = members
        for old in [e for e in self.epochs if e < epoch - 8]:  # (retired long ago)
            del self.epochs[old]
        for rank in item.get("joined", ()):
            self.admitted_in[int(rank)] = epoch
            why = self.departed.pop(int(rank), None)
            when = self.departed_at.pop(int(rank), None)
            if why is not None:  # (a free place that a new worker took was never a member)
                self.rejoined[int(rank)] = (when or 0.0, why)
        self.members = list(members)
        if item["t"] == "members":
            with self._verdict_ready:
                self._admissions.append(item)
        # (last: whoever reads it here finds the epoch's members, departures and admission taken in)
        self.announced_epoch = max(self.announced_epoch, epoch)
        if item["t"] == "members":
            if item.get("joined"):
                log.warning("rank %d: ranks %s rejoined the job; members %s", self.rank, item["joined"], self.members)
            else:  # (a control plane that took the job back: its store is new)
                log.warning("rank %d: membership epoch %d, members %s, in the new store", self.rank, epoch, members)

    def departed_for(self, epoch: int) -> set[int]:
        """The ranks gone from membership epoch `epoch`'s group: those that departed, and those whose
        process now is one admitted in a later epoch (the process of that group died; the new one is
        never in it). What a wait on that group's peers gives up on (a pair's first connect)."""
        later = {rank for rank, admitted in list(self.admitted_in.items()) if admitted > epoch}
        return set(self.departed) | later

    def take_admissions(self, inside_only: bool = False) -> list[Message]:
        """The `members` items (admissions) that came since the last call, oldest first; `inside_only`:
        not those admitted in a meeting's release (`at`), which stay for a later call."""
        with self._verdict_ready:
            taken = [item for item in self._admissions if not (inside_only and "at" in item)]
            self._admissions = [item for item in self._admissions if inside_only and "at" in item]
        return taken

    def round_members(
        self, key: str, round_index: int, slots: Sequence[int], operation: str, start: bool = False
    ) -> Message:
        """The control plane's answer on gossip round `round_index` of the schedule's group `key`
        (`slots`): which of them take part and in which membership epoch (`GroupGenerator.round_members`);
        `start`: the round this rank, admitted inside a phase, takes up gossip at. Bounded as `verdict` is."""
        self._rejected = None
        fields: dict[str, Any] = {"start": True} if start else {"slots": [int(r) for r in slots]}
        self.send("round", key=key, round=int(round_index), **fields)
        late = f"the control plane named no members of {operation} within {self.timeout:.0f}s"
        return self._answer(self._round_answers, key, f"the members of {operation}", self.timeout, late)

    def _answer(self, answers: dict[str, Any], key: str, waiting_for: str, limit: float, late: str) -> Any:
        """The control plane's answer `key`, taken from `answers` (the reader thread puts it there), waited
        for at most `limit` s (`CoordinationTimeout` with `late`); it ends at once when the control plane
        is lost, this rank is left out, or one of its messages was rejected."""
        deadline = time.monotonic() + limit
        with self.beacon.waiting(), self._verdict_ready:
            while key not in answers:
                if self._gone():
                    raise self.plane_lost(waiting_for)
                if self.left_out is not None:  # the others decide without it: no answer comes here
                    raise self.left_out_error(waiting_for)
                if self._rejected is not None:
                    raise ControlPlaneError(f"rank {self.rank}: {self._rejected}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CoordinationTimeout(f"rank {self.rank}: {late}")
                self._verdict_ready.wait(min(remaining, WATCH_SECONDS))
            return answers.pop(key)

    def await_admission(self, timeout: float) -> Message:
        """A rejoining rank: wait (at most `timeout` s) for its admission (at once, after the members'
        meeting, or at their epoch's end: `GroupGenerator`'s `Rejoining`), and return the admission
        item: the membership epoch, its members, the donor, the members of the last meeting (`base`),
        `at` (the meeting it was admitted in, if any) and `position`, where its rank stood in its shard
        of the epoch if it reported it. Raises `ControlPlaneError` with the control plane's reason if it
        cannot rejoin (`FitEnded` if the fit ended; it is stopping, runs another configuration) and
        `CoordinationTimeout` if the members did not meet in time."""
        item = self._next(f"its admission to the fit it rejoins (up to {timeout:.0f}s)", timeout)
        while item["t"] != "admit":
            if item["t"] == "error" and item.get("ended") is True:
                raise FitEnded(f"rank {self.rank}: {item.get('message')}")
            if item["t"] == "error":
                raise ControlPlaneError(f"rank {self.rank}: {item.get('message')}")
            item = self._next("its admission to the fit", timeout)
        return item

    def meet(self, name: str, timeout: float, **report: Any) -> Message:
        """Arrive at meeting `name` and return its release (for a rank that runs no groups yet: a
        joiner at its admission and the rebuild of the process group that follows it)."""
        self.send("arrive", sync=name, **report)
        while True:
            item = self._next(f"the other ranks at {name!r}", timeout)
            if item["t"] == "release" and item["sync"] == name:
                return item
            if item["t"] == "error":
                error = FitEnded if item.get("ended") is True else ControlPlaneError
                raise error(f"rank {self.rank}: {item.get('message')} (at {name!r})")

    def _next(self, what: str, timeout: float) -> Message:
        with self.beacon.waiting():
            if self._rejected is not None:
                raise ControlPlaneError(f"rank {self.rank}: {self._rejected}")
            item = self.receive(timeout)
        if item is None:
            if self._rejected is not None:
                raise ControlPlaneError(f"rank {self.rank}: {self._rejected}")
            raise CoordinationTimeout(f"rank {self.rank}: waited {timeout:.0f}s for {what}")
        return item

    def post(self, item: Message) -> None:
        """Put `item` at the end of this rank's inbox, behind everything the coordinator already sent it."""
        self.client.send({"op": "echo", "rank": self.rank, "item": {**item, "s": self.number}})

    def lost_error(self, during: str) -> MemberLost:
        """The error a rank raises when members departed (naming them and why)."""
        # in the order the control plane saw them go: the first is the cause, later ones may have followed it
        departed = dict(self.departed)  # a snapshot: the reader thread adds to it (cascading losses)
        names = "; ".join(f"rank {r}: {why}" for r, why in departed.items())
        return MemberLost(
            f"rank {self.rank}: rank{'s' if len(departed) > 1 else ''} {list(departed)} left the job "
            f"during {during} ({names}); this job cannot go on without them"
        )

    def explain(self, error: BaseException, during: str, wait: float = 2.0) -> BaseException:
        """The error to raise for `error` (a failed exchange): `MemberLost` if a member departed (the
        control plane's notice may trail the failed connection by a moment: wait up to `wait` s), or
        `ControlPlaneLost` once the control plane is lost (no notice will come)."""
        if self._gone():
            lost = self.plane_lost(during)
            lost.__cause__ = error
            return lost
        if self._departure.wait(wait):
            lost = self.lost_error(during)
            lost.__cause__ = error
            return lost
        return error

    def check_members(self, during: str) -> None:
        """Raise `ControlPlaneLost` if the control plane is lost (ranks that left are no error: the
        survivors go on without them)."""
        self.raise_if_cut_off(during)

    def close(self, failed: bool = False) -> None:
        """This rank is done with the session: its fit ended normally, or (`failed`) it gives up on the
        fit after an error (it departs at once: nobody waits for it)."""
        if self.open:
            self.open = False
            self._watching.set()
            self.beacon.stop()
            try:
                self.send("close", **({"failed": True} if failed else {}))
            except CoordinationTimeout:
                pass
            self.client.forget(self)


class Counters:
    """A key-value table in the coordinator's session, with TCPStore's interface (what we use of it).

    Values are kept as the coordinator got them; `get` returns bytes, as TCPStore does.
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        #: called while a claim waits at an emptied queue: the exchanges the training thread runs
        #: itself (a blocking exchanger's groups), which its peers would otherwise wait for
        self.serve: Callable[[], None] | None = None

    def _kv(self, do: str, what: str, timeout: float | None = None, **fields: Any) -> Any:
        return self.session.request("kv", what, timeout, do=do, **fields)

    def add(self, key: str, amount: int) -> int:
        return int(self._kv("add", f"the counter {key!r}", key=key, amount=int(amount)))

    def begin_add(self, key: str, amount: int) -> Callable[[], int]:
        """`add`, sent now; call what it returns for the counter's new value (the round trip overlaps the
        caller's work: a batch's global-progress ticket claimed a batch ahead)."""
        reply = self.session.begin("kv", f"the counter {key!r}", do="add", key=key, amount=int(amount))
        return lambda: int(reply.result())

    def begin_claim(
        self,
        cursor: str,
        first: int,
        tickets: str | None = None,
        ticketed: int = 0,
        num: int | None = None,
        chunk: int | None = None,
        set_aside: tuple[Sequence[int], Sequence[int]] | None = None,
        park: bool = False,
        standby: bool = False,
        follow: tuple[int, int] | None = None,
        reports: bool = False,
    ) -> ClaimInFlight:
        """A claim on the work queue, sent now, its answer taken later (`ClaimInFlight.result`), so that
        the control plane's round trip overlaps this rank's training: the queue's next chunk (`first`
        plus the claims of `cursor` so far; or `chunk`, one a resumed checkpoint handed to this rank)
        and, if `tickets` is given and the chunk is below `ticketed`, the next value of the `tickets`
        counter with it (one message for a batch's data and its global-progress ticket). The control
        plane holds the chunk for this rank until it reports it trained (`report`). `num`: the queue's
        length; `set_aside`: on this rank's first claim of an epoch, the members and the chunk each
        started the epoch with (`lightning_prague.core.plane.work`); `park`: at an emptied queue, wait
        while a live member may still give chunks back, serving `serve` meanwhile
        (`lightning_prague.core.plane.queue_end`); `standby`: this rank left the epoch's tail, and its
        claim waits (parked) until nobody else will take the queue's rest, then gets a chunk of it (or
        one a lost member gave back), else the queue's end. `follow`: `(leader, n)`, this rank is a
        follower in a replica group and claims nothing itself: the answer is the `n`-th (from 0) that
        `leader`'s claims on `cursor` got, the same `[chunk, ticket]`, waited for as long as the leader's
        claim may be parked; the other fields are not used then. It fails at once (`ControlPlaneError`)
        if the leader leaves the job, or is not a live member. `reports`: this rank trains and reports
        the chunks it holds while the claim waits at the queue's end (it takes the answer only after
        them), so the others' parked claims wait for those chunks too."""
        what = f"a claim on the work queue {cursor!r}"
        fields: dict[str, Any] = {"key": cursor, "first": first, "tickets": tickets, "ticketed": ticketed}
        if num is not None:
            fields["num"] = num
        if chunk is not None:
            fields["chunk"] = chunk
        if set_aside is not None:
            fields["members"], fields["preset"] = list(set_aside[0]), list(set_aside[1])
        if park or standby:
            # at an emptied queue the claim waits while a member may still give chunks back, as long as
            # the epoch's closing meeting would wait for it (`lightning_prague.core.plane.queue_end`)
            fields["park"] = True
            what = f"{what} (at the queue's end)"
        if standby:
            fields["standby"] = True
            what = f"{what}, standing by at the epoch's tail"
        if reports and (park or standby):
            fields["reports"] = True
        if follow is not None:
            leader, n = int(follow[0]), int(follow[1])
            fields["follow"] = [leader, n]
            what = f"{what}, following answer {n} of rank {leader} (the leader of its replica)"
        # a follow waits as long as its leader's claim may be parked: it is treated as parked
        parked = park or standby or follow is not None
        return ClaimInFlight(self, self.session.begin("kv", what, do="claim", **fields), parked)

    def give_back(self, cursor: str, shard: int, position: int) -> bool:
        """Offer the rest of `shard` of the queue `cursor`, which this rank holds, from `position` (a slow
        rank at a stream's tail): True if it went back to the queue for a claimer (this rank holds it no
        more, and claims no more from that queue), False if nobody would read it (this rank keeps it)."""
        what = f"giving shard {shard} of {cursor!r} back"
        return bool(self._kv("give_back", what, key=cursor, shard=int(shard), position=int(position)))

    def report(
        self,
        cursor: str,
        hold: Sequence[int] = (),
        tickets: Sequence[int | None] = (),
        done: Sequence[int] = (),
        end: bool = False,
        back: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Tell the control plane, without waiting, of chunks of the queue `cursor` this rank now holds
        (with the claim values of their `tickets`), has trained (`done`) or gives back untrained from a
        position (`back`: `(shard, position)`); `end`: it claims no more from that queue (it left the
        epoch's tail)."""
        fields: dict[str, Any] = {"key": cursor}
        if end:
            fields["end"] = True
        if back:
            fields["back"] = [[int(chunk), int(position)] for chunk, position in back]
        if hold:
            fields["hold"], fields["tickets"] = list(hold), list(tickets)
        if done:
            fields["done"] = list(done)
        self.session.send("work", **fields)

    def set(self, key: str, value: str | bytes) -> None:
        self._kv("set", f"setting {key!r}", key=key, value=_text(value))

    def get(self, key: str) -> bytes:
        return str(self._kv("get", f"reading {key!r}", key=key)).encode()

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        seconds = None if timeout is None else timeout.total_seconds()
        for key in keys:
            self._kv("get", f"waiting for {key!r}", seconds, key=key)

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._kv("check", f"checking {list(keys)}", keys=list(keys)))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        value = self._kv(
            "cas", f"compare-and-set of {key!r}", key=key, expected=_text(expected), desired=_text(desired)
        )
        return str(value).encode()

    def delete_key(self, key: str) -> bool:
        return bool(self._kv("delete", f"deleting {key!r}", key=key))

    def num_keys(self) -> int:
        return int(self._kv("keys", "counting the keys"))


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ClaimInFlight:
    """A claim on the work queue sent and not yet answered (`Counters.begin_claim`)."""

    def __init__(self, counters: Counters, reply: SessionReply, park: bool) -> None:
        self.counters = counters
        self.reply = reply
        self.park = park

    def result(self) -> tuple[int, int | None]:
        """The claimed chunk and its ticket (`None`: none). A claim that may park waits as long as the
        epoch's closing meeting would (the session's long bound), serving `Counters.serve`, and counts
        as waiting for the hang detector."""
        if not self.park:
            claimed, ticket = self.reply.result()
        else:
            session = self.counters.session
            with session.beacon.waiting():
                claimed, ticket = self.reply.result(session.long_bound, self.counters.serve)
        return int(claimed), None if ticket is None else int(ticket)

    def answered(self) -> bool:
        """Whether the control plane answered the claim (one that waits at an emptied queue has not)."""
        return self.reply.pending.answered()


class SessionReply:
    """A session's request in flight (`Session.begin`): the control plane's loss as `ControlPlaneLost`."""

    def __init__(self, session: Session, pending: PendingReply) -> None:
        self.session = session
        self.pending = pending

    def result(self, timeout: float | None = None, serve: Callable[[], None] | None = None) -> Any:
        try:
            return self.pending.result(timeout, serve)
        except PragueError as err:
            lost = self.session._lost_plane(err, self.pending.what)
            if lost is err:
                raise
            raise lost from err


class PendingReply:
    """A request sent and not yet answered (`ControlClient.begin`); `result` waits for its reply."""

    def __init__(self, client: ControlClient, req: int, waiter: queue.Queue[Message], what: str) -> None:
        self.client = client
        self.req = req
        self.what = what
        self._waiter = waiter

    def answered(self) -> bool:
        """Whether the reply came (and `result` has not taken it yet)."""
        return not self._waiter.empty()

    def result(self, timeout: float | None = None, serve: Callable[[], None] | None = None) -> Any:
        """The reply's value, waited for at most `timeout` s (default: the client's), calling `serve`
        every few milliseconds meanwhile; `CoordinationTimeout` naming the request if none came, and
        the control plane's rejection or the lost link as errors."""
        client, what = self.client, self.what
        limit = client.timeout if timeout is None else timeout
        try:
            reply = self._waiter.get(timeout=limit) if serve is None else _serving(self._waiter, limit, serve)
        except queue.Empty:
            client._forget_reply(self.req)
            raise CoordinationTimeout(
                f"rank {client.rank}: the control plane at {client.address} did not answer {what} within {limit:.0f}s"
            ) from None
        except BaseException:  # `serve` failed: nobody waits for the reply any more
            client._forget_reply(self.req)
            raise
        if "error" in reply:
            if reply.get("source") == CONTROL_PLANE:  # its handler rejected the request
                raise ControlPlaneError(f"rank {client.rank}: {what} failed: {reply['error']}")
            raise (
                client.link.closed_error(what)
                if client.link.closed
                else CoordinationTimeout(f"rank {client.rank}: {what} failed: {reply['error']}")
            )
        return reply.get("value")


def _serving(waiter: queue.Queue[Message], limit: float, serve: Callable[[], None]) -> Message:
    """`waiter`'s message within `limit` seconds, calling `serve` every few milliseconds meanwhile."""
    deadline = time.monotonic() + limit
    while True:
        try:
            return waiter.get(timeout=max(0.0, min(0.005, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                raise
        serve()
