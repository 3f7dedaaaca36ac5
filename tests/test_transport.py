"""The control plane in one process: the transport (order, batching, echo, timeouts, closing) and the
coordinator's sessions, counters and membership, driven through real connections."""

from __future__ import annotations

import threading
import time

import pytest
from helpers import CREDENTIALS, LAUNCH, loose_decode, plane_credentials

from lightning_prague.core import ControlClient, SessionConfig, make_policy
from lightning_prague.core.client.link import MessageLink
from lightning_prague.core.errors import CONTROL_PLANE, ControlPlaneError, CoordinationTimeout
from lightning_prague.core.plane.server import MessageServer

pytestmark = pytest.mark.timeout(60)


def _echo_server() -> MessageServer:
    """A server whose handler sends every message's ``items`` to the ranks they name."""

    def handle(message: dict) -> dict[int, list[dict]]:
        return {int(rank): items for rank, items in message["to"].items()}

    server = MessageServer(handle, "127.0.0.1", CREDENTIALS, decode=loose_decode)
    server.start()
    return server


def test_items_arrive_in_the_order_they_were_produced_and_wait_for_ranks_not_yet_connected():
    server = _echo_server()
    host, port = server.address
    try:
        sender = MessageLink(host, port, 0, timeout=10, credentials=CREDENTIALS)
        for i in range(200):  # many messages in flight at once: the server handles them in batches
            sender.send({"op": "x", "rank": 0, "to": {"0": [{"t": "n", "i": i}], "1": [{"t": "n", "i": -i}]}})
        assert [sender.receive()["i"] for _ in range(200)] == list(range(200))
        late = MessageLink(
            host, port, 1, timeout=10, credentials=CREDENTIALS
        )  # rank 1 connects after its items were produced
        assert [late.receive()["i"] for _ in range(200)] == [-i for i in range(200)]
    finally:
        server.close()


def test_an_echo_comes_behind_everything_already_sent_and_wakes_a_blocked_receiver():
    server = _echo_server()
    host, port = server.address
    try:
        link = MessageLink(host, port, 3, timeout=10, credentials=CREDENTIALS)
        got: list[dict] = []
        reader = threading.Thread(target=lambda: got.extend(link.receive() for _ in range(2)))
        reader.start()
        time.sleep(0.1)
        link.send({"op": "x", "rank": 3, "to": {"3": [{"t": "group"}]}})
        link.send({"op": "echo", "rank": 3, "item": {"t": "pause"}})  # from another thread than the reader
        reader.join(10)
        assert got == [{"t": "group"}, {"t": "pause"}]
    finally:
        server.close()


def test_receive_times_out_with_none_and_a_closed_server_is_an_error_naming_the_rank():
    server = _echo_server()
    host, port = server.address
    link = MessageLink(host, port, 2, timeout=10, credentials=CREDENTIALS)
    start = time.monotonic()
    assert link.receive(timeout=0.2) is None
    assert time.monotonic() - start < 5
    server.close()
    with pytest.raises(CoordinationTimeout, match="rank 2: the control plane closed the connection"):
        link.receive(timeout=5)


def test_a_server_that_is_not_there_is_an_error_naming_the_rank_and_the_address():
    server = _echo_server()
    host, port = server.address
    server.close()
    with pytest.raises(CoordinationTimeout, match=f"rank 5: cannot connect to the control plane at {host}"):
        MessageLink(host, port, 5, timeout=2, credentials=CREDENTIALS)


def test_a_new_process_waits_for_its_predecessors_connection_to_close_and_another_live_one_is_refused(
    monkeypatch,
):
    """A process started for a rank whose previous process died an instant ago can reach the server before
    the server reads that connection's close: the server refuses its hello (a live rank's connection is
    never taken over) and says why, and the new process tries again until the old connection closed. It
    once failed a rejoin under srun. A rank whose other process lives is refused for good, with a message
    that says so."""
    import lightning_prague.core.client.link as link_module

    server = _echo_server()
    host, port = server.address
    first = MessageLink(host, port, 3, timeout=10, credentials=CREDENTIALS)
    closer = threading.Timer(1.0, first.close)
    closer.start()
    start = time.monotonic()
    second = MessageLink(host, port, 3, timeout=10, credentials=CREDENTIALS)  # in once the first one closed
    assert 0.9 < time.monotonic() - start < 8
    monkeypatch.setattr(link_module, "CONNECTED_ALREADY_SECONDS", 1.0)
    with pytest.raises(CoordinationTimeout, match="rank 3: the control plane still held a connection of this rank"):
        MessageLink(host, port, 3, timeout=10, credentials=CREDENTIALS)
    second.close()
    server.close()


def _clients(server: MessageServer, world: int) -> list[ControlClient]:
    host, port = server.address
    return [ControlClient(host, port, rank, timeout=10, credentials=CREDENTIALS) for rank in range(world)]


def _config(world: int) -> SessionConfig:
    return SessionConfig(world, make_policy("random", world, 2, seed=0).spec())


def test_ranks_of_a_session_get_groups_and_share_counters_that_vanish_with_the_session(plane):
    control, server = plane
    clients = _clients(server, 4)
    sessions = [c.open_session(1, _config(4)) for c in clients]
    sessions[1].send("ready", req=1, version=0)
    group = sessions[1].receive()
    answer = sessions[1].receive()
    assert group["t"] == "group" and 1 in group["members"] and len(group["members"]) == 2
    assert answer == {"t": "answer", "req": 1, "gid": group["gid"], "s": 1}
    partner = next(r for r in group["members"] if r != 1)
    assert sessions[partner].receive() == group  # the same item, in the partner's inbox
    # counters: atomic across ranks, TCPStore's interface
    claims = [s.counters.add("epoch/0/cursor", 1) for s in sessions for _ in range(5)]
    assert sorted(claims) == list(range(1, 21))
    assert sessions[0].counters.compare_set("mode", "", "idle") == b"idle"
    assert sessions[3].counters.compare_set("mode", "", "fast") == b"idle"  # the first one wins
    waiter = threading.Thread(target=lambda: sessions[2].counters.wait(["end"]))
    waiter.start()
    time.sleep(0.1)
    sessions[0].counters.set("end", "17")
    waiter.join(5)
    assert not waiter.is_alive() and sessions[2].counters.get("end") == b"17"
    assert control.sessions[1].values  # the counters live in the session...
    for s in sessions:
        s.close()
    time.sleep(0.2)
    assert control.sessions == {}  # ...and go with it
    for c in clients:
        c.close()


def test_a_rank_whose_connection_closes_is_named_to_every_other_member_at_once_and_they_go_on(plane):
    _, server = plane
    clients = _clients(server, 3)
    sessions = [c.open_session(7, _config(3)) for c in clients]
    sessions[0].send("arrive", sync="epoch_end")  # rank 0 waits at a synchronization point
    clients[2].close()  # rank 2's process ends (kill -9 closes its sockets the same way)
    item = sessions[0].receive(timeout=5)
    assert item["t"] == "departed" and item["rank"] == 2 and item["members"] == [0, 1]
    assert sessions[1].receive(timeout=5)["t"] == "departed"
    assert sessions[1].departed == {2: "its process ended: its connection to the control plane closed"}
    assert sessions[1].members == [0, 1]
    sessions[1].check_members("training")  # a lost rank is no error: the survivors go on
    sessions[1].send("arrive", sync="epoch_end")  # the meeting waits for the live ranks only
    for s in sessions[:2]:
        release = s.receive(timeout=5)
        assert release["t"] == "release" and release["members"] == [0, 1]
    for c in clients[:2]:
        c.close()


def test_a_rank_that_leaves_after_an_error_is_named_and_a_closed_session_reports_nobody(plane):
    _, server = plane
    clients = _clients(server, 2)
    first = [c.open_session(1, _config(2)) for c in clients]
    for s in first:  # a fit that ended: its members met at its end (a close before it is a departure)
        s.send("arrive", sync="fit_end")
    for s in first:
        assert s.receive(timeout=5)["t"] == "release"
        s.close()
    second = [c.open_session(2, _config(2)) for c in clients]
    clients[0].close()  # gone after the first session ended: only the second one hears of it
    assert second[1].receive(timeout=5)["t"] == "departed"
    assert first[1].departed == {}
    second[1].send("leave")
    assert second[1].receive(timeout=5)["t"] == "left"
    clients[1].close()


def test_a_stop_asked_by_one_rank_reaches_every_rank_and_the_release_says_stop(plane):
    _, server = plane
    clients = _clients(server, 3)
    sessions = [c.open_session(1, _config(3)) for c in clients]
    sessions[2].send("arrive", sync="epoch_end@epoch0", stop=True, speed=0.5, untrained=[7])
    for rank in (0, 1):
        assert sessions[rank].receive(timeout=5) == {"t": "stop", "reason": "request", "s": 1}
        assert sessions[rank].stop_reason == "request"
        sessions[rank].send("arrive", sync="epoch_end@epoch0", stop=False, speed=0.1 * (rank + 1), untrained=[rank])
    releases = [s.receive(timeout=5) for s in sessions[:2]] + [sessions[2].receive(timeout=5)]
    releases[2] = releases[2] if releases[2]["t"] == "release" else sessions[2].receive(timeout=5)
    for release in releases:
        assert release["t"] == "release" and release["stop"] is True
        assert release["speeds"] == [0.1, 0.2, 0.5] and release["pending"] == [0, 1, 7]
    for c in clients:
        c.close()


def test_a_control_plane_that_goes_away_is_an_error_at_the_next_check(plane):
    _, server = plane
    client = _clients(server, 1)[0]
    session = client.open_session(1, _config(2))
    session.check_members("training")  # nothing to report
    server.close()
    deadline = time.monotonic() + 5
    while not client.closed and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(
        CoordinationTimeout, match=r"rank 0: the control plane at .* closed the connection.*during training"
    ):
        session.check_members("training")


def _wait_for_exit(handle, seconds: float) -> int | None:
    deadline = time.monotonic() + seconds
    while handle.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return handle.poll()


def test_the_supervisor_exits_by_itself_when_nobody_comes_and_when_everyone_has_gone():
    from datetime import timedelta

    import torch.distributed as dist
    from helpers import free_port

    from lightning_prague.core.plane.launch import launch, wait_until_listening
    from lightning_prague.core.protocol import address_key

    # nobody connects: it waits as long as the rendezvous may take (`wait`), not one operation's timeout
    port = free_port()
    started = time.monotonic()
    lonely = launch("127.0.0.1", port, 2, timeout=0.2, host_store=True, wait=2.0, **LAUNCH)
    wait_until_listening(lonely, "127.0.0.1", port, timeout=30)
    assert _wait_for_exit(lonely, 30) == 0
    assert time.monotonic() - started >= 2.0  # not gone at its operation timeout
    # both ranks come (through the store it hosts) and go: it goes, and takes the store with it
    port = free_port()
    job = launch("127.0.0.1", port, 2, timeout=60.0, host_store=True, **LAUNCH)
    wait_until_listening(job, "127.0.0.1", port, timeout=30)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30), wait_for_workers=False)
    store.wait([address_key()], timedelta(seconds=30))
    host, control_port, pid, credentials = plane_credentials(store, address_key())
    assert pid == job.pid
    clients = [ControlClient(host, control_port, rank, timeout=10, credentials=credentials) for rank in range(2)]
    clients[0].close()
    time.sleep(0.3)
    assert job.poll() is None, "rank 1 is still connected"
    clients[1].close()
    assert _wait_for_exit(job, 15) == 0


def test_a_quiet_control_plane_is_no_error_however_long_nothing_arrives(plane):
    # the link's timeout bounds sends and requests, not silence: a gossiping worker may hear nothing for long
    _, server = plane
    host, port = server.address
    client = ControlClient(host, port, 0, timeout=0.5, credentials=CREDENTIALS)
    session = client.open_session(1, _config(2))
    time.sleep(1.5)
    assert not client.closed
    session.counters.add("k", 1)  # the connection still works
    client.close()


def test_ranks_that_all_fail_still_leave_after_their_session_is_over(plane):
    _, server = plane
    clients = _clients(server, 2)
    sessions = [c.open_session(1, _config(2)) for c in clients]
    for s in sessions:
        s.send("leave")  # both fits fail: the session is over once both departed
    for s in sessions:
        kinds = []
        while not kinds or kinds[-1] != "left":
            item = s.receive(timeout=5)
            assert item is not None, kinds
            kinds.append(item["t"])
    for c in clients:
        c.close()


def test_a_message_the_control_plane_rejects_is_reported_to_its_sender_only_and_costs_nothing_else(plane):
    _, server = plane
    clients = _clients(server, 2)
    session = clients[0].open_session(1, _config(2))
    session.counters.set("k", "text")
    with pytest.raises(ControlPlaneError, match="the control plane rejected 'kv'"):
        session.counters.add("k", 1)  # a well-formed message the plane's logic cannot do
    other = clients[1].open_session(1, _config(3))  # another configuration than the session's
    item = other.receive(timeout=5)
    assert item["t"] == "error" and item["source"] == CONTROL_PLANE and "another configuration" in item["message"]
    assert session.counters.add("n", 2) == 2  # both connections still work
    assert server.connected == {0, 1}
    for c in clients:
        c.close()


def test_a_server_that_fails_tells_every_client_its_error_before_closing():
    def handle(message: dict) -> dict[int, list[dict]]:
        raise SystemExit("the handler's thread is ending")  # not an Exception: it ends the server's loop

    server = MessageServer(handle, "127.0.0.1", CREDENTIALS, decode=loose_decode)
    server.start()
    host, port = server.address
    links = [MessageLink(host, port, rank, timeout=10, credentials=CREDENTIALS) for rank in range(2)]
    try:
        links[0].send({"op": "x", "rank": 0})
        for link in links:  # at once, not after a timeout, and with the server's own error
            with pytest.raises(ControlPlaneError, match="failed: SystemExit: the handler's thread is ending"):
                link.receive(timeout=5)
    finally:
        server.close()


def test_a_router_that_fails_ends_the_link_with_its_error_not_a_silent_reader():
    server = _echo_server()
    host, port = server.address

    def router(message: dict) -> bool:
        if message.get("t") == "poison":
            raise KeyError("req")
        return False

    link = MessageLink(host, port, 0, timeout=10, credentials=CREDENTIALS, router=router)
    try:
        link.send({"op": "x", "rank": 0, "to": {"0": [{"t": "fine"}, {"t": "poison"}, {"t": "after"}]}})
        assert link.receive(timeout=5) == {"t": "fine"}
        with pytest.raises(ControlPlaneError, match=r"could not handle its item \{'t': 'poison'\} \(KeyError"):
            link.receive(timeout=5)
    finally:
        link.close()
        server.close()


def test_control_plane_connections_probe_an_idle_peer_and_give_up_on_a_silent_one():
    """Keepalive probes find a peer host that vanished while the connection was idle, and the user
    timeout bounds both them and unacknowledged data (15 minutes), so a lost node's connection ends."""
    import socket

    from lightning_prague.core.protocol import KEEPALIVE, USER_TIMEOUT_MS, tune_socket

    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_connection(listener.getsockname()) as sock:
        tune_socket(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE["TCP_KEEPIDLE"]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == USER_TIMEOUT_MS
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
