"""Step-based training (issue 11) under the work-queue strategies, with a 5x slow worker.

Each run launches 4 forked ranks of ``scripts/steps.py`` and checks several promises at once:
the step budget is honoured exactly, validation and checkpoints happen at the promised global steps
on every rank with one model and one learning rate, no sample is trained twice in an epoch, a
resumed fit continues exactly, and a streaming epoch ends when the first stream does.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.helpers import TrainingRun, rank_results, run_many
from tests.scripts.steps import lr_factor

pytestmark = pytest.mark.timeout(240)
WORLD = 4


RUNS = {
    "budget": ["--strategy", "partial_reduce", "--samples", "192", "--batch-size", "4", "--max-steps", "30"]
    + ["--val-every", "7", "--checkpoint-every", "10"],
    # prague to step 15 (a checkpoint mid-epoch), then a new fit resumed from it to step 30
    "first": ["--strategy", "prague", "--samples", "192", "--checkpoint-every", "15", "--val-every", "7"]
    + ["--max-steps", "15"],
    "resumed": ["--strategy", "prague", "--samples", "192", "--checkpoint-every", "15", "--val-every", "7"]
    + ["--max-steps", "30"],
    # the same checkpoint, resumed on 3 workers (a worker lost for good, or a smaller allocation)
    "resumed_on_3": ["--strategy", "prague", "--samples", "192", "--checkpoint-every", "15", "--val-every", "7"]
    + ["--max-steps", "30"],
    # every rank reads its own stream of 50 samples (13 batches, one DataLoader worker process each);
    # manual optimization: the module steps its scheduler once per batch, as it would under DDP
    "stream": ["--strategy", "adpsgd", "--streaming", "--samples", "200", "--num-workers", "1", "--max-steps", "30"]
    + ["--val-every", "5", "--checkpoint-every", "0", "--manual", "--lr", "0.05"],
}


def devices(name: str) -> int:
    return 3 if name == "resumed_on_3" else WORLD


@pytest.fixture(scope="module")
def step_runs(tmp_path_factory) -> dict[str, TrainingRun]:
    """Every run of this module, one after the other in one process (4 ranks forked from it each)."""
    root = tmp_path_factory.mktemp("steps")
    ckpt = root / "ckpt"
    extra = {
        "first": ["--checkpoint-dir", str(ckpt)],
        "resumed": ["--checkpoint-dir", str(ckpt), "--resume", str(ckpt / "step=15.ckpt")],
        # (from a copy that says the epoch's last batch was reached, as a checkpoint at the budget once did)
        "resumed_on_3": ["--checkpoint-dir", str(root / "ckpt3"), "--resume", str(ckpt / "step=15.ckpt")]
        + ["--resume-as-last-batch"],
    }
    runs = {
        name: (
            "steps.py",
            ["--json", str(root / name / "result.json"), "--devices", str(devices(name)), *args, *extra.get(name, [])],
        )
        for name, args in RUNS.items()
    }
    return run_many(root, runs)


def outcome(step_runs: dict[str, TrainingRun], name: str) -> tuple[list[dict], dict]:
    run = step_runs[name]
    assert run.status == 0, run.log[-4000:]
    ranks = rank_results(run.dir)
    assert [r["rank"] for r in ranks] == list(range(devices(name)))
    return ranks, run.result


def trained(ranks: list[dict]) -> list[tuple[int, int]]:
    return [(epoch, index) for r in ranks for epoch, index in r["trained"]]


def assert_agree_at_synchronization_points(ranks: list[dict]) -> None:
    first = ranks[0]["validations"]
    for r in ranks[1:]:
        assert [v["step"] for v in r["validations"]] == [v["step"] for v in first]
        for mine, theirs in zip(r["validations"], first):
            assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-9)
            assert mine["weights"] == pytest.approx(theirs["weights"], rel=1e-5, abs=1e-6)


def test_max_steps_validation_and_checkpoints_run_on_global_steps(step_runs):
    ranks, main = outcome(step_runs, "budget")
    samples = trained(ranks)
    # the budget: 30 steps of 4 workers, as under DDP, whoever trained them
    assert len(samples) == 30 * WORLD * 4
    assert all(r["global_step"] == 30 and r["stepping_batches"] == 30 for r in ranks)
    # validation every 7 global steps, checkpoints every 10, on every rank at the same moment
    assert [v["step"] for v in ranks[0]["validations"]] == [7, 14, 21, 28]
    assert_agree_at_synchronization_points(ranks)
    assert main["checkpoints"] == ["step=10.ckpt", "step=20.ckpt", "step=30.ckpt"]
    # two full epochs of 48 batches and part of a third; nothing trained twice in an epoch
    per_epoch = Counter(epoch for epoch, _ in samples)
    assert per_epoch[0] == per_epoch[1] == 192 and len(set(samples)) == len(samples)
    # the fast workers took more of the work than the 5x slower one
    batches = [len(r["trained"]) for r in ranks]
    assert max(batches[:-1]) > batches[-1] and min(batches[:-1]) > batches[-1]


def test_each_rank_learns_its_last_batch_of_an_epoch_after_training_it(step_runs):
    """The work queue's fetcher looks for the next batch after a batch's step (`StepFirstFetcher`), so a
    claim parked at the emptied queue never holds an untrained batch back; Lightning still learns which
    batch ended each epoch before that batch's hooks, validation and epoch end run."""
    ranks, _ = outcome(step_runs, "budget")
    for r in ranks:
        assert r["fetcher"] == "StepFirstFetcher"
        for epoch in (0, 1):  # the two whole epochs (the third ends at the step budget)
            ends = [[index, last] for e, index, last in r["batch_ends"] if e == epoch]
            assert ends, f"rank {r['rank']} trained no batch of epoch {epoch}"
            assert [index for index, _ in ends] == list(range(len(ends)))
            assert [last for _, last in ends] == [False] * (len(ends) - 1) + [True], (r["rank"], epoch)


def test_a_fit_resumed_mid_epoch_continues_where_it_stopped(step_runs):
    ranks_a, _ = outcome(step_runs, "first")
    ranks_b, main = outcome(step_runs, "resumed")
    samples = trained(ranks_a) + trained(ranks_b)
    # step 15 is 60 batches, inside the second epoch (48 batches each): exactly the missing ones follow
    assert len(samples) == len(set(samples)) == 30 * WORLD * 4
    assert Counter(epoch for epoch, _ in samples) == {0: 192, 1: 192, 2: 96}
    assert all(r["global_step"] == 30 for r in ranks_b)
    assert [v["step"] for v in ranks_b[0]["validations"]] == [21, 28]
    assert_agree_at_synchronization_points(ranks_b)
    assert main["checkpoints"] == ["step=15.ckpt", "step=30.ckpt"]


def test_a_fit_resumed_on_fewer_workers_continues_exactly_where_it_stopped(step_runs):
    ranks_a, _ = outcome(step_runs, "first")
    ranks_b, main = outcome(step_runs, "resumed_on_3")
    samples = trained(ranks_a) + trained(ranks_b)
    # 15 steps of 4 workers (60 batches: epoch 0 and 12 batches of epoch 1), then 15 steps of 3 workers
    # (45 batches), as DDP resumed on 3 would: the rest of epoch 1 exactly once, then 9 batches of epoch 2.
    # Its checkpoint says the epoch's last batch was reached (Lightning's fetcher looks a batch ahead, and at
    # the step budget the loader holds a batch back): the epoch still goes on where the work queue stood
    assert len(samples) == len(set(samples)) == (15 * WORLD + 15 * 3) * 4
    assert Counter(epoch for epoch, _ in samples) == {0: 192, 1: 192, 2: 36}
    assert all(r["global_step"] == 30 for r in ranks_b)
    # validation every 7 steps and checkpoints every 15 go on at the same global steps
    assert [v["step"] for v in ranks_b[0]["validations"]] == [21, 28]
    assert_agree_at_synchronization_points(ranks_b)
    assert main["checkpoints"] == ["step=30.ckpt"]


def test_streaming_epochs_end_with_the_first_stream_and_the_budget_holds(step_runs):
    ranks, _ = outcome(step_runs, "stream")
    batches = sum(-(-len([s for s in r["trained"] if s[0] == e]) // 4) for r in ranks for e in range(10))
    assert batches <= 30 * WORLD  # epochs are rounded up to whole steps, as DDP pads them
    samples = trained(ranks)
    assert len(set(samples)) == len(samples)  # no sample twice in one epoch
    epochs = Counter(epoch for epoch, _ in samples)
    # an epoch ends when the first stream ends: nobody waits for the slow worker to read all of its own
    assert len(epochs) >= 3 and all(count < 200 for count in list(epochs.values())[:-1])
    assert all(r["global_step"] == 30 for r in ranks)
    assert [v["step"] for v in ranks[0]["validations"]] == [5, 10, 15, 20, 25, 30]
    assert_agree_at_synchronization_points(ranks)
    # the LR is the schedule's value at the global step, although fast workers stepped it more often
    for validation in ranks[0]["validations"]:
        assert validation["lr"] == pytest.approx(0.05 * lr_factor(validation["step"], 30), rel=1e-9)
