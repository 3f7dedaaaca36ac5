"""Launching multi-process runs from tests: free ports, timeouts, JSON results."""

from __future__ import annotations

import faulthandler
import gc
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_prague.core.auth import Credentials
from lightning_prague.core.protocol import BadMessage

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


#: the credentials of the control planes that tests serve from a thread of their own
CREDENTIALS = Credentials.generate()


#: what `launch` needs besides the job's layout, for a supervisor that a test starts itself
LAUNCH = {"secret": Credentials.generate().key.hex().encode(), "launch_id": "tests", "publish_secret": True}


def loose_decode(line: bytes) -> dict:
    """A decoder for tests of the transport alone: any JSON object with an `op` (no record checked)."""
    try:
        message = json.loads(line)
    except ValueError as err:
        raise BadMessage(str(err)) from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise BadMessage(f"not a message: {line[:80]!r}")
    return message


def plane_credentials(store, key: str):
    """`(host, port, pid, credentials)` of the control plane a supervisor published in `store` under `key`."""
    record = json.loads(store.get(key))
    credentials = Credentials.derive(record["secret"].encode(), record["launch"])
    return record["host"], record["port"], record["pid"], credentials


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"})
    out.pop("LOCAL_RANK", None)
    out.update(extra)
    return out


def _write_to_the_log() -> None:
    """In a forked child whose fds 1 and 2 are its log: Python's streams (pytest may have replaced them
    with its capture) and the logging handlers that wrote to them write there too."""
    import io
    import logging

    old = {id(sys.stdout), id(sys.stderr), id(sys.__stdout__), id(sys.__stderr__)}
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    root = logging.getLogger()
    for handler in list(root.handlers):  # pytest's capture handlers: the log file shows warnings instead
        root.removeHandler(handler)
    warnings_to_log = logging.StreamHandler(sys.stderr)
    warnings_to_log.setLevel(logging.WARNING)
    root.addHandler(warnings_to_log)
    for logger in logging.Logger.manager.loggerDict.values():
        for handler in getattr(logger, "handlers", []):
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in old:
                handler.setStream(sys.stderr)


def _warnings_to_stderr() -> None:
    """Print warnings, as a process of its own would: the forked child inherits pytest's recording of them."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    warnings.showwarning = show


def _run_script_in_child(script: Path, argv: list[str], environ: dict[str, str], log: Path) -> None:
    """Body of a forked rank: the script's ``__main__`` with its own argv, environment and log file."""
    import runpy
    import traceback

    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    _write_to_the_log()
    _warnings_to_stderr()
    faulthandler.enable()  # a crash of a forked rank leaves its stacks in its log
    if "torch" in sys.modules:  # the parent's OpenMP threads do not exist here: one compute thread
        sys.modules["torch"].set_num_threads(1)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = [str(script), *argv]
    code = 0
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never run the test process's exit handlers in a child


def _start_forked(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Fork `procs` with every object of the test process frozen: a child's garbage collector never
    finalises what earlier tests left behind (a finaliser of a process group or thread that only the
    parent has crashed a forked rank with SIGSEGV in the full suite)."""
    gc.collect()
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()


def run_core_ranks(
    tmp: Path,
    world: int,
    *args: str,
    timeout: float = 90,
    script: str = "core_worker.py",
    fork: bool = True,
    may_die: tuple[int, ...] = (),
    **extra_env: str,
) -> list[dict]:
    """Run ``scripts/<script>`` (default ``core_worker.py``) on ``world`` ranks; return their JSON results
    (``{}`` for the ranks in ``may_die``, which must end by SIGKILL).

    The ranks are forked from the test process, which has imported everything already: a core
    run costs no interpreter start-up (most of its time on two cores otherwise). ``fork=False``
    starts fresh interpreters instead (CUDA cannot be used in a forked child).
    """
    if not fork:
        return _run_core_ranks_in_new_processes(tmp, world, *args, timeout=timeout, script=script, **extra_env)
    ctx = multiprocessing.get_context("fork")
    port = free_port()
    environ = env(**extra_env)
    logs = [tmp / f"r{r}.log" for r in range(world)]
    procs = [
        ctx.Process(
            target=_run_script_in_child,
            args=(SCRIPTS / script, [str(r), str(world), str(port), str(tmp / f"r{r}.json"), *args], environ, logs[r]),
        )
        for r in range(world)
    ]
    _start_forked(procs)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for r, p in enumerate(procs):
        expected = -9 if r in may_die else 0
        assert p.exitcode == expected, f"rank {r} failed (exit code {p.exitcode}):\n{logs[r].read_text()[-3000:]}"
    return [{} if r in may_die else json.loads((tmp / f"r{r}.json").read_text()) for r in range(world)]


def _run_core_ranks_in_new_processes(
    tmp: Path, world: int, *args: str, timeout: float, script: str, **extra_env: str
) -> list[dict]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(SCRIPTS / script), str(r), str(world), str(port), str(tmp / f"r{r}.json"), *args],
            env=env(**extra_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r][-3000:]}"
    return [json.loads((tmp / f"r{r}.json").read_text()) for r in range(world)]


#: options of scripts/train.py that need every rank to be a process of its own (run after fit, signals)
NEEDS_POPEN = (
    "--sigterm-rank",
    "--raise-at-batch",
    "--raise-in-validation-rank",
    "--refit-epochs",
    "--test",
    "--num-nodes",
    "--fault",
    "--start-method",
)


def run_training(tmp: Path, *args: str, timeout: float = 240, script: str = "train.py", **extra_env: str):
    """Run a Lightning training script (which launches its own ranks); return (completed process, rank-0 JSON).

    The demo's ranks are forked from the script's process (one import of Lightning instead of one
    per rank: most of a run's time on two cores) unless an option needs separate processes.
    """
    out_json = tmp / "result.json"
    fork = script == "train.py" and not any(a in NEEDS_POPEN for a in args)
    cmd = [sys.executable, str(SCRIPTS / script), "--json", str(out_json), *args]
    if fork:
        cmd += ["--start-method", "fork"]
    proc = subprocess.run(cmd, env=env(**extra_env), cwd=tmp, capture_output=True, text=True, timeout=timeout)
    result = json.loads(out_json.read_text()) if out_json.exists() else None
    return proc, result


def rank_results(tmp: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp.glob("result.rank*.json"))]


@dataclass
class TrainingRun:
    """One run of :func:`run_many`: its directory, exit status, rank-0 result (``result.json``) and output."""

    dir: Path
    status: int
    result: dict | None
    log: str


def run_many(root: Path, runs: dict[str, tuple[str, list[str]]], timeout: float = 600) -> dict[str, TrainingRun]:
    """Run ``name -> (script, args)`` one after the other in one process (``scripts/run_many.py``), each
    in ``root / name``; a script that launches ranks should fork them (one import of Lightning in all)."""
    specs = []
    for name, (script, args) in runs.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        specs.append({"script": str(SCRIPTS / script), "dir": str(root / name), "args": args})
    (root / "runs.json").write_text(json.dumps(specs))
    cmd = [sys.executable, str(SCRIPTS / "run_many.py"), str(root / "runs.json")]
    proc = subprocess.run(cmd, env=env(), cwd=root, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = {}
    for name in runs:
        directory = root / name
        result = directory / "result.json"
        exit_file = directory / "exit"
        out[name] = TrainingRun(
            directory,
            int(exit_file.read_text()) if exit_file.exists() else -1,
            json.loads(result.read_text()) if result.exists() else None,
            (directory / "log.txt").read_text() if (directory / "log.txt").exists() else "",
        )
    return out


def run_external_ranks(
    tmp: Path, world: int, *args: str, timeout: float = 120, slurm: bool = False
) -> tuple[list[int | None], list[str]]:
    """Run ``scripts/train.py`` as ``world`` processes started from outside Lightning, one per rank, with
    the variables a cluster launcher sets (as torchrun or SLURM would; no launcher kills the others
    when one dies). They are forked from the test process. Returns each rank's exit code (``None``:
    still running at the timeout, then killed) and output. ``slurm``: with the variables SLURM's
    ``srun`` sets as well (one node, job 4242), so that Lightning uses its SLURM environment."""
    argv = [*args, "--devices", str(world), "--json", str(tmp / "result.json")]
    return run_script_ranks(tmp, world, "train.py", argv, timeout, slurm)


def run_script_ranks(
    tmp: Path, world: int, script: str, argv: list[str], timeout: float = 90, slurm: bool = False
) -> tuple[list[int | None], list[str]]:
    """``scripts/<script>`` as ``world`` ranks forked from this process, each started as a cluster
    launcher would (no launcher kills the others): their exit codes (``None``: killed at the timeout)
    and their logs."""
    ctx = multiprocessing.get_context("fork")
    base = env(WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), GROUP_RANK="0")
    logs = [tmp / f"rank{r}.log" for r in range(world)]
    procs = [
        ctx.Process(
            target=_run_script_in_child,
            args=(SCRIPTS / script, argv, {**base, **_rank_variables(r, world, slurm)}, logs[r]),
        )
        for r in range(world)
    ]
    _start_forked(procs)
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        codes.append(p.exitcode)
        if p.is_alive():
            p.kill()
            p.join()
    return codes, [log.read_text() for log in logs]


def _rank_variables(rank: int, world: int, slurm: bool) -> dict[str, str]:
    variables = {"RANK": str(rank), "LOCAL_RANK": str(rank)}
    if slurm:
        variables.update(
            SLURM_NTASKS=str(world),
            SLURM_NTASKS_PER_NODE=str(world),
            SLURM_NNODES="1",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_NODEID="0",
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="prague-test",
            SLURM_NODELIST="127.0.0.1",
        )
    return variables


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
