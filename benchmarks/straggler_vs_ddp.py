"""Training time of strategy="prague" against Lightning's DDP, measured in the same run.

    python benchmarks/straggler_vs_ddp.py --devices 8 --epochs 4 --repeats 1

The workload is the digits demo with each step stretched to --step-time seconds (a sleep, as in
the papers) and, under the ``straggler`` profile, rank 0 slowed down --slow-factor times. Times are
from the start to the end of training (process start-up excluded) on rank 0; the ratio is
ddp / strategy, so above 1 means faster than DDP.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]


def run(strategy: str, profile: str, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "lightning_prague.demo.run",
            "--strategy",
            strategy,
            "--devices",
            str(args.devices),
            "--epochs",
            str(args.epochs),
            "--profile",
            profile,
            "--slow-factor",
            str(args.slow_factor),
            "--step-time",
            str(args.step_time),
            "--json",
            str(out),
        ]
        subprocess.run(cmd, cwd=tmp, check=True, capture_output=True, timeout=900)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--step-time", type=float, default=0.05)
    parser.add_argument("--slow-factor", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--strategies", nargs="+", default=["prague"])
    parser.add_argument("--profiles", nargs="+", default=["straggler", "homogeneous"])
    args = parser.parse_args()
    rows = []
    for profile in args.profiles:
        times: dict[str, list[float]] = {}
        accs: dict[str, list[float]] = {}
        for _ in range(args.repeats):
            for strategy in ["ddp", *args.strategies]:
                result = run(strategy, profile, args)
                times.setdefault(strategy, []).append(result["train_seconds"])
                accs.setdefault(strategy, []).append(result["val_acc"])
                print(
                    f"{profile:12s} {strategy:10s} train={result['train_seconds']:.2f}s "
                    f"val_acc={result['val_acc']:.4f} batches={result['batches_per_worker']}",
                    flush=True,
                )
        ddp_time = median(times["ddp"])
        for strategy in args.strategies:
            rows.append(
                {
                    "profile": profile,
                    "strategy": strategy,
                    "train_seconds": median(times[strategy]),
                    "ddp_train_seconds": ddp_time,
                    "speedup_vs_ddp": ddp_time / median(times[strategy]),
                    "val_acc": median(accs[strategy]),
                    "ddp_val_acc": median(accs["ddp"]),
                }
            )
    print(f"\n{'profile':12s} {'strategy':10s} {'time':>7s} {'ddp':>7s} {'speedup':>8s} {'acc':>7s} {'ddp acc':>7s}")
    for r in rows:
        print(
            f"{r['profile']:12s} {r['strategy']:10s} {r['train_seconds']:7.2f} {r['ddp_train_seconds']:7.2f} "
            f"{r['speedup_vs_ddp']:8.2f} {r['val_acc']:7.4f} {r['ddp_val_acc']:7.4f}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
