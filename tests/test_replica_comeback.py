"""A lost replica comes back whole (issue 50): both ranks of a replica start again and rejoin the fit
together, while the other replicas train on.

Two real jobs, run side by side: four CPU workers under the strategy's launcher with `max_restarts=1`
(forked ranks), in replicas of 2, epochs of 240 batches (the digits in batches of 6: 120 chunks of
one batch per rank of a replica), 50 ms steps: `decent_adam` at each replica's own pace (a ring of
replicas, the work queue, each rank holding the whole model), one epoch; and `prague` (random groups
of replicas, the work queue) with the model sharded over each replica (`shard=True`) over two epochs,
where each new process gets its shard from the same rank of a live replica, both of one moment. In
each, rank 3 kills itself with SIGKILL at its 20th batch; its mate, rank 2, fails at that step's
gradient average and leaves with it, saying so (a forked rank's failure reaches the strategy's
`on_exception` too). The agent starts both again. The control plane admits them together, in one
membership epoch, only once both have asked (a replica trains whole); the donor sends both the same
state (or each its shard); they make their replica's group anew on the job's store, and train the
rest of the epoch with the others, the replica's second rank following its first rank's claims,
tickets included.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers import run_demo_jobs

import lightning_prague.demo.run  # noqa: F401  (imported once here: the jobs' agents are forked from this process)

#: the digits' training samples and the batch size: 120 chunks of a batch for each rank of a replica
SAMPLES, BATCH, WORLD, REPLICA = 1438, 6, 4, 2
KILLED, MATE, KILLED_AT = 3, 2, 20  # each of the lost replica's processes trained the 19 batches before it
#: job -> (strategy, its options, epochs)
CASES = {
    "decent_adam": ("decent_adam", ["--pace", "own"], 1),
    "prague_sharded": ("prague", ["--shard"], 2),
}


def _command(job: str, out: Path) -> list[str]:
    strategy, options, epochs = CASES[job]
    command = ["--strategy", strategy, *options, "--devices", str(WORLD), "--replica-size", str(REPLICA)]
    command += ["--epochs", str(epochs), "--batch-size", str(BATCH), "--step-time", "0.05", "--profile", "homogeneous"]
    command += ["--fault", f"{KILLED}:{KILLED_AT}:kill", "--max-restarts", "1", "--hang-timeout", "10"]
    return [*command, "--start-method", "fork", "--json", str(out / "result.json")]


@pytest.fixture(scope="module")
def comeback_jobs(tmp_path_factory) -> dict[str, tuple[int | None, dict[int, dict], str, Path]]:
    """Both jobs at once: name -> (exit status, each rank's last result, the job's output, its folder)."""
    return run_demo_jobs({name: (lambda out, n=name: _command(n, out)) for name in CASES}, tmp_path_factory)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("job", list(CASES))
def test_a_lost_replica_comes_back_whole_and_every_batch_is_trained_once(comeback_jobs, job):
    status, results, output, _ = comeback_jobs[job]
    epochs = CASES[job][2]
    assert status == 0, output[-4000:]  # the agent: every rank's last process exited 0
    assert sorted(results) == list(range(WORLD)), output[-4000:]
    # admitted together, in one membership epoch, inside the epoch
    assert "ranks [2, 3] rejoined the job; members [0, 1, 2, 3]" in output, output[-4000:]
    for rank in (MATE, KILLED):
        assert f"rank {rank}: rejoined the job inside the epoch (membership epoch 1)" in output
    if "--shard" in CASES[job][1]:  # each from the live replica's rank of its own shard
        assert "received the fit's state from rank 0" in output.split(f"rank {MATE}: rejoined the job")[1][:200]
        assert "received the fit's state from rank 1" in output.split(f"rank {KILLED}: rejoined the job")[1][:200]
    # the replica's new processes got their state (their shards) of one moment: the same step
    assert results[MATE]["joined_at_step"] == results[KILLED]["joined_at_step"] >= KILLED_AT - 1, results
    # the mate left with its replica and said why (its own error is the backend's, of the gradient average)
    assert f"rank {MATE} leaves the job with its replica (ranks [2, 3]): rank(s) [{KILLED}] of it were lost" in output
    assert [results[r]["restarts"] for r in range(WORLD)] == [0, 0, 1, 1], "only the lost replica restarted"
    # the replica's new processes took the same steps, and a good part of the epoch
    assert results[MATE]["batches_this_process"] == results[KILLED]["batches_this_process"] >= 5, results
    # every batch trained once: by the survivors, the new processes, and the 19 each lost process trained
    trained = sum(results[r]["batches_this_process"] for r in results) + 2 * (KILLED_AT - 1)
    assert trained == epochs * REPLICA * math.ceil(SAMPLES / (BATCH * REPLICA)), {
        r: results[r]["batches_this_process"] for r in results
    }
    # and the fit ended on one consensus model, learned (sharded: rank i of every replica holds its same shard)
    digests = [results[r]["params_sha256"] for r in range(WORLD)]
    if "--shard" in CASES[job][1]:
        assert digests[0] == digests[2] != digests[1] == digests[3], digests
    else:
        assert len(set(digests)) == 1, digests
    assert results[0]["val_acc"] >= 0.5, results[0]["val_acc"]
