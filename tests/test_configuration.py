"""Configurations the strategy cannot honour fail early, naming the option and the way out."""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_prague
from lightning_prague import ConfigurationError, PartialAllReduceStrategy
from lightning_prague.core.protocol import PORT_VARIABLE
from lightning_prague.strategies._checks import check_layer_sync, check_trainer


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"grouping": "fastest"}, "grouping='fastest' is not a grouping policy"),
        ({"group_size": 1}, "group_size=1 is invalid"),
        ({"sync_every": 0}, "sync_every=0 is invalid"),
        ({"timeout": 0}, "timeout=0 is invalid"),
    ],
)
def test_bad_strategy_arguments(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        PartialAllReduceStrategy(**kwargs)


def _trainer(**kwargs):
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=PartialAllReduceStrategy(group_size=2), logger=False, **kwargs
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"limit_train_batches": 0.5}, "limit_train_batches=0.5 .*cannot be honoured"),
        ({"val_check_interval": "00:00:01:00"}, "time-based val_check_interval"),
        ({"callbacks": [ModelCheckpoint(train_time_interval=timedelta(minutes=1))]}, "train_time_interval"),
        ({"limit_train_batches": 5, "val_check_interval": 10}, "limit_train_batches=5 cannot be combined"),
    ],
)
def test_trainer_settings_that_need_lock_step_are_rejected(kwargs, match):
    trainer = _trainer(**kwargs)
    with pytest.raises(ConfigurationError, match=match):
        check_trainer(trainer, "prague")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_steps": 100},
        {"val_check_interval": 10, "check_val_every_n_epoch": None},
        {"val_check_interval": 0.25},
        {"callbacks": [ModelCheckpoint(every_n_train_steps=5)]},
    ],
)
def test_step_based_settings_run_on_global_progress(kwargs):
    check_trainer(_trainer(**kwargs), "prague")


def test_default_settings_pass_and_names_are_registered():
    check_trainer(_trainer(max_epochs=3, callbacks=[ModelCheckpoint(every_n_epochs=1)]), "prague")
    for name in ("prague", "partial_all_reduce"):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=name, logger=False)
        assert isinstance(trainer.strategy, lightning_prague.PartialAllReduceStrategy)
        assert trainer.strategy.group_size == 3 and trainer.strategy.grouping == "random"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"topology": "torus"}, "topology='torus' is not a topology of strategy='decent_adam'"),
        ({"workers_per_node": 0}, "workers_per_node=0 is invalid"),
        ({"bucket_mb": 0}, "bucket_mb=0 is invalid"),
    ],
)
def test_bad_decent_adam_arguments(kwargs, match):
    with pytest.raises(ConfigurationError, match=match):
        lightning_prague.DecentAdamStrategy(**kwargs)


@pytest.mark.parametrize("kind", [lightning_prague.DecentAdamStrategy, lightning_prague.PartialAllReduceStrategy])
def test_a_pace_is_one_of_three_its_own_needs_the_overlap_and_auto_is_own_in_replicas(kind):
    """`pace` is refused by name; at its own pace a worker trains on while its round is in flight, so
    `overlap=False` cannot go with it; and only the own pace takes its data from the work queue."""
    extra = {"grouping": "static"} if kind is lightning_prague.PartialAllReduceStrategy else {}
    with pytest.raises(ConfigurationError, match="pace='fast' is not a pace of .*choose one of auto, round, own"):
        kind(pace="fast", **extra)
    with pytest.raises(ConfigurationError, match="pace='own' with overlap=False"):
        kind(pace="own", overlap=False, **extra)
    assert kind(pace="own", **extra).shards_by_work_queue
    assert not kind(pace="round", **extra).shards_by_work_queue
    # the default: the paper's rounds for ranks on their own, each replica's own pace in replica groups (a slow
    # node must not stall the others), unless the exchanges do not overlap the updates
    assert kind(**extra).pace == "round" and not kind(**extra).shards_by_work_queue
    for replica_size in (2, "node"):
        assert kind(replica_size=replica_size, **extra).pace == "own"
        assert kind(replica_size=replica_size, **extra).shards_by_work_queue
        assert kind(replica_size=replica_size, pace="round", **extra).pace == "round"
    assert kind(replica_size=2, overlap=False, **extra).pace == "round"


@pytest.mark.parametrize(
    ("kwargs", "devices", "match"),
    [
        ({"topology": "one_peer_exp"}, 3, "needs a power of two workers .* got 3"),
        ({"topology": "alternating_exp_ring", "workers_per_node": 2}, 3, "3 workers cannot be split into nodes"),
        ({"schedule": [[[0, 1], [1, 2]]]}, 3, "round 0: rank 1 is in two groups"),
        ({"schedule": [[[0, 1], [2]]]}, 3, "never mixes ranks \\[2\\] with rank 0"),
    ],
)
def test_decent_adam_topology_is_validated_against_the_world_before_training(kwargs, devices, match):
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=lightning_prague.DecentAdamStrategy(**kwargs), logger=False
    )
    trainer.strategy.set_world_ranks()
    with pytest.raises(ConfigurationError, match=match):
        trainer.strategy.make_policy()


@pytest.mark.parametrize(("nodes", "warns"), [(2, True), (1, False)])
def test_static_grouping_says_when_it_does_not_use_group_size(nodes, warns, recwarn):
    strategy = PartialAllReduceStrategy(grouping="static", group_size=3)
    trainer = L.Trainer(accelerator="cpu", devices=4, num_nodes=nodes, strategy=strategy, logger=False)
    trainer.strategy.set_world_ranks()
    trainer.strategy.make_policy()
    said = [str(w.message) for w in recwarn if "group_size=3 is not used" in str(w.message)]
    expected = (
        "grouping='static' on 2 nodes of 4 workers groups by the node layout (node averages, pairs inside a node "
        "and one group across the nodes); group_size=3 is not used"
    )
    assert said == ([expected] if warns else [])


@pytest.mark.parametrize("name", sorted(lightning_prague.strategies.STRATEGIES))
def test_make_policy_returns_the_policy_and_changes_nothing_on_the_strategy(name):
    strategy = L.Trainer(accelerator="cpu", devices=4, strategy=name, logger=False).strategy
    strategy.set_world_ranks()
    before = {key: id(value) for key, value in vars(strategy).items()}
    assert strategy.make_policy() is not strategy.make_policy()  # a new policy for every fit
    assert {key: id(value) for key, value in vars(strategy).items()} == before


def test_decent_adam_is_registered_and_allows_step_based_settings():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="decent_adam", logger=False, max_steps=10)
    assert isinstance(trainer.strategy, lightning_prague.DecentAdamStrategy)
    assert trainer.strategy.topology == "ring" and not trainer.strategy.shards_by_work_queue


def test_max_groups_deprecated_in_0_1_is_gone():
    with pytest.raises(TypeError, match="max_groups"):
        PartialAllReduceStrategy(max_groups=64)  # type: ignore[call-arg]


def test_the_command_lists_every_subcommand_and_its_version(capsys):
    from lightning_prague.cli import main

    main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("fit", "validate", "test", "predict", "plan", "bench", "--version"))
    main(["--version"])
    assert capsys.readouterr().out.strip() == f"lightning-prague {lightning_prague.__version__}"


def test_sync_batchnorm_is_rejected_with_what_to_use_instead():
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="prague", sync_batchnorm=True, logger=False, enable_progress_bar=False
    )
    with pytest.raises(ConfigurationError, match="sync_batchnorm=True cannot be honoured.*GroupNorm"):
        check_layer_sync(trainer.strategy, "prague")
    check_layer_sync(L.Trainer(accelerator="cpu", devices=2, strategy="prague", logger=False).strategy, "prague")


# -- DDP's own options (code moved from DDPStrategy) --------------------------------------------
DDP_NO_OPS = {"find_unused_parameters": True, "static_graph": True, "gradient_as_bucket_view": True}


@pytest.mark.parametrize("name", sorted(lightning_prague.strategies.STRATEGIES))
def test_ddp_options_whose_purpose_holds_are_accepted_by_every_strategy(name, caplog, monkeypatch):
    from lightning_prague.strategies import STRATEGIES, ddp_options

    monkeypatch.setattr(ddp_options, "_logged", set())
    cls = STRATEGIES[name][0]
    with caplog.at_level(logging.DEBUG, logger=ddp_options.__name__):
        strategy = cls(**DDP_NO_OPS, init_sync=True, broadcast_buffers=False, sync_every=2)
        cls(find_unused_parameters=False)
    assert strategy.sync_every == 2  # the strategy's own options still apply
    lines = [r.getMessage() for r in caplog.records if r.name == ddp_options.__name__]
    for option in [*DDP_NO_OPS, "init_sync", "broadcast_buffers"]:
        # once each, with the reason
        assert sum(f"ignoring {option}=" in line for line in lines) == 1, lines
    assert any("find_unused_parameters=True: parameters without a gradient are no error" in line for line in lines)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"broadcast_buffers": True}, r"broadcast_buffers=True: buffers are not broadcast.*instead: remove.*=False"),
        ({"bucket_cap_mb": 50}, r"bucket_cap_mb=50: there are no gradient buckets.*instead: bucket_mb="),
        ({"ddp_comm_hook": print}, r"ddp_comm_hook=.*no gradient is all-reduced.*instead: sync_every="),
        ({"ddp_comm_state": object()}, r"ddp_comm_state=.*instead: sync_every="),
        ({"ddp_comm_wrapper": print}, r"ddp_comm_wrapper=.*instead: sync_every="),
        ({"model_averaging_period": 4}, r"model_averaging_period=4: .*instead: sync_every=.*average_at_sync"),
        ({"init_sync": False}, r"init_sync=False: .*cannot be skipped.*instead: remove"),
        ({"device_ids": [0]}, r"device_ids=\[0\]: .*instead: Trainer\(accelerator=..., devices=...\)"),
        ({"mixed_precision": object()}, r"mixed_precision=.*instead: Trainer\(precision=...\)"),
        ({"process_group": None}, r"process_group=None: .*instead: the strategy's own grouping options"),
    ],
)
def test_ddp_options_that_cannot_apply_are_rejected_with_what_to_use_instead(kwargs, match):
    with pytest.raises(ConfigurationError, match=f"strategy='prague' cannot honour DistributedDataParallel's {match}"):
        PartialAllReduceStrategy(**kwargs)


def test_every_rejected_ddp_option_is_named_at_once_and_subclasses_pass_them_on():
    with pytest.raises(ConfigurationError) as info:
        lightning_prague.DecentAdamStrategy(topology="complete", bucket_cap_mb=25, broadcast_buffers=True)
    message = str(info.value)
    assert "strategy='decent_adam'" in message
    assert "\n- bucket_cap_mb=25: " in message and "\n- broadcast_buffers=True: " in message


def test_unknown_keywords_fail_naming_them_with_the_closest_option():
    with pytest.raises(
        TypeError, match=r"unexpected keyword argument\(s\) 'bucket_mbb' \(did you mean 'bucket_mb'\?\)"
    ):
        PartialAllReduceStrategy(bucket_mbb=10)
    with pytest.raises(TypeError, match=r"'group_sise' \(did you mean 'group_size'\?\)"):
        lightning_prague.PartialReduceStrategy(group_sise=2)
    with pytest.raises(TypeError, match=r"'flux_capacitor': neither an option of the strategy nor"):
        lightning_prague.ADPSGDStrategy(flux_capacitor=1)


def test_the_table_covers_every_option_of_ddp_and_ddp_strategy_and_newer_ones_are_rejected(monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_prague.strategies import ddp_options
    from lightning_prague.strategies.base import DecentralizedStrategy

    ours = set(inspect.signature(DecentralizedStrategy.__init__).parameters)
    lightning = set(inspect.signature(DDPStrategy.__init__).parameters) - {"self", "kwargs"}
    assert ddp_options.ddp_module_options() <= ddp_options.DDP_OPTIONS.keys()
    assert lightning - ours <= ddp_options.DDP_OPTIONS.keys()
    assert not ours & ddp_options.DDP_OPTIONS.keys()  # an option of ours never reaches the table
    # an argument of a newer DistributedDataParallel than the table knows: rejected, not ignored
    monkeypatch.setattr(ddp_options, "ddp_module_options", lambda: frozenset({"future_flag"}))
    with pytest.raises(ConfigurationError, match="future_flag=1: no gradient is all-reduced.*remove the option"):
        PartialAllReduceStrategy(future_flag=1)


def test_ddp_strategy_timeout_as_a_timedelta_is_seconds():
    assert PartialAllReduceStrategy(timeout=timedelta(minutes=2)).operation_timeout == 120.0


# -- coordinator_port ----------------------------------------------------------------------------
@pytest.mark.parametrize("port", [0, -1, 65536, True, "29500"])
def test_coordinator_port_must_be_a_port_number(port, monkeypatch):
    monkeypatch.delenv(PORT_VARIABLE, raising=False)
    with pytest.raises(ConfigurationError, match=f"coordinator_port={port!r} is invalid: .* from 1 to 65535"):
        PartialAllReduceStrategy(coordinator_port=port)


def test_coordinator_port_and_the_environment_variable_must_agree(monkeypatch):
    monkeypatch.setenv(PORT_VARIABLE, "29501")
    with pytest.raises(
        ConfigurationError, match=f"coordinator_port=29502 and {PORT_VARIABLE}=29501 name different ports"
    ):
        lightning_prague.DecentAdamStrategy(coordinator_port=29502)
    assert lightning_prague.ADPSGDStrategy(coordinator_port=29501).coordinator_port == 29501
    assert lightning_prague.ADPSGDStrategy().coordinator_port is None  # the variable decides at launch
    monkeypatch.setenv(PORT_VARIABLE, "http")
    with pytest.raises(ConfigurationError, match=f"{PORT_VARIABLE}='http' is invalid"):
        PartialAllReduceStrategy()


def test_coordinator_port_from_a_cli_config(monkeypatch):
    import sys

    from helpers import ROOT

    from lightning_prague.cli import PragueCLI

    monkeypatch.setattr(sys, "argv", ["lightning-prague"])
    monkeypatch.delenv(PORT_VARIABLE, raising=False)
    config = ROOT / "examples" / "configs" / "prague_by_name.yaml"
    args = ["--config", str(config), "--trainer.strategy.coordinator_port", "29555", "--trainer.devices", "2"]
    args += ["--seed_everything", "0"]
    cli = PragueCLI(run=False, args=args)
    assert type(cli.trainer.strategy) is PartialAllReduceStrategy and cli.trainer.strategy.coordinator_port == 29555
