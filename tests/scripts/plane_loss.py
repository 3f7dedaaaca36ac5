"""A demo run whose control plane is lost mid-fit: rank 0 SIGKILLs the supervisor at its N-th batch.

Usage: the demo's options (`lightning_prague.demo.run`) plus `--kill-plane-batch N` and
`--exception-checkpoint DIR` (Lightning's `OnExceptionCheckpoint` into DIR). Every rank writes what
its fit raised (`error`: its type and text, `type`, `control_plane_error`: whether it is a
`ControlPlaneError`, `on_exception`: the type Lightning's `on_exception` hooks got, `time`) to
`result.rankR.json` beside `--json`, and exits with status 3 if its fit failed.
"""

import argparse
import json
import os
import signal
import sys
import time
import traceback

import lightning as L
import torch

from lightning_prague.core.errors import ControlPlaneError
from lightning_prague.demo import run


class KillPlane(L.Callback):
    """Rank 0 SIGKILLs the supervisor (the store and the control plane) at its `batch`-th batch."""

    def __init__(self, batch: int, path) -> None:
        self.batch, self.path, self.seen = batch, path, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if trainer.global_rank == 0 and self.seen == self.batch:
            pid = trainer.strategy.job.supervisor_pid
            self.path.write_text(json.dumps({"pid": pid, "time": time.time()}))
            os.kill(pid, signal.SIGKILL)


class SeenInOnException(L.Callback):
    """Records the exception Lightning's `on_exception` hooks were called with."""

    def __init__(self) -> None:
        self.exception: BaseException | None = None

    def on_exception(self, trainer, pl_module, exception):
        self.exception = exception


def main() -> None:
    extra = argparse.ArgumentParser()
    extra.add_argument("--kill-plane-batch", type=int, default=5)
    extra.add_argument("--exception-checkpoint", required=True)
    own, rest = extra.parse_known_args()
    args = run.parse_args(rest)
    seen = SeenInOnException()
    callbacks = [
        KillPlane(own.kill_plane_batch, args.json.parent / "plane_killed.json"),
        L.pytorch.callbacks.OnExceptionCheckpoint(own.exception_checkpoint),
        seen,
    ]
    trainer, model, data, _, _ = run.build(args, callbacks)
    try:
        trainer.fit(model, datamodule=data)
    except Exception as err:
        report = {"error": f"{type(err).__name__}: {err}", "type": type(err).__name__, "time": time.time()}
        report["control_plane_error"] = isinstance(err, ControlPlaneError)
        report["on_exception"] = None if seen.exception is None else type(seen.exception).__name__
        report["traceback"] = traceback.format_exc()
        path = args.json.with_suffix(f".rank{trainer.global_rank}.json")
        path.write_text(json.dumps(report))
        sys.stdout.flush()
        sys.exit(3)
    path = args.json.with_suffix(f".rank{trainer.global_rank}.json")
    path.write_text(json.dumps({"error": None, "time": time.time()}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
