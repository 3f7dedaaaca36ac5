"""The largest tensor storage a piece of work allocates, seen from torch's dispatcher.

`largest_allocation(work)` runs `work` under a `TorchDispatchMode` that looks at every operation's
outputs and records the size of each storage that none of its inputs held: the temporaries and new
tensors it makes, however glibc or the caching allocator then places them. Used in place of
resident memory (a forked child reuses its parent's free heap without touching new pages) and of
the profiler (a dependency on its event format for one number). The calling thread only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _LargestAllocation(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.where = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                size = t.untyped_storage().nbytes()
                if size > self.largest:
                    self.largest, self.where = size, str(func)
        return out


def largest_allocation(work: Callable[[], object]) -> tuple[int, str]:
    """Bytes of the largest storage `work()` allocated in this thread, and the operation that did."""
    mode = _LargestAllocation()
    with mode:
        work()
    return mode.largest, mode.where
