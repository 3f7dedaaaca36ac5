"""A Hugging Face streaming dataset passed whole to `prague`, in real jobs: its shards are shared out by
speed, every row is trained exactly once through a `kill -9`, the reading runs in DataLoader worker
processes (which never talk to the control plane), and a fit resumed from a checkpoint taken inside the
streaming epoch, on another number of workers, trains exactly the rows the first had not.

The first job (`benchmarks/streaming_vs_ddp.py --one`, its ranks forked from it): 16 JSON-lines shards of
48 rows written here, 4 CPU workers, batches of 8, each rank's `DataLoader` with 2 worker processes,
rank 0 four times slower than the others, a checkpoint every 2 global steps (8 batches), rank 2
SIGKILLed at its 6th batch (not restarted). Every rank writes the row ids it trained after each batch,
with the batch's global-progress ticket. The second job resumes from the first checkpoint (16 batches
in: before the kill) on 3 workers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import free_port, run_forked_together

pytest.importorskip("datasets")

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parents[1]
SHARDS, ROWS, BATCH, KILLED, AT = 16, 48, 8, 2, 6
EVERY = 2  # global steps between checkpoints; a step is one batch per worker (4 batches)
RESUMED_STEP = 4  # the checkpoint the second job resumes from: 16 batches in


def _fit(data: Path, out: Path, workers: int, *extra: str) -> subprocess.CompletedProcess:
    """One fit, forked from this process (its imports done: no interpreter start-up)."""
    argv = ["--one", "--strategy", "prague", "--data", str(data), "--out", str(out), "--workers", str(workers)]
    argv += ["--batch-size", str(BATCH), "--step-time", "0.02", "--slow-factor", "4", "--num-workers", "2", *extra]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    (done,) = run_forked_together([(ROOT / "benchmarks" / "streaming_vs_ddp.py", argv, env, out)], timeout=150)
    return done


def _trained(out: Path) -> dict[int, list[tuple[int | None, list[int]]]]:
    return {int(p.name.split(".")[1]): json.loads(p.read_text()) for p in out.glob("ids.*.json")}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, subprocess.CompletedProcess, Path]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from streaming_vs_ddp import write_shards
    finally:
        sys.path.pop(0)
    data = tmp_path_factory.mktemp("shards")
    first, second = tmp_path_factory.mktemp("streaming_job"), tmp_path_factory.mktemp("streaming_resumed")
    write_shards(data, SHARDS, ROWS)
    killed = _fit(data, first, 4, "--checkpoint-every", str(EVERY), "--kill", f"{KILLED}:{AT}")
    checkpoint = first / "checkpoints" / f"epoch=0-step={RESUMED_STEP}.ckpt"
    resumed = _fit(data, second, 3, "--resume", str(checkpoint)) if checkpoint.exists() else killed
    return killed, first, resumed, second


def test_every_row_of_the_stream_is_trained_once_through_a_kill_and_fast_ranks_read_more(jobs):
    done, out, _, _ = jobs
    assert done.returncode == 0, done.stderr[-4000:]
    assert (out / "result.0.json").exists()  # the fit returned
    trained = {rank: [i for _, ids in batches for i in ids] for rank, batches in _trained(out).items()}
    counts = Counter(i for ids in trained.values() for i in ids)
    assert set(counts) == set(range(SHARDS * ROWS)), f"{SHARDS * ROWS - len(counts)} rows never trained"
    assert max(counts.values()) == 1, [i for i, c in counts.items() if c > 1][:20]
    # the killed rank trained its first batches (its 6th died with it and was read again by another)
    assert len(trained[KILLED]) == (AT - 1) * BATCH
    # the slow rank read less than each fast survivor: the shards went by speed
    assert all(len(trained[0]) < len(trained[r]) for r in (1, 3)), {r: len(ids) for r, ids in trained.items()}
    assert "has no shards the strategy can share out" not in done.stderr


def test_a_fit_resumed_inside_the_streaming_epoch_on_fewer_workers_trains_exactly_the_rest(jobs):
    _, first, done, out = jobs
    assert (first / "checkpoints" / f"epoch=0-step={RESUMED_STEP}.ckpt").exists(), sorted(first.rglob("*.ckpt"))
    assert done.returncode == 0, done.stderr[-4000:]
    # the first fit's rows up to the checkpoint: the batches whose tickets (global batch numbers) it covers
    covered = RESUMED_STEP * 4
    before = Counter(i for batches in _trained(first).values() for t, ids in batches if t <= covered for i in ids)
    after = Counter(i for batches in _trained(out).values() for _, ids in batches for i in ids)
    # tickets no batch trained under: the killed rank's last two at most (the batch it was training, and
    # the next one's, claimed ahead: docs/streaming.md), each after the last ticket it trained
    tickets = {t for batches in _trained(first).values() for t, _ in batches}
    holes = [t for t in range(1, max(tickets) + 1) if t not in tickets]
    last_of_killed = max(t for t, _ in _trained(first)[KILLED])
    assert len(holes) <= 2 and all(t > last_of_killed for t in holes), (holes, last_of_killed)
    assert sum(before.values()) == (covered - sum(t <= covered for t in holes)) * BATCH
    both = before + after
    assert set(both) == set(range(SHARDS * ROWS)), f"{SHARDS * ROWS - len(both)} rows never trained"
    assert max(both.values()) == 1, sorted(i for i, c in both.items() if c > 1)[:20]
    assert sorted(_trained(out)) == [0, 1, 2]  # (three workers now)
