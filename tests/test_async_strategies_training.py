"""strategy="partial_reduce" and strategy="adpsgd" end to end under Lightning's launcher (gloo)."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, rank_results, run_external_ranks, run_many

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("strategy", ["partial_reduce", "adpsgd"])
def test_with_a_straggler_reaches_ddp_accuracy_and_fast_workers_do_more(straggler_runs, assert_learned, strategy):
    run = straggler_runs[strategy]  # partial_reduce with staleness weighting
    assert run.status == 0, run.log[-3000:]
    result = run.result
    assert_learned(result)  # conftest.py: margins no run meets or misses by luck
    slow, *fast = result["batches_per_worker"]
    assert min(fast) >= 3 * slow, result["batches_per_worker"]
    assert sum(result["batches_per_worker"]) == 4 * 45, "every batch is trained exactly once per epoch"
    assert result["epochs_in_store"] == [3], "finished epochs' keys are deleted: the store does not grow"
    ranks = [result, *rank_results(run.dir)]
    assert sorted(r["rank"] for r in ranks) == [0, 1, 2, 3]
    # the final global average sums the members in the same order on every member: bitwise the same
    assert len({r["params_sha256"] for r in ranks}) == 1, "replicas must agree after fit"
    for r in ranks:
        assert r["threads_after_fit"] == [], f"rank {r['rank']} left threads behind: {r['threads_after_fit']}"
        # a batch's chunk and its global-progress ticket come in one request; a few more per epoch
        batches = result["batches_per_worker"][r["rank"]]
        assert r["control_requests"] <= batches + 8 * 4 + 8, (r["rank"], r["control_requests"], batches)


@pytest.mark.parametrize("strategy", ["prague", "partial_reduce", "adpsgd", "decent_adam"])
def test_no_training_step_reads_a_device_value_on_the_host(straggler_runs, strategy):
    """A counting stand-in for the device's synchronisation (scripts/train.py `HostSyncCounter`: `item`,
    `tolist`, `bool`/`float`/`int` of a tensor, CUDA synchronize, from this package's code, any thread)
    finds none in any training batch of any rank: on CUDA each would stall the host every step."""
    run = straggler_runs[strategy]
    assert run.status == 0, run.log[-3000:]
    for r in [run.result, *rank_results(run.dir)]:
        assert r["host_sync_self_check"] == 1, "the stand-in did not count a known read"
        assert r["batches_counted"] == r["batches_per_worker"][r["rank"]], r["batches_counted"]
        assert r["host_syncs"] == [], f"rank {r['rank']}: host reads in batches at {r['host_sync_sites']}"


@pytest.mark.parametrize(
    ("strategy", "failing"),
    # one per kind of communication thread: BackgroundAverager (partial_reduce; prague's too), the
    # gossip thread (decent_adam), and adpsgd with only its active rank failing, whose passive
    # rank's responder thread must learn of it
    [("partial_reduce", None), ("decent_adam", None), ("adpsgd", 0)],
    ids=lambda v: {None: "every-rank", 0: "rank0-only"}.get(v, v),
)
def test_an_exception_in_training_stops_every_thread_and_exits(tmp_path, strategy, failing):
    # two ranks (each a process of its own): the failing one and one that must learn of it
    epochs = "50" if failing is None else "3"  # a survivor goes on to the end, alone
    args = ["--strategy", strategy, "--group-size", "2", "--epochs", epochs, "--step-time", "0.02"]
    args += ["--raise-at-batch", "4"]
    if failing is not None:
        args += ["--raise-rank", str(failing)]
    codes, logs = run_external_ranks(tmp_path, 2, *args)
    assert codes == [3, 0], (codes, logs[0][-3000:])
    failed = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("result.rank*.json"))]
    assert len(failed) == (2 if failing is None else 1)
    for report in failed:  # its own failure, or (every rank failing) the other's if that came first
        assert "injected failure" in report["error"] or "it stopped after an error" in report["error"]
        assert report["threads"] == [], f"threads left after the exception: {report['threads']}"
    if failing is not None:  # the other rank finished the fit without it, its threads stopped too
        survivor = json.loads((tmp_path / "result.json").read_text())
        assert survivor["rank"] == 1 and survivor["epochs_run"] == 3, survivor
        assert survivor["lost_workers"]["0"]["why"] == "it stopped after an error"
        assert survivor["threads_after_fit"] == []


@pytest.mark.parametrize("strategy", ["adpsgd", "decent_adam"])
def test_sigterm_on_one_worker_stops_every_rank(tmp_path, strategy):
    # adpsgd: rank 1 is passive; decent_adam stops at the next synchronization point (the epoch end)
    args = ["--strategy", strategy, "--epochs", "200", "--step-time", "0.02"]
    codes, logs = run_external_ranks(tmp_path, 2, *args, "--sigterm-rank", "1", "--sigterm-batch", "4")
    assert codes == [1, 1], codes
    output = "".join(logs)
    for rank in range(2):
        assert f"rank {rank}: stopping on SIGTERM" in output, output[-3000:]
    assert "CoordinationTimeout" not in output and "max_epochs=200` reached" not in output


CLI_CONFIGS = [
    ("partial_reduce_digits.yaml", 3, []),
    ("adpsgd_digits.yaml", 4, []),
    ("decent_adam_textlm.yaml", 4, []),
    ("prague_digits.yaml", 3, []),
    ("prague_textlm_steps.yaml", 4, ["--trainer.max_steps", "40"]),
    # the same step-based LM with Partial Reduce (only the strategy's class changes), its text as a sharded
    # stream of 16 shards (docs/streaming.md) that the work queue shares out; its 40 steps (160 batches)
    # span three of the stream's epochs (about 64 batches each): the budget is spent inside the third
    (
        "prague_textlm_steps.yaml",
        4,
        ["--trainer.max_steps", "40", "--trainer.strategy.class_path", "lightning_prague.PartialReduceStrategy"]
        + ["--data.init_args.streaming_shards", "16", "--trainer.max_epochs", "-1"],
    ),
]


def test_lightning_cli_configs(tmp_path):
    """Every example config trains from ``lightning-prague fit`` (all in one process: one import of Lightning)."""
    cli = str(ROOT / "lightning_prague" / "cli.py")
    runs = {
        f"{i}-{config}": (
            cli,
            ["fit", "--config", str(ROOT / "examples" / "configs" / config), "--trainer.devices", str(devices)]
            + ["--trainer.max_epochs", "1", "--trainer.default_root_dir", str(tmp_path / str(i)), *extra]
            + ["--trainer.strategy.init_args.start_method", "fork"],  # ranks forked from the one process
        )
        for i, (config, devices, extra) in enumerate(CLI_CONFIGS)
    }
    outcomes = run_many(tmp_path, runs, timeout=280)
    failed = {name: run.log[-3000:] for name, run in outcomes.items() if run.status != 0}
    assert not failed, failed
    printed = [name for name, run in outcomes.items() if "batches per worker" in run.log]
    assert len(printed) == len(CLI_CONFIGS), f"WorkerSummary's table missing from {set(outcomes) - set(printed)}"
