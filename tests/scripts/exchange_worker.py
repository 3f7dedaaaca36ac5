"""One rank of a core-only run of the threaded exchangers (AD-PSGD gossip or Partial Reduce).

Usage: exchange_worker.py RANK WORLD PORT OUT_JSON MODE STEPS [SLOW_RANK SLOW_FACTOR]

With a slow rank, that rank does STEPS steps per phase and the others step until it is done.

MODE is ``gossip`` (active ranks run BackgroundAverager, passive ones PassiveResponder) or
``first_ready`` / ``first_ready_staleness`` (every rank runs BackgroundAverager). Each step adds a
known increment to the parameters ("training") while exchanges run in the background, so the test
can check that the sum over ranks equals the start plus every increment: no exchange lost or
applied twice.
"""

import json
import random
import sys
import time

import torch
import torch.distributed as dist

from lightning_prague.core import BucketedTensors, GroupWorker, SessionConfig, init_job
from lightning_prague.core.exchange.overlap import BackgroundAverager, PassiveResponder, communication_threads
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.core.grouping.policies import GossipPolicy, make_policy


def comm_threads() -> list[str]:
    return communication_threads()


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, mode, steps = sys.argv[4], sys.argv[5], int(sys.argv[6])
    slow_rank = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    slow_factor = float(sys.argv[8]) if len(sys.argv) > 8 else 1.0
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    graph = BipartiteGraph.ring(world)
    if mode == "gossip":
        policy = GossipPolicy(graph, seed=1)
    else:
        weighting = "staleness" if mode.endswith("staleness") else "uniform"
        policy = make_policy("first_ready", world, 2, seed=1, weighting=weighting, mixing_window=4 * world)
    session = job.open_session(SessionConfig(world, policy.spec(), avoid_stragglers=False, record_history=True))
    params = torch.full((6,), float(rank), dtype=torch.float64)
    start_sum = float(params.sum())
    tensors = BucketedTensors([params], bucket_bytes=16)
    worker = GroupWorker(session, tensors, timeout=60, job=job)
    passive = mode == "gossip" and not graph.is_active(rank)
    exchanger = (PassiveResponder if passive else BackgroundAverager)(worker, tensors, timeout=60)
    rng = random.Random(rank)
    control = session.counters  # the slow rank tells the others it is done
    added = 0.0
    threads_during = []
    for phase in range(2):  # two asynchronous phases: threads must stop and start again around the sync point
        exchanger.start()
        done_key = f"phase{phase}/slow_done"
        step = 0
        # with a slow rank, the others keep training until it has done its steps (as with a shared work queue)
        while step < steps if slow_rank in (-1, rank) else not control.check([done_key]):
            step += 1
            base = rng.uniform(0.005, 0.015)
            time.sleep(base * (slow_factor if rank == slow_rank else 1.0))
            increment = 0.001 * (rank + 1)
            params.add_(increment)
            added += increment * params.numel()
            worker.version += 1
            exchanger.step()
        if rank == slow_rank:
            control.set(done_key, "1")
        threads_during.append(comm_threads())
        exchanger.drain()
        threads_after_drain = comm_threads()
        worker.synchronize(f"phase{phase}")
    before_global = float(params.sum())
    worker.global_average()
    exchanger.close()
    result = {
        "rank": rank,
        "passive": passive,
        "start_sum": start_sum,
        "added": added,
        "before_global_sum": before_global,
        "final": params.tolist(),
        "exchanges": exchanger.exchanges,
        "groups_executed": worker.stats.groups_executed,
        "requests": worker.stats.requests,
        "skipped": worker.stats.skipped,
        "threads_during": threads_during,
        "threads_after_drain": threads_after_drain,
        "threads_at_end": comm_threads(),
    }
    if rank == 0:
        history = session.request("history", "the group history")
        result["issued"] = [members for _, members in history["issued"]]
        result["windows_closed"] = history["windows_closed"]
    worker.close()
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
