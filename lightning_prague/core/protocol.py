"""The wire contract between the training processes and the control plane: one module both sides import.

The control plane (`lightning_prague.core.plane`, in the supervisor process) and each training
process's client of it (`lightning_prague.core.client`) share nothing but this module (and the
errors): how a message travels (one JSON object per line over TCP, `encode_line`, `tune_socket`),
the names of the items and meetings both sides know (`HELLO`, `ALIVE`, `STOP_SYNC`, `COMMIT`, ...),
a session's configuration (`SessionConfig`, sent with `join`), the hang rule the plane applies to
the beats a client sends (`HangRule`, `BEAT_SECONDS`), and where the plane's address is published
in the store (`address_key`) and on which port it listens (`resolve_control_port`).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from lightning_prague.core.errors import ConfigurationError

if TYPE_CHECKING:
    from lightning_prague.core.grouping.policies import GroupingPolicy

#: one message or item: a JSON object, one line on the wire
Message = dict[str, Any]
HELLO = "hello"  # the first message on a connection: which rank it belongs to
#: bytes read from a socket at once
RECV_BYTES = 1 << 20


def encode_line(message: Message) -> bytes:
    """One message as it travels: compact JSON and a newline."""
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


#: Linux's ``TCP_RTO_MAX_MS`` socket option (kernel 6.15 and newer; not in Python's `socket` module yet)
TCP_RTO_MAX_MS = 44
#: the longest retransmission timeout of a control-plane connection, milliseconds (the kernel's default
#: is 120 s): after a network partition heals, the connection carries messages again within about
#: this long, instead of waiting for a retransmission backed off to about the partition's own length
RTO_MAX_MS = 1000
#: how long a control-plane connection may carry unacknowledged data before the kernel gives it up,
#: milliseconds: about what the kernel's default retries (`tcp_retries2`) allow with its default backoff
USER_TIMEOUT_MS = 15 * 60 * 1000


def tune_socket(sock: socket.socket) -> None:
    """Low latency, and a connection that outlives a network partition (see the constants above)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # not a TCP socket (e.g. a socketpair): nothing to tune
        return
    try:  # best effort: older kernels and other systems keep their default backoff
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, RTO_MAX_MS)
    except OSError:
        return
    # with retransmissions a second apart the kernel would give a silent connection up after its 15
    # retries, about 15 s: keep it for as long as with the default backoff, so that a partition ends
    # a worker by the hang rule (its bound may be longer), never by a broken connection
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
    except (OSError, AttributeError):
        pass


#: what a router returns for a message it has taken care of (it is not queued for `receive`)
ROUTED = True
#: the last line a failing server writes to every connection: `{"t": FAILED, "error": ...}`
FAILED = "__server_failed__"


#: seconds between two beats of a worker's beacon
BEAT_SECONDS = 1.0
#: a worker not heard from for this long has gone silent (its beacon stopped), not merely slow
SILENT_SECONDS = 3 * BEAT_SECONDS


@dataclass(frozen=True)
class HangRule:
    """When a worker counts as hung (see `lightning_prague.core.plane.liveness`); part of a session's configuration."""

    floor: float = 10.0
    factor: float = 20.0
    #: steps a worker must have timed before its own history sets its bound
    min_steps: int = 1

    #: a busy worker (outside its steps) is declared hung after this many times its bound without a
    #: word: its beacon thread beats whatever its training thread does, so a long silence means the
    #: process is frozen or cut off (a network partition), even in a checkpoint that may take longer
    silent_busy_factor: float = 3.0

    def bound(self, step: Optional[float], busy: bool, timeout: float) -> float:
        """Seconds without progress after which a worker is declared hung."""
        if busy or step is None:
            return timeout
        return max(self.floor, self.factor * step)

    def silence_bound(self, step: Optional[float], busy: bool, timeout: float) -> float:
        """Seconds without a word (not even a beat) after which a worker is declared hung: its bound, or
        `silent_busy_factor` times its stepping bound while it is busy (before its first timed step:
        `timeout`, as for progress: a first step that compiles may hold the interpreter)."""
        if step is None:
            return timeout
        stepping = max(self.floor, self.factor * step)
        return min(timeout, self.silent_busy_factor * stepping) if busy else stepping


#: the item that answers a member's beat: the control plane still counts it in (`Session.check_reachable`)
ALIVE = "alive"
#: suffix of a work queue's key: the chunks of lost ranks, handed out before the queue goes on
REQUEUED = "/requeued"


@dataclass
class SessionConfig:
    """What the coordinator of one session needs; every rank sends the same one with `join`."""

    world_size: int
    #: who averages with whom (a `lightning_prague.core.grouping` policy, run by the control plane)
    policy: GroupingPolicy
    avoid_stragglers: bool = True
    sync_averages: bool = False
    record_history: bool = False
    #: seconds one operation may take
    timeout: float = 300.0
    hang: HangRule = field(default_factory=HangRule)
    #: the job stops (a `"request"` stop) when fewer live workers remain
    min_workers: int = 1
    #: seconds every rank may take to reach a synchronization point; also the hang bound of a
    #: worker busy outside its steps or before its first timed step (`HangRule`); default: `timeout`
    sync_timeout: float | None = None
    #: groups draw only workers not busy in another group (`GroupGenerator.avoid_busy`)
    avoid_busy: bool = False

    def encode(self) -> str:
        return base64.b64encode(pickle.dumps(self)).decode()

    @staticmethod
    def decode(text: str) -> SessionConfig:
        config = pickle.loads(base64.b64decode(text))
        if not isinstance(config, SessionConfig):
            raise TypeError(f"not a session configuration: {type(config).__name__}")
        return config


#: the name of the meeting at which every rank stops (a stop decided by the job)
STOP_SYNC = "__stop__"
#: the suffix of a commit meeting (`<sync>/commit`): the members' completeness of a collective;
#: released whenever every live worker arrived, while stopping too
COMMIT = "/commit"
#: reasons of a stop at once (every rank drains at its next batch): a signal, or the cluster's requeue signal
SIGTERM, REQUEUE = "sigterm", "requeue"


#: the store key (no prefix, suffixed with torchelastic's restart count) that holds `host:port:pid`
ADDRESS_KEY = "lightning_prague/control"
#: environment variable: a fixed port for the control plane (default: a free one)
PORT_VARIABLE = "LIGHTNING_PRAGUE_CONTROL_PORT"


def resolve_control_port(control_port: int | None = None) -> int | None:
    """The control plane's port: `control_port`, else `PORT_VARIABLE`'s, else `None` (a free one).

    Raises `ConfigurationError` for a port outside 1-65535, a variable that is not one, or both
    set to different ports.
    """
    if control_port is not None and (
        isinstance(control_port, bool) or not isinstance(control_port, int) or not 1 <= control_port <= 65535
    ):
        raise ConfigurationError(
            f"coordinator_port={control_port!r} is invalid: it must be a TCP port number from 1 to 65535 "
            "(or unset for a free port)"
        )
    value = os.environ.get(PORT_VARIABLE, "").strip()
    if not value:
        return control_port
    try:
        env_port = int(value)
    except ValueError:
        env_port = 0
    if not 1 <= env_port <= 65535:
        raise ConfigurationError(
            f"{PORT_VARIABLE}={value!r} is invalid: it must be a TCP port number from 1 to 65535 (or unset)"
        )
    if control_port is not None and control_port != env_port:
        raise ConfigurationError(
            f"coordinator_port={control_port} and {PORT_VARIABLE}={env_port} name different ports for the control "
            f"plane: set only one of them (or both to the same port)"
        )
    return env_port


def address_key() -> str:
    """The key of this launch attempt (torchrun restarts workers under the same agent store)."""
    return f"{ADDRESS_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
