"""Synchronization points: where the unaligned ranks meet, become one model and follow the membership.

Between synchronization points every rank trains its replica at its own pace. At validation
during fit, at every epoch's end, at the end of fit and at the boundaries of step-based
schedules (`lightning_prague.strategies.global_progress`) every rank drains its exchanges, meets the
others at the coordinator and (`average_at_sync`) the replicas are averaged, so that validation,
checkpoints and `trainer.test` see one consensus model (`Synchronizer.synchronize`). The release of
the meeting carries what every rank decided: a stop, the workers' speeds for the work queue, the
batches still to train, and the members that are left; the ranks then follow it (a lost rank's
shards go to the survivors, the lowest live rank takes over global rank 0's duties: `survivors`).
A checkpoint written there holds the mean of the workers' optimizer states as well
(`Synchronizer.optimizer_state`).

One model means the whole `state_dict`: the average covers the parameters (a tied parameter once,
so it stays tied) and the floating-point buffers, read from the module at every average (a buffer
the module replaced rather than updated in place is averaged, not the one it dropped), and the
integer and boolean buffers (BatchNorm's `num_batches_tracked`, which differs between ranks that took
different numbers of steps) become their element-wise maximum over the live ranks
(`lightning_prague.core.comm.exact`), all in the same all-or-nothing decision
(`GroupWorker.global_average`).

`SyncPoints` is the callback that calls these points from the trainer's hooks; the strategy
inserts it before every other callback, so that they all run on the consensus model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_prague.core.comm.averaging import averaged_optimizer_state, averaged_state
from lightning_prague.core.comm.exact import exact_state
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.protocol import ADMITTING_AT

if TYPE_CHECKING:
    from lightning_prague.strategies.base import DecentralizedStrategy

log = logging.getLogger(__name__)

#: where `Synchronizer.follow_admissions` runs: a training batch's end; drained before a meeting; or
#: inside a meeting or after its release
BATCH_END, DRAINED, ALIGNED = "batch end", "drained", "aligned"


class SyncPoints(Callback):
    """Calls the strategy's synchronization points from the trainer's hooks; runs before other callbacks."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy
        #: this epoch: training batches this rank trained, and whether it validated
        self._batches_in_epoch = 0
        self._validated_in_epoch = False

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batches_in_epoch, self._validated_in_epoch = 0, False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        follow_module(self.strategy)  # before any meeting, the stop point's included

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.strategy.progress is not None:
            self.strategy.progress.on_train_start()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.strategy.enter_async_phase()

    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self.strategy.progressed()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.outside_steps()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.strategy.progress is not None:
            self.strategy.progress.after_batch()  # a boundary: meet before step-based callbacks run
        # lock-step shards
        self.strategy.loaders.report_position(trainer.current_epoch, batch_idx + 1, trainer.num_training_batches)
        self._batches_in_epoch += 1
        # a joiner waits for its state (this rank may send it)
        self.strategy.synchronizer.follow_admissions(point=BATCH_END)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validated_in_epoch = True
        self.strategy.outside_steps()  # until its first batch: a meeting, loaders built
        if not self.strategy.controller.validation_starts():
            return  # the ranks met at the boundary just before
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking:
            self.strategy.synchronize(f"validation@epoch{trainer.current_epoch}")
            if self.strategy.regrouped:  # ranks were lost at this very meeting
                self.strategy.loaders.reshard_validation()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.outside_steps()
        if self._owes_validation(trainer):
            # it joined this epoch when no batch of it was left: Lightning validates after a batch only,
            # but the members validate at this epoch's end (a synchronization point it must meet too)
            log.debug("rank %d: validating at the end of the epoch it joined with no batch left", trainer.global_rank)
            loop = trainer.fit_loop.epoch_loop
            trainer.validating = True
            loop.val_loop.run()
            trainer.training = True
        self.strategy.synchronize(f"epoch_end@epoch{trainer.current_epoch}")

    def _owes_validation(self, trainer: Trainer) -> bool:
        """This rank joined the fit inside the current epoch, trained no batch of it, and the members
        validate at its end (epoch-based validation)."""
        strategy = self.strategy
        if self._batches_in_epoch or self._validated_in_epoch or strategy.joined_epoch != trainer.current_epoch:
            return False
        progress = strategy.progress
        if progress is not None and progress.schedule is not None and progress.schedule.validate_every is not None:
            return False  # step-based validation: at boundaries, which this rank meets as they come
        return bool(trainer.fit_loop.epoch_loop._should_check_val_epoch())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.strategy.synchronize("fit_end")


def follow_module(strategy: DecentralizedStrategy) -> None:
    """Make the strategy's global averages read the model's state at each average: the averaged
    tensors (`averaged_state`) and the integer and boolean buffers (`exact_state`)."""
    worker = strategy.worker
    if worker is None or worker.live_state is not None:
        return

    def live_state() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        module = strategy.lightning_module
        if module is None:  # no module any more (torn down): the tensors of setup
            return list(worker.tensors.tensors), []
        return averaged_state(module), exact_state(module)

    worker.live_state = live_state


def average_replicas(worker: GroupWorker, name: str) -> None:
    """Right after the meeting `name`: one model on every live rank (a rank lost during the
    average: meet again without it and average again)."""
    while not worker.global_average():
        worker.synchronize(f"{name}/again")
    worker.version = worker.released_version  # one model again: one version


class Synchronizer:
    """Runs the strategy's synchronization points (see the module docstring)."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy

    def follow_admissions(self, at_epoch_end: bool = False, inside_only: bool = False, point: str = ALIGNED) -> None:
        """At a batch boundary, a meeting, or a meeting's end, on the training thread: follow the ranks
        admitted since the last call (`GroupWorker.donate`: their membership epoch's group, and the
        fit's state from the donor, taken here; `at_epoch_end`: it is taken at the end of the epoch, so
        the joiner starts the next one), and share the work queue with them from the next epoch on.
        No meeting: the others train on. `point`: where this is (`BATCH_END`, `DRAINED` before a
        meeting, else `ALIGNED`: inside a meeting or after its release), which says when the ranks of a
        sharded replica send their shards (`donations_upto`)."""
        strategy = self.strategy
        worker = strategy.worker
        job = strategy.job
        if worker is None or job is None:
            return
        upto = self.donations_upto(point)
        admitted = worker.donate(lambda: strategy.peer_state.snapshot(at_epoch_end), inside_only, upto)
        if not admitted:
            return
        loader = strategy.progress.loader if strategy.progress is not None else None
        if loader is not None:
            loader.set_members(list(job.members))
        # (Lightning's shards follow the membership at the next meeting, on every member alike)
        strategy.survivors.assign_rank_zero()

    def donations_upto(self, point: str) -> Optional[int]:
        """The membership epochs up to which this rank sends joiners the fit's state at `point`: all
        (`None`) but for a model sharded over its replica, whose ranks send their shards of one moment
        (`lightning_prague.core.replicas.agreement.DonationAgreement`): at a batch's end those its
        replica's ranks all heard of one batch before, when drained before a meeting those any of them
        heard of, and inside a meeting (nothing moves) or after its release (everyone follows it alike)
        all of them."""
        strategy = self.strategy
        worker = strategy.worker
        agreement = strategy.donation_agreement()
        if agreement is None or worker is None or point == ALIGNED:
            return None
        newest = worker.newest_epoch()
        agreed = agreement.lagged(newest) if point == BATCH_END else agreement.settle(newest)
        if agreed > newest:
            worker.await_epoch(agreed, "another rank of its replica")
        return agreed

    def _meet(self, name: str) -> dict[str, Any]:
        """Drain, meet every rank at `name`; the release."""
        strategy = self.strategy
        worker = strategy.worker
        assert worker is not None
        strategy.drain()
        # the state a joiner waits for goes out first (the meeting waits for it), drained: what a sharded
        # replica's ranks send then is of one moment, whichever rank heard of the joiner first
        self.follow_admissions(point=DRAINED)
        loader = strategy.progress.loader if strategy.progress is not None else None
        sampler = loader.sampler if loader is not None else None
        strategy.stops.request_signal_stop()
        trainer = strategy._trainer
        assert trainer is not None
        report: dict[str, Any] = {"stop": bool(trainer.should_stop or strategy.stops.held_request)}
        if loader is not None:
            report["untrained"] = loader.untrained()
            if loader.shard_positions() is not None:
                report["positions"] = loader.shard_positions()
        if sampler is not None:
            report["speed"] = sampler.seconds_per_chunk
        stopping = worker.synchronize(name, strategy.exchanger, **report)
        if strategy.exchanger is not None:  # every rank drained and met: a replica's slices come together
            strategy.exchanger.put_together()
        if stopping:
            strategy.stops.raise_stop()
        return worker.release or {}

    def synchronize(self, name: str, progress: Optional[int], inside_epoch: bool, validate: bool) -> None:
        """Drain, meet every rank, then average (see `DecentralizedStrategy.synchronize`)."""
        strategy = self.strategy
        worker = strategy.worker
        if worker is None:
            return
        # ranks with nothing left of the epoch wait to rejoin (the last release said so): every member meets at
        # this epoch's end, whose release admits them
        admitting = name.startswith(ADMITTING_AT) and bool((worker.release or {}).get("joining"))
        if not strategy.controller.must_meet and not admitting:
            return
        self._meet(name)
        self._after_meeting(progress, inside_epoch, validate)

    def _after_meeting(self, progress: Optional[int], inside_epoch: bool, validate: bool) -> None:
        """What every rank does after a meeting's release: stop, average, follow the membership, and the
        admissions of its release (an epoch's end)."""
        strategy = self.strategy
        worker = strategy.worker
        assert worker is not None and strategy._trainer is not None
        trainer = strategy._trainer
        name = (worker.release or {}).get("sync", "")
        loader = strategy.progress.loader if strategy.progress is not None else None
        sampler = loader.sampler if loader is not None else None
        release = worker.release or {}
        if release.get("stop"):  # some rank decided to stop: every rank stops here, together
            trainer.should_stop = True
        if strategy.measure_consensus:
            strategy.consensus_error = worker.consensus_error()
        if strategy.average_at_sync:
            follow_module(strategy)
            average_replicas(worker, name)
        # ranks admitted in this release (an epoch's end), or meanwhile: the donor sends them its state
        self.follow_admissions(at_epoch_end=name.startswith(ADMITTING_AT) and not inside_epoch)
        if loader is not None:  # (the job's members: ranks admitted in the release too)
            loader.set_members(list(strategy.job.members) if strategy.job is not None else list(worker.members))
        # this rank's shards changed (a loss followed inside this meeting's sub-meetings too), or the control
        # plane says the membership did (a joiner's own shards date from its admission): alike on every member.
        # Where it says so, every member rebuilds its loaders, whatever its own shards were: a joiner admitted
        # among fewer members than the release names rebuilds them, and the barrier Lightning runs as it sets
        # up the next epoch's training data must run on every member or on none (a joiner's alone met the
        # others' gossip rounds on its pairs, and gloo aborted the job: "Received data size doesn't match")
        changed = bool(release.get("changed"))
        strategy.regrouped = strategy.survivors.follow_membership(rebuild=changed) or changed
        strategy.survivors.log_membership()
        if loader is not None and strategy.is_global_zero:
            loader.forget_finished_epochs()
        if sampler is not None and "speeds" in release:
            # every rank's time per batch, for the work queue's tail decisions
            sampler.set_speeds(release["speeds"])
        strategy.controller.met(inside_epoch, validate)
        if loader is not None:
            loader.untrained_at_meeting(release)
            if strategy.progress is not None and strategy.progress.schedule is not None:
                reached = loader.synchronized(progress)
                if progress is None:
                    strategy.progress.at_synchronization(reached)

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer's `state` as a checkpoint holds it: at a synchronization point the mean over
        the live workers (see `DecentralizedStrategy.optimizer_state`), elsewhere this rank's own."""
        strategy = self.strategy
        worker = strategy.worker
        if worker is None or strategy.failed or not strategy.controller.aligned or not state:
            return state
        operation = "optimizer state average for a checkpoint"
        members, decide = tuple(worker.members), worker.agree
        if worker.fresh:  # ranks admitted at this point (an epoch's end) hold the donor's state and write no
            # checkpoint here: the others average among themselves, deciding among themselves, as Lightning's
            # collectives do then (`collectives.RoutedCollectives.members`)
            if strategy.global_rank in worker.fresh:
                return state
            members = tuple(m for m in worker.members if m not in worker.fresh)

            def decide(complete: bool) -> bool:
                return worker.comm.agree_among(members, complete, operation)

        averaged, complete = averaged_optimizer_state(state, worker.comm, members, operation=operation, decide=decide)
        if not complete:
            log.warning(
                "rank %d: the checkpoint holds this rank's own optimizer state, not the mean", strategy.global_rank
            )
        return averaged
