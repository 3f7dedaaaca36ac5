"""A rank's keeper (`lightning_prague.strategies.keeper`) and how a new process finds its job's running fit
(`lightning_prague.core.discovery`), without training: small processes and a store in this one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from helpers import free_port

from lightning_prague.core.discovery import find_running_fit, publish_running, read_mark, running_key
from lightning_prague.strategies.keeper import (
    EXCLUDED_EXIT_VARIABLE,
    KEEPER_VARIABLE,
    RESTARTS_VARIABLE,
    Keeper,
    keeper_argv,
)

pytestmark = pytest.mark.timeout(60)

#: a training process's stand-in: appends its restart count and its keeper's variable to a file, then
#: exits with the status the file's line count picks from argv
STAND_IN = """
import os, sys
path, codes = sys.argv[1], sys.argv[2:]
with open(path, "a") as out:
    out.write(f"{os.environ.get('LIGHTNING_PRAGUE_RESTART_COUNT', '-')} {os.environ.get('LIGHTNING_PRAGUE_KEEPER')} "
              f"{os.environ.get('LIGHTNING_PRAGUE_EXCLUDED_EXIT_STATUS')}\\n")
runs = len(open(path).read().splitlines())
code = int(codes[min(runs, len(codes)) - 1])
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def stand_in(path: Path, *codes: int) -> list[str]:
    return [sys.executable, "-c", STAND_IN, str(path), *map(str, codes)]


def test_the_keeper_restarts_a_failed_process_with_its_restart_count_until_it_succeeds(tmp_path):
    runs = tmp_path / "runs"
    keeper = Keeper(stand_in(runs, -9, 75, 0), max_restarts=2, backoff=0.01, environment=dict(os.environ))
    assert keeper.run() == 0
    lines = [line.split() for line in runs.read_text().splitlines()]
    assert [line[0] for line in lines] == ["-", "1", "2"]  # the first start has no restart count
    assert {line[1] for line in lines} == {str(os.getpid())}  # each knows its keeper: it starts no keeper itself
    assert {line[2] for line in lines} == {"75"}  # an exclusion is reported so that the keeper restarts it


def test_past_its_restarts_the_keeper_reports_the_last_status(tmp_path):
    keeper = Keeper(stand_in(tmp_path / "runs", 3, 4), max_restarts=1, backoff=0.01, environment={})
    assert keeper.run() == 4
    assert len((tmp_path / "runs").read_text().splitlines()) == 2


def test_the_keeper_program_dies_as_its_process_did_and_forwards_sigterm(tmp_path):
    """Run as the launcher's task: a killed process past its restarts kills the keeper with the same
    signal; a SIGTERM to the keeper reaches the process and nothing is restarted after it."""
    argv = keeper_argv(stand_in(tmp_path / "killed", -9), 0, None)
    assert subprocess.run(argv, timeout=30).returncode == -signal.SIGKILL
    sleeper = [sys.executable, "-c", "import signal, sys, time; time.sleep(30)"]
    keeper = subprocess.Popen(keeper_argv(sleeper, 3, None, backoff=0.01), stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the interpreters start
    keeper.send_signal(signal.SIGTERM)
    assert keeper.wait(timeout=20) == -signal.SIGTERM
    assert "stays lost (0 restarts of 3 used, the launcher stops the task)" in keeper.stderr.read()


def test_the_keepers_environment_variables_are_the_librarys():
    from lightning_prague.core.client.partition import EXCLUDED_EXIT_VARIABLE as excluded
    from lightning_prague.core.job import RESTARTS_VARIABLE as restarts

    assert (RESTARTS_VARIABLE, EXCLUDED_EXIT_VARIABLE) == (restarts, excluded)  # the keeper imports neither
    assert KEEPER_VARIABLE.startswith("LIGHTNING_PRAGUE_")


def test_a_new_process_finds_only_its_own_jobs_running_fit():
    """The running mark: found for the job's own id, never for another job's (a requeue, another
    allocation on the same port), nor when malformed or when nothing listens."""
    port = free_port()
    assert not find_running_fit(2, "127.0.0.1", port, "slurm:4242:0")  # nothing listens: a fresh start
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    assert not find_running_fit(2, "127.0.0.1", port, "slurm:4242:0")  # the store, but no fit met yet
    publish_running(store, "slurm:4242:0", 0)
    assert find_running_fit(2, "127.0.0.1", port, "slurm:4242:0")  # a new srun step of the same job
    assert not find_running_fit(2, "127.0.0.1", port, "slurm:4242:1")  # the job requeued: a fresh fit
    assert not find_running_fit(2, "127.0.0.1", port, "slurm:777:0")  # another job on the same port
    store.set(running_key("slurm:9:0"), json.dumps({"launch": "slurm:4242:0", "since": 1.0}))
    assert not find_running_fit(2, "127.0.0.1", port, "slurm:9:0")  # a mark that names another job
    store.set(running_key("slurm:8:0"), b"x" * 5000)
    assert not find_running_fit(2, "127.0.0.1", port, "slurm:8:0")
    assert not read_mark(b"[1]", "a") and not read_mark(b'{"launch": "a", "since": 1, "more": 2}', "a")
    assert read_mark(json.dumps({"launch": "a", "since": 1.5}).encode(), "a")


@pytest.fixture
def torchrun_env(monkeypatch):
    """A torchrun worker's variables (run id, no restart yet), on a job of 2 nodes."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    return monkeypatch


def test_a_torchrun_restart_across_nodes_is_refused_with_what_to_do(torchrun_env):
    from lightning_prague.core.errors import ConfigurationError
    from lightning_prague.strategies.launcher import check_torchrun_restarts

    torchrun_env.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.warns(UserWarning, match="on 2 nodes, where its restarts cannot heal the job: run torchrun with"):
        check_torchrun_restarts(0, 2)  # the first start: a warning
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with pytest.raises(ConfigurationError, match=r"restart 1 of --max-restarts 3.*--max-restarts 0 and give the"):
        check_torchrun_restarts(0, 2)
    torchrun_env.setenv("GROUP_WORLD_SIZE", "1")
    check_torchrun_restarts(0, 1)  # one node: torchrun's restart and resume from the last checkpoint stays
    torchrun_env.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.warns(UserWarning, match="max_restarts=2 restarts a lost rank in place already"):
        check_torchrun_restarts(2, 1)


class _MPI:
    """A stand-in for `mpi4py.MPI` with an initialised (or finalised) library."""

    def __init__(self, finalized: bool = False) -> None:
        self.finalized = finalized

    def Is_initialized(self) -> bool:  # noqa: N802  (mpi4py's names)
        return True

    def Is_finalized(self) -> bool:  # noqa: N802
        return self.finalized


def test_state_that_does_not_survive_a_fork_is_named(monkeypatch):
    """CUDA initialised, or an MPI library that mpi4py initialised (Lightning's MPI detection imports
    it wherever mpi4py is installed): a forked training process could not use the first and hangs at
    its exit in the second's finalisation (seen with Open MPI 5 under a keeper)."""
    import torch

    from lightning_prague.core.forking import unforkable_state

    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    assert unforkable_state() is None  # this process: no CUDA, no MPI
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _MPI(finalized=True))
    assert unforkable_state() is None  # finalised already: nothing left to hang on
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _MPI())
    assert "MPI library is initialised" in (unforkable_state() or "")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert unforkable_state() == "CUDA is initialised"


def test_the_keeper_starts_the_training_process_anew_where_a_fork_is_unsafe(monkeypatch, caplog):
    """With an MPI library initialised, the task's process forks nothing: it becomes the keeper
    (`exec`), which starts the training process as a new process of the same command."""
    from lightning_prague.strategies import launcher

    class Became(Exception):
        pass

    def execv(path, argv):
        raise Became(argv)

    def fork():
        raise AssertionError("a training process was forked from a process with MPI initialised")

    monkeypatch.setitem(sys.modules, "mpi4py.MPI", _MPI())
    monkeypatch.setattr(launcher.os, "fork", fork)
    monkeypatch.setattr(launcher.os, "execv", execv)
    with caplog.at_level("WARNING", logger=launcher.__name__), pytest.raises(Became) as became:
        launcher.keep_this_rank(2)
    (argv,) = became.value.args
    assert argv[argv.index("--max-restarts") + 1] == "2" and "--child" not in argv, argv
    assert "MPI library is initialised" in caplog.text and "starts its training process anew" in caplog.text


#: a training script's stand-in for the warm spare: records its pid, restart count, whether torch was
#: imported before it ran (in a spare it was) and its keeper; its first run dies after `argv[2]` seconds
SPARE_STAND_IN = """
import os, sys
path = sys.argv[1]
with open(path, "a") as out:
    out.write(f"{os.getpid()} {os.environ.get('LIGHTNING_PRAGUE_RESTART_COUNT', '-')} {'torch' in sys.modules} "
              f"{os.environ.get('LIGHTNING_PRAGUE_KEEPER')}\\n")
if len(open(path).read().splitlines()) == 1:
    import time
    time.sleep(float(sys.argv[2]))
    os.kill(os.getpid(), 9)
"""


def kept_stand_in(tmp_path: Path, dies_after: float) -> tuple[Keeper, list[list[str]]]:
    """A keeper with a warm spare (started at once) runs `SPARE_STAND_IN`, whose first process dies
    after `dies_after` seconds: the keeper, and what each process recorded."""
    script, runs = tmp_path / "train.py", tmp_path / "runs"
    script.write_text(SPARE_STAND_IN)
    command = [sys.executable, str(script), str(runs), str(dies_after)]
    keeper = Keeper(command, max_restarts=1, backoff=0.01, environment=dict(os.environ), spare=True, spare_delay=0)
    assert keeper.run() == 0
    return keeper, [line.split() for line in runs.read_text().splitlines()]


def _dying_spare(command: list[str]) -> list[str]:
    return [sys.executable, "-c", "raise SystemExit(3)"]


def test_a_keepers_restart_runs_in_its_warm_spare(tmp_path):
    """Under srun, torchrun or a container the keeper keeps a warm spare, as the node's agent does:
    the restart runs the rank's command in a process that imported torch and Lightning already."""
    from lightning_prague.strategies.keeper import SPARE_VARIABLE, spare_wanted

    keeper, (first, second) = kept_stand_in(tmp_path, 0.5)
    assert first[1:3] == ["-", "False"], first  # a new process: nothing imported before the script
    assert second[1:] == ["1", "True", str(os.getpid())], second  # the spare: torch was there already
    assert keeper.spares_taken == 1 and keeper.spare is None  # no restart left: no new spare
    assert spare_wanted({}) and not spare_wanted({SPARE_VARIABLE: "0"})
    assert "--spare" in keeper_argv(keeper.command, 1, None, spare=True)
    assert "--spare" not in keeper_argv(keeper.command, 1, None)


def test_a_spare_that_dies_at_once_is_not_replaced_in_a_loop(tmp_path, monkeypatch):
    """A spare that cannot start (a broken install) is started again once per spare delay, not at every look."""
    from lightning_prague.strategies import keeper as keeper_module

    monkeypatch.setattr(keeper_module, "spare_command", _dying_spare)
    command = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    keeper = Keeper(command, max_restarts=1, backoff=0.01, environment=dict(os.environ), spare=True, spare_delay=0.5)
    assert keeper.run() == 0
    spares = [proc for proc in keeper._procs.values() if proc.args[-1] == "raise SystemExit(3)"]
    assert 1 <= len(spares) <= 4, len(spares)  # 1.5 s at one per 0.5 s, not one per look (0.1 s)
    assert keeper.spares_taken == 0


def test_a_restart_whose_spare_died_starts_a_new_process(tmp_path, monkeypatch):
    """A spare that is gone when the rank is lost (it crashed, or was killed): the keeper starts the
    rank's new process as it does without a spare."""
    from lightning_prague.strategies import keeper as keeper_module

    monkeypatch.setattr(keeper_module, "spare_command", _dying_spare)
    keeper, (_, second) = kept_stand_in(tmp_path, 1.0)
    assert second[1:3] == ["1", "False"], second  # a new process, not the (dead) spare
    assert keeper.spares_taken == 0


def test_a_restarted_training_process_learns_how_its_predecessor_ended():
    from lightning_prague.strategies.keeper import PREVIOUS_EXIT_VARIABLE, child_environment

    first = child_environment({PREVIOUS_EXIT_VARIABLE: "stale"}, 42, 0, None)
    assert PREVIOUS_EXIT_VARIABLE not in first  # a first start has no predecessor
    assert child_environment({}, 42, 2, 1)[PREVIOUS_EXIT_VARIABLE] == "1"
    assert child_environment({}, 42, 1, -9)[PREVIOUS_EXIT_VARIABLE] == "-9"


@pytest.mark.parametrize(
    "previous,excluded,fails",
    [(None, None, None), ("-9", None, None), ("75", None, None), ("1", None, 1), ("3", None, 3), ("0", "0", None)],
)
def test_a_restart_that_finds_no_job_fails_only_after_a_predecessor_whose_fit_failed(
    monkeypatch, previous, excluded, fails
):
    """Killed (a signal) or excluded (fenced, cut off): the others may have finished the fit. A fit
    that failed (an exception: exit status 1, or the script's own) left no fit that ended."""
    from lightning_prague.core.job import PREVIOUS_EXIT_VARIABLE
    from lightning_prague.strategies.in_place import predecessor_failed
    from lightning_prague.strategies.keeper import EXCLUDED_EXIT_VARIABLE

    for name, value in ((PREVIOUS_EXIT_VARIABLE, previous), (EXCLUDED_EXIT_VARIABLE, excluded)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert predecessor_failed() == fails
