"""The coordinator service: a thread on global rank 0 that runs the Group Generator over the TCPStore.

Workers push messages onto one store queue (``requests``); the service pops them one at a time,
feeds :class:`~lightning_prague.core.generator.GroupGenerator`, and pushes the items a message
produces for a worker onto that worker's queue (``inbox/<rank>``) as one bundle. A single
consumer gives the one global order of assignments that makes group operations deadlock-free.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from lightning_prague.core.generator import GroupGenerator
from lightning_prague.core.store import StoreAddress, decode, encode

log = logging.getLogger(__name__)

REQUESTS = "requests"
SHUTDOWN = {"op": "__shutdown__", "rank": 0}


def inbox(rank: int) -> str:
    return f"inbox/{rank}"


class CoordinatorService:
    """Runs a :class:`GroupGenerator` in a daemon thread until :meth:`close`."""

    def __init__(self, address: StoreAddress, generator: GroupGenerator, poll_timeout: float = 60.0) -> None:
        self.address = address
        self.generator = generator
        self.poll_timeout = poll_timeout
        self.error: BaseException | None = None
        self.handled = 0
        self.store_ops = 0  # pops and pushes of the service
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()

    def start(self) -> None:
        store = self.address.connect(self.poll_timeout)  # connect in the caller: fail early, not in the thread
        self._thread = threading.Thread(target=self._run, args=(store,), name="prague-coordinator", daemon=True)
        self._thread.start()

    def _run(self, store: dist.Store) -> None:
        try:
            while True:
                try:
                    message = decode(store.queue_pop(REQUESTS))
                except dist.DistStoreError:
                    if self._closing.is_set():
                        return
                    continue  # idle (e.g. a long validation): keep serving
                if message["op"] == SHUTDOWN["op"]:
                    return
                try:
                    items = self.generator.handle(message)
                except Exception as err:  # a malformed message must not kill the service silently
                    log.exception("coordinator rejected message %s", message)
                    items = {int(message.get("rank", 0)): [{"t": "error", "message": f"coordinator: {err}"}]}
                for rank, rank_items in items.items():  # one push per rank and message: a bundle, in order
                    store.queue_push(inbox(rank), encode(rank_items[0] if len(rank_items) == 1 else rank_items))
                self.store_ops += 1 + len(items)
                if message["op"] == "arrive":  # lets a timed-out worker name the ranks it waited for
                    store.set("parked", encode(sorted(self.generator.parked)))
                self.handled += 1
        except BaseException as err:  # pragma: no cover - surfaced through .error and worker timeouts
            self.error = err
            log.exception("prague coordinator stopped")

    def await_departures(self, timeout: float) -> list[int]:
        """Keep serving until every rank has left after an error; returns the ranks that did not.

        Rank 0 calls this before :meth:`close` when it is torn down by an error: the other ranks
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
        if self._thread is None:
            return
        self._closing.set()
        try:
            store = self.address.connect(timeout)
            store.queue_push(REQUESTS, encode(SHUTDOWN))
        except Exception:  # the store may already be gone at interpreter exit
            log.debug("could not post shutdown to the coordinator", exc_info=True)
        self._thread.join(timeout)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
