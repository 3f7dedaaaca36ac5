"""One fit's session on this rank: its control session, worker and exchanger, from start to close.

A strategy decides *what* a fit needs in a `SessionPlan` (its factory builds it from its options;
building it starts nothing). A `TrainingSession` then owns the lifecycle:

* `open` joins the session of the control plane (at setup, before the data is loaded: the work
  queue and global progress live in it);
* `start` builds this rank's `GroupWorker` over the model's tensors (their final device known)
  and the exchanger that runs its exchanges;
* `close` ends it: after an error in the middle of a phase it first *leaves* (runs what peers wait
  for, so nobody is stranded), then stops every thread and closes the session. Safe to call twice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_prague.core.client.control import Session
from lightning_prague.core.comm.averaging import BucketedTensors
from lightning_prague.core.exchange.overlap import Exchanger
from lightning_prague.core.exchange.worker import GroupWorker
from lightning_prague.core.job import Job
from lightning_prague.core.membership import Admission
from lightning_prague.core.protocol import SessionConfig

log = logging.getLogger(__name__)

#: `make_exchanger(worker, tensors)`: how this rank's exchanges run relative to its steps
ExchangerFactory = Callable[[GroupWorker, BucketedTensors], Exchanger]


@dataclass(frozen=True)
class SessionPlan:
    """What one fit's session needs, decided at setup; building it has no side effect."""

    config: SessionConfig
    make_exchanger: ExchangerFactory
    #: seconds one operation may take
    timeout: float
    bucket_bytes: int
    #: seconds every rank may take to reach one synchronization point (default: `timeout`)
    sync_timeout: float | None = None


class TrainingSession:
    """Owns one fit's control session, worker and exchanger on this rank (see the module docstring)."""

    def __init__(self, job: Job, plan: SessionPlan) -> None:
        self.job = job
        self.plan = plan
        self.session: Session | None = None
        self.worker: GroupWorker | None = None
        self.exchanger: Exchanger | None = None
        #: a rank that rejoined the fit: its admission and the state the donor sent (`Job.rejoin`)
        self.admission: Admission | None = None

    def open(self) -> Session:
        """Join this fit's session of the control plane (every rank opens its sessions in the same
        order); a rank that rejoins waits here for its admission and the fit's state (`Job.rejoin`)."""
        if self.session is None:
            if self.job.joining:
                wait = self.plan.sync_timeout or self.plan.timeout
                self.admission = self.job.rejoin(self.plan.config, wait, self.plan.timeout)
                self.session = self.admission.session
            else:
                self.session = self.job.open_session(self.plan.config)
        return self.session

    def start(self, state: list[torch.Tensor]) -> None:
        """This rank's worker and exchanger over `state` (the tensors group averages change)."""
        session = self.open()
        tensors = BucketedTensors(state, self.plan.bucket_bytes)
        self.worker = GroupWorker(
            session, tensors, self.plan.timeout, sync_timeout=self.plan.sync_timeout, job=self.job
        )
        self.exchanger = self.plan.make_exchanger(self.worker, tensors)
        if self.admission is not None:  # rejoined: go on from the members' counters
            self.exchanger.take_up(self.admission.release)
        # a claim that waits at the work queue's end keeps running the groups peers drew this rank into
        session.counters.serve = self._serve_while_parked

    def _serve_while_parked(self) -> None:
        """While a claim waits at the work queue's end: run the groups peers drew this rank into, unless
        a communication thread runs them (a joiner is drawn into groups from its first claim on, before
        its first batch started any thread; a background exchanger's idle thread reads no inbox)."""
        if self.worker is not None and self.exchanger is not None:
            self.exchanger.serve_while_parked()

    @property
    def started(self) -> bool:
        return self.worker is not None and self.exchanger is not None

    def close(self, interrupted: bool) -> None:
        """End the session; `interrupted`: torn down in the middle of a phase (an error)."""
        exchanger, self.exchanger = self.exchanger, None
        if exchanger is not None:
            if interrupted:  # do not strand peers in our groups
                try:
                    exchanger.leave()
                except Exception:
                    log.warning("rank %d: could not leave the coordinator cleanly", self.job.rank, exc_info=True)
            exchanger.close()
        worker, self.worker = self.worker, None
        if worker is not None:
            worker.close()
        elif self.session is not None:
            self.session.close(failed=interrupted)  # it never trained: an error before its first step
        self.session = None
