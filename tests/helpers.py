"""Launching multi-process runs from tests: free ports, timeouts, JSON results."""

from __future__ import annotations

# (imported here, before any test starts a thread: a name lookup imports this codec lazily, and a
# thread that held its import lock while the test process forked a job left the lock held in every
# process of that job, whose first lookup then hung for ever: seen in `test_hostile_job.py`)
import encodings.idna  # noqa: F401
import faulthandler
import gc
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

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


def wait_until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Poll `condition` until it holds, for at most `seconds`; then assert it."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


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


def _run_script_in_child(
    script: Path | str, argv: list[str], environ: dict[str, str], log: Path | None, cwd: Path | None = None
) -> None:
    """Body of a forked rank: the script's ``__main__`` with its own argv, environment and log file
    (``None``: file descriptors 1 and 2 are set already), in ``cwd`` if given. A ``str`` script is a
    module's name, run as ``python -m`` runs it."""
    import runpy
    import traceback

    if log is not None:
        with open(log, "w") as out:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
    if cwd is not None:
        os.chdir(cwd)
    _write_to_the_log()
    _warnings_to_stderr()
    faulthandler.enable()  # a crash of a forked rank leaves its stacks in its log
    faulthandler.register(signal.SIGQUIT, all_threads=True)  # and so does a rank a test gives up on
    if "torch" in sys.modules:  # the parent's OpenMP threads do not exist here: one compute thread
        sys.modules["torch"].set_num_threads(1)
    os.environ.clear()
    os.environ.update(environ)
    sys.argv = [str(script), *argv]
    code = 0
    try:
        if isinstance(script, str):
            sys.modules.pop(script, None)  # imported here already: runpy would warn of a module run twice
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
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


def _run_in_session(module: str, argv: list[str], environ: dict[str, str], log: Path, cwd: Path) -> None:
    """Body of a `ForkedJob`: a session of its own, then the module (see `_run_script_in_child`)."""
    os.setsid()
    sys.path.insert(0, str(cwd))
    _run_script_in_child(module, argv, environ, log, cwd)


class ForkedJob:
    """``python -m MODULE ARGV...`` in ``cwd`` with the environment ``environ``, its output in ``log``,
    in a session of its own, as ``subprocess.Popen(..., start_new_session=True)`` starts it, but forked
    from this process, which has imported torch and Lightning already (no interpreter start, no
    import). The part of `subprocess.Popen` the tests use: ``pid``, ``poll``, ``wait``, ``returncode``."""

    def __init__(self, module: str, argv: list[str], environ: dict[str, str], cwd: Path, log: Path) -> None:
        self.args = [sys.executable, "-m", module, *argv]
        self._child = multiprocessing.get_context("fork").Process(
            target=_run_in_session, args=(module, argv, environ, log, cwd)
        )
        _start_forked([self._child])
        self.pid = self._child.pid

    @property
    def returncode(self) -> int | None:
        return self._child.exitcode

    def poll(self) -> int | None:
        return self._child.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._child.join(timeout)
        if self._child.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._child.exitcode


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


#: a `run_forked` environment variable that is no environment variable: the run's descriptor limit
NOFILE_VARIABLE = "PRAGUE_TEST_NOFILE"


def _run_script_on_pipes(
    script: Path | str, argv: list[str], environ: dict[str, str], pipes: tuple[int, int, int, int], cwd: Path
) -> None:
    """Body of a child of `run_forked`: stdout and stderr on the write ends of its two pipes (``pipes``:
    read and write end of stdout's, then of stderr's), which only file descriptors 1 and 2 hold, and
    ``sys.path[0]`` as the interpreter would set it (the script's folder; for a module, ``cwd``).
    ``environ[NOFILE_VARIABLE]``, if set, is the run's soft and hard limit of open descriptors (``SOFT:HARD``)."""
    limit = environ.pop(NOFILE_VARIABLE, None)
    if limit is not None:
        import resource

        soft, hard = (int(n) for n in limit.split(":"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    sys.path.insert(0, str(cwd if isinstance(script, str) else Path(script).resolve().parent))
    read_out, write_out, read_err, write_err = pipes
    os.close(read_out)
    os.close(read_err)
    os.dup2(write_out, 1)
    os.dup2(write_err, 2)
    os.close(write_out)
    os.close(write_err)
    _run_script_in_child(script, argv, environ, None, cwd)


def _read_until_closed(fds: list[int], deadline: float) -> dict[int, bytes] | None:
    """Everything written to the pipes ``fds`` until every writer closed them (``None``: not by the deadline)."""
    import selectors

    chunks: dict[int, list[bytes]] = {fd: [] for fd in fds}
    with selectors.DefaultSelector() as selector:
        for fd in fds:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            for key, _ in selector.select(left):
                data = os.read(key.fd, 1 << 16)
                if data:
                    chunks[key.fd].append(data)
                else:
                    selector.unregister(key.fd)
    return {fd: b"".join(parts) for fd, parts in chunks.items()}


def _text(data: bytes) -> str:
    """Output as ``subprocess.run(..., text=True)`` gives it (universal newlines)."""
    return data.decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _kill(children: list[multiprocessing.process.BaseProcess]) -> None:
    """SIGKILL ``children`` (those still running) and reap them."""
    for child in children:
        if child.is_alive():
            child.kill()
        child.join()


#: one run of `run_forked_together`: the script (a ``str``: a module's name), its argv, environment and directory
ForkedRun = tuple[Path | str, list[str], dict[str, str], Path]


def run_forked(
    script: Path | str, argv: list[str], environ: dict[str, str], cwd: Path, timeout: float
) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGV...`` (a ``str`` script: ``python -m SCRIPT ARGV...``) in ``cwd`` with the
    environment ``environ``, as ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)``
    runs it, but forked from this process, which has imported torch and Lightning already: no
    interpreter start-up and no import (about 4 s of CPU on two cores per launch).

    As with ``subprocess.run``, the output is read until every process that holds the pipes (the
    child and the ranks it starts or forks) has closed them, and a run past ``timeout`` kills the
    child and raises `subprocess.TimeoutExpired`. The exit status is the child's (``-N``: killed by
    signal N; an uncaught `SystemExit` without an integer code is 1, see `_run_script_in_child`)."""
    return run_forked_together([(script, argv, environ, cwd)], timeout)[0]


def run_forked_together(runs: list[ForkedRun], timeout: float) -> list[subprocess.CompletedProcess]:
    """Several `run_forked` runs at the same time (the nodes of one job, say), their outputs read
    together (no run waits on a full pipe while another is read); past ``timeout`` every child is
    killed and `subprocess.TimeoutExpired` raised."""
    ctx = multiprocessing.get_context("fork")
    pipes = []
    children = []
    for script, argv, environ, cwd in runs:
        read_out, write_out = os.pipe()
        read_err, write_err = os.pipe()
        pipes.append((read_out, read_err))
        ends = (read_out, write_out, read_err, write_err)
        children.append(ctx.Process(target=_run_script_on_pipes, args=(script, argv, environ, ends, cwd)))
        try:
            _start_forked(children[-1:])
        finally:
            os.close(write_out)
            os.close(write_err)
    commands = [
        [sys.executable, *(["-m", script] if isinstance(script, str) else [str(script)]), *argv]
        for script, argv, _, _ in runs
    ]
    read_ends = [fd for pair in pipes for fd in pair]
    try:
        output = _read_until_closed(read_ends, time.monotonic() + timeout)
    except BaseException:  # pytest-timeout's, say: as `subprocess.run` does, the children go too
        _kill(children)
        raise
    finally:
        for fd in read_ends:
            os.close(fd)
    if output is None:
        _kill(children)
        raise subprocess.TimeoutExpired(commands[0], timeout)
    out = []
    for command, child, (read_out, read_err) in zip(commands, children, pipes):
        child.join()
        out.append(
            subprocess.CompletedProcess(command, child.exitcode, _text(output[read_out]), _text(output[read_err]))
        )
    return out


def run_training(tmp: Path, *args: str, timeout: float = 240, script: str = "train.py", **extra_env: str):
    """Run a Lightning training script (which launches its own ranks); return (completed process, rank-0 JSON).

    The script's process is forked from the test process (`run_forked`: no import of Lightning), and
    the demo's ranks from the script's process, unless an option needs separate processes (then
    ranks 1.. are new interpreters, which Lightning's launcher starts).
    """
    out_json = tmp / "result.json"
    fork = script == "train.py" and not any(a in NEEDS_POPEN for a in args)
    argv = ["--json", str(out_json), *args]
    if fork:
        argv += ["--start-method", "fork"]
    proc = run_forked(SCRIPTS / script, argv, env(**extra_env), tmp, timeout)
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
    """Run ``name -> (script, args)`` one after the other in one process (``scripts/run_many.py``, forked
    from this one: `run_forked`), each in ``root / name``; a script that launches ranks should fork
    them (no import of Lightning at all)."""
    specs = []
    for name, (script, args) in runs.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        specs.append({"script": str(SCRIPTS / script), "dir": str(root / name), "args": args})
    (root / "runs.json").write_text(json.dumps(specs))
    proc = run_forked(SCRIPTS / "run_many.py", [str(root / "runs.json")], env(), root, timeout)
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
    hung = [p for p in procs if p.is_alive()]
    for p in hung:  # each prints its threads' stacks into its log first (`_run_script_in_child`)
        os.kill(p.pid, signal.SIGQUIT)
    if hung:
        time.sleep(1.0)
    for p in hung:
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


def parent_of(pid: int) -> int | None:
    """The parent's process id, or None once the process is gone."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children_of(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    pids = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    return [child for child in pids if parent_of(child) == pid]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> set[str]:
    try:
        return set(Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"))
    except OSError:
        return set()


def _is_spare(pid: int) -> bool:
    return b"lightning_prague.strategies.spare" in _cmdline(pid)


def keeper_children(variables: set[str]) -> dict[str, int]:
    """The processes of the keeper (``keeper.py``) that has ``variables`` in its environment: its
    training process (``"training"``) and its warm spare (``"spare"``), those that run."""
    children: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or b"keeper.py" not in _cmdline(int(entry.name)):
            continue
        if variables <= _environ(int(entry.name)):
            for child in children_of(int(entry.name)):
                children["spare" if _is_spare(child) else "training"] = child
    return children


def spare_beside(training: int) -> int | None:
    """The warm spare that the keeper of training process `training` keeps, if it keeps one now."""
    keeper = parent_of(training)
    spares = [child for child in children_of(keeper) if _is_spare(child)] if keeper is not None else []
    return spares[0] if spares else None


class IdleProcesses:
    """Which processes stopped using the CPU: a warm spare has imported torch and Lightning and waits on
    its input (killed before that, a rank's new process came back 15-20 s later, its spare still
    importing, once after the fit had ended)."""

    #: seconds a process's CPU time must stay the same
    QUIET_SECONDS = 1.5

    def __init__(self) -> None:
        self._since: dict[int, tuple[int, float]] = {}

    def settled(self, pid: int) -> bool:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return False
        ticks = int(fields[11]) + int(fields[12])  # utime + stime
        now = time.monotonic()
        seen = self._since.get(pid)
        if seen is None or seen[0] != ticks:
            self._since[pid] = (ticks, now)
            return False
        return now - seen[1] >= self.QUIET_SECONDS


def dump_stacks(job: subprocess.Popen | ForkedJob, log: Path, seconds: float = 3.0) -> str:
    """The end of the log of a demo job (`python -m lightning_prague.demo.run`, started with
    `start_new_session=True`) a test gives up on, after every process of it printed its threads'
    stacks there (SIGQUIT: the demo's `faulthandler`; its supervisor runs in a session of its own)."""
    try:
        os.killpg(job.pid, signal.SIGQUIT)
    except ProcessLookupError:
        pass
    time.sleep(seconds)
    planes = [p.read_text(errors="replace")[-4000:] for p in sorted(log.parent.glob("lightning_prague_logs/*.log"))]
    return "\n".join([log.read_text(errors="replace")[-20000:], *(f"supervisor log:\n{p}" for p in planes)])


def run_demo_jobs(
    commands: dict[str, Callable[[Path], list[str]]], tmp_path_factory: Any, timeout: float = 240
) -> dict[str, tuple[int | None, dict[int, dict], str, Path]]:
    """Demo jobs (`python -m lightning_prague.demo.run`) side by side, each forked from this process in a
    folder of its own with a free port: name -> (its exit status, each rank's last result, its output,
    its folder). `commands[name](folder)` is the job's argv. A job past `timeout` fails the test with
    every process's stacks; every job still running at the end is killed."""
    runs = {}
    for name, command in commands.items():
        out = tmp_path_factory.mktemp(name)
        environ = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
        environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        runs[name] = (out, ForkedJob("lightning_prague.demo.run", command(out), environ, out, out / "log.txt"))
    results = {}
    try:
        for name, (out, job) in runs.items():
            try:
                job.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {name} job did not end within {timeout:.0f} s:\n{dump_stacks(job, out / 'log.txt')}")
            ranks = {r["rank"]: r for r in (json.loads(p.read_text()) for p in out.glob("result*.json"))}
            results[name] = (job.returncode, ranks, (out / "log.txt").read_text(), out)
    finally:
        for _, job in runs.values():
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
    return results
