"""Step-based training under an asynchronous strategy; every rank writes what it saw to result.rankR.json.

A linear model on synthetic data whose samples carry their index, one 5x slow rank, and the
step-based features of issue 11: ``max_steps``, ``val_check_interval`` in steps (or a fraction),
``ModelCheckpoint(every_n_train_steps=...)``, a warm-up + cosine LR schedule sized by
``trainer.estimated_stepping_batches`` (stepped by Lightning, or by the module under
``--manual`` optimization), and a map-style or a streaming training set.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from lightning_prague.callbacks import SlowdownInjector
from lightning_prague.demo.synthetic import IndexedSamples, RankStream

FEATURES = 8


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(FEATURES, generator=g)
    return x, x.sum(0, keepdim=True), index


def lr_factor(step: int, total: int) -> float:
    """Linear warm-up over the first 10% of ``total`` steps, then cosine to 0 (the LR after ``step`` steps)."""
    warmup = max(1, int(0.1 * total))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


class Model(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.net = torch.nn.Linear(FEATURES, 1)
        self.trained: list[list[int]] = []  # [epoch, index] of every trained sample
        self.validations: list[dict] = []
        self.tickets: list = []  # [epoch, global ticket, lr] of every trained batch
        #: [epoch, batch_idx, trainer.is_last_batch] at the end of every trained batch
        self.batch_ends: list[list] = []
        self.stepping_batches = None
        self.automatic_optimization = not args.manual

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.trained += [[self.current_epoch, int(i)] for i in index]
        progress = getattr(self.trainer.strategy, "progress", None)
        if progress is not None and progress.loader is not None:
            lr = self.trainer.optimizers[0].param_groups[0]["lr"]
            self.tickets.append([self.current_epoch, progress.loader.current_ticket, round(lr, 5)])
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.lr_schedulers().step()  # once per batch, as under DDP: the strategy makes it the global step
        return None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_ends.append([self.current_epoch, batch_idx, self.trainer.is_last_batch])
        self.fetcher = type(self.trainer.fit_loop._data_fetcher).__name__

    def validation_step(self, batch, batch_idx):
        x, y, _ = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("val_loss", loss, sync_dist=True)

    def on_validation_start(self):
        if self.trainer.sanity_checking:
            return
        weights = self.net.weight.detach().flatten().tolist()
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.validations.append({"step": self.trainer.global_step, "lr": lr, "weights": weights})

    def on_fit_end(self):
        trainer = self.trainer
        progress = getattr(trainer.strategy, "progress", None)
        result = {
            "rank": trainer.global_rank,
            "global_step": trainer.global_step,
            "trained": self.trained,
            "validations": self.validations,
            "stepping_batches": self.stepping_batches,
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "val_loss": float(trainer.callback_metrics.get("val_loss", float("nan"))),
            "met": progress.met if progress is not None else [],
            "tickets": self.tickets,
            "batch_ends": self.batch_ends,
            "fetcher": getattr(self, "fetcher", None),
        }
        self.args.json.with_name(f"result.rank{trainer.global_rank}.json").write_text(json.dumps(result))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.args.lr)
        total = self.trainer.estimated_stepping_batches
        self.stepping_batches = total
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total))
        return [optimizer], [{"scheduler": scheduler, "interval": "step"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--strategy", default="partial_reduce")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--start-method", default="fork")
    parser.add_argument("--samples", type=int, default=192)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--val-every", default="7", help="steps (int) or a fraction of an epoch")
    parser.add_argument("--per-epoch-val", action="store_true", help="check_val_every_n_epoch=1 (else None)")
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument(
        "--resume-as-last-batch",
        action="store_true",
        help="resume from a copy of --resume that says its epoch's last batch was reached (as Lightning's fetcher, "
        "a batch ahead, wrote a checkpoint at the step budget before the strategy corrected it)",
    )
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--manual", action="store_true", help="manual optimization")
    parser.add_argument("--step-time", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    dataset = RankStream(args.samples, sample) if args.streaming else IndexedSamples(args.samples, sample)
    train = DataLoader(dataset, batch_size=args.batch_size, shuffle=not args.streaming, num_workers=args.num_workers)
    val = DataLoader(IndexedSamples(32, sample), batch_size=16)
    callbacks = [SlowdownInjector(args.step_time, profile="straggler", slow_ranks=[args.devices - 1])]
    checkpoint = None
    if args.checkpoint_every:
        checkpoint = ModelCheckpoint(
            dirpath=args.checkpoint_dir or args.json.parent / "ckpt",
            every_n_train_steps=args.checkpoint_every,
            save_top_k=-1,
            filename="{step}",
        )
        callbacks.append(checkpoint)
    val_every = float(args.val_every) if "." in args.val_every else int(args.val_every)
    strategy = args.strategy
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=_strategy(strategy, args.start_method),
        max_steps=args.max_steps,
        val_check_interval=val_every,
        check_val_every_n_epoch=1 if args.per_epoch_val else None,
        accumulate_grad_batches=args.accumulate,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
    )
    model = Model(args)
    resume = args.resume
    if resume is not None and args.resume_as_last_batch:
        state = torch.load(resume, weights_only=False)
        state["loops"]["fit_loop"]["epoch_loop.batch_progress"]["is_last_batch"] = True
        resume = args.json.parent / "resume-as-last-batch.ckpt"
        torch.save(state, resume)
    trainer.fit(model, train, val, ckpt_path=resume)
    saved = sorted(p.name for p in Path(checkpoint.dirpath).glob("*.ckpt")) if checkpoint else []
    args.json.write_text(json.dumps({"checkpoints": saved}))


def _strategy(name: str, start_method: str):
    if name == "ddp":
        return L.pytorch.strategies.DDPStrategy(start_method=start_method)
    from lightning_prague.strategies import STRATEGIES

    return STRATEGIES[name][0](start_method=start_method)


if __name__ == "__main__":
    main()
