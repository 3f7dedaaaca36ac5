"""Preemption: SIGTERM on one worker, and SLURM's requeue signal, stop every strategy within a
step or two (not at the next synchronization point), with one consensus model at the stop, which
is what a checkpoint written then holds."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_external_ranks

pytestmark = pytest.mark.timeout(200)

# 200 epochs of about 22 batches per rank: only a coordinated stop ends them
WORKLOAD = ["--epochs", "200", "--step-time", "0.02", "--group-size", "2"]


def stops(tmp) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(tmp.glob("result.stop*.json"))]


@pytest.mark.parametrize("strategy", ["decent_adam", "partial_reduce"])
def test_sigterm_stops_every_rank_within_a_step_with_one_model_and_a_consensus_checkpoint(tmp_path, strategy):
    checkpoints = tmp_path / "on_exception"
    args = ["--strategy", strategy, *WORKLOAD, "--sigterm-rank", "1", "--sigterm-batch", "4"]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--exception-checkpoint", str(checkpoints)]
    codes, logs = run_external_ranks(tmp_path, 2, *args)
    assert codes == [1, 1], (codes, logs[1][-3000:])
    states = stops(tmp_path)
    assert [s["rank"] for s in states] == [0, 1] and {s["error"] for s in states} == {"SIGTERMException"}
    # within a step or two of the signal: the first epoch (about 22 batches per rank) had not ended
    assert all(s["epoch"] == 0 for s in states), states
    # the replicas were averaged at the stop point: one model, bitwise
    assert len({(s["params_sum"], s["params_norm"]) for s in states}) == 1, states
    (written,) = checkpoints.glob("*.ckpt")
    checkpoint = torch.load(written, map_location="cpu", weights_only=False)
    params = torch.cat([t.reshape(-1).double() for t in checkpoint["state_dict"].values() if t.is_floating_point()])
    assert float(params.sum()) == pytest.approx(states[0]["params_sum"], rel=1e-12)


def test_slurms_requeue_signal_stops_every_rank_then_writes_the_consensus_and_requeues(tmp_path):
    # rank 1 alone gets SIGUSR1 (SLURM sends it to every task, not necessarily before the others stop)
    root = tmp_path / "root"
    args = ["--strategy", "decent_adam", *WORKLOAD, "--sigterm-rank", "1", "--sigterm-batch", "4"]
    args += ["--sigterm-signal", "SIGUSR1", "--root-dir", str(root)]
    args += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--exception-checkpoint", str(tmp_path / "on_exception")]
    codes, logs = run_external_ranks(tmp_path, 2, *args, slurm=True)
    assert codes == [1, 1], (codes, logs[0][-3000:], logs[1][-3000:])
    states = stops(tmp_path)
    assert [s["rank"] for s in states] == [0, 1] and all(s["epoch"] == 0 for s in states), states
    assert len({(s["params_sum"], s["params_norm"]) for s in states}) == 1, states
    # Lightning's requeue: the HPC checkpoint (here of the consensus model), then `scontrol requeue`
    (hpc,) = root.glob("hpc_ckpt_*.ckpt")
    checkpoint = torch.load(hpc, map_location="cpu", weights_only=False)
    params = torch.cat([t.reshape(-1).double() for t in checkpoint["state_dict"].values() if t.is_floating_point()])
    assert float(params.sum()) == pytest.approx(states[0]["params_sum"], rel=1e-12)
    assert "requeing job 4242" in logs[0] and "requeing job" not in logs[1]  # the leader requeues (no scontrol here)
