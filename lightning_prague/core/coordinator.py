"""The coordinator service: a thread on global rank 0 that runs the Group Generator.

Workers send messages over one connection each (`lightning_prague.core.transport`); the
service handles them one at a time in a single thread, feeds
`GroupGenerator`, and sends the items a message produces
to each worker it names. A single consumer gives the one global order of assignments that makes
group operations deadlock-free. The job's TCPStore only carries the service's address (set once)
and the `parked` hint of a synchronization point.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import torch.distributed as dist

from lightning_prague.core.errors import CoordinationTimeout
from lightning_prague.core.generator import GroupGenerator, Item
from lightning_prague.core.store import StoreAddress, encode
from lightning_prague.core.transport import MessageLink, MessageServer

log = logging.getLogger(__name__)

#: the store key (under the session's prefix) that holds the service's `host:port`
ADDRESS_KEY = "coordinator"


class CoordinatorService:
    """Runs a `GroupGenerator` behind a `MessageServer` until `close`."""

    def __init__(self, address: StoreAddress, generator: GroupGenerator, poll_timeout: float = 60.0) -> None:
        self.address = address
        self.generator = generator
        self.poll_timeout = poll_timeout
        self.handled = 0
        self._store: dist.Store | None = None
        self._server: MessageServer | None = None

    def start(self) -> None:
        """Listen, publish the address in the store, and serve from a daemon thread."""
        self._store = self.address.open(self.poll_timeout)  # in the caller: fail early, not in the thread
        self._server = MessageServer(self._handle, self.address.host)
        host, port = self._server.address
        if host in ("0.0.0.0", "::"):  # listening on every interface: the workers reach us by this host's name
            host = self.address.host if self.address.host in ("127.0.0.1", "localhost") else socket.getfqdn()
        else:
            host = self.address.host
        self._store.set(ADDRESS_KEY, f"{host}:{port}")
        self._server.start()

    def _handle(self, message: dict) -> dict[int, list[Item]]:
        try:
            items = self.generator.handle(message)
        except Exception as err:  # a malformed message must not kill the service silently
            log.exception("coordinator rejected message %s", message)
            items = {int(message.get("rank", 0)): [{"t": "error", "message": f"coordinator: {err}"}]}
        if message.get("op") == "arrive" and self._store is not None:
            # lets a timed-out worker name the ranks it waited for (once per rank and synchronization point)
            self._store.set("parked", encode(sorted(self.generator.parked)))
        self.handled += 1
        return items

    @property
    def error(self) -> BaseException | None:
        return None if self._server is None else self._server.error

    @property
    def messages(self) -> int:
        """Messages received plus items sent by the service so far."""
        return 0 if self._server is None else self._server.messages_in + self._server.messages_out

    @property
    def writes(self) -> int:
        """Socket writes of the service so far (one per worker and batch of items)."""
        return 0 if self._server is None else self._server.writes

    def await_departures(self, timeout: float) -> list[int]:
        """Keep serving until every rank has left after an error; returns the ranks that did not.

        Rank 0 calls this before `close` when it is torn down by an error: the other ranks
        leave through this service (at once if they failed too, or at their next synchronization
        point, which reports rank 0's departure), and would wait in vain if it were already gone.
        """
        deadline = time.monotonic() + timeout
        while self.alive and time.monotonic() < deadline:
            if len(self.generator.left) == self.generator.world_size:
                return []
            time.sleep(0.01)
        return sorted(set(range(self.generator.world_size)) - self.generator.left)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; safe to call twice. Call only after every worker is done with it."""
        server, self._server = self._server, None
        if server is not None:
            server.close(timeout)

    @property
    def alive(self) -> bool:
        return self._server is not None and self._server.alive


def connect_to_coordinator(store: dist.Store, rank: int, timeout: float) -> MessageLink:
    """Open `rank`'s connection to the coordinator whose address rank 0 published in `store`."""
    try:
        store.wait([ADDRESS_KEY], timedelta(seconds=timeout))
        host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
    except dist.DistStoreError as err:
        raise CoordinationTimeout(
            f"rank {rank}: the coordinator of rank 0 did not publish its address within {timeout:.0f}s ({err})"
        ) from None
    return MessageLink(host, int(port), rank, timeout)
