"""Peak resident memory per worker of every strategy against DDP, in copies of the model.

    python benchmarks/memory.py                                   # 4 workers, 25M parameters, DDP and all four
    python benchmarks/memory.py --params 5e6 --strategies ddp prague --out memory-small.json
    python benchmarks/memory.py --where                           # also: what every thread ran at the peak
    python benchmarks/memory.py --mmap-threshold 131072           # resident memory = live tensors
    python benchmarks/memory.py --strategies ddp decent_adam decent_adam/replicas decent_adam/sharded

Each strategy (and Lightning's `strategy="ddp"` first, the baseline) runs as a command of its own
(`python benchmarks/memory.py --run STRATEGY ...`) with Lightning's default launcher
(`accelerator="cpu", devices=--devices`: ranks 1..N-1 re-run the command as children of rank 0;
gloo on 127.0.0.1). Every rank builds the same model, `--layers` square `nn.Linear` layers with
ReLU between them, as wide as makes `--params` float32 parameters (25M: 4 layers of 2499 x 2499,
95.3 MiB), in its `__init__` (`--build-in configure_model`: in Lightning's `configure_model` hook,
after the strategy set its ranks up), and trains it for one epoch on random data (`--steps` batches
of `--batch-size` per worker: the dataset holds `steps x batch x devices` samples; the work-queue strategies let a fast
worker take a few more), MSE loss, SGD with momentum 0.9 (`--optimizer adamw`: AdamW), no validation,
no checkpoints, no logger.
`prague` and `partial_reduce` run with `group_size=--group-size` (default 2, as AD-PSGD's pairs);
`decent_adam/replicas` and `decent_adam/sharded` (asked for by name) train in replica groups of 2
ranks (`replica_size=2`), the model whole on each rank or sharded over the pair (`shard=True`);
every other option of the strategies is their default (`bucket_mb=25`, overlap on, the end-of-fit
global average on). Each rank reads its own peak at the end of fit (after the strategy's teardown):
`resource.getrusage(RUSAGE_SELF).ru_maxrss` and `VmHWM` of `/proc/self/status` (they agree; the
table uses `ru_maxrss`), and its resident memory just before it built the model (`start`: the
interpreter, torch, Lightning and this package). Only the rank's own process counts: the
supervisor process that rank 0 starts for the asynchronous strategies is not in any rank's figure.

Columns:

* peak per worker (MiB): ranks 0..N-1 in order (`ru_maxrss`; rank 0 is also the launcher of the
  others);
* vs DDP (model copies): `(peak - ddp_peak) / model_bytes`, each rank against DDP's same rank,
  as the range over the workers (the goal: at most +2);
* above start (model copies): `(peak - start) / model_bytes`, the range over the workers: the
  peak without the framework's fixed cost (DDP: parameters, gradients, momentum and its gradient
  buckets, about 4);
* peak / parameter bytes: the largest worker's peak over the model's bytes.

glibc's allocator keeps freed blocks of a few tens of MB resident (its mmap threshold rises to the
size of the largest block freed, up to 32 MiB, and each thread allocates from an arena of its own),
so the peak depends on how often model-sized buffers are allocated and freed, and from which
thread. `--mmap-threshold BYTES` sets `MALLOC_MMAP_THRESHOLD_` for every rank (a fixed threshold:
every larger block is mapped on allocation and unmapped on free), so that resident memory follows
the bytes of live tensors: the run to account for copies with.

`--where` adds a thread to every rank that samples its resident memory (`/proc/self/statm`) every
`--interval` seconds and, at each new high, records the innermost frames of every Python thread
(`sys._current_frames`): where the training and communication threads were when the peak was
reached. The stacks take a few KiB, but the sampling perturbs the timing and so, with glibc
defaults, which freed blocks get reused: such a run's peaks can move by a copy or two.
Writes `--out` (JSON: the settings, every rank's measurements, the rows) and prints the table.
Linux only (`/proc`, `ru_maxrss` in KiB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

MiB = 2**20
GROUPED = ("prague", "partial_reduce")  # the strategies with a group_size option
STRATEGIES = ("ddp", "prague", "partial_reduce", "adpsgd", "decent_adam")
#: runs in replica groups of 2 (issue 50), when asked for: the model whole on each rank, or sharded over the pair
REPLICA_RUNS = (
    "decent_adam/replicas",
    "decent_adam/sharded",
    "prague/replicas",
    "prague/sharded",
    "partial_reduce/sharded",
    "adpsgd/sharded",
)


# -- measuring, inside a rank ------------------------------------------------------------------
def resident_bytes() -> int:
    """This process's resident memory now."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def high_water_bytes() -> int:
    """This process's peak resident memory so far, as the kernel keeps it (`VmHWM`)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def max_rss_bytes() -> int:
    """`ru_maxrss` of this process (KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakSampler:
    """A daemon thread that samples this process's resident memory and keeps the threads' stacks at its peak."""

    def __init__(self, interval: float, frames: int = 6) -> None:
        self.interval = interval
        self.frames = frames
        self.peak = 0
        self.stacks: dict[str, list[str]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            rss = resident_bytes()
            if rss <= self.peak + MiB:  # a new high by at least 1 MiB: take the stacks again
                continue
            self.peak = rss
            names = {t.ident: t.name for t in threading.enumerate()}
            stacks = {}
            for ident, frame in sys._current_frames().items():
                if ident == self._thread.ident:
                    continue
                summary = traceback.extract_stack(frame)[-self.frames :]
                stacks[names.get(ident, str(ident))] = [
                    f"{_short(entry.filename)}:{entry.lineno} {entry.name}" for entry in summary
                ]
            self.stacks = stacks


def _short(filename: str) -> str:
    for marker in ("lightning_prague/", "lightning/", "torch/", "benchmarks/"):
        if marker in filename:
            return marker + filename.split(marker, 1)[1]
    return filename


def train(args: argparse.Namespace) -> None:
    """One fit of `args.run` in this process (every rank runs it); each rank writes its measurements."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_prague.strategies import STRATEGIES as OURS

    torch.set_num_threads(1)
    sampler = PeakSampler(args.interval) if args.where else None
    if sampler is not None:
        sampler.start()
    start_bytes = resident_bytes()
    width = model_width(args.params, args.layers)

    def build() -> nn.Module:
        layers: list[nn.Module] = []
        for i in range(args.layers):
            layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < args.layers - 1 else [])
        return nn.Sequential(*layers)

    class Wide(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module | None = build() if args.build_in == "init" else None

        def configure_model(self) -> None:
            if self.net is None:  # (`--build-in configure_model`: built where the strategy set up its ranks)
                self.net = build()

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            if args.optimizer == "adamw":  # two moments per parameter
                return torch.optim.AdamW(self.parameters(), lr=1e-4)
            return torch.optim.SGD(self.parameters(), lr=1e-3, momentum=0.9)

    class Report(L.Callback):
        def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            self.setup_bytes = resident_bytes()

        def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
            # the strategy's teardown ran before on_fit_end: every exchange and average is in the peak
            result = {
                "strategy": args.run,
                "rank": trainer.global_rank,
                "pid": os.getpid(),
                "parameters": sum(p.numel() for p in pl_module.parameters()),
                "model_bytes": sum(p.numel() * p.element_size() for p in pl_module.parameters()),
                "start_bytes": start_bytes,
                "setup_bytes": self.setup_bytes,
                "end_bytes": resident_bytes(),
                "peak_bytes": max_rss_bytes(),
                "vmhwm_bytes": high_water_bytes(),
                "steps": trainer.global_step,
            }
            if sampler is not None:
                sampler.stop()
                result.update(sampled_peak_bytes=sampler.peak, stacks_at_peak=sampler.stacks)
            path = Path(args.run_dir) / f"rank{trainer.global_rank}.json"
            path.write_text(json.dumps(result, indent=2))

    L.seed_everything(0, verbose=False)
    model = Wide()
    generator = torch.Generator().manual_seed(0)
    size = args.steps * args.batch_size * args.devices
    data = TensorDataset(torch.randn(size, width, generator=generator), torch.randn(size, width, generator=generator))
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=make_strategy(args.run, args.group_size, OURS),
        max_epochs=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        callbacks=[Report()],
    )
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size))


def model_width(params: float, layers: int) -> int:
    """The width of `layers` square Linear layers (with biases) holding about `params` parameters."""
    per_layer = params / layers
    return max(1, int((-1 + math.sqrt(1 + 4 * per_layer)) / 2))  # w^2 + w = per_layer


def make_strategy(name: str, group_size: int, ours: dict[str, Any]) -> Any:
    if name == "ddp":
        return "ddp"  # Lightning's, as users select it
    name, _, variant = name.partition("/")
    cls = ours[name][0]
    options: dict[str, Any] = {"hang_timeout": 60.0}  # two busy cores: no false hang; no effect on memory
    if variant:  # replica groups of 2 ranks, the model whole on each or sharded over the pair (issue 50)
        options.update(replica_size=2, shard=variant == "sharded")
    if name in GROUPED:
        options["group_size"] = group_size
    return cls(**options)


# -- the driver --------------------------------------------------------------------------------
def measure(strategy: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run `strategy` as a command of its own; every rank's measurements, by rank."""
    with tempfile.TemporaryDirectory(prefix=f"memory-{strategy.replace('/', '-')}-") as run_dir:
        command = [sys.executable, __file__, "--run", strategy, "--run-dir", run_dir]
        command += ["--devices", str(args.devices), "--params", str(args.params), "--layers", str(args.layers)]
        command += ["--steps", str(args.steps), "--batch-size", str(args.batch_size), "--optimizer", args.optimizer]
        command += ["--group-size", str(args.group_size), "--interval", str(args.interval)]
        command += ["--build-in", args.build_in]
        command += ["--where"] if args.where else []
        env = dict(os.environ)
        if args.mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)  # read by glibc at start: every rank inherits it
        start = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
        files = sorted(Path(run_dir).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        if done.returncode != 0 or len(files) != args.devices:
            raise RuntimeError(
                f"{strategy} failed (exit {done.returncode}, {len(files)} of {args.devices} ranks reported):\n"
                f"{done.stderr[-3000:]}"
            )
        ranks = [json.loads(p.read_text()) for p in files]
    print(f"{strategy}: {time.monotonic() - start:.0f}s", file=sys.stderr, flush=True)
    return ranks


def rows(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per strategy (see the module docstring for the columns)."""
    ddp = results.get("ddp")
    table = []
    for strategy, ranks in results.items():
        model = ranks[0]["model_bytes"]
        peaks = [r["peak_bytes"] for r in ranks]
        row: dict[str, Any] = {
            "strategy": strategy,
            "peak_mib": [p / MiB for p in peaks],
            "above_start_copies": [(r["peak_bytes"] - r["start_bytes"]) / model for r in ranks],
            "peak_per_param_byte": max(peaks) / model,
            "steps": [r["steps"] for r in ranks],
        }
        if ddp is not None:
            row["vs_ddp_copies"] = [(p - d["peak_bytes"]) / model for p, d in zip(peaks, ddp)]
        table.append(row)
    return table


def markdown(
    table: list[dict[str, Any]], model_bytes: int, parameters: int, devices: int, mmap_threshold: int | None
) -> str:
    def span(values: list[float], sign: str = "+") -> str:
        low, high = (f"{v:{sign}.1f}" for v in (min(values), max(values)))
        return low if low == high else f"{low} to {high}"

    allocator = "glibc defaults" if mmap_threshold is None else f"MALLOC_MMAP_THRESHOLD_={mmap_threshold}"
    lines = [
        f"{devices} workers, {parameters / 1e6:.2f}M float32 parameters ({model_bytes / MiB:.1f} MiB per model copy), "
        f"{allocator}",
        "",
        "| strategy | peak per worker (MiB) | vs DDP (model copies) | above start (model copies) "
        "| peak / parameter bytes |",
        "|---|---|---|---|---|",
    ]
    for row in table:
        peaks = " / ".join(f"{p:,.0f}" for p in row["peak_mib"])
        vs_ddp = span(row["vs_ddp_copies"]) if "vs_ddp_copies" in row else "-"
        above = span(row["above_start_copies"], sign="")
        lines.append(f"| {row['strategy']} | {peaks} | {vs_ddp} | {above} | {row['peak_per_param_byte']:.1f} |")
    return "\n".join(lines)


def where(results: dict[str, list[dict[str, Any]]]) -> str:
    """The stacks at the peak of each strategy's largest worker (`--where`)."""
    out = []
    for strategy, ranks in results.items():
        worst = max(ranks, key=lambda r: r["peak_bytes"])
        if "stacks_at_peak" not in worst:
            continue
        out.append(f"\n{strategy}, rank {worst['rank']}: sampled peak {worst['sampled_peak_bytes'] / MiB:,.0f} MiB")
        for thread, frames in worst["stacks_at_peak"].items():
            out.append(f"  {thread}:")
            out += [f"    {frame}" for frame in frames]
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), help="ddp first: the baseline")
    parser.add_argument("--devices", type=int, default=4, help="CPU worker processes")
    parser.add_argument("--params", type=float, default=25e6, help="float32 parameters of the model (about)")
    parser.add_argument("--layers", type=int, default=4, help="square Linear layers")
    parser.add_argument("--steps", type=int, default=20, help="training batches per worker (one epoch)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="SGD with momentum, or AdamW")
    parser.add_argument("--group-size", type=int, default=2, help="of prague and partial_reduce")
    parser.add_argument(
        "--build-in", choices=["init", "configure_model"], default="init",
        help="where the module builds its layers: its __init__, or Lightning's configure_model hook",
    )  # fmt: skip
    parser.add_argument(
        "--mmap-threshold", type=int, metavar="BYTES", help="set MALLOC_MMAP_THRESHOLD_ (e.g. 131072): RSS = live bytes"
    )
    parser.add_argument("--where", action="store_true", help="record every thread's stack at each rank's peak")
    parser.add_argument("--interval", type=float, default=0.002, help="seconds between samples of --where")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, default=Path("bench-out/memory.json"), help="the JSON results")
    parser.add_argument("--run", help=argparse.SUPPRESS)  # internal: train one strategy in this process
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)  # internal: where the ranks write
    args = parser.parse_args(argv)
    problems = []
    if args.devices < 2:
        problems.append(f"--devices {args.devices}: at least 2 workers")
    if args.params < args.layers or args.layers < 1 or args.steps < 1 or args.batch_size < 1:
        problems.append("--params, --layers, --steps and --batch-size must be positive (params >= layers)")
    if not 2 <= args.group_size <= args.devices:
        problems.append(f"--group-size {args.group_size}: 2 to --devices")
    unknown = [s for s in args.strategies if s not in STRATEGIES + REPLICA_RUNS]
    if unknown:
        problems.append(f"--strategies: unknown {unknown}; choose from {list(STRATEGIES + REPLICA_RUNS)}")
    if problems:
        parser.error("; ".join(problems))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run:
        train(args)
        return
    strategies = sorted(args.strategies, key=lambda s: s != "ddp")  # the baseline first
    results = {strategy: measure(strategy, args) for strategy in strategies}
    first = next(iter(results.values()))[0]
    table = rows(results)
    text = markdown(table, first["model_bytes"], first["parameters"], args.devices, args.mmap_threshold)
    print(text)
    if args.where:
        print(where(results))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in ("run", "run_dir")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": settings, "rows": table, "ranks": results}, indent=2))


if __name__ == "__main__":
    main()
