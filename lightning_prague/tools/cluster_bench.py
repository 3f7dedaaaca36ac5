"""`lightning-prague bench --cluster`: every strategy against DDP on an emulated cluster with slow links.

    sudo -E env PATH="$PATH" lightning-prague bench --cluster slow_node inter_node --out bench-cluster

Each profile builds an emulated cluster (`lightning_prague/tools/cluster`: one network namespace per node, a
Debian-style ``/etc/hosts``, links shaped with ``tc tbf``; it needs root) and
runs the digits workload on it, with a model wide enough that one exchange at the full link rate
takes about one step. Ranks inside a node talk over its loopback (fast); ranks on different nodes
over the shaped links. Each run's row holds what crossed between the nodes per batch trained (the
nodes' interface counters: every protocol, exchanges and control plane alike). The profiles:

- ``slow_node`` (a): 4 nodes x 1 worker, three links at ``--rate``, the last node's 20x slower
  (``--slow-ratio``);
- ``inter_node`` (b): 2 nodes x 4 workers, fast inside a node, ``--rate / 2`` between the nodes
  (steps twice as long: eight workers share this machine's cores);
- ``slow_node_pairs`` (issue 50's cluster): 4 nodes x 2 workers, every link at ``--rate``, node4's
  two ranks 3x slower; besides the other runs, ``prague`` (random groups and its static schedule),
  ``partial_reduce``, ``adpsgd`` and ``decent_adam`` in replica groups of a node (``--replica-size node``: each
  node's two ranks one synchronous replica, decentralized between nodes).

Runs: DDP (first: speed-ups are against it), ``prague`` with its ``random`` and ``static``
grouping, ``partial_reduce``, ``adpsgd``, and ``decent_adam`` with its ``ring`` and
``alternating_exp_ring`` topologies. Each run's ranks are started on their nodes as SLURM's
``srun`` would (``lightning_prague.tools.cluster.srun``, one import of Lightning per node), with
``GLOO_SOCKET_IFNAME`` naming the node's interface; ``--launcher torchrun`` starts them with a torchrun
agent per node instead (c10d rendezvous on node1, each rank its own import of Lightning), and ``--runs``
keeps only the runs named by their labels (DDP's always runs). The table adds the runtime model's prediction
(`lightning_prague.tools.runtime_model` with the emulated links: per-node link rates, the loopback inside a node).

On two loaded CPU cores ``inter_node`` takes about 4 minutes and ``slow_node`` about 17: DDP, the
ring and the static schedules run at the slow link's pace there (``--epochs 1`` or ``--strategies``
shorten it). ``--predict-from RUNS_JSON`` re-tabulates saved runs without building anything;
with ``--reprobe`` it builds each profile's cluster to measure its probes anew (no training).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lightning_prague.tools.results import add_speedups, measured, write_outputs
from lightning_prague.tools.runtime_model import Cluster, ComputeProfile, Link, predict

#: the strategies a profile runs, as (label, demo strategy, extra demo options)
RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("ddp", "ddp", ()),
    ("prague", "prague", ("--grouping", "random")),
    ("prague/static", "prague", ("--grouping", "static")),
    ("partial_reduce", "partial_reduce", ()),
    ("adpsgd", "adpsgd", ()),
    ("decent_adam/ring", "decent_adam", ("--topology", "ring")),
    ("decent_adam/alternating_exp_ring", "decent_adam", ("--topology", "alternating_exp_ring")),
)
#: bytes per second of a node's loopback as the runtime model sees it (gloo over TCP on one host)
LOOPBACK = Link(bandwidth=1e9, latency=1e-4)
#: latency of an emulated link (no netem here: only the bridge and TCP's own)
EMULATED_LATENCY = 2e-4


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate (``"100mbit"``, ``"1gbit"``); `ValueError` when it is none."""
    import re

    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not match or float(match[1]) <= 0:
        raise ValueError(f"not a rate: {rate!r} (examples: 100mbit, 1gbit)")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]]


def rate_text(bits: float) -> str:
    """A rate as ``tc`` takes it."""
    return f"{int(round(bits))}bit"


@dataclass(frozen=True)
class ClusterProfile:
    """One emulated cluster and the workload run on it."""

    name: str
    workers_per_node: int
    rates: tuple[float, ...]  # bits per second of each node's link, both directions
    step_time: float  # simulated compute seconds per step
    epochs: int
    hidden: int  # width of the digits MLP: the model's size
    batch_size: int = 32
    description: str = ""
    #: ranks whose steps take `slow_factor` times as long (the demo's straggler profile)
    slow_ranks: tuple[int, ...] = ()
    slow_factor: float = 1.0
    #: whether its runs include the strategies that take replica groups, in replicas of a node
    replicas: bool = False

    @property
    def nodes(self) -> int:
        return len(self.rates)

    def slowdown(self, rank: int) -> float:
        """How many times longer `rank`'s steps take than `step_time`."""
        return self.slow_factor if rank in self.slow_ranks else 1.0

    @property
    def world(self) -> int:
        return self.nodes * self.workers_per_node

    def model_bytes(self) -> int:
        """Bytes every exchange moves: the digits MLP's parameters and BatchNorm buffers, float32."""
        h = self.hidden
        parameters = 64 * h + h + 2 * h + h * h + h + 10 * h + 10
        return 4 * (parameters + 2 * h)

    def exchange_seconds(self) -> float:
        """One model's transfer at the fastest link's rate."""
        return self.model_bytes() * 8 / max(self.rates)

    def model_cluster(
        self, efficiency: float = 1.0, loopback: Link = LOOPBACK, single_flow: float | None = None
    ) -> Cluster:
        """The runtime model's view: each node's link (bytes/s, ``efficiency`` of its shaped rate:
        what TCP gets through ``tbf`` with the link kept busy; ``single_flow``: the share one
        point-to-point exchange gets by itself, `Link.single_flow`) and the loopback inside a node."""
        links = tuple(
            Link(efficiency * rate / 8, EMULATED_LATENCY, single_flow * rate / 8 if single_flow else None)
            for rate in self.rates
        )
        return Cluster(self.workers_per_node, intra=loopback, inter=min(links, key=lambda k: k.bandwidth),
                       node_links=links)  # fmt: skip


def cluster_profile(name: str, rate: float, slow_ratio: float) -> ClusterProfile:
    """Profile ``name`` with links at ``rate`` bit/s (the slow node's ``rate / slow_ratio``)."""
    if name == "slow_node":
        return ClusterProfile(
            name, 1, (rate, rate, rate, rate / slow_ratio), step_time=0.1, epochs=3, hidden=768, batch_size=16,
            description=f"4 nodes x 1 worker, node4's link {slow_ratio:g}x slower",
        )  # fmt: skip
    if name == "inter_node":
        return ClusterProfile(
            name, 4, (rate / 2, rate / 2), step_time=0.2, epochs=4, hidden=768,
            description="2 nodes x 4 workers, loopback inside a node, links between nodes at half --rate",
        )  # fmt: skip
    if name == "slow_node_pairs":
        return ClusterProfile(
            name, 2, (rate,) * 4, step_time=0.2, epochs=3, hidden=768, slow_ranks=(6, 7), slow_factor=3.0,
            replicas=True, description="4 nodes x 2 workers, every link at --rate, node4's ranks 3x slower",
        )  # fmt: skip
    raise ValueError(f"no cluster profile {name!r}; choose from {', '.join(CLUSTER_PROFILES)}")


CLUSTER_PROFILES = ("slow_node", "inter_node", "slow_node_pairs")
#: the runs in replica groups of a node (profiles with `replicas`): the strategies that take them
REPLICA_RUNS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("prague/random/replicas", "prague", ("--grouping", "random", "--replica-size", "node")),
    ("partial_reduce/replicas", "partial_reduce", ("--replica-size", "node")),
    ("adpsgd/replicas", "adpsgd", ("--replica-size", "node")),
    ("prague/static/replicas", "prague", ("--grouping", "static", "--pace", "round", "--replica-size", "node")),
    ("decent_adam/ring/replicas", "decent_adam", ("--topology", "ring", "--pace", "round", "--replica-size", "node")),
    ("prague/static/own/replicas", "prague", ("--grouping", "static", "--pace", "own", "--replica-size", "node")),
    ("decent_adam/ring/own/replicas", "decent_adam", ("--topology", "ring", "--pace", "own", "--replica-size", "node")),
)


def profiles_from(args: argparse.Namespace) -> list[ClusterProfile]:
    """The profiles of ``--cluster``, with the overrides of the command line."""
    made = []
    for name in args.cluster:
        profile = cluster_profile(name, parse_rate(args.rate), args.slow_ratio)
        given = {"epochs": args.epochs, "step_time": args.step_time, "hidden": args.hidden,
                 "batch_size": args.batch_size}  # fmt: skip
        overrides = {key: value for key, value in given.items() if value is not None}
        made.append(replace(profile, **overrides))
    return made


def check(args: argparse.Namespace) -> list[str]:
    """Problems with the ``--cluster`` options, each naming its option (nothing is built here)."""
    problems = []
    try:
        parse_rate(args.rate)
    except ValueError as err:
        problems.append(f"--rate: {err}")
    if args.slow_ratio < 1:
        problems.append(f"--slow-ratio {args.slow_ratio}: a slow link is at least 1x slower")
    if args.hidden is not None and args.hidden < 1:
        problems.append(f"--hidden {args.hidden}: must be positive")
    if args.batch_size is not None and args.batch_size < 1:
        problems.append(f"--batch-size {args.batch_size}: must be positive")
    if args.job_timeout <= 0:
        problems.append(f"--job-timeout {args.job_timeout}: must be positive (seconds)")
    known = {label for label, _, _ in (*RUNS, *REPLICA_RUNS)}
    unknown = [label for label in getattr(args, "runs", None) or () if label not in known]
    if unknown:
        problems.append(f"--runs {' '.join(unknown)}: no such run; the runs are {', '.join(sorted(known))}")
    return problems


def runs(args: argparse.Namespace, profile: ClusterProfile | None = None) -> list[tuple[str, str, tuple[str, ...]]]:
    """The runs of a profile: DDP and the chosen strategies, each with its variants (and in replica
    groups where the profile has them)."""
    chosen = {"ddp", *args.strategies}
    extra = REPLICA_RUNS if profile is not None and profile.replicas else ()
    labels = getattr(args, "runs", None)
    labels = {"ddp", *labels} if labels else None  # (speed-ups and predictions are measured against DDP's run)
    return [run for run in (*RUNS, *extra) if run[1] in chosen and (labels is None or run[0] in labels)]


def load_cluster_tool() -> Any:
    """The emulated cluster (`lightning_prague.tools.cluster`), imported when a cluster bench runs."""
    import lightning_prague.tools.cluster as tool

    return tool


def unavailable() -> str | None:
    """Why no emulated cluster can be built here (``None``: the cheap checks pass)."""
    try:
        tool = load_cluster_tool()
    except (RuntimeError, ImportError) as err:
        return str(err)
    return tool.unavailable_reason()


PROBE = """
import os, sys, time, torch, torch.distributed as dist
rank, nbytes = int(os.environ["PROBE_RANK"]), int(os.environ["PROBE_BYTES"])
dist.init_process_group("gloo", init_method="tcp://" + os.environ["PROBE_MASTER"], rank=rank, world_size=2)
x, y, times = torch.ones(nbytes // 4), torch.empty(nbytes // 4), []
for _ in range(1 + int(os.environ["PROBE_REPEATS"])):  # the first warms the connection up
    dist.barrier()
    start = time.perf_counter()
    ops = [dist.P2POp(dist.isend, x, 1 - rank), dist.P2POp(dist.irecv, y, 1 - rank)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    times.append(time.perf_counter() - start)
if rank == 0:
    print("PROBE", sum(times[1:]) / len(times[1:]), flush=True)
dist.destroy_process_group()
"""


#: exchanges a probe times (after one that warms the connection up): one exchange over a shaped link
#: takes 0.7 to 1.5 times its mean (losses at tbf's full queue, recovery), so a few are not enough
PROBE_REPEATS = 20


def probe_exchange(
    cluster: Any, profile: ClusterProfile, port: int, inside: bool = False, timeout: float = 300.0
) -> float | None:
    """Mean seconds one model takes each way at once between node1 and the node with the slowest
    link (the second node when all are equal), or with ``inside`` between two processes on node1
    (its loopback), over `PROBE_REPEATS` exchanges: what one of the library's point-to-point
    exchanges gets from the shaped links by itself and from this machine's loopback, measured with
    two bare gloo processes (`None` if the probe failed)."""
    tool = load_cluster_tool()
    slowest = 0 if inside else min(range(1, profile.nodes), key=lambda i: profile.rates[i])
    procs = []
    for rank, node in enumerate((cluster.nodes[0], cluster.nodes[slowest])):
        env = tool.clean_environment({
            "PROBE_RANK": str(rank), "PROBE_BYTES": str(profile.model_bytes()), "OMP_NUM_THREADS": "1",
            "PROBE_REPEATS": str(PROBE_REPEATS),
            "PROBE_MASTER": f"{cluster.nodes[0].address}:{port}", "GLOO_SOCKET_IFNAME": node.ifname,
        })  # fmt: skip
        procs.append(cluster.run(node, [sys.executable, "-c", PROBE], env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True))  # fmt: skip
    try:
        out = procs[0].communicate(timeout=timeout)[0]
        procs[1].wait(timeout=10)
    except subprocess.TimeoutExpired:
        for proc in procs:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        return None
    lines = [line for line in out.splitlines() if line.startswith("PROBE ")]
    return float(lines[-1].split()[1]) if lines else None


def demo_argv(strategy: str, extra: tuple[str, ...], profile: ClusterProfile, args: argparse.Namespace) -> list[str]:
    return [
        "--strategy",
        strategy,
        *extra,
        "--devices",
        str(profile.workers_per_node),
        "--num-nodes",
        str(profile.nodes),
        "--epochs",
        str(profile.epochs),
        "--step-time",
        str(profile.step_time),
        *(
            (
                "--profile",
                "straggler",
                "--slow-factor",
                str(profile.slow_factor),
                *(arg for rank in profile.slow_ranks for arg in ("--slow-rank", str(rank))),
            )
            if profile.slow_ranks
            else ("--profile", "homogeneous")
        ),
        "--hidden",
        str(profile.hidden),
        "--batch-size",
        str(profile.batch_size),
        "--seed",
        str(args.seed),
        "--group-size",
        str(min(args.group_size, profile.world)),
        "--grouping-timeout",
        str(args.job_timeout),
    ]  # fmt: skip (no --monitors: ConsensusMonitor gathers every replica over the slow links each epoch)


def node_command(
    profile: ClusterProfile, node: Any, directory: Path, port: int, timeout: float, launcher: str
) -> list[str]:
    """What starts ``node``'s ranks of a run: the srun-style launcher, or a torchrun agent (c10d rendezvous on
    node1, no restarts) with the demo's arguments from the run's ``steps.json``."""
    if launcher == "torchrun":
        argv = json.loads((directory / "steps.json").read_text())[0]["argv"]
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", str(profile.nodes), "--nproc-per-node",
            str(profile.workers_per_node), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node1:{port}",
            "--rdzv-id", f"bench-{port}", "--max-restarts", "0", "-m", "lightning_prague.demo.run", *argv,
        ]  # fmt: skip
    return [
        sys.executable, "-m", "lightning_prague.tools.cluster.srun", "--nnodes", str(profile.nodes), "--node-id",
        str(node.index), "--ntasks-per-node", str(profile.workers_per_node), "--nodelist",
        f"node[1-{profile.nodes}]", "--master-addr", "node1", "--master-port", str(port),
        "--preload", "--steps", str(directory / "steps.json"), "--log-dir", str(directory),
        "--timeout", str(timeout), "-m", "lightning_prague.demo.run",
    ]  # fmt: skip


def run_on_cluster(
    cluster: Any,
    profile: ClusterProfile,
    argv: list[str],
    directory: Path,
    port: int,
    timeout: float,
    launcher: str = "srun",
) -> dict[str, Any]:
    """One run, its ranks started on every node by ``launcher`` (`node_command`); rank 0's result.

    Raises `RuntimeError` with the end of the logs when a node fails or the run passes ``timeout``.
    """
    tool = load_cluster_tool()
    directory.mkdir(parents=True, exist_ok=True)
    out = directory / "result.json"
    for old in directory.glob("result*.json"):
        old.unlink()
    job_id = str(port)
    (directory / "steps.json").write_text(json.dumps([{"job_id": job_id, "argv": [*argv, "--json", str(out)]}]))
    procs = []
    for node in cluster.nodes:
        env = tool.clean_environment(
            {"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1", "TMPDIR": str(directory)}
        )
        command = node_command(profile, node, directory, port, timeout, launcher)
        with open(directory / f"{launcher}-{node.name}.log", "w") as log:
            procs.append(cluster.run(node, command, env, stdout=log, stderr=subprocess.STDOUT, cwd=directory))
    deadline = time.monotonic() + timeout + 30
    # a node that fails ends the run: the others would wait for its ranks until their timeout
    while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    codes: list[int | None] = []
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
            codes.append(None)
        else:
            codes.append(proc.returncode)
    if any(codes) or codes.count(None) or not out.exists():
        logs = sorted(directory.glob("*.log"))
        tail = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in logs)
        raise RuntimeError(f"run in {directory} failed (exit statuses {codes}); its logs end:\n{tail}")
    return json.loads(out.read_text())


def summarize(label: str, profile: ClusterProfile, result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:

    return {
        "strategy": label,
        "profile": profile.name,
        **measured(result, args.target_acc),
        "limit": sum(result["batch_size"] / (profile.step_time * profile.slowdown(r)) for r in range(profile.world)),
        "batches_per_worker": result["batches_per_worker"],
        "batch_size": result["batch_size"],
    }


def ddp_bytes(profile: ClusterProfile) -> int:
    """Bytes of DDP's all-reduce: the parameters' gradients (no buffers)."""
    return profile.model_bytes() - 4 * 2 * profile.hidden


def model_name(label: str) -> tuple[str, dict[str, Any]]:
    """The runtime model's strategy and options for a run's label."""
    strategy, *rest = label.split("/")
    grouped = rest[-1:] == ["replicas"]  # (`strategy/replicas` or `strategy/variant/replicas`)
    variant = rest[0] if rest and not (grouped and len(rest) == 1) else ""
    options: dict[str, Any] = {"replica_size": "node"} if grouped else {}
    if "own" in rest:
        options["pace"] = "own"
    if strategy == "prague" and variant == "static":
        return "prague", {"grouping": "static", **options}
    if strategy == "decent_adam":
        return "decent_adam", {"topology": variant or "ring", **options}
    return strategy, options


def add_cluster_predictions(rows: list[dict[str, Any]], profiles: dict[str, ClusterProfile], seed: int = 0) -> None:
    """Predicted throughput per row from the runtime model with the emulated links.

    As `bench.add_predictions`, three things are calibrated per profile from its DDP run: the
    training time outside steps per epoch (validation, Lightning's loop); the links' efficiency, the
    share of the shaped rate that TCP gets through ``tbf`` with the link kept busy (the model's ring
    all-reduce over the rates against the all-reduce DDP timed after training: `Link.bandwidth`);
    and the host time per step beyond the simulated compute and that all-reduce. The probe gives
    the share one exchange gets by itself (`Link.single_flow`). The rates themselves are the ones
    the cluster was shaped to.
    """
    for name, profile in profiles.items():
        mine = [row for row in rows if row["profile"] == name]
        nbytes = profile.model_bytes()
        ddp = next((row for row in mine if row["strategy"] == "ddp"), None)
        overhead, step_overhead, efficiency = 0.0, 0.0, 1.0
        if ddp is not None:
            overhead = max(0.0, ddp["train_seconds"] - ddp["step_seconds"]) / profile.epochs
            steps = ddp["batches"] / profile.world
            nominal = profile.model_cluster().allreduce_seconds(range(profile.world), ddp_bytes(profile))
            slowest = profile.step_time * max(map(profile.slowdown, range(profile.world)))  # DDP's pace
            beyond_compute = max(0.0, ddp["step_seconds"] / steps - slowest)
            measured = min(ddp.get("measured_allreduce_seconds") or nominal, beyond_compute)
            efficiency = min(1.0, nominal / measured) if measured > 0 else 1.0
            step_overhead = beyond_compute - measured
        ring = profile.model_cluster(efficiency)
        # the library's exchanges are point to point (all-to-all in small groups): their efficiency is
        # the probe's, one model each way at once between node1 and the slowest link's node
        probe = next((row.get("probe_exchange_seconds") for row in mine if row.get("probe_exchange_seconds")), None)
        slowest = min(profile.rates[1:])
        p2p_efficiency = min(1.0, nbytes * 8 / slowest / probe) if probe else efficiency
        inside = next((row.get("probe_loopback_seconds") for row in mine if row.get("probe_loopback_seconds")), None)
        loopback = Link(bandwidth=nbytes / inside, latency=LOOPBACK.latency) if inside else LOOPBACK
        # a link kept busy (exchanges sharing it, the library's ring) carries what DDP's ring got through
        # it; one exchange by itself what the probe's did
        exchanges = profile.model_cluster(efficiency, loopback, single_flow=p2p_efficiency)
        workers = [
            ComputeProfile(profile.step_time, slowdown=profile.slowdown(r), overhead=step_overhead)
            for r in range(profile.world)
        ]
        for row in mine:
            strategy, options = model_name(row["strategy"])
            if options.get("replica_size") == "node":
                options["replica_size"] = profile.workers_per_node
            prediction = predict(
                workers,
                ddp_bytes(profile) if strategy == "ddp" else nbytes,
                strategies=[strategy],
                seed=seed,
                cluster=ring if strategy == "ddp" else exchanges,
                group_size=row.get("group_size", 3),
                **options,
            )[0]
            predicted_seconds = row["batches"] / prediction.throughput + profile.epochs * (
                overhead + prediction.sync_wait + prediction.sync_seconds
            )
            row["predicted_throughput"] = row["throughput"] * row["train_seconds"] / predicted_seconds
            row["predicted_error"] = row["predicted_throughput"] / row["throughput"] - 1
            row["overhead_per_epoch"] = overhead
            row["step_overhead"] = step_overhead
            row["link_efficiency"] = efficiency
            row["exchange_efficiency"] = p2p_efficiency
            row["loopback_bytes_per_second"] = loopback.bandwidth


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'profile':<11} {'strategy':<33} {'samples/s':>9} {'predicted':>9} {'error':>6} {'vs ddp':>7} "
        f"{'final acc':>9} {'train s':>8} {'MB/batch':>8} {'batches per worker':<24}"
    )
    lines = [header]
    for r in rows:
        crossed = r.get("inter_node_bytes_per_batch")
        lines.append(
            f"{r['profile']:<11} {r['strategy']:<33} {r['throughput']:>9.0f} {r['predicted_throughput']:>9.0f} "
            f"{r['predicted_error']:>+6.0%} {r['speedup_vs_ddp']:>6.2f}x {r['final_acc']:>9.4f} "
            f"{r['train_seconds']:>8.1f} {'-' if crossed is None else f'{crossed / 2**20:.2f}':>8} "
            f"{' '.join(str(b) for b in r['batches_per_worker']):<24}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every profile of ``args.cluster``: build its cluster, run each strategy, tear down; the rows."""
    profiles = {p.name: p for p in profiles_from(args)}
    if args.predict_from is not None:
        saved = json.loads(args.predict_from.read_text())
        if getattr(args, "reprobe", False):
            reprobe(saved, profiles, args)
        return tabulate(saved, profiles, args)
    tool = load_cluster_tool()
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    port = 21000 + os.getpid() % 2000 * 10  # a fresh port per run: no socket of an earlier run in its way
    for profile in profiles.values():
        with build_cluster(tool, profile) as cluster:
            print(f"{profile.name}: {profile.description}; model {profile.model_bytes() / 2**20:.1f} MiB, "
                  f"{profile.exchange_seconds():.2f}s per transfer at the fastest link, step {profile.step_time}s",
                  flush=True)  # fmt: skip
            print(cluster.describe(), flush=True)
            port += 2
            exchange, loopback = probe_cluster(cluster, profile, port)
            for label, strategy, extra in runs(args, profile):
                port += 1
                directory = args.out / "logs" / f"{profile.name}-{label.replace('/', '-')}"
                argv = demo_argv(strategy, extra, profile, args)
                sent = sum(cluster.sent_bytes(node) for node in cluster.nodes)
                launcher = getattr(args, "launcher", "srun")
                result = run_on_cluster(cluster, profile, argv, directory, port, args.job_timeout, launcher)
                sent = sum(cluster.sent_bytes(node) for node in cluster.nodes) - sent
                row = summarize(label, profile, result, args)
                # what crossed between nodes (every protocol: exchanges, all-reduces, the store, the control
                # plane, validation's averages) per batch trained by any rank
                row["inter_node_bytes_per_batch"] = sent / max(1, sum(result["batches_per_worker"]))
                row["group_size"] = min(args.group_size, profile.world)
                row["probe_exchange_seconds"] = exchange
                row["probe_loopback_seconds"] = loopback
                rows.append(row)
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "runs.json").write_text(json.dumps(rows, indent=2))  # before any prediction
                print(f"{profile.name} / {label}: {row['train_seconds']:.1f}s of training, acc={row['final_acc']:.4f}, "
                      f"batches per worker {row['batches_per_worker']} (elapsed {time.perf_counter() - start:.0f}s)",
                      flush=True)  # fmt: skip
    return tabulate(rows, profiles, args)


def build_cluster(tool: Any, profile: ClusterProfile) -> Any:
    """The profile's emulated cluster, started (a context manager that tears it down); the bench
    stops with the reason if it cannot be built."""
    rates = {f"node{i + 1}": rate_text(rate) for i, rate in enumerate(profile.rates)}
    try:
        return tool.Cluster(profile.nodes, rate=rate_text(max(profile.rates)), rates=rates).start()
    except tool.ClusterError as err:
        raise SystemExit(f"bench --cluster: cannot build the emulated cluster: {err}") from err


def probe_cluster(cluster: Any, profile: ClusterProfile, port: int) -> tuple[float | None, float | None]:
    """The profile's two probes (`probe_exchange`): between node1 and the slowest link's node, and
    inside node1 (``None`` with one worker per node)."""
    exchange = probe_exchange(cluster, profile, port)
    loopback = probe_exchange(cluster, profile, port + 1, inside=True) if profile.workers_per_node > 1 else None
    print(f"{profile.name}: one model each way between node1 and its slowest peer: {exchange}s, "
          f"inside node1: {loopback}s (means of {PROBE_REPEATS})", flush=True)  # fmt: skip
    return exchange, loopback


def reprobe(rows: list[dict[str, Any]], profiles: dict[str, ClusterProfile], args: argparse.Namespace) -> None:
    """``--reprobe``: build each profile's cluster again, measure its probes and put them into the saved
    rows in place (the saved ones stay as ``saved_probe_*``), written to ``--out``/runs.json for later
    ``--predict-from``; nothing is trained."""
    tool = load_cluster_tool()
    port = 21000 + os.getpid() % 2000 * 10
    for profile in profiles.values():
        mine = [row for row in rows if row["profile"] == profile.name]
        if not mine:
            continue
        with build_cluster(tool, profile) as cluster:
            port += 2
            exchange, loopback = probe_cluster(cluster, profile, port)
        for row in mine:
            for key, value in (("probe_exchange_seconds", exchange), ("probe_loopback_seconds", loopback)):
                row.setdefault(f"saved_{key}", row.get(key))
                row[key] = value
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs.json").write_text(json.dumps(rows, indent=2))


def tabulate(
    rows: list[dict[str, Any]], profiles: dict[str, ClusterProfile], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Predictions and speed-ups of the runs' rows; writes the outputs, prints the table."""
    rows = [row for row in rows if row["profile"] in profiles]
    add_cluster_predictions(rows, profiles, args.seed)
    add_speedups(rows)
    write_outputs(rows, args.out)
    print(format_table(rows))
    print(f"wrote {args.out}/bench.json, bench.csv, accuracy_vs_time.png, throughput_vs_limit.png")
    return rows
