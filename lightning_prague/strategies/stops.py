"""Signals and stops: every rank stops at the same point, with one model.

Lightning broadcasts a SIGTERM flag on the world group before every training batch, and its SLURM
handler writes a checkpoint from inside the signal handler; under asynchrony the first would put
the ranks back in lock step and the second would save one rank's replica in the middle of a
phase. `Stops` replaces both (`check_stop` for the broadcast, `on_sigterm` and `on_requeue_signal`
for the handlers, installed by the strategy's setup through `_patches`):

* a signal only sets a flag; before its next batch the rank asks the control plane to stop every
  rank (`request_signal_stop`), and each rank, once the announcement reaches it, drains its
  exchanges and meets the others at a *stop point*, where the replicas are averaged and Lightning's
  `SIGTERMException` ends the fit (`raise_stop`); for the requeue signal Lightning's own handler (a
  checkpoint, `scontrol requeue`) then runs on every rank alike;
* `trainer.should_stop` set on any rank (Timer, EarlyStopping, the module) is a stop *requested*
  of the job: every rank ends its epoch after its current batch and stops at the same
  synchronization point;
* a member lost during training ends the fit with an error naming it (`check_stop`);
* in replica groups every rank of a replica stops at the same step: under the work queue its data
  ends (`end_replicas_data`), under the lock-step strategies its ranks agree on the stop one batch
  after the first of them saw it (`agree_in_replica`, `lightning_prague.core.replicas.agreement`).

Under torchrun a worker's SIGTERM comes from its agent, which stops every worker of its node
whenever one of them fails (and to restart them, or to end the job): there it is no stop of the
job but this rank's departure (`leave`). The rank leaves at its next batch, the control plane
counts it lost, and the other nodes' ranks train on. A job-wide stop there would end every node's
fit early for one failed worker, with status 0, and their agents would never join the failed
node's new rendezvous of a restart.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_prague.core.protocol import REQUEUE, SIGTERM, STOP_SYNC
from lightning_prague.core.replicas.agreement import StopAgreement
from lightning_prague.strategies.sync_points import average_replicas

if TYPE_CHECKING:
    from lightning_prague.strategies.base import DecentralizedStrategy

log = logging.getLogger(__name__)


def sigterm_is_the_agents() -> bool:
    """Whether a SIGTERM of this process is its torchrun agent stopping its node's workers."""
    return bool(os.environ.get("TORCHELASTIC_RUN_ID"))


def requeue_signal(environment: Optional[ClusterEnvironment]) -> int:
    """The cluster's requeue signal (SLURM's, as Lightning's SLURM environment names it; SIGUSR1)."""
    return int(getattr(environment, "requeue_signal", None) or signal.SIGUSR1)


class Stops:
    """The strategy's signal handlers and stop points (see the module docstring)."""

    def __init__(self, strategy: DecentralizedStrategy) -> None:
        self.strategy = strategy
        #: the replica's agreement on stops (lock-step strategies in replica groups), made at the fit's first batch
        self.agreement: Optional[StopAgreement] = None
        #: `trainer.should_stop` set on this rank during a batch, held back until its replica's ranks agree
        self.held_request = False
        #: this rank's replica agreed on a requested stop (lock-step strategies in replica groups)
        self.agreed = False

    def replacements(self, trainer: Any) -> dict[str, Callable[..., Any]]:
        """Lightning's methods that these replace on the trainer's objects (installed by `_patches`)."""
        replaced: dict[str, Callable[..., Any]] = {
            "_broadcast_sigterm_tensor": self.check_stop,
            "_sigterm_notifier_fn": self.on_sigterm,
            "_slurm_sigusr_handler_fn": self.on_requeue_signal,
        }
        if self.strategy.replicas.replica_size > 1:
            replaced["on_advance_end"] = self._holding_requests(trainer.fit_loop.epoch_loop.on_advance_end, trainer)
        return replaced

    def _holding_requests(self, original: Callable[[Any], None], trainer: Any) -> Callable[[Any], None]:
        """The epoch loop's end of a batch, but a `trainer.should_stop` that a callback or the module set on
        this rank during the batch (a `Timer`, the module itself) is held back (`held_request`): Lightning
        would end this rank's epoch at once while its replica's other ranks went on into the next step's
        gradient average. It becomes the replica's request at the next batch (`check_stop`), and every rank
        of the replica ends its epoch at the same batch."""

        def on_advance_end(data_fetcher: Any) -> None:
            # (under the lock-step strategies `agree_in_replica` sets it for every rank of the replica
            # alike; under the work queue the replica's data ends instead and the closing meeting stops it)
            if trainer.should_stop and not self.agreed:
                log.debug("rank %d: a stop set during the batch waits for its replica", self.strategy.global_rank)
                trainer.should_stop = False
                self.held_request = True
            original(data_fetcher)

        return on_advance_end

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """Lightning's SIGTERM handler: forward the signal to this node's other processes, as
        Lightning does, and set a flag that the next batch turns into a stop of every rank."""
        strategy = self.strategy
        if not strategy.controller.sigterm and strategy.launcher is not None:
            strategy.launcher.kill(signum)  # forward to this node's other processes, as Lightning does
        strategy.controller.sigterm = True

    def on_requeue_signal(self, signum: int, frame: Any) -> None:
        """SLURM's requeue signal (`SLURMEnvironment(auto_requeue=True)`): Lightning's handler would
        write a checkpoint of this rank's replica from inside the handler, in the middle of a phase.
        It becomes a stop at the next batch instead, and the handler runs at the stop point."""
        controller = self.strategy.controller
        controller.requeue_signal = signum
        controller.sigterm = True

    def request_signal_stop(self) -> None:
        """A signal reached this process: ask every rank to stop (for the requeue signal, to write
        the requeue checkpoint as well)."""
        strategy = self.strategy
        controller = strategy.controller
        if controller.requeue_signal is None and sigterm_is_the_agents():
            return  # this rank leaves at its next batch (`leave`): the job goes on
        if strategy.worker is not None and controller.sigterm:
            strategy.worker.request_stop(REQUEUE if controller.requeue_signal is not None else SIGTERM)

    def check_stop(self) -> None:
        """Before every training batch (where Lightning would broadcast its SIGTERM flag): local checks
        of what the control plane announced. A lost member ends the fit with an error naming it; a
        stop asked for by any rank (`trainer.should_stop`) ends this rank's epoch after this batch,
        so that every rank stops at the same synchronization point; SIGTERM drains and stops now."""
        strategy = self.strategy
        worker = strategy.worker
        if worker is None:
            return
        session = worker.session
        session.beacon.bump()
        session.check_members("training")
        trainer = strategy._trainer
        asked = trainer is not None and (trainer.should_stop or self.held_request) and session.stop_reason is None
        if asked:
            worker.request_stop("request")
        self.request_signal_stop()
        if self.leaving_on_agents_sigterm():
            self.leave()  # (a replica's other ranks fail at their next gradient average, and leave too)
        if self.stops_by_data():
            self.end_replicas_data(session)
            return
        agreement = self.replica_agreement()
        if agreement is not None:
            self.agree_in_replica(agreement, asked)
            return
        if trainer is not None and not asked and session.stop_reason == "request" and not trainer.should_stop:
            log.debug("rank %d: the job is stopping; ending this epoch", strategy.global_rank)
            trainer.should_stop = True
        if session.stop_reason in (SIGTERM, REQUEUE):  # announced: stop at this batch, whatever reads the inbox
            worker.stop_seen = True
        if worker.stop_seen:
            strategy.drain()
            worker.drain_for_stop(strategy.exchanger)
            self.raise_stop()

    def stops_by_data(self) -> bool:
        """Whether this rank stops where its data ends rather than at the batch a stop reaches it: the
        ranks of a replica (`replica_size`) under the work queue take every step together, and a stop
        reaches each at its own batch."""
        strategy = self.strategy
        return (
            strategy.shards_by_work_queue
            and strategy.replicas.replica_size > 1
            and strategy.loaders.sampler is not None
        )

    def end_replicas_data(self, session: Any) -> None:
        """A stop (SIGTERM, the requeue signal, `trainer.should_stop` on some rank) in a replica: the
        replica's first rank claims nothing more in this epoch (`WorkQueueSampler.end_claims`), so its
        ranks end the epoch at the same chunk, and the epoch's closing meeting follows the stop (every
        rank meets at the stop point there, `GroupWorker.synchronize`). Its other ranks do nothing
        here: they follow its claims. Costs the batches already claimed or fetched (one or two)."""
        strategy = self.strategy
        assert strategy.worker is not None
        sampler = strategy.loaders.sampler
        stopping = session.stop_reason is not None or strategy.worker.stop_seen
        if stopping and sampler is not None and not sampler.follows:
            log.debug("rank %d: stopping; its replica claims nothing more in this epoch", strategy.global_rank)
            sampler.end_claims()

    def replica_agreement(self) -> Optional[StopAgreement]:
        """The replica's `StopAgreement` under a lock-step strategy in replica groups (its ranks average
        gradients at every step, and a stop reaches each at its own batch); `None` otherwise."""
        strategy = self.strategy
        if strategy.replicas.replica_size == 1 or strategy.shards_by_work_queue:
            return None
        if self.agreement is None:
            group = strategy.replica_host_group()  # host memory: never a wait for the device
            what = f"rank {strategy.global_rank}'s replica's stops"
            self.agreement = StopAgreement(group, timedelta(seconds=strategy.operation_timeout), what)
        return self.agreement

    def agree_in_replica(self, agreement: StopAgreement, asked: bool) -> None:
        """What this rank saw of a stop goes to its replica; what the replica's ranks saw one batch ago
        is acted on, by every rank of the replica at the same batch (`lightning_prague.core.replicas.agreement`)."""
        strategy = self.strategy
        worker, trainer = strategy.worker, strategy._trainer
        assert worker is not None
        session = worker.session
        signal = worker.stop_seen or session.stop_reason in (SIGTERM, REQUEUE)
        agreed = agreement.exchange(signal=signal, request=asked or session.stop_reason == "request")
        if agreed.request and trainer is not None and not trainer.should_stop:
            log.debug("rank %d: its replica agreed the job is stopping; ending this epoch", strategy.global_rank)
            self.agreed = True
            trainer.should_stop = True
        if agreed.signal:
            worker.stop_seen = True
            strategy.drain()
            worker.drain_for_stop(strategy.exchanger)
            self.raise_stop()

    def close(self) -> None:
        """The fit ended: the agreement goes (its group is the strategy's, `replica_host_group`)."""
        self.agreement = None
        self.held_request = self.agreed = False

    def leaving_on_agents_sigterm(self) -> bool:
        """Whether this rank got its torchrun agent's SIGTERM (not a requeue signal): it leaves the job."""
        controller = self.strategy.controller
        return controller.sigterm and controller.requeue_signal is None and sigterm_is_the_agents()

    def leave(self) -> None:
        """Under torchrun: the agent is stopping this node's workers; this rank leaves the job now
        (its teardown leaves the session mid-phase, as a lost rank's would) and the others go on."""
        self.say_leaving()
        raise SIGTERMException()

    def say_leaving(self) -> None:
        log.warning(
            "rank %d: SIGTERM from its torchrun agent, which stops this node's workers (one of them "
            "failed, or the job restarts or ends): this rank leaves the job; the others go on",
            self.strategy.global_rank,
        )

    def raise_stop(self) -> None:
        """Every rank met at the stop point: make the replicas one model (so any checkpoint written
        now, Lightning's `OnExceptionCheckpoint`'s or the requeue's, holds the consensus), run the
        requeue if one was signalled, and stop as Lightning does on SIGTERM."""
        strategy = self.strategy
        log.warning("rank %d: stopping on SIGTERM; every rank drained its group operations first", strategy.global_rank)
        trainer, worker = strategy._trainer, strategy.worker
        assert trainer is not None and worker is not None
        if strategy.average_at_sync:
            average_replicas(worker, STOP_SYNC)
        trainer._signal_connector.received_sigterm = True
        strategy.controller.met()  # every rank drained and met at the stop point
        if (worker.release or {}).get("requeue"):  # decided at the stop point: every rank alike
            signum = strategy.controller.requeue_signal or requeue_signal(strategy.cluster_environment)
            log.warning(
                "rank %d: requeue signal: a checkpoint of the consensus model, then requeue", strategy.global_rank
            )
            connector = trainer._signal_connector
            type(connector)._slurm_sigusr_handler_fn(connector, signum, None)  # Lightning's own, now aligned
        raise SIGTERMException()
