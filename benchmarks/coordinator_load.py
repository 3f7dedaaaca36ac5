"""Load test of the coordinator alone: group formations per second and request latency at N workers.

    python benchmarks/coordinator_load.py                       # N = 8, 64, 256, 1024, random groups of 3
    python benchmarks/coordinator_load.py --sizes 256 --policy first_ready --seconds 10

A real TCPStore and the real :class:`~lightning_prague.core.CoordinatorService` (with its
:class:`~lightning_prague.core.GroupGenerator` and message server) run in this process, as on
rank 0. Simulated workers run in a few forked client processes: each opens one connection per
rank it simulates (the coordinator's address is read from the store, as a worker does), sends
``ready`` and, as soon as that rank's answer arrives, its next ``ready`` (the messages of
:meth:`~lightning_prague.core.GroupWorker.partial_sync`, without the tensors). The clients never
pause, so this measures how many requests the coordinator can serve, not a training job.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing as mp
import selectors
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_prague.core import CoordinatorService, GroupGenerator, StoreAddress, make_policy
from lightning_prague.core.coordinator import ADDRESS_KEY
from lightning_prague.core.transport import HELLO, encode_line


def _client_process(address: StoreAddress, ranks: list[int], stop_at: float, think: float, out: str) -> None:
    """Closed-loop clients for ``ranks`` in one event loop: each keeps one request outstanding and
    sends its next one ``think`` seconds after its answer (a training step; 0: at once)."""
    store = address.connect(60)
    store.wait([ADDRESS_KEY], timedelta(seconds=60))
    host, port = store.get(ADDRESS_KEY).decode().rsplit(":", 1)
    selector = selectors.DefaultSelector()
    state: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        sock = socket.create_connection((host, int(port)), timeout=60)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(encode_line({"op": HELLO, "rank": rank}))
        sock.setblocking(False)
        state[rank] = {"sock": sock, "req": 0, "sent": 0.0, "buf": b""}
        selector.register(sock, selectors.EVENT_READ, rank)
    latencies: list[float] = []

    def ask(rank: int) -> None:
        entry = state[rank]
        entry["req"] += 1
        entry["sent"] = time.monotonic()
        message = {"op": "ready", "rank": rank, "req": entry["req"], "version": 0}
        entry["sock"].setblocking(True)
        entry["sock"].sendall(encode_line(message))
        entry["sock"].setblocking(False)

    due: list[tuple[float, int]] = []  # (when, rank): requests waiting for their think time
    for i, rank in enumerate(ranks):
        heapq.heappush(due, (time.monotonic() + think * i / len(ranks), rank))
    while time.monotonic() < stop_at:
        now = time.monotonic()
        while due and due[0][0] <= now:
            ask(heapq.heappop(due)[1])
        wait = min(1.0, max(0.0, due[0][0] - now)) if due else 1.0
        for key, _ in selector.select(timeout=wait):
            rank = key.data
            entry = state[rank]
            try:
                data = entry["sock"].recv(1 << 20)
            except BlockingIOError:
                continue
            lines = (entry["buf"] + data).split(b"\n")
            entry["buf"] = lines.pop()
            for line in lines:
                item = json.loads(line)
                if item["t"] == "answer" and item["req"] == entry["req"]:
                    latencies.append(time.monotonic() - entry["sent"])
                    if think > 0:
                        heapq.heappush(due, (time.monotonic() + think, rank))
                    else:
                        ask(rank)
    for entry in state.values():
        entry["sock"].close()
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
            args=(address, list(range(p, world, args.processes)), stop_at, args.think, outs[p]),
        )
        for p in range(args.processes)
    ]
    for p in procs:
        p.start()
    time.sleep(args.warmup)
    groups_before, handled_before, writes_before = generator.next_gid, service.handled, service.writes
    messages_before = service.messages
    start = time.monotonic()
    time.sleep(args.seconds)
    elapsed = time.monotonic() - start
    groups, handled = generator.next_gid - groups_before, service.handled - handled_before
    writes = service.writes - writes_before
    messages = service.messages - messages_before
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
        "think_s": args.think,
        "messages_per_request": messages / max(handled, 1),
        "writes_per_request": writes / max(handled, 1),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--policy", default="random", choices=["random", "buffer", "division", "first_ready"])
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument(
        "--think", type=float, default=0.0, help="seconds each simulated worker computes between requests (0: saturate)"
    )
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--out", type=Path, default=Path("coordinator-load"))
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes):
        parser.error("--sizes: every size must be at least 2 workers")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [measure(n, args, args.out) for n in args.sizes]
    print("| N | policy | formations/s | requests/s | latency p50 / p99 (ms) | messages / writes per request |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['workers']} | {r['policy']} | {r['formations_per_s']:.0f} | {r['requests_per_s']:.0f} | "
            f"{r['latency_p50_ms']:.2f} / {r['latency_p99_ms']:.2f} | "
            f"{r['messages_per_request']:.2f} / {r['writes_per_request']:.2f} |"
        )
    (args.out / "coordinator_load.json").write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
