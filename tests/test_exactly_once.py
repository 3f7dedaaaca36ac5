"""Every batch of an epoch is trained exactly once by the job's members, whoever is lost and when.

Real processes, real kill -9: each rank writes the samples of every batch it trained (after its
optimizer step, `scripts/samples.py`), and the samples an epoch trained over all ranks, the lost
ones' included, must be the training set, each sample as often as it occurs in it. Rank 2 dies at
its first step (its set-aside chunk and its prefetched claim go back to the queue), rank 1 right
after a step it trained (that batch must not be trained again), rank 4 in the middle of the epoch,
and rank 3 in its last step of the first epoch: it trains a batch while its claim for the next one
waits at the emptied queue, and dies a second later (the claims there wait for the batch it holds,
and rank 0 trains it).
The control plane's side is unit-tested in `test_work_ledger.py`.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from helpers import run_external_ranks

import lightning_prague.demo.run  # noqa: F401  (imported once here: the ranks are forked from this process)

pytestmark = pytest.mark.timeout(200)

FAULTS = {2: "1:kill", 1: "5:kill-after-step", 4: "7:kill", 3: "2:kill-at-queue-end"}


def trained_samples(tmp_path, world: int) -> tuple[Counter, dict[int, Counter], Counter]:
    """The training set, the samples every epoch trained over all ranks, and each rank's batch count."""
    dataset = Counter(json.loads((tmp_path / "dataset.json").read_text()))
    trained: dict[int, Counter] = {0: Counter(), 1: Counter()}
    by_rank: Counter = Counter()
    for rank in range(world):
        path = tmp_path / f"samples.rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            record = json.loads(line)
            trained[record["epoch"]].update(record["samples"])
            by_rank[rank] += 1
    return dataset, trained, by_rank


def assert_every_sample_once(dataset: Counter, trained: dict[int, Counter]) -> None:
    for epoch, samples in trained.items():
        assert samples == dataset, (
            epoch,
            "lost:",
            sum((dataset - samples).values()),
            "twice:",
            sum((samples - dataset).values()),
        )


@pytest.mark.parametrize("strategy", ["prague", "adpsgd"])
def test_no_batch_is_lost_or_trained_twice_when_ranks_die(tmp_path, strategy):
    args = ["--strategy", strategy, "--epochs", "2", "--step-time", "0.05", "--record-samples"]
    for rank, fault in FAULTS.items():
        args += ["--fault", f"{rank}:{fault}"]
    codes, logs = run_external_ranks(tmp_path, 5, *args, timeout=150)
    assert codes[0] == 0, (codes, logs[0][-3000:])
    assert codes[3] == -9 and (tmp_path / "fault.3.json").exists(), "rank 3 died in its last step of an epoch"
    dataset, trained, by_rank = trained_samples(tmp_path, 5)
    assert by_rank[1] == 5, by_rank  # it trained five batches and died after the fifth
    assert_every_sample_once(dataset, trained)


def test_a_hung_ranks_batches_are_trained_by_the_others_after_they_emptied_the_queue(tmp_path):
    """Rank 3 hangs early in the first epoch; the others empty the queue long before it is found
    hung, and their claims at the queue's end wait for it. Once it is fenced, its batches go to them.
    Blocking prague: its random groups draw ranks that wait at the queue's end, which serve them
    (without that, their peers would wait for them, and they for their peers, until a timeout).
    Rank 5 dies at a synchronization point (in the first epoch's validation): the second epoch,
    which still counts it among its members, hands its set-aside batch to the others."""
    args = ["--strategy", "prague", "--no-overlap", "--epochs", "2", "--step-time", "0.05", "--record-samples"]
    args += ["--grouping-timeout", "30", "--hang-timeout", "2", "--fault", "3:2:hang"]
    args += ["--fault", "5:3:kill-in-validation"]
    codes, logs = run_external_ranks(tmp_path, 6, *args, timeout=150)
    for rank in (0, 1, 2, 4):
        assert codes[rank] == 0, (rank, codes, logs[rank][-3000:])
    dataset, trained, by_rank = trained_samples(tmp_path, 6)
    assert by_rank[3] == 1, by_rank  # it trained one batch, then hung in its second
    result = json.loads((tmp_path / "result.json").read_text())
    assert sorted(result["lost_workers"]) == ["3", "5"], result["lost_workers"]
    assert_every_sample_once(dataset, trained)
