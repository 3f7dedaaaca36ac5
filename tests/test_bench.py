"""`lightning-prague bench` end to end with tiny sizes: valid JSON, CSV and PNG, one row per strategy and profile."""

from __future__ import annotations

import argparse
import csv
import json

import pytest
from helpers import ROOT, env, run_forked

from lightning_prague.tools.bench import add_predictions
from lightning_prague.tools.results import FIELDS

pytestmark = pytest.mark.timeout(300)


def test_bench_quick_preset_runs_end_to_end_and_writes_valid_outputs(tmp_path):
    out = tmp_path / "out"
    argv = [
        "bench", "--preset", "quick", "--out", str(out), "--devices", "2", "--epochs", "1", "--step-time", "0.005",
        "--strategies", "prague", "--profiles", "straggler",
    ]  # fmt: skip
    # `python -m lightning_prague.cli ...`, forked from this process (which has imported Lightning)
    proc = run_forked("lightning_prague.cli", argv, env(), ROOT, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/2] straggler / ddp" in proc.stdout and "samples/s" in proc.stdout, proc.stdout

    rows = json.loads((out / "bench.json").read_text())
    assert [(r["strategy"], r["profile"]) for r in rows] == [("ddp", "straggler"), ("prague", "straggler")]
    for row in rows:
        assert set(FIELDS) <= set(row)
        assert 0 < row["throughput"] and 0 < row["predicted_throughput"]
        assert row["throughput"] <= row["limit"] * 1.05, "nothing beats the sum of the workers' speeds"
        assert 0.5 < row["final_acc"] <= 1.0
        assert 0 < row["step_seconds"] < row["train_seconds"], "validation and sync points are not steps"
    ddp, prague = rows
    assert ddp["speedup_vs_ddp"] == 1.0
    assert ddp["consensus_error"] == pytest.approx(0.0, abs=1e-12), "DDP's replicas are the same"
    assert prague["consensus_error"] > 0, "prague's replicas differ before the global average"
    # Lightning's DDP reports no waiting (its all-reduce counts as compute); prague's ranks wait at every
    # synchronization point (the fast one for the straggler), for less than the whole run
    assert ddp["sync_fraction"] == 0.0 and 0 < prague["sync_fraction"] < 1, (ddp, prague)

    with (out / "bench.csv").open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == FIELDS and len(table) == 2
    assert float(table[1]["throughput"]) == pytest.approx(rows[1]["throughput"])

    import matplotlib.image

    for name in ("accuracy_vs_time.png", "throughput_vs_limit.png"):
        image = matplotlib.image.imread(out / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_predictions_calibrate_epoch_cost_step_overhead_and_all_reduce_from_the_first_ddp_run():
    args = argparse.Namespace(devices=4, epochs=2, step_time=0.05, slow_factor=5.0, sigma=0.5, seed=0)
    steps, allreduce, host, per_epoch = 10, 0.004, 0.008, 0.1  # per worker; seconds
    step_seconds = steps * (args.step_time + host + allreduce)
    rows = [
        {"strategy": "ddp", "profile": "homogeneous", "batches": 4 * steps, "throughput": 100.0,
         "step_seconds": step_seconds, "train_seconds": step_seconds + args.epochs * per_epoch,
         "measured_allreduce_seconds": allreduce},
        {"strategy": "prague", "profile": "homogeneous", "batches": 4 * steps, "throughput": 100.0,
         "step_seconds": 0.5, "train_seconds": 0.8},
    ]  # fmt: skip
    add_predictions(rows, args)
    ddp, prague = rows
    assert ddp["overhead_per_epoch"] == pytest.approx(per_epoch)
    assert ddp["allreduce_seconds"] == pytest.approx(allreduce, rel=1e-3)
    assert ddp["step_overhead"] == pytest.approx(host, rel=1e-3), "DDP's step beyond compute and all-reduce"
    assert ddp["predicted_throughput"] == pytest.approx(ddp["throughput"], rel=1e-3), "DDP's own run is reproduced"
    # prague pays the host time every step; its groups of 3 (4/6 of the world's all-reduce) hide behind the steps;
    # each epoch's synchronization point also waits for the steps in flight (less than one step)
    step = args.step_time + host
    fastest = steps * step + args.epochs * per_epoch
    predicted_seconds = 100.0 * 0.8 / prague["predicted_throughput"]
    assert fastest < predicted_seconds < fastest + args.epochs * step

    del rows[0]["measured_allreduce_seconds"]  # a result without the timing: all of it is the all-reduce
    add_predictions(rows, args)
    assert rows[0]["allreduce_seconds"] == pytest.approx(allreduce + host, rel=1e-3) and rows[0]["step_overhead"] == 0


def test_bench_arguments_are_checked_before_any_run(capsys):
    from lightning_prague.tools.bench import parse_args

    for argv, expected in [
        (["--strategies", "pragu"], "invalid choice: 'pragu'"),
        (["--profiles", "slow"], "invalid choice: 'slow'"),
        (["--devices", "1"], "at least 2 workers"),
        (["--devices", "4", "--group-size", "5"], "between 2 and --devices (4)"),
        (["--epochs", "0"], "at least one epoch"),
        (["--step-time", "-1"], "must be positive"),
    ]:
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        assert stop.value.code == 2 and expected in capsys.readouterr().err, argv
    args = parse_args(["--devices", "2", "--strategies", "prague", "prague"])
    assert args.group_size == 2 and args.strategies == ["ddp", "prague"], "defaults fit the worker count"


def test_a_failing_run_stops_the_bench_with_the_end_of_its_output(tmp_path, monkeypatch):
    from lightning_prague.demo import run as demo_run
    from lightning_prague.tools import bench

    def broken(argv, extra_callbacks=None):
        print("training started")
        raise RuntimeError("rank 2 lost its group")

    monkeypatch.setattr(demo_run, "main", broken)
    args = bench.parse_args(["--out", str(tmp_path), "--devices", "2"])
    with pytest.raises(RuntimeError) as failure:
        bench.run_one("prague", "straggler", args)
    message = str(failure.value)
    assert "bench run prague/straggler failed (exit status 1)" in message
    assert "training started" in message and "rank 2 lost its group" in message, "the run's own output is shown"
    assert (tmp_path / "logs" / "straggler-prague" / "log.txt").exists()
