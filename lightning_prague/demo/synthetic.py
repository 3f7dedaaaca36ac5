"""Synthetic datasets made from a function of the sample index: the same on every rank and every run.

Tests and benchmarks use them to count which samples were trained (map-style) and to give every
rank a stream of its own (streaming), without data files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class IndexedSamples(Dataset):
    """`sample(i)` for `i` in `range(size)`."""

    def __init__(self, size: int, sample: Callable[[int], Any]) -> None:
        self.size = size
        self.sample = sample

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Any:
        return self.sample(index)


class RankStream(IterableDataset):
    """Rank `r`'s own stream: `sample(i)` for `i = r, r + world, ...` below `length`, split again
    among the DataLoader's worker processes, as a sharded streaming dataset reads its shards."""

    def __init__(self, length: int, sample: Callable[[int], Any]) -> None:
        self.length = length
        self.sample = sample

    def __iter__(self) -> Iterator[Any]:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        for index in range(rank + world * worker, self.length, world * workers):
            yield self.sample(index)
