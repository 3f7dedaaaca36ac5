"""A sharded stream with a 5x straggler: time to consume it, against DDP on the same shards split by node.

    python benchmarks/streaming_vs_ddp.py                      # 4 workers, 32 shards, every strategy
    python benchmarks/streaming_vs_ddp.py --kill 2:20          # rank 2 killed at its 20th batch (no restart)
    python benchmarks/streaming_vs_ddp.py --strategies prague --workers 2

A Hugging Face `datasets` streaming dataset over `--shards` JSON-lines files written here (rows with
their id, 32 features and a label that a linear model can learn), one epoch, `--workers` CPU
workers, rank 0 `--slow-factor` times slower (`SlowdownInjector`, `--step-time` per batch). DDP gets
the dataset split by node (`datasets.distributed.split_dataset_by_node`), as DDP users do; each
strategy gets the whole dataset and shares its shards out by speed
(`lightning_prague.core.data.shard_queue`). Every rank writes the ids it trained; the report counts
the rows missing and trained twice, against the physical limit (the sum of the workers' speeds),
and rank 0's model's accuracy on 4096 held-out rows.
Each run is a process of its own, its ranks forked from it (`--start-method fork`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROWS_PER_SHARD_DEFAULT = 512
FEATURES = 32


def labelled(count: int, generator: Any) -> tuple[Any, Any]:
    """`count` rows of features and their labels, by one fixed linear rule (the same in every call)."""
    import torch

    weights = torch.randn(FEATURES, generator=torch.Generator().manual_seed(12345))
    x = torch.randn(count, FEATURES, generator=generator)
    return x, (x @ weights > 0).long()


def write_shards(directory: Path, shards: int, rows: int, seed: int = 0) -> list[str]:
    """`shards` JSON-lines files of `rows` rows each: an id, features and a label (`labelled`)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    paths = []
    for shard in range(shards):
        path = directory / f"shard-{shard:03d}.jsonl"
        x, y = labelled(rows, generator)
        with open(path, "w") as out:
            for i in range(rows):
                row = {"id": shard * rows + i, "x": [round(v, 4) for v in x[i].tolist()], "y": int(y[i])}
                out.write(json.dumps(row) + "\n")
        paths.append(str(path))
    return paths


def run_one(args: argparse.Namespace) -> None:
    """One fit (this process is its launcher; `--strategy`): writes `ids.<rank>.json` and `result.<rank>.json`."""
    import lightning as L
    import torch
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy
    from torch import nn
    from torch.utils.data import DataLoader

    from lightning_prague.callbacks import SlowdownInjector
    from lightning_prague.strategies import STRATEGIES

    out = Path(args.out)
    files = sorted(str(p) for p in Path(args.data).glob("shard-*.jsonl"))

    class Rows(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, 2))
            self.seen: list[int] = []
            self.batches = 0

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            self.batches += 1
            if args.kill and self.global_rank == args.kill[0] and self.batches == args.kill[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            loss = nn.functional.cross_entropy(self.net(batch["x"]), batch["y"])
            # with its global-progress ticket under the strategies (which global step trained it)
            progress = getattr(self.trainer.strategy, "progress", None)
            loader = progress.loader if progress is not None else None
            ticket = loader.current_ticket if loader is not None else None
            self.seen.append([ticket, [int(i) for i in batch["id"]]])
            return loss

        def on_train_batch_end(self, *args_, **kwargs) -> None:  # type: ignore[no-untyped-def]
            (out / f"ids.{self.global_rank}.json").write_text(json.dumps(self.seen))

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def collate(rows):  # type: ignore[no-untyped-def]
        return {
            "id": torch.tensor([r["id"] for r in rows]),
            "x": torch.tensor([r["x"] for r in rows]),
            "y": torch.tensor([r["y"] for r in rows]),
        }

    dataset = load_dataset("json", data_files=files, split="train", streaming=True)
    if args.strategy == "ddp":
        world = args.workers
        strategy = DDPStrategy(start_method="fork", process_group_backend="gloo")
        rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))

        def loader_for(rank: int) -> DataLoader:
            part = split_dataset_by_node(dataset, rank, world)
            return DataLoader(part, batch_size=args.batch_size, collate_fn=collate, num_workers=args.num_workers)
    else:
        strategy = STRATEGIES[args.strategy][0](start_method="fork")
        rank = 0

        def loader_for(rank: int) -> DataLoader:
            return DataLoader(dataset, batch_size=args.batch_size, collate_fn=collate, num_workers=args.num_workers)

    class Data(L.LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return loader_for(self.trainer.global_rank)

    callbacks: list[L.Callback] = [
        SlowdownInjector(args.step_time, "straggler", slow_ranks=[0], slow_factor=args.slow_factor)
    ]
    if args.checkpoint_every:  # a checkpoint every N global steps (mid-epoch: the shards' positions in it)
        callbacks.append(ModelCheckpoint(out / "checkpoints", every_n_train_steps=args.checkpoint_every, save_top_k=-1))
    trainer = L.Trainer(
        accelerator="cpu", devices=args.workers, strategy=strategy, max_epochs=1, logger=False,
        enable_checkpointing=bool(args.checkpoint_every), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=out,
    )  # fmt: skip
    model = Rows()
    start = time.monotonic()
    trainer.fit(model, datamodule=Data(), ckpt_path=args.resume)
    seconds = time.monotonic() - start
    x, y = labelled(4096, torch.Generator().manual_seed(999))  # held out: rows no shard has
    with torch.no_grad():
        accuracy = float((model.net(x).argmax(1) == y).float().mean())
    (out / f"result.{trainer.global_rank}.json").write_text(
        json.dumps({"rank": trainer.global_rank, "seconds": seconds, "batches": model.batches, "acc": accuracy})
    )
    del rank


def report(args: argparse.Namespace, shards: int, rows: int) -> list[dict]:
    total = shards * rows
    rows_out = []
    for strategy in args.strategies:
        out = Path(tempfile.mkdtemp(prefix=f"stream-{strategy}-"))
        command = [sys.executable, __file__, "--one", "--strategy", strategy, "--data", args.data, "--out", str(out)]
        command += ["--workers", str(args.workers), "--batch-size", str(args.batch_size)]
        command += ["--num-workers", str(args.num_workers)]
        command += ["--step-time", str(args.step_time), "--slow-factor", str(args.slow_factor)]
        if args.kill and strategy != "ddp":
            command += ["--kill", f"{args.kill[0]}:{args.kill[1]}"]
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env["MASTER_PORT"] = str(20000 + os.getpid() % 20000)
        started = time.monotonic()
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.job_timeout)
        wall = time.monotonic() - started
        results = [json.loads(p.read_text()) for p in out.glob("result.*.json")]
        trained = Counter(i for p in out.glob("ids.*.json") for _, ids in json.loads(p.read_text()) for i in ids)
        seconds = max((r["seconds"] for r in results), default=float("nan"))
        accuracy = max((r["acc"] for r in results), default=float("nan"))
        missing = total - len(trained)
        twice = sum(c - 1 for c in trained.values() if c > 1)
        limit = total / args.batch_size * args.step_time / (args.workers - 1 + 1 / args.slow_factor)
        rows_out.append(
            {
                "strategy": strategy, "returned": len(results), "exit": done.returncode, "seconds": seconds,
                "wall": wall, "missing": missing, "twice": twice, "limit": limit, "acc": accuracy,
            }
        )  # fmt: skip
        if done.returncode != 0 and not args.kill:
            print(done.stderr[-3000:], file=sys.stderr)
    ddp = next((r["seconds"] for r in rows_out if r["strategy"] == "ddp"), float("nan"))
    header = f"{'strategy':16}{'returned':>9}{'time (s)':>10}{'vs DDP':>9}{'limit':>8}{'of limit':>10}"
    print(header + f"{'missing':>9}{'twice':>7}{'acc':>8}")
    for r in rows_out:
        print(
            f"{r['strategy']:16}{r['returned']:>9}{r['seconds']:>10.2f}{ddp / r['seconds']:>8.2f}x{r['limit']:>8.2f}"
            f"{r['limit'] / r['seconds']:>9.0%}{r['missing']:>9}{r['twice']:>7}{r['acc']:>8.4f}"
        )
    return rows_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=["ddp", "prague", "partial_reduce", "adpsgd"])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--shards", type=int, default=32)
    parser.add_argument("--rows-per-shard", type=int, default=ROWS_PER_SHARD_DEFAULT)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=0, help="each rank's DataLoader worker processes")
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--slow-factor", type=float, default=5.0)
    parser.add_argument(
        "--kill",
        type=lambda s: tuple(int(v) for v in s.split(":")),
        default=None,
        help="RANK:BATCH: that rank SIGKILLs itself at that batch (strategies only; no restart)",
    )
    parser.add_argument("--job-timeout", type=float, default=600.0)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="(--one) a checkpoint every N global steps")
    parser.add_argument("--resume", default=None, help="(--one) resume the fit from this checkpoint")
    parser.add_argument("--json", default=None, help="write the rows here")
    # (one run, in a process of its own)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="prague", help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args)
        return
    with tempfile.TemporaryDirectory(prefix="stream-shards-") as data:
        write_shards(Path(data), args.shards, args.rows_per_shard)
        args.data = data
        rows = report(args, args.shards, args.rows_per_shard)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
