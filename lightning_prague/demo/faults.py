"""Real faults, injected into a demo run: for the fault tests and `benchmarks/faults.py`.

A fault is `RANK[@PROCESS]:BATCH:KIND`: when rank `RANK` starts the training step of its `BATCH`-th
batch (counted over the whole fit in a rank's first process, from that process's start in a later
one), it

- `kill`: ends with SIGKILL (a preempted instance, an out-of-memory kill);
- `kill-in-exchange`: ends with SIGKILL inside its next group exchange, once it has posted its
  first message there (its peers have posted theirs and wait on it);
- `raise`: raises in `training_step` (a bug, a bad batch);
- `hang`: sleeps forever in `training_step` (a deadlock; its threads keep running);
- `stop`: stops itself with SIGSTOP (a frozen process: nothing of it runs);
- `kill-in-validation`: ends with SIGKILL in its first validation step after that batch (while
  the ranks are aligned: the others are validating, or syncing the metrics);
- `kill-after-step`: ends with SIGKILL at the end of that batch, after its optimizer step and the
  trainer's callbacks (a batch that was trained, and must not be trained again);
- `kill-at-queue-end`: ends with SIGKILL in the training step of its first batch from that one on
  whose claim for the next one waits at the emptied queue (every chunk of the epoch handed out, and
  no answer for half a second), a second later, once the other ranks are done with theirs and wait
  there too (a batch lost in a rank's last step of an epoch);
- `compute=SECONDS`: computes on the CPU for that long in `training_step`, then trains on (a slow
  step: a callback that renders images, a recompile; it must not be taken for a hang);
- `block=SECONDS`: blocks for that long without using the CPU, then trains on (a stall of a network
  file system, a lock held elsewhere);
- `kill-before-training`: ends with SIGKILL when its fit's training starts, before its first batch
  (`BATCH` is not used). In a process that rejoined a running fit, that is after its admission and
  the state a live member sent it, before it claimed or trained anything;
- `kill-in-transfer`: from that batch on, ends with SIGKILL inside the next state transfer it sends
  a rejoining rank as its donor, once the first message of it (the payload's size) went out: the
  joiner waits for the rest from a process that is gone;
- `kill-plane`: SIGKILLs the job's control plane (the supervisor, or the plane service whose pid the
  store names) and trains on: global rank 0 starts its supervisor again, which takes the job back
  from its journal (a plane service must be started again by whoever runs it);
- `other-model`: builds its model with hidden layers twice as wide, at its setup (`BATCH` is not
  used): a script edited between a job's start and a restart. A process that rejoins with it must
  be refused by name, and the job go on.

`PROCESS` picks which process of the rank the fault strikes: 0 (the default) its first, `n` its
`n`-th restart (`LIGHTNING_PRAGUE_RESTART_COUNT` from the strategies' launcher with `max_restarts`,
or `TORCHELASTIC_RESTART_COUNT` under torchrun), so that a fault can strike a process that
rejoins: `2:20:kill` and `2@1:1:kill-before-training` kill rank 2 at its 20th batch and then its
first new process between its admission and its first batch. A process started by hand to rejoin
(`LIGHTNING_PRAGUE_REJOIN=1`, no restart count) runs without faults.

Before it strikes it writes `fault.RANK.json` (`kind`, wall-clock `time`; `fault.RANK@PROCESS.json`
for a later process) to the given directory, so that a test or a benchmark can time the detection.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.job import RESTARTS_VARIABLE, rejoining

KINDS = (
    "kill", "kill-in-exchange", "raise", "hang", "stop", "kill-in-validation", "kill-after-step", "compute", "block",
    "kill-before-training", "kill-in-transfer", "other-model", "kill-plane", "kill-at-queue-end",
)  # fmt: skip
#: the kinds that strike somewhere else than at the start of a training step
_ELSEWHERE = ("kill-in-validation", "kill-after-step", "kill-before-training", "other-model", "kill-at-queue-end")
#: the kinds that last `=SECONDS` and then let the rank train on
TIMED = ("compute", "block")


@dataclass(frozen=True)
class Fault:
    """One fault: which rank, at which batch, what (see the module docstring); `process`: which process of
    the rank (0: its first, n: its n-th restart)."""

    rank: int
    batch: int
    kind: str
    seconds: float = 0.0
    process: int = 0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """`RANK[@PROCESS]:BATCH:KIND[=SECONDS]` as a `Fault`; a `ConfigurationError` naming the spec if it is not."""
        try:
            where, batch, kind = spec.split(":")
            rank, _, process = where.partition("@")
            kind, _, seconds = kind.partition("=")
            fault = cls(int(rank), int(batch), kind, float(seconds) if seconds else 0.0, int(process or 0))
        except ValueError:
            raise ConfigurationError(f"fault {spec!r} is not RANK[@PROCESS]:BATCH:KIND (e.g. 2:10:kill)") from None
        if fault.kind not in KINDS or fault.batch < 1 or fault.rank < 0 or fault.process < 0:
            raise ConfigurationError(
                f"fault {spec!r}: KIND is one of {', '.join(KINDS)}, BATCH counts from 1 and PROCESS from 0"
            )
        if (fault.kind in TIMED) != (fault.seconds > 0):
            raise ConfigurationError(
                f"fault {spec!r}: {'/'.join(TIMED)} take =SECONDS (e.g. 2:10:compute=30), no other"
            )
        return fault


def process_number() -> int | None:
    """Which process of its rank this one is: 0 its first, n its n-th restart (by the strategies'
    launcher or torchrun); `None` for a process started by hand to rejoin, which no fault strikes."""
    restarts = max(
        int(os.environ.get(RESTARTS_VARIABLE, "0") or 0), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    )
    if restarts == 0 and rejoining():
        return None
    return restarts


def inject_faults(model: Any, faults: list[Fault], directory: Path) -> None:
    """Wrap `model`'s hooks so that each fault of this process (`Fault.process`) strikes its rank at its batch."""
    if not faults:
        return
    plan = _Plan(faults)
    step, validation_step, batch_end = model.training_step, model.validation_step, model.on_train_batch_end
    train_start, setup = model.on_train_start, model.setup
    seen = [0]

    def training_step(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        fault = plan.get(model.trainer.global_rank)
        if fault is not None and seen[0] == fault.batch and fault.kind not in _ELSEWHERE:
            strike(fault, directory)
        if fault is not None and seen[0] >= fault.batch and fault.kind == "kill-at-queue-end" and _parked(model):
            time.sleep(1.0)  # the others train their last batches and wait at the queue's end
            strike(fault, directory)
        return step(*args, **kwargs)

    def on_train_start(*args: Any, **kwargs: Any) -> Any:
        fault = plan.get(model.trainer.global_rank)
        if fault is not None and fault.kind == "kill-before-training":
            strike(fault, directory)
        return train_start(*args, **kwargs)

    def setting_up(*args: Any, **kwargs: Any) -> Any:  # every rank's own process, before the strategy's setup
        fault = plan.get(model.trainer.global_rank)
        if fault is not None and fault.kind == "other-model":
            strike(fault, directory)
            _widen(model)
        return setup(*args, **kwargs)

    def on_train_batch_end(*args: Any, **kwargs: Any) -> Any:
        fault = plan.get(model.trainer.global_rank)
        if fault is not None and seen[0] == fault.batch and fault.kind == "kill-after-step":
            strike(fault, directory)
        return batch_end(*args, **kwargs)

    def validating_step(*args: Any, **kwargs: Any) -> Any:
        fault = plan.get(model.trainer.global_rank)
        if fault is not None and seen[0] >= fault.batch and fault.kind == "kill-in-validation":
            strike(fault, directory)
        return validation_step(*args, **kwargs)

    model.training_step = training_step
    model.validation_step = validating_step
    model.on_train_batch_end = on_train_batch_end
    model.on_train_start = on_train_start
    model.setup = setting_up


class _Plan:
    """The faults, by rank and process of the rank. Which process this one is, is asked when a fault
    would strike (`process_number`), not when the hooks are wrapped: a rank forked again from the
    process that wrapped them (`start_method="fork"`) is a later process of its rank, and one that
    learns in its fit that it rejoins a running one (it found the fit by itself,
    `lightning_prague.core.job.look_for_running_fit`) is struck by none: the fault struck its predecessor."""

    def __init__(self, faults: list[Fault]) -> None:
        self.faults = {(f.rank, f.process): f for f in faults}

    def get(self, rank: Any, default: Any = None) -> Any:
        number = process_number()
        return default if number is None else self.faults.get((rank, number), default)


def strike(fault: Fault, directory: Path) -> None:
    """Record `fault` (`fault.RANK.json`, see the module docstring) and carry it out."""
    name = f"fault.{fault.rank}.json" if fault.process == 0 else f"fault.{fault.rank}@{fault.process}.json"
    (directory / name).write_text(json.dumps({"kind": fault.kind, "time": time.time()}))
    if fault.kind == "compute":
        end = time.monotonic() + fault.seconds
        total = 0
        while time.monotonic() < end:  # pure Python: the interpreter switches threads, the beacon beats
            total += sum(i * i for i in range(10_000))
    elif fault.kind == "block":
        time.sleep(fault.seconds)
    if fault.kind in ("kill", "kill-in-validation", "kill-after-step", "kill-before-training", "kill-at-queue-end"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "kill-plane":
        from lightning_prague.core.job import current_job

        job = current_job()
        if job is not None and job.supervisor_pid > 0:
            os.kill(job.supervisor_pid, signal.SIGKILL)
    elif fault.kind == "kill-in-exchange":
        _kill_in_next_exchange()
    elif fault.kind == "kill-in-transfer":
        _kill_in_next_transfer()
    elif fault.kind == "raise":
        raise RuntimeError(f"injected failure on rank {fault.rank}")
    elif fault.kind == "hang":
        while True:
            time.sleep(1.0)
    elif fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def _parked(model: Any) -> bool:
    """Whether this rank's claim in flight waits at its epoch's emptied work queue: the queue handed out
    every chunk, and the claim got no answer within half a second (False without a work queue)."""
    progress = getattr(model.trainer.strategy, "progress", None)
    sampler = getattr(getattr(progress, "loader", None), "sampler", None)
    claim = getattr(getattr(sampler, "_in_flight", None), "__self__", None)  # (its `result`'s claim)
    if claim is None or not hasattr(claim, "answered") or sampler.cursor() < sampler.num_chunks:
        return False
    deadline = time.monotonic() + 0.5
    while not claim.answered():
        if time.monotonic() > deadline:
            return True
        time.sleep(0.01)
    return False


def _kill_in_next_exchange() -> None:
    from lightning_prague.core.comm import groups

    def post(self: Any, ops: list[Any]) -> Any:  # every algorithm of GroupComm starts its messages here
        first = ops[0]
        first.op(first.tensor, first.peer, first.group)
        os.kill(os.getpid(), signal.SIGKILL)

    groups.GroupComm._post = post  # type: ignore[method-assign]


def _kill_in_next_transfer() -> None:
    """SIGKILL this process in the next state transfer it sends, once its first message went out."""
    from lightning_prague.core.comm import transfer

    send = transfer.send_payload

    def send_payload(comm: Any, peer: int, payload: bytes, what: str) -> float:  # `BackgroundTransfer` sends here
        point_to_point = comm.point_to_point

        def first_then_die(*args: Any, **kwargs: Any) -> None:
            point_to_point(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        comm.point_to_point = first_then_die
        return send(comm, peer, payload, what)

    transfer.send_payload = send_payload  # type: ignore[assignment]


def _widen(model: Any) -> None:
    """`model` (the demo's `DigitsClassifier`) with hidden layers twice as wide: another model."""
    hparams = dict(model.hparams)
    model.net = type(model)(**{**hparams, "hidden": 2 * int(hparams.get("hidden", 64))}).net
