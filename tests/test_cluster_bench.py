"""`lightning-prague bench --cluster` in-process: its options, its cluster profiles and its predictions.

Nothing here builds a cluster or starts a process: the runs themselves are measured by the bench
(docs/multi_node.md has the tables), and the emulated cluster is tested by tests/test_cluster.py.
"""

from __future__ import annotations

import json
import types

import pytest

import lightning_prague.demo.run
from lightning_prague.tools import bench, cluster_bench
from lightning_prague.tools.cluster_bench import (
    CLUSTER_PROFILES,
    add_cluster_predictions,
    cluster_profile,
    model_name,
    parse_rate,
    profiles_from,
    runs,
)
from lightning_prague.tools.runtime_model import ComputeProfile, predict


@pytest.fixture
def available(monkeypatch):
    """The cheap checks pass (root, tools) wherever the test runs: nothing is built in these tests."""
    monkeypatch.setattr(cluster_bench, "unavailable", lambda: None)


def test_cluster_options_are_parsed_with_the_profiles_defaults(available, tmp_path):
    args = bench.parse_args(["--cluster", "slow_node", "inter_node", "slow_node", "--out", str(tmp_path)])
    assert args.cluster == ["slow_node", "inter_node"]
    assert args.strategies[0] == "ddp" and args.group_size == 3
    slow, inter = profiles_from(args)
    assert (slow.nodes, slow.workers_per_node, slow.world) == (4, 1, 4)
    assert slow.rates == (200e6, 200e6, 200e6, 10e6), "node4's link 20x slower than the others"
    assert (inter.nodes, inter.workers_per_node, inter.world) == (2, 4, 8)
    assert inter.rates == (100e6, 100e6)
    for profile in (slow, inter):  # several MB, about one step per transfer at the fast rate
        assert profile.model_bytes() > 2 * 2**20
        assert 0.5 * profile.step_time <= profile.exchange_seconds() <= 1.5 * profile.step_time


def test_overrides_apply_to_every_profile(available, tmp_path):
    args = bench.parse_args(
        ["--cluster", "inter_node", "--epochs", "1", "--step-time", "0.05", "--hidden", "64", "--rate", "1gbit",
         "--slow-ratio", "10", "--out", str(tmp_path)]
    )  # fmt: skip
    (profile,) = profiles_from(args)
    assert (profile.epochs, profile.step_time, profile.hidden) == (1, 0.05, 64)
    assert profile.rates == (500e6, 500e6)
    assert cluster_profile("slow_node", 1e9, 10).rates[-1] == 1e8


def test_where_no_cluster_can_be_built_the_bench_says_why(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cluster_bench, "unavailable", lambda: "the emulated cluster needs root")
    with pytest.raises(SystemExit) as exit_:
        bench.parse_args(["--cluster", "slow_node", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    assert (
        "--cluster: cannot build an emulated cluster here: the emulated cluster needs root" in capsys.readouterr().err
    )


def test_bad_cluster_options_name_the_option(available, capsys, tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(
            ["--cluster", "slow_node", "--rate", "fast", "--slow-ratio", "0.5", "--hidden", "0", "--out", str(tmp_path)]
        )
    err = capsys.readouterr().err
    assert "--rate: not a rate: 'fast'" in err and "--slow-ratio 0.5" in err and "--hidden 0" in err
    with pytest.raises(SystemExit):
        bench.parse_args(["--cluster", "no_such_profile"])
    assert "invalid choice" in capsys.readouterr().err


def test_rates_and_profiles():
    assert parse_rate("100mbit") == 100e6 and parse_rate("1gbit") == 1e9 and parse_rate("500kbit") == 500e3
    with pytest.raises(ValueError):
        parse_rate("0mbit")
    with pytest.raises(ValueError, match="no cluster profile"):
        cluster_profile("mesh", 1e9, 20)
    assert set(CLUSTER_PROFILES) == {"slow_node", "inter_node", "slow_node_pairs"}


def test_issue_50s_cluster_slows_node4s_ranks_and_runs_decent_adam_in_replicas_of_a_node_too(available, tmp_path):
    args = bench.parse_args(["--cluster", "slow_node_pairs", "--rate", "1gbit", "--out", str(tmp_path)])
    (profile,) = profiles_from(args)
    assert (profile.nodes, profile.workers_per_node, profile.rates) == (4, 2, (1e9,) * 4)
    labels = [label for label, _, _ in runs(args, profile)]
    assert labels[-8:] == [
        "decent_adam/alternating_exp_ring", "prague/random/replicas", "partial_reduce/replicas", "adpsgd/replicas",
        "prague/static/replicas", "decent_adam/ring/replicas", "prague/static/own/replicas",
        "decent_adam/ring/own/replicas",
    ]  # fmt: skip
    assert "decent_adam/ring/replicas" not in [label for label, _, _ in runs(args)], "only where the profile asks"
    argv = cluster_bench.demo_argv("decent_adam", ("--replica-size", "node"), profile, args)
    assert argv[argv.index("--profile") + 1] == "straggler" and argv[argv.index("--slow-factor") + 1] == "3.0"
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--slow-rank"] == ["6", "7"]
    assert model_name("decent_adam/ring/replicas") == ("decent_adam", {"topology": "ring", "replica_size": "node"})
    assert model_name("prague/static/replicas") == ("prague", {"grouping": "static", "replica_size": "node"})
    assert model_name("prague/random/replicas") == ("prague", {"replica_size": "node"})
    assert model_name("partial_reduce/replicas") == ("partial_reduce", {"replica_size": "node"})
    assert model_name("adpsgd/replicas") == ("adpsgd", {"replica_size": "node"})
    own = {"pace": "own", "replica_size": "node"}
    assert model_name("decent_adam/ring/own/replicas") == ("decent_adam", {"topology": "ring", **own})
    assert model_name("prague/static/own/replicas") == ("prague", {"grouping": "static", **own})
    argv = cluster_bench.demo_argv("decent_adam", ("--pace", "own", "--replica-size", "node"), profile, args)
    assert lightning_prague.demo.run.parse_args(argv).pace == "own"


def test_every_strategy_runs_after_ddp_with_the_variants_compared(available, tmp_path):
    args = bench.parse_args(["--cluster", "inter_node", "--out", str(tmp_path)])
    labels = [label for label, _, _ in runs(args)]
    assert labels == [
        "ddp", "prague", "prague/static", "partial_reduce", "adpsgd", "decent_adam/ring",
        "decent_adam/alternating_exp_ring",
    ]  # fmt: skip
    args = bench.parse_args(["--cluster", "inter_node", "--strategies", "decent_adam", "--out", str(tmp_path)])
    assert [label for label, _, _ in runs(args)] == ["ddp", "decent_adam/ring", "decent_adam/alternating_exp_ring"]
    assert model_name("prague/static") == ("prague", {"grouping": "static"})
    assert model_name("decent_adam/alternating_exp_ring") == ("decent_adam", {"topology": "alternating_exp_ring"})
    assert model_name("adpsgd") == ("adpsgd", {})


def test_chosen_runs_start_after_ddp_and_torchrun_starts_each_nodes_ranks(available, tmp_path, capsys):
    """`--runs` picks runs by their labels (DDP's always runs: the speed-ups are against it), an unknown
    label is refused by name, and `--launcher torchrun` starts one agent per node, its rendezvous on node1,
    with the run's demo arguments."""
    argv = ["--cluster", "slow_node_pairs", "--strategies", "prague", "--runs", "prague/random/replicas"]
    args = bench.parse_args([*argv, "--launcher", "torchrun", "--out", str(tmp_path)])
    (profile,) = profiles_from(args)
    assert [label for label, _, _ in runs(args, profile)] == ["ddp", "prague/random/replicas"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--cluster", "slow_node_pairs", "--runs", "prague/fast", "--out", str(tmp_path)])
    assert "--runs prague/fast: no such run; the runs are adpsgd" in capsys.readouterr().err
    demo = ["--strategy", "prague", "--json", "result.json"]
    (tmp_path / "steps.json").write_text(json.dumps([{"job_id": "1", "argv": demo}]))
    node = types.SimpleNamespace(index=2, name="node3")
    command = cluster_bench.node_command(profile, node, tmp_path, 29500, 60.0, "torchrun")
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert command[command.index("--nnodes") + 1] == "4" and command[command.index("--nproc-per-node") + 1] == "2"
    assert command[command.index("--rdzv-endpoint") + 1] == "node1:29500"
    assert command[command.index("-m", 3) :] == ["-m", "lightning_prague.demo.run", *demo]
    srun = cluster_bench.node_command(profile, node, tmp_path, 29500, 60.0, "srun")
    assert "lightning_prague.tools.cluster.srun" in srun and srun[srun.index("--node-id") + 1] == "2"


def test_predictions_use_the_shaped_links_calibrated_by_the_ddp_run():
    profile = cluster_profile("slow_node", 200e6, 20)
    ddp_bytes = cluster_bench.ddp_bytes(profile)
    nominal = profile.model_cluster().allreduce_seconds(range(4), ddp_bytes)  # a ring over node4's 10 Mbit/s
    assert nominal == pytest.approx(1.5 * ddp_bytes * 8 / 10e6, rel=0.01)
    allreduce, epochs, steps, per_epoch = nominal / 0.9, profile.epochs, 12, 1.0  # TCP gets 90% of the rate
    step_seconds = steps * epochs * (profile.step_time + allreduce)
    rows = [
        {"strategy": "ddp", "profile": "slow_node", "batches": 4 * steps * epochs, "throughput": 10.0,
         "step_seconds": step_seconds, "train_seconds": step_seconds + epochs * per_epoch,
         "measured_allreduce_seconds": allreduce},
        {"strategy": "partial_reduce", "profile": "slow_node", "batches": 4 * steps * epochs, "throughput": 40.0,
         "step_seconds": 5.0, "train_seconds": 30.0},
    ]  # fmt: skip
    transfer = profile.model_bytes() * 8 / 10e6  # one model over node4's link
    for row in rows:  # the probe: one model each way between node1 and node4 took 1.25x the rate's time
        row["probe_exchange_seconds"] = 1.25 * transfer
    add_cluster_predictions(rows, {"slow_node": profile})
    ddp, partial = rows
    assert ddp["link_efficiency"] == pytest.approx(0.9)
    assert partial["exchange_efficiency"] == pytest.approx(0.8)
    assert ddp["overhead_per_epoch"] == pytest.approx(per_epoch)
    assert ddp["step_overhead"] == pytest.approx(0.0, abs=1e-9)
    assert ddp["predicted_throughput"] == pytest.approx(ddp["throughput"], rel=1e-3), "DDP's own run is reproduced"
    # the asynchronous strategy computes at full speed; each epoch ends with a drain and the global
    # average, an all-to-all in which node4 sends and receives the model three times over its slow link:
    # three flows at once keep it busy, at DDP's 90%; one exchange by itself gets the probe's 80%
    workers = [ComputeProfile(profile.step_time)] * 4
    cluster = profile.model_cluster(0.9, single_flow=0.8)
    assert cluster.link_of(3).flow_bandwidth == pytest.approx(0.8 * 10e6 / 8)
    model = predict(workers, profile.model_bytes(), strategies=["partial_reduce"], cluster=cluster)[0]
    assert model.sync_seconds == pytest.approx(3 * transfer / 0.9, rel=0.01)
    assert cluster.exchange_seconds([0, 3], profile.model_bytes()) == pytest.approx(transfer / 0.8, rel=0.01)
    predicted_seconds = rows[1]["batches"] / model.throughput + epochs * (
        per_epoch + model.sync_wait + model.sync_seconds
    )
    assert partial["predicted_throughput"] == pytest.approx(40.0 * 30.0 / predicted_seconds)
    assert partial["predicted_error"] == pytest.approx(partial["predicted_throughput"] / 40.0 - 1)


def test_reprobe_measures_the_probes_anew_for_saved_runs_and_keeps_the_saved_ones(available, tmp_path, monkeypatch):
    with pytest.raises(SystemExit):  # a full run probes its clusters anyway
        bench.parse_args(["--cluster", "slow_node", "--reprobe", "--out", str(tmp_path)])
    saved = [{"strategy": "ddp", "profile": "slow_node", "probe_exchange_seconds": 2.2, "probe_loopback_seconds": None},
             {"strategy": "ddp", "profile": "inter_node", "probe_exchange_seconds": 0.3}]  # fmt: skip
    built = []

    class FakeCluster:  # the cluster tool, without a cluster
        def __init__(self, nodes, rate, rates):
            built.append((nodes, rates))

        def start(self):
            return self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Tool:
        Cluster, ClusterError = FakeCluster, RuntimeError

    monkeypatch.setattr(cluster_bench, "load_cluster_tool", lambda: Tool)
    monkeypatch.setattr(cluster_bench, "probe_cluster", lambda cluster, profile, port: (2.9, None))
    args = bench.parse_args(["--cluster", "slow_node", "--out", str(tmp_path), "--predict-from", __file__, "--reprobe"])
    cluster_bench.reprobe(saved, {"slow_node": cluster_profile("slow_node", 200e6, 20)}, args)
    assert built == [(4, {"node1": "200000000bit", "node2": "200000000bit", "node3": "200000000bit",
                          "node4": "10000000bit"})]  # fmt: skip
    assert saved[0]["probe_exchange_seconds"] == 2.9 and saved[0]["saved_probe_exchange_seconds"] == 2.2
    assert saved[1] == {"strategy": "ddp", "profile": "inter_node", "probe_exchange_seconds": 0.3}, "not re-probed"
    assert (tmp_path / "runs.json").is_file(), "the re-probed rows, for later --predict-from"
