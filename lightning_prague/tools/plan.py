"""`lightning-prague plan`: predict which strategy trains fastest on a cluster, before running it.

    lightning-prague plan --workers 8 --step-time 0.05 --sigma 0.5
    lightning-prague plan --workers 8 --step-time 0.05 --slow 0:5 --model-mb 100 --bandwidth-gbps 10
    lightning-prague plan --timings stragglers.json   # written by StragglerMonitor(path="stragglers.json")
    lightning-prague plan --workers 16 --workers-per-node 4 --inter-bandwidth-gbps 10 --topology alternating_exp_ring
    lightning-prague plan --workers 4 --step-time 0.1 --model-mb 2.5 --node-bandwidth-gbps 0.2 0.2 0.2 0.01
    lightning-prague plan --workers 8 --workers-per-node 2 --slow 6:3 --slow 7:3 --model-mb 100 --replica-size node

With `--node-bandwidth-gbps` (one rate per node: what its link carries each way) a transfer between
two nodes runs at the slower of their links, exchanges that leave a node at once share its link,
and the asynchronous strategies' synchronization points (their drain and global average) are
priced too (see `lightning_prague.tools.runtime_model`).

With `--replica-size K` (or `node`: `--workers-per-node`) each decentralized strategy is predicted
twice: every rank on its own, and in replicas of `K` consecutive ranks that train synchronously and
decentralize as one (issue 50's design, `docs/design/replicas.md`: no strategy takes `replica_size`
yet); the recommendation says which pays.

Prints per strategy the predicted time per iteration, throughput, share of the physical limit
(the sum of the workers' speeds) and the extra wait at each synchronization point, and recommends
the fastest (see `lightning_prague.tools.runtime_model`). Every option is checked before anything is computed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.topology import TOPOLOGIES, make_topology
from lightning_prague.core.replicas.layout import NODE, ReplicaLayout
from lightning_prague.strategies.options import resolve_pace
from lightning_prague.tools.runtime_model import (
    STRATEGY_MODELS,
    Cluster,
    ComputeProfile,
    Link,
    Prediction,
    predict,
    recommend,
)


def make_parser() -> argparse.ArgumentParser:
    """`lightning-prague plan`'s options, each with its help and (in `--help`) its default."""
    parser = argparse.ArgumentParser(
        prog="lightning-prague plan",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # every option's default in --help
    )
    parser.add_argument("--workers", type=int, default=8, help="training processes (ranks) in the job")
    parser.add_argument(
        "--step-time",
        type=float,
        default=0.05,
        help="compute seconds per step (forward and backward) of a normal worker",
    )
    parser.add_argument("--sigma", type=float, default=0.0, help="lognormal jitter (sigma) of every step's time")
    parser.add_argument("--slow", action="append", default=[], metavar="RANK:FACTOR", help="a straggler (repeatable)")
    parser.add_argument(
        "--timings", type=Path, help="StragglerMonitor's file (its path option), or a JSON list of seconds per step"
    )
    parser.add_argument("--model-mb", type=float, default=1.0, help="size of the averaged model state (MB)")
    parser.add_argument("--workers-per-node", type=int, default=1, help="consecutive ranks sharing a node")
    parser.add_argument(
        "--bandwidth-gbps",
        "--inter-bandwidth-gbps",
        dest="bandwidth_gbps",
        type=float,
        default=10.0,
        help="each node's link (Gbit/s): between nodes, or between workers with one worker per node",
    )
    parser.add_argument(
        "--latency-ms",
        "--inter-latency-ms",
        dest="latency_ms",
        type=float,
        default=0.1,
        help="one message's latency (ms) between nodes",
    )
    parser.add_argument(
        "--intra-bandwidth-gbps", type=float, default=800.0, help="between workers of one node (Gbit/s)"
    )
    parser.add_argument("--intra-latency-ms", type=float, default=0.01, help="one message's latency (ms) inside a node")
    parser.add_argument(
        "--node-bandwidth-gbps",
        type=float,
        nargs="+",
        metavar="GBPS",
        help="each node's own link (Gbit/s), one per node (instead of one --bandwidth-gbps for all): a slow node",
    )
    parser.add_argument("--topology", default="ring", choices=sorted(TOPOLOGIES), help="decent_adam's topology")
    parser.add_argument("--grouping", default="random", choices=["random", "static"], help="prague's grouping")
    parser.add_argument(
        "--pace",
        default="auto",
        choices=["auto", "round", "own"],
        help="decent_adam's and the static schedule's pace (auto, as the strategies: own in replicas, else round)",
    )
    parser.add_argument(
        "--backward-fraction",
        type=float,
        default=2 / 3,
        help="share of a step that is the backward pass, which DDP overlaps its all-reduce with (0: no overlap)",
    )
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's gradient bucket size (MB)")
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=list(STRATEGY_MODELS),
        choices=STRATEGY_MODELS,
        help="the strategies to predict",
    )
    parser.add_argument(
        "--group-size", type=int, help="prague/partial_reduce group size (unset: 3, at most the worker count)"
    )
    parser.add_argument(
        "--step-overhead",
        type=float,
        default=0.0,
        help="host seconds (s) every step pays that a slow device does not stretch",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the simulated grouping decisions and jitter")
    parser.add_argument(
        "--replica-size",
        default="1",
        help="also predict the decentralized strategies over replicas of this many consecutive ranks ('node': "
        "--workers-per-node), each training synchronously",
    )
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    problems = check(args)
    if not problems:
        try:
            args.profiles = profiles_from(args)
        except (OSError, ValueError, KeyError, TypeError, ConfigurationError) as err:
            problems.append(f"--timings {args.timings}: {err}" if args.timings else str(err))
    if not problems:
        workers = len(args.profiles)
        args.group_size = min(3, workers) if args.group_size is None else args.group_size
        if not 2 <= args.group_size <= max(2, workers):
            problems.append(f"--group-size {args.group_size}: must be between 2 and the worker count ({workers})")
        problems += replica_problems(args, workers)
        if "decent_adam" in args.strategies:
            try:
                make_topology(args.topology, workers, args.workers_per_node)
                if args.replica_size > 1:
                    replicas = Cluster(args.workers_per_node).of_replicas(args.replica_size, workers)
                    make_topology(args.topology, workers // args.replica_size, replicas.workers_per_node)
            except ConfigurationError as err:
                problems.append(f"--topology {args.topology}: {err}")
    if problems:
        parser.error("; ".join(problems))
    return args


def check(args: argparse.Namespace) -> list[str]:
    """What is wrong with the options, each problem naming its option."""
    problems = []
    positive = {"--workers": args.workers, "--step-time": args.step_time,
                "--workers-per-node": args.workers_per_node, "--bandwidth-gbps": args.bandwidth_gbps,
                "--intra-bandwidth-gbps": args.intra_bandwidth_gbps, "--bucket-mb": args.bucket_mb}  # fmt: skip
    problems += [f"{name} {value}: must be positive" for name, value in positive.items() if value <= 0]
    not_negative = {"--sigma": args.sigma, "--model-mb": args.model_mb, "--latency-ms": args.latency_ms,
                    "--intra-latency-ms": args.intra_latency_ms, "--step-overhead": args.step_overhead}  # fmt: skip
    problems += [f"{name} {value}: must not be negative" for name, value in not_negative.items() if value < 0]
    if not 0 <= args.backward_fraction <= 1:
        problems.append(f"--backward-fraction {args.backward_fraction}: a share between 0 and 1")
    for spec in args.slow:
        rank, colon, factor = spec.partition(":")
        try:
            if not colon or not 0 <= int(rank) < args.workers or float(factor) <= 0:
                raise ValueError
        except ValueError:
            problems.append(f"--slow {spec}: expected RANK:FACTOR with 0 <= RANK < --workers and FACTOR > 0")
    if args.timings is not None and not args.timings.is_file():
        problems.append(f"--timings {args.timings}: no such file")
    if args.node_bandwidth_gbps is not None:
        if any(rate <= 0 for rate in args.node_bandwidth_gbps):
            problems.append(f"--node-bandwidth-gbps {args.node_bandwidth_gbps}: every rate must be positive")
        nodes = -(-args.workers // max(1, args.workers_per_node))
        if args.timings is None and len(args.node_bandwidth_gbps) != nodes:
            problems.append(
                f"--node-bandwidth-gbps: {len(args.node_bandwidth_gbps)} rates for {nodes} nodes "
                f"(--workers {args.workers} / --workers-per-node {args.workers_per_node})"
            )
    return problems


def replica_problems(args: argparse.Namespace, workers: int) -> list[str]:
    """What is wrong with `--replica-size` for `workers` ranks; sets `args.replica_size` to a number."""
    spec = str(args.replica_size)
    try:
        size = args.workers_per_node if spec == NODE else int(spec) if spec.strip().isdigit() else spec
        layout = ReplicaLayout.resolve(size, workers, args.workers_per_node)
        if layout.replica_size > 1:
            if layout.replicas < 2:
                raise ConfigurationError(f"it makes the {workers} workers one replica, which is DDP")
            Cluster(args.workers_per_node).of_replicas(layout.replica_size, workers)
    except (ValueError, ConfigurationError) as err:
        args.replica_size = 1
        return [f"--replica-size {spec}: {err}"]
    args.replica_size = layout.replica_size
    return []


def profiles_from(args: argparse.Namespace) -> list[ComputeProfile]:
    if args.timings:
        rows = json.loads(args.timings.read_text())
        if isinstance(rows, dict):  # StragglerMonitor's file
            rows = rows["workers"]
        seconds = [row["compute_per_step"] if isinstance(row, dict) else float(row) for row in rows]
        if not seconds:
            raise ValueError("lists no worker")
        return [ComputeProfile(s, sigma=args.sigma, overhead=args.step_overhead) for s in seconds]
    slow = {}
    for spec in args.slow:
        rank, _, factor = spec.partition(":")
        slow[int(rank)] = float(factor)
    return [
        ComputeProfile(args.step_time, slowdown=slow.get(r, 1.0), sigma=args.sigma, overhead=args.step_overhead)
        for r in range(args.workers)
    ]


def format_table(predictions: list[Prediction]) -> str:
    lines = [
        f"{'strategy':<32} {'s/iteration':>12} {'batches/s':>10} {'of limit':>9} {'sync wait':>10} "
        f"{'sync average':>12}  method"
    ]
    for p in predictions:
        lines.append(
            f"{p.name:<32} {p.seconds_per_iteration:>12.4f} {p.throughput:>10.1f} "
            f"{p.throughput / p.limit:>8.0%} {p.sync_wait:>9.3f}s {p.sync_seconds:>11.3f}s  {p.method}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Prediction]:
    args = parse_args(argv)
    workers = args.profiles
    cluster = Cluster(
        args.workers_per_node,
        intra=Link(bandwidth=args.intra_bandwidth_gbps * 1e9 / 8, latency=args.intra_latency_ms / 1000),
        inter=Link(bandwidth=args.bandwidth_gbps * 1e9 / 8, latency=args.latency_ms / 1000),
        node_links=None
        if args.node_bandwidth_gbps is None
        else tuple(Link(bandwidth=g * 1e9 / 8, latency=args.latency_ms / 1000) for g in args.node_bandwidth_gbps),
    )
    common = dict(
        group_size=args.group_size,
        seed=args.seed,
        cluster=cluster,
        topology=args.topology,
        backward_fraction=args.backward_fraction,
        bucket_bytes=int(args.bucket_mb * 2**20),
        grouping=args.grouping,
    )
    model_bytes = int(args.model_mb * 2**20)
    own = resolve_pace(args.pace, True, 1)
    predictions = predict(workers, model_bytes, strategies=args.strategies, pace=own, **common)
    decentralized = [name for name in args.strategies if name != "ddp"]
    if args.replica_size > 1 and decentralized:
        in_replicas = resolve_pace(args.pace, True, args.replica_size)
        predictions += predict(
            workers, model_bytes, strategies=decentralized, replica_size=args.replica_size, pace=in_replicas, **common
        )
    print(format_table(predictions))
    best = recommend(predictions)
    print(f"physical limit: {predictions[0].limit:.1f} batches/s; recommended: {best.name}")
    return predictions
