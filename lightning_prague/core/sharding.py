"""Heterogeneity-aware data sharding: one global work queue per epoch.

An epoch is one pass over a shuffled permutation of the dataset, cut into chunks of one batch.
Every rank first takes the chunk numbered by its rank (so nobody ends an epoch empty-handed), then
claims further chunks from an atomic counter in the TCPStore. Fast ranks claim more chunks; nobody
idles at the end of the epoch waiting for a slow rank's fixed shard. The permutation depends only
on ``seed`` and the epoch, so all ranks agree on it without communicating.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.store import StoreAddress


class WorkQueueSampler(Sampler[int]):
    """Yields dataset indices, a chunk at a time, claimed from a store-wide counter.

    It deliberately has no ``__len__``: how many batches a rank gets depends on its speed, and a
    length would make trainers schedule per-rank events (mid-epoch validation) at batch counts that
    differ between ranks.
    """

    def __init__(
        self,
        dataset_size: int,
        chunk_size: int,
        rank: int,
        world_size: int,
        address: StoreAddress,
        shuffle: bool = True,
        seed: int = 0,
        timeout: float = 300.0,
    ) -> None:
        if chunk_size < 1:
            raise ConfigurationError(f"chunk_size (the batch size) must be at least 1, got {chunk_size}")
        self.dataset_size = dataset_size
        self.chunk_size = chunk_size
        self.rank = rank
        self.world_size = world_size
        self.address = address
        self.shuffle = shuffle
        self.seed = seed
        self.timeout = timeout
        self.epoch = 0
        self.chunks_taken = 0  # in the current epoch
        self.total_chunks_taken = 0
        self._store: dist.Store | None = None
        if self.num_chunks < world_size:
            raise ConfigurationError(
                f"the training set has {dataset_size} samples, {self.num_chunks} batches of {chunk_size}, fewer than "
                f"the {world_size} workers; use a smaller batch size or fewer devices"
            )

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.dataset_size / self.chunk_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_store"] = None  # a socket does not pickle; reconnect lazily
        return state

    def _claim(self) -> int:
        if self._store is None:
            self._store = self.address.connect(self.timeout)
        return self.world_size + int(self._store.add(f"epoch/{self.epoch}/cursor", 1)) - 1

    def permutation(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.dataset_size))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.permutation()
        self.chunks_taken = 0
        chunk = self.rank
        while chunk < self.num_chunks:
            self.chunks_taken += 1
            self.total_chunks_taken += 1
            yield from order[chunk * self.chunk_size : (chunk + 1) * self.chunk_size]
            chunk = self._claim()
