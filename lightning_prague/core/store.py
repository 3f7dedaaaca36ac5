"""Access to torch.distributed's TCPStore, the one rendezvous service every job already has.

The work queue's counters, the end-of-phase agreement of gossip and the coordinator's published
address live in it (the coordinator's messages have their own connections,
:mod:`lightning_prague.core.transport`). Each thread opens its own client connection
(:meth:`StoreAddress.connect`) because a TCPStore client is not meant to be shared between threads.
"""

from __future__ import annotations

import json
import os
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
        """Read ``MASTER_ADDR``/``MASTER_PORT``, the variables every torch launcher sets."""
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
        """``client`` (a raw store client) seen under this address's prefix."""
        return dist.PrefixStore(f"{self.prefix}/", client)

    def connect(self, timeout: float) -> dist.Store:
        """Open a new client connection; every blocking call on it waits at most ``timeout`` s."""
        client = dist.TCPStore(
            self.host, self.port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
        )
        return self.attach(client)


def encode(message: dict[str, Any]) -> str:
    return json.dumps(message, separators=(",", ":"))


def decode(raw: bytes | str) -> dict[str, Any]:
    return json.loads(raw)
