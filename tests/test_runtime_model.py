"""The runtime model against closed-form cases, and ``lightning-prague plan``."""

from __future__ import annotations

import json

import pytest

from lightning_prague.core.errors import ConfigurationError
from lightning_prague.core.runtime_model import ComputeProfile, Link, predict, recommend
from lightning_prague.plan import main as plan

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
