"""A rank's keeper: a small parent that starts the rank's training process again when it is lost.

Under a launcher that starts every rank itself (SLURM's `srun`, torchrun with `--max-restarts 0`, a
Kubernetes container, `mpirun`) the strategies' `max_restarts` works through this keeper: the
process the launcher started forks its training process at the start of `fit`
(`SurvivingScriptLauncher`) and then *becomes* the keeper (`exec`: the same pid, so the launcher
still sees its task, now a small interpreter that imports nothing of torch or Lightning). The
keeper

- waits for its training process; one that exits with an error (a crash, `kill -9`, an
  out-of-memory kill, a rank the control plane excluded, which its keeper has exit with 75) is
  started again as a new process of the same command and environment, with
  `LIGHTNING_PRAGUE_RESTART_COUNT` counting its restarts: it rejoins the running fit
  (`lightning_prague.strategies.rejoin`). At most `max_restarts` times, the n-th after
  `backoff` x 2^(n-1) seconds, so that a process that fails at once is not restarted in a loop;
- forwards the signals a launcher sends its task (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2) to the
  training process, and restarts nothing after a SIGTERM, SIGINT or SIGHUP (the launcher stops the
  job);
- keeps a *warm spare* (as the node's agent does under Lightning's launcher): `SPARE_DELAY` seconds
  after it starts, and after a restart took one, it starts `python -m lightning_prague.strategies.spare`
  with the rank's command, a process that imports torch and Lightning and waits; a restart hands the
  spare the new process's environment, and it runs the command in itself, without the seconds of
  imports. It costs one idle interpreter per rank (a few hundred MB of host memory, no GPU memory);
  `LIGHTNING_PRAGUE_WARM_SPARE=0` turns it off;
- exits as its last training process did: with its exit status, or killed by the same signal, so
  the launcher reports what it would have without a keeper (docs/fault_tolerance.md, "Exit
  statuses"). A training process dies with its keeper (`PR_SET_PDEATHSIG` on Linux): a launcher
  that SIGKILLs its task leaves no rank behind.

Standard library only: this file runs as a program (`python -P keeper.py ...`, by path, so that
the package's `__init__` and its imports of torch and Lightning stay out of it) in the launcher's task.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

#: environment variable of a training process that a keeper (or the node's agent) started: its
#: parent's pid; a process whose parent is that pid is kept already and starts no keeper of its own
KEEPER_VARIABLE = "LIGHTNING_PRAGUE_KEEPER"
#: environment variable: the restart count of a rank's process (as `lightning_prague.core.job`'s)
RESTARTS_VARIABLE = "LIGHTNING_PRAGUE_RESTART_COUNT"
#: environment variable: the exit status of an excluded rank (as `lightning_prague.core.client.partition`'s)
EXCLUDED_EXIT_VARIABLE = "LIGHTNING_PRAGUE_EXCLUDED_EXIT_STATUS"
#: environment variable: a restarted process's predecessor's exit status (as `lightning_prague.core.job`'s)
PREVIOUS_EXIT_VARIABLE = "LIGHTNING_PRAGUE_PREVIOUS_EXIT_STATUS"
#: the exit status a kept rank reports an exclusion with, so that its keeper starts it again
EXCLUDED_STATUS = 75
#: the signals forwarded to the training process
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
#: the forwarded signals after which nothing is restarted (the launcher stops the task)
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: seconds before a rank's first restart; each further one waits twice as long
BACKOFF = 1.0
#: environment variable: `0` turns the keeper's warm spare off
SPARE_VARIABLE = "LIGHTNING_PRAGUE_WARM_SPARE"
#: seconds after the keeper starts, and after a restart took the spare, before a new spare starts (its
#: imports would slow the training process's own start)
SPARE_DELAY = 5.0
#: how often the keeper looks at its training process and its spare, seconds
POLL_SECONDS = 0.1
_PR_SET_PDEATHSIG = 1


def spare_environment(command: Sequence[str], environment: dict[str, str]) -> dict[str, str]:
    """The environment a spare for `command` (`[-m module | script] args...`) starts with:
    `environment`, and for a script its folder first on `PYTHONPATH`, where `python script.py` puts it
    (the rank's own environment replaces this one before the script runs; the path stays)."""
    if not command or command[0] == "-m":
        return dict(environment)
    folder = os.path.dirname(os.path.abspath(command[0]))
    rest = environment.get("PYTHONPATH")
    return {**environment, "PYTHONPATH": folder + (os.pathsep + rest if rest else "")}


def spare_command(command: Sequence[str]) -> list[str]:
    """The command line of a warm spare for the training process's `command` (its interpreter first)."""
    return [command[0], "-m", "lightning_prague.strategies.spare", *command[1:]]


def start_spare(command: Sequence[str], environment: dict[str, str], **popen: Any) -> subprocess.Popen:
    """A warm spare for the training process's `command`, reading its orders from a pipe (`hand_over`)."""
    return subprocess.Popen(  # noqa: PLW1509  (`preexec_fn` where given: the keeper runs no threads)
        spare_command(command), stdin=subprocess.PIPE, env=spare_environment(command[1:], environment), **popen
    )


def hand_over(spare: Optional[subprocess.Popen], environment: dict[str, str]) -> bool:
    """Make `spare` the new process of a rank: send it the process's `environment`; whether it took
    it (`False`: none, or it died meanwhile: start a new process as without a spare)."""
    if spare is None or spare.poll() is not None or spare.stdin is None:
        return False
    try:
        spare.stdin.write(json.dumps(environment).encode() + b"\n")
        spare.stdin.close()
    except OSError:
        return False
    return True


def spare_wanted(environment: dict[str, str]) -> bool:
    """Whether a keeper keeps a warm spare: unless `SPARE_VARIABLE` is `0`."""
    return environment.get(SPARE_VARIABLE, "1").strip() != "0"


def kept() -> bool:
    """Whether this process was started by a keeper (or the node's agent): it is kept already."""
    return os.environ.get(KEEPER_VARIABLE, "") == str(os.getppid())


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing): called in
    a training process right after its keeper forked it, before anything else runs."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the keeper's own end is the only bound
        return
    if os.getppid() != parent:  # the parent died before the call: follow it
        os._exit(1)


def child_environment(
    base: dict[str, str], keeper: int, restarts: int, previous: Optional[int] = None
) -> dict[str, str]:
    """A training process's environment: `base`, its keeper's pid, its restart count and its previous
    process's exit status (none on the first start) and the exit status of an exclusion
    (`EXCLUDED_STATUS` unless the user set one)."""
    env = dict(base)
    env[KEEPER_VARIABLE] = str(keeper)
    env.setdefault(EXCLUDED_EXIT_VARIABLE, str(EXCLUDED_STATUS))
    env.pop(PREVIOUS_EXIT_VARIABLE, None)
    if restarts:
        env[RESTARTS_VARIABLE] = str(restarts)
        if previous is not None:
            env[PREVIOUS_EXIT_VARIABLE] = str(previous)
    else:
        env.pop(RESTARTS_VARIABLE, None)
    return env


class Keeper:
    """Keeps one rank's training process running (see the module docstring)."""

    def __init__(
        self,
        command: Sequence[str],
        max_restarts: int,
        child: Optional[int] = None,
        backoff: float = BACKOFF,
        environment: Optional[dict[str, str]] = None,
        spare: bool = False,
        spare_delay: float = SPARE_DELAY,
    ) -> None:
        if not command:
            raise ValueError("the keeper needs the training process's command")
        if max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts}: a count of restarts, 0 or more")
        self.command = list(command)
        self.max_restarts = max_restarts
        self.backoff = backoff
        self.environment = dict(os.environ if environment is None else environment)
        #: the running training process's pid (`child`: one this process forked before it became the keeper)
        self.pid: Optional[int] = child
        self.restarts = 0
        #: the exit status of the last training process that ended (passed to the next one)
        self.previous: Optional[int] = None
        self.stopping = False
        self._procs: dict[int, subprocess.Popen] = {}  # the processes it started (kept: no finalizer reaps them)
        #: whether it keeps a warm spare, the spare (a process that imported torch and Lightning and
        #: waits on its standard input) and when the next one starts
        self.keeps_spare = spare and len(self.command) >= 2
        self.spare: Optional[subprocess.Popen] = None
        self.spare_delay = spare_delay
        self._spare_due = time.monotonic() + spare_delay
        #: how many restarts the spare took
        self.spares_taken = 0

    def _forward(self, signum: int, frame: Any) -> None:
        if signum in STOPPING:
            self.stopping = True
        if self.pid is not None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:  # it just ended: the wait below sees it
                pass

    def _start(self) -> int:
        env = child_environment(self.environment, os.getpid(), self.restarts, self.previous)
        spare, self.spare = self.spare, None
        if self.restarts and spare is not None:
            self._spare_due = time.monotonic() + self.spare_delay
            if hand_over(spare, env):
                self.spares_taken += 1
                _say(f"the rank's new process is its warm spare (pid {spare.pid})")
                return spare.pid
        proc = subprocess.Popen(self.command, env=env, preexec_fn=die_with_parent)  # noqa: PLW1509  (no threads here)
        self._procs[proc.pid] = proc
        return proc.pid

    def _keep_spare(self) -> None:
        """Start a warm spare where none stands ready and one is due (`SPARE_DELAY`)."""
        if not self.keeps_spare or self.stopping or time.monotonic() < self._spare_due:
            return
        if self.spare is not None and self.spare.poll() is None:
            return
        if self.restarts >= self.max_restarts:
            return  # no restart left to take it
        self._spare_due = time.monotonic() + self.spare_delay  # one that dies at once is not replaced in a loop
        self.spare = start_spare(self.command, self.environment, preexec_fn=die_with_parent)
        self._procs[self.spare.pid] = self.spare

    def _end_spare(self) -> None:
        """End the spare, which holds nothing (it may still be importing: it is not waited for)."""
        spare, self.spare = self.spare, None
        if spare is None:
            return
        if spare.stdin is not None:
            try:
                spare.stdin.close()
            except OSError:
                pass
        spare.kill()
        spare.wait()

    def _wait(self, pid: int) -> int:
        """`pid`'s exit status, as `os.waitstatus_to_exitcode` gives it (`-N`: killed by signal N); the
        warm spare is kept meanwhile."""
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            self._keep_spare()
            time.sleep(POLL_SECONDS)  # a signal runs its handler and the sleep goes on (PEP 475)
        self._procs.pop(pid, None)
        return os.waitstatus_to_exitcode(status)

    def run(self) -> int:
        """Keep the rank's process running until it succeeds, the launcher stops it, or the restarts
        are used up; the last process's status (`-N`: killed by signal N). The signal handlers it
        forwards with are the previous ones again when it returns."""
        previous = {signum: signal.signal(signum, self._forward) for signum in FORWARDED}
        try:
            return self._keep()
        finally:
            self._end_spare()
            for signum, handler in previous.items():
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _keep(self) -> int:
        if self.pid is None:
            self.pid = self._start()
        while True:
            code = self._wait(self.pid)
            self.pid = None
            if code == 0 or self.stopping or self.restarts >= self.max_restarts:
                if code:
                    _say(
                        f"rank's process exited with status {code} and stays lost ({self.restarts} restarts of "
                        f"{self.max_restarts} used{', the launcher stops the task' if self.stopping else ''})"
                    )
                return code
            self.restarts += 1
            self.previous = code
            wait = self.backoff * 2 ** (self.restarts - 1)
            _say(
                f"rank's process exited with status {code}: starting it again in {wait:.0f}s "
                f"(restart {self.restarts} of {self.max_restarts})"
            )
            deadline = time.monotonic() + wait
            while not self.stopping and time.monotonic() < deadline:
                time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
            if self.stopping:
                return code
            self.pid = self._start()


def exit_as(code: int) -> None:
    """End this process as a process with exit status `code` would (`-N`: killed by signal N)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two have no handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1.0)  # a signal that does not end a process by default (none of ours): report it as a shell does
        os._exit(128 - code)
    os._exit(code)


def keeper_argv(
    command: Sequence[str], max_restarts: int, child: Optional[int], backoff: float = BACKOFF, spare: bool = False
) -> list[str]:
    """The command line a task's process `exec`s to become its rank's keeper (this file, run by path);
    `child`: the training process it forked (`None`: the keeper starts it); `spare`: it keeps a warm spare."""
    argv = [sys.executable, "-P", os.path.abspath(__file__), "--max-restarts", str(max_restarts)]
    argv += ["--backoff", str(backoff), "--command", json.dumps(list(command))] + (["--spare"] if spare else [])
    return argv if child is None else [*argv, "--child", str(child)]


def _say(message: str) -> None:
    print(f"lightning-prague keeper[{os.getpid()}]: {message}", file=sys.stderr, flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--child", type=int, help="the training process this process forked (else: start one)")
    parser.add_argument("--backoff", type=float, default=BACKOFF, help="seconds before the first restart")
    parser.add_argument("--command", required=True, help="the training process's command, a JSON list of strings")
    parser.add_argument("--spare", action="store_true", help="keep a warm spare for the restarts")
    args = parser.parse_args(argv)
    command = json.loads(args.command)
    if not isinstance(command, list) or not command or not all(isinstance(part, str) for part in command):
        parser.error("--command must be a JSON list of strings")
    exit_as(Keeper(command, args.max_restarts, args.child, args.backoff, spare=args.spare).run())


if __name__ == "__main__":
    main()
