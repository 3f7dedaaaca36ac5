"""The same training with DDP and with one of our strategies, under a slow worker, side by side.

    python examples/digits_demo.py                              # DDP, then prague
    python examples/digits_demo.py --strategy partial_reduce    # DDP, then partial_reduce
    python examples/digits_demo.py --baseline none              # prague alone

Each run is `lightning_prague.demo.run` (every option of it applies to both runs, see `--help`)
with its worker processes forked from this one, so Lightning is imported once. Their output goes
to log files; the console shows a progress bar per run and, at the end, one table: training time,
validation accuracy and batches per worker of each run.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from tqdm import tqdm

from lightning_prague.demo import run as single_run


class TerminalProgress(L.Callback):
    """Rank 0 draws the run's progress (the global step, as DDP would count it) on the terminal,
    through a file descriptor that the run's captured output does not touch."""

    def __init__(self, terminal_fd: int, label: str) -> None:
        self.terminal_fd = terminal_fd
        self.label = label
        self._bar: tqdm | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            terminal = os.fdopen(os.dup(self.terminal_fd), "w")
            total = int(trainer.estimated_stepping_batches)
            interval = 0.25 if terminal.isatty() else 2.0  # a log file gets a line every few seconds
            self._bar = tqdm(total=total, desc=f"{self.label:<15}", unit="step", file=terminal, mininterval=interval)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self._bar is not None:
            self._bar.update(max(0, min(trainer.global_step, self._bar.total) - self._bar.n))

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._bar is not None and "val_acc" in trainer.callback_metrics:
            self._bar.set_postfix_str(f"val_acc={float(trainer.callback_metrics['val_acc']):.3f}")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._bar is not None:
            self._bar.update(self._bar.total - self._bar.n)
            self._bar.close()
            self._bar.fp.close()
            self._bar = None


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Every other option is passed to both runs: see python -m lightning_prague.demo.run --help.",
    )
    parser.add_argument("--strategy", default="prague", help="the strategy to compare (default: prague)")
    parser.add_argument("--baseline", default="ddp", help="run this first for comparison; 'none' to skip")
    parser.add_argument("--logs", type=Path, help="directory for the runs' output (default: a new temporary one)")
    args, rest = parser.parse_known_args(argv)
    if "--help" in rest or "-h" in rest:
        parser.print_help()
        raise SystemExit(0)
    # every option of the runs checked before the first one starts
    args.run_options = single_run.parse_args(["--strategy", args.strategy, *rest])
    return args, rest


def describe(options: argparse.Namespace) -> str:
    """One line on the workload: workers, slowdown, epochs."""
    slow = ", ".join(str(r) for r in options.slow_ranks or [0])
    slowdown = {
        "straggler": f"worker {slow} slowed down {options.slow_factor:g}x",
        "jitter": f"every step jittered (lognormal sigma {options.sigma:g})",
        "periodic": f"worker {slow} {options.slow_factor:g}x slower {options.duty:.0%} of the time",
        "homogeneous": "no slow worker",
    }[options.profile]
    epochs = f"{options.epochs} epoch{'s' if options.epochs != 1 else ''}"
    return f"digits, {options.devices} CPU workers, {slowdown}, {epochs}"


def format_comparison(results: dict[str, dict[str, Any]]) -> str:
    """The runs side by side: training time (and speed-up over the first), accuracy, batches per worker."""
    names = list(results)
    first = results[names[0]]["train_seconds"]
    cells: dict[str, list[str]] = {"training time": [], "validation accuracy": [], "batches per worker": []}
    for name in names:
        result = results[name]
        seconds = result["train_seconds"]
        speedup = f" ({first / seconds:.1f}x faster)" if name != names[0] and seconds < first else ""
        cells["training time"].append(f"{seconds:.1f} s{speedup}")
        cells["validation accuracy"].append(f"{result['val_acc']:.3f}")
        cells["batches per worker"].append(" ".join(str(b) for b in result["batches_per_worker"]))
    width = max(24, *(len(c) + 3 for column in cells.values() for c in column))
    lines = [f"{'':<20}" + "".join(f"{name:<{width}}" for name in names)]
    for label, column in cells.items():
        lines.append(f"{label:<20}" + "".join(f"{c:<{width}}" for c in column))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    args, rest = parse_args(argv)
    torch.set_num_threads(1)  # the forked workers inherit it: one compute thread each
    options = args.run_options
    logs = args.logs or Path(tempfile.mkdtemp(prefix="lightning-prague-demo-"))
    names = [args.strategy] if args.baseline == "none" else [args.baseline, args.strategy]
    print(describe(options), flush=True)
    terminal = os.dup(sys.stderr.fileno())
    results = {}
    try:
        for name in names:
            progress = [TerminalProgress(terminal, name)]
            try:
                results[name] = single_run.run_logged(
                    [*rest, "--strategy", name], logs / name, f"the {name} run", progress
                )
            except RuntimeError as failure:
                raise SystemExit(str(failure)) from None
    finally:
        os.close(terminal)
    print()
    print(format_comparison(results))
    print(f"\nfull output of each run: {logs}/<strategy>/log.txt", flush=True)
    return results
