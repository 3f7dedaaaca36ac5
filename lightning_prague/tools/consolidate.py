"""`lightning-prague consolidate DIR [--out FILE]`: one whole checkpoint file from a directory saved shard
by shard (`state_dict_type="sharded"`), which any Lightning job loads (`ckpt_path=`, `load_from_checkpoint`).

    lightning-prague consolidate checkpoints/last.ckpt                  # writes checkpoints/last.ckpt.consolidated
    lightning-prague consolidate checkpoints/epoch=3.ckpt --out model.ckpt

It runs in one process, on the CPU, and holds the whole model and optimizer state in host memory.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.strategies.sharded_checkpoints import consolidate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightning-prague consolidate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", type=Path, help="the directory a sharded checkpoint was saved in")
    parser.add_argument("--out", type=Path, help="the file to write (default: the directory's name + .consolidated)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else args.checkpoint.with_name(args.checkpoint.name + ".consolidated")
    try:
        checkpoint = consolidate(args.checkpoint)
    except ConfigurationError as error:
        parser.error(str(error))
    torch.save(checkpoint, out)
    print(f"wrote {out}: the whole model and {len(checkpoint['optimizer_states'])} optimizer state(s)")
