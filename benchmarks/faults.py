"""Lost workers: how the asynchronous strategies survive a killed or hung worker, against DDP and restart-and-resume.

    python benchmarks/faults.py                                          # 4 strategies x (kill:2, hang:2, kill:0)
    python benchmarks/faults.py --strategies prague adpsgd --faults kill:2 stop:2 --epochs 4
    python benchmarks/faults.py --faults kill-in-exchange:1 raise:3 --no-baselines --out bench-raise
    python benchmarks/faults.py --faults kill:2 kill:0 hang:2@prague,adpsgd     # hang: two strategies only

Every run is the digits demo (`python -m lightning_prague.demo.run`) on `--devices` CPU workers
(default 4, `--step-time` 0.05 s, `--group-size` 2, `--profile homogeneous`: no straggler, so a
fault is the only disturbance), started as a command of its own with the default launcher
(`--start-method popen`: ranks 1..N-1 are children of rank 0; when rank 0 is killed the others go
on as orphans). A fault is `KIND:RANK` (`kill`, `hang`, `stop`, `raise`, ...: the kinds of
`lightning_prague.demo.faults`): rank RANK strikes when it starts its `--fault-batch`-th training
batch (default: the middle of epoch 2, or of epoch 1 with fewer than 3 epochs, from the batches per
worker and epoch of the strategy's fault-free run); `KIND:RANK@STRATEGY,...` runs it under those
strategies only. Per strategy the bench runs once fault-free, then once per fault, and waits
(polling, with the `--timeout` deadline) for the result file of every rank that should survive,
not only for the command: an orphaned rank still writes its result.

Reported per (strategy, fault):

* detect: min over the survivors of the time each heard of the loss (`lost_workers[rank].time`,
  wall clock) minus the time the faulted rank struck (`fault.RANK.json`);
* recover: what the fault cost the survivors: max over the survivors of (its fit time with the
  fault - the same rank's fit time in the fault-free run);
* throughput before / after: batches per second of all workers together, from the leader's
  `timeline` (the time of each epoch's validation since the start of training, so epoch k takes
  `t[k] - t[k-1]`, validation included) and the batches of an epoch (all workers, measured in the
  fault-free run; after the fault, the survivors' shares of it where a strategy keeps equal
  shards, `decent_adam`, instead of a work queue): before = the epochs before the one the fault
  struck in, after = the epochs after it (`-` when there are none); a fault-free row's is over
  all its epochs;
* batches trained: the survivors' training batches plus the faulted rank's before it struck, of
  the fault-free run's (the asynchronous strategies share one work queue of batches per epoch);
* val_acc of the leader (the lowest surviving rank) and its gap to the fault-free run, in points
  (after a loss the validation set is resharded among the survivors, so it is the whole set);
* whether the survivors' `params_checksum` agree.

Baselines (unless `--no-baselines`): Lightning's DDP fault-free and with each fault (it dies when a
rank dies: the exit status of the command, the wall time, and when the last of its processes ended
after the fault; a hung rank stalls the others in their all-reduce until the process group's 30
minute timeout, so the bench kills a DDP run `--ddp-stall` seconds after its fault and reports it
hung); and restart-and-resume: DDP with `--checkpoint-dir` and a kill of rank 2 (the DDP kill:2 run
when it is in `--faults`), then a second DDP run with `--resume <dir>/last.ckpt` that finishes the
epochs. Its cost is the wall time of both runs (each from launch to the end of its last process, or
to the last result file) less the wall time of the fault-free DDP run: it includes a second start-up
of every worker, but not the time it takes to notice the failure and relaunch.

Each run works in a directory of its own, `--out/runs/<label>/` (emptied first: its `log.txt`, the
ranks' `result*.json`, the `fault.*.json`, DDP's checkpoints). Every run is bounded: at `--timeout`
seconds, `--ddp-stall` seconds after a DDP run's fault, or `--exit-grace` seconds after the last
survivor wrote its result (a hung rank may never exit, and rank 0's process waits for its children), the
bench SIGKILLs what is left of the run: its process group and any process whose command line names
the run's result file (the supervisor, in a session of its own, is forked from rank 0). Writes
`faults.json` (the settings, every run and every row) and `faults.md` (the table) to `--out`.
Linux only (it reads `/proc` to find a run's processes).
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STRATEGIES = ("prague", "partial_reduce", "adpsgd", "decent_adam")


def _fault_kinds() -> tuple[str, ...]:
    """`lightning_prague.demo.faults.KINDS`, read from its source (importing the package imports Lightning)."""
    spec = importlib.util.find_spec("lightning_prague")  # finds the package without running its __init__
    assert spec is not None and spec.submodule_search_locations, "lightning_prague is not installed"
    source = Path(next(iter(spec.submodule_search_locations))) / "demo" / "faults.py"
    for node in ast.parse(source.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "KINDS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError(f"no KINDS in {source}")


KINDS = _fault_kinds()
DEFAULT_FAULTS = ("kill:2", "hang:2", "kill:0")
#: `--epoch-repeats` of `--single-epoch`: 4 x 719 batches of 2 samples, about 150 s of 4 workers at 0.2 s a step
SINGLE_EPOCH_REPEATS = 4
#: variables of an enclosing distributed job that would make the demo join it instead of starting its own
DISTRIBUTED_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "GLOBAL_RANK", "RANK", "WORLD_SIZE")


def parse_fault(spec: str) -> tuple[str, int, tuple[str, ...]]:
    """`KIND:RANK`, or `KIND:RANK@STRATEGY,...` to run it under those strategies only (DDP runs every fault)."""
    fault, _, only = spec.partition("@")
    kind, _, rank = fault.rpartition(":")
    strategies = tuple(only.split(",")) if only else ()
    if kind not in KINDS or not rank.isdigit() or not set(strategies) <= set(STRATEGIES):
        raise argparse.ArgumentTypeError(
            f"{spec!r} is not KIND:RANK[@STRATEGY,...] with KIND one of {', '.join(KINDS)} "
            f"and STRATEGY one of {', '.join(STRATEGIES)}"
        )
    return kind, int(rank), strategies


def fault_name(fault: tuple[str, int, tuple[str, ...]]) -> str:
    return f"{fault[0]}:{fault[1]}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES), metavar="STRATEGY",
                        help=f"asynchronous strategies to run: {', '.join(STRATEGIES)}")  # fmt: skip
    parser.add_argument(
        "--faults",
        nargs="+",
        type=parse_fault,
        default=[parse_fault(f) for f in DEFAULT_FAULTS],
        metavar="KIND:RANK[@STRATEGY,...]",
        help=f"one run each; @ limits a fault to some strategies (default: {' '.join(DEFAULT_FAULTS)})",
    )
    parser.add_argument("--devices", type=int, default=4, help="CPU worker processes")
    parser.add_argument("--epochs", type=int, help="default 3 (1 with --single-epoch)")
    parser.add_argument("--step-time", type=float, default=0.05, help="simulated compute time per step (s)")
    parser.add_argument("--batch-size", type=int, help="the demo's (default 32, 2 with --single-epoch)")
    parser.add_argument(
        "--epoch-repeats", type=int, help="the demo's: the training set this many times per epoch (default 1, "
        f"{SINGLE_EPOCH_REPEATS} with --single-epoch)",
    )  # fmt: skip
    parser.add_argument("--group-size", type=int, default=2, help="prague / partial_reduce group size")
    parser.add_argument("--profile", default="homogeneous", help="the demo's slowdown profile")
    parser.add_argument("--hang-timeout", type=float, default=10.0, help="the strategies' shortest hang bound (s)")
    parser.add_argument("--fault-batch", type=int, help="the faulted rank's batch (counted over the fit) to strike at")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baselines", action="store_true", help="skip DDP and restart-and-resume")
    parser.add_argument(
        "--timeout", type=float, help="wall-clock bound of one run (s; default 300, 900 with --single-epoch)"
    )
    parser.add_argument("--ddp-stall", type=float, default=20.0, help="kill a DDP run this long after its fault (s)")
    parser.add_argument(
        "--exit-grace", type=float, default=10.0, help="kill what is left of a run this long after its last result (s)"
    )
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="the demo's: a killed rank's process is started again and rejoins"
    )
    parser.add_argument(
        "--churn", type=float, metavar="SECONDS", help="instead of --faults: kill a worker every SECONDS (churn.py)"
    )
    parser.add_argument(
        "--single-epoch",
        action="store_true",
        help="with --churn: one long epoch of small batches (--epochs 1 --batch-size 2 "
        f"--epoch-repeats {SINGLE_EPOCH_REPEATS}), the killed workers rejoining inside it",
    )
    parser.add_argument(
        "--churn-runs",
        nargs="+",
        choices=("rejoin", "lost"),
        help="the churn runs after the fault-free one (default: rejoin lost; rejoin with --single-epoch)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-out/faults"))
    args = parser.parse_args(argv)
    single = args.single_epoch
    args.epochs = args.epochs if args.epochs is not None else 1 if single else 3
    args.batch_size = args.batch_size or (2 if single else 32)
    args.epoch_repeats = args.epoch_repeats or (SINGLE_EPOCH_REPEATS if single else 1)
    args.timeout = args.timeout or (900.0 if single else 300.0)
    args.churn_runs = args.churn_runs or (["rejoin"] if single else ["rejoin", "lost"])
    problems = []
    if single and (args.churn is None or args.epochs != 1):
        problems.append("--single-epoch: with --churn, and one epoch (--epochs 1)")
    if args.batch_size < 2 or args.epoch_repeats < 1:
        problems.append("--batch-size: at least 2 (the model's BatchNorm); --epoch-repeats: at least 1")
    if args.devices < 3:
        problems.append(f"--devices {args.devices}: at least 3 (a fault leaves at least 2 workers)")
    if args.epochs < 1:
        problems.append(f"--epochs {args.epochs}: at least 1")
    if args.step_time <= 0 or args.hang_timeout <= 0:
        problems.append("--step-time and --hang-timeout must be positive")
    if not 2 <= args.group_size <= args.devices:
        problems.append(f"--group-size {args.group_size}: between 2 and --devices ({args.devices})")
    if args.max_restarts < 0 or (args.churn is not None and args.churn <= 0):
        problems.append("--max-restarts must be at least 0 and --churn positive")
    if args.fault_batch is not None and args.fault_batch < 1:
        problems.append(f"--fault-batch {args.fault_batch}: batches count from 1")
    bad = [fault_name(f) for f in args.faults if f[1] >= args.devices]
    if bad:
        problems.append(f"--faults {' '.join(bad)}: ranks are 0..{args.devices - 1}")
    if args.out.exists() and not args.out.is_dir():
        problems.append(f"--out {args.out}: exists and is not a directory")
    if not Path("/proc/self/stat").exists():
        problems.append("this benchmark reads /proc to find the processes of a run (Linux only)")
    if problems:
        parser.error("; ".join(problems))
    args.faults = list(dict.fromkeys(args.faults))
    args.out = args.out.resolve()
    return args


# --------------------------------------------------------------------------- the processes of a run


def _processes() -> list[tuple[int, str, int]]:
    """(pid, state, process group) of every process on this machine."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        found.append((int(entry.name), fields[0], int(fields[2])))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def run_processes(group: int, marker: str) -> list[int]:
    """The live processes of a run: its process group (the command and its rank children, orphaned or
    not) and any process whose command line holds `marker` (the supervisor has a session of its own)."""
    me = os.getpid()
    return [
        pid
        for pid, state, pgrp in _processes()
        if pid != me and state not in "ZX" and (pgrp == group or marker in _cmdline(pid))
    ]


def _describe(pid: int, group: int) -> str:
    """`rank R` (a rank's process: its LOCAL_RANK, 0 when unset) or `supervisor` (outside the group)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.partition(b"=")[::2] for item in f.read().split(b"\0") if item)
        rank = env.get(b"LOCAL_RANK", b"0").decode()
    except OSError:
        rank = "?"
    return f"rank {rank}" if os.getpgid(pid) == group else "supervisor"


def kill_run(group: int, marker: str) -> list[str]:
    """SIGKILL every live process of the run, by pid; returns what was killed (`pid (role)`)."""
    killed: dict[int, str] = {}
    for _ in range(20):
        pids = run_processes(group, marker)
        if not pids:
            break
        for pid in pids:
            try:
                role = killed.get(pid) or _describe(pid, group)
                os.kill(pid, signal.SIGKILL)
                killed[pid] = role
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return [f"{pid} ({role})" for pid, role in killed.items()]


# --------------------------------------------------------------------------- one run


def read_results(directory: Path) -> dict[int, dict[str, Any]]:
    """The ranks' result files (the leader's is `result.json`, the others' `result.rankR.json`), by rank."""
    results = {}
    for path in directory.glob("result*.json"):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):  # being written
            continue
        result["written_at"] = path.stat().st_mtime
        results[int(result["rank"])] = result
    return results


def read_fault_time(directory: Path) -> float | None:
    times = []
    for path in directory.glob("fault.*.json"):
        try:
            times.append(float(json.loads(path.read_text())["time"]))
        except (OSError, ValueError, KeyError):
            continue
    return min(times) if times else None


def launch(
    label: str,
    argv: list[str],
    args: argparse.Namespace,
    survivors: set[int] | None,
    during: Callable[[Path, float], None] | None = None,
) -> dict[str, Any]:
    """Run the demo with `argv` in `--out/runs/<label>`, bounded; returns what happened.

    `survivors`: the ranks that should write a result (the run is over once they have, plus
    `--exit-grace`); `None` for a DDP run with a fault (over when its processes are gone, or
    `--ddp-stall` seconds after the fault). `during(directory, now)`: called while it runs (churn's kills).
    """
    directory = args.out / "runs" / label
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    result_file = directory / "result.json"
    command = [sys.executable, "-m", "lightning_prague.demo.run", *argv, "--json", str(result_file)]
    env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env["PYTHONUNBUFFERED"] = "1"
    marker = str(result_file)
    start = time.time()
    with open(directory / "log.txt", "wb") as log:
        proc = subprocess.Popen(
            command, cwd=directory, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip
    group = proc.pid
    fault_time = results_complete = None
    ended = "ended"
    while True:
        time.sleep(0.2)
        proc.poll()  # reap the command, so it does not count as live
        now = time.time()
        live = run_processes(group, marker)
        fault_time = fault_time or read_fault_time(directory)
        if not live:
            break
        if during is not None:
            during(directory, now)
        if survivors and results_complete is None and survivors <= read_results(directory).keys():
            results_complete = now
        if results_complete is not None and now - results_complete > args.exit_grace:
            ended = "leftovers killed"
            break
        if survivors is None and fault_time is not None and now - fault_time > args.ddp_stall:
            ended = "stalled"
            break
        if now - start > args.timeout:
            ended = "timeout"
            break
    last_process = time.time()
    killed = kill_run(group, marker) if ended != "ended" else []
    try:
        status = proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        status = None
    fault_time = fault_time or read_fault_time(directory)
    results = read_results(directory)
    finished = bool(survivors) and survivors <= results.keys()
    end = max(r["written_at"] for r in results.values()) if finished else last_process
    return {
        "label": label,
        "command": shlex.join(command),
        "directory": str(directory),
        "exit_status": status,  # the command's: rank 0's process
        "ended": ended,  # ended (every process exited), leftovers killed, stalled, timeout
        "killed": killed,  # what was left of it at the end, SIGKILLed by the bench
        "finished": finished,  # every expected survivor wrote its result
        "start": start,
        "fault_time": fault_time,
        "last_process": last_process,  # when its last process ended (or was found still running, then killed)
        "wall_seconds": end - start,  # launch to the last survivor's result, or to the end of its processes
        "results": {str(rank): result for rank, result in sorted(results.items())},
    }


# --------------------------------------------------------------------------- what a run measured


def per_epoch_batches(result: dict[str, Any]) -> float:
    return sum(result["batches_per_worker"]) / max(1, result["epochs_run"])


def default_fault_batch(free: dict[str, Any], args: argparse.Namespace) -> int:
    """The middle of epoch 2 (epoch 1 with fewer than 3 epochs), in the faulted rank's own batches."""
    per_rank = per_epoch_batches(free) / args.devices
    epoch = 2 if args.epochs >= 3 else 1
    return max(1, round(per_rank * (epoch - 0.5)))


def fault_epoch(batch: int, free: dict[str, Any], args: argparse.Namespace) -> int:
    """The epoch (from 1) in which the faulted rank reaches `batch`, from the fault-free batches per rank."""
    per_rank = per_epoch_batches(free) / args.devices
    return min(args.epochs, max(1, math.ceil(batch / per_rank)))


def throughput(timeline: list[list[float]], epochs: list[int], batches: float) -> float | None:
    """Batches per second over `epochs` (numbered from 1) of `timeline`, `batches` per epoch."""
    ends = [0.0] + [t for t, _ in timeline]
    spans = [ends[k] - ends[k - 1] for k in epochs if 1 <= k < len(ends)]
    return batches * len(spans) / sum(spans) if spans and sum(spans) > 0 else None


@functools.cache
def shares_work_queue(strategy: str) -> bool:
    """Whether `strategy` shards training batches by one work queue (imports Lightning, once)."""
    from lightning_prague.strategies import STRATEGIES as CLASSES

    return bool(CLASSES[strategy][0].shards_by_work_queue)


def free_row(strategy: str, run: dict[str, Any]) -> dict[str, Any]:
    results = {int(r): v for r, v in run["results"].items()}
    row: dict[str, Any] = {
        "strategy": strategy,
        "fault": "none",
        "run": run["label"],
        "wall_seconds": run["wall_seconds"],
    }
    if not run["finished"]:
        return {**row, "outcome": f"FAILED ({run['ended']}, exit status {run['exit_status']})"}
    leader = results[min(results)]
    batches = per_epoch_batches(leader)
    row.update(
        outcome=f"{len(results)}/{len(results)} finished",
        fit_seconds=max(r["fit_seconds"] for r in results.values()),
        batches_per_epoch=batches,
        batches=sum(leader["batches_per_worker"]),
        batches_fault_free=sum(leader["batches_per_worker"]),
        before=throughput(leader["timeline"], list(range(1, leader["epochs_run"] + 1)), batches),
        val_acc=leader["val_acc"],
        checksums_agree=_agree([r["params_checksum"] for r in results.values()]),
    )
    return row


def _agree(values: list[float]) -> bool:
    return all(math.isclose(v, values[0], rel_tol=1e-6, abs_tol=1e-6) for v in values)


def fault_row(
    strategy: str,
    fault: tuple[str, int, tuple[str, ...]],
    batch: int,
    run: dict[str, Any],
    free: dict[str, Any],
    args: argparse.Namespace,
) -> dict[str, Any]:
    kind, rank, _ = fault
    results = {int(r): v for r, v in run["results"].items()}
    survivors = [r for r in range(args.devices) if r != rank]
    row: dict[str, Any] = {
        "strategy": strategy,
        "fault": f"{kind}:{rank}",
        "fault_batch": batch,
        "run": run["label"],
        "wall_seconds": run["wall_seconds"],
        "fault_struck": run["fault_time"] is not None,
        "survivors_finished": sorted(r for r in results if r in survivors),
        "killed_by_bench": run["killed"],
    }
    if run["fault_time"] is None:
        return {**row, "outcome": f"FAULT DID NOT STRIKE ({run['ended']})"}
    done = [r for r in survivors if r in results]
    row["outcome"] = f"{len(done)}/{len(survivors)} finished" + ("" if run["finished"] else f" ({run['ended']})")
    if not done:
        return row
    heard = [results[r]["lost_workers"].get(str(rank), {}).get("time") for r in done]
    delays = [t - run["fault_time"] for t in heard if t]
    row["detect_seconds"] = min(delays) if delays else None
    row["detect_seconds_all"] = delays
    row["undetected_by"] = [r for r, t in zip(done, heard) if not t]
    row["other_losses"] = sorted({k for r in done for k in results[r]["lost_workers"] if k != str(rank)})
    free_results = {int(r): v for r, v in free["results"].items()}
    costs = [results[r]["fit_seconds"] - free_results[r]["fit_seconds"] for r in done if r in free_results]
    row["recover_seconds"] = max(costs) if costs else None
    leader = results[min(done)]
    free_leader = free_results[min(free_results)]
    batches = per_epoch_batches(free_leader)
    struck = fault_epoch(batch, free_leader, args)
    row["fault_epoch"] = struck
    row["before"] = throughput(leader["timeline"], list(range(1, struck)), batches)
    # a work queue hands the survivors every batch of an epoch; equal shards lose the lost rank's
    after = batches if shares_work_queue(strategy) else batches * len(survivors) / args.devices
    row["after"] = throughput(leader["timeline"], list(range(struck + 1, args.epochs + 1)), after)
    row["epoch_seconds"] = [
        b - a for a, b in zip([0.0] + [t for t, _ in leader["timeline"]], [t for t, _ in leader["timeline"]])
    ]
    row["fit_seconds"] = max(results[r]["fit_seconds"] for r in done)
    row["epochs_run"] = leader["epochs_run"]
    row["val_acc"] = leader["val_acc"]
    row["val_acc_gap_points"] = 100 * (leader["val_acc"] - free_leader["val_acc"])
    row["checksums_agree"] = _agree([results[r]["params_checksum"] for r in done])
    back = results.get(rank) if args.max_restarts else None  # its new process rejoined and finished the fit
    if back is not None and back.get("restarts"):
        row["rejoined"] = {
            "first_batch_after_fault": back["first_batch_time"] - run["fault_time"],
            "batches": back["batches_this_process"],
            "agrees": _agree([back["params_checksum"], leader["params_checksum"]]),
            "fit_returned_after_fault": back["fit_end_time"] - run["fault_time"],
        }
    # training batches of the fit: the survivors' and the faulted rank's before it struck, of the fault-free run's
    row["batches"] = sum(leader["batches_per_worker"]) + batch - 1
    row["batches_fault_free"] = sum(free_leader["batches_per_worker"])
    return row


def ddp_fault_row(fault: tuple[str, int, tuple[str, ...]], batch: int, run: dict[str, Any]) -> dict[str, Any]:
    kind, rank, _ = fault
    row: dict[str, Any] = {
        "strategy": "ddp",
        "fault": f"{kind}:{rank}",
        "fault_batch": batch,
        "run": run["label"],
        "wall_seconds": run["wall_seconds"],
        "exit_status": run["exit_status"],
        "fault_struck": run["fault_time"] is not None,
    }
    if run["fault_time"] is None:
        return {**row, "outcome": f"FAULT DID NOT STRIKE ({run['ended']})"}
    after = run["last_process"] - run["fault_time"]
    row["ended_after_fault_seconds"] = after
    if run["results"]:
        row["outcome"] = f"finished?! ({len(run['results'])} results, exit status {run['exit_status']})"
    elif run["ended"] == "ended":
        row["outcome"] = f"died: exit status {run['exit_status']}, all processes gone {after:.1f} s after the fault"
    else:
        row["outcome"] = f"hung ({run['ended']}): killed by the bench {after:.0f} s after the fault"
    return row


def restart_row(first: dict[str, Any], second: dict[str, Any], free: dict[str, Any] | None) -> dict[str, Any]:
    total = first["wall_seconds"] + second["wall_seconds"]
    row: dict[str, Any] = {
        "strategy": "ddp restart",
        "fault": "kill:2",
        "run": f"{first['label']} + {second['label']}",
        "wall_seconds": total,
        "first_wall_seconds": first["wall_seconds"],
        "second_wall_seconds": second["wall_seconds"],
        "resumed_from": second.get("resumed_from"),
    }
    if not second["finished"]:
        return {**row, "outcome": f"resume FAILED ({second['ended']}, exit status {second['exit_status']})"}
    results = {int(r): v for r, v in second["results"].items()}
    leader = results[min(results)]
    row["outcome"] = f"{first['wall_seconds']:.1f} s + {second['wall_seconds']:.1f} s wall"
    row["val_acc"] = leader["val_acc"]
    row["checksums_agree"] = _agree([r["params_checksum"] for r in results.values()])
    if free is not None and free.get("val_acc") is not None:
        row["recover_seconds"] = total - free["wall_seconds"]  # wall time: includes the second start-up
        row["val_acc_gap_points"] = 100 * (leader["val_acc"] - free["val_acc"])
    return row


# --------------------------------------------------------------------------- the table


def _num(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| strategy | fault | outcome | detect (s) | recover (s) | batches/s before | after | batches trained | "
        "val_acc (gap, pts) | replicas agree |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        acc = "-" if r.get("val_acc") is None else f"{r['val_acc']:.4f}"
        if r.get("val_acc_gap_points") is not None:
            acc += f" ({r['val_acc_gap_points']:+.1f})"
        agree = {True: "yes", False: "**no**", None: "-"}[r.get("checksums_agree")]
        fault = r["fault"] if "fault_batch" not in r else f"{r['fault']} @{r['fault_batch']}"
        batches = "-" if r.get("batches") is None else f"{r['batches']}/{r['batches_fault_free']}"
        lines.append(
            f"| {r['strategy']} | {fault} | {r['outcome']} | {_num(r.get('detect_seconds'), 2)} | "
            f"{_num(r.get('recover_seconds'))} | {_num(r.get('before'), 0)} | {_num(r.get('after'), 0)} | "
            f"{batches} | {acc} | {agree} |"
        )
    return "\n".join(lines)


def write_outputs(
    args: argparse.Namespace, runs: list[dict[str, Any]], rows: list[dict[str, Any]], argv: list[str]
) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    settings["faults"] = [fault_name(f) + (f"@{','.join(f[2])}" if f[2] else "") for f in args.faults]
    command = shlex.join(["python", "benchmarks/faults.py", *argv])
    (args.out / "faults.json").write_text(
        json.dumps({"command": command, "settings": settings, "rows": rows, "runs": runs}, indent=2)
    )
    (args.out / "faults.md").write_text(format_table(rows) + "\n")


# --------------------------------------------------------------------------- main


def demo_argv(strategy: str, args: argparse.Namespace) -> list[str]:
    return [
        "--strategy", strategy, "--devices", str(args.devices), "--epochs", str(args.epochs),
        "--step-time", str(args.step_time), "--group-size", str(args.group_size), "--profile", args.profile,
        "--hang-timeout", str(args.hang_timeout), "--seed", str(args.seed), "--batch-size", str(args.batch_size),
        *(["--epoch-repeats", str(args.epoch_repeats)] if args.epoch_repeats > 1 else []),
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    start = time.time()
    all_ranks = set(range(args.devices))

    def run(
        label: str, run_argv: list[str], survivors: set[int] | None, during: Callable | None = None
    ) -> dict[str, Any]:
        result = launch(label, run_argv, args, survivors, during)
        runs.append(result)
        print(
            f"[{time.time() - start:5.0f}s] {label}: {result['ended']}, exit status {result['exit_status']}, "
            f"{len(result['results'])} result(s), {result['wall_seconds']:.1f}s wall",
            flush=True,
        )
        write_outputs(args, runs, rows, argv)  # partial results survive an interrupted bench
        return result

    if args.churn is not None:
        try:
            from benchmarks.churn import format_churn_table, run_churn
        except ImportError:  # run as a script: its folder is on the path
            from churn import format_churn_table, run_churn

        churn_rows = run_churn(args, demo_argv, run)
        print(format_churn_table(churn_rows))
        print(f"{len(runs)} runs in {time.time() - start:.0f}s; wrote {args.out}/churn.json and churn.md")
        return churn_rows

    if not args.no_baselines:
        base = demo_argv("ddp", args)
        free_run = run("ddp-none", base, all_ranks)
        ddp_free = free_row("ddp", free_run)
        rows.append(ddp_free)
        batch = args.fault_batch or (default_fault_batch(free_run["results"]["0"], args) if free_run["finished"] else 1)
        first = None
        for fault in args.faults:
            kind, rank, _ = fault
            label = f"ddp-{kind}-{rank}"
            fault_argv = [
                *base,
                "--fault",
                f"{rank}:{batch}:{kind}",
                "--checkpoint-dir",
                str(args.out / "runs" / label / "ckpt"),
            ]
            ddp_run = run(label, fault_argv, None)
            rows.append(ddp_fault_row(fault, batch, ddp_run))
            if (kind, rank) == ("kill", 2):
                first = ddp_run
        if first is None:  # the restart's first half, when kill:2 is not among the faults
            label = "ddp-restart-first"
            fault_argv = [
                *base,
                "--fault",
                f"2:{batch}:kill",
                "--checkpoint-dir",
                str(args.out / "runs" / label / "ckpt"),
            ]
            first = run(label, fault_argv, None)
        checkpoint = Path(first["directory"]) / "ckpt" / "last.ckpt"
        resume = ["--resume", str(checkpoint)] if checkpoint.exists() else []  # no checkpoint yet: from scratch
        second = run("ddp-restart-resume", [*base, *resume], all_ranks)
        second["resumed_from"] = str(checkpoint) if resume else None
        rows.append(restart_row(first, second, ddp_free))

    for strategy in args.strategies:
        base = demo_argv(strategy, args)
        free_run = run(f"{strategy}-none", base, all_ranks)
        rows.append(free_row(strategy, free_run))
        if not free_run["finished"]:
            print(f"{strategy}: the fault-free run failed (see {free_run['directory']}/log.txt); skipping its faults")
            continue
        free_leader = free_run["results"][min(free_run["results"], key=int)]
        batch = args.fault_batch or default_fault_batch(free_leader, args)
        for fault in args.faults:
            kind, rank, only = fault
            if only and strategy not in only:
                continue
            rejoins = args.max_restarts > 0  # the faulted rank's new process writes a result too
            fault_run = run(
                f"{strategy}-{kind}-{rank}",
                [*base, "--fault", f"{rank}:{batch}:{kind}", "--max-restarts", str(args.max_restarts)],
                all_ranks if rejoins else all_ranks - {rank},
            )
            rows.append(fault_row(strategy, fault, batch, fault_run, free_run, args))

    write_outputs(args, runs, rows, argv)
    print(format_table(rows))
    print(f"{len(runs)} runs in {time.time() - start:.0f}s; wrote {args.out}/faults.json and faults.md")
    return rows


if __name__ == "__main__":
    main()
