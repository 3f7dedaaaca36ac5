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
