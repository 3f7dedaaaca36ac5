"""A character-level Transformer language model with strategy="decent_adam" and AccumAdam.

    python examples/textlm_decent_adam.py                   # decent_adam, 4 CPU workers, 3 epochs
    python examples/textlm_decent_adam.py --strategy ddp    # the same with Lightning's DDP

The text is CPython's own help topics (``pydoc_data``), so nothing is downloaded. Prints the
validation loss (nats per character; guessing uniformly gives about 4.6) and the training time.
"""

import argparse
import json
import time
from pathlib import Path

import lightning as L
import torch

from lightning_prague import DecentAdamStrategy
from lightning_prague.callbacks import SlowdownInjector, WorkerSummary
from lightning_prague.demo.textlm import PythonHelpText, TinyTransformerLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="decent_adam", choices=["decent_adam", "ddp"])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--topology", default="ring")
    parser.add_argument("--optimizer", default="accum_adam")
    parser.add_argument("--accum-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-chars", type=int, default=120_000, help="characters of the corpus to use")
    parser.add_argument("--step-time", type=float, default=0.0, help="simulated compute time per step (s)")
    parser.add_argument("--profile", default="homogeneous", choices=["homogeneous", "straggler", "jitter"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write rank 0's result here")
    parser.add_argument(
        "--start-method",
        default="popen",
        choices=["popen", "fork"],
        help="popen re-runs this script per rank; fork copies this process (one import of Lightning)",
    )
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)
    fork = args.start_method == "fork"
    if args.strategy == "decent_adam":
        strategy = DecentAdamStrategy(topology=args.topology, seed=args.seed, start_method=args.start_method)
    else:
        strategy = "ddp_fork" if fork else "ddp"
    summary = WorkerSummary()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=[
            SlowdownInjector(step_time=args.step_time, profile=args.profile, seed=args.seed),
            summary,
            Report(args, summary),
        ],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = TinyTransformerLM(lr=args.lr, optimizer=args.optimizer, accum_steps=args.accum_steps)
    trainer.fit(model, datamodule=PythonHelpText(max_chars=args.max_chars))


class Report(L.Callback):
    """Rank 0 prints and writes the result from inside its own process (with ``fork`` the ranks
    are children of the process that called ``fit``)."""

    def __init__(self, args: argparse.Namespace, summary: WorkerSummary) -> None:
        self.args, self.summary, self.start = args, summary, time.perf_counter()

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = time.perf_counter()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        result = {
            "strategy": self.args.strategy,
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "train_seconds": self.summary.train_seconds,
            "fit_seconds": time.perf_counter() - self.start,
            "batches_per_worker": self.summary.batches_per_worker,
        }
        print(
            f"{result['strategy']}: val_loss={result['val_loss']:.4f} train={result['train_seconds']:.1f}s", flush=True
        )
        if self.args.json:
            self.args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
