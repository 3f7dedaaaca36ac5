"""`lightning-prague bench` end to end with tiny sizes: valid JSON, CSV and PNG, one row per strategy and profile."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from helpers import ROOT, env

from lightning_prague.bench import FIELDS

pytestmark = pytest.mark.timeout(300)


def test_bench_quick_preset_runs_end_to_end_and_writes_valid_outputs(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "lightning_prague.cli", "bench", "--preset", "quick", "--out", str(out),
        "--devices", "2", "--epochs", "1", "--step-time", "0.005", "--strategies", "prague",
        "--profiles", "straggler",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/2] straggler / ddp" in proc.stdout and "samples/s" in proc.stdout, proc.stdout

    rows = json.loads((out / "bench.json").read_text())
    assert [(r["strategy"], r["profile"]) for r in rows] == [("ddp", "straggler"), ("prague", "straggler")]
    for row in rows:
        assert set(FIELDS) <= set(row)
        assert 0 < row["throughput"] and 0 < row["predicted_throughput"]
        assert row["throughput"] <= row["limit"] * 1.05, "nothing beats the sum of the workers' speeds"
        assert 0.0 <= row["sync_fraction"] <= 1.0 and row["consensus_error"] >= 0.0
        assert 0.5 < row["final_acc"] <= 1.0
    assert rows[0]["speedup_vs_ddp"] == 1.0 and rows[0]["consensus_error"] < 1e-12, "DDP's replicas are identical"
    assert rows[1]["consensus_error"] > 0, "prague's replicas differ before the global average"

    with (out / "bench.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == FIELDS and len(table) == 2
    assert float(table[1]["throughput"]) == pytest.approx(rows[1]["throughput"])

    import matplotlib.image

    for name in ("accuracy_vs_time.png", "throughput_vs_limit.png"):
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
