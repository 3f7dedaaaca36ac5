"""The runtime model against closed-form cases, and ``lightning-prague plan``."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from lightning_prague.callbacks.straggler import StragglerMonitor, WorkerTiming
from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.grouping.bipartite import BipartiteGraph
from lightning_prague.tools import runtime_model
from lightning_prague.tools.plan import main as plan
from lightning_prague.tools.runtime_model import Cluster, ComputeProfile, Link, predict, recommend

MB = 2**20


def by_name(predictions):
    return {p.strategy: p for p in predictions}


def test_without_variance_all_reduce_time_is_compute_plus_communication():
    link = Link(bandwidth=100 * MB, latency=0.001)
    workers = [ComputeProfile(0.05)] * 8
    ddp = by_name(predict(workers, 10 * MB, link, ["ddp"]))["ddp"]
    comm = 2 * 7 / 8 * 10 / 100 + 2 * 7 * 0.001
    assert ddp.method == "closed form"
    assert ddp.seconds_per_iteration == pytest.approx(0.05 + comm)
    assert ddp.throughput == pytest.approx(8 / (0.05 + comm))


def test_with_one_straggler_all_reduce_runs_at_the_stragglers_speed():
    workers = [ComputeProfile(0.05, slowdown=5.0)] + [ComputeProfile(0.05)] * 7
    result = by_name(predict(workers, 0, Link(latency=0.0)))
    assert result["ddp"].seconds_per_iteration == pytest.approx(0.25)
    assert result["ddp"].limit == pytest.approx(7 / 0.05 + 1 / 0.25)  # the sum of the workers' speeds
    assert result["prague"].throughput == pytest.approx(result["prague"].limit), "nobody waits for the straggler"
    assert result["ddp"].limit / result["ddp"].throughput == pytest.approx(4.5)  # the brief's 7.2/T against 1.6/T


def test_async_strategies_are_bounded_by_their_exchange_when_it_is_slower_than_compute():
    workers = [ComputeProfile(0.01)] * 4
    slow_link = Link(bandwidth=10 * MB, latency=0.0)
    prague = by_name(predict(workers, 1 * MB, slow_link, ["prague"], group_size=2))["prague"]
    assert prague.throughput == pytest.approx(4 / (2 * 1 / 2 * 1 / 10))  # each step waits for a 0.1 s exchange


def test_jitter_costs_all_reduce_more_than_lagged_gossip_and_nothing_beats_the_limit():
    workers = [ComputeProfile(0.05, sigma=0.5)] * 8
    result = by_name(predict(workers, 0, Link(latency=0.0), steps=600))
    assert result["ddp"].method == "monte carlo"
    assert result["ddp"].throughput < result["decent_adam"].throughput < result["prague"].throughput
    for p in result.values():
        assert p.throughput <= p.limit * 1.05
    assert result["decent_adam"].throughput / result["ddp"].throughput == pytest.approx(1.55, abs=0.2)
    assert recommend(list(result.values())).strategy in ("prague", "partial_reduce", "adpsgd")


def test_lagged_gossip_without_variance_runs_at_compute_speed():
    decent = by_name(predict([ComputeProfile(0.02)] * 6, 0, Link(latency=0.0), ["decent_adam"]))["decent_adam"]
    assert decent.seconds_per_iteration == pytest.approx(0.02)


def test_bad_inputs_are_rejected():
    with pytest.raises(ConfigurationError, match="no runtime model for \\['fsdp'\\]"):
        predict([ComputeProfile(0.05)], 0, strategies=["fsdp"])
    with pytest.raises(ConfigurationError, match="invalid compute profile"):
        ComputeProfile(0.0)


def test_plan_command_prints_a_table_and_recommends(tmp_path, capsys):
    predictions = plan(["--workers", "4", "--step-time", "0.05", "--slow", "0:5", "--model-mb", "0"])
    out = capsys.readouterr().out
    assert "recommended:" in out and "ddp" in out and "of limit" in out
    assert by_name(predictions)["ddp"].seconds_per_iteration == pytest.approx(0.25, rel=0.01)
    timings = tmp_path / "timings.json"
    timings.write_text(json.dumps([{"compute_per_step": 0.1}, {"compute_per_step": 0.02}]))
    predictions = plan(["--timings", str(timings), "--model-mb", "0", "--strategies", "ddp", "prague"])
    assert by_name(predictions)["prague"].limit == pytest.approx(10 + 50)


def test_ddp_hides_the_all_reduce_behind_the_backward_pass_but_not_the_last_bucket():
    link = Link(bandwidth=100 * MB, latency=0.0)
    workers = [ComputeProfile(0.06)] * 8
    allreduce = 2 * 7 / 8 * 10 / 100  # 10 MB in a ring of 8
    plain = by_name(predict(workers, 10 * MB, link, ["ddp"]))["ddp"]
    overlapped = by_name(predict(workers, 10 * MB, link, ["ddp"], backward_fraction=2 / 3, bucket_bytes=MB))["ddp"]
    assert plain.seconds_per_iteration == pytest.approx(0.06 + allreduce)
    assert overlapped.seconds_per_iteration == pytest.approx(0.06 + allreduce - 0.04)
    # a backward pass longer than the all-reduce hides all of it but the last bucket's
    hidden = by_name(predict([ComputeProfile(0.6)] * 8, 10 * MB, link, ["ddp"], backward_fraction=0.5, bucket_bytes=MB))
    assert hidden["ddp"].seconds_per_iteration == pytest.approx(0.6 + allreduce / 10)


def test_groups_inside_a_node_use_the_intra_node_link():
    cluster = Cluster(4, intra=Link(bandwidth=1000 * MB, latency=0.0), inter=Link(bandwidth=10 * MB, latency=0.0))
    assert cluster.allreduce_seconds([0, 1, 2, 3], 10 * MB) == pytest.approx(2 * 3 / 4 * 10 / 1000)
    assert cluster.allreduce_seconds([3, 4], 10 * MB) == pytest.approx(10 / 10)
    # a random pair of 8 workers on 2 nodes shares a node with probability 3/7
    expected = 3 / 7 * (10 / 1000) + 4 / 7 * (10 / 10)
    assert cluster.random_group_seconds(8, 2, 10 * MB) == pytest.approx(expected)


def test_decent_adam_pays_for_the_links_its_topology_crosses():
    workers = [ComputeProfile(0.01)] * 16
    fast, slow = Link(bandwidth=float("inf"), latency=0.0), Link(bandwidth=MB, latency=0.0)  # 1 MB: 1 s across nodes
    one_node = by_name(predict(workers, MB, strategies=["decent_adam"], cluster=Cluster(16, fast, slow)))
    assert one_node["decent_adam"].throughput == pytest.approx(16 / 0.01, rel=0.01)
    # the ring's pairs (3, 4), (7, 8), ... cross nodes of 4 every other round: the exchange bounds everyone
    nodes = Cluster(4, fast, slow)
    ring = by_name(predict(workers, MB, strategies=["decent_adam"], cluster=nodes))["decent_adam"]
    assert ring.throughput < 0.2 * one_node["decent_adam"].throughput
    complete = by_name(predict(workers, MB, strategies=["decent_adam"], cluster=nodes, topology="complete"))
    assert complete["decent_adam"].throughput < ring.throughput  # everyone crosses, every round


def test_a_schedule_at_each_workers_own_pace_is_not_held_to_the_slowest_one():
    """`pace="own"`: the gossip rounds no longer hold every worker to the slowest one's steps, so a 3x
    slower worker costs the others nothing; in rounds, all go at its pace."""
    workers = [ComputeProfile(0.01)] * 6 + [ComputeProfile(0.03)] * 2
    for options in ({}, {"grouping": "static"}):
        strategy = "prague" if options else "decent_adam"
        rounds = by_name(predict(workers, 0, strategies=[strategy], **options))[strategy]
        own = by_name(predict(workers, 0, strategies=[strategy], pace="own", **options))[strategy]
        assert rounds.throughput == pytest.approx(8 / 0.03, rel=0.05)
        assert own.throughput == pytest.approx(6 / 0.01 + 2 / 0.03, rel=0.05)


def test_plan_reads_the_file_straggler_monitor_writes(tmp_path, capsys):
    monitor = StragglerMonitor(path=str(tmp_path / "stragglers.json"))
    monitor.timings = [WorkerTiming(0, 100, 5.0, 0.1), WorkerTiming(1, 500, 5.0, 0.2), WorkerTiming(2, 500, 5.0, 0.0)]
    monitor.write(monitor.path)
    predictions = by_name(plan(["--timings", monitor.path, "--model-mb", "0", "--workers-per-node", "3"]))
    assert predictions["prague"].limit == pytest.approx(1 / 0.05 + 2 / 0.01)
    assert predictions["ddp"].seconds_per_iteration == pytest.approx(0.05, rel=0.01)  # the slowest worker's pace
    assert "recommended:" in capsys.readouterr().out


def test_work_queue_strategies_wait_at_sync_points_for_the_steps_in_flight_and_lock_step_ones_do_not():
    step = 0.1
    alone = by_name(predict([ComputeProfile(step)] * 2, 1000, Link(float("inf"), 0.0)))
    # a random moment falls uniformly inside a step; equal deterministic workers that started together
    # stay in phase, so each, and the slowest of them, has half a step left on average
    assert alone["prague"].sync_wait == pytest.approx(step / 2, rel=0.15)
    assert alone["ddp"].sync_wait == 0.0 and alone["decent_adam"].sync_wait == 0.0, "lock-step: nothing in flight"
    straggler = by_name(predict([ComputeProfile(step, slowdown=5.0)] + [ComputeProfile(step)] * 3, 1000))
    # the straggler leaves the epoch's tail to the others (as the work queue does): only their steps are in flight
    assert straggler["partial_reduce"].sync_wait == pytest.approx(step / 2, rel=0.15)
    assert straggler["adpsgd"].sync_wait == straggler["prague"].sync_wait, "one work queue, one wait"
    slower = by_name(predict([ComputeProfile(step, slowdown=1.5)] + [ComputeProfile(step)] * 3, 1000))
    assert slower["prague"].sync_wait > 0.55 * step, "a worker only 1.5x slower still trains to the end"


def test_host_overhead_is_paid_every_step_and_not_stretched_by_a_slow_device():
    slow = ComputeProfile(0.1, slowdown=3.0, overhead=0.02)
    assert slow.mean == pytest.approx(0.32) and ComputeProfile(0.1, overhead=0.02).mean == pytest.approx(0.12)
    with pytest.raises(ConfigurationError):
        ComputeProfile(0.1, overhead=-0.01)


def test_plan_checks_every_option_before_computing(capsys):
    for argv, expected in [
        (["--workers", "4", "--slow", "7:5"], "--slow 7:5: expected RANK:FACTOR"),
        (["--workers", "4", "--slow", "1"], "--slow 1: expected RANK:FACTOR"),
        (["--step-time", "0"], "--step-time 0.0: must be positive"),
        (["--backward-fraction", "2"], "a share between 0 and 1"),
        (["--workers", "6", "--topology", "one_peer_exp"], "--topology one_peer_exp:"),
        (["--workers", "2", "--group-size", "3"], "--group-size 3: must be between 2 and the worker count (2)"),
        (["--timings", "no-such-file.json"], "no such file"),
        (["--strategies", "dp"], "invalid choice: 'dp'"),
    ]:
        with pytest.raises(SystemExit) as stop:
            plan(argv)
        assert stop.value.code == 2 and expected in capsys.readouterr().err, argv


def test_per_node_links_price_each_exchange_at_its_nodes_links():
    fast, slow = Link(bandwidth=10 * MB, latency=0.0), Link(bandwidth=MB, latency=0.0)
    cluster = Cluster(1, intra=Link(bandwidth=float("inf"), latency=0.0), inter=slow, node_links=(fast,) * 3 + (slow,))
    assert cluster.exchange_seconds([0, 1], MB) == pytest.approx(0.1)
    assert cluster.exchange_seconds([0, 3], MB) == pytest.approx(1.0), "a pair runs at the slower link"
    # all-to-all among 4 (the library's small groups): node 3 sends its model to 3 others and receives 3
    assert cluster.exchange_seconds([0, 1, 2, 3], MB) == pytest.approx(3.0)
    assert cluster.allreduce_seconds([0, 1, 2, 3], MB) == pytest.approx(1.5), "DDP's ring: 2 (n-1)/n over it"
    # exchanges leaving a node at once share its link
    costs = cluster.round_seconds([(0, 3), (1, 2)], MB)
    assert costs[(0, 3)] == pytest.approx(1.0) and costs[(1, 2)] == pytest.approx(0.1)
    two_nodes = Cluster(2, intra=Link(bandwidth=float("inf"), latency=0.0), inter=fast, node_links=(fast, fast))
    costs = two_nodes.round_seconds([(0, 2), (1, 3)], MB)
    assert costs[(0, 2)] == pytest.approx(0.2) and costs[(1, 3)] == pytest.approx(0.2)


def test_with_a_slow_node_background_exchanges_cost_at_synchronization_points_not_per_step():
    fast, slow = Link(bandwidth=10 * MB, latency=0.0), Link(bandwidth=MB, latency=0.0)
    cluster = Cluster(1, intra=fast, inter=slow, node_links=(fast,) * 3 + (slow,))
    workers = [ComputeProfile(0.1)] * 4
    result = by_name(predict(workers, MB, cluster=cluster))
    assert result["ddp"].seconds_per_iteration == pytest.approx(0.1 + 1.5)
    for name in ("prague", "partial_reduce", "adpsgd"):  # no step waits for an exchange in flight
        assert result[name].throughput == pytest.approx(40.0)
        assert result[name].sync_seconds == pytest.approx(3.0), "the global average: node 3 sends 3 models"
        assert 0.5 <= result[name].sync_wait <= 2.0, "draining the slow exchange in flight"
    assert result["ddp"].sync_seconds == 0.0
    static = predict(workers, MB, strategies=["prague"], cluster=cluster, grouping="static")[0]
    assert static.method == "monte carlo" and static.throughput < 40.0, "the static schedule's rounds wait"


def test_one_crossing_per_round_beats_the_ring_on_two_nodes():
    fast, inter = Link(bandwidth=100 * MB, latency=0.0), Link(bandwidth=5 * MB, latency=0.0)
    cluster = Cluster(4, intra=fast, inter=inter, node_links=(inter, inter))
    workers = [ComputeProfile(0.2)] * 8
    ring, alternating = (
        predict(workers, MB, strategies=["decent_adam"], cluster=cluster, topology=t)[0]
        for t in ("ring", "alternating_exp_ring")
    )
    ddp = predict(workers, MB, strategies=["ddp"], cluster=cluster)[0]
    assert alternating.throughput > ring.throughput > ddp.throughput


def test_plan_takes_a_link_per_node(capsys):
    plan(["--workers", "4", "--step-time", "0.1", "--model-mb", "1", "--node-bandwidth-gbps", "1", "1", "1", "0.05"])
    out = capsys.readouterr().out
    assert "sync average" in out and "recommended: " in out
    with pytest.raises(SystemExit):
        plan(["--workers", "4", "--node-bandwidth-gbps", "1", "1"])
    assert "--node-bandwidth-gbps: 2 rates for 4 nodes" in capsys.readouterr().err


def test_a_lone_exchange_runs_at_one_flows_rate_and_concurrent_ones_share_the_links_rate():
    link = Link(bandwidth=10 * MB, latency=0.0, single_flow=5 * MB)  # a lone TCP flow gets half of it
    two_nodes = Cluster(2, intra=Link(bandwidth=float("inf"), latency=0.0), inter=link, node_links=(link, link))
    assert two_nodes.exchange_seconds([0, 2], MB) == pytest.approx(0.2), "one flow each way: single_flow"
    costs = two_nodes.round_seconds([(0, 2), (1, 3)], MB)  # two flows keep the link busy
    assert costs[(0, 2)] == pytest.approx(0.2) and costs[(1, 3)] == pytest.approx(0.2)
    costs = two_nodes.round_seconds([(0, 2), (1, 3)], 4 * MB)
    assert costs[(0, 2)] == pytest.approx(0.8), "max(2 x 4 MB at 10 MB/s, 4 MB at 5 MB/s)"
    ring = Cluster(1, intra=link, inter=link, node_links=(link,) * 8)
    assert ring.exchange_seconds(range(8), 8 * MB) == pytest.approx(2 * 7 / 8 * 8 / 10), "a pipelined ring: bandwidth"
    assert Link(bandwidth=MB).flow_bandwidth == MB and Link(MB, 0.0, 2 * MB).flow_bandwidth == MB


def test_the_meeting_that_ends_a_gossip_phase_waits_for_the_last_round_and_the_idle_rounds_run_before_it():
    # a ring of 4 where every group with worker 3 (behind a slow link) takes 2 s and the others 0.1 s;
    # rounds alternate (0,1),(2,3) and (0,3),(1,2); the last round issued (odd) is (0,3),(1,2)
    pairs = {0: [(0, 1), (2, 3)], 1: [(0, 3), (1, 2)]}

    def done(issued, i, t):
        group = next(g for g in pairs[t % 2] if i in g)
        return max(issued[j] for j in group) + (2.0 if 3 in group else 0.1)

    arrivals = [-3.0, -3.0, -0.5, 0.0]  # 0 and 1 finished their steps early, 3 last
    # without idle rounds the meeting waits for round (0,3) in flight
    assert runtime_model._phase_end(list(arrivals), 1, done, idle_after=10.0) == pytest.approx(2.0)
    # 0 and 1 wait over 1 s: 1 and 2 run an idle round once their pair (1,2) is done; after the release
    # every worker runs to that round, so (2,3) waits for (0,3) and crosses the slow link once more
    assert runtime_model._phase_end(list(arrivals), 1, done, idle_after=1.0) == pytest.approx(4.0)
    # nobody arrives long before the others: no idle round
    assert runtime_model._phase_end([-0.5, -0.5, -0.5, 0.0], 1, done, idle_after=1.0) == pytest.approx(2.0)
    # rounds that cost nothing: the idle rounds end anyway
    free = lambda issued, i, t: max(issued)  # noqa: E731
    assert runtime_model._phase_end([-5.0, 0.0], 0, free, idle_after=1.0) == pytest.approx(0.0)


def test_lagged_gossip_pays_its_last_round_at_every_synchronization_point():
    link = Link(bandwidth=10 * MB, latency=0.0)
    cluster = Cluster(1, intra=link, inter=link, node_links=(link,) * 4)
    decent = predict([ComputeProfile(0.5)] * 4, MB, strategies=["decent_adam"], cluster=cluster)[0]
    assert decent.seconds_per_iteration == pytest.approx(0.5), "the exchange (0.1 s) hides behind the steps"
    assert decent.sync_wait == pytest.approx(0.1), "but nothing hides the round in flight at the meeting"


def test_a_passive_worker_serving_several_actives_queues_them_and_the_drain_grows_with_them():
    fast, slow = Link(bandwidth=100 * MB, latency=0.0), Link(bandwidth=MB, latency=0.0)
    workers = [ComputeProfile(0.1)] * 5

    def drain(actives):  # actives 0 .. actives - 1 and one passive behind a slow link (1 s per exchange)
        cluster = Cluster(1, intra=fast, inter=fast, node_links=(fast,) * actives + (slow,))
        graph = BipartiteGraph(actives + 1, [(a, actives) for a in range(actives)])
        return runtime_model._passive_drain(workers[: actives + 1], cluster, graph, MB, 400, random.Random(0))

    one, two, four = drain(1), drain(2), drain(4)
    assert one == pytest.approx(0.5, abs=0.1), "one exchange in flight: half of it remains on average"
    assert one < two < four, "each active that picked the passive waits behind the others"
    assert four > 2.0, "four actives nearly always queued at the slow passive: most of 4 exchanges remain"
    # through the model: AD-PSGD on a slow node drains more than one exchange's residual
    slow_node = Cluster(1, intra=fast, inter=slow, node_links=(fast,) * 3 + (slow,))
    adpsgd = predict(workers[:4], MB, strategies=["adpsgd"], cluster=slow_node)[0]
    assert adpsgd.sync_wait > 1.0, "both actives queue at passive node 3 (1 s each)"


def test_partial_reduce_averages_the_workers_left_over_from_full_groups_after_the_others_drained():
    link = Link(bandwidth=10 * MB, latency=0.0)
    pair = 0.1  # a pair's exchange of 1 MB: each sends its model once
    for n, extra in ((8, pair), (6, 0.0), (4, 0.0)):  # groups of 3: 2, 0 and 1 workers left over
        cluster = Cluster(1, intra=link, inter=link, node_links=(link,) * n)
        workers = [ComputeProfile(0.001)] * n  # steps short enough that the drain decides
        prague, partial = predict(workers, MB, strategies=["prague", "partial_reduce"], cluster=cluster)
        assert partial.sync_wait - prague.sync_wait == pytest.approx(extra, abs=1e-9), n


def test_every_plan_option_says_what_it_is_and_its_default(capsys):
    from lightning_prague.tools.plan import make_parser

    parser = make_parser()
    undescribed = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
    assert not undescribed, f"plan options without help: {undescribed}"
    assert isinstance(parser.formatter_class, type) and issubclass(
        parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter
    )
    with pytest.raises(SystemExit):
        plan(["--help"])
    assert "training processes (ranks) in the job (default: 8)" in " ".join(capsys.readouterr().out.split())


# -- replica groups (issue 50): a replica is one worker whose step trains a batch on each of its ranks


def test_a_replicas_step_is_its_slowest_rank_plus_the_all_reduce_its_backward_pass_cannot_hide():
    members = [ComputeProfile(0.1), ComputeProfile(0.3)]
    assert runtime_model.ReplicaProfile(members, allreduce=0.05).mean == pytest.approx(0.35)
    hidden = runtime_model.ReplicaProfile(members, allreduce=0.05, last_bucket=0.01, backward=0.5)
    assert hidden.mean == pytest.approx(0.31), "only the last bucket is exposed"
    assert runtime_model.ReplicaProfile(members[:1], allreduce=1.0).mean == pytest.approx(0.1), "alone: no all-reduce"
    jittered = runtime_model.ReplicaProfile([ComputeProfile(0.1, sigma=0.5)] * 2, allreduce=0.0)
    assert jittered.mean > ComputeProfile(0.1, sigma=0.5).mean, "the slower of two draws, on average"


def test_replicas_of_one_rank_predict_exactly_what_ranks_alone_do():
    fast, slow = Link(bandwidth=10 * MB, latency=0.0), Link(bandwidth=MB, latency=0.0)
    cluster = Cluster(2, intra=fast, inter=slow, node_links=(fast, slow))
    workers = [ComputeProfile(0.1, sigma=0.2)] * 4
    assert predict(workers, MB, cluster=cluster, replica_size=1) == predict(workers, MB, cluster=cluster)


def test_replicas_pay_behind_slow_links_where_one_model_per_node_crosses_them():
    """On 4 nodes x 2 with node 3's ranks 3x slower and 1 Gbit/s links, `decent_adam`'s ring over
    replicas of a node: compute-bound, the same as rank by rank; link-bound, faster (each rank sends
    its slice across the link, so one model per node crosses it per round, not one per rank)."""
    intra, gbit = Link(bandwidth=100e9, latency=1e-5), Link(bandwidth=1e9 / 8, latency=1e-4)
    nodes = Cluster(2, intra=intra, inter=gbit, node_links=(gbit,) * 4)
    slow_node = [ComputeProfile(0.05, slowdown=3.0 if rank >= 6 else 1.0) for rank in range(8)]

    def decent_adam(model_mb: float, replica_size: int):
        return predict(slow_node, int(model_mb * MB), cluster=nodes, strategies=["decent_adam"],
                       backward_fraction=2 / 3, replica_size=replica_size)[0]  # fmt: skip

    assert decent_adam(1, 2).throughput == pytest.approx(decent_adam(1, 1).throughput, rel=0.01)
    alone, paired = decent_adam(100, 1), decent_adam(100, 2)
    assert paired.throughput > 1.05 * alone.throughput, (paired, alone)
    assert paired.replica_size == 2 and paired.name == "decent_adam (replicas of 2)"
    assert paired.sync_seconds == alone.sync_seconds, "every rank averages at a synchronization point either way"


def test_replicas_cost_where_one_rank_is_slow_inside_a_fast_node():
    intra = Link(bandwidth=100e9, latency=1e-5)
    slow_rank = [ComputeProfile(0.05, slowdown=5.0 if rank == 1 else 1.0) for rank in range(8)]
    fast_links = Cluster(2, intra=intra, inter=Link(bandwidth=100e9 / 8, latency=1e-5))
    alone = by_name(predict(slow_rank, MB, cluster=fast_links, strategies=["prague", "ddp"]))
    paired = by_name(predict(slow_rank, MB, cluster=fast_links, strategies=["prague", "ddp"], replica_size=2))
    assert alone["prague"].throughput == pytest.approx(7 / 0.05 + 1 / 0.25)
    assert paired["prague"].throughput < 2 * (1 / 0.25 + 3 / 0.05) <= 0.9 * alone["prague"].throughput
    assert paired["ddp"] == alone["ddp"], "DDP is every rank in lock-step either way"


def test_replicas_see_a_cluster_of_their_own():
    a, b = Link(bandwidth=4 * MB, latency=0.001), Link(bandwidth=MB, latency=0.002)
    cluster = Cluster(2, inter=a, node_links=(a, a, b, b))
    assert cluster.of_replicas(1, 4) is cluster
    per_node = cluster.of_replicas(2, 4)
    assert per_node.workers_per_node == 1 and per_node.node_links == cluster.node_links
    assert Cluster(4, node_links=(a, b)).of_replicas(2, 2).workers_per_node == 2
    spanning = cluster.of_replicas(4, 4)  # a replica's slices leave through both of its nodes' links
    assert spanning.workers_per_node == 1 and [link.bandwidth for link in spanning.node_links] == [8 * MB, 2 * MB]
    assert spanning.node_links[1].latency == 0.002
    with pytest.raises(ConfigurationError, match="replica_size=3 neither divides"):
        cluster.of_replicas(3, 4)
    with pytest.raises(ConfigurationError, match="one replica, which is DDP"):
        predict([ComputeProfile(0.1)] * 4, MB, cluster=Cluster(2), replica_size=4)
    with pytest.raises(ConfigurationError, match="does not divide the job's 4 ranks"):
        predict([ComputeProfile(0.1)] * 4, MB, replica_size=3)


def test_plan_predicts_each_strategy_alone_and_in_replicas_and_says_which_pays(capsys):
    argv = ["--workers", "8", "--workers-per-node", "2", "--slow", "6:3", "--slow", "7:3", "--model-mb", "100",
            "--node-bandwidth-gbps", "1", "1", "1", "1", "--strategies", "ddp", "decent_adam"]  # fmt: skip
    predictions = plan([*argv, "--replica-size", "node"])
    out = capsys.readouterr().out
    assert [p.name for p in predictions] == ["ddp", "decent_adam", "decent_adam (replicas of 2)"]
    best = max(predictions, key=lambda p: p.throughput)
    assert "decent_adam (replicas of 2)" in out and f"recommended: {best.name}\n" in out
    for size, message in (("3", "does not divide the job's 8 ranks"), ("8", "one replica, which is DDP"),
                          ("two", "a positive number of ranks or 'node', not 'two'")):  # fmt: skip
        with pytest.raises(SystemExit):
            plan([*argv, "--replica-size", size])
        err = capsys.readouterr().err
        assert f"--replica-size {size}: " in err and message in err, err
