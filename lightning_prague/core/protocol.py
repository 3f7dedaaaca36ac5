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

import json
import os
import socket
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.records import (
    BOOLEAN,
    MAX_INT,
    BadRecord,
    Check,
    Record,
    environment_number,
    hex_digest,
    integer,
    json_object,
    list_of,
    number,
    one_of,
    optional,
    pair_of,
    text,
)

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
#: keepalive probes of an idle control-plane connection: the first after 30 s of silence, then every
#: 10 s (its end is `USER_TIMEOUT_MS`'s, which bounds unanswered probes too)
KEEPALIVE = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 9}
#: how long a control-plane connection may carry unacknowledged data before the kernel gives it up,
#: milliseconds: about what the kernel's default retries (`tcp_retries2`) allow with its default backoff
USER_TIMEOUT_MS = 15 * 60 * 1000


def tune_socket(sock: socket.socket) -> None:
    """Low latency, and a connection that outlives a network partition (see the constants above)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError:  # not a TCP socket (e.g. a socketpair): nothing to tune
        return
    try:  # an idle connection to a host that vanished (no reset ever comes) is probed, and ends by the timeout below
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in KEEPALIVE.items():
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except (OSError, AttributeError):
        pass
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
    """When a worker counts as hung (see `lightning_prague.core.plane.liveness`); part of a session's configuration.

    A worker without training progress is judged by what else it shows (its beacon reports it,
    `lightning_prague.core.client.activity`):

    * **moving** (its training thread uses the CPU, its stack moves, or its device has work): it is
      slow, not dead; only the session's long bound (`sync_timeout`) ends it (a livelock);
    * **blocked** (none of these: a deadlock, a wait on a lock or on I/O that never returns): hung
      after `max(floor, factor x its longest recent step)`, 60 s by default, as torchft's collectives
      (DDP waits 1,800 s; 60 s outlasts a network file system's stall or a long logging call), and
      **left out** of the fit well before, after `max(min(leave_out_floor, floor), factor x its
      step)`, 10 s by default: the others go on without it, and if it wakes before its fence it
      comes back in place, with a live member's state;
    * **silent** (not even its beacon thread beats: a frozen or SIGSTOPped process, a lost node): hung
      after `max(min(silent_floor, floor), factor x its step)`, 10 s by default; on the control
      plane's own host a silent process that is running and using the CPU (a C call that holds the
      interpreter) counts as moving.
    """

    floor: float = 60.0
    factor: float = 20.0
    #: steps a worker must have timed before its own history sets its bound
    min_steps: int = 1
    #: a busy worker (outside its steps) is declared hung after this many times its bound without a
    #: word: its beacon thread beats whatever its training thread does, so a long silence means the
    #: process is frozen or cut off (a network partition), even in a checkpoint that may take longer
    silent_busy_factor: float = 3.0
    #: the shortest time without any sign of life after which a stepping worker is left out of the
    #: fit (its short bound): the others go on without it, but it is fenced only at `bound`, and if it
    #: wakes before that it comes back in place (never above `floor`)
    leave_out_floor: float = 10.0
    #: the shortest silence (no beat at all) after which a stepping worker is hung (never above `floor`)
    silent_floor: float = 10.0

    def bound(self, step: Optional[float], busy: bool, timeout: float) -> float:
        """Seconds without progress and without any sign of life after which a worker is hung (blocked)."""
        if busy or step is None:
            return timeout
        return max(self.floor, self.factor * step)

    def leave_out_bound(self, step: Optional[float], busy: bool, timeout: float) -> Optional[float]:
        """Seconds without progress and without any sign of life after which a stepping worker is left
        out of the fit, though not fenced: `max(min(leave_out_floor, floor), factor x its step)`;
        `None` while it is busy or has not timed a step (a checkpoint, a first step that compiles:
        only the long bound applies there), and where it is not shorter than the long bound (`bound`:
        the worker is fenced then, without being left out first)."""
        if busy or step is None:
            return None
        short = max(min(self.leave_out_floor, self.floor), self.factor * step)
        return short if short < self.bound(step, busy, timeout) else None

    def silence_bound(self, step: Optional[float], busy: bool, timeout: float) -> float:
        """Seconds without a word (not even a beat) after which a worker is declared hung: its silent
        bound, or `silent_busy_factor` times it while it is busy (before its first timed step:
        `timeout`, as for progress: a first step that compiles may hold the interpreter)."""
        if step is None:
            return timeout
        stepping = max(min(self.silent_floor, self.floor), self.factor * step)
        return min(timeout, self.silent_busy_factor * stepping) if busy else stepping


#: how the reason of a rank left out of a fit starts (`HangDetector.left_out`): a departure that is no loss
LEFT_OUT = "left out"

#: the item that answers a member's beat: the control plane still counts it in (`Session.check_reachable`)
ALIVE = "alive"
#: suffix of a work queue's key: the chunks of lost ranks, handed out before the queue goes on
REQUEUED = "/requeued"


@dataclass
class SessionConfig:
    """What the coordinator of one session needs; every rank sends the same one with `join`.

    It travels as a JSON object (`to_wire`), checked field by field on receipt (`from_wire`).
    """

    world_size: int
    #: who averages with whom: a grouping policy's spec (`GroupingPolicy.spec()`, a JSON object), which
    #: the control plane rebuilds and validates (`lightning_prague.core.grouping.policies.policy_from_spec`)
    policy: dict[str, Any]
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
    #: ranks `0..launched-1` start the fit; ranks from `launched` up to `world_size` are free places
    #: that new workers take by joining the running fit (`max_workers`); `None`: every rank starts it
    launched: int | None = None
    #: consecutive ranks that train one model (replica groups): they leave and come back together
    replica_size: int = 1
    #: each rank of a replica holds its own shard of the model (`shard=True`): a replica that comes back
    #: gets each rank's state from the same rank of one live replica (`GroupGenerator`'s `donors`)
    shard: bool = False

    def to_wire(self) -> dict[str, Any]:
        """This configuration as the JSON object `join` carries."""
        return asdict(self)

    @staticmethod
    def from_wire(obj: Any) -> SessionConfig:
        """The configuration a `join` carried; raises `BadRecord` naming a field that is not what it must be."""
        fields = dict(CONFIG_RECORD.check(obj))
        fields["hang"] = HangRule(**HANG_RECORD.check(fields.get("hang", {})))
        if fields.get("launched") is not None and fields["launched"] > fields["world_size"]:
            raise BadRecord(f"a session's configuration: launched={fields['launched']} > world_size")
        if fields["world_size"] % fields.get("replica_size", 1):
            raise BadRecord(
                f"a session's configuration: replica_size={fields['replica_size']} does not divide "
                f"world_size={fields['world_size']}"
            )
        return SessionConfig(**fields)

    @property
    def starting(self) -> int:
        """How many ranks start the fit (the others join it later)."""
        return self.world_size if self.launched is None else self.launched


#: the largest rank (and world size less one) the control plane accepts
MAX_RANK = (1 << 20) - 1
_SECONDS = number(0.0, 1e7)
HANG_RECORD = Record(
    "a hang rule",
    {},
    {
        "floor": _SECONDS,
        "factor": number(0.0, 1e6),
        "min_steps": integer(0, 1 << 20),
        "silent_busy_factor": number(0.0, 1e6),
        "silent_floor": _SECONDS,
        "leave_out_floor": _SECONDS,
    },
)
CONFIG_RECORD = Record(
    "a session's configuration",
    {"world_size": integer(1, MAX_RANK + 1), "policy": json_object()},
    {
        "avoid_stragglers": BOOLEAN,
        "sync_averages": BOOLEAN,
        "record_history": BOOLEAN,
        "timeout": number(1e-3, 1e7),
        "hang": json_object(),
        "min_workers": integer(0, MAX_RANK + 1),
        "sync_timeout": optional(number(1e-3, 1e7)),
        "avoid_busy": BOOLEAN,
        "launched": optional(integer(1, MAX_RANK + 1)),
        "replica_size": integer(1, MAX_RANK + 1),
        "shard": BOOLEAN,
    },
)


#: the name of the meeting at which every rank stops (a stop decided by the job)
STOP_SYNC = "__stop__"
#: the suffix of a commit meeting (`<sync>/commit`): the members' completeness of a collective;
#: released whenever every live worker arrived, while stopping too
COMMIT = "/commit"
#: the prefix of the meetings at which joiners with nothing of the members' epoch to train are admitted
#: (every epoch's end)
ADMITTING_AT = "epoch_end@"


def donor_of(admission: dict[str, Any], rank: int) -> int:
    """The rank that sends joiner `rank` the fit's state, as an admission item (`members` or `admit`,
    from the control plane) names it: its pair in `donors` (sharded replicas: each joiner has its
    own), else the admission's `donor`. -1 where the item names none (or names it badly)."""
    donors = admission.get("donors")
    if isinstance(donors, list) and len(donors) <= MAX_RANK + 1:
        for pair in donors:
            if isinstance(pair, list) and len(pair) == 2 and pair[0] == rank and type(pair[1]) is int:
                return int(pair[1]) if 0 <= pair[1] <= MAX_RANK else -1
    donor = admission.get("donor", -1)
    return donor if type(donor) is int and -1 <= donor <= MAX_RANK else -1


def is_synchronization_point(sync: str) -> bool:
    """Whether meeting `sync` is a synchronization point of its own, not one that follows another's
    release (`<sync>/commit`, `<sync>/rounds`, a rebuild's), an agreement outside any (`commit`), or the
    stop: after its release every member tells the control plane when it trains again (`resume`)."""
    return "/" not in sync and sync not in (COMMIT.lstrip("/"), STOP_SYNC)


def rebuild_meeting(sync: str, attempt: int) -> str:
    """The meeting where the members of a rebuilt process group (`Job.regroup`) agree whether its
    `attempt`-th build, after the release of `sync`, succeeded everywhere: the survivors of a loss
    and a joiner at its admission name it alike."""
    return f"{sync}/rebuild{attempt}{COMMIT}"


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
    env_port = environment_number(PORT_VARIABLE, int, 1, 65535, "a TCP port number from 1 to 65535 (or unset)")
    if env_port is None:
        return control_port
    if control_port is not None and control_port != env_port:
        raise ConfigurationError(
            f"coordinator_port={control_port} and {PORT_VARIABLE}={env_port} name different ports for the control "
            f"plane: set only one of them (or both to the same port)"
        )
    return env_port


#: what the supervisor publishes in the store (as JSON, under `address_key()`): where its control plane
#: listens, its pid, the launch it serves, whether it hosts the store itself (`store`: the store then
#: restarts with it) and, if the user set no secret, the generated one
ADDRESS_RECORD = Record(
    "the control plane's address in the store",
    {"host": text(255), "port": integer(1, 65535), "pid": integer(1, 1 << 31), "launch": text(256)},
    {"secret": hex_digest(64), "store": BOOLEAN},
)


#: the key under which a plane service (`lightning_prague.core.plane.service`) publishes its record: one
#: job's, whatever a rank's launcher counts (`address_key` counts torchrun's restarts)
SERVICE_ADDRESS_KEY = f"{ADDRESS_KEY}/service"


def address_key() -> str:
    """The key of this launch attempt (torchrun restarts workers under the same agent store)."""
    return f"{ADDRESS_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


# -- the records: every message a training process sends the control plane ----------------------
#: the first line the control plane writes on a connection: `{"t": CHALLENGE, "nonce", "launch"}`
#: (see `lightning_prague.core.auth`); a client answers it with its `hello`
CHALLENGE = "challenge"
#: the control plane's answer to a `hello` whose proof holds: `{"t": WELCOME, "proof"}`
WELCOME = "welcome"
#: the last line the control plane writes to a rank whose message broke the protocol (it then drops the
#: connection): `{"t": REFUSED, "error": why}`
REFUSED = "__refused__"
#: the longest line read from a connection before it proved it belongs to the job, bytes
MAX_HELLO_BYTES = 4096

_RANK = integer(0, MAX_RANK)
_SESSION = integer(1, (1 << 31) - 1)
_REQ = integer()
_COUNT = integer()
_KEY = text(512)
_VALUE = text(1 << 16)
_CHUNKS = list_of(integer(), 1 << 16)
#: a ticket as the queue's claims count it: a set-aside ticket is at most 0 (`WorkLedger.set_aside`)
_TICKET = integer(-MAX_RANK - 1, MAX_INT)
_HEX = hex_digest(64)
#: what a replica's follower asks for: `[leader, n]`, the `n`-th answer (from 0) of its leader's claims on a queue
_FOLLOW = Check(
    lambda v: isinstance(v, list) and len(v) == 2 and _RANK(v[0]) and _COUNT(v[1]),
    f"a pair [the leader's rank, the number of its answer]: {_RANK.what}, then {_COUNT.what}",
)
#: the fields of every message of a session
_IN_SESSION = {"s": _SESSION, "rank": _RANK}
_REQUEST = {**_IN_SESSION, "req": _REQ}


def _session_record(op: str, optional_fields: dict | None = None, request: bool = False, **required) -> Record:
    return Record(
        f"{op!r}", {"op": one_of(op), **(_REQUEST if request else _IN_SESSION), **required}, optional_fields or {}
    )


#: every message the control plane accepts, by its `op` (`kv` by its `do`: `KV_RECORDS`)
RECORDS: dict[str, Record] = {
    # `got`: a connection that resumes this rank's stream after the control plane restarted (or the link
    # broke): the last item it received (`ITEM_SEQ`); the plane answers `RESUMED` and sends the rest
    HELLO: Record("'hello'", {"op": one_of(HELLO), "rank": _RANK, "nonce": _HEX, "proof": _HEX}, {"got": integer()}),
    # puts `item` behind everything already sent to the sender (a thread wakes another of its process)
    "echo": Record("'echo'", {"op": one_of("echo"), "rank": _RANK, "item": json_object(16)}),
    "join": _session_record(
        "join",
        # `rejoin`: a new process for a rank that left the job, asking to be admitted (`GroupGenerator`'s
        # `Rejoining`: at once, in a new membership epoch)
        {"addresses": list_of(text(64), 1024), "rejoin": BOOLEAN},
        config=json_object(),
        pid=integer(0, 1 << 31),
        host=text(255),
    ),
    "beat": _session_record(
        "beat", {"step": optional(_SECONDS), "active": BOOLEAN}, progress=_COUNT, waiting=BOOLEAN, busy=BOOLEAN
    ),
    # `failed`: it gives up on the fit (a joiner whose admission or state transfer failed): a departure
    "close": _session_record("close", {"failed": BOOLEAN}),
    "leave": _session_record("leave"),
    "idle": _session_record("idle"),
    # it trains again after a meeting and the sub-meetings that followed it (`GroupGenerator`'s `Rejoining`)
    "resume": _session_record("resume"),
    "stop": _session_record("stop", {"reason": text(64)}),
    # chunks of the work queue this rank now holds (`tickets`: the claim values of their tickets) or trained;
    # `back`: shards it gives back untrained from a position (a slow rank at a stream's tail); `end`: it
    # claims no more from that queue (`lightning_prague.core.plane.queue_end`)
    "work": _session_record(
        "work",
        {
            "hold": _CHUNKS,
            "tickets": list_of(optional(_TICKET), 1 << 16),
            "done": _CHUNKS,
            "back": list_of(pair_of(integer()), 1 << 16),
            "end": BOOLEAN,
        },
        key=_KEY,
    ),
    # where this rank stands in its own shard of the epoch (lock-step shards, not the work queue): it has
    # trained `batches` batches of shard `shard` of `of` in epoch `epoch` (`total`: of that many, where the
    # loader has a length); a new process for it goes on from there (`lightning_prague.strategies.loaders`)
    "trained": _session_record(
        "trained", {"total": _COUNT}, epoch=_COUNT, batches=_COUNT, shard=_RANK, of=integer(1, MAX_RANK + 1)
    ),
    # which of `slots`, ranks that were no members at the last meeting, take part in gossip round `round`
    # of the schedule's group `key` (`GroupGenerator.round_members`); `start`: a rank admitted inside a
    # phase asks at which round it takes up gossip (then `key` names it and `slots` is empty)
    "round": _session_record(
        "round", {"slots": list_of(_RANK, MAX_RANK + 1), "start": BOOLEAN}, key=text(128), round=_COUNT
    ),
    # this rank's completeness of a group collective, before it writes anything back (`GroupVerdicts`)
    # `epoch`: the membership epoch its members were drawn in (`GroupVerdicts.readmitted`)
    "summed": _session_record(
        "summed", {"epoch": _COUNT}, key=text(128), members=list_of(_RANK, MAX_RANK + 1), ok=BOOLEAN
    ),
    "parked": _session_record("parked", request=True),
    "history": _session_record("history", request=True),
    "ready": _session_record("ready", {"version": _COUNT}, request=True),
    "arrive": _session_record(
        "arrive",
        {
            "stop": BOOLEAN,
            "untrained": _CHUNKS,
            # a sharded stream's shards this rank holds, each with the position it was trained to
            "positions": list_of(pair_of(integer()), 1 << 16),
            "speed": optional(_SECONDS),
            "round": _COUNT,
            "settle": BOOLEAN,
            "incomplete": BOOLEAN,
        },
        sync=text(512),
    ),
}
_KV = {"op": one_of("kv"), **_REQUEST}
#: the key-value operations of a session (`{"op": "kv", "do": ...}`), as TCPStore's and the work queue's
KV_RECORDS: dict[str, Record] = {
    "add": Record("'kv' add", {**_KV, "do": one_of("add"), "key": _KEY, "amount": integer(-MAX_INT, MAX_INT)}),
    "set": Record("'kv' set", {**_KV, "do": one_of("set"), "key": _KEY, "value": _VALUE}),
    "cas": Record("'kv' cas", {**_KV, "do": one_of("cas"), "key": _KEY, "expected": _VALUE, "desired": _VALUE}),
    "claim": Record(
        "'kv' claim",
        {**_KV, "do": one_of("claim"), "key": _KEY, "first": _COUNT, "ticketed": _COUNT},
        {
            "tickets": optional(_KEY),
            "num": _COUNT,
            "chunk": _COUNT,
            "members": list_of(_RANK, MAX_RANK + 1),
            "preset": list_of(integer(-1, MAX_INT), MAX_RANK + 1),
            "park": BOOLEAN,
            # a rank that left the epoch's tail: it takes a chunk only if nobody else will
            "standby": BOOLEAN,
            # the claimer trains, and reports, the chunks it holds while this claim waits at the queue's end
            # (it fetches its next batch only after its step): the others' parked claims wait for them too
            "reports": BOOLEAN,
            # a replica's follower: not a claim of its own, but its leader's answer `n` on the queue, the same
            # `[chunk, ticket]` (`FollowedClaims` in `lightning_prague.core.plane.queue_end`)
            "follow": _FOLLOW,
        },
    ),
    # a slow rank at a stream's tail offers a shard's rest from a position; the reply says whether a claimer
    # takes it (`lightning_prague.core.data.shard_queue`)
    "give_back": Record(
        "'kv' give_back", {**_KV, "do": one_of("give_back"), "key": _KEY, "shard": _COUNT, "position": _COUNT}
    ),
    "get": Record("'kv' get", {**_KV, "do": one_of("get"), "key": _KEY}),
    "check": Record("'kv' check", {**_KV, "do": one_of("check"), "keys": list_of(_KEY, 64)}),
    "delete": Record("'kv' delete", {**_KV, "do": one_of("delete"), "key": _KEY}),
    "keys": Record("'kv' keys", {**_KV, "do": one_of("keys")}),
}


#: the field that numbers a training process's messages over its link (1, 2, ...; beats are not numbered):
#: a control plane that restarted tells it which it handled, and it sends the rest again
#: (`lightning_prague.core.plane.journal`)
MESSAGE_SEQ = "m"
#: the field that numbers the items the control plane sends one rank (consecutive; replies and
#: session items alike, not the answers to beats): a link that resumes names the last it got
ITEM_SEQ = "n"
#: the control plane's answer to a resuming `hello`: `{"t": RESUMED, "handled": m}` (the last message
#: of the rank's it handled; the items after the one the rank got follow), or `{"t": RESUMED, "error"}`
RESUMED = "resumed"
_MESSAGE_SEQ = integer(1, MAX_INT)


class BadMessage(BadRecord):
    """What a connection sent is not a message of the protocol: the connection is dropped."""


def decode_message(line: bytes) -> Message:
    """One line from a training process as a message: a JSON object that is one of `RECORDS`.

    Raises `BadMessage` for anything else (bytes that are not UTF-8 JSON, another JSON value, an
    unknown op, a field that is missing, unknown, of the wrong type or out of range).
    """
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise BadMessage(f"a line that is not JSON ({type(err).__name__}: {str(err)[:80]})") from None
    if not isinstance(message, dict):
        raise BadMessage(f"a line that is not a message (a JSON object with an 'op'): {line[:80]!r}")
    return check_message(message)


def check_message(message: dict[str, Any]) -> Message:
    """`message` (a JSON object read from anywhere: a socket, the control plane's journal) if it is one
    of `RECORDS`; `BadMessage` otherwise (see `decode_message`)."""
    op, do = message.get("op"), message.get("do")
    record = None
    if isinstance(op, str):
        record = (KV_RECORDS.get(do) if isinstance(do, str) else None) if op == "kv" else RECORDS.get(op)
    if record is None:
        shown = f"'kv' operation {str(message.get('do'))[:40]!r}" if op == "kv" else f"op {str(op)[:40]!r}"
        raise BadMessage(f"an unknown {shown}")
    seq = message.pop(MESSAGE_SEQ, None) if op != HELLO else None
    try:
        record.check(message)
    except BadRecord as err:
        raise BadMessage(str(err)) from None
    if seq is not None:
        if not _MESSAGE_SEQ(seq):
            raise BadMessage(f"field {MESSAGE_SEQ!r} is {str(seq)[:40]!r}, but it must be {_MESSAGE_SEQ.what}")
        message[MESSAGE_SEQ] = seq
    return message
