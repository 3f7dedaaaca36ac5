"""The demo's side-by-side comparison: its table and its argument checks (the demo itself runs in CI)."""

from __future__ import annotations

import pytest

from lightning_prague.demo.compare import describe, format_comparison, parse_args
from lightning_prague.demo.run import parse_args as run_args


def test_the_table_puts_the_runs_side_by_side_with_the_speed_up_over_the_first():
    results = {
        "ddp": {"train_seconds": 12.0, "val_acc": 0.95, "batches_per_worker": [48, 48, 48, 48]},
        "prague": {"train_seconds": 4.0, "val_acc": 0.9512, "batches_per_worker": [9, 57, 58, 56]},
    }
    lines = format_comparison(results).splitlines()
    assert lines[0].split() == ["ddp", "prague"]
    assert lines[1].startswith("training time") and "12.0 s" in lines[1] and "4.0 s (3.0x faster)" in lines[1]
    assert "0.950" in lines[2] and "0.951" in lines[2]
    assert "48 48 48 48" in lines[3] and "9 57 58 56" in lines[3]
    slower = {**results, "prague": {**results["prague"], "train_seconds": 20.0}}
    assert "faster" not in format_comparison(slower), "no speed-up is claimed for a slower run"


def test_workload_line_and_options_checked_before_any_run(capsys):
    assert describe(run_args([])) == "digits, 4 CPU workers, worker 0 slowed down 5x, 4 epochs"
    args, rest = parse_args(["--strategy", "adpsgd", "--epochs", "2", "--baseline", "none"])
    assert (args.strategy, args.baseline, rest) == ("adpsgd", "none", ["--epochs", "2"])
    with pytest.raises(SystemExit):
        parse_args(["--profile", "sluggish"])
    assert "invalid choice: 'sluggish'" in capsys.readouterr().err
