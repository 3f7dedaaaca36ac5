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

**Restarts** (`max_restarts` above 0) under a launcher that starts every rank itself (SLURM's `srun`,
torchrun, a container): each rank's process becomes its rank's *keeper* at the start of `fit`
(`keep_this_rank`, `lightning_prague.strategies.keeper`): it forks the training process and restarts
it in place when it is lost. torchrun's own restarts cannot heal a job of several nodes: a restarted
worker there is refused with what to do (`check_torchrun_restarts`).

**A new process of a running job** (a new `srun` step, a restarted container, a process by hand
with `LIGHTNING_PRAGUE_REJOIN=1`) finds the job's running fit before its `fit` starts
(`lightning_prague.core.job.look_for_running_fit`) and resumes from `PEER_CHECKPOINT`.

**Restarts under Lightning's launcher** (`max_restarts` above 0, on each node): the process the user
started becomes the node's *agent*. It trains nothing: it starts every rank of the node, rank 0
included, as a child (`RankAgent`), and when one exits with an error (a crash, `kill -9`, an
out-of-memory kill, a hang the control plane fenced) it starts a new process for that rank, with
the rank's environment and `LIGHTNING_PRAGUE_RESTART_COUNT` counting its restarts. That process rejoins the running fit
(`lightning_prague.strategies.rejoin`). Each rank is restarted at most `max_restarts` times, the
n-th time after `RESTART_BACKOFF` x 2^(n-1) seconds, so a rank that crashes at once again is not
restarted in a tight loop; past its budget it stays lost and the others finish the fit. The agent
is the one process that must live: it holds no training state and runs no collective, so only a
signal to it ends it (it forwards SIGTERM and SIGINT to the ranks, and restarts nothing after). It
exits once every rank's last process has, with status 0 if each of them exited 0, else 1; the rest of
the user's script after `fit` runs in the ranks' processes (in rank 0's, as usual), not in the agent.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, Optional

from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from typing_extensions import override

from lightning_prague.core.auth import LAUNCH_VARIABLE, known_launch_id, new_launch_id
from lightning_prague.core.client.partition import EXCLUDED_EXIT_VARIABLE, FENCED_EXIT_STATUS
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.forking import unforkable_state
from lightning_prague.core.job import PREVIOUS_EXIT_VARIABLE, RESTARTS_VARIABLE, look_for_running_fit, rejoining
from lightning_prague.core.plane.service import plane_address
from lightning_prague.strategies.in_place import ComebackMultiProcessingLauncher, RejoinInPlace
from lightning_prague.strategies.keeper import (
    BACKOFF,
    KEEPER_VARIABLE,
    child_environment,
    die_with_parent,
    hand_over,
    keeper_argv,
    kept,
    spare_wanted,
    start_spare,
)
from lightning_prague.strategies.rejoin import PEER_CHECKPOINT, with_checkpoint

log = logging.getLogger(__name__)


class SurvivingScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's script launcher without its kill-all child observer (see the module docstring)."""

    #: seconds rank 0's process waits, at its exit, for children still running
    wait_at_exit: float = 3600.0
    #: a fit that torchrun restarted resumes from the last checkpoint (see the module docstring)
    resume_on_restart: bool = True

    def __init__(self, *args: Any, max_restarts: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: restarts of each rank's process (see the module docstring); 0: none
        self.max_restarts = max_restarts

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        fitting = trainer is not None and getattr(trainer.state.fn, "value", None) == "fit"
        external = self.cluster_environment.creates_processes_externally
        check_torchrun_restarts(self.max_restarts, self.num_nodes)
        if external and self.max_restarts > 0 and not kept():
            keep_this_rank(self.max_restarts)  # returns in the training process; this one becomes its keeper
        if fitting and external:  # a lost rank's new process finds its job's running fit by itself
            environment = self.cluster_environment
            store = plane_address() or (environment.main_address, environment.main_port)  # a plane service's, if any
            look_for_running_fit(environment.global_rank(), *store)
        if fitting and rejoining():  # a new process for a lost rank: the fit's state comes from a live member
            args, kwargs = with_checkpoint(function, args, kwargs, PEER_CHECKPOINT, force=True)
        elif self.resume_on_restart and restarted and fitting:
            args, kwargs = resume_from_last(function, args, kwargs)
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        if not external:
            if self.num_nodes == 1 and known_launch_id() is None:
                # every rank of this launch is a child of this process: they inherit its id, and refuse a
                # control plane that serves another launch (an earlier job's supervisor on a fixed port)
                os.environ[LAUNCH_VARIABLE] = new_launch_id()
            if self.max_restarts > 0:
                os.environ[KEEPER_VARIABLE] = str(os.getpid())  # the ranks it starts are kept: no keeper of their own
                self._call_children_scripts()  # Lightning's environment for every rank; rank 0 is started below
                status = RankAgent(self.procs, self.max_restarts).run()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)  # the agent trained nothing: the script's rest runs in the ranks
            self._call_children_scripts()
            threading.Thread(
                target=_report_exits, args=(list(self.procs),), name="prague-children", daemon=True
            ).start()
            atexit.register(_wait_for, list(self.procs), self.wait_at_exit)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        if trainer is not None:  # a rank left out of the fit comes back in place
            function = RejoinInPlace(function, trainer)
        return function(*args, **kwargs)


class ForkedRank:
    """A rank's process forked by `SurvivingForkLauncher`, as `RankAgent` watches one (`subprocess.Popen`'s
    `pid`, `poll`, `returncode` and `send_signal`)."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.process.exitcode

    def poll(self) -> Optional[int]:
        return self.process.exitcode  # (reaps it once it ended: `waitpid` without blocking)

    def send_signal(self, signum: int) -> None:
        try:
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass


class SurvivingForkLauncher(ComebackMultiProcessingLauncher):
    """`start_method="fork"` whose survivors go on: each rank of the node is forked from the process
    that called `fit`, which becomes the node's agent (`RankAgent`) as under the script launcher.

    Lightning's launcher for forked ranks (`torch.multiprocessing`) ends every rank when one fails.
    Here a rank that fails is only logged, the others finish the fit, and with `max_restarts` a lost
    rank is forked again from the same point, as a new process for its rank (`RESTARTS_VARIABLE`),
    which rejoins the running fit from a live member's state: no interpreter start and no import, so
    it trains again within about a second of its loss. After the ranks ended, the process that called
    `fit` takes rank 0's results as Lightning's launcher does (the trained weights, the best
    checkpoint's path, the logged metrics); if rank 0's last process failed, there are none and `fit`
    raises. Forking is refused where CUDA or an MPI library is initialised already."""

    #: the exit statuses of each local rank's last process, once the ranks ended
    status: dict[int, int]

    @override
    def launch(self, function: Callable, *args: Any, trainer: Optional[Any] = None, **kwargs: Any) -> Any:
        hazard = unforkable_state()
        if hazard is not None:
            raise ConfigurationError(
                f"{hazard} before fit: the ranks cannot be forked from this process (start_method='fork'). "
                "Use start_method='popen' (the default), or initialise it only inside the fit"
            )
        fitting = trainer is not None and getattr(trainer.state.fn, "value", None) == "fit"
        if self._already_fit and fitting:
            raise ConfigurationError(
                "trainer.fit() was called twice on one Trainer with start_method='fork': create a new Trainer, "
                "and pass fit(ckpt_path=...) to go on from a checkpoint"
            )
        assert self._strategy.cluster_environment is not None
        os.environ["MASTER_PORT"] = str(self._strategy.cluster_environment.main_port)  # one port for every rank
        launch_id = known_launch_id()
        if launch_id is None and self._strategy.num_nodes == 1:  # every process of the launch, restarts included
            launch_id = new_launch_id()  # (on several nodes each would make its own: the supervisor's is taken)
        wrapped = RejoinInPlace(function, trainer) if trainer is not None else function
        context = multiprocessing.get_context("fork")
        results = context.SimpleQueue()

        agent: Optional[RankAgent] = None

        def start(local_rank: int, restarts: int) -> ForkedRank:
            previous = agent.previous.get(local_rank) if agent is not None and restarts else None
            process = context.Process(
                target=self._run_rank,
                args=(local_rank, restarts, previous, launch_id, trainer, function, wrapped, args, kwargs),
                kwargs={"results": results},
                name=f"prague-rank-{local_rank}",
            )
            sys.stdout.flush()
            sys.stderr.flush()
            process.start()
            return ForkedRank(process)

        max_restarts = getattr(self._strategy, "max_restarts", 0) if fitting else 0  # only a fit can be rejoined
        children = [start(local, 0) for local in range(1, self._strategy.num_processes)]
        agent = RankAgent(children, max_restarts, start=start)
        agent.run()
        self.status = dict(agent.status)
        self.procs = [rank.process for rank in agent.procs.values()]
        lost = {local: code for local, code in sorted(self.status.items()) if code}
        if results.empty():
            raise ConfigurationError(
                f"local rank 0's last process exited with status {self.status.get(0)} (ranks lost: {lost}): "
                "there is no result of the fit to take into this process (a rank's own error, if it raised one, "
                "is printed above)"
            )
        output = results.get()
        if lost:
            log.warning("local ranks %s ended with statuses %s; the others finished the fit", list(lost), lost)
        if trainer is None:
            return output
        self._already_fit |= fitting
        self._recover_results_in_main_process(output, trainer)
        return output.trainer_results

    def _run_rank(
        self,
        local_rank: int,
        restarts: int,
        previous: Optional[int],
        launch_id: Optional[str],
        trainer: Optional[Any],
        function: Callable,
        wrapped: Callable,
        args: Any,
        kwargs: Any,
        results: Any,
    ) -> None:
        """A forked rank's process: its launch, its restarts (a restarted one resumes from a live
        member's state, `PEER_CHECKPOINT`), then Lightning's own wrapper of the fit."""
        if launch_id is not None:
            os.environ[LAUNCH_VARIABLE] = launch_id
        os.environ.setdefault(EXCLUDED_EXIT_VARIABLE, str(FENCED_EXIT_STATUS))  # an excluded rank is a lost one
        if restarts:
            os.environ[RESTARTS_VARIABLE] = str(restarts)
            if previous is not None:
                os.environ[PREVIOUS_EXIT_VARIABLE] = str(previous)
            args, kwargs = with_checkpoint(function, args, kwargs, PEER_CHECKPOINT, force=True)
        self._wrapping_function(
            local_rank, trainer, failing_as_in_the_main_process(trainer, wrapped), args, kwargs, results
        )


def failing_as_in_the_main_process(trainer: Optional[Any], function: Callable) -> Callable:
    """`function` (a forked rank's fit), whose failure reaches the strategy's `on_exception` first, as in a
    process that runs `fit` itself (Lightning's `_call_and_handle_interrupt` calls it; its launcher's
    wrapper in a forked process does not): the control plane learns of it at once, and a rank whose
    replica lost a rank says so."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except BaseException as err:
            strategy = getattr(trainer, "strategy", None)
            if strategy is not None:
                try:
                    strategy.on_exception(err)
                except Exception:  # (the fit's own error is the one to report)
                    log.debug("the strategy's on_exception failed", exc_info=True)
            raise

    return run


def keep_this_rank(max_restarts: int) -> None:
    """Give this rank a keeper (`lightning_prague.strategies.keeper`): fork the training process, which
    returns from here and trains, and make this process, the one the launcher started, its keeper
    (`exec`: same pid, a small interpreter). Where the training process cannot be forked (CUDA or an
    MPI library is initialised already: `lightning_prague.core.forking`), the keeper starts it as a new
    process of the same command instead."""
    command = list(_basic_subprocess_cmd())
    sys.stdout.flush()
    sys.stderr.flush()
    spare = spare_wanted(dict(os.environ))
    hazard = unforkable_state()
    if hazard is not None:
        log.warning("%s before fit: this rank's keeper starts its training process anew", hazard)
        os.execv(sys.executable, keeper_argv(command, max_restarts, None, spare=spare))
    keeper = os.getpid()
    child = os.fork()
    if child == 0:  # the training process
        die_with_parent()
        os.environ.update(child_environment(dict(os.environ), keeper, 0))
        log.info("rank's keeper (pid %d) restarts this process (pid %d) if it is lost", keeper, os.getpid())
        return
    os.execv(sys.executable, keeper_argv(command, max_restarts, child, spare=spare))


#: what to do instead of torchrun's restarts on several nodes
TORCHRUN_ADVICE = (
    "run torchrun with --max-restarts 0 and give the strategy max_restarts (e.g. PartialAllReduceStrategy("
    "max_restarts=3)): each rank's keeper then starts a lost worker again in place and it rejoins the running fit, "
    "while the others train on (docs/multi_node.md, A lost worker comes back)"
)


def check_torchrun_restarts(max_restarts: int, num_nodes: int) -> None:
    """torchrun's own restarts (`--max-restarts`) restart every worker of a node, and across nodes its
    agents count them apart, so that a restarted node's workers never meet the others': refuse a
    restarted worker of a job of several nodes with what to do, and warn at the first start where
    torchrun may restart (or where it would restart what the strategy's `max_restarts` keeps)."""
    env = os.environ
    if not env.get("TORCHELASTIC_RUN_ID"):
        return
    torchrun_restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    nodes = max(num_nodes, int(env.get("GROUP_WORLD_SIZE", "1") or 1))
    if nodes > 1 and int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        raise ConfigurationError(
            f"torchrun restarted this node's workers (restart {env['TORCHELASTIC_RESTART_COUNT']} of --max-restarts "
            f"{torchrun_restarts}), but on {nodes} nodes a torchrun restart cannot heal the job: it restarts every "
            f"worker of the node and the nodes' agents count restarts apart, so the new workers never meet the "
            f"running fit. Stop the job and {TORCHRUN_ADVICE}; a rerun resumes from the last checkpoint"
        )
    if torchrun_restarts > 0 and (nodes > 1 or max_restarts > 0):
        warnings.warn(
            f"torchrun runs with --max-restarts {torchrun_restarts}"
            + (f" on {nodes} nodes, where its restarts cannot heal the job" if nodes > 1 else "")
            + (f", and max_restarts={max_restarts} restarts a lost rank in place already" if max_restarts else "")
            + f": {TORCHRUN_ADVICE}",
            stacklevel=3,
        )


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
    return with_checkpoint(function, args, kwargs, "last")


#: seconds before a rank's first restart; each further one waits twice as long
RESTART_BACKOFF = BACKOFF  # the keeper's, which restarts a rank under other launchers
#: seconds after a restart took the warm spare before a new one starts (its imports would slow the
#: restarted rank's own start)
SPARE_DELAY = 5.0


class RankAgent:
    """Starts every rank of one node and restarts the lost ones (see the module docstring).

    `start(local_rank, restarts)`: how a rank's process starts (anything with `pid`, `poll()`,
    `returncode` and `send_signal`); by default a new interpreter of the script, as Lightning starts
    ranks 1.., with a warm spare kept for the restarts (`start_method="popen"`). The fork launcher
    (`SurvivingForkLauncher`) passes its own: a fork needs no spare."""

    def __init__(
        self,
        children: list[Any],
        max_restarts: int,
        period: float = 0.2,
        start: Optional[Callable[[int, int], Any]] = None,
    ) -> None:
        self.max_restarts = max_restarts
        self.period = period
        #: a process that imported torch and Lightning, ready to become a lost rank (see `_start`)
        self.spare: Optional[subprocess.Popen] = None
        self._spare_due = time.monotonic()  # it imports alongside the ranks: ready by the first loss
        self.keeps_spare = start is None
        #: local rank -> the exit status of its last process that ended (passed to the next one)
        self.previous: dict[int, int] = {}
        self._start_rank = start if start is not None else self._start
        #: local rank -> its running process (rank 0's started here; the others before: `children`)
        self.procs: dict[int, Any] = {0: self._start_rank(0, 0)}
        self.procs.update({local: proc for local, proc in enumerate(children, start=1)})
        self.restarts: dict[int, int] = dict.fromkeys(self.procs, 0)
        self.status: dict[int, int] = {}
        self._stopping = False

    def _start(self, local_rank: int, restarts: int) -> subprocess.Popen:
        """A process for `local_rank` with the environment Lightning gives it, and its restart count:
        a restart takes the warm spare if one is ready (`lightning_prague.strategies.spare`)."""
        env = os.environ.copy()
        env["LOCAL_RANK"] = str(local_rank)
        env[RESTARTS_VARIABLE] = str(restarts)
        env.pop(PREVIOUS_EXIT_VARIABLE, None)
        if local_rank in self.previous:
            env[PREVIOUS_EXIT_VARIABLE] = str(self.previous[local_rank])
        env.setdefault(EXCLUDED_EXIT_VARIABLE, str(FENCED_EXIT_STATUS))  # an excluded rank is a lost one: restart it
        if restarts == 0:
            env.pop(RESTARTS_VARIABLE)
            return subprocess.Popen(_basic_subprocess_cmd(), env=env)
        spare, self.spare = self.spare, None
        self._spare_due = time.monotonic() + SPARE_DELAY
        if hand_over(spare, env):
            assert spare is not None
            log.debug("local rank %d: its new process is the warm spare (pid %d)", local_rank, spare.pid)
            return spare
        return subprocess.Popen(_basic_subprocess_cmd(), env=env)  # no spare, or it died: as usual

    def _keep_spare(self) -> None:
        """Start a warm spare when none is ready: with the ranks, and `SPARE_DELAY` after a restart took one."""
        if not self.keeps_spare or self._stopping or self.max_restarts == 0 or time.monotonic() < self._spare_due:
            return
        if self.spare is not None and self.spare.poll() is None:
            return
        self._spare_due = time.monotonic() + SPARE_DELAY  # one that dies at once is not replaced in a loop
        self.spare = start_spare(_basic_subprocess_cmd(), dict(os.environ))
        log.debug("a warm spare (pid %d) stands ready to replace a lost rank", self.spare.pid)

    def _end_spare(self) -> None:
        spare, self.spare = self.spare, None
        if spare is not None and spare.stdin is not None:
            spare.stdin.close()  # end of input: it exits
            try:
                spare.wait(5.0)
            except subprocess.TimeoutExpired:
                spare.kill()

    def _forward(self, signum: int, frame: Any) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    def run(self) -> int:
        """Watch the ranks until every one's last process exited; the agent's exit status."""
        previous = {signum: signal.signal(signum, self._forward) for signum in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._watch()
        finally:
            self._end_spare()
            for signum, handler in previous.items():  # as they were before
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _watch(self) -> int:
        due: dict[int, float] = {}  # local rank -> when its next process starts
        while len(self.status) < len(self.procs):
            time.sleep(self.period)
            self._keep_spare()
            for local, proc in list(self.procs.items()):
                if local in self.status or local in due or proc.poll() is None:
                    continue
                code = proc.returncode
                if code == 0 or self._stopping or self.restarts[local] >= self.max_restarts:
                    self.status[local] = code
                    if code:
                        log.warning(
                            "local rank %d (pid %d) exited with status %d and stays lost (%d restarts of %d used)",
                            local, proc.pid, code, self.restarts[local], self.max_restarts,
                        )  # fmt: skip
                    continue
                self.restarts[local] += 1
                self.previous[local] = code
                wait = RESTART_BACKOFF * 2 ** (self.restarts[local] - 1)
                due[local] = time.monotonic() + wait
                log.warning(
                    "local rank %d (pid %d) exited with status %d: starting it again in %.0fs (restart %d of %d)",
                    local, proc.pid, code, wait, self.restarts[local], self.max_restarts,
                )  # fmt: skip
            for local, when in list(due.items()):
                if time.monotonic() >= when and not self._stopping:
                    self.procs[local] = self._start_rank(local, self.restarts[local])
                    del due[local]
                elif self._stopping:
                    self.status[local] = self.procs[local].returncode or 1
                    del due[local]
        return 0 if all(code == 0 for code in self.status.values()) else 1
