"""Fixtures shared by the end-to-end training tests."""

from __future__ import annotations

import pytest
from helpers import run_training

#: 4 CPU workers, 40 ms steps, rank 0 slowed 5x, 4 epochs of digits
STRAGGLER = ["--devices", "4", "--epochs", "4", "--profile", "straggler", "--slow-factor", "5", "--step-time", "0.04"]


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory):
    """Lightning's DDP on the straggler workload: the accuracy the asynchronous strategies must match."""
    proc, result = run_training(tmp_path_factory.mktemp("ddp"), "--strategy", "ddp", *STRAGGLER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result
