"""A lost worker comes back inside one long epoch, and every batch is trained once.

Three real jobs, run side by side with a fourth (the slow part): four CPU workers under the strategy's
launcher with `max_restarts=1` (new interpreters under `prague`, forked ranks under `decent_adam` and
`prague` with `grouping="static"`), one epoch of 719 batches (the digits in batches of 2), 50 ms
steps. In each job one rank kills itself with SIGKILL at its 20th batch: rank 2 under `prague` (the
work queue), rank 0 (the leader) under `decent_adam` and rank 1 under static grouping (lock-step
shards). The agent starts the rank again, and the new process is
admitted at once, in a membership epoch of its own, with no meeting of the members (not at an
epoch's end that would come too late), gets the fit's state from a live member, and trains the rest
of the epoch with the others: the work queue's batches, or the rest of the lost rank's own shard
(gossip rounds take it in at a round every member of its groups agrees on).

The control plane dies too, after the admission (not in the static grouping's job): rank 1 SIGKILLs
the supervisor at its 130th batch (and at its 60th in the later-epoch job). Rank 0 starts it again:
its first process under `prague`, and under `decent_adam` the new process that replaced it (it
adopted the supervisor its predecessor started, and tells it died by the journal's lock). The plane
takes the job back from its journal and renews the admission's membership epoch in its new store,
every rank reconnects, and every batch is still trained once (`test_plane_restart.py` for the
mechanism).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import run_demo_jobs

import lightning_prague.demo.run  # noqa: F401  (imported once here: the jobs' agents are forked from this process)

#: the digits' training samples and the batch size: one long epoch of 719 batches
SAMPLES, BATCH = 1438, 2
KILLED_AT = 20  # the killed process trained the 19 batches before it
#: `prague-static`: `prague` with `grouping="static"`, lock-step shards as `decent_adam`'s
CASES = {"prague": 2, "decent_adam": 0, "prague-static": 1}
#: the cases whose ranks train lock-step shards (each rank its own, padded to the same length)
LOCK_STEP = ("decent_adam", "prague-static")
#: how the agent starts the ranks: new interpreters (the default), or forks of itself (no import per
#: rank: restarts within a second)
START_METHOD = {"prague": "popen", "decent_adam": "fork", "prague-static": "fork"}
#: the jobs whose control plane rank 1 kills, and at which of its batches (after the admission)
PLANE_KILLED = {"prague": 130, "decent_adam": 130, "decent_adam-later-epoch": 60}


#: the third job, alongside: `decent_adam` over 8 short epochs, rank 2 killed at its 20th batch (in
#: epoch 1), with checkpoints at every epoch's end (`test_a_lock_step_rank_restarted_in_a_later_epoch...`)
LATER_EPOCH = "decent_adam-later-epoch"


def _command(strategy: str, rank: int, out: Path) -> list[str]:
    command = ["--strategy", strategy.partition("-")[0], "--devices", "4"]
    if strategy.endswith("-static"):
        command += ["--grouping", "static"]
    command += ["--epochs", "1", "--batch-size", str(BATCH), "--step-time", "0.05", "--profile", "homogeneous"]
    command += ["--fault", f"{rank}:{KILLED_AT}:kill", "--max-restarts", "1", "--hang-timeout", "10"]
    command += ["--start-method", START_METHOD[strategy]]
    if strategy in PLANE_KILLED:
        command += ["--fault", f"1:{PLANE_KILLED[strategy]}:kill-plane"]
    return [*command, "--json", str(out / "result.json")]


def _later_epoch_command(out: Path) -> list[str]:
    command = ["--strategy", "decent_adam", "--devices", "4"]
    command += ["--start-method", "fork"]
    command += ["--epochs", "8", "--step-time", "0.05", "--profile", "homogeneous", "--fault", "2:20:kill"]
    command += ["--fault", f"1:{PLANE_KILLED[LATER_EPOCH]}:kill-plane"]
    command += ["--max-restarts", "1", "--hang-timeout", "10", "--json", str(out / "result.json")]
    # checkpoints at every epoch's end, right after the admission there: the others average their optimizer
    # states among themselves, not with the joiner, which writes none there (it did, and gloo aborted)
    return [*command, "--checkpoint-dir", str(out / "checkpoints")]


@pytest.fixture(scope="module")
def long_epoch_jobs(tmp_path_factory) -> dict[str, tuple[int, dict[int, dict], str, Path]]:
    """The three jobs at once: name -> (exit status, each rank's last result, the job's stderr, its folder)."""
    commands = {strategy: (lambda out, s=strategy, r=rank: _command(s, r, out)) for strategy, rank in CASES.items()}
    commands[LATER_EPOCH] = _later_epoch_command
    # the agents forked from this process (no interpreter start); the prague job's ranks are new interpreters
    return run_demo_jobs(commands, tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", list(CASES))
def test_a_killed_rank_rejoins_inside_one_long_epoch_and_every_batch_is_trained_once(long_epoch_jobs, strategy):
    status, results, stderr, _ = long_epoch_jobs[strategy]
    killed = CASES[strategy]
    assert status == 0, stderr[-4000:]  # the agent: every rank's last process exited 0
    assert sorted(results) == [0, 1, 2, 3], stderr[-4000:]
    assert "rejoined the job inside the epoch" in stderr  # at once, with no meeting of the members
    assert results[killed]["restarts"] == 1
    assert results[killed]["batches_this_process"] >= 100  # the new process trained the epoch on
    assert all(results[r]["epochs_run"] == 1 for r in results)
    # every batch trained once: by the survivors, the new process, and the 19 the killed one trained
    trained = sum(results[r]["batches_this_process"] for r in results) + KILLED_AT - 1
    if strategy in LOCK_STEP:  # lock-step shards: each of the 4 padded to the same length
        batches = 4 * math.ceil(math.ceil(SAMPLES / 4) / BATCH)
    else:  # the work queue: one pass over the data
        batches = math.ceil(SAMPLES / BATCH)
    assert trained == batches, (strategy, {r: results[r]["batches_this_process"] for r in results})
    # and the fit ended on one consensus model
    assert len({results[r]["params_sha256"] for r in results}) == 1
    if strategy in PLANE_KILLED:
        assert_plane_taken_back(stderr)


def test_a_successor_resumes_the_epoch_where_the_lost_rank_stood_with_its_steps_moved_to_match():
    """The donor stood at batch 43 of its shard, the lost rank at 19: the successor's loop goes on from
    19, its global step with it; a state without loop progress is refused by name."""
    from lightning_prague.core.errors import ConfigurationError
    from lightning_prague.strategies.rejoin import resume_epoch_progress

    counters = {"ready": 43, "started": 43, "processed": 43, "completed": 43}
    checkpoint = {
        "global_step": 43,
        "loops": {
            "fit_loop": {
                "epoch_loop.batch_progress": {"total": {**counters}, "current": {**counters}, "is_last_batch": 1},
                "epoch_loop.automatic_optimization.optim_progress": {"optimizer": {"step": {"total": dict(counters)}}},
                "epoch_loop.state_dict": {"_batches_that_stepped": 43},
            }
        },
    }
    resume_epoch_progress(checkpoint, 19)
    fit_loop = checkpoint["loops"]["fit_loop"]
    assert fit_loop["epoch_loop.batch_progress"]["current"]["ready"] == 19
    assert fit_loop["epoch_loop.batch_progress"]["is_last_batch"] is False  # it goes on in this epoch
    assert fit_loop["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"]["total"]["completed"] == 19
    assert checkpoint["global_step"] == 19 and fit_loop["epoch_loop.state_dict"]["_batches_that_stepped"] == 19
    with pytest.raises(ConfigurationError, match="no training loop progress"):
        resume_epoch_progress({"loops": "not loops"}, 3)


@pytest.mark.timeout(240)
def test_a_lock_step_rank_restarted_in_a_later_epoch_is_admitted_at_an_epoch_end_and_nothing_crashes(long_epoch_jobs):
    """`decent_adam`, 8 short epochs (13 batches per rank): rank 2 killed at its 20th batch, in epoch
    1; its new process asks to rejoin epochs later, when its shard holds nothing of the members'
    epoch. It is admitted at their epoch's end, not inside the epoch: admitted inside it, it trained
    nothing there, its idle gossip rounds met a survivor's validation collective and two survivors'
    gloo pairs aborted the job ("Received data size doesn't match"). A checkpoint written at that
    epoch's end, right after the admission, averages the others' optimizer states without the joiner."""
    status, results, stderr, out = long_epoch_jobs[LATER_EPOCH]
    assert status == 0 and "Received data size" not in stderr, stderr[-4000:]
    assert sorted(results) == [0, 1, 2, 3], stderr[-4000:]
    assert results[2]["restarts"] == 1
    assert "rank 2: rejoined the job at 'epoch_end@epoch" in stderr, stderr[-4000:]
    assert all(results[r]["epochs_run"] == 8 for r in results)
    # admitted at the fit's last epoch's end (a slow start) it validates nothing: it has the members' metrics
    assert results[2]["val_acc"] is not None
    assert len({results[r]["params_sha256"] for r in results}) == 1
    assert (out / "checkpoints" / "last.ckpt").is_file()
    assert_plane_taken_back(stderr)


def assert_plane_taken_back(stderr: str) -> None:
    """The supervisor that rank 1 killed was started again by rank 0, every rank's link came back, and the
    admission's membership epoch was renewed in the new store."""
    assert "restarted the supervisor" in stderr, stderr[-4000:]
    assert stderr.count("reconnected to the control plane") == 4, stderr[-4000:]
    assert "in the new store" in stderr, stderr[-4000:]
