"""Step-based training with a straggler: the Transformer LM of ``examples/configs/prague_textlm_steps.yaml``.

    python benchmarks/steps_vs_ddp.py                          # ddp, prague, partial_reduce; 120 steps
    python benchmarks/steps_vs_ddp.py --max-steps 60 --strategies ddp adpsgd
    python benchmarks/steps_vs_ddp.py --streaming 32           # the text as a stream of 32 shards

Every strategy trains the same model on the same data to the same number of global steps
(``max_steps``), with validation and a checkpoint every ``max_steps / 3`` steps, linear warm-up
then cosine decay per step, and the last of 4 CPU workers 5x slower (simulated compute time
``--step-time`` per step, padded by sleeping). The workers are forked from this process, so the
time of each ``fit`` is training plus a second or so of setup, not interpreter start-up. Prints
each strategy's time, speed-up over DDP and final validation loss against DDP's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_prague  # noqa: F401  (registers the strategies)
from lightning_prague.callbacks import SlowdownInjector
from lightning_prague.demo import PythonHelpText, TinyTransformerLM
from lightning_prague.strategies import STRATEGIES


def fit(strategy: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    """One training run; its time and final validation loss (rank 0's, after the last synchronization)."""
    L.seed_everything(0, verbose=False)
    every = max(1, args.max_steps // 3)
    if strategy == "ddp":
        chosen = L.pytorch.strategies.DDPStrategy(start_method="fork")
    else:
        chosen = STRATEGIES[strategy][0](start_method="fork")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=chosen,
        max_steps=args.max_steps,
        val_check_interval=every,
        check_val_every_n_epoch=None,
        limit_val_batches=8,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[
            ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=every, save_top_k=-1, filename="{step}"),
            SlowdownInjector(args.step_time, profile="straggler", slow_ranks=[args.devices - 1], slow_factor=5.0),
        ],
    )
    warmup = max(1, args.max_steps // 12)
    model = TinyTransformerLM(lr=3e-3, optimizer="adam", warmup_steps=warmup, lr_schedule="cosine")
    start = time.perf_counter()
    # a sharded stream (--streaming): each strategy gets it whole; DDP's ranks read their own shards of it
    data = PythonHelpText(
        context=64,
        batch_size=32,
        streaming_shards=args.streaming,
        split_by_rank=bool(args.streaming) and strategy == "ddp",
    )
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 2), "val_loss": round(float(trainer.callback_metrics["val_loss"]), 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ("ddp", *STRATEGIES)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "prague", "partial_reduce"], choices=names)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--step-time", type=float, default=0.05, help="simulated compute seconds per step")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--streaming", type=int, default=0, metavar="SHARDS",
        help="train on the text as a sharded stream of SHARDS shards (DDP: split by rank) instead of shuffled windows",
    )  # fmt: skip
    args = parser.parse_args(argv)
    results = {}
    for strategy in args.strategies:
        with tempfile.TemporaryDirectory() as root:
            results[strategy] = fit(strategy, args, Path(root))
    base = results.get("ddp")
    print(f"\n{'strategy':<16}{'seconds':>9}{'speed-up':>10}{'val_loss':>10}{'vs ddp':>9}")
    for strategy, row in results.items():
        speedup = f"{base['seconds'] / row['seconds']:.2f}x" if base else ""
        delta = f"{100 * (row['val_loss'] / base['val_loss'] - 1):+.1f}%" if base else ""
        print(f"{strategy:<16}{row['seconds']:>9.1f}{speedup:>10}{row['val_loss']:>10.4f}{delta:>9}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
