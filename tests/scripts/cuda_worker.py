"""One rank of the CUDA path on one GPU: every rank on cuda:0, gloo between the processes.

Usage: cuda_worker.py RANK WORLD PORT OUT_JSON

NCCL refuses two ranks on one device, so the ranks talk over gloo: the model state lives on the
GPU and every collective stages it through the backend's device (the CPU), from communication
threads bound to the GPU on streams of their own, exactly as with NCCL. Checks: a group average
of float32 and bfloat16 state on the GPU; overlapped exchanges (BackgroundAverager) that conserve
the sum; one round of LaggedGossip; the consensus measurement; the device and stream every group
sum ran on, by thread: the exchangers' own communication threads (bound by `CommStream.bind` as
they start) and, for comparison, the training thread.
"""

import hashlib
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

from lightning_prague.core import (
    BucketedTensors,
    GroupWorker,
    SessionConfig,
    average_,
    init_job,
    make_policy,
    make_topology,
)
from lightning_prague.core.exchange.gossip import LaggedGossip
from lightning_prague.core.exchange.overlap import BackgroundAverager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_reads import HostReadCounter  # noqa: E402


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    job = init_job(rank, world, "gloo", timeout=60)
    session = job.open_session(SessionConfig(world, make_policy("first_ready", world, 2).spec()))
    device = torch.device("cuda", 0)
    params = torch.full((1000,), float(rank), device=device)
    half = torch.full((10,), float(rank), device=device, dtype=torch.bfloat16)
    tensors = BucketedTensors([params, half])
    worker = GroupWorker(session, tensors, timeout=60, job=job)
    result = {"rank": rank, "buckets": len(tensors.buckets)}
    seen: dict[str, list[dict[str, int]]] = {}  # thread name -> the distinct (device, stream) its sums ran on
    group_sum = worker.comm.sum_

    def recorded_sum(*args, **kwargs):  # every exchange's group sums come here, in the thread that runs them
        where = {"device": torch.cuda.current_device(), "stream": torch.cuda.current_stream().cuda_stream}
        places = seen.setdefault(threading.current_thread().name, [])
        if where not in places:
            places.append(where)
        return group_sum(*args, **kwargs)

    worker.comm.sum_ = recorded_sum

    average_(tensors, worker.comm, list(range(world)), operation="test average")
    result["mean"] = [float(params.mean()), float(half.float().mean())]

    exchanger = BackgroundAverager(worker, tensors, timeout=60)
    start_sum = float(params.double().sum())
    added = 0.0
    reads = HostReadCounter()  # the no-sync assertion: no step reads a device value on the host
    reads.install()
    result["host_read_self_check"] = reads.self_check()
    exchanger.start()
    for _ in range(20):
        params.add_(0.5 * (rank + 1))
        added += 0.5 * (rank + 1) * params.numel()
        worker.version += 1
        reads.key = "background steps"
        exchanger.step()
        reads.key = None
    exchanger.drain()
    worker.synchronize("overlapped")
    result.update(start_sum=start_sum, added=added, sum=float(params.double().sum()), exchanges=exchanger.exchanges)
    result["consensus_error"] = worker.consensus_error()
    worker.global_average()
    digest = hashlib.sha256()
    for t in (params, half):
        digest.update(t.cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    result["after_global_sha256"] = digest.hexdigest()

    for t in (params, half):
        t.fill_(float(rank))
    gossip = LaggedGossip(worker, tensors, make_topology("complete", world), timeout=60, name="cuda")
    reads.key = "gossip round"
    gossip.issue()
    gossip.mix()
    reads.key = None
    reads.remove()
    result["host_reads"] = reads.counts
    result["host_read_sites"] = reads.where
    gossip.close()
    result["gossip_mean"] = float(params.mean())
    result["sum_threads"] = seen
    result["streams"] = {
        "background": exchanger.streams.stream.cuda_stream,
        "gossip": gossip.streams.stream.cuda_stream,
        "default": torch.cuda.default_stream(device).cuda_stream,
    }
    worker.close()
    with open(out, "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
