"""What SLURM's ``srun`` does on one node, without SLURM: start a job step's tasks of this node, each
a process with the variables ``srun`` gives it.

    # on node I of N (inside the emulated cluster: Cluster.run, or `python -m lightning_prague.tools.cluster run`)
    python -m lightning_prague.tools.cluster.srun --nnodes 2 --node-id {node_rank} --ntasks-per-node 2 \\
        --nodelist 'node[1-2]' --job-id 4242 -m lightning_prague.demo.run -- --devices 2 --num-nodes 2

Each task gets ``SLURM_NTASKS``, ``SLURM_NTASKS_PER_NODE``, ``SLURM_NNODES``, ``SLURM_PROCID``,
``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_JOB_ID``, ``SLURM_JOB_NAME`` and ``SLURM_NODELIST``
(tasks laid out node by node, as ``--distribution=block``), so that Lightning picks its
``SLURMEnvironment``: the global rank is ``node_id * ntasks_per_node + local id``, ``MASTER_ADDR``
the first node of the node list and ``MASTER_PORT`` 15000 plus the job id's last four digits,
unless ``--master-addr`` / ``--master-port`` set them.

Why ``--preload``: on a small machine most of a short job's time is each task's import of torch
and Lightning. With ``--preload`` this launcher imports the module once and forks the tasks from
itself (each then runs the module's ``__main__`` with its own environment and ``sys.argv``), instead
of starting a fresh interpreter per task as ``srun`` does. Several job steps (``--steps FILE``: a
JSON list of ``{"job_id", "argv"}``) can share that one import; they run at the same time.

A task runs a module (``-m MODULE``, as above) or a command (``python train.py ...``; with
``--preload`` a ``python SCRIPT`` command is forked from this launcher, which imported torch,
Lightning and this package once, and runs the script as ``__main__``): see `Program`.
``lightning_prague.tools.cluster.batch`` runs a SLURM batch script whose ``srun`` lines land here.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Program:
    """What every task runs: a module as ``__main__`` (``module``, each step's ``argv`` its arguments),
    or a command (``command``, e.g. ``python train.py --epochs 2``, each step's ``argv`` appended)."""

    module: str | None = None
    command: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.module is None) == (not self.command):
            raise ValueError("a task runs a module or a command, exactly one of them")

    @property
    def script(self) -> str | None:
        """The script a ``python SCRIPT ...`` command runs (what ``--preload`` can fork), else ``None``."""
        python = len(self.command) >= 2 and Path(self.command[0]).name.startswith("python")
        return self.command[1] if python and self.command[1].endswith(".py") else None

    def fresh_argv(self, argv: Sequence[str]) -> list[str]:
        """The command line of a task in a fresh interpreter."""
        if self.module is not None:
            return [sys.executable, "-m", self.module, *argv]
        return [*self.command, *argv]

    def preload(self) -> None:
        """Import what the forked tasks will need: the module, or torch, Lightning and this package."""
        importlib.import_module(self.module if self.module is not None else "lightning_prague")

    def run_forked(self, argv: Sequence[str]) -> None:
        """Run the module or the script as ``__main__`` in this (forked) process, as Python would."""
        if self.module is not None:
            sys.argv = [self.module, *argv]
            sys.modules.pop(self.module, None)  # its dependencies stay imported; runpy warns of a module run twice
            runpy.run_module(self.module, run_name="__main__", alter_sys=True)
            return
        script = str(self.script)
        sys.argv = [script, *self.command[2:], *argv]
        # `python SCRIPT` starts with the script's folder as sys.path[0], where `python -m` has the
        # working directory: the forked task gets the interpreter's own first entry, not an extra one
        sys.path[0] = str(Path(script).resolve().parent)
        runpy.run_path(script, run_name="__main__")


@dataclass(frozen=True)
class Step:
    """One job step: its job id (a distinct id gives a distinct default ``MASTER_PORT``), the
    program's arguments, and a file whose appearance starts its tasks (``gate``; ``None``: at once),
    so that a test can start one step of a shared launcher when something else has happened."""

    job_id: str
    argv: list[str]
    gate: str | None = None


@dataclass(frozen=True)
class Layout:
    """Where this node's tasks sit in the job."""

    nnodes: int
    node_id: int
    ntasks_per_node: int
    nodelist: str
    job_name: str = "lpcluster"

    def rank(self, local_id: int) -> int:
        return self.node_id * self.ntasks_per_node + local_id


def slurm_variables(layout: Layout, job_id: str, local_id: int) -> dict[str, str]:
    """The variables ``srun`` sets for task ``local_id`` of this node."""
    return {
        "SLURM_NTASKS": str(layout.nnodes * layout.ntasks_per_node),
        "SLURM_NTASKS_PER_NODE": str(layout.ntasks_per_node),
        "SLURM_NNODES": str(layout.nnodes),
        "SLURM_PROCID": str(layout.rank(local_id)),
        "SLURM_LOCALID": str(local_id),
        "SLURM_NODEID": str(layout.node_id),
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": layout.job_name,
        "SLURM_NODELIST": layout.nodelist,
    }


def task_environment(base: Mapping[str, str], layout: Layout, job_id: str, local_id: int) -> dict[str, str]:
    """``base`` without any rank variables it carried, plus the task's SLURM variables."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_") and k not in ("RANK", "LOCAL_RANK")}
    env.update(slurm_variables(layout, job_id, local_id))
    return env


def _run_forked(program: Program, argv: Sequence[str], env: Mapping[str, str], log: Path | None) -> None:
    """Body of a forked task: the program as ``__main__`` with its own environment, argv and log
    (``None``: this launcher's output, as ``srun`` relays its tasks' output)."""
    code = 1
    try:
        if log is not None:
            with open(log, "w") as out:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
        os.environ.clear()
        os.environ.update(env)
        program.run_forked(argv)
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never the launcher's exit handlers in a task


#: the fresh interpreters started, kept so that no Popen's finalizer reaps a pid `wait_all` waits for
_children: list[subprocess.Popen] = []


def start_task(program: Program, argv: Sequence[str], env: Mapping[str, str], log: Path | None, preload: bool) -> int:
    """Start one task; its pid. Forked from this process with ``preload`` (where the program can be:
    a module or a ``python SCRIPT`` command), else a fresh interpreter."""
    if not (preload and (program.module is not None or program.script is not None)):
        command = program.fresh_argv(argv)
        if log is None:
            proc = subprocess.Popen(command, env=dict(env))
        else:
            with open(log, "w") as out:
                proc = subprocess.Popen(command, env=dict(env), stdout=out, stderr=out)
        _children.append(proc)
        return proc.pid
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _run_forked(program, argv, env, log)
    return pid


def wait_all(pids: Sequence[int], timeout: float | None, kill_on_bad_exit: bool = False) -> dict[int, int]:
    """Exit status of each pid (negative: killed by that signal; 124: killed at the timeout). With
    ``kill_on_bad_exit`` (``srun --kill-on-bad-exit=1``) the first task that fails ends the others
    with SIGKILL, as SLURM ends the step (here: this node's tasks), and theirs count as 0: the step's
    status is the failed task's."""
    deadline = None if timeout is None else time.monotonic() + timeout
    codes: dict[int, int] = {}
    ended: set[int] = set()  # the tasks ended for another's failure: their status is not the step's
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                if pid in ended:
                    codes[pid] = 0
        if kill_on_bad_exit and any(codes.values()):
            for pid in set(pids) - set(codes) - ended:
                os.kill(pid, 9)
                ended.add(pid)
        if deadline is not None and time.monotonic() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                codes[pid] = 124
        time.sleep(0.05)
    return codes


def srun_node(
    layout: Layout,
    program: Program | str,
    steps: Sequence[Step],
    log_dir: Path | None = None,
    *,
    preload: bool = False,
    extra_env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    kill_on_bad_exit: bool = False,
) -> int:
    """Run this node's tasks of every step at once; the worst exit status (0 when all succeed).

    ``program``: a `Program`, or a module's name. Task ``local_id`` of step ``job_id`` logs to
    ``log_dir/job<job_id>.rank<global rank>.log``, or to this process's output without ``log_dir``.
    """
    program = Program(module=program) if isinstance(program, str) else program
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    if preload:
        program.preload()
    base = {**os.environ, **(extra_env or {})}
    deadline = None if timeout is None else time.monotonic() + timeout
    pids = []
    tasks: dict[int, str] = {}
    waiting = list(steps)
    while waiting:
        for step in [s for s in waiting if s.gate is None or Path(s.gate).exists()]:
            waiting.remove(step)
            for local_id in range(layout.ntasks_per_node):
                env = task_environment(base, layout, step.job_id, local_id)
                log = None if log_dir is None else log_dir / f"job{step.job_id}.rank{layout.rank(local_id)}.log"
                pids.append(start_task(program, step.argv, env, log, preload))
                tasks[pids[-1]] = f"job {step.job_id} rank {layout.rank(local_id)}"
        if waiting and deadline is not None and time.monotonic() > deadline:
            for step in waiting:
                print(f"srun: job {step.job_id} never started: no {step.gate}", file=sys.stderr, flush=True)
            return 124
        if waiting:
            time.sleep(0.1)
    remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
    codes = wait_all(pids, remaining, kill_on_bad_exit)
    worst = max(codes.values(), key=abs)
    for pid, code in codes.items():
        if code:
            print(f"srun: task pid {pid} ({tasks[pid]}) exited with {code}", file=sys.stderr, flush=True)
    return worst


def shell_status(code: int) -> int:
    """An exit status as a shell (and ``srun``) reports it: a task killed by signal N is 128 + N."""
    return code if code >= 0 else 128 - code


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that place this node in the job (`layout_from_arguments`), and the job's id."""
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-id", type=int, required=True, help="this node's index, 0-based")
    parser.add_argument("--ntasks-per-node", type=int, required=True)
    parser.add_argument("--nodelist", required=True, help="SLURM_NODELIST, e.g. 'node[1-2]'")
    parser.add_argument("--job-id", default="4242", help="SLURM_JOB_ID")
    parser.add_argument("--job-name", default="lpcluster", help="SLURM_JOB_NAME (not bash or interactive)")


def layout_from_arguments(args: argparse.Namespace) -> Layout:
    return Layout(args.nnodes, args.node_id, args.ntasks_per_node, args.nodelist, args.job_name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_prague.tools.cluster.srun", description=__doc__.splitlines()[0]
    )
    add_layout_arguments(parser)
    parser.add_argument("--master-addr", help="MASTER_ADDR (default: Lightning's, the node list's first)")
    parser.add_argument("--master-port", help="MASTER_PORT (default: Lightning's, from the job id)")
    parser.add_argument("--preload", action="store_true", help="import the module once, fork the tasks")
    parser.add_argument(
        "--steps", type=Path, help='JSON list of {"job_id": ..., "argv": [...], "gate": FILE or absent}, run at once'
    )
    parser.add_argument("--log-dir", type=Path, help="a log file per task here (default: this output)")
    parser.add_argument("--timeout", type=float, help="kill the tasks after this many seconds")
    parser.add_argument("-m", dest="module", help="the module each task runs as __main__ (else: a command)")
    parser.add_argument(
        "args", nargs=argparse.REMAINDER, help="-- then the module's arguments (a single step), or the command"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layout = layout_from_arguments(args)
    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    if args.module is None and (args.steps or not rest):
        raise SystemExit("srun: give -m MODULE (with --steps or its arguments), or a command to run")
    program = Program(module=args.module) if args.module is not None else Program(command=tuple(rest))
    if args.steps:
        steps = [
            Step(str(s["job_id"]), [str(a) for a in s["argv"]], s.get("gate"))
            for s in json.loads(args.steps.read_text())
        ]
    else:
        steps = [Step(args.job_id, rest if args.module is not None else [])]
    extra = {"MASTER_ADDR": args.master_addr} if args.master_addr else {}
    if args.master_port:
        extra["MASTER_PORT"] = args.master_port
    worst = srun_node(layout, program, steps, args.log_dir, preload=args.preload, extra_env=extra, timeout=args.timeout)
    return shell_status(worst)


if __name__ == "__main__":
    sys.exit(main())
