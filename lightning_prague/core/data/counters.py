"""The per-epoch counters of the data rooms in the session's key-value table.

The work queue (`sharding`) and global progress (`progress`) each keep a few counters per epoch in
the session's `Counters` (the coordinator's table; a TCPStore works too, with the same calls). Both
name them, read and increment them, wait for them and delete them once every rank is done with an
epoch in the same way; `EpochKeys` and the functions here are that one way, so the store holds a
bounded number of keys per kind, under names that cannot collide between kinds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


@dataclass(frozen=True)
class EpochKeys:
    """The counters one kind of data bookkeeping keeps per epoch: `<kind>/<epoch>/<name>` for each
    of `names` (every key it may write in an epoch, so that forgetting the epoch deletes them all)."""

    kind: str
    names: tuple[str, ...]

    def key(self, epoch: int, name: str) -> str:
        """The store key of counter `name` in `epoch`."""
        return f"{self.kind}/{epoch}/{name}"

    def keys(self, epoch: int) -> list[str]:
        """Every store key of `epoch`, in the order of `names`."""
        return [self.key(epoch, name) for name in self.names]

    def present(self, store: Any, epoch: int) -> bool:
        """Whether `epoch` still has keys in `store`."""
        return any(store.check([key]) for key in self.keys(epoch))

    def forget(self, store: Any, epoch: int) -> None:
        """Delete `epoch`'s keys from `store`; call once every rank is done with that epoch."""
        for key in self.keys(epoch):
            store.delete_key(key)


def increment(store: Any, key: str, amount: int = 1) -> int:
    """The counter `key` after adding `amount` to it, atomically (one store operation; a counter
    that does not exist yet starts from 0)."""
    return int(store.add(key, amount))


def begin_increment(store: Any, key: str, amount: int = 1) -> Callable[[], int]:
    """`increment`, sent now and its answer taken later (call what it returns): the session's
    `Counters` overlap the control plane's round trip with the caller's work (`Counters.begin_add`);
    a store without that (a TCPStore) increments at once."""
    begin = getattr(store, "begin_add", None)
    if begin is None:
        value = increment(store, key, amount)
        return lambda: value
    return begin(key, amount)


def read(store: Any, key: str) -> int:
    """The counter `key` now (one store operation: adding 0)."""
    return increment(store, key, 0)


def wait_for(store: Any, keys: Sequence[str], seconds: float) -> None:
    """Until every one of `keys` is set in `store`; the store raises (`RuntimeError`) after `seconds`."""
    store.wait(list(keys), timedelta(seconds=seconds))
