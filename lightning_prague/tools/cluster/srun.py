"""What SLURM's ``srun`` does on one node, without SLURM: start a job step's tasks of this node, each
a process with the variables ``srun`` gives it.

    # on node I of N (inside the emulated cluster: Cluster.run, or `python -m lightning_prague.tools.cluster run`)
    python -m lightning_prague.tools.cluster.srun --nnodes 2 --node-id {node_rank} --ntasks-per-node 2 \\
        --nodelist 'node[1-2]' --job-id 4242 -m lightning_prague.demo.run -- --devices 2 --num-nodes 2

Each task gets the variables ``srun`` sets for a task of a job step (`slurm_variables`): the job's
(``SLURM_JOB_ID``/``SLURM_JOBID``, ``SLURM_JOB_NAME``, ``SLURM_JOB_NODELIST``/``SLURM_NODELIST``,
``SLURM_JOB_NUM_NODES``/``SLURM_NNODES``, ``SLURM_NTASKS``/``SLURM_NPROCS``,
``SLURM_NTASKS_PER_NODE``, ``SLURM_TASKS_PER_NODE``, and ``SLURM_RESTART_COUNT`` once the job was
requeued: ``--restart-count``), the step's (``SLURM_STEP_ID``/``SLURM_STEPID``: ``--step-id``,
``SLURM_STEP_NODELIST``, ``SLURM_STEP_NUM_NODES``, ``SLURM_STEP_NUM_TASKS``,
``SLURM_STEP_TASKS_PER_NODE``) and the task's (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_NODEID``, ``SLURMD_NODENAME``, ``SLURM_TASK_PID``), tasks laid out node by node, as
``--distribution=block``, so that Lightning picks its ``SLURMEnvironment``: the global rank is
``node_id * ntasks_per_node + local id``, ``MASTER_ADDR`` the first node of the node list and
``MASTER_PORT`` 15000 plus the job id's last four digits, unless ``--master-addr`` /
``--master-port`` set them.

A lost task started again as a new step of the same job: ``--step-id 1 --tasks 0`` starts only
local task 0 of this node, with the variables of its place in the job (its ``SLURM_PROCID``, the
job's ``SLURM_NTASKS``) and the new step's id. (A real one-task ``srun`` gives its step a layout of
its own, ``SLURM_PROCID=0`` and ``SLURM_NTASKS=1``: see docs/multi_node.md for the recipe that
gives the task its place in the job.)

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
    so that a test can start one step of a shared launcher when something else has happened;
    ``step_id`` (``SLURM_STEP_ID``), the job's requeue count (``restart_count``, 0: never requeued)
    and the local tasks of this node it starts (``tasks``; ``None``: every one); ``export``: variables
    its tasks get on top of the launcher's environment (``srun --export=ALL,NAME=VALUE``)."""

    job_id: str
    argv: list[str]
    gate: str | None = None
    step_id: int = 0
    restart_count: int = 0
    tasks: tuple[int, ...] | None = None
    export: tuple[tuple[str, str], ...] = ()


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


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM node list: ``node[1-3,5]`` is node1, node2, node3 and node5, with
    zero padding kept (``n[01-02]``); lists separated by commas at the top level are joined."""
    names: list[str] = []
    part, depth = "", 0
    for char in nodelist + ",":
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            names += _expand_one(part) if part else []
            part = ""
        else:
            part += char
    return names


def _expand_one(pattern: str) -> list[str]:
    prefix, bracket, rest = pattern.partition("[")
    if not bracket:
        return [pattern]
    ranges, _, suffix = rest.partition("]")
    names = []
    for item in ranges.split(","):
        low, _, high = item.partition("-")
        for number in range(int(low), int(high or low) + 1):
            names += [f"{prefix}{number:0{len(low)}d}{name}" for name in _expand_one(suffix) or [""]]
    return names


def slurm_variables(
    layout: Layout, job_id: str, local_id: int, step_id: int = 0, restart_count: int = 0
) -> dict[str, str]:
    """The variables ``srun`` sets for task ``local_id`` of this node in step ``step_id`` of job
    ``job_id`` (requeued ``restart_count`` times), whose tasks are the job's (see the module docstring)."""
    ntasks = str(layout.nnodes * layout.ntasks_per_node)
    nodes = expand_nodelist(layout.nodelist)
    per_node = f"{layout.ntasks_per_node}(x{layout.nnodes})" if layout.nnodes > 1 else str(layout.ntasks_per_node)
    variables = {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOBID": job_id,
        "SLURM_JOB_NAME": layout.job_name,
        "SLURM_JOB_NODELIST": layout.nodelist,
        "SLURM_NODELIST": layout.nodelist,
        "SLURM_JOB_NUM_NODES": str(layout.nnodes),
        "SLURM_NNODES": str(layout.nnodes),
        "SLURM_NTASKS": ntasks,
        "SLURM_NPROCS": ntasks,
        "SLURM_NTASKS_PER_NODE": str(layout.ntasks_per_node),
        "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_STEP_ID": str(step_id),
        "SLURM_STEPID": str(step_id),
        "SLURM_STEP_NODELIST": layout.nodelist,
        "SLURM_STEP_NUM_NODES": str(layout.nnodes),
        "SLURM_STEP_NUM_TASKS": ntasks,
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURM_PROCID": str(layout.rank(local_id)),
        "SLURM_LOCALID": str(local_id),
        "SLURM_NODEID": str(layout.node_id),
        "SLURMD_NODENAME": nodes[layout.node_id] if layout.node_id < len(nodes) else nodes[-1],
    }
    if restart_count > 0:  # SLURM sets it once the job was requeued
        variables["SLURM_RESTART_COUNT"] = str(restart_count)
    return variables


def task_environment(
    base: Mapping[str, str], layout: Layout, job_id: str, local_id: int, step_id: int = 0, restart_count: int = 0
) -> dict[str, str]:
    """``base`` without any rank variables it carried, plus the task's SLURM variables."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_") and k not in ("RANK", "LOCAL_RANK")}
    env.update(slurm_variables(layout, job_id, local_id, step_id, restart_count))
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
        os.environ["SLURM_TASK_PID"] = str(os.getpid())
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
        # a task's own pid: the interpreter is started through `exec`, so the shell's pid is the task's
        command = ["/bin/sh", "-c", 'SLURM_TASK_PID=$$ exec "$@"', "srun-task", *command]
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
            for local_id in range(layout.ntasks_per_node) if step.tasks is None else step.tasks:
                exported = {**base, **dict(step.export)}
                env = task_environment(exported, layout, step.job_id, local_id, step.step_id, step.restart_count)
                name = f"job{step.job_id}.rank{layout.rank(local_id)}"
                log = (
                    None
                    if log_dir is None
                    else log_dir / (f"{name}.step{step.step_id}.log" if step.step_id else f"{name}.log")
                )
                pids.append(start_task(program, step.argv, env, log, preload))
                tasks[pids[-1]] = (
                    f"job {step.job_id}"
                    + (f".{step.step_id}" if step.step_id else "")
                    + (f" rank {layout.rank(local_id)}")
                )
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
    parser.add_argument("--step-id", type=int, default=0, help="SLURM_STEP_ID: this step's number in the job")
    parser.add_argument(
        "--restart-count", type=int, default=0, help="SLURM_RESTART_COUNT: how often the job was requeued (0: never)"
    )


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
        "--steps",
        type=Path,
        help='JSON list of {"job_id": ..., "argv": [...], and optionally "gate": FILE, "step_id", "restart_count", '
        '"tasks": [local ids], "export": {NAME: VALUE}}, run at once',
    )
    parser.add_argument("--log-dir", type=Path, help="a log file per task here (default: this output)")
    parser.add_argument("--timeout", type=float, help="kill the tasks after this many seconds")
    parser.add_argument(
        "--tasks", help="start only these local tasks of this node, e.g. '0' or '0,1' (a lost task started again)"
    )
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
    tasks = None if args.tasks is None else tuple(int(t) for t in args.tasks.split(","))
    if tasks is not None and not all(0 <= t < layout.ntasks_per_node for t in tasks):
        raise SystemExit(f"srun: --tasks {args.tasks}: local tasks of this node are 0..{layout.ntasks_per_node - 1}")
    if args.steps:
        steps = [
            Step(
                str(s["job_id"]),
                [str(a) for a in s["argv"]],
                s.get("gate"),
                int(s.get("step_id", args.step_id)),
                int(s.get("restart_count", args.restart_count)),
                tuple(s["tasks"]) if "tasks" in s else tasks,
                tuple((str(k), str(v)) for k, v in s.get("export", {}).items()),
            )  # fmt: skip
            for s in json.loads(args.steps.read_text())
        ]
    else:
        argv = rest if args.module is not None else []
        steps = [Step(args.job_id, argv, step_id=args.step_id, restart_count=args.restart_count, tasks=tasks)]
    extra = {"MASTER_ADDR": args.master_addr} if args.master_addr else {}
    if args.master_port:
        extra["MASTER_PORT"] = args.master_port
    worst = srun_node(layout, program, steps, args.log_dir, preload=args.preload, extra_env=extra, timeout=args.timeout)
    return shell_status(worst)


if __name__ == "__main__":
    sys.exit(main())
