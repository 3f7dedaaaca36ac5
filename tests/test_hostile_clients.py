"""A bad connection costs only itself: what a rank never sends, sent to a real control plane.

Each case opens a raw socket to a running `MessageServer` + `ControlPlane` next to a real rank's
`MessageLink`, sends something no rank sends (before the handshake, with a wrong proof, or after
a valid one), and checks that this one connection is closed, the server is still serving, and the
real rank's link still works (its echo comes back). Hypothesis fuzzes the decoder and the server's
loop; fencing is tried with real processes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CREDENTIALS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_prague.core import ControlPlane, SessionConfig, make_policy
from lightning_prague.core.auth import Credentials
from lightning_prague.core.client.link import MessageLink
from lightning_prague.core.plane import server as server_module
from lightning_prague.core.plane.server import MAX_LINE_BYTES, BadMessage, MessageServer, decode_message
from lightning_prague.core.protocol import KV_RECORDS, RECORDS, HangRule, encode_line

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(plane):
    """The control plane (conftest's `plane`) and a real rank 0's link to it."""
    _, server = plane
    rank = MessageLink(*server.address, 0, timeout=10, credentials=CREDENTIALS)
    yield server, rank
    rank.close()


def _closed_by_server(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the server closes `sock` (reads until end of file or a reset) within `timeout`."""
    sock.settimeout(timeout)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sock.recv(1 << 16):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return False


def _still_serves(server: MessageServer, rank: MessageLink) -> None:
    assert server.alive and server.error is None
    rank.send({"op": "echo", "rank": 0, "item": {"t": "still-here"}})
    assert rank.receive(timeout=10) == {"t": "still-here"}
    assert 0 in server.connected


def _line(sock: socket.socket) -> dict:
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return json.loads(data)


def _hello(sock: socket.socket, rank: int, credentials: Credentials = CREDENTIALS) -> bytes:
    """The hello line that answers the challenge on `sock`, as a rank holding `credentials` writes it."""
    challenge = _line(sock)
    assert challenge["t"] == "challenge" and challenge["launch"] == CREDENTIALS.launch
    nonce = os.urandom(32).hex()
    proof = credentials.hello_proof(challenge["nonce"], nonce, rank)
    return encode_line({"op": "hello", "rank": rank, "nonce": nonce, "proof": proof})


def _proven(server: MessageServer, rank: int) -> socket.socket:
    """A raw connection that passed the handshake as `rank` (it holds the job's key)."""
    sock = socket.create_connection(server.address, timeout=10)
    sock.sendall(_hello(sock, rank))
    assert _line(sock)["t"] == "welcome"
    return sock


def _independent_proof(key: bytes, server_nonce: str, client_nonce: str, rank: int) -> str:
    """The handshake's proof computed from its description (docs/security.md), not from the package."""
    message = b"\0".join((b"hello", server_nonce.encode(), client_nonce.encode(), str(rank).encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def test_the_handshake_matches_its_description_and_a_rank_that_proves_it_is_served(served):
    server, _ = served
    with socket.create_connection(server.address, timeout=10) as sock:
        challenge = _line(sock)
        nonce = "ab" * 32
        proof = _independent_proof(CREDENTIALS.key, challenge["nonce"], nonce, 4)
        sock.sendall(encode_line({"op": "hello", "rank": 4, "nonce": nonce, "proof": proof}))
        welcome = _line(sock)
        expected = hmac.new(
            CREDENTIALS.key, b"\0".join((b"welcome", challenge["nonce"].encode(), nonce.encode(), b"4")), "sha256"
        )
        assert welcome == {"t": "welcome", "proof": expected.hexdigest()}
        sock.sendall(encode_line({"op": "echo", "rank": 4, "item": {"t": "mine"}}))
        assert _line(sock) == {"t": "mine"}
    assert server.refused == 0


def _wrong_secret(sock: socket.socket) -> bytes:
    return _hello(sock, 5, Credentials.derive(b"not the job's secret at all", CREDENTIALS.launch))


def _another_launch(sock: socket.socket) -> bytes:
    return _hello(sock, 5, Credentials.derive(b"the same secret, another launch", "another launch"))


def _replayed(sock: socket.socket) -> bytes:
    """A hello that proved rank 5 on another connection (captured), replayed on this one."""
    with socket.create_connection(sock.getpeername(), timeout=10) as first:
        line = _hello(first, 5)
        first.sendall(line)
        assert _line(first)["t"] == "welcome"
    _line(sock)
    return line


def _proven_then(*messages: dict):
    def send(sock: socket.socket) -> bytes:
        line = _hello(sock, 6)
        sock.sendall(line)
        assert _line(sock)["t"] == "welcome"
        return b"".join(encode_line(m) for m in messages)

    return send


_JOIN = {"op": "join", "s": 1, "rank": 6, "pid": 123, "host": "h"}
#: a pickle that, if loaded, would create this file
PICKLED_MARKER = Path(os.environ.get("TMPDIR", "/tmp")) / f"lightning_prague-pickle-ran-{os.getpid()}"


class _Payload:
    def __reduce__(self):
        return (open, (str(PICKLED_MARKER), "w"))


HOSTILE = {
    "an HTTP request line": lambda sock: b"GET / HTTP/1.0\r\n\r\n",
    "random bytes": lambda sock: os.urandom(64 << 10) + b"\n",
    "a JSON value that is not an object": lambda sock: b"[1, 2, 3]\n",
    "an object without an op": lambda sock: b'{"rank": 0}\n',
    "a message before hello": lambda sock: encode_line({**_JOIN, "config": {}}),
    "a hello without a proof": lambda sock: encode_line({"op": "hello", "rank": 1}),
    "a hello for a rank that is no rank": lambda sock: encode_line(
        {"op": "hello", "rank": "1; rm -rf /", "nonce": "0" * 64, "proof": "0" * 64}
    ),
    "a first line longer than a hello": lambda sock: b"x" * (8 << 10) + b"\n",
    "a hello with the proof of another secret": _wrong_secret,
    "a hello with the proof of another launch": _another_launch,
    "a replayed hello": _replayed,
    "a proven hello for a live rank": lambda sock: _hello(sock, 0),
    "a message in another rank's name": _proven_then({"op": "echo", "rank": 0, "item": {"t": "stolen"}}),
    "an echo without an item": _proven_then({"op": "echo", "rank": 6}),
    "a second hello on one connection": _proven_then({"op": "hello", "rank": 8, "nonce": "0" * 64, "proof": "0" * 64}),
    "an unknown op": _proven_then({"op": "exec", "rank": 6, "s": 1}),
    "a field of the wrong type": _proven_then(
        {"op": "beat", "s": 1, "rank": 6, "progress": "1", "waiting": 0, "busy": 0}
    ),
    "an unknown field": _proven_then({"op": "close", "s": 1, "rank": 6, "code": "print(1)"}),
    "a join whose config is a pickle": _proven_then(
        {**_JOIN, "config": __import__("base64").b64encode(pickle.dumps(_Payload())).decode()}
    ),
    "a join that claims pid -1": _proven_then({**_JOIN, "pid": -1, "config": {}}),
    "a line longer than the bound after the hello": _proven_then(
        {"op": "echo", "rank": 6, "item": {"t": "x" * MAX_LINE_BYTES}}
    ),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_line_no_rank_sends_costs_its_sender_the_connection_and_nothing_else(served, what):
    server, rank = served
    with socket.create_connection(server.address, timeout=10) as stray:
        try:
            stray.sendall(HOSTILE[what](stray))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while still sending
        assert _closed_by_server(stray), f"the server kept a connection that sent {what}"
    _still_serves(server, rank)
    assert server.refused == 1
    assert server.connected == {0}
    assert not PICKLED_MARKER.exists()


def test_a_well_formed_message_the_plane_cannot_do_is_answered_to_its_sender_and_runs_nothing(served):
    server, rank = served
    policy = make_policy("random", 8, 2).spec()
    bad_policies = [{**policy, "kind": "pickle"}, {**policy, "group_size": 9}, {**policy, "world_size": 4}]
    with _proven(server, 6) as sock:
        for number, bad in enumerate(bad_policies, start=1):
            config = SessionConfig(8, bad).to_wire()
            sock.sendall(encode_line({**_JOIN, "s": number, "config": config}))
            item = _line(sock)
            assert item["t"] == "error" and item["s"] == number, item
        sock.sendall(encode_line({"op": "echo", "rank": 6, "item": {"t": "still-mine"}}))
        assert _line(sock) == {"t": "still-mine"}  # its connection goes on
    _still_serves(server, rank)
    assert server.refused == 0


def test_a_rank_that_resets_its_connection_with_output_queued_leaves_the_plane_serving(served):
    server, rank = served
    sock = _proven(server, 3)
    big = {"t": "pad", "data": "y" * (1 << 16)}
    sock.sendall(b"".join(encode_line({"op": "echo", "rank": 3, "item": big}) for _ in range(64)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset, with megabytes of echoes queued for it and unread
    time.sleep(0.5)
    _still_serves(server, rank)


def test_connections_that_never_prove_who_they_are_are_dropped_and_bounded(monkeypatch, plane):
    monkeypatch.setattr(server_module, "HELLO_SECONDS", 1.0)
    monkeypatch.setattr(server_module, "MAX_UNPROVEN", 16)
    _, server = plane
    rank = MessageLink(*server.address, 0, timeout=10, credentials=CREDENTIALS)
    idle = [socket.create_connection(server.address, timeout=10) for _ in range(40)]
    try:
        _still_serves(server, rank)
        # past the bound, the oldest went at once; the others within their time to prove it
        assert all(_closed_by_server(sock, timeout=5) for sock in idle)
        assert server.refused == 40
        _still_serves(server, rank)
    finally:
        for sock in idle:
            sock.close()
        rank.close()


def _serve_out_of_descriptors(address, ready, stop) -> None:
    """In a forked child: a control plane whose descriptors run out long before its bound on unproven
    connections does (40 descriptors left to it under its soft and hard limit, the bound raised past
    them), so `accept` meets EMFILE."""
    import resource

    limit = len(os.listdir("/proc/self/fd")) + 40  # what this fork inherited from pytest, and 40 more
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    control = ControlPlane()
    server = MessageServer(control.handle, "127.0.0.1", CREDENTIALS, on_disconnect=control.on_disconnect)
    server.max_unproven = 10_000
    server.start()
    address.send(server.address)
    ready.wait(60)
    stop.wait(60)
    address.send((server.alive, server.error is None, server.refused))
    server.close()


def test_a_flood_past_the_descriptor_limit_costs_the_flood_and_never_the_plane():
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_serve_out_of_descriptors, args=(child_end, ready, stop), daemon=True)
    child.start()
    flood: list[socket.socket] = []
    try:
        assert parent_end.poll(30)
        address = tuple(parent_end.recv())
        rank = MessageLink(*address, 0, timeout=10, credentials=CREDENTIALS)
        ready.set()
        for _ in range(300):  # past the plane's 40 descriptors left, never a byte
            flood.append(socket.create_connection(address, timeout=10))
        time.sleep(0.5)
        rank.send({"op": "echo", "rank": 0, "item": {"t": "still-here"}})
        assert rank.receive(timeout=10) == {"t": "still-here"}
        late = MessageLink(*address, 1, timeout=10, credentials=CREDENTIALS)  # a rank that comes now gets in
        late.send({"op": "echo", "rank": 1, "item": {"t": "in"}})
        assert late.receive(timeout=10) == {"t": "in"}
        stop.set()
        assert parent_end.poll(30)
        alive, no_error, refused = parent_end.recv()
        assert alive and no_error and refused > 0  # the oldest unproven connections made room
        late.close()
        rank.close()
    finally:
        stop.set()
        for sock in flood:
            sock.close()
        child.join(10)
        child.kill()


def _limits_raised(report) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (100, 200))
    raised = server_module.raise_descriptor_limit()
    report.send((raised, resource.getrlimit(resource.RLIMIT_NOFILE), server_module.unproven_bound()))


def test_the_plane_raises_its_soft_descriptor_limit_and_bounds_unproven_connections_by_it():
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_limits_raised, args=(child_end,))
    child.start()
    assert parent_end.poll(30)
    assert parent_end.recv() == (200, (200, 200), 50)  # a quarter of the limit stays for unproven ones
    child.join(10)


def test_an_error_in_the_planes_periodic_work_is_logged_not_fatal():
    calls = []

    def tick():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in one tick")
        return {}

    server = MessageServer(lambda message: {}, "127.0.0.1", CREDENTIALS, on_tick=tick, tick_seconds=0.01)
    server.start()
    try:
        rank = MessageLink(*server.address, 0, timeout=10, credentials=CREDENTIALS)
        deadline = time.monotonic() + 10
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        _still_serves(server, rank)
        rank.close()
    finally:
        server.close()


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_the_decoder_turns_any_bytes_into_a_message_or_a_bad_message(line):
    try:
        message = decode_message(line)
    except BadMessage:
        return
    assert isinstance(message, dict) and isinstance(message["op"], str)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
_OPS = st.sampled_from([*RECORDS, "kv", "exec", ""])
_FIELDS = st.sampled_from(
    [
        "s",
        "rank",
        "req",
        "do",
        "key",
        "pid",
        "config",
        "item",
        "sync",
        "progress",
        "members",
        "ok",
        "epoch",
        "back",
        "x",
    ]
)


@settings(max_examples=300, deadline=None)
@given(_OPS, st.sampled_from([*KV_RECORDS, "drop"]), st.dictionaries(_FIELDS, _JSON, max_size=6))
def test_the_decoder_accepts_only_records_of_the_protocol(op, do, fields):
    message = {**fields, "op": op}
    if op == "kv":
        message["do"] = do
    line = json.dumps(message).encode()
    try:
        decoded = decode_message(line)
    except BadMessage:
        return
    record = KV_RECORDS[do] if op == "kv" else RECORDS[op]
    assert set(record.required) <= set(decoded) <= set(record.required) | set(record.optional)
    for key, value in decoded.items():
        rule = record.required.get(key) or record.optional[key]
        assert rule(value), (key, value)


@pytest.mark.parametrize(
    "fields",
    [
        {"op": "summed", "key": "g1", "members": [0, 1], "ok": True, "epoch": -1},
        {"op": "summed", "key": "g1", "members": [0, 1], "ok": True, "epoch": "3"},
        {"op": "summed", "key": "g1", "members": [0, 1], "ok": True, "epoch": 1.5},
        {"op": "summed", "key": "g1", "members": [0, 1], "ok": True, "epoch": 1 << 80},
        {"op": "work", "key": "q", "back": [[1, 2, 3]]},
        {"op": "work", "key": "q", "back": [[1, -2]]},
        {"op": "work", "key": "q", "back": [["1", 2]]},
        {"op": "work", "key": "q", "back": 7},
    ],
)
def test_a_verdicts_membership_epoch_and_a_shard_given_back_are_typed_and_bounded(fields):
    """The fields a rank adds to `summed` (the epoch its group was drawn in) and to `work` (shards given
    back from a position): anything but a count, or a pair of counts, is a bad message."""
    message = {"s": 1, "rank": 0, **fields}
    with pytest.raises(BadMessage):
        decode_message(json.dumps(message).encode())
    good = {**message, "epoch": 3} if fields["op"] == "summed" else {**message, "back": [[1, 40]]}
    assert decode_message(json.dumps(good).encode())["op"] == fields["op"]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(min_size=1, max_size=2048) | st.sampled_from(list(HOSTILE)), min_size=1, max_size=4))
def test_the_servers_loop_survives_any_sequence_of_bytes_on_a_connection(plane, chunks):
    _, server = plane
    rank = _rank_of(server)
    with socket.create_connection(server.address, timeout=10) as stray:
        for chunk in chunks:
            try:
                stray.sendall(HOSTILE[chunk](stray) if isinstance(chunk, str) else chunk)
            except (OSError, AssertionError):
                # refused already: a send to a closed connection, or a handshake helper that found it
                # closed (an AssertionError, or ENOTCONN when it asks the reset socket for its peer)
                break
    _still_serves(server, rank)
    assert not PICKLED_MARKER.exists()


_RANK: list[tuple[MessageServer, MessageLink]] = []


def _rank_of(server: MessageServer) -> MessageLink:
    """Rank 0's link to `server`, made once per server (hypothesis runs many examples on one fixture)."""
    if not _RANK or _RANK[0][0] is not server or _RANK[0][1].closed:
        if _RANK:
            _RANK.pop()[1].close()
        _RANK.append((server, MessageLink(*server.address, 0, timeout=10, credentials=CREDENTIALS)))
    return _RANK[0][1]


# -- fencing: only a process that verifiably holds the hung rank's connection is killed --------------
@pytest.fixture
def fencing_plane():
    """A control plane with its periodic work (the hang detector, fencing), as in the supervisor."""
    control = ControlPlane()
    server = MessageServer(
        control.handle,
        "127.0.0.1",
        CREDENTIALS,
        on_connect=control.on_connect,
        on_disconnect=control.on_disconnect,
        on_tick=control.tick,
        tick_seconds=0.05,
    )
    control.ends = server.ends
    server.start()
    yield server
    server.close()


def _join_and_fall_silent(server: MessageServer, rank: int, pid: int) -> socket.socket:
    """A proven connection of `rank` that joins a one-second-bounded session claiming `pid`, then says nothing."""
    sock = _proven(server, rank)
    config = SessionConfig(4, make_policy("random", 4, 2).spec(), timeout=1.0, hang=HangRule(floor=0.5))
    join = {"op": "join", "s": 1, "rank": rank, "pid": pid, "host": socket.gethostname(), "config": config.to_wire()}
    sock.sendall(encode_line(join))
    return sock


def _sleeper(**kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs)


def test_fencing_kills_the_process_that_holds_the_hung_ranks_connection(fencing_plane):
    sock = _join_and_fall_silent(fencing_plane, 1, 0)  # the pid is fixed below, once the process holds it
    sock.close()
    sock = _proven(fencing_plane, 2)
    worker = _sleeper(pass_fds=[sock.fileno()])  # the connection is the worker's: this process lets it go
    try:
        config = SessionConfig(4, make_policy("random", 4, 2).spec(), timeout=1.0, hang=HangRule(floor=0.5))
        join = {"op": "join", "s": 1, "rank": 2, "pid": worker.pid, "host": socket.gethostname()}
        sock.sendall(encode_line({**join, "config": config.to_wire()}))
        sock.close()
        assert worker.wait(timeout=20) == -signal.SIGKILL
    finally:
        worker.kill()


@pytest.mark.parametrize("claimed", ["init", "the plane", "another process", "nonexistent"])
def test_fencing_never_kills_a_pid_that_a_message_merely_names(fencing_plane, claimed):
    bystander = _sleeper()
    pids = {"init": 1, "the plane": os.getpid(), "another process": bystander.pid, "nonexistent": 1 << 30}
    try:
        sock = _join_and_fall_silent(fencing_plane, 1, pids[claimed])
        fenced = _line(sock)  # hung after a second: told to end itself, since its pid cannot be verified
        while fenced["t"] != "fenced":
            fenced = _line(sock)
        assert bystander.poll() is None  # not killed
        sock.close()
    finally:
        bystander.kill()


def test_a_rank_whose_message_breaks_the_protocol_learns_why_its_connection_was_dropped(plane):
    from lightning_prague.core.errors import ControlPlaneError

    _, server = plane
    link = MessageLink(*server.address, 2, timeout=10, credentials=CREDENTIALS)
    link.send({"op": "beat", "s": 1, "rank": 2, "progress": -1, "waiting": False, "busy": False})
    with pytest.raises(ControlPlaneError, match=r"refused a message of this rank: 'beat': field 'progress' is -1"):
        link.receive(timeout=10)
    link.close()
    assert server.refused == 1 and server.alive


def test_a_fenced_process_that_never_closes_its_connection_holds_its_rank_no_longer(fencing_plane):
    sock = _join_and_fall_silent(fencing_plane, 1, 1 << 30)  # a remote-looking process: told to end itself
    fenced = _line(sock)
    while fenced["t"] != "fenced":
        fenced = _line(sock)
    assert _closed_by_server(sock)  # it stays frozen (never reads on, never closes): the plane closes it
    replacement = _proven(fencing_plane, 1)  # a new process for the rank is welcome at once
    replacement.close()
    sock.close()


def test_items_queued_for_a_rank_that_never_connects_are_bounded(monkeypatch):
    monkeypatch.setattr(server_module, "MAX_WAITING_BYTES", 1000)
    server = MessageServer(lambda message: {}, "127.0.0.1", CREDENTIALS)  # (its loop is not needed here)
    try:
        item = {"t": "pad", "data": "x" * 600}
        for _ in range(5):
            server._route({5: [item]}, {})
        assert len(server._waiting[5]) < 2 * 1000 and server.messages_dropped == 3
    finally:
        server._listener.close()
