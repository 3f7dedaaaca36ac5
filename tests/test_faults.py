"""A lost worker, a stop decided on one rank, and users' own collectives, in real processes.

The job's control plane runs in a supervisor process of its own: a rank that dies (kill -9, rank 0
included) is named to every other rank at once, and they stop with an error that says so; a stop
decided on one rank (Timer, the module itself) is taken by every rank at the same synchronization
point; a user's collective on the world group runs beside our exchanges, which use a process group
of their own.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import process_alive, rank_results, run_external_ranks, run_training

pytestmark = pytest.mark.timeout(240)

WORKLOAD = ["--epochs", "40", "--step-time", "0.03", "--group-size", "2"]


@pytest.mark.parametrize(("strategy", "dead"), [("prague", 0), ("decent_adam", 2)])
def test_a_worker_killed_with_sigkill_is_named_by_every_other_rank_within_15_seconds(tmp_path, strategy, dead):
    codes, logs = run_external_ranks(
        tmp_path, 4, "--strategy", strategy, *WORKLOAD, "--kill-rank", str(dead), "--kill-batch", "8"
    )
    assert codes[dead] == -9, (codes, logs[dead][-3000:])
    killed = json.loads((tmp_path / "killed.json").read_text())
    supervisors = set()
    for rank in range(4):
        if rank == dead:
            continue
        assert codes[rank] in (0, 3), (rank, codes, logs[rank][-3000:])  # it ended, with the report written
        report = json.loads((tmp_path / f"result.rank{rank}.json").read_text())
        # the killed rank first; ranks that stopped because of it may follow
        assert f"[{dead}" in report["error"] and "left the job" in report["error"], report["error"]
        assert f"rank {dead}: its process ended" in report["error"], report["error"]
        assert report["time"] - killed["time"] < 15, f"rank {rank} took {report['time'] - killed['time']:.1f}s"
        assert report["threads"] == [], report
        supervisors.add(report["supervisor_pid"])
    assert len(supervisors) == 1
    (pid,) = supervisors
    deadline = time.monotonic() + 10
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not process_alive(pid), "the supervisor outlived every rank of its job"


def test_a_rank_that_fails_while_the_ranks_are_aligned_is_named_to_the_others_at_once(tmp_path):
    # rank 1 fails in validation (no asynchronous phase to interrupt): it still leaves the session, so
    # rank 0 learns of it at its next batch instead of waiting for it at the epoch's end until the timeout
    args = ["--strategy", "partial_reduce", "--group-size", "2", "--epochs", "3", "--step-time", "0.02"]
    codes, logs = run_external_ranks(tmp_path, 2, *args, "--raise-in-validation-rank", "1", "--grouping-timeout", "60")
    assert codes == [3, 0], (codes, logs[0][-3000:])
    failed = json.loads((tmp_path / "result.rank1.json").read_text())
    assert "injected failure in validation on rank 1" in failed["error"]
    other = json.loads((tmp_path / "result.rank0.json").read_text())
    assert "rank [1] left the job" in other["error"] and "rank 1: it stopped after an error" in other["error"], other
    assert other["time"] - failed["time"] < 15


@pytest.mark.parametrize(
    "stop",
    [["--timer", "2.5"], ["--module-stop-rank", "1", "--module-stop-batch", "10"]],
    ids=["timer", "module-on-one-rank"],
)
def test_a_stop_decided_on_one_rank_is_taken_by_every_rank_at_the_same_point(tmp_path, stop):
    proc, result = run_training(
        tmp_path, "--strategy", "prague", "--devices", "4", "--epochs", "40", "--step-time", "0.02", *stop
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CoordinationTimeout" not in proc.stderr and "MemberLost" not in proc.stderr
    ranks = rank_results(tmp_path) + [result]
    assert len(ranks) == 4
    assert result["epochs_run"] < 39, "the stop came before max_epochs"
    assert {(r["epochs_run"], r["global_step"]) for r in ranks} == {(result["epochs_run"], result["global_step"])}
    assert all(r["should_stop"] for r in ranks)
    assert len({round(r["params_checksum"], 4) for r in ranks}) == 1, "every rank stopped with the consensus model"
    supervisor = result.get("supervisor_pid")
    assert supervisor and not process_alive(supervisor), "the supervisor outlived the job"


@pytest.mark.parametrize("strategy", ["prague", "adpsgd"])
def test_a_users_all_reduce_on_the_world_group_in_every_step_neither_hangs_nor_mixes_with_ours(tmp_path, strategy):
    # equal batch counts per rank (a user's per-step collective needs them), our exchanges in threads meanwhile
    proc, result = run_training(
        tmp_path, "--strategy", strategy, "--devices", "4", "--epochs", "2", "--step-time", "0.02",
        "--user-allreduce", "--limit-train-batches", "6",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = [json.loads((tmp_path / f"result.allreduce{r}.json").read_text()) for r in range(4)]
    for s in sums:
        assert s["sums"] == [4.0] * 12, "the user's all-reduce saw every rank's tensor, nothing of ours"
    ranks = rank_results(tmp_path) + [result]
    assert len({round(r["params_checksum"], 4) for r in ranks}) == 1, "our averages agree on every rank"
    assert result["exchanges"] > 0 and result["val_acc"] > 0.5
