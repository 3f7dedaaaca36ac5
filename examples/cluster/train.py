"""One training script for every launcher: SLURM (`slurm.sbatch`), torchrun (`torchrun.sh`) and
Kubernetes, one process per pod (`kubernetes.yaml`).

    python examples/cluster/train.py --num-nodes 4 --devices 8 --strategy prague --root-dir runs/digits

Nothing in it names the launcher: Lightning finds its cluster environment in the variables the
launcher set (SLURM's, torchrun's, or its own `MASTER_ADDR`/`NODE_RANK`/`LOCAL_RANK`), exactly as for
a DDP job. What changes from DDP is the `strategy` name. Everything the job writes goes under
`--root-dir` (a shared file system, so that it outlives the job): the checkpoints, the metrics
(`workers/live` and `workers/lost` among them) and the supervisor's log (`lightning_prague_logs/`).

A lost worker comes back while the others train on: `--max-restarts N` (3 here) gives each rank a
keeper, a small parent in the task the launcher started, which starts the rank's training process
again when it dies (a crash, `kill -9`, an out-of-memory kill); the new process rejoins the running fit
with a live worker's state. A replacement task, container or pod started by the launcher (a new `srun`
step, a restarted container, a new pod with the same index) finds the running fit of its job by
itself and rejoins it too (docs/multi_node.md, A lost worker comes back).

A restarted job resumes: from SLURM's requeue checkpoint (`hpc_ckpt_N.ckpt`, which Lightning finds
itself) if there is one, else from the last checkpoint. Swap in your own model and data; the digits
ship inside scikit-learn, so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import os
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import lightning_prague  # noqa: F401  (registers strategy="prague", "partial_reduce", "adpsgd", "decent_adam")
from lightning_prague.demo.digits import DigitsClassifier, DigitsDataModule
from lightning_prague.strategies import STRATEGIES


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="prague", help="prague, partial_reduce, adpsgd, decent_adam (or ddp)")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (SLURM: --nodes; Kubernetes: pods)")
    parser.add_argument("--devices", type=int, default=1, help="processes per node, one per GPU")
    parser.add_argument("--accelerator", default="auto", help="gpu, cpu or auto")
    parser.add_argument("--max-epochs", type=int, default=20)
    parser.add_argument(
        "--max-restarts", type=int, default=3, help="times each rank's keeper starts a lost training process again"
    )
    parser.add_argument("--root-dir", type=Path, default=Path("runs/digits"), help="checkpoints, metrics, logs")
    return parser.parse_args()


def resume_from(root: Path) -> str | None:
    """The checkpoint `fit` resumes from: none where SLURM's requeue left one (Lightning then takes
    it), else the last checkpoint if there is one."""
    if any(root.glob("hpc_ckpt_*.ckpt")) or not (root / "checkpoints" / "last.ckpt").exists():
        return None
    return "last"


def strategy(name: str, max_restarts: int) -> L.pytorch.strategies.Strategy | str:
    """The strategy `name` with `max_restarts`; another name (`ddp`) as Lightning resolves it."""
    if name not in STRATEGIES:
        return name
    cls, _ = STRATEGIES[name]
    return cls(max_restarts=max_restarts)


class TrainedHere(L.Callback):
    """Counts the batches this process trained (a restarted one: those since it rejoined)."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.batches += 1


def main() -> None:
    args = parse_args()
    L.seed_everything(0)
    trained_here = TrainedHere()
    trainer = L.Trainer(
        strategy=strategy(args.strategy, args.max_restarts),
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.max_epochs,
        default_root_dir=args.root_dir,
        logger=CSVLogger(args.root_dir, name="metrics"),
        callbacks=[ModelCheckpoint(dirpath=args.root_dir / "checkpoints", save_last=True), trained_here],
        enable_progress_bar=False,
    )
    model = DigitsClassifier()
    trainer.fit(model, DigitsDataModule(batch_size=32), ckpt_path=resume_from(args.root_dir))
    # every rank ends the fit with the same model (the consensus at the last synchronization point)
    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()
    accuracy = trainer.callback_metrics.get("val_acc", torch.tensor(float("nan")))
    print(
        f"train.py: rank {trainer.global_rank} finished the fit at epoch {trainer.current_epoch}, step "
        f"{trainer.global_step}, validation accuracy {float(accuracy):.3f}, parameters {digest[:16]}; this "
        f"process (restart {os.environ.get('LIGHTNING_PRAGUE_RESTART_COUNT', '0')}) trained {trained_here.batches} "
        f"batches",
        flush=True,
    )


if __name__ == "__main__":
    main()
