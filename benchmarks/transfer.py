"""The state a rejoining rank receives from a live member: how long it takes, by size.

    python benchmarks/transfer.py                        # the demo's models and 1 GB, on gloo over loopback
    python benchmarks/transfer.py --sizes-mb 10 100 1000 --out bench-out/transfer

Two processes on this machine, a gloo process group over 127.0.0.1 (the library's transport for a
rejoin: `lightning_prague.core.comm.transfer`, the same `GroupComm` point-to-point the exchanges
use). For each state (the digits demo's model, the text demo's model, then float32 tensors of
each `--sizes-mb`, as a checkpoint holds them: a dict of named tensors) the donor encodes it as a
donor's transfer thread does (`torch.save` to bytes) and sends it (`send_payload`); the joiner
receives it (`receive_payload`) and decodes it (`decode_object`). Reported: the payload's size,
the seconds and MB/s of the send, and the seconds of encoding (on the donor) and decoding (on the
joiner). Both the encoding and the send run on the donor's transfer thread while it trains on
(`BackgroundTransfer`); the joiner's decoding delays only the joiner.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def demo_states() -> dict[str, dict[str, torch.Tensor]]:
    """The demos' models, as the state dicts a checkpoint holds."""
    from lightning_prague.demo.digits import DigitsClassifier
    from lightning_prague.demo.textlm import TinyTransformerLM

    return {"digits demo": DigitsClassifier().state_dict(), "text demo": TinyTransformerLM().state_dict()}


def sized_state(megabytes: float, piece_mb: float = 64.0) -> dict[str, torch.Tensor]:
    """Float32 tensors totalling `megabytes`, in pieces of at most `piece_mb` (a model's layers)."""
    total = int(megabytes * 2**20 / 4)
    piece = int(piece_mb * 2**20 / 4)
    return {
        f"layer{i}.weight": torch.randn(min(piece, total - start)) for i, start in enumerate(range(0, total, piece))
    }


def _rank(rank: int, port: int, states: list[tuple[str, Any]], out: str) -> None:
    from lightning_prague.core.comm.collectives import decode_object
    from lightning_prague.core.comm.groups import GroupComm
    from lightning_prague.core.comm.transfer import receive_payload, send_payload

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    comm = GroupComm(rank, 2, 600.0, dist.group.WORLD)
    rows = []
    for name, state in states:
        if rank == 0:
            start = time.perf_counter()
            buffer = io.BytesIO()
            torch.save(state, buffer)  # as the donor's transfer thread writes its snapshot
            payload = buffer.getvalue()
            encoded = time.perf_counter() - start
            sent = send_payload(comm, 1, payload, name)
            rows.append({"state": name, "bytes": len(payload), "encode_s": encoded, "send_s": sent})
        else:
            start = time.perf_counter()
            payload = receive_payload(comm, 0, name)
            received = time.perf_counter() - start
            start = time.perf_counter()
            decode_object(payload)
            rows.append({"state": name, "receive_s": received, "decode_s": time.perf_counter() - start})
        dist.barrier()
    Path(out).with_suffix(f".rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1024.0], help="states of this many MB")
    parser.add_argument("--out", type=Path, default=Path("bench-out/transfer"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    states = [*demo_states().items()] + [(f"{mb:g} MB of float32", sized_state(mb)) for mb in args.sizes_mb]
    raw = args.out / "raw.json"
    mp.start_processes(_rank, args=(free_port(), states, str(raw)), nprocs=2, start_method="fork")
    donor = json.loads(raw.with_suffix(".rank0.json").read_text())
    joiner = json.loads(raw.with_suffix(".rank1.json").read_text())
    rows = [{**d, **j, "mb_per_s": d["bytes"] / 1e6 / max(d["send_s"], 1e-9)} for d, j in zip(donor, joiner)]
    lines = [
        "| state | MB | send (s) | MB/s | encode on the donor (s) | decode on the joiner (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['state']} | {r['bytes'] / 1e6:.2f} | {r['send_s']:.3f} | {r['mb_per_s']:.0f} | "
            f"{r['encode_s']:.3f} | {r['decode_s']:.3f} |"
        )
    table = "\n".join(lines)
    (args.out / "transfer.md").write_text(table + "\n")
    (args.out / "transfer.json").write_text(
        json.dumps({"command": sys.argv, "cpus": os.cpu_count(), "rows": rows}, indent=2)
    )
    print(table)
    return rows


if __name__ == "__main__":
    main()
