"""Test driver around lightning_prague.demo.run: adds fault injection and a second fit.

Extra options: --sigterm-rank R --sigterm-batch N (rank R sends itself SIGTERM, or --sigterm-signal, at
its N-th batch),
--refit-epochs E (call trainer.fit again to E epochs), --test (trainer.test after fit), --exception-checkpoint DIR
(Lightning's OnExceptionCheckpoint into DIR, and each rank writes its parameters' sum and norm at the
exception to result.stopRANK.json),
--raise-at-batch N (every rank, or only --raise-rank R, raises at its N-th batch; each rank then
writes the error it got and the names of the communication threads still alive to result.rankR.json,
and rank 0 exits with status 3), --kill-rank R --kill-batch N (rank R kills itself with SIGKILL at
its N-th batch, after writing the time to killed.json; the others report as with --raise-at-batch),
--timer SECONDS (Lightning's Timer stops the fit), --module-stop-rank R --module-stop-batch N (the
LightningModule sets trainer.should_stop on rank R only, at its N-th batch), --user-allreduce (every
training step all-reduces a tensor on the world group, as a user's step may, and checks the sum),
--count-host-syncs (counts, per training batch, this package's reads of device values on the host,
see `HostSyncCounter`), and the demo's --fault RANK:BATCH:KIND (lightning_prague.demo.faults).
"""

import argparse
import json
import os
import signal
import sys
import threading
import time

import lightning as L
import torch
import torch.distributed as dist

from lightning_prague.core.exchange.overlap import communication_threads
from lightning_prague.demo import run

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_reads import HostReadCounter  # noqa: E402


class HostSyncCounter(L.Callback):
    """Counts this package's host reads of device values (`host_reads.HostReadCounter`) per training
    batch, from its start to its end, in any thread. Writes `host_syncs`: `[epoch, batch, global step,
    count]` per batch with a non-zero count, `host_sync_sites`, `batches_counted` and
    `host_sync_self_check` (1: the stand-in counted a known read)."""

    def __init__(self, reporter) -> None:
        self.reporter = reporter
        self.counter = HostReadCounter()
        self.self_check = 0
        self._batches = 0

    def on_train_start(self, trainer, pl_module):
        self.counter.install()
        self.self_check = self.counter.self_check()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.counter.key = (trainer.current_epoch, batch_idx, trainer.global_step)
        self._batches += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.counter.key = None

    def on_train_end(self, trainer, pl_module):
        self.counter.key = None
        self.counter.remove()
        measurements = self.reporter.measurements
        measurements["host_syncs"] = [[*key, n] for key, n in sorted(self.counter.counts.items())]
        measurements["host_sync_sites"] = self.counter.where
        measurements["batches_counted"] = self._batches
        measurements["host_sync_self_check"] = self.self_check


class SelfSigterm(L.Callback):
    def __init__(self, rank: int, batch: int, signum: int = signal.SIGTERM) -> None:
        self.rank, self.batch, self.signum, self.seen = rank, batch, signum, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if trainer.global_rank == self.rank and self.seen == self.batch:
            os.kill(os.getpid(), self.signum)


class RaiseAt(L.Callback):
    def __init__(self, batch: int, rank: int | None) -> None:
        self.batch, self.rank, self.seen = batch, rank, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if self.seen == self.batch and self.rank in (None, trainer.global_rank):
            raise RuntimeError(f"injected failure on rank {trainer.global_rank}")


class RaiseInValidation(L.Callback):
    """Raises on one rank in its first validation batch (while every rank is aligned)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.global_rank == self.rank and not trainer.sanity_checking:
            raise RuntimeError(f"injected failure in validation on rank {trainer.global_rank}")


class KillAt(L.Callback):
    def __init__(self, rank: int, batch: int, path) -> None:
        self.rank, self.batch, self.path, self.seen = rank, batch, path, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        if trainer.global_rank == self.rank and self.seen == self.batch:
            self.path.write_text(json.dumps({"rank": self.rank, "time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)


def stop_in_module(model, rank: int, batch: int) -> None:
    """The module itself sets trainer.should_stop, on one rank only (as a module's own logic may)."""
    step = model.training_step
    seen = [0]

    def training_step(*args, **kwargs):
        out = step(*args, **kwargs)
        seen[0] += 1
        if model.trainer.global_rank == rank and seen[0] == batch:
            model.trainer.should_stop = True
        return out

    model.training_step = training_step


def all_reduce_in_step(model) -> list[float]:
    """Every training step all-reduces a tensor on the world group; returns the sums it got."""
    step = model.training_step
    sums: list[float] = []

    def training_step(*args, **kwargs):
        value = torch.ones(1)
        dist.all_reduce(value)
        sums.append(float(value))
        return step(*args, **kwargs)

    model.training_step = training_step
    return sums


class WriteSums(L.Callback):
    """Writes the sums a rank's steps got from their all-reduces, in the rank's own process."""

    def __init__(self, sums: list[float], json_path) -> None:
        self.sums, self.path = sums, json_path

    def on_train_end(self, trainer, pl_module):
        path = self.path.with_suffix(f".allreduce{trainer.global_rank}.json")
        path.write_text(json.dumps({"sums": self.sums, "world_size": trainer.world_size}))


class StateAtStop(L.Callback):
    """On a stop by signal (Lightning's SIGTERMException), every rank writes what it holds then."""

    def __init__(self, json_path) -> None:
        self.path = json_path

    def on_exception(self, trainer, pl_module, exception):
        state = pl_module.state_dict()  # what a checkpoint's "state_dict" holds
        params = torch.cat([t.detach().reshape(-1).double() for t in state.values() if t.is_floating_point()])
        state = {"rank": trainer.global_rank, "global_step": trainer.global_step, "epoch": trainer.current_epoch}
        state.update(params_sum=float(params.sum()), params_norm=float(params.norm()), error=type(exception).__name__)
        self.path.with_suffix(f".stop{trainer.global_rank}.json").write_text(json.dumps(state))


def prague_threads() -> list[str]:
    return communication_threads()


def main() -> None:
    extra = argparse.ArgumentParser()
    extra.add_argument("--sigterm-rank", type=int)
    extra.add_argument("--sigterm-batch", type=int, default=3)
    extra.add_argument("--sigterm-signal", default="SIGTERM", help="the signal --sigterm-rank sends itself")
    extra.add_argument("--refit-epochs", type=int)
    extra.add_argument("--raise-at-batch", type=int)
    extra.add_argument("--raise-rank", type=int, help="only this rank raises (default: every rank)")
    extra.add_argument("--raise-in-validation-rank", type=int)
    extra.add_argument("--kill-rank", type=int)
    extra.add_argument("--kill-batch", type=int, default=5)
    extra.add_argument("--timer", type=float)
    extra.add_argument("--module-stop-rank", type=int)
    extra.add_argument("--module-stop-batch", type=int, default=5)
    extra.add_argument("--user-allreduce", action="store_true")
    extra.add_argument("--exception-checkpoint", help="add OnExceptionCheckpoint writing to this directory")
    extra.add_argument("--count-host-syncs", action="store_true")
    extra.add_argument("--record-samples", action="store_true", help="samples.rankR.jsonl: what each rank trained")
    own, rest = extra.parse_known_args()
    args = run.parse_args(rest)
    callbacks = []
    if own.sigterm_rank is not None:
        callbacks.append(SelfSigterm(own.sigterm_rank, own.sigterm_batch, getattr(signal, own.sigterm_signal)))
    if own.raise_at_batch:
        callbacks.append(RaiseAt(own.raise_at_batch, own.raise_rank))
    if own.raise_in_validation_rank is not None:
        callbacks.append(RaiseInValidation(own.raise_in_validation_rank))
    if own.kill_rank is not None:
        callbacks.append(KillAt(own.kill_rank, own.kill_batch, args.json.parent / "killed.json"))
    if own.exception_checkpoint:
        callbacks.append(L.pytorch.callbacks.OnExceptionCheckpoint(own.exception_checkpoint))
        callbacks.append(StateAtStop(args.json))
    if own.timer is not None:
        callbacks.append(L.pytorch.callbacks.Timer(duration={"seconds": own.timer}))
    if own.record_samples:
        from samples import SampleRecorder

        callbacks.append(SampleRecorder(args.json.parent))
    trainer, model, data, summary, checkpoint = run.build(args, callbacks)
    if own.module_stop_rank is not None:
        stop_in_module(model, own.module_stop_rank, own.module_stop_batch)
    if own.user_allreduce:
        trainer.callbacks.append(WriteSums(all_reduce_in_step(model), args.json))
    reporter = next(cb for cb in trainer.callbacks if isinstance(cb, run.RunReport))
    if own.count_host_syncs:  # after the reporter: its on_train_end sets the measurements this adds to
        trainer.callbacks.append(HostSyncCounter(reporter))
    try:
        trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    except RuntimeError as err:
        if not (own.raise_at_batch or own.kill_rank or own.raise_in_validation_rank is not None or args.fault):
            raise
        failed_at = time.time()
        path = args.json.with_suffix(f".rank{trainer.global_rank}.json")
        import traceback

        frames = sys._current_frames()
        stacks = {
            t.name: "".join(traceback.format_stack(frames[t.ident]))
            for t in threading.enumerate()
            if t.name.startswith("prague-") and not t.name.startswith("prague-control") and t.ident in frames
        }
        job = getattr(trainer.strategy, "job", None)
        report = {"error": str(err), "threads": prague_threads(), "stacks": stacks, "time": failed_at}
        report["traceback"] = traceback.format_exc()
        report["supervisor_pid"] = job.supervisor_pid if job is not None else None
        path.write_text(json.dumps(report))
        if trainer.global_rank != 0:
            sys.exit(0)  # Lightning's launcher kills every rank when one exits non-zero; the report has the error
        for proc in getattr(trainer.strategy.launcher, "procs", []):  # rank 0 waits for the ranks it launched
            proc.wait(timeout=120)
        sys.exit(3)  # a normal exit: it would hang on any non-daemon thread left behind
    if reporter.result is None:  # forked ranks wrote their results themselves; this is their parent
        return
    if own.refit_epochs:
        trainer.fit_loop.max_epochs = own.refit_epochs
        trainer.fit(model, datamodule=data)
    result = dict(reporter.result)
    if args.test:
        result["test_acc"] = float(trainer.test(model, datamodule=data, verbose=False)[0]["test_acc"])
    if args.json:
        path = args.json if trainer.is_global_zero else args.json.with_suffix(f".rank{trainer.global_rank}.json")
        path.write_text(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints every thread's stack
    torch.set_num_threads(1)
    main()
