"""One rank of a core-only (no Lightning) run: partial syncs with uneven step times, then a global average.

Usage: core_worker.py RANK WORLD PORT OUT_JSON POLICY GROUP_SIZE STEPS [SLOW_RANK SLOW_SECONDS]
"""

import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from lightning_prague.core import BucketedTensors, GroupWorker, SessionConfig, communicator_count, init_job, make_policy
from lightning_prague.core.comm.averaging import averaged_optimizer_state


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    out, policy, group_size, steps = sys.argv[4], sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
    slow_rank = int(sys.argv[8]) if len(sys.argv) > 8 else -1
    slow_seconds = float(sys.argv[9]) if len(sys.argv) > 9 else 0.0
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    config = SessionConfig(world, make_policy(policy, world, group_size, seed=1).spec(), record_history=True)
    session = job.open_session(config)
    params = torch.full((5,), float(rank))
    buffer = torch.full((3,), float(rank) * 10)
    worker = GroupWorker(session, BucketedTensors([params, buffer], bucket_bytes=16), timeout=60, job=job)
    rng = random.Random(rank)
    history = []
    communicators = communicator_count()  # after warm-up (GroupWorker's construction)
    raw = dist.distributed_c10d._get_default_store()
    keys = []
    for step in range(steps):
        if step in (steps // 4, steps // 2, 3 * steps // 4, steps - 1):
            keys.append([raw.num_keys(), session.counters.num_keys()])
        time.sleep(slow_seconds if rank == slow_rank else rng.uniform(0.0, 0.01))
        before = params.clone()
        gid = worker.partial_sync().gid
        history.append({"gid": gid, "before": before.tolist(), "after": params.tolist()})
    worker.synchronize("end")
    mean_before = params.clone()
    worker.global_average()
    # an optimizer's state_dict, as a checkpoint at a synchronization point averages it
    moments = {
        "step": torch.tensor(float(rank + 1)),
        "exp_avg": torch.full((4,), float(rank)),
        "exp_avg_sq": torch.full((4,), float(rank**2)),
    }
    state = {"state": {0: moments, 1: {"momentum_buffer": torch.full((2,), 2.0 * rank)}}, "param_groups": [{"lr": 0.1}]}
    optimizer_mean, complete = averaged_optimizer_state(state, worker.comm, worker.members)
    # a worker that never stepped has no state for parameter 1: every worker keeps its own
    uneven = {"state": dict(state["state"]) if rank else {0: moments}, "param_groups": state["param_groups"]}
    kept, uneven_complete = averaged_optimizer_state(uneven, worker.comm, worker.members)
    result = {
        "rank": rank,
        "optimizer_mean": {str(k): {n: t.tolist() for n, t in v.items()} for k, v in optimizer_mean["state"].items()},
        "optimizer_complete": complete,
        "optimizer_unchanged": moments["exp_avg"].tolist() == [float(rank)] * 4 and moments["step"].item() == rank + 1,
        "uneven": [uneven_complete, kept["state"][0]["exp_avg"].tolist()],
        "history": history,
        "final": params.tolist(),
        "buffer": buffer.tolist(),
        "before_global": mean_before.tolist(),
        "stats": {"groups": worker.stats.groups_executed, "skipped": worker.stats.skipped},
        "new_communicators": communicator_count() - communicators,
        "store_keys": keys,
    }
    if rank == 0:
        result["issued"] = session.request("history", "the group history")["issued"]
    worker.close()
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
