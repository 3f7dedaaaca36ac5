"""One rank of a background transfer (`BackgroundTransfer`) on a plain gloo group of 3 ranks.

Rank 0 sends a payload to rank 2 from a thread; meanwhile it sums with rank 1 (the transfer is
held until that sum is done, so it surely runs during it), then sums with rank 2, which waits for
the transfer first. Rank 2 receives the payload, then sums with rank 0: the two streams of
operations with rank 0 must not mix.

Usage: transfer_worker.py RANK WORLD PORT OUT_JSON
"""

import json
import sys
import threading

import torch
import torch.distributed as dist

from lightning_prague.core.comm.groups import GroupComm
from lightning_prague.core.comm.transfer import BackgroundTransfer, receive_payload

PAYLOAD = bytes(range(256)) * 40_000  # 10 MB


def main() -> None:
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    comm = GroupComm(rank, world, 60.0, dist.group.WORLD)
    result = {}
    if rank == 0:
        first_sum_done = threading.Event()

        def encode() -> bytes:
            first_sum_done.wait(60)
            return PAYLOAD

        transfer = BackgroundTransfer(comm, [2], encode, "the payload", 60.0)
        comm.before_exchange = transfer.guard
        transfer.start()
        total = torch.tensor([1.0])
        comm.sum_(total, (0, 1), "a sum with a rank that receives nothing")
        result["sent_before_the_first_sum"] = transfer.done
        first_sum_done.set()
        total = torch.tensor([1.0])
        comm.sum_(total, (0, 2), "a sum with the receiver")
        result["sent_before_the_second_sum"] = transfer.done and bool(transfer.sent)
        result["sum_with_2"] = total.item()
    elif rank == 1:
        total = torch.tensor([10.0])
        comm.sum_(total, (0, 1), "a sum with the sender")
        result["sum_with_0"] = total.item()
    else:
        result["payload_intact"] = receive_payload(comm, 0, "the payload") == PAYLOAD
        total = torch.tensor([100.0])
        comm.sum_(total, (0, 2), "a sum with the sender")
        result["sum_with_0"] = total.item()
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
