"""The coordinator's message transport, in one process: order, batching, echo, timeouts, closing."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import free_port

from lightning_prague.core import CoordinatorService, GroupGenerator, StoreAddress, make_policy
from lightning_prague.core.coordinator import connect_to_coordinator
from lightning_prague.core.errors import CoordinationTimeout
from lightning_prague.core.transport import MessageLink, MessageServer

pytestmark = pytest.mark.timeout(60)


def _echo_server() -> MessageServer:
    """A server whose handler sends every message's ``items`` to the ranks they name."""

    def handle(message: dict) -> dict[int, list[dict]]:
        return {int(rank): items for rank, items in message["to"].items()}

    server = MessageServer(handle, "127.0.0.1")
    server.start()
    return server


def test_items_arrive_in_the_order_they_were_produced_and_wait_for_ranks_not_yet_connected():
    server = _echo_server()
    host, port = server.address
    try:
        sender = MessageLink(host, port, 0, timeout=10)
        for i in range(200):  # many messages in flight at once: the server handles them in batches
            sender.send({"op": "x", "rank": 0, "to": {"0": [{"t": "n", "i": i}], "1": [{"t": "n", "i": -i}]}})
        assert [sender.receive()["i"] for _ in range(200)] == list(range(200))
        late = MessageLink(host, port, 1, timeout=10)  # rank 1 connects after its items were produced
        assert [late.receive()["i"] for _ in range(200)] == [-i for i in range(200)]
    finally:
        server.close()


def test_an_echo_comes_behind_everything_already_sent_and_wakes_a_blocked_receiver():
    server = _echo_server()
    host, port = server.address
    try:
        link = MessageLink(host, port, 3, timeout=10)
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


def test_receive_times_out_with_none_and_a_closed_coordinator_is_an_error_naming_rank_0():
    server = _echo_server()
    host, port = server.address
    link = MessageLink(host, port, 2, timeout=10)
    start = time.monotonic()
    assert link.receive(timeout=0.2) is None
    assert time.monotonic() - start < 5
    server.close()
    with pytest.raises(CoordinationTimeout, match="rank 2: the coordinator of rank 0 closed the connection"):
        link.receive(timeout=5)


def test_a_coordinator_that_is_not_there_is_an_error_naming_the_rank_and_the_address():
    server = _echo_server()
    host, port = server.address
    server.close()
    with pytest.raises(CoordinationTimeout, match=f"rank 5: cannot connect to the coordinator of rank 0 at {host}"):
        MessageLink(host, port, 5, timeout=2)


def test_workers_find_the_coordinator_through_the_store_and_get_groups():
    port = free_port()
    server_store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    address = StoreAddress("127.0.0.1", port, "transport-test")
    generator = GroupGenerator(4, make_policy("random", 4, 2, seed=0))
    service = CoordinatorService(address, generator)
    service.start()
    try:
        links = [connect_to_coordinator(address.connect(10), rank, timeout=10) for rank in range(4)]
        links[1].send({"op": "ready", "rank": 1, "req": 1, "version": 0})
        group = links[1].receive()
        answer = links[1].receive()
        assert group["t"] == "group" and 1 in group["members"] and len(group["members"]) == 2
        assert answer == {"t": "answer", "req": 1, "gid": group["gid"]}
        partner = next(r for r in group["members"] if r != 1)
        assert links[partner].receive() == group  # the same item, in the partner's inbox
        before = server_store.num_keys()
        for req in range(2, 50):
            links[1].send({"op": "ready", "rank": 1, "req": req, "version": 0})
        while links[1].receive(timeout=10)["t"] != "answer" or service.handled < 49:
            pass
        assert server_store.num_keys() == before  # requests and groups never touch the store
        for link in links:
            link.close()
    finally:
        service.close()
