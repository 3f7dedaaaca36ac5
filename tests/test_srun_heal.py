"""A lost rank comes back under SLURM's `srun`: a new step of the same job, or the rank's own keeper.

Three jobs of 4 tasks each, started as `srun` starts them (SLURM's variables, one process per task,
no other launcher: the emulated `srun` of `lightning_prague.tools.cluster.srun`, forked from one
import, on 127.0.0.1 with gloo), run side by side:

- `prague` and `decent_adam`: rank 2 kills itself (SIGKILL) at its 10th batch and rank 1 at its
  40th. Once each process is gone, a new `srun` step of the same job starts its task again: rank 2
  as step 1 with nothing added (it finds the running fit of its job by itself), rank 1 as step 2
  with `LIGHTNING_PRAGUE_REJOIN=1`. Every fit returns, with one model, and each new process trains
  at least 50 batches.
- `prague` with `max_restarts=1`: every task's process becomes its rank's keeper
  (`lightning_prague.strategies.keeper`), which keeps a warm spare; rank 1's training process is
  killed (SIGKILL) once it trains and its spare stands ready (the spare's CPU time stands still:
  killed at a fixed batch instead, the spare was once still importing under load, and the new
  process came after the fit), and its keeper starts it again in place, in the spare. The new
  process rejoins and trains; every task (keeper) exits 0, as the fit finished.

About 20 s on two cores.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT, IdleProcesses, free_port, process_alive, run_forked, spare_beside

from lightning_prague.strategies.keeper import SPARE_VARIABLE
from lightning_prague.tools.cluster.srun import Layout, expand_nodelist, slurm_variables

pytestmark = pytest.mark.timeout(300)

TASKS = 4
#: a new step of the job starts each of these ranks again once its process is gone: rank -> (batch it
#: kills itself at, its new step's id, what the step exports on top of the job's environment)
NEW_STEPS = {2: (10, 1, {}), 1: (40, 2, {"LIGHTNING_PRAGUE_REJOIN": "1"})}
#: the rank the keeper of the `max_restarts` job restarts
KEPT = 1
EPOCHS = 2
#: the epochs of the job whose keeper restarts a rank: its spare is warm 20-30 s into the fit under
#: load (its interpreter starts 5 s after the keeper's and imports torch and Lightning beside 12 ranks),
#: and the survivors must still be training when the new process rejoins
KEPT_EPOCHS = 4
#: the fewest batches a new process trains
MIN_BATCHES = 50
JOB_TIMEOUT = 200


def demo_args(strategy: str, out: Path, faults: list[str], restarts: int = 0) -> list[str]:
    """A short fit: 2 epochs of the digits, each 4 times over in batches of 8 (720 batches an epoch);
    8 times over for a job whose keeper restarts a rank (its new process is a fresh interpreter, which
    imports torch and Lightning: the fit must outlast that on two loaded cores)."""
    return [
        "--strategy", strategy, "--devices", str(TASKS), "--epochs", str(KEPT_EPOCHS if restarts else EPOCHS),
        "--batch-size", "8",
        "--epoch-repeats", "8" if restarts else "4", "--step-time", "0.02", "--profile", "homogeneous",
        "--hang-timeout", "30", "--grouping-timeout", "60", "--max-restarts", str(restarts), "--json", str(out),
        *(arg for fault in faults for arg in ("--fault", fault)),
    ]  # fmt: skip


def gate_after_kill(directory: Path, rank: int, gate: Path, deadline: float) -> None:
    """Touch `gate` once rank `rank`'s process struck its fault and is gone (as a user srun's the task
    again after it died)."""
    fault, pid_file = directory / f"fault.{rank}.json", directory / f"pid.{rank}"
    while not fault.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(pid_file.read_text()) if pid_file.exists() else None
    while pid is not None and process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    gate.touch()


def kill_once_the_spare_is_warm(directory: Path, rank: int, deadline: float) -> None:
    """SIGKILL rank `rank`'s training process once it trains (its ``pid`` file) and its keeper's spare
    is warm; write what was done to ``killed.RANK``."""
    pid_file, warm = directory / f"pid.{rank}", IdleProcesses()
    while time.monotonic() < deadline:
        pid = int(pid_file.read_text()) if pid_file.exists() and pid_file.read_text().strip() else None
        spare = spare_beside(pid) if pid is not None else None
        if pid is not None and spare is not None and warm.settled(spare):
            os.kill(pid, signal.SIGKILL)
            (directory / f"killed.{rank}").write_text(f"killed training process {pid} beside warm spare {spare}")
            return
        time.sleep(0.1)
    (directory / f"killed.{rank}").write_text("never killed: no warm spare beside a training process in time")


def results(directory: Path) -> dict[int, dict]:
    files = [directory / "result.json", *sorted(directory.glob("result.rank*.json"))]
    found = [json.loads(path.read_text()) for path in files if path.exists()]
    return {result["rank"]: result for result in found}


@pytest.fixture(scope="module")
def srun_jobs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """The three jobs under one emulated `srun` (its output names every task that failed):
    name -> (its directory, the launcher's output and the job's logs)."""
    root = tmp_path_factory.mktemp("srun")
    jobs = {"prague": ("prague", 0), "decent_adam": ("decent_adam", 0), "kept": ("prague", 1)}
    steps, gates = [], []
    for i, (name, (strategy, restarts)) in enumerate(jobs.items()):
        directory = root / name
        directory.mkdir()
        job_id, port = str(4801 + i), str(free_port())
        faults = [] if restarts else [f"{rank}:{batch}:kill" for rank, (batch, _, _) in NEW_STEPS.items()]
        argv = demo_args(strategy, directory / "result.json", faults, restarts)
        if restarts:  # the keepers of the ranks never lost keep no spare (a spare's imports cost the loaded cores)
            others = [t for t in range(TASKS) if t != KEPT]
            steps.append({"job_id": job_id, "argv": argv, "tasks": [KEPT], "export": {"MASTER_PORT": port}})
            steps.append(
                {"job_id": job_id, "argv": argv, "tasks": others, "export": {"MASTER_PORT": port, SPARE_VARIABLE: "0"}}
            )
        else:
            steps.append({"job_id": job_id, "argv": argv, "export": {"MASTER_PORT": port}})
        for rank, (_, step_id, export) in NEW_STEPS.items() if not restarts else ():
            gate = directory / f"srun.step{step_id}"
            gates.append((directory, rank, gate))
            steps.append(
                {"job_id": job_id, "argv": argv, "gate": str(gate), "step_id": step_id, "tasks": [rank],
                 "export": {"MASTER_PORT": port, **export}}
            )  # fmt: skip
    (root / "steps.json").write_text(json.dumps(steps))
    argv = [
        "--nnodes", "1", "--node-id", "0", "--ntasks-per-node", str(TASKS), "--nodelist", "127.0.0.1",
        "--master-addr", "127.0.0.1", "--preload", "--steps", str(root / "steps.json"), "--log-dir", str(root),
        "--timeout", str(JOB_TIMEOUT), "-m", "lightning_prague.demo.run",
    ]  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")}
    environment.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    deadline = time.monotonic() + JOB_TIMEOUT
    watchers = [threading.Thread(target=gate_after_kill, args=(*g, deadline), daemon=True) for g in gates]
    kill = threading.Thread(target=kill_once_the_spare_is_warm, args=(root / "kept", KEPT, deadline), daemon=True)
    watchers.append(kill)
    for watcher in watchers:
        watcher.start()
    done = run_forked("lightning_prague.tools.cluster.srun", argv, environment, root, JOB_TIMEOUT + 30)
    launcher = done.stdout + done.stderr
    return {name: (root / name, launcher + job_logs(root, str(4801 + i))) for i, name in enumerate(jobs)}


def job_logs(root: Path, job_id: str) -> str:
    """The tail of every log of job `job_id`: its tasks' and its supervisor's (named by the job's port)."""
    steps = json.loads((root / "steps.json").read_text())
    port = next(step["export"]["MASTER_PORT"] for step in steps if step["job_id"] == job_id)
    paths = [*sorted(root.glob(f"job{job_id}.*.log")), *sorted(root.glob(f"lightning_prague_logs/*-{port}-*.log"))]
    return "".join(f"\n--- {p.name}\n{p.read_text(errors='replace')[-2500:]}" for p in paths)


def launcher_lines(output: str, job_id: str) -> list[str]:
    """What the emulated srun said of the job's tasks that failed (it names failures only)."""
    return [line for line in output.splitlines() if line.startswith("srun: task") and f"(job {job_id}" in line]


@pytest.mark.parametrize("strategy", ["prague", "decent_adam"])
def test_a_new_srun_step_of_the_job_rejoins_its_running_fit(srun_jobs, strategy):
    """Rank 2 (nothing added) and rank 1 (`LIGHTNING_PRAGUE_REJOIN=1`), each started again as a new step
    of the same job, rejoin the running fit and train on; every fit returns with one model."""
    directory, output = srun_jobs[strategy]
    job_id = str(4801 + ["prague", "decent_adam"].index(strategy))
    found = results(directory)
    assert sorted(found) == list(range(TASKS)), f"results of ranks {sorted(found)}\n{output[-16000:]}"
    assert len({r["params_sha256"] for r in found.values()}) == 1, output[-16000:]
    for rank, result in found.items():
        assert result["epochs_run"] == EPOCHS, (rank, result["epochs_run"], output[-8000:])
    for rank in NEW_STEPS:
        struck = json.loads((directory / f"fault.{rank}.json").read_text())["time"]
        assert found[rank]["first_batch_time"] > struck, (rank, found[rank]["first_batch_time"], struck)
        assert found[rank]["batches_this_process"] >= MIN_BATCHES, (rank, found[rank]["batches_this_process"])
    # the killed processes are the only tasks of the job that failed: the new steps' tasks exited 0
    failed = launcher_lines(output, job_id)
    assert sorted(line.split("rank ")[-1] for line in failed) == ["1) exited with -9", "2) exited with -9"], failed
    log = (directory.parent / f"job{job_id}.rank2.step1.log").read_text()
    assert "this process rejoins it" in log, log[-3000:]  # found the running fit by itself


def test_the_keeper_of_max_restarts_restarts_a_killed_rank_under_srun(srun_jobs):
    """`max_restarts=1` under srun: rank 1's keeper starts its killed training process again in its warm
    spare, which rejoins and trains; every task exits 0 (the keeper exits as its last process did)."""
    directory, output = srun_jobs["kept"]
    found = results(directory)
    killed = (directory / f"killed.{KEPT}").read_text()
    assert killed.startswith("killed"), killed
    assert sorted(found) == list(range(TASKS)), f"results of ranks {sorted(found)}\n{output[-12000:]}"
    assert len({r["params_sha256"] for r in found.values()}) == 1, output[-12000:]
    assert found[KEPT]["restarts"] == 1 and found[KEPT]["batches_this_process"] > 0, found[KEPT]
    assert all(found[r]["restarts"] == 0 for r in range(TASKS) if r != KEPT)
    assert launcher_lines(output, "4803") == [], output[-8000:]  # every task (a keeper) exited 0
    log = (directory.parent / "job4803.rank1.log").read_text()
    assert "starting it again in 1s (restart 1 of 1)" in log, log[-3000:]
    assert "the rank's new process is its warm spare" in log, log[-3000:]  # it stood ready: no new interpreter


def test_srun_sets_the_variables_of_a_step_of_a_requeued_job():
    layout = Layout(2, 1, 2, "node[1-2]")
    variables = slurm_variables(layout, "4242", 1, step_id=3, restart_count=2)
    assert variables["SLURM_PROCID"] == "3" and variables["SLURM_NTASKS"] == variables["SLURM_STEP_NUM_TASKS"] == "4"
    assert variables["SLURM_STEP_ID"] == variables["SLURM_STEPID"] == "3"
    assert variables["SLURM_JOB_ID"] == variables["SLURM_JOBID"] == "4242"
    assert variables["SLURM_RESTART_COUNT"] == "2" and variables["SLURMD_NODENAME"] == "node2"
    assert variables["SLURM_JOB_NODELIST"] == variables["SLURM_STEP_NODELIST"] == "node[1-2]"
    assert variables["SLURM_TASKS_PER_NODE"] == "2(x2)"
    assert "SLURM_RESTART_COUNT" not in slurm_variables(layout, "4242", 1)  # set once the job was requeued
    assert expand_nodelist("n[01-02,7],gpu5") == ["n01", "n02", "n7", "gpu5"]
