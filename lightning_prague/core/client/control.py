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
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lightning_prague.core.auth import Credentials
from lightning_prague.core.client.beacon import Beacon
from lightning_prague.core.client.link import MessageLink
from lightning_prague.core.client.partition import FENCED_EXIT_STATUS, MARGIN_SECONDS, drop_connections, own_addresses
from lightning_prague.core.errors import CONTROL_PLANE, ControlPlaneError, CoordinationTimeout, MemberLost
from lightning_prague.core.protocol import ALIVE, BEAT_SECONDS, ROUTED, HangRule, Message, SessionConfig

log = logging.getLogger(__name__)

_CLOSED: Message = {"t": "__closed__"}


class ControlClient:
    """This process's connection to the control plane (see the module docstring)."""

    def __init__(self, host: str, port: int, rank: int, timeout: float, credentials: Credentials) -> None:
        self.rank = rank
        self.timeout = timeout
        self.address = f"{host}:{port}"
        #: the supervisor's process id (as it published it with its address)
        self.supervisor_pid = 0
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
        with self._lock:
            waiters, self._replies = list(self._replies.values()), {}
        for waiter in waiters:
            waiter.put({"t": "reply", "error": error})
        for session in list(self._sessions.values()):
            session.deliver(_CLOSED)

    # -- requests ------------------------------------------------------------------------------
    def send(self, message: Message) -> None:
        self.link.send(message)

    def request(self, message: Message, what: str, timeout: float | None = None) -> Any:
        """Send `message` with a fresh `req` number and return the reply's value."""
        req = next(self._req)
        waiter: queue.Queue[Message] = queue.Queue(maxsize=1)
        with self._lock:
            if self.link.closed:
                raise self.link.closed_error(what)
            self._replies[req] = waiter
        self.link.send({**message, "req": req, "rank": self.rank})
        limit = self.timeout if timeout is None else timeout
        try:
            reply = waiter.get(timeout=limit)
        except queue.Empty:
            with self._lock:
                self._replies.pop(req, None)
            raise CoordinationTimeout(
                f"rank {self.rank}: the control plane at {self.address} did not answer {what} within {limit:.0f}s"
            ) from None
        if "error" in reply:
            if reply.get("source") == CONTROL_PLANE:  # its handler rejected the request
                raise ControlPlaneError(f"rank {self.rank}: {what} failed: {reply['error']}")
            raise (
                self.link.closed_error(what)
                if self.link.closed
                else CoordinationTimeout(f"rank {self.rank}: {what} failed: {reply['error']}")
            )
        return reply.get("value")

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, number: int, config: SessionConfig) -> Session:
        """Join session `number` (one fit); every rank of the session must join it with the same config."""
        # the control plane's hang detector uses the longer of the two as the bound of a busy worker
        long_bound = max(config.timeout, config.sync_timeout or 0.0)
        session = Session(self, number, config.world_size, Beacon(config.hang), long_bound)
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
            }
        )
        session.beacon.start(
            lambda fields: session.send("beat", **fields),
            f"prague-control-beacon-{self.rank}",
            watch=session.check_reachable,
        )
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
        #: the ranks still in the job, as of the latest departure notice
        self.members: list[int] = list(range(world_size))
        #: `None`, or why the job is stopping (`"sigterm"`, `"request"`), as soon as it is announced
        self.stop_reason: str | None = None
        self.counters = Counters(self)
        self.open = True
        self._departure = threading.Event()
        #: requests this rank sent in the session (work-queue claims, tickets, ...), for tests and monitors
        self.requests = 0

    def deliver(self, item: Message) -> None:
        """Called by the reader thread for every item of this session."""
        kind = item["t"]
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
        elif kind == "fenced":  # declared hung: end this process, as a local one would be SIGKILLed
            log.error("rank %d: the control plane fenced this rank (%s); exiting", self.rank, item.get("reason"))
            os._exit(FENCED_EXIT_STATUS)
        elif kind == "stop" and (self.stop_reason is None or item.get("reason") == "requeue"):
            self.stop_reason = str(item.get("reason", "sigterm"))
            log.debug("rank %d: the job is stopping (%s)", self.rank, self.stop_reason)
        self._inbox.put(item)

    def send(self, op: str, **fields: Any) -> None:
        self.client.send({"op": op, "s": self.number, "rank": self.rank, **fields})

    def check_reachable(self) -> None:
        """End this process if the control plane has not been heard from for this rank's hang bound
        plus `MARGIN_SECONDS` (called by the beacon thread before each beat, and every beat is
        answered): it has declared this rank lost by then, and the other ranks go on without it.

        This is the cut side of a network partition (`lightning_prague.core.client.partition`): the control
        plane's `fenced` item cannot reach it, so it fences itself, with the same exit status, rather
        than train on apart from the others or wait on them until an operation's timeout.
        """
        link = self.client.link
        if not self.open:
            return
        heard = max(link.last_received, self._opened)
        silent = time.monotonic() - heard
        # the bound the control plane applies: from the state of the latest beat it got, which may be
        # any sent since the control plane was last heard from (a beat takes a moment to be answered)
        hang = self.beacon.bound(self.long_bound, since=heard - BEAT_SECONDS)
        if silent <= hang + MARGIN_SECONDS:
            return
        # a closed connection fails a wait on the control plane at once; this ends a rank that waits on
        # something else (an exchange with a peer across the partition) too
        closed = f" ({link.close_error})" if link.closed and link.close_error else ""
        message = (
            f"rank {self.rank} on {socket.gethostname()}: cut off from the control plane at {self.client.address}"
            f"{closed}: nothing heard from it for {silent:.1f}s, longer than this rank's hang bound ({hang:.1f}s) plus "
            f"{MARGIN_SECONDS:.0f}s. The control plane has declared this rank lost (a network partition, or the "
            f"control plane's node is down) and the ranks that reach it go on without it; ending this process "
            f"(exit status {FENCED_EXIT_STATUS}) so that it never trains on apart from them"
        )
        try:
            sys.stderr.write(f"lightning_prague: {message}\n")
            sys.stderr.flush()
        finally:
            os._exit(FENCED_EXIT_STATUS)

    def request(self, op: str, what: str, timeout: float | None = None, **fields: Any) -> Any:
        self.requests += 1
        return self.client.request({"op": op, "s": self.number, **fields}, what, timeout)

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next item of this session's inbox, or `None` if none came within `timeout`."""
        try:
            item = self._inbox.get(timeout=self.timeout if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return None
        if item is _CLOSED:
            self._inbox.put(_CLOSED)
            raise self.client.link.closed_error()
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
        control plane's notice may trail the failed connection by a moment: wait up to `wait` s)."""
        if self._departure.wait(wait):
            lost = self.lost_error(during)
            lost.__cause__ = error
            return lost
        return error

    def check_members(self, during: str) -> None:
        """Raise `CoordinationTimeout` (`ControlPlaneError` if it failed) if the control plane is gone
        (ranks that left are no error: the survivors go on without them)."""
        if self.client.closed:
            raise self.client.link.closed_error(during)

    def close(self) -> None:
        """This rank is done with the session (its fit ended normally)."""
        if self.open:
            self.open = False
            self.beacon.stop()
            try:
                self.send("close")
            except CoordinationTimeout:
                pass
            self.client.forget(self)


class Counters:
    """A key-value table in the coordinator's session, with TCPStore's interface (what we use of it).

    Values are kept as the coordinator got them; `get` returns bytes, as TCPStore does.
    """

    def __init__(self, session: Session) -> None:
        self.session = session

    def _kv(self, do: str, what: str, timeout: float | None = None, **fields: Any) -> Any:
        return self.session.request("kv", what, timeout, do=do, **fields)

    def add(self, key: str, amount: int) -> int:
        return int(self._kv("add", f"the counter {key!r}", key=key, amount=int(amount)))

    def claim(
        self,
        cursor: str,
        first: int,
        tickets: str | None = None,
        ticketed: int = 0,
        held: Sequence[int] = (),
        num: int | None = None,
    ) -> tuple[int, int | None]:
        """The work queue's next chunk (`first` plus the claims of `cursor` so far) and, if `tickets`
        is given and the chunk is below `ticketed`, the next value of the `tickets` counter with it:
        one message for a batch's data and its global-progress ticket. `held`: the chunks this rank
        holds untrained (they go back to the queue if it is lost); `num`: the queue's length."""
        what = f"a claim on the work queue {cursor!r}"
        fields: dict[str, Any] = {"key": cursor, "first": first, "tickets": tickets, "ticketed": ticketed}
        if held:
            fields["held"] = list(held)
        if num is not None:
            fields["num"] = num
        chunk, ticket = self._kv("claim", what, **fields)
        return int(chunk), None if ticket is None else int(ticket)

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
