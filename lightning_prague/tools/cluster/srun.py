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
class Step:
    """One job step: its job id (a distinct id gives a distinct default ``MASTER_PORT``) and the
    module's arguments."""

    job_id: str
    argv: list[str]


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


def _run_forked(module: str, argv: Sequence[str], env: Mapping[str, str], log: Path | None) -> None:
    """Body of a forked task: the module's ``__main__`` with its own environment, argv and log
    (``None``: this launcher's output, as ``srun`` relays its tasks' output)."""
    code = 1
    try:
        if log is not None:
            with open(log, "w") as out:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = [module, *argv]
        sys.modules.pop(module, None)  # its dependencies stay imported; runpy warns of a module run twice
        runpy.run_module(module, run_name="__main__", alter_sys=True)
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


def start_task(module: str, argv: Sequence[str], env: Mapping[str, str], log: Path | None, preload: bool) -> int:
    """Start one task; its pid. Forked from this process with ``preload``, else a fresh interpreter."""
    if not preload:
        command = [sys.executable, "-m", module, *argv]
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
        _run_forked(module, argv, env, log)
    return pid


def wait_all(pids: Sequence[int], timeout: float | None) -> dict[int, int]:
    """Exit status of each pid (negative: killed by that signal; 124: killed at the timeout)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    codes: dict[int, int] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() > deadline:
            for pid in set(pids) - set(codes):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                codes[pid] = 124
        time.sleep(0.05)
    return codes


def srun_node(
    layout: Layout,
    module: str,
    steps: Sequence[Step],
    log_dir: Path | None = None,
    *,
    preload: bool = False,
    extra_env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> int:
    """Run this node's tasks of every step at once; the worst exit status (0 when all succeed).

    Task ``local_id`` of step ``job_id`` logs to ``log_dir/job<job_id>.rank<global rank>.log``, or
    to this process's output without ``log_dir``.
    """
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    if preload:
        importlib.import_module(module)
    base = {**os.environ, **(extra_env or {})}
    pids = []
    tasks: dict[int, str] = {}
    for step in steps:
        for local_id in range(layout.ntasks_per_node):
            env = task_environment(base, layout, step.job_id, local_id)
            log = None if log_dir is None else log_dir / f"job{step.job_id}.rank{layout.rank(local_id)}.log"
            pids.append(start_task(module, step.argv, env, log, preload))
            tasks[pids[-1]] = f"job {step.job_id} rank {layout.rank(local_id)}"
    codes = wait_all(pids, timeout)
    worst = max(codes.values(), key=abs)
    for pid, code in codes.items():
        if code:
            print(f"srun: task pid {pid} ({tasks[pid]}) exited with {code}", file=sys.stderr, flush=True)
    return worst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_prague.tools.cluster.srun", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--node-id", type=int, required=True, help="this node's index, 0-based")
    parser.add_argument("--ntasks-per-node", type=int, required=True)
    parser.add_argument("--nodelist", required=True, help="SLURM_NODELIST, e.g. 'node[1-2]'")
    parser.add_argument("--job-id", default="4242", help="SLURM_JOB_ID of a single step")
    parser.add_argument("--job-name", default="lpcluster", help="SLURM_JOB_NAME (not bash or interactive)")
    parser.add_argument("--master-addr", help="MASTER_ADDR (default: Lightning's, the node list's first)")
    parser.add_argument("--master-port", help="MASTER_PORT (default: Lightning's, from the job id)")
    parser.add_argument("--preload", action="store_true", help="import the module once, fork the tasks")
    parser.add_argument("--steps", type=Path, help='JSON list of {"job_id": ..., "argv": [...]}, run at once')
    parser.add_argument("--log-dir", type=Path, help="a log file per task here (default: this output)")
    parser.add_argument("--timeout", type=float, help="kill the tasks after this many seconds")
    parser.add_argument("-m", dest="module", required=True, help="the module each task runs as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the module's arguments (a single step)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layout = Layout(args.nnodes, args.node_id, args.ntasks_per_node, args.nodelist, args.job_name)
    if args.steps:
        steps = [Step(str(s["job_id"]), [str(a) for a in s["argv"]]) for s in json.loads(args.steps.read_text())]
    else:
        steps = [Step(args.job_id, args.args[1:] if args.args[:1] == ["--"] else args.args)]
    extra = {"MASTER_ADDR": args.master_addr} if args.master_addr else {}
    if args.master_port:
        extra["MASTER_PORT"] = args.master_port
    return srun_node(
        layout, args.module, steps, args.log_dir, preload=args.preload, extra_env=extra, timeout=args.timeout
    )


if __name__ == "__main__":
    sys.exit(main())
