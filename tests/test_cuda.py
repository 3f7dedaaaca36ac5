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
    for r in results:
        assert r["buckets"] == 2, "float32 and bfloat16 state are averaged in buckets of their own"
        assert r["mean"] == pytest.approx([mean, mean], abs=1e-2)
        assert r["thread"] == {"device": 0, "own_stream": True}, "the communication thread is bound to the GPU"
        assert r["exchanges"] > 0 and r["consensus_error"] >= 0.0
        assert r["gossip_mean"] == pytest.approx(mean, abs=1e-5)
    # overlapped exchanges conserve the sum of all replicas: nothing lost or applied twice
    assert sum(r["sum"] for r in results) == pytest.approx(total_before, rel=1e-5)
    assert results[0]["after_global"] == pytest.approx(results[1]["after_global"], rel=1e-6)
