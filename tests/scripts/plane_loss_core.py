"""One rank of a core-only run whose control plane is SIGKILLed while rank 0 waits in an exchange.

Usage: plane_loss_core.py RANK WORLD PORT OUT_JSON

Rank 0 starts a group sum with rank 1 and blocks in it (rank 1 never takes part: it sleeps, as a
peer across a partition would never answer); a timer thread of rank 0 then SIGKILLs the supervisor
and writes when to `OUT_JSON`'s directory (`plane_killed.json`). Neither training thread ever
contacts the control plane again: each process must end itself (the last resort, exit status 75).
"""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from lightning_prague.core import BucketedTensors, GroupWorker, SessionConfig, init_job, make_policy
from lightning_prague.core.protocol import HangRule

#: the hang bound of a stepping rank in this run (the grace of the last resort)
BOUND = 2.0


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    config = SessionConfig(
        world, make_policy("random", world, 2, seed=1).spec(), timeout=60, hang=HangRule(floor=BOUND)
    )
    session = job.open_session(config)
    params = torch.full((5,), float(rank))
    worker = GroupWorker(session, BucketedTensors([params]), timeout=60, job=job)
    worker.synchronize("start")  # every rank is in; then two quick steps: the stepping bound applies
    session.beacon.bump()
    session.beacon.bump()
    if rank == 0:

        def kill_plane() -> None:
            time.sleep(0.5)
            (out.parent / "plane_killed.json").write_text(json.dumps({"time": time.time()}))
            os.kill(job.supervisor_pid, signal.SIGKILL)

        threading.Thread(target=kill_plane, daemon=True).start()
        worker.comm.sum_(torch.ones(3), (0, 1), "an exchange with a rank that never answers", timeout=60)
    else:
        time.sleep(60)
    out.write_text(json.dumps({"rank": rank, "ended": "normally"}))  # never: the process ends before


if __name__ == "__main__":
    main()
