"""Fixtures shared by the end-to-end training tests."""

from __future__ import annotations

import pytest
from helpers import TrainingRun, run_many

#: 4 CPU workers, 40 ms steps, rank 0 slowed 5x, 4 epochs of digits
STRAGGLER = ["--devices", "4", "--epochs", "4", "--profile", "straggler", "--slow-factor", "5", "--step-time", "0.04"]
#: the straggler workload's runs, with each strategy's options
STRAGGLER_RUNS = {
    "ddp": [],
    "prague": ["--sync-dist-train-loss"],  # a per-step collective: the strategy warns and logs locally
    "partial_reduce": ["--weighting", "staleness"],
    "adpsgd": [],
    "decent_adam": [],
}


@pytest.fixture(scope="session")
def straggler_runs(tmp_path_factory) -> dict[str, TrainingRun]:
    """Every strategy and Lightning's DDP on the straggler workload, in one process (ranks forked from it)."""
    root = tmp_path_factory.mktemp("straggler")
    runs = {
        name: ("train.py", ["--json", str(root / name / "result.json"), "--strategy", name, *extra, *STRAGGLER]
               + ["--start-method", "fork"])
        for name, extra in STRAGGLER_RUNS.items()
    }  # fmt: skip
    return run_many(root, runs)


@pytest.fixture(scope="session")
def ddp_reference(straggler_runs):
    """Lightning's DDP on the straggler workload: the accuracy the asynchronous strategies must match."""
    run = straggler_runs["ddp"]
    assert run.status == 0, run.log[-3000:]
    return run.result
