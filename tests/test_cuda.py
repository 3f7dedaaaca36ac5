"""The CUDA path on one GPU (skipped without CUDA): device placement, streams, mixed precision."""

from __future__ import annotations

import pytest
import torch
from helpers import run_core_ranks

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_group_sums_overlap_and_gossip_run_on_the_gpu_through_the_same_code(tmp_path):
    world = 2
    results = run_core_ranks(tmp_path, world, script="cuda_worker.py", fork=False)  # CUDA cannot be forked
    mean = sum(range(world)) / world
    total_before = sum(r["start_sum"] + r["added"] for r in results)
    for rank, r in enumerate(results):
        assert r["rank"] == rank
        assert r["buckets"] == 2, "float32 and bfloat16 state are averaged in buckets of their own"
        assert r["mean"] == pytest.approx([mean, mean], abs=1e-2)
        # where every group sum ran, recorded inside the sum by the thread that ran it: the exchangers'
        # own communication threads are bound to the GPU and to their exchanger's stream
        threads, streams = r["sum_threads"], r["streams"]
        gossip = [name for name in threads if name.startswith(f"prague-gossip-{rank}")]
        assert sorted(threads) == sorted(["MainThread", f"prague-comm-{rank}", *gossip]) and len(gossip) == 1, threads
        assert threads[f"prague-comm-{rank}"] == [{"device": 0, "stream": streams["background"]}]
        assert threads[gossip[0]] == [{"device": 0, "stream": streams["gossip"]}]
        assert threads["MainThread"] == [{"device": 0, "stream": streams["default"]}], "unbound: the default stream"
        assert streams["default"] not in (streams["background"], streams["gossip"]), streams
        assert r["exchanges"] > 0
        assert r["gossip_mean"] == pytest.approx(mean, abs=1e-5)
        # the no-sync assertion (scripts/host_reads.py): the training thread's steps and a gossip round
        # read no device value on the host, by any thread of this package (the stand-in counts a known one)
        assert r["host_read_self_check"] == 1
        assert r["host_reads"] == {}, r["host_read_sites"]
    # overlapped exchanges conserve the sum of all replicas: nothing lost or applied twice
    assert sum(r["sum"] for r in results) == pytest.approx(total_before, rel=1e-5)
    # the consensus error from what the ranks hold: every element of a replica's float32 tensor is the
    # same value v_r (constant adds, averages of constant tensors); the bfloat16 one is 0.5 on both
    v = [r["sum"] / 1000 for r in results]
    m = sum(v) / world
    expected = 1000 * sum((x - m) ** 2 for x in v) / world / (1000 * m**2 + 10 * 0.5**2)
    # (the measurement's mean is rounded to float32: replicas one ulp apart read ~1e-14 off)
    assert results[0]["consensus_error"] == results[1]["consensus_error"], "one all-reduced number on every rank"
    assert results[0]["consensus_error"] == pytest.approx(expected, rel=1e-5, abs=1e-12), (v, expected)
    # the global average sums the members in the same order on every member: bitwise the same replicas
    assert results[0]["after_global_sha256"] == results[1]["after_global_sha256"]


# -- a background transfer on NCCL's path (one GPU: NCCL itself needs two) ------------------------------
#: how long the stand-in's operation with a live peer runs on the device, and one with a peer that died
PIECE_SECONDS, HANG_SECONDS = 0.05, 6.0


def _transfer_on_the_gpu(out: str) -> None:
    """A fresh process: `BackgroundTransfer` on NCCL's path, with torch's `fake` process group and a
    stand-in for NCCL's batched point-to-point operations that behaves as ProcessGroupNCCL does on the
    device: each batch runs on the communicator's own stream after the issuing thread's current stream
    (`syncStream`), `Work.wait` makes the current stream wait for it (the host does not), and
    `Work.is_completed` queries its end. The peer is a kernel that sleeps; a peer that died, one that
    sleeps long past the test (`HANG_SECONDS`)."""
    import json
    import threading
    import time

    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the `fake` backend)

    from lightning_prague.core.comm import transfer
    from lightning_prague.core.comm.groups import GroupComm
    from lightning_prague.core.comm.transfer import BackgroundTransfer

    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=3)
    dist.get_backend = lambda group=None: "nccl"  # type: ignore[assignment]  (GroupComm takes NCCL's path)
    torch.cuda._sleep(1000)  # (loads the kernel)
    torch.cuda.synchronize()
    start = time.monotonic()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    cycles_per_second = 100_000_000 / (time.monotonic() - start)

    nccl = torch.cuda.Stream()  # the communicator's own stream, as ProcessGroupNCCL's
    issues: list[dict] = []  # where each batch was issued from
    arrived: list[torch.Tensor] = []  # what the peer received
    never_after: list[int] = []  # the number of batches after which the peer takes part no more
    hung: list[torch.cuda.Event] = []

    class Work:
        def __init__(self, end: torch.cuda.Event) -> None:
            self.end = end

        def is_completed(self) -> bool:
            return self.end.query()

        def wait(self, timeout=None) -> bool:  # NCCL's: orders the current stream, the host goes on
            torch.cuda.current_stream().wait_event(self.end)
            return True

    def batch_isend_irecv(ops):
        current = torch.cuda.current_stream()
        issues.append(
            {
                "thread": threading.current_thread().name,
                "device": torch.cuda.current_device(),
                "stream": current.cuda_stream,
            }
        )
        never = bool(never_after) and len(issues) > never_after[0]
        nccl.wait_stream(current)  # the inputs are ready first
        with torch.cuda.stream(nccl):
            torch.cuda._sleep(int(cycles_per_second * (HANG_SECONDS if never else PIECE_SECONDS)))
            if not never:
                arrived.extend(op.tensor.clone() for op in ops)
            end = torch.cuda.Event()
            end.record(nccl)
        for op in ops:
            op.tensor.record_stream(nccl)
        if never:
            hung.append(end)
        return [Work(end)]

    dist.batch_isend_irecv = batch_isend_irecv  # type: ignore[assignment]
    transfer.PIECE_BYTES = 1 << 20
    payload = bytes(range(256)) * (3 * 4096 + 100)  # four pieces
    result: dict = {"default_stream": torch.cuda.default_stream(0).cuda_stream}

    # a live receiver: every piece arrives, and each wait lasted until the piece had run on the device
    comm = GroupComm(0, 3, 30.0)
    result["comm"] = {"device": str(comm.device), "batched": comm.batched}
    sending = BackgroundTransfer(comm, [2], lambda: payload, "the state", 30.0).start()
    sending.wait()
    torch.cuda.synchronize()
    result["live"] = {
        "issues": list(issues),
        "transfer_stream": sending.stream.stream.cuda_stream,  # type: ignore[union-attr]
        "size": int(arrived[0].item()),
        "intact": b"".join(t.cpu().numpy().tobytes() for t in arrived[1:]) == payload,
        "sent": sending.sent,
    }

    # a receiver that dies after the size and one piece: its departure is announced 0.3 s later
    issues.clear()
    arrived.clear()
    never_after.append(2)
    departed: set[int] = set()
    comm = GroupComm(0, 3, 60.0)
    comm.abandon = lambda members: any(m in departed for m in members)
    sending = BackgroundTransfer(comm, [2], lambda: payload, "the state", 60.0).start()
    deadline = time.monotonic() + 20
    while not hung and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    departed.add(2)
    announced = time.monotonic()
    sending.wait()
    gave_up = time.monotonic() - announced
    still_hung = bool(hung) and not hung[0].query()  # the dead peer's operation holds the communicator's stream
    x = torch.ones(1 << 20, device="cuda")
    start = time.monotonic()
    (x * 2).sum()
    torch.cuda.current_stream().synchronize()  # the compute stream: held by nothing of the transfer
    result["dead"] = {
        "gave_up": gave_up,
        "done": sending.done,
        "sent": sending.sent,
        "still_hung": still_hung,
        "compute_seconds": time.monotonic() - start,
        "transfer_stream_free": sending.stream.stream.query(),  # type: ignore[union-attr]
        "issues": list(issues),
    }
    torch.cuda.synchronize()  # the stand-in's long kernel ends before the process does
    with open(out, "w") as f:
        json.dump(result, f)


@pytest.mark.timeout(120)
def test_a_background_transfer_binds_the_gpu_and_its_own_stream_and_never_holds_the_compute_stream(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "transfer.json"
    proc = subprocess.run(  # a fresh interpreter: CUDA cannot be forked
        [sys.executable, __file__, str(out)], capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["comm"] == {"device": "cuda:0", "batched": True}
    live = r["live"]
    # every piece was issued by the transfer thread, bound to the GPU and on its own stream, not the default one
    assert [i["thread"] for i in live["issues"]] == ["prague-transfer-0"] * 5  # the size and four pieces
    assert {(i["device"], i["stream"]) for i in live["issues"]} == {(0, live["transfer_stream"])}
    assert live["transfer_stream"] != r["default_stream"]
    assert live["size"] == 3 * 4096 * 256 + 100 * 256 and live["intact"]
    ((receiver, _, seconds),) = live["sent"]
    assert receiver == 2 and seconds >= 0.8 * 5 * PIECE_SECONDS, "each wait lasted until the piece ran on the GPU"
    dead = r["dead"]
    assert dead["done"] and dead["sent"] == [] and dead["gave_up"] < 2.0, "the thread gave up at the departure"
    assert dead["still_hung"], "(the test's premise: the dead peer's operation was still running)"
    assert dead["compute_seconds"] < 1.0, "the compute stream waited for the transfer to a dead peer"
    assert dead["transfer_stream_free"], "the transfer's own stream waited for an operation that never ends"
    assert len(dead["issues"]) == 3  # the size, one piece, and the piece that never arrived


if __name__ == "__main__":  # the fresh process of the transfer test above
    import sys

    _transfer_on_the_gpu(sys.argv[1])
