"""One rank of a core-only run in which a membership epoch's process group is made with no meeting.

Usage: epoch_group_worker.py RANK WORLD PORT OUT_JSON LATE_RANK

Every rank joins the job; then each makes membership epoch 1's group among every rank
(`Membership.epoch_group`, as a member does when an admission reaches it), rank LATE_RANK only 3 s
after the others. Ranks 0 and 1 sum a tensor over the new group at once (the pair connects at its
first exchange: nobody waits for the late rank), then every rank sums over all of them. Then ranks 0
and 1 make epoch 2's group as if the late rank had departed, and sum over their pair on it (a third
member's departure must not fail the pair's connection). Then every rank makes epoch 3's group and
ranks 1 and 2 die at once: rank 0's first exchange with each ends incomplete when that peer is
counted departed, never held in gloo's connect. Each writes how long its creation and its sums took
and what they gave.
"""

import json
import os
import sys
import time

import torch

from lightning_prague.core import GroupComm, init_job

LATE_SECONDS = 3.0


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    late = int(sys.argv[5])
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    job = init_job(rank, world, "gloo", timeout=60)
    members = list(range(world))
    if rank == late:
        time.sleep(LATE_SECONDS)
    start = time.monotonic()
    group = job.epoch_group(1, members)
    created = time.monotonic() - start
    comm = GroupComm(rank, world, 30, group)
    comm.rebind(group, members)
    pair_seconds, pair = None, None
    if rank in (0, 1):
        start = time.monotonic()
        tensor = torch.full((4,), float(rank + 1))
        complete = comm.sum_(tensor, (0, 1), "the pair's first exchange")
        pair_seconds, pair = time.monotonic() - start, (tensor.tolist() if complete else None)
    everyone = torch.full((4,), float(rank + 1))
    complete = comm.sum_(everyone, tuple(members), "a sum over every member")
    result = {
        "rank": rank,
        "created": created,
        "pair_seconds": pair_seconds,
        "pair": pair,
        "everyone": everyone.tolist() if complete else None,
        "epochs": sorted(job.epoch_groups),
    }
    if rank in (0, 1):  # epoch 2: the late rank departed before this pair's first exchange on it
        group = job.epoch_group(2, members, lambda: {late})
        comm = GroupComm(rank, world, 30, group)
        comm.rebind(group, members)
        tensor = torch.full((4,), float(rank + 1))
        try:
            complete = comm.sum_(tensor, (0, 1), "the pair's first exchange after a departure")
            result["pair_after_departure"] = tensor.tolist() if complete else None
        except Exception as err:  # (what it did before: a third member's departure failed the pair)
            result["pair_after_departure"] = f"{type(err).__name__}: {err}"
    job.retire_epochs()  # (the job's group is neither epoch's: both are dropped)
    result["epochs_after_retire"] = sorted(job.epoch_groups)
    # epoch 3: every rank makes its group (and so publishes its addresses), then ranks 1 and 2 die
    # before any pair of it connected; rank 0's first exchange with each must end once that peer is
    # counted departed (a second after it began), wherever gloo's connect would wait for it
    departs_at: dict[int, float] = {}
    group = job.epoch_group(3, members, lambda: {p for p, at in departs_at.items() if time.monotonic() > at})
    if rank != 0:
        with open(out, "w") as f:
            json.dump(result, f)
        os._exit(0)  # (as a killed process: its sockets close, it never connects)
    comm = GroupComm(rank, world, 30, group)
    comm.rebind(group, members)
    while not all(os.path.exists(os.path.join(os.path.dirname(out), f"r{p}.json")) for p in (1, 2)):
        time.sleep(0.05)
    time.sleep(0.5)  # (their processes end)
    result["dead_peers"] = {}
    for peer in (1, 2):
        start = time.monotonic()
        departs_at[peer] = start + 1.0
        complete = comm.sum_(torch.ones(4), (0, peer), "a first exchange with a peer that died")
        result["dead_peers"][str(peer)] = [complete, time.monotonic() - start]
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
