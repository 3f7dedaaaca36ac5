"""Exceptions raised by lightning-prague.

Every failure of a distributed wait is a `CoordinationTimeout` whose message names the
ranks involved and the operation, because asynchronous training fails by hanging and a hang
without a name is impossible to debug.
"""

from __future__ import annotations

#: `source` of the error items and replies by which the control plane reports its own failures
CONTROL_PLANE = "control plane"


class PragueError(RuntimeError):
    """Base class of all errors raised by lightning-prague."""


class ConfigurationError(PragueError, ValueError):
    """An option cannot be honoured; the message names the option and what to do instead."""


class CoordinationTimeout(PragueError, TimeoutError):
    """A wait on the coordinator, a group or a peer exceeded its timeout."""


class ControlPlaneError(PragueError):
    """The control plane failed: its handler rejected a message (a bug, or a malformed message), or
    its server stopped on an error. Not a timeout and no disagreement of the ranks; the message
    carries the control plane's own error."""


class ControlPlaneLost(ControlPlaneError, CoordinationTimeout):
    """This rank lost its control plane: its connection closed (the supervisor process or its node is
    gone) or nothing came from it for longer than this rank's hang bound (a network partition). The
    job cannot go on without it, so the fit ends on this rank, through Lightning's `on_exception`
    (an `OnExceptionCheckpoint` still writes its checkpoint). A `ControlPlaneError`, and a
    `CoordinationTimeout` as a wait on the control plane used to fail; the message says why."""


class FitEnded(ControlPlaneError):
    """A process that would rejoin a running fit found none: nothing listens at the job's store any
    more (its supervisor exited when the others finished the fit, or its node is gone). A process a
    restarter started for a lost rank ends its fit quietly on this (the others trained its part);
    one started by hand to rejoin fails with it. The message names the address and how long this
    process looked. `nothing_listens`: it is only known that nothing listens there (the fit may also
    have failed: its control plane lost), not that the control plane said the fit ended."""

    def __init__(self, message: str, nothing_listens: bool = False) -> None:
        super().__init__(message)
        self.nothing_listens = nothing_listens


class SyncMismatchError(PragueError):
    """Ranks arrived at different synchronization points and would otherwise deadlock."""


class ExchangeInterrupted(PragueError):
    """A communication thread was told to stop while it waited (shutdown after an error elsewhere)."""


class LeftOut(PragueError):
    """The control plane left this rank out of the fit: it showed no sign of life for its short hang
    bound (a step that blocked), and the others went on without it. It was not fenced: the process
    lives, so it comes back as a new process for its rank does, in place (the strategies rejoin the
    running fit with a live member's state, `lightning_prague.strategies.in_place`). The message
    says how long it was blocked."""


class MemberLost(PragueError):
    """A rank left the job (its process ended, or it stopped after an error) while others needed it.

    The message names the rank, why it left, and what this rank was doing.
    """
