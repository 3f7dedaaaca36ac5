"""Fixtures shared by the end-to-end training tests."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import SCRIPTS, env

#: 4 CPU workers, 40 ms steps, rank 0 slowed 5x, 4 epochs of digits
STRAGGLER = ["--devices", "4", "--epochs", "4", "--profile", "straggler", "--slow-factor", "5", "--step-time", "0.04"]
#: the straggler workload's runs, with each strategy's options
STRAGGLER_RUNS = {
    "ddp": [],
    "prague": [],
    "partial_reduce": ["--weighting", "staleness"],
    "adpsgd": [],
    "decent_adam": [],
}


@dataclass
class TrainingRun:
    """One run of ``tests/scripts/train.py``: its directory, exit status, rank-0 result and output."""

    dir: Path
    status: int
    result: dict | None
    log: str


@pytest.fixture(scope="session")
def straggler_runs(tmp_path_factory) -> dict[str, TrainingRun]:
    """Every strategy and Lightning's DDP on the straggler workload, in one process (ranks forked from it)."""
    root = tmp_path_factory.mktemp("straggler")
    specs = []
    for name, extra in STRAGGLER_RUNS.items():
        (root / name).mkdir()
        specs.append({"dir": str(root / name), "args": ["--strategy", name, *extra, *STRAGGLER]})
    (root / "spec.json").write_text(json.dumps(specs))
    cmd = [sys.executable, str(SCRIPTS / "train_many.py"), str(root / "spec.json")]
    proc = subprocess.run(cmd, env=env(), cwd=root, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {}
    for name in STRAGGLER_RUNS:
        directory = root / name
        result = directory / "result.json"
        runs[name] = TrainingRun(
            directory,
            int((directory / "exit").read_text()),
            json.loads(result.read_text()) if result.exists() else None,
            (directory / "log.txt").read_text(),
        )
    return runs


@pytest.fixture(scope="session")
def ddp_reference(straggler_runs):
    """Lightning's DDP on the straggler workload: the accuracy the asynchronous strategies must match."""
    run = straggler_runs["ddp"]
    assert run.status == 0, run.log[-3000:]
    return run.result
