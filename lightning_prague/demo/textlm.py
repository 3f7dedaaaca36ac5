"""A small character-level Transformer language model on text that ships with Python.

The corpus is the help text of CPython's `pydoc_data.topics` (about 450k characters of
English prose and Python code, installed with every CPython), so nothing is downloaded. Text is
cut into non-overlapping windows of `context + 1` characters; the model predicts each next
character. Validation uses the last `val_fraction` of the text.
"""

from __future__ import annotations

import math
import string
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_prague.optim import AccumAdam, AccumAdamW

#: characters the model knows; anything else in the corpus becomes `UNKNOWN`
ALPHABET = string.printable
UNKNOWN = "?"

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "accum_adam": AccumAdam,
    "accum_adamw": AccumAdamW,
    "sgd": torch.optim.SGD,
}


def python_help_text(max_chars: int | None = None) -> str:
    """The corpus: CPython's pydoc topics, in a fixed order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return text[:max_chars] if max_chars else text


def encode(text: str) -> torch.Tensor:
    index = {c: i for i, c in enumerate(ALPHABET)}
    unknown = index[UNKNOWN]
    return torch.tensor([index.get(c, unknown) for c in text], dtype=torch.long)


class CharWindows(Dataset):
    """Non-overlapping windows of `context + 1` characters: inputs and next-character targets."""

    def __init__(self, codes: torch.Tensor, context: int) -> None:
        self.codes = codes
        self.context = context

    def __len__(self) -> int:
        return (len(self.codes) - 1) // self.context

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.codes[i * self.context : (i + 1) * self.context + 1]
        return chunk[:-1], chunk[1:]


class CharShards(IterableDataset):
    """The same windows as a sharded stream, as a pretraining corpus arrives: `num_shards` contiguous
    shards, each read from any window on (`iter_shard`: the protocol of
    `lightning_prague.core.data.shard_sources.ShardedStream`). Iterated whole it reads every shard in
    turn, or, with `split_by_rank`, only this rank's (shards `rank`, `rank + world`, ...), as a DDP
    user splits a stream by node."""

    def __init__(self, codes: torch.Tensor, context: int, num_shards: int, split_by_rank: bool = False) -> None:
        self.windows = CharWindows(codes, context)
        count = len(self.windows)
        if not 1 <= num_shards <= count:
            raise ValueError(f"num_shards={num_shards} must be between 1 and the {count} windows of the text")
        self.num_shards = num_shards
        self.bounds = [(count * k // num_shards, count * (k + 1) // num_shards) for k in range(num_shards)]
        self.split_by_rank = split_by_rank

    def iter_shard(self, shard: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        first, end = self.bounds[shard]
        for i in range(first + start, end):
            yield self.windows[i]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        shards = range(self.num_shards)
        if self.split_by_rank and dist.is_available() and dist.is_initialized():
            shards = range(dist.get_rank(), self.num_shards, dist.get_world_size())
        for shard in shards:
            yield from self.iter_shard(shard, 0)


class PythonHelpText(L.LightningDataModule):
    """The pydoc corpus as character windows; the last `val_fraction` of the text is validation.
    `streaming_shards`: the training windows as a sharded stream of that many shards (`CharShards`),
    `split_by_rank`: each rank reading its own shards of it."""

    def __init__(
        self,
        context: int = 64,
        batch_size: int = 32,
        max_chars: int = 120_000,
        val_fraction: float = 0.1,
        streaming_shards: int = 0,
        split_by_rank: bool = False,
    ):
        super().__init__()
        self.context = context
        self.batch_size = batch_size
        self.max_chars = max_chars
        self.val_fraction = val_fraction
        self.streaming_shards = streaming_shards
        self.split_by_rank = split_by_rank

    def setup(self, stage: str) -> None:
        codes = encode(python_help_text(self.max_chars))
        split = int(len(codes) * (1 - self.val_fraction))
        self.train_set = CharWindows(codes[:split], self.context)
        self.val_set = CharWindows(codes[split:], self.context)
        if self.streaming_shards:
            self.train_stream = CharShards(codes[:split], self.context, self.streaming_shards, self.split_by_rank)

    def train_dataloader(self) -> DataLoader:
        if self.streaming_shards:
            return DataLoader(self.train_stream, batch_size=self.batch_size)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=128)


class TinyTransformerLM(L.LightningModule):
    """A causal Transformer over characters; logs `val_loss` (nats per character) and `val_ppl`."""

    def __init__(
        self,
        d_model: int = 64,
        n_heads: int = 4,
        n_layers: int = 2,
        context: int = 64,
        lr: float = 3e-3,
        optimizer: str = "accum_adam",
        accum_steps: int = 4,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
    ) -> None:
        """`lr_schedule`: `"constant"` (after `warmup_steps` of linear warm-up) or `"cosine"`
        (warm-up, then cosine decay to zero at `trainer.estimated_stepping_batches`); stepped every
        optimizer step, which under the asynchronous strategies means every global step."""
        super().__init__()
        if lr_schedule not in ("constant", "cosine"):
            raise ValueError(f"lr_schedule={lr_schedule!r} is unknown; choose constant or cosine")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={optimizer!r} is unknown; choose one of {', '.join(sorted(OPTIMIZERS))}")
        self.save_hyperparameters()
        vocab = len(ALPHABET)
        self.embed = nn.Embedding(vocab, d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=2 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        nn.init.normal_(self.position, std=0.02)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        n = codes.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=codes.device)
        h = self.embed(codes) + self.position[:n]
        return self.head(self.norm(self.blocks(h, mask=mask, is_causal=True)))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", torch.exp(loss), sync_dist=True)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = self._optimizer()
        if hp.warmup_steps == 0 and hp.lr_schedule == "constant":
            return optimizer
        total = self.trainer.estimated_stepping_batches
        if hp.lr_schedule == "cosine" and not math.isfinite(total):
            raise ValueError("lr_schedule='cosine' needs a finite trainer.estimated_stepping_batches (set max_steps)")
        warmup = hp.warmup_steps

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            if hp.lr_schedule == "constant":
                return 1.0
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / max(1.0, total - warmup))))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _optimizer(self) -> torch.optim.Optimizer:
        hp = self.hparams
        kind = OPTIMIZERS[hp.optimizer]
        if hp.optimizer.startswith("accum"):
            return kind(self.parameters(), lr=hp.lr, accum_steps=hp.accum_steps, weight_decay=hp.weight_decay)
        if hp.optimizer == "sgd":
            return kind(self.parameters(), lr=hp.lr, momentum=0.9)
        return kind(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)


def uniform_loss() -> float:
    """Cross-entropy of guessing uniformly over the alphabet, the loss an untrained model starts near."""
    return math.log(len(ALPHABET))
