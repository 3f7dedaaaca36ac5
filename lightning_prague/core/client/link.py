"""A training process's connection to the control plane: `MessageLink`, read by a thread of its own.

The server side is `lightning_prague.core.plane.server.MessageServer`; what travels between them is
`lightning_prague.core.protocol`'s. A reader thread takes every line off the socket as it arrives
and hands it to a router, so a worker learns of a departure or a stop even while no thread of it
waits on the link.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable

from lightning_prague.core.auth import Credentials, new_nonce, proof_holds
from lightning_prague.core.errors import ControlPlaneError, ControlPlaneLost, CoordinationTimeout, PragueError
from lightning_prague.core.protocol import (
    CHALLENGE,
    FAILED,
    HELLO,
    ITEM_SEQ,
    MAX_HELLO_BYTES,
    MESSAGE_SEQ,
    RECV_BYTES,
    REFUSED,
    RESUMED,
    WELCOME,
    Message,
    encode_line,
    tune_socket,
)

log = logging.getLogger(__name__)

#: messages a link keeps to send again after it reconnects (the control plane handled all but the
#: last few when it died: `lightning_prague.core.plane.journal`)
RESEND_MESSAGES = 4096
#: seconds between two attempts to reconnect
RECONNECT_SECONDS = 0.5
#: seconds a new process tries again while the server still holds a connection of its rank (its
#: predecessor's, which the server has not seen close yet)
CONNECTED_ALREADY_SECONDS = 10.0
#: messages that are not numbered: the beats (the hang detector's alone) and the transport's own
_UNNUMBERED = frozenset({HELLO, "beat", "echo"})


class MessageLink:
    """One process's connection to a `MessageServer`, read by a thread of its own.

    Any thread may `send` (a lock keeps lines whole, and one connection keeps one order). The
    reader thread passes every message to `router` (if given) as it arrives; what the router does
    not take (returns a false value) is queued for `receive`. When the server closes the
    connection, `on_close(error)` runs once and `receive` raises `CoordinationTimeout`.

    Before anything else, the link and the server prove to each other that they hold the launch's
    key (`credentials`, see `lightning_prague.core.auth`); a server that cannot (another job's, an
    earlier launch's) or that refuses this rank fails the constructor with `CoordinationTimeout`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        timeout: float,
        credentials: Credentials,
        router: Callable[[Message], bool] | None = None,
        on_close: Callable[[str], None] | None = None,
        peer: str = "the control plane",
        reconnect_within: float = 0.0,
        on_reconnect_attempt: Callable[[], None] | None = None,
        on_resumed: Callable[[], None] | None = None,
    ) -> None:
        self.rank = rank
        self.timeout = timeout
        self.peer = peer
        self.router = router
        self.on_close = on_close
        self.reconnect_within = reconnect_within
        self.on_reconnect_attempt = on_reconnect_attempt
        self.on_resumed = on_resumed
        self._host, self._port, self._credentials = host, port, credentials
        self._sock = self._open_socket()
        self._send_lock = threading.Lock()
        self._seq = 0  # the number of the last message numbered
        self._unacked: deque[tuple[int, bytes]] = deque(maxlen=RESEND_MESSAGES)
        self._got: int | None = None  # the number of the last item received (`None`: none yet)
        #: the connection closed and the link is reconnecting (`reconnect_within`)
        self.reconnecting = False
        #: times it reconnected
        self.reconnects = 0
        self._closing = False
        self._queue: queue.Queue[Message | None] = queue.Queue()
        self.sent = 0
        self.received = 0
        #: `time.monotonic()` when data last came from the server (the connection's start, at first):
        #: how a worker tells that it is cut off from the control plane (`lightning_prague.core.client.control`)
        self.last_received = time.monotonic()
        self.closed = False
        self.close_error: str | None = None
        #: the server's own error, if it failed (it said so before it closed the connection)
        self.server_error: str | None = None
        self.address = f"{host}:{port}"
        self._buffer = bytearray()
        self._connect_first(credentials)
        self._reader = threading.Thread(target=self._read_forever, name=f"prague-control-{rank}", daemon=True)
        self._reader.start()

    def _connect_first(self, credentials: Credentials) -> None:
        """The handshake on the socket opened; while the server holds a connection of this rank still
        (the process this one replaces died an instant ago, and the server has not read its close yet),
        a new connection and handshake every `RECONNECT_SECONDS`, for up to `CONNECTED_ALREADY_SECONDS`."""
        deadline = time.monotonic() + CONNECTED_ALREADY_SECONDS
        while True:
            try:
                self._handshake(credentials)
                return
            except _ConnectedAlready as err:
                self._sock.close()
                if time.monotonic() >= deadline:
                    raise CoordinationTimeout(
                        f"rank {self.rank}: {self.peer} still held a connection of this rank after "
                        f"{CONNECTED_ALREADY_SECONDS:.0f}s ({err}): another process of this rank lives (or its node "
                        "is cut off and not yet declared lost), or two processes were given the same rank"
                    ) from None
                log.debug("rank %d: %s holds a connection of this rank still; trying again", self.rank, self.peer)
                time.sleep(RECONNECT_SECONDS)
                self._buffer = bytearray()
                self._sock = self._open_socket()
            except BaseException:
                self._sock.close()
                raise

    def _open_socket(self) -> socket.socket:
        host, port = self._host, self._port
        try:
            sock = socket.create_connection((host, port), timeout=self.timeout)
        except OSError as err:
            where = self.peer if f"{host}:{port}" in self.peer else f"{self.peer} at {host}:{port}"  # the address once
            raise CoordinationTimeout(f"rank {self.rank}: cannot connect to {where} ({err})") from None
        tune_socket(sock)
        # the reader blocks in recv without a timeout (a quiet control plane is no error: a gossiping
        # worker may hear nothing for a long time); only sends are bounded, by the kernel
        sock.settimeout(None)
        seconds = max(1.0, float(self.timeout))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(seconds), int(seconds % 1 * 1e6)))
        return sock

    def _handshake(self, credentials: Credentials, got: int | None = None) -> None:
        """Answer the server's challenge and check its welcome (see `lightning_prague.core.auth`);
        `got`: this link resumes, and got the items up to that number."""
        self._sock.settimeout(max(1.0, float(self.timeout)))
        challenge = self._handshake_line("its challenge")
        launch = challenge.get("launch")
        if (
            challenge.get("t") != CHALLENGE
            or not isinstance(challenge.get("nonce"), str)
            or not isinstance(launch, str)
        ):
            raise CoordinationTimeout(
                f"rank {self.rank}: {self.peer} is not a lightning-prague control plane (it sent {str(challenge)[:80]})"
            )
        if launch != credentials.launch:
            raise CoordinationTimeout(
                f"rank {self.rank}: {self.peer} serves another launch ({launch[:80]!r}, this rank's is "
                f"{credentials.launch!r}): a supervisor of another job or an earlier launch holds the port"
            )
        nonce = new_nonce()
        server_nonce = challenge["nonce"][:128]
        proof = credentials.hello_proof(server_nonce, nonce, self.rank)
        hello = {"op": HELLO, "rank": self.rank, "nonce": nonce, "proof": proof}
        try:
            self._sock.sendall(encode_line(hello if got is None else {**hello, "got": got}))
        except OSError as err:
            raise CoordinationTimeout(f"rank {self.rank}: {self.peer} took no hello ({err})") from None
        welcome = self._handshake_line("its welcome (it refused this rank: another secret, or a rank connected twice)")
        if welcome.get("t") == REFUSED:  # it proved the secret, and the server holds a connection of this rank
            raise _ConnectedAlready(str(welcome.get("error"))[:500])
        expected = credentials.welcome_proof(server_nonce, nonce, self.rank)
        if welcome.get("t") != WELCOME or not proof_holds(expected, str(welcome.get("proof"))):
            raise CoordinationTimeout(
                f"rank {self.rank}: {self.peer} did not prove that it holds this job's secret; it is not this launch's "
                "control plane"
            )
        self._sock.settimeout(None)
        log.debug("rank %d: authenticated with %s (launch %s)", self.rank, self.peer, credentials.launch)

    def _handshake_line(self, what: str) -> Message:
        """The next line of the handshake as a JSON object (bytes after it stay for the reader thread)."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_HELLO_BYTES:
                raise CoordinationTimeout(
                    f"rank {self.rank}: {self.peer} sent a line too long while waiting for {what}"
                )
            try:
                data = self._sock.recv(RECV_BYTES)
            except OSError as err:
                raise CoordinationTimeout(f"rank {self.rank}: no answer from {self.peer} with {what} ({err})") from None
            if not data:
                raise CoordinationTimeout(f"rank {self.rank}: {self.peer} closed the connection instead of {what}")
            self._buffer += data
        end = self._buffer.index(b"\n")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise CoordinationTimeout(f"rank {self.rank}: {self.peer} sent {line[:80]!r} instead of {what}")
        return message

    def local_address(self) -> str | None:
        """The address this connection leaves from (what the server sees as this process's)."""
        try:
            return str(self._sock.getsockname()[0])
        except OSError:
            return None

    def send(self, message: Message) -> None:
        numbered = message.get("op") not in _UNNUMBERED
        with self._send_lock:
            if self.closed and not self.reconnecting:  # it ended (not back within its wait, or closed here)
                what = self.close_error or f"rank {self.rank}: the connection to {self.peer} closed"
                raise ControlPlaneLost(f"{what} (this rank could not send {message.get('op')!r})")
            if numbered:
                self._seq += 1
                line = encode_line({**message, MESSAGE_SEQ: self._seq})
                self._unacked.append((self._seq, line))
            else:
                line = encode_line(message)
            if self.reconnecting:  # sent again once the link is back (a beat: the next one will do)
                return
            try:
                self._sock.sendall(line)
            except OSError as err:  # lost is lost, whether the reader or a sender sees it first
                if self.reconnect_within > 0 and not self._closing:
                    log.debug("rank %d: sending to %s failed (%s): the reader reconnects", self.rank, self.peer, err)
                    try:
                        self._sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                if isinstance(err, (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
                    what = f"closed the connection (this rank could not send {message.get('op')!r}: {err})"
                else:  # the kernel's buffer stayed full for the link's timeout: it reads nothing
                    what = f"took nothing this rank sent for {self.timeout:.0f}s ({message.get('op')!r}: {err})"
                raise ControlPlaneLost(f"rank {self.rank}: {self.peer} {what}; it stopped or failed") from None
            self.sent += 1

    def _read_forever(self) -> None:
        buffer: bytearray | None = self._buffer  # what came with the welcome, first
        self._buffer = bytearray()
        error = ""
        while buffer is not None:
            error = self._read_connection(buffer)
            if self.server_error is not None or self._closing or self.reconnect_within <= 0:
                break
            buffer = self._reconnect(error)
            if buffer is None and self.server_error is None:
                error = f"{error} and did not come back within {self.reconnect_within:.0f}s"
        if self.server_error is not None:
            try:  # the server closes a failed connection itself; a malformed one is closed here
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.closed = True
        if self.server_error is not None:
            self.close_error = f"rank {self.rank}: {self.peer} failed: {self.server_error}"
        else:
            self.close_error = f"rank {self.rank}: {self.peer} closed the connection{error}; it stopped or failed"
        if self.on_close is not None:
            try:
                self.on_close(self.close_error)
            except Exception:
                log.exception("rank %d: error while handling the closed connection", self.rank)
        self._queue.put(None)

    def _read_connection(self, buffer: bytearray) -> str:
        """Read the connection until it ends or the server failed; returns why it ended (`""`: closed)."""
        error = ""
        while self.server_error is None:
            end = buffer.rfind(b"\n")
            if end < 0:
                try:
                    data = self._sock.recv(RECV_BYTES)
                except OSError as err:
                    data, error = b"", f" ({err})"
                if not data:
                    break
                self.last_received = time.monotonic()
                buffer += data
                continue
            lines = bytes(buffer[:end]).split(b"\n")
            del buffer[: end + 1]
            for line in lines:
                if self.server_error is not None:  # the connection ends here: nothing after it is handled
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    message = None
                if not isinstance(message, dict):  # the plane proved who it is: this is its failure
                    self.server_error = f"it sent a line that is not a message: {line[:80]!r}"
                    break
                seq = message.pop(ITEM_SEQ, None)
                if seq is not None:
                    if self._got is not None and isinstance(seq, int) and seq <= self._got:
                        continue  # sent again after a reconnect: had it
                    if self._got is not None and seq != self._got + 1:
                        self.server_error = f"items {self._got + 1} to {seq} never arrived"
                        break
                    self._got = seq if isinstance(seq, int) else self._got
                self.received += 1
                if message.get("t") == FAILED:
                    self.server_error = str(message.get("error"))
                elif message.get("t") == REFUSED:  # a bug of this package: a message outside the protocol
                    self.server_error = f"it refused a message of this rank: {message.get('error')}"
                elif self.router is None or not self._routed(message):
                    self._queue.put(message)
        return error

    def _reconnect(self, why: str) -> bytearray | None:
        """Reconnect and resume (see the class docstring); returns what came after the server's answer,
        or `None` if the link ends (not back within `reconnect_within`, or the server refused it)."""
        with self._send_lock:
            self.reconnecting = True
        started = time.monotonic()
        log.warning(
            "rank %d: %s closed the connection%s; reconnecting for up to %.0fs (a control plane started again takes "
            "the job back)", self.rank, self.peer, why, self.reconnect_within,
        )  # fmt: skip
        last = why
        while not self._closing:
            if self.on_reconnect_attempt is not None:
                try:
                    self.on_reconnect_attempt()
                except Exception:
                    log.exception("rank %d: preparing a reconnect failed", self.rank)
            try:
                handled = self._resume()
            except _Refused as err:
                self.server_error = str(err)
                return None
            except (OSError, CoordinationTimeout) as err:
                last = f" ({err})"
            else:
                with self._send_lock:
                    kept = list(self._unacked)
                    if handled < self._seq and (not kept or kept[0][0] > handled + 1):
                        self.server_error = (
                            f"it handled this rank's messages up to {handled} of {self._seq}; the rest are no longer "
                            "kept"
                        )
                        return None
                    again = [line for seq, line in kept if seq > handled]
                    try:
                        self._sock.sendall(b"".join(again))
                        self.reconnecting = False
                    except OSError as err:  # gone again: the next attempt
                        last = f" ({err})"
                if not self.reconnecting:
                    return self._resumed(started, len(again))
            left = started + self.reconnect_within - time.monotonic()
            if left <= 0:
                log.error(
                    "rank %d: %s did not come back within %.0fs%s", self.rank, self.peer, self.reconnect_within, last
                )
                return None
            time.sleep(min(RECONNECT_SECONDS, left))
        return None

    def _resumed(self, started: float, sent_again: int) -> bytearray:
        """The link is back: what came after the server's answer, for the reader."""
        self.reconnects += 1
        self.last_received = time.monotonic()
        log.warning(
            "rank %d: reconnected to %s after %.1fs: %d messages sent again", self.rank, self.peer,
            time.monotonic() - started, sent_again,
        )  # fmt: skip
        if self.on_resumed is not None:
            try:
                self.on_resumed()
            except Exception:
                log.exception("rank %d: handling the resumed link failed", self.rank)
        buffer, self._buffer = self._buffer, bytearray()
        return buffer

    def _resume(self) -> int:
        """One attempt: a new connection, the handshake naming the last item got, and the server's
        answer: the last message of this link it handled."""
        try:
            self._sock.close()
        except OSError:
            pass
        self._buffer = bytearray()
        self._sock = self._open_socket()
        self._handshake(self._credentials, got=self._got or 0)
        self._sock.settimeout(max(1.0, float(self.timeout)))
        answer = self._handshake_line("its answer to the resume")
        self._sock.settimeout(None)
        if answer.get("t") != RESUMED:
            raise CoordinationTimeout(f"rank {self.rank}: {self.peer} sent {str(answer)[:80]} instead of resuming")
        if "error" in answer:
            raise _Refused(str(answer["error"])[:500])
        handled = answer.get("handled")
        if not isinstance(handled, int) or handled < 0:
            raise _Refused(f"it answered the resume with {str(answer)[:80]}")
        return handled

    def _routed(self, message: Message) -> bool:
        """The router's answer; a router that fails ends the link with its error (never a silent reader)."""
        assert self.router is not None
        try:
            return self.router(message)
        except Exception as err:
            log.exception("rank %d: handling an item of %s failed", self.rank, self.peer)
            self.server_error = f"this rank could not handle its item {str(message)[:80]} ({type(err).__name__}: {err})"
            return True

    def receive(self, timeout: float | None = None) -> Message | None:
        """The next message not taken by the router, or `None` if none arrived within `timeout`
        (default: the link's). Raises `CoordinationTimeout` once the server closed the connection."""
        try:
            message = self._queue.get(timeout=self.timeout if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return None
        if message is None:
            self._queue.put(None)  # every later receive fails the same way
            raise self.closed_error()
        return message

    def closed_error(self, during: str = "") -> PragueError:
        """The error for a wait on this closed link: `ControlPlaneError` if the server failed (with
        its error), else `CoordinationTimeout` (it stopped, or the connection broke)."""
        text = self.close_error or f"rank {self.rank}: the connection to {self.peer} closed"
        if during:
            text = f"{text} (during {during})"
        if self.server_error is not None:
            return ControlPlaneError(text)
        return CoordinationTimeout(text)

    def close(self) -> None:
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if threading.current_thread() is not self._reader:
            self._reader.join(5.0)
        self.closed = True


class _ConnectedAlready(CoordinationTimeout):
    """The server refused this rank's hello: it holds a connection of the same rank still."""


class _Refused(Exception):
    """The server answered a resume with an error: this link cannot go on."""
