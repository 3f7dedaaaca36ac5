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
`srun`, `mpirun`, a cluster's own) let the survivors go on.
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

log = logging.getLogger(__name__)


class SurvivingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher without its kill-all child observer (see the module docstring)."""

    #: seconds rank 0's process waits, at its exit, for children still running
    wait_at_exit: float = 3600.0

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not self.cluster_environment.creates_processes_externally:
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
