"""A bench's rows: the columns read from one run's result, speed-ups against DDP, the files written.

Shared by `bench` (slowdown profiles on this machine) and `cluster_bench` (an emulated cluster).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

FIELDS = [
    "strategy",
    "profile",
    "throughput",
    "predicted_throughput",
    "limit",
    "time_to_target",
    "final_acc",
    "consensus_error",
    "sync_fraction",
    "train_seconds",
    "speedup_vs_ddp",
]


def measured(result: dict[str, Any], target_acc: float) -> dict[str, Any]:
    """The columns of a bench row read from one run's result (`lightning_prague.demo.run`)."""
    seconds = result["train_seconds"]
    samples = result["samples_per_epoch"] * result["epochs_run"]
    reached = [t for t, acc in result["timeline"] if acc >= target_acc]
    waits = [t["wait_seconds"] / seconds for t in result.get("worker_timings", []) if seconds > 0]
    errors = result.get("consensus_error") or [0.0]
    return {
        "throughput": samples / seconds,
        "time_to_target": reached[0] if reached else None,
        "final_acc": result["val_acc"],
        "consensus_error": errors[-1],
        "sync_fraction": sum(waits) / len(waits) if waits else 0.0,
        "train_seconds": seconds,
        "step_seconds": result["step_seconds"],
        "batches": sum(result["batches_per_worker"]),
        "timeline": result["timeline"],
        "measured_allreduce_seconds": result.get("allreduce_seconds"),
    }


def add_speedups(rows: list[dict[str, Any]]) -> None:
    ddp = {row["profile"]: row["train_seconds"] for row in rows if row["strategy"] == "ddp"}
    for row in rows:
        row["speedup_vs_ddp"] = ddp[row["profile"]] / row["train_seconds"] if row["profile"] in ddp else None


def write_outputs(rows: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=2))
    with (out / "bench.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out)


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = list(dict.fromkeys(r["profile"] for r in rows))
    fig, axes = plt.subplots(1, len(profiles), figsize=(5 * len(profiles), 4), squeeze=False)
    for ax, profile in zip(axes[0], profiles):
        for r in (r for r in rows if r["profile"] == profile):
            times, accs = zip(*r["timeline"]) if r["timeline"] else ((), ())
            ax.plot(times, accs, marker="o", label=r["strategy"])
        ax.set(title=f"profile: {profile}", xlabel="training time (s)", ylabel="validation accuracy")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "accuracy_vs_time.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['strategy']}\n{r['profile']}" for r in rows]
    xs = range(len(rows))
    ax.bar(xs, [r["limit"] for r in rows], color="lightgrey", label="physical limit")
    ax.bar(xs, [r["throughput"] for r in rows], width=0.5, label="measured")
    ax.scatter(xs, [r["predicted_throughput"] for r in rows], color="black", zorder=3, label="predicted")
    ax.set_xticks(list(xs), labels, rotation=90, fontsize=7)
    ax.set(ylabel="training samples / s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_limit.png", dpi=100)
    plt.close(fig)
