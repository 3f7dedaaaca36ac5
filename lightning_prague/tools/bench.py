"""`lightning-prague bench`: every strategy against Lightning's DDP, under slowdown profiles, in one run.

    lightning-prague bench --preset quick --out bench-quick     # 4 workers, 3 epochs, 2 profiles: about a minute
    lightning-prague bench --preset full --out bench-full       # 8 workers, 4 epochs, 3 profiles
    lightning-prague bench --cluster slow_node inter_node       # an emulated cluster with slow links (root)

Each run trains the digits workload (`lightning_prague.demo.run`) with ConsensusMonitor and
StragglerMonitor, its worker processes forked from this one: Lightning is imported once for all
the runs, not once per run. Per strategy and profile it reports throughput (training samples per
second of training time), time to `--target-acc` validation accuracy, final accuracy, consensus
error before the last global average, the fraction of time workers spent waiting on others, the
physical limit (the sum of the workers' speeds) and the throughput the runtime model predicts
(`lightning_prague.tools.runtime_model`; three costs of this machine are calibrated once, from the first DDP run:
the per-epoch cost of validation and Lightning's loop, the host time of a training step, and an
all-reduce). It writes `bench.json`, `bench.csv`, `accuracy_vs_time.png` and
`throughput_vs_limit.png` to `--out`, and each run's output to `--out/logs/`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from lightning_prague.callbacks.slowdown import PROFILES
from lightning_prague.tools.cluster_bench import CLUSTER_PROFILES
from lightning_prague.tools.results import add_speedups, measured, write_outputs
from lightning_prague.tools.runtime_model import ComputeProfile, Link, predict

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"devices": 4, "epochs": 3, "step_time": 0.03, "profiles": ["straggler", "jitter"]},
    "full": {"devices": 8, "epochs": 4, "step_time": 0.05, "profiles": ["homogeneous", "straggler", "jitter"]},
}
STRATEGIES = ["ddp", "prague", "partial_reduce", "adpsgd", "decent_adam"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options, every one checked here, before any run starts."""
    parser = argparse.ArgumentParser(prog="lightning-prague bench", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick")
    parser.add_argument("--out", type=Path, default=Path("bench-out/bench"))
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=STRATEGIES, metavar="STRATEGY",
                        help=f"strategies to run (DDP always runs): {', '.join(STRATEGIES)}")  # fmt: skip
    parser.add_argument("--profiles", nargs="+", choices=PROFILES, metavar="PROFILE",
                        help=f"override the preset's slowdown profiles: {', '.join(PROFILES)}")  # fmt: skip
    parser.add_argument("--devices", type=int, help="override the preset's worker count (at least 2)")
    parser.add_argument("--epochs", type=int, help="override the preset's epochs")
    parser.add_argument("--step-time", type=float, help="override the preset's simulated step time (s)")
    parser.add_argument("--slow-factor", type=float, default=5.0, help="the straggler's slowdown (rank 0)")
    parser.add_argument("--sigma", type=float, default=0.5, help="lognormal sigma of the jitter profile")
    parser.add_argument(
        "--group-size", type=int, help="prague/partial_reduce group size, 2 to --devices (default: min(3, --devices))"
    )
    parser.add_argument("--target-acc", type=float, default=0.8, help="validation accuracy for time-to-target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="print a line per run instead of a progress bar")
    cluster = parser.add_argument_group(
        "emulated cluster (root)",
        "run on an emulated cluster with slow links instead of slowdown profiles (tools.cluster_bench)",
    )
    cluster.add_argument(
        "--cluster", nargs="+", choices=CLUSTER_PROFILES, metavar="PROFILE",
        help=f"cluster profiles: {', '.join(CLUSTER_PROFILES)} (--epochs, --step-time override theirs)",
    )  # fmt: skip
    cluster.add_argument("--rate", default="200mbit", help="the fast links' rate (tc syntax)")
    cluster.add_argument("--slow-ratio", type=float, default=20.0, help="how much slower the slow_node's link is")
    cluster.add_argument("--hidden", type=int, help="override the profiles' model width (their model size)")
    cluster.add_argument("--batch-size", type=int, help="override the profiles' batch size")
    cluster.add_argument("--job-timeout", type=float, default=600.0, help="seconds one run may take")
    cluster.add_argument(
        "--launcher", choices=("srun", "torchrun"), default="srun",
        help="how each node starts its ranks: SLURM's srun (one import of Lightning per node), or torchrun "
             "(one agent per node, c10d rendezvous on node1)",
    )  # fmt: skip
    cluster.add_argument(
        "--runs", nargs="+", metavar="LABEL",
        help="only these runs of the chosen strategies (labels as in the table: prague/random/replicas, ...); DDP's "
             "always runs (the speed-ups are against it)",
    )  # fmt: skip
    cluster.add_argument(
        "--predict-from", type=Path, metavar="RUNS_JSON",
        help="run nothing: predict and tabulate the runs a --cluster bench saved (its --out/runs.json)",
    )  # fmt: skip
    cluster.add_argument(
        "--reprobe", action="store_true",
        help="with --predict-from: build each profile's cluster and measure its links' probes anew (no training)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.cluster:
        return _cluster_args(parser, args)
    preset = PRESETS[args.preset]
    args.profiles = list(dict.fromkeys(args.profiles or preset["profiles"]))
    args.devices = preset["devices"] if args.devices is None else args.devices
    args.epochs = preset["epochs"] if args.epochs is None else args.epochs
    args.step_time = preset["step_time"] if args.step_time is None else args.step_time
    args.group_size = min(3, args.devices) if args.group_size is None else args.group_size
    problems = []
    if args.devices < 2:
        problems.append(f"--devices {args.devices}: the strategies need at least 2 workers")
    if args.epochs < 1:
        problems.append(f"--epochs {args.epochs}: train at least one epoch")
    if args.step_time <= 0:
        problems.append(f"--step-time {args.step_time}: must be positive (seconds)")
    if args.slow_factor < 1:
        problems.append(f"--slow-factor {args.slow_factor}: a straggler is at least 1x slower")
    if args.sigma < 0:
        problems.append(f"--sigma {args.sigma}: must not be negative")
    if not 2 <= args.group_size <= max(2, args.devices):
        problems.append(f"--group-size {args.group_size}: must be between 2 and --devices ({args.devices})")
    if not 0 < args.target_acc <= 1:
        problems.append(f"--target-acc {args.target_acc}: an accuracy in (0, 1]")
    if args.out.exists() and not args.out.is_dir():
        problems.append(f"--out {args.out}: exists and is not a directory")
    if problems:
        parser.error("; ".join(problems))
    args.strategies = list(dict.fromkeys(["ddp", *args.strategies]))  # speed-ups are measured against DDP, run first
    return args


def _cluster_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The options of a ``--cluster`` run, checked; the cluster tool's own check (root, tools) too."""
    from lightning_prague.tools import cluster_bench

    args.cluster = list(dict.fromkeys(args.cluster))
    args.group_size = 3 if args.group_size is None else args.group_size
    problems = cluster_bench.check(args)
    if args.epochs is not None and args.epochs < 1:
        problems.append(f"--epochs {args.epochs}: train at least one epoch")
    if args.step_time is not None and args.step_time <= 0:
        problems.append(f"--step-time {args.step_time}: must be positive (seconds)")
    if args.group_size < 2:
        problems.append(f"--group-size {args.group_size}: a group needs at least 2 workers")
    if args.out.exists() and not args.out.is_dir():
        problems.append(f"--out {args.out}: exists and is not a directory")
    if args.predict_from is not None and not args.predict_from.is_file():
        problems.append(f"--predict-from {args.predict_from}: no such file")
    if args.reprobe and args.predict_from is None:
        problems.append("--reprobe: only with --predict-from (a full run probes its clusters anyway)")
    if not problems and (args.predict_from is None or args.reprobe):
        reason = cluster_bench.unavailable()
        if reason:
            problems.append(f"--cluster: cannot build an emulated cluster here: {reason}")
    if problems:
        parser.error("; ".join(problems))
    args.strategies = list(dict.fromkeys(["ddp", *args.strategies]))
    return args


def run_one(strategy: str, profile: str, args: argparse.Namespace) -> dict[str, Any]:
    """One training run, its ranks forked from this process; returns rank 0's result.

    The run's output (its ranks' included) goes to `--out/logs/<profile>-<strategy>/log.txt`.
    """
    from lightning_prague.demo import run as demo_run  # imports Lightning

    argv = [
        "--strategy", strategy, "--profile", profile, "--devices", str(args.devices), "--epochs", str(args.epochs),
        "--step-time", str(args.step_time), "--slow-factor", str(args.slow_factor), "--sigma", str(args.sigma),
        "--seed", str(args.seed), "--group-size", str(args.group_size), "--monitors",
    ]  # fmt: skip
    return demo_run.run_logged(argv, args.out / "logs" / f"{profile}-{strategy}", f"bench run {strategy}/{profile}")


def worker_profiles(profile: str, args: argparse.Namespace, overhead: float = 0.0) -> list[ComputeProfile]:
    """The compute-time distributions the SlowdownInjector simulates under `profile`, plus `overhead`
    seconds of host time per step."""
    slow = {0: args.slow_factor} if profile == "straggler" else {}
    sigma = args.sigma if profile == "jitter" else 0.0
    periodic = {"period": 20, "duty": 0.25, "periodic_factor": args.slow_factor}  # the demo's defaults, rank 0
    return [
        ComputeProfile(
            args.step_time,
            slowdown=slow.get(r, 1.0),
            sigma=sigma,
            overhead=overhead,
            **(periodic if profile == "periodic" and r == 0 else {}),
        )
        for r in range(args.devices)
    ]


def summarize(strategy: str, profile: str, result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    limit = sum(result["batch_size"] / w.mean for w in worker_profiles(profile, args))
    return {"strategy": strategy, "profile": profile, **measured(result, args.target_acc), "limit": limit}


def add_predictions(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Predicted throughput per row, from the runtime model calibrated on the first DDP run.

    Three costs of this machine are measured there, not assumed: the per-epoch cost (validation,
    synchronization points, Lightning's loop: the training time outside training batches); the
    all-reduce of the whole model across the world (timed after training, `allreduce_seconds`),
    which sets the link's per-message latency, so smaller groups cost proportionally less; and the
    host time of a step (Lightning's loop, callbacks, backward and optimizer on the CPU: DDP's time
    per step beyond the simulated compute and the all-reduce), which every worker pays every step
    in every strategy.
    """
    model_bytes = 4 * (64 * 64 + 64 + 2 * 64 + 64 * 64 + 64 + 64 * 10 + 10)  # the digits MLP, float32
    link, overhead, step_overhead = Link(bandwidth=1e9, latency=2e-4), 0.0, 0.0
    ddp = next((row for row in rows if row["strategy"] == "ddp"), None)
    if ddp is not None:
        overhead = max(0.0, ddp["train_seconds"] - ddp["step_seconds"]) / args.epochs
        free_link = Link(bandwidth=float("inf"), latency=0.0)
        compute_only = predict(worker_profiles(ddp["profile"], args), model_bytes, free_link, ["ddp"])[0]
        measured_step = ddp["step_seconds"] / (ddp["batches"] / args.devices)
        beyond_compute = max(0.0, measured_step - compute_only.seconds_per_iteration)
        measured = ddp.get("measured_allreduce_seconds")
        allreduce = beyond_compute if measured is None else min(beyond_compute, measured)
        step_overhead = beyond_compute - allreduce
        link = Link(bandwidth=float("inf"), latency=allreduce / (2 * (args.devices - 1)) if args.devices > 1 else 0.0)
    for row in rows:
        workers = worker_profiles(row["profile"], args, step_overhead)
        models = {p.strategy: p for p in predict(workers, model_bytes, link, seed=args.seed)}
        prediction = models.get(row["strategy"], models["prague"])
        steps_seconds = row["batches"] / prediction.throughput  # batches over all workers / batches per second
        # one synchronization point per epoch (validation at its end) waits for the steps in flight
        predicted_seconds = steps_seconds + (overhead + prediction.sync_wait) * args.epochs
        row["predicted_throughput"] = row["throughput"] * row["train_seconds"] / predicted_seconds
        row["overhead_per_epoch"] = overhead
        row["step_overhead"] = step_overhead
        row["allreduce_seconds"] = link.allreduce_seconds(args.devices, model_bytes)


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'profile':<12} {'strategy':<15} {'samples/s':>9} {'predicted':>9} {'limit':>7} {'vs ddp':>7} "
        f"{'to target':>9} {'final acc':>9} {'consensus':>9} {'waiting':>7}"
    )
    lines = [header]
    for r in rows:
        target = "-" if r["time_to_target"] is None else f"{r['time_to_target']:.2f}s"
        lines.append(
            f"{r['profile']:<12} {r['strategy']:<15} {r['throughput']:>9.0f} {r['predicted_throughput']:>9.0f} "
            f"{r['limit']:>7.0f} {r['speedup_vs_ddp']:>6.2f}x {target:>9} {r['final_acc']:>9.4f} "
            f"{r['consensus_error']:>9.2e} {r['sync_fraction']:>7.0%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    import torch
    from tqdm import tqdm

    args = parse_args(argv)
    if args.cluster:
        from lightning_prague.tools import cluster_bench

        return cluster_bench.main(args)
    torch.set_num_threads(1)  # the forked workers inherit it: one compute thread per worker
    plan = [(profile, strategy) for profile in args.profiles for strategy in args.strategies]
    rows = []
    start = time.perf_counter()
    tqdm.monitor_interval = 0  # no monitor thread: the runs fork this process, and forks should find no threads
    with tqdm(
        total=len(plan), desc="bench", unit="run", disable=True if args.no_progress else None, dynamic_ncols=True
    ) as bar:
        for index, (profile, strategy) in enumerate(plan, 1):
            bar.set_postfix_str(f"{profile} / {strategy}")
            row = summarize(strategy, profile, run_one(strategy, profile, args), args)
            rows.append(row)
            bar.write(
                f"[{index}/{len(plan)}] {profile} / {strategy}: {row['train_seconds']:.2f}s of training, "
                f"acc={row['final_acc']:.4f} (elapsed {time.perf_counter() - start:.0f}s)"
            )
            bar.update()
    add_predictions(rows, args)
    add_speedups(rows)
    write_outputs(rows, args.out)
    print(format_table(rows))
    print(f"wrote {args.out}/bench.json, bench.csv, accuracy_vs_time.png, throughput_vs_limit.png")
    return rows
