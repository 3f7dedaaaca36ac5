"""Fencing kills only the process that verifiably holds the worker's connection (real processes)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from lightning_prague.core.plane import fencing
from lightning_prague.core.plane.fencing import fence, owns_connection

pytestmark = pytest.mark.timeout(60)

if not sys.platform.startswith("linux"):
    pytest.skip("fencing verifies connections through Linux's /proc", allow_module_level=True)

# connects to the given address, says so, then holds the connection until the server closes it (so
# that a child can never outlive its test for long) or 60 s have passed
_CLIENT = """
import socket, sys
family = socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET
s = socket.socket(family, socket.SOCK_STREAM)
s.connect((sys.argv[1], int(sys.argv[2])))
sys.stdout.write("connected\\n")
sys.stdout.flush()
s.settimeout(60)
try:
    s.recv(1)
except OSError:
    pass
"""


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)
    if process.stdout is not None:
        process.stdout.close()


@contextlib.contextmanager
def _connected_child(
    host: str, family: socket.AddressFamily = socket.AF_INET
) -> Iterator[tuple[subprocess.Popen, tuple[str, int], tuple[str, int]]]:
    """A child process connected to a listener of this test: (child, client, server) as the
    server's accepted socket sees them."""
    listener = socket.socket(family, socket.SOCK_STREAM)
    child = None
    conn = None
    try:
        listener.bind((host, 0))
        listener.listen(1)
        listener.settimeout(20)
        port = listener.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", _CLIENT, host, str(port)], stdout=subprocess.PIPE, text=True)
        conn, _ = listener.accept()
        assert child.stdout is not None and child.stdout.readline().strip() == "connected"
        yield child, conn.getpeername()[:2], conn.getsockname()[:2]
    finally:
        if child is not None:
            _stop(child)
        if conn is not None:
            conn.close()
        listener.close()


@contextlib.contextmanager
def _bystander() -> Iterator[subprocess.Popen]:
    """A real process of this user that holds no such socket."""
    process = subprocess.Popen(["sleep", "30"])
    try:
        yield process
    finally:
        _stop(process)


def test_the_owner_is_verified_and_fenced() -> None:
    with _connected_child("127.0.0.1") as (child, client, server):
        assert client[0] == "127.0.0.1" and server[0] == "127.0.0.1"
        assert owns_connection(child.pid, client, server)
        assert fence(child.pid, client, server)
        assert child.wait(timeout=10) == -signal.SIGKILL


def test_an_ipv4_mapped_spelling_is_the_same_address() -> None:
    with _connected_child("127.0.0.1") as (child, client, server):
        mapped_client = (f"::ffff:{client[0]}", client[1])
        mapped_server = (f"::ffff:{server[0]}", server[1])
        assert owns_connection(child.pid, mapped_client, mapped_server)


def test_another_process_is_not_the_owner_and_is_not_killed() -> None:
    with _connected_child("127.0.0.1") as (child, client, server), _bystander() as other:
        assert not owns_connection(other.pid, client, server)
        assert not fence(other.pid, client, server)
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=0.5)
        assert other.poll() is None
        assert child.poll() is None  # the real owner was not touched either


def test_a_wrong_client_port_is_not_verified() -> None:
    with _connected_child("127.0.0.1") as (child, client, server):
        wrong = (client[0], client[1] + 1 if client[1] < 65535 else client[1] - 1)
        assert not owns_connection(child.pid, wrong, server)
        assert not owns_connection(child.pid, server, client)  # the server's end is not the client's
        assert not fence(child.pid, wrong, server)
        assert child.poll() is None


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait(timeout=10)
    pid = process.pid
    assert not os.path.exists(f"/proc/{pid}")  # reaped; reuse this soon is practically impossible
    return pid


@pytest.mark.parametrize("kind", ["-1", "0", "1", "self", "dead"])
def test_forbidden_and_missing_pids_are_never_killed(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kills: list[tuple] = []
    with _connected_child("127.0.0.1") as (child, client, server):
        pid = {"-1": -1, "0": 0, "1": 1, "self": os.getpid(), "dead": _dead_pid()}[kind]
        with monkeypatch.context() as patch:  # undone before the cleanup kills the child
            patch.setattr(os, "kill", lambda *args: kills.append(("kill", *args)))
            if hasattr(signal, "pidfd_send_signal"):
                patch.setattr(signal, "pidfd_send_signal", lambda *args: kills.append(("pidfd", *args)))
            assert not owns_connection(pid, client, server)
            assert not fence(pid, client, server)
        assert kills == []
        assert child.poll() is None


def test_malformed_input_is_not_verified() -> None:
    with _connected_child("127.0.0.1") as (child, client, server):
        assert not owns_connection(str(child.pid), client, server)  # type: ignore[arg-type]
        assert not owns_connection(True, client, server)
        assert not owns_connection(child.pid, ("not an ip", client[1]), server)
        assert not owns_connection(child.pid, client, ("127.0.0.1",))  # type: ignore[arg-type]
        assert child.poll() is None


def test_a_failed_kill_returns_false(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise PermissionError("refused")

    with _connected_child("127.0.0.1") as (child, client, server):
        assert owns_connection(child.pid, client, server)
        with monkeypatch.context() as patch:  # undone before the cleanup kills the child
            patch.setattr(os, "kill", refuse)
            if hasattr(signal, "pidfd_send_signal"):
                patch.setattr(signal, "pidfd_send_signal", refuse)
            assert not fence(child.pid, client, server)
        assert child.poll() is None


def test_without_pidfds_fence_falls_back_to_os_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fencing, "_open_pidfd", lambda pid: None)
    with _connected_child("127.0.0.1") as (child, client, server):
        assert fence(child.pid, client, server)
        assert child.wait(timeout=10) == -signal.SIGKILL


def _ipv6_loopback_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback_works(), reason="no IPv6 loopback here")
def test_an_ipv6_connection_is_verified() -> None:
    with _connected_child("::1", socket.AF_INET6) as (child, client, server):
        assert client[0] == "::1"
        assert owns_connection(child.pid, client, server)
        with _bystander() as other:
            assert not owns_connection(other.pid, client, server)
        assert fence(child.pid, client, server)
        assert child.wait(timeout=10) == -signal.SIGKILL


def _mapped_loopback_works() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::ffff:127.0.0.1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _mapped_loopback_works(), reason="no IPv4-mapped IPv6 sockets here")
def test_an_ipv4_mapped_connection_is_verified() -> None:
    # both ends are IPv6 sockets, so the client's row is in /proc/net/tcp6, as a mapped address
    with _connected_child("::ffff:127.0.0.1", socket.AF_INET6) as (child, client, server):
        assert client[0] == "::ffff:127.0.0.1"
        assert owns_connection(child.pid, client, server)
        assert owns_connection(child.pid, ("127.0.0.1", client[1]), ("127.0.0.1", server[1]))
        assert not owns_connection(child.pid, (client[0], server[1]), server)
        assert fence(child.pid, client, server)
        assert child.wait(timeout=10) == -signal.SIGKILL
