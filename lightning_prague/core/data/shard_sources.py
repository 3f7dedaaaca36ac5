"""The shards of a stream: what the work queue shares out when the training data is an `IterableDataset`.

A stream the strategy can share out by speed is one it can read shard by shard, from any position:

* **our protocol**, for a plain `torch.utils.data.IterableDataset` over files: an attribute
  `num_shards` (an int) and a method `iter_shard(shard, start)` that yields the samples of shard
  `shard` from its `start`-th on (`ShardedStream`). Reading a shard must give the same samples in the
  same order every time (no shuffling that differs between calls), so that a shard taken over
  from a lost rank goes on where that rank stood;
* **Hugging Face `datasets`** streaming datasets (`datasets.IterableDataset`): their `n_shards`
  (the files, or the generator's shards), read with `.shard(n_shards, k)` and `.skip(start)`;
* **`litdata`'s `StreamingDataset`** (what `litdata.optimize` wrote): its chunks, each read by index;

`shard_source(dataset)` finds the one that applies, or `None`: a stream without shards is read as
the user wrote it, each rank its own (`lightning_prague.strategies.loaders` warns what that loses).
Nothing here imports `datasets` or `litdata`: a dataset is recognised by what it has.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice
from typing import Any, Optional, Protocol, runtime_checkable


@runtime_checkable
class ShardedStream(Protocol):
    """A stream in shards that can each be read from any position (see the module docstring)."""

    num_shards: int

    def iter_shard(self, shard: int, start: int) -> Iterator[Any]:
        """The samples of shard `shard`, from its `start`-th (0-based) on, in the same order every time."""
        ...


class ShardSource:
    """How to read one kind of sharded stream: its number of shards and one shard from a position."""

    #: what the stream is, for messages
    kind = "a sharded stream"

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    @property
    def num_shards(self) -> int:
        raise NotImplementedError

    def iter_shard(self, shard: int, start: int) -> Iterator[Any]:
        raise NotImplementedError


class ProtocolSource(ShardSource):
    """A dataset with our protocol (`ShardedStream`)."""

    kind = "a stream with num_shards and iter_shard"

    @property
    def num_shards(self) -> int:
        return int(self.dataset.num_shards)

    def iter_shard(self, shard: int, start: int) -> Iterator[Any]:
        return iter(self.dataset.iter_shard(shard, start))


class HuggingFaceSource(ShardSource):
    """A Hugging Face `datasets.IterableDataset` (streaming): one shard of its `n_shards`, skipped to
    `start` (`IterableDataset.skip` reads and drops the samples before it: no index is needed)."""

    kind = "a Hugging Face streaming dataset"

    @property
    def num_shards(self) -> int:
        return int(self.dataset.n_shards)

    def iter_shard(self, shard: int, start: int) -> Iterator[Any]:
        part = self.dataset.shard(num_shards=self.num_shards, index=shard, contiguous=True)
        part = part.skip(start) if start else part
        # (not `iter(part)`: inside a DataLoader worker process it would split the one shard among the
        # workers, and this worker would read a part of it; `IterableDataset.iter` reads it whole)
        return _rows(part.iter(batch_size=READ_BATCH))


class LitdataSource(ShardSource):
    """`litdata`'s `StreamingDataset` (the output of `litdata.optimize`): its chunks are the shards, each
    read sample by sample through the dataset's own random access (`dataset[i]`, which fetches the
    chunk where it is remote), in the chunks' order of its index."""

    kind = "a litdata StreamingDataset"

    def __init__(self, dataset: Any) -> None:
        super().__init__(dataset)
        #: each chunk's first sample (in the dataset's numbering) and its number of samples
        self.chunks: list[tuple[int, int]] = []
        first = 0
        for begin, end in dataset.region_of_interest:
            self.chunks.append((first, int(end) - int(begin)))
            first += int(end) - int(begin)

    @property
    def num_shards(self) -> int:
        return len(self.chunks)

    def iter_shard(self, shard: int, start: int) -> Iterator[Any]:
        first, count = self.chunks[shard]
        return (self.dataset[first + i] for i in range(max(0, start), count))


#: samples a Hugging Face shard is read in at once (then handed out one by one)
READ_BATCH = 64


def _rows(batches: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The samples of `datasets`' column batches (a dict of equal-length columns each), one by one."""
    for batch in batches:
        columns = list(batch)
        for i in range(len(batch[columns[0]]) if columns else 0):
            yield {column: batch[column][i] for column in columns}


def shard_source(dataset: Any) -> Optional[ShardSource]:
    """The shards of `dataset`, or `None` for a stream without any (see the module docstring)."""
    if isinstance(dataset, ShardedStream) and not isinstance(dataset, type):
        return ProtocolSource(dataset)
    module = type(dataset).__module__ or ""
    if module.startswith("datasets.") and hasattr(dataset, "n_shards") and hasattr(dataset, "shard"):
        return HuggingFaceSource(dataset)
    if module.startswith("litdata.") and isinstance(getattr(dataset, "region_of_interest", None), list):
        return LitdataSource(dataset)
    return None


def read_rows(rows: Iterator[Any], count: int) -> list[Any]:
    """The next `count` samples of `rows` (fewer where it ends)."""
    return list(islice(rows, count))
