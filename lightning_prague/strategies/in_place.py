"""A rank the control plane left out comes back in place: its fit runs again, as a rejoining one.

A training step that blocks (a stalled network file system, a lock held elsewhere, a deadlock) is
left out of the fit once it has shown no sign of life for its short hang bound (10 s for short
steps, `HangRule.leave_out_bound`): the others go on without it as without a lost rank, and it is
fenced (SIGKILLed) only at its long bound (60 s). If it wakes before that, the process is whole;
only its place in the fit is gone (its replica missed the others' averages, its work was handed
to them). It then comes back as a new process for its rank would, without a new process:

1. its training thread raises `LeftOut` at its next contact with the control plane (a batch's
   start, a claim, a wait);
2. `RejoinInPlace`, which wraps the fit where the launcher runs it in each rank's process, ends
   that attempt as Lightning ends a failed one (the strategy's `on_exception`, the trainer's
   teardown: the session is closed, the exchanges stopped), without the callbacks' exception
   hooks (the fit has not failed);
3. the job becomes a joiner of the running fit (`Job.leave_in_place`), and the fit runs again
   from `PEER_CHECKPOINT`: the rank is admitted at once, with no meeting, a live
   member sends the fit's state, and it trains on in the epoch the others are in.

Nobody fences it, the launcher restarts nothing, and nothing runs the user's script again. If the
others finished the fit while it was left out, its fit ends when it wakes, without an error; so does
that of a process that came back in place and finds the fit ended before its admission, and that of
a process a restarter started for a lost rank that finds the fit ended (`FitEnded`: the
others trained its part before it was up), unless its predecessor's fit had failed and it finds
nothing of the job at all (`predecessor_failed`): the job's control plane was lost, and it fails with
`ControlPlaneLost` rather than report a fit that ended. A rank of lock-step shards (`decent_adam`,
`grouping="static"`) that comes back in a later epoch than the one it was left out in is admitted
at the members' epoch's end, as a new process for a rank lost in an earlier epoch is (inside that
epoch its shard holds nothing for it; in the same epoch it trains the rest of its shard). One whose
admission raced with the members' epoch's end (admitted inside the epoch its rank stood in, it
receives the state of the next: `EpochMovedOn`) leaves and asks again, and is admitted at that
epoch's end; this counts as a comeback. A rank that keeps being
left out comes back at most `MAX_COMEBACKS` times per process; after that its fit fails with the
last `LeftOut` (the others go on). Any other error ends the fit as before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from typing_extensions import override

from lightning_prague.core.client.partition import EXCLUDED_EXIT_VARIABLE, FENCED_EXIT_STATUS
from lightning_prague.core.errors import ControlPlaneLost, FitEnded
from lightning_prague.core.job import previous_exit, restarts
from lightning_prague.core.replicas.sharding import full_model_state, is_sharded
from lightning_prague.strategies.rejoin import PEER_CHECKPOINT, with_checkpoint

log = logging.getLogger(__name__)

#: times one process comes back in place before a further `LeftOut` ends its fit
MAX_COMEBACKS = 3


class EpochMovedOn(Exception):
    """A rank of lock-step shards (`decent_adam`, `grouping="static"`) was admitted inside a later epoch
    than the one its rank stood in: it has nothing to train there. The control plane admits such a
    rank at the members' epoch's end, so this happens only where its admission raced with the members'
    epoch's end (admitted inside epoch e, the donor's state is of e + 1). Raised while its admission's
    state is loaded; `RejoinInPlace` then leaves the fit and asks again (its rank still stands in
    epoch e, so it is admitted at the members' epoch's end)."""


class RejoinInPlace:
    """`function` (the trainer's `_fit_impl`, as a launcher runs it in a rank's process), run again as
    a rejoining fit each time the control plane left this rank out (see the module docstring).

    A class rather than a closure: launchers that spawn their ranks pickle it."""

    def __init__(self, function: Callable[..., Any], trainer: Any) -> None:
        self.function = function
        self.trainer = trainer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        comebacks = 0
        while True:
            try:
                return self.function(*args, **kwargs)
            except EpochMovedOn as moved_on:
                if comebacks >= MAX_COMEBACKS:
                    raise
                comebacks += 1
                log.warning(
                    "%s: it leaves and asks again, to be admitted at the members' epoch's end (comeback %d of at "
                    "most %d)", moved_on, comebacks, MAX_COMEBACKS,
                )  # fmt: skip
                self.come_back(moved_on)
                args, kwargs = with_checkpoint(self.function, args, kwargs, PEER_CHECKPOINT, force=True)
            except FitEnded as ended:
                if restarts() == 0 and comebacks == 0:  # started by hand to rejoin: the address may be wrong
                    raise
                failed = predecessor_failed()
                if ended.nothing_listens and failed is not None:
                    raise ControlPlaneLost(
                        f"{ended}; this rank's previous process failed its fit (exit status {failed}), and "
                        "nothing of the job is left to rejoin: its control plane was lost (or the fit failed "
                        "everywhere), so this restart fails too instead of reporting a fit that ended"
                    ) from None
                how = "which came back in place" if comebacks else "started again for its rank"
                log.warning("%s; this process, %s, has nothing to train: its fit ends here", ended, how)
                end_attempt(self.trainer, ended)
                return None
            except Exception as error:  # (an interrupt, a SystemExit: never a comeback)
                reason = left_out_reason(self.trainer)
                if reason is None or comebacks >= MAX_COMEBACKS:
                    raise
                if getattr(self.trainer.strategy.session, "fit_ended", False):
                    log.warning(
                        "rank %s was left out of the fit (%s), and the others finished it meanwhile: its fit ends here",
                        getattr(self.trainer, "global_rank", "?"), reason,
                    )  # fmt: skip
                    end_attempt(self.trainer, error)
                    return None
                comebacks += 1
                log.warning(
                    "rank %s was left out of the fit (%s): it rejoins the fit in place (comeback %d of at most %d)",
                    getattr(self.trainer, "global_rank", "?"), reason, comebacks, MAX_COMEBACKS,
                )  # fmt: skip
                self.come_back(error)
                args, kwargs = with_checkpoint(self.function, args, kwargs, PEER_CHECKPOINT, force=True)

    def come_back(self, error: BaseException) -> None:
        """End the attempt that raised `error` (it leaves the fit, as a failed rank does) and make the
        job a joiner of the same fit again."""
        end_attempt(self.trainer, error)
        self.trainer.strategy.leave_in_place()


def predecessor_failed() -> int | None:
    """The exit status of this restarted process's predecessor if its fit failed (it exited with a
    status of its own, an uncaught exception's 1 say), else `None`: a first start, a predecessor
    killed by a signal, or one that ended itself as excluded (`EXCLUDED_EXIT_VARIABLE`'s status: fenced
    or cut off), after which the others may well have finished the fit."""
    status = previous_exit()
    excluded = os.environ.get(EXCLUDED_EXIT_VARIABLE, str(FENCED_EXIT_STATUS)).strip()
    if status is None or status <= 0 or str(status) == excluded:
        return None
    return status


def left_out_reason(trainer: Any) -> str | None:
    """Why the control plane left this rank out of its running fit, or `None` (not left out, or not
    one of our strategies)."""
    session = getattr(getattr(trainer, "strategy", None), "session", None)
    reason = getattr(session, "left_out", None)
    return reason if isinstance(reason, str) else None


def end_attempt(trainer: Any, error: BaseException) -> None:
    """End a fit attempt that raised `error` as Lightning ends a failed fit (the strategy's
    `on_exception`, then the trainer's teardown), but without the callbacks' and loggers' failure
    hooks: the fit goes on, in this process, from a live member's state."""
    trainer.strategy.on_exception(error)
    trainer._teardown()
    trainer.training = True  # as `Trainer.fit` sets it before it runs the fit: the fit goes on
    trainer.should_stop = False


class ComebackMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's launcher for `start_method="spawn"`, `"fork"` and `"forkserver"`, whose ranks come
    back in place when left out (`RejoinInPlace`)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        wrapped = RejoinInPlace(function, trainer) if trainer is not None else function
        return super().launch(wrapped, *args, trainer=trainer, **kwargs)

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        """Lightning's, but a model sharded over its replica (`shard=True`) goes to the process that
        called fit whole: each replica gathers it on its first rank (a collective of its ranks, which
        all come here), and rank 0 sends its whole model where Lightning's would send its shards,
        which that process's plain module cannot load."""
        module = trainer.lightning_module
        if not is_sharded(module):
            return super()._collect_rank_zero_results(trainer, results)
        whole = full_model_state(module)
        module.state_dict = lambda *args, **kwargs: whole  # (what Lightning's saves for that process)
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict
