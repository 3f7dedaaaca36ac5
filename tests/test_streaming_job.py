"""A Hugging Face streaming dataset passed whole to `prague`, in one real job: its shards are shared out by
speed, every row is trained exactly once through a `kill -9`, and the reading runs in DataLoader worker
processes (which never talk to the control plane).

The job (`benchmarks/streaming_vs_ddp.py --one`, its ranks forked from it): 16 JSON-lines shards of 48
rows written here, 4 CPU workers, batches of 8, each rank's `DataLoader` with 2 worker processes, rank 0
four times slower than the others, rank 2 SIGKILLed at its 6th batch (not restarted). Every rank writes
the row ids it trained after each batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import free_port

pytest.importorskip("datasets")

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
SHARDS, ROWS, BATCH, KILLED, AT = 16, 48, 8, 2, 6


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from streaming_vs_ddp import write_shards
    finally:
        sys.path.pop(0)
    data, out = tmp_path_factory.mktemp("shards"), tmp_path_factory.mktemp("streaming_job")
    write_shards(data, SHARDS, ROWS)
    command = [sys.executable, str(ROOT / "benchmarks" / "streaming_vs_ddp.py"), "--one", "--strategy", "prague"]
    command += ["--data", str(data), "--out", str(out), "--workers", "4", "--batch-size", str(BATCH)]
    command += ["--step-time", "0.03", "--slow-factor", "4", "--num-workers", "2", "--kill", f"{KILLED}:{AT}"]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150, cwd=out)
    return done, out


def test_every_row_of_the_stream_is_trained_once_through_a_kill_and_fast_ranks_read_more(job):
    done, out = job
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "result.0.json").exists()  # the fit returned
    trained = {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out.glob("ids.*.json")}
    counts = Counter(i for ids in trained.values() for i in ids)
    assert set(counts) == set(range(SHARDS * ROWS)), f"{SHARDS * ROWS - len(counts)} rows never trained"
    assert max(counts.values()) == 1, [i for i, c in counts.items() if c > 1][:20]
    # the killed rank trained its first batches (its 6th died with it and was read again by another)
    assert len(trained[KILLED]) == (AT - 1) * BATCH
    # the slow rank read less than each fast survivor: the shards went by speed
    assert all(len(trained[0]) < len(trained[r]) for r in (1, 3)), {r: len(ids) for r, ids in trained.items()}
    assert "has no shards the strategy can share out" not in done.stderr
