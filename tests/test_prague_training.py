"""strategy="prague" end to end: several CPU processes under Lightning's own launcher (gloo).

Each test launches a training script in a process of its own under a timeout (forked from the test
process, which has imported Lightning already, where the test allows it); ranks write their results as
JSON. Together they cover convergence against DDP, straggler tolerance, consensus at
synchronization points, checkpoint/early stopping/resume/second fit/test, SIGTERM on one rank,
several nodes, and the LightningCLI entry point.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from helpers import (
    ROOT,
    SCRIPTS,
    env,
    free_port,
    rank_results,
    run_external_ranks,
    run_forked,
    run_forked_together,
    run_training,
)

pytestmark = pytest.mark.timeout(300)


def test_prague_with_a_straggler_reaches_ddp_accuracy_and_fast_workers_do_more(straggler_runs, assert_learned):
    run = straggler_runs["prague"]
    assert run.status == 0, run.log[-3000:]
    result = run.result
    assert_learned(result)  # conftest.py: margins no run meets or misses by luck
    slow, *fast = result["batches_per_worker"]
    assert min(fast) >= 3 * slow, result["batches_per_worker"]
    # one epoch is one pass over the data by all workers together (45 batches of 32)
    assert sum(result["batches_per_worker"]) == 4 * 45
    # after the final synchronization point every replica is the same consensus model, bitwise (the
    # global average sums the members in the same order on every member)
    ranks = [result, *rank_results(run.dir)]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    digests = {r["params_sha256"] for r in ranks}
    assert len(digests) == 1, digests
    # sync_dist logging in training_step is local, with a warning that says so: every rank logs each
    # step's loss during asynchronous training, and a rank warns once per operation (not per metric or step)
    warning = (
        "reduce (e.g. self.log(..., sync_dist=True)) was called during asynchronous training with "
        "strategy='prague', while ranks are at different steps; a world-wide collective here would hang, so it "
        "uses this rank's local value instead (this warning is shown once). Values logged with sync_dist=True during "
        "training steps are per-rank; they are reduced across ranks at epoch end."
    )
    assert run.log.count(warning) == len(ranks), run.log[-3000:]
    # a torchmetrics metric that syncs its state every step does so locally too, with its own warning
    metric = "a torchmetrics metric's state sync (dist_sync_on_step=True) was called during asynchronous training"
    assert run.log.count(metric) == len(ranks), run.log[-3000:]


def test_static_schedule_trains_without_asking_the_coordinator(tmp_path):
    args = ["--strategy", "prague", "--grouping", "static", "--group-size", "2", "--devices", "4", "--epochs", "2"]
    proc, result = run_training(tmp_path, *args, "--step-time", "0", "--profile", "homogeneous")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["val_acc"] > 0.5, result
    assert result["batches_per_worker"] == [2 * 12] * 4, "equal shards: the static rounds run in lock step"
    ranks = [result, *rank_results(tmp_path)]
    assert [r["coordinator_requests"] for r in ranks] == [0] * 4, "a static schedule needs no coordinator round trip"
    assert all(r["exchanges"] >= 2 * 12 for r in ranks), [r["exchanges"] for r in ranks]
    assert len({r["params_sha256"] for r in ranks}) == 1, "replicas must agree after fit (bitwise)"


def test_checkpoint_early_stopping_resume_second_fit_and_test(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--strategy", "prague", "--step-time", "0", "--checkpoint-dir", str(ckpt)]
    # ranks started as a cluster launcher would (each a process of its own: a test and a second fit follow fit)
    codes, logs = run_external_ranks(tmp_path, 3, *args, "--epochs", "6", "--early-stopping", "--test")
    assert codes == [0, 0, 0], (codes, logs[0][-3000:])
    first = json.loads((tmp_path / "result.json").read_text())
    assert 1 <= first["epochs_run"] < 6, "EarlyStopping(min_delta=0.5) must stop training early"
    assert (ckpt / "last.ckpt").exists() and first["best_model_path"]
    assert first["test_acc"] == pytest.approx(first["val_acc"], abs=1e-6), "test must see the consensus model"

    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    codes, logs = run_external_ranks(
        resumed_dir,
        3,
        *args,
        "--epochs",
        str(first["epochs_run"] + 2),
        "--resume",
        str(ckpt / "last.ckpt"),
        "--refit-epochs",
        str(first["epochs_run"] + 3),
    )
    assert codes == [0, 0, 0], (codes, logs[0][-3000:])
    resumed = json.loads((resumed_dir / "result.json").read_text())
    assert resumed["epochs_run"] == first["epochs_run"] + 3
    assert resumed["val_acc"] > 0.85
    ranks = [resumed, *rank_results(resumed_dir)]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2]
    assert len({r["params_sha256"] for r in ranks}) == 1, "replicas must agree after the second fit (bitwise)"


def test_sigterm_on_one_rank_stops_every_rank_without_hanging(tmp_path):
    args = [
        "--strategy",
        "prague",
        "--epochs",
        "200",
        "--step-time",
        "0.02",
        "--sigterm-rank",
        "2",
        "--sigterm-batch",
        "4",
    ]
    _, logs = run_external_ranks(tmp_path, 3, *args)
    output = "".join(logs)
    # Lightning's SIGTERMException is a SystemExit: every rank leaves fit cleanly
    for rank in range(3):
        assert f"rank {rank}: stopping on SIGTERM" in output, output[-3000:]
    assert "CoordinationTimeout" not in output and "timed out" not in output
    assert "max_epochs=200` reached" not in output


def test_group_size_larger_than_the_world_fails_at_setup(tmp_path):
    proc, _ = run_training(tmp_path, "--strategy", "prague", "--devices", "2", "--group-size", "3", timeout=120)
    assert proc.returncode != 0
    assert "group_size=3 is invalid for 2 workers" in proc.stderr


def test_two_nodes_on_localhost(tmp_path):
    port = str(free_port())
    nodes = []
    for node in range(2):
        out = tmp_path / f"node{node}"
        out.mkdir()
        argv = [
            "--json",
            str(out / "result.json"),
            "--strategy",
            "prague",
            "--devices",
            "2",
            "--num-nodes",
            "2",
            "--epochs",
            "2",
            "--step-time",
            "0.01",
            "--start-method",
            "fork",  # each node forks its ranks: one process per node, itself forked from this one
        ]
        nodes.append((SCRIPTS / "train.py", argv, env(MASTER_PORT=port, NODE_RANK=str(node)), out))
    for proc in run_forked_together(nodes, timeout=240):
        assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "node0" / "result.json").read_text())
    assert result["devices"] == 4 and len(result["batches_per_worker"]) == 4
    assert sum(result["batches_per_worker"]) == 2 * 45


def test_lightning_cli_selects_the_strategy_by_name_from_yaml(tmp_path):
    # the class_path form: tests/test_async_strategies_training.py::test_lightning_cli_configs
    config_args = ["--config", "examples/configs/prague_by_name.yaml", "--trainer.devices", "3"]
    argv = ["fit", *config_args, "--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path)]
    # `python -m lightning_prague.cli ...`, its process forked from this one (ranks 1 and 2: Lightning's launcher)
    proc = run_forked("lightning_prague.cli", argv, env(), ROOT, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())  # what LightningCLI ran, as it saves it
    assert saved["trainer"]["strategy"]["class_path"] == "lightning_prague.PartialAllReduceStrategy"
    assert saved["trainer"]["strategy"]["init_args"]["group_size"] == 3, "the registered name's defaults"


def test_torchrun_restarts_after_a_kill_and_resumes_from_the_last_checkpoint(tmp_path):
    # DataLoader worker processes too; torchrun stops and restarts every worker when rank 1 is killed
    # (in its third epoch: 45 batches an epoch, about 22 each), and the restarted fit, given no
    # ckpt_path, resumes from the last checkpoint
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "--max-restarts", "1", str(ROOT / "tests" / "scripts" / "train.py"), "--json", str(out),
        "--devices", "2", "--group-size", "2", "--epochs", "4", "--step-time", "0.01", "--num-workers", "1",
        "--checkpoint-dir", str(tmp_path / "ckpt"), "--fault", "1:50:kill",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "fault.1.json").exists(), "the fault struck in the first attempt"
    assert "resuming the fit from the last checkpoint" in proc.stderr, proc.stderr[-3000:]
    # the agent's SIGTERM to the other workers is no stop of the job: each leaves (docs: Exit statuses).
    # Rank 0 says so, unless its connection to the control plane closed first as the agent stopped the
    # node (seen once in CI: it then reported the control plane lost, a wrong reason; the closing note
    # of 2026-11-28 has it): either way no rank took it for a stop of the job
    left = "SIGTERM from its torchrun agent, which stops this node's workers" in proc.stderr
    assert left or "rank 0: lost the control plane" in proc.stderr, proc.stderr[-3000:]
    assert "stopping on SIGTERM" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["epochs_run"] == 4 and result["val_acc"] > 0.85
    # the restarted fit trained only the epochs after the checkpoint (at least the last one)
    trained = sum(result["batches_per_worker"])
    assert 45 <= trained < 4 * 45, result["batches_per_worker"]
    assert "Restoring states from the checkpoint path at" in proc.stderr + proc.stdout


def test_an_error_after_the_torchrun_agents_sigterm_is_this_ranks_leave_not_a_failure(monkeypatch, caplog):
    """torchrun's agent signals the node's processes together: a DataLoader worker may die of the
    SIGTERM before the rank's next batch checks its flag, and the fit fails with that worker's error.
    The rank then leaves the job as on the SIGTERM itself (what the torchrun test above saw once)."""
    import logging

    from lightning_prague import PartialAllReduceStrategy

    error = RuntimeError("DataLoader worker (pid 4242) is killed by signal: Terminated.")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    strategy = PartialAllReduceStrategy()
    strategy.controller.sigterm = True
    strategy.on_exception(error)
    assert strategy.failed  # no torchrun: a SIGTERM stops every rank, and an error is a failure
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    with caplog.at_level(logging.WARNING, logger="lightning_prague.strategies.stops"):
        strategy.on_exception(error)
    assert not strategy.failed
    assert "SIGTERM from its torchrun agent, which stops this node's workers" in caplog.text
    strategy.controller.sigterm = False
    strategy.on_exception(error)
    assert strategy.failed  # no SIGTERM came: a failure
