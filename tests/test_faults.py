"""A stop decided on one rank, and users' own collectives, in real processes.

A stop decided on one rank (Timer, the module itself) is taken by every rank at the same
synchronization point; a user's collective on the world group runs beside our exchanges, which use
a process group of their own. (Lost workers: `test_survivors.py`.)
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import process_alive, rank_results, run_training

pytestmark = pytest.mark.timeout(240)

WORKLOAD = ["--epochs", "40", "--step-time", "0.03", "--group-size", "2"]


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
    assert len({r["params_sha256"] for r in ranks}) == 1, "every rank stopped with the consensus model (bitwise)"
    # the supervisor ends itself once the last rank's connection closed (it looks every 50 ms): the job's
    # command can return a moment before it is gone
    supervisor = result.get("supervisor_pid")
    deadline = time.monotonic() + 10
    while supervisor and process_alive(supervisor) and time.monotonic() < deadline:
        time.sleep(0.05)
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
    assert len({r["params_sha256"] for r in ranks}) == 1, "our averages agree on every rank (bitwise)"
    assert result["exchanges"] > 0 and result["val_acc"] > 0.5
