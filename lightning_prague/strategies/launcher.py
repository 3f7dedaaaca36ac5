"""Starting a node's ranks so that one rank's death does not end the others.

Lightning's script launcher (`start_method="popen"`) starts ranks 1..N-1 of a node as children of
rank 0's process and watches them with a thread that SIGKILLs every child and rank 0 itself as
soon as one child exits with an error. That is right for DDP, where nobody can go on without the
lost rank, and wrong for the asynchronous strategies, whose survivors finish the fit without it.
`SurvivingScriptLauncher` starts the children the same way but only logs a child's exit, and when
rank 0's script ends it waits for its children, so the command that started the job returns once
every rank of the node has. A SIGTERM is still forwarded to the children (`kill`).

Other start methods (`spawn`, `fork`, `forkserver`) run on `torch.multiprocessing`, which ends
every process when one fails; under torchrun the agent restarts every worker when one fails
(`--max-restarts`): only the script launcher and launchers that start each rank directly (SLURM's
`srun`, `mpirun`, a cluster's own) let the survivors go on. Where the engine restarts every worker,
recovery is restart and resume: on a restart (`TORCHELASTIC_RESTART_COUNT` above 0) a `fit` given
no `ckpt_path` resumes from the last checkpoint (`ckpt_path="last"`: the newest `last` checkpoint of
the trainer's `ModelCheckpoint` callbacks; from scratch, with Lightning's warning, if there is
none), on however many workers the restart has.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_prague.core.auth import LAUNCH_VARIABLE, known_launch_id, new_launch_id

log = logging.getLogger(__name__)


class SurvivingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher without its kill-all child observer (see the module docstring)."""

    #: seconds rank 0's process waits, at its exit, for children still running
    wait_at_exit: float = 3600.0
    #: a fit that torchrun restarted resumes from the last checkpoint (see the module docstring)
    resume_on_restart: bool = True

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        fitting = trainer is not None and getattr(trainer.state.fn, "value", None) == "fit"
        if self.resume_on_restart and restarted and fitting:
            args, kwargs = resume_from_last(function, args, kwargs)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
            if self.num_nodes == 1 and known_launch_id() is None:
                # every rank of this launch is a child of this process: they inherit its id, and refuse a
                # control plane that serves another launch (an earlier job's supervisor on a fixed port)
                os.environ[LAUNCH_VARIABLE] = new_launch_id()
            self._call_children_scripts()
            threading.Thread(
                target=_report_exits, args=(list(self.procs),), name="prague-children", daemon=True
            ).start()
            atexit.register(_wait_for, list(self.procs), self.wait_at_exit)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        return function(*args, **kwargs)


def _report_exits(procs: list[subprocess.Popen], period: float = 1.0) -> None:
    """Log each child's exit (an error exit is a lost rank: the others go on)."""
    running = list(procs)
    while running:
        time.sleep(period)
        for proc in list(running):
            code = proc.poll()
            if code is None:
                continue
            running.remove(proc)
            if code:
                log.warning("a rank's process (pid %d) exited with status %d; the other ranks go on", proc.pid, code)


def _wait_for(procs: list[subprocess.Popen], limit: float) -> None:
    deadline = time.monotonic() + limit
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("rank process %d still runs %.0fs after rank 0's script ended", proc.pid, limit)


def resume_from_last(function: Callable, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """`function`'s arguments with `ckpt_path="last"` unless one was given (Lightning's `_fit_impl`
    takes it; if a Lightning version does not, nothing changes and a warning says so)."""
    try:
        bound = inspect.signature(function).bind(*args, **kwargs)
    except (TypeError, ValueError):
        bound = None
    if bound is None or "ckpt_path" not in inspect.signature(function).parameters:
        log.warning("this Lightning version's fit takes no ckpt_path: a restarted fit starts from scratch")
        return args, kwargs
    if bound.arguments.get("ckpt_path") is None:
        log.warning("the job was restarted: resuming the fit from the last checkpoint")
        bound.arguments["ckpt_path"] = "last"
    return bound.args, bound.kwargs
