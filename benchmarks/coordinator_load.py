"""Load test of the coordinator alone: group formations per second and request latency at N workers.

    python benchmarks/coordinator_load.py                       # N = 8, 64, 256, 1024, random groups of 3
    python benchmarks/coordinator_load.py --sizes 256 --policy first_ready --seconds 10

A real TCPStore and the real :class:`~lightning_prague.core.CoordinatorService` (with its
:class:`~lightning_prague.core.GroupGenerator`) run in this process, as on rank 0. Simulated
workers run in a few forked client processes, several threads each, every thread with its own
store connection and a share of the N ranks: for each of its ranks in turn it sends ``ready``
(the worker's message) and pops that rank's inbox until the answer, exactly as
:meth:`~lightning_prague.core.GroupWorker.partial_sync` does, without the tensors. The clients
never pause, so this measures how many requests the coordinator can serve, not a training job.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_prague.core import CoordinatorService, GroupGenerator, StoreAddress, make_policy
from lightning_prague.core.coordinator import REQUESTS, inbox
from lightning_prague.core.store import decode, encode


def _client_thread(address: StoreAddress, ranks: list[int], stop_at: float, latencies: list[float]) -> None:
    store = address.connect(60)
    req = dict.fromkeys(ranks, 0)
    while time.monotonic() < stop_at:
        for rank in ranks:
            req[rank] += 1
            sent = time.monotonic()
            store.queue_push(REQUESTS, encode({"op": "ready", "rank": rank, "req": req[rank], "version": 0}))
            answered = False
            while not answered:
                try:
                    message = decode(store.queue_pop(inbox(rank)))
                except dist.QueueEmptyError:  # woken without an item under load: wait on (as GroupWorker)
                    continue
                for item in message if isinstance(message, list) else [message]:
                    if item["t"] == "answer" and item["req"] == req[rank]:
                        answered = True
            latencies.append(time.monotonic() - sent)


def _client_process(address: StoreAddress, ranks: list[int], threads: int, stop_at: float, out: str) -> None:
    latencies: list[float] = []
    shares = [ranks[i::threads] for i in range(threads)]
    workers = [
        threading.Thread(target=_client_thread, args=(address, share, stop_at, latencies)) for share in shares if share
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    Path(out).write_text(json.dumps(latencies))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def measure(world: int, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    address = StoreAddress("127.0.0.1", port, f"load{world}")
    kwargs = {"mixing_window": 10 * world} if args.policy == "first_ready" else {}
    policy = make_policy(args.policy, world, min(args.group_size, world), seed=0, **kwargs)
    generator = GroupGenerator(world, policy, avoid_stragglers=True)
    service = CoordinatorService(address, generator)
    service.start()
    ctx = mp.get_context("fork")
    stop_at = time.monotonic() + args.warmup + args.seconds
    outs = [str(tmp / f"lat-{world}-{p}.json") for p in range(args.processes)]
    procs = [
        ctx.Process(
            target=_client_process,
            args=(address, list(range(p, world, args.processes)), args.threads, stop_at, outs[p]),
        )
        for p in range(args.processes)
    ]
    for p in procs:
        p.start()
    time.sleep(args.warmup)
    groups_before, handled_before = generator.next_gid, service.handled
    start = time.monotonic()
    time.sleep(args.seconds)
    elapsed = time.monotonic() - start
    groups, handled = generator.next_gid - groups_before, service.handled - handled_before
    for p in procs:
        p.join(120)
    service.close()
    del server
    latencies = [x for o in outs for x in json.loads(Path(o).read_text())]
    return {
        "workers": world,
        "policy": args.policy,
        "formations_per_s": groups / elapsed,
        "requests_per_s": handled / elapsed,
        "latency_p50_ms": 1000 * _percentile(latencies, 0.5),
        "latency_p99_ms": 1000 * _percentile(latencies, 0.99),
        "store_ops_per_request": service.store_ops / max(service.handled, 1),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--policy", default="random", choices=["random", "buffer", "division", "first_ready"])
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--threads", type=int, default=8, help="client threads per process")
    parser.add_argument("--out", type=Path, default=Path("coordinator-load"))
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes):
        parser.error("--sizes: every size must be at least 2 workers")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [measure(n, args, args.out) for n in args.sizes]
    print("| N | policy | formations/s | requests/s | latency p50 / p99 (ms) | store ops per request |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['policy']} | {r['formations_per_s']:.0f} | {r['requests_per_s']:.0f} | "
            f"{r['latency_p50_ms']:.2f} / {r['latency_p99_ms']:.2f} | {r['store_ops_per_request']:.2f} |"
        )
    (args.out / "coordinator_load.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
