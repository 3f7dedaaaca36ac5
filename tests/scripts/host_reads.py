"""A counting stand-in for the device's synchronisation, for scripts/train.py and scripts/cuda_worker.py.

Every call of `HOST_READS` made from this package's library code (not the demo's report), in any
thread, while `key` is set, is counted under that key. On the CPU these calls cost nothing; on CUDA
each makes the host wait until the device has caught up, so a training step must make none.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

#: calls that make the host wait for the device when the tensor is on CUDA, and where they live
HOST_READS = [(torch.Tensor, name) for name in ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")]
HOST_READS += [(torch.cuda, "synchronize"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]


class HostReadCounter:
    """Counts this package's host reads of device values while `key` is not `None` (see the module)."""

    def __init__(self) -> None:
        self.key: Any = None
        self.counts: dict[Any, int] = {}
        self.where: dict[str, int] = {}  # "module:line call" -> count
        self._saved: list[tuple[Any, str, Any]] = []

    def install(self) -> None:
        for owner, name in HOST_READS:
            self._wrap(owner, name)

    def remove(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def _wrap(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        counter = self

        def counted(*args, **kwargs):
            key = counter.key
            if key is not None:
                caller = sys._getframe(1)
                module = caller.f_globals.get("__name__", "")
                if module.startswith("lightning_prague") and not module.startswith("lightning_prague.demo"):
                    counter.counts[key] = counter.counts.get(key, 0) + 1
                    site = f"{module}:{caller.f_lineno} {name}"
                    counter.where[site] = counter.where.get(site, 0) + 1
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, counted)

    def self_check(self) -> int:
        """How many reads it counts in `WorkerStats.take_group_error`, which reads its sum on the host
        once (at log time): 1 if the stand-in works. Leaves no count behind."""
        from lightning_prague.core.exchange.worker import WorkerStats

        stats = WorkerStats()
        stats.record_group_error(torch.tensor(0.5))
        previous, self.key = self.key, ("self-check",)
        stats.take_group_error()
        found = self.counts.pop(self.key, 0)
        self.where.clear()
        self.key = previous
        return found
