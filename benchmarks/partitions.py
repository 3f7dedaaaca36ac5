"""Network partitions on an emulated cluster: node2 of 2 nodes x 2 workers cut off, every strategy.

    python -m benchmarks.partitions --out /tmp/partitions            # every strategy, 3 runs each
    python -m benchmarks.partitions --strategies prague --cuts long   # one run

For each strategy, three srun-style jobs (`lightning_prague.tools.cluster.srun --preload`) of the digits demo
on 2 nodes x 2 workers (1 Gbit/s links, homogeneous 0.2 s steps, 6 epochs, the default 10 s hang
bound): no cut; a **long** cut (node2's switch port down until every rank on node2 has ended, or
`--long-limit` seconds; healed only then, so that node2 can learn nothing from the control plane and
has to fence itself); a **short** cut (`--short` seconds, 3 by default, under the detection bound).
Each cut starts `--cut-after` seconds after every rank has set up (Lightning's SLURM line in each
rank's log). Columns:

- *cut (s)*: how long node2's link was down;
- *detect (s)*: from the cut to rank 0 (or rank 1, if rank 0 failed) hearing that node2's ranks are
  lost (`lost_workers`), `-`: none;
- *survivors*: node1's ranks that ended their fit, and whether they hold one model (one digest);
- *fit (s)* and *vs no cut*: the same rank's fit time, and its difference from rank 0's in the same
  strategy's run without a cut;
- *node2 ended (s)*: from the cut to the end of node2's launcher (all its ranks);
- *node2 exit*: the exit status of each of node2's ranks (75: fenced) and the first line of its
  error (`-`: it finished its fit: it was not cut off long enough to be counted out).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lightning_prague.tools.cluster import Cluster, clean_environment

ROOT = Path(__file__).resolve().parents[1]

STRATEGIES = ("prague", "partial_reduce", "adpsgd", "decent_adam")
NODES, WORKERS = 2, 2
CUT_NODE = "node2"
READY = "SLURM auto-requeueing"  # Lightning prints it in each rank's setup under SLURM


@dataclass
class Run:
    strategy: str
    cut: str  # "none", "long", "short"
    directory: Path
    cut_seconds: float = 0.0
    cut_at: float = 0.0  # wall clock
    node2_ended: float | None = None  # seconds after the cut
    codes: dict[int, int] = field(default_factory=dict)
    results: dict[int, dict] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    failed: str = ""


def demo_args(args: argparse.Namespace, strategy: str, out: Path) -> list[str]:
    return [
        "--strategy", strategy, "--devices", str(WORKERS), "--num-nodes", str(NODES), "--epochs", str(args.epochs),
        "--step-time", str(args.step_time), "--profile", "homogeneous", "--group-size", "2",
        "--grouping-timeout", str(args.timeout), "--hang-timeout", str(args.hang_timeout), "--json", str(out),
    ]  # fmt: skip


def error_line(log: Path) -> str:
    """The line that says why a rank ended: the fencing message, else the last exception's."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        if "lightning_prague: rank" in line or "fenced this rank" in line:
            return line.split("lightning_prague: ", 1)[-1].strip()
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Timeout|Lost|Exception)\b", line)]
    return errors[-1].strip() if errors else ""


def run_one(cluster: Cluster, args: argparse.Namespace, strategy: str, cut: str, out: Path, job_id: int) -> Run:
    run = Run(strategy, cut, out / f"{strategy}-{cut}")
    shutil.rmtree(run.directory, ignore_errors=True)
    run.directory.mkdir(parents=True)
    steps = [{"job_id": str(job_id), "argv": demo_args(args, strategy, run.directory / "result.json")}]
    (run.directory / "steps.json").write_text(json.dumps(steps))
    procs = {}
    for node in cluster.nodes:
        env = clean_environment(
            {"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1", "TMPDIR": str(run.directory)}
        )
        argv = [
            sys.executable, "-m", "lightning_prague.tools.cluster.srun", "--nnodes", str(NODES),
            "--node-id", str(node.index),
            "--ntasks-per-node", str(WORKERS), "--nodelist", f"node[1-{NODES}]", "--master-addr", "node1",
            "--preload", "--steps", str(run.directory / "steps.json"), "--log-dir", str(run.directory),
            "--timeout", str(args.job_timeout), "-m", "lightning_prague.demo.run",
        ]  # fmt: skip
        with open(run.directory / f"srun-{node.name}.log", "w") as log:
            procs[node.name] = cluster.run(node, argv, env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    logs = [run.directory / f"job{job_id}.rank{rank}.log" for rank in range(NODES * WORKERS)]
    deadline = time.monotonic() + args.job_timeout + 30
    try:
        if cut != "none":
            while not all(p.exists() and READY in p.read_text(errors="replace") for p in logs):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs.values()):
                    run.failed = "a launcher ended, or the ranks did not set up, before the cut"
                    return run
                time.sleep(0.2)
            time.sleep(args.cut_after)
            cluster.cut(CUT_NODE)
            run.cut_at, start = time.time(), time.monotonic()
            limit = args.short if cut == "short" else args.long_limit
            while time.monotonic() - start < limit:
                if cut == "long" and procs[CUT_NODE].poll() is not None:
                    break
                time.sleep(0.05)
            cluster.heal(CUT_NODE)
            run.cut_seconds = time.monotonic() - start
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < deadline:
            if run.cut_at and run.node2_ended is None and procs[CUT_NODE].poll() is not None:
                run.node2_ended = time.time() - run.cut_at
            time.sleep(0.05)
        if run.cut_at and run.node2_ended is None and procs[CUT_NODE].poll() is not None:
            run.node2_ended = time.time() - run.cut_at
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                run.failed = run.failed or "killed at the job's timeout"
    for name in procs:
        text = (run.directory / f"srun-{name}.log").read_text(errors="replace")
        for rank, code in re.findall(r"\(job \d+ rank (\d+)\) exited with (-?\d+)", text):
            run.codes[int(rank)] = int(code)
    for rank in range(NODES * WORKERS):
        run.codes.setdefault(rank, 0)
        run.errors[rank] = error_line(logs[rank])
    files = [run.directory / "result.json", *run.directory.glob("result.rank*.json")]
    for path in files:
        if path.exists():
            result = json.loads(path.read_text())
            run.results[int(result["rank"])] = result
    return run


def row(run: Run, baseline: Run | None) -> list[str]:
    survivors = [r for r in range(WORKERS) if r in run.results]
    digests = {run.results[r]["params_sha256"] for r in survivors}
    first = run.results.get(survivors[0], {}) if survivors else {}  # rank 0's, unless it failed
    lost = first.get("lost_workers", {})
    heard = [entry["time"] for rank, entry in lost.items() if int(rank) >= WORKERS]
    detect = f"{min(heard) - run.cut_at:.1f}" if heard and run.cut_at else "-"
    fit = first.get("fit_seconds")
    base = baseline.results.get(0, {}).get("fit_seconds") if baseline is not None else None
    versus = f"{fit - base:+.1f}" if fit is not None and base is not None and run is not baseline else "-"
    cut_ranks = range(WORKERS, NODES * WORKERS)
    codes = "/".join(str(run.codes.get(r, "?")) for r in cut_ranks)
    finished = all(r in run.results for r in cut_ranks)
    message = "-" if finished else (run.errors.get(WORKERS) or "?")
    if len(message) > 150:
        message = message[:147] + "..."
    ended = f"{run.node2_ended:.1f}" if run.node2_ended is not None else "-"
    return [
        run.strategy,
        run.cut,
        f"{run.cut_seconds:.1f}" if run.cut != "none" else "-",
        detect,
        f"{len(survivors)}/{WORKERS}"
        + (", one model" if len(digests) == 1 else f", {len(digests)} models")
        + "".join(f"; rank {r} exit {run.codes.get(r)}" for r in range(WORKERS) if r not in run.results),
        f"{fit:.1f}" if fit is not None else "-",
        versus,
        ended if run.cut != "none" else "-",
        f"{codes}: {message}" if run.cut != "none" else codes,
    ] + ([run.failed] if run.failed else [])


HEADER = ["strategy", "cut", "cut (s)", "detect (s)", "survivors", "fit (s)", "vs no cut (s)", "node2 ended (s)"]
HEADER.append("node2 exit: status of ranks 2/3, why")


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.partitions", description=__doc__.split("\n")[0])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--cuts", nargs="+", default=["none", "long", "short"], choices=["none", "long", "short"])
    parser.add_argument("--out", type=Path, default=Path("bench-out/partitions"))
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--step-time", type=float, default=0.2)
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="the detection bound's floor (s)")
    parser.add_argument("--timeout", type=float, default=300.0, help="the strategies' operation timeout (s)")
    parser.add_argument("--cut-after", type=float, default=5.0, help="seconds after set-up to cut node2")
    parser.add_argument("--short", type=float, default=3.0, help="seconds of the short cut")
    parser.add_argument("--long-limit", type=float, default=90.0, help="longest long cut (s)")
    parser.add_argument("--job-timeout", type=float, default=300.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows = []
    with Cluster(NODES, rate="1gbit", prefix="lppart-") as cluster:
        for strategy in args.strategies:
            runs: dict[str, Run] = {}
            for i, cut in enumerate(args.cuts):
                job_id = 26001 + len(rows) + i
                runs[cut] = run_one(cluster, args, strategy, cut, args.out, job_id)
                print(f"{strategy} {cut}: {row(runs[cut], runs.get('none'))}", flush=True)
            rows += [row(runs[cut], runs.get("none")) for cut in args.cuts]
    print()
    print(table(rows))
    print(
        f"\n{len(rows)} runs in {time.monotonic() - started:.0f} s on {platform.node()} "
        f"({platform.machine()}, {platform.system()} {platform.release()}), {time.strftime('%Y-%m-%d')}; "
        f"command: python -m benchmarks.partitions {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    (args.out / "table.md").write_text(table(rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
