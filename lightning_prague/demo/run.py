"""One training run of the digits workload, shared by the demo script, the tests and the benchmark.

Run as `python -m lightning_prague.demo.run --strategy prague --devices 4`; every rank re-runs
this module (Lightning's launcher), rank 0 prints the result and can write it as JSON.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import lightning_prague  # noqa: F401  (registers the strategies)
from lightning_prague.callbacks import ConsensusMonitor, SlowdownInjector, StragglerMonitor, WorkerSummary
from lightning_prague.callbacks.slowdown import PROFILES
from lightning_prague.core.exchange.overlap import communication_threads
from lightning_prague.core.job import RESTARTS_VARIABLE
from lightning_prague.demo.captured import run_captured
from lightning_prague.demo.digits import OPTIMIZERS, DigitsClassifier, DigitsDataModule
from lightning_prague.demo.faults import KINDS, Fault, inject_faults
from lightning_prague.strategies.base import DecentralizedStrategy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="prague", help="prague, partial_reduce, adpsgd, decent_adam, ddp, ...")
    parser.add_argument("--devices", type=int, default=4, help="CPU worker processes")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64, help="width of the model's two hidden layers")
    parser.add_argument("--limit-train-batches", type=int, help="training batches per worker and epoch")
    parser.add_argument(
        "--epoch-repeats", type=int, default=1, help="repeat the training set this many times in each epoch"
    )
    parser.add_argument("--step-time", type=float, default=0.05, help="simulated compute time per step (s)")
    parser.add_argument("--profile", default="straggler", choices=list(PROFILES))
    parser.add_argument("--slow-rank", type=int, action="append", dest="slow_ranks", help="rank to slow (repeatable)")
    parser.add_argument("--slow-factor", type=float, default=5.0)
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of the jitter profile")
    parser.add_argument("--period", type=int, default=20, help="steps per cycle of the periodic profile")
    parser.add_argument("--duty", type=float, default=0.25, help="slow fraction of each periodic cycle")
    parser.add_argument("--slow-link-rank", type=int, action="append", dest="slow_link_ranks", help="(repeatable)")
    parser.add_argument("--link-seconds-per-mb", type=float, default=0.0, help="extra delay of the slow links")
    parser.add_argument("--monitors", action="store_true", help="add ConsensusMonitor and StragglerMonitor")
    parser.add_argument("--csv-dir", type=Path, help="log metrics with Lightning's CSVLogger here")
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--grouping", default="random", help="prague's grouping policy")
    parser.add_argument(
        "--no-overlap", dest="overlap", action="store_false", help="prague: exchange in the training thread (blocking)"
    )
    parser.add_argument("--weighting", default="uniform", help="partial_reduce: uniform or staleness")
    parser.add_argument("--topology", default="ring", help="decent_adam's topology")
    parser.add_argument(
        "--pace",
        default="auto",
        choices=("auto", "round", "own"),
        help="decent_adam's and prague's static schedule's pace (auto: own in replica groups, else round)",
    )
    parser.add_argument(
        "--replica-size", default="1", help="consecutive ranks training one model synchronously ('node': a node's)"
    )
    parser.add_argument(
        "--shard", action="store_true", help="shard the model over each replica's ranks (FSDP2; with --replica-size)"
    )
    parser.add_argument("--optimizer", default="sgd", choices=sorted(OPTIMIZERS))
    parser.add_argument("--accum-steps", type=int, default=4, help="tau of accum_adam / accum_adamw")
    parser.add_argument("--lr-decay", type=float, default=1.0, help="multiply the LR by this after every epoch")
    parser.add_argument(
        "--sync-dist-train-loss",
        action="store_true",
        help="log each step's loss reduced across ranks and a training accuracy metric that syncs every step "
        "(asynchronous strategies warn and use the local values)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the result of rank 0 here")
    parser.add_argument("--checkpoint-dir", type=Path, help="keep the best checkpoint (by val_acc) here")
    parser.add_argument("--root-dir", type=Path, help="the trainer's default_root_dir (default: the working directory)")
    parser.add_argument("--resume", type=Path, help="resume fit from this checkpoint")
    parser.add_argument("--early-stopping", action="store_true", help="stop when val_acc stops improving")
    parser.add_argument("--test", action="store_true", help="run trainer.test after fit")
    parser.add_argument("--grouping-timeout", type=float, default=300.0, help="timeout of every wait (s)")
    parser.add_argument("--min-workers", type=int, default=1, help="stop the job when fewer workers remain")
    parser.add_argument(
        "--max-workers",
        type=int,
        help="the job may grow to this many workers (new ones join with LIGHTNING_PRAGUE_REJOIN=1)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="start a lost rank's process again (at most this often per rank)"
    )
    parser.add_argument(
        "--plane", help="HOST:PORT of a plane service (lightning-prague plane) that hosts the store and control plane"
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=60.0,
        help="shortest time without progress or sign of life before a worker is hung (s)",
    )
    parser.add_argument(
        "--hang-factor", type=float, default=20.0, help="a worker is hung after this many times its step time (or more)"
    )
    parser.add_argument(
        "--leave-out-after",
        type=float,
        default=10.0,
        help="a blocked worker is left out of the fit after this long without progress or sign of life (s)",
    )
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        type=Fault.parse,
        metavar="RANK[@PROCESS]:BATCH:KIND",
        help=f"inject a real fault ({', '.join(KINDS)}; see lightning_prague.demo.faults); repeatable",
    )
    parser.add_argument(
        "--start-method",
        default="popen",
        choices=["popen", "fork"],
        help="how worker processes start: popen re-runs this script per rank; fork copies the parent "
        "(no second import of Lightning per rank; Linux/macOS, CPU only)",
    )
    return parser.parse_args(argv)


def build_strategy(args: argparse.Namespace) -> Any:
    """Our strategies with the demo's options; any other name goes to Lightning as is."""
    shared = {
        "seed": args.seed,
        "timeout": args.grouping_timeout,
        "start_method": args.start_method,
        "min_workers": args.min_workers,
        "max_restarts": args.max_restarts,
        "max_workers": args.max_workers,
        "plane": args.plane,
        "hang_timeout": args.hang_timeout,
        "hang_factor": args.hang_factor,
        "leave_out_after": args.leave_out_after,
    }
    if args.replica_size != "1":  # (given only where asked: every strategy takes it, only decent_adam uses it)
        shared["replica_size"] = int(args.replica_size) if args.replica_size.isdigit() else args.replica_size
    if args.shard:
        shared["shard"] = True
    if args.strategy in ("prague", "partial_all_reduce"):
        return lightning_prague.PartialAllReduceStrategy(
            group_size=args.group_size, grouping=args.grouping, overlap=args.overlap, pace=args.pace, **shared
        )
    if args.strategy == "partial_reduce":
        return lightning_prague.PartialReduceStrategy(group_size=args.group_size, weighting=args.weighting, **shared)
    if args.strategy == "adpsgd":
        return lightning_prague.ADPSGDStrategy(**shared)
    if args.strategy == "decent_adam":
        return lightning_prague.DecentAdamStrategy(topology=args.topology, pace=args.pace, **shared)
    if args.strategy == "ddp" and args.start_method == "fork":
        return "ddp_fork"
    return args.strategy


class RepeatedDigits(DigitsDataModule):
    """The digits with the training set repeated `repeats` times in each epoch (`--epoch-repeats`):
    one long epoch of the same small workload."""

    def __init__(self, repeats: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.repeats = repeats

    def setup(self, stage: str) -> None:
        super().setup(stage)
        x, y = self.train_set.tensors
        self.train_set = TensorDataset(x.repeat(self.repeats, 1), y.repeat(self.repeats))


class RunReport(L.Callback):
    """Writes each rank's result at the end of fit, inside the rank's own process.

    With `--start-method fork` the ranks are children of the process that called `fit`, so
    the result must be taken where the training state lives, not after `fit` returns.
    """

    def __init__(self, args: argparse.Namespace, summary: WorkerSummary, data: DigitsDataModule) -> None:
        self.args, self.summary, self.data = args, summary, data
        self.checkpoint: Any = None
        self.result: dict[str, Any] | None = None
        self.measurements: dict[str, Any] = {}
        self._start = time.perf_counter()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = time.perf_counter()
        self.fit_start_time = time.time()
        self.first_batch_time: float | None = None
        if self.args.json:  # which process is this rank now (`benchmarks/faults.py --churn` kills them)
            (self.args.json.parent / f"pid.{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if getattr(self, "first_batch_time", None) is None:  # (a rejoined rank's: when it trains again)
            self.first_batch_time = time.time()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the strategy's worker is gone by on_fit_end (teardown runs first)
        worker, exchanger = getattr(trainer.strategy, "worker", None), getattr(trainer.strategy, "exchanger", None)
        if worker is not None and exchanger is not None:
            self.measurements = {
                "coordinator_requests": worker.stats.requests,
                "exchanges": exchanger.exchanges,
                "control_requests": worker.session.requests,  # work-queue claims and tickets, mostly
            }
        job = getattr(trainer.strategy, "job", None)
        if job is not None:
            self.measurements["supervisor_pid"] = job.supervisor_pid
        progress = getattr(trainer.strategy, "progress", None)
        if progress is not None and progress.loader is not None and trainer.is_global_zero:
            self.measurements["epochs_in_store"] = progress.loader.epochs_in_store()
        if not isinstance(trainer.strategy, DecentralizedStrategy) and trainer.world_size > 1:
            # lock-step ranks: a world-wide collective is safe here
            self.measurements["allreduce_seconds"] = time_allreduce(pl_module)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds = time.perf_counter() - self._start
        measurements = {
            **self.measurements,
            "process_started": process_start_time(),
            "first_batch_time": getattr(self, "first_batch_time", None),
            "fit_start_time": getattr(self, "fit_start_time", None),
            "fit_end_time": time.time(),
        }
        self.result = report(
            self.args, trainer, pl_module, self.data, self.summary, self.checkpoint, seconds, measurements
        )


def process_start_time() -> float | None:
    """The wall-clock time this process started (Linux: `/proc`), else `None`."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def time_allreduce(module: torch.nn.Module, repeats: int = 20, budget: float = 2.0) -> float:
    """Seconds one all-reduce of all of `module`'s parameters takes across the world, on this machine:
    the exchange DDP does every step (the bench calibrates its runtime model with it). At most
    `repeats` of them, fewer when the first shows they would take longer than about `budget`
    seconds (a slow link); every rank runs the same number, agreed on with the slowest first one."""
    flat = torch.zeros(sum(p.numel() for p in module.parameters()), device=next(module.parameters()).device)
    torch.distributed.barrier()
    start = time.perf_counter()
    torch.distributed.all_reduce(flat)
    first = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=flat.device)
    torch.distributed.all_reduce(first, op=torch.distributed.ReduceOp.MAX)
    more = min(repeats - 1, int(budget / max(float(first), 1e-9)))
    start = time.perf_counter()
    for _ in range(more):
        torch.distributed.all_reduce(flat)
    return (time.perf_counter() - start) / more if more > 0 else float(first)


def build(
    args: argparse.Namespace, extra_callbacks: list[L.Callback] | None = None
) -> tuple[L.Trainer, DigitsClassifier, DigitsDataModule, WorkerSummary, Any]:
    """Trainer, model, data, the per-worker summary and the checkpoint callback (or None) for `args`."""
    L.seed_everything(args.seed, workers=True, verbose=False)
    summary = WorkerSummary(verbose=True)
    data = (
        RepeatedDigits(args.epoch_repeats, batch_size=args.batch_size, num_workers=args.num_workers)
        if args.epoch_repeats > 1
        else DigitsDataModule(batch_size=args.batch_size, num_workers=args.num_workers)
    )
    reporter = RunReport(args, summary, data)
    callbacks: list[L.Callback] = [
        SlowdownInjector(
            step_time=args.step_time,
            profile=args.profile,
            slow_ranks=args.slow_ranks or [0],
            slow_factor=args.slow_factor,
            sigma=args.sigma,
            period=args.period,
            duty=args.duty,
            seed=args.seed,
            slow_link_ranks=args.slow_link_ranks,
            link_seconds_per_byte=args.link_seconds_per_mb / 2**20,
        ),
        summary,
        reporter,
    ]
    if args.monitors:
        callbacks += [ConsensusMonitor(), StragglerMonitor(verbose=True)]
    checkpoint = None
    if args.checkpoint_dir:
        checkpoint = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, monitor="val_acc", mode="max")
        # save_last=True would rewrite last.ckpt only in epochs that improve val_acc: keep the latest
        # state with a checkpoint of its own, written at every epoch end
        latest = L.pytorch.callbacks.ModelCheckpoint(
            dirpath=args.checkpoint_dir, filename="last", monitor=None, save_top_k=1, enable_version_counter=False
        )
        callbacks += [checkpoint, latest]
        reporter.checkpoint = checkpoint
    if args.early_stopping:
        callbacks.append(L.pytorch.callbacks.EarlyStopping(monitor="val_acc", mode="max", patience=1, min_delta=0.5))
    callbacks.extend(extra_callbacks or [])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=build_strategy(args),
        max_epochs=args.epochs,
        limit_train_batches=args.limit_train_batches,
        callbacks=callbacks,
        logger=L.pytorch.loggers.CSVLogger(args.csv_dir, name="", version="") if args.csv_dir else False,
        log_every_n_steps=1,
        enable_checkpointing=checkpoint is not None,
        default_root_dir=args.root_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = DigitsClassifier(
        hidden=args.hidden,
        lr=args.lr,
        optimizer=args.optimizer,
        accum_steps=args.accum_steps,
        lr_decay=args.lr_decay,
        sync_dist_train_loss=args.sync_dist_train_loss,
    )
    if args.fault:
        inject_faults(model, args.fault, args.json.parent if args.json else Path.cwd())
    return trainer, model, data, summary, checkpoint


def _metric(trainer: L.Trainer, name: str) -> float | None:
    """A logged metric of this process, or `None` if it has none (a process that rejoined a running
    fit has the members' latest ones until it validates itself)."""
    value = trainer.callback_metrics.get(name)
    return None if value is None else float(value)


def _shown(value: float | None) -> str:
    return "none (no validation metrics in this process)" if value is None else f"{value:.4f}"


def params_digest(model: torch.nn.Module) -> str:
    """SHA-256 of the bytes of `model`'s parameters, in order: equal exactly when the replicas are
    bitwise the same (`params_checksum`, a sum, can round equal-enough values apart or different ones
    together). Of a model sharded over its replica (`--shard`): this rank's shards, the same on rank
    `i` of every replica."""
    digest = hashlib.sha256()
    for p in local_parameters(model):
        digest.update(p.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def local_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """`model`'s parameters as this rank holds them (a sharded one's: its shards), detached."""
    return [p.to_local().detach() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]


def report(
    args: argparse.Namespace,
    trainer: L.Trainer,
    model: L.LightningModule,
    data: DigitsDataModule,
    summary: WorkerSummary,
    checkpoint: Any,
    fit_seconds: float,
    measurements: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result of a run as a dict; rank 0 prints a line, every rank writes JSON if asked.

    `measurements`: what this rank asked the coordinator for and exchanged, the epochs that still
    have keys in the store (rank 0), or how long an all-reduce took (see `RunReport`).
    """
    result: dict[str, Any] = {
        "strategy": args.strategy,
        "devices": args.devices * args.num_nodes,
        "epochs_run": trainer.current_epoch,
        "global_step": trainer.global_step,
        "should_stop": bool(trainer.should_stop),
        "fit_seconds": fit_seconds,
        "train_seconds": summary.train_seconds,
        "step_seconds": summary.step_seconds,
        # `None` in a process that logged none (a rank that rejoins takes the members' metrics)
        "val_acc": _metric(trainer, "val_acc"),
        "val_loss": _metric(trainer, "val_loss"),
        "batches_per_worker": summary.batches_per_worker,
        "params_checksum": float(sum(p.double().sum() for p in local_parameters(model))),
        "params_sha256": params_digest(model),
        "lr": float(trainer.optimizers[0].param_groups[0]["lr"]),
        "timeline": summary.timeline,
        "samples_per_epoch": len(data.train_set),
        "batch_size": args.batch_size,
    }
    for callback in trainer.callbacks:
        if isinstance(callback, ConsensusMonitor):
            result["consensus_error"] = [error for _, error in callback.history]
        if isinstance(callback, StragglerMonitor):
            result["stragglers"] = callback.flagged
            result["worker_timings"] = callback.as_dicts()
    if checkpoint is not None:
        result["best_model_path"] = checkpoint.best_model_path
        latest = [cb for cb in trainer.checkpoint_callbacks if cb is not checkpoint and cb.monitor is None]
        result["last_model_path"] = latest[0].best_model_path if latest else checkpoint.last_model_path
    result.update(measurements or {})
    lost = getattr(trainer.strategy, "lost_workers", {})
    result["lost_workers"] = {str(rank): {"time": at, "why": why} for rank, (at, why) in lost.items()}
    # every rank reports its own checksum and digest so callers can check the replicas agree
    result["rank"] = trainer.global_rank
    result["restarts"] = int(os.environ.get(RESTARTS_VARIABLE, "0") or 0)  # this process's: 0 for the first
    result["batches_this_process"] = getattr(trainer.strategy, "batches_done", None)
    # a process that rejoined: the global step of the state a live member sent it
    result["joined_at_step"] = getattr(trainer.strategy, "joined_at_step", None)
    result["threads_after_fit"] = communication_threads()
    if trainer.is_global_zero:
        print(
            f"{args.strategy}: val_acc={_shown(result['val_acc'])} train={summary.train_seconds:.2f}s "
            f"fit={fit_seconds:.1f}s epochs={result['epochs_run']}",
            flush=True,
        )
    if args.json:
        path = args.json if trainer.is_global_zero else args.json.with_suffix(f".rank{trainer.global_rank}.json")
        path.write_text(json.dumps(result, indent=2))
    return result


def main(argv: list[str] | None = None, extra_callbacks: list[L.Callback] | None = None) -> dict[str, Any] | None:
    """Train; returns this process's result (`None` in the parent of forked ranks)."""
    args = parse_args(argv)
    trainer, model, data, summary, checkpoint = build(args, extra_callbacks)
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    result = next(cb for cb in trainer.callbacks if isinstance(cb, RunReport)).result
    if args.test:
        test_acc = float(trainer.test(model, datamodule=data, verbose=False)[0]["test_acc"])
        if trainer.is_global_zero:
            print(f"test_acc={test_acc:.4f}", flush=True)
    return result


def run_logged(
    argv: list[str], directory: Path, label: str, extra_callbacks: list[L.Callback] | None = None
) -> dict[str, Any]:
    """Train as `main(argv)` does, the ranks forked from this process, its output (the ranks'
    included) in `directory/log.txt`; returns rank 0's result.

    Raises `RuntimeError` naming `label`, the exit status and the end of the run's output when
    the run fails. Lightning is imported once for any number of such runs.
    """
    directory = directory.resolve()  # the run works in it: paths relative to here would break
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "result.json"
    out.unlink(missing_ok=True)
    train = partial(main, [*argv, "--json", str(out), "--start-method", "fork"], extra_callbacks)
    status = run_captured(train, directory / "log.txt", cwd=directory)
    if status != 0 or not out.exists():
        tail = (directory / "log.txt").read_text()[-3000:]
        raise RuntimeError(f"{label} failed (exit status {status}); its output ends:\n{tail}")
    return json.loads(out.read_text())


if __name__ == "__main__":
    # `kill -QUIT PID` prints every thread's stack to stderr and the run goes on (a test dumps a job it gave up on)
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    torch.set_num_threads(1)
    main()
