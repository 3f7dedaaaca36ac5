"""How the communication layer scales with the number of workers: N = 8, 16, 32 processes on one machine.

    python benchmarks/scaling.py                                   # every strategy and DDP, both profiles
    python benchmarks/scaling.py --sizes 16 --profiles straggler --seconds 20

Each run forks N worker processes (gloo on 127.0.0.1) that train a parameter vector with the
core's exchangers exactly as the strategies configure them (every rank calls ``init_job``, which
on rank 0 starts the supervisor process that hosts the store and the control plane, opens a
session with the strategy's policy and builds a ``GroupWorker`` on it): ``prague`` (random groups of 3,
overlapped), ``partial_reduce`` (first ready groups of 3, overlapped), ``adpsgd`` (active/passive
pairs on the bipartite ring), ``decent_adam`` (lagged gossip on the ring), and ``ddp`` (a
world all-reduce of the gradient after every step, as DistributedDataParallel does). A step is
a sleep of the simulated compute time (long enough that two cores are not the bottleneck),
5x longer on rank 0 under the ``straggler`` profile. Lightning is not imported, so start-up is
cheap and what is measured is the communication layer.

Reported per run: throughput (steps per second, all workers) as a fraction of the physical limit
(the sum of the workers' speeds), communicators created after warm-up (must be 0), the
coordinator's reply latency (p50/p99 of request to first reply), messages to and from the
coordinator per step (as the workers count them: sent and received), operations on the session's
counters per step (the key-value table in the control plane that the gossip's end-of-phase
agreement uses; counted on every worker during the window), and the peak RSS of a worker.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_prague.core import (
    BucketedTensors,
    GroupWorker,
    SessionConfig,
    communicator_count,
    init_job,
    make_policy,
    make_topology,
)
from lightning_prague.core.exchange.gossip import LaggedGossip
from lightning_prague.core.exchange.overlap import BackgroundAverager, Exchanger, PassiveResponder
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.core.grouping.policies import GossipPolicy, GroupingPolicy, SchedulePolicy

STRATEGIES = ("ddp", "prague", "partial_reduce", "adpsgd", "decent_adam")
PROFILES = ("straggler", "homogeneous")
SLOW_FACTOR = 5.0


def _policy(strategy: str, world: int, group_size: int) -> GroupingPolicy:
    if strategy == "prague":
        return make_policy("random", world, group_size, seed=0)
    if strategy == "partial_reduce":
        return make_policy("first_ready", world, group_size, seed=0)
    if strategy == "adpsgd":
        return GossipPolicy(BipartiteGraph.ring(world), seed=0)
    return SchedulePolicy(make_topology("ring", world), seed=0)


def _exchanger(strategy: str, worker: GroupWorker, tensors: BucketedTensors) -> Exchanger:
    if strategy == "adpsgd" and not BipartiteGraph.ring(worker.world_size).is_active(worker.rank):
        return PassiveResponder(worker, tensors, worker.timeout)
    if strategy == "decent_adam":
        return LaggedGossip(worker, tensors, make_topology("ring", worker.world_size), worker.timeout, name="scaling")
    return BackgroundAverager(worker, tensors, worker.timeout)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class CountingCounters:
    """A session's counters (`Counters`) that count the operations made through them (the benchmark's meter)."""

    def __init__(self, counters: Any) -> None:
        self._counters = counters
        self.operations = 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._counters, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.operations += 1
            return method(*args, **kwargs)

        return counted


def worker_main(rank: int, world: int, port: int, config: dict[str, Any], out: str) -> None:
    """One worker process: warm up, train for the window, drain, report."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = None
    if config["strategy"] == "ddp":  # no control plane: a plain process group
        dist.init_process_group("gloo", rank=rank, world_size=world)
    else:  # rank 0 starts the supervisor (store and control plane); everyone joins the job
        job = init_job(rank, world, "gloo", timeout=120)
    strategy, step_time, seconds = config["strategy"], config["step_time"], config["seconds"]
    slow = SLOW_FACTOR if config["profile"] == "straggler" and rank == 0 else 1.0
    params = torch.zeros(config["dim"])
    tensors = BucketedTensors([params])
    result: dict[str, Any] = {"rank": rank}
    if strategy == "ddp":
        grad = torch.ones(config["dim"])
        communicators = communicator_count()
        steps = max(1, int(seconds / (step_time * SLOW_FACTOR if config["profile"] == "straggler" else step_time)))
        dist.barrier()
        start = time.monotonic()
        for _ in range(steps):
            time.sleep(step_time * slow)
            dist.all_reduce(grad)  # lock-step: everyone waits for the slowest every step
            params.add_(grad, alpha=-1e-6)
        elapsed = time.monotonic() - start
        result.update(steps=steps, elapsed=elapsed, messages=0, counter_ops=0, reply=[])
    else:
        assert job is not None
        policy = _policy(strategy, world, config["group_size"])
        session = job.open_session(SessionConfig(world, policy.spec(), avoid_stragglers=True))
        worker = GroupWorker(session, tensors, timeout=120, job=job)  # warms up the job's process group
        communicators = communicator_count()
        exchanger = _exchanger(strategy, worker, tensors)
        worker.counters = counted = CountingCounters(worker.counters)  # counter operations from here on
        dist.barrier()
        start = time.monotonic()
        deadline = start + seconds
        steps = 0
        exchanger.start()
        while True:
            time.sleep(step_time * slow)
            if time.monotonic() > deadline:
                break
            params.add_(1e-3)
            worker.version += 1
            exchanger.step()
            steps += 1
        elapsed = seconds
        exchanger.drain()
        worker.synchronize("end")
        exchanger.close()
        result.update(
            steps=steps,
            elapsed=elapsed,
            messages=worker.stats.messages,
            counter_ops=counted.operations,
            reply=list(worker.stats.reply_seconds),
        )
        worker.close()
    result["new_communicators"] = communicator_count() - communicators
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    if job is not None:  # the supervisor exits once every rank's connection closed
        job.control.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, config: dict[str, Any], tmp: Path, timeout: float) -> dict[str, Any]:
    """Fork ``world`` workers, wait for them, and summarise their reports."""
    ctx = mp.get_context("fork")
    port = _free_port()
    outs = [str(tmp / f"{config['strategy']}-{config['profile']}-{world}-r{r}.json") for r in range(world)]
    procs = [ctx.Process(target=worker_main, args=(r, world, port, config, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
    for p in procs:
        if p.is_alive():
            p.kill()
    if failed:
        raise RuntimeError(f"{config['strategy']}/{config['profile']} N={world}: ranks {failed} failed or hung")
    reports = [json.loads(Path(o).read_text()) for o in outs]
    step_time = config["step_time"]
    speeds = [
        1 / (step_time * (SLOW_FACTOR if config["profile"] == "straggler" and r == 0 else 1.0)) for r in range(world)
    ]
    limit = sum(speeds)
    elapsed = max(r["elapsed"] for r in reports)
    throughput = sum(r["steps"] for r in reports) / elapsed
    steps = sum(r["steps"] for r in reports)
    replies = [x for r in reports for x in r["reply"]]
    messages = sum(r["messages"] for r in reports)
    return {
        "strategy": config["strategy"],
        "profile": config["profile"],
        "workers": world,
        "throughput": throughput,
        "limit": limit,
        "fraction_of_limit": throughput / limit,
        "new_communicators": sum(r["new_communicators"] for r in reports),
        "reply_p50_ms": 1000 * _percentile(replies, 0.5),
        "reply_p99_ms": 1000 * _percentile(replies, 0.99),
        "messages_per_step": messages / max(steps, 1),
        "counter_ops_per_step": sum(r["counter_ops"] for r in reports) / max(steps, 1),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in reports),
        "fast_steps_median": statistics.median(r["steps"] for r in reports[1:]),
        "slow_steps": reports[0]["steps"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"| {'strategy':<14} | profile     |   N | steps/s | limit | of limit | vs DDP | new comms |"
        " reply p50/p99 (ms) | msgs/step | counter ops/step | peak RSS (MB) |"
    )
    lines = [head, "|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|"]
    ddp = {(r["profile"], r["workers"]): r["throughput"] for r in rows if r["strategy"] == "ddp"}
    for r in rows:
        base = ddp.get((r["profile"], r["workers"]))
        versus = f"{r['throughput'] / base:5.2f}x" if base else "   -  "
        lines.append(
            f"| {r['strategy']:<14} | {r['profile']:<11} | {r['workers']:>3} | {r['throughput']:7.1f} | "
            f"{r['limit']:5.1f} | {r['fraction_of_limit']:8.0%} | {versus} | {r['new_communicators']:>9} | "
            f"{r['reply_p50_ms']:8.1f} / {r['reply_p99_ms']:<7.1f} | {r['messages_per_step']:9.1f} | "
            f"{r['counter_ops_per_step']:16.2f} | "
            f"{r['peak_rss_mb']:13.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES), choices=PROFILES)
    parser.add_argument("--step-time", type=float, default=0.2, help="simulated compute time of a step (s)")
    parser.add_argument("--seconds", type=float, default=12.0, help="length of the measured window (s)")
    parser.add_argument("--dim", type=int, default=25_000, help="floats in the averaged parameter vector")
    parser.add_argument("--group-size", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench-out/scaling"))
    args = parser.parse_args(argv)
    if any(n < 2 for n in args.sizes):
        parser.error("--sizes: every size must be at least 2 workers")
    if args.step_time <= 0 or args.seconds <= 0:
        parser.error("--step-time and --seconds must be positive")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for world in args.sizes:
        for profile in args.profiles:
            for strategy in args.strategies:
                config = {
                    "strategy": strategy,
                    "profile": profile,
                    "step_time": args.step_time,
                    "seconds": args.seconds,
                    "dim": args.dim,
                    "group_size": args.group_size,
                }
                row = run(world, config, args.out, timeout=args.seconds * 6 + 120)
                rows.append(row)
                print(
                    f"{strategy:>14} {profile:>11} N={world:<3} {row['fraction_of_limit']:5.0%} of the limit, "
                    f"{row['new_communicators']} new communicators",
                    flush=True,
                )
    text = table(rows)
    print(text)
    (args.out / "scaling.json").write_text(json.dumps(rows, indent=2))
    (args.out / "scaling.md").write_text(text + "\n")
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
