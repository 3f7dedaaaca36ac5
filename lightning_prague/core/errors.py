"""Exceptions raised by lightning-prague.

Every failure of a distributed wait is a `CoordinationTimeout` whose message names the
ranks involved and the operation, because asynchronous training fails by hanging and a hang
without a name is impossible to debug.
"""

from __future__ import annotations


class PragueError(RuntimeError):
    """Base class of all errors raised by lightning-prague."""


class ConfigurationError(PragueError, ValueError):
    """An option cannot be honoured; the message names the option and what to do instead."""


class CoordinationTimeout(PragueError, TimeoutError):
    """A wait on the coordinator, a group or a peer exceeded its timeout."""


class SyncMismatchError(PragueError):
    """Ranks arrived at different synchronization points and would otherwise deadlock."""


class ExchangeInterrupted(PragueError):
    """A communication thread was told to stop while it waited (shutdown after an error elsewhere)."""


class MemberLost(PragueError):
    """A rank left the job (its process ended, or it stopped after an error) while others needed it.

    The message names the rank, why it left, and what this rank was doing.
    """
