"""One rank of the slow-link check: 2 ranks on gloo, rank 1 behind a simulated slow link.

Usage: links_worker.py RANK WORLD PORT OUT_JSON

Writes how long a blocking group sum took with the slow link, an overlapped one (issued, then
0.3 s of "computation", then waited for), and a blocking one when the slow worker is elsewhere.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from lightning_prague.core import BucketedTensors, GroupComm, SessionConfig, init_job, make_policy, make_topology
from lightning_prague.core.gossip import LaggedGossip
from lightning_prague.core.links import SlowLinks, simulate_slow_links
from lightning_prague.core.worker import GroupWorker


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=30)
    session = job.open_session(SessionConfig(world, make_policy("random", world, 2)))
    tensor = torch.ones(1000)  # 4000 bytes
    worker = GroupWorker(session, BucketedTensors([tensor]), timeout=30)
    comm: GroupComm = worker.comm
    result = {}
    simulate_slow_links(SlowLinks(frozenset({1}), 0.3 / 4000))  # 0.3 s for this tensor
    start = time.perf_counter()
    comm.sum_(tensor, (0, 1), "blocking")
    result["blocking"] = time.perf_counter() - start
    gossip = LaggedGossip(worker, worker.tensors, make_topology("complete", world), timeout=30, name="links")
    start = time.perf_counter()
    gossip.issue()
    time.sleep(0.3)  # computation while the exchange is in flight
    gossip.mix()
    result["overlapped"] = time.perf_counter() - start
    gossip.close()
    simulate_slow_links(SlowLinks(frozenset({5}), 1.0))  # a slow worker outside the group
    start = time.perf_counter()
    comm.sum_(tensor, (0, 1), "elsewhere")
    result["elsewhere"] = time.perf_counter() - start
    simulate_slow_links(None)
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
