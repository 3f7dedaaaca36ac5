"""Access to torch.distributed's TCPStore, the one rendezvous service every job already has.

The work queue's counters, the end-of-phase agreement of gossip and the coordinator's published
address live in it (the coordinator's messages have their own connections,
`lightning_prague.core.transport`). Every user in a process shares one client connection
(`StoreAddress.open`): the one `torch.distributed` opened for the default process group
when it points at the same store, else one opened on first use. TCPStore clients serialize their
operations, so threads may share them. New connections are avoided on purpose: when a few dozen
clients connect to one TCPStore at the same moment (every rank at setup), some of them wait about
5 s for the server to accept them (measured with 32 processes on torch 2.13).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_prague.core.errors import CoordinationTimeout


@dataclass(frozen=True)
class StoreAddress:
    """Where the job's TCPStore listens, plus a key prefix that isolates one training session."""

    host: str
    port: int
    prefix: str = "prague"

    @classmethod
    def from_env(cls, prefix: str = "prague") -> StoreAddress:
        """Read `MASTER_ADDR`/`MASTER_PORT`, the variables every torch launcher sets."""
        try:
            return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), prefix)
        except KeyError as err:
            raise CoordinationTimeout(
                f"cannot find the TCPStore: environment variable {err.args[0]} is not set; "
                "initialize torch.distributed with the env:// method (torchrun and Lightning do)"
            ) from None

    def child(self, name: str) -> StoreAddress:
        """The same store under a longer prefix."""
        return StoreAddress(self.host, self.port, f"{self.prefix}/{name}")

    def attach(self, client: dist.Store) -> dist.Store:
        """`client` (a raw store client) seen under this address's prefix."""
        return dist.PrefixStore(f"{self.prefix}/", client)

    def connect(self, timeout: float) -> dist.Store:
        """Open a new client connection; every blocking call on it waits at most `timeout` s."""
        return self.attach(_tcp_client(self.host, self.port, timeout))

    def open(self, timeout: float) -> dist.Store:
        """This process's shared client of the store, under this address's prefix (see the module docs).

        Its default timeout is the one it was opened with, not `timeout`: wait on keys with an
        explicit timeout.
        """
        client = _default_group_store(self.host, self.port)  # looked up, not cached: it dies with its group
        if client is None:
            key = (self.host, self.port, os.getpid())  # a forked child must not use its parent's socket
            with _CLIENTS_LOCK:
                client = _CLIENTS.get(key)
                if client is None:
                    client = _CLIENTS[key] = _tcp_client(self.host, self.port, timeout)
        return self.attach(client)


_CLIENTS: dict[tuple[str, int, int], dist.Store] = {}
_CLIENTS_LOCK = threading.Lock()


def _tcp_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)


def _default_group_store(host: str, port: int) -> dist.TCPStore | None:
    """The default process group's TCPStore client when it is the store at `host:port`."""
    if not dist.is_available() or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore) or store.port != port:
        return None
    same_host = store.host == host or {store.host, host} <= {"127.0.0.1", "localhost"}
    return store if same_host else None


def encode(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


def decode(raw: bytes | str) -> dict[str, Any]:
    return json.loads(raw)
