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
    args = parser.parse_args()

    L.seed_everything(args.seed, verbose=False)
    strategy = DecentAdamStrategy(topology=args.topology, seed=args.seed) if args.strategy == "decent_adam" else "ddp"
    summary = WorkerSummary()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        callbacks=[SlowdownInjector(step_time=args.step_time, profile=args.profile, seed=args.seed), summary],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = TinyTransformerLM(lr=args.lr, optimizer=args.optimizer, accum_steps=args.accum_steps)
    start = time.perf_counter()
    trainer.fit(model, datamodule=PythonHelpText(max_chars=args.max_chars))
    result = {
        "strategy": args.strategy,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "train_seconds": summary.train_seconds,
        "fit_seconds": time.perf_counter() - start,
        "batches_per_worker": summary.batches_per_worker,
    }
    if trainer.is_global_zero:
        print(f"{args.strategy}: val_loss={result['val_loss']:.4f} train={result['train_seconds']:.1f}s", flush=True)
        if args.json:
            args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
