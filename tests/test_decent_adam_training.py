"""strategy="decent_adam" end to end under Lightning's launcher (gloo): accuracy, optimizers, checkpoints."""

from __future__ import annotations

import pytest
import torch
from helpers import ROOT, rank_results, run_many, run_training

pytestmark = pytest.mark.timeout(300)

QUICK = ["--strategy", "decent_adam", "--devices", "4", "--step-time", "0", "--profile", "homogeneous"]
STEPS_PER_EPOCH = 12  # digits: 1437 training images in 4 equal shards of 360, batches of 32
STEPS_PER_EPOCH_OF_2 = 23  # in 2 shards of 719


def test_with_a_slow_worker_finishes_matches_ddp_and_replicas_agree(straggler_runs, assert_learned):
    run = straggler_runs["decent_adam"]
    assert run.status == 0, run.log[-3000:]
    result = run.result
    assert_learned(result)  # conftest.py: margins no run meets or misses by luck
    assert result["batches_per_worker"] == [4 * STEPS_PER_EPOCH] * 4, "equal shards: every worker runs every round"
    ranks = [result, *rank_results(run.dir)]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    # the final global average sums the members in the same order on every member: bitwise the same
    assert len({r["params_sha256"] for r in ranks}) == 1, "replicas must agree after fit"
    assert all(r["threads_after_fit"] == [] for r in ranks)


def test_an_adaptive_optimizer_and_its_lr_scheduler_train(tmp_path):
    # AccumAdam on the ring is covered by the checkpoint test below
    lr = 0.01
    args = [*QUICK, "--epochs", "3", "--optimizer", "adamw", "--lr", str(lr), "--lr-decay", "0.5"]
    proc, result = run_training(tmp_path, *args, "--topology", "one_peer_exp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["val_acc"] > 0.85, result
    assert result["lr"] == pytest.approx(lr * 0.5**3), "the LR scheduler stepped once per epoch"
    assert len({r["params_sha256"] for r in [result, *rank_results(tmp_path)]}) == 1, "replicas must agree"


def _optimizer_state(path):
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    (state,) = checkpoint["optimizer_states"]
    return state


def test_accum_adam_state_survives_checkpoint_and_resume(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    args = [*QUICK, "--devices", "2", "--optimizer", "accum_adam", "--lr", "0.01", "--accum-steps", "5"]
    proc, before = run_training(first, *args, "--epochs", "2", "--checkpoint-dir", str(first / "ckpt"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = _optimizer_state(before["last_model_path"])  # rank 0's optimizer, saved by rank 0
    assert state["param_groups"][0]["accum_steps"] == 5
    steps = {s["step"] for s in state["state"].values()}
    assert steps == {2 * STEPS_PER_EPOCH_OF_2}, (steps, before["batches_per_worker"])
    assert all("grad_sum" in s and s["exp_avg"].abs().sum() > 0 for s in state["state"].values())

    resume = ["--resume", before["last_model_path"], "--checkpoint-dir", str(second / "ckpt")]
    proc, after = run_training(second, *args, "--epochs", "3", *resume)
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = _optimizer_state(after["last_model_path"])
    steps = {s["step"] for s in resumed["state"].values()}
    assert steps == {3 * STEPS_PER_EPOCH_OF_2}, "the step count went on from the checkpoint"
    assert after["epochs_run"] == 3 and after["val_acc"] >= before["val_acc"] - 0.02


def test_language_model_example_reaches_ddp_validation_loss(tmp_path):
    example = str(ROOT / "examples" / "textlm_decent_adam.py")
    runs = run_many(
        tmp_path,
        {
            strategy: (example, ["--strategy", strategy, "--devices", "3", "--start-method", "fork"]
                       + ["--json", str(tmp_path / strategy / "result.json")])
            for strategy in ("ddp", "decent_adam")
        },
    )  # fmt: skip
    losses = {}
    for strategy, run in runs.items():
        assert run.status == 0, run.log[-3000:]
        losses[strategy] = run.result["val_loss"]
    assert losses["ddp"] < 3.0, f"the model must learn (uniform guessing is 4.6): {losses}"
    assert losses["decent_adam"] <= losses["ddp"] * 1.03, losses
