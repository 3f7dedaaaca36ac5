"""What ``sbatch`` does, on the emulated cluster: a SLURM batch script runs with the variables SLURM
gives a batch job, and the ``srun`` on its ``PATH`` starts the job step's tasks.

    # on every node (inside the emulated cluster: `python -m lightning_prague.tools.cluster run`)
    python -m lightning_prague.tools.cluster.batch --nnodes 2 --node-id {node_rank} --ntasks-per-node 2 \\
        --nodelist 'node[1-2]' --job-id 4242 --preload examples/cluster/slurm.sbatch -- --max-epochs 1

A real batch script runs once, on the job's first node, and each ``srun`` in it starts the step's
tasks on every node with the script's environment (``--export=ALL``, srun's default). Here the
script runs on every node and its ``srun`` (`write_srun`: a shim that calls `srun_main`) starts
that node's tasks: each task sees what it would under SLURM, its ``SLURM_*`` variables and the
script's exports. The job's status is the worst node's, as ``srun``'s is its worst task's.

The shim takes ``--kill-on-bad-exit[=0|1]`` (``-K``): with 1 the first task that fails ends the
others of its node (SLURM ends the whole step). Options it does not know are refused with their
name, so that a script never silently runs differently here than under SLURM.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .srun import Layout, Program, Step, add_layout_arguments, layout_from_arguments, shell_status, srun_node


def batch_environment(
    base: Mapping[str, str], layout: Layout, job_id: str, submit_dir: Path, srun_dir: Path
) -> dict[str, str]:
    """``base`` plus what SLURM sets for a batch script on this node, with ``srun_dir`` (where
    `write_srun` put the shim) first on ``PATH``."""
    env = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
    env.update(
        SLURM_JOB_ID=job_id,
        SLURM_JOB_NAME=layout.job_name,
        SLURM_JOB_NUM_NODES=str(layout.nnodes),
        SLURM_NNODES=str(layout.nnodes),
        SLURM_NTASKS=str(layout.nnodes * layout.ntasks_per_node),
        SLURM_NTASKS_PER_NODE=str(layout.ntasks_per_node),
        SLURM_JOB_NODELIST=layout.nodelist,
        SLURM_NODELIST=layout.nodelist,
        SLURM_NODEID=str(layout.node_id),
        SLURM_SUBMIT_DIR=str(submit_dir),
        PATH=f"{srun_dir}{os.pathsep}{base.get('PATH', os.defpath)}",
    )
    return env


def write_srun(
    directory: Path, *, preload: bool = False, log_dir: Path | None = None, timeout: float | None = None
) -> Path:
    """An executable ``srun`` in ``directory`` that runs `srun_main` with this interpreter; its
    options: fork the tasks from one import (``preload``), a log file per task (``log_dir``), kill
    them after ``timeout`` seconds."""
    directory.mkdir(parents=True, exist_ok=True)
    options = ["--preload"] if preload else []
    if log_dir is not None:
        options += ["--log-dir", str(log_dir)]
    if timeout is not None:
        options += ["--timeout", str(timeout)]
    command = shlex.join([sys.executable, "-m", "lightning_prague.tools.cluster.batch", "srun", *options, "--"])
    path = directory / "srun"
    header = "#!/bin/sh\n# srun on the emulated cluster (lightning_prague.tools.cluster.batch)\n"
    path.write_text(f'{header}exec {command} "$@"\n')
    path.chmod(0o755)
    return path


def parse_srun_options(argv: Sequence[str]) -> tuple[bool, list[str]]:
    """``srun``'s options this shim takes, and the command after them: (kill on bad exit, command)."""
    kill = False
    args = list(argv)
    while args and args[0].startswith("-"):
        option = args.pop(0)
        name, has_value, value = option.partition("=")
        if name.startswith("-K") and not name.startswith("--") and len(name) > 2:  # -K0, -K1
            name, has_value, value = "-K", True, option[2:]
        if name in ("--kill-on-bad-exit", "-K"):
            if has_value and value not in ("0", "1"):
                raise SystemExit(f"srun (emulated): --kill-on-bad-exit takes 0 or 1, not {value!r}")
            kill = not has_value or value == "1"
        elif option == "--":
            break
        else:
            raise SystemExit(f"srun (emulated): option {option!r} is not emulated (only --kill-on-bad-exit, -K)")
    if not args:
        raise SystemExit("srun (emulated): no command to run")
    return kill, args


def layout_from_environment(env: Mapping[str, str]) -> Layout:
    """This node's place in the batch job, from the variables `batch_environment` set."""
    try:
        return Layout(
            int(env["SLURM_JOB_NUM_NODES"]),
            int(env["SLURM_NODEID"]),
            int(env["SLURM_NTASKS_PER_NODE"]),
            env["SLURM_JOB_NODELIST"],
            env.get("SLURM_JOB_NAME", "lpcluster"),
        )
    except (KeyError, ValueError) as why:
        raise SystemExit(f"srun (emulated): not inside an emulated batch job ({why!r} missing or invalid)") from None


def srun_main(argv: Sequence[str], env: Mapping[str, str] | None = None) -> int:
    """The shim's body: ``[--preload] [--log-dir D] [--timeout S] -- SRUN_OPTIONS... COMMAND...``;
    this node's tasks of the step; the worst exit status."""
    parser = argparse.ArgumentParser(prog="srun (emulated)")
    parser.add_argument("--preload", action="store_true")
    parser.add_argument("--log-dir", type=Path)
    parser.add_argument("--timeout", type=float)
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    kill, command = parse_srun_options(rest)
    environment = dict(os.environ if env is None else env)
    layout = layout_from_environment(environment)
    worst = srun_node(
        layout,
        Program(command=tuple(command)),
        [Step(environment["SLURM_JOB_ID"], [])],
        args.log_dir,
        preload=args.preload,
        timeout=args.timeout,
        kill_on_bad_exit=kill,
    )
    return shell_status(worst)


def run_batch(
    script: Path,
    args: Sequence[str],
    layout: Layout,
    job_id: str,
    *,
    preload: bool = False,
    log_dir: Path | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run a batch script on this node with its ``srun``; its exit status."""
    srun_dir = Path(tempfile.mkdtemp(prefix=f"lpc-srun-{job_id}-{layout.node_id}-"))
    write_srun(srun_dir, preload=preload, log_dir=log_dir, timeout=timeout)
    environment = batch_environment(os.environ if env is None else env, layout, job_id, Path.cwd(), srun_dir)
    return subprocess.call(["bash", str(script), *args], env=environment)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["srun"]:
        return srun_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m lightning_prague.tools.cluster.batch", description=__doc__.splitlines()[0]
    )
    add_layout_arguments(parser)
    parser.add_argument("--preload", action="store_true", help="srun forks python SCRIPT tasks from one import")
    parser.add_argument("--log-dir", type=Path, help="srun writes a log file per task here")
    parser.add_argument("--timeout", type=float, help="srun kills its tasks after this many seconds")
    parser.add_argument("script", type=Path, help="the batch script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the script's arguments")
    args = parser.parse_args(argv)
    layout = layout_from_arguments(args)
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    return run_batch(
        args.script, script_args, layout, args.job_id, preload=args.preload, log_dir=args.log_dir, timeout=args.timeout
    )


if __name__ == "__main__":
    sys.exit(main())
