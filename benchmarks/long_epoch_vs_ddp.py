"""One long epoch, no validation, a 5x straggler: how close each strategy comes to the physical limit.

    python benchmarks/long_epoch_vs_ddp.py                          # 8 workers, 800 batches, 50 ms steps
    python benchmarks/long_epoch_vs_ddp.py --devices 16 --batches 1600 --step-time 0.1

The digits bench (`lightning-prague bench`) has short epochs: 45 batches of 32, validated after
each, so its per-epoch costs (validation, the synchronization point, the last batches in flight)
weigh as much as the training itself. This benchmark removes them to show the other end: a small
MLP on synthetic data, one epoch of `--batches` batches of 16, `limit_val_batches=0`, every step
stretched to `--step-time` by `SlowdownInjector` (rank 0 `--slow-factor` times slower). Each
strategy runs in a process of its own (its ranks forked from it); the time is rank 0's, from the
start to the end of training. The limit is the sum of the workers' speeds, against DDP, which
runs at the straggler's pace.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, Strategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_prague.callbacks import SlowdownInjector
from lightning_prague.strategies import STRATEGIES

BATCH = 16


class SmallMLP(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class TrainingTime(L.Callback):
    """Prints rank 0's training time as the line the parent process reads."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.monotonic()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_rank == 0:
            print(f"TRAIN_SECONDS {time.monotonic() - self.start:.3f}", flush=True)


def make_strategy(name: str) -> Strategy:
    if name == "ddp":
        return DDPStrategy(start_method="fork")
    return STRATEGIES[name][0](start_method="fork")


def train(args: argparse.Namespace) -> None:
    """One fit of `args.strategy` (run in a process of its own by `main`)."""
    generator = torch.Generator().manual_seed(0)
    size = args.batches * BATCH
    data = TensorDataset(torch.randn(size, 32, generator=generator), torch.randint(0, 10, (size,), generator=generator))
    slowdown = SlowdownInjector(
        step_time=args.step_time, profile="straggler", slow_ranks=[0], slow_factor=args.slow_factor
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=make_strategy(args.strategy),
        max_epochs=1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
        callbacks=[slowdown, TrainingTime()],
    )
    trainer.fit(SmallMLP(), DataLoader(data, batch_size=BATCH, shuffle=True))


def measure(strategy: str, args: argparse.Namespace) -> float:
    command = [sys.executable, __file__, "--run", strategy, "--devices", str(args.devices)]
    command += [
        "--batches",
        str(args.batches),
        "--step-time",
        str(args.step_time),
        "--slow-factor",
        str(args.slow_factor),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("TRAIN_SECONDS ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{strategy} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return float(lines[-1].split()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["prague", "partial_reduce", "adpsgd"])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--batches", type=int, default=800, help="batches in the epoch (all workers together)")
    parser.add_argument("--step-time", type=float, default=0.05, help="simulated seconds per step of a fast worker")
    parser.add_argument("--slow-factor", type=float, default=5.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: train one strategy in this process
    args = parser.parse_args(argv)
    problems = []
    if args.devices < 2:
        problems.append(f"--devices {args.devices}: at least 2 workers")
    if args.batches < args.devices:
        problems.append(f"--batches {args.batches}: at least one per worker ({args.devices})")
    if args.step_time <= 0 or args.slow_factor < 1:
        problems.append("--step-time must be positive and --slow-factor at least 1")
    unknown = [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        problems.append(f"--strategies: unknown {unknown}; choose from {sorted(STRATEGIES)}")
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run:
        train(argparse.Namespace(**{**vars(args), "strategy": args.run}))
        return
    fast = args.devices - 1
    limit_vs_ddp = (fast + 1 / args.slow_factor) / (args.devices / args.slow_factor)  # step times alone
    ddp = measure("ddp", args)
    print(
        f"{args.devices} workers, {args.batches} batches, {args.step_time * 1000:.0f} ms steps, rank 0 at "
        f"{args.slow_factor:g}x; physical limit {limit_vs_ddp:.2f}x DDP (step times alone)"
    )
    print("| strategy | train (s) | vs DDP | of the limit |")
    print("|---|---|---|---|")
    print(f"| ddp | {ddp:.2f} | 1.00x | |")
    ideal = args.batches / (fast / args.step_time + 1 / (args.step_time * args.slow_factor))
    for strategy in args.strategies:
        seconds = measure(strategy, args)
        print(f"| {strategy} | {seconds:.2f} | {ddp / seconds:.2f}x | {ideal / seconds:.0%} |", flush=True)


if __name__ == "__main__":
    main()
