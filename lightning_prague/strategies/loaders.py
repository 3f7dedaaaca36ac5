"""The strategy's data: the training loader fed from the work queue, and Lightning's shards among the live ranks.

Two kinds of sharding meet in an asynchronous fit (`StrategyLoaders`):

* **the work queue** (strategies with `shards_by_work_queue`): Lightning would give the training
  `DataLoader` a static `DistributedSampler`, an equal shard per rank. Its `_prepare_dataloader`
  is replaced (`wrap_prepare_dataloader`) so that a map-style loader is rebuilt around a
  `WorkQueueSampler` (fast workers take more batches from one global queue), and every training
  loader is wrapped in a `ProgressLoader`, which hands each batch its ticket of global progress
  (`lightning_prague.strategies.global_progress`). A stream (`IterableDataset`) is not sharded:
  every rank reads its own, as the user wrote it.
* **Lightning's own shards** (validation, and training without the work queue): once a rank was
  lost they are cut among the survivors (`sampler_kwargs`); `reshard` drops the loaders Lightning
  built for the old membership so that their next pass is rebuilt, and `reshard_validation`
  rebuilds a validation that starts at the very meeting that lost the rank.

**Lock-step shards through a loss** (training without the work queue: `decent_adam`, `grouping="static"`).
Each rank tells the control plane, after every batch, where it stands in its own shard of the epoch
(`report_position`: the epoch, the batches it trained, its shard and the number of shards; one small
message, no reply). A new process for a lost rank gets that position with its admission
(`resume_shard`) and goes on from there: its loop's batch count is the lost rank's (`resumed_progress`)
and its training loader reads the same shard from the next batch on (`ResumedShardSampler`), so the
rest of the lost rank's shard is trained once, by its successor, instead of being skipped. A batch the
lost rank trained but had not reported yet (it died between its optimizer step and the message) is
trained again; one whose report went out is not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _update_dataloader
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_prague.core.data.progress import ProgressCounter
from lightning_prague.core.data.progress_loader import ProgressLoader
from lightning_prague.core.data.shard_queue import ShardQueueSampler, ShardReader, keep_batch
from lightning_prague.core.data.shard_sources import ShardSource, shard_source
from lightning_prague.core.data.sharding import ChunkBatches, WorkQueueSampler
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.strategies.global_progress import batches_per_epoch

if TYPE_CHECKING:
    from lightning_prague.strategies.base import DecentralizedStrategy

#: Lightning's `_DataConnector._prepare_dataloader(dataloader, shuffle, mode)`
PrepareDataloader = Callable[[object, bool, RunningStage], object]


class StrategyLoaders:
    """The strategy's loaders and shards (see the module docstring)."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy
        #: the training loader's work-queue sampler (map-style data under the work queue)
        self.sampler: WorkQueueSampler | None = None
        self.sharded_members: tuple[int, ...] = ()  # the members Lightning's shards were last built for
        #: the shard the training loader reads (lock-step shards): (shard, number of shards)
        self.shard_layout: Optional[tuple[int, int]] = None
        #: where a lost rank stood in its shard, for this rank that took its place (`resume_shard`)
        self._resume: Optional[dict[str, int]] = None

    # -- the training loader from the work queue -------------------------------------------------
    def replacements(self, trainer: Trainer) -> dict[str, Callable[..., Any]]:
        """Lightning's methods that these replace on the trainer's objects (installed by `_patches`)."""
        return {"_prepare_dataloader": self.wrap_prepare_dataloader(trainer._data_connector._prepare_dataloader)}

    def wrap_prepare_dataloader(self, original: PrepareDataloader) -> PrepareDataloader:
        """Lightning's `_prepare_dataloader`, feeding the training loader from the work queue."""
        strategy = self.strategy

        def prepare(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
            progress = strategy.progress
            sharded = strategy.shards_by_work_queue and strategy.session is not None and progress is not None
            if mode == RunningStage.TRAINING and not strategy.shards_by_work_queue:
                return self.lockstep(original(dataloader, shuffle, mode))
            if mode != RunningStage.TRAINING or not sharded:
                return original(dataloader, shuffle, mode)
            assert progress is not None
            if isinstance(dataloader, DataLoader) and not isinstance(dataloader.dataset, IterableDataset):
                loader = self.shard(dataloader)
                sampler = self.sampler
                assert sampler is not None
                # (a replica trains one chunk per step: its epoch has as many steps as the queue has chunks)
                per_epoch = batches_per_epoch(loader) if sampler.replica_size == 1 else sampler.num_chunks
                return progress.wrap(loader, self.progress_loader, per_epoch)
            if strategy.replicas.replica_size > 1:
                raise ConfigurationError(
                    f"strategy={strategy.strategy_name!r} with replica_size={strategy.replica_size!r} trains from "
                    "map-style data only: the ranks of a replica must take the same steps, and a stream's shards "
                    "are shared out rank by rank (docs/replica_groups.md)"
                )
            source = self.stream_source(dataloader)
            if source is not None:  # a sharded stream: its shards from the work queue
                assert isinstance(dataloader, DataLoader)
                return progress.wrap(self.shard_stream(dataloader, source), self.progress_loader, None)
            # a stream without shards: every rank reads its own, as the user wrote it; an epoch ends
            # with the first that ends
            self.sampler = None
            return progress.wrap(original(dataloader, shuffle, mode), self.progress_loader, None)

        return prepare

    def progress_loader(self, loader: Any, batches_per_epoch: Optional[int], start: int) -> ProgressLoader:
        """`loader` handing out tickets of global progress (see `GlobalProgress.wrap`)."""
        strategy = self.strategy
        session, progress, trainer = strategy.session, strategy.progress, strategy._trainer
        assert session is not None and progress is not None and trainer is not None
        replica_size = strategy.replicas.replica_size
        counter = ProgressCounter(
            session.counters,
            strategy.operation_timeout,
            progress.budget,
            strategy.global_rank - strategy.global_rank % replica_size,  # (a replica counts as one worker)
            strategy.data_workers,
            progress.batches_per_step,
        )
        if replica_size > 1 and self.sampler is not None:
            counter.set_members(self.sampler.units_of(strategy._require_job().members))
        return ProgressLoader(
            loader,
            counter,
            lambda: trainer.current_epoch,
            sampler=self.sampler,
            batches_per_epoch=batches_per_epoch,
            start=start,
        )

    def shard(self, dataloader: DataLoader) -> DataLoader:
        """`dataloader` rebuilt around a work-queue sampler (`ConfigurationError` for one that cannot be)."""
        strategy = self.strategy
        name = strategy.strategy_name
        if dataloader.batch_size is None:
            raise ConfigurationError(
                f"strategy={name!r} needs the training DataLoader to use batch_size (a custom batch_sampler cannot "
                "be fed from the work queue)"
            )
        if isinstance(dataloader.sampler, RandomSampler):
            shuffle = True
        elif isinstance(dataloader.sampler, SequentialSampler):
            shuffle = False
        else:
            raise ConfigurationError(
                f"strategy={name!r} replaces the training sampler with a work-queue sampler but the DataLoader has a "
                f"custom sampler ({type(dataloader.sampler).__name__}); use shuffle=True or shuffle=False instead"
            )
        assert strategy.session is not None
        replica_size = strategy.replicas.replica_size
        if replica_size > 1 and dataloader.drop_last:
            raise ConfigurationError(
                f"strategy={name!r} with replica_size={strategy.replica_size!r} cannot drop the last batch of an "
                "epoch (drop_last=True): the ranks of a replica must take the same steps; use drop_last=False"
            )
        # in replica groups a chunk is one step of a replica: a batch for each of its ranks
        self.sampler = WorkQueueSampler(
            len(dataloader.dataset),  # type: ignore[arg-type]
            dataloader.batch_size * replica_size,
            strategy.global_rank,
            strategy.data_workers,
            strategy.session.counters,
            shuffle=shuffle,
            seed=strategy.seed,
            timeout=strategy.operation_timeout,
            replica_size=replica_size,
        )
        if replica_size > 1:
            self.sampler.set_members(strategy._require_job().members)
        loader = _update_dataloader(dataloader, self.sampler, mode=RunningStage.TRAINING)
        if type(loader.batch_sampler) is BatchSampler:  # each chunk one batch (`ChunkBatches`)
            loader.batch_sampler.__class__ = ChunkBatches  # (a DataLoader's batch sampler is set once, at init)
        return loader

    # -- a sharded stream from the work queue -------------------------------------------------------
    def stream_source(self, dataloader: object) -> Optional[ShardSource]:
        """The shards of the training stream the strategy shares out, or `None` (with a warning that
        says what is lost) for a stream it reads as the user wrote it."""
        name = self.strategy.strategy_name
        dataset = getattr(dataloader, "dataset", None)
        if not isinstance(dataloader, DataLoader) or dataset is None:
            return None
        if getattr(dataset, "_distributed", None):  # `datasets.distributed.split_dataset_by_node`
            rank_zero_warn(
                f"strategy={name!r}: the training stream is already split by node, so each rank reads its own "
                "part: fast ranks do not take more, a lost rank's part is not read on, and the epoch ends "
                "with the first part that ends. Pass the whole dataset (not split_dataset_by_node) to have "
                "its shards shared out by speed (docs/streaming.md)."
            )
            return None
        source = shard_source(dataset)
        if source is None:
            rank_zero_warn(
                f"strategy={name!r}: the training stream ({type(dataset).__name__}) has no shards the strategy "
                "can share out, so each rank reads it as written and the epoch ends with the first stream that "
                "ends. Give it `num_shards` and `iter_shard(shard, start)`, or use a Hugging Face streaming "
                "dataset (docs/streaming.md)."
            )
        return source

    def shard_stream(self, dataloader: DataLoader, source: ShardSource) -> DataLoader:
        """`dataloader`'s stream read shard by shard from the work queue
        (`lightning_prague.core.data.shard_queue`), in the same worker processes, with the same collate."""
        strategy = self.strategy
        if dataloader.batch_size is None:
            raise ConfigurationError(
                f"strategy={strategy.strategy_name!r} reads a sharded stream in batches of the DataLoader's "
                "batch_size: give the training DataLoader a batch_size"
            )
        assert strategy.session is not None
        workers = int(dataloader.num_workers or 0)
        self.sampler = ShardQueueSampler(
            source.num_shards,
            dataloader.batch_size,
            strategy.global_rank,
            strategy.capacity,
            strategy.session.counters,
            slots=max(1, workers),
            timeout=strategy.operation_timeout,
        )
        extra: dict[str, Any] = {}
        if workers:
            extra = {
                "prefetch_factor": dataloader.prefetch_factor,
                "persistent_workers": dataloader.persistent_workers,
                "multiprocessing_context": dataloader.multiprocessing_context,
            }
        return DataLoader(
            ShardReader(source, dataloader.collate_fn),
            batch_size=None,
            sampler=self.sampler,
            collate_fn=keep_batch,
            num_workers=workers,
            pin_memory=dataloader.pin_memory,
            timeout=dataloader.timeout,
            worker_init_fn=dataloader.worker_init_fn,
            **extra,
        )

    # -- lock-step shards through a loss (see the module docstring) ---------------------------------
    def lockstep(self, loader: object) -> object:
        """The training loader Lightning built with its shard: noted, and, for a rank that took a lost
        one's place, reading the lost rank's shard from where it stood."""
        if not isinstance(loader, DataLoader) or not isinstance(loader.sampler, DistributedSampler):
            self.shard_layout = None
            dataset = getattr(loader, "dataset", None)
            if isinstance(dataset, IterableDataset) and shard_source(dataset) is not None:
                rank_zero_warn(
                    f"strategy={self.strategy.strategy_name!r} trains in lock-step and reads the training stream as "
                    "written: every rank reads all of it unless the dataset is split by rank "
                    "(split_dataset_by_node); the work-queue strategies share a sharded stream out (docs/streaming.md)"
                )
            return loader
        sampler = loader.sampler
        resume, self._resume = self._resume, None
        if resume is None:
            self.shard_layout = (sampler.rank, sampler.num_replicas)
            return loader
        shard = DistributedSampler(
            sampler.dataset,
            num_replicas=resume["of"],
            rank=resume["shard"],
            shuffle=sampler.shuffle,
            seed=sampler.seed,
            drop_last=sampler.drop_last,
        )
        self.shard_layout = (resume["shard"], resume["of"])
        assert loader.batch_size is not None
        resumed = ResumedShardSampler(shard, resume["epoch"], resume["batches"] * loader.batch_size)
        return _update_dataloader(loader, resumed, mode=RunningStage.TRAINING)

    def resume_shard(self, position: Optional[dict[str, int]], epoch: int) -> Optional[int]:
        """This rank takes a lost rank's place in `epoch` (a rejoin): its training loader goes on from
        where that rank stood (`position`, as the control plane last heard it). Returns the batches
        of the epoch already trained in that shard (the loop's count to resume from), or `None` where
        there is nothing to resume (the rank stood in an earlier epoch, or nowhere: the others' shards
        cover this one without it; the control plane admits such a rank at an epoch's end)."""
        if position is None or position.get("epoch") != epoch:
            self._resume = None
            return None
        self._resume = dict(position)
        return int(position["batches"])

    def report_position(self, epoch: int, batches: int, total: float | int | None = None) -> None:
        """After a batch (lock-step shards): tell the control plane where this rank stands in its shard
        (`total`: the epoch's batches, where the loader has a length)."""
        session = self.strategy.session
        if self.shard_layout is None or session is None or self.strategy.shards_by_work_queue:
            return
        shard, of = self.shard_layout
        extra = {"total": int(total)} if total is not None and math.isfinite(total) else {}
        session.send("trained", epoch=epoch, batches=batches, shard=shard, of=of, **extra)

    # -- Lightning's shards among the live ranks -------------------------------------------------
    def sampler_kwargs(self) -> Optional[dict[str, Any]]:
        """Lightning's shards among the members (the launched ranks, less those lost, plus those that
        joined); `None`: Lightning's own (no job yet)."""
        strategy = self.strategy
        job = strategy.job
        if job is not None and strategy.global_rank in job.members:
            return {"num_replicas": len(job.members), "rank": job.members.index(strategy.global_rank)}
        return None

    def reshard(self, members: tuple[int, ...], rebuild: bool = False) -> bool:
        """After a release: if the membership changed, the data that Lightning shards by rank
        (validation, and training without the work queue) is sharded among `members` from its next
        pass (their loaders are rebuilt: `sampler_kwargs`). `rebuild`: the release says it changed
        (every member rebuilds, the same on each). Returns whether this rank's shards changed."""
        if members == self.sharded_members and not rebuild:
            return False
        changed = members != self.sharded_members
        self.sharded_members = members
        strategy = self.strategy
        assert strategy._trainer is not None
        fit_loop = strategy._trainer.fit_loop
        fit_loop.epoch_loop.val_loop._combined_loader = None
        if not strategy.shards_by_work_queue:
            fit_loop._combined_loader = None  # from the next epoch on (this one's iterator goes on)
        return changed

    def reshard_validation(self) -> None:
        """The validation that starts now shards among the survivors (the membership changed at its
        own meeting, after Lightning built its loaders): rebuild them and the loop's fetcher."""
        trainer = self.strategy._trainer
        assert trainer is not None
        loop = trainer.fit_loop.epoch_loop.val_loop
        loop._combined_loader = None
        loop.setup_data()
        loop.reset()


class ResumedShardSampler(Sampler[int]):
    """A shard (`DistributedSampler`) that leaves out its first `skip` indices in `epoch`, the epoch a
    lost rank was lost in (its successor goes on from where it stood); every other epoch whole."""

    def __init__(self, shard: DistributedSampler, epoch: int, skip: int) -> None:
        self.shard = shard
        self.resumed_epoch = epoch
        self.skip = skip
        self.epoch = epoch
        shard.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.shard.set_epoch(epoch)

    def __iter__(self):  # type: ignore[no-untyped-def]
        indices = list(self.shard)
        return iter(indices[self.skip :] if self.epoch == self.resumed_epoch else indices)

    def __len__(self) -> int:
        # the whole shard: the loop's batch count goes on from where the lost rank stood, up to its end
        return len(self.shard)
