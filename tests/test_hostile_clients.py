"""A bad connection costs only itself: what a rank never sends, sent to a real control plane.

Each case opens a raw socket to a running `MessageServer` + `ControlPlane` next to a real rank's
`MessageLink`, sends something no rank sends, and checks that this one connection is closed, the
server is still serving, and the real rank's link still works (its echo comes back). A hypothesis
fuzz checks that the decoder turns any bytes into a message or a `BadMessage`, nothing else.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_prague.core import ControlPlane
from lightning_prague.core.client.link import MessageLink
from lightning_prague.core.plane.server import MAX_LINE_BYTES, BadMessage, MessageServer, decode_message
from lightning_prague.core.protocol import encode_line

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def served(plane):
    """The control plane (conftest's `plane`) and a real rank 0's link to it."""
    _, server = plane
    rank = MessageLink(*server.address, 0, timeout=10)
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
    assert server.connected == {0}


HOSTILE = {
    "an HTTP request line": b"GET / HTTP/1.0\r\n\r\n",
    "random bytes": os.urandom(64 << 10) + b"\n",
    "a JSON value that is not an object": b"[1, 2, 3]\n",
    "an object without an op": b'{"rank": 0}\n',
    "a message before hello": encode_line({"op": "join", "s": 1, "rank": 1, "config": "x"}),
    "a hello for a rank that is no rank": encode_line({"op": "hello", "rank": "1; rm -rf /"}),
    "a hello for a negative rank": encode_line({"op": "hello", "rank": -1}),
    "a hello for a live rank": encode_line({"op": "hello", "rank": 0}),
    "a message in another rank's name": encode_line({"op": "hello", "rank": 5})
    + encode_line({"op": "echo", "rank": 0, "item": {"t": "stolen"}}),
    "an echo without an item": encode_line({"op": "hello", "rank": 6}) + encode_line({"op": "echo", "rank": 6}),
    "a second hello on one connection": encode_line({"op": "hello", "rank": 7})
    + encode_line({"op": "hello", "rank": 8}),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_a_line_no_rank_sends_costs_its_sender_the_connection_and_nothing_else(served, what):
    server, rank = served
    with socket.create_connection(server.address, timeout=10) as stray:
        stray.sendall(HOSTILE[what])
        assert _closed_by_server(stray), f"the server kept a connection that sent {what}"
    _still_serves(server, rank)
    assert server.refused == 1
    assert 0 in server.connected and server.connected <= {0, 5, 6, 7}


def test_a_line_longer_than_the_bound_is_refused_before_its_end(served):
    server, rank = served
    with socket.create_connection(server.address, timeout=10) as stray:
        try:
            stray.sendall(b"x" * (MAX_LINE_BYTES + (1 << 16)))  # no newline ever comes
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused while still sending
        assert _closed_by_server(stray)
    _still_serves(server, rank)


def test_a_rank_that_resets_its_connection_with_output_queued_leaves_the_plane_serving(served):
    server, rank = served
    sock = socket.create_connection(server.address, timeout=10)
    sock.sendall(encode_line({"op": "hello", "rank": 3}))
    big = {"t": "pad", "data": "y" * (1 << 16)}
    sock.sendall(b"".join(encode_line({"op": "echo", "rank": 3, "item": big}) for _ in range(64)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset, with megabytes of echoes queued for it and unread
    time.sleep(0.5)
    _still_serves(server, rank)


def test_connections_held_open_without_a_byte_do_no_harm(served):
    server, rank = served
    idle = [socket.create_connection(server.address, timeout=10) for _ in range(50)]
    try:
        _still_serves(server, rank)
    finally:
        for sock in idle:
            sock.close()
    _still_serves(server, rank)


def test_an_error_in_the_planes_periodic_work_is_logged_not_fatal():
    calls = []

    def tick():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug in one tick")
        return {}

    server = MessageServer(lambda message: {}, "127.0.0.1", on_tick=tick, tick_seconds=0.01)
    server.start()
    try:
        rank = MessageLink(*server.address, 0, timeout=10)
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


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    )
)
def test_the_decoder_accepts_exactly_the_json_objects_with_a_string_op(value):
    line = encode_line(value)[:-1]
    if isinstance(value, dict) and isinstance(value.get("op"), str):
        assert decode_message(line) == value
    else:
        with pytest.raises(BadMessage):
            decode_message(line)


@pytest.mark.parametrize("pid", [-1, 0, 1, "own"])
def test_fencing_never_kills_a_pid_that_cannot_be_a_worker(monkeypatch, pid):
    from types import SimpleNamespace

    from lightning_prague.core.plane import coordinator

    killed: list[int] = []
    monkeypatch.setattr(coordinator.os, "kill", lambda target, signal: killed.append(target))
    pid = os.getpid() if pid == "own" else pid
    session = SimpleNamespace(number=1, processes={3: (pid, socket.gethostname())})
    out: dict = {}
    ControlPlane._fence(session, 3, "hung", out)
    assert killed == [] and out == {3: [{"t": "fenced", "reason": "hung"}]}
    session.processes[3] = (os.getpid() + 1_000_000, socket.gethostname())  # a pid a worker may have
    ControlPlane._fence(session, 3, "hung", out)
    assert killed == [os.getpid() + 1_000_000]
