"""Churn: the throughput of a job whose workers are killed every K seconds and come back.

    python benchmarks/faults.py --churn 30 --strategies prague adpsgd --epochs 40 --step-time 0.2
    python benchmarks/faults.py --churn 30 --single-epoch --step-time 0.2     # one long epoch

For each strategy `benchmarks/faults.py --churn K` runs the digits demo three times, with the
same settings (`--devices`, `--epochs`, `--step-time`, `--batch-size`, ...):

* `none`: fault-free;
* `rejoin`: with `--max-restarts` (default 100 with `--churn`), a worker killed (SIGKILL) every
  K seconds from the start of training, in turn rank 1, 2, ..., N-1, 0, 1, ...; the strategies'
  launcher starts a new process for it, which rejoins the running fit;
* `lost`: the same kills, with `--max-restarts 0`: a killed worker stays lost (the kills stop when
  one worker is left).

`--churn-runs` picks the runs after the fault-free one. `--single-epoch` is one long epoch instead of
many short ones: `--epochs 1`, batches of 2 samples and the training set repeated 4 times (the demo's
`--epoch-repeats`), 2,876 batches, about 150 s of 4 workers at `--step-time 0.2`; a killed worker's
new process can only rejoin inside the epoch (it is admitted at once, with no meeting). It runs
`rejoin` only by default: with kills that stay lost the job would end on one
worker, for several times the span.

The demo writes each rank's current process id to `pid.RANK` when its fit starts, which is how the
bench finds the process of a rank (a restarted one too). Reported per run: the kills, the fit's
span (the first rank's fit start to the last rank's fit end, wall clock), the throughput (epochs x
the fault-free run's batches per epoch / span: every batch of the work queue is trained once),
its ratio to the fault-free run's, the mean time from a kill to the new process's first trained
batch (known for each rank's last process only: the one that writes a result), the mean time from a
kill to the new process's fit start (when the bench, polling every 0.2 s, sees its `pid.RANK`;
known for every kill; a joiner writes it once admitted and sent the fit's state), the kills whose
rank came back, and the leader's validation accuracy. `decent_adam` keeps equal shards per worker, so the
batches of a lost worker's shard are not trained while it is away; its throughput is still
counted in the fault-free run's batches per epoch.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: `--max-restarts` of the `rejoin` runs when `--max-restarts` is not given
CHURN_RESTARTS = 100


class Churn:
    """Kills one rank's current process every `every` seconds from the start of training (see the
    module docstring); called by the bench's polling loop with the run's directory."""

    def __init__(self, every: float, devices: int, restarts: bool) -> None:
        self.every = every
        self.devices = devices
        self.restarts = restarts
        self.kills: list[dict[str, Any]] = []
        self._started: float | None = None
        #: the first fit start, from the first processes' `pid.*` files (their results may never be written)
        self.fit_start: float | None = None
        self._next_rank = 1 % devices
        self._lost: set[int] = set()

    def __call__(self, directory: Path, now: float) -> None:
        pids = read_pids(directory)
        for kill in self.kills:  # a new process for the rank started its fit: it is back
            if "back" not in kill and pids.get(kill["rank"], kill["pid"]) != kill["pid"]:
                kill["back"] = time.time()
        if self._started is None:
            if len(pids) < self.devices:
                return  # training starts when every rank's fit has
            self._started = now
            self.fit_start = min((p.stat().st_mtime for p in directory.glob("pid.*")), default=None)
        if (directory / "result.json").exists() or any(directory.glob("result.rank*.json")):
            return  # the fit is ending: a kill now is not churn
        if now < self._started + self.every * (len(self.kills) + 1):
            return
        if not self.restarts and len(self._lost) >= self.devices - 1:
            return
        rank = self._next_rank
        while rank in self._lost:
            rank = (rank + 1) % self.devices
        self._next_rank = (rank + 1) % self.devices
        pid = pids.get(rank)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.kills.append({"rank": rank, "pid": pid, "time": time.time()})
        if not self.restarts:
            self._lost.add(rank)


def read_pids(directory: Path) -> dict[int, int]:
    """Each rank's current process (`pid.RANK`, written by the demo at its fit's start)."""
    pids = {}
    for path in directory.glob("pid.*"):
        try:
            pids[int(path.suffix[1:])] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return pids


def fit_span(results: dict[str, dict[str, Any]], start: float | None = None) -> float | None:
    """The first rank's fit start (`start`, the first processes' oldest `pid.*` file, or a result's
    `fit_start_time`) to the last fit's end. The results alone are not enough: when every rank was
    killed, they are all from restarted processes, which started their fits late."""
    ends = [r["fit_end_time"] for r in results.values() if r.get("fit_end_time")]
    starts = [r["fit_start_time"] for r in results.values() if r.get("fit_start_time")]
    starts += [start] if start is not None else []
    if not ends or not starts:
        return None
    return max(ends) - min(starts)


def rejoin_seconds(results: dict[str, dict[str, Any]], kills: list[dict[str, Any]]) -> float | None:
    """Mean, over the restarted processes that wrote a result, of the time from the kill of their
    rank's previous process to their first trained batch."""
    spans = []
    for result in results.values():
        if not result.get("restarts") or not result.get("first_batch_time"):
            continue
        before = [k["time"] for k in kills if k["rank"] == result["rank"] and k["time"] < result["first_batch_time"]]
        if before:
            spans.append(result["first_batch_time"] - max(before))
    return sum(spans) / len(spans) if spans else None


def back_seconds(kills: list[dict[str, Any]]) -> list[float]:
    """For each kill whose rank came back: the time to its new process's fit start (as the bench saw it)."""
    return [k["back"] - k["time"] for k in kills if "back" in k]


def churn_row(
    strategy: str,
    mode: str,
    run: dict[str, Any],
    kills: list[dict[str, Any]],
    free: dict[str, Any] | None,
    start: float | None = None,
) -> dict[str, Any]:
    results = run["results"]
    row: dict[str, Any] = {"strategy": strategy, "mode": mode, "run": run["label"], "kills": len(kills)}
    if not results:
        return {**row, "outcome": f"FAILED ({run['ended']}, exit status {run['exit_status']})"}
    leader = results[min(results, key=int)]
    span = fit_span(results, start)
    batches = free["batches_per_epoch"] if free else sum(leader["batches_per_worker"]) / max(1, leader["epochs_run"])
    row.update(
        outcome=f"{len(results)} fits returned, exit status {run['exit_status']}",
        span_seconds=span,
        epochs=leader["epochs_run"],
        batches_per_epoch=batches,
        throughput=batches * leader["epochs_run"] / span if span else None,
        rejoin_seconds=rejoin_seconds(results, kills),
        val_acc=leader["val_acc"],
    )
    back = back_seconds(kills)
    if back:
        row.update(back=len(back), back_seconds=sum(back) / len(back), back_seconds_each=back)
    if free and free.get("throughput") and row["throughput"]:
        row["of_fault_free"] = row["throughput"] / free["throughput"]
    return row


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_churn_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | run | kills | back | outcome | span (s) | batches/s | of fault-free | kill to fit start (s) "
        "| kill to first batch (s) | val_acc |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = "-" if r.get("of_fault_free") is None else f"{100 * r['of_fault_free']:.1f}%"
        lines.append(
            f"| {r['strategy']} | {r['mode']} | {r['kills']} | {r.get('back', '-')} | {r['outcome']} | "
            f"{_num(r.get('span_seconds'))} | {_num(r.get('throughput'))} | {share} | {_num(r.get('back_seconds'))} | "
            f"{_num(r.get('rejoin_seconds'))} | {_num(r.get('val_acc'), 4)} |"
        )
    return "\n".join(lines)


def run_churn(
    args: Any, demo_argv: Callable[[str, Any], list[str]], run: Callable[..., dict[str, Any]]
) -> list[dict[str, Any]]:
    """The churn comparison for each of `args.strategies` (see the module docstring); `run(label,
    argv, survivors, during)` is the bench's bounded launch."""
    rows: list[dict[str, Any]] = []
    everyone = set(range(args.devices))
    restarts = args.max_restarts if args.max_restarts else CHURN_RESTARTS
    for strategy in args.strategies:
        base = demo_argv(strategy, args)
        free_run = run(f"{strategy}-churn-none", base, everyone)
        free = churn_row(strategy, "none", free_run, [], None)
        free["of_fault_free"] = 1.0 if free.get("throughput") else None
        rows.append(free)
        for mode, budget in [(m, restarts if m == "rejoin" else 0) for m in args.churn_runs]:
            killer = Churn(args.churn, args.devices, restarts=budget > 0)
            # the fit is over once the ranks still alive have written their results: `None` waits for the command
            churn_run = run(f"{strategy}-churn-{mode}", [*base, "--max-restarts", str(budget)], None, killer)
            row = churn_row(strategy, mode, churn_run, killer.kills, free, killer.fit_start)
            row["kill_times"] = [k["time"] for k in killer.kills]
            row["kills_each"] = killer.kills
            rows.append(row)
        write_churn(args, rows)
    return rows


def write_churn(args: Any, rows: list[dict[str, Any]]) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "every": args.churn,
        "single_epoch": args.single_epoch,
        "epochs": args.epochs,
        "step_time": args.step_time,
        "batch_size": args.batch_size,
        "epoch_repeats": args.epoch_repeats,
    }
    (args.out / "churn.json").write_text(json.dumps({**settings, "rows": rows}, indent=2))
    (args.out / "churn.md").write_text(format_churn_table(rows) + "\n")
