"""Where one rank stands between synchronization points: a small explicit state machine.

Asynchronous training alternates *aligned* stretches (every rank at the same point of the training
loop: collectives are safe) and *asynchronous phases* (ranks at different steps). A rank leaves
an aligned stretch at its first training batch and comes back at the next synchronization point
(validation, epoch end, a boundary of global progress, end of fit), where it meets every other
rank. The controller owns that state and the one decision that depends on it, with no Lightning
and no communication in it, so that it can be tested on its own (tests/test_phases.py):

    ALIGNED --batch_starts--> ASYNCHRONOUS --met(inside_epoch=False)--> ALIGNED
                                           --met(inside_epoch=True)---> MET_INSIDE_EPOCH
    MET_INSIDE_EPOCH --batch_starts--> ASYNCHRONOUS
    MET_INSIDE_EPOCH --(epoch end: must_meet is True)--> met(...) as from ASYNCHRONOUS

`MET_INSIDE_EPOCH`: the ranks met at a boundary inside an epoch that the others go on training
in; this rank owes them the epoch's next meeting even if it trains no further batch. Validation
requested by a boundary (`validation`) runs right after that meeting without a meeting of its own.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    ALIGNED = "aligned"
    ASYNCHRONOUS = "asynchronous"
    MET_INSIDE_EPOCH = "met at a boundary inside an epoch"


class Validation(enum.Enum):
    NONE = "none"
    #: a boundary asked for validation; the loop's next validation check takes it
    DUE = "due at the next validation check"
    #: validation runs right after a boundary's meeting: it needs no meeting of its own
    AFTER_BOUNDARY = "running right after a boundary"


class SyncController:
    """One rank's phase, pending validation and stop request (see the module docstring)."""

    def __init__(self) -> None:
        self.phase = Phase.ALIGNED
        self.validation = Validation.NONE
        #: SIGTERM reached this process; it becomes a stop of the job at the next batch or meeting
        self.sigterm = False
        #: the cluster's requeue signal (SLURM's SIGUSR1) reached this process: a SIGTERM-like stop,
        #: then the requeue checkpoint at the stop point (`None`: not asked)
        self.requeue_signal: int | None = None
        self.meetings = 0

    @property
    def aligned(self) -> bool:
        """Every rank is at the same point of the loop: collectives of every rank are safe."""
        return self.phase is not Phase.ASYNCHRONOUS

    @property
    def must_meet(self) -> bool:
        """A synchronization point reached now must meet the other ranks (otherwise it is a no-op)."""
        return self.phase is not Phase.ALIGNED

    def batch_starts(self) -> None:
        self.phase = Phase.ASYNCHRONOUS

    def met(self, inside_epoch: bool = False, validate: bool = False) -> None:
        """The ranks met (and averaged); `inside_epoch`: at a boundary that others train past;
        `validate`: the boundary asks for validation now."""
        self.meetings += 1
        self.phase = Phase.MET_INSIDE_EPOCH if inside_epoch else Phase.ALIGNED
        if validate:
            self.validation = Validation.DUE

    def take_validation(self, loop_would_validate: bool) -> bool | None:
        """At the loop's validation check: `True`/`False` if a boundary decided (validate if the loop's
        epoch-based setting allows it), `None` if the loop decides as usual."""
        if self.validation is not Validation.DUE:
            return None
        self.validation = Validation.AFTER_BOUNDARY if loop_would_validate else Validation.NONE
        return loop_would_validate

    def validation_starts(self) -> bool:
        """Validation begins: whether it needs a meeting of its own (not right after a boundary's)."""
        if self.validation is Validation.AFTER_BOUNDARY:
            self.validation = Validation.NONE
            return False
        return True

    def reset(self) -> None:
        """Teardown: whatever happened, the next fit starts aligned."""
        self.phase = Phase.ALIGNED
        self.validation = Validation.NONE
        self.sigterm = False
        self.requeue_signal = None

    def __repr__(self) -> str:
        return f"SyncController({self.phase.value}, validation {self.validation.value}, sigterm={self.sigterm})"
