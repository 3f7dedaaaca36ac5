"""The control plane's message transport: one TCP connection per process, newline-delimited JSON.

Every training process keeps one connection to the control plane (the supervisor process,
`lightning_prague.core.plane.supervisor`) for as long as it lives. A message is
one JSON object on one line. The server handles everything that arrived on any connection in one
pass of its event loop, in arrival order, and sends each worker what that pass produced for it
in one write: under load, requests and replies are batched by the transport itself, so the cost
per request is a few microseconds of parsing rather than a synchronous round trip.

Why not the TCPStore that every job already has: its queues serve one item per round trip, and
the coordinator needed about four of them per request (pop the request, push each member's
items), which capped it near 3k requests/s. The store only carries the server's address.

The server is `MessageServer` (one thread, `selectors`); it tells its owner when a rank connects
and when a rank's connection closes (a process that ends, however it ends, closes its sockets: this
is how the control plane sees a lost worker within milliseconds). The client is `MessageLink`: a
reader thread takes every line off the socket as it arrives and hands it to a router, so a
worker learns of a departure or a stop even while no thread of it waits on the link.

Anyone who reaches the port may connect, so the server trusts nothing a connection sends: the
connection first proves that it belongs to this launch (`lightning_prague.core.auth`; one line of
at most `MAX_HELLO_BYTES` within `HELLO_SECONDS`, at most `MAX_UNPROVEN` such connections at once),
which binds its rank to it; then every line must be a record of the protocol
(`lightning_prague.core.protocol.decode_message`) in that rank's own name. Anything else costs that
connection only (`_refuse`, logged with its peer's address); what the messages mean is the
handler's business.
"""

from __future__ import annotations

import errno
import logging
import resource
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from lightning_prague.core.auth import Credentials, new_nonce, proof_holds
from lightning_prague.core.protocol import (
    CHALLENGE,
    FAILED,
    HELLO,
    MAX_HELLO_BYTES,
    MAX_RANK,
    RECV_BYTES,
    REFUSED,
    WELCOME,
    BadMessage,
    Message,
    decode_message,
    encode_line,
    tune_socket,
)

log = logging.getLogger(__name__)


#: `handler(message) -> {rank: [item, ...]}`: the items to send, per rank, in order
Handler = Callable[[Message], dict[int, list[Message]]]
#: `on_disconnect(rank)`: the items to send, per rank, in order
RankEvent = Callable[[int], dict[int, list[Message]]]
#: `on_connect(rank, hello)`: the same, for a rank whose connection proved who it is (its `hello`)
ConnectEvent = Callable[[int, Message], dict[int, list[Message]]]


#: the longest line a connection may send, bytes: a longer one costs its sender the connection
MAX_LINE_BYTES = 1 << 20
#: the most a connection may have queued for it unread, bytes (a reader that never reads): past it the
#: connection is dropped, as if its process had ended
MAX_PENDING_BYTES = 256 << 20
#: seconds a connection may take to prove it belongs to the job (`lightning_prague.core.auth`)
HELLO_SECONDS = 10.0
#: connections that have not proved it yet, at most: past it the oldest of them is dropped (a quarter
#: of the process's descriptor limit, if that is less: `unproven_bound`)
MAX_UNPROVEN = 1024
#: connections accepted per pass of the event loop, at most: a flood of connections cannot starve the
#: ranks' beats and messages
ACCEPTS_PER_PASS = 64
#: seconds the server stops accepting when this process is out of descriptors and no unproven
#: connection is left to drop (the connections already there are served meanwhile)
ACCEPT_PAUSE_SECONDS = 0.1
#: the most bytes of items queued for a rank that has not connected yet: past it they are dropped
MAX_WAITING_BYTES = 4 << 20
#: items after which the server closes the rank's connection once they are written (best effort): a
#: fenced process, which may be frozen and never close it, holds its rank no longer
CLOSING_ITEMS = frozenset({"fenced"})
#: `accept` errors that mean this process (or the machine) is out of descriptors or memory for now
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
#: dropped connections logged as warnings per window of seconds (the rest at debug level, then counted)
REFUSALS_LOGGED, REFUSALS_WINDOW = 20, 60.0

__all__ = ["MAX_RANK", "BadMessage", "MessageServer", "decode_message", "raise_descriptor_limit", "unproven_bound"]


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit of open descriptors to its hard limit (a plane serves many
    connections; the common soft limit, 1024, is what a flood exhausts first). Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as err:
            log.debug("could not raise the descriptor limit from %d to %d: %s", soft, hard, err)
    return soft


def unproven_bound() -> int:
    """How many unproven connections the server keeps at once: `MAX_UNPROVEN`, or a quarter of the
    descriptor limit if that is less (the rest stays for the ranks' connections, the store and files)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return MAX_UNPROVEN
    return max(4, min(MAX_UNPROVEN, soft // 4))


@dataclass
class _Connection:
    sock: socket.socket
    peer: str = "?"
    #: the challenge's nonce (see `lightning_prague.core.auth`) and when the connection must have answered it
    nonce: str = ""
    deadline: float = 0.0
    #: the connection's two ends, (address, port), for fencing its process (`lightning_prague.core.plane.fencing`)
    client: tuple[str, int] = ("", 0)
    server: tuple[str, int] = ("", 0)
    rank: int | None = None  # set once it proved who it is (its `hello`)
    closed: bool = False
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    writing: bool = False  # registered for EVENT_WRITE because the kernel buffer was full
    closing: bool = False  # closed once what is queued for it is written (`CLOSING_ITEMS`)


class MessageServer:
    """Serves `MessageLink` clients from one thread; `handler` turns each message into items.

    `handler` runs in the server thread, one message at a time, in the order messages arrived
    (per connection, the order they were sent), so whatever it decides has one global order.
    Items for a rank are written to that rank's connection in the order they were produced; items
    for a rank that has not connected yet wait for it. The `echo` op (`{"op": "echo", "rank",
    "item"}`) puts `item` behind everything already sent to `rank`: a thread can wake itself.
    """

    def __init__(
        self,
        handler: Handler,
        host: str,
        credentials: Credentials,
        name: str = "prague-coordinator",
        port: int = 0,
        on_connect: ConnectEvent | None = None,
        on_disconnect: RankEvent | None = None,
        on_tick: Callable[[], dict[int, list[Message]]] | None = None,
        tick_seconds: float = 0.25,
        before_send: Callable[[], None] | None = None,
        decode: Callable[[bytes], Message] = decode_message,
    ) -> None:
        self.handler = handler
        self.credentials = credentials
        #: a line after the hello as a message, or `BadMessage` (the protocol's records; a test of the
        #: transport alone may pass its own)
        self.decode = decode
        #: called every `tick_seconds` in the server thread; its items are sent like a handler's
        self.on_tick = on_tick
        self.tick_seconds = tick_seconds
        #: called in each pass of the loop before anything it produced is written (the journal's flush)
        self.before_send = before_send
        self._next_tick = 0.0
        self.name = name
        self.on_connect = on_connect
        self.on_disconnect = on_disconnect
        #: ranks with an open connection now, and every rank that ever connected
        self.connected: set[int] = set()
        self.ever_connected: set[int] = set()
        #: connections that proved who they are, since the server started
        self.hellos = 0
        #: items dropped because their rank's process was gone (or never came, past the queue's bound)
        self.messages_dropped = 0
        self.messages_in = 0
        self.messages_out = 0
        #: connections dropped for breaking the protocol (`_refuse`)
        self.refused = 0
        self.writes = 0  # socket writes (one per rank and pass of the loop, unless the kernel buffer fills)
        self.error: BaseException | None = None
        self._listener = self._listen(host, port)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._wake_r, self._wake_w = socket.socketpair()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._by_rank: dict[int, _Connection] = {}
        self._waiting: dict[int, bytearray] = {}  # items for ranks that have not connected yet
        self._overflowed: set[int] = set()  # ranks whose waiting items passed `MAX_WAITING_BYTES` (logged once)
        self._dropped: list[int] = []  # ranks whose connection closed in this pass of the loop
        self._unproven: OrderedDict[int, _Connection] = OrderedDict()  # by id, oldest first
        self.max_unproven = unproven_bound()
        self._accept_paused_until = 0.0  # out of descriptors: the listener is not watched until then
        self._refusals_since, self._refusals_logged, self._refusals_unlogged = 0.0, 0, 0

    def ends(self, rank: int) -> tuple[tuple[str, int], tuple[str, int]] | None:
        """`(client, server)` addresses of `rank`'s connection, while it is connected."""
        conn = self._by_rank.get(rank)
        return None if conn is None else (conn.client, conn.server)

    @staticmethod
    def _listen(host: str, port: int) -> socket.socket:
        """Listen on `host` (`""`: every interface); raises `OSError` if `host` is not an address of
        this machine (the supervisor decides what then, see `lightning_prague.core.plane.supervisor`)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.create_server((host, port), backlog=4096, family=family)
        listener.setblocking(False)
        return listener

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread and close every connection; safe to call twice."""
        if self._thread is None:
            return
        self._closing.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._thread.join(timeout)
        self._thread = None

    # -- the event loop ---------------------------------------------------------------------------
    def _serve(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, None)
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        try:
            while not self._closing.is_set():
                arrived: list[tuple[_Connection, Message]] = []
                for key, mask in selector.select(timeout=self.tick_seconds if self.on_tick else 1.0):
                    if key.fileobj is self._listener:
                        self._accept(selector)
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    else:
                        conn: _Connection = key.data
                        if mask & selectors.EVENT_WRITE:
                            self._flush(selector, conn)
                        if mask & selectors.EVENT_READ and not conn.closed:
                            self._read(selector, conn, arrived)
                self._expire_unproven(selector)
                self._resume_accepting(selector)
                touched: dict[int, _Connection] = {}
                for conn, message in arrived:
                    self._dispatch(selector, conn, message, touched)
                while self._dropped:
                    rank = self._dropped.pop(0)
                    if self.on_disconnect is not None and rank not in self.connected:
                        self._route(self._guarded(self.on_disconnect, rank), touched)
                if self.on_tick is not None and time.monotonic() >= self._next_tick:
                    self._next_tick = time.monotonic() + self.tick_seconds
                    self._route(self._guarded(self.on_tick), touched)
                if touched and self.before_send is not None:
                    self.before_send()  # (an error here stops the server: nothing it cannot explain is sent)
                for conn in touched.values():
                    self._flush(selector, conn)
        except BaseException as err:  # every client is told why before its connection closes
            self.error = err
            log.exception("%s stopped", self.name)
            self._tell_everyone_it_failed(selector, err)
        finally:
            for key in list(selector.get_map().values()):
                try:
                    key.fileobj.close()  # type: ignore[union-attr]
                except OSError:
                    pass
            selector.close()
            self._wake_w.close()

    def _tell_everyone_it_failed(self, selector: selectors.BaseSelector, err: BaseException) -> None:
        """Best effort, a second at most per client: each learns the server's error at once (rather
        than a bare closed connection) and fails with it."""
        line = encode_line({"t": FAILED, "error": f"{type(err).__name__}: {err}"})
        for key in list(selector.get_map().values()):
            conn = key.data
            if not isinstance(conn, _Connection):
                continue
            try:
                conn.sock.settimeout(1.0)
                conn.sock.sendall(bytes(conn.outbuf) + line)
            except OSError:
                pass

    def _accept(self, selector: selectors.BaseSelector) -> None:
        """Accept what waits, at most `ACCEPTS_PER_PASS` connections. Out of descriptors, the oldest
        unproven connection makes room; with none, accepting pauses a moment. No accept error stops
        the server: a flood costs the flood's connections, never the ranks'."""
        for _ in range(ACCEPTS_PER_PASS):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno not in _EXHAUSTED:  # e.g. ECONNABORTED: that connection is gone, not the server
                    log.debug("%s: accept failed: %s", self.name, err)
                    continue
                if self._unproven:
                    _, oldest = self._unproven.popitem(last=False)
                    self._refuse(selector, oldest, f"the server is out of descriptors ({err.strerror})")
                    continue
                self._pause_accepting(selector, err)
                return
            sock.setblocking(False)
            tune_socket(sock)
            conn = _Connection(sock, peer=_peer_name(peer), nonce=new_nonce())
            conn.deadline = time.monotonic() + HELLO_SECONDS
            try:
                conn.client, conn.server = sock.getpeername()[:2], sock.getsockname()[:2]
            except OSError:  # reset already
                sock.close()
                continue
            if len(self._unproven) >= self.max_unproven:
                _, oldest = self._unproven.popitem(last=False)
                self._refuse(selector, oldest, f"more than {self.max_unproven} connections had not proved who they are")
            self._unproven[id(conn)] = conn
            selector.register(sock, selectors.EVENT_READ, conn)
            conn.outbuf += encode_line({"t": CHALLENGE, "nonce": conn.nonce, "launch": self.credentials.launch})
            self._flush(selector, conn)

    def _pause_accepting(self, selector: selectors.BaseSelector, err: OSError) -> None:
        """Out of descriptors with no unproven connection to drop: stop watching the listener for
        `ACCEPT_PAUSE_SECONDS` (the waiting connections stay in its backlog) instead of spinning on it."""
        if self._accept_paused_until:
            return
        log.warning(
            "%s: out of descriptors (%s, %d connections of ranks): not accepting for %.1fs",
            self.name,
            err.strerror,
            len(self._by_rank),
            ACCEPT_PAUSE_SECONDS,
        )
        self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE_SECONDS
        try:
            selector.unregister(self._listener)
        except (KeyError, ValueError):
            pass

    def _resume_accepting(self, selector: selectors.BaseSelector) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            selector.register(self._listener, selectors.EVENT_READ, None)

    def _expire_unproven(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        while self._unproven:
            conn = next(iter(self._unproven.values()))
            if conn.deadline > now:
                return
            self._refuse(selector, conn, f"it did not prove who it is within {HELLO_SECONDS:.0f}s")

    def _read(self, selector: selectors.BaseSelector, conn: _Connection, arrived: list[tuple[_Connection, Message]]):
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the worker closed its connection (done, or its process ended)
            self._drop(selector, conn)
            return
        conn.inbuf += data
        if conn.rank is None:  # one short line, its hello, before anything else is read
            end = conn.inbuf.find(b"\n")
            if end < 0 or end > MAX_HELLO_BYTES:
                if end > MAX_HELLO_BYTES or len(conn.inbuf) > MAX_HELLO_BYTES:
                    self._refuse(selector, conn, f"a first line longer than {MAX_HELLO_BYTES} bytes")
                return
            line, rest = bytes(conn.inbuf[:end]), conn.inbuf[end + 1 :]
            conn.inbuf = bytearray()
            if not self._hello(selector, conn, line, arrived):
                return
            conn.inbuf = rest
        end = conn.inbuf.rfind(b"\n")
        if len(conn.inbuf) - end - 1 > MAX_LINE_BYTES:  # the line still arriving
            self._refuse(selector, conn, f"a line longer than {MAX_LINE_BYTES} bytes")
            return
        if end < 0:
            return
        lines, conn.inbuf = bytes(conn.inbuf[:end]), conn.inbuf[end + 1 :]
        for line in lines.split(b"\n"):
            if len(line) > MAX_LINE_BYTES:
                self._refuse(selector, conn, f"a line longer than {MAX_LINE_BYTES} bytes")
                return
            try:
                message = self.decode(line)
            except BadMessage as err:
                self._refuse(selector, conn, str(err))
                return
            if message["op"] == HELLO:
                self._refuse(selector, conn, f"a second hello on rank {conn.rank}'s connection")
                return
            arrived.append((conn, message))
            self.messages_in += 1

    def _hello(
        self,
        selector: selectors.BaseSelector,
        conn: _Connection,
        line: bytes,
        arrived: list[tuple[_Connection, Message]],
    ) -> bool:
        """Check a connection's first line: a `hello` that proves it holds the launch's key, for a rank
        not connected already. True: the rank is bound to this connection (and welcomed)."""
        try:
            message = decode_message(line)
        except BadMessage as err:
            self._refuse(selector, conn, str(err))
            return False
        if message["op"] != HELLO:
            self._refuse(selector, conn, f"{message['op']!r} before hello")
            return False
        rank, nonce = message["rank"], message["nonce"]
        if not proof_holds(self.credentials.hello_proof(conn.nonce, nonce, rank), message["proof"]):
            self._refuse(
                selector, conn, f"a hello for rank {rank} whose proof does not hold (another secret or launch)"
            )
            return False
        if rank in self._by_rank:  # a live rank's connection is never taken over
            # (it proved the secret: it is told why, and retries while a dead predecessor's connection closes)
            self._refuse(selector, conn, f"a hello for rank {rank}, which is connected already", tell=True)
            return False
        self._unproven.pop(id(conn), None)
        conn.rank = rank
        conn.outbuf += encode_line({"t": WELCOME, "proof": self.credentials.welcome_proof(conn.nonce, nonce, rank)})
        arrived.append((conn, message))
        self.messages_in += 1
        return True

    def _refuse(self, selector: selectors.BaseSelector, conn: _Connection, why: str, tell: bool = False) -> None:
        """Drop one connection that broke the protocol; the plane and every other connection go on.
        `tell`: say why even before the connection is bound to a rank (it proved the secret)."""
        now = time.monotonic()
        if now - self._refusals_since >= REFUSALS_WINDOW:  # a new window: say how many were not logged
            if self._refusals_unlogged:
                log.warning("%s: %d more connections dropped", self.name, self._refusals_unlogged)
            self._refusals_since, self._refusals_logged, self._refusals_unlogged = now, 0, 0
        self._refusals_logged += 1
        level = logging.WARNING if self._refusals_logged <= REFUSALS_LOGGED else logging.DEBUG
        self._refusals_unlogged += level == logging.DEBUG  # a flood does not flood the log
        log.log(
            level,
            "%s: dropped the connection from %s%s: %s",
            self.name,
            conn.peer,
            "" if conn.rank is None else f" (rank {conn.rank})",
            why,
        )
        self.refused += 1
        if (conn.rank is not None or tell) and not conn.closed:  # a rank that proved who it is learns why
            try:
                conn.sock.send(bytes(conn.outbuf) + encode_line({"t": REFUSED, "error": why[:500]}))
            except OSError:
                pass
        self._drop(selector, conn)

    def _drop(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        if conn.closed:  # a failed flush dropped it earlier in this pass
            return
        conn.closed = True
        conn.outbuf.clear()
        self._unproven.pop(id(conn), None)
        try:
            selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        if conn.rank is not None and self._by_rank.get(conn.rank) is conn:
            del self._by_rank[conn.rank]
            self.connected.discard(conn.rank)
            self._dropped.append(conn.rank)
            log.debug("%s: rank %d's connection closed", self.name, conn.rank)

    def _dispatch(
        self, selector: selectors.BaseSelector, conn: _Connection, message: Message, touched: dict[int, _Connection]
    ) -> None:
        if conn.closed:
            return
        op = message["op"]
        rank = conn.rank
        assert rank is not None  # only a connection that proved who it is gets here (`_hello`)
        if op == HELLO:
            if rank in self._by_rank:  # another connection proved the same rank in this pass
                return self._refuse(selector, conn, f"a hello for rank {rank}, which is connected already")
            self._by_rank[rank] = conn
            touched[rank] = conn
            self.connected.add(rank)
            self.ever_connected.add(rank)
            self.hellos += 1
            waiting = self._waiting.pop(rank, None)
            if waiting and "got" not in message:  # a link that resumes gets what it missed from `on_connect`
                conn.outbuf += waiting
            if self.on_connect is not None:
                self._route(self._guarded(self.on_connect, rank, message), touched)
            return
        if message["rank"] != rank:  # a rank speaks only for itself
            return self._refuse(selector, conn, f"{op!r} in the name of rank {message['rank']!r}")
        if op == "echo":
            out = {rank: [message["item"]]}
        else:
            out = self._guarded(self.handler, message)
        self._route(out, touched)

    def _guarded(self, call: Callable[..., dict[int, list[Message]]], *args: object) -> dict[int, list[Message]]:
        """`call(*args)`'s items; an error inside it is logged and costs nothing but those items (the
        handler reports a message it rejects to its sender itself)."""
        try:
            return call(*args)
        except Exception:
            log.exception("%s: %s failed", self.name, getattr(call, "__name__", call))
            return {}

    def _route(self, out: dict[int, list[Message]], touched: dict[int, _Connection]) -> None:
        encoded: dict[int, bytes] = {}  # a group item is one object shared by its members: encode it once
        for rank, items in out.items():
            buffer = self._by_rank.get(rank)
            if buffer is None and rank in self.ever_connected:
                # its process is gone: what was meant for it is not for the next process of that rank
                # (a new process opens its sessions afresh), so it is dropped, not queued
                self.messages_dropped += len(items)
                log.debug("%s: dropped %d items for rank %d, which is not connected", self.name, len(items), rank)
                continue
            target = buffer.outbuf if buffer is not None else self._waiting.setdefault(rank, bytearray())
            if buffer is None and len(target) > MAX_WAITING_BYTES:  # a rank that never connects
                if rank not in self._overflowed:
                    self._overflowed.add(rank)
                    log.warning("%s: more than %d bytes queued for rank %d, which never connected: "
                                "dropping its items", self.name, MAX_WAITING_BYTES, rank)  # fmt: skip
                self.messages_dropped += len(items)
                continue
            for item in items:
                line = encoded.get(id(item))
                if line is None:
                    line = encoded[id(item)] = encode_line(item)
                target += line
                if buffer is not None and item.get("t") in CLOSING_ITEMS:
                    buffer.closing = True
            self.messages_out += len(items)
            if buffer is not None:
                touched[rank] = buffer

    def _flush(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        if conn.closed:
            return
        if len(conn.outbuf) > MAX_PENDING_BYTES:
            return self._refuse(selector, conn, f"more than {MAX_PENDING_BYTES} bytes queued and not read")
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                self.writes += 1
                del conn.outbuf[:sent]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:  # the worker is gone; its items have no reader
                self._drop(selector, conn)
                return
        if conn.closing:  # written as far as the kernel takes it now: its process holds the rank no longer
            log.debug("%s: closing rank %s's connection after its last item", self.name, conn.rank)
            self._drop(selector, conn)
            return
        wants_write = bool(conn.outbuf)
        if wants_write != conn.writing:
            conn.writing = wants_write
            events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wants_write else 0)
            selector.modify(conn.sock, events, conn)


def _peer_name(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address) or "a local socket"
