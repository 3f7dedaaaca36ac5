"""`train.py` with ranks that die while the survivors rebuild the job's process group.

Usage: the options of `train.py`, plus `--die-in-rebuild RANK:ATTEMPT:WHEN` (repeatable): rank RANK
SIGKILLs itself in attempt ATTEMPT of the first rebuild of the process group, before it publishes
its address in the store (`before-key`) or a moment after (`after-key`: while the others connect
to it). It writes `fault.RANK.json` first, as the demo's faults do.
"""

import argparse
import json
import os
import runpy
import signal
import sys
import time
from pathlib import Path

from lightning_prague.core import job as job_module


def die_in_rebuilds(plan: dict[int, tuple[int, str]], directory: Path) -> None:
    publish = job_module.RendezvousStore.set

    def set_(store, key, value):
        attempt, when = plan.get(store.rank, (0, ""))
        if f"(attempt {attempt})" in store.what:
            (directory / f"fault.{store.rank}.json").write_text(json.dumps({"kind": when, "time": time.time()}))
            if when == "after-key":
                publish(store, key, value)
                time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        publish(store, key, value)

    job_module.RendezvousStore.set = set_


def main() -> None:
    own = argparse.ArgumentParser()
    own.add_argument("--die-in-rebuild", action="append", default=[], metavar="RANK:ATTEMPT:WHEN")
    own.add_argument("--json", type=Path, required=True)
    args, rest = own.parse_known_args()
    plan = {}
    for spec in args.die_in_rebuild:
        rank, attempt, when = spec.split(":")
        plan[int(rank)] = (int(attempt), when)
    die_in_rebuilds(plan, args.json.parent)
    script = Path(__file__).resolve().parent / "train.py"
    sys.argv = [str(script), "--json", str(args.json), *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
