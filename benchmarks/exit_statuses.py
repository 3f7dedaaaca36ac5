"""What SLURM and torchrun report when a rank is lost or excluded: measured on an emulated cluster.

    sudo -E env PATH="$PATH" python -m benchmarks.exit_statuses --out /tmp/exit-statuses

Jobs of the digits demo (`prague`, 2 nodes x 2 workers, 1 Gbit/s links, 0.05 s steps, a 3 s hang
bound), each with one fault at rank R's 10th batch, launched two ways:

- **srun**: `lightning_prague.tools.cluster.srun` per node, the tasks started as ``srun`` starts
  them (``--kill-on-bad-exit=0``); the step's status, which a batch script ending in ``srun``
  returns and SLURM records as the job's, is its worst task's;
- **torchrun**: one agent per node (c10d rendezvous on node1, ``--max-restarts 0``, and once 1,
  where the fit resumes from its last checkpoint); the job succeeded when every agent exits 0.

The faults: ``hang`` (the rank sleeps in its training step: the control plane excludes it, and
it exits with the excluded status, 0 unless `LIGHTNING_PRAGUE_EXCLUDED_EXIT_STATUS` says
otherwise; the table runs it both ways) and ``kill`` (SIGKILL). Columns: the ranks whose fit
finished (a result file), each rank's exit status as its launcher saw it (``-``: none reported, it
exited 0), the launchers' statuses, and what the job's status then is.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lightning_prague.tools.cluster import Cluster, clean_environment

ROOT = Path(__file__).resolve().parents[1]
NODES, WORKERS = 2, 2


@dataclass(frozen=True)
class Case:
    launcher: str  # srun | torchrun
    fault: str  # RANK:BATCH:KIND
    excluded_status: str | None = None  # LIGHTNING_PRAGUE_EXCLUDED_EXIT_STATUS, None: the default (0)
    max_restarts: int = 0  # torchrun's --max-restarts

    @property
    def name(self) -> str:
        status = "" if self.excluded_status is None else f"-excluded{self.excluded_status}"
        restarts = f"-restarts{self.max_restarts}" if self.max_restarts else ""
        return f"{self.launcher}-{self.fault.replace(':', '_')}{status}{restarts}"


CASES = [
    Case("srun", "3:10:hang"),
    Case("srun", "3:10:hang", "75"),
    Case("srun", "3:10:kill"),
    Case("torchrun", "3:10:hang"),
    Case("torchrun", "3:10:hang", "75"),
    Case("torchrun", "3:10:kill"),
    Case("torchrun", "1:10:kill"),  # a rank on the rendezvous host's node, whose agent hosts the store
    Case("torchrun", "3:10:kill", max_restarts=1),  # every worker restarted, the fit resumed
]


def demo_args(case: Case, out: Path, epochs: int) -> list[str]:
    resume = ["--checkpoint-dir", str(out / "checkpoints")] if case.max_restarts else []  # what a restart resumes
    return [*resume,
        "--strategy", "prague", "--devices", str(WORKERS), "--num-nodes", str(NODES), "--epochs", str(epochs),
        "--step-time", "0.05", "--hang-timeout", "3", "--hang-factor", "5", "--profile", "homogeneous",
        "--fault", case.fault, "--json", str(out / "result.json"),
    ]  # fmt: skip


def node_env(node, out: Path, case: Case) -> dict[str, str]:
    env = {"GLOO_SOCKET_IFNAME": node.ifname, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    env["PATH"] = f"{Path(sys.executable).parent}:{clean_environment().get('PATH', '')}"
    if case.excluded_status is not None:
        env["LIGHTNING_PRAGUE_EXCLUDED_EXIT_STATUS"] = case.excluded_status
    return clean_environment(env)


def launch(cluster: Cluster, case: Case, out: Path, epochs: int, job_id: int) -> list[subprocess.Popen]:
    procs = []
    for node in cluster.nodes:
        if case.launcher == "srun":
            argv = [
                sys.executable, "-m", "lightning_prague.tools.cluster.srun", "--nnodes", str(NODES),
                "--node-id", str(node.index), "--ntasks-per-node", str(WORKERS), "--nodelist", f"node[1-{NODES}]",
                "--job-id", str(job_id), "--master-addr", "node1", "--preload", "--log-dir", str(out),
                "-m", "lightning_prague.demo.run", "--", *demo_args(case, out, epochs),
            ]  # fmt: skip
        else:
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                "--nproc-per-node", str(WORKERS), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"node1:{29400 + job_id % 100}", "--rdzv-id", case.name, "--max-restarts", str(case.max_restarts),
                "-m", "lightning_prague.demo.run", *demo_args(case, out, epochs),
            ]  # fmt: skip
        log = open(out / f"{case.launcher}-{node.name}.log", "w")
        procs.append(cluster.run(node, argv, node_env(node, out, case), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    return procs


def rank_statuses(case: Case, out: Path) -> dict[int, str]:
    """Each rank's non-zero exit status as its launcher reported it."""
    text = "\n".join(p.read_text(errors="replace") for p in sorted(out.glob(f"{case.launcher}-node*.log")))
    found: dict[int, str] = {}
    if case.launcher == "srun":
        for rank, code in re.findall(r"rank (\d+)\) exited with (-?\d+)", text):
            found[int(rank)] = code
    else:  # torchrun's error report: "rank : R (local_rank: L)" ... "exitcode : N"
        for rank, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", text):
            found[int(rank)] = code
    return found


def run_case(cluster: Cluster, case: Case, root: Path, epochs: int, job_id: int, timeout: float) -> list[str]:
    out = root / case.name
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    procs = launch(cluster, case, out, epochs, job_id)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(max(1.0, timeout - (time.monotonic() - start))))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(None)
    finished = sorted(json.loads(p.read_text())["rank"] for p in out.glob("result*.json") if p.read_text().strip())
    statuses = rank_statuses(case, out)
    each = " ".join(f"{r}:{statuses.get(r, '-')}" for r in range(NODES * WORKERS))
    if case.launcher == "srun":
        worst = max((c for c in codes if c is not None), key=abs, default=None)
        job = "COMPLETED" if worst == 0 else f"FAILED ({worst})"
    else:
        job = "SUCCEEDED" if codes == [0] * NODES else "FAILED"
    excluded = case.excluded_status or "0 (default)"
    return [case.launcher, case.fault, excluded, ",".join(map(str, finished)) or "none", each, str(codes), job,
            f"{time.monotonic() - start:.0f}"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-out/exit-statuses"))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per job before its processes are killed")
    parser.add_argument("--cases", nargs="+", help="case names to run (default: all)")
    args = parser.parse_args(argv)
    header = ["launcher", "fault", "excluded status", "fit finished", "rank:status", "launchers", "job", "s"]
    rows = []
    with Cluster(NODES, rate="1gbit") as cluster:
        for i, case in enumerate(CASES):
            if args.cases and case.name not in args.cases:
                continue
            rows.append(run_case(cluster, case, args.out, args.epochs, 26001 + i, args.timeout))
            print(" | ".join(rows[-1]), flush=True)
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]
    print("\n".join(table))
    (args.out / "table.md").write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
