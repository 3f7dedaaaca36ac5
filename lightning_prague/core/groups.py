"""Communicators for arbitrary subsets of ranks.

Each communicator is built directly from the backend's process-group class over a private prefix
of the job's TCPStore, so that creating one involves only its members (no world-wide collective,
no dependence on creation order outside the group) and so that a key is never reused after it is
dropped. gloo and NCCL take the same path; only the class and its options differ.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_prague.core.errors import CoordinationTimeout
from lightning_prague.core.links import active_slow_links


def _new_backend_group(backend: str, store: dist.Store, rank: int, size: int, timeout: float) -> dist.ProcessGroup:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise ValueError(f"backend {backend!r} is not supported for partial all-reduce; use 'gloo' or 'nccl'")


@dataclass
class PendingCollective:
    """An issued collective and the earliest time it may count as done (later on a slow link)."""

    work: dist.Work
    ready_at: float


class Group:
    """A communicator over ``members`` (global ranks, sorted) as seen from one member."""

    def __init__(self, key: str, members: tuple[int, ...], rank: int, backend_group: dist.ProcessGroup, timeout: float):
        self.key = key
        self.members = members
        self.rank = rank
        self._pg = backend_group
        self._timeout = timeout

    @property
    def size(self) -> int:
        return len(self.members)

    def all_reduce_sum_(self, tensor: torch.Tensor, operation: str = "all-reduce") -> None:
        """In-place sum over the members; fails with :class:`CoordinationTimeout` naming the ranks."""
        self.wait(self.start_all_reduce_sum_(tensor, operation), operation)

    def start_all_reduce_sum_(self, tensor: torch.Tensor, operation: str = "all-reduce") -> PendingCollective:
        """Issue the in-place sum and return at once; :meth:`wait` on the result before reading ``tensor``."""
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        links = active_slow_links()
        delay = links.delay(self.members, tensor.numel() * tensor.element_size()) if links else 0.0
        try:
            return PendingCollective(self._pg.allreduce([tensor], options), time.monotonic() + delay)
        except RuntimeError as err:
            raise self._failure(operation, err) from err

    def wait(self, pending: PendingCollective, operation: str = "all-reduce", timeout: float | None = None) -> None:
        """Wait for an issued collective, at most ``timeout`` (default: the group's timeout)."""
        try:
            pending.work.wait(timedelta(seconds=self._timeout if timeout is None else timeout))
        except RuntimeError as err:
            raise self._failure(operation, err) from err
        remaining = pending.ready_at - time.monotonic()
        if remaining > 0:  # a simulated slow link (core.links)
            time.sleep(remaining)

    def _failure(self, operation: str, err: BaseException) -> CoordinationTimeout:
        return CoordinationTimeout(
            f"rank {self.rank}: {operation} over group {list(self.members)} ({self.key}) failed or timed out "
            f"after {self._timeout:.0f}s: {err}"
        )


class GroupCache:
    """This rank's communicators, keyed by the names the Group Generator hands out.

    The cache itself does not evict: the generator decides, in inbox order, when a key is dropped,
    so all members of a group always agree on whether it exists (see ``CommunicatorLRU``).
    """

    def __init__(self, store: dist.Store, rank: int, backend: str, timeout: float) -> None:
        self._store = store
        self.rank = rank
        self.backend = backend
        self.timeout = timeout
        self._groups: dict[str, Group] = {}
        self.created = 0

    def get(self, key: str, members: tuple[int, ...]) -> Group:
        group = self._groups.get(key)
        if group is None:
            group = self._create(key, tuple(sorted(members)))
            self._groups[key] = group
        return group

    def _create(self, key: str, members: tuple[int, ...]) -> Group:
        if self.rank not in members:
            raise ValueError(f"rank {self.rank} asked to join group {list(members)} it is not a member of")
        start = time.monotonic()
        try:
            pg = _new_backend_group(
                self.backend,
                dist.PrefixStore(f"pg/{key}/", self._store),
                members.index(self.rank),
                len(members),
                self.timeout,
            )
        except RuntimeError as err:
            raise CoordinationTimeout(
                f"rank {self.rank}: creating communicator {key} for ranks {list(members)} failed after "
                f"{time.monotonic() - start:.1f}s (timeout {self.timeout:.0f}s): {err}"
            ) from err
        self.created += 1
        return Group(key, members, self.rank, pg, self.timeout)

    def drop(self, key: str) -> None:
        self._groups.pop(key, None)

    def clear(self) -> None:
        self._groups.clear()

    def __len__(self) -> int:
        return len(self._groups)
