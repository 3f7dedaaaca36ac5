"""Configurations the strategy cannot honour fail early, naming the option and the way out."""

from __future__ import annotations

from datetime import timedelta

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_prague
from lightning_prague import ConfigurationError, PartialAllReduceStrategy
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


def test_decent_adam_is_registered_and_allows_step_based_settings():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="decent_adam", logger=False, max_steps=10)
    assert isinstance(trainer.strategy, lightning_prague.DecentAdamStrategy)
    assert trainer.strategy.topology == "ring" and not trainer.strategy.shards_by_work_queue


def test_max_groups_is_deprecated_and_says_why():
    with pytest.warns(FutureWarning, match="max_groups is deprecated and has no effect"):
        PartialAllReduceStrategy(max_groups=64)


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
