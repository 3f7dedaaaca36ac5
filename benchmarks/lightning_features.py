"""Lightning features under every strategy, with one slow worker: a compatibility matrix.

    python benchmarks/lightning_features.py                         # every strategy, every case
    python benchmarks/lightning_features.py --strategies prague --cases steps manual

Each case is a small ``Trainer.fit`` (and, for some, validate/test/predict, a second fit or a
resume) on 4 CPU workers started by ``fork`` from this process, with the last worker 5x slower.
A case passes when it finishes without an error or a hang (every strategy's waits time out after
``--timeout`` seconds, synchronization points included) and, where the case is step-based,
training stopped at exactly the promised global step. The table (and ``--json``) says which cases
passed, their time, the global step reached and the final validation loss.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import (
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    StochasticWeightAveraging,
    Timer,
)
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_prague  # noqa: F401  (registers the strategies)
from lightning_prague.callbacks import SlowdownInjector
from lightning_prague.demo.synthetic import IndexedSamples, RankStream
from lightning_prague.strategies import STRATEGIES

FEATURES = 16
STRATEGY_NAMES = ("ddp", "prague", "partial_reduce", "adpsgd", "decent_adam")


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(FEATURES, generator=g)
    return x, (x[: FEATURES // 2].sum(0, keepdim=True) > 0).float()


class Classifier(L.LightningModule):
    """A small MLP with a step-interval OneCycle schedule sized by ``estimated_stepping_batches``."""

    def __init__(self, lr: float = 0.05, compile_body: bool = False, manual: bool = False) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU())
        if compile_body:
            self.body = torch.compile(self.body)
        self.head = torch.nn.Linear(32, 1)
        self.lr = lr
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))

    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.binary_cross_entropy_with_logits(self(x), y)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=1.0)
        optimizer.step()
        self.lr_schedulers().step()
        return None

    def validation_step(self, batch, batch_idx, dataloader_idx: int = 0):
        self.log("val_loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total) or total <= 0:  # streaming epochs: no length to size a schedule by
            return optimizer
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=self.lr, total_steps=int(total) + 1)
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


class StepRecorder(L.Callback):
    """Every rank writes the epoch and global step it ended ``fit`` at (a forked run does not report it back)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        staged = self.root / f".step.rank{trainer.global_rank}"  # renamed into place: rank 0 never reads half a file
        staged.write_text(f"{trainer.current_epoch} {trainer.global_step}")
        staged.replace(self.root / f"step.rank{trainer.global_rank}")

    def ended(self) -> list[tuple[int, int]]:
        """(epoch, global step) of every rank that has ended fit, by rank."""
        return [tuple(map(int, path.read_text().split())) for path in sorted(self.root.glob("step.rank*"))]

    def steps(self) -> list[int]:
        return [step for _, step in self.ended()]


@dataclass
class Case:
    """One Lightning feature (or combination) to train with."""

    trainer: dict[str, Any] = field(default_factory=dict)
    #: start the workers as a user's script would (``popen``: Lightning runs the script once per
    #: rank), for what a ``fork`` start cannot do (a second ``fit`` on the same trainer)
    popen: bool = False
    model: dict[str, Any] = field(default_factory=dict)
    callbacks: Callable[[Path], list] = lambda root: []
    streaming: bool = False
    num_workers: int = 0
    val_loaders: int = 1
    expect_step: int | None = None
    then: Callable[[L.Trainer, L.LightningModule, Run], None] | None = None


def second_fit(trainer: L.Trainer, model: L.LightningModule, run: Run) -> None:
    """The same trainer fits again, one validation interval further."""
    trainer.fit_loop.epoch_loop.max_steps = 4 * run.unit
    trainer.fit(model, run.train_loader(), run.val_loaders())
    run.check_step(trainer, 4 * run.unit)


def evaluate_all(trainer: L.Trainer, model: L.LightningModule, run: Run) -> None:
    trainer.validate(model, run.val_loaders())
    trainer.test(model, DataLoader(IndexedSamples(64, sample), batch_size=16))
    predictions = trainer.predict(model, DataLoader(IndexedSamples(32, sample), batch_size=16))
    if trainer.global_rank == 0 and predictions is not None and len(predictions) == 0:
        raise AssertionError("predict returned no batches")


def resume(trainer: L.Trainer, model: L.LightningModule, run: Run) -> None:
    """A new trainer resumes from the checkpoint two intervals in and trains to the same budget."""
    step = 2 * run.unit
    path = sorted((run.root / "ckpt").glob(f"step={step}*.ckpt"))
    if not path:
        raise AssertionError(f"no checkpoint at step {step} in {run.root / 'ckpt'}")
    again = run.trainer()
    again.fit(Classifier(), run.train_loader(), run.val_loaders(), ckpt_path=str(path[0]))
    run.check_step(again, 3 * run.unit)


def build_cases(unit: int) -> dict[str, Case]:
    """Every case; step-based ones train ``3 * unit`` global steps, validating every ``unit``."""
    steps = {"max_steps": 3 * unit, "val_check_interval": unit, "check_val_every_n_epoch": None}
    end = 3 * unit

    def checkpoints(root: Path) -> list:
        return [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=unit, save_top_k=-1, filename="{step}")]

    return {
        "steps": Case(steps, callbacks=checkpoints, expect_step=end),
        "val_fraction": Case({"max_steps": end, "val_check_interval": 0.5}, expect_step=end),
        "bf16": Case({**steps, "precision": "bf16-mixed"}, expect_step=end),
        "accumulate": Case({**steps, "accumulate_grad_batches": 2}, expect_step=end),
        "clip": Case({**steps, "gradient_clip_val": 0.5}, expect_step=end),
        "manual": Case(steps, model={"manual": True}, expect_step=end),
        "compiled": Case(steps, model={"compile_body": True}, expect_step=end),
        "lr_monitor": Case(steps, callbacks=lambda root: [LearningRateMonitor("step")], expect_step=end),
        "two_val_loaders": Case(steps, val_loaders=2, expect_step=end),
        "early_stopping": Case(steps, callbacks=lambda root: [EarlyStopping("val_loss", patience=1)]),
        "timer": Case(steps, callbacks=lambda root: [Timer(duration="00:00:05:00")], expect_step=end),
        # the Timer fires on each rank's own clock, mid-epoch: every rank must stop at one point
        "timer_fires": Case({"max_epochs": 1000}, callbacks=lambda root: [Timer(duration="00:00:00:03")]),
        "swa": Case(
            {"max_epochs": 3}, callbacks=lambda root: [StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)]
        ),
        "epoch_checkpoint": Case(
            {"max_epochs": 2},
            callbacks=lambda root: [ModelCheckpoint(dirpath=root / "ckpt", monitor="val_loss", save_last=True)],
        ),
        "second_fit": Case(steps, popen=True, expect_step=end, then=second_fit),
        "validate_test_predict": Case(steps, expect_step=end, then=evaluate_all),
        "streaming_steps": Case(steps, streaming=True, num_workers=1, expect_step=end),
        "streaming_epochs": Case({"max_epochs": 2}, streaming=True),
        "resume": Case(steps, callbacks=checkpoints, expect_step=end, then=resume),
    }


CASE_NAMES = tuple(build_cases(1))


class Run:
    """One strategy's run of one case: builds trainers and loaders, checks the global step."""

    def __init__(self, strategy: str, case: Case, root: Path, args: argparse.Namespace) -> None:
        self.strategy, self.case, self.root, self.args = strategy, case, root, args
        self.unit: int = args.unit
        self.global_step: int | None = None

    def make_strategy(self):
        start_method = "popen" if self.case.popen else "fork"
        if self.strategy == "ddp":
            return L.pytorch.strategies.DDPStrategy(start_method=start_method)
        timeout = self.args.timeout  # every wait, a synchronization point's included: a hang fails fast here
        return STRATEGIES[self.strategy][0](start_method=start_method, timeout=timeout, sync_timeout=timeout)

    def trainer(self, **overrides: Any) -> L.Trainer:
        callbacks = [
            SlowdownInjector(self.args.step_time, profile="straggler", slow_ranks=[self.args.devices - 1]),
            StepRecorder(self.root),
            *self.case.callbacks(self.root),
        ]
        options = {
            "accelerator": "cpu",
            "devices": self.args.devices,
            "strategy": self.make_strategy(),
            "callbacks": callbacks,
            "logger": CSVLogger(self.root / "logs"),
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 2,
            "default_root_dir": self.root,
            **self.case.trainer,
            **overrides,
        }
        return L.Trainer(**options)

    def train_loader(self) -> DataLoader:
        if self.case.streaming:
            dataset: Dataset = RankStream(self.args.samples, sample)
            return DataLoader(dataset, batch_size=8, num_workers=self.case.num_workers)
        return DataLoader(
            IndexedSamples(self.args.samples, sample), batch_size=8, shuffle=True, num_workers=self.case.num_workers
        )

    def val_loaders(self) -> list[DataLoader]:
        return [DataLoader(IndexedSamples(64, sample), batch_size=16) for _ in range(self.case.val_loaders)]

    def check_step(self, trainer: L.Trainer, expected: int | None) -> None:
        """Every rank ended the last fit at ``expected`` (when given) and at the same global step."""
        if trainer.global_rank != 0:  # started by popen: rank 0 checks for everyone
            return
        recorder = next(cb for cb in trainer.callbacks if isinstance(cb, StepRecorder))
        deadline = time.monotonic() + 30
        while len(recorder.steps()) < self.args.devices and time.monotonic() < deadline:
            time.sleep(0.1)  # started by popen: the other ranks are finishing their fit too
        ended = recorder.ended()
        steps = [step for _, step in ended]
        if len(ended) != self.args.devices or len({epoch for epoch, _ in ended}) != 1:
            raise AssertionError(f"ranks ended fit at (epoch, global step) {ended}")
        # the global step is the job's (global progress) under DDP and the work-queue strategies; under
        # decent_adam it is each rank's own count of steps, and a stop decided mid-epoch (timer_fires)
        # reaches each rank at its next batch: one epoch, steps within a couple of each other
        own_counts = not getattr(trainer.strategy, "shards_by_work_queue", True)
        if len(set(steps)) != 1 and not (own_counts and max(steps) - min(steps) <= 2 and expected is None):
            raise AssertionError(f"ranks ended fit at global steps {steps}")
        if expected is not None and steps[0] != expected:
            raise AssertionError(f"training stopped at global step {steps[0]}, expected {expected}")
        self.global_step: int | None = max(steps)
        for path in self.root.glob("step.rank*"):
            path.unlink()

    def __call__(self) -> dict[str, Any]:
        L.seed_everything(0, verbose=False)  # the same initial model and data order for every strategy
        trainer = self.trainer()
        model = Classifier(**self.case.model)
        start = time.perf_counter()
        trainer.fit(model, self.train_loader(), self.val_loaders())
        self.check_step(trainer, self.case.expect_step)
        if self.case.then is not None:
            self.case.then(trainer, model, self)
        loss = trainer.callback_metrics.get("val_loss")
        return {
            "seconds": round(time.perf_counter() - start, 1),
            "global_step": self.global_step,
            "val_loss": None if loss is None else round(float(loss), 4),
        }


def run_case(strategy: str, name: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One case's result row; a ``popen`` case runs in a script of its own (Lightning re-runs it per rank)."""
    case = build_cases(args.unit)[name]
    if case.popen and not args.in_script:
        out = root / "row.json"
        command = [sys.executable, __file__, "--strategies", strategy, "--cases", name, "--in-script"]
        command += ["--json", str(out), "--devices", str(args.devices), "--samples", str(args.samples)]
        command += ["--unit", str(args.unit), "--step-time", str(args.step_time)]
        command += ["--timeout", str(args.timeout), "--root", str(root)]
        subprocess.run(command, check=False, timeout=10 * args.timeout)
        if not out.exists():
            return {"strategy": strategy, "case": name, "result": "FAILED", "error": "the script wrote no result"}
        return json.loads(out.read_text())[0]
    row: dict[str, Any] = {"strategy": strategy, "case": name}
    try:
        row.update(Run(strategy, case, root, args)(), result="ok")
    except Exception as error:  # a failing case must not stop the matrix
        row.update(result="FAILED", error=f"{type(error).__name__}: {error}")
        traceback.print_exc()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGY_NAMES), choices=STRATEGY_NAMES)
    parser.add_argument("--cases", nargs="+", default=list(CASE_NAMES), choices=CASE_NAMES)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--unit", type=int, default=8, help="step-based cases: 3 x unit steps, validation every unit")
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--step-time", type=float, default=0.01, help="seconds per step of a normal worker")
    parser.add_argument("--timeout", type=float, default=60.0, help="every strategy wait fails after this")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--in-script", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.environ.get("LOCAL_RANK", "0") != "0":  # a worker Lightning started by re-running this script
        run_case(args.strategies[0], args.cases[0], args.root, args)
        return 0
    results: list[dict[str, Any]] = []
    show = print if not args.in_script else lambda *a, **k: None
    show(f"{'strategy':<16}{'case':<24}{'result':<8}{'seconds':>8}{'step':>6}{'val_loss':>10}", flush=True)
    for strategy in args.strategies:
        for name in args.cases:
            with tempfile.TemporaryDirectory() as temporary:
                row = run_case(strategy, name, args.root or Path(temporary), args)
            results.append(row)
            show(
                f"{strategy:<16}{name:<24}{row['result']:<8}{row.get('seconds', ''):>8}"
                f"{row.get('global_step', ''):>6}{str(row.get('val_loss', '')):>10}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    failed = [f"{r['strategy']}/{r['case']}: {r['error']}" for r in results if r["result"] != "ok"]
    show("\n".join(["", f"{len(results) - len(failed)} of {len(results)} passed", *failed]))
    show("\n".join(speedups(results)))
    return 1 if failed else 0


def speedups(results: list[dict[str, Any]]) -> list[str]:
    """Per case and strategy: DDP's time over the strategy's, and the validation loss against DDP's."""
    ddp = {r["case"]: r for r in results if r["strategy"] == "ddp" and r["result"] == "ok"}
    lines = []
    for r in results:
        base = ddp.get(r["case"])
        if r["strategy"] == "ddp" or base is None or r["result"] != "ok" or not r["seconds"]:
            continue
        line = f"{r['case']:<24}{r['strategy']:<16}{base['seconds'] / r['seconds']:5.2f}x faster than ddp"
        if r["val_loss"] is not None and base["val_loss"]:
            line += f", val_loss {100 * (r['val_loss'] / base['val_loss'] - 1):+.1f}% vs ddp"
        lines.append(line)
    return ["", "Speed-up (fit time, including start-up of the forked workers):", *lines] if lines else []


if __name__ == "__main__":
    raise SystemExit(main())
