"""Real faults, injected into a demo run: for the fault tests and `benchmarks/faults.py`.

A fault is `RANK:BATCH:KIND`: when rank `RANK` starts the training step of its `BATCH`-th batch
(counted over the whole fit), it

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
- `compute=SECONDS`: computes on the CPU for that long in `training_step`, then trains on (a slow
  step: a callback that renders images, a recompile; it must not be taken for a hang);
- `block=SECONDS`: blocks for that long without using the CPU, then trains on (a stall of a network
  file system, a lock held elsewhere).

Before it strikes it writes `fault.RANK.json` (`kind`, wall-clock `time`) to the given directory,
so that a test or a benchmark can time the detection. A fault strikes in a job's first attempt
only: workers that torchrun restarts (`TORCHELASTIC_RESTART_COUNT` above 0) run without it.
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
from lightning_prague.core.job import rejoining

KINDS = (
    "kill", "kill-in-exchange", "raise", "hang", "stop", "kill-in-validation", "kill-after-step", "compute", "block"
)  # fmt: skip
#: the kinds that strike somewhere else than at the start of a training step
_ELSEWHERE = ("kill-in-validation", "kill-after-step")
#: the kinds that last `=SECONDS` and then let the rank train on
TIMED = ("compute", "block")


@dataclass(frozen=True)
class Fault:
    rank: int
    batch: int
    kind: str
    seconds: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> Fault:
        try:
            rank, batch, kind = spec.split(":")
            kind, _, seconds = kind.partition("=")
            fault = cls(int(rank), int(batch), kind, float(seconds) if seconds else 0.0)
        except ValueError:
            raise ConfigurationError(f"fault {spec!r} is not RANK:BATCH:KIND (e.g. 2:10:kill)") from None
        if fault.kind not in KINDS or fault.batch < 1 or fault.rank < 0:
            raise ConfigurationError(f"fault {spec!r}: KIND is one of {', '.join(KINDS)} and BATCH counts from 1")
        if (fault.kind in TIMED) != (fault.seconds > 0):
            raise ConfigurationError(
                f"fault {spec!r}: {'/'.join(TIMED)} take =SECONDS (e.g. 2:10:compute=30), no other"
            )
        return fault


def inject_faults(model: Any, faults: list[Fault], directory: Path) -> None:
    """Wrap `model.training_step` so that each fault strikes its rank at its batch."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 or rejoining():
        return  # a restarted process: the fault struck its predecessor
    plan = {f.rank: f for f in faults}
    step, validation_step, batch_end = model.training_step, model.validation_step, model.on_train_batch_end
    seen = [0]

    def training_step(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        fault = plan.get(model.trainer.global_rank)
        if fault is not None and seen[0] == fault.batch and fault.kind not in _ELSEWHERE:
            strike(fault, directory)
        return step(*args, **kwargs)

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


def strike(fault: Fault, directory: Path) -> None:
    (directory / f"fault.{fault.rank}.json").write_text(json.dumps({"kind": fault.kind, "time": time.time()}))
    if fault.kind == "compute":
        end = time.monotonic() + fault.seconds
        total = 0
        while time.monotonic() < end:  # pure Python: the interpreter switches threads, the beacon beats
            total += sum(i * i for i in range(10_000))
    elif fault.kind == "block":
        time.sleep(fault.seconds)
    if fault.kind in ("kill", "kill-in-validation", "kill-after-step"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.kind == "kill-in-exchange":
        _kill_in_next_exchange()
    elif fault.kind == "raise":
        raise RuntimeError(f"injected failure on rank {fault.rank}")
    elif fault.kind == "hang":
        while True:
            time.sleep(1.0)
    elif fault.kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)


def _kill_in_next_exchange() -> None:
    from lightning_prague.core.comm import groups

    def post(self: Any, ops: list[Any]) -> Any:  # every algorithm of GroupComm starts its messages here
        first = ops[0]
        first.op(first.tensor, first.peer, first.group)
        os.kill(os.getpid(), signal.SIGKILL)

    groups.GroupComm._post = post  # type: ignore[method-assign]
