"""One rank of a core-only run of LaggedGossip (decentralized Adam's overlapped gossip) on gloo.

Usage: gossip_worker.py RANK WORLD PORT OUT_JSON CASES_JSON STEPS

CASES_JSON maps case names to topologies, each ``{"name": ..., "workers_per_node": ...}`` or
``{"schedule": [...]}``. For each case the rank writes: for every round of the period, its
tensors after one round from known starting values ("rounds"); and the parameters after STEPS
steps of gradient descent on a quadratic with the exchange overlapped ("overlapped"), waited for
at once ("blocking") and mixed in at once ("averaged_first"), each with the number of rounds run
including the end-of-phase idle rounds; and ("uneven") the same with rank r running STEPS + 2r
steps. Also the exact consensus error of the starting values and the group error each round's
mix recorded, ("own_pace") a ring at each rank's own pace with rank 3 slow, and ("phase_keys",
rank 0) which of four phases still have keys in the store. Every round sums its buckets in pieces of
3 elements (`SUM_PIECE_BYTES`), as a large model's buckets are.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from lightning_prague.core import BucketedTensors, GroupWorker, SessionConfig, init_job, make_policy, make_topology
from lightning_prague.core.exchange import gossip as gossip_module
from lightning_prague.core.exchange.gossip import LaggedGossip

# every round sums its buckets in pieces of 3 elements (float64): the results must not depend on the pieces
gossip_module.SUM_PIECE_BYTES = 24

DIM, LR = 7, 0.3


def start_values(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(4, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)]


def target(rank: int) -> torch.Tensor:
    return torch.arange(DIM, dtype=torch.float64) * (rank + 1)


def train(
    worker: GroupWorker,
    tensors: BucketedTensors,
    schedule,
    steps: int,
    overlap: bool,
    name: str,
    lagged: bool = True,
    idle_after: float = 60.0,
) -> dict:
    # equal step counts: a rank never waits long enough for idle rounds, however loaded the machine
    gossip = LaggedGossip(
        worker, tensors, schedule, timeout=60, overlap=overlap, name=name, idle_after=idle_after, lagged=lagged
    )
    for t, v in zip(tensors.tensors, start_values(worker.rank)):
        t.copy_(v)
    gossip.start()  # round 0 carries x^0
    for _ in range(steps):
        x = torch.cat([t.reshape(-1) for t in tensors.tensors])
        grad = x - target(worker.rank)  # taken at the un-averaged x^t
        gossip.mix()  # x <- W_t x^t
        offset = 0
        for t in tensors.tensors:
            t.sub_(LR * grad[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        gossip.step()  # issues round t+1 with x^{t+1}
    gossip.end_phase(f"{name}/end")  # idle rounds up to the agreed final round, the last one mixed in
    return {"params": torch.cat([t.reshape(-1) for t in tensors.tensors]).tolist(), "rounds": gossip.round}


def own_pace(worker: GroupWorker, tensors: BucketedTensors, schedule, steps: int) -> dict:
    """`steps` steps at each rank's own pace (`own_pace`), rank 3 sleeping 0.05 s in each: the parameters,
    the rounds run, the local steps taken, and the sum of the gradient steps applied (`lr * grad`)."""
    gossip = LaggedGossip(worker, tensors, schedule, timeout=60, name="own", idle_after=0.1, own_pace=True)
    for t, v in zip(tensors.tensors, start_values(worker.rank)):
        t.copy_(v)
    applied = torch.zeros(DIM, dtype=torch.float64)
    gossip.start()
    for _ in range(steps):
        if worker.rank == 3:
            time.sleep(0.05)
        x = torch.cat([t.reshape(-1) for t in tensors.tensors])
        grad = LR * (x - target(worker.rank))
        applied += grad
        offset = 0
        for t in tensors.tensors:
            t.sub_(grad[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
        gossip.step()  # mixes the round in if it is done (and issues the next), else a local step
    gossip.end_phase("own/end")
    return {
        "params": torch.cat([t.reshape(-1) for t in tensors.tensors]).tolist(),
        "rounds": gossip.round,
        "local_steps": gossip.local_steps,
        "applied": applied.tolist(),
    }


def phases_of_uneven_length(worker: GroupWorker, schedule, phases: int) -> dict:
    """Run `phases` phases of uneven length (rank r steps 1 + (r + phase) % 3 times): the round each
    ended at, the idle rounds run, and the keys the session's counters hold afterwards."""
    gossip = LaggedGossip(worker, worker.tensors, schedule, timeout=60, name="phases", idle_after=0.1)
    ended_at = []
    for phase in range(phases):
        gossip.start()
        for _ in range(1 + (worker.rank + phase) % 3):
            gossip.step()
        gossip.end_phase(f"phases/phase{phase}")
        ended_at.append(gossip.round)
    return {"ended_at": ended_at, "idle_rounds": gossip.idle_rounds, "counter_keys": worker.counters.num_keys()}


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    cases, steps = json.loads(sys.argv[5]), int(sys.argv[6])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    session = job.open_session(SessionConfig(world, make_policy("random", world, 2).spec()))
    params = [torch.zeros(4, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)]
    tensors = BucketedTensors(params, bucket_bytes=32)  # two buckets
    worker = GroupWorker(session, tensors, timeout=60, job=job)
    result = {"rank": rank, "start": torch.cat(start_values(rank)).tolist()}
    for t, v in zip(params, start_values(rank)):
        t.copy_(v)
    result["consensus_error"] = worker.consensus_error()  # of the known starting values
    for case, spec in cases.items():
        schedule = make_topology(spec.get("name", ""), world, spec.get("workers_per_node", 1), spec.get("schedule"))
        rounds, group_errors = [], []
        for r in range(schedule.period):
            gossip = LaggedGossip(worker, tensors, schedule, timeout=60)
            for t, v in zip(params, start_values(rank)):
                t.copy_(v)
            gossip.round = r
            gossip.issue()
            gossip.mix()
            rounds.append(torch.cat(params).tolist())
            group_errors.append(worker.stats.take_group_error())
        result[case] = {
            "rounds": rounds,
            "group_errors": group_errors,
            "overlapped": train(worker, tensors, schedule, steps, overlap=True, name=f"{case}-overlapped"),
            "blocking": train(worker, tensors, schedule, steps, overlap=False, name=f"{case}-blocking"),
            # lagged=False mixes each round in at once: the gradient is taken at the averaged x
            "averaged_first": train(
                worker, tensors, schedule, steps, overlap=False, name=f"{case}-averaged", lagged=False
            ),
            # rank r runs steps + 2r steps: the end-of-phase protocol must still end every rank together
            # (a short idle_after: the ranks that finish first switch to idle rounds quickly)
            "uneven": train(
                worker, tensors, schedule, steps + 2 * rank, overlap=True, name=f"{case}-uneven", idle_after=0.1
            ),
        }
    result["own_pace"] = own_pace(worker, tensors, make_topology("ring", world), steps=12)
    result["phases"] = phases_of_uneven_length(worker, make_topology("ring", world), phases=4)
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
